// The arithmetic of CudaBackend's training kernels (cuda/train_math.hpp, one GPU thread per work
// item) and the layouts of its backward GEMMs (cuda/gemm_plan.hpp), run on the host with plain
// g++ against the CPU backend's backward (brigade/backend/cpu_train.hpp). Every item function is
// called for every index of its launch grid, exactly as kernels.cu's kernels do, so the formulas
// and the indexing the GPU runs are checked on machines without a GPU.
#include <brigade/backend/cpu.hpp>
#include <brigade/backend/cpu_train.hpp>

#include "../../cuda/gemm_plan.hpp"
#include "../../cuda/train_math.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

using namespace brigade;
namespace cd = brigade::cuda::detail;

namespace {

std::vector<float> randoms(std::size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

double rel_err(std::span<const float> a, std::span<const float> b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1.0));
}

/// Three packed sequences of 5, 1 and 7 tokens (cu_seqlens), and the per-row metadata the
/// backend uploads: position, first row and end row of each row's sequence.
struct Packed {
  std::vector<std::int64_t> offsets{0, 5, 6, 13};
  std::int64_t tokens = 13;
  std::vector<std::int32_t> pos, begin, end;
  Packed() {
    for (std::size_t s = 0; s + 1 < offsets.size(); ++s)
      for (std::int64_t t = offsets[s]; t < offsets[s + 1]; ++t) {
        pos.push_back(static_cast<std::int32_t>(t - offsets[s]));
        begin.push_back(static_cast<std::int32_t>(offsets[s]));
        end.push_back(static_cast<std::int32_t>(offsets[s + 1]));
      }
  }
};

/// RoPE's frequencies as CudaBackend computes them on the host.
std::vector<float> rope_freqs(int head_size, float theta) {
  std::vector<float> f(static_cast<std::size_t>(head_size / 2));
  for (int j = 0; j < head_size / 2; ++j)
    f[static_cast<std::size_t>(j)] =
        1.0f / std::pow(theta, static_cast<float>(2 * j) / static_cast<float>(head_size));
  return f;
}

}  // namespace

TEST_CASE("cuda.train-math: RMSNorm forward, backward-input and gain gradient match cpu_train") {
  const std::int64_t tokens = 9, dim = 24;
  const auto x = randoms(tokens * dim, 1);
  const auto w = randoms(dim, 2);
  const auto dy = randoms(tokens * dim, 3);
  std::vector<float> out(tokens * dim), inv(tokens), ref_out(tokens * dim), ref_inv(tokens);
  cpu::rmsnorm_train(x.data(), w.data(), ref_out.data(), ref_inv.data(), tokens, dim, 1e-5f);
  for (std::int64_t t = 0; t < tokens; ++t)
    cd::rmsnorm_train_item(x.data(), w.data(), out.data(), inv.data(), t, dim, 1e-5f);
  CHECK(out == ref_out);  // the same float formula in the same order
  CHECK(inv == ref_inv);

  for (const bool accumulate : {false, true}) {
    CAPTURE(accumulate);
    const auto base = randoms(tokens * dim, 4);
    std::vector<float> dx = base, ref_dx = base, dw(dim, 0.5f), ref_dw(dim, 0.5f);
    cpu::rmsnorm_backward(x.data(), w.data(), inv.data(), dy.data(), ref_dx.data(), ref_dw.data(),
                          tokens, dim, accumulate ? cpu::Store::Accumulate : cpu::Store::Overwrite);
    // kernels.cu's order: the gain gradient's columns first, then the rows.
    for (std::int64_t j = 0; j < dim; ++j)
      cd::rmsnorm_dweight_item(x.data(), inv.data(), dy.data(), dw.data(), j, tokens, dim);
    for (std::int64_t t = 0; t < tokens; ++t)
      cd::rmsnorm_backward_item(x.data(), w.data(), inv.data(), dy.data(), dx.data(), t, dim,
                                accumulate);
    CHECK(rel_err(dx, ref_dx) < 1e-6);
    CHECK(rel_err(dw, ref_dw) < 1e-6);
  }
  // dx aliasing x (the head's backward writes its input gradient over its input).
  std::vector<float> xa = x, ref_dx(tokens * dim);
  cpu::rmsnorm_backward(x.data(), w.data(), inv.data(), dy.data(), ref_dx.data(), nullptr, tokens,
                        dim);
  for (std::int64_t t = 0; t < tokens; ++t)
    cd::rmsnorm_backward_item(xa.data(), w.data(), inv.data(), dy.data(), xa.data(), t, dim, false);
  CHECK(rel_err(xa, ref_dx) < 1e-6);
}

