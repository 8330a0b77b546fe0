// CPU kernels against naive double-precision references written here, and the decoder layer
// against a whole-layer reference, against itself across prefill/decode splits, and across
// packed batches.
#include "brigade/backend/cpu.hpp"
#include "brigade/backend/cpu_backend.hpp"
#include "brigade/backend/decoder.hpp"
#include "brigade/core/error.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/weights.hpp"

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

using brigade::Errc;
using brigade::Error;
namespace cpu = brigade::cpu;
namespace backend = brigade::backend;
using brigade::DType;
using Vec = std::vector<float>;
using DVec = std::vector<double>;

std::size_t sz(std::int64_t n) { return static_cast<std::size_t>(n); }

using brigade::test::random_vec;

/// max_i |got_i - ref_i| <= rtol * max_i |ref_i|: relative to the output's scale, so that
/// elements that cancel to near zero do not demand more than float can give.
template <class A, class B>
void check_close(const A& got, const B& ref, double rtol = 1e-5) {
  REQUIRE(got.size() == ref.size());
  double err = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    REQUIRE(std::isfinite(static_cast<double>(got[i])));
    err = std::max(err, std::abs(static_cast<double>(got[i]) - static_cast<double>(ref[i])));
    scale = std::max(scale, std::abs(static_cast<double>(ref[i])));
  }
  INFO("max abs error " << err << ", max |ref| " << scale);
  CHECK(err <= rtol * std::max(scale, 1e-30));
}

// ---- naive double references ----------------------------------------------------------------

DVec ref_rmsnorm(const Vec& x, const Vec& w, std::int64_t tokens, std::int64_t dim, double eps) {
  DVec out(sz(tokens * dim));
  for (std::int64_t t = 0; t < tokens; ++t) {
    double ss = 0.0;
    for (std::int64_t j = 0; j < dim; ++j) ss += double(x[sz(t * dim + j)]) * x[sz(t * dim + j)];
    const double inv = 1.0 / std::sqrt(ss / double(dim) + eps);
    for (std::int64_t j = 0; j < dim; ++j) out[sz(t * dim + j)] = w[sz(j)] * inv * x[sz(t * dim + j)];
  }
  return out;
}

template <class X, class W>
DVec ref_matmul_wt(const X& x, const W& w, std::int64_t tokens, std::int64_t in,
                   std::int64_t out_dim) {
  DVec out(sz(tokens * out_dim), 0.0);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t n = 0; n < out_dim; ++n) {
      double acc = 0.0;
      for (std::int64_t k = 0; k < in; ++k) acc += double(x[sz(t * in + k)]) * double(w[sz(n * in + k)]);
      out[sz(t * out_dim + n)] = acc;
    }
  return out;
}

/// Rotates rows of width `width` (heads of head_size) at positions pos; angle from `angle(p, j)`.
template <class V, class Angle>
void ref_rope_rows(V& x, const std::vector<std::int32_t>& pos, std::int64_t width, int head_size,
                   Angle angle) {
  for (std::size_t t = 0; t < pos.size(); ++t)
    for (std::int64_t i = 0; i < width; i += 2) {
      const double a = angle(pos[t], (i % head_size) / 2);
      const double c = std::cos(a), s = std::sin(a);
      const double v0 = x[t * sz(width) + sz(i)], v1 = x[t * sz(width) + sz(i) + 1];
      x[t * sz(width) + sz(i)] = v0 * c - v1 * s;
      x[t * sz(width) + sz(i) + 1] = v0 * s + v1 * c;
    }
}

/// RoPE angle in exact arithmetic: pos * theta^(-2j/head_size).
auto exact_angle(int head_size, double theta) {
  return [=](std::int32_t p, std::int64_t j) {
    return double(p) * std::pow(theta, -2.0 * double(j) / head_size);
  };
}

/// Causal GQA attention in double; q [tokens x n_heads*hs], caches [pos0+tokens x kv_dim].
template <class Q, class K>
DVec ref_attention(const Q& q, const K& kc, const K& vc, std::int64_t tokens, std::int64_t pos0,
                   int n_heads, int n_kv_heads, int hs) {
  const std::int64_t dim = std::int64_t(n_heads) * hs, kv_dim = std::int64_t(n_kv_heads) * hs;
  DVec out(sz(tokens * dim), 0.0);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (int h = 0; h < n_heads; ++h) {
      const std::int64_t kvh = h / (n_heads / n_kv_heads);
      const std::int64_t n = pos0 + t + 1;
      DVec s(sz(n));
      double mx = -std::numeric_limits<double>::infinity();
      for (std::int64_t j = 0; j < n; ++j) {
        double acc = 0.0;
        for (int i = 0; i < hs; ++i)
          acc += double(q[sz(t * dim + h * hs + i)]) * double(kc[sz(j * kv_dim + kvh * hs + i)]);
        s[sz(j)] = acc / std::sqrt(double(hs));
        mx = std::max(mx, s[sz(j)]);
      }
      double sum = 0.0;
      for (double& e : s) sum += (e = std::exp(e - mx));
      for (std::int64_t j = 0; j < n; ++j)
        for (int i = 0; i < hs; ++i)
          out[sz(t * dim + h * hs + i)] += s[sz(j)] / sum * double(vc[sz(j * kv_dim + kvh * hs + i)]);
    }
  return out;
}

std::vector<std::int32_t> positions(std::int64_t pos0, std::int64_t tokens) {
  std::vector<std::int32_t> p(sz(tokens));
  for (std::int64_t t = 0; t < tokens; ++t) p[sz(t)] = static_cast<std::int32_t>(pos0 + t);
  return p;
}

}  // namespace

// ---- element-wise and GEMM kernels ----------------------------------------------------------

TEST_CASE("cpu_kernels.gemm_backend: BRIGADE_GEMM picks the library, its name says which") {
  // ctest unit.gemm_eigen runs these tests under BRIGADE_GEMM=eigen: this case is what fails
  // there if the override stopped reaching the kernels.
  const char* env = std::getenv("BRIGADE_GEMM");
  const std::string want = env != nullptr ? env : "";
  if (want == "eigen") {
    CHECK(cpu::gemm_backend() == cpu::GemmBackend::Eigen);
    CHECK(cpu::gemm_backend_name() == "eigen");
  } else if (want == "blas") {
    CHECK(cpu::gemm_backend() == cpu::GemmBackend::Blas);
    CHECK(cpu::gemm_backend_name().rfind("openblas ", 0) == 0);
  } else {
    CHECK((cpu::gemm_backend_name() == "eigen") ==
          (cpu::gemm_backend() == cpu::GemmBackend::Eigen));
  }
}

