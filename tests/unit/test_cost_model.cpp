// Cost models: the CostModel concept, the unit model's conventions and the roofline model's
// derivation from model::layer_cost.
#include <brigade/cost/cost_model.hpp>
#include <brigade/schedule.hpp>
#include <brigade/sim/simulator.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <string>

namespace sch = brigade::schedule;
namespace model = brigade::model;
using brigade::Errc;
using brigade::Error;
using brigade::cost::CostModel;
using brigade::cost::Link;
using brigade::cost::RooflineCostModel;
using brigade::cost::RooflineOptions;
using brigade::cost::UnitCostModel;
using sch::Op;

namespace {

// Archetypes for the concept's negative checks.
struct NoLink {
  double compute_seconds(const sch::Action&) const { return 0; }
  double activation_bytes(const sch::Action&) const { return 0; }
  double message_bytes(const sch::Action&) const { return 0; }
};
struct StringTimes {
  std::string compute_seconds(const sch::Action&) const { return ""; }
  double activation_bytes(const sch::Action&) const { return 0; }
  double message_bytes(const sch::Action&) const { return 0; }
  Link link(int, int) const { return {}; }
};
struct Minimal {
  double compute_seconds(const sch::Action&) const { return 1; }
  double activation_bytes(const sch::Action&) const { return 0; }
  double message_bytes(const sch::Action&) const { return 0; }
  Link link(int, int) const { return {}; }
};

static_assert(CostModel<UnitCostModel>);
static_assert(CostModel<RooflineCostModel>);
static_assert(CostModel<Minimal>);
static_assert(!CostModel<NoLink>, "a cost model must say what its links cost");
static_assert(!CostModel<StringTimes>, "compute_seconds must return seconds");

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    CHECK(e.code() == Errc::InvalidArgument);
    return e.what();
  }
  FAIL("expected a brigade::Error");
  return {};
}

}  // namespace

TEST_CASE("cost.concept: any model of CostModel drives the simulator") {
  const auto s = sch::lower(sch::gpipe({2, 2}));
  const auto r = brigade::sim::simulate(s, Minimal{});
  CHECK(r.makespan == doctest::Approx(6.0));  // every compute action 1 s: (M + P - 1)(F + B)
}

TEST_CASE("cost.unit: conventions and refusals") {
  const auto shape = sch::Shape::make(2, 4);
  const UnitCostModel u(shape, 1.0, 2.0);
  CHECK(u.compute_seconds({Op::F, 0, 0, 0}) == 1.0);
  CHECK(u.compute_seconds({Op::Recompute, 0, 0, 0}) == 1.0);
  CHECK(u.compute_seconds({Op::B, 0, 0, 0}) == 2.0);
  CHECK(u.compute_seconds({Op::BI, 0, 0, 0}) == 1.0);
  CHECK(u.compute_seconds({Op::BW, 0, 0, 0}) == 1.0);
  CHECK(u.compute_seconds({Op::Opt, 0, 0, 0}) == 0.0);
  CHECK(u.compute_seconds({Op::SendF, 0, 0, 0}) == 0.0);
  CHECK(u.activation_bytes({Op::F, 1, 0, 0}) == 1.0);
  CHECK(u.link(0, 1).is_free());
  CHECK(contains(error_of([&] { UnitCostModel bad(shape, -1.0, 2.0); }), "F=-1"));
  CHECK(contains(error_of([&] { UnitCostModel bad(shape, 1.0, 2.0, std::nan("")); }),
                 "expected finite and >= 0"));
  brigade::cost::UnitCostOptions o;
  o.link.bytes_per_s = 0.0;
  CHECK(contains(error_of([&] { UnitCostModel bad(shape, 1.0, 2.0, std::nullopt, o); }),
                 "bandwidth 0 bytes/s"));
}

