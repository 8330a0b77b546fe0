// CPU kernel benchmarks: one Llama decoder layer over a 512-token prefill, against plain SGEMM
// on the layer's largest shapes, all through brigade::cpu with one BLAS thread.
//
// Scenarios:
//   BM_DecoderLayerPrefill/dim:1024  hidden 2816, 16 heads, 16 KV heads (head_size 64)
//   BM_DecoderLayerPrefill/dim:2048  hidden 5632, 32 heads, 4 KV heads (TinyLlama-1.1B's layer)
//       one sequence, pos0 = 0, T = 512 tokens, random weights; each iteration restores the
//       residual stream (a 2-4 MiB copy, < 0.1% of the time) and runs decoder_layer_forward.
//   BM_Sgemm/T/in/out               matmul_wt(x[T x in], W[out x in]) for the layer's three
//       largest shapes: [512 x dim] W1^T (W3 alike), [512 x hidden] W2^T, [512 x dim] Wq^T.
//   BM_MatmulSmallM/T/in/out/path/woff  matmul_wt(x[T x in], W[out x in]) at decode sizes, T
//       in {1, 4, 8, 16, 32, 64}, on the 42M Llama's shapes (dim 512, hidden 1376, vocab 32000):
//       Wq/Wk/Wv/Wo 512x512, W1/W3 1376x512, W2 512x1376, classifier 32000x512.
//       path:0/1/2 is matmul_wt's small-M kernel built for generic C++ / AVX2+FMA / AVX-512
//       (skipped where the CPU lacks it; the label names it); path:3 the packing GEMM of larger
//       products (OpenBLAS SGEMM or Eigen's, per cpu::gemm_backend()), in this binary.
//       woff: W starts 0 or 28 bytes past a 64-byte line (28: where a llama2.c checkpoint's
//       mmap puts every tensor; the kernel's shifted loads, cpu_small_m_kernel.hpp).
//       Counters: GFLOP/s and weight_GB/s (W's bytes per second: the decode roofline's stream).
//   BM_DecodeSweep/T/path/prefetch  the 42M Llama's whole decode step of weight products (all 57
//       matrices and the classifier, 168 MB, streamed from memory as in decode) on T rows, with
//       the small-M kernel's W prefetches off and on (cpu::set_small_m_prefetch): the ratio of the
//       two in one run is the prefetches' gain.
//   BM_MatmulSmallMTyped/T/in/out/dtype  the same products with W kept in F32, F16, BF16 or
//       Q8_0 (dtype = brigade::DType 0, 1, 2, 5), on this CPU's widest small-M kernel (T <= 64;
//       T = 64 runs the GEMM on a dequantized copy where OpenBLAS takes T > 16): weight_GB/s
//       counts the narrow bytes.
//
// Times are CPU time (the default; one BLAS thread, so all work runs on the benchmark thread):
// on a shared machine they do not count time spent descheduled, unlike wall time.
//
// Counters:
//   GFLOP/s   counted FLOPs per CPU second. For the layer:
//               2*T*(2*dim*dim + 2*dim*kv_dim + 3*dim*hidden)   the seven projections
//             + 4*T*(T/2)*dim                                    attention: Q K^T and P V, one
//                                                                 multiply-add each per visible
//                                                                 key, T/2 keys per query on
//                                                                 average (causal)
//             RMSNorm, RoPE, softmax and SwiGLU are not counted (they are O(T*dim)).
//             For SGEMM and MatmulSmallM: 2*T*in*out.
//   sgemm_GFLOP/s (layer only) the FLOP-weighted SGEMM rate of the same three shapes, measured
//             once per shape in this process before the timed loop (best of 7 runs each).
//   vs_sgemm  (layer only) GFLOP/s / sgemm_GFLOP/s: how close the whole layer gets to plain GEMM
//             (both timed as thread CPU time; the layer's around the whole loop, copies included).
//
// Correctness guards (the benchmark fails with SkipWithError rather than report a fast wrong
// result): before timing, rows 0, 1, 65 and 200 of the layer output and of the K/V cache are
// compared to a naive double-precision reference of run.c's layer (relative error <= 1e-4); after
// timing, the last iteration's output must equal the first bit for bit. SGEMM checks one output
// entry per row block against a double dot product.
//
// Run: bench_kernels --benchmark_min_time=0.5
// (on a CPU newer than the installed OpenBLAS knows, also set OPENBLAS_CORETYPE; main() warns.)
#include "brigade/backend/cpu.hpp"
#include "brigade/backend/cpu_backend.hpp"
#include "brigade/backend/decoder.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/weights.hpp"

