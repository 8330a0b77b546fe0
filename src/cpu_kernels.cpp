// CPU kernels of the Llama decoder: run.c's float32 math, with the matrix products on Eigen's
// own GEMM or, for large products, OpenBLAS's SGEMM when OpenBLAS has a kernel for this CPU
// (see gemm_backend()).
//
// Threads: intra_op.hpp's team of the calling thread, one pool for every kernel. A product is
// split over W's rows (the output's columns), attention over heads; OpenBLAS runs
// single-threaded inside each part.
#include "brigade/backend/cpu.hpp"

#include "brigade/core/error.hpp"
#include "cpu_checks.hpp"
#include "cpu_elementwise.hpp"
#include "cpu_small_m.hpp"
#include "intra_op.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/weights.hpp"

#include <Eigen/Core>
#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>


namespace brigade::cpu {
inline namespace v0 {
namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MapMat = Eigen::Map<RowMat>;
using ConstMapMat = Eigen::Map<const RowMat>;
using StridedMat = Eigen::Map<RowMat, 0, Eigen::OuterStride<>>;
using ConstStridedMat = Eigen::Map<const RowMat, 0, Eigen::OuterStride<>>;

// Products with fewer rows go to Eigen (a GEMV-like shape, where Eigen is faster than SGEMM).
constexpr std::int64_t kBlasMinRows = 32;

using detail::gemm_chunk;
using detail::parallel_chunks;

/// Query rows per attention block: S = Q_blk K^T is [kAttnBlock x context] floats.
constexpr std::int64_t kAttnBlock = 128;

std::size_t usize(std::int64_t n) { return static_cast<std::size_t>(n); }

/// Resizes `v` to at least `n` elements; never shrinks (no reallocation in steady state).
template <class T>
T* grow(std::vector<T>& v, std::int64_t n) {
  if (v.size() < usize(n)) v.resize(usize(n));
  return v.data();
}

using detail::check_gemm_shape;
using detail::check_heads;

using detail::intra_op_threads;
using detail::parallel_parts;
using detail::part_range;

const detail::ElementwiseKernels& elementwise_of(KernelIsa isa) noexcept;

/// attention() with caller-owned score storage (grown on demand).
void attention_impl(const float* q, const float* k_cache, const float* v_cache, float* out,
                    std::int64_t tokens, std::int64_t pos0, int n_heads, int n_kv_heads,
                    int head_size, std::vector<float>& scores) {
  const std::int64_t hs = head_size;
  const std::int64_t dim = static_cast<std::int64_t>(n_heads) * hs;
  const std::int64_t kv_dim = static_cast<std::int64_t>(n_kv_heads) * hs;
  const int kv_mul = n_heads / n_kv_heads;
  const float scale = std::sqrt(static_cast<float>(head_size));  // run.c: sqrtf(head_size)
  const auto softmax_scaled = elementwise_of(kernel_isa()).softmax;
  const std::int64_t context = pos0 + tokens;
  const std::int64_t block_scores = std::min(kAttnBlock, tokens) * context;
  // Heads are independent: with intra-op threads each part takes a contiguous range of heads
  // and its own score block (the bits do not depend on the thread count). Decode (a few rows
  // over a short context) stays on the calling thread, where a fork costs more than the work.
  const int threads = std::min(
      n_heads, intra_op_threads(4.0 * double(tokens) * double(context) * double(dim)));
  float* all = grow(scores, block_scores * threads);
  parallel_parts(threads, [&](int part) {
  std::int64_t h0 = 0, h1 = 0;
  part_range(n_heads, threads, part, 1, h0, h1);
  float* att = all + block_scores * part;
  for (int h = static_cast<int>(h0); h < h1; ++h) {
    const std::int64_t kv_off = static_cast<std::int64_t>(h / kv_mul) * hs;
    for (std::int64_t r0 = 0; r0 < tokens; r0 += kAttnBlock) {
      const std::int64_t rows = std::min(kAttnBlock, tokens - r0);
      const std::int64_t keys = pos0 + r0 + rows;  // the block's last row sees keys 0..keys-1
      ConstStridedMat qb(q + r0 * dim + h * hs, rows, hs, Eigen::OuterStride<>(dim));
      ConstStridedMat kb(k_cache + kv_off, keys, hs, Eigen::OuterStride<>(kv_dim));
      ConstStridedMat vb(v_cache + kv_off, keys, hs, Eigen::OuterStride<>(kv_dim));
      MapMat s(att, rows, keys);
      s.noalias() = qb * kb.transpose();
      for (std::int64_t i = 0; i < rows; ++i) {
        float* row = att + i * keys;
        const std::int64_t visible = pos0 + r0 + i + 1;  // causal: keys 0..pos0+r0+i
        softmax_scaled(row, visible, scale);  // softmax(row / scale)
        std::fill(row + visible, row + keys, 0.0f);
      }
      StridedMat ob(out + r0 * dim + h * hs, rows, hs, Eigen::OuterStride<>(dim));
      ob.noalias() = s * vb;
    }
  }
  });
}

}  // namespace

void rmsnorm(const float* x, const float* weight, float* out, std::int64_t tokens,
             std::int64_t dim, float eps) {
  BRIGADE_CHECK(tokens >= 0 && dim > 0, Errc::InvalidArgument,
                "rmsnorm: tokens = {}, dim = {}; expected tokens >= 0 and dim > 0", tokens, dim);
  for (std::int64_t t = 0; t < tokens; ++t) {
    const float* xr = x + t * dim;
    float* o = out + t * dim;
    float ss = 0.0f;
    for (std::int64_t j = 0; j < dim; ++j) ss += xr[j] * xr[j];
    ss /= static_cast<float>(dim);
    ss += eps;
    ss = 1.0f / std::sqrt(ss);
    for (std::int64_t j = 0; j < dim; ++j) o[j] = weight[j] * (ss * xr[j]);
  }
}

GemmBackend gemm_backend() {
  static const GemmBackend chosen = [] {
    openblas_set_num_threads(1);  // before any SGEMM: OpenBLAS never starts its own threads
    if (const char* env = std::getenv("BRIGADE_GEMM")) {
      if (std::string_view(env) == "eigen") return GemmBackend::Eigen;
      if (std::string_view(env) == "blas") return GemmBackend::Blas;
    }
    // OpenBLAS's DYNAMIC_ARCH falls back to these generic kernels on CPUs it does not know
    // (0.3.21 runs "Prescott" SSE3 code on Sapphire/Emerald Rapids: ~5x slower than Eigen's
    // AVX-512 GEMM there). Use OpenBLAS only when it has a real kernel for this CPU.
    const std::string_view core = openblas_get_corename();
    for (std::string_view generic : {"Prescott", "Katmai", "Coppermine", "Northwood", "Banias",
                                     "Core2", "Penryn", "Dunnington", "Atom", "Unknown"})
      if (core == generic) return GemmBackend::Eigen;
    return GemmBackend::Blas;
  }();
  return chosen;
}

std::string gemm_backend_name() {
  if (gemm_backend() == GemmBackend::Eigen) return "eigen";
  return std::string("openblas ") + openblas_get_corename();
}

namespace {

// ---- small-M path: out[T x N] (+)= x[T x K] W^T for few rows T, W streamed once unpacked ----
//
// A packing GEMM (Eigen's, OpenBLAS's) copies all of W on every call, which costs more than the
// product itself when T is small (decode). The small-M kernels (cpu_small_m.hpp) read W in place
// with a summation order fixed per output, the same in the generic, AVX2 and AVX-512 builds, so
// the instruction set chosen at run time changes the speed, never the bits.

/// BRIGADE_SMALL_M=0 turns the small-M kernel off (the GEMM for every T), for comparisons.
bool small_m_enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("BRIGADE_SMALL_M");
    return !(env != nullptr && std::string_view(env) == "0");
  }();
  return enabled;
}

