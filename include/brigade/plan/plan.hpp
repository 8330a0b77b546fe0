// brigade::plan::Plan: what a planner hands to an engine or to the simulator. One value holds
// the split (partition + placement), the lowered and validated schedule, and the work of every
// micro-batch; make_plan() builds one from names in the generator and partition tables.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/layer_cost.hpp"
#include "brigade/partition/partition.hpp"
#include "brigade/partition/policies.hpp"
#include "brigade/schedule/action.hpp"
#include "brigade/schedule/lower.hpp"
#include "brigade/schedule/registry.hpp"
#include "brigade/schedule/validate.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace brigade::plan {
inline namespace v0 {

/// Checks that `shape` places its virtual stages where `partition` does: the same number of
/// stages and ranks, and shape.rank_of(v) == partition.stage(v).rank for every v.
/// @param who names the caller in the messages ("Plan", "RooflineCostModel")
/// @throws brigade::Error{InvalidArgument} "<who>: the partition has S stages on P ranks, the
///         schedule ..." or "<who>: the schedule places virtual stage v on rank r, the partition
///         on rank q"; as Shape::check()
inline void check_placement(const partition::Partition& partition, const schedule::Shape& shape,
                            std::string_view who) {
  BRIGADE_CHECK(partition.num_stages() == shape.num_virtual_stages &&
                    partition.num_ranks() == shape.num_ranks,
                Errc::InvalidArgument,
                "{}: the partition has {} stages on {} ranks, the schedule {} virtual stages on "
                "{} ranks",
                who, partition.num_stages(), partition.num_ranks(), shape.num_virtual_stages,
                shape.num_ranks);
  shape.check();
  for (int v = 0; v < shape.num_virtual_stages; ++v)
    BRIGADE_CHECK(shape.rank_of(v) == partition.stage(v).rank, Errc::InvalidArgument,
                  "{}: the schedule places virtual stage {} on rank {}, the partition on rank {}",
                  who, v, shape.rank_of(v), partition.stage(v).rank);
}

/// A pipeline plan: partition + placement + lowered schedule + per-micro-batch work.
///
/// - The partition is the one virtual stage -> rank map: stage v's layers and rank. A plan is
///   only built when the schedule's Shape::placement (the ranks its programs were generated for)
///   is that map, so the plan's shape() and partition() cannot disagree; make_plan() asks the
///   partition policy for the generator's placement.
/// - The schedule is lowered (SEND/RECV explicit) and has passed schedule::validate() under
///   `execution()`, so an executor with those windows completes it.
/// - work()[m] is micro-batch m's work (model::WorkItem: tokens, sequences, mean attention
///   context). Training: the tokens (rows) and packed sequences of the micro-batch. Inference:
///   its prefill (round 0: prompt tokens, sequences, mean context); decode round c >= 1
///   processes `sequences` tokens at context tokens / sequences + c. Empty when the work is not
///   known when the plan is made (a training engine then takes it from each step's batches).
///
/// Engines (engine::TrainingEngine, engine::DistributedTrainer) run a Plan; sim::simulate()
/// predicts it; cost::RooflineCostModel prices it from work(). A value type: copyable, compared
/// by value.
class Plan {
 public:
  /// @param partition the split and placement (num_stages() virtual stages on num_ranks() ranks)
  /// @param schedule  a generator's compute-only schedule, or a lowered one, over the
  ///                  partition's virtual stages and ranks
  /// @param work      empty, or one WorkItem per micro-batch (each with tokens >= 1,
  ///                  sequences in [1, tokens], context > 0)
  /// @param execution the executor semantics the schedule is validated against
  /// @throws brigade::Error{InvalidArgument} if the schedule's ranks or virtual stages differ
  ///         from the partition's, the schedule places virtual stage v elsewhere than the
  ///         partition (naming v), the work has the wrong count or a bad entry (naming the
  ///         micro-batch); brigade::Error{Deadlock or InvalidArgument} from validate()
  Plan(partition::Partition partition, const schedule::Schedule& schedule,
       std::vector<model::WorkItem> work = {}, schedule::ExecutionModel execution = {})
      : partition_(std::move(partition)), work_(std::move(work)), execution_(execution) {
    check_placement(partition_, schedule.shape, "Plan");
    lowered_ = is_lowered(schedule) ? schedule : schedule::lower(schedule);
    schedule::validate(lowered_, execution_);
    const auto& sh = lowered_.shape;
    BRIGADE_CHECK(work_.empty() || static_cast<int>(work_.size()) == sh.num_microbatches,
                  Errc::InvalidArgument, "Plan: work for {} micro-batches, the schedule has {}",
                  work_.size(), sh.num_microbatches);
    for (std::size_t m = 0; m < work_.size(); ++m) {
      const auto& w = work_[m];
      BRIGADE_CHECK(w.tokens >= 1 && w.sequences >= 1 && w.sequences <= w.tokens &&
                        w.context > 0.0 && std::isfinite(w.context),
                    Errc::InvalidArgument,
                    "Plan: micro-batch {} has {} tokens in {} sequences at context {}, expected "
                    "tokens >= 1, sequences in [1, tokens], context > 0",
                    m, w.tokens, w.sequences, w.context);
    }
  }

  /// The split: stage v's layers [first, last) and its rank.
  [[nodiscard]] const partition::Partition& partition() const noexcept { return partition_; }
  /// The lowered, validated schedule (every rank's program).
  [[nodiscard]] const schedule::Schedule& schedule() const noexcept { return lowered_; }
  /// The schedule's shape (placement taken from the partition).
  [[nodiscard]] const schedule::Shape& shape() const noexcept { return lowered_.shape; }
  /// Per micro-batch work (see the class comment); empty when not known in advance.
  [[nodiscard]] std::span<const model::WorkItem> work() const noexcept { return work_; }
  /// The executor semantics the schedule was validated against.
  [[nodiscard]] const schedule::ExecutionModel& execution() const noexcept { return execution_; }
  /// Rank `r`'s lowered program.
  /// @throws brigade::Error{InvalidArgument} if r is not in [0, num_ranks)
  [[nodiscard]] std::span<const schedule::Action> program(int r) const {
    BRIGADE_CHECK(r >= 0 && r < lowered_.shape.num_ranks, Errc::InvalidArgument,
                  "Plan: rank {} outside [0, {})", r, lowered_.shape.num_ranks);
    return lowered_.ranks[static_cast<std::size_t>(r)];
  }

  friend bool operator==(const Plan& a, const Plan& b) {
    auto same = [](const model::WorkItem& x, const model::WorkItem& y) {
      return x.tokens == y.tokens && x.sequences == y.sequences && x.context == y.context;
    };
    return a.partition_ == b.partition_ && a.lowered_ == b.lowered_ &&
           std::equal(a.work_.begin(), a.work_.end(), b.work_.begin(), b.work_.end(), same) &&
           a.execution_.sends == b.execution_.sends &&
           a.execution_.windows.recv_window == b.execution_.windows.recv_window &&
           a.execution_.windows.send_window == b.execution_.windows.send_window;
  }

 private:
  static bool is_lowered(const schedule::Schedule& s) {
    for (const auto& prog : s.ranks)
      for (const auto& a : prog)
        if (is_communication(a.op)) return true;
    return false;
  }

  partition::Partition partition_;
  schedule::Schedule lowered_;
  std::vector<model::WorkItem> work_;
  schedule::ExecutionModel execution_;
};

/// The work of one compute action of micro-batch work `base`: in training, chunk c of
/// shape.num_chunks carries base.tokens / C tokens (at least 1) of the base's sequences and
/// context; in inference, round 0 (prefill) is the base and round c >= 1 (decode) one token
/// per sequence at context base.tokens / base.sequences + c.
inline model::WorkItem action_work(const schedule::Shape& shape, const model::WorkItem& base,
                                   int chunk) noexcept {
  model::WorkItem w = base;
  if (shape.mode == schedule::Mode::Training) {
    w.tokens = std::max<std::int64_t>(1, base.tokens / std::max(1, shape.num_chunks));
  } else if (chunk > 0) {
    w.tokens = base.sequences;
    w.context = static_cast<double>(base.tokens) / static_cast<double>(std::max<std::int64_t>(1, base.sequences)) + chunk;
  }
  return w;
}

/// What make_plan() builds a plan from: a generator and a partition policy, both by name.
struct PlanRequest {
  /// A generator of schedule::generators() (gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v,
  /// dualpipe-v, inference, or one added by schedule::register_generator).
  std::string schedule = "1f1b";
  schedule::Params params{};  ///< ranks, micro-batches, virtual stages (, decode rounds)
  /// A policy of partition::policies() ("uniform", "balanced", or one added by
  /// partition::register_policy).
  std::string partition = "balanced";
  /// The micro-batch the partition policy balances for (tokens, sequences, mean context).
  model::WorkItem balance_for{256, 1, 128.0};
  /// Seconds of a layer for a work item and phase, what the policy prices layers with
  /// (partition::PolicyRequest::layer_seconds): the roofline at default rates unless set, e.g.
  /// to cost::ProfiledLayerTimes on a device profile.
  model::LayerSeconds layer_seconds = model::roofline_layer_seconds();
  std::vector<model::WorkItem> work;  ///< per micro-batch work for the Plan (may be empty)
  schedule::ExecutionModel execution{};
};

/// Builds a plan from a generator's compute-only schedule `compute` (request.schedule and
/// request.params are not used): splits `spec` with the policy `request.partition` over the
/// schedule's placement (v mod P, or the V shape), lowers and validates.
/// @throws brigade::Error{InvalidArgument} for an unknown policy (listing the known ones), more
///         virtual stages than the policy can split the model into; as Plan's constructor
inline Plan make_plan(const model::ModelSpec& spec, const schedule::Schedule& compute,
                      const PlanRequest& request) {
  partition::PolicyRequest pr;
  pr.placement = compute.shape.placement;
  pr.num_ranks = compute.shape.num_ranks;
  pr.work = request.balance_for;
  pr.training = compute.shape.mode == schedule::Mode::Training;
  pr.layer_seconds = request.layer_seconds;
  return Plan(partition::make_partition(spec, request.partition, pr), compute, request.work,
              request.execution);
}

/// Builds a plan by names: runs the generator `request.schedule` with request.params, then
/// make_plan(spec, schedule, request). Identical inputs give identical plans, so every process
/// of a distributed run agrees on the split.
/// @throws brigade::Error{InvalidArgument} for an unknown generator (listing the known ones),
///         parameters the generator rejects; as the other overload
inline Plan make_plan(const model::ModelSpec& spec, const PlanRequest& request) {
  return make_plan(spec, schedule::generate(request.schedule, request.params), request);
}

}  // namespace v0
}  // namespace brigade::plan
