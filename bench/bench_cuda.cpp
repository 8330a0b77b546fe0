// GPU benchmarks of brigade::cuda (built only with the component; scripts/device_check.sh runs
// them on a lent GPU machine).
//
// Scenarios, in registration order (the layer benchmarks read the peak measured first):
//   BM_GemmBf16/M/N/K        cuBLAS bf16 x bf16 -> bf16 GEMM, fp32 accumulation, through
//                            CudaBackend::matmul_wt: the "measured bf16 GEMM peak" is the best
//                            TFLOP/s over these shapes (8192^3 and the 8B layer's own shapes)
//   BM_LayerPrefillBf16      one Llama-3-8B-shaped decoder layer (dim 4096, 32 heads, 8 KV heads,
//                            hidden 14336) on a 2048-token prefill in bf16: TFLOP/s and the
//                            fraction of the measured peak
//   BM_LayerDecodeBf16       the same layer, 64 sequences decoding one token at context 2048:
//                            time per step and weight bytes read per second
//
// Units and formulas: times come from CUDA events around each run (UseManualTime). FLOPs of the
// layer are the useful ones: 2*T*(dim*(dim + 2*kv_dim) + dim*dim + 3*dim*hidden) for the GEMMs
// plus 4*n_heads*head_size*T*(T+1)/2 for causal attention (QK^T and PV over the visible keys
// only). fraction_of_peak = layer TFLOP/s / peak TFLOP/s, with the peak from the same run.
// Correctness guard: every benchmark checks its output is finite and fails otherwise.
#include <brigade/backend/cuda.hpp>
#include <brigade/model/config.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <vector>

namespace {

using brigade::cuda::CudaBackend;
using brigade::cuda::DeviceBuffer;
using brigade::DType;
using brigade::cuda::Event;

double g_peak_tflops = 0.0;     // best BM_GemmBf16 result of this run
double g_prefill_tflops = 0.0;  // last BM_LayerPrefillBf16 result
double g_prefill_ms = 0.0;
double g_decode_ms = 0.0;

CudaBackend& gpu() {
  static CudaBackend backend;
  return backend;
}

/// Times `run` with CUDA events around it, for each benchmark iteration; returns mean seconds.
template <class F>
double timed_loop(benchmark::State& state, F&& run) {
  Event start, stop;
  run();  // warm-up: handles, workspaces, scratch growth stay out of the timings
  gpu().synchronize();
  double total = 0.0;
  for (auto _ : state) {
    start.record(gpu().stream());
    run();
    stop.record(gpu().stream());
    stop.synchronize();
    const double s = static_cast<double>(stop.elapsed_ms_since(start)) * 1e-3;
    state.SetIterationTime(s);
    total += s;
  }
  return total / static_cast<double>(std::max<std::int64_t>(state.iterations(), 1));
}

/// True when every sampled element of a float32 device array is finite.
bool finite_sample(const float* device, std::int64_t n) {
  std::vector<float> host(static_cast<std::size_t>(std::min<std::int64_t>(n, 4096)));
  gpu().download(host.data(), device, host.size() * sizeof(float));
  return std::all_of(host.begin(), host.end(), [](float v) { return std::isfinite(v); });
}

void BM_GemmBf16(benchmark::State& state) {
  const std::int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  DeviceBuffer a = gpu().allocate(static_cast<std::size_t>(m * k) * 2);
  DeviceBuffer b = gpu().allocate(static_cast<std::size_t>(n * k) * 2);
  DeviceBuffer c = gpu().allocate(static_cast<std::size_t>(m * n) * 2);
  DeviceBuffer c32 = gpu().allocate(static_cast<std::size_t>(m * n) * 4);
  gpu().fill_random(a.data(), DType::BF16, m * k, 1, 1.0f);  // random data: zeros run faster
  gpu().fill_random(b.data(), DType::BF16, n * k, 2, 1.0f);
  const double s = timed_loop(state, [&] {
    gpu().matmul_wt(a.data(), b.data(), DType::BF16, c.data(), DType::BF16, m, k, n);
  });
  gpu().convert(c.data(), DType::BF16, c32.data(), DType::F32, m * n);
  if (!finite_sample(c32.as<float>(), m * n)) state.SkipWithError("non-finite GEMM output");
  const double tflops =
      2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) / s * 1e-12;
  g_peak_tflops = std::max(g_peak_tflops, tflops);
  state.counters["TFLOP_per_s"] = tflops;
}
BENCHMARK(BM_GemmBf16)
    ->ArgNames({"M", "N", "K"})
    ->Args({8192, 8192, 8192})
    ->Args({2048, 6144, 4096})   // the layer's fused QKV projection
    ->Args({2048, 28672, 4096})  // W1|W3
    ->Args({2048, 4096, 14336})  // W2
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