bool isa_supported(KernelIsa isa) noexcept {
  switch (isa) {
    case KernelIsa::Generic:
      return true;
#if BRIGADE_X86_KERNELS
    // GCC's CPU model checks include the OS's support for the wider registers (XGETBV).
    case KernelIsa::Avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case KernelIsa::Avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c");
#else
    case KernelIsa::Avx2:
    case KernelIsa::Avx512:
      return false;
#endif
  }
  return false;
}

/// Most rows T for which matmul_wt takes the small-M kernel: 64 (decode micro-batches of up to 64
/// sequences) when Eigen's GEMM runs the larger products. With OpenBLAS's SGEMM behind it: 32 on
/// a CPU with AVX-512, whose small-M kernel matches or passes SGEMM at 32 rows (Zen 5 with
/// OpenBLAS's Cooperlake kernels: 84-108 against 78-106 GFLOP/s, W in cache; an Intel Xeon with
/// its SkylakeX kernels: 32-sequence decode on the 42M shape 1.30x faster on one thread, 1.18x on
/// two, W streamed, docs/benchmarks.md), and 16 on one without, whose AVX2 kernel OpenBLAS's
/// tuned kernels pass from about 32 rows. The limit follows the CPU, not the kernel chosen
/// (set_kernel_isa), so that choosing another instruction set changes the speed, never which
/// products take the small-M kernel, nor the bits. BRIGADE_SMALL_M_MAX_ROWS=N sets it (read
/// once, for comparisons).
std::int64_t small_max_rows() {
  static const std::int64_t rows = [] {
    if (const char* env = std::getenv("BRIGADE_SMALL_M_MAX_ROWS"))
      return std::max<std::int64_t>(0, std::atoll(env));
    if (gemm_backend() != GemmBackend::Blas) return std::int64_t{64};
    return std::int64_t{isa_supported(KernelIsa::Avx512) ? 32 : 16};
  }();
  return rows;
}

