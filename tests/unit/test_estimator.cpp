// cost::LatencyEstimator: priors from layer times, multiplicative corrections learned from
// measurements, their fallbacks, and observations read from a run's Timeline.
#include <brigade/cost/estimator.hpp>
#include <brigade/plan/plan.hpp>

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <cmath>
#include <limits>

using brigade::test::rel;

using namespace brigade;
using model::Phase;

namespace {

model::ModelSpec spec42() { return model::ModelSpec(model::named_config("42M")); }

/// A layer-time model with round numbers: every layer but the sampler costs tokens x 1 ms in
/// a forward or inference phase, 2 ms per token in a backward pass.
double toy(const model::ModelSpec& spec, int layer, const model::WorkItem& w, Phase phase) {
  if (spec.layer(layer).kind == model::LayerKind::Sampler) return 1.0;  // never counted
  const bool backward = phase == Phase::BackwardInput || phase == Phase::BackwardWeight;
  return static_cast<double>(w.tokens) * (backward ? 2e-3 : 1e-3);
}

}  // namespace

TEST_CASE("estimator.prior: the layers' times summed over the passes, the sampler left out") {
  const auto spec = spec42();  // 8 decoder layers: embedding 0, decoders 1-8, norm, head, sampler
  cost::LatencyEstimator est(spec, toy);
  const model::WorkItem w{16, 16, 100.0};
  CHECK(est.prior(0, 3, w, Phase::Decode) == rel(3 * 16e-3));
  CHECK(est.prior(9, spec.num_layers(), w, Phase::Decode) == rel(2 * 16e-3));
  CHECK(est.prior(1, 2, w, cost::Passes::backward()) == rel(2 * 32e-3));
  CHECK(est.predict(1, 2, w, Phase::Forward) == est.prior(1, 2, w, Phase::Forward));
  CHECK(est.correction(1, 2, Phase::Forward) == 0.0);
  CHECK_THROWS_WITH_AS((void)est.prior(3, 3, w, Phase::Decode),
                       doctest::Contains("layers [3, 3) of a model of 12"), Error);
}

TEST_CASE("estimator.observe: a measured ratio carries over to other work sizes, then to "
          "layers not yet seen with those passes") {
  const auto spec = spec42();
  cost::LatencyEstimator est(spec, toy, {0.25});
  // Layers [1, 5) measured 20% slower than their prior at 16 sequences...
  est.observe(1, 5, {16, 16, 100.0}, Phase::Decode, 1.2 * 4 * 16e-3);
  CHECK(est.correction(1, 5, Phase::Decode) == rel(std::log(1.2)));
  // ...are predicted 20% slower at 8.
  CHECK(est.predict(1, 5, {8, 8, 50.0}, Phase::Decode) == rel(1.2 * 4 * 8e-3));
  // Other layers with the same passes fall back to the mean over all decode observations.
  CHECK(est.predict(5, 9, {8, 8, 50.0}, Phase::Decode) == rel(1.2 * 4 * 8e-3));
  // Other passes are untouched.
  CHECK(est.predict(1, 5, {8, 8, 50.0}, Phase::Prefill) == rel(4 * 8e-3));
  // The first 1 / smoothing = 4 observations are averaged evenly, then a moving average.
  est.observe(1, 5, {16, 16, 100.0}, Phase::Decode, 0.8 * 4 * 16e-3);
  CHECK(est.correction(1, 5, Phase::Decode) ==
        rel((std::log(1.2) + std::log(0.8)) / 2));
  for (int i = 0; i < 2; ++i) est.observe(1, 5, {16, 16, 100.0}, Phase::Decode, 4 * 16e-3);
  const double mean4 = (std::log(1.2) + std::log(0.8)) / 4;
  CHECK(est.correction(1, 5, Phase::Decode) == rel(mean4));
  est.observe(1, 5, {16, 16, 100.0}, Phase::Decode, 2.0 * 4 * 16e-3);
  CHECK(est.correction(1, 5, Phase::Decode) ==
        rel(mean4 + 0.25 * (std::log(2.0) - mean4)));
  CHECK(est.observations() == 5);
  // Bad measurements are refused.
  CHECK_THROWS_WITH_AS(est.observe(1, 5, {16, 16, 1.0}, Phase::Decode, 0.0),
                       doctest::Contains("a measurement of 0 s"), Error);
  CHECK_THROWS_AS(est.observe(1, 5, {16, 16, 1.0}, Phase::Decode,
                              std::numeric_limits<double>::quiet_NaN()),
                  Error);
  CHECK_THROWS_WITH_AS(cost::LatencyEstimator(spec, toy, {0.0}),
                       doctest::Contains("smoothing = 0"), Error);
  CHECK_THROWS_AS(cost::LatencyEstimator(spec, model::LayerSeconds{}), Error);
}

TEST_CASE("estimator.timeline: a run's F, B, BI and BW intervals, priced with the plan's "
          "layers and work") {
  const auto spec = spec42();
  plan::PlanRequest req;
  req.schedule = "zb-h1";
  req.params = {2, 2, 1};
  req.partition = "uniform";
  req.work = {{256, 1, 128.0}, {64, 2, 16.0}};
  const plan::Plan p = plan::make_plan(spec, req);
  cost::LatencyEstimator est(spec, toy);
  // Every interval took 1.5x its prior: F, BI and BW each learn log 1.5.
  Timeline tl(2);
  double t = 0.0;
  for (int r = 0; r < 2; ++r)
    for (const auto& a : p.program(r)) {
      if (a.op != schedule::Op::F && a.op != schedule::Op::BI && a.op != schedule::Op::BW)
        continue;
      Interval iv;
      iv.rank = r;
      iv.op = a.op;
      iv.virtual_stage = a.virtual_stage;
      iv.microbatch = a.microbatch;
      iv.chunk = a.chunk;
      const auto& st = p.partition().stage(a.virtual_stage);
      const auto& w = req.work[static_cast<std::size_t>(a.microbatch)];
      const cost::Passes passes = a.op == schedule::Op::F    ? Phase::Forward
                                  : a.op == schedule::Op::BI ? Phase::BackwardInput
                                                             : Phase::BackwardWeight;
      iv.start = t;
      t += 1.5 * est.prior(st.first, st.last, w, passes);
      iv.end = t;
      tl.add(iv);
    }
  est.observe(p, tl);
  CHECK(est.observations() == 12);  // 2 stages x 2 micro-batches x (F, BI, BW)
  for (const auto& iv : tl.intervals()) {
    CHECK(est.predict(p, iv) == rel(iv.duration()));
    CHECK(est.prior(p, iv) == rel(iv.duration() / 1.5));
  }
  CHECK(est.correction(0, 5, Phase::BackwardWeight) == rel(std::log(1.5)));
  // A plan without per-micro-batch work cannot price its intervals.
  req.work.clear();
  CHECK_THROWS_WITH_AS(est.observe(plan::make_plan(spec, req), tl),
                       doctest::Contains("carries no per-micro-batch work"), Error);
}
