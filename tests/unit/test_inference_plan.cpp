// plan::inference_plans: the candidates, their predicted times in closed form, the pick.
#include "brigade/plan/inference_plan.hpp"
#include "brigade/cost/profiled.hpp"
#include "brigade/core/error.hpp"
#include "brigade/model/config.hpp"

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <limits>

using brigade::test::rel;

using namespace brigade;

namespace {

model::ModelSpec spec42m() { return model::ModelSpec(model::named_config("42M")); }

/// A profile with no overheads: products at `flops` on one thread and `flops2` on two (every
/// row count and product), one core streaming `core_bw`, both `box_bw`, free attention and
/// hand-over.
cost::DeviceProfile bare(double flops, double core_bw, double box_bw, double flops2 = 0.0) {
  using model::Phase;
  cost::DeviceProfile p;
  p.name = "bare";
  p.kind = "cpu";
  p.source = "test";
  p.dtype = "f32";
  p.cores = 2;
  for (auto product : {Phase::Forward, Phase::BackwardInput, Phase::BackwardWeight})
    for (int t : {1, 2}) p.gemm.push_back({product, 1, t, t == 1 ? flops : (flops2 > 0 ? flops2 : 2 * flops)});
  for (auto phase : {Phase::Decode, Phase::Forward, Phase::BackwardInput})
    p.attention.push_back({phase, 1, 64, 1e-15});
  p.core_bytes_per_s = core_bw;
  p.memory_bytes_per_s = box_bw;
  p.memory_capacity_bytes = 1e12;
  p.disk_bytes_per_s = 1e9;
  p.links = {{"in-process", 0.0, 1e12}};
  return p;
}

}  // namespace

TEST_CASE("plan.inference_plans: 1 stage x 1 thread, 1 micro-batch is the layers' profiled sum") {
  const auto spec = spec42m();
  const plan::InferenceWorkload wl{4, 8, 16};
  auto prof = bare(40e9, 20e9, 30e9);
  prof.links[0].latency_s = 5e-6;  // the hand-over, once per stage and micro-batch
  const auto plans = plan::inference_plans(spec, wl, prof);
  const plan::InferencePlan* p = nullptr;
  for (const auto& c : plans)
    if (c.stages == 1 && c.threads == 1 && c.microbatches == 1) p = &c;
  REQUIRE(p != nullptr);
  const cost::ProfiledLayerTimes times(prof);
  double round = 5e-6, prefill = 5e-6;
  for (int l = 0; l < spec.num_layers(); ++l) {
    round += times(spec, l, {4, 4, 8 + 16 / 2.0}, model::Phase::Decode);
    prefill += times(spec, l, {32, 4, 4.0}, model::Phase::Prefill);
  }
  CHECK(p->decode_round_s == rel(round, 1e-12));
  CHECK(p->prefill_s == rel(prefill, 1e-12));
  CHECK(p->tokens_per_s == doctest::Approx(4.0 * 16 / (prefill + 16 * round)).epsilon(1e-12));
  CHECK(p->bounds == std::vector<int>{0, spec.num_layers()});
  CHECK(p->describe(4) == "1 stage x 1 thread, 1 micro-batch of 4");
}

TEST_CASE("plan.inference_plans: candidates, order, and partitions") {
  const auto spec = spec42m();
  const auto plans = plan::inference_plans(spec, {32, 1, 48}, bare(40e9, 20e9, 30e9));
  // S = 1: T in {1, 2} x G in 1..4; S = 2: T = 1 x G in 1..8.
  CHECK(plans.size() == 16);
  for (std::size_t i = 1; i < plans.size(); ++i)
    CHECK(plans[i - 1].tokens_per_s >= plans[i].tokens_per_s);
  for (const auto& p : plans) {
    CHECK(p.stages * p.threads <= 2);
    CHECK(p.microbatches <= std::min(32, 4 * p.stages));
    const auto part = p.partition(spec.num_layers());
    CHECK(part.num_stages() == p.stages);
  }
  // One sequence: never more micro-batches than sequences.
  for (const auto& p : plan::inference_plans(spec, {1, 1, 8}, bare(40e9, 20e9, 30e9)))
    CHECK(p.microbatches == 1);
}

