// Intra-op threads of the CPU kernels: each thread that runs kernels (a stage's thread, the main
// thread of a one-stage run) owns a team of cpu::blas_threads() - 1 workers that spin between
// parallel regions, so a fork and join costs well under a microsecond: single-sequence decode
// splits every weight matrix of 0.5-4 MB over the cores, about 60 regions per token.
//
// One pool for every kernel: OpenBLAS runs single-threaded inside each part (its own pthreads
// pool stays idle) and Eigen's GEMM is never given OpenMP threads. Two pools on the same cores
// (OpenBLAS's and Eigen's OpenMP team, as brigade had before) busy-wait against each other:
// 2-thread prefill of the 42M Llama ran at 0.8x of one thread on a 2-core machine.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace brigade::cpu::detail {

/// Work under this many flops (or the equivalent in bytes streamed) stays on the calling thread:
/// a fork and join of a spinning team costs about a microsecond, 2e5 flops a few.
inline constexpr double kParallelMinFlops = 2e5;

/// Rows of W per call when a packing GEMM (OpenBLAS's SGEMM, Eigen's GEMM) of `rows` rows of W
/// is cut for the threads: ceil(rows / 256) calls of equal size (rounded up to 8 rows, the
/// last call shorter: 1376 rows as 5 x 232 + 216). The cut depends on the shape only, so the one-thread path makes the same
/// calls: a packing GEMM's rounding depends on where its micro-kernel tiles fall, which moves
/// with the size of each call. Each call packs the other operand again: 256 rows keep that
/// within about 3% of one call (OpenBLAS 0.3.21 on Zen 3, K = 512 and 1376; 128 rows cost 5-7%).
inline std::int64_t gemm_chunk(std::int64_t rows) noexcept {
  const std::int64_t calls = std::max<std::int64_t>(1, (rows + 255) / 256);
  return ((rows + calls - 1) / calls + 7) / 8 * 8;
}

/// Threads a kernel of `flops` uses: cpu::blas_threads(), or 1 under kParallelMinFlops or when
/// called from inside a part of a parallel region (teams never nest).
int intra_op_threads(double flops) noexcept;

/// Runs fn(ctx, p) for p in [0, parts) with part 0 on the calling thread and parts 1.. on the
/// calling thread's workers (started on first use, kept until the thread exits), and returns
/// when all are done. parts must be <= cpu::blas_threads(); parts <= 1 runs inline. The first
/// exception thrown by a part is rethrown here after every part has finished.
void run_parts(int parts, void (*fn)(void*, int), void* ctx);

/// run_parts over a callable f(int part).
template <class F>
void parallel_parts(int parts, F&& f) {
  if (parts <= 1) {
    f(0);
    return;
  }
  using Fn = std::remove_reference_t<F>;
  run_parts(parts, [](void* c, int p) { (*static_cast<Fn*>(c))(p); },
            const_cast<void*>(static_cast<const void*>(&f)));
}

/// Runs f(begin, end) over [0, n) cut into chunks of `chunk` items (the last one shorter), the
/// chunks dealt in contiguous runs to min(threads, chunks) parts. The cut does not depend on the
/// thread count: work done per chunk gives the same bits at any thread count.
template <class F>
void parallel_chunks(std::int64_t n, std::int64_t chunk, int threads, F&& f) {
  const std::int64_t chunks = (n + chunk - 1) / chunk;
  const int parts = static_cast<int>(std::min<std::int64_t>(threads, chunks));
  parallel_parts(parts, [&](int p) {
    for (std::int64_t c = chunks * p / parts; c < chunks * (p + 1) / parts; ++c)
      f(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

/// [begin, end) of part p of n items split into `parts` contiguous ranges, each a multiple of
/// `granule` items except the last.
inline void part_range(std::int64_t n, int parts, int p, std::int64_t granule,
                       std::int64_t& begin, std::int64_t& end) noexcept {
  const std::int64_t units = (n + granule - 1) / granule;
  begin = std::min(n, units * p / parts * granule);
  end = std::min(n, units * (p + 1) / parts * granule);
}

}  // namespace brigade::cpu::detail
