// The cost of refusing non-finite numbers (issue 9), measured beside what it protects.
//
// Scenarios (docs/benchmarks.md, "Non-finite checks"):
//   BM_FirstNonFinite/floats:N   first_non_finite() over N finite floats (cache-resident for
//       small N): bytes_per_s is the scan rate.
//   BM_DecodeCheckShare/seqs:N   `brigade generate --synthetic 42M`, 1 stage, 1 thread, N one-token
//       prompts decoding 48 positions; in the same iteration, the same number of check_finite()
//       calls on buffers of the shapes the stage checks (every layer's output: [rows x dim] for
//       the embedding, each decoder and the final norm, [rows x vocab] for the logits).
//       check_share = time of those checks / time of the run that already includes them.
//   BM_WeightScan42M             the load-time scan of every weight of the 42M model (the
//       loader's check_finite_weights work), beside one decode step of the same model
//       (scan_over_decode_step = scan time / time of one position of one sequence).
//
// Scenario (docs/benchmarks.md, "Integrity checks"):
//   BM_SentinelCheck/rows:R/cols:C/minor:M  VerifyingTransport's check of one received f32
//       [R, C] message (SentinelMonitor::observe of a stream past its warm-up: statistics, score,
//       verdict, EMA update; with M = 1 also minor-share, as on a gradient stream: its GEMM and
//       the MinorSubspace's learning, its eigendecompositions amortized), beside the memcpy of
//       the same bytes into the receive buffer that precedes it in the same iteration (as a
//       receive does; the check then reads the buffer): check_over_memcpy = check time / memcpy
//       time; check_us = microseconds per message.
#include <brigade/core/finite.hpp>
#include <brigade/engine/inference.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/partition/partition.hpp>
#include <brigade/transport/verify.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <vector>

using namespace brigade;

