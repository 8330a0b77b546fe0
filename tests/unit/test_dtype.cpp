// brigade::DType: sizes, names, and the float32 <-> F16/BF16 conversions against an independent
// reference (round to nearest even computed in double precision over the two neighbours).
#include "brigade/core/dtype.hpp"

#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

using brigade::DType;
using brigade::Errc;
using brigade::Error;

namespace {

/// The half nearest to f by exhaustive search among the finite halves' neighbours of f,
/// ties to the even bit pattern; NaN excluded. Overflow: beyond 65520 in magnitude is infinity.
std::uint16_t f16_reference(float f) {
  const double x = f;
  const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(x);
  if (a >= 65520.0) return sign | 0x7c00;
  // Binary search over the non-negative finite halves (monotone in their bit patterns).
  std::uint16_t lo = 0, hi = 0x7bff;
  while (hi - lo > 1) {
    const auto mid = static_cast<std::uint16_t>((lo + hi) / 2);
    if (static_cast<double>(brigade::f16_to_f32(mid)) <= a) lo = mid; else hi = mid;
  }
  const double dl = a - brigade::f16_to_f32(lo), dh = brigade::f16_to_f32(hi) - a;
  std::uint16_t pick = dl < dh ? lo : dh < dl ? hi : ((lo & 1) ? hi : lo);
  if (dl < 0) pick = lo;  // a below lo cannot happen except a == 0
  return sign | pick;
}

}  // namespace

TEST_CASE("dtype: sizes, blocks and names") {
  CHECK(brigade::dtype_block_bytes(DType::F32) == 4);
  CHECK(brigade::dtype_block_bytes(DType::F16) == 2);
  CHECK(brigade::dtype_block_bytes(DType::BF16) == 2);
  CHECK(brigade::dtype_block_bytes(DType::I32) == 4);
  CHECK(brigade::dtype_block_bytes(DType::U8) == 1);
  CHECK(brigade::dtype_block_bytes(DType::Q8_0) == 34);
  CHECK(brigade::dtype_element_bytes(DType::Q8_0) == doctest::Approx(1.0625));
  CHECK(brigade::dtype_bytes(DType::BF16, 7) == 14);
  CHECK(brigade::dtype_bytes(DType::Q8_0, 64) == 68);
  CHECK_THROWS_AS(brigade::dtype_bytes(DType::Q8_0, 33), Error);
  CHECK_THROWS_AS(brigade::dtype_bytes(DType::F32, -1), Error);
  for (int i = 0; i < brigade::kNumDTypes; ++i) {
    const auto t = static_cast<DType>(i);
    CHECK(brigade::parse_dtype(brigade::to_string(t)) == t);
  }
  CHECK(!brigade::parse_dtype("fp16").has_value());
  CHECK(brigade::is_float_dtype(DType::BF16));
  CHECK(!brigade::is_float_dtype(DType::Q8_0));
}

TEST_CASE("dtype: every half converts to float32 and back to the same bits") {
  int nans = 0;
  for (std::uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = brigade::f16_to_f32(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) {
      ++nans;
      CHECK(std::isnan(brigade::f16_to_f32(brigade::f32_to_f16(f))));
      continue;
    }
    REQUIRE(brigade::f32_to_f16(f) == h);
  }
  CHECK(nans == 2 * 1023);
  CHECK(brigade::f16_to_f32(0x3c00) == 1.0f);
  CHECK(brigade::f16_to_f32(0x0001) == std::ldexp(1.0f, -24));  // smallest subnormal
  CHECK(brigade::f16_to_f32(0x7bff) == 65504.0f);
  CHECK(brigade::f16_to_f32(0xfc00) == -std::numeric_limits<float>::infinity());
}