TEST_CASE("cuda.train-math: SwiGLU backward matches cpu::swiglu_backward, in place") {
  const std::int64_t n = 257;
  const auto g = randoms(n, 5, 3.0f);
  const auto u = randoms(n, 6);
  const auto dh = randoms(n, 7);
  std::vector<float> rdg(n), rdu(n), rh(n);
  cpu::swiglu_backward(g.data(), u.data(), dh.data(), rdg.data(), rdu.data(), n, rh.data());
  std::vector<float> dg = g, du = u, h(n);  // dgate over gate, dup over up, as the backend
  for (std::int64_t i = 0; i < n; ++i)
    cd::swiglu_backward_item(dg.data(), du.data(), dh.data(), dg.data(), du.data(), h.data(), i);
  CHECK(rel_err(dg, rdg) < 1e-6);
  CHECK(rel_err(du, rdu) < 1e-6);
  CHECK(rel_err(h, rh) < 1e-6);
}

TEST_CASE("cuda.train-math: RoPE over packed rows and its inverse match cpu_train") {
  const Packed p;
  const int n_heads = 4, n_kv = 2, hs = 8;
  const std::int64_t dim = n_heads * hs, kv_dim = n_kv * hs;
  const float theta = 10000.0f;
  const auto freq = rope_freqs(hs, theta);
  const auto q0 = randoms(p.tokens * dim, 8);
  const auto k0 = randoms(p.tokens * kv_dim, 9);
  for (const bool inverse : {false, true}) {
    CAPTURE(inverse);
    std::vector<float> q = q0, k = k0, rq = q0, rk = k0;
    if (inverse)
      cpu::rope_backward(rq.data(), rk.data(), p.pos.data(), p.tokens, n_heads, n_kv, hs, theta);
    else
      cpu::rope_varlen(rq.data(), rk.data(), p.offsets, n_heads, n_kv, hs, theta);
    const std::int64_t pairs = p.tokens * ((dim + kv_dim) / 2);
    for (std::int64_t i = 0; i < pairs; ++i)
      cd::rope_item(q.data(), k.data(), p.pos.data(), freq.data(), i, dim, kv_dim, hs, inverse);
    CHECK(rel_err(q, rq) < 1e-6);
    CHECK(rel_err(k, rk) < 1e-6);
  }
}

TEST_CASE("cuda.train-math: causal varlen attention forward and backward match cpu_train (GQA)") {
  const Packed p;
  const int n_heads = 6, n_kv = 2, hs = 8;
  const std::int64_t dim = n_heads * hs, kv_dim = n_kv * hs, T = p.tokens;
  const auto q = randoms(T * dim, 10);
  const auto k = randoms(T * kv_dim, 11);
  const auto v = randoms(T * kv_dim, 12);
  const auto dout = randoms(T * dim, 13);
  std::vector<float> ref_out(T * dim), ref_lse(T * n_heads);
  cpu::attention_varlen_forward(q.data(), k.data(), v.data(), ref_out.data(), ref_lse.data(),
                                p.offsets, n_heads, n_kv, hs);
  std::vector<float> out(T * dim, NAN), lse(T * n_heads, NAN);
  for (std::int64_t i = 0; i < T * n_heads; ++i)
    cd::attention_forward_item(q.data(), k.data(), v.data(), out.data(), lse.data(),
                               p.begin.data(), i, n_heads, n_kv, hs);
  CHECK(rel_err(out, ref_out) < 1e-5);
  CHECK(rel_err(lse, ref_lse) < 1e-6);

  std::vector<float> rdq(T * dim), rdk(T * kv_dim), rdv(T * kv_dim);
  cpu::attention_varlen_backward(q.data(), k.data(), v.data(), ref_out.data(), ref_lse.data(),
                                 dout.data(), rdq.data(), rdk.data(), rdv.data(), p.offsets,
                                 n_heads, n_kv, hs);
  std::vector<float> dsum(T * n_heads), dq(T * dim, NAN), dk(T * kv_dim, NAN), dv(T * kv_dim, NAN);
  for (std::int64_t i = 0; i < T * n_heads; ++i)
    cd::attention_dsum_item(dout.data(), out.data(), dsum.data(), i, n_heads, hs);
  for (std::int64_t i = 0; i < T * n_heads; ++i)
    cd::attention_dq_item(q.data(), k.data(), v.data(), lse.data(), dsum.data(), dout.data(),
                          dq.data(), p.begin.data(), i, n_heads, n_kv, hs);
  for (std::int64_t i = 0; i < T * n_kv; ++i)
    cd::attention_dkv_item(q.data(), k.data(), v.data(), lse.data(), dsum.data(), dout.data(),
                           dk.data(), dv.data(), p.end.data(), i, n_heads, n_kv, hs);
  CHECK(rel_err(dq, rdq) < 1e-5);
  CHECK(rel_err(dk, rdk) < 1e-5);
  CHECK(rel_err(dv, rdv) < 1e-5);
}

