// Closed forms of the classic schedules, checked through the simulator with unit costs and
// free links. Bubble ratio = idle rank-time / (P x makespan).
#include <brigade/cost/cost_model.hpp>
#include <brigade/schedule.hpp>
#include <brigade/sim/simulator.hpp>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include "test_util.hpp"

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

using brigade::test::rel;

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
          CHECK(one.peak_memory_bytes[uk] == doctest::Approx(std::min(P - k, M)));
        }
        // ZB-H1 holds an activation until its BW, and its BW runs before the next forward:
        // every rank peaks at min(P, M), 1F1B's rank-0 figure.
        const auto zb = run(sch::zero_bubble_h1({P, M}), 1, 1, 1);
        for (int k = 0; k < P; ++k) CHECK(zb.peak_stash[static_cast<std::size_t>(k)] == std::min(P, M));
      }
    }
}

TEST_CASE("sim.unit-costs: a rank's share is split evenly over its virtual stages") {
  const auto s = sch::interleaved_1f1b({2, 4, 4});
  const UnitCostModel unit(s.shape, 2.0, 4.0);
  CHECK(unit.compute_seconds({sch::Op::F, 5, 0, 0}) == rel(0.5));
  CHECK(unit.compute_seconds({sch::Op::B, 5, 0, 0}) == rel(1.0));
  CHECK(unit.compute_seconds({sch::Op::BI, 5, 0, 0}) == rel(0.5));
  const UnitCostModel split(s.shape, 2.0, 4.0, 1.0);
  CHECK(split.compute_seconds({sch::Op::B, 5, 0, 0}) == rel(1.25));
  CHECK(split.compute_seconds({sch::Op::BW, 5, 0, 0}) == rel(0.25));
  const auto r = simulate(sch::lower(s), unit);
  for (double busy : r.busy_seconds) CHECK(busy == doctest::Approx(4 * 6.0));
}

namespace {

/// The ZB-H1 order brigade ran before it released activations at their BW: BI(k), then the next
/// forward, then BW(k - r). The reference the new order's makespan is held to.
sch::Schedule zb_h1_forward_first(int P, int M) {
  sch::Schedule s = sch::empty_schedule(sch::Shape::make(P, M));
  for (int r = 0; r < P; ++r) {
    auto& prog = s.ranks[static_cast<std::size_t>(r)];
    int w = 0;
    for (int f = 0; f < std::min(P - r, M); ++f) prog.push_back({sch::Op::F, r, f, 0});
    for (int k = 0; k < M; ++k) {
      prog.push_back({sch::Op::BI, r, k, 0});
      if (k + P - r < M) prog.push_back({sch::Op::F, r, k + P - r, 0});
      if (k >= r) prog.push_back({sch::Op::BW, r, w++, 0});
    }
    while (w < M) prog.push_back({sch::Op::BW, r, w++, 0});
  }
  return s;
}

int max_of(const std::vector<int>& v) { return *std::max_element(v.begin(), v.end()); }

}  // namespace

// issue 20: ZB-H1 with at most P stashed micro-batches per rank and the same makespan as the
// forward-first order, at every cost ratio and with link latency.
TEST_CASE("sim.zb-h1.memory: peak stash <= P per rank, makespan of the forward-first order") {
  using Costs = std::tuple<double, double, double>;
  const std::vector<Costs> ratios{{1, 1, 1},   {2, 1, 1}, {1, 2, 1},
                                  {1, 1, 2},   {1, 1, 0.5}, {1, 2, 2}};
  for (int P : {2, 4, 8})
    for (int M : {P, 2 * P, 4 * P})
      for (const auto& [f, b, w] : ratios)
        for (double latency : {0.0, 0.25}) {
          CAPTURE(P);
          CAPTURE(M);
          CAPTURE(f);
          CAPTURE(b);
          CAPTURE(w);
          CAPTURE(latency);
          brigade::cost::UnitCostOptions opt;
          opt.link.latency_s = latency;
          const auto now = sch::lower(sch::zero_bubble_h1({P, M}));
          const auto before = sch::lower(zb_h1_forward_first(P, M));
          const auto r = simulate(now, UnitCostModel(now.shape, f, b, w, opt));
          const auto ref = simulate(before, UnitCostModel(before.shape, f, b, w, opt));
          CHECK(r.makespan == doctest::Approx(ref.makespan).epsilon(1e-12));
          for (int k = 0; k < P; ++k) CHECK(r.peak_stash[static_cast<std::size_t>(k)] <= P);
          CHECK(max_of(r.peak_stash) == P);
          if (M > P) CHECK(max_of(ref.peak_stash) == P + 1);  // what the old order held
        }
}

