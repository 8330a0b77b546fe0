// matmul_wt's small-M kernel for AVX2 + FMA (built with -mavx2 -mfma whatever the library's
// target; run only where the CPU has both: see cpu_kernels.cpp). Includes nothing with external
// linkage but the entry point, so no AVX2 code can leak into the generic build's functions.
#include "cpu_small_m_kernel.hpp"

#include <immintrin.h>

namespace brigade::cpu::detail {
namespace {

struct Avx2 {
  using Packet = __m256;
  static constexpr int kWidth = 8;
  static __m256 zero() { return _mm256_setzero_ps(); }
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 fma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
};

// 16 ymm registers: MR x NR accumulators (one 8-lane packet at a time), plus NR weight packets
// and one x packet live at once: 4 x 3 (12 + 3 + 1), 7 loads per 12 FMAs; a GEMV of 4 W rows
// (4 weight streams). Measured on Zen 3 with bench_kernels BM_MatmulSmallM (docs/benchmarks.md).
constexpr int kMR = 4, kNR = 3, kGemvNR = 4;

}  // namespace

void small_m_avx2(const float* x, const float* w, float* out, std::int64_t tokens,
                  std::int64_t in, std::int64_t out_dim, std::int64_t n_begin, std::int64_t n_end,
                  bool accumulate) {
  sm_dispatch<Avx2, kMR, kNR, kGemvNR>(x, w, out, tokens, in, out_dim, n_begin, n_end,
                                       accumulate);
}

}  // namespace brigade::cpu::detail
