// DynaPipe's dynamic micro-batching (Jiang et al. 2024, "DynaPipe: Optimizing Multi-task
// Training through Dynamic Pipelines", EuroSys '24, §4): samples ordered by length, split into
// consecutive ranges by a dynamic program that minimises the pipeline's predicted iteration
// time under a per-micro-batch memory limit, with micro-batch times from the cost model.
#pragma once

#include "brigade/batching/batcher.hpp"
#include "brigade/core/error.hpp"
#include "brigade/cost/cost_model.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/layer_cost.hpp"
#include "brigade/partition/partition.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <functional>
#include <limits>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

namespace brigade::batching {
inline namespace v0 {

/// What the dynamic batcher prices a micro-batch by, as functions of its model::WorkItem.
struct MicroBatchCost {
  /// Seconds one pipeline stage spends on the micro-batch (forward + backward), >= 0.
  std::function<double(const model::WorkItem&)> seconds;
  /// Bytes of activations one stage keeps for it; must not decrease as samples are added.
  std::function<double(const model::WorkItem&)> activation_bytes;
};

/// The cost of a micro-batch on the slowest stage of `partition` from the calibrated layer
/// times (cost::ProfiledLayerTimes or model::roofline_layer_seconds):
/// - seconds: max over stages of the sum over the stage's layers of the Forward, BackwardInput
///   and BackwardWeight seconds of `layer_seconds` for the work item. A ModelSpec's layers of
///   one kind share one shape (every decoder is built from the one LlamaConfig), so each kind
///   is priced once per work item, on its first layer, and counted per stage;
/// - activation_bytes: max over stages of the larger part of cost::training_stash (what the
///   stage holds after F, or after BI until BW) for the work item's tokens and sequences.
/// @throws brigade::Error{InvalidArgument} if layer_seconds is empty
inline MicroBatchCost stage_cost(const model::ModelSpec& spec, const partition::Partition& partition,
                                 model::LayerSeconds layer_seconds) {
  BRIGADE_CHECK(static_cast<bool>(layer_seconds), Errc::InvalidArgument,
                "batching::stage_cost: no layer_seconds");
  constexpr int kKinds = 5;  // model::LayerKind's values
  std::array<int, kKinds> first_layer;
  first_layer.fill(-1);
  std::vector<std::array<int, kKinds>> counts;  // [stage][kind] layers
  for (const auto& st : partition.stages()) {
    std::array<int, kKinds> c{};
    for (int l = st.first; l < st.last; ++l) {
      const auto k = static_cast<std::size_t>(spec.layer(l).kind);
      ++c[k];
      if (first_layer[k] < 0) first_layer[k] = l;
    }
    counts.push_back(c);
  }
  MicroBatchCost c;
  c.seconds = [spec, counts, first_layer, ls = std::move(layer_seconds)](const model::WorkItem& w) {
    std::array<double, kKinds> per_kind{};
    for (std::size_t k = 0; k < kKinds; ++k) {
      if (first_layer[k] < 0) continue;
      per_kind[k] = ls(spec, first_layer[k], w, model::Phase::Forward) +
                    ls(spec, first_layer[k], w, model::Phase::BackwardInput) +
                    ls(spec, first_layer[k], w, model::Phase::BackwardWeight);
    }
    double worst = 0.0;
    for (const auto& stage : counts) {
      double s = 0.0;
      for (std::size_t k = 0; k < kKinds; ++k) s += stage[k] * per_kind[k];
      worst = std::max(worst, s);
    }
    return worst;
  };
  c.activation_bytes = [spec, partition](const model::WorkItem& w) {
    double worst = 0.0;
    for (const auto& st : partition.stages()) {
      const auto s = cost::training_stash(spec, st, w.tokens, w.sequences);
      worst = std::max({worst, s.forward, s.backward_input});
    }
    return worst;
  };
  return c;
}

/// DynaPipe's predicted iteration time of a pipeline of `stages` stages over micro-batches of
/// these per-stage seconds: (stages - 1) x the slowest + the sum (the fill and drain of the
/// slowest micro-batch plus every micro-batch once through the slowest stage; §4.1).
inline double predicted_iteration_seconds(std::span<const double> seconds, int stages) noexcept {
  double worst = 0.0, sum = 0.0;
  for (const double s : seconds) {
    worst = std::max(worst, s);
    sum += s;
  }
  return (stages - 1) * worst + sum;
}

/// The dynamic batcher's answer: micro-batches (in ascending length order), with each one's
/// predicted seconds per stage and activation bytes, and the predicted iteration time.
struct DynamicPlan {
  std::vector<MicroBatch> microbatches;
  std::vector<double> seconds;           ///< [micro-batches] MicroBatchCost::seconds
  std::vector<double> activation_bytes;  ///< [micro-batches] MicroBatchCost::activation_bytes
  double iteration_seconds = 0.0;        ///< predicted_iteration_seconds(seconds, stages)
  int bounds_tried = 0;                  ///< how many bounds on the slowest micro-batch ran a DP
};

/// Dynamic micro-batching (DynaPipe §4.2): the samples are ordered by length (ties by input
/// position) and split into consecutive ranges, each one micro-batch packed by offsets
/// (varlen_microbatch: no padding, attention within each sample; DynaPipe pads within a
/// micro-batch, our kernels take cu_seqlens), minimising
/// predicted_iteration_seconds(micro-batch seconds, stages) subject to every micro-batch's
/// activation_bytes <= memory_limit_bytes.
///
/// The objective is not additive (its max term), so, as the paper does, a bound T on the
/// slowest micro-batch is fixed and a DP over prefixes minimises the sum of micro-batch times
/// with every micro-batch at most T: f(0) = 0, f(j) = min over i < j with t(i, j) <= T and
/// memory(i, j) <= limit of f(i) + t(i, j); the answer is the best (stages - 1) x (the split's
/// own slowest) + f(n) over the bounds, tried from the largest down, each DP's split skipping
/// the bounds between its own slowest and its bound (they give the same split). With every
/// distinct t(i, j) a candidate bound this is exact; when there are more than `max_bounds` distinct times, `max_bounds` of them are tried,
/// evenly spaced in rank order from the largest single-sample time (no split can have its
/// slowest below it) to the largest (the paper quantises the bound the same way). Memory is
/// assumed to grow as samples are added, so each range stops at the first that does not fit:
/// O(n w) cost evaluations for n samples and w samples in the largest micro-batch, then
/// O(n w) per bound at most (a range's scan stops where no longer range is under the bound).
class DynamicBatcher {
 public:
  /// @param cost               seconds and activation bytes of a micro-batch (stage_cost)
  /// @param stages             pipeline stages S, >= 1
  /// @param memory_limit_bytes activation bytes one micro-batch may take on a stage, > 0
  /// @param max_bounds         most bounds on the slowest micro-batch tried, >= 1
  /// @throws brigade::Error{InvalidArgument} for an empty cost function or a bad parameter
  DynamicBatcher(MicroBatchCost cost, int stages, double memory_limit_bytes, int max_bounds = 256)
      : cost_(std::move(cost)), stages_(stages), limit_(memory_limit_bytes),
        max_bounds_(max_bounds) {
    BRIGADE_CHECK(cost_.seconds && cost_.activation_bytes, Errc::InvalidArgument,
                  "DynamicBatcher: the cost has no seconds or no activation_bytes function");
    BRIGADE_CHECK(stages >= 1 && memory_limit_bytes > 0.0 && max_bounds >= 1,
                  Errc::InvalidArgument,
                  "DynamicBatcher: {} stages, memory limit {} bytes, {} bounds; expected >= 1, "
                  "> 0, >= 1",
                  stages, memory_limit_bytes, max_bounds);
  }

  /// The micro-batches of solve(samples).
  [[nodiscard]] std::vector<MicroBatch> plan(std::span<const SampleLength> samples) const {
    return solve(samples).microbatches;
  }

  /// Runs the DP (see the class comment).
  /// @throws brigade::Error{InvalidArgument} for an empty input, a sample under 1 token, or a
  ///         sample whose micro-batch alone needs more than the memory limit (naming the
  ///         sample, its tokens, its bytes and the limit)
  [[nodiscard]] DynamicPlan solve(std::span<const SampleLength> samples) const {
    detail::check_samples(samples, "DynamicBatcher");
    const auto n = static_cast<std::int64_t>(samples.size());
    std::vector<std::int64_t> order(static_cast<std::size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
      return samples[static_cast<std::size_t>(a)].tokens < samples[static_cast<std::size_t>(b)].tokens;
    });
    auto len = [&](std::int64_t k) {
      return samples[static_cast<std::size_t>(order[static_cast<std::size_t>(k)])].tokens;
    };
    // times[i][k], bytes[i][k]: the range [i, i + k + 1) of the sorted samples, while it fits.
    std::vector<std::vector<double>> times(static_cast<std::size_t>(n)),
        bytes(static_cast<std::size_t>(n)), suffix_min(static_cast<std::size_t>(n));
    std::vector<double> all_times;
    double single_max = 0.0;
    all_times.reserve(static_cast<std::size_t>(n) * 16);
    for (std::int64_t i = 0; i < n; ++i) {
      times[static_cast<std::size_t>(i)].reserve(16);
      bytes[static_cast<std::size_t>(i)].reserve(16);
      std::int64_t tokens = 0;
      double pairs = 0.0;
      for (std::int64_t j = i; j < n; ++j) {
        tokens += len(j);
        pairs += causal_pairs(len(j));
        const auto w = varlen_work(tokens, j - i + 1, pairs);
        const double b = cost_.activation_bytes(w);
        if (b > limit_) {
          const auto& s = samples[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])];
          BRIGADE_CHECK(j > i, Errc::InvalidArgument,
                        "DynamicBatcher: sample {} ({} tokens) needs {} bytes of activations on a "
                        "stage as a micro-batch of its own, more than the micro-batch memory "
                        "limit of {} bytes",
                        s.index, s.tokens, b, limit_);
          break;
        }
        const double t = cost_.seconds(w);
        times[static_cast<std::size_t>(i)].push_back(t);
        bytes[static_cast<std::size_t>(i)].push_back(b);
        all_times.push_back(t);
      }
      single_max = std::max(single_max, times[static_cast<std::size_t>(i)].front());
      // suffix_min[i][k]: the fastest of the ranges [i, i + k' + 1), k' >= k; a bound below it
      // ends the scan of i's ranges (at once where times grow with the range, as they do).
      auto& m = suffix_min[static_cast<std::size_t>(i)];
      const auto& ti = times[static_cast<std::size_t>(i)];
      m.resize(ti.size());
      for (std::size_t k = ti.size(); k-- > 0;)
        m[k] = k + 1 == ti.size() ? ti[k] : std::min(ti[k], m[k + 1]);
    }
    std::sort(all_times.begin(), all_times.end());
    all_times.erase(std::unique(all_times.begin(), all_times.end()), all_times.end());
    std::vector<double> candidates;
    if (static_cast<std::int64_t>(all_times.size()) <= max_bounds_) {
      candidates = all_times;
    } else {
      const auto lo = static_cast<std::int64_t>(
          std::lower_bound(all_times.begin(), all_times.end(), single_max) - all_times.begin());
      const auto hi = static_cast<std::int64_t>(all_times.size()) - 1;
      for (int q = 0; q < max_bounds_; ++q) {
        const auto k = max_bounds_ == 1 ? hi : lo + (hi - lo) * q / (max_bounds_ - 1);
        candidates.push_back(all_times[static_cast<std::size_t>(k)]);
      }
      candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
    }

