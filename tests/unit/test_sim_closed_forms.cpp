// Closed forms of the classic schedules, checked through the simulator with unit costs and
// free links. Bubble ratio = idle rank-time / (P x makespan).
#include <brigade/cost/cost_model.hpp>
#include <brigade/schedule.hpp>
#include <brigade/sim/simulator.hpp>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <optional>

namespace sch = brigade::schedule;
using brigade::cost::UnitCostModel;
using brigade::sim::simulate;

namespace {

brigade::sim::SimResult run(const sch::Schedule& compute, double f, double b,
                            std::optional<double> w = std::nullopt) {
  const UnitCostModel unit(compute.shape, f, b, w);
  return simulate(sch::lower(compute), unit);
}

}  // namespace

// paper: GPipe (Huang et al. 2019) §2.2; PipeDream-Flush (Narayanan et al. 2021) §3
TEST_CASE("sim.gpipe-1f1b.closed-form: bubble (P-1)/(M+P-1) and makespan (M+P-1)(F+B)") {
  for (const char* name : {"gpipe", "1f1b"}) {
    for (int P : {1, 2, 3, 4, 8}) SUBCASE(fmt::format("{}.p{}", name, P).c_str()) {
        for (int M : {1, 2, 3, 4, 7, 8, 16, 32}) {
          for (auto [f, b] : {std::pair{1.0, 1.0}, std::pair{1.0, 2.0}, std::pair{0.5, 1.5}}) {
            CAPTURE(name);
            CAPTURE(P);
            CAPTURE(M);
            CAPTURE(f);
            CAPTURE(b);
            const auto r = run(sch::generate(name, {P, M}), f, b);
            CHECK(r.makespan == doctest::Approx((M + P - 1) * (f + b)).epsilon(1e-12));
            CHECK(r.bubble_ratio == doctest::Approx(double(P - 1) / (M + P - 1)).epsilon(1e-12));
            for (int k = 0; k < P; ++k)
              CHECK(r.busy_seconds[static_cast<std::size_t>(k)] == doctest::Approx(M * (f + b)));
          }
        }
      }
  }
}

// paper: PTD-P (Narayanan et al. 2021) §2.2.2, the interleaved schedule's bubble
TEST_CASE("sim.interleaved.closed-form: bubble (P-1)/(VM+P-1) for M a multiple of P") {
  for (int P : {1, 2, 3, 4, 8}) SUBCASE(fmt::format("p{}", P).c_str()) {
      for (int V : {1, 2, 3, 4}) {
        for (int groups : {1, 2, 3, 4}) {
          const int M = P * groups;
          CAPTURE(P);
          CAPTURE(V);
          CAPTURE(M);
          const double f = 1.0, b = 2.0;
          const auto r = run(sch::interleaved_1f1b({P, M, V}), f, b);
          CHECK(r.bubble_ratio == doctest::Approx(double(P - 1) / (V * M + P - 1)).epsilon(1e-12));
          CHECK(r.makespan == doctest::Approx(M * (f + b) + (P - 1) * (f + b) / V).epsilon(1e-12));
        }
      }
    }
}

// paper: Qi et al. 2023, Zero Bubble Pipeline Parallelism, §3 (ZB-H1: bubble (P-1)(F+B-W))
TEST_CASE("sim.zb-h1.closed-form: F=B=W=1 gives bubble (P-1)/(3M+P-1) for M >= P") {
  for (int P : {1, 2, 3, 4, 6, 8}) SUBCASE(fmt::format("p{}", P).c_str()) {
      for (int M : {1, 2, 3, 4, 6, 8, 12, 16, 32}) {
        if (M < P) continue;
        CAPTURE(P);
        CAPTURE(M);
        const auto r = run(sch::zero_bubble_h1({P, M}), 1.0, 1.0, 1.0);
        CHECK(r.bubble_ratio == doctest::Approx(double(P - 1) / (3 * M + P - 1)).epsilon(1e-12));
        // Every rank idles (P-1)(F+B-W) = P-1 units: the bubble is spread evenly.
        for (int k = 0; k < P; ++k)
          CHECK(r.makespan - r.busy_seconds[static_cast<std::size_t>(k)] ==
                doctest::Approx(P - 1.0));
        // The same schedule costed without W (B = 2 is the full backward, split BI = BW = 1).
        const auto same = run(sch::zero_bubble_h1({P, M}), 1.0, 2.0);
        CHECK(same.makespan == doctest::Approx(r.makespan));
        // Against 1F1B with the same total backward (B + W = 2): bubble (P-1)(F+B+W) there.
        const auto base = run(sch::one_f_one_b({P, M}), 1.0, 2.0);
        CHECK(base.makespan - r.makespan == doctest::Approx(2.0 * (P - 1)));
      }
    }
}

TEST_CASE("sim.1f1b-vs-gpipe.peak-stash: rank 0 holds min(P, M) micro-batches vs GPipe's M") {
  for (int P : {1, 2, 3, 4, 8}) SUBCASE(fmt::format("p{}", P).c_str()) {
      for (int M : {1, 2, 3, 4, 8, 16}) {
        CAPTURE(P);
        CAPTURE(M);
        const auto one = run(sch::one_f_one_b({P, M}), 1, 2);
        const auto gp = run(sch::gpipe({P, M}), 1, 2);
        CHECK(one.peak_stash[0] == std::min(P, M));
        CHECK(gp.peak_stash[0] == M);
        for (int k = 0; k < P; ++k) {
          const auto uk = static_cast<std::size_t>(k);
          CHECK(one.peak_stash[uk] == std::min(P - k, M));
          CHECK(gp.peak_stash[uk] == M);
          // Unit activations: one unit per micro-batch and rank.
          CHECK(one.peak_activation_bytes[uk] == doctest::Approx(std::min(P - k, M)));
        }
        // ZB-H1 keeps at most 1F1B's P forwards waiting for their BI; counting an activation as
        // held until its BW (which runs after the next forward), rank 0 peaks one higher once
        // M > P. (The paper's equal-memory claim counts only what BW still needs after BI.)
        if (M >= P)
          CHECK(run(sch::zero_bubble_h1({P, M}), 1, 1, 1).peak_stash[0] == P + (M > P ? 1 : 0));
      }
    }
}

TEST_CASE("sim.unit-costs: a rank's share is split evenly over its virtual stages") {
  const auto s = sch::interleaved_1f1b({2, 4, 4});
  const UnitCostModel unit(s.shape, 2.0, 4.0);
  CHECK(unit.compute_seconds({sch::Op::F, 5, 0, 0}) == doctest::Approx(0.5));
  CHECK(unit.compute_seconds({sch::Op::B, 5, 0, 0}) == doctest::Approx(1.0));
  CHECK(unit.compute_seconds({sch::Op::BI, 5, 0, 0}) == doctest::Approx(0.5));
  const UnitCostModel split(s.shape, 2.0, 4.0, 1.0);
  CHECK(split.compute_seconds({sch::Op::B, 5, 0, 0}) == doctest::Approx(1.25));
  CHECK(split.compute_seconds({sch::Op::BW, 5, 0, 0}) == doctest::Approx(0.25));
  const auto r = simulate(sch::lower(s), unit);
  for (double busy : r.busy_seconds) CHECK(busy == doctest::Approx(4 * 6.0));
}
