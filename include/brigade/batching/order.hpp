// DynaPipe's micro-batch ordering (Jiang et al. 2024, "DynaPipe", EuroSys '24, §5): the order
// in which unequal micro-batches enter the adaptive schedule, chosen by simulating candidates.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/batching/dynamic.hpp"
#include "brigade/cost/cost_model.hpp"
#include "brigade/schedule/adaptive.hpp"
#include "brigade/schedule/lower.hpp"
#include "brigade/schedule/recompute.hpp"
#include "brigade/sim/simulator.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <numeric>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace brigade::batching {
inline namespace v0 {

/// A cost model of per-micro-batch costs, the same on every stage (a MicroBatchTable): micro-
/// batch m's forward takes forward_fraction x base[m], its backward the rest, a RECOMPUTE
/// another forward, with base[m] = seconds[m] (seconds[m] / (1 + forward_fraction) when it
/// recomputes, so that its F, RECOMPUTE and B add up to seconds[m]); its stash is peak_bytes[m]
/// after F, RECOMPUTE and BI, and held_bytes[m] after an F whose RECOMPUTE follows
/// (checkpoint_bytes); messages are free. What order_adaptive scores candidate orders with; a
/// cost::CostModel.
class MicroBatchTableCost {
 public:
  /// @param table per micro-batch: seconds (>= 0), held and peak bytes (0 <= held <= peak; held
  ///              = peak unless it recomputes), recompute flags (or none: no recompute)
  /// @param forward_fraction the forward's share of a micro-batch's F + B seconds, in (0, 1)
  /// @throws brigade::Error{InvalidArgument} for columns of different sizes, a negative or
  ///         non-finite entry, held bytes above the peak (or below it without recompute), or a
  ///         fraction outside (0, 1)
  MicroBatchTableCost(MicroBatchTable table, double forward_fraction)
      : t_(std::move(table)), fraction_(forward_fraction) {
    const auto M = t_.seconds.size();
    BRIGADE_CHECK(t_.held_bytes.size() == M && t_.peak_bytes.size() == M &&
                      (t_.recompute.empty() || t_.recompute.size() == M),
                  Errc::InvalidArgument,
                  "MicroBatchTableCost: {} times, {} held and {} peak byte counts, {} recompute "
                  "flags",
                  M, t_.held_bytes.size(), t_.peak_bytes.size(), t_.recompute.size());
    BRIGADE_CHECK(forward_fraction > 0.0 && forward_fraction < 1.0, Errc::InvalidArgument,
                  "MicroBatchTableCost: forward fraction {}, expected in (0, 1)", forward_fraction);
    if (t_.recompute.empty()) t_.recompute.assign(M, 0);
    for (std::size_t m = 0; m < M; ++m)
      BRIGADE_CHECK(t_.seconds[m] >= 0.0 && std::isfinite(t_.seconds[m]) &&
                        t_.held_bytes[m] >= 0.0 && std::isfinite(t_.peak_bytes[m]) &&
                        (t_.recompute[m] != 0 ? t_.held_bytes[m] <= t_.peak_bytes[m]
                                              : t_.held_bytes[m] == t_.peak_bytes[m]),
                    Errc::InvalidArgument,
                    "MicroBatchTableCost: micro-batch {}: {} s, {} bytes held, {} at its peak, "
                    "recompute {}; expected finite, >= 0, and held <= peak (equal without "
                    "recompute)",
                    m, t_.seconds[m], t_.held_bytes[m], t_.peak_bytes[m], t_.recompute[m] != 0);
  }
  [[nodiscard]] double compute_seconds(const schedule::Action& a) const noexcept {
    const auto m = static_cast<std::size_t>(a.microbatch);
    const double s = t_.recompute[m] != 0 ? t_.seconds[m] / (1.0 + fraction_) : t_.seconds[m];
    if (a.op == schedule::Op::F || a.op == schedule::Op::Recompute) return fraction_ * s;
    if (a.op == schedule::Op::B) return (1.0 - fraction_) * s;
    if (a.op == schedule::Op::BI || a.op == schedule::Op::BW) return (1.0 - fraction_) * s / 2;
    return 0.0;
  }
  [[nodiscard]] double activation_bytes(const schedule::Action& a) const noexcept {
    return a.op == schedule::Op::F || a.op == schedule::Op::BI || a.op == schedule::Op::Recompute
               ? t_.peak_bytes[static_cast<std::size_t>(a.microbatch)]
               : 0.0;
  }
  /// held_bytes: what a recomputed micro-batch keeps from its F to its RECOMPUTE.
  [[nodiscard]] double checkpoint_bytes(const schedule::Action& a) const noexcept {
    return t_.held_bytes[static_cast<std::size_t>(a.microbatch)];
  }
  [[nodiscard]] double message_bytes(const schedule::Action&) const noexcept { return 0.0; }
  [[nodiscard]] cost::Link link(int, int) const noexcept { return {}; }

 private:
  MicroBatchTable t_;
  double fraction_;
};

static_assert(cost::CostModel<MicroBatchTableCost> && cost::HasCheckpointBytes<MicroBatchTableCost>);

/// The order order_adaptive chose and the schedule it runs.
struct AdaptiveOrder {
  /// order[k] = the caller's micro-batch that runs as micro-batch k (enters rank 0 k-th).
  std::vector<int> order;
  /// The chosen schedule over the micro-batches in `order` (compute-only; lower() it), with a
  /// RECOMPUTE before the backward of each micro-batch that recomputes (with_recompute).
  schedule::Schedule schedule;
  std::string_view generator = "adaptive";
  double makespan_seconds = 0.0;  ///< simulated iteration time of `schedule` (MicroBatchTableCost)
  double input_order_makespan_seconds = 0.0;  ///< the adaptive schedule's in the input order
  int orders_tried = 0;                       ///< candidate orders simulated
};

/// DynaPipe's micro-batch ordering (Jiang et al. 2024, §5; execution_planner.optimize_schedule
/// in awslabs/optimizing-multitask-training-through-dynamic-pipelines): the micro-batches are
/// grouped by cost into k clusters (k-means; k = `clusters`, or 4 for up to 20 micro-batches
/// and 3 above, as DynaPipe does), every one of the k! orders of the clusters is tried (within
/// a cluster the input order; DynaPipe shuffles it at random), and the input order too; with
/// at most k micro-batches every permutation is tried. Each candidate is run through
/// schedule::adaptive under the memory limit (each micro-batch's held bytes, and its peak for
/// those that recompute) and simulated (MicroBatchTableCost, free links); 1F1B on the same
/// order is a candidate too wherever its simulated peak fits the limit (DynaPipe's planner
/// likewise tries each schedule method its placement allows, 1F1B among them: with
/// micro-batches of nearly one size the cycle order runs more forwards ahead on the middle
/// ranks than 1F1B and delays their first backward). Either schedule gets a RECOMPUTE before
/// the backward of each micro-batch that recomputes (schedule::with_recompute). The fastest
/// wins, the earliest tried on ties (the input order first, adaptive before 1F1B).
/// Our clustering is one-dimensional, on the stage seconds (DynaPipe clusters the forward and
/// backward times of the first and last stage, which our slowest-stage cost folds into one).
///
/// @param table    [M] each micro-batch's seconds, held and peak bytes, recompute flag
///                 (DynamicPlan::costs; a static batcher's micro-batches through
///                 choose_recompute)
/// @param ranks    pipeline ranks P, >= 1
/// @param memory_limit_bytes activation bytes a rank may hold at once (> 0; infinity: none)
/// @param clusters k, 0 for DynaPipe's default, else 1..5 (5! = 120 orders)
/// @param forward_fraction the forward's share of a micro-batch's F + B seconds (backward = 2
///        x forward for a transformer layer: 1/3)
/// @throws brigade::Error{InvalidArgument} for no micro-batches, a malformed table, a bad
///         parameter, or a micro-batch over the limit (schedule::adaptive's error)
inline AdaptiveOrder order_adaptive(const MicroBatchTable& table, int ranks,
                                    double memory_limit_bytes, int clusters = 0,
                                    double forward_fraction = 1.0 / 3.0) {
  BRIGADE_CHECK(table.size() > 0, Errc::InvalidArgument, "order_adaptive: no micro-batches");
  BRIGADE_CHECK(clusters >= 0 && clusters <= 5, Errc::InvalidArgument,
                "order_adaptive: {} clusters, expected 0 (DynaPipe's default) to 5", clusters);
  const MicroBatchTableCost check(table, forward_fraction);  // validates the entries
  (void)check;
  const std::span<const double> seconds = table.seconds;
  const int M = static_cast<int>(seconds.size());
  const int k = clusters > 0 ? clusters : (M > 20 ? 3 : 4);

  std::vector<std::vector<int>> candidates;
  std::vector<int> identity(static_cast<std::size_t>(M));
  std::iota(identity.begin(), identity.end(), 0);
  candidates.push_back(identity);
  if (M <= k) {
    std::vector<int> perm = identity;
    while (std::next_permutation(perm.begin(), perm.end())) candidates.push_back(perm);
  } else {
    // 1-D k-means (Lloyd), centres started at the k quantiles of the sorted times.
    std::vector<double> sorted(seconds.begin(), seconds.end());
    std::sort(sorted.begin(), sorted.end());
    std::vector<double> centre(static_cast<std::size_t>(k));
    for (int c = 0; c < k; ++c)
      centre[static_cast<std::size_t>(c)] =
          sorted[static_cast<std::size_t>((2 * c + 1) * M / (2 * k))];
    std::vector<int> label(static_cast<std::size_t>(M), -1);
    for (int iter = 0; iter < 100; ++iter) {
      bool moved = false;
      for (int m = 0; m < M; ++m) {
        int best = 0;
        for (int c = 1; c < k; ++c)
          if (std::abs(seconds[static_cast<std::size_t>(m)] - centre[static_cast<std::size_t>(c)]) <
              std::abs(seconds[static_cast<std::size_t>(m)] - centre[static_cast<std::size_t>(best)]))
            best = c;
        moved |= label[static_cast<std::size_t>(m)] != best;
        label[static_cast<std::size_t>(m)] = best;
      }
      if (!moved) break;
      for (int c = 0; c < k; ++c) {
        double sum = 0.0;
        int n = 0;
        for (int m = 0; m < M; ++m)
          if (label[static_cast<std::size_t>(m)] == c) {
            sum += seconds[static_cast<std::size_t>(m)];
            ++n;
          }
        if (n > 0) centre[static_cast<std::size_t>(c)] = sum / n;
      }
    }
    std::vector<std::vector<int>> groups;
    for (int c = 0; c < k; ++c) {
      std::vector<int> g;
      for (int m = 0; m < M; ++m)
        if (label[static_cast<std::size_t>(m)] == c) g.push_back(m);
      if (!g.empty()) groups.push_back(std::move(g));
    }
    std::vector<int> perm(groups.size());
    std::iota(perm.begin(), perm.end(), 0);
    do {
      std::vector<int> order;
      for (const int g : perm)
        order.insert(order.end(), groups[static_cast<std::size_t>(g)].begin(),
                     groups[static_cast<std::size_t>(g)].end());
      if (order != identity) candidates.push_back(std::move(order));
    } while (std::next_permutation(perm.begin(), perm.end()));
  }

  AdaptiveOrder best;
  const bool recompute = table.any_recompute();
  for (const auto& order : candidates) {
    const MicroBatchTable t = table.permuted(order);
    schedule::Params p{ranks, M};
    p.memory_limit_bytes = memory_limit_bytes;
    p.microbatch_bytes = t.held_bytes;
    if (recompute) p.microbatch_peak_bytes = t.peak_bytes;
    const MicroBatchTableCost cost(t, forward_fraction);
    sim::SimOptions opt;
    opt.record_timeline = false;
    auto consider = [&](schedule::Schedule compute, std::string_view generator) {
      compute = schedule::with_recompute(compute, recompute ? std::span<const char>(t.recompute)
                                                            : std::span<const char>());
      const auto r = sim::simulate(schedule::lower(compute), cost, opt);
      // 1F1B must fit (to rounding: P equal micro-batches at a limit of P of them do).
      if (generator != "adaptive" &&
          *std::max_element(r.peak_memory_bytes.begin(), r.peak_memory_bytes.end()) >
              memory_limit_bytes * (1.0 + 1e-9))
        return;
      if (best.order.empty() || r.makespan < best.makespan_seconds) {
        best.order = order;
        best.schedule = std::move(compute);
        best.generator = generator;
        best.makespan_seconds = r.makespan;
      }
    };
    consider(schedule::adaptive(p), "adaptive");
    if (best.orders_tried++ == 0) best.input_order_makespan_seconds = best.makespan_seconds;
    consider(schedule::one_f_one_b(p), "1f1b");
  }
  return best;
}

}  // namespace v0
}  // namespace brigade::batching
