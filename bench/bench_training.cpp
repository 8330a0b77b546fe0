// Pipeline training throughput on this machine (docs/benchmarks.md, "Pipeline training").
//
//   BM_Train/stages:S/microbatches:M  a synthetic Llama of dim 512, 8 layers, 8 heads, FFN 1376,
//       vocab 32000 (the "42M" shape), M micro-batches of one 256-token sequence per step,
//       1F1B over S ranks (one thread each, one GEMM thread per rank). Counters:
//       tokens_per_s (target rows / step wall time), bubble_measured (Timeline of the run),
//       bubble_simulated (the simulator on the same lowered schedule with the measured mean
//       action costs), and their ratio; peak_mib_measured and peak_mib_simulated (the largest
//       rank's peak memory, StepResult::peak_memory_bytes, against the simulator's figure for
//       the same micro-batches, the plan with the micro-batches' work (engine::microbatch_work); MiB).
//       split:0 is the balanced split on the default-rate roofline, split:1 on this machine's
//       device profile measured in the same run (cost::ProfiledLayerTimes, the CLI's default);
//       bubble_calibrated and tokens_per_s_calibrated are the simulator's prediction of the
//       step from that profile alone (RooflineCostModel with the profiled layer times).
//   BM_TrainSpeedup/microbatches:M  issue 13's 2-stage / 1-stage ratio for 1F1B at M: both
//       engines (one rank; two ranks on the profiled split, as BM_Train split:1) step in turn
//       on the same batches, 8 pairs in alternating order. Counters: the median, least and
//       largest per-pair ratio of tokens/s, each side's median tokens/s, and each side's median
//       seconds in TrainingEngine::optimizer_step (the step's AdamW update).
//   BM_CalibratedTrainingOps/ranks:P  held-out prediction error of the calibrated model for
//       training ops: zb-h1 on P ranks, 4 micro-batches; every F, BI and BW of a step against
//       cost::LatencyEstimator's prior (the profile alone) and against its prediction after
//       observing the step before (online refinement). Counters: median |predicted/measured - 1|
//       per op, prior and refined, and the prior's median predicted/measured.
//   BM_TrainSchedule/schedule:K/microbatches:M  the same model and batches on 2 ranks, one
//       schedule per K: 0 = 1f1b, 1 = interleaved-1f1b (V = 2), 2 = zb-h1, 3 = zb-v,
//       4 = dualpipe-v (issue 20: the schedules side by side in one run, each with the
//       simulator's prediction beside its measured bubble).
#include <brigade/cost/estimator.hpp>
#include <brigade/cost/profiled.hpp>
#include <brigade/data/corpus.hpp>
#include <brigade/engine/training.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/sim/simulator.hpp>

#include <benchmark/benchmark.h>

#include "machine_context.hpp"
#include "workloads.hpp"

#include <algorithm>
#include <chrono>
#include <map>
#include <string>

using namespace brigade;