TEST_CASE("cpu_kernels.rmsnorm: matches a double reference, in place too") {
  std::mt19937 rng(1);
  using Shape = std::pair<std::int64_t, std::int64_t>;
  for (auto [tokens, dim] : {Shape{1, 7}, Shape{3, 64}, Shape{5, 33}, Shape{2, 1000}}) {
    CAPTURE(tokens);
    CAPTURE(dim);
    const Vec x = random_vec(rng, tokens * dim, -3.0f, 3.0f);
    const Vec w = random_vec(rng, dim, 0.5f, 1.5f);
    const DVec ref = ref_rmsnorm(x, w, tokens, dim, 1e-5);
    Vec out(x.size());
    cpu::rmsnorm(x.data(), w.data(), out.data(), tokens, dim, 1e-5f);
    check_close(out, ref);
    Vec inplace = x;
    cpu::rmsnorm(inplace.data(), w.data(), inplace.data(), tokens, dim, 1e-5f);
    CHECK(inplace == out);
  }
  Vec one{1.0f};
  CHECK_THROWS_AS(cpu::rmsnorm(one.data(), one.data(), one.data(), 1, 0, 1e-5f), Error);
}

TEST_CASE("cpu_kernels.matmul_wt: one GEMM for all rows matches a double reference") {
  std::mt19937 rng(2);
  struct Shape { std::int64_t t, in, out; };
  for (Shape s : {Shape{1, 7, 5}, Shape{3, 64, 48}, Shape{17, 33, 65}, Shape{64, 128, 96},
                  Shape{2, 1, 3}, Shape{129, 45, 257}}) {
    CAPTURE(s.t);
    CAPTURE(s.in);
    CAPTURE(s.out);
    const Vec x = random_vec(rng, s.t * s.in), w = random_vec(rng, s.out * s.in);
    const DVec ref = ref_matmul_wt(x, w, s.t, s.in, s.out);
    Vec out(sz(s.t * s.out), 123.0f);  // garbage that must be overwritten
    cpu::matmul_wt(x.data(), w.data(), out.data(), s.t, s.in, s.out);
    check_close(out, ref);

    const Vec base = random_vec(rng, s.t * s.out);
    Vec acc = base;
    cpu::matmul_wt_accumulate(x.data(), w.data(), acc.data(), s.t, s.in, s.out);
    DVec ref_acc = ref;
    for (std::size_t i = 0; i < ref_acc.size(); ++i) ref_acc[i] += base[i];
    check_close(acc, ref_acc);
  }
  SUBCASE("each row equals the same product done one row at a time") {
    const std::int64_t t = 9, in = 40, out = 24;
    const Vec x = random_vec(rng, t * in), w = random_vec(rng, out * in);
    Vec all(sz(t * out)), row(sz(out));
    cpu::matmul_wt(x.data(), w.data(), all.data(), t, in, out);
    for (std::int64_t r = 0; r < t; ++r) {
      cpu::matmul_wt(x.data() + r * in, w.data(), row.data(), 1, in, out);
      check_close(row, Vec(all.begin() + r * out, all.begin() + (r + 1) * out));
    }
  }
  CHECK_THROWS_AS(cpu::matmul_wt(nullptr, nullptr, nullptr, -1, 2, 2), Error);
}

TEST_CASE("cpu_kernels.matmul_wt: the small-row path matches a double reference for T = 1..70") {
  // Up to 16 rows (64 with Eigen's GEMM behind) matmul_wt streams W unpacked in blocks of 16
  // lanes: odd K exercises the K tail, odd N the W rows outside the kernel's segments, T % MR
  // the x-row tail; larger T the hand-over to the GEMM.
  std::mt19937 rng(11);
  for (std::int64_t in : {1, 15, 16, 17, 63, 129, 172}) {
    for (std::int64_t out : {1, 5, 63, 129, 172}) {
      const Vec w = random_vec(rng, out * in);
      const Vec x_all = random_vec(rng, 70 * in);
      const Vec base = random_vec(rng, 70 * out);
      for (std::int64_t t = 1; t <= 70; t += (t < 20 || t > 60) ? 1 : 7) {
        CAPTURE(t);
        CAPTURE(in);
        CAPTURE(out);
        const Vec x(x_all.begin(), x_all.begin() + t * in);
        const DVec ref = ref_matmul_wt(x, w, t, in, out);
        Vec y(sz(t * out), -7.0f);
        cpu::matmul_wt(x.data(), w.data(), y.data(), t, in, out);
        check_close(y, ref);
        Vec acc(base.begin(), base.begin() + t * out);
        cpu::matmul_wt_accumulate(x.data(), w.data(), acc.data(), t, in, out);
        DVec ref_acc = ref;
        for (std::size_t i = 0; i < ref_acc.size(); ++i) ref_acc[i] += base[i];
        check_close(acc, ref_acc);
        if (t <= 16) {  // small-M: a row gives the same bits alone as inside the batch
          Vec row(sz(out));
          cpu::matmul_wt(x.data() + (t - 1) * in, w.data(), row.data(), 1, in, out);
          CHECK(std::equal(row.begin(), row.end(), y.begin() + (t - 1) * out));
        }
      }
    }
  }
}

/// The small-M summation order written out in scalar code: 16 lanes of fmaf over k, the lanes
/// reduced as pairs (l, l+8), (l, l+4), (l, l+2), (0, 1), then the K % 16 tail left to right.
float ref_small_m_dot(const float* x, const float* w, std::int64_t in) {
  float lanes[16] = {};
  const std::int64_t k_vec = in - in % 16;
  for (std::int64_t k = 0; k < k_vec; ++k) lanes[k % 16] = std::fma(x[k], w[k], lanes[k % 16]);
  for (int h = 8; h >= 1; h /= 2)
    for (int l = 0; l < h; ++l) lanes[l] = lanes[l] + lanes[l + h];
  float s = lanes[0];
  for (std::int64_t k = k_vec; k < in; ++k) {
    volatile float p = x[k] * w[k];  // a rounded product, then the add (no contraction)
    s += p;
  }
  return s;
}

