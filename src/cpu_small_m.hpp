// matmul_wt's small-row (decode) kernel: its contract, shared by the per-ISA translation units
// (internal to src/).
//
// out[t, n] (+)= sum_k x[t, k] w[n, k] for rows t in [0, tokens) of x and rows n in
// [n_begin, n_end) of W, with W read in place (never packed) so that each weight is streamed
// from memory once per call whatever the number of x rows. W is F32, F16, BF16 or Q8_0
// (model/weight_matrix.hpp's layouts); each weight is converted to its float32 value (exact)
// in registers as it is read, so a typed W gives the bits of the float32 W it dequantizes to.
//
// Summation order of every output, the same in every implementation (generic, AVX2/FMA,
// AVX-512): 16 lanes, lane l summing fma(x[k], w[k], acc) for k = l, l + 16, ... < K - K % 16 in
// increasing k from 0; the lanes reduced by reduce_lanes() below; then the K % 16 tail products
// added left to right (a multiply, then an add: the library builds with -ffp-contract=off).
// So an output's bits depend only on its x row and W row: not on the instruction set, the
// buffers' alignment, the thread count, the blocking or the other rows in the batch.
#pragma once

#include "brigade/core/dtype.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace brigade::cpu::detail {

/// The lanes of the fixed summation order.
inline constexpr int kSmallMLanes = 16;

/// A small-M kernel: the contract above, for the rows [n_begin, n_end) of W (output columns).
/// @param x   [tokens x in] row-major
/// @param w   [out_dim x in] row-major in `wt` (F32, F16, BF16 or Q8_0 with in % 32 == 0: the
///            caller checks)
/// @param out [tokens x out_dim] row-major; columns [n_begin, n_end) written (or added to)
/// @param prefetch software prefetches of the next W rows while a call computes (where the
///            kernel has them: cpu_small_m_kernel.hpp, sm_rows); they change the speed, never the
///            bits (cpu::set_small_m_prefetch)
using SmallMKernel = void (*)(const float* x, const void* w, DType wt, float* out,
                              std::int64_t tokens, std::int64_t in, std::int64_t out_dim,
                              std::int64_t n_begin, std::int64_t n_end, bool accumulate,
                              bool prefetch);

/// Dequantizes rows [0, rows) of W ([rows x in] in `wt`: F16, BF16 or Q8_0) into out
/// [rows x in] float32 (exact; the GEMM path's conversion of a typed W).
using DequantizeKernel = void (*)(const void* w, DType wt, std::int64_t in, std::int64_t rows,
                                  float* out);

// Internal linkage on purpose: every translation unit (each built for its own instruction set)
// keeps its own copy, so the linker can never hand the AVX-512 build of it to the generic path.
namespace {

/// The fixed lane reduction: pairs (l, l + 8), then (l, l + 4), then (l, l + 2), then the two
/// left: the tree of a 512-bit register halved three times, which a 256-bit pair gives as well.
inline float reduce_lanes(const float* lanes) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = lanes[i] + lanes[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  const float s0 = s4[0] + s4[2], s1 = s4[1] + s4[3];
  return s0 + s1;
}

/// Bytes of one W row of `in` elements of WT (literal sizes: these kernels call no function of
/// core/dtype.hpp, whose out-of-line copies would be built for this file's instruction set).
template <DType WT>
constexpr std::int64_t row_bytes(std::int64_t in) noexcept {
  if constexpr (WT == DType::Q8_0)
    return in / 32 * 34;
  else if constexpr (WT == DType::F32)
    return in * 4;
  else
    return in * 2;
}

/// Element k of a W row of WT as its float32 value (exact), for the scalar code; `Half`
/// converts a binary16 (each instruction set brings its own, so no function is shared).
template <DType WT, class Half>
inline float weight_at(const std::byte* row, std::int64_t k, Half half) noexcept {
  std::uint16_t h;
  if constexpr (WT == DType::F32) {
    float f;
    std::memcpy(&f, row + 4 * k, 4);
    return f;
  } else if constexpr (WT == DType::Q8_0) {
    const std::byte* block = row + k / 32 * 34;
    std::memcpy(&h, block, 2);
    return static_cast<float>(static_cast<std::int8_t>(block[2 + k % 32])) * half(h);
  } else if constexpr (WT == DType::F16) {
    std::memcpy(&h, row + 2 * k, 2);
    return half(h);
  } else {  // BF16: the top half of a float32
    std::memcpy(&h, row + 2 * k, 2);
    const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
}

/// The K % 16 tail of one output, added left to right after the lanes' sum `s` (W row `w`).
template <DType WT, class Half>
inline float add_tail(float s, const float* x, const std::byte* w, std::int64_t k0,
                      std::int64_t in, Half half) {
  for (std::int64_t k = k0; k < in; ++k) s += x[k] * weight_at<WT>(w, k, half);
  return s;
}

}  // namespace

/// Portable C++ (std::fma per lane): the definition of the order, and the fallback.
void small_m_generic(const float* x, const void* w, DType wt, float* out, std::int64_t tokens,
                     std::int64_t in, std::int64_t out_dim, std::int64_t n_begin,
                     std::int64_t n_end, bool accumulate, bool prefetch);

#if BRIGADE_X86_KERNELS
/// AVX2 + FMA + F16C (two 8-lane registers per accumulator); src/cpu_small_m_avx2.cpp.
void small_m_avx2(const float* x, const void* w, DType wt, float* out, std::int64_t tokens,
                  std::int64_t in, std::int64_t out_dim, std::int64_t n_begin, std::int64_t n_end,
                  bool accumulate, bool prefetch);
/// AVX-512F (one 16-lane register per accumulator); src/cpu_small_m_avx512.cpp.
void small_m_avx512(const float* x, const void* w, DType wt, float* out, std::int64_t tokens,
                    std::int64_t in, std::int64_t out_dim, std::int64_t n_begin,
                    std::int64_t n_end, bool accumulate, bool prefetch);
/// The dequantizers of the AVX2 and AVX-512 builds (the generic one is model::dequantize_rows).
void dequantize_avx2(const void* w, DType wt, std::int64_t in, std::int64_t rows, float* out);
void dequantize_avx512(const void* w, DType wt, std::int64_t in, std::int64_t rows, float* out);
#endif

}  // namespace brigade::cpu::detail