KernelIsa best_isa() noexcept {
  for (KernelIsa isa : {KernelIsa::Avx512, KernelIsa::Avx2})
    if (isa_supported(isa)) return isa;
  return KernelIsa::Generic;
}

detail::SmallMKernel kernel_of(KernelIsa isa) noexcept {
  switch (isa) {
#if BRIGADE_X86_KERNELS
    case KernelIsa::Avx2:
      return detail::small_m_avx2;
    case KernelIsa::Avx512:
      return detail::small_m_avx512;
#endif
    default:
      return detail::small_m_generic;
  }
}

/// The element-wise kernels of `isa` (cpu_elementwise.hpp: the same bits in every one).
const detail::ElementwiseKernels& elementwise_of(KernelIsa isa) noexcept {
  switch (isa) {
#if BRIGADE_X86_KERNELS
    case KernelIsa::Avx2:
      return detail::kElementwiseAvx2;
    case KernelIsa::Avx512:
      return detail::kElementwiseAvx512;
#endif
    default:
      return detail::kElementwiseGeneric;
  }
}

/// The typed-W dequantizer of `isa` (the GEMM path's conversion).
void dequantize_for(KernelIsa isa, model::WeightMatrix w, std::int64_t in, std::int64_t rows,
                    float* out) {
  switch (isa) {
#if BRIGADE_X86_KERNELS
    case KernelIsa::Avx2:
      return detail::dequantize_avx2(w.data, w.dtype, in, rows, out);
    case KernelIsa::Avx512:
      return detail::dequantize_avx512(w.data, w.dtype, in, rows, out);
#endif
    default:
      return model::dequantize_rows(w, in, 0, rows, out);
  }
}

/// The instruction set named by BRIGADE_KERNEL_ISA when it is set (for comparisons: the AVX2
/// kernel on an AVX-512 CPU), else the widest one this CPU supports.
KernelIsa initial_isa() {
  const char* env = std::getenv("BRIGADE_KERNEL_ISA");
  if (env == nullptr || *env == '\0') return best_isa();
  const KernelIsa isa = parse_kernel_isa(env, "BRIGADE_KERNEL_ISA");
  BRIGADE_CHECK(isa_supported(isa), Errc::InvalidArgument,
                "BRIGADE_KERNEL_ISA={}: this CPU (or this build) has no {} support; expected "
                "one of the supported instruction sets (the widest here: {})",
                to_string(isa), to_string(isa), to_string(best_isa()));
  return isa;
}

/// The process's small-M kernel (initialised on first use; a bad BRIGADE_KERNEL_ISA throws
/// there, and again at the next use).
std::atomic<KernelIsa>& current_isa() {
  static std::atomic<KernelIsa> isa{initial_isa()};
  return isa;
}

/// Whether the small-M kernels prefetch the next W rows (set_small_m_prefetch).
std::atomic<bool>& prefetch_flag() {
  static std::atomic<bool> on{true};
  return on;
}

/// Bytes of the cache line that the small-M kernels' x packets should not straddle.
constexpr std::uintptr_t kLineBytes = 64;