namespace {

const model::LlamaWeights& weights42m() {
  static const model::LlamaWeights w = model::make_synthetic_weights(model::named_config("42M"), 1234);
  return w;
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void BM_FirstNonFinite(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  std::vector<float> x(n, 0.5f);
  for (auto _ : state) benchmark::DoNotOptimize(first_non_finite(x.data(), n));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(n * sizeof(float)));
}
BENCHMARK(BM_FirstNonFinite)->ArgName("floats")->Arg(512 * 8)->Arg(32000 * 8)->Arg(1 << 24);

engine::InferenceReport decode(int seqs, int steps) {
  const auto& w = weights42m();
  const model::ModelSpec spec(w.config);
  const auto part = partition::uniform(spec, 1);
  std::vector<engine::GenerationRequest> reqs(static_cast<std::size_t>(seqs),
                                              engine::GenerationRequest{{1}, steps});
  engine::InferenceOptions opt;
  opt.sampler.temperature = 0.0f;
  opt.blas_threads = 1;
  return engine::generate(w, part, reqs, opt);
}

void BM_DecodeCheckShare(benchmark::State& state) {
  const int seqs = static_cast<int>(state.range(0));
  constexpr int kSteps = 48;
  const auto& c = weights42m().config;
  // One micro-batch of `seqs` rows per position (1 stage: every sequence in one group).
  std::vector<float> act(static_cast<std::size_t>(seqs) * c.dim, 0.5f),
      logits(static_cast<std::size_t>(seqs) * c.vocab_size, 0.5f);
  double run_s = 0, check_s = 0;
  for (auto _ : state) {
    const double t0 = now();
    const auto rep = decode(seqs, kSteps);
    const double t1 = now();
    for (int pos = 0; pos < kSteps; ++pos) {
      for (int l = 0; l < c.n_layers + 2; ++l)
        check_finite(act.data(), seqs, c.dim, [] { return std::string(); },
                     [](std::int64_t) { return std::string(); });
      check_finite(logits.data(), seqs, c.vocab_size, [] { return std::string(); },
                   [](std::int64_t) { return std::string(); });
    }
    const double t2 = now();
    run_s += t1 - t0;
    check_s += t2 - t1;
    benchmark::DoNotOptimize(rep.generated_tokens);
  }
  state.counters["check_share"] = check_s / run_s;
  state.counters["check_us_per_position"] = check_s / state.iterations() / kSteps * 1e6;
}
BENCHMARK(BM_DecodeCheckShare)->ArgName("seqs")->Arg(1)->Arg(8)->Unit(benchmark::kMillisecond)
    ->UseRealTime()->Iterations(3);

void BM_WeightScan42M(benchmark::State& state) {
  const auto& w = weights42m();
  const auto& c = w.config;
  // The model's weights are one buffer: scan from the embedding to the end of rms_final.
  const float* first = w.token_embedding.f32();
  const auto n = static_cast<std::size_t>(w.rms_final + c.dim - first);
  double scan_s = 0;
  for (auto _ : state) {
    const double t0 = now();
    benchmark::DoNotOptimize(first_non_finite(first, n));
    scan_s += now() - t0;
  }
  const auto rep = decode(1, 16);
  const double step_s = rep.wall_s / 16;
  state.counters["GB_per_s"] = static_cast<double>(n) * 4 / (scan_s / state.iterations()) / 1e9;
  state.counters["scan_over_decode_step"] = scan_s / state.iterations() / step_s;
}
BENCHMARK(BM_WeightScan42M)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(5);

void BM_SentinelCheck(benchmark::State& state) {
  const auto rows = state.range(0), cols = state.range(1);
  const auto n = static_cast<std::size_t>(rows * cols);
  // Different messages of one stream (hidden-state-like: per-channel means and spreads), as
  // many as fit in 4 MiB (8 to 256; the sources stay in cache, as a transport's would), cycled;
  // 300 learned first (past warm-up and calibration). As on a receive: the transport copies the
  // message into the receive buffer (the memcpy), then the check reads the buffer.
  std::mt19937_64 g(7);
  std::normal_distribution<float> nd;
  std::vector<float> mu(static_cast<std::size_t>(cols)), sd(mu.size());
  for (std::size_t c = 0; c < mu.size(); ++c) {
    mu[c] = nd(g);
    sd[c] = 0.5f + std::fabs(nd(g));
  }
  const std::size_t count = std::clamp<std::size_t>((std::size_t{4} << 20) / (n * sizeof(float)), 8, 256);
  std::vector<std::vector<float>> msgs(count, std::vector<float>(n));
  for (auto& m : msgs)
    for (std::size_t i = 0; i < n; ++i) m[i] = mu[i % mu.size()] + sd[i % mu.size()] * nd(g);
  const bool minor = state.range(2) != 0;
  transport::SentinelMonitor monitor(transport::SentinelConfig{}, minor);
  // Past warm-up and, with minor-share, past the subspace's first basis (its ring of recent
  // messages, then 4 p rows in the covariance, at most 32 rows of each message) and the
  // statistic's own warm-up.
  const std::int64_t p = std::min<std::int64_t>(cols, transport::MinorSubspace::kDims);
  const std::int64_t warm = std::max<std::int64_t>(
      300, transport::MinorSubspace::kRecent +
               transport::MinorSubspace::kRefreshRows * p /
                   std::min<std::int64_t>(rows, transport::MinorSubspace::kRows) +
               100);
  for (std::int64_t i = 0; i < warm; ++i)
    monitor.observe(msgs[static_cast<std::size_t>(i) % msgs.size()], rows);
  std::vector<float> buffer(n);
  double check_s = 0, copy_s = 0;
  std::size_t k = 0, flagged = 0;
  for (auto _ : state) {
    const auto& x = msgs[k++ % msgs.size()];
    const double t0 = now();
    std::memcpy(buffer.data(), x.data(), n * sizeof(float));
    benchmark::ClobberMemory();
    const double t1 = now();
    const auto a = monitor.observe(buffer, rows);
    const double t2 = now();
    flagged += a.flagged ? 1 : 0;
    copy_s += t1 - t0;
    check_s += t2 - t1;
  }
  state.counters["check_us"] = check_s / static_cast<double>(state.iterations()) * 1e6;
  state.counters["memcpy_us"] = copy_s / static_cast<double>(state.iterations()) * 1e6;
  state.counters["check_over_memcpy"] = check_s / copy_s;
  state.counters["flagged"] = static_cast<double>(flagged);
}
BENCHMARK(BM_SentinelCheck)->ArgNames({"rows", "cols", "minor"})->ArgsProduct({{256}, {512}, {0, 1}})
    ->ArgsProduct({{1}, {512}, {0, 1}})->ArgsProduct({{8}, {64}, {0, 1}})->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
