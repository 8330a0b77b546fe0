// CPU kernels of the Llama decoder on Eigen (OpenBLAS behind Eigen's large products).
//
// All activations are float32, row-major [tokens x width]. Tokens of several sequences are
// packed one after another (varlen, as cu_seqlens): no padding, no wasted compute.
#pragma once

#include "brigade/backend/backend.hpp"
#include "brigade/model/weight_matrix.hpp"

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace brigade::cpu {
inline namespace v0 {

/// RMSNorm, as run.c: out[t, i] = weight[i] * x[t, i] / sqrt(mean_i(x[t, :]^2) + eps).
/// @param x      [tokens x dim]
/// @param weight [dim]
/// @param out    [tokens x dim]; may alias x
/// @throws brigade::Error{InvalidArgument} if tokens < 0 or dim < 1
void rmsnorm(const float* x, const float* weight, float* out, std::int64_t tokens, std::int64_t dim,
             float eps);

/// out = x * W^T: out[t, n] = sum_k x[t, k] W[n, k], W in F32, F16, BF16 or Q8_0 (weights
/// kept in their dtype; activations float32).
/// Up to 64 rows (16 when gemm_backend() is OpenBLAS, faster from ~32 rows), the decode
/// micro-batches, a small-M kernel streams W once, unpacked, with a fixed
/// summation order per output (16 lanes over k, each lane one FMA per step in increasing k; the
/// lanes reduced as pairs (l, l+8), (l, l+4), (l, l+2), (0, 1); then the K % 16 tail left to
/// right): the bits do not depend on the buffers' alignment, the thread count, the other rows in
/// the batch or the instruction set (kernel_isa()). A typed W is read in its dtype, each weight
/// converted to its exact float32 value in registers (F16 by F16C, BF16 by a shift, Q8_0 as
/// int8 times the block's scale), so it streams 2 (F16, BF16) or 1.0625 (Q8_0) bytes per weight
/// and gives the bits of the float32 kernel on the dequantized W. More rows: one GEMM (Eigen's,
/// or OpenBLAS SGEMM per gemm_backend()); a typed W is first dequantized whole into a
/// per-thread float32 scratch of out x in floats (kept between calls), so the bits are again
/// those of the dequantized W. BRIGADE_SMALL_M=0 in the environment sends every size to the GEMM
/// (for comparisons).
/// @param x   [tokens x in], row-major
/// @param w   [out x in], row-major (llama2.c's layout), in its dtype (model/weight_matrix.hpp)
/// @param out [tokens x out], row-major; must not alias x
/// @throws brigade::Error{InvalidArgument} if a size is negative, w's dtype is not a weight
///         dtype, or it is Q8_0 and in is not a multiple of 32
void matmul_wt(const float* x, model::WeightMatrix w, float* out, std::int64_t tokens,
               std::int64_t in, std::int64_t out_dim);

/// out += x * W^T (the residual-add form of matmul_wt, the same kernels), W in its dtype.
/// @throws brigade::Error{InvalidArgument} as matmul_wt
void matmul_wt_accumulate(const float* x, model::WeightMatrix w, float* out,
                          std::int64_t tokens, std::int64_t in, std::int64_t out_dim);

/// Rotary position embedding on adjacent pairs (2i, 2i+1) within each head, as run.c:
/// freq = theta^(-(2i mod head_size)/head_size), angle = pos * freq,
/// (a, b) -> (a cos - b sin, a sin + b cos), applied to q and k.
/// @param q   [tokens x n_heads*head_size], rotated in place
/// @param k   [tokens x n_kv_heads*head_size], rotated in place
/// @param pos [tokens] absolute position of each token
/// @throws brigade::Error{InvalidArgument} if tokens < 0, a head count is < 1, n_heads is not a
///         multiple of n_kv_heads, or head_size is not positive and even
void rope(float* q, float* k, const std::int32_t* pos, std::int64_t tokens, int n_heads,
          int n_kv_heads, int head_size, float theta);

/// Causal grouped-query attention for one sequence against its KV cache.
///
/// Query row t sits at absolute position pos0 + t and attends to cache rows 0..pos0 + t.
/// Query head h reads KV head h / (n_heads / n_kv_heads). Scores are q.k / sqrt(head_size),
/// softmax with the maximum subtracted, then the weighted sum of V rows.
/// @param q       [tokens x n_heads*head_size]
/// @param k_cache [>= pos0+tokens rows x n_kv_heads*head_size], rows 0..pos0+tokens-1 filled
/// @param v_cache same shape as k_cache
/// @param out     [tokens x n_heads*head_size]; must not alias q
/// @throws brigade::Error{InvalidArgument} for negative tokens or pos0, or heads as in rope()
void attention(const float* q, const float* k_cache, const float* v_cache, float* out,
               std::int64_t tokens, std::int64_t pos0, int n_heads, int n_kv_heads, int head_size);

/// SwiGLU gate: gate[i] = silu(gate[i]) * up[i], silu(x) = x * (1 / (1 + e^-x)), with vexp's
/// e^x (the same bits on every instruction set).
void swiglu(float* gate, const float* up, std::int64_t n);

/// In place, x[i] = e^(x[i] - shift) for i < n (x[i] - shift rounded to float first), the
/// exponential of softmax() and swiglu(): vectorized on the kernel_isa(), the same bits on
/// every instruction set, within 1 ulp of e^x for arguments in [-87.3, 88.7]; an argument below
/// ln(FLT_MIN) = -87.34 gives 0 (the C library's expf returns a subnormal there), one above
/// ln(FLT_MAX) = 88.72 gives +inf, NaN gives NaN. Range reduction by ln 2 (Cody-Waite) and the
/// Taylor polynomial of e^r to degree 7 (src/cpu_elementwise.hpp).
/// @throws brigade::Error{InvalidArgument} for n < 0, or x null with n > 0
void vexp(float* x, std::int64_t n, float shift = 0.0f);

/// In-place softmax over x[0..n) with the maximum subtracted: e^(x - max) by vexp(), summed left
/// to right, each divided by the sum.
void softmax(float* x, std::int64_t n);

/// out[t, :] = table[ids[t], :]: embedding lookup, the rows converted to float32 (exact).
/// @param table [vocab x dim] in its dtype (F32, F16, BF16, Q8_0); ids must be in [0, vocab)
/// @param out   [tokens x dim] float32
/// @throws brigade::Error{InvalidArgument} if the table's dtype is not a weight dtype or is Q8_0
///         with dim not a multiple of 32
void embedding(model::WeightMatrix table, const std::int32_t* ids, float* out,
               std::int64_t tokens, std::int64_t dim);

/// Intra-op threads of the kernels (process-wide): each thread that runs kernels uses a team
/// of n threads (itself and n - 1 workers it owns, spinning about 300 us between regions) that
/// splits the decode kernel over W's rows, a packing GEMM into ceil(rows / 256) equal calls over
/// W's rows (one single-threaded OpenBLAS or Eigen call each), attention over heads, RoPE over tokens and
/// SwiGLU over elements. Work under about 2e5 flops stays on the calling thread. The bits do
/// not depend on n. brigade's pipeline sets 1 per stage thread unless told otherwise.
/// @throws brigade::Error{InvalidArgument} if n < 1
void set_blas_threads(int n);

/// Current intra-op GEMM thread count.
int blas_threads();

/// Instruction sets of matmul_wt's small-M (decode) kernel, chosen at run time from the CPU's
/// features (the library itself is not built for them: each has its own translation unit built
/// with its target flags). All give the same bits; only their speed differs.
enum class KernelIsa : std::uint8_t {
  Generic,  ///< portable C++ (std::fma per lane): any CPU
  Avx2,     ///< x86-64 AVX2 + FMA + F16C: two 256-bit registers per 16-lane accumulator
  Avx512,   ///< x86-64 AVX-512F: one 512-bit register per 16-lane accumulator
};

/// "generic", "avx2" or "avx512".
std::string_view to_string(KernelIsa isa) noexcept;

/// True if this CPU (and OS) can run `isa` and this build has its kernel (x86-64 only for Avx2
/// and Avx512).
bool kernel_isa_supported(KernelIsa isa) noexcept;

/// The KernelIsa whose to_string() is `name` ("generic", "avx2" or "avx512").
/// @param what where `name` came from, for the error (a flag or variable name)
/// @throws brigade::Error{InvalidArgument} "<what> '<name>'; expected generic, avx2 or avx512"
///         for any other name
KernelIsa parse_kernel_isa(std::string_view name,
                           std::string_view what = "kernel instruction set");

/// The small-M kernel in use: process-wide, initially the one the environment variable
/// BRIGADE_KERNEL_ISA names (generic, avx2 or avx512: to compare kernels in whole runs, e.g.
/// the AVX2 kernel on an AVX-512 CPU), else the widest supported (Avx512, then Avx2, then
/// Generic). Read once, at the first call of this or any kernel that uses it.
/// @throws brigade::Error{InvalidArgument} if BRIGADE_KERNEL_ISA is set to an unknown name or
///         to an instruction set this CPU or build does not support
KernelIsa kernel_isa();

/// Selects the small-M kernel for the whole process (benchmarks and tests compare them).
/// @throws brigade::Error{InvalidArgument} if `isa` is unknown or not supported here
void set_kernel_isa(KernelIsa isa);

/// Whether the small-M kernels (AVX2 and AVX-512; from 2 rows of x) prefetch the next W rows
/// while they compute, spread over the walk one cache line per step (cpu_small_m_kernel.hpp):
/// process-wide, initially true. The prefetches change the speed, never the bits. On Zen 5,
/// over the 42M Llama's whole decode sweep (168 MB of F32 weights streamed from memory), they
/// raise 4-16 rows by 1.1-1.4x (bench_kernels BM_DecodeSweep, docs/benchmarks.md).
bool small_m_prefetch() noexcept;

/// Turns the small-M kernels' W prefetches on or off for the whole process (benchmarks compare
/// the two in one run).
void set_small_m_prefetch(bool on) noexcept;

/// This CPU's model as the OS names it (/proc/cpuinfo "model name"), or "unknown".
std::string cpu_model_name();

/// Which library runs matmul_wt's products above the small-M kernel's rows (OpenBLAS from 32
/// rows, Eigen below that, when the small-M kernel is turned off with BRIGADE_SMALL_M=0).
enum class GemmBackend : std::uint8_t {
  Eigen,  ///< Eigen's own GEMM (vectorised for this CPU with -march=native)
  Blas,   ///< OpenBLAS SGEMM
};

/// The GEMM library in use, chosen once per process: the environment variable BRIGADE_GEMM
/// (`eigen` or `blas`) if set, else OpenBLAS when it has a kernel for this CPU
/// (openblas_get_corename() is not one of its generic fallbacks such as "Prescott"), else Eigen.
GemmBackend gemm_backend();

/// gemm_backend() with its kernels, for benchmark reports: "openblas <core>" (the core
/// OpenBLAS's DYNAMIC_ARCH runs, openblas_get_corename(): e.g. Haswell for its AVX2 kernels,
/// SkylakeX or Cooperlake for its AVX-512 ones; OPENBLAS_CORETYPE overrides its own pick) or
/// "eigen".
std::string gemm_backend_name();

}  // namespace v0
}  // namespace brigade::cpu