#include <Eigen/Core>
#include <cblas.h>
#include <benchmark/benchmark.h>

#include "machine_context.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

namespace cpu = brigade::cpu;
namespace model = brigade::model;
using brigade::DType;
using Vec = std::vector<float>;
constexpr std::int64_t kTokens = 512;

std::size_t sz(std::int64_t n) { return static_cast<std::size_t>(n); }

Vec random_vec(std::mt19937& rng, std::int64_t n, float a) {
  std::uniform_real_distribution<float> d(-a, a);
  Vec v(sz(n));
  for (float& x : v) x = d(rng);
  return v;
}

brigade::model::LlamaConfig layer_config(int dim) {
  brigade::model::LlamaConfig c;
  c.dim = dim;
  c.hidden_dim = dim == 1024 ? 2816 : 5632;
  c.n_heads = dim / 64;
  c.n_kv_heads = dim == 1024 ? 16 : 4;
  c.n_layers = 1;
  c.vocab_size = 32000;
  c.seq_len = static_cast<int>(kTokens);
  c.validate("bench layer");
  return c;
}

/// Counted FLOPs of one layer over T tokens (see the header comment).
double layer_flops(const brigade::model::LlamaConfig& c, std::int64_t T) {
  const double d = c.dim, kv = c.kv_dim(), h = c.hidden_dim, t = static_cast<double>(T);
  return 2.0 * t * (2.0 * d * d + 2.0 * d * kv + 3.0 * d * h) + 4.0 * t * (t / 2.0) * d;
}

/// CPU time of the calling thread in seconds: with one BLAS thread all the work runs here, and
/// unlike wall time it does not count time spent descheduled on a shared machine.
double thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

/// Thread CPU seconds of the best of `reps` calls of fn.
template <class F>
double best_seconds(int reps, F&& fn) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const double t0 = thread_seconds();
    fn();
    best = std::min(best, thread_seconds() - t0);
  }
  return best;
}

/// A layer's weights, input and caches; built once per shape.
struct LayerFixture {
  brigade::model::LlamaConfig cfg;
  Vec rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3;
  Vec x0, k_cache, v_cache;
  std::string error;        // non-empty when the reference check failed
  double sgemm_rate = 0.0;  // FLOP-weighted SGEMM rate of the three largest shapes, FLOP/s

  brigade::model::DecoderWeights view() const {
    return {rms_att.data(), wq.data(), wk.data(), wv.data(), wo.data(),
            rms_ffn.data(), w1.data(), w2.data(), w3.data()};
  }
};