void small_m_gemm(const float* x, model::WeightMatrix w, float* out, std::int64_t tokens,
                  std::int64_t in, std::int64_t out_dim, bool accumulate) {
  const KernelIsa isa = current_isa().load(std::memory_order_relaxed);
  const detail::SmallMKernel kernel = kernel_of(isa);
  const bool prefetch = prefetch_flag().load(std::memory_order_relaxed);
  // x is read once per block of W rows, from L1: packets that straddle a line cost two of L1's
  // load slots each (with an x from a std::vector every 64-byte packet does), which halved the
  // 8-row AVX-512 product with W in cache (bench_kernels BM_MatmulSmallM). A copy on a line,
  // tokens x in floats, costs about 1 / out_dim of the product. Rows stay on lines only when
  // `in` is a multiple of 16 floats.
  thread_local std::vector<float> x_on_line;
  constexpr std::int64_t kLineFloats = kLineBytes / sizeof(float);
  if (isa != KernelIsa::Generic && reinterpret_cast<std::uintptr_t>(x) % kLineBytes != 0 &&
      in % kLineFloats == 0) {
    float* base = grow(x_on_line, tokens * in + kLineFloats);
    const std::uintptr_t misfit = reinterpret_cast<std::uintptr_t>(base) % kLineBytes;
    float* aligned = base + (misfit == 0 ? 0 : (kLineBytes - misfit) / sizeof(float));
    std::copy_n(x, tokens * in, aligned);
    x = aligned;
  }
  const int threads = intra_op_threads(2.0 * double(tokens) * double(in) * double(out_dim));
  if (threads > 1) {
    // Each part takes one contiguous range of W's rows (its own weight streams); each
    // output's summation order is the same whoever computes it.
    parallel_parts(threads, [&](int p) {
      std::int64_t n0 = 0, n1 = 0;
      part_range(out_dim, threads, p, 16, n0, n1);
      if (n1 > n0)
        kernel(x, w.data, w.dtype, out, tokens, in, out_dim, n0, n1, accumulate, prefetch);
    });
  } else {
    kernel(x, w.data, w.dtype, out, tokens, in, out_dim, 0, out_dim, accumulate, prefetch);
  }
}

void gemm_wt(const float* x, model::WeightMatrix wm, float* out, std::int64_t tokens,
             std::int64_t in, std::int64_t out_dim, float beta) {
  if (tokens <= small_max_rows() && small_m_enabled()) {
    small_m_gemm(x, wm, out, tokens, in, out_dim, beta != 0.0f);
    return;
  }
  // More rows (prefill): a typed W is dequantized whole into this thread's float32 scratch
  // (out_dim * in floats, kept for the next call) and the float32 GEMM runs on it, the same call
  // as for a float32 W, so the bits are those of the dequantized matrix. The conversion streams
  // W once and writes 4 bytes per weight: about 1 / tokens of the GEMM's work per weight.
  thread_local std::vector<float> dequantized;
  const float* w = nullptr;
  if (wm.dtype == DType::F32) {
    w = static_cast<const float*>(wm.data);
  } else {
    w = grow(dequantized, out_dim * in);
    dequantize_for(current_isa().load(std::memory_order_relaxed), wm, in, out_dim,
                   dequantized.data());
  }
  const bool blas = gemm_backend() == GemmBackend::Blas && tokens >= kBlasMinRows;
  const int threads = intra_op_threads(2.0 * double(tokens) * double(in) * double(out_dim));
  // Fixed chunks of gemm_chunk(out_dim) rows of W (columns of out), one single-threaded call
  // each, dealt to the threads: the same calls at any thread count, so the same bits.
  const std::int64_t chunk = gemm_chunk(out_dim);
  parallel_chunks(out_dim, chunk, threads, [&](std::int64_t n0, std::int64_t n1) {
    if (blas) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(tokens),
                  static_cast<blasint>(n1 - n0), static_cast<blasint>(in), 1.0f, x,
                  static_cast<blasint>(in), w + n0 * in, static_cast<blasint>(in), beta,
                  out + n0, static_cast<blasint>(out_dim));
      return;
    }
    StridedMat o(out + n0, tokens, n1 - n0, Eigen::OuterStride<>(out_dim));
    const ConstMapMat xm(x, tokens, in), wp(w + n0 * in, n1 - n0, in);
    if (beta == 0.0f)
      o.noalias() = xm * wp.transpose();
    else
      o.noalias() += xm * wp.transpose();
  });
}
}  // namespace

