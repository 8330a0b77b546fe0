// Helpers of the differential tests: NaN-poisoned outputs between guard bands, bf16 on the host,
// random inputs, and the error metric.
#pragma once

#include <brigade/backend/cuda.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace brigade::cuda::test {

/// bfloat16 of `f`, round-to-nearest-even (NaN kept quiet), as the bits CUDA's
/// __float2bfloat16_rn produces.
inline std::uint16_t to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu))
    return static_cast<std::uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

/// The float a bfloat16 holds.
inline float from_bf16(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// `n` normal(0, scale^2) floats from `seed`.
inline std::vector<float> random_floats(std::size_t n, std::uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

/// A device array of `n` elements of `elem` bytes between two guard bands of `guard` elements.
/// poison() fills the payload with 0xFF bytes (NaN as float32 and as bfloat16, -1 as int32) and
/// the guards with 0xA5; check_guards() fails the test if a kernel wrote outside the payload.
class Guarded {
 public:
  Guarded(CudaBackend& gpu, std::size_t n, std::size_t elem, std::size_t guard = 256)
      : gpu_(&gpu), n_(n), elem_(elem), guard_(guard), buf_(gpu.allocate((n + 2 * guard) * elem)) {
    poison();
  }
  /// Device address of element 0 of the payload.
  [[nodiscard]] void* data() { return static_cast<char*>(buf_.data()) + guard_ * elem_; }
  template <class T>
  [[nodiscard]] T* as() {
    return static_cast<T*>(data());
  }
  [[nodiscard]] std::size_t size() const { return n_; }

  /// Guards to 0xA5, payload to 0xFF (synchronous).
  void poison() {
    std::vector<unsigned char> host((n_ + 2 * guard_) * elem_, 0xA5);
    std::memset(host.data() + guard_ * elem_, 0xFF, n_ * elem_);
    buf_.copy_from_host(host.data(), host.size());
  }
  /// Writes the payload from host memory (n elements of elem bytes).
  void set(const void* host) {
    gpu_->synchronize();
    buf_.copy_from_host(host, n_ * elem_, guard_ * elem_);
  }
  /// The payload as floats (float32 or bfloat16 payloads).
  std::vector<float> floats(DType dtype) {
    gpu_->synchronize();
    std::vector<float> out(n_);
    if (dtype == DType::F32) {
      buf_.copy_to_host(out.data(), n_ * 4, guard_ * elem_);
    } else {
      std::vector<std::uint16_t> b(n_);
      buf_.copy_to_host(b.data(), n_ * 2, guard_ * elem_);
      for (std::size_t i = 0; i < n_; ++i) out[i] = from_bf16(b[i]);
    }
    return out;
  }
  /// The payload as int32.
  std::vector<std::int32_t> ints() {
    gpu_->synchronize();
    std::vector<std::int32_t> out(n_);
    buf_.copy_to_host(out.data(), n_ * 4, guard_ * elem_);
    return out;
  }
  /// Fails the test when a guard byte changed.
  void check_guards(const std::string& what) {
    gpu_->synchronize();
    std::vector<unsigned char> host((n_ + 2 * guard_) * elem_);
    buf_.copy_to_host(host.data(), host.size());
    std::size_t bad = 0;
    for (std::size_t i = 0; i < guard_ * elem_; ++i) {
      bad += host[i] != 0xA5;
      bad += host[host.size() - 1 - i] != 0xA5;
    }
    INFO(what);
    CHECK_MESSAGE(bad == 0, "guard bytes overwritten: " << bad);
  }

 private:
  CudaBackend* gpu_;
  std::size_t n_, elem_, guard_;
  DeviceBuffer buf_;
};

/// A Guarded array holding `values` in `dtype` (converted on the host).
inline Guarded make_input(CudaBackend& gpu, const std::vector<float>& values, DType dtype) {
  Guarded g(gpu, values.size(), dtype_block_bytes(dtype));
  if (dtype == DType::F32) {
    g.set(values.data());
  } else {
    std::vector<std::uint16_t> b(values.size());
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = to_bf16(values[i]);
    g.set(b.data());
  }
  return g;
}

/// Relative L2 error ||got - ref|| / ||ref|| (infinite when got holds a NaN or infinity).
inline double rel_l2(std::span<const float> got, std::span<const float> ref) {
  REQUIRE(got.size() == ref.size());
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    const double d = static_cast<double>(got[i]) - static_cast<double>(ref[i]);
    num += d * d;
    den += static_cast<double>(ref[i]) * static_cast<double>(ref[i]);
  }
  return den == 0.0 ? std::sqrt(num) : std::sqrt(num / den);
}

/// Checks rel_l2(got, ref) <= tol, naming what was compared.
inline void check_close(const std::string& what, std::span<const float> got,
                        std::span<const float> ref, double tol) {
  const double e = rel_l2(got, ref);
  INFO(what << ": relative L2 error " << e << ", tolerance " << tol);
  CHECK(e <= tol);
}

/// The per-kernel tolerance of a dtype: float32 ~1e-5, bfloat16 ~1e-2 (relative L2).
inline double tolerance(DType dtype, double f32 = 1e-5) { return dtype == DType::F32 ? f32 : 1e-2; }

}  // namespace brigade::cuda::test
