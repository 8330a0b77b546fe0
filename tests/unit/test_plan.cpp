// plan::Plan and the partition-policy table: one virtual stage -> rank map, lowered and
// validated schedules, per-micro-batch work, policies registered at run time.
#include <brigade/cost/cost_model.hpp>
#include <brigade/partition/policies.hpp>
#include <brigade/plan/plan.hpp>
#include <brigade/schedule/generators.hpp>
#include <brigade/schedule/lower.hpp>
#include <brigade/sim/simulator.hpp>

#include <doctest/doctest.h>

#include "test_util.hpp"

using brigade::test::rel;

using namespace brigade;
namespace sch = brigade::schedule;

namespace {

const model::ModelSpec& spec42() {
  static const model::ModelSpec spec(model::named_config("42M"));  // 8 decoder layers
  return spec;
}

/// A user's policy: every stage but the last gets one decoder layer, the last the rest.
partition::Partition front_light(const model::ModelSpec& spec, const partition::PolicyRequest& r) {
  const int N = r.num_stages();
  std::vector<int> bounds{0};
  for (int v = 1; v < N; ++v) bounds.push_back(1 + v);  // embedding + layer 0, then one each
  bounds.push_back(spec.num_layers());
  return partition::placed(partition::from_bounds(spec.num_layers(), bounds), r.placement,
                           r.num_ranks);
}

/// A broken policy: ignores the placement (every stage on rank 0).
partition::Partition ignores_placement(const model::ModelSpec& spec,
                                       const partition::PolicyRequest& r) {
  auto p = partition::uniform(spec, r.num_stages());
  std::vector<int> zeros(static_cast<std::size_t>(r.num_stages()), 0);
  return partition::placed(p, zeros, 1);
}

}  // namespace

TEST_CASE("plan.make_plan: the partition is the one placement, the schedule is lowered and "
          "validated") {
  plan::PlanRequest req;
  req.schedule = "zb-v";
  req.params = {3, 6, 2};
  req.partition = "uniform";
  const plan::Plan p = plan::make_plan(spec42(), req);
  const auto& sh = p.shape();
  CHECK(sh.num_virtual_stages == 6);
  for (int v = 0; v < 6; ++v) CHECK(sh.rank_of(v) == p.partition().stage(v).rank);
  CHECK(p.partition().stage(5).rank == 0);  // the V: 0 1 2 2 1 0
  CHECK(p.partition().stage(3).rank == 2);
  const auto expect = sch::lower(sch::zero_bubble_v({3, 6, 2}), p.partition());
  CHECK(p.schedule() == expect);
  CHECK(p.program(1).size() == expect.ranks[1].size());
  CHECK(p.work().empty());
  CHECK(p == plan::make_plan(spec42(), req));  // deterministic: every process agrees
  CHECK_THROWS_WITH_AS((void)p.program(3), doctest::Contains("rank 3 outside [0, 3)"), Error);
}

TEST_CASE("plan.Plan: disagreements between partition, schedule and work are refused") {
  const auto part2 = partition::uniform(spec42(), 2);
  CHECK_THROWS_WITH_AS(plan::Plan(part2, sch::one_f_one_b({3, 4})),
                       doctest::Contains("the partition has 2 stages on 2 ranks, the schedule 3 "
                                         "virtual stages on 3 ranks"),
                       Error);
  const auto placed = partition::placed(part2, std::vector<int>{0, 1}, 2);
  // A schedule (lowered or not) generated for another placement than the partition's.
  auto lowered = sch::lower(sch::one_f_one_b({2, 4}));
  const auto swapped = partition::placed(part2, std::vector<int>{1, 0}, 2);
  for (const auto& s : {lowered, sch::one_f_one_b({2, 4})})
    CHECK_THROWS_WITH_AS(plan::Plan(swapped, s),
                         doctest::Contains("places virtual stage 0 on rank 0, the partition on "
                                           "rank 1"),
                         Error);
  // Lowered or compute-only, the same plan.
  CHECK(plan::Plan(placed, lowered) == plan::Plan(placed, sch::one_f_one_b({2, 4})));
  CHECK_THROWS_WITH_AS(plan::Plan(placed, sch::one_f_one_b({2, 4}), {{8, 2, 4.0}}),
                       doctest::Contains("work for 1 micro-batches, the schedule has 4"), Error);
  std::vector<model::WorkItem> work(4, {8, 2, 4.0});
  work[2] = {3, 4, 1.0};
  CHECK_THROWS_WITH_AS(plan::Plan(placed, sch::one_f_one_b({2, 4}), work),
                       doctest::Contains("micro-batch 2 has 3 tokens in 4 sequences"), Error);
  // A schedule that would deadlock is refused by validate() when the plan is built.
  auto bad = lowered;
  std::swap(bad.ranks[1][0], bad.ranks[1][1]);
  CHECK_THROWS_AS(plan::Plan(placed, bad), Error);
}