TEST_CASE("cpu_kernels.kernel_isa: every instruction set, with its W prefetches on and off, "
          "gives the documented order's bits") {
  const cpu::KernelIsa before = cpu::kernel_isa();
  const bool prefetch_before = cpu::small_m_prefetch();
  CHECK(prefetch_before);  // on by default
  CHECK(cpu::kernel_isa_supported(before));
  CHECK(cpu::kernel_isa_supported(cpu::KernelIsa::Generic));
  CHECK(cpu::to_string(cpu::KernelIsa::Avx2) == "avx2");
  CHECK(!cpu::cpu_model_name().empty());
  std::mt19937 rng(21);
  int checked = 0;
  for (auto isa : {cpu::KernelIsa::Generic, cpu::KernelIsa::Avx2, cpu::KernelIsa::Avx512}) {
    if (!cpu::kernel_isa_supported(isa)) {
      CHECK_THROWS_AS(cpu::set_kernel_isa(isa), Error);
      continue;
    }
    cpu::set_kernel_isa(isa);
    CHECK(cpu::kernel_isa() == isa);
    ++checked;
    // The W prefetches (from 2 rows of x; one line per step, shared by the blocks of x rows:
    // 1, 2 and more blocks below) change no bit.
    for (const bool prefetch : {true, false}) {
      cpu::set_small_m_prefetch(prefetch);
      CHECK(cpu::small_m_prefetch() == prefetch);
      for (std::int64_t t : {1, 2, 3, 5, 9, 16}) {
        // k-chunks of 256 (src/cpu_small_m_kernel.hpp): one partial, two whole, five and a partial
        // with a tail of 12, and none (in < 16)
        for (auto [in, out] : {std::pair<std::int64_t, std::int64_t>{172, 129}, {512, 63},
                               {1388, 37}, {7, 11}}) {
          CAPTURE(cpu::to_string(isa));
          CAPTURE(prefetch);
          CAPTURE(t);
          CAPTURE(in);
          const Vec x = random_vec(rng, t * in), w = random_vec(rng, out * in);
          Vec y(sz(t * out)), acc = random_vec(rng, t * out);
          const Vec acc0 = acc;
          cpu::matmul_wt(x.data(), w.data(), y.data(), t, in, out);
          cpu::matmul_wt_accumulate(x.data(), w.data(), acc.data(), t, in, out);
          int wrong = 0;
          for (std::int64_t r = 0; r < t; ++r)
            for (std::int64_t n = 0; n < out; ++n) {
              const float d = ref_small_m_dot(x.data() + r * in, w.data() + n * in, in);
              wrong += y[sz(r * out + n)] != d;
              wrong += acc[sz(r * out + n)] != acc0[sz(r * out + n)] + d;
            }
          CHECK(wrong == 0);
        }
      }
    }
  }
  cpu::set_kernel_isa(before);
  cpu::set_small_m_prefetch(prefetch_before);
  CHECK(checked >= 1);
  CHECK_THROWS_AS(cpu::set_kernel_isa(static_cast<cpu::KernelIsa>(9)), Error);
  for (auto isa : {cpu::KernelIsa::Generic, cpu::KernelIsa::Avx2, cpu::KernelIsa::Avx512})
    CHECK(cpu::parse_kernel_isa(cpu::to_string(isa)) == isa);
  CHECK_THROWS_WITH_AS(cpu::parse_kernel_isa("AVX2"),
                       "kernel instruction set 'AVX2'; expected generic, avx2 or avx512", Error);
}

TEST_CASE("cpu_kernels.kernel_isa: products of 17 to 64 rows (the small-M kernel's or the "
          "GEMM's, by a limit that follows the CPU) give the same bits under every instruction "
          "set") {
  const cpu::KernelIsa before = cpu::kernel_isa();
  std::mt19937 rng(47);
  for (std::int64_t t : {17, 24, 32, 33, 48, 64}) {
    CAPTURE(t);
    const std::int64_t in = 512, out = 96;
    const Vec x = random_vec(rng, t * in), w = random_vec(rng, out * in);
    std::vector<Vec> ys;
    for (auto isa : {cpu::KernelIsa::Generic, cpu::KernelIsa::Avx2, cpu::KernelIsa::Avx512}) {
      if (!cpu::kernel_isa_supported(isa)) continue;
      cpu::set_kernel_isa(isa);
      Vec y(sz(t * out));
      cpu::matmul_wt(x.data(), w.data(), y.data(), t, in, out);
      ys.push_back(std::move(y));
    }
    REQUIRE(!ys.empty());
    for (std::size_t i = 1; i < ys.size(); ++i) CHECK(ys[i] == ys[0]);
  }
  cpu::set_kernel_isa(before);
}

TEST_CASE("cpu_kernels.kernel_isa: W and x at each float offset from a cache line give the "
          "documented order's bits") {
  // A float32 W whose rows start inside a packet is read as aligned packets recombined in
  // registers (cpu_small_m_kernel.hpp, WLoad), its last step per row unaligned; an x off a line
  // is copied onto one (cpu_kernels.cpp). Both when `in` is a multiple of the packet (16
  // floats; 8 for AVX2's W): 512 (two k-chunks: the carry across a chunk boundary), 48 (one
  // partial chunk), 1376 (six chunks), and 40 (AVX2 only: shifted loads, then a tail of 8).
  const cpu::KernelIsa before = cpu::kernel_isa();
  std::mt19937 rng(33);
  // `n` floats starting `offset` floats past a 64-byte line of `storage`
  auto on_line = [](Vec& storage, std::int64_t n, std::int64_t offset) {
    storage.assign(sz(n + 32), 0.0f);
    const auto base = reinterpret_cast<std::uintptr_t>(storage.data());
    return reinterpret_cast<float*>((base + 63) / 64 * 64) + offset;
  };
  int checked = 0;
  for (auto isa : {cpu::KernelIsa::Generic, cpu::KernelIsa::Avx2, cpu::KernelIsa::Avx512}) {
    if (!cpu::kernel_isa_supported(isa)) continue;
    cpu::set_kernel_isa(isa);
    for (auto [in, out] :
         {std::pair<std::int64_t, std::int64_t>{512, 37}, {48, 21}, {1376, 19}, {40, 23}})
      for (std::int64_t t : {1, 3, 8, 16}) {  // rows the small-M kernel takes with either GEMM
        const Vec x0 = random_vec(rng, t * in), w0 = random_vec(rng, out * in);
        Vec ref(sz(t * out));
        for (std::int64_t r = 0; r < t; ++r)
          for (std::int64_t n = 0; n < out; ++n)
            ref[sz(r * out + n)] = ref_small_m_dot(x0.data() + r * in, w0.data() + n * in, in);
        for (std::int64_t w_off = 0; w_off < 16; ++w_off)
          for (std::int64_t x_off : {0, 4, 7}) {
            CAPTURE(cpu::to_string(isa));
            CAPTURE(in);
            CAPTURE(t);
            CAPTURE(w_off);
            CAPTURE(x_off);
            Vec xs, ws;
            float* x = on_line(xs, t * in, x_off);
            float* w = on_line(ws, out * in, w_off);
            std::copy(x0.begin(), x0.end(), x);
            std::copy(w0.begin(), w0.end(), w);
            Vec y(sz(t * out)), acc(sz(t * out), 0.5f);
            cpu::matmul_wt(x, w, y.data(), t, in, out);
            cpu::matmul_wt_accumulate(x, w, acc.data(), t, in, out);
            int wrong = 0;
            for (std::size_t i = 0; i < ref.size(); ++i) {
              wrong += y[i] != ref[i];
              wrong += acc[i] != 0.5f + ref[i];
            }
            CHECK(wrong == 0);
            ++checked;
          }
      }
  }
  cpu::set_kernel_isa(before);
  CHECK(checked >= 4 * 4 * 16 * 3);
}

