// The machine and its same-run ceilings, printed in the context header of every benchmark
// binary (docs/benchmarks.md: every table carries them): the CPU model, the instruction set of
// the decode kernel, one core's GEMM rate, and the STREAM triad bandwidth of one core and of all
// cores at once (cost::measure_profile with one point of each kind, about a second).
#pragma once

#include <brigade/backend/cpu.hpp>
#include <brigade/cost/profile.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace brigade::bench {

/// One core's matmul_wt rate on a 256 x 512 x 1376 product (a prefill GEMM), GFLOP/s, best of 5.
inline double gemm_gflops_one_core() {
  constexpr std::int64_t T = 256, K = 512, N = 1376;
  std::vector<float> x(T * K, 0.5f), w(N * K, 0.25f), y(T * N);
  const int before = cpu::blas_threads();
  cpu::set_blas_threads(1);
  double best = 1e30;
  for (int rep = 0; rep < 6; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    cpu::matmul_wt(x.data(), w.data(), y.data(), T, K, N);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep > 0) best = std::min(best, s);
  }
  cpu::set_blas_threads(before);
  return 2.0 * T * K * N / best * 1e-9;
}

/// This machine's device profile for its 2 cores (cost::measure_profile with the default
/// points), measured once per binary: what the CLI's `--profile auto` measures, for benchmarks
/// that split or predict like the CLI.
inline const cost::DeviceProfile& machine_profile() {
  static const cost::DeviceProfile p = [] {
    cost::ProfileOptions o;
    o.cores = 2;
    return cost::measure_profile(o);
  }();
  return p;
}

/// Median of xs (0 for none).
inline double median(std::vector<double> xs) {
  if (xs.empty()) return 0.0;
  std::nth_element(xs.begin(), xs.begin() + static_cast<std::ptrdiff_t>(xs.size() / 2), xs.end());
  return xs[xs.size() / 2];
}

/// Median of |x - 1| over xs (0 for none): the typical relative error of predicted / measured
/// ratios.
inline double median_error(std::vector<double> xs) {
  for (double& x : xs) x = std::abs(x - 1.0);
  return median(std::move(xs));
}

/// Adds cpu_model, kernel_isa, gemm_library, ceiling_gemm_GFLOPs_1core, ceiling_triad_GBs_1core
/// and ceiling_triad_GBs_box (all hardware threads) to Google Benchmark's context; warns on
/// stderr when OpenBLAS runs older kernels than the CPU has.
inline void add_machine_context() {
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  cost::ProfileOptions o;
  o.cores = cores;
  o.rows = {16};
  o.backward_rows = {256};
  o.contexts = {256};
  o.training_contexts = {128};
  o.disk_bytes = std::int64_t{8} << 20;
  o.seconds_per_point = 0.02;
  const auto profile = cost::measure_profile(o);
  auto fmt1 = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f", v);
    return std::string(buf);
  };
  benchmark::AddCustomContext("cpu_model", cpu::cpu_model_name());
  benchmark::AddCustomContext("kernel_isa", std::string(cpu::to_string(cpu::kernel_isa())));
  // The prefill GEMM's library and kernels. OpenBLAS 0.3.21 picks its AVX-512 kernels on Zen 5
  // (Cooperlake) by itself, but an OPENBLAS_CORETYPE set in the environment overrides that, and
  // on CPUs it does not know it may fall back to SSE3 (Prescott) or AVX2 (Haswell) code.
  const std::string gemm = cpu::gemm_backend_name();
  benchmark::AddCustomContext("gemm_library", gemm);
  const bool avx2_core = gemm == "openblas Haswell" || gemm == "openblas Zen";
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  if ((avx2_core && cpu::kernel_isa_supported(cpu::KernelIsa::Avx512)) ||
      gemm == "openblas Prescott" || gemm == "openblas Core2" || gemm == "openblas Nehalem")
    std::fprintf(stderr,
                 "warning: %s: OpenBLAS runs older kernels than this CPU has (OPENBLAS_CORETYPE"
                 " is %s); the prefill GEMM rate is below this CPU's (unset it, or set "
                 "SkylakeX for AVX-512)\n",
                 gemm.c_str(), coretype != nullptr ? coretype : "not set");
  benchmark::AddCustomContext("ceiling_gemm_GFLOPs_1core", fmt1(gemm_gflops_one_core()));
  benchmark::AddCustomContext("ceiling_triad_GBs_1core", fmt1(profile.core_bytes_per_s * 1e-9));
  benchmark::AddCustomContext("ceiling_triad_GBs_box",
                              fmt1(profile.memory_bytes_per_s * 1e-9) + " (" + std::to_string(cores) +
                                  " cores)");
}

/// The main() of a benchmark binary: Google Benchmark's flags, the machine context above, then
/// every registered benchmark. @returns 1 for an unrecognised argument, else 0
inline int run_benchmarks(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  add_machine_context();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace brigade::bench