void matmul_wt(const float* x, model::WeightMatrix w, float* out, std::int64_t tokens,
               std::int64_t in, std::int64_t out_dim) {
  check_gemm_shape("matmul_wt", tokens, in, out_dim);
  model::check_weight_shape(w.dtype, in, "matmul_wt");
  if (tokens == 0 || out_dim == 0) return;
  if (in == 0) {
    MapMat(out, tokens, out_dim).setZero();
    return;
  }
  gemm_wt(x, w, out, tokens, in, out_dim, 0.0f);
}

void matmul_wt_accumulate(const float* x, model::WeightMatrix w, float* out,
                          std::int64_t tokens, std::int64_t in, std::int64_t out_dim) {
  check_gemm_shape("matmul_wt_accumulate", tokens, in, out_dim);
  model::check_weight_shape(w.dtype, in, "matmul_wt_accumulate");
  if (tokens == 0 || out_dim == 0 || in == 0) return;
  gemm_wt(x, w, out, tokens, in, out_dim, 1.0f);
}

void rope(float* q, float* k, const std::int32_t* pos, std::int64_t tokens, int n_heads,
          int n_kv_heads, int head_size, float theta) {
  check_heads("rope", n_heads, n_kv_heads, head_size);
  BRIGADE_CHECK(tokens >= 0, Errc::InvalidArgument, "rope: tokens = {}; expected >= 0", tokens);
  const int half = head_size / 2;
  const std::int64_t dim = static_cast<std::int64_t>(n_heads) * head_size;
  const std::int64_t kv_dim = static_cast<std::int64_t>(n_kv_heads) * head_size;
  // run.c evaluates freq, cos and sin per element i of the row, but they depend only on
  // i % head_size and pos: computing them once per (token, pair) gives the same bits.
  std::vector<float> f(static_cast<std::size_t>(half));
  for (int j = 0; j < half; ++j) {
    const int head_dim = 2 * j;
    f[usize(j)] =
        1.0f / std::pow(theta, static_cast<float>(head_dim) / static_cast<float>(head_size));
  }
  // Tokens are independent (a cos and a sin per pair and token): split over the intra-op
  // threads in prefill.
  const int threads =
      intra_op_threads(40.0 * double(tokens) * double(half) + double(tokens * (dim + kv_dim)));
  parallel_parts(threads, [&](int part) {
  std::int64_t t0 = 0, t1 = 0;
  part_range(tokens, threads, part, 1, t0, t1);
  std::vector<float> c(2 * static_cast<std::size_t>(half));  // cos, sin per pair
  for (std::int64_t t = t0; t < t1; ++t) {
    const float p = static_cast<float>(pos[t]);
    for (int j = 0; j < half; ++j) {
      const float val = p * f[usize(j)];
      c[usize(2 * j)] = std::cos(val);
      c[usize(2 * j + 1)] = std::sin(val);
    }
    auto rotate = [&](float* row, std::int64_t width) {
      for (std::int64_t i = 0; i < width; i += 2) {
        const std::size_t j = usize(i % head_size);  // = 2 * pair index
        const float fcr = c[j], fci = c[j + 1];
        const float v0 = row[i], v1 = row[i + 1];
        row[i] = v0 * fcr - v1 * fci;
        row[i + 1] = v0 * fci + v1 * fcr;
      }
    };
    rotate(q + t * dim, dim);
    rotate(k + t * kv_dim, kv_dim);
  }
  });
}

void attention(const float* q, const float* k_cache, const float* v_cache, float* out,
               std::int64_t tokens, std::int64_t pos0, int n_heads, int n_kv_heads,
               int head_size) {
  check_heads("attention", n_heads, n_kv_heads, head_size);
  BRIGADE_CHECK(tokens >= 0 && pos0 >= 0, Errc::InvalidArgument,
                "attention: tokens = {}, pos0 = {}; expected both >= 0", tokens, pos0);
  if (tokens == 0) return;
  std::vector<float> scores;
  attention_impl(q, k_cache, v_cache, out, tokens, pos0, n_heads, n_kv_heads, head_size, scores);
}

void swiglu(float* gate, const float* up, std::int64_t n) {
  // About 4 flops' time per element with the vectorized e^x: split over the intra-op threads
  // in prefill only.
  const auto kernel = elementwise_of(kernel_isa()).swiglu;
  const int threads = intra_op_threads(4.0 * double(n));
  parallel_parts(threads, [&](int p) {
    std::int64_t i0 = 0, i1 = 0;
    part_range(n, threads, p, 16, i0, i1);
    kernel(gate + i0, up + i0, i1 - i0);
  });
}