TEST_CASE("cpu_kernels.matmul_wt: same bits on differently aligned copies of the inputs") {
  std::mt19937 rng(12);
  for (std::int64_t t : {1, 2, 3, 4, 7, 15, 16}) {  // the small-M path's sizes
    for (auto [in, out] : {std::pair<std::int64_t, std::int64_t>{172, 129}, {512, 63}, {63, 200}, {1376, 301}}) {
      CAPTURE(t);
      CAPTURE(in);
      CAPTURE(out);
      const Vec x = random_vec(rng, t * in), w = random_vec(rng, out * in);
      Vec first(sz(t * out)), acc_first = random_vec(rng, t * out);
      const Vec acc_base = acc_first;
      cpu::matmul_wt(x.data(), w.data(), first.data(), t, in, out);
      cpu::matmul_wt_accumulate(x.data(), w.data(), acc_first.data(), t, in, out);
      for (std::int64_t shift = 1; shift < 16; shift += 3) {  // 4..60 bytes off the first copy
        CAPTURE(shift);
        Vec xs(sz(shift + t * in)), ws(sz(shift + out * in)), ys(sz(shift + t * out));
        std::copy(x.begin(), x.end(), xs.begin() + shift);
        std::copy(w.begin(), w.end(), ws.begin() + shift);
        cpu::matmul_wt(xs.data() + shift, ws.data() + shift, ys.data() + shift, t, in, out);
        CHECK(std::equal(first.begin(), first.end(), ys.begin() + shift));
        std::copy(acc_base.begin(), acc_base.end(), ys.begin() + shift);
        cpu::matmul_wt_accumulate(xs.data() + shift, ws.data() + shift, ys.data() + shift, t, in,
                                  out);
        CHECK(std::equal(acc_first.begin(), acc_first.end(), ys.begin() + shift));
      }
      // Two threads split W's rows (above ~2 MFLOP): the bits do not depend on the thread count.
      const int threads_before = cpu::blas_threads();
      cpu::set_blas_threads(threads_before == 2 ? 1 : 2);
      Vec two(sz(t * out));
      cpu::matmul_wt(x.data(), w.data(), two.data(), t, in, out);
      cpu::set_blas_threads(threads_before);
      CHECK(two == first);
    }
  }
}

TEST_CASE("cpu_kernels.rope: adjacent pairs per head, q over all heads, k over kv heads") {
  std::mt19937 rng(3);
  struct Case { int n_heads, n_kv_heads, head_size; std::int64_t tokens, pos0; };
  for (Case c : {Case{4, 4, 8, 1, 0}, Case{4, 2, 8, 5, 3}, Case{8, 2, 6, 7, 11},
                 Case{6, 3, 10, 4, 40}, Case{2, 1, 64, 3, 20}}) {
    CAPTURE(c.n_heads);
    CAPTURE(c.n_kv_heads);
    CAPTURE(c.head_size);
    const std::int64_t dim = std::int64_t(c.n_heads) * c.head_size;
    const std::int64_t kv_dim = std::int64_t(c.n_kv_heads) * c.head_size;
    const auto pos = positions(c.pos0, c.tokens);
    Vec q = random_vec(rng, c.tokens * dim), k = random_vec(rng, c.tokens * kv_dim);
    DVec rq(q.begin(), q.end()), rk(k.begin(), k.end());
    ref_rope_rows(rq, pos, dim, c.head_size, exact_angle(c.head_size, 10000.0));
    ref_rope_rows(rk, pos, kv_dim, c.head_size, exact_angle(c.head_size, 10000.0));
    cpu::rope(q.data(), k.data(), pos.data(), c.tokens, c.n_heads, c.n_kv_heads, c.head_size,
              10000.0f);
    check_close(q, rq);
    check_close(k, rk);
  }
  SUBCASE("large positions: run.c's float angle pos * powf(...), rotated in double") {
    const int hs = 16, nh = 2;
    const std::vector<std::int32_t> pos{0, 255, 1000, 4095};
    Vec q = random_vec(rng, 4 * nh * hs), k = random_vec(rng, 4 * hs);
    DVec rq(q.begin(), q.end()), rk(k.begin(), k.end());
    auto float_angle = [&](std::int32_t p, std::int64_t j) {
      const float freq = 1.0f / std::pow(500000.0f, float(2 * j) / float(hs));
      return double(float(p) * freq);
    };
    ref_rope_rows(rq, pos, nh * hs, hs, float_angle);
    ref_rope_rows(rk, pos, hs, hs, float_angle);
    cpu::rope(q.data(), k.data(), pos.data(), 4, nh, 1, hs, 500000.0f);
    check_close(q, rq);
    check_close(k, rk);
  }
  Vec q(8), k(8);
  const std::int32_t p0 = 0;
  CHECK_THROWS_AS(cpu::rope(q.data(), k.data(), &p0, 1, 3, 2, 2, 1e4f), Error);  // 3 % 2 != 0
  CHECK_THROWS_AS(cpu::rope(q.data(), k.data(), &p0, 1, 2, 2, 3, 1e4f), Error);  // odd head
}

TEST_CASE("cpu_kernels.attention: causal GQA against cache rows 0..pos0+t") {
  std::mt19937 rng(4);
  struct Case { int n_heads, n_kv_heads, head_size; std::int64_t tokens, pos0; };
  // GQA ratios 1, 2, 4 and 2; decode (1 token), prefill, prefill after a prefix, and a prompt
  // longer than one 64-row attention block.
  for (Case c : {Case{4, 4, 8, 1, 0}, Case{4, 2, 8, 5, 3}, Case{8, 2, 6, 7, 0},
                 Case{8, 4, 16, 3, 10}, Case{2, 1, 4, 70, 5}, Case{4, 1, 8, 130, 0},
                 Case{8, 2, 8, 1, 37}}) {
    CAPTURE(c.n_heads);
    CAPTURE(c.n_kv_heads);
    CAPTURE(c.head_size);
    CAPTURE(c.tokens);
    CAPTURE(c.pos0);
    const std::int64_t dim = std::int64_t(c.n_heads) * c.head_size;
    const std::int64_t kv_dim = std::int64_t(c.n_kv_heads) * c.head_size;
    const std::int64_t ctx = c.pos0 + c.tokens;
    const Vec q = random_vec(rng, c.tokens * dim, -2.0f, 2.0f);
    // Capacity beyond ctx holds NaN: rows past pos0+tokens must never be read.
    Vec kc = random_vec(rng, (ctx + 3) * kv_dim), vc = random_vec(rng, (ctx + 3) * kv_dim);
    std::fill(kc.begin() + ctx * kv_dim, kc.end(), std::numeric_limits<float>::quiet_NaN());
    std::fill(vc.begin() + ctx * kv_dim, vc.end(), std::numeric_limits<float>::quiet_NaN());
    const DVec ref = ref_attention(q, kc, vc, c.tokens, c.pos0, c.n_heads, c.n_kv_heads,
                                   c.head_size);
    Vec out(sz(c.tokens * dim));
    cpu::attention(q.data(), kc.data(), vc.data(), out.data(), c.tokens, c.pos0, c.n_heads,
                   c.n_kv_heads, c.head_size);
    check_close(out, ref);
  }
}