TEST_CASE("plan.policies: a policy registered at run time is found by name and checked") {
  partition::register_policy({"front-light", "one decoder layer per stage but the last",
                              &front_light});
  CHECK(partition::policies().back().name == "front-light");
  plan::PlanRequest req;
  req.schedule = "1f1b";
  req.params = {3, 4};
  req.partition = "front-light";
  const plan::Plan p = plan::make_plan(spec42(), req);
  CHECK(p.partition().to_string() == "[0,2)@0 [2,3)@1 [3,12)@2");
  CHECK_THROWS_WITH_AS(partition::register_policy({"front-light", "again", &front_light}),
                       doctest::Contains("a partition called 'front-light' exists already"),
                       Error);
  CHECK_THROWS_WITH_AS(partition::register_policy({"null", "no function", nullptr}),
                       doctest::Contains("needs a name and a function"), Error);
  partition::register_policy({"ignores-placement", "broken", &ignores_placement});
  req.partition = "ignores-placement";
  CHECK_THROWS_WITH_AS((void)plan::make_plan(spec42(), req),
                       doctest::Contains("'ignores-placement' returned 3 stages of 12 layers on 1 "
                                         "ranks, asked for 3 stages of 12 layers on 3 ranks"),
                       Error);
  req.partition = "even";
  CHECK_THROWS_WITH_AS((void)plan::make_plan(spec42(), req),
                       doctest::Contains("unknown partition 'even', expected one of: uniform, "
                                         "balanced, front-light"),
                       Error);
}

TEST_CASE("plan.simulate: the simulator prices each micro-batch's own work") {
  // Two micro-batches, the second four times the tokens of the first: on one rank the makespan
  // is the sum of their forward times, and the second F costs about four times the first.
  plan::PlanRequest req;
  req.schedule = "gpipe";
  req.params = {1, 2};
  req.partition = "uniform";
  req.work = {{64, 1, 32.0}, {256, 4, 32.0}};
  const plan::Plan p = plan::make_plan(spec42(), req);
  cost::RooflineOptions ro;
  ro.rates = {1e12, 1e15};  // compute-bound: time follows FLOPs
  const cost::RooflineCostModel cm(spec42(), p, ro);
  CHECK(cm.work(1, 0).tokens == 256);
  CHECK(cm.work(0, 0).sequences == 1);
  const double f0 = cm.compute_seconds({sch::Op::F, 0, 0, 0});
  const double f1 = cm.compute_seconds({sch::Op::F, 0, 1, 0});
  CHECK(f1 / f0 == doctest::Approx(4.0).epsilon(0.02));
  const auto r = sim::simulate(p, cm);
  CHECK(r.makespan == rel(f0 + f1 + cm.compute_seconds({sch::Op::B, 0, 0, 0}) +
                          cm.compute_seconds({sch::Op::B, 0, 1, 0})));
  // The same plan without work prices every micro-batch alike.
  req.work.clear();
  const cost::RooflineCostModel same(spec42(), plan::make_plan(spec42(), req), ro);
  CHECK(same.compute_seconds({sch::Op::F, 0, 0, 0}) ==
        same.compute_seconds({sch::Op::F, 0, 1, 0}));
}
