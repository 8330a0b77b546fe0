// Pipelined decode throughput on this machine, with its ceilings measured in the same binary.
//
// Scenarios (docs/benchmarks.md, "Pipelined decode"):
//   BM_Decode/stages:S/threads:T/seqs:N/mb:G  `brigade generate --synthetic 42M` as a library
//       call: N sequences (one-token prompts) decode 48 positions with S stages of T intra-op
//       threads each in G micro-batches (0 = min(N, S)); counters: tokens_per_s (generated
//       tokens / wall), bubble (1 - mean stage busy fraction), timeline_bubble
//       (Timeline::bubble_ratio of the measured run) and simulated_bubble (the simulator on the
//       same lowered inference schedule with the op costs measured in that run,
//       engine::simulated_bubble), and their ratio sim_over_measured.
//   BM_PlannedDecode/seqs:N  plan::inference_plans for 2 cores on this machine's profile: the
//       pick and every other plan priced, run interleaved (each iteration runs them all once);
//       counters: the pick's median tokens_per_s and its prediction, best_tokens_per_s (the
//       plan with the highest median) and pick_over_best (issue 10: within 5% of the best).
//   BM_GemmCeiling/threads:T   T independent single-threaded SGEMMs at once (the compute-bound
//       ceiling of T cores for independent work, which is what pipeline stages do).
//   BM_TriadCeiling/threads:T  T threads running a STREAM triad on private arrays (the
//       memory-bound ceiling).
//   BM_Llama42M_Prefill/threads:T / BM_Llama42M_Decode/threads:T/dtype:D  the llama.cpp
//       reference shape (dim 512, 8 layers, FFN 1376, vocab 32000): one sequence, 1 stage of T
//       threads: prefill of 512 tokens (F32), and decode tokens/s with the matrices kept in
//       dtype D (brigade::DType: 0 F32, 1 F16, 2 BF16, 5 Q8_0; model::convert_weights) and the
//       weight bytes streamed per second (weight_GB_per_s, against BM_TriadCeiling/threads:1 of
//       the same run).
//   BM_RebalanceDecide/stages:S  one evaluation of serve::Rebalancer::decide on the book's
//       thread (the predictor priced on a full window of 64 rounds per micro-batch, S
//       micro-batches of 8 decoding sequences, the current plan and both candidates simulated
//       through the lowered window): decide_us, and share_of_round, its seconds over one decode
//       round of the same shape measured in the same run (S stages x 1 thread, 8 x S sequences,
//       48 positions: wall / 48).
//   BM_RingOffload/offload:O  prima.cpp's ring (2 ranks x 2 windows) of the 42M model written to
//       a file and mapped, 8 sequences in 2 groups decode 32 positions, without (0) and with (1)
//       weight offload (PREFETCH/RELEASE of every window each round, madvise); counters:
//       tokens_per_s and the seconds per generated token of PREFETCH, RELEASE and F intervals.
#include <brigade/backend/cpu.hpp>
#include <brigade/cost/profile.hpp>
#include <brigade/cost/estimator.hpp>
#include <brigade/cost/profiled.hpp>
#include <brigade/engine/inference.hpp>
#include <brigade/engine/training.hpp>
#include <brigade/schedule/generators.hpp>
#include <brigade/schedule/lower.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/partition/partition.hpp>
#include <brigade/partition/ring.hpp>
#include <brigade/plan/inference_plan.hpp>
#include <brigade/serve/rebalance.hpp>

#include <benchmark/benchmark.h>

#include "machine_context.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

using namespace brigade;

