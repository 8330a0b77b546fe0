// plan::measure_cpu_rates: the planner's rates, measured on this machine.
#include "brigade/plan/inference_plan.hpp"

#include "brigade/backend/cpu.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>

namespace brigade::plan {
inline namespace v0 {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// Bytes per second of `threads` threads each running a STREAM triad over 3 x 32 MiB of their
/// own (best of 3 passes; the first pass also touches the pages).
double triad_bytes_per_s(int threads) {
  constexpr std::size_t n = 8u << 20;
  std::vector<std::vector<float>> a(static_cast<std::size_t>(threads)),
      b(static_cast<std::size_t>(threads)), c(static_cast<std::size_t>(threads));
  double best = 1e30;
  for (int pass = 0; pass < 4; ++pass) {
    std::vector<std::thread> pool;
    const double t0 = now_s();
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        auto& pa = a[static_cast<std::size_t>(t)];
        auto& pb = b[static_cast<std::size_t>(t)];
        auto& pc = c[static_cast<std::size_t>(t)];
        if (pa.empty()) {
          pa.assign(n, 0.0f);
          pb.assign(n, 1.0f);
          pc.assign(n, 2.0f);
        }
        for (std::size_t i = 0; i < n; ++i) pa[i] = pb[i] + 3.0f * pc[i];
      });
    for (auto& th : pool) th.join();
    if (pass > 0) best = std::min(best, now_s() - t0);
  }
  return 3.0 * sizeof(float) * static_cast<double>(n) * threads / best;
}

/// FLOP/s of `threads` threads each running matmul_wt (16 x 512 by 1376 x 512, its own buffers)
/// 12 times at once: the sum of each thread's best repetition.
double kernel_flops_per_s(int threads) {
  constexpr std::int64_t T = 16, K = 512, N = 1376;
  std::vector<double> rate(static_cast<std::size_t>(threads));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&rate, t] {
      std::vector<float> x(T * K, 0.5f), w(N * K, 0.25f), y(T * N);
      double best = 1e30;
      for (int rep = 0; rep < 12; ++rep) {
        const double t0 = now_s();
        cpu::matmul_wt(x.data(), w.data(), y.data(), T, K, N);
        if (rep > 1) best = std::min(best, now_s() - t0);
      }
      rate[static_cast<std::size_t>(t)] = 2.0 * T * K * N / best;
    });
  for (auto& th : pool) th.join();
  double sum = 0.0;
  for (double v : rate) sum += v;
  return sum;
}

}  // namespace

CpuRates measure_cpu_rates(int cores) {
  BRIGADE_CHECK(cores >= 1, Errc::InvalidArgument, "measure_cpu_rates: cores = {}; expected >= 1",
                cores);
  CpuRates r;
  r.cores = cores;
  r.core_bytes_per_s = triad_bytes_per_s(1);
  r.box_bytes_per_s = cores > 1 ? triad_bytes_per_s(cores) : r.core_bytes_per_s;

  // The decode kernel's FP32 rate: 16 rows against a cached 1376 x 512 weight, one thread
  // alone, then `cores` such threads at once (their sum).
  const int threads_before = cpu::blas_threads();
  cpu::set_blas_threads(1);
  r.flops_per_s = kernel_flops_per_s(1);
  r.box_flops_per_s = cores > 1 ? kernel_flops_per_s(cores) : r.flops_per_s;
  cpu::set_blas_threads(threads_before);

  // Fork/join of one intra-op parallel product (median of 201 empty parallel regions).
  if (cores > 1) {
    std::vector<double> s;
    for (int rep = 0; rep < 201; ++rep) {
      const double t0 = now_s();
#pragma omp parallel num_threads(cores)
      { asm volatile("" ::: "memory"); }
      s.push_back(now_s() - t0);
    }
    std::nth_element(s.begin(), s.begin() + 100, s.end());
    r.fork_join_s = s[100];
  }
  return r;
}

}  // namespace v0
}  // namespace brigade::plan