// issue 20: interleaved 1F1B for every M (Megatron's and PyTorch's groups of >= P micro-batches).
TEST_CASE("sim.interleaved.any-m: valid for every M, closed form where P divides M") {
  for (int P : {2, 4, 8})
    for (int V : {2, 3, 4})
      for (int M : {1, 3, 6, P, 2 * P, 4 * P, P + 1, 2 * P + 1}) {
        CAPTURE(P);
        CAPTURE(V);
        CAPTURE(M);
        const double f = 1.0, b = 2.0;
        const auto r = run(sch::interleaved_1f1b({P, M, V}), f, b);  // validates first
        for (double busy : r.busy_seconds) CHECK(busy == doctest::Approx(M * (f + b)));
        const double closed = double(P - 1) / (V * M + P - 1);
        if (M % P == 0) {
          CHECK(r.bubble_ratio == rel(closed, 1e-12));
          // Rank k stashes its warm-up plus the forward that precedes the first backward.
          for (int k = 0; k < P; ++k)
            CHECK(r.peak_stash[static_cast<std::size_t>(k)] ==
                  std::min(2 * (P - k - 1) + (V - 1) * P + 1, V * M));
        } else {
          CHECK(r.bubble_ratio >= closed - 1e-12);  // never better than the ideal interleaving
        }
      }
}

// paper: Qi et al. 2023, Zero Bubble Pipeline Parallelism, §6 (ZB-V): with F = B = W per chunk,
// zero bubble in the steady state at 1F1B's peak activation memory.
TEST_CASE("sim.zb-v.claims: F=BI=BW=1 per chunk, free links: only the P-1 fill, 1F1B's memory") {
  for (int P : {2, 4, 8})
    for (int M : {2 * P, 4 * P}) {
      CAPTURE(P);
      CAPTURE(M);
      // Per-rank shares of 2 split over the two chunks: F = BI = BW = 1 per chunk.
      const auto r = run(sch::zero_bubble_v({P, M, 2}), 2, 2, 2);
      CHECK(r.makespan == doctest::Approx(6.0 * M + P - 1));
      CHECK(r.bubble_ratio == rel(double(P - 1) / (6 * M + P - 1), 1e-12));
      // Each rank idles exactly P-1 chunk-forwards: the first forward's trip down the V before
      // the tip can start; nothing in the steady state.
      for (int k = 0; k < P; ++k) {
        const auto uk = static_cast<std::size_t>(k);
        CHECK(r.makespan - r.busy_seconds[uk] == doctest::Approx(P - 1.0));
        // 2P chunks = P units (a unit = one micro-batch of a whole rank's layers), 1F1B's peak.
        CHECK(r.peak_stash[uk] == 2 * P);
        CHECK(r.peak_memory_bytes[uk] == doctest::Approx(P));
      }
      const auto one = run(sch::one_f_one_b({P, M}), 2, 4);
      CHECK(one.peak_memory_bytes[0] == doctest::Approx(P));
    }
}

// deepseek-ai/DualPipe README: DualPipe(V) bubble (PP/2-1)(F&B + B - 3W), activation PP + 1 per
// device, PP = 2P stages. Here F&B = F + B (the pair runs back to back).
TEST_CASE("sim.dualpipe-v.claims: bubble within the published bound, PP + 1 chunk activations") {
  using Costs = std::tuple<double, double, double>;
  for (const auto& [f, bi, bw] : std::vector<Costs>{{1, 1, 1}, {1, 2, 1}, {2, 1, 1}, {1, 1, 2}})
    for (int P : {2, 4, 8})
      for (int M : {2 * P, 4 * P}) {
        CAPTURE(P);
        CAPTURE(M);
        CAPTURE(f);
        CAPTURE(bi);
        CAPTURE(bw);
        const auto r = run(sch::dualpipe_v({P, M, 2}), 2 * f, 2 * bi, 2 * bw);
        const double b = bi + bw, fb = f + b;
        const double bound = (P - 1) * (fb + b - 3 * bw);
        for (int k = 0; k < P; ++k) {
          const auto uk = static_cast<std::size_t>(k);
          CHECK(r.busy_seconds[uk] == doctest::Approx(2.0 * M * (f + b)));
          CHECK(r.makespan - r.busy_seconds[uk] <= bound + 1e-9);
          CHECK(r.peak_stash[uk] == 2 * P + 1);  // PP + 1 chunks
        }
        if (f == bi && bi == bw)  // F = BI = BW: the same P-1 fill as ZB-V
          CHECK(r.makespan == doctest::Approx(6.0 * M * f + (P - 1) * f));
      }
}