namespace {

const model::LlamaWeights& weights42m() {
  static const model::LlamaWeights w = model::make_synthetic_weights(model::named_config("42M"), 1234);
  return w;
}

/// The 42M model with its matrices kept in `dtype` (model::convert_weights, once per dtype).
const model::LlamaWeights& weights42m(DType dtype) {
  static std::map<DType, model::LlamaWeights> converted;
  static std::mutex m;
  std::lock_guard lock(m);
  auto it = converted.find(dtype);
  if (it == converted.end())
    it = converted.emplace(dtype, model::convert_weights(weights42m(), dtype)).first;
  return it->second;
}

/// A decode run and the plan it ran (engine::inference_plan of its partition and requests).
struct DecodeRun {
  engine::InferenceReport report;
  plan::Plan plan;
};

using bench::machine_profile;

/// `seqs` requests: one-token prompts (token 1) unless `prompt_len` > 1 (then ids 300..1299).
std::vector<engine::GenerationRequest> decode_requests(int seqs, int steps, int prompt_len) {
  std::vector<engine::GenerationRequest> reqs;
  for (int i = 0; i < seqs; ++i) {
    std::vector<int> prompt{1};
    for (int t = 1; t < prompt_len; ++t) prompt.push_back(300 + (i * 7 + t) % 1000);
    reqs.push_back({prompt, steps});
  }
  return reqs;
}

/// Generates `seqs` sequences of `steps` tokens after `prompt_len`-token prompts with the
/// stages of `part`, `threads` intra-op threads each, in `microbatches` groups (0: the engine's
/// default), greedy.
DecodeRun decode_run(const partition::Partition& part, int threads, int seqs, int steps,
                     int prompt_len, int microbatches, DType dtype = DType::F32) {
  const auto& w = weights42m(dtype);
  const auto reqs = decode_requests(seqs, steps, prompt_len);
  engine::InferenceOptions opt;
  opt.sampler.temperature = 0.0f;
  opt.blas_threads = threads;
  opt.microbatches = microbatches;
  auto p = engine::inference_plan(w.config, part, reqs, microbatches);
  auto rep = engine::generate(w, p, reqs, opt);
  return {std::move(rep), std::move(p)};
}

/// As above on `stages` stages split by the balanced policy on this machine's profile (the
/// CLI's default: cost::ProfiledLayerTimes) unless `roofline` (the default-rate roofline). One
/// stage holds every layer whatever the policy: no profile is measured for it, so a process
/// that runs only one-stage benchmarks starts at once.
DecodeRun decode_run(int stages, int threads, int seqs, int steps, int prompt_len,
                     int microbatches = 0, bool roofline = false, DType dtype = DType::F32) {
  const model::ModelSpec spec(weights42m(dtype).config);
  const int groups = microbatches > 0 ? std::min(seqs, microbatches) : std::min(seqs, std::max(stages, 1));
  const model::WorkItem work{(seqs + groups - 1) / groups, (seqs + groups - 1) / groups, steps / 2.0};
  const auto part =
      stages == 1 ? partition::uniform(spec, 1)
      : roofline  ? partition::balanced(spec, stages, work)
                  : partition::balanced(spec, stages, work,
                                        cost::ProfiledLayerTimes(machine_profile(), threads,
                                                                 stages * threads));
  return decode_run(part, threads, seqs, steps, prompt_len, microbatches, dtype);
}

/// Weight bytes one decode step streams with the matrices in `dtype`: every matrix once (the
/// shared embedding table as the classifier; the embedding lookup reads one row more) and the
/// float32 norm gains: model::weight_bytes.
double weight_bytes_per_token(DType dtype) {
  return static_cast<double>(model::weight_bytes(weights42m(dtype)));
}

void BM_Decode(benchmark::State& state) {
  const int stages = static_cast<int>(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  const int seqs = static_cast<int>(state.range(2));
  const int mb = static_cast<int>(state.range(3));
  double tokens = 0, seconds = 0, busy = 0, measured = 0, simulated = 0;
  for (auto _ : state) {
    const auto run = decode_run(stages, threads, seqs, 48, 1, mb);
    const auto& rep = run.report;
    tokens += static_cast<double>(rep.generated_tokens);
    seconds += rep.wall_s;
    // The plan that ran (one-token prompts: every group runs all its rounds).
    measured += rep.timeline.bubble_ratio();
    simulated += engine::simulated_bubble(run.plan.schedule(), rep.timeline);
    double b = 0;
    for (int s = 0; s < stages; ++s) b += rep.timeline.busy(s) / rep.wall_s;
    busy += b / stages;
    if (rep.generated_tokens != static_cast<std::int64_t>(seqs) * 48)
      state.SkipWithError("wrong number of generated tokens");
  }
  state.counters["tokens_per_s"] = tokens / seconds;
  state.counters["bubble"] = 1.0 - busy / static_cast<double>(state.iterations());
  state.counters["timeline_bubble"] = measured / static_cast<double>(state.iterations());
  state.counters["simulated_bubble"] = simulated / static_cast<double>(state.iterations());
  state.counters["sim_over_measured"] = measured > 0 ? simulated / measured : 0.0;
  cpu::set_blas_threads(1);
}
// mb = micro-batches (0 = the engine's default, min(sequences, stages)).
BENCHMARK(BM_Decode)
    ->ArgNames({"stages", "threads", "seqs", "mb"})
    ->Args({1, 1, 1, 0})->Args({1, 2, 1, 0})
    ->Args({1, 1, 8, 0})->Args({1, 2, 8, 0})->Args({2, 1, 8, 2})->Args({2, 1, 8, 4})
    ->Args({1, 1, 32, 0})->Args({1, 2, 32, 0})->Args({2, 1, 32, 2})->Args({2, 1, 32, 4})
    ->Args({2, 1, 32, 8})
    ->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(2);

/// The planner's pick for 2 cores (a device profile measured once, in this run) against every
/// plan it priced, all run the same way (48 positions of `seqs` one-token prompts, each plan's
/// own partition, threads and micro-batches), interleaved: each iteration runs every plan once,
/// starting one plan later than the iteration before, so the machine's drift and the order
/// effects of a run (docs/benchmarks.md) fall on all plans alike. Counters: tokens_per_s and
/// predicted_tokens_per_s of the pick (its median over the iterations), best_tokens_per_s (the
/// highest median of any plan) and pick_over_best; the label names the pick and the best plan.
/// With BRIGADE_PLAN_TABLE=1 it prints every plan's predicted and median measured tokens/s.
void BM_PlannedDecode(benchmark::State& state) {
  const int seqs = static_cast<int>(state.range(0));
  const model::ModelSpec spec(weights42m().config);
  const auto plans = plan::inference_plans(spec, {seqs, 1, 47}, machine_profile());
  std::vector<std::vector<double>> rates(plans.size());
  std::size_t start = 0;
  for (auto _ : state) {
    for (std::size_t j = 0; j < plans.size(); ++j) {
      const std::size_t i = (start + j) % plans.size();
      const auto& p = plans[i];
      const auto rep =
          decode_run(p.partition(spec.num_layers()), p.threads, seqs, 48, 1, p.microbatches).report;
      if (rep.generated_tokens != static_cast<std::int64_t>(seqs) * 48)
        state.SkipWithError("wrong number of generated tokens");
      rates[i].push_back(static_cast<double>(rep.generated_tokens) / rep.wall_s);
    }
    ++start;
  }
  std::vector<double> medians;
  for (const auto& r : rates) medians.push_back(bench::median(r));
  const auto best = static_cast<std::size_t>(
      std::max_element(medians.begin(), medians.end()) - medians.begin());
  state.counters["tokens_per_s"] = medians.front();
  state.counters["predicted_tokens_per_s"] = plans.front().tokens_per_s;
  state.counters["best_tokens_per_s"] = medians[best];
  state.counters["pick_over_best"] = medians.front() / medians[best];
  state.SetLabel("pick: " + plans.front().describe(seqs) + "; best: " + plans[best].describe(seqs));
  if (const char* t = std::getenv("BRIGADE_PLAN_TABLE"); t && std::string(t) == "1") {
    std::fprintf(stderr, "| %d sequences: plan | predicted tokens/s | measured (median of %zu) | measured / predicted |\n| --- | ---: | ---: | ---: |\n",
                 seqs, rates.front().size());
    for (std::size_t i = 0; i < plans.size(); ++i)
      std::fprintf(stderr, "| %s%s | %.0f | %.0f | %.2f |\n", plans[i].describe(seqs).c_str(),
                   i == 0 ? " (pick)" : "", plans[i].tokens_per_s, medians[i],
                   medians[i] / plans[i].tokens_per_s);
  }
  cpu::set_blas_threads(1);
}
BENCHMARK(BM_PlannedDecode)->ArgName("seqs")->Arg(8)->Arg(32)
    ->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);

void BM_GemmCeiling(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  constexpr int T = 256, K = 512, N = 1376;
  std::vector<std::vector<float>> x(threads, std::vector<float>(T * K, 0.5f)),
      w(threads, std::vector<float>(N * K, 0.25f)), y(threads, std::vector<float>(T * N));
  cpu::set_blas_threads(1);
  for (auto _ : state) {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        for (int r = 0; r < 8; ++r)
          cpu::matmul_wt(x[t].data(), w[t].data(), y[t].data(), T, K, N);
      });
    for (auto& th : pool) th.join();
    benchmark::DoNotOptimize(y[0][0]);
    if (std::abs(y[0][7] - 0.125f * K) > 1e-2f) state.SkipWithError("wrong GEMM result");
  }
  state.counters["GFLOP_per_s"] = benchmark::Counter(
      2.0 * T * K * N * 8 * threads * static_cast<double>(state.iterations()) / 1e9,
      benchmark::Counter::kIsRate);
}
BENCHMARK(BM_GemmCeiling)->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_TriadCeiling(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  constexpr std::size_t n = 8u << 20;  // 3 arrays x 32 MiB per thread: far beyond the caches
  std::vector<std::vector<float>> a(threads, std::vector<float>(n)), b(threads, std::vector<float>(n, 1.0f)),
      c(threads, std::vector<float>(n, 2.0f));
  for (auto _ : state) {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        float* __restrict pa = a[t].data();
        const float* __restrict pb = b[t].data();
        const float* __restrict pc = c[t].data();
        for (std::size_t i = 0; i < n; ++i) pa[i] = pb[i] + 3.0f * pc[i];
      });
    for (auto& th : pool) th.join();
    benchmark::DoNotOptimize(a[0][n - 1]);
  }
  state.counters["GB_per_s"] = benchmark::Counter(
      3.0 * sizeof(float) * n * threads * static_cast<double>(state.iterations()) / 1e9,
      benchmark::Counter::kIsRate);
}
BENCHMARK(BM_TriadCeiling)->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_Llama42M_Prefill(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  double tokens = 0, seconds = 0;
  for (auto _ : state) {
    // steps = prompt length: the prefill of 512 tokens and one sampled token.
    const auto rep = decode_run(1, threads, 1, 512, 512).report;
    tokens += 512;
    seconds += rep.sequences[0].ttft_s;
  }
  state.counters["prefill_tokens_per_s"] = tokens / seconds;
  cpu::set_blas_threads(1);
}
BENCHMARK(BM_Llama42M_Prefill)->ArgName("threads")->Arg(1)->Arg(2)
    ->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);