/// A Llama-3-8B decoder layer's shapes.
brigade::model::LlamaConfig layer_config() {
  brigade::model::LlamaConfig c;
  c.dim = 4096;
  c.hidden_dim = 14336;
  c.n_layers = 1;
  c.n_heads = 32;
  c.n_kv_heads = 8;
  c.vocab_size = 128256;
  c.seq_len = 8192;
  c.rope_theta = 500000.0f;
  return c;
}

/// Random bf16 weights of one layer, made on the GPU (std 0.02 uniform), gains 1.
brigade::cuda::DeviceDecoderWeights random_layer(const brigade::model::LlamaConfig& c) {
  brigade::cuda::DeviceDecoderWeights w;
  const std::int64_t dim = c.dim, kv = c.kv_dim(), h = c.hidden_dim;
  w.dtype = DType::BF16;
  const std::vector<float> ones(static_cast<std::size_t>(dim), 1.0f);
  w.rms_att = gpu().allocate(ones.size() * 4);
  w.rms_ffn = gpu().allocate(ones.size() * 4);
  w.rms_att.copy_from_host(ones.data(), ones.size() * 4);
  w.rms_ffn.copy_from_host(ones.data(), ones.size() * 4);
  const float scale = 0.02f * std::sqrt(3.0f);
  auto matrix = [&](DeviceBuffer& b, std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
    b = gpu().allocate(static_cast<std::size_t>(rows * cols) * 2);
    gpu().fill_random(b.data(), DType::BF16, rows * cols, seed, scale);
  };
  matrix(w.wqkv, dim + 2 * kv, dim, 11);
  matrix(w.wo, dim, dim, 12);
  matrix(w.w13, 2 * h, dim, 13);
  matrix(w.w2, dim, h, 14);
  return w;
}

double layer_flops(const brigade::model::LlamaConfig& c, double tokens, double pos0) {
  const double dim = c.dim, kv = c.kv_dim(), h = c.hidden_dim;
  const double gemm = 2.0 * tokens * (dim * (dim + 2.0 * kv) + dim * dim + 3.0 * dim * h);
  // Visible keys summed over the new rows: sum_{t} (pos0 + t + 1).
  const double keys = tokens * pos0 + tokens * (tokens + 1.0) / 2.0;
  const double attn = 4.0 * c.n_heads * c.head_size() * keys;
  return gemm + attn;
}

void BM_LayerPrefillBf16(benchmark::State& state) {
  const auto c = layer_config();
  const std::int64_t tokens = state.range(0);
  const auto w = random_layer(c);
  const std::int64_t kv_dim = c.kv_dim();
  DeviceBuffer k = gpu().allocate(static_cast<std::size_t>(tokens * kv_dim) * 2);
  DeviceBuffer v = gpu().allocate(static_cast<std::size_t>(tokens * kv_dim) * 2);
  DeviceBuffer x = gpu().allocate(static_cast<std::size_t>(tokens * c.dim) * 4);
  DeviceBuffer x0 = gpu().allocate(x.size());
  gpu().fill_random(x0.data(), DType::F32, tokens * c.dim, 3, 1.0f);
  const brigade::backend::SequenceSlice slice{0, 0, static_cast<std::int32_t>(tokens)};
  const std::int64_t first[1] = {0};
  const int capacity[1] = {static_cast<int>(tokens)};
  const brigade::backend::KvCacheView cache{k.data(), v.data(), DType::BF16, kv_dim, first,
                                            capacity};
  const double s = timed_loop(state, [&] {
    gpu().copy(x.data(), x0.data(), x.size());  // same input every run (2048 x 4096 x 4 bytes)
    gpu().decoder_layer_forward(c, w, x.as<float>(), tokens, {&slice, 1}, cache);
  });
  if (!finite_sample(x.as<float>(), tokens * c.dim)) state.SkipWithError("non-finite layer output");
  const double tflops = layer_flops(c, static_cast<double>(tokens), 0.0) / s * 1e-12;
  g_prefill_tflops = tflops;
  g_prefill_ms = s * 1e3;
  state.counters["TFLOP_per_s"] = tflops;
  state.counters["peak_TFLOP_per_s"] = g_peak_tflops;
  state.counters["fraction_of_peak"] = g_peak_tflops > 0 ? tflops / g_peak_tflops : 0.0;
  state.counters["tokens_per_s"] = static_cast<double>(tokens) / s;
}
BENCHMARK(BM_LayerPrefillBf16)
    ->ArgNames({"tokens"})
    ->Arg(2048)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

