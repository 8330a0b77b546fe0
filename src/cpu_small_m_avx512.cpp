// matmul_wt's small-M kernel for AVX-512F (built with -mavx512f whatever the library's target;
// run only where the CPU and the OS support it: see cpu_kernels.cpp). Includes nothing with
// external linkage but the entry point, so no AVX-512 code can leak into other builds.
#include "cpu_small_m_kernel.hpp"

#include <immintrin.h>

namespace brigade::cpu::detail {
namespace {

struct Avx512 {
  using Packet = __m512;
  static constexpr int kWidth = 16;
  static __m512 zero() { return _mm512_setzero_ps(); }
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 fma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
};

// 32 zmm registers: 4 x 4 accumulators (16) with 4 weight packets and one x packet; a GEMV of 8
// W rows (8 weight streams). Tuned on Emerald Rapids (bench_kernels BM_MatmulSmallM, docs/benchmarks.md).
constexpr int kMR = 4, kNR = 4, kGemvNR = 8;

}  // namespace

void small_m_avx512(const float* x, const float* w, float* out, std::int64_t tokens,
                    std::int64_t in, std::int64_t out_dim, std::int64_t n_begin,
                    std::int64_t n_end, bool accumulate) {
  sm_dispatch<Avx512, kMR, kNR, kGemvNR>(x, w, out, tokens, in, out_dim, n_begin, n_end,
                                         accumulate);
}

}  // namespace brigade::cpu::detail