/// Naive double reference of run.c's layer for selected output rows; compares `out` (the kernel's
/// output) and the kernel's caches, and returns an error message or "".
std::string check_against_reference(const LayerFixture& f, const Vec& out) {
  const auto& c = f.cfg;
  const std::int64_t dim = c.dim, kv = c.kv_dim(), hid = c.hidden_dim;
  const int hs = c.head_size(), kv_mul = c.n_heads / c.n_kv_heads;
  const std::vector<std::int64_t> rows{0, 1, 65, 200};
  const std::int64_t upto = rows.back() + 1;
  auto norm = [&](const double* x, const Vec& w, std::vector<double>& o) {
    double ss = 0.0;
    for (std::int64_t j = 0; j < dim; ++j) ss += x[j] * x[j];
    const double inv = 1.0 / std::sqrt(ss / double(dim) + double(c.norm_eps));
    o.resize(sz(dim));
    for (std::int64_t j = 0; j < dim; ++j) o[sz(j)] = w[sz(j)] * inv * x[j];
  };
  auto matvec = [](const Vec& w, const std::vector<double>& x, std::int64_t n_out,
                   std::int64_t n_in) {
    std::vector<double> y(sz(n_out), 0.0);
    for (std::int64_t i = 0; i < n_out; ++i) {
      const float* wr = w.data() + i * n_in;
      double acc = 0.0;
      for (std::int64_t j = 0; j < n_in; ++j) acc += double(wr[j]) * x[sz(j)];
      y[sz(i)] = acc;
    }
    return y;
  };
  auto rope = [&](std::vector<double>& v, std::int64_t p) {
    for (std::size_t i = 0; i < v.size(); i += 2) {
      const double a = double(p) * std::pow(double(c.rope_theta), -double(i % sz(hs)) / hs);
      const double v0 = v[i], v1 = v[i + 1];
      v[i] = v0 * std::cos(a) - v1 * std::sin(a);
      v[i + 1] = v0 * std::sin(a) + v1 * std::cos(a);
    }
  };
  auto rel_err = [](const std::vector<double>& ref, const float* got) {
    double err = 0.0, scale = 1e-30;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      if (!std::isfinite(got[i])) return 1e30;
      err = std::max(err, std::abs(ref[i] - double(got[i])));
      scale = std::max(scale, std::abs(ref[i]));
    }
    return err / scale;
  };
  // K and V of every row that a checked row can see.
  std::vector<std::vector<double>> K(sz(upto)), V(sz(upto));
  std::vector<double> x(sz(dim)), xb;
  for (std::int64_t t = 0; t < upto; ++t) {
    std::copy(f.x0.begin() + t * dim, f.x0.begin() + (t + 1) * dim, x.begin());
    norm(x.data(), f.rms_att, xb);
    K[sz(t)] = matvec(f.wk, xb, kv, dim);
    V[sz(t)] = matvec(f.wv, xb, kv, dim);
    rope(K[sz(t)], t);
  }
  for (std::int64_t t : rows) {
    if (rel_err(K[sz(t)], f.k_cache.data() + t * kv) > 1e-4 ||
        rel_err(V[sz(t)], f.v_cache.data() + t * kv) > 1e-4)
      return "K/V cache row " + std::to_string(t) + " differs from the double reference";
    std::copy(f.x0.begin() + t * dim, f.x0.begin() + (t + 1) * dim, x.begin());
    norm(x.data(), f.rms_att, xb);
    std::vector<double> q = matvec(f.wq, xb, dim, dim);
    rope(q, t);
    std::vector<double> att(sz(dim), 0.0);
    for (int h = 0; h < c.n_heads; ++h) {
      const std::int64_t ko = std::int64_t(h / kv_mul) * hs;
      std::vector<double> s(sz(t + 1));
      double mx = -1e300, sum = 0.0;
      for (std::int64_t j = 0; j <= t; ++j) {
        double acc = 0.0;
        for (int i = 0; i < hs; ++i) acc += q[sz(h * hs + i)] * K[sz(j)][sz(ko + i)];
        s[sz(j)] = acc / std::sqrt(double(hs));
        mx = std::max(mx, s[sz(j)]);
      }
      for (double& e : s) sum += (e = std::exp(e - mx));
      for (std::int64_t j = 0; j <= t; ++j)
        for (int i = 0; i < hs; ++i) att[sz(h * hs + i)] += s[sz(j)] / sum * V[sz(j)][sz(ko + i)];
    }
    const std::vector<double> o = matvec(f.wo, att, dim, dim);
    for (std::int64_t j = 0; j < dim; ++j) x[sz(j)] += o[sz(j)];
    norm(x.data(), f.rms_ffn, xb);
    std::vector<double> h1 = matvec(f.w1, xb, hid, dim);
    const std::vector<double> h3 = matvec(f.w3, xb, hid, dim);
    for (std::size_t i = 0; i < h1.size(); ++i) h1[i] = h1[i] / (1.0 + std::exp(-h1[i])) * h3[i];
    const std::vector<double> d = matvec(f.w2, h1, dim, hid);
    for (std::int64_t j = 0; j < dim; ++j) x[sz(j)] += d[sz(j)];
    const double e = rel_err(x, out.data() + t * dim);
    if (e > 1e-4)
      return "output row " + std::to_string(t) + " differs from the double reference (relative " +
             std::to_string(e) + ")";
  }
  return "";
}

/// The three largest GEMM shapes of a layer as {in, out} for x[T x in] W[out x in]^T.
std::vector<std::pair<std::int64_t, std::int64_t>> largest_shapes(
    const brigade::model::LlamaConfig& c) {
  return {{c.dim, c.hidden_dim}, {c.hidden_dim, c.dim}, {c.dim, c.dim}};
}

