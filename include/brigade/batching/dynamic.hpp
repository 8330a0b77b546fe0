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
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace brigade::batching {
inline namespace v0 {

/// How a micro-batch's activations live between its forward and its backward on every stage.
enum class Recompute : std::uint8_t {
  None,  ///< the forward keeps what the backward needs (cost::training_stash)
  /// the forward keeps only the stage's input (cost::recompute_checkpoint_bytes) and a
  /// RECOMPUTE re-runs the stage's forward (all its layers) before the backward
  Full,
};

/// "none", "full".
constexpr std::string_view to_string(Recompute r) noexcept {
  return r == Recompute::Full ? "full" : "none";
}

/// What the dynamic batcher prices a micro-batch by, as functions of its model::WorkItem.
struct MicroBatchCost {
  /// Seconds one pipeline stage spends on the micro-batch (forward + backward), >= 0.
  std::function<double(const model::WorkItem&)> seconds;
  /// Bytes of activations one stage keeps for it; must not decrease as samples are added.
  std::function<double(const model::WorkItem&)> activation_bytes;
  /// Optional (with checkpoint_bytes): seconds with full recompute, the forward run twice
  /// (F, RECOMPUTE, then the backward), >= seconds.
  std::function<double(const model::WorkItem&)> recompute_seconds;
  /// Optional (with recompute_seconds): bytes one stage keeps from the F to the RECOMPUTE
  /// under full recompute; must not decrease as samples are added.
  std::function<double(const model::WorkItem&)> checkpoint_bytes;

  /// True when full recompute is priced (both optional functions are set).
  [[nodiscard]] bool offers_recompute() const noexcept {
    return static_cast<bool>(recompute_seconds) && static_cast<bool>(checkpoint_bytes);
  }
};

/// The cost of a micro-batch on the slowest stage of `partition` from the calibrated layer
/// times (cost::ProfiledLayerTimes or model::roofline_layer_seconds):
/// - seconds: max over stages of the sum over the stage's layers of the Forward, BackwardInput
///   and BackwardWeight seconds of `layer_seconds` for the work item. A ModelSpec's layers of
///   one kind share one shape (every decoder is built from the one LlamaConfig), so each kind
///   is priced once per work item, on its first layer, and counted per stage;
/// - recompute_seconds: the same with each stage's Forward counted twice (the RECOMPUTE re-runs
///   the stage's forward, every layer of it, as runtime::TrainStage::recompute does);
/// - activation_bytes: max over stages of the larger part of cost::training_stash (what the
///   stage holds after F, or after BI until BW) for the work item's tokens and sequences; with
///   full recompute it is still what the stage holds from its RECOMPUTE to its backward;
/// - checkpoint_bytes: max over stages of cost::recompute_checkpoint_bytes (the stage's input,
///   tokens x dim float32; nothing on the stage with the embedding).
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
  // The slowest stage's seconds with each stage's forward counted `forwards` times.
  auto slowest = [spec, counts, first_layer, ls = std::move(layer_seconds)](
                     const model::WorkItem& w, double forwards) {
    std::array<double, kKinds> per_kind{};
    for (std::size_t k = 0; k < kKinds; ++k) {
      if (first_layer[k] < 0) continue;
      per_kind[k] = forwards * ls(spec, first_layer[k], w, model::Phase::Forward) +
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
  MicroBatchCost c;
  c.seconds = [slowest](const model::WorkItem& w) { return slowest(w, 1.0); };
  c.recompute_seconds = [slowest](const model::WorkItem& w) { return slowest(w, 2.0); };
  c.activation_bytes = [spec, partition](const model::WorkItem& w) {
    double worst = 0.0;
    for (const auto& st : partition.stages()) {
      const auto s = cost::training_stash(spec, st, w.tokens, w.sequences);
      worst = std::max({worst, s.forward, s.backward_input});
    }
    return worst;
  };
  c.checkpoint_bytes = [spec, partition](const model::WorkItem& w) {
    double worst = 0.0;
    for (const auto& st : partition.stages())
      worst = std::max(worst, cost::recompute_checkpoint_bytes(spec, st, w.tokens));
    return worst;
  };
  return c;
}

/// Options of the dynamic batcher beyond its per-micro-batch memory limit.
struct DynamicOptions {
  /// Consider full recompute for a micro-batch whose activations do not fit the limit (used
  /// only when the cost offers_recompute()).
  bool recompute = true;
  /// Bytes one micro-batch may hold at its peak on a stage (its whole stash, from its RECOMPUTE
  /// to its backward) when it recomputes: DynaPipe's peak-activation limit, the memory a rank
  /// has for activations (the schedule's per-rank limit); infinity: none.
  double peak_limit_bytes = std::numeric_limits<double>::infinity();
  /// Most bounds on the slowest micro-batch tried, >= 1 (see DynamicBatcher).
  int max_bounds = 256;
};

/// The mode a micro-batch runs in and what it costs in it (choose_recompute).
struct MicroBatchChoice {
  Recompute mode = Recompute::None;
  bool fits = false;              ///< false: it fits the limits in no mode
  double seconds = 0.0;           ///< MicroBatchCost seconds in `mode` (recompute_seconds if Full)
  double activation_bytes = 0.0;  ///< its whole stash (the peak in either mode)
  double checkpoint_bytes = 0.0;  ///< kept from F to RECOMPUTE under Full (0 if not priced)
  /// Bytes a stage keeps for it from its F to its backward: activation_bytes, or
  /// checkpoint_bytes when it recomputes.
  [[nodiscard]] double held_bytes() const noexcept {
    return mode == Recompute::Full ? checkpoint_bytes : activation_bytes;
  }
};

/// DynaPipe's recompute choice for one micro-batch (Jiang et al. 2024, §4; the planner of
/// awslabs/optimizing-multitask-training-through-dynamic-pipelines tries "none", "selective"
/// and "full" in that order, data_opt/optimizer.py): the fastest mode whose memory fits. None
/// (the fastest) when activation_bytes <= `limit`; else Full when the cost offers it,
/// options.recompute is set, checkpoint_bytes <= `limit` and activation_bytes <=
/// options.peak_limit_bytes; else it does not fit (`fits` false, mode None). Selective
/// recompute (Megatron-LM's: the attention's s x s softmax and dropout activations rebuilt,
/// Korthikanti et al. 2022, section 5) is not a mode: our attention keeps one log-sum-exp per
/// token and head, never the probabilities (FlashAttention-2's recipe, cost::training_stash), so
/// it would drop nothing.
/// @param limit bytes a stage may keep for one micro-batch from its F to its backward
inline MicroBatchChoice choose_recompute(const MicroBatchCost& cost, const model::WorkItem& w,
                                         double limit, const DynamicOptions& options) {
  MicroBatchChoice c;
  c.activation_bytes = cost.activation_bytes(w);
  if (c.activation_bytes <= limit) {
    c.fits = true;
    c.seconds = cost.seconds(w);
    return c;
  }
  if (!options.recompute || !cost.offers_recompute()) return c;
  c.checkpoint_bytes = cost.checkpoint_bytes(w);
  if (c.checkpoint_bytes > limit || c.activation_bytes > options.peak_limit_bytes) return c;
  c.fits = true;
  c.mode = Recompute::Full;
  c.seconds = cost.recompute_seconds(w);
  return c;
}

/// Per micro-batch, [M] each: what the ordering (order_adaptive), the adaptive schedule and
/// the simulator (MicroBatchTableCost) take of a batcher's micro-batches.
struct MicroBatchTable {
  std::vector<double> seconds;     ///< F + B seconds on the slowest stage, in its mode
  std::vector<double> held_bytes;  ///< kept on a stage from F to the backward
  std::vector<double> peak_bytes;  ///< its whole stash (from F, or from its RECOMPUTE, to B)
  std::vector<char> recompute;     ///< 1: Recompute::Full

  /// Appends a micro-batch (`choice.fits` assumed).
  void push_back(const MicroBatchChoice& choice) {
    seconds.push_back(choice.seconds);
    held_bytes.push_back(choice.held_bytes());
    peak_bytes.push_back(choice.activation_bytes);
    recompute.push_back(choice.mode == Recompute::Full ? 1 : 0);
  }
  /// The table of micro-batches that do not recompute: held = peak = bytes (a static batcher's
  /// micro-batches, priced by MicroBatchCost seconds and activation_bytes).
  /// @throws brigade::Error{InvalidArgument} for spans of different sizes
  [[nodiscard]] static MicroBatchTable without_recompute(std::span<const double> seconds,
                                                         std::span<const double> bytes) {
    BRIGADE_CHECK(seconds.size() == bytes.size(), Errc::InvalidArgument,
                  "MicroBatchTable: {} times and {} byte counts", seconds.size(), bytes.size());
    MicroBatchTable t;
    t.seconds.assign(seconds.begin(), seconds.end());
    t.held_bytes.assign(bytes.begin(), bytes.end());
    t.peak_bytes = t.held_bytes;
    t.recompute.assign(seconds.size(), 0);
    return t;
  }
  [[nodiscard]] std::size_t size() const noexcept { return seconds.size(); }
  [[nodiscard]] bool any_recompute() const noexcept {
    return std::find(recompute.begin(), recompute.end(), 1) != recompute.end();
  }
  /// The table of micro-batches order[0], order[1], ... (indices into this one).
  /// @throws brigade::Error{InvalidArgument} for an index outside the table
  [[nodiscard]] MicroBatchTable permuted(std::span<const int> order) const {
    MicroBatchTable t;
    for (const int m : order) {
      BRIGADE_CHECK(m >= 0 && static_cast<std::size_t>(m) < size(), Errc::InvalidArgument,
                    "MicroBatchTable: micro-batch {} of {}", m, size());
      const auto k = static_cast<std::size_t>(m);
      t.seconds.push_back(seconds[k]);
      t.held_bytes.push_back(held_bytes[k]);
      t.peak_bytes.push_back(peak_bytes[k]);
      t.recompute.push_back(recompute[k]);
    }
    return t;
  }
};

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
/// mode, predicted seconds per stage and bytes, and the predicted iteration time.
struct DynamicPlan {
  std::vector<MicroBatch> microbatches;
  MicroBatchTable costs;           ///< [micro-batches] choose_recompute's choice for each
  double iteration_seconds = 0.0;  ///< predicted_iteration_seconds(costs.seconds, stages)
  int bounds_tried = 0;            ///< how many bounds on the slowest micro-batch ran a DP
};

/// Dynamic micro-batching (DynaPipe §4.2): the samples are ordered by length (ties by input
/// position) and split into consecutive ranges, each one micro-batch packed by offsets
/// (varlen_microbatch: no padding, attention within each sample; DynaPipe pads within a
/// micro-batch, our kernels take cu_seqlens), each in the fastest recompute mode that fits
/// (choose_recompute: its activations, or with full recompute its checkpoint, at most
/// memory_limit_bytes; with recompute its whole stash at most options.peak_limit_bytes),
/// minimising predicted_iteration_seconds(micro-batch seconds in their modes, stages).
///
/// The recompute choice is per micro-batch, priced in the DP: a range's cost is its fastest
/// fitting mode's seconds (with full recompute the stage's forward counted twice), which is
/// what minimises the objective for any split (both of its terms grow with each micro-batch's
/// seconds), so the DP over splits with those costs is exact over every split and every
/// assignment of modes. DynaPipe's planner picks one mode per iteration: it runs its DP once
/// per mode in the order none, selective, full and keeps the first that finds a split
/// (data_opt/optimizer.py, generate_microbatches); a per-iteration mode is one of the
/// assignments ours searches, so ours is never slower by the objective.
///
/// The objective is not additive (its max term), so, as the paper does, a bound T on the
/// slowest micro-batch is fixed and a DP over prefixes minimises the sum of micro-batch times
/// with every micro-batch at most T: f(0) = 0, f(j) = min over i < j with t(i, j) <= T and
/// (i, j) fitting in some mode of f(i) + t(i, j); the answer is the best (stages - 1) x (the
/// split's own slowest) + f(n) over the bounds, tried from the largest down, each DP's split
/// skipping the bounds between its own slowest and its bound (they give the same split). With
/// every distinct t(i, j) a candidate bound this is exact; when there are more than
/// options.max_bounds distinct times, max_bounds of them are tried, evenly spaced in rank order
/// from the largest single-sample time (no split can have its slowest below it) to the largest
/// (the paper quantises the bound the same way). Memory is assumed to grow as samples are
/// added, so each range stops at the first that fits in no mode: O(n w) cost evaluations for n
/// samples and w samples in the largest micro-batch, then O(n w) per bound at most (a range's
/// scan stops where no longer range is under the bound). Full recompute lets a micro-batch
/// grow until its checkpoint (the stage input: d floats a token, about a thirteenth of one
/// decoder layer's stash) or its whole stash (the peak limit) stops it, so w is larger with it.
class DynamicBatcher {
 public:
  /// @param cost               seconds and activation bytes of a micro-batch (stage_cost);
  ///                           its recompute functions make full recompute a choice
  /// @param stages             pipeline stages S, >= 1
  /// @param memory_limit_bytes bytes one micro-batch may keep on a stage from its forward to
  ///                           its backward, > 0 (DynaPipe's per-micro-batch limit: a rank's
  ///                           activation memory over the micro-batches it holds at once)
  /// @param options            recompute, peak limit, bounds
  /// @throws brigade::Error{InvalidArgument} for an empty cost function or a bad parameter
  DynamicBatcher(MicroBatchCost cost, int stages, double memory_limit_bytes,
                 DynamicOptions options = {})
      : cost_(std::move(cost)), stages_(stages), limit_(memory_limit_bytes), opt_(options) {
    BRIGADE_CHECK(cost_.seconds && cost_.activation_bytes, Errc::InvalidArgument,
                  "DynamicBatcher: the cost has no seconds or no activation_bytes function");
    BRIGADE_CHECK(stages >= 1 && memory_limit_bytes > 0.0 && options.max_bounds >= 1 &&
                      options.peak_limit_bytes > 0.0,
                  Errc::InvalidArgument,
                  "DynamicBatcher: {} stages, memory limit {} bytes, peak limit {} bytes, {} "
                  "bounds; expected >= 1, > 0, > 0, >= 1",
                  stages, memory_limit_bytes, options.peak_limit_bytes, options.max_bounds);
  }

  /// The micro-batches of solve(samples).
  [[nodiscard]] std::vector<MicroBatch> plan(std::span<const SampleLength> samples) const {
    return solve(samples).microbatches;
  }

  /// Runs the DP (see the class comment).
  /// @throws brigade::Error{InvalidArgument} for an empty input, a sample under 1 token, or a
  ///         sample whose micro-batch alone fits in no mode (naming the sample, its tokens, its
  ///         bytes and the limit; with recompute also its checkpoint, its peak and the peak
  ///         limit)
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
    const bool recompute = opt_.recompute && cost_.offers_recompute();
    // choices[i][k]: the range [i, i + k + 1) of the sorted samples in its mode, while it fits.
    std::vector<std::vector<MicroBatchChoice>> choices(static_cast<std::size_t>(n));
    std::vector<std::vector<double>> suffix_min(static_cast<std::size_t>(n));
    std::vector<double> all_times;
    double single_max = 0.0;
    all_times.reserve(static_cast<std::size_t>(n) * 16);
    for (std::int64_t i = 0; i < n; ++i) {
      auto& ci = choices[static_cast<std::size_t>(i)];
      ci.reserve(16);
      std::int64_t tokens = 0;
      double pairs = 0.0;
      for (std::int64_t j = i; j < n; ++j) {
        tokens += len(j);
        pairs += causal_pairs(len(j));
        const auto c = choose_recompute(cost_, varlen_work(tokens, j - i + 1, pairs), limit_, opt_);
        if (!c.fits) {
          if (j == i) fail_alone(samples[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])], c, recompute);
          break;
        }
        ci.push_back(c);
        all_times.push_back(c.seconds);
      }
      single_max = std::max(single_max, ci.front().seconds);
      // suffix_min[i][k]: the fastest of the ranges [i, i + k' + 1), k' >= k; a bound below it
      // ends the scan of i's ranges (at once where times grow with the range, as they do).
      auto& m = suffix_min[static_cast<std::size_t>(i)];
      m.resize(ci.size());
      for (std::size_t k = ci.size(); k-- > 0;)
        m[k] = k + 1 == ci.size() ? ci[k].seconds : std::min(ci[k].seconds, m[k + 1]);
    }
    std::sort(all_times.begin(), all_times.end());
    all_times.erase(std::unique(all_times.begin(), all_times.end()), all_times.end());
    std::vector<double> candidates;
    const int max_bounds = opt_.max_bounds;
    if (static_cast<std::int64_t>(all_times.size()) <= max_bounds) {
      candidates = all_times;
    } else {
      const auto lo = static_cast<std::int64_t>(
          std::lower_bound(all_times.begin(), all_times.end(), single_max) - all_times.begin());
      const auto hi = static_cast<std::int64_t>(all_times.size()) - 1;
      for (int q = 0; q < max_bounds; ++q) {
        const auto k = max_bounds == 1 ? hi : lo + (hi - lo) * q / (max_bounds - 1);
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
        const auto& ci = choices[static_cast<std::size_t>(i)];
        const auto& mi = suffix_min[static_cast<std::size_t>(i)];
        for (std::size_t k = 0; k < ci.size() && mi[k] <= bound; ++k) {
          const double t = ci[k].seconds;
          if (t > bound) continue;
          const auto j = static_cast<std::size_t>(i) + k + 1;
          if (fi + t < f[j]) {
            f[j] = fi + t;
            prev[j] = i;
            worst[j] = std::max(worst[static_cast<std::size_t>(i)], t);
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
      out.costs.push_back(choices[static_cast<std::size_t>(i)][static_cast<std::size_t>(j - i - 1)]);
    }
    out.iteration_seconds = predicted_iteration_seconds(out.costs.seconds, stages_);
    return out;
  }

  [[nodiscard]] int stages() const noexcept { return stages_; }
  [[nodiscard]] double memory_limit_bytes() const noexcept { return limit_; }
  [[nodiscard]] const DynamicOptions& options() const noexcept { return opt_; }

 private:
  [[noreturn]] void fail_alone(const SampleLength& s, const MicroBatchChoice& c,
                               bool recompute) const {
    if (!recompute)
      ::brigade::detail::fail(Errc::InvalidArgument,
                   "DynamicBatcher: sample {} ({} tokens) needs {} bytes of activations on a "
                   "stage as a micro-batch of its own, more than the micro-batch memory limit "
                   "of {} bytes",
                   s.index, s.tokens, c.activation_bytes, limit_);
    ::brigade::detail::fail(Errc::InvalidArgument,
                 "DynamicBatcher: sample {} ({} tokens) needs {} bytes of activations on a "
                 "stage as a micro-batch of its own, more than the micro-batch memory limit of "
                 "{} bytes, and does not fit with full recompute either: it keeps {} bytes "
                 "from its forward to its recompute (limit {} bytes) and peaks at {} bytes "
                 "(peak limit {} bytes)",
                 s.index, s.tokens, c.activation_bytes, limit_, c.checkpoint_bytes, limit_,
                 c.activation_bytes, opt_.peak_limit_bytes);
  }

  MicroBatchCost cost_;
  int stages_;
  double limit_;
  DynamicOptions opt_;
};

static_assert(Batcher<DynamicBatcher>);

}  // namespace v0
}  // namespace brigade::batching
