// DynaPipe's online latency predictor for serving: each stage's seconds per micro-batch round,
// fitted online from the executor's measured F and SAMPLE times against the round's features,
// on top of the calibrated cost model's layer times (cost::LatencyEstimator's prior).
#pragma once

#include "brigade/core/timeline.hpp"
#include "brigade/cost/estimator.hpp"
#include "brigade/partition/partition.hpp"
#include "brigade/serve/serving.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace brigade::serve {
inline namespace v0 {

/// Predicts the seconds stage v spends on one micro-batch's round (its F, plus SAMPLE on the
/// stage holding the sampler) as w_v . x, with the features
///
///   x = [ prior of the round's decode tokens on v's layers,
///         prior of the round's prompt-chunk tokens on v's layers,
///         sequences sampled (when v holds the sampler; top-p sorts over the vocabulary) x 1 ms,
///         1 ms (fixed cost per round: launches, the per-row checks) ]
///
/// where the priors are cost::LatencyEstimator::prior (the calibrated layer times of a device
/// profile, or the roofline): so the layers v holds, the tokens, the sequences and their
/// context lengths enter through the cost model, and the fit learns how this machine, now,
/// departs from it. w_v is the weighted least-squares fit over the rounds observed so far, each
/// weighted 1 / seconds^2 (it minimises the squared relative error, the quantity MAPE reports),
/// with a ridge pull of `ridge` towards the prior's own answer w = [1, 1, 0, 0] (what it
/// predicts before any observation). DynaPipe (inference) predicts per-stage latency in real
/// time to drive its layer moves; this is that predictor for brigade's rounds. Not
/// thread-safe: one owner updates it between rounds.
class StageLatencyPredictor {
 public:
  static constexpr int kFeatures = 4;
  using Features = std::array<double, kFeatures>;

  /// @param estimator the calibrated cost model's estimator (its prior prices the layers)
  /// @param partition the stages' layer ranges
  /// @param ridge     pull towards the prior (dimensionless, relative to one observation)
  /// @throws brigade::Error{InvalidArgument} for a partition of another model or ridge < 0
  StageLatencyPredictor(cost::LatencyEstimator estimator, partition::Partition partition,
                        double ridge = 1e-3)
      : est_(std::move(estimator)), part_(std::move(partition)), ridge_(ridge),
        fits_(static_cast<std::size_t>(part_.num_stages())) {
    BRIGADE_CHECK(part_.num_layers() == est_.spec().num_layers(), Errc::InvalidArgument,
                  "StageLatencyPredictor: the partition covers {} layers, the model has {}",
                  part_.num_layers(), est_.spec().num_layers());
    BRIGADE_CHECK(ridge >= 0.0 && std::isfinite(ridge), Errc::InvalidArgument,
                  "StageLatencyPredictor: ridge = {}, expected >= 0", ridge);
  }

  /// The features of stage v for round `f` (see the class comment).
  /// @throws brigade::Error{InvalidArgument} for v outside the partition
  [[nodiscard]] Features features(int v, const RoundFeatures& f) const {
    return features(part_, v, f);
  }

  /// The features of stage v for round `f` when the stages hold the layers of `p` (a plan the
  /// rebalancer moves layers in: the fit stays, the layers priced change).
  /// @throws brigade::Error{InvalidArgument} for v outside the partition or a partition of
  ///         another model or stage count
  [[nodiscard]] Features features(const partition::Partition& p, int v,
                                  const RoundFeatures& f) const {
    BRIGADE_CHECK(v >= 0 && v < part_.num_stages() && p.num_stages() == part_.num_stages() &&
                      p.num_layers() == part_.num_layers(),
                  Errc::InvalidArgument,
                  "StageLatencyPredictor: stage {} of {} (a partition of {} stages and {} layers "
                  "for one of {} and {})",
                  v, part_.num_stages(), p.num_stages(), p.num_layers(), part_.num_stages(),
                  part_.num_layers());
    const auto& st = p.stage(v);
    Features x{0.0, 0.0, 0.0, 1e-3};
    if (f.decode_seqs > 0)
      x[0] = est_.prior(st.first, st.last, {f.decode_seqs, f.decode_seqs, f.decode_context},
                        model::Phase::Decode);
    if (f.prefill_tokens > 0)
      x[1] = est_.prior(st.first, st.last, {f.prefill_tokens, f.prefill_seqs, f.prefill_context},
                        model::Phase::Prefill);
    if (st.last == p.num_layers()) x[2] = 1e-3 * f.sampled;
    return x;
  }

  /// Predicted seconds of stage v on round `f`.
  [[nodiscard]] double predict(int v, const RoundFeatures& f) const { return predict(part_, v, f); }

  /// Predicted seconds of stage v on round `f` with the layers of `p` (features(p, v, f)),
  /// never below 0: a fit may weigh a feature negatively (the fixed cost and a near-constant
  /// prior trade off), and on a round outside the ones it learned from w . x can then fall under
  /// zero, which no stage's time does (the MPI serving tests met -1e-7 s in about one run in
  /// eight, and the simulator refuses a negative time).
  [[nodiscard]] double predict(const partition::Partition& p, int v, const RoundFeatures& f) const {
    const auto x = features(p, v, f);
    const auto& w = fits_[static_cast<std::size_t>(v)].w;
    double y = 0.0;
    for (int i = 0; i < kFeatures; ++i) y += w[static_cast<std::size_t>(i)] * x[static_cast<std::size_t>(i)];
    return std::max(0.0, y);
  }

  /// The prior alone (the calibrated cost model): x[0] + x[1].
  [[nodiscard]] double prior(int v, const RoundFeatures& f) const { return prior(part_, v, f); }

  /// The prior alone with the layers of `p`.
  [[nodiscard]] double prior(const partition::Partition& p, int v, const RoundFeatures& f) const {
    const auto x = features(p, v, f);
    return x[0] + x[1];
  }

  /// Folds in one measurement: stage v took `seconds` on round `f`; refits w_v.
  /// @throws brigade::Error{InvalidArgument} for seconds not finite and > 0, v outside
  void observe(int v, const RoundFeatures& f, double seconds) { observe(part_, v, f, seconds); }

  /// Folds in one measurement of a round that ran with the layers of `p`.
  /// @throws brigade::Error{InvalidArgument} as observe() and features(p, v, f)
  void observe(const partition::Partition& p, int v, const RoundFeatures& f, double seconds) {
    BRIGADE_CHECK(seconds > 0.0 && std::isfinite(seconds), Errc::InvalidArgument,
                  "StageLatencyPredictor: a measurement of {} s, expected finite and > 0",
                  seconds);
    const auto x = features(p, v, f);
    auto& fit = fits_[static_cast<std::size_t>(v)];
    const double wgt = 1.0 / (seconds * seconds);
    for (std::size_t i = 0; i < kFeatures; ++i) {
      fit.b[i] += wgt * x[i] * seconds;
      for (std::size_t j = 0; j < kFeatures; ++j) fit.a[i][j] += wgt * x[i] * x[j];
    }
    ++fit.n;
    fit.solve(ridge_);
  }

  /// Observations of stage v so far.
  [[nodiscard]] std::int64_t observations(int v) const {
    return fits_[static_cast<std::size_t>(v)].n;
  }
  /// The current weights of stage v.
  [[nodiscard]] const Features& weights(int v) const {
    return fits_[static_cast<std::size_t>(v)].w;
  }
  [[nodiscard]] const partition::Partition& partition() const noexcept { return part_; }

 private:
  struct Fit {
    std::array<std::array<double, kFeatures>, kFeatures> a{};  // sum w x x^T
    Features b{};                                              // sum w x y
    Features w{1.0, 1.0, 0.0, 0.0};
    std::int64_t n = 0;
    // (A + r I_scaled) w = b + r I_scaled w0 by Gaussian elimination with partial pivoting; the
    // ridge is scaled by A's mean diagonal, so `ridge` is relative to the data.
    void solve(double ridge) {
      constexpr Features w0{1.0, 1.0, 0.0, 0.0};
      double diag = 0.0;
      for (int i = 0; i < kFeatures; ++i) diag += a[static_cast<std::size_t>(i)][static_cast<std::size_t>(i)];
      const double r = ridge * std::max(diag / kFeatures, 1e-300);
      std::array<std::array<double, kFeatures + 1>, kFeatures> m{};
      for (std::size_t i = 0; i < kFeatures; ++i) {
        for (std::size_t j = 0; j < kFeatures; ++j) m[i][j] = a[i][j] + (i == j ? r : 0.0);
        m[i][kFeatures] = b[i] + r * w0[i];
      }
      for (std::size_t c = 0; c < kFeatures; ++c) {
        std::size_t p = c;
        for (std::size_t i = c + 1; i < kFeatures; ++i)
          if (std::abs(m[i][c]) > std::abs(m[p][c])) p = i;
        if (!(std::abs(m[p][c]) > 0.0)) return;  // singular: keep the last weights
        std::swap(m[c], m[p]);
        for (std::size_t i = 0; i < kFeatures; ++i) {
          if (i == c) continue;
          const double k = m[i][c] / m[c][c];
          for (std::size_t j = c; j <= kFeatures; ++j) m[i][j] -= k * m[c][j];
        }
      }
      for (std::size_t i = 0; i < kFeatures; ++i) w[i] = m[i][kFeatures] / m[i][i];
    }
  };
  cost::LatencyEstimator est_;
  partition::Partition part_;
  double ridge_;
  std::vector<Fit> fits_;
};

/// Measured seconds of every stage on every round of a serving run: for each (virtual stage,
/// micro-batch, round) with an F interval in `timeline`, its F seconds plus the SAMPLE seconds
/// of the same round; keyed by (stage, index into report.round_features), in the order the
/// first stage built the rounds.
struct StageRound {
  int stage = 0;
  std::size_t round = 0;  ///< index into ServeReport::round_features
  double seconds = 0.0;
};

/// The (stage, round) measurements of `report` (see StageRound).
inline std::vector<StageRound> stage_rounds(const ServeReport& report) {
  std::map<std::pair<int, int>, std::size_t> index;  // (micro-batch, round) -> feature
  for (std::size_t i = 0; i < report.round_features.size(); ++i)
    index[{report.round_features[i].microbatch, report.round_features[i].round}] = i;
  std::map<std::pair<std::size_t, int>, double> secs;  // (feature, stage) -> seconds
  for (const auto& iv : report.timeline.intervals()) {
    if (iv.op != Op::F && iv.op != Op::Sample) continue;
    const auto it = index.find({iv.microbatch, iv.chunk});
    if (it == index.end()) continue;
    secs[{it->second, iv.virtual_stage}] += iv.duration();
  }
  std::vector<StageRound> out;
  for (const auto& [key, s] : secs)
    if (s > 0.0) out.push_back({key.second, key.first, s});
  return out;
}

/// How well the predictor did on a run, per stage.
struct PredictorError {
  int stage = 0;
  std::int64_t rounds = 0;   ///< rounds measured on the stage
  /// Mean absolute percentage error of the predictions made online (each round predicted from
  /// the rounds before it, then observed), after the first `warmup` rounds.
  double online_mape = 0.0;
  /// MAPE on the held-out last (1 - train_fraction) of the rounds with the fit frozen after the
  /// first train_fraction.
  double heldout_mape = 0.0;
  /// MAPE of the calibrated cost model alone (the prior, no fit) on the same held-out rounds.
  double prior_heldout_mape = 0.0;
};

/// Replays `report`'s rounds through a fresh predictor in the order they were built and
/// returns each stage's errors (PredictorError).
/// @throws brigade::Error{InvalidArgument} for train_fraction outside (0, 1), warmup < 0
inline std::vector<PredictorError> evaluate_predictor(const ServeReport& report,
                                                      const StageLatencyPredictor& fresh,
                                                      double train_fraction = 0.7,
                                                      int warmup = 10) {
  BRIGADE_CHECK(train_fraction > 0.0 && train_fraction < 1.0 && warmup >= 0,
                Errc::InvalidArgument,
                "evaluate_predictor: train_fraction {} (in (0, 1)), warmup {} (>= 0)",
                train_fraction, warmup);
  const auto rounds = stage_rounds(report);
  const int S = fresh.partition().num_stages();
  std::vector<std::vector<StageRound>> per(static_cast<std::size_t>(S));
  for (const auto& r : rounds) per[static_cast<std::size_t>(r.stage)].push_back(r);
  std::vector<PredictorError> out;
  for (int v = 0; v < S; ++v) {
    auto& rs = per[static_cast<std::size_t>(v)];
    std::sort(rs.begin(), rs.end(), [](auto& a, auto& b) { return a.round < b.round; });
    PredictorError e;
    e.stage = v;
    e.rounds = static_cast<std::int64_t>(rs.size());
    StageLatencyPredictor online = fresh, frozen = fresh;
    const auto split = static_cast<std::size_t>(train_fraction * static_cast<double>(rs.size()));
    double on = 0, held = 0, prior = 0;
    std::int64_t n_on = 0, n_held = 0;
    for (std::size_t i = 0; i < rs.size(); ++i) {
      const auto& f = report.round_features[rs[i].round];
      // The layers the stages held in that round (a rebalanced run changes them).
      const auto& plan = report.plans.empty() ? fresh.partition() : report.plan_at(f.round);
      const double y = rs[i].seconds;
      if (static_cast<int>(i) >= warmup) {
        on += std::abs(online.predict(plan, v, f) - y) / y;
        ++n_on;
      }
      online.observe(plan, v, f, y);
      if (i < split) {
        frozen.observe(plan, v, f, y);
      } else {
        held += std::abs(frozen.predict(plan, v, f) - y) / y;
        prior += std::abs(frozen.prior(plan, v, f) - y) / y;
        ++n_held;
      }
    }
    e.online_mape = n_on ? on / static_cast<double>(n_on) : 0.0;
    e.heldout_mape = n_held ? held / static_cast<double>(n_held) : 0.0;
    e.prior_heldout_mape = n_held ? prior / static_cast<double>(n_held) : 0.0;
    out.push_back(e);
  }
  return out;
}

}  // namespace v0
}  // namespace brigade::serve
