// The CUDA test binary's main: without a usable GPU it prints why and exits 77, which ctest's
// SKIP_RETURN_CODE turns into "Skipped" (never "Passed"); with one it runs doctest.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <brigade/backend/cuda.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  const brigade::cuda::DeviceInfo info = brigade::cuda::probe_devices();
  if (!info.available) {
    std::printf("no CUDA device: %s; skipping\n", info.reason.c_str());
    return 77;
  }
  std::printf("CUDA device 0 of %d: %s (compute capability %d.%d)\n", info.count, info.name.c_str(),
              info.compute_major, info.compute_minor);
  doctest::Context context(argc, argv);
  return context.run();
}
