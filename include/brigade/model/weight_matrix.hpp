// A weight matrix kept in its stored dtype (F32, F16, BF16 or Q8_0): the typed view the CPU
// kernels read directly, and the exact conversions to and from float32.
#pragma once

#include "brigade/core/dtype.hpp"

#include <cstddef>
#include <cstdint>

namespace brigade::model {
inline namespace v0 {

/// A read-only view of a row-major [rows x cols] weight matrix (llama2.c's and GGUF's `out x in`
/// layout: y = W x is y[i] = sum_j W[i, j] x[j]) stored in `dtype`. The shape is not stored: it
/// comes from the model's config. Layouts, row after row with no padding:
/// - F32: cols float32 per row.
/// - F16, BF16: cols 16-bit values per row (IEEE binary16 / bfloat16 bit patterns, host order).
/// - Q8_0: llama.cpp's block_q8_0 (ggml-common.h), cols / 32 blocks per row, each 34 bytes:
///   a binary16 scale d, then 32 int8 q; element i of the block is d * q[i] (exact in float32:
///   an 11-bit times an 8-bit significand). cols must be a multiple of 32: a row is never padded
///   to whole blocks (check_weight_shape refuses it). Blocks are 2-byte aligned at best.
/// An F32 matrix converts implicitly from `const float*`, so float32 code builds it as before.
struct WeightMatrix {
  const void* data = nullptr;  ///< the first byte of row 0
  DType dtype = DType::F32;    ///< F32, F16, BF16 or Q8_0

  constexpr WeightMatrix() noexcept = default;
  /// An F32 matrix at `f32` (implicit on purpose: every float32 weight pointer is one).
  constexpr WeightMatrix(const float* f32) noexcept : data(f32) {}  // NOLINT: implicit
  /// A matrix of `t` at `p` (the layout above).
  constexpr WeightMatrix(const void* p, DType t) noexcept : data(p), dtype(t) {}

  constexpr explicit operator bool() const noexcept { return data != nullptr; }
  constexpr bool operator==(const WeightMatrix&) const noexcept = default;

  /// The float32 data.
  /// @throws brigade::Error{InvalidArgument} naming the dtype if it is not F32
  const float* f32() const;
};

/// True for the dtypes a WeightMatrix may hold: F32, F16, BF16, Q8_0.
constexpr bool is_weight_dtype(DType t) noexcept {
  return t == DType::F32 || t == DType::F16 || t == DType::BF16 || t == DType::Q8_0;
}

/// Bytes of one row of `cols` elements of `t` (Q8_0: cols / 32 * 34).
/// @throws brigade::Error{InvalidArgument} as check_weight_shape
std::size_t weight_row_bytes(DType t, std::int64_t cols);

/// Refuses what no kernel reads: `t` not a weight dtype, cols < 0, or a Q8_0 row whose cols is
/// not a multiple of 32 (rows are whole blocks; llama.cpp refuses it the same way).
/// @throws brigade::Error{InvalidArgument} naming `what`, the dtype and cols
void check_weight_shape(DType t, std::int64_t cols, const char* what);

/// Row `n` of `w` ([? x cols]): its first byte.
inline const std::byte* weight_row(WeightMatrix w, std::int64_t cols, std::int64_t n) noexcept {
  const std::int64_t bytes = w.dtype == DType::Q8_0
                                 ? cols / 32 * 34
                                 : cols * static_cast<std::int64_t>(dtype_block_bytes(w.dtype));
  return static_cast<const std::byte*>(w.data) + n * bytes;
}

/// Rows [row0, row0 + rows) of `w` ([? x cols]) as float32 into out [rows x cols] (exact: every
/// F16, BF16 and Q8_0 value is a float32).
/// @throws brigade::Error{InvalidArgument} as check_weight_shape, or if rows or row0 < 0
void dequantize_rows(WeightMatrix w, std::int64_t cols, std::int64_t row0, std::int64_t rows,
                     float* out);

/// The first element of `w` ([rows x cols], row-major) that is not finite, as rows * cols + 0 ..
/// rows * cols - 1 in row-major order, or rows * cols when every element is finite: F32 by
/// core/finite.hpp's scan, F16 and BF16 by their exponent bits, Q8_0 by its blocks' scales (each
/// int8 value is finite). The loaders' check of a file's weights (a NaN weight would only show
/// as a NaN logit later).
/// @throws brigade::Error{InvalidArgument} as check_weight_shape, or if rows < 0
std::size_t first_non_finite_weight(WeightMatrix w, std::int64_t rows, std::int64_t cols);

/// Converts a float32 [rows x cols] matrix to `t` in `dst` (rows * weight_row_bytes(t, cols)
/// bytes): F16 and BF16 rounded to nearest even (core/dtype.hpp); Q8_0 as llama.cpp's
/// quantize_row_q8_0_ref: per block of 32, amax = max |x|, d = amax / 127 (float32),
/// q = roundf(x * (1 / d)) (halves away from zero; 0 when d is 0), the stored scale d rounded to
/// binary16.
/// @throws brigade::Error{InvalidArgument} as check_weight_shape, or if rows < 0
void quantize_rows(const float* src, std::int64_t rows, std::int64_t cols, DType t, void* dst);

}  // namespace v0
}  // namespace brigade::model