TEST_CASE("plan.inference_plans: a shared memory bus makes one stream of few reads the pick") {
  // Memory-bound (FLOPs free) and a bus no faster for two cores than for one: every extra
  // micro-batch re-reads the weights and a second core adds nothing, so 1 x 1, one micro-batch.
  const auto spec = spec42m();
  auto prof = bare(1e15, 20e9, 20e9);
  prof.links[0].latency_s = 1e-6;
  const auto best = plan::best_inference_plan(spec, {32, 1, 48}, prof);
  CHECK(best.stages == 1);
  CHECK(best.threads == 1);
  CHECK(best.microbatches == 1);
}

TEST_CASE("plan.inference_plans: compute-bound, two threads twice as fast: 1 stage x 2 threads") {
  // Bandwidth free: two threads halve every layer exactly; two stages cannot beat that (their
  // split is uneven and a micro-batch's tokens cross both stages in turn).
  const auto spec = spec42m();
  const auto plans = plan::inference_plans(spec, {32, 1, 48}, bare(40e9, 1e15, 1e15));
  CHECK(plans.front().stages == 1);
  CHECK(plans.front().threads == 2);
  CHECK(plans.front().microbatches == 1);
  const plan::InferencePlan* one = nullptr;
  for (const auto& c : plans)
    if (c.stages == 1 && c.threads == 1 && c.microbatches == 1) one = &c;
  REQUIRE(one != nullptr);
  CHECK(plans.front().tokens_per_s == doctest::Approx(2.0 * one->tokens_per_s).epsilon(1e-6));
}

TEST_CASE("plan.inference_plans: intra-op threads that add no FLOPs lose to two stages") {
  // The 2-thread products run no faster than the 1-thread ones (a fork/join that eats the
  // gain, as on a loaded machine): the second core is worth a stage, not a thread.
  const auto spec = spec42m();
  const auto best = plan::best_inference_plan(spec, {32, 1, 48}, bare(40e9, 1e15, 1e15, 40e9));
  CHECK(best.stages == 2);
  CHECK(best.threads == 1);
  CHECK(best.microbatches >= 2);
}

TEST_CASE("plan.inference_plans: fewer micro-batches than stages wait on the token round trip") {
  // Two stages, one micro-batch: a round is the sum of the stages (the second idles while the
  // first works and back); two micro-batches overlap, and the slowest stage paces the round.
  const auto spec = spec42m();
  const auto plans = plan::inference_plans(spec, {8, 1, 8}, bare(40e9, 20e9, 40e9));
  const plan::InferencePlan *g1 = nullptr, *g2 = nullptr;
  for (const auto& c : plans) {
    if (c.stages == 2 && c.microbatches == 1) g1 = &c;
    if (c.stages == 2 && c.microbatches == 2) g2 = &c;
  }
  REQUIRE(g1 != nullptr);
  REQUIRE(g2 != nullptr);
  CHECK(g2->decode_round_s < g1->decode_round_s);
}

TEST_CASE("plan.inference_plans: bad workloads and profiles are refused") {
  const auto spec = spec42m();
  const auto r = bare(40e9, 20e9, 30e9);
  CHECK_THROWS_AS(plan::inference_plans(spec, {0, 1, 8}, r), Error);
  CHECK_THROWS_AS(plan::inference_plans(spec, {4, 0, 8}, r), Error);
  CHECK_THROWS_AS(plan::inference_plans(spec, {4, 1, 0}, r), Error);
  CHECK_THROWS_WITH_AS(plan::inference_plans(spec, {4, 1, 8}, r, -1),
                       doctest::Contains("cores = -1"), Error);
  auto bad = r;
  bad.memory_bytes_per_s = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_WITH_AS(plan::inference_plans(spec, {4, 1, 8}, bad),
                       doctest::Contains("memory_bytes_per_s"), Error);
  bad = r;
  bad.gemm[0].flops_per_s = 0.0;
  CHECK_THROWS_WITH_AS(plan::inference_plans(spec, {4, 1, 8}, bad),
                       doctest::Contains("gemm[0].flops_per_s"), Error);
  // One core: one candidate family only (1 stage x 1 thread).
  for (const auto& p : plan::inference_plans(spec, {4, 1, 8}, r, 1)) {
    CHECK(p.stages == 1);
    CHECK(p.threads == 1);
  }
}