namespace {

const model::LlamaWeights& weights42m() {
  static const auto w = model::make_synthetic_weights(model::named_config("42M"), 1234);
  return w;
}

using bench::machine_profile;
using bench::median;
using bench::median_error;

/// M micro-batches, each one sequence of 257 random tokens (256 target rows).
std::vector<data::PackedBatch> batches(int m, std::uint64_t seed) {
  return bench::random_sequences(m, 256, 32000, seed);
}

/// Trains `cfg` for one step not counted, then for the benchmark's iterations, and reports
/// tokens/s and the bubbles.
void run_training(benchmark::State& state, const engine::TrainingConfig& cfg) {
  const int m = cfg.microbatches;
  engine::TrainingEngine eng(weights42m(), cfg);
  const auto data = batches(m, 7);
  double tokens = 0, seconds = 0, measured = 0, simulated = 0, peak = 0, peak_sim = 0;
  // The plan with these micro-batches' work: the roofline model's sizes are then exact for them.
  const plan::Plan step(eng.plan().partition(), eng.plan().schedule(),
                        engine::microbatch_work(data), eng.plan().execution());
  const cost::RooflineCostModel sizes(model::ModelSpec(weights42m().config), step);
  eng.train_step(data);  // warm-up, not counted: the first step first-touches every buffer
  for (auto _ : state) {
    const auto r = eng.train_step(data);
    tokens += static_cast<double>(r.tokens);
    seconds += r.seconds;
    measured += r.timeline.bubble_ratio();
    const auto predicted = sim::simulate(
        step, engine::MeasuredCostModel(step.shape(), r.timeline, sizes));
    simulated += predicted.bubble_ratio;
    for (double b : r.peak_memory_bytes) peak = std::max(peak, b);
    for (double b : predicted.peak_memory_bytes) peak_sim = std::max(peak_sim, b);
    if (!std::isfinite(r.loss) || r.loss < 5.0) state.SkipWithError("implausible loss");
  }
  // The simulator's prediction from the device profile alone: profiled layer times per pass,
  // the profile's in-process link.
  cost::RooflineOptions calibrated;
  calibrated.layer_seconds = cost::ProfiledLayerTimes(machine_profile(), 1, cfg.ranks);
  const auto& link = machine_profile().link("in-process");
  calibrated.link = {link.latency_s, link.bytes_per_s};
  const auto from_profile = sim::simulate(
      step, cost::RooflineCostModel(model::ModelSpec(weights42m().config), step, calibrated));
  state.counters["bubble_calibrated"] = from_profile.bubble_ratio;
  state.counters["tokens_per_s_calibrated"] =
      static_cast<double>(m) * 256.0 / from_profile.makespan;
  const auto n = static_cast<double>(state.iterations());
  state.counters["tokens_per_s"] = tokens / seconds;
  state.counters["bubble_measured"] = measured / n;
  state.counters["bubble_simulated"] = simulated / n;
  state.counters["peak_mib_measured"] = peak / (1 << 20);
  state.counters["peak_mib_simulated"] = peak_sim / (1 << 20);
}

void BM_Train(benchmark::State& state) {
  engine::TrainingConfig cfg;
  cfg.schedule = "1f1b";
  cfg.ranks = static_cast<int>(state.range(0));
  cfg.microbatches = static_cast<int>(state.range(1));
  if (state.range(2) == 1)
    cfg.layer_seconds = cost::ProfiledLayerTimes(machine_profile(), 1, cfg.ranks);
  engine::TrainingEngine probe(weights42m(), cfg);
  state.SetLabel(probe.plan().partition().to_string());
  run_training(state, cfg);
}
BENCHMARK(BM_Train)
    ->ArgNames({"stages", "microbatches", "split"})
    ->Args({1, 8, 1})->Args({2, 4, 1})->Args({2, 8, 0})->Args({2, 8, 1})->Args({2, 16, 1})
    ->Unit(benchmark::kSecond)->UseRealTime()->Iterations(2);

void BM_TrainSpeedup(benchmark::State& state) {
  // One stage and two stages (calibrated split) trained on the same micro-batches, one step of
  // each per iteration, their order alternating, so both see the same moment of the host: the
  // ratio is taken per pair, and its median is the figure (run-to-run noise on a shared host
  // moves both members of a pair together).
  const int m = static_cast<int>(state.range(0));
  engine::TrainingConfig one;
  one.schedule = "1f1b";
  one.ranks = 1;
  one.microbatches = m;
  engine::TrainingConfig two = one;
  two.ranks = 2;
  two.layer_seconds = cost::ProfiledLayerTimes(machine_profile(), 1, two.ranks);
  engine::TrainingEngine e1(weights42m(), one), e2(weights42m(), two);
  state.SetLabel(e2.plan().partition().to_string());
  const auto data = batches(m, 7);
  std::vector<double> opt1, opt2;  // optimizer seconds per step
  // One train_step as its two halves (compute_gradients, then optimizer_step), timed apart.
  const auto rate = [&](engine::TrainingEngine& e, std::vector<double>& opt) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = e.compute_gradients(data);
    const auto t1 = std::chrono::steady_clock::now();
    e.optimizer_step();
    const auto t2 = std::chrono::steady_clock::now();
    if (!std::isfinite(r.loss) || r.loss < 5.0) state.SkipWithError("implausible loss");
    opt.push_back(std::chrono::duration<double>(t2 - t1).count());
    return static_cast<double>(r.tokens) / std::chrono::duration<double>(t2 - t0).count();
  };
  rate(e1, opt1), rate(e2, opt2);  // warm-up: first-touch of activations, stashes, moments
  opt1.clear(), opt2.clear();
  std::vector<double> ratios, r1, r2;
  bool flip = false;
  for (auto _ : state) {
    double a = 0, b = 0;
    if (flip) b = rate(e2, opt2), a = rate(e1, opt1);
    else a = rate(e1, opt1), b = rate(e2, opt2);
    flip = !flip;
    r1.push_back(a), r2.push_back(b), ratios.push_back(b / a);
  }
  state.counters["tokens_per_s_1stage"] = median(r1);
  state.counters["tokens_per_s_2stage"] = median(r2);
  state.counters["optimizer_s_1stage"] = median(opt1);
  state.counters["optimizer_s_2stage"] = median(opt2);
  state.counters["speedup_median"] = median(ratios);
  state.counters["speedup_min"] = *std::min_element(ratios.begin(), ratios.end());
  state.counters["speedup_max"] = *std::max_element(ratios.begin(), ratios.end());
}
BENCHMARK(BM_TrainSpeedup)->ArgName("microbatches")->Arg(8)
    ->Unit(benchmark::kSecond)->UseRealTime()->Iterations(8);

