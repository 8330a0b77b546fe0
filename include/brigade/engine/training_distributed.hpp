// Distributed training: every rank (one process under MPI, or one thread) holds only the
// TrainStages placed on it, runs its own lowered program over any Transport, and the cross-rank
// reductions (tied embedding, loss, global gradient norm) and checkpoint gathers are
// point-to-point messages over the same transport. The SPMD form of TrainingEngine.
#pragma once

#include "brigade/engine/distributed.hpp"
#include "brigade/engine/training.hpp"
#include "brigade/io/trace.hpp"
#include "brigade/tp/tensor_parallel.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace brigade::engine {
inline namespace v0 {

namespace detail {
/// Message tags of distributed training (after run_training_program's 11 and 12).
inline constexpr int kTagTrainStart = 13;     // Bytes [0]: rank 0 starts every rank's step clock
inline constexpr int kTagTiedGrad = 14;       // F32 [size]: the tied embedding's gradient
inline constexpr int kTagReduce = 15;         // Bytes [n]: doubles of an all-gather
inline constexpr int kTagBlobSize = 16;       // Bytes [8]: size of the next blob (uint64)
inline constexpr int kTagBlob = 17;           // Bytes [n]: timeline, tensors or optimizer entries
inline constexpr int kTagCheckpointDone = 18; // Bytes [0]: rank 0 wrote the checkpoint

/// Tensors keyed by name as bytes: per tensor int32 name length, name, int64 count, floats.
inline std::string encode_tensors(const std::map<std::string, std::vector<float>>& tensors) {
  std::string out;
  for (const auto& [name, v] : tensors) {
    const auto len = static_cast<std::int32_t>(name.size());
    const auto n = static_cast<std::int64_t>(v.size());
    out.append(reinterpret_cast<const char*>(&len), sizeof len);
    out += name;
    out.append(reinterpret_cast<const char*>(&n), sizeof n);
    out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  }
  return out;
}

/// Inverse of encode_tensors; a tensor already in `out` is replaced.
/// @throws brigade::Error{Internal} for bytes that are not encode_tensors' output
inline void decode_tensors(const std::string& bytes, std::map<std::string, std::vector<float>>& out) {
  std::size_t pos = 0;
  auto get = [&](void* dst, std::size_t n) {
    BRIGADE_CHECK(pos + n <= bytes.size(), Errc::Internal,
                  "decode_tensors: truncated message ({} bytes)", bytes.size());
    std::memcpy(dst, bytes.data() + pos, n);
    pos += n;
  };
  while (pos < bytes.size()) {
    std::int32_t len = 0;
    std::int64_t n = 0;
    get(&len, sizeof len);
    BRIGADE_CHECK(len >= 0, Errc::Internal, "decode_tensors: name length {}", len);
    std::string name(static_cast<std::size_t>(len), '\0');
    get(name.data(), name.size());
    get(&n, sizeof n);
    BRIGADE_CHECK(n >= 0, Errc::Internal, "decode_tensors: {} has {} floats", name, n);
    std::vector<float> v(static_cast<std::size_t>(n));
    get(v.data(), v.size() * sizeof(float));
    out[name] = std::move(v);
  }
}
}  // namespace detail

/// The collective groups a DistributedTrainer's rank belongs to beyond its pipeline (the DP x PP
/// x TP grid of tp::Grid; tp::MpiGrid makes them over MPI): each must outlive the trainer.
struct TrainingGroups {
  /// The TP group of this rank's stages (the ranks of the same replica and pipeline rank), or
  /// null: its size is the TP degree (TrainingOptions::tp must equal it), its rank this rank's
  /// TP rank.
  tp::Group* tp = nullptr;
  /// The DP group (the ranks of the same pipeline rank and TP rank in every replica), or null:
  /// gradients are all-reduced over it before every optimizer step.
  tp::Group* dp = nullptr;
};

/// Trains a Llama split into pipeline stages, one rank per process (or thread): this rank's part
/// of a TrainingEngine run. Every rank of the transport's world constructs one with the same
/// weights and configuration (config.ranks == transport.world_size()) and makes the same
/// sequence of collective calls (compute_gradients, optimizer_step, train_step, evaluate,
/// save_checkpoint, load_optimizer_state) with the same batches.
///
/// The split and the lowered schedule are TrainingEngine's (training_plan()), each
/// rank builds only the virtual stages v with `shape.rank_of(v) == transport.rank()`, and runs
/// run_training_program for its rank. After the program:
/// - the tied embedding: the ranks of the first and the last virtual stage exchange their
///   "tok_embeddings" gradients and both set first + last (TrainingEngine's sum: same bits);
/// - the loss: the tail rank's sum and count reach every rank;
/// - the global norm: every rank's per-virtual-stage squared-gradient sums (and the tail's tied
///   copy) reach every rank, which sums them in virtual-stage order as TrainingEngine does, so
///   the clipping scale and every AdamW update are bitwise those of the in-process engine.
/// Gradients, losses, norms and parameters are therefore bitwise those of TrainingEngine for the
/// same configuration and batches.
///
/// Checkpoints: save_checkpoint gathers every stage's parameters and AdamW moments to rank 0,
/// which writes `model.bin` and `optimizer.bin` in TrainingEngine's formats (a checkpoint written
/// here resumes in-process and vice versa). load_optimizer_state has every rank read
/// `dir/optimizer.bin` (the folder must be visible to every process at the same path) and keep
/// its own stages' entries.
///
/// Tensor and data parallelism (TrainingGroups): with a TP group of t members the transport is
/// one pipeline of the grid (the ranks of one replica and TP index) and this rank's stages are
/// its TP rank's slices (runtime::TrainStage's split), their collectives over the group; the
/// global norm sums every shard once and every replicated norm gain once (the per-stage squared
/// sums all-gathered over the group and added in TP-rank order, TrainingEngine's order, so the
/// norm is bitwise the in-process engine's). With a DP group of d replicas each replica runs its
/// own micro-batches; after the backward the step's real targets, summed losses and skip flags
/// are all-reduced over the group, every gradient is weighted by its replica's share of the
/// targets and all-reduced (DataParallelTrainer's rule: every replica then holds the gradient of
/// the mean loss over all replicas' targets, takes the same update, and the loss and tokens
/// returned are the whole step's). gradients() are this rank's (its shards with TP).
/// Checkpoints are written once: the TP shards of every stage are all-gathered over the TP
/// group and assembled, replica 0's pipeline of TP rank 0 gathers them to its rank 0 (world rank
/// 0), which writes both files (whole tensors, the in-process formats); every rank returns once
/// they are written. load_optimizer_state keeps each TP rank's slice of the whole entries.
///
/// Failures: a rank that fails with an error other than PeerTimeout or Aborted calls
/// `transport.abort(reason)` when the transport has one, so the others stop with Aborted; a rank
/// that stops answering makes the others throw PeerTimeout naming it (MpiTransport) within about
/// 1.25 x config.timeout_s.
///
/// Not thread-safe; one thread drives one DistributedTrainer and its transport.
template <transport::Transport T>
class DistributedTrainer {
 public:
  /// Runs `plan` on this rank: builds the virtual stages v with
  /// `plan.partition().stage(v).rank == transport.rank()`.
  /// @param transport this rank's endpoint; must outlive the trainer
  /// @param plan      the same training plan on every rank (plan.shape().num_ranks ranks)
  /// @param fault test-only: rank `fault.rank` ends its process with std::_Exit(3) (after one line
  ///        on stderr) when its compute_gradients is called for the (after_steps + 1)-th time in
  ///        this process, i.e. after `after_steps` completed steps (and their checkpoints)
  /// @param groups the rank's TP and DP groups (none: a pipeline alone)
  /// @throws brigade::Error{InvalidArgument} as TrainingEngine's constructor; if the plan's ranks
  ///         differ from transport.world_size(); for a bad FaultInjection; if options.tp differs
  ///         from the TP group's size
  DistributedTrainer(T& transport, const model::LlamaWeights& init, plan::Plan plan,
                     TrainingOptions options = {}, FaultInjection fault = {},
                     TrainingGroups groups = {})
      : tp_(&transport), config_(init.config), cfg_(options), fault_(fault), plan_(std::move(plan)),
        groups_(groups) {
    detail::check_training_plan(plan_, init.config, options);
    const int tp_size = groups.tp != nullptr ? groups.tp->size() : 1;
    BRIGADE_CHECK(options.tp == tp_size, Errc::InvalidArgument,
                  "DistributedTrainer: TrainingOptions::tp = {} but the TP group has {} members",
                  options.tp, tp_size);
    const int world = transport.world_size();
    const int ranks = plan_.shape().num_ranks;
    BRIGADE_CHECK(ranks == world, Errc::InvalidArgument,
                  "DistributedTrainer: {} pipeline ranks, the transport's world has {} (run one "
                  "process per rank, e.g. mpirun -np {})",
                  ranks, world, ranks);
    BRIGADE_CHECK(fault.rank < world, Errc::InvalidArgument,
                  "DistributedTrainer: fault injection on rank {}, outside [0, {})", fault.rank,
                  world);
    BRIGADE_CHECK(fault.rank < 0 || fault.after_steps >= 1, Errc::InvalidArgument,
                  "DistributedTrainer: fault injection after {} steps, expected >= 1",
                  fault.after_steps);
    const int N = plan_.shape().num_virtual_stages;
    stages_.resize(static_cast<std::size_t>(N));
    optimizers_.resize(static_cast<std::size_t>(N));
    for (int v = 0; v < N; ++v) {
      if (plan_.partition().stage(v).rank != rank()) continue;
      const auto i = static_cast<std::size_t>(v);
      stages_[i] = runtime::make_train_stage(options.stages, init, plan_.partition().stage(v), v,
                                             groups.tp);
      optimizers_[i] = detail::make_stage_optimizer(*stages_[i], options.optimizer);
    }
  }

  /// Runs training_plan(init.config, config) with config's options (see the Plan overload).
  /// @throws brigade::Error{InvalidArgument} as training_plan() and the Plan overload
  DistributedTrainer(T& transport, const model::LlamaWeights& init, const TrainingConfig& config,
                     FaultInjection fault = {}, TrainingGroups groups = {})
      : DistributedTrainer(transport, init, training_plan(init.config, config), config, fault,
                           groups) {}

  /// Forward and backward of every micro-batch by the schedule (collective). Gradients of the
  /// mean loss are left in this rank's stages, the tied copies summed across ranks (with a DP
  /// group: over every replica's micro-batches, each replica passing its own `batches`).
  /// @return loss and tokens of the whole step on every rank (with DP: of every replica); the
  ///         Timeline of every rank of the pipeline on its rank 0 (gathered), of this rank only
  ///         elsewhere; seconds = this rank's wall time
  /// @throws brigade::Error{InvalidArgument} as TrainingEngine::compute_gradients; any error of
  ///         the stages or the transport (PeerTimeout naming the rank that stopped answering,
  ///         Aborted, HeaderMismatch, Mpi)
  StepResult compute_gradients(std::span<const data::PackedBatch> batches) {
    return compute_gradients(plan_, batches);
  }
  /// compute_gradients for one step of its own plan (collective; every rank passes the same
  /// `step`): the trainer's partition, the step's schedule, micro-batch count and work, as
  /// TrainingEngine::compute_gradients(step, batches).
  /// @throws brigade::Error{InvalidArgument} as detail::check_step_plan and
  ///         compute_gradients(batches)
  StepResult compute_gradients(const plan::Plan& step, std::span<const data::PackedBatch> batches) {
    detail::check_step_plan(plan_, step, batches);
    const auto& shape = step.shape();
    const double targets = detail::step_targets(batches);
    if (fault_.rank == rank() && calls_ == fault_.after_steps) {
      fmt::print(stderr, "brigade: fault injection: rank {} exits (code 3) after {} step(s)\n",
                 rank(), calls_);
      std::fflush(stderr);
      std::fflush(stdout);
      std::_Exit(3);
    }
    ++calls_;
    return guarded([&] {
      for (auto& s : stages_)
        if (s) s->zero_grad();
      cpu::set_blas_threads(cfg_.threads_per_rank);
      const int P = shape.num_ranks;
      const auto t0 = start_clock();
      Timeline tl(P);
      MicrobatchDrops drops;
      const auto stats = run_training_program(
          step.program(rank()), shape, rank(), stage_ptrs(), batches, targets,
          *tp_, t0, cfg_.timeout_s, tl, config_.dim, step.execution().windows, &drops,
          cfg_.pipeline_dtype);
      StepResult res;
      const double end_s = seconds_since(t0);
      res.seconds = end_s;
      res.origin = t0;
      res.timeline = gather_timeline(tl, end_s, static_cast<double>(stats.peak_memory_bytes),
                                     res.peak_memory_bytes);
      // Every rank's flagged micro-batches, so that all of them decide alike.
      const auto M = static_cast<std::size_t>(shape.num_microbatches);
      std::vector<double> mine(2 * M, 0.0);
      for (std::size_t m = 0; m < M; ++m) {
        mine[m] = drops.dropped[m];
        mine[M + m] = drops.applied[m];
      }
      const auto all = all_gather(mine);
      std::vector<MicrobatchDrops> per_rank(static_cast<std::size_t>(P));
      for (std::size_t r = 0; r < per_rank.size(); ++r)
        for (std::size_t m = 0; m < M; ++m) {
          per_rank[r].dropped.push_back(all[r * 2 * M + m] != 0.0 ? 1 : 0);
          per_rank[r].applied.push_back(all[r * 2 * M + M + m] != 0.0 ? 1 : 0);
        }
      const auto decision = detail::decide_drops(per_rank, batches);
      detail::apply_drops(decision, stage_ptrs());
      skip_update_ = decision.skip_update;
      res.dropped_microbatches = decision.dropped;
      res.update_skipped = decision.skip_update;
      const auto loss = reduce_loss([&] {
        return detail::kept_loss(*stages_.back(), shape.num_microbatches, decision.dropped);
      });
      res.tokens = loss.count;
      res.loss = loss.mean();
      res.task_loss = reduce_task_loss(detail::step_tasks(batches), [&] {
        return detail::kept_task_loss(*stages_.back(), batches, decision.dropped);
      });
      sum_tied_gradients();
      if (groups_.dp != nullptr) reduce_replicas(res, loss);
      return res;
    });
  }

  /// Global-norm clipping and one AdamW update of this rank's stages (collective: the squared
  /// gradient sums are exchanged); nothing on any rank when the last step's update was skipped
  /// (StepResult::update_skipped, the same on every rank).
  /// @return {learning rate, gradient norm before clipping}; {0, 0} for a skipped update
  std::pair<double, double> optimizer_step() {
    if (skip_update_) return {0.0, 0.0};
    return guarded([&] {
      const int N = plan_.shape().num_virtual_stages;
      std::vector<AdamW*> opts;
      for (auto& o : optimizers_) opts.push_back(o.get());
      std::vector<double> mine = detail::grad_square_sums(opts);
      mine.push_back(0.0);
      if (tied_across_stages() && holds(N - 1))
        mine[static_cast<std::size_t>(N)] = detail::tied_square_sum(*stages_.back());
      if (groups_.tp != nullptr) {
        // Each stage's TP ranks' sums, added in TP-rank order (TrainingEngine's order).
        const auto n = mine.size();
        std::vector<double> every(n * static_cast<std::size_t>(groups_.tp->size()));
        groups_.tp->all_gather(std::span<const double>(mine), std::span<double>(every));
        for (std::size_t i = 0; i < n; ++i) {
          double sum = 0.0;
          for (int t = 0; t < groups_.tp->size(); ++t) sum += every[static_cast<std::size_t>(t) * n + i];
          mine[i] = sum;
        }
      }
      const auto all = all_gather(mine);
      std::vector<double> per_stage(static_cast<std::size_t>(N));
      for (int v = 0; v < N; ++v)
        per_stage[static_cast<std::size_t>(v)] =
            all[static_cast<std::size_t>(plan_.shape().rank_of(v) * (N + 1) + v)];
      const double tied =
          all[static_cast<std::size_t>(plan_.shape().rank_of(N - 1) * (N + 1) + N)];
      const double norm = detail::global_grad_norm(per_stage, tied);
      const double lr = detail::step_optimizers(opts, norm);
      for (auto& s : stages_)
        if (s) s->upload_parameters();
      ++steps_;
      return std::pair<double, double>{lr, norm};
    });
  }

  /// compute_gradients() then optimizer_step() (collective); seconds covers both.
  StepResult train_step(std::span<const data::PackedBatch> batches) {
    return train_step(plan_, batches);
  }
  /// compute_gradients(step, batches) then optimizer_step() (collective).
  /// @throws brigade::Error as compute_gradients(step, batches)
  StepResult train_step(const plan::Plan& step, std::span<const data::PackedBatch> batches) {
    const auto t0 = std::chrono::steady_clock::now();
    StepResult r = compute_gradients(step, batches);
    const auto [lr, norm] = optimizer_step();
    r.lr = lr;
    r.grad_norm = norm;
    r.seconds = seconds_since(t0);
    return r;
  }

  /// Mean cross-entropy of `batches` under the current parameters, forward only, pipelined
  /// micro-batch by micro-batch (collective); the same value on every rank, bitwise
  /// TrainingEngine::evaluate's.
  /// @throws brigade::Error{InvalidArgument} if batches is empty; transport errors
  double evaluate(std::span<const data::PackedBatch> batches) {
    BRIGADE_CHECK(!batches.empty(), Errc::InvalidArgument, "TrainingEngine::evaluate: no batches");
    return guarded([&] {
      cpu::set_blas_threads(cfg_.threads_per_rank);
      schedule::Shape shape = plan_.shape();
      shape.num_microbatches = static_cast<int>(batches.size());
      const int N = shape.num_virtual_stages, me = rank();
      using schedule::Op;
      std::vector<schedule::Action> program;
      for (int mb = 0; mb < shape.num_microbatches; ++mb)
        for (int v = 0; v < N; ++v) {
          if (shape.rank_of(v) != me) continue;
          if (v > 0 && shape.rank_of(v - 1) != me) program.push_back({Op::RecvF, v, mb, 0});
          program.push_back({Op::F, v, mb, 0});
          if (v + 1 < N && shape.rank_of(v + 1) != me) program.push_back({Op::SendF, v, mb, 0});
        }
      Timeline tl(shape.num_ranks);
      run_training_program(program, shape, me, stage_ptrs(), batches, 1.0, *tp_,
                           std::chrono::steady_clock::now(), cfg_.timeout_s, tl, config_.dim,
                           ExecutorWindows{}, nullptr, cfg_.pipeline_dtype);
      const auto loss = reduce_loss([&] {
        cpu::CrossEntropyLoss sum;
        for (int mb = 0; mb < shape.num_microbatches; ++mb) {
          const auto l = stages_.back()->loss(mb);
          sum.sum += l.sum;
          sum.count += l.count;
        }
        return sum;
      });
      for (auto& s : stages_)
        if (s) s->clear_microbatches();
      return loss.mean();
    });
  }

  /// This rank's parameters' gradients by name (after compute_gradients(); with TP its shards,
  /// runtime::ParamRef describes each).
  [[nodiscard]] std::map<std::string, std::vector<float>> gradients() const {
    std::map<std::string, std::vector<float>> out;
    for (auto& s : stages_)
      if (s)
        for (auto& p : s->params())
          if (!out.count(p.name)) out[p.name].assign(p.grad, p.grad + p.size);
    return out;
  }

  /// Gathers every stage's parameters and AdamW moments to rank 0, which writes `dir/model.bin`
  /// and `dir/optimizer.bin` exactly as TrainingEngine::save_checkpoint (collective; every rank
  /// returns once rank 0 has written both files).
  /// @throws brigade::Error{BadFile} on rank 0 if a file cannot be written (the others then
  ///         get Aborted); transport errors
  void save_checkpoint(const std::filesystem::path& dir, std::int64_t data_position) {
    guarded([&] {
      const int N = plan_.shape().num_virtual_stages;
      const int me = rank();
      const auto deadline = [&] { return transport::Deadline::after(cfg_.timeout_s); };
      // Every held stage whole (with TP: its shards gathered over the TP group, in v order on
      // every member).
      std::vector<std::vector<detail::WholeParam>> whole(static_cast<std::size_t>(N));
      for (int v = 0; v < N; ++v)
        if (holds(v)) whole[static_cast<std::size_t>(v)] = whole_stage(v);
      const auto tensors_of = [](std::vector<detail::WholeParam>& ps) {
        std::map<std::string, std::vector<float>> t;
        for (auto& p : ps) t[p.name] = p.value;
        return t;
      };
      // Replica 0's pipeline of TP rank 0 gathers to its rank 0 (world rank 0), which writes.
      const bool writes = (groups_.tp == nullptr || groups_.tp->rank() == 0) &&
                          (groups_.dp == nullptr || groups_.dp->rank() == 0);
      if (writes && me != 0) {
        for (int v = 0; v < N; ++v) {
          if (!holds(v)) continue;
          auto& w = whole[static_cast<std::size_t>(v)];
          send_blob(0, detail::encode_tensors(tensors_of(w)), transport::MessageKind::Weights);
          std::string entries;
          detail::append_optimizer_entries(entries, v, w);
          send_blob(0, entries, transport::MessageKind::Weights);
        }
        auto r = tp_->irecv(0, detail::kTagCheckpointDone, bytes_header(0), {});
        tp_->wait(r, deadline());
      } else if (writes) {
        std::vector<std::map<std::string, std::vector<float>>> tensors(static_cast<std::size_t>(N));
        std::string entries;
        std::int64_t count = 0;
        for (int v = 0; v < N; ++v) {
          const int from = plan_.shape().rank_of(v);
          auto& t = tensors[static_cast<std::size_t>(v)];
          if (from == 0) {
            auto& w = whole[static_cast<std::size_t>(v)];
            t = tensors_of(w);
            count += detail::append_optimizer_entries(entries, v, w);
            continue;
          }
          detail::decode_tensors(recv_blob(from, transport::MessageKind::Weights), t);
          const std::string e = recv_blob(from, transport::MessageKind::Weights);
          count += static_cast<std::int64_t>(stage_param_count(e));
          entries += e;
        }
        // Stage 0's embedding wins (written last), as in TrainingEngine::export_weights.
        std::map<std::string, std::vector<float>> all;
        for (int v = N - 1; v >= 0; --v)
          for (auto& [name, vals] : tensors[static_cast<std::size_t>(v)]) all[name] = std::move(vals);
        std::error_code ec;
        std::filesystem::create_directories(dir, ec);
        BRIGADE_CHECK(!ec, Errc::BadFile, "{}: cannot create the checkpoint folder: {}",
                      dir.string(), ec.message());
        model::save_llama2c_checkpoint(dir / "model.bin", detail::weights_from_tensors(config_, all));
        io::write_file_atomic(dir / "optimizer.bin",
                              detail::optimizer_file_header(steps_, data_position, count) + entries);
        std::vector<transport::Request> done;
        for (int r = 1; r < plan_.shape().num_ranks; ++r)
          done.push_back(tp_->isend(r, detail::kTagCheckpointDone, bytes_header(0), {}));
        for (auto& r : done) tp_->wait(r, deadline());
      }
      // Every rank returns once the files are written: the writing pipeline's ranks join their
      // TP groups, then every rank its DP group.
      for (tp::Group* g : {groups_.tp, groups_.dp})
        if (g != nullptr) {
          std::vector<double> one{1.0};
          g->all_reduce(std::span<double>(one));
        }
      return 0;
    });
  }

  /// Restores this rank's stages' AdamW state from `dir/optimizer.bin` (read by every rank; the
  /// weights come from `dir/model.bin`, passed to the constructor). Not collective.
  /// @return the saved data position
  /// @throws brigade::Error{BadFile} as TrainingEngine::load_optimizer_state
  std::int64_t load_optimizer_state(const std::filesystem::path& dir) {
    std::vector<runtime::TrainStageBase*> stages;
    std::vector<AdamW*> optimizers;
    for (std::size_t v = 0; v < stages_.size(); ++v) {
      stages.push_back(stages_[v].get());
      optimizers.push_back(optimizers_[v].get());
    }
    const auto [steps, position] = detail::read_optimizer_file(dir, stages, optimizers);
    steps_ = steps;
    return position;
  }

  /// The plan every step runs (identical on every rank).
  [[nodiscard]] const plan::Plan& plan() const noexcept { return plan_; }
  /// Optimizer steps taken.
  [[nodiscard]] std::int64_t steps() const noexcept { return steps_; }
  /// This rank (the transport's).
  [[nodiscard]] int rank() const { return tp_->rank(); }
  /// True when this rank holds virtual stage v.
  [[nodiscard]] bool holds(int v) const noexcept {
    return v >= 0 && v < static_cast<int>(stages_.size()) && stages_[static_cast<std::size_t>(v)];
  }

 private:
  static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  static transport::MessageHeader bytes_header(
      std::int64_t nbytes, transport::MessageKind kind = transport::MessageKind::Control) {
    return transport::MessageHeader::make(0, 0, brigade::DType::U8, {nbytes}, 0, kind);
  }
  runtime::TrainStageBase& stage(int v) { return *stages_[static_cast<std::size_t>(v)]; }
  AdamW& optimizer(int v) { return *optimizers_[static_cast<std::size_t>(v)]; }
  [[nodiscard]] bool tied_across_stages() const {
    return config_.shared_classifier && stages_.size() > 1;
  }
  std::vector<runtime::TrainStageBase*> stage_ptrs() {
    std::vector<runtime::TrainStageBase*> p;
    for (auto& s : stages_) p.push_back(s.get());
    return p;
  }
  /// Virtual stage v's parameters whole with their AdamW moments: its own without TP, else each
  /// shard all-gathered over the TP group (values and moments in one call per parameter) and
  /// assembled (runtime::place_shard). Collective over the TP group.
  std::vector<detail::WholeParam> whole_stage(int v) {
    std::array<runtime::TrainStageBase*, 1> st{&stage(v)};
    std::array<AdamW*, 1> opt{&optimizer(v)};
    if (groups_.tp == nullptr) return detail::whole_params(st, opt);
    const auto params = stage(v).params();
    const auto state = optimizer(v).state();
    const std::size_t K = params.size();
    const int members = groups_.tp->size();
    std::vector<detail::WholeParam> out(K);
    for (std::size_t k = 0; k < K; ++k) {
      const auto& p = params[k];
      const auto n = static_cast<std::size_t>(p.size);
      std::vector<float> mine(3 * n), every(3 * n * static_cast<std::size_t>(members));
      std::copy_n(p.value, n, mine.begin());
      std::copy_n(state[k].data(), n, mine.begin() + static_cast<std::ptrdiff_t>(n));
      std::copy_n(state[K + k].data(), n, mine.begin() + static_cast<std::ptrdiff_t>(2 * n));
      groups_.tp->all_gather(std::span<const float>(mine), std::span<float>(every));
      auto& w = out[k];
      w.name = p.name;
      const auto full = static_cast<std::size_t>(p.full_size());
      w.value.resize(full);
      w.m.resize(full);
      w.v.resize(full);
      for (int t = 0; t < members; ++t) {
        const float* at = every.data() + static_cast<std::size_t>(t) * 3 * n;
        runtime::place_shard(p, t, at, w.value.data());
        runtime::place_shard(p, t, at + n, w.m.data());
        runtime::place_shard(p, t, at + 2 * n, w.v.data());
      }
    }
    return out;
  }

  /// Data parallelism (TrainingGroups::dp): the step's real targets, summed loss, per-task
  /// losses and skip flags over every replica; then every gradient of this rank weighted by the
  /// replica's share of the targets and all-reduced (DataParallelTrainer's rule).
  void reduce_replicas(StepResult& res, const cpu::CrossEntropyLoss& loss) {
    tp::Group& dp = *groups_.dp;
    // Every replica's (targets, mean loss, skipped), combined in replica order as
    // DataParallelTrainer does (the same bits as the threads).
    const std::vector<double> mine{static_cast<double>(loss.count), loss.mean(),
                                   res.update_skipped ? 1.0 : 0.0};
    std::vector<double> every(3 * static_cast<std::size_t>(dp.size()));
    dp.all_gather(std::span<const double>(mine), std::span<double>(every));
    double total = every[0], skipped = 0.0;
    for (int r = 1; r < dp.size(); ++r) total += every[3 * static_cast<std::size_t>(r)];
    std::vector<double> targets, means;
    for (int r = 0; r < dp.size(); ++r) {
      const auto at = 3 * static_cast<std::size_t>(r);
      targets.push_back(every[at]);
      means.push_back(every[at + 1]);
      skipped += every[at + 2];
    }
    const double mean = detail::replica_mean_loss(targets, means);
    // Per task: the replicas' task counts may differ (the largest task id each saw).
    std::vector<double> sizes(static_cast<std::size_t>(dp.size()));
    const double mine_size = static_cast<double>(res.task_loss.size());
    dp.all_gather(std::span<const double>(&mine_size, 1), std::span<double>(sizes));
    const auto tasks = static_cast<std::size_t>(*std::max_element(sizes.begin(), sizes.end()));
    if (tasks > 0) {
      std::vector<double> per(2 * tasks, 0.0);
      for (std::size_t t = 0; t < res.task_loss.size(); ++t) {
        per[2 * t] = res.task_loss[t].sum;
        per[2 * t + 1] = static_cast<double>(res.task_loss[t].count);
      }
      dp.all_reduce(std::span<double>(per));
      res.task_loss.assign(tasks, {});
      for (std::size_t t = 0; t < tasks; ++t)
        res.task_loss[t] = {per[2 * t], static_cast<std::int64_t>(per[2 * t + 1])};
    }
    const double share = static_cast<double>(loss.count) / total;
    res.tokens = static_cast<std::int64_t>(total);
    res.loss = mean;
    if (skipped > 0.0) {  // a replica skips its update: every replica does
      skip_update_ = true;
      res.update_skipped = true;
      return;
    }
    const auto w = static_cast<float>(share);
    for (auto& st : stages_) {
      if (!st) continue;
      for (auto& p : st->params()) {
        std::span<float> g(p.grad, static_cast<std::size_t>(p.size));
        for (float& x : g) x *= w;
        dp.all_reduce(g);
      }
    }
  }

  /// Entries in an append_optimizer_entries blob.
  static std::size_t stage_param_count(const std::string& e) {
    std::size_t pos = 0, n = 0;
    while (pos + 16 <= e.size()) {
      std::int32_t len = 0;
      std::int64_t size = 0;
      std::memcpy(&len, e.data() + pos + 4, 4);
      std::memcpy(&size, e.data() + pos + 8 + static_cast<std::size_t>(len), 8);
      pos += 16 + static_cast<std::size_t>(len) + 2 * static_cast<std::size_t>(size) * sizeof(float);
      ++n;
    }
    BRIGADE_CHECK(pos == e.size(), Errc::Internal, "save_checkpoint: a malformed optimizer blob");
    return n;
  }

  /// Runs `body`; on an error of this rank (not a timeout or another rank's abort), tells the
  /// others through transport.abort when the transport has one, then rethrows.
  template <class F>
  auto guarded(F&& body) {
    try {
      return body();
    } catch (const std::exception& e) {
      transport::abort_others(*tp_, e);
      throw;
    }
  }

  /// Rank 0 sends every rank a start message; each starts its clock when it has it (one origin
  /// for every rank's Timeline, to within one message latency).
  std::chrono::steady_clock::time_point start_clock() {
    const auto deadline = transport::Deadline::after(cfg_.timeout_s);
    if (rank() == 0) {
      std::vector<transport::Request> starts;
      for (int r = 1; r < plan_.shape().num_ranks; ++r)
        starts.push_back(tp_->isend(r, detail::kTagTrainStart, bytes_header(0), {}));
      const auto t0 = std::chrono::steady_clock::now();
      for (auto& s : starts) tp_->wait(s, deadline);
      return t0;
    }
    auto r = tp_->irecv(0, detail::kTagTrainStart, bytes_header(0), {});
    tp_->wait(r, deadline);
    return std::chrono::steady_clock::now();
  }

  /// Sends `text` (a size, then the bytes) as a message of `kind` (Weights for checkpoint
  /// tensors and optimizer entries, Control for timelines).
  void send_blob(int peer, const std::string& text,
                 transport::MessageKind kind = transport::MessageKind::Control) {
    const std::uint64_t size = text.size();
    auto rs = tp_->isend(peer, detail::kTagBlobSize, bytes_header(8),
                         std::as_bytes(std::span<const std::uint64_t>(&size, 1)));
    auto rt = tp_->isend(peer, detail::kTagBlob, bytes_header(static_cast<std::int64_t>(size), kind),
                         std::as_bytes(std::span<const char>(text.data(), text.size())));
    tp_->wait(rs, transport::Deadline::after(cfg_.timeout_s));
    tp_->wait(rt, transport::Deadline::after(cfg_.timeout_s));
  }
  /// Receives a send_blob of `kind` from `peer`.
  std::string recv_blob(int peer, transport::MessageKind kind = transport::MessageKind::Control) {
    std::uint64_t size = 0;
    auto rs = tp_->irecv(peer, detail::kTagBlobSize, bytes_header(8),
                         std::as_writable_bytes(std::span<std::uint64_t>(&size, 1)));
    tp_->wait(rs, transport::Deadline::after(cfg_.timeout_s));
    std::string text(static_cast<std::size_t>(size), '\0');
    auto rt = tp_->irecv(peer, detail::kTagBlob, bytes_header(static_cast<std::int64_t>(size), kind),
                         std::as_writable_bytes(std::span<char>(text.data(), text.size())));
    tp_->wait(rt, transport::Deadline::after(cfg_.timeout_s));
    return text;
  }

  /// Every rank's `mine` (same length everywhere), rank-major: result[r * n + i].
  std::vector<double> all_gather(const std::vector<double>& mine) {
    const int P = plan_.shape().num_ranks, me = rank();
    const std::size_t n = mine.size();
    std::vector<double> all(n * static_cast<std::size_t>(P), 0.0);
    std::copy(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(n) * me);
    const auto h = bytes_header(static_cast<std::int64_t>(n * sizeof(double)));
    std::vector<transport::Request> reqs;
    for (int r = 0; r < P; ++r) {
      if (r == me) continue;
      reqs.push_back(tp_->irecv(r, detail::kTagReduce, h,
                                std::as_writable_bytes(std::span<double>(
                                    all.data() + n * static_cast<std::size_t>(r), n))));
    }
    for (int r = 0; r < P; ++r)
      if (r != me)
        reqs.push_back(tp_->isend(r, detail::kTagReduce, h,
                                  std::as_bytes(std::span<const double>(mine.data(), n))));
    for (auto& r : reqs) tp_->wait(r, transport::Deadline::after(cfg_.timeout_s));
    return all;
  }

  /// The tail rank's `n` values (computed by `tail_values` there, resized to n) on every rank.
  template <class F>
  std::vector<double> from_tail(std::size_t n, F&& tail_values) {
    const int N = plan_.shape().num_virtual_stages;
    std::vector<double> mine(n, 0.0);
    if (holds(N - 1)) {
      mine = tail_values();
      mine.resize(n, 0.0);
    }
    const auto all = all_gather(mine);
    const auto at = static_cast<std::ptrdiff_t>(
        static_cast<std::size_t>(plan_.shape().rank_of(N - 1)) * n);
    return {all.begin() + at, all.begin() + at + static_cast<std::ptrdiff_t>(n)};
  }

  /// The tail rank's loss (computed by `tail_loss` there) on every rank.
  template <class F>
  cpu::CrossEntropyLoss reduce_loss(F&& tail_loss) {
    const auto v = from_tail(2, [&] {
      const auto l = tail_loss();
      return std::vector<double>{l.sum, static_cast<double>(l.count)};
    });
    return {v[0], static_cast<std::int64_t>(v[1])};
  }

  /// The tail rank's per-task loss (detail::kept_task_loss there, [tasks] or empty) on every
  /// rank: one flag (whether the tail has any) and a (sum, count) pair per task.
  template <class F>
  std::vector<cpu::CrossEntropyLoss> reduce_task_loss(int tasks, F&& tail_task_loss) {
    if (tasks == 0) return {};
    const auto n = static_cast<std::size_t>(tasks);
    const auto v = from_tail(1 + 2 * n, [&] {
      const auto per = tail_task_loss();
      std::vector<double> out(1 + 2 * n, 0.0);
      out[0] = per.empty() ? 0.0 : 1.0;
      for (std::size_t t = 0; t < per.size() && t < n; ++t) {
        out[1 + 2 * t] = per[t].sum;
        out[2 + 2 * t] = static_cast<double>(per[t].count);
      }
      return out;
    });
    if (v[0] == 0.0) return {};
    std::vector<cpu::CrossEntropyLoss> out(n);
    for (std::size_t t = 0; t < n; ++t)
      out[t] = {v[1 + 2 * t], static_cast<std::int64_t>(v[2 + 2 * t])};
    return out;
  }

  /// The tied classifier: the first and the last virtual stage both get first + last.
  void sum_tied_gradients() {
    if (!tied_across_stages()) return;
    const int N = plan_.shape().num_virtual_stages;
    const int first = plan_.shape().rank_of(0), last = plan_.shape().rank_of(N - 1);
    if (first == last) {
      if (rank() != first) return;
      auto a = detail::find_param(stage(0), "tok_embeddings");
      auto b = detail::find_param(stage(N - 1), "tok_embeddings");
      for (std::int64_t i = 0; i < a.size; ++i) a.grad[i] = b.grad[i] = a.grad[i] + b.grad[i];
      return;
    }
    if (rank() != first && rank() != last) return;
    const bool is_first = rank() == first;
    auto mine = detail::find_param(stage(is_first ? 0 : N - 1), "tok_embeddings");
    std::vector<float> theirs(static_cast<std::size_t>(mine.size));
    const auto h = transport::MessageHeader::make(0, 0, brigade::DType::F32, {mine.size}, 0,
                                                  transport::MessageKind::Gradient);
    const int peer = is_first ? last : first;
    auto rr = tp_->irecv(peer, detail::kTagTiedGrad, h,
                         transport::as_writable_bytes(std::span<float>(theirs)));
    auto rs = tp_->isend(peer, detail::kTagTiedGrad, h,
                         transport::as_bytes(std::span<const float>(
                             mine.grad, static_cast<std::size_t>(mine.size))));
    tp_->wait(rr, transport::Deadline::after(cfg_.timeout_s));
    tp_->wait(rs, transport::Deadline::after(cfg_.timeout_s));
    // first + last, in that order, as TrainingEngine.
    for (std::int64_t i = 0; i < mine.size; ++i) {
      const float o = theirs[static_cast<std::size_t>(i)];
      mine.grad[i] = is_first ? mine.grad[i] + o : o + mine.grad[i];
    }
  }

  /// Rank 0: every rank's intervals merged, and every rank's peak memory in `peaks`;
  /// elsewhere: `tl` itself (after sending it with `peak`), `peaks` left empty.
  Timeline gather_timeline(const Timeline& tl, double end_s, double peak,
                           std::vector<double>& peaks) {
    const int P = plan_.shape().num_ranks;
    if (rank() != 0) {
      send_blob(0, detail::encode_rank_result(tl, end_s, peak));
      return tl;
    }
    peaks.assign(static_cast<std::size_t>(P), 0.0);
    peaks[0] = peak;
    Timeline all = tl;
    for (int r = 1; r < P; ++r)
      detail::decode_rank_result(recv_blob(r), r, all, &peaks[static_cast<std::size_t>(r)]);
    return all;
  }

  T* tp_;
  model::LlamaConfig config_;
  TrainingOptions cfg_;
  FaultInjection fault_;
  plan::Plan plan_;
  TrainingGroups groups_;
  std::vector<std::unique_ptr<runtime::TrainStageBase>> stages_;  // by virtual stage; null elsewhere
  std::vector<std::unique_ptr<AdamW>> optimizers_;            // by virtual stage; null elsewhere
  std::int64_t steps_ = 0;
  bool skip_update_ = false;  // the last compute_gradients' DropDecision::skip_update
  int calls_ = 0;
};

}  // namespace v0
}  // namespace brigade::engine