TEST_CASE("cost.roofline.110M.p4: each action sums layer_cost rooflines over its stage") {
  const model::ModelSpec spec(model::named_config("110M"));
  const auto shape = sch::Shape::make(4, 8);
  const auto part = RooflineCostModel::placed_uniform(spec, shape);
  RooflineOptions opt;
  opt.workload = {2, 128};
  const RooflineCostModel rc(spec, part, shape, opt);
  // Stage 1 holds decoder layers only: F = sum of their rooflines for 256 tokens.
  const model::WorkItem w{256, 2, 64.0};
  double expect = 0.0;
  for (int l = part.stage(1).first; l < part.stage(1).last; ++l)
    expect += model::roofline_seconds(model::layer_cost(spec, l, w), opt.rates);
  CHECK(rc.compute_seconds({Op::F, 1, 0, 0}) == doctest::Approx(expect));
  CHECK(rc.compute_seconds({Op::B, 1, 0, 0}) == doctest::Approx(2 * expect));
  CHECK(rc.compute_seconds({Op::BI, 1, 0, 0}) + rc.compute_seconds({Op::BW, 1, 0, 0}) ==
        doctest::Approx(rc.compute_seconds({Op::B, 1, 0, 0})));
  CHECK(rc.message_bytes({Op::SendF, 1, 0, 0}) == doctest::Approx(256.0 * 768 * 4));
  CHECK(rc.activation_bytes({Op::F, 1, 0, 0}) > 0.0);
  // The tail stage carries the LM head: slower than a decoder-only stage of the same size.
  CHECK(rc.compute_seconds({Op::F, 3, 0, 0}) > rc.compute_seconds({Op::F, 2, 0, 0}));
  CHECK(rc.link(0, 1).latency_s == doctest::Approx(5e-6));
  // Simulating with it gives a positive, finite makespan and a bubble in (0, 1).
  const auto r = brigade::sim::simulate(sch::lower(sch::one_f_one_b({4, 8})), rc);
  CHECK(r.makespan > 0.0);
  CHECK(r.bubble_ratio > 0.0);
  CHECK(r.bubble_ratio < 1.0);
  CHECK(r.peak_activation_bytes[0] > r.peak_activation_bytes[3]);
}

TEST_CASE("cost.roofline.260K.inference: prefill costs more than a decode step, tokens are small") {
  const model::ModelSpec spec(model::named_config("260K"));
  const auto s = sch::inference({2, 2, 1, 3});
  const auto part = RooflineCostModel::placed_uniform(spec, s.shape);
  const RooflineCostModel rc(spec, part, s.shape);
  CHECK(rc.work(0, 0).tokens == 256);
  CHECK(rc.work(0, 2).tokens == 1);
  CHECK(rc.work(0, 2).context == doctest::Approx(258.0));
  CHECK(rc.compute_seconds({Op::F, 0, 0, 0}) > rc.compute_seconds({Op::F, 0, 0, 1}));
  CHECK(rc.compute_seconds({Op::Sample, 1, 0, 1}) > 0.0);
  CHECK(rc.message_bytes({Op::SendF, 1, 0, 0}) == doctest::Approx(4.0));  // one token id
  CHECK(rc.activation_bytes({Op::F, 0, 0, 0}) == 0.0);
  const auto r = brigade::sim::simulate(sch::lower(s), rc);
  CHECK(r.makespan > 0.0);
}

TEST_CASE("cost.roofline: refusals name the mismatch") {
  const model::ModelSpec spec(model::named_config("260K"));
  const auto shape = sch::Shape::make(2, 4, 2);
  // A partition with stage i on rank i does not match the round-robin placement 0,1,0,1.
  const auto plain = brigade::partition::uniform(spec, 2);
  CHECK(contains(error_of([&] { RooflineCostModel rc(spec, plain, shape); }),
                 "partition has 2 stages on 2 ranks, the shape 4 virtual stages on 2 ranks"));
  RooflineOptions opt;
  opt.workload.batch = 0;
  const auto part = RooflineCostModel::placed_uniform(spec, shape);
  CHECK(contains(error_of([&] { RooflineCostModel rc(spec, part, shape, opt); }), "batch 0"));
  opt.workload.batch = 1;
  opt.rank_rates.resize(3);
  CHECK(contains(error_of([&] { RooflineCostModel rc(spec, part, shape, opt); }),
                 "3 rank rates for 2 ranks"));
  CHECK_THROWS_AS((void)RooflineCostModel::placed_uniform(spec, sch::Shape::make(4, 1, 2)), Error);
}
