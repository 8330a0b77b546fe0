// matmul_wt's small-M kernel for AVX2 + FMA + F16C (built with -mavx2 -mfma -mf16c whatever the
// library's target; run only where the CPU has all three: see cpu_kernels.cpp). Includes
// nothing with external linkage but the entry point, so no AVX2 code can leak into the generic
// build's functions.
#include "cpu_small_m_kernel.hpp"

#include <immintrin.h>

namespace brigade::cpu::detail {
namespace {

struct Avx2 {
  using Packet = __m256;
  static constexpr int kWidth = 8;
  /// sm_rows prefetches the next W rows from 2 x rows on (cpu_small_m_kernel.hpp).
  static constexpr int kPrefetchRows = 2;
  /// x packets as FMA memory operands where the compiler folds them (the blocking was tuned so
  /// on Zen 3; on Zen 5 a register x made no difference here).
  static constexpr bool kXInRegister = false;
  static __m256 zero() { return _mm256_setzero_ps(); }
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static float half(std::uint16_t h) { return _cvtsh_ss(h); }
  /// W elements k .. k + 7 of a row: F16 by F16C, BF16 by a 16-bit shift; Q8_0 (q8_load) as
  /// the int8 values times the block's scale (each product exact).
  template <DType WT>
  static __m256 load_w(const std::byte* row, std::int64_t k) {
    if constexpr (WT == DType::F32) {
      return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + k);
    } else if constexpr (WT == DType::F16) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k)));
    } else {  // BF16
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
  static __m256 q8_scale(const std::byte* row, std::int64_t k) {
    std::uint16_t d;
    std::memcpy(&d, row + (k >> 5) * 34, 2);
    return _mm256_set1_ps(half(d));
  }
  static __m256 q8_load(const std::byte* row, std::int64_t k, __m256 d) {
    const std::byte* q = row + (k >> 5) * 34 + 2 + (k & 31);
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d);
  }
  /// A float32 W row that starts `s` floats (1..7) past a 32-byte boundary: the in-register
  /// lane rotation and the lanes taken from the second aligned packet.
  struct Shift {
    __m256i idx;
    __m256 upper;
    int s;
  };
  static Shift make_shift(int s) {
    const __m256i i = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i is = _mm256_add_epi32(i, _mm256_set1_epi32(s));
    // lane i takes element (i + s) % 8 of the first packet when i + s < 8, else of the second
    return {_mm256_and_si256(is, _mm256_set1_epi32(7)),
            _mm256_castsi256_ps(_mm256_cmpgt_epi32(is, _mm256_set1_epi32(7))), s};
  }
  static __m256 load_aligned(const float* p) { return _mm256_load_ps(p); }
  /// Elements s .. s + 7 of the aligned packets lo, hi: each rotated, one blend.
  static __m256 combine(__m256 lo, __m256 hi, const Shift& sh) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, sh.idx),
                            _mm256_permutevar8x32_ps(hi, sh.idx), sh.upper);
  }
  static __m256 fma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
};

// 16 ymm registers: MR x NR accumulators (one 8-lane packet at a time), plus the weight packets
// and x packets live at once. F32 W: 2 x 6 (12 + 2 + up to 2), which beats 4 x 3 and 3 x 4 on
// Zen 3 by 1.1-1.6x at 4 and 16 rows: each x packet, which comes from L2 once per block of W
// rows, feeds 6 W rows (8 loads per 12 FMAs). A typed W (F16, BF16, Q8_0): 4 x 3, since every
// weight packet is converted (vcvtph2ps, shifts, int8 conversion and scale) once per block of x
// rows, and 6 conversions per 12 FMAs cost it 25-35% against 3. A GEMV of 4 W rows (4 weight
// streams). Measured with bench_kernels BM_MatmulSmallM and BM_MatmulSmallMTyped
// (docs/benchmarks.md, "Decode kernels per instruction set").
constexpr int kMR = 2, kNR = 6, kTypedMR = 4, kTypedNR = 3, kGemvNR = 4;

}  // namespace

void small_m_avx2(const float* x, const void* w, DType wt, float* out, std::int64_t tokens,
                  std::int64_t in, std::int64_t out_dim, std::int64_t n_begin, std::int64_t n_end,
                  bool accumulate, bool prefetch) {
  sm_dispatch<Avx2, kMR, kNR, kTypedMR, kTypedNR, kGemvNR>(x, w, wt, out, tokens, in, out_dim,
                                                           n_begin, n_end, accumulate, prefetch);
}

void dequantize_avx2(const void* w, DType wt, std::int64_t in, std::int64_t rows, float* out) {
  sm_dequantize<Avx2>(w, wt, in, rows, out);
}

}  // namespace brigade::cpu::detail