namespace brigade::cpu {
inline namespace v0 {

/// Causal grouped-query attention of a packed batch against its KV caches (the Backend
/// concept's attention, brigade/backend/backend.hpp): stores k and v (this batch's rows, after
/// RoPE) into rows pos0.. of each slice's sequence in `cache` (float32), then runs attention()
/// for each slice. Several slices (a decode micro-batch) are split over the intra-op threads,
/// each slice's attention on one thread (its heads split only when it is alone), so the bits do
/// not depend on the thread count.
/// @param q   [tokens x n_heads*head_size]
/// @param k   [tokens x n_kv_heads*head_size]
/// @param v   [tokens x n_kv_heads*head_size]
/// @param out [tokens x n_heads*head_size]; must not alias q
/// @param seqs the slices in row order (tokens = backend::packed_rows(seqs)); the caller checks
///            that each fits its sequence's capacity
/// @throws brigade::Error{InvalidArgument} for heads as in rope(), a cache that is not F32 or
///         whose kv_dim is not n_kv_heads * head_size, or a slice with tokens < 1 or pos0 < 0
void attention(const backend::KvCacheView& cache, const float* q, const float* k, const float* v,
               float* out, std::span<const backend::SequenceSlice> seqs, int n_heads,
               int n_kv_heads, int head_size);

}  // namespace v0
}  // namespace brigade::cpu