void BM_Llama42M_Decode(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const auto dtype = static_cast<DType>(state.range(1));
  state.SetLabel(std::string(to_string(dtype)) + " weights");
  double tps = 0;
  for (auto _ : state) {
    const auto rep = decode_run(1, threads, 1, 129, 1, 0, false, dtype).report;
    tps += 1.0 / rep.sequences[0].tpot_s();
  }
  const double rate = tps / static_cast<double>(state.iterations());
  state.counters["decode_tokens_per_s"] = rate;
  // The weight stream: compare with BM_TriadCeiling's GB_per_s of the same run.
  state.counters["weight_GB_per_s"] = rate * weight_bytes_per_token(dtype) * 1e-9;
  cpu::set_blas_threads(1);
}
// dtype: the brigade::DType of the matrices (0 f32, 1 f16, 2 bf16, 5 q8_0).
BENCHMARK(BM_Llama42M_Decode)->ArgNames({"threads", "dtype"})
    ->ArgsProduct({{1, 2}, {static_cast<int>(DType::F32), static_cast<int>(DType::F16),
                            static_cast<int>(DType::BF16), static_cast<int>(DType::Q8_0)}})
    ->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);

/// The calibrated model's prediction error on held-out work: a device profile measured once in
/// this run (cost::measure_profile: synthetic shapes, not the model), then the 42M model on one
/// stage of one thread: seqs sequences decoding 48 tokens (or one 512-token prefill when seqs
/// is 0). Each F interval (prefill, or every decode round) is predicted by
/// cost::LatencyEstimator from the profile alone (prior) and after observing the previous
/// iteration's run (refined, online). Counters: median |predicted/measured - 1| of both, and
/// the mean predicted/measured of the prior.
void BM_CalibratedPrediction(benchmark::State& state) {
  const int seqs = static_cast<int>(state.range(0));
  const model::ModelSpec spec(weights42m().config);
  cost::ProfileOptions one;
  one.cores = 1;
  static const cost::DeviceProfile profile = cost::measure_profile(one);
  cost::LatencyEstimator est(spec, cost::ProfiledLayerTimes(profile));
  std::vector<double> prior, refined;
  bool first = true;
  for (auto _ : state) {
    const auto run = seqs > 0 ? decode_run(1, 1, seqs, 48, 1) : decode_run(1, 1, 1, 512, 512);
    for (const auto& iv : run.report.timeline.intervals()) {
      if (iv.op != Op::F || (seqs > 0) != (iv.chunk > 0)) continue;
      prior.push_back(est.prior(run.plan, iv) / iv.duration());
      if (!first) refined.push_back(est.predict(run.plan, iv) / iv.duration());
    }
    est.observe(run.plan, run.report.timeline);
    first = false;
  }
  double mean = 0;
  for (double x : prior) mean += x;
  state.counters["prior_over_measured"] = mean / static_cast<double>(prior.size());
  state.counters["prior_err"] = bench::median_error(prior);
  state.counters["refined_err"] = bench::median_error(refined);
}
BENCHMARK(BM_CalibratedPrediction)->ArgName("seqs")->Arg(0)->Arg(1)->Arg(8)->Arg(32)
    ->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);

