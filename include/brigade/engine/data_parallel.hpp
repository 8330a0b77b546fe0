// Data parallelism of a whole training pipeline: DP replicas of a TrainingEngine whose gradients
// are all-reduced before every optimizer step.
#pragma once

#include "brigade/data/corpus.hpp"
#include "brigade/engine/training.hpp"

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace brigade::engine {
inline namespace v0 {

/// `dp` data-parallel replicas of one training pipeline (Megatron-LM's data parallelism over
/// its pipeline groups, Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
/// GPU Clusters Using Megatron-LM", §2.1; PyTorch DDP's gradient all-reduce, Li et al. 2020):
/// each replica is a TrainingEngine of `config` (its P ranks on threads) on the same initial
/// weights and plan, and each step gives replica r the micro-batches [r M, (r + 1) M) of the
/// step's dp x M (M = config.microbatches). Between the backward and the optimizer step the
/// replicas' gradients are all-reduced (transport::InProcessCollectives over one thread per
/// replica, sums in replica order), each first weighted by its share of the step's real targets
/// (tokens_r / tokens), so every replica holds the gradient of the mean loss over the whole
/// step's targets, what one pipeline computes over all dp x M micro-batches; every replica then
/// takes the same AdamW update (the same global norm, the same bits), so their weights stay
/// equal, and checkpoints are written once, from replica 0. With config.tp > 1 each replica is
/// a tensor-parallel engine (DP x PP x TP on dp x P x t threads). Across processes the same is
/// DistributedTrainer with a TrainingGroups::dp group (`brigade train --dp` under mpirun).
class DataParallelTrainer {
 public:
  /// @throws brigade::Error{InvalidArgument} for dp < 1; as TrainingEngine(init, config)
  DataParallelTrainer(const model::LlamaWeights& init, const TrainingConfig& config, int dp);
  ~DataParallelTrainer();
  DataParallelTrainer(const DataParallelTrainer&) = delete;
  DataParallelTrainer& operator=(const DataParallelTrainer&) = delete;

  /// Replicas (the DP degree).
  [[nodiscard]] int replicas() const noexcept;
  /// Replica r's engine (its plan, its stages).
  [[nodiscard]] TrainingEngine& replica(int r);

  /// Forward and backward of every replica's share of `batches` (dp x config.microbatches, in
  /// replica order) on dp x P threads, then the gradient all-reduce; no update.
  /// @return loss and tokens of the whole step (the replicas' losses weighted by their targets),
  ///         the per-task loss summed over the replicas, the wall time, the Timeline with replica
  ///         r's rank g (of its P or, with TP, its grid's G ranks) as row r G + g, every replica's
  ///         peak memory (the same order)
  /// @throws brigade::Error{InvalidArgument} if batches.size() != dp x config.microbatches or a
  ///         batch is empty; any replica's error (the other replicas are stopped: Aborted)
  StepResult compute_gradients(std::span<const data::PackedBatch> batches);
  /// Every replica's optimizer step (the same update on each).
  /// @return {learning rate, gradient norm before clipping}, replica 0's (all equal)
  std::pair<double, double> optimizer_step();
  /// compute_gradients() then optimizer_step().
  StepResult train_step(std::span<const data::PackedBatch> batches);
  /// Every parameter's gradient by name, replica 0's (after the all-reduce: every replica's).
  [[nodiscard]] std::map<std::string, std::vector<float>> gradients() const;
  /// The current parameters (replica 0's; every replica holds the same).
  [[nodiscard]] model::LlamaWeights export_weights() const;
  /// Writes the checkpoint once, from replica 0 (TrainingEngine::save_checkpoint).
  /// @throws brigade::Error{BadFile} if a file cannot be written
  void save_checkpoint(const std::filesystem::path& dir, std::int64_t data_position) const;
  /// Every replica restores its optimizer state from `dir` (TrainingEngine::load_optimizer_state).
  /// @return the saved data position
  /// @throws brigade::Error{BadFile} as TrainingEngine::load_optimizer_state
  std::int64_t load_optimizer_state(const std::filesystem::path& dir);
  /// Mean held-out loss of `batches` (replica 0's: every replica holds the same weights).
  /// @throws brigade::Error as TrainingEngine::evaluate
  double evaluate(std::span<const data::PackedBatch> batches);
  /// The plan every replica runs.
  [[nodiscard]] const plan::Plan& plan() const noexcept;
  /// Optimizer steps taken (every replica's).
  [[nodiscard]] std::int64_t steps() const noexcept;

 private:
  TrainingConfig config_;
  std::vector<std::unique_ptr<TrainingEngine>> engines_;
};

}  // namespace v0
}  // namespace brigade::engine