void vexp(float* x, std::int64_t n, float shift) {
  BRIGADE_CHECK(n >= 0 && (n == 0 || x != nullptr), Errc::InvalidArgument,
                "vexp: n = {} with x {}; expected n >= 0 and x set when n > 0", n,
                x ? "set" : "null");
  if (n > 0) elementwise_of(kernel_isa()).exp(x, n, shift);
}

void softmax(float* x, std::int64_t n) {
  if (n > 0) elementwise_of(kernel_isa()).softmax(x, n, 1.0f);
}

void embedding(model::WeightMatrix table, const std::int32_t* ids, float* out,
               std::int64_t tokens, std::int64_t dim) {
  for (std::int64_t t = 0; t < tokens; ++t)
    model::dequantize_rows(table, dim, ids[t], 1, out + t * dim);
}


std::string_view to_string(KernelIsa isa) noexcept {
  switch (isa) {
    case KernelIsa::Generic:
      return "generic";
    case KernelIsa::Avx2:
      return "avx2";
    case KernelIsa::Avx512:
      return "avx512";
  }
  return "unknown";
}

bool kernel_isa_supported(KernelIsa isa) noexcept { return isa_supported(isa); }

KernelIsa parse_kernel_isa(std::string_view name, std::string_view what) {
  for (KernelIsa isa : {KernelIsa::Generic, KernelIsa::Avx2, KernelIsa::Avx512})
    if (name == to_string(isa)) return isa;
  ::brigade::detail::fail(Errc::InvalidArgument, "{} '{}'; expected generic, avx2 or avx512", what,
                          ::brigade::detail::excerpt(name));
}

KernelIsa kernel_isa() { return current_isa().load(std::memory_order_relaxed); }

void set_kernel_isa(KernelIsa isa) {
  BRIGADE_CHECK(isa == KernelIsa::Generic || isa == KernelIsa::Avx2 || isa == KernelIsa::Avx512,
                Errc::InvalidArgument, "set_kernel_isa: unknown instruction set {}",
                static_cast<int>(isa));
  BRIGADE_CHECK(isa_supported(isa), Errc::InvalidArgument,
                "set_kernel_isa: this CPU (or this build) has no {} support", to_string(isa));
  current_isa().store(isa, std::memory_order_relaxed);
}

bool small_m_prefetch() noexcept { return prefetch_flag().load(std::memory_order_relaxed); }

void set_small_m_prefetch(bool on) noexcept {
  prefetch_flag().store(on, std::memory_order_relaxed);
}

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const auto colon = line.find(':');
    if (colon == std::string::npos) break;
    const auto first = line.find_first_not_of(" \t", colon + 1);
    return first == std::string::npos ? std::string() : line.substr(first);
  }
  return "unknown";
}

