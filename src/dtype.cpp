// Bulk float32 <-> F16/BF16 conversions (core/dtype.hpp).
#include "brigade/core/dtype.hpp"

#include <cstring>

namespace brigade {
inline namespace v0 {
namespace {

void check(std::int64_t n, DType t, const char* what) {
  if (n < 0)
    throw Error(Errc::InvalidArgument, fmt::format("{}: element count {} is negative", what, n));
  if (!is_float_dtype(t))
    throw Error(Errc::InvalidArgument,
                fmt::format("{}: dtype {} is not a float dtype (f32, f16, bf16)", what,
                            to_string(t)));
}

}  // namespace

void convert_from_f32(const float* src, void* dst, DType dst_dtype, std::int64_t n) {
  check(n, dst_dtype, "convert_from_f32");
  switch (dst_dtype) {
    case DType::F32:
      if (dst != src) std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
      return;
    case DType::F16: {
      auto* out = static_cast<std::uint16_t*>(dst);
      for (std::int64_t i = 0; i < n; ++i) out[i] = f32_to_f16(src[i]);
      return;
    }
    case DType::BF16: {
      auto* out = static_cast<std::uint16_t*>(dst);
      for (std::int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(src[i]);
      return;
    }
    default: return;
  }
}

void convert_to_f32(const void* src, DType src_dtype, float* dst, std::int64_t n) {
  check(n, src_dtype, "convert_to_f32");
  switch (src_dtype) {
    case DType::F32:
      if (dst != src) std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
      return;
    case DType::F16: {
      const auto* in = static_cast<const std::uint16_t*>(src);
      for (std::int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(in[i]);
      return;
    }
    case DType::BF16: {
      const auto* in = static_cast<const std::uint16_t*>(src);
      for (std::int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(in[i]);
      return;
    }
    default: return;
  }
}

}  // namespace v0
}  // namespace brigade