/// One evaluation of the rebalancer's decision (see the header): threshold 0 and patience 1
/// so that every call evaluates, min_gain 0.99 so that none moves a layer and every call
/// does the same work.
void BM_RebalanceDecide(benchmark::State& state) {
  const int S = static_cast<int>(state.range(0));
  const auto& w = weights42m();
  const model::ModelSpec spec(w.config);
  serve::RebalanceOptions o;
  o.threshold = 0.0;
  o.patience = 1;
  o.warmup = 0;
  o.min_gain = 0.99;
  serve::Rebalancer rb(w, partition::uniform(spec, S), S, std::size_t{1} << 20, o);
  constexpr int kRounds = 64;
  std::vector<serve::RoundFeatures> recent;
  for (int r = 0; r < kRounds; ++r)
    for (int m = 0; m < S; ++m) {
      serve::RoundFeatures f;
      f.microbatch = m;
      f.round = r;
      f.decode_seqs = 8;
      f.decode_context = 100.0 + r;
      f.sampled = 8;
      recent.push_back(f);
      for (int v = 0; v < S; ++v)  // the tail stage 1.5x the others: a standing imbalance
        rb.observe(v, f, (v == S - 1 ? 1.5e-3 : 1e-3) * (1.0 + 0.01 * (r % 7)));
    }
  int evaluated = 0;
  double seconds = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto order = rb.decide(kRounds, 0.0, recent, 8 * S * 100);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (order) state.SkipWithError("the rebalancer moved a layer at min_gain 0.99");
    ++evaluated;
  }
  const auto ref = decode_run(S, 1, 8 * S, 48, 1, S).report;
  const double round_s = ref.wall_s / 48.0;
  state.counters["decide_us"] = 1e6 * seconds / evaluated;
  state.counters["decode_round_ms"] = 1e3 * round_s;
  state.counters["share_of_round"] = seconds / evaluated / round_s;
  cpu::set_blas_threads(1);
}
BENCHMARK(BM_RebalanceDecide)->ArgName("stages")->Arg(2)->Arg(4)
    ->Unit(benchmark::kMicrosecond)->UseRealTime();

