// The element-wise kernels (e^x, softmax, SwiGLU) and the float32 e^x they share, written once
// and built in every instruction set's translation unit (internal to src/).
//
// The C library's expf is a function call per element, and it was 60% of a 512-token prefill's
// attention (softmax over 131k scores per head and layer) and all of SwiGLU's 1.5 ms per layer
// on the 42M shape (docs/benchmarks.md, "Prefill's exponentials"). exp_f32 is straight-line
// float arithmetic, so a loop over it vectorizes: Cody-Waite range reduction x = n ln2 + r with
// |r| <= ln2 / 2 (n = round(x / ln2) by the 1.5 * 2^23 shift), e^r by its Taylor polynomial to
// r^7 / 7! (truncation below 1e-8 relative), and 2^n put into the exponent field. Every
// multiply-add is an explicit fma and the library builds with -ffp-contract=off, so each element
// goes through the same operations whatever the vector width: the generic, AVX2 and AVX-512
// builds (each translation unit with -fno-trapping-math, so that the selects vectorize on AVX2
// too) give the same bits (tests/unit/test_cpu_kernels.cpp, "cpu_kernels.vexp"). Softmax's
// maximum and sum run over the 16 lanes of cpu_small_m.hpp (lane l takes elements l, l + 16,
// ...; the lanes reduced by reduce_lanes, then the tail left to right), in every build.
// Accuracy: within 1 ulp of e^x over [-87.3, 88.7] (the same test sweeps it against double
// exp). Outside: e^x < FLT_MIN (x < -87.34) is flushed to 0 where expf returns a subnormal,
// x > ln(FLT_MAX) gives +inf, NaN stays NaN.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_small_m.hpp"

namespace brigade::cpu::detail {

/// One instruction set's element-wise kernels; every set gives the same bits.
struct ElementwiseKernels {
  /// x[i] = e^(x[i] - shift) for i < n (the subtraction rounded to float first).
  void (*exp)(float* x, std::int64_t n, float shift);
  /// In place over x[0..n), n >= 1: t = x / divisor, then e^(t - max t) / their sum.
  void (*softmax)(float* x, std::int64_t n, float divisor);
  /// gate[i] = (gate[i] * (1 / (1 + e^-gate[i]))) * up[i] for i < n.
  void (*swiglu)(float* gate, const float* up, std::int64_t n);
};

/// The portable build (src/cpu_elementwise_generic.cpp), the AVX2 + FMA build
/// (src/cpu_elementwise_avx2.cpp) and the AVX-512F build (src/cpu_elementwise_avx512.cpp).
extern const ElementwiseKernels kElementwiseGeneric, kElementwiseAvx2, kElementwiseAvx512;

// Internal linkage on purpose, as cpu_small_m.hpp: each translation unit (each built for its
// own instruction set) keeps its own copy.
namespace {

/// e^x (see the file comment).
inline float exp_f32(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kShift = 12582912.0f;             // 1.5 * 2^23: x + kShift rounds x to an integer
  constexpr float kLn2Hi = 0.693145751953125f;      // ln 2 to 15 bits: n * kLn2Hi is exact
  constexpr float kLn2Lo = 1.42860676533018708e-06f;  // ln 2 - kLn2Hi
  constexpr float kMax = 88.72283935546875f;        // ln(FLT_MAX), rounded down
  constexpr float kMin = -87.33654022216797f;       // ln(FLT_MIN)
  // Clamped so that n stays in [-126, 128]; a NaN passes through every step.
  const float c = x < kMin ? kMin : (x > kMax ? kMax : x);
  const float n = std::fma(c, kLog2e, kShift) - kShift;
  float r = std::fma(-n, kLn2Hi, c);
  r = std::fma(-n, kLn2Lo, r);
  float p = 1.0f / 5040.0f;
  p = std::fma(p, r, 1.0f / 720.0f);
  p = std::fma(p, r, 1.0f / 120.0f);
  p = std::fma(p, r, 1.0f / 24.0f);
  p = std::fma(p, r, 1.0f / 6.0f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  // 2^n for n in [-126, 128]: 2^(n - 1) * 2 above 0, so that the exponent field stays normal.
  // Every operation runs for every element and only constants and computed values are selected
  // (no arithmetic under a condition, which a vectorizer may not run speculatively on AVX2).
  const auto ni = static_cast<std::int32_t>(n);
  const std::int32_t e = ni - (ni > 0 ? 1 : 0);
  float y = p * std::bit_cast<float>((e + 127) << 23);
  y *= ni > 0 ? 2.0f : 1.0f;
  y = x < kMin ? 0.0f : y;
  return x > kMax ? std::numeric_limits<float>::infinity() : y;
}

/// ElementwiseKernels::exp, for each translation unit to build.
inline void exp_loop(float* x, std::int64_t n, float shift) {
  for (std::int64_t i = 0; i < n; ++i) x[i] = exp_f32(x[i] - shift);
}

/// ElementwiseKernels::softmax, for each translation unit to build: the maximum and the sum in
/// the fixed lane order (the file comment).
inline void softmax_loop(float* x, std::int64_t n, float divisor) {
  constexpr int L = kSmallMLanes;
  const std::int64_t n_vec = n - n % L;
  float lanes[L];
  for (int l = 0; l < L; ++l) lanes[l] = -std::numeric_limits<float>::infinity();
  for (std::int64_t i = 0; i < n_vec; i += L)
    for (int l = 0; l < L; ++l) {
      const float t = x[i + l] / divisor;
      x[i + l] = t;
      lanes[l] = t > lanes[l] ? t : lanes[l];
    }
  float m = lanes[0];
  for (int l = 1; l < L; ++l) m = lanes[l] > m ? lanes[l] : m;
  for (std::int64_t i = n_vec; i < n; ++i) {
    const float t = x[i] / divisor;
    x[i] = t;
    m = t > m ? t : m;
  }
  exp_loop(x, n, m);
  for (int l = 0; l < L; ++l) lanes[l] = 0.0f;
  for (std::int64_t i = 0; i < n_vec; i += L)
    for (int l = 0; l < L; ++l) lanes[l] += x[i + l];
  float sum = reduce_lanes(lanes);
  for (std::int64_t i = n_vec; i < n; ++i) sum += x[i];
  for (std::int64_t i = 0; i < n; ++i) x[i] /= sum;
}

/// ElementwiseKernels::swiglu, for each translation unit to build.
inline void swiglu_loop(float* gate, const float* up, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    float v = gate[i];
    v *= 1.0f / (1.0f + exp_f32(-v));
    gate[i] = v * up[i];
  }
}

}  // namespace
}  // namespace brigade::cpu::detail