TEST_CASE("cpu_kernels.swiglu, softmax, embedding: element-wise kernels") {
  std::mt19937 rng(5);
  for (std::int64_t n : {1, 7, 1000}) {
    Vec g = random_vec(rng, n, -10.0f, 10.0f);
    const Vec u = random_vec(rng, n, -2.0f, 2.0f);
    DVec ref(sz(n));
    for (std::size_t i = 0; i < sz(n); ++i) ref[i] = g[i] / (1.0 + std::exp(-double(g[i]))) * u[i];
    cpu::swiglu(g.data(), u.data(), n);
    check_close(g, ref);
  }
  for (std::int64_t n : {1, 5, 1000}) {
    Vec x = random_vec(rng, n, 80.0f, 100.0f);  // exp overflows without the max subtracted
    const double mx = *std::max_element(x.begin(), x.end());
    DVec ref(sz(n));
    double sum = 0.0;
    for (std::size_t i = 0; i < sz(n); ++i) sum += (ref[i] = std::exp(double(x[i]) - mx));
    for (double& r : ref) r /= sum;
    cpu::softmax(x.data(), n);
    check_close(x, ref);
  }
  const std::int64_t vocab = 11, dim = 9;
  const Vec table = random_vec(rng, vocab * dim);
  const std::vector<std::int32_t> ids{3, 0, 10, 3};
  Vec out(ids.size() * dim);
  cpu::embedding(table.data(), ids.data(), out.data(), 4, dim);
  for (std::size_t t = 0; t < ids.size(); ++t)
    for (std::int64_t j = 0; j < dim; ++j)
      CHECK(out[t * dim + sz(j)] == table[sz(ids[t] * dim + j)]);
}

TEST_CASE("cpu_kernels.vexp: within 1 ulp of e^x, the same bits on every instruction set, and "
          "its edges") {
  // Every 97th float from ln(FLT_MIN) to ln(FLT_MAX) (about 22 million arguments of both signs).
  Vec args;
  for (float x = -87.33654f; x < 88.72283f;) {
    args.push_back(x);
    std::uint32_t bits = 0;
    std::memcpy(&bits, &x, sizeof bits);
    bits = x < 0.0f ? (bits >= 97u + 0x80000000u ? bits - 97u : 0u) : bits + 97u;
    if (bits == 0u) bits = 1u;  // cross zero onto the smallest positive float
    std::memcpy(&x, &bits, sizeof bits);
  }
  REQUIRE(args.size() > 20'000'000u);
  const cpu::KernelIsa before = cpu::kernel_isa();
  std::vector<Vec> outs;
  for (auto isa : {cpu::KernelIsa::Generic, cpu::KernelIsa::Avx2, cpu::KernelIsa::Avx512}) {
    if (!cpu::kernel_isa_supported(isa)) continue;
    cpu::set_kernel_isa(isa);
    Vec y = args;
    cpu::vexp(y.data(), static_cast<std::int64_t>(y.size()));
    outs.push_back(std::move(y));
  }
  cpu::set_kernel_isa(before);
  REQUIRE(!outs.empty());
  double worst = 0.0;
  float worst_at = 0.0f;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const double ref = std::exp(double(args[i]));
    const float r = static_cast<float>(ref);
    const double ulp = double(std::nextafter(r, std::numeric_limits<float>::infinity())) - r;
    const double err = std::abs(double(outs[0][i]) - ref) / ulp;
    if (err > worst) {
      worst = err;
      worst_at = args[i];
    }
  }
  INFO("largest error " << worst << " ulp at x = " << worst_at);
  CHECK(worst <= 1.0);
  for (std::size_t k = 1; k < outs.size(); ++k)
    CHECK(std::memcmp(outs[k].data(), outs[0].data(), outs[0].size() * sizeof(float)) == 0);
  // The edges: e^0 = 1 exactly; below ln(FLT_MIN) 0, above ln(FLT_MAX) +inf; NaN stays NaN.
  const float inf = std::numeric_limits<float>::infinity();
  Vec e{0.0f, -0.0f, -inf, inf, -87.4f, -1000.0f, 88.73f, 1000.0f,
        std::numeric_limits<float>::quiet_NaN(), 1.0f};
  cpu::vexp(e.data(), static_cast<std::int64_t>(e.size()));
  CHECK(e[0] == 1.0f);
  CHECK(e[1] == 1.0f);
  CHECK(e[2] == 0.0f);
  CHECK(e[3] == inf);
  CHECK(e[4] == 0.0f);
  CHECK(e[5] == 0.0f);
  CHECK(e[6] == inf);
  CHECK(e[7] == inf);
  CHECK(std::isnan(e[8]));
  CHECK(std::abs(double(e[9]) - std::exp(1.0)) <= 2.4e-7);
  // The shift: e^(x - s), the difference rounded to float first.
  Vec a{3.25f, -1.5f, 0.1f}, b{3.25f - 2.5f, -1.5f - 2.5f, 0.1f - 2.5f};
  cpu::vexp(a.data(), 3, 2.5f);
  cpu::vexp(b.data(), 3);
  CHECK(std::memcmp(a.data(), b.data(), sizeof(float) * 3) == 0);
  cpu::vexp(nullptr, 0);
  CHECK_THROWS_WITH_AS(cpu::vexp(a.data(), -1), "vexp: n = -1 with x set; expected n >= 0 and x set when n > 0", Error);
  CHECK_THROWS_WITH_AS(cpu::vexp(nullptr, 2), "vexp: n = 2 with x null; expected n >= 0 and x set when n > 0", Error);
}

