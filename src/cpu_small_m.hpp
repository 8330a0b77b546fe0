// matmul_wt's small-row (decode) kernel: its contract, shared by the per-ISA translation units
// (internal to src/).
//
// out[t, n] (+)= sum_k x[t, k] w[n, k] for rows t in [0, tokens) of x and rows n in
// [n_begin, n_end) of W, with W read in place (never packed) so that each weight is streamed
// from memory once per call whatever the number of x rows.
//
// Summation order of every output, the same in every implementation (generic, AVX2/FMA,
// AVX-512): 16 lanes, lane l summing fma(x[k], w[k], acc) for k = l, l + 16, ... < K - K % 16 in
// increasing k from 0; the lanes reduced by reduce_lanes() below; then the K % 16 tail products
// added left to right (a multiply, then an add: the library builds with -ffp-contract=off).
// So an output's bits depend only on its x row and W row: not on the instruction set, the
// buffers' alignment, the thread count, the blocking or the other rows in the batch.
#pragma once

#include <cstdint>

namespace brigade::cpu::detail {

/// The lanes of the fixed summation order.
inline constexpr int kSmallMLanes = 16;

/// A small-M kernel: the contract above, for the rows [n_begin, n_end) of W (output columns).
/// @param x   [tokens x in] row-major
/// @param w   [out_dim x in] row-major
/// @param out [tokens x out_dim] row-major; columns [n_begin, n_end) written (or added to)
using SmallMKernel = void (*)(const float* x, const float* w, float* out, std::int64_t tokens,
                              std::int64_t in, std::int64_t out_dim, std::int64_t n_begin,
                              std::int64_t n_end, bool accumulate);

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

/// The K % 16 tail of one output, added left to right after the lanes' sum `s`.
inline float add_tail(float s, const float* x, const float* w, std::int64_t k0, std::int64_t in) {
  for (std::int64_t k = k0; k < in; ++k) s += x[k] * w[k];
  return s;
}

}  // namespace

/// Portable C++ (std::fma per lane): the definition of the order, and the fallback.
void small_m_generic(const float* x, const float* w, float* out, std::int64_t tokens,
                     std::int64_t in, std::int64_t out_dim, std::int64_t n_begin,
                     std::int64_t n_end, bool accumulate);

#if BRIGADE_X86_KERNELS
/// AVX2 + FMA (two 8-lane registers per accumulator); src/cpu_small_m_avx2.cpp.
void small_m_avx2(const float* x, const float* w, float* out, std::int64_t tokens,
                  std::int64_t in, std::int64_t out_dim, std::int64_t n_begin, std::int64_t n_end,
                  bool accumulate);
/// AVX-512F (one 16-lane register per accumulator); src/cpu_small_m_avx512.cpp.
void small_m_avx512(const float* x, const float* w, float* out, std::int64_t tokens,
                    std::int64_t in, std::int64_t out_dim, std::int64_t n_begin,
                    std::int64_t n_end, bool accumulate);
#endif

}  // namespace brigade::cpu::detail