void BM_LayerDecodeBf16(benchmark::State& state) {
  const auto c = layer_config();
  const std::int64_t seqs = state.range(0), context = state.range(1);
  const auto w = random_layer(c);
  const std::int64_t kv_dim = c.kv_dim();
  DeviceBuffer kv = gpu().allocate(static_cast<std::size_t>(2 * seqs * (context + 1) * kv_dim) * 2);
  gpu().fill_random(kv.data(), DType::BF16, 2 * seqs * (context + 1) * kv_dim, 4, 1.0f);
  DeviceBuffer x = gpu().allocate(static_cast<std::size_t>(seqs * c.dim) * 4);
  DeviceBuffer x0 = gpu().allocate(x.size());
  gpu().fill_random(x0.data(), DType::F32, seqs * c.dim, 5, 1.0f);
  // Sequence i's (context + 1) rows at row i (context + 1) of the keys (the first half of kv)
  // and of the values (the second half).
  std::vector<brigade::backend::SequenceSlice> slices;
  std::vector<std::int64_t> first;
  std::vector<int> capacity;
  for (std::int64_t i = 0; i < seqs; ++i) {
    slices.push_back({static_cast<std::int32_t>(i), static_cast<std::int32_t>(context), 1});
    first.push_back(i * (context + 1));
    capacity.push_back(static_cast<int>(context + 1));
  }
  auto* base = static_cast<char*>(kv.data());
  const brigade::backend::KvCacheView cache{
      base, base + static_cast<std::size_t>(seqs * (context + 1) * kv_dim) * 2, DType::BF16,
      kv_dim, first, capacity};
  const double s = timed_loop(state, [&] {
    gpu().copy(x.data(), x0.data(), x.size());
    gpu().decoder_layer_forward(c, w, x.as<float>(), seqs, slices, cache);
  });
  if (!finite_sample(x.as<float>(), seqs * c.dim)) state.SkipWithError("non-finite layer output");
  const double weight_bytes = 2.0 * (static_cast<double>(c.dim) * (c.dim + 2.0 * kv_dim) +
                                     1.0 * c.dim * c.dim + 3.0 * c.dim * c.hidden_dim);
  const double kv_bytes = 2.0 * 2.0 * static_cast<double>(seqs) * (context + 1.0) * kv_dim;
  g_decode_ms = s * 1e3;
  state.counters["GB_per_s_weights_and_kv"] = (weight_bytes + kv_bytes) / s * 1e-9;
  state.counters["tokens_per_s"] = static_cast<double>(seqs) / s;
}
BENCHMARK(BM_LayerDecodeBf16)
    ->ArgNames({"seqs", "context"})
    ->Args({64, 2048})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  const auto info = brigade::cuda::probe_devices();
  if (!info.available) {
    std::printf("no CUDA device: %s; skipping\n", info.reason.c_str());
    return 77;
  }
  std::printf("device: %s (compute capability %d.%d)\n", info.name.c_str(), info.compute_major,
              info.compute_minor);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  std::printf("\nsummary: measured bf16 GEMM peak %.1f TFLOP/s\n", g_peak_tflops);
  if (g_prefill_tflops > 0)
    std::printf(
        "summary: 8B-shaped layer, 2048-token bf16 prefill: %.3f ms, %.1f TFLOP/s = %.1f%% "
        "of the measured peak (target >= 50%%)\n",
        g_prefill_ms, g_prefill_tflops,
        g_peak_tflops > 0 ? 100.0 * g_prefill_tflops / g_peak_tflops : 0.0);
  if (g_decode_ms > 0)
    std::printf("summary: 8B-shaped layer, 64-sequence decode at context 2048: %.3f ms per step\n",
                g_decode_ms);
  return 0;
}