TEST_CASE("cpu_kernels.kernel_isa: softmax and swiglu give the same bits on every instruction set") {
  std::mt19937 rng(8);
  const cpu::KernelIsa before = cpu::kernel_isa();
  for (std::int64_t n : {1, 15, 16, 17, 33, 1000, 32000}) {
    CAPTURE(n);
    const Vec x = random_vec(rng, n, -30.0f, 30.0f), g = random_vec(rng, n, -12.0f, 12.0f),
              u = random_vec(rng, n, -2.0f, 2.0f);
    std::vector<Vec> soft, gate;
    for (auto isa : {cpu::KernelIsa::Generic, cpu::KernelIsa::Avx2, cpu::KernelIsa::Avx512}) {
      if (!cpu::kernel_isa_supported(isa)) continue;
      cpu::set_kernel_isa(isa);
      soft.push_back(x);
      cpu::softmax(soft.back().data(), n);
      gate.push_back(g);
      cpu::swiglu(gate.back().data(), u.data(), n);
    }
    // softmax sums to 1 and matches double; the instruction sets agree bit for bit.
    double sum = 0.0;
    for (float p : soft[0]) sum += p;
    CHECK(std::abs(sum - 1.0) < 1e-5);
    double mx = x[0], z = 0.0;
    for (float v : x) mx = std::max(mx, double(v));
    for (float v : x) z += std::exp(double(v) - mx);
    double worst = 0.0;
    for (std::int64_t i = 0; i < n; ++i) {
      const double ref = std::exp(double(x[sz(i)]) - mx) / z;
      worst = std::max(worst, std::abs(double(soft[0][sz(i)]) - ref) / (ref + 1e-30));
    }
    CHECK(worst < 1e-5);
    for (std::size_t k = 1; k < soft.size(); ++k) {
      CHECK(std::memcmp(soft[k].data(), soft[0].data(), sz(n) * sizeof(float)) == 0);
      CHECK(std::memcmp(gate[k].data(), gate[0].data(), sz(n) * sizeof(float)) == 0);
    }
  }
  cpu::set_kernel_isa(before);
}

TEST_CASE("cpu_kernels.blas_threads: set and read back") {
  const int before = cpu::blas_threads();
  CHECK(before >= 1);
  cpu::set_blas_threads(1);
  CHECK(cpu::blas_threads() == 1);
  cpu::set_blas_threads(before);
  CHECK(cpu::blas_threads() == before);
  CHECK_THROWS_AS(cpu::set_blas_threads(0), Error);
}

// ---- decoder layer --------------------------------------------------------------------------

namespace {

/// Random layer weights owned by vectors, with a DecoderWeights view.
struct Layer {
  brigade::model::LlamaConfig cfg;
  Vec rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3;
  brigade::model::DecoderWeights view() const {
    return {rms_att.data(), wq.data(), wk.data(), wv.data(), wo.data(),
            rms_ffn.data(), w1.data(), w2.data(), w3.data()};
  }
};

Layer make_layer(int dim, int hidden, int n_heads, int n_kv_heads, int seq_len, unsigned seed) {
  Layer l;
  l.cfg.dim = dim;
  l.cfg.hidden_dim = hidden;
  l.cfg.n_layers = 1;
  l.cfg.n_heads = n_heads;
  l.cfg.n_kv_heads = n_kv_heads;
  l.cfg.vocab_size = 32;
  l.cfg.seq_len = seq_len;
  l.cfg.validate("test layer");
  std::mt19937 rng(seed);
  const std::int64_t kv = l.cfg.kv_dim();
  const float a = 1.7f / std::sqrt(float(dim)), b = 1.7f / std::sqrt(float(hidden));
  l.rms_att = random_vec(rng, dim, 0.5f, 1.5f);
  l.rms_ffn = random_vec(rng, dim, 0.5f, 1.5f);
  l.wq = random_vec(rng, std::int64_t(dim) * dim, -a, a);
  l.wk = random_vec(rng, kv * dim, -a, a);
  l.wv = random_vec(rng, kv * dim, -a, a);
  l.wo = random_vec(rng, std::int64_t(dim) * dim, -a, a);
  l.w1 = random_vec(rng, std::int64_t(hidden) * dim, -a, a);
  l.w3 = random_vec(rng, std::int64_t(hidden) * dim, -a, a);
  l.w2 = random_vec(rng, std::int64_t(dim) * hidden, -b, b);
  return l;
}

/// One sequence's residual rows and caches, for the reference.
struct RefSeq {
  DVec x;              // [tokens x dim], updated
  DVec k_cache, v_cache;  // [capacity x kv_dim], rows pos0.. written
  std::int64_t tokens, pos0;
};

/// Whole decoder layer in double for one sequence (run.c's forward() body, all rows at once).
void ref_layer(const Layer& l, RefSeq& s) {
  const auto& c = l.cfg;
  const std::int64_t dim = c.dim, kv = c.kv_dim(), hid = c.hidden_dim, T = s.tokens;
  const int hs = c.head_size();
  auto norm = [&](const DVec& x, const Vec& w) {
    DVec o(x.size());
    for (std::int64_t t = 0; t < T; ++t) {
      double ss = 0.0;
      for (std::int64_t j = 0; j < dim; ++j) ss += x[sz(t * dim + j)] * x[sz(t * dim + j)];
      const double inv = 1.0 / std::sqrt(ss / double(dim) + double(c.norm_eps));
      for (std::int64_t j = 0; j < dim; ++j) o[sz(t * dim + j)] = w[sz(j)] * inv * x[sz(t * dim + j)];
    }
    return o;
  };
  const auto pos = positions(s.pos0, T);
  DVec xb = norm(s.x, l.rms_att);
  DVec q = ref_matmul_wt(xb, l.wq, T, dim, dim);
  DVec k = ref_matmul_wt(xb, l.wk, T, dim, kv);
  DVec v = ref_matmul_wt(xb, l.wv, T, dim, kv);
  ref_rope_rows(q, pos, dim, hs, exact_angle(hs, c.rope_theta));
  ref_rope_rows(k, pos, kv, hs, exact_angle(hs, c.rope_theta));
  std::copy(k.begin(), k.end(), s.k_cache.begin() + s.pos0 * kv);
  std::copy(v.begin(), v.end(), s.v_cache.begin() + s.pos0 * kv);
  const DVec att = ref_attention(q, s.k_cache, s.v_cache, T, s.pos0, c.n_heads, c.n_kv_heads, hs);
  const DVec o = ref_matmul_wt(att, l.wo, T, dim, dim);
  for (std::size_t i = 0; i < s.x.size(); ++i) s.x[i] += o[i];
  xb = norm(s.x, l.rms_ffn);
  DVec h1 = ref_matmul_wt(xb, l.w1, T, dim, hid);
  const DVec h3 = ref_matmul_wt(xb, l.w3, T, dim, hid);
  for (std::size_t i = 0; i < h1.size(); ++i) h1[i] = h1[i] / (1.0 + std::exp(-h1[i])) * h3[i];
  const DVec d = ref_matmul_wt(h1, l.w2, T, hid, dim);
  for (std::size_t i = 0; i < s.x.size(); ++i) s.x[i] += d[i];
}

/// A sequence for the kernel: residual rows plus caches whose first pos0 rows are a random
/// prefix (as earlier steps would have left them) and whose later rows are NaN.
struct Seq {
  Vec x, k_cache, v_cache;
  std::int64_t tokens, pos0;
};

Seq make_seq(const Layer& l, std::int64_t tokens, std::int64_t pos0, std::mt19937& rng) {
  const std::int64_t kv = l.cfg.kv_dim(), cap = l.cfg.seq_len;
  Seq s{random_vec(rng, tokens * l.cfg.dim, -2.0f, 2.0f),
        Vec(sz(cap * kv), std::numeric_limits<float>::quiet_NaN()),
        Vec(sz(cap * kv), std::numeric_limits<float>::quiet_NaN()), tokens, pos0};
  const Vec kp = random_vec(rng, pos0 * kv), vp = random_vec(rng, pos0 * kv);
  std::copy(kp.begin(), kp.end(), s.k_cache.begin());
  std::copy(vp.begin(), vp.end(), s.v_cache.begin());
  return s;
}

using Scratch = backend::DecoderBuffers<cpu::CpuBackend>;

/// Runs backend::decoder_layer_forward on CpuBackend over sequences packed in order into one
/// micro-batch: sequence i of `seqs` is slot i of one layer cache (capacity seq_len each), its
/// cache rows copied in before and out after.
void run_packed(const Layer& l, std::vector<Seq*> seqs, Scratch& scratch) {
  const std::int64_t kv = l.cfg.kv_dim(), cap = l.cfg.seq_len;
  const auto n = static_cast<std::int64_t>(seqs.size());
  Vec x, cache(sz(2 * n * cap * kv));  // every slot's keys, then every slot's values
  std::vector<std::int64_t> first;
  std::vector<int> caps;
  std::vector<backend::SequenceSlice> slices;
  for (std::int64_t i = 0; i < n; ++i) {
    const Seq* s = seqs[sz(i)];
    std::copy(s->k_cache.begin(), s->k_cache.end(), cache.begin() + i * cap * kv);
    std::copy(s->v_cache.begin(), s->v_cache.end(), cache.begin() + (n + i) * cap * kv);
    first.push_back(i * cap);
    caps.push_back(l.cfg.seq_len);
    slices.push_back({std::int32_t(i), std::int32_t(s->pos0), std::int32_t(s->tokens)});
    x.insert(x.end(), s->x.begin(), s->x.end());
  }
  const backend::KvCacheView view{cache.data(), cache.data() + n * cap * kv, DType::F32, kv,
                                  first, caps};
  cpu::CpuBackend b;
  backend::decoder_layer_forward(b, l.cfg, l.view(), x.data(), backend::packed_rows(slices),
                                 slices, view, scratch);
  std::size_t off = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    Seq* s = seqs[sz(i)];
    std::copy(x.begin() + std::ptrdiff_t(off), x.begin() + std::ptrdiff_t(off + s->x.size()),
              s->x.begin());
    off += s->x.size();
    std::copy(cache.begin() + i * cap * kv, cache.begin() + (i + 1) * cap * kv, s->k_cache.begin());
    std::copy(cache.begin() + (n + i) * cap * kv, cache.begin() + (n + i + 1) * cap * kv,
              s->v_cache.begin());
  }
}

