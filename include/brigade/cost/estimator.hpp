// brigade::cost::LatencyEstimator: stage latencies predicted from a layer-time model (a device
// profile) and refined online from what the executor measured. The estimator DynaPipe's latency
// predictor needs (Zhang et al., "DynaPipe", inference: per-stage latency predicted in real
// time), kept apart from the simulator's cost models so a serving loop can query and update it
// between rounds.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/core/timeline.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/layer_cost.hpp"
#include "brigade/plan/plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

namespace brigade::cost {
inline namespace v0 {

/// The passes a compute action runs: one phase, or the input and weight gradients together (a
/// full backward B).
class Passes {
 public:
  /// One phase.
  constexpr Passes(model::Phase phase) noexcept  // NOLINT(google-explicit-constructor)
      : mask_(bit(phase)) {}
  /// BackwardInput + BackwardWeight, the full backward B.
  static constexpr Passes backward() noexcept {
    Passes p(model::Phase::BackwardInput);
    p.mask_ |= bit(model::Phase::BackwardWeight);
    return p;
  }
  /// True when `phase` is one of them.
  [[nodiscard]] constexpr bool has(model::Phase phase) const noexcept {
    return (mask_ & bit(phase)) != 0;
  }
  /// A number per distinct set (a map key).
  [[nodiscard]] constexpr unsigned mask() const noexcept { return mask_; }
  friend constexpr bool operator==(Passes, Passes) noexcept = default;

 private:
  static constexpr unsigned bit(model::Phase p) noexcept { return 1u << static_cast<unsigned>(p); }
  unsigned mask_ = 0;
};

/// How fast LatencyEstimator follows new measurements.
struct EstimatorOptions {
  /// Weight of a new observation in the exponential moving average of log(measured / prior),
  /// in (0, 1]. The first 1 / smoothing observations of a key are averaged evenly (weight
  /// 1 / n), so a few measurements already correct the prior.
  double smoothing = 0.2;
};

/// Predicts the seconds of a stage's layers [first, last) for a WorkItem and its passes as
/// prior x exp(correction):
///
/// - prior: the sum over the layers and passes of `prior` (a model::LayerSeconds:
///   cost::ProfiledLayerTimes calibrated on the device's profile, or the roofline), the sampler
///   layer left out (the executor times SAMPLE apart from F);
/// - correction: an exponential moving average of log(measured / prior) over the observations
///   of the same layers and passes, or, for layers never observed with those passes, over all
///   observations of those passes, or 0 before any.
///
/// The correction is multiplicative, so it carries over between work sizes (a stage measured
/// 10% slower than its profile at 16 sequences is predicted 10% slower at 8), and the prior
/// keeps the shape of the cost in tokens and context. Not thread-safe: one owner updates it.
class LatencyEstimator {
 public:
  /// @throws brigade::Error{InvalidArgument} for an empty prior or smoothing outside (0, 1]
  LatencyEstimator(model::ModelSpec spec, model::LayerSeconds prior, EstimatorOptions options = {})
      : spec_(std::move(spec)), prior_(std::move(prior)), opt_(options) {
    BRIGADE_CHECK(static_cast<bool>(prior_), Errc::InvalidArgument,
                  "LatencyEstimator: the prior layer times are empty");
    BRIGADE_CHECK(opt_.smoothing > 0.0 && opt_.smoothing <= 1.0, Errc::InvalidArgument,
                  "LatencyEstimator: smoothing = {}, expected in (0, 1]", opt_.smoothing);
  }

  /// The prior seconds of layers [first, last) for `work` in `passes`.
  /// @throws brigade::Error{InvalidArgument} for a range outside the model
  [[nodiscard]] double prior(int first, int last, const model::WorkItem& work,
                             Passes passes) const {
    check_range(first, last);
    double t = 0.0;
    for (int l = first; l < last; ++l) {
      if (spec_.layer(l).kind == model::LayerKind::Sampler) continue;  // SAMPLE, not F
      for (auto ph : kPhases)
        if (passes.has(ph)) t += prior_(spec_, l, work, ph);
    }
    return t;
  }

  /// The refined prediction: prior(first, last, work, passes) x exp(correction).
  /// @throws brigade::Error{InvalidArgument} as prior()
  [[nodiscard]] double predict(int first, int last, const model::WorkItem& work,
                               Passes passes) const {
    return prior(first, last, work, passes) * std::exp(correction(first, last, passes));
  }

  /// log(measured / prior) as learned so far for these layers and passes (see the class
  /// comment for the fallbacks); 0 before any observation.
  [[nodiscard]] double correction(int first, int last, Passes passes) const {
    if (auto it = by_key_.find({first, last, passes.mask()}); it != by_key_.end())
      return it->second.mean;
    if (auto it = by_passes_.find(passes.mask()); it != by_passes_.end()) return it->second.mean;
    return 0.0;
  }

  /// Folds one measurement in: layers [first, last) took `seconds` for `work` in `passes`.
  /// Measurements whose prior is 0 carry no ratio and are ignored.
  /// @throws brigade::Error{InvalidArgument} for a range outside the model or seconds that are
  ///         not finite and > 0
  void observe(int first, int last, const model::WorkItem& work, Passes passes, double seconds) {
    BRIGADE_CHECK(seconds > 0.0 && std::isfinite(seconds), Errc::InvalidArgument,
                  "LatencyEstimator: a measurement of {} s, expected finite and > 0", seconds);
    const double p = prior(first, last, work, passes);
    if (!(p > 0.0)) return;
    const double x = std::log(seconds / p);
    by_key_[{first, last, passes.mask()}].add(x, opt_.smoothing);
    by_passes_[passes.mask()].add(x, opt_.smoothing);
    ++observations_;
  }

  /// Folds in every compute interval of a run of `plan` (F, B, BI, BW; an inference F is a
  /// prefill in round 0 and a decode after), each priced with its virtual stage's layers and
  /// its micro-batch's work (plan::action_work of plan.work()).
  /// @throws brigade::Error{InvalidArgument} if the plan carries no per-micro-batch work or
  ///         an interval names a virtual stage or micro-batch outside it
  void observe(const plan::Plan& plan, const Timeline& timeline) {
    for (const auto& iv : timeline.intervals()) {
      const auto what = action_of(plan, iv);
      if (what && iv.duration() > 0.0)
        observe(what->first, what->last, what->work, what->passes, iv.duration());
    }
  }

  /// The prior of interval `iv` of a run of `plan` (its layers, work and passes, as
  /// observe(plan, timeline) reads them); 0 for an interval that is not F, B, BI or BW.
  /// @throws brigade::Error{InvalidArgument} as observe(plan, timeline)
  [[nodiscard]] double prior(const plan::Plan& plan, const Interval& iv) const {
    const auto what = action_of(plan, iv);
    return what ? prior(what->first, what->last, what->work, what->passes) : 0.0;
  }

  /// The refined prediction of interval `iv` of a run of `plan` (its layers, work and
  /// passes, as observe(plan, timeline) reads them); 0 for an interval that is not F, B, BI or
  /// BW.
  /// @throws brigade::Error{InvalidArgument} as observe(plan, timeline)
  [[nodiscard]] double predict(const plan::Plan& plan, const Interval& iv) const {
    const auto what = action_of(plan, iv);
    return what ? predict(what->first, what->last, what->work, what->passes) : 0.0;
  }

  /// Measurements folded in so far.
  [[nodiscard]] std::int64_t observations() const noexcept { return observations_; }
  /// The model the estimator prices.
  [[nodiscard]] const model::ModelSpec& spec() const noexcept { return spec_; }

 private:
  static constexpr model::Phase kPhases[] = {model::Phase::Prefill, model::Phase::Decode,
                                             model::Phase::Forward, model::Phase::BackwardInput,
                                             model::Phase::BackwardWeight};
  struct Average {
    double mean = 0.0;
    std::int64_t n = 0;
    void add(double x, double smoothing) {
      ++n;
      const double w = std::max(smoothing, 1.0 / static_cast<double>(n));
      mean += w * (x - mean);
    }
  };
  struct What {
    int first, last;
    model::WorkItem work;
    Passes passes;
  };
  void check_range(int first, int last) const {
    BRIGADE_CHECK(first >= 0 && first < last && last <= spec_.num_layers(), Errc::InvalidArgument,
                  "LatencyEstimator: layers [{}, {}) of a model of {}", first, last,
                  spec_.num_layers());
  }
  static std::optional<What> action_of(const plan::Plan& plan, const Interval& iv) {
    using schedule::Op;
    if (iv.op != Op::F && iv.op != Op::B && iv.op != Op::BI && iv.op != Op::BW) return std::nullopt;
    const auto& sh = plan.shape();
    BRIGADE_CHECK(!plan.work().empty(), Errc::InvalidArgument,
                  "LatencyEstimator: the plan carries no per-micro-batch work");
    BRIGADE_CHECK(iv.virtual_stage >= 0 && iv.virtual_stage < sh.num_virtual_stages &&
                      iv.microbatch >= 0 && iv.microbatch < sh.num_microbatches,
                  Errc::InvalidArgument,
                  "LatencyEstimator: an interval of virtual stage {}, micro-batch {}; the plan "
                  "has {} and {}",
                  iv.virtual_stage, iv.microbatch, sh.num_virtual_stages, sh.num_microbatches);
    const auto& st = plan.partition().stage(iv.virtual_stage);
    const model::WorkItem w = plan::action_work(
        sh, plan.work()[static_cast<std::size_t>(iv.microbatch)], iv.chunk);
    const bool training = sh.mode == schedule::Mode::Training;
    Passes passes = model::Phase::Forward;
    switch (iv.op) {
      case Op::F:
        passes = training ? model::Phase::Forward
                          : (iv.chunk == 0 ? model::Phase::Prefill : model::Phase::Decode);
        break;
      case Op::B: passes = Passes::backward(); break;
      case Op::BI: passes = model::Phase::BackwardInput; break;
      default: passes = model::Phase::BackwardWeight; break;
    }
    return What{st.first, st.last, w, passes};
  }

  model::ModelSpec spec_;
  model::LayerSeconds prior_;
  EstimatorOptions opt_;
  std::map<std::tuple<int, int, unsigned>, Average> by_key_;
  std::map<unsigned, Average> by_passes_;
  std::int64_t observations_ = 0;
};

}  // namespace v0
}  // namespace brigade::cost
