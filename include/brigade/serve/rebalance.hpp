// DynaPipe's live layer rebalancer for serving: between rounds, when the online latency predictor
// says the slowest stage exceeds the mean by a threshold (for long enough), a boundary decoder
// layer moves to the neighbouring stage; its weights and KV caches migrate in parts overlapped
// with serving (engine::InferenceWorker, MIGRATE / MIGRATE_RECV), and the plan changes at one
// round boundary on every rank.
#pragma once

#include "brigade/engine/inference.hpp"
#include "brigade/model/layer_cost.hpp"
#include "brigade/model/weights.hpp"
#include "brigade/partition/partition.hpp"
#include "brigade/schedule/action.hpp"
#include "brigade/serve/predictor.hpp"
#include "brigade/serve/serving.hpp"

#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace brigade::serve {
inline namespace v0 {

/// The partition `p` with the decoder layer at virtual stage `from`'s end facing its neighbour
/// `to` (from - 1 or from + 1) moved to `to`; std::nullopt when that layer is not a decoder
/// (the embedding, the final norm, the LM head and the sampler stay where they are) or `from`
/// would be left without a layer.
/// @throws brigade::Error{InvalidArgument} if from or to lies outside p or they are not
///         neighbours
std::optional<partition::Partition> move_layer(const partition::Partition& p, int from, int to);

/// One evaluation of the rebalancer's decision (Rebalancer::evaluations): the recent rounds
/// simulated with the layers as they were and with the best candidate move.
struct RebalanceEvaluation {
  int round = 0;                 ///< the round it was made at
  int from = 0, to = 0;          ///< the best candidate (from = to = the slowest stage if none)
  double round_s = 0.0;          ///< predicted seconds per executor round as the layers were
  double best_after_s = 0.0;     ///< ... with the best candidate (round_s if none)
  double required_gain = 0.0;    ///< the fraction it had to gain (LayerMove::required_gain)
  bool moved = false;            ///< the candidate was ordered
  /// The predicted gain, 1 - best_after_s / round_s (0 without a candidate).
  [[nodiscard]] double gain() const noexcept {
    return round_s > 0.0 ? 1.0 - best_after_s / round_s : 0.0;
  }
};

/// DynaPipe's rebalancer: the online latency predictor (StageLatencyPredictor) fitted on every
/// stage's measured rounds, and the decision, made between rounds by virtual stage 0's book:
/// over the recent rounds' features, predict each stage's seconds per micro-batch round with
/// the current layers; when the slowest exceeds the mean by `threshold` for `patience`
/// consecutive rounds (and `cooldown` rounds have passed since the last switch, and no move is
/// under way), simulate the recent rounds through the pipeline (round_seconds) with the layers
/// as they are and with one boundary decoder moved from the slowest stage to either neighbour,
/// and make the move that gives the fewest seconds per round, if it lowers them by `min_gain`
/// plus the predictor's error measured on the earlier moves (else wait another `patience`
/// rounds before simulating again). Each move is checked as its rounds come in: the fit as
/// it was when the move was ordered prices the moved stages' measured rounds under the new
/// layers (LayerMove::checked_*), which is how far a prediction for a split not yet run was
/// off. The simulation, not the
/// slowest stage's load, judges the move: a round of one live micro-batch lasts the sum of the
/// stages, so a move that evens the stages but costs more in all (a decoder priced higher on
/// the stage that adopts it) lengthens it; with every micro-batch full it is the busiest
/// stage's sum (docs/serving.md, "The rebalancer's objective"). Hysteresis
/// against oscillation: a move that undoes the previous one (the same layer back) needs twice
/// `min_gain`, and each such reversal in a row doubles the cooldown before the next move (up to
/// 64 x; a move that is not a reversal resets it). The move's
/// parts are sized so that each part carries at most `part_bytes` (parts = 1 + ceil(bytes /
/// (micro-batches x part_bytes)) rounds). One move at a time. Not thread-safe: the book owns it.
class Rebalancer {
 public:
  /// @param weights      the served model (layer sizes)
  /// @param start        the partition serving starts with (one stage per rank)
  /// @param microbatches micro-batches in flight
  /// @param part_bytes   engine::InferenceOptions::migration_part_bytes
  /// @throws brigade::Error{InvalidArgument} for options out of range (threshold < 0, patience
  ///         < 1, cooldown < 0, warmup < 0, window < 0, min_gain outside [0, 1), force_every <
  ///         0), a partition of another model, microbatches < 1, part_bytes < 1
  Rebalancer(const model::LlamaWeights& weights, partition::Partition start, int microbatches,
             std::size_t part_bytes, RebalanceOptions options);

  /// Folds in a measurement: stage v took `seconds` on the round of `f` (F, plus SAMPLE on the
  /// tail), which ran with plan_at(f.round); a round of the last move's stages from its switch
  /// on also checks that move (LayerMove::checked_*).
  void observe(int v, const RoundFeatures& f, double seconds);
  /// The predictor's error on the splits it moved to: the mean over the moves checked over at
  /// least 16 stage rounds of |checked_predicted_s / checked_measured_s - 1| (0 when none is).
  [[nodiscard]] double moved_prediction_error() const noexcept;

  /// The decision at round `round` (see the class comment): a move to order, or none.
  /// @param recent the micro-batch rounds built so far, in order (the last `window` are weighed)
  /// @param live_positions KV positions held by the live sequences (sizes the migration)
  std::optional<engine::detail::MoveOrder> decide(int round, double now_s,
                                                  std::span<const RoundFeatures> recent,
                                                  std::int64_t live_positions);

  /// The layers the stages hold in round `round`.
  [[nodiscard]] const partition::Partition& plan_at(int round) const;
  /// Every plan with the round it starts at, in order (the first at round 0).
  [[nodiscard]] const std::vector<std::pair<int, partition::Partition>>& plans() const noexcept {
    return plans_;
  }
  [[nodiscard]] const std::vector<LayerMove>& moves() const noexcept { return moves_; }
  /// Every evaluation so far, in order (one per `patience` rounds of standing imbalance; the
  /// moves are the ones with `moved`): what the rebalancer saw when it did not move.
  [[nodiscard]] const std::vector<RebalanceEvaluation>& evaluations() const noexcept {
    return evaluations_;
  }
  [[nodiscard]] const StageLatencyPredictor& predictor() const noexcept { return pred_; }

 private:
  /// Predicted seconds per micro-batch round of every stage with `p` over `recent`.
  std::vector<double> stage_seconds(const partition::Partition& p,
                                    std::span<const RoundFeatures> recent) const;
  /// Predicted seconds per executor round with `p` over `window`: its rounds (the executor's,
  /// from the smallest to the largest in it) as the inference schedule's rounds
  /// (schedule::inference, every micro-batch live, lowered), each F priced by the predictor on
  /// its micro-batch's features of that round (0 where the micro-batch built nothing),
  /// simulated (sim::simulate, free links); the makespan over the rounds. The lowered
  /// schedule depends on the round count only: it is built once per count and kept (a
  /// decision prices the current plan and each candidate on the same one).
  double round_seconds(const partition::Partition& p, std::span<const RoundFeatures> window);

  const model::LlamaWeights* weights_;
  RebalanceOptions o_;
  int microbatches_;
  std::size_t part_bytes_;
  StageLatencyPredictor pred_;
  std::optional<StageLatencyPredictor> ordered_fit_;  // the fit when moves_.back() was ordered
  std::vector<std::pair<int, partition::Partition>> plans_;
  std::vector<LayerMove> moves_;
  std::vector<RebalanceEvaluation> evaluations_;
  int streak_ = 0;
  int forced_ = 0;
  int reversals_ = 0;  // moves in a row that each undid the one before
  int lowered_rounds_ = 0;      // the round count lowered_ was built for (0: none yet)
  schedule::Schedule lowered_;  // schedule::inference over lowered_rounds_ rounds, lowered
};

/// What the migrations of a run did to its rounds, from its Timeline. A round's time is the gap
/// between the starts of consecutive rounds on virtual stage 0 (its first F of each round),
/// less the seconds the book slept in it waiting for an arrival (RoundFeatures::idle_s);
/// a migration's rounds are [ordered_round, switch_round] (the ordered round's time ends with
/// the next round's start, where the new owner allocates the layer it adopts); its neighbours
/// are the `neighbours` rounds before ordered_round and after switch_round, outside every
/// migration. The baseline is the same measure over windows of as many rounds (the median
/// migration's) that hold no migration, tiling the run from round 0: how much slower than
/// its neighbours the slowest round of a window is with no migration in it, from the batch
/// mix changing and the machine alone.
struct MigrationImpact {
  int migrations = 0;
  /// The largest ratio of a migration round's time to the median of its neighbours' (1 = as
  /// fast as them; the target is <= 1.2).
  double max_round_ratio = 0.0;
  /// Over the migrations, the mean of their rounds' ratios to their neighbours' median (the
  /// typical slowdown of a round while a layer moves).
  double mean_round_ratio = 0.0;
  /// The median, over the migrations, of a migration's largest ratio.
  double median_max_round_ratio = 0.0;
  int baseline_windows = 0;  ///< windows without a migration measured for the baseline
  /// The median, over the baseline windows, of a window's largest ratio (compare with
  /// median_max_round_ratio).
  double baseline_max_round_ratio = 0.0;
  /// The median, over the baseline windows, of a window's mean ratio (compare with
  /// mean_round_ratio).
  double baseline_mean_round_ratio = 0.0;
  /// The largest share, in [0, 1], of a migration round's window that one rank spent in its
  /// MIGRATE and MIGRATE_RECV actions (copying parts, or waiting for one). A round's window is
  /// [its first F on virtual stage 0, the next round's), and each rank's ops are counted by
  /// the time they overlap it, whatever round they belong to. This is the latency a migration
  /// adds to the round directly.
  double max_migration_share = 0.0;
  /// The largest t / (t - m) over a migration round's window of t seconds and a rank that
  /// spent m of it in migration ops: how much slower the round was than it would have been
  /// without that rank's migration work, if that work lay on the round's critical path. It is
  /// an upper bound of the latency a migration added (the neighbours' ratio above also moves
  /// with the batch mix). Infinite only when a rank migrated for the whole window.
  double max_added_ratio = 0.0;
  double migration_seconds = 0.0;  ///< seconds in MIGRATE / MIGRATE_RECV, all ranks
  std::int64_t migration_bytes = 0;  ///< bytes the parts carried
};

/// The MigrationImpact of `report` (see there).
/// @throws brigade::Error{InvalidArgument} for neighbours < 1
MigrationImpact migration_impact(const ServeReport& report, int neighbours = 4);

}  // namespace v0
}  // namespace brigade::serve
