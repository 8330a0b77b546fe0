// Cost models: the CostModel concept, the unit model's conventions and the roofline model's
// derivation from model::layer_cost.
#include <brigade/cost/cost_model.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/runtime/train_stage.hpp>
#include <brigade/schedule.hpp>
#include <brigade/sim/simulator.hpp>

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <cmath>
#include <string>

using brigade::test::rel;

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
  CHECK(rc.compute_seconds({Op::F, 1, 0, 0}) == rel(expect));
  CHECK(rc.compute_seconds({Op::B, 1, 0, 0}) == rel(2 * expect));
  CHECK(rc.compute_seconds({Op::BI, 1, 0, 0}) + rc.compute_seconds({Op::BW, 1, 0, 0}) ==
        rel(rc.compute_seconds({Op::B, 1, 0, 0})));
  CHECK(rc.message_bytes({Op::SendF, 1, 0, 0}) == doctest::Approx(256.0 * 768 * 4));
  // A 16-bit pipeline dtype halves every activation and gradient message.
  auto half = opt;
  half.pipeline_dtype = brigade::DType::BF16;
  const RooflineCostModel rc16(spec, part, shape, half);
  CHECK(rc16.message_bytes({Op::SendF, 1, 0, 0}) == doctest::Approx(256.0 * 768 * 2));
  CHECK(rc16.message_bytes({Op::SendB, 2, 0, 0}) == doctest::Approx(256.0 * 768 * 2));
  // Memory: training_stash() of the stage for 256 tokens in 2 sequences, changed by BI.
  const auto stash = brigade::cost::training_stash(spec, part.stage(1), 256, 2);
  CHECK(rc.activation_bytes({Op::F, 1, 0, 0}) == stash.forward);
  CHECK(rc.activation_bytes({Op::BI, 1, 0, 0}) == stash.backward_input);
  CHECK(rc.activation_bytes({Op::BW, 1, 0, 0}) == 0.0);
  CHECK(rc.activation_bytes({Op::B, 1, 0, 0}) == 0.0);
  // The tail stage carries the LM head: slower than a decoder-only stage of the same size.
  CHECK(rc.compute_seconds({Op::F, 3, 0, 0}) > rc.compute_seconds({Op::F, 2, 0, 0}));
  CHECK(rc.link(0, 1).latency_s == rel(5e-6));
  // Simulating with it gives a positive, finite makespan and a bubble in (0, 1).
  const auto r = brigade::sim::simulate(sch::lower(sch::one_f_one_b({4, 8})), rc);
  CHECK(r.makespan > 0.0);
  CHECK(r.bubble_ratio > 0.0);
  CHECK(r.bubble_ratio < 1.0);
  CHECK(r.peak_memory_bytes[0] > r.peak_memory_bytes[3]);
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
                 "RooflineCostModel: the partition has 2 stages on 2 ranks, the schedule 4 "
                 "virtual stages on 2 ranks"));
  RooflineOptions opt;
  opt.workload.batch = 0;
  const auto part = RooflineCostModel::placed_uniform(spec, shape);
  CHECK(contains(error_of([&] { RooflineCostModel rc(spec, part, shape, opt); }), "batch 0"));
  opt.workload.batch = 1;
  opt.rank_rates.resize(3);
  CHECK(contains(error_of([&] { RooflineCostModel rc(spec, part, shape, opt); }),
                 "3 rank rates for 2 ranks"));
  opt.rank_rates.clear();
  opt.pipeline_dtype = brigade::DType::Q8_0;
  CHECK(contains(error_of([&] { RooflineCostModel rc(spec, part, shape, opt); }),
                 "pipeline dtype q8_0"));
  CHECK_THROWS_AS((void)RooflineCostModel::placed_uniform(spec, sch::Shape::make(4, 1, 2)), Error);
}

