// brigade::DType: the one element-type enum of the library (message payloads, device tensors,
// stored weights), with exact scalar conversions between float32 and the 16-bit formats.
#pragma once

#include "brigade/core/error.hpp"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace brigade {
inline namespace v0 {

/// Element type of a tensor, a message payload or a stored weight matrix. The numeric values are
/// part of the MPI and NCCL wire format (MessageHeader::dtype) and must not change.
enum class DType : std::uint8_t {
  F32 = 0,   ///< IEEE 754 binary32
  F16 = 1,   ///< IEEE 754 binary16 (5-bit exponent, 10-bit mantissa)
  BF16 = 2,  ///< bfloat16: the top 16 bits of a binary32 (8-bit exponent, 7-bit mantissa)
  I32 = 3,   ///< two's-complement int32 (token ids, positions, sizes)
  U8 = 4,    ///< raw bytes (serialised records: descriptors, gathered timelines)
  Q8_0 = 5,  ///< llama.cpp's Q8_0 weight blocks: 32 int8 values after one binary16 scale d,
             ///< value i = d * q[i]; 34 bytes per block of 32 (weights only, never a payload)
};

/// Number of DType values.
inline constexpr int kNumDTypes = 6;

/// Elements per storage block of `t`: 32 for Q8_0, 1 for every element type.
constexpr std::int64_t dtype_block_elements(DType t) noexcept { return t == DType::Q8_0 ? 32 : 1; }

/// Bytes per storage block of `t` (per element for every type but Q8_0): 4, 2, 2, 4, 1, 34.
constexpr std::size_t dtype_block_bytes(DType t) noexcept {
  switch (t) {
    case DType::F32:
    case DType::I32: return 4;
    case DType::F16:
    case DType::BF16: return 2;
    case DType::U8: return 1;
    case DType::Q8_0: return 34;
  }
  return 0;
}

/// Average bytes per element of `t` (Q8_0: 34 / 32 = 1.0625), for memory and traffic models.
constexpr double dtype_element_bytes(DType t) noexcept {
  return static_cast<double>(dtype_block_bytes(t)) / static_cast<double>(dtype_block_elements(t));
}

/// Bytes that hold `n` elements of `t`.
/// @throws brigade::Error{InvalidArgument} if n < 0, or n is not a multiple of Q8_0's 32-element
///         block (naming n and the dtype)
inline std::size_t dtype_bytes(DType t, std::int64_t n) {
  const std::int64_t block = dtype_block_elements(t);
  if (n < 0 || n % block != 0)
    throw Error(Errc::InvalidArgument,
                fmt::format("{} elements of dtype {} do not fill whole blocks of {} elements",
                            n, static_cast<int>(t), block));
  return static_cast<std::size_t>(n / block) * dtype_block_bytes(t);
}

/// Name of `t` as GGUF and the command line spell it: "f32", "f16", "bf16", "i32", "u8", "q8_0".
constexpr std::string_view to_string(DType t) noexcept {
  switch (t) {
    case DType::F32: return "f32";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
    case DType::I32: return "i32";
    case DType::U8: return "u8";
    case DType::Q8_0: return "q8_0";
  }
  return "unknown";
}

/// The DType named `name` (as to_string writes it), or nullopt.
constexpr std::optional<DType> parse_dtype(std::string_view name) noexcept {
  for (int i = 0; i < kNumDTypes; ++i)
    if (to_string(static_cast<DType>(i)) == name) return static_cast<DType>(i);
  return std::nullopt;
}

/// True for the floating-point element types a float32 value converts to and from (F32, F16,
/// BF16): the dtypes an activation or gradient payload may travel in.
constexpr bool is_float_dtype(DType t) noexcept {
  return t == DType::F32 || t == DType::F16 || t == DType::BF16;
}

/// The float32 value of a bfloat16 (exact: bfloat16 is the top half of a float32).
constexpr float bf16_to_f32(std::uint16_t h) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}

/// `f` rounded to bfloat16, to nearest with ties to even; NaN stays a (quiet) NaN with its sign,
/// values beyond the largest bfloat16 round to infinity.
constexpr std::uint16_t f32_to_bf16(float f) noexcept {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}

/// The float32 value of an IEEE binary16 (exact: every half, subnormals included, is a float).
constexpr float f16_to_f32(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));  // inf, NaN
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return std::bit_cast<float>(sign);  // signed zero
  // Subnormal half: mant * 2^-24, normalised into a float's exponent.
  std::uint32_t e = 113;
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  return std::bit_cast<float>(sign | (e << 23) | ((mant & 0x3ffu) << 13));
}

/// `f` rounded to IEEE binary16, to nearest with ties to even (subnormal halves included);
/// beyond 65504 (after rounding) it becomes infinity; NaN stays a (quiet) NaN with its sign.
constexpr std::uint16_t f32_to_f16(float f) noexcept {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u)  // NaN: keep the top mantissa bits, force quiet
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {  // below the smallest normal half (2^-14): a subnormal or zero
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal (2^-25): zero
    const std::uint32_t e = abs >> 23;
    const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - e;  // value = mant * 2^(e-150); half unit = 2^-24
    std::uint32_t half = mant >> shift;
    const std::uint32_t rest = mant & ((1u << shift) - 1u);
    const std::uint32_t mid = 1u << (shift - 1u);
    if (rest > mid || (rest == mid && (half & 1u))) ++half;
    return static_cast<std::uint16_t>(sign | half);
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to even; a
  // carry into the exponent is the correct result (up to infinity, excluded above).
  const std::uint32_t rebased = abs - (112u << 23);
  const std::uint32_t rounding = 0xfffu + ((rebased >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | ((rebased + rounding) >> 13));
}

/// Converts `n` float32 values to `dst_dtype` (F32: a copy; F16, BF16: rounded to nearest even).
/// @param src [n] float32
/// @param dst [n] elements of `dst_dtype`; must not overlap src unless dst_dtype is F32 and
///            dst == src
/// @throws brigade::Error{InvalidArgument} if n < 0 or dst_dtype is not a float dtype
void convert_from_f32(const float* src, void* dst, DType dst_dtype, std::int64_t n);

/// Converts `n` values of `src_dtype` (F32, F16 or BF16) to float32 (exact).
/// @param src [n] elements of `src_dtype`
/// @param dst [n] float32; must not overlap src unless src_dtype is F32 and dst == src
/// @throws brigade::Error{InvalidArgument} if n < 0 or src_dtype is not a float dtype
void convert_to_f32(const void* src, DType src_dtype, float* dst, std::int64_t n);

}  // namespace v0
}  // namespace brigade