TEST_CASE("cuda.train-math: cross-entropy rows match cpu::cross_entropy (pad -1, denominator)") {
  const std::int64_t tokens = 6, vocab = 37;
  const auto logits = randoms(tokens * vocab, 14, 4.0f);
  const std::vector<std::int32_t> targets{3, -1, 0, 36, -1, 17};
  const double denom = 11.0;
  std::vector<float> rd(tokens * vocab);
  const auto ref = cpu::cross_entropy(logits.data(), targets.data(), tokens, vocab, rd.data(), denom);
  std::vector<float> d = logits;  // dlogits over logits, as the backend
  std::vector<double> rows(tokens, NAN);
  const auto inv = static_cast<float>(1.0 / denom);
  for (std::int64_t t = 0; t < tokens; ++t)
    cd::cross_entropy_item(d.data(), targets.data(), d.data(), rows.data(), t, vocab, inv);
  double sum = 0;
  for (const double r : rows) sum += r;
  CHECK(ref.count == 4);
  CHECK(sum == doctest::Approx(ref.sum).epsilon(1e-6));
  CHECK(rows[1] == 0.0);
  CHECK(rel_err(d, rd) < 1e-6);
  for (std::int64_t i = 0; i < vocab; ++i) CHECK(d[static_cast<std::size_t>(vocab + i)] == 0.0f);
}

TEST_CASE("cuda.train-math: embedding backward adds repeated ids like cpu::embedding_backward") {
  const std::int64_t tokens = 7, dim = 5, vocab = 4;
  const std::vector<std::int32_t> ids{2, 0, 2, 3, 2, 0, 1};
  const auto dy = randoms(tokens * dim, 15);
  std::vector<float> ref(vocab * dim, 0.25f), got(vocab * dim, 0.25f);
  cpu::embedding_backward(dy.data(), ids.data(), ref.data(), tokens, dim, vocab);
  for (std::int64_t j = 0; j < dim; ++j)
    cd::embedding_backward_item(dy.data(), ids.data(), got.data(), j, tokens, dim);
  CHECK(got == ref);
}

TEST_CASE("cuda.gemm_plan: backward-input dY W and backward-weight dW += dY^T X match cpu_train") {
  const std::int64_t tokens = 7, in = 12, out = 10;
  const auto x = randoms(tokens * in, 16);
  const auto w = randoms(out * in, 17);
  const auto dy = randoms(tokens * out, 18);
  std::vector<float> rdx(tokens * in), dx(tokens * in, NAN);
  cpu::matmul_wt_backward_input(dy.data(), w.data(), rdx.data(), tokens, in, out);
  cd::reference_gemm(cd::plan_linear_backward_input(tokens, in, out), w.data(), dy.data(),
                     dx.data(), 1.0f, 0.0f);
  CHECK(rel_err(dx, rdx) < 1e-6);
  const auto base = randoms(out * in, 19);
  std::vector<float> rdw = base, dw = base;
  cpu::matmul_wt_backward_weight(dy.data(), x.data(), rdw.data(), tokens, in, out);
  cd::reference_gemm(cd::plan_linear_backward_weight(tokens, in, out), x.data(), dy.data(),
                     dw.data(), 1.0f, 1.0f);  // beta = 1: accumulates, as the backend
  CHECK(rel_err(dw, rdw) < 1e-6);
}