using Scratch = brigade::backend::DecoderBuffers<cpu::CpuBackend>;

/// One decoder layer on CpuBackend over the fixture's kTokens-row prefill (its one sequence's
/// KV cache: f.k_cache, f.v_cache, kTokens rows each).
void run_layer(LayerFixture& f, Vec& x, Scratch& scratch) {
  static const std::int64_t first_row[1] = {0};
  static const int capacity[1] = {static_cast<int>(kTokens)};
  const brigade::backend::SequenceSlice seq{0, 0, static_cast<std::int32_t>(kTokens)};
  const brigade::backend::KvCacheView cache{f.k_cache.data(), f.v_cache.data(),
                                            brigade::DType::F32, f.cfg.kv_dim(), first_row,
                                            capacity};
  cpu::CpuBackend b;
  brigade::backend::decoder_layer_forward(b, f.cfg, f.view(), x.data(), kTokens, {&seq, 1}, cache,
                                          scratch);
}

LayerFixture& fixture(int dim) {
  static std::map<int, std::unique_ptr<LayerFixture>> cache;
  auto& slot = cache[dim];
  if (slot) return *slot;
  slot = std::make_unique<LayerFixture>();
  LayerFixture& f = *slot;
  f.cfg = layer_config(dim);
  const std::int64_t d = dim, kv = f.cfg.kv_dim(), h = f.cfg.hidden_dim;
  std::mt19937 rng(static_cast<unsigned>(dim));
  const float a = 1.7f / std::sqrt(float(d)), b = 1.7f / std::sqrt(float(h));
  f.rms_att = random_vec(rng, d, 0.5f);
  f.rms_ffn = random_vec(rng, d, 0.5f);
  for (float& g : f.rms_att) g += 1.0f;
  for (float& g : f.rms_ffn) g += 1.0f;
  f.wq = random_vec(rng, d * d, a);
  f.wk = random_vec(rng, kv * d, a);
  f.wv = random_vec(rng, kv * d, a);
  f.wo = random_vec(rng, d * d, a);
  f.w1 = random_vec(rng, h * d, a);
  f.w3 = random_vec(rng, h * d, a);
  f.w2 = random_vec(rng, d * h, b);
  f.x0 = random_vec(rng, kTokens * d, 1.0f);
  f.k_cache.assign(sz(kTokens * kv), 0.0f);
  f.v_cache.assign(sz(kTokens * kv), 0.0f);

  // Correctness guard on one untimed run.
  Vec x = f.x0;
  Scratch scratch;
  run_layer(f, x, scratch);
  f.error = check_against_reference(f, x);

  // The comparison: plain SGEMM on the three largest shapes, FLOP-weighted.
  double flops = 0.0, secs = 0.0;
  for (auto [in, out] : largest_shapes(f.cfg)) {
    const Vec xs = random_vec(rng, kTokens * in, 1.0f), ws = random_vec(rng, out * in, 0.05f);
    Vec ys(sz(kTokens * out));
    secs += best_seconds(7, [&] { cpu::matmul_wt(xs.data(), ws.data(), ys.data(), kTokens, in, out); });
    flops += 2.0 * double(kTokens) * double(in) * double(out);
  }
  f.sgemm_rate = flops / secs;
  return f;
}

void BM_DecoderLayerPrefill(benchmark::State& state) {
  LayerFixture& f = fixture(static_cast<int>(state.range(0)));
  if (!f.error.empty()) {
    state.SkipWithError(f.error.c_str());
    return;
  }
  Vec x(f.x0.size()), first;
  Scratch scratch;
  const double t0 = thread_seconds();
  for (auto _ : state) {
    std::copy(f.x0.begin(), f.x0.end(), x.begin());
    run_layer(f, x, scratch);
    benchmark::DoNotOptimize(x.data());
    benchmark::ClobberMemory();
    if (first.empty()) first = x;
  }
  const double elapsed = thread_seconds() - t0;
  if (!first.empty() && first != x) {
    state.SkipWithError("the layer output changed between iterations");
    return;
  }
  const double flops = layer_flops(f.cfg, kTokens);
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["sgemm_GFLOP/s"] = f.sgemm_rate * 1e-9;
  const double rate = flops * double(state.iterations()) / elapsed;
  state.counters["vs_sgemm"] = rate / f.sgemm_rate;
  state.counters["tokens/s"] =
      benchmark::Counter(double(kTokens), benchmark::Counter::kIsIterationInvariantRate);
  state.SetItemsProcessed(state.iterations() * kTokens);
}