void BM_CalibratedTrainingOps(benchmark::State& state) {
  engine::TrainingConfig cfg;
  cfg.schedule = "zb-h1";
  cfg.ranks = static_cast<int>(state.range(0));
  cfg.microbatches = 4;
  cfg.layer_seconds = cost::ProfiledLayerTimes(machine_profile(), 1, cfg.ranks);
  engine::TrainingEngine eng(weights42m(), cfg);
  const auto data = batches(cfg.microbatches, 11);
  const plan::Plan step(eng.plan().partition(), eng.plan().schedule(),
                        engine::microbatch_work(data), eng.plan().execution());
  cost::LatencyEstimator est(model::ModelSpec(weights42m().config), cfg.layer_seconds);
  std::map<schedule::Op, std::vector<double>> prior, refined;
  bool first = true;
  for (auto _ : state) {
    const auto r = eng.train_step(data);
    if (!first) {  // held out: predicted before this step's times are observed
      for (const auto& iv : r.timeline.intervals()) {
        if (iv.op != schedule::Op::F && iv.op != schedule::Op::BI && iv.op != schedule::Op::BW)
          continue;
        prior[iv.op].push_back(est.prior(step, iv) / iv.duration());
        refined[iv.op].push_back(est.predict(step, iv) / iv.duration());
      }
    }
    est.observe(step, r.timeline);
    first = false;
  }
  for (auto op : {schedule::Op::F, schedule::Op::BI, schedule::Op::BW}) {
    const std::string name(brigade::to_string(op));
    state.counters["prior_err_" + name] = median_error(prior[op]);
    state.counters["prior_ratio_" + name] = median(prior[op]);
    state.counters["refined_err_" + name] = median_error(refined[op]);
  }
}
BENCHMARK(BM_CalibratedTrainingOps)->ArgName("ranks")->Arg(1)->Arg(2)
    ->Unit(benchmark::kSecond)->UseRealTime()->Iterations(3);

void BM_TrainSchedule(benchmark::State& state) {
  struct Choice {
    const char* name;
    int virtual_stages;
  };
  constexpr Choice choices[] = {
      {"1f1b", 1}, {"interleaved-1f1b", 2}, {"zb-h1", 1}, {"zb-v", 2}, {"dualpipe-v", 2}};
  const auto& c = choices[state.range(0)];
  state.SetLabel(c.name);
  engine::TrainingConfig cfg;
  cfg.schedule = c.name;
  cfg.ranks = 2;
  cfg.virtual_stages = c.virtual_stages;
  cfg.microbatches = static_cast<int>(state.range(1));
  run_training(state, cfg);
}
BENCHMARK(BM_TrainSchedule)
    ->ArgNames({"schedule", "microbatches"})
    ->ArgsProduct({{0, 1, 2, 3, 4}, {8}})
    ->Unit(benchmark::kSecond)->UseRealTime()->Iterations(2);

}  // namespace

int main(int argc, char** argv) { return brigade::bench::run_benchmarks(argc, argv); }