/// The 42M synthetic model written once as a llama2.c file and mapped back (what `brigade
/// generate --model FILE` does), so PREFETCH/RELEASE act on real file pages.
const model::LlamaWeights& mapped42m() {
  static const model::LlamaWeights w = [] {
    const auto path = std::filesystem::temp_directory_path() /
                      ("brigade_bench_42m_" + std::to_string(::getpid()) + ".bin");
    model::save_llama2c_checkpoint(path, weights42m());
    auto mapped = model::load_llama2c_checkpoint(path);
    std::filesystem::remove(path);  // the mapping keeps the pages; the name is not needed
    return mapped;
  }();
  return w;
}

void BM_RingOffload(benchmark::State& state) {
  // prima.cpp's pipelined ring: 2 ranks x 2 windows of the mapped 42M model, 8 sequences in 2
  // groups decode 32 positions; offload:1 RELEASEs and PREFETCHes every window each round
  // (madvise DONTNEED / WILLNEED; the file stays in the page cache, so this is the cost of the
  // advice and of faulting the pages back in, not of a disk).
  const bool offload = state.range(0) != 0;
  const auto& w = mapped42m();
  const model::ModelSpec spec(w.config);
  const std::vector<int> windows(4, w.config.n_layers / 4);  // 2 ranks x 2 windows
  const auto part = partition::ring_partition(spec, 2, windows);
  std::vector<engine::GenerationRequest> reqs;
  for (int i = 0; i < 8; ++i) reqs.push_back({{1, 300 + 7 * i}, 32});
  engine::InferenceOptions opt;
  opt.sampler.temperature = 0.0f;
  opt.microbatches = 2;
  opt.weight_offload = offload;
  double tokens = 0, seconds = 0, prefetch_s = 0, release_s = 0, forward_s = 0;
  for (auto _ : state) {
    const auto rep = engine::generate(w, part, reqs, opt);
    tokens += static_cast<double>(rep.generated_tokens);
    seconds += rep.wall_s;
    for (const auto& iv : rep.timeline.intervals()) {
      if (iv.op == Op::Prefetch) prefetch_s += iv.duration();
      if (iv.op == Op::Release) release_s += iv.duration();
      if (iv.op == Op::F) forward_s += iv.duration();
    }
  }
  state.counters["tokens_per_s"] = tokens / seconds;
  state.counters["prefetch_s_per_token"] = prefetch_s / tokens;
  state.counters["release_s_per_token"] = release_s / tokens;
  state.counters["forward_s_per_token"] = forward_s / tokens;
}
BENCHMARK(BM_RingOffload)->ArgName("offload")->Arg(0)->Arg(1)
    ->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);

}  // namespace

int main(int argc, char** argv) { return brigade::bench::run_benchmarks(argc, argv); }
