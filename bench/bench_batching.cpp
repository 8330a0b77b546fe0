// Planning time of the batchers for one global batch (docs/benchmarks.md, "Batching").
//
// Workload: a 65,536-token global batch of samples drawn from a seeded log-normal (median 128
// tokens, sigma 1.0, clamped to [8, 2048]; seed 15): a stand-in for FLANv2's spread of input
// lengths (many short instructions, a long tail), not its published statistics. Model: the
// 1.1B Llama shape on 4 uniform stages; cost: cost::ProfiledLayerTimes on the H100 datasheet
// profile (profiles/nvidia_h100_sxm.json) through batching::stage_cost; memory limit per
// micro-batch: the activation bytes of one 8,192-token sequence on the worst stage.
//   BM_Dynamic/bounds:256/recompute:1   DynamicBatcher::solve with its default 256 candidate
//                          bounds and the recompute choice (full recompute where a micro-batch
//                          does not fit, peak limit 4 x the micro-batch limit: what
//                          brigade train and plan-batches use)
//   BM_Dynamic/bounds:256/recompute:0   the same without the recompute choice
//   BM_Dynamic/bounds:1073741824/...    every distinct micro-batch time a candidate bound (the
//                          exact DP)
//   BM_Offsets   OffsetsBatcher with an 8,192-token budget (the comparison in the same run)
//   BM_Packing   PackingBatcher, rows of 2,048 tokens, 4 rows per micro-batch
//   BM_Order     order_adaptive over BM_Dynamic/256/1's micro-batches (DynaPipe's ordering: every
//                cluster order simulated under the adaptive schedule and 1F1B; rank limit 4 x
//                the micro-batch limit); with BM_Dynamic, the whole plan of one global batch
// Counters: samples, micro-batches, and (dynamic) the predicted iteration seconds and the
// bounds its DP ran, and the micro-batches it recomputes. Target (issue 15): BM_Dynamic under
// 50 ms.
#include <brigade/batching/batcher.hpp>
#include <brigade/batching/dynamic.hpp>
#include <brigade/batching/order.hpp>
#include <brigade/cost/profiled.hpp>
#include <brigade/partition/partition.hpp>

#include <benchmark/benchmark.h>

#include "machine_context.hpp"

#include <algorithm>
#include <cmath>
#include <random>

namespace {

namespace batching = brigade::batching;

std::vector<batching::SampleLength> global_batch(std::int64_t tokens) {
  std::mt19937_64 rng(15);
  std::lognormal_distribution<double> len(std::log(128.0), 1.0);
  std::vector<batching::SampleLength> s;
  std::int64_t total = 0;
  while (total < tokens) {
    const auto l = std::clamp<std::int64_t>(std::llround(len(rng)), 8, 2048);
    const auto take = std::min(l, tokens - total);
    s.push_back({take, static_cast<int>(s.size() % 8), static_cast<std::int64_t>(s.size())});
    total += take;
  }
  return s;
}

struct Setup {
  std::vector<batching::SampleLength> samples = global_batch(65536);
  brigade::model::ModelSpec spec{brigade::model::named_config("1.1B")};
  batching::MicroBatchCost cost = batching::stage_cost(
      spec, brigade::partition::uniform(spec, 4),
      brigade::cost::ProfiledLayerTimes(
          brigade::cost::load_profile(BRIGADE_MODEL_DIR "/../profiles/nvidia_h100_sxm.json")));
  double limit = cost.activation_bytes({8192, 1, 4096.5});
};

const Setup& setup() {
  static const Setup s;
  return s;
}

void BM_Dynamic(benchmark::State& state) {
  const auto& s = setup();
  batching::DynamicOptions opt;
  opt.max_bounds = static_cast<int>(state.range(0));
  opt.recompute = state.range(1) != 0;
  opt.peak_limit_bytes = 4 * s.limit;
  const batching::DynamicBatcher dynamic(s.cost, 4, s.limit, opt);
  batching::DynamicPlan plan;
  for (auto _ : state) {
    plan = dynamic.solve(s.samples);
    benchmark::DoNotOptimize(plan);
  }
  state.counters["samples"] = static_cast<double>(s.samples.size());
  state.counters["microbatches"] = static_cast<double>(plan.microbatches.size());
  state.counters["iteration_s"] = plan.iteration_seconds;
  state.counters["bounds"] = plan.bounds_tried;
  state.counters["recomputed"] = static_cast<double>(
      std::count(plan.costs.recompute.begin(), plan.costs.recompute.end(), 1));
}

void BM_Offsets(benchmark::State& state) {
  const auto& s = setup();
  std::vector<batching::MicroBatch> mbs;
  for (auto _ : state) {
    mbs = batching::OffsetsBatcher{8192}.plan(s.samples);
    benchmark::DoNotOptimize(mbs);
  }
  state.counters["samples"] = static_cast<double>(s.samples.size());
  state.counters["microbatches"] = static_cast<double>(mbs.size());
}

void BM_Packing(benchmark::State& state) {
  const auto& s = setup();
  std::vector<batching::MicroBatch> mbs;
  for (auto _ : state) {
    mbs = batching::PackingBatcher{2048, 4}.plan(s.samples);
    benchmark::DoNotOptimize(mbs);
  }
  state.counters["samples"] = static_cast<double>(s.samples.size());
  state.counters["microbatches"] = static_cast<double>(mbs.size());
}

void BM_Order(benchmark::State& state) {
  const auto& s = setup();
  batching::DynamicOptions opt;
  opt.peak_limit_bytes = 4 * s.limit;
  const auto plan = batching::DynamicBatcher(s.cost, 4, s.limit, opt).solve(s.samples);
  batching::AdaptiveOrder order;
  for (auto _ : state) {
    order = batching::order_adaptive(plan.costs, 4, 4 * s.limit);
    benchmark::DoNotOptimize(order);
  }
  state.counters["microbatches"] = static_cast<double>(plan.microbatches.size());
  state.counters["orders"] = order.orders_tried;
  state.counters["iteration_s"] = order.makespan_seconds;
}

}  // namespace

BENCHMARK(BM_Dynamic)
    ->ArgNames({"bounds", "recompute"})
    ->Args({256, 1})
    ->Args({256, 0})
    ->Args({1 << 30, 1})
    ->Args({1 << 30, 0})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Offsets)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Packing)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Order)->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) { return brigade::bench::run_benchmarks(argc, argv); }