    constexpr double kInf = std::numeric_limits<double>::infinity();
    std::vector<double> f(static_cast<std::size_t>(n + 1)), worst(static_cast<std::size_t>(n + 1));
    std::vector<std::int64_t> prev(static_cast<std::size_t>(n + 1));
    double best = kInf;
    std::vector<std::int64_t> best_prev;
    DynamicPlan out;
    // Bounds from the largest down. The DP's split at bound T has its own slowest W <= T, and
    // every bound in [W, T] gives that same split (it is feasible there and optimal for the
    // larger T), so the next bound tried is the largest one below W; a bound without any
    // feasible split ends the search (no smaller one has one).
    for (auto next = static_cast<std::ptrdiff_t>(candidates.size()) - 1; next >= 0;) {
      const double bound = candidates[static_cast<std::size_t>(next)];
      if (bound < single_max) break;  // some sample's own micro-batch is slower: infeasible
      ++out.bounds_tried;
      std::fill(f.begin(), f.end(), kInf);
      f[0] = 0.0;
      worst[0] = 0.0;
      for (std::int64_t i = 0; i < n; ++i) {
        const double fi = f[static_cast<std::size_t>(i)];
        if (fi == kInf) continue;
        const auto& ti = times[static_cast<std::size_t>(i)];
        const auto& mi = suffix_min[static_cast<std::size_t>(i)];
        for (std::size_t k = 0; k < ti.size() && mi[k] <= bound; ++k) {
          if (ti[k] > bound) continue;
          const auto j = static_cast<std::size_t>(i) + k + 1;
          if (fi + ti[k] < f[j]) {
            f[j] = fi + ti[k];
            prev[j] = i;
            worst[j] = std::max(worst[static_cast<std::size_t>(i)], ti[k]);
          }
        }
      }
      if (f[static_cast<std::size_t>(n)] == kInf) break;
      const double slowest = worst[static_cast<std::size_t>(n)];
      const double objective = (stages_ - 1) * slowest + f[static_cast<std::size_t>(n)];
      if (objective < best) {
        best = objective;
        best_prev = prev;
      }
      next = static_cast<std::ptrdiff_t>(
                 std::lower_bound(candidates.begin(), candidates.end(), slowest) -
                 candidates.begin()) - 1;
    }
    // Walk the best split back, then emit it front to back.
    std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
    for (std::int64_t j = n; j > 0; j = best_prev[static_cast<std::size_t>(j)])
      ranges.emplace_back(best_prev[static_cast<std::size_t>(j)], j);
    std::reverse(ranges.begin(), ranges.end());
    for (const auto& [i, j] : ranges) {
      std::vector<std::int64_t> positions(order.begin() + i, order.begin() + j);
      out.microbatches.push_back(varlen_microbatch(samples, std::move(positions)));
      const auto k = static_cast<std::size_t>(j - i - 1);
      out.seconds.push_back(times[static_cast<std::size_t>(i)][k]);
      out.activation_bytes.push_back(bytes[static_cast<std::size_t>(i)][k]);
    }
    out.iteration_seconds = predicted_iteration_seconds(out.seconds, stages_);
    return out;
  }

  [[nodiscard]] int stages() const noexcept { return stages_; }
  [[nodiscard]] double memory_limit_bytes() const noexcept { return limit_; }

 private:
  MicroBatchCost cost_;
  int stages_;
  double limit_;
  int max_bounds_;
};

static_assert(Batcher<DynamicBatcher>);

}  // namespace v0
}  // namespace brigade::batching
