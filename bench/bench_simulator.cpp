// Schedule simulator benchmarks (docs/benchmarks.md, "Schedule simulator").
//
// Scenarios, each over 1F1B with P ranks and M micro-batches (unit costs F=1, B=2, free links):
//   BM_GenerateLower       generate the compute-only schedule and lower() it
//   BM_Validate            validate() the lowered schedule (symbolic execution)
//   BM_Simulate            simulate() without validation, recording the Timeline
//   BM_ValidateSimulate    simulate() with validation: the "simulate and validate"
// Counters: actions/s = lowered actions handled per second (rate over the timed loop).
// Correctness guard: the simulated bubble ratio must equal (P-1)/(M+P-1), else the benchmark
// reports an error instead of a time.
#include <brigade/cost/cost_model.hpp>
#include <brigade/schedule.hpp>
#include <brigade/sim/simulator.hpp>

#include <benchmark/benchmark.h>

#include "machine_context.hpp"

#include <cmath>

namespace {

namespace sch = brigade::schedule;

struct Fixture {
  sch::Schedule lowered;
  brigade::cost::UnitCostModel costs;
  double expected_bubble;
};

Fixture make(const benchmark::State& state) {
  const int P = static_cast<int>(state.range(0)), M = static_cast<int>(state.range(1));
  auto lowered = sch::lower(sch::one_f_one_b({P, M}));
  brigade::cost::UnitCostModel costs(lowered.shape, 1.0, 2.0);
  return {std::move(lowered), std::move(costs), double(P - 1) / (M + P - 1)};
}

void set_rate(benchmark::State& state, std::size_t actions) {
  state.counters["actions/s"] = benchmark::Counter(static_cast<double>(actions),
                                                   benchmark::Counter::kIsIterationInvariantRate);
  state.counters["actions"] = static_cast<double>(actions);
}

bool check_bubble(benchmark::State& state, const brigade::sim::SimResult& r, double expected) {
  if (std::abs(r.bubble_ratio - expected) > 1e-9) {
    state.SkipWithError("bubble ratio differs from the closed form (P-1)/(M+P-1)");
    return false;
  }
  state.counters["bubble"] = r.bubble_ratio;
  return true;
}

void BM_GenerateLower(benchmark::State& state) {
  const int P = static_cast<int>(state.range(0)), M = static_cast<int>(state.range(1));
  std::size_t actions = 0;
  for (auto _ : state) {
    auto lowered = sch::lower(sch::one_f_one_b({P, M}));
    actions = lowered.num_actions();
    benchmark::DoNotOptimize(lowered);
  }
  set_rate(state, actions);
}

void BM_Validate(benchmark::State& state) {
  const Fixture f = make(state);
  for (auto _ : state) {
    auto proof = sch::validate(f.lowered);
    benchmark::DoNotOptimize(proof);
  }
  set_rate(state, f.lowered.num_actions());
}

void BM_Simulate(benchmark::State& state) {
  const Fixture f = make(state);
  brigade::sim::SimOptions opt;
  opt.validate = false;
  for (auto _ : state) {
    auto r = brigade::sim::simulate(f.lowered, f.costs, opt);
    if (!check_bubble(state, r, f.expected_bubble)) return;
    benchmark::DoNotOptimize(r);
  }
  set_rate(state, f.lowered.num_actions());
}

void BM_ValidateSimulate(benchmark::State& state) {
  const Fixture f = make(state);
  for (auto _ : state) {
    auto r = brigade::sim::simulate(f.lowered, f.costs);  // validates first
    if (!check_bubble(state, r, f.expected_bubble)) return;
    benchmark::DoNotOptimize(r);
  }
  set_rate(state, f.lowered.num_actions());
}

void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"ranks", "microbatches"})
      ->Args({8, 64})
      ->Args({64, 1024})
      ->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(BM_GenerateLower)->Apply(shapes);
BENCHMARK(BM_Validate)->Apply(shapes);
BENCHMARK(BM_Simulate)->Apply(shapes);
BENCHMARK(BM_ValidateSimulate)->Apply(shapes);

int main(int argc, char** argv) { return brigade::bench::run_benchmarks(argc, argv); }