TEST_CASE("dtype: float32 to half rounds to nearest even, subnormals and overflow included") {
  CHECK(brigade::f32_to_f16(65504.0f) == 0x7bff);
  CHECK(brigade::f32_to_f16(65519.99f) == 0x7bff);
  CHECK(brigade::f32_to_f16(65520.0f) == 0x7c00);   // the tie rounds to even: infinity
  CHECK(brigade::f32_to_f16(std::ldexp(1.0f, -25)) == 0x0000);  // tie to even: zero
  CHECK(brigade::f32_to_f16(std::ldexp(1.5f, -25)) == 0x0001);
  CHECK(brigade::f32_to_f16(std::ldexp(3.0f, -25)) == 0x0002);  // 1.5 units: tie to even 2
  CHECK(brigade::f32_to_f16(-0.0f) == 0x8000);
  CHECK(brigade::f32_to_f16(1.0f / 3.0f) == 0x3555);
  CHECK(brigade::f32_to_f16(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);  // tie: even 1.0
  CHECK(brigade::f32_to_f16(1.0f + std::ldexp(3.0f, -11)) == 0x3c02);  // tie: even up
  // Every 997th float32 bit pattern (all exponents, both signs), against the reference.
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 997) {
    const float f = std::bit_cast<float>(static_cast<std::uint32_t>(u));
    if (std::isnan(f)) continue;
    const std::uint16_t got = brigade::f32_to_f16(f);
    if (got != f16_reference(f)) {
      FAIL("f32_to_f16(" << f << " = 0x" << std::hex << u << ") = 0x" << got << ", expected 0x"
                         << f16_reference(f));
    }
  }
}

TEST_CASE("dtype: bfloat16 rounds to nearest even and round-trips every value") {
  CHECK(brigade::f32_to_bf16(1.0f) == 0x3f80);
  CHECK(brigade::f32_to_bf16(std::bit_cast<float>(0x3f808000u)) == 0x3f80);  // tie: even
  CHECK(brigade::f32_to_bf16(std::bit_cast<float>(0x3f818000u)) == 0x3f82);  // tie: even up
  CHECK(brigade::f32_to_bf16(std::bit_cast<float>(0x3f808001u)) == 0x3f81);
  CHECK(brigade::f32_to_bf16(std::bit_cast<float>(0x7f7fffffu)) == 0x7f80);  // overflow: inf
  CHECK(std::isnan(brigade::bf16_to_f32(brigade::f32_to_bf16(std::nanf("")))));
  // A NaN whose payload sits in the low bits only stays a NaN (not infinity).
  CHECK(std::isnan(brigade::bf16_to_f32(brigade::f32_to_bf16(std::bit_cast<float>(0x7f800001u)))));
  for (std::uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = brigade::bf16_to_f32(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) continue;
    REQUIRE(brigade::f32_to_bf16(f) == h);
  }
}

TEST_CASE("dtype: bulk conversions match the scalar ones and refuse what is not a float") {
  std::vector<float> src = {0.0f, -1.5f, 3.14159f, 65504.0f, 1e-6f, -7e4f, 1e-30f};
  const auto n = static_cast<std::int64_t>(src.size());
  for (const DType t : {DType::F16, DType::BF16}) {
    std::vector<std::uint16_t> narrow(src.size());
    brigade::convert_from_f32(src.data(), narrow.data(), t, n);
    std::vector<float> back(src.size());
    brigade::convert_to_f32(narrow.data(), t, back.data(), n);
    for (std::size_t i = 0; i < src.size(); ++i) {
      const std::uint16_t s = t == DType::F16 ? brigade::f32_to_f16(src[i])
                                              : brigade::f32_to_bf16(src[i]);
      CHECK(narrow[i] == s);
      CHECK(back[i] == (t == DType::F16 ? brigade::f16_to_f32(s) : brigade::bf16_to_f32(s)));
    }
  }
  std::vector<float> copy(src.size());
  brigade::convert_from_f32(src.data(), copy.data(), DType::F32, n);
  CHECK(copy == src);
  try {
    brigade::convert_from_f32(src.data(), copy.data(), DType::Q8_0, n);
    FAIL("q8_0 accepted");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::InvalidArgument);
    CHECK(std::string(e.what()).find("q8_0") != std::string::npos);
  }
  CHECK_THROWS_AS(brigade::convert_to_f32(copy.data(), DType::I32, copy.data(), n), Error);
  CHECK_THROWS_AS(brigade::convert_to_f32(copy.data(), DType::F32, copy.data(), -1), Error);
}
