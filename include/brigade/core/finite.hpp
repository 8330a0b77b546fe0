// Finding NaN and infinity in float buffers at memory speed: the check behind the loaders'
// refusal of non-finite weights and the pipeline stages' refusal of non-finite activations.
#pragma once

#include "brigade/core/error.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

namespace brigade {
inline namespace v0 {

/// Index of the first element of p[0, n) that is NaN or +-infinity, or n when all are finite.
/// Blocks of 1024 floats are screened by a branch-free OR of an exponent test (all exponent
/// bits set, IEEE-754 binary32), which compilers vectorize; only a block that fails is searched
/// element by element. Cost: one read of the buffer (bench_kernels BM_FirstNonFinite,
/// docs/benchmarks.md).
inline std::size_t first_non_finite(const float* p, std::size_t n) noexcept {
  constexpr std::size_t kBlock = 1024;
  constexpr std::uint32_t kExp = 0x7F800000u;
  for (std::size_t b = 0; b < n; b += kBlock) {
    const std::size_t e = n - b < kBlock ? n : b + kBlock;
    std::uint32_t bad = 0;
    for (std::size_t i = b; i < e; ++i) {
      std::uint32_t bits;
      std::memcpy(&bits, p + i, sizeof bits);
      bad |= static_cast<std::uint32_t>((bits & kExp) == kExp);
    }
    if (bad)
      for (std::size_t i = b; i < e; ++i)
        if (!std::isfinite(p[i])) return i;
  }
  return n;
}

/// Checks a row-major [rows x width] float buffer for NaN and infinities.
/// @param where called only on failure, returns the words that name the buffer ("stage of layers
///        [0, 4), micro-batch 2, output of layer 3 (decoder 2)")
/// @param row_name called only on failure with the bad row, returns words naming it ("row 5") 
/// @throws brigade::Error{NonFinite} "<where>: <value> at <row words>, column <c> of
///         [rows x width]" for the first non-finite element
template <class Where, class RowName>
void check_finite(const float* x, std::int64_t rows, std::int64_t width, Where&& where,
                  RowName&& row_name) {
  const auto n = static_cast<std::size_t>(rows * width);
  const std::size_t i = first_non_finite(x, n);
  if (i == n) return;
  const auto r = static_cast<std::int64_t>(i) / width, c = static_cast<std::int64_t>(i) % width;
  detail::fail(Errc::NonFinite, "{}: {} at {}, column {} of [{} x {}]", where(), x[i], row_name(r),
               c, rows, width);
}

}  // namespace v0
}  // namespace brigade
