// matmul_wt's small-M kernel for AVX-512F (built with -mavx512f -mf16c whatever the library's
// target; run only where the CPU and the OS support it: see cpu_kernels.cpp). Includes nothing with
// external linkage but the entry point, so no AVX-512 code can leak into other builds.
#include "cpu_small_m_kernel.hpp"

#include <immintrin.h>

namespace brigade::cpu::detail {
namespace {

struct Avx512 {
  using Packet = __m512;
  static constexpr int kWidth = 16;
  /// sm_rows prefetches the next W rows from 2 x rows on (cpu_small_m_kernel.hpp).
  static constexpr int kPrefetchRows = 2;
  /// sm_chunk keeps each x packet in a register for its NR FMAs (cpu_small_m_kernel.hpp).
  static constexpr bool kXInRegister = true;
  static __m512 zero() { return _mm512_setzero_ps(); }
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static float half(std::uint16_t h) { return _cvtsh_ss(h); }
  /// W elements k .. k + 15 of a row: F16 by vcvtph2ps, BF16 by a 16-bit shift; Q8_0
  /// (q8_load) as the int8 values times the block's scale (each product exact).
  template <DType WT>
  static __m512 load_w(const std::byte* row, std::int64_t k) {
    if constexpr (WT == DType::F32) {
      return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + k);
    } else if constexpr (WT == DType::F16) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * k)));
    } else {  // BF16
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * k));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
  static __m512 q8_scale(const std::byte* row, std::int64_t k) {
    std::uint16_t d;
    std::memcpy(&d, row + (k >> 5) * 34, 2);
    return _mm512_set1_ps(half(d));
  }
  static __m512 q8_load(const std::byte* row, std::int64_t k, __m512 d) {
    const std::byte* q = row + (k >> 5) * 34 + 2 + (k & 31);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), d);
  }
  /// A float32 W row that starts `s` floats (1..15) past a 64-byte line: the lane indices that
  /// pick elements s .. s + 15 from two aligned packets.
  struct Shift {
    __m512i idx;
    int s;
  };
  static Shift make_shift(int s) {
    return {_mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                             _mm512_set1_epi32(s)),
            s};
  }
  static __m512 load_aligned(const float* p) { return _mm512_load_ps(p); }
  /// Elements s .. s + 15 of the aligned packets lo, hi (one vpermt2ps).
  static __m512 combine(__m512 lo, __m512 hi, const Shift& sh) {
    return _mm512_permutex2var_ps(lo, sh.idx, hi);
  }
  static __m512 fma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
};

// 32 zmm registers. F32: 8 x 3 accumulators (24) with 3 weight packets, one x packet and, for a
// W off its lines, 3 carried aligned packets and the permutation; with x held in a register
// (kXInRegister) a step is 3 + 8 loads per 24 FMAs. On Zen 5 it beat 8 x 2 with x in a register
// at 8 and 16 rows, and over the 42M decode sweep it ran them 1.13-1.64x faster than the 8 x 2
// kernel with folded x loads (bench_kernels BM_DecodeSweep, docs/benchmarks.md).
// Typed W: 8 x 2 (16 accumulators; each weight packet is converted once per block of x rows),
// the blocking measured against 4 x 4 on Zen 5 (1.0-1.4x, BM_MatmulSmallMTyped). With x on a
// line (copied there, cpu_kernels.cpp) an 8-row batch is one block of x rows, so each weight
// packet is loaded once. A GEMV of 8 W rows (8 weight streams).
constexpr int kMR = 8, kNR = 3, kTypedMR = 8, kTypedNR = 2, kGemvNR = 8;

}  // namespace

void small_m_avx512(const float* x, const void* w, DType wt, float* out, std::int64_t tokens,
                    std::int64_t in, std::int64_t out_dim, std::int64_t n_begin, std::int64_t n_end,
                    bool accumulate, bool prefetch) {
  sm_dispatch<Avx512, kMR, kNR, kTypedMR, kTypedNR, kGemvNR>(x, w, wt, out, tokens, in, out_dim,
                                                             n_begin, n_end, accumulate, prefetch);
}

void dequantize_avx512(const void* w, DType wt, std::int64_t in, std::int64_t rows, float* out) {
  sm_dequantize<Avx512>(w, wt, in, rows, out);
}

}  // namespace brigade::cpu::detail