void attention(const backend::KvCacheView& cache, const float* q, const float* k, const float* v,
               float* out, std::span<const backend::SequenceSlice> seqs, int n_heads,
               int n_kv_heads, int head_size) {
  check_heads("attention", n_heads, n_kv_heads, head_size);
  const std::int64_t hs = head_size;
  const std::int64_t dim = n_heads * hs;
  const std::int64_t kv_dim = n_kv_heads * hs;
  BRIGADE_CHECK(cache.dtype == DType::F32 && cache.kv_dim == kv_dim, Errc::InvalidArgument,
                "attention: a {} KV cache of kv_dim {}; expected f32 with kv_dim {}",
                to_string(cache.dtype), cache.kv_dim, kv_dim);
  for (const auto& s : seqs)
    BRIGADE_CHECK(s.tokens >= 1 && s.pos0 >= 0 && s.seq >= 0 &&
                      static_cast<std::size_t>(s.seq) < cache.first_row.size(),
                  Errc::InvalidArgument,
                  "attention: sequence {} with pos0 = {}, tokens = {}; expected pos0 >= 0, "
                  "tokens >= 1 and a sequence of the cache's {}",
                  s.seq, s.pos0, s.tokens, cache.first_row.size());
  auto* keys = static_cast<float*>(cache.keys);
  auto* values = static_cast<float*>(cache.values);
  const auto k_rows = [&](const backend::SequenceSlice& s) {
    return keys + cache.first_row[static_cast<std::size_t>(s.seq)] * kv_dim;
  };
  const auto v_rows = [&](const backend::SequenceSlice& s) {
    return values + cache.first_row[static_cast<std::size_t>(s.seq)] * kv_dim;
  };
  std::int64_t row = 0;
  for (const auto& s : seqs) {
    std::copy(k + row * kv_dim, k + (row + s.tokens) * kv_dim, k_rows(s) + s.pos0 * kv_dim);
    std::copy(v + row * kv_dim, v + (row + s.tokens) * kv_dim, v_rows(s) + s.pos0 * kv_dim);
    row += s.tokens;
  }
  // Several sequences (a decode micro-batch): parts over sequences, each sequence's attention
  // on one thread (its heads split only when it is alone), so the bits stay those of one thread.
  double attention_flops = 0.0;
  for (const auto& s : seqs)
    attention_flops += 4.0 * double(s.tokens) * double(s.pos0 + s.tokens) * double(dim);
  const int seq_threads =
      seqs.size() > 1
          ? std::min(static_cast<int>(seqs.size()), intra_op_threads(attention_flops))
          : 1;
  parallel_parts(seq_threads, [&](int part) {
    thread_local std::vector<float> scores;
    std::int64_t s0 = 0, s1 = 0;
    part_range(static_cast<std::int64_t>(seqs.size()), seq_threads, part, 1, s0, s1);
    std::int64_t r = 0;  // the first row of slice s0
    for (std::int64_t i = 0; i < s0; ++i) r += seqs[static_cast<std::size_t>(i)].tokens;
    for (std::int64_t i = s0; i < s1; ++i) {
      const auto& s = seqs[static_cast<std::size_t>(i)];
      attention_impl(q + r * dim, k_rows(s), v_rows(s), out + r * dim, s.tokens, s.pos0, n_heads,
                     n_kv_heads, head_size, scores);
      r += s.tokens;
    }
  });
}

}  // namespace v0
}  // namespace brigade::cpu

// The definition of the small-M summation order (cpu_small_m.hpp), and the portable fallback.
namespace brigade::cpu::detail {
namespace {
template <DType WT>
void small_m_generic_typed(const float* x, const std::byte* w, float* out, std::int64_t tokens,
                           std::int64_t in, std::int64_t out_dim, std::int64_t n_begin,
                           std::int64_t n_end, bool accumulate) {
  const std::int64_t k_vec = in - in % kSmallMLanes;
  const auto half = [](std::uint16_t h) { return f16_to_f32(h); };
  for (std::int64_t t = 0; t < tokens; ++t) {
    const float* xr = x + t * in;
    for (std::int64_t n = n_begin; n < n_end; ++n) {
      const std::byte* wr = w + n * row_bytes<WT>(in);
      float lanes[kSmallMLanes] = {};
      for (std::int64_t k = 0; k < k_vec; k += kSmallMLanes)
        for (int l = 0; l < kSmallMLanes; ++l)
          lanes[l] = std::fma(xr[k + l], weight_at<WT>(wr, k + l, half), lanes[l]);
      const float s = add_tail<WT>(reduce_lanes(lanes), xr, wr, k_vec, in, half);
      float& o = out[t * out_dim + n];
      o = accumulate ? o + s : s;
    }
  }
}
}  // namespace

void small_m_generic(const float* x, const void* w, DType wt, float* out, std::int64_t tokens,
                     std::int64_t in, std::int64_t out_dim, std::int64_t n_begin,
                     std::int64_t n_end, bool accumulate, bool /*prefetch: none here*/) {
  const auto* wb = static_cast<const std::byte*>(w);
  switch (wt) {
    case DType::F32:
      return small_m_generic_typed<DType::F32>(x, wb, out, tokens, in, out_dim, n_begin, n_end,
                                               accumulate);
    case DType::F16:
      return small_m_generic_typed<DType::F16>(x, wb, out, tokens, in, out_dim, n_begin, n_end,
                                               accumulate);
    case DType::BF16:
      return small_m_generic_typed<DType::BF16>(x, wb, out, tokens, in, out_dim, n_begin, n_end,
                                                accumulate);
    case DType::Q8_0:
      return small_m_generic_typed<DType::Q8_0>(x, wb, out, tokens, in, out_dim, n_begin, n_end,
                                                accumulate);
    default:
      return;
  }
}

}  // namespace brigade::cpu::detail