/// The cache rows [0, rows) of a cache as a vector.
Vec rows_of(const Vec& cache, std::int64_t rows, std::int64_t kv) {
  return Vec(cache.begin(), cache.begin() + rows * kv);
}

}  // namespace

TEST_CASE("cpu_kernels.decoder_layer_forward: matches a double whole-layer reference") {
  struct Case { int dim, hidden, n_heads, n_kv_heads; std::int64_t tokens, pos0; };
  // GQA ratios 1, 2, 4; odd hidden width; decode and prefill, with and without a cached prefix.
  for (Case c : {Case{32, 75, 4, 4, 1, 0}, Case{32, 75, 4, 2, 6, 0}, Case{64, 101, 8, 2, 5, 9},
                 Case{48, 64, 4, 1, 1, 13}, Case{40, 90, 4, 2, 70, 3}}) {
    CAPTURE(c.dim);
    CAPTURE(c.n_heads);
    CAPTURE(c.n_kv_heads);
    CAPTURE(c.tokens);
    CAPTURE(c.pos0);
    const Layer l = make_layer(c.dim, c.hidden, c.n_heads, c.n_kv_heads, 96, 10u + unsigned(c.dim));
    std::mt19937 rng(99);
    Seq s = make_seq(l, c.tokens, c.pos0, rng);
    RefSeq r{DVec(s.x.begin(), s.x.end()), DVec(s.k_cache.begin(), s.k_cache.end()),
             DVec(s.v_cache.begin(), s.v_cache.end()), c.tokens, c.pos0};
    ref_layer(l, r);
    Scratch scratch;
    run_packed(l, {&s}, scratch);
    const std::int64_t kv = l.cfg.kv_dim(), ctx = c.pos0 + c.tokens;
    check_close(s.x, r.x);
    check_close(rows_of(s.k_cache, ctx, kv), DVec(r.k_cache.begin(), r.k_cache.begin() + ctx * kv));
    check_close(rows_of(s.v_cache, ctx, kv), DVec(r.v_cache.begin(), r.v_cache.begin() + ctx * kv));
    // Rows past the context are left untouched (still NaN).
    CHECK(std::isnan(s.k_cache[sz(ctx * kv)]));
    CHECK(std::isnan(s.v_cache[sz(ctx * kv)]));
  }
}

TEST_CASE("cpu_kernels.decoder_layer_forward: a 7-token prefill equals 7 one-token decode steps") {
  const Layer l = make_layer(64, 150, 8, 2, 32, 21);
  std::mt19937 rng(7);
  Seq prefill = make_seq(l, 7, 0, rng);
  Seq decode = prefill;
  Scratch scratch;
  run_packed(l, {&prefill}, scratch);
  const std::int64_t dim = l.cfg.dim, kv = l.cfg.kv_dim();
  for (std::int64_t t = 0; t < 7; ++t) {
    Seq step{Vec(decode.x.begin() + t * dim, decode.x.begin() + (t + 1) * dim), {}, {}, 1, t};
    step.k_cache.swap(decode.k_cache);
    step.v_cache.swap(decode.v_cache);
    run_packed(l, {&step}, scratch);  // same scratch, now smaller: no reallocation needed
    std::copy(step.x.begin(), step.x.end(), decode.x.begin() + t * dim);
    decode.k_cache.swap(step.k_cache);
    decode.v_cache.swap(step.v_cache);
  }
  check_close(decode.x, prefill.x);
  check_close(rows_of(decode.k_cache, 7, kv), rows_of(prefill.k_cache, 7, kv));
  check_close(rows_of(decode.v_cache, 7, kv), rows_of(prefill.v_cache, 7, kv));
}