void BM_Sgemm(benchmark::State& state) {
  const std::int64_t T = state.range(0), in = state.range(1), out = state.range(2);
  std::mt19937 rng(static_cast<unsigned>(in * 7 + out));
  const Vec x = random_vec(rng, T * in, 1.0f), w = random_vec(rng, out * in, 0.05f);
  Vec y(sz(T * out));
  for (auto _ : state) {
    cpu::matmul_wt(x.data(), w.data(), y.data(), T, in, out);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  for (std::int64_t r = 0; r < T; r += 97) {
    const std::int64_t n = (r * 31) % out;
    double ref = 0.0, mag = 0.0;
    for (std::int64_t k = 0; k < in; ++k) {
      ref += double(x[sz(r * in + k)]) * double(w[sz(n * in + k)]);
      mag += std::abs(double(x[sz(r * in + k)]) * double(w[sz(n * in + k)]));
    }
    if (!(std::abs(ref - double(y[sz(r * out + n)])) <= 1e-5 * mag)) {
      state.SkipWithError("SGEMM output differs from a double dot product");
      return;
    }
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * double(T) * double(in) * double(out) * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

/// One output per row of y ([T x out] = x W^T) against a double dot product (relative to the
/// sum of |products|).
bool matches_double(const Vec& x, const Vec& w, const Vec& y, std::int64_t T, std::int64_t in,
                    std::int64_t out) {
  for (std::int64_t r = 0; r < T; ++r) {
    const std::int64_t n = (r * 131 + 7) % out;
    double ref = 0.0, mag = 0.0;
    for (std::int64_t k = 0; k < in; ++k) {
      ref += double(x[sz(r * in + k)]) * double(w[sz(n * in + k)]);
      mag += std::abs(double(x[sz(r * in + k)]) * double(w[sz(n * in + k)]));
    }
    if (!(std::abs(ref - double(y[sz(r * out + n)])) <= 1e-5 * mag)) return false;
  }
  return true;
}

/// GFLOP/s, and weight_GB/s: W's bytes (`bytes_per_weight` each) per second, the decode
/// roofline's stream, against the triad bandwidth (ceiling_triad_GBs_1core in the context).
void set_small_m_counters(benchmark::State& state, std::int64_t T, std::int64_t in,
                          std::int64_t out, double bytes_per_weight) {
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * double(T) * double(in) * double(out) * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["weight_GB/s"] =
      benchmark::Counter(double(out) * double(in) * bytes_per_weight * 1e-9,
                         benchmark::Counter::kIsIterationInvariantRate);
}

void BM_MatmulSmallM(benchmark::State& state) {
  // path: 0-2 = matmul_wt with the small-M kernel of that instruction set (cpu::KernelIsa:
  // generic, avx2, avx512), 3 = the packing GEMM matmul_wt runs above 64 rows (OpenBLAS SGEMM
  // or Eigen's, per cpu::gemm_backend()).
  const std::int64_t T = state.range(0), in = state.range(1), out = state.range(2);
  const std::int64_t path = state.range(3), woff = state.range(4);
  const bool eigen = path == 3;
  const auto isa = static_cast<cpu::KernelIsa>(eigen ? 0 : path);
  if (!cpu::kernel_isa_supported(isa)) {
    state.SkipWithError("this CPU has no such instruction set");
    return;
  }
  const cpu::KernelIsa isa_before = cpu::kernel_isa();
  cpu::set_kernel_isa(isa);
  const bool blas = cpu::gemm_backend() == cpu::GemmBackend::Blas;
  state.SetLabel(eigen ? (blas ? "openblas-sgemm" : "eigen-gemm") : std::string(cpu::to_string(isa)));
  std::mt19937 rng(static_cast<unsigned>(in * 7 + out + T));
  const Vec x = random_vec(rng, T * in, 1.0f), w = random_vec(rng, out * in, 0.05f);
  Vec y(sz(T * out));
  // W placed `woff` bytes past a 64-byte line (28: where a llama2.c checkpoint puts every tensor)
  Vec w_storage(w.size() + 32);
  float* wp = reinterpret_cast<float*>(
                  (reinterpret_cast<std::uintptr_t>(w_storage.data()) + 63) / 64 * 64) +
              woff / 4;
  std::copy(w.begin(), w.end(), wp);
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  auto run = [&] {
    if (eigen && blas) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(T),
                  static_cast<blasint>(out), static_cast<blasint>(in), 1.0f, x.data(),
                  static_cast<blasint>(in), wp, static_cast<blasint>(in), 0.0f, y.data(),
                  static_cast<blasint>(out));
    } else if (eigen) {
      Eigen::Map<RowMat> o(y.data(), T, out);
      o.noalias() = Eigen::Map<const RowMat>(x.data(), T, in) *
                    Eigen::Map<const RowMat>(wp, out, in).transpose();
    } else {
      cpu::matmul_wt(x.data(), wp, y.data(), T, in, out);
    }
  };
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  cpu::set_kernel_isa(isa_before);
  if (!matches_double(x, w, y, T, in, out)) {
    state.SkipWithError("matmul_wt output differs from a double dot product");
    return;
  }
  set_small_m_counters(state, T, in, out, sizeof(float));
}

void BM_MatmulSmallMTyped(benchmark::State& state) {
  // matmul_wt with W kept in dtype (brigade::DType: 0 F32, 1 F16, 2 BF16, 5 Q8_0), on this CPU's
  // widest small-M kernel (cpu::kernel_isa(), the label): the kernel reads the narrow type.
  const std::int64_t T = state.range(0), in = state.range(1), out = state.range(2);
  const auto dtype = static_cast<DType>(state.range(3));
  state.SetLabel(std::string(cpu::to_string(cpu::kernel_isa())) + " " +
                 std::string(to_string(dtype)));
  std::mt19937 rng(static_cast<unsigned>(in * 7 + out + T));
  const Vec x = random_vec(rng, T * in, 1.0f), w = random_vec(rng, out * in, 0.05f);
  std::vector<std::byte> typed(sz(out) * model::weight_row_bytes(dtype, in));
  model::quantize_rows(w.data(), out, in, dtype, typed.data());
  Vec deq(w.size()), y(sz(T * out));
  model::dequantize_rows({typed.data(), dtype}, in, 0, out, deq.data());
  for (auto _ : state) {
    cpu::matmul_wt(x.data(), {typed.data(), dtype}, y.data(), T, in, out);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  if (!matches_double(x, deq, y, T, in, out)) {
    state.SkipWithError("matmul_wt output differs from a double dot product");
    return;
  }
  set_small_m_counters(state, T, in, out, dtype_element_bytes(dtype));
}

}  // namespace

BENCHMARK(BM_DecoderLayerPrefill)
    ->ArgName("dim")
    ->Arg(1024)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond);