// What our kernels keep (FlashAttention-2: the log-sum-exp, not the probabilities), per token.
TEST_CASE("cost.training-stash: the per-token formula, and what a TrainStage holds, to the byte") {
  const auto cfg = model::named_config("260K");
  const model::ModelSpec spec(cfg);
  const double d = cfg.dim, kv = cfg.kv_dim(), f = cfg.hidden_dim, H = cfg.n_heads,
               V = cfg.vocab_size;
  // Two decoder layers, 100 tokens in 3 sequences.
  const auto two = brigade::cost::training_stash(spec, {0, 1, 3}, 100, 3);
  const double index = 100 * 4.0 + 4 * 8.0;
  CHECK(two.forward == 2 * (100 * (6 * d + 2 * kv + 2 * f + H + 2) * 4 + index));
  CHECK(two.backward_input == 2 * ((100 * (6 * d + 2 * kv + 3 * f) + 2 * d) * 4 + index));
  // The tail (norm, head, loss, sampler): dim + vocab floats per token, plus the head's dx.
  const int n = spec.num_layers();
  const auto tail = brigade::cost::training_stash(spec, {0, cfg.n_layers + 1, n}, 100, 3);
  CHECK(tail.forward == (100 * (2 * d + V) + d) * 4);
  CHECK(tail.backward_input == (100 * (d + V) + d) * 4);
  // The embedding keeps its output gradient from BI to BW.
  const auto emb = brigade::cost::training_stash(spec, {0, 0, 1}, 100, 3);
  CHECK(emb.forward == 0.0);
  CHECK(emb.backward_input == 100 * d * 4);

  // A real stage of layers [1, 3) (decoders 0 and 1) holds exactly that, plus its output (after
  // F, until released) and its input gradient (after BI, until released).
  const auto w = model::make_synthetic_weights(cfg, 7);
  brigade::runtime::TrainStage<> stage(w, {0, 1, 3});
  brigade::data::PackedBatch b;
  for (int i = 0; i < 100; ++i) {
    b.inputs.push_back(i % cfg.vocab_size);
    b.targets.push_back((i + 1) % cfg.vocab_size);
  }
  b.offsets = {0, 30, 70, 100};
  std::vector<float> x(static_cast<std::size_t>(100 * cfg.dim), 0.01f), dy = x;
  CHECK(stage.held_bytes() == 0);
  stage.forward(0, b, x.data(), 100.0);
  const double message = 100 * d * 4;
  CHECK(static_cast<double>(stage.held_bytes()) == two.forward + message);
  stage.release_output(0);
  CHECK(static_cast<double>(stage.held_bytes()) == two.forward);
  stage.backward_input(0, dy.data());
  CHECK(static_cast<double>(stage.held_bytes()) == two.backward_input + message);
  stage.backward_weight(0);
  CHECK(static_cast<double>(stage.held_bytes()) == message);
  stage.release_grad_input(0);
  CHECK(stage.held_bytes() == 0);
}

namespace {

/// The roofline model's stashes without messages: the simulator's peak is then stashes only.
struct StashOnly {
  RooflineCostModel sizes;
  double compute_seconds(const sch::Action&) const { return 1.0; }
  double activation_bytes(const sch::Action& a) const { return sizes.activation_bytes(a); }
  double message_bytes(const sch::Action&) const { return 0.0; }
  Link link(int, int) const { return {}; }
};

}  // namespace

// The known peaks (docs/schedules.md) in bytes of stories260K's real stages: 1F1B's rank r
// holds min(M, P - r) forward stashes a_r, GPipe M; ZB-H1's rank r, at the BI of its steady
// state, r + 1 backward-input stashes b_r (BW runs r steps later) and P - r - 1 forwards, or
// after the forward r b_r + (P - r) a_r, whichever is larger.
TEST_CASE("sim.memory.closed-forms: peak stash bytes of 1f1b, gpipe and zb-h1 per rank") {
  const model::ModelSpec spec(model::named_config("260K"));
  for (int P : {1, 2, 3, 4})
    for (int M : {1, 2, 4, 8, 16}) {
      CAPTURE(P);
      CAPTURE(M);
      const auto shape = sch::Shape::make(P, M);
      const auto part = RooflineCostModel::placed_uniform(spec, shape);
      RooflineOptions opt;
      opt.workload = {2, 32};  // 64 tokens in 2 sequences per micro-batch
      const StashOnly cost{RooflineCostModel(spec, part, shape, opt)};
      const auto one = brigade::sim::simulate(sch::lower(sch::one_f_one_b({P, M})), cost);
      const auto gp = brigade::sim::simulate(sch::lower(sch::gpipe({P, M})), cost);
      const auto zb = brigade::sim::simulate(sch::lower(sch::zero_bubble_h1({P, M})), cost);
      for (int r = 0; r < P; ++r) {
        CAPTURE(r);
        const auto s = brigade::cost::training_stash(spec, part.stage(r), 64, 2);
        const double a = s.forward, b = s.backward_input;
        const auto ur = static_cast<std::size_t>(r);
        CHECK(one.peak_memory_bytes[ur] == doctest::Approx(std::min(M, P - r) * a));
        CHECK(gp.peak_memory_bytes[ur] == doctest::Approx(M * a));
        if (M >= P)
          CHECK(zb.peak_memory_bytes[ur] ==
                doctest::Approx(r * b + (P - r - 1) * a + std::max(a, b)));
      }
    }
}