TEST_CASE("cpu_kernels.decoder_layer_forward: the same bits at 1, 2 and 3 intra-op threads") {
  // The team splits every product over W's rows, attention over heads, RoPE over tokens and
  // SwiGLU over elements (src/intra_op.hpp): no sum changes order. Shapes above the split
  // threshold (2e5 flops): a 300-token prefill after a 20-token prefix (dim 128, GQA 8:2), and
  // one decode row through 512 x 512 and 1376 x 512 matrices (the 42M Llama's layer).
  struct Case { int dim, hidden, n_heads, n_kv_heads; std::int64_t tokens, pos0; };
  for (Case c : {Case{128, 352, 8, 2, 300, 20}, Case{512, 1376, 8, 8, 1, 40}}) {
    CAPTURE(c.dim);
    const Layer l = make_layer(c.dim, c.hidden, c.n_heads, c.n_kv_heads, 400, 5u);
    std::mt19937 rng(8);
    const Seq start = make_seq(l, c.tokens, c.pos0, rng);
    const int before = cpu::blas_threads();
    std::vector<Seq> out;
    for (int threads : {1, 2, 3}) {
      cpu::set_blas_threads(threads);
      Seq s = start;
      Scratch scratch;
      run_packed(l, {&s}, scratch);
      out.push_back(std::move(s));
    }
    cpu::set_blas_threads(before);
    const std::int64_t rows = (c.pos0 + c.tokens) * l.cfg.kv_dim();
    for (std::size_t i = 1; i < out.size(); ++i) {
      CAPTURE(i + 1);
      CHECK(out[i].x == out[0].x);
      CHECK(rows_of(out[i].k_cache, rows / l.cfg.kv_dim(), l.cfg.kv_dim()) ==
            rows_of(out[0].k_cache, rows / l.cfg.kv_dim(), l.cfg.kv_dim()));
    }
  }
  // A decode micro-batch of 6 sequences at contexts 90-140: attention split over sequences.
  const Layer l = make_layer(128, 352, 8, 2, 200, 6u);
  std::mt19937 rng(9);
  std::vector<Seq> start;
  for (int i = 0; i < 6; ++i) start.push_back(make_seq(l, 1, 90 + 10 * i, rng));
  const int before = cpu::blas_threads();
  std::vector<std::vector<Seq>> out;
  for (int threads : {1, 2, 3}) {
    cpu::set_blas_threads(threads);
    std::vector<Seq> batch = start;
    std::vector<Seq*> ptrs;
    for (Seq& s : batch) ptrs.push_back(&s);
    Scratch scratch;
    run_packed(l, ptrs, scratch);
    out.push_back(std::move(batch));
  }
  cpu::set_blas_threads(before);
  for (std::size_t i = 1; i < out.size(); ++i)
    for (std::size_t s = 0; s < start.size(); ++s) {
      CAPTURE(i + 1);
      CAPTURE(s);
      CHECK(out[i][s].x == out[0][s].x);
    }
}

TEST_CASE("cpu_kernels.decoder_layer_forward: a packed batch of lengths 5,1,3 equals each alone") {
  const Layer l = make_layer(48, 120, 6, 3, 40, 33);
  std::mt19937 rng(8);
  Seq a = make_seq(l, 5, 0, rng), b = make_seq(l, 1, 17, rng), c = make_seq(l, 3, 6, rng);
  Seq a1 = a, b1 = b, c1 = c;
  Scratch packed_scratch, alone_scratch;
  run_packed(l, {&a, &b, &c}, packed_scratch);
  for (Seq* s : {&a1, &b1, &c1}) run_packed(l, {s}, alone_scratch);
  const std::int64_t kv = l.cfg.kv_dim();
  using Pair = std::pair<Seq*, Seq*>;
  for (auto [p, s] : {Pair{&a, &a1}, Pair{&b, &b1}, Pair{&c, &c1}}) {
    CAPTURE(p->pos0);
    check_close(p->x, s->x);
    check_close(rows_of(p->k_cache, p->pos0 + p->tokens, kv), rows_of(s->k_cache, s->pos0 + s->tokens, kv));
    check_close(rows_of(p->v_cache, p->pos0 + p->tokens, kv), rows_of(s->v_cache, s->pos0 + s->tokens, kv));
  }
}

TEST_CASE("cpu_kernels.decoder_layer_forward: slices that do not cover the rows are refused") {
  const Layer l = make_layer(32, 64, 4, 2, 16, 5);
  const std::int64_t kv = l.cfg.kv_dim();
  Vec x(6 * 32, 0.5f), cache(2 * 2 * 16 * sz(kv));  // two slots of 16 rows: keys, then values
  const std::vector<std::int64_t> first{0, 16};
  std::vector<int> caps{16, 16};
  Scratch scratch;
  cpu::CpuBackend b;
  auto run = [&](std::vector<backend::SequenceSlice> s, std::int64_t tokens = 6) {
    const backend::KvCacheView view{cache.data(), cache.data() + 32 * kv, DType::F32, kv, first,
                                    caps};
    backend::decoder_layer_forward(b, l.cfg, l.view(), x.data(), tokens, s, view, scratch);
  };
  auto expect_invalid = [&](std::vector<backend::SequenceSlice> s, std::int64_t tokens = 6) {
    try {
      run(std::move(s), tokens);
      FAIL("expected brigade::Error");
    } catch (const Error& e) {
      CHECK(e.code() == Errc::InvalidArgument);
      CHECK(std::string(e.what()).find("decoder_layer_forward: ") == 0);
    }
  };
  SUBCASE("slices stop short of tokens") { expect_invalid({{0, 0, 3}}); }
  SUBCASE("slices run past tokens") { expect_invalid({{0, 0, 3}, {1, 0, 4}}); }
  SUBCASE("no slices for nonzero tokens") { expect_invalid({}); }
  SUBCASE("an empty slice") { expect_invalid({{0, 0, 3}, {1, 0, 0}, {1, 0, 3}}); }
  SUBCASE("a negative position") { expect_invalid({{0, -1, 3}, {1, 0, 3}}); }
  SUBCASE("a sequence the cache does not hold") { expect_invalid({{0, 0, 3}, {2, 0, 3}}); }
  SUBCASE("positions past seq_len") { expect_invalid({{0, 14, 3}, {1, 0, 3}}); }
  SUBCASE("positions past the sequence's capacity") {
    caps[0] = 2;
    expect_invalid({{0, 0, 3}, {1, 0, 3}});
  }
  SUBCASE("the valid split runs, and zero tokens with no slices is a no-op") {
    CHECK_NOTHROW(run({{0, 0, 3}, {1, 0, 3}}));
    CHECK_NOTHROW(run({}, 0));
  }
}