BENCHMARK(BM_Sgemm)
    ->ArgNames({"T", "in", "out"})
    ->Args({kTokens, 1024, 2816})
    ->Args({kTokens, 2816, 1024})
    ->Args({kTokens, 1024, 1024})
    ->Args({kTokens, 2048, 5632})
    ->Args({kTokens, 5632, 2048})
    ->Args({kTokens, 2048, 2048})
    ->Unit(benchmark::kMillisecond);

BENCHMARK(BM_MatmulSmallM)
    ->ArgNames({"T", "in", "out", "path", "woff"})
    ->ArgsProduct({{1, 4, 8, 16, 32, 64}, {512}, {512, 1376, 32000}, {0, 1, 2, 3}, {0, 28}})
    ->ArgsProduct({{1, 4, 8, 16, 32, 64}, {1376}, {512}, {0, 1, 2, 3}, {0, 28}})
    ->Unit(benchmark::kMicrosecond);

void BM_DecodeSweep(benchmark::State& state) {
  // One decode step's weight products of the 42M Llama (model::named_config("42M")), in the
  // order decode runs them: 8 layers x (Wq, Wk, Wv, Wo 512x512; W1, W3 1376x512; W2 512x1376)
  // and the 32000x512 classifier,
  // 42.0 M float32 weights (168 MB, 5x this CPU's L3) laid out back to back 28 bytes past a
  // line (as a llama2.c checkpoint's mmap puts them), so W streams from memory as in decode;
  // BM_MatmulSmallM's single matrices stay in cache between iterations. path: 1 avx2, 2
  // avx512 (cpu::KernelIsa); prefetch: cpu::set_small_m_prefetch (0 off, 1 on).
  const std::int64_t T = state.range(0), path = state.range(1);
  const bool prefetch = state.range(2) != 0;
  const auto isa = static_cast<cpu::KernelIsa>(path);
  if (!cpu::kernel_isa_supported(isa)) {
    state.SkipWithError("this CPU has no such instruction set");
    return;
  }
  struct Shape {
    std::int64_t out, in;
  };
  const model::LlamaConfig c = model::named_config("42M");
  const std::int64_t d = c.dim, kv = c.kv_dim(), h = c.hidden_dim;
  std::vector<Shape> shapes;
  for (int l = 0; l < c.n_layers; ++l)
    for (const Shape sh : {Shape{d, d}, Shape{kv, d}, Shape{kv, d}, Shape{d, d}, Shape{h, d},
                           Shape{h, d}, Shape{d, h}})
      shapes.push_back(sh);
  shapes.push_back({c.vocab_size, d});
  std::int64_t weights = 0;
  for (const auto& sh : shapes) weights += sh.out * sh.in;
  // One copy of the weights for every instance (the same pages, so instances compare the
  // kernels, not where the allocator put 168 MB), 28 bytes past a line.
  static Vec storage;
  if (storage.empty()) {
    storage.resize(sz(weights + 32));
    std::mt19937 wrng(42);
    std::uniform_real_distribution<float> u(-0.05f, 0.05f);
    for (float& v : storage) v = u(wrng);
  }
  const float* w = reinterpret_cast<const float*>(
                       (reinterpret_cast<std::uintptr_t>(storage.data()) + 63) / 64 * 64) +
                   7;
  std::mt19937 rng(static_cast<unsigned>(T));
  const Vec x = random_vec(rng, T * std::max(d, h), 1.0f);
  Vec y(sz(T * std::max<std::int64_t>(c.vocab_size, h))), first;
  const cpu::KernelIsa isa_before = cpu::kernel_isa();
  const bool prefetch_before = cpu::small_m_prefetch();
  cpu::set_kernel_isa(isa);
  cpu::set_small_m_prefetch(prefetch);
  state.SetLabel(std::string(cpu::to_string(isa)) + (prefetch ? " prefetch" : " no-prefetch"));
  auto sweep = [&] {
    const float* wi = w;
    for (const auto& sh : shapes) {
      cpu::matmul_wt(x.data(), wi, y.data(), T, sh.in, sh.out);
      wi += sh.out * sh.in;
    }
  };
  sweep();
  first = y;
  for (auto _ : state) {
    sweep();
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  cpu::set_kernel_isa(isa_before);
  cpu::set_small_m_prefetch(prefetch_before);
  if (y != first) {
    state.SkipWithError("the sweep's last classifier output differs from its first");
    return;
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * double(T) * double(weights) * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["weight_GB/s"] = benchmark::Counter(
      double(weights) * sizeof(float) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK(BM_DecodeSweep)
    ->ArgNames({"T", "path", "prefetch"})
    ->ArgsProduct({{1, 2, 4, 8, 16}, {1, 2}, {0, 1}})
    ->Unit(benchmark::kMillisecond);

// dtype: 0 F32, 1 F16, 2 BF16, 5 Q8_0 (brigade::DType); the decode shapes of the 42M model.
BENCHMARK(BM_MatmulSmallMTyped)
    ->ArgNames({"T", "in", "out", "dtype"})
    ->ArgsProduct({{1, 4, 16, 64}, {512}, {1376, 32000}, {0, 1, 2, 5}})
    ->ArgsProduct({{1, 4, 16, 64}, {1376}, {512}, {0, 1, 2, 5}})
    ->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  cpu::set_blas_threads(1);  // single-thread rates: one stage thread per core in brigade
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("blas_threads", std::to_string(cpu::blas_threads()));
  brigade::bench::add_machine_context();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
