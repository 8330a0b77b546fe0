// Training kernels: every backward against central finite differences of a double-precision
// reference forward (templated on the scalar), evaluated at the float inputs the kernel saw, so
// the float kernel's analytic gradient is compared with the exact function's gradient. The
// training decoder layer against the inference layer, finite differences, its B/W split,
// packing, and bad input.
#include "brigade/backend/cpu.hpp"
#include "brigade/backend/cpu_train.hpp"
#include "brigade/backend/cpu_backend.hpp"
#include "brigade/backend/decoder.hpp"
#include "brigade/core/error.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/weights.hpp"

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

using brigade::Errc;
using brigade::Error;
namespace cpu = brigade::cpu;
namespace backend = brigade::backend;
using brigade::DType;
using Vec = std::vector<float>;
using DVec = std::vector<double>;
using Offsets = std::vector<std::int64_t>;
template <class T>
using V = std::vector<T>;

/// Relative tolerance of an analytic float gradient against the double finite difference.
/// Observed errors are below 5e-7 (float rounding of the analytic gradient); a wrong term in a
/// gradient shows up at 1e-2 or more.
constexpr double kGradTol = 1e-5;

std::size_t sz(std::int64_t n) { return static_cast<std::size_t>(n); }

using brigade::test::random_vec;

DVec to_d(const Vec& v) { return DVec(v.begin(), v.end()); }

/// max_i |got_i - ref_i| <= rtol * max_i |ref_i| (relative to the tensor's scale).
template <class A, class B>
void check_close(const A& got, const B& ref, double rtol) {
  REQUIRE(got.size() == ref.size());
  double err = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    REQUIRE(std::isfinite(static_cast<double>(got[i])));
    err = std::max(err, std::abs(static_cast<double>(got[i]) - static_cast<double>(ref[i])));
    scale = std::max(scale, std::abs(static_cast<double>(ref[i])));
  }
  INFO("max abs error " << err << ", max |ref| " << scale);
  CHECK(scale > 0.0);
  CHECK(err <= rtol * std::max(scale, 1e-30));
}

/// Central differences of f at p, every coordinate: (f(p + eps e_i) - f(p - eps e_i)) / 2 eps.
DVec numeric_grad(const std::function<double(const DVec&)>& f, DVec p, double eps = 1e-6) {
  DVec g(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    const double o = p[i];
    p[i] = o + eps;
    const double fp = f(p);
    p[i] = o - eps;
    const double fm = f(p);
    p[i] = o;
    g[i] = (fp - fm) / (2.0 * eps);
  }
  return g;
}

/// sum_i c_i y_i: the scalar loss whose gradient wrt y is c.
template <class T>
double dot(const V<T>& y, const Vec& c) {
  double s = 0.0;
  for (std::size_t i = 0; i < y.size(); ++i) s += double(y[i]) * double(c[i]);
  return s;
}

// ---- reference forwards, templated on the scalar -----------------------------------------

template <class T>
V<T> ref_rmsnorm(const V<T>& x, const V<T>& w, std::int64_t tokens, std::int64_t dim, double eps) {
  V<T> out(sz(tokens * dim));
  for (std::int64_t t = 0; t < tokens; ++t) {
    T ss = 0;
    for (std::int64_t j = 0; j < dim; ++j) ss += x[sz(t * dim + j)] * x[sz(t * dim + j)];
    const T inv = T(1) / std::sqrt(ss / T(dim) + T(eps));
    for (std::int64_t j = 0; j < dim; ++j) out[sz(t * dim + j)] = w[sz(j)] * inv * x[sz(t * dim + j)];
  }
  return out;
}

template <class T>
V<T> ref_matmul_wt(const V<T>& x, const V<T>& w, std::int64_t tokens, std::int64_t in,
                   std::int64_t out_dim) {
  V<T> out(sz(tokens * out_dim), T(0));
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t n = 0; n < out_dim; ++n) {
      T acc = 0;
      for (std::int64_t k = 0; k < in; ++k) acc += x[sz(t * in + k)] * w[sz(n * in + k)];
      out[sz(t * out_dim + n)] = acc;
    }
  return out;
}

std::vector<std::int32_t> positions_of(const Offsets& offsets) {
  std::vector<std::int32_t> pos;
  for (std::size_t s = 0; s + 1 < offsets.size(); ++s)
    for (std::int64_t t = 0; t < offsets[s + 1] - offsets[s]; ++t)
      pos.push_back(static_cast<std::int32_t>(t));
  return pos;
}

/// RoPE with the kernel's float angle (float(pos) * (1 / powf(theta, 2j / hs))), then cos and
/// sin and the rotation in T: the exact function of the angles the kernel uses.
template <class T>
void ref_rope(V<T>& x, const std::vector<std::int32_t>& pos, std::int64_t width, int hs,
              float theta) {
  for (std::size_t t = 0; t < pos.size(); ++t)
    for (std::int64_t i = 0; i < width; i += 2) {
      const int hd = int(i % hs);
      const float f = 1.0f / std::pow(theta, float(hd) / float(hs));
      const double a = double(float(pos[t]) * f);
      const T c = T(std::cos(a)), s = T(std::sin(a));
      const T v0 = x[t * sz(width) + sz(i)], v1 = x[t * sz(width) + sz(i) + 1];
      x[t * sz(width) + sz(i)] = v0 * c - v1 * s;
      x[t * sz(width) + sz(i) + 1] = v0 * s + v1 * c;
    }
}

/// Causal GQA attention within each packed sequence; lse (if given) gets log-sum-exp per row
/// and head.
template <class T>
V<T> ref_attention(const V<T>& q, const V<T>& k, const V<T>& v, const Offsets& offsets,
                   int n_heads, int n_kv_heads, int hs, V<T>* lse = nullptr) {
  const std::int64_t dim = std::int64_t(n_heads) * hs, kv_dim = std::int64_t(n_kv_heads) * hs;
  const std::int64_t tokens = offsets.back();
  V<T> out(sz(tokens * dim), T(0));
  if (lse) lse->assign(sz(tokens * n_heads), T(0));
  for (std::size_t s = 0; s + 1 < offsets.size(); ++s)
    for (std::int64_t t = offsets[s]; t < offsets[s + 1]; ++t)
      for (int h = 0; h < n_heads; ++h) {
        const std::int64_t kvh = h / (n_heads / n_kv_heads);
        V<T> sc;
        T mx = -std::numeric_limits<T>::infinity();
        for (std::int64_t j = offsets[s]; j <= t; ++j) {
          T acc = 0;
          for (int i = 0; i < hs; ++i)
            acc += q[sz(t * dim + h * hs + i)] * k[sz(j * kv_dim + kvh * hs + i)];
          sc.push_back(acc / std::sqrt(T(hs)));
          mx = std::max(mx, sc.back());
        }
        T sum = 0;
        for (T& e : sc) sum += (e = std::exp(e - mx));
        if (lse) (*lse)[sz(t * n_heads + h)] = mx + std::log(sum);
        for (std::int64_t j = offsets[s]; j <= t; ++j)
          for (int i = 0; i < hs; ++i)
            out[sz(t * dim + h * hs + i)] +=
                sc[sz(j - offsets[s])] / sum * v[sz(j * kv_dim + kvh * hs + i)];
      }
  return out;
}

template <class T>
V<T> ref_swiglu(const V<T>& g, const V<T>& u) {
  V<T> h(g.size());
  for (std::size_t i = 0; i < g.size(); ++i) h[i] = g[i] / (T(1) + std::exp(-g[i])) * u[i];
  return h;
}

/// Mean cross-entropy over rows with a target (-1 ignored).
template <class T>
T ref_cross_entropy(const V<T>& logits, const std::vector<std::int32_t>& targets,
                    std::int64_t vocab) {
  T sum = 0;
  std::int64_t count = 0;
  for (std::size_t t = 0; t < targets.size(); ++t) {
    if (targets[t] < 0) continue;
    const T* row = logits.data() + t * sz(vocab);
    const T mx = *std::max_element(row, row + vocab);
    T s = 0;
    for (std::int64_t j = 0; j < vocab; ++j) s += std::exp(row[j] - mx);
    sum += mx + std::log(s) - row[targets[t]];
    ++count;
  }
  return count > 0 ? sum / T(count) : T(0);
}

// ---- a decoder layer with owned weights, and its reference ----------------------------------

/// Index of each DecoderWeights tensor in Layer::t and DecoderGrads::tensors().
enum Tensor { RmsAtt, Wq, Wk, Wv, Wo, RmsFfn, W1, W2, W3, kTensors };
constexpr const char* kTensorNames[kTensors] = {"rms_att", "wq",  "wk", "wv", "wo",
                                                "rms_ffn", "w1", "w2", "w3"};

struct Layer {
  brigade::model::LlamaConfig cfg;
  std::array<Vec, kTensors> t;
  brigade::model::DecoderWeights view() const {
    return {t[RmsAtt].data(), t[Wq].data(), t[Wk].data(), t[Wv].data(), t[Wo].data(),
            t[RmsFfn].data(), t[W1].data(), t[W2].data(), t[W3].data()};
  }
};

brigade::model::LlamaConfig make_config(int dim, int hidden, int n_heads, int n_kv_heads,
                                        int seq_len) {
  brigade::model::LlamaConfig c;
  c.dim = dim;
  c.hidden_dim = hidden;
  c.n_layers = 1;
  c.n_heads = n_heads;
  c.n_kv_heads = n_kv_heads;
  c.vocab_size = 32;
  c.seq_len = seq_len;
  c.validate("test config");
  return c;
}

Layer make_layer(const brigade::model::LlamaConfig& c, unsigned seed) {
  Layer l;
  l.cfg = c;
  std::mt19937 rng(seed);
  const std::int64_t dim = c.dim, kv = c.kv_dim(), hid = c.hidden_dim;
  const float a = 1.7f / std::sqrt(float(dim)), b = 1.7f / std::sqrt(float(hid));
  l.t[RmsAtt] = random_vec(rng, dim, 0.5f, 1.5f);
  l.t[RmsFfn] = random_vec(rng, dim, 0.5f, 1.5f);
  l.t[Wq] = random_vec(rng, dim * dim, -a, a);
  l.t[Wk] = random_vec(rng, kv * dim, -a, a);
  l.t[Wv] = random_vec(rng, kv * dim, -a, a);
  l.t[Wo] = random_vec(rng, dim * dim, -a, a);
  l.t[W1] = random_vec(rng, hid * dim, -a, a);
  l.t[W3] = random_vec(rng, hid * dim, -a, a);
  l.t[W2] = random_vec(rng, dim * hid, -b, b);
  return l;
}

/// The training layer in T: x_mid = x + attn(rope(xb Wq^T), rope(xb Wk^T), xb Wv^T) Wo^T,
/// y = x_mid + (silu(xf W1^T) * xf W3^T) W2^T, xb/xf the RMSNorms.
template <class T>
V<T> ref_layer(const brigade::model::LlamaConfig& c, const std::array<V<T>, kTensors>& w,
               const V<T>& x, const Offsets& offsets) {
  const std::int64_t dim = c.dim, kv = c.kv_dim(), hid = c.hidden_dim, n = offsets.back();
  const int hs = c.head_size();
  const auto pos = positions_of(offsets);
  const V<T> xb = ref_rmsnorm(x, w[RmsAtt], n, dim, c.norm_eps);
  V<T> q = ref_matmul_wt(xb, w[Wq], n, dim, dim);
  V<T> k = ref_matmul_wt(xb, w[Wk], n, dim, kv);
  const V<T> v = ref_matmul_wt(xb, w[Wv], n, dim, kv);
  ref_rope(q, pos, dim, hs, c.rope_theta);
  ref_rope(k, pos, kv, hs, c.rope_theta);
  const V<T> att = ref_attention(q, k, v, offsets, c.n_heads, c.n_kv_heads, hs);
  V<T> xm = ref_matmul_wt(att, w[Wo], n, dim, dim);
  for (std::size_t i = 0; i < xm.size(); ++i) xm[i] += x[i];
  const V<T> xf = ref_rmsnorm(xm, w[RmsFfn], n, dim, c.norm_eps);
  const V<T> hb = ref_swiglu(ref_matmul_wt(xf, w[W1], n, dim, hid), ref_matmul_wt(xf, w[W3], n, dim, hid));
  V<T> y = ref_matmul_wt(hb, w[W2], n, hid, dim);
  for (std::size_t i = 0; i < y.size(); ++i) y[i] += xm[i];
  return y;
}

std::array<DVec, kTensors> to_d(const std::array<Vec, kTensors>& t) {
  std::array<DVec, kTensors> d;
  for (int i = 0; i < kTensors; ++i) d[sz(i)] = to_d(t[sz(i)]);
  return d;
}

/// Runs the training layer (forward, BI, BW) on one packed micro-batch.
struct TrainResult {
  Vec y, dx;
  cpu::DecoderGrads grads;
};

TrainResult run_train(const Layer& l, const Vec& x, const Vec& dy, const Offsets& offsets) {
  TrainResult r;
  const std::int64_t n = offsets.back();
  r.y.resize(x.size());
  r.dx.resize(x.size());
  r.grads.zero(l.cfg);
  cpu::DecoderActivations acts;
  cpu::DecoderTrainScratch scratch;
  cpu::decoder_train_forward(l.cfg, l.view(), x.data(), r.y.data(), n, offsets, acts, &scratch);
  cpu::decoder_backward_input(l.cfg, l.view(), acts, dy.data(), r.dx.data(), &scratch);
  cpu::decoder_backward_weight(l.cfg, acts, r.grads);
  return r;
}

void expect_invalid_argument(const std::function<void()>& f) {
  try {
    f();
    FAIL("expected brigade::Error");
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(e.code() == Errc::InvalidArgument);
  }
}

void expect_invalid_usage(const std::function<void()>& f) {
  try {
    f();
    FAIL("expected brigade::Error");
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(e.code() == Errc::InvalidUsage);
  }
}

}  // namespace

// ---- per-kernel backward vs finite differences -------------------------------------------------

TEST_CASE("train.embedding_backward: scatter-add with repeated ids, ids out of range refused") {
  std::mt19937 rng(1);
  const std::int64_t vocab = 7, dim = 5;
  const std::vector<std::int32_t> ids = {3, 0, 3, 6, 3};
  const std::int64_t n = std::int64_t(ids.size());
  const Vec table = random_vec(rng, vocab * dim), c = random_vec(rng, n * dim);
  auto loss = [&](const DVec& tb) {
    double s = 0.0;
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t j = 0; j < dim; ++j) s += tb[sz(ids[sz(t)] * dim + j)] * c[sz(t * dim + j)];
    return s;
  };
  Vec dtable(sz(vocab * dim), 0.5f);  // accumulates onto what is there
  cpu::embedding_backward(c.data(), ids.data(), dtable.data(), n, dim, vocab);
  DVec ref = numeric_grad(loss, to_d(table));
  for (double& g : ref) g += 0.5;
  check_close(dtable, ref, kGradTol);

  const std::vector<std::int32_t> bad = {1, 7};
  Vec before = dtable;
  expect_invalid_argument([&] {
    cpu::embedding_backward(c.data(), bad.data(), dtable.data(), 2, dim, vocab);
  });
  CHECK(dtable == before);  // nothing written
  const std::vector<std::int32_t> neg = {-1};
  expect_invalid_argument(
      [&] { cpu::embedding_backward(c.data(), neg.data(), dtable.data(), 1, dim, vocab); });
}

TEST_CASE("train.rmsnorm_backward: dx and dweight vs finite differences, accumulate, aliasing") {
  std::mt19937 rng(2);
  const std::int64_t n = 4, dim = 9;
  const float eps = 1e-5f;
  const Vec x = random_vec(rng, n * dim, -2.0f, 2.0f), w = random_vec(rng, dim, 0.5f, 1.5f);
  const Vec c = random_vec(rng, n * dim);

  Vec y(x.size()), y_inf(x.size()), inv(sz(n));
  cpu::rmsnorm_train(x.data(), w.data(), y.data(), inv.data(), n, dim, eps);
  cpu::rmsnorm(x.data(), w.data(), y_inf.data(), n, dim, eps);
  CHECK(y == y_inf);  // same float formula as the inference kernel

  Vec dx(x.size()), dw(sz(dim), 0.0f);
  cpu::rmsnorm_backward(x.data(), w.data(), inv.data(), c.data(), dx.data(), dw.data(), n, dim);
  const DVec dw_ref = numeric_grad(
      [&](const DVec& wd) { return dot(ref_rmsnorm(to_d(x), wd, n, dim, eps), c); }, to_d(w));
  const DVec dx_ref = numeric_grad(
      [&](const DVec& xd) { return dot(ref_rmsnorm(xd, to_d(w), n, dim, eps), c); }, to_d(x));
  check_close(dx, dx_ref, kGradTol);
  check_close(dw, dw_ref, kGradTol);

  SUBCASE("Store::Accumulate adds, dweight accumulates, nullptr skips it") {
    Vec acc(x.size(), 1.0f), dw2 = dw;
    cpu::rmsnorm_backward(x.data(), w.data(), inv.data(), c.data(), acc.data(), dw2.data(), n, dim,
                          cpu::Store::Accumulate);
    for (std::size_t i = 0; i < acc.size(); ++i) CHECK(acc[i] == doctest::Approx(dx[i] + 1.0f));
    for (std::size_t i = 0; i < dw.size(); ++i) CHECK(dw2[i] == doctest::Approx(2.0f * dw[i]));
    Vec dx3(x.size());
    cpu::rmsnorm_backward(x.data(), w.data(), inv.data(), c.data(), dx3.data(), nullptr, n, dim);
    CHECK(dx3 == dx);
  }
  SUBCASE("dx may alias dy") {
    Vec g = c;
    cpu::rmsnorm_backward(x.data(), w.data(), inv.data(), g.data(), g.data(), nullptr, n, dim);
    CHECK(g == dx);
  }
}

TEST_CASE("train.matmul_wt backward: input dX = dY W and weight dW += dY^T X, separately") {
  std::mt19937 rng(3);
  const std::int64_t n = 5, in = 7, out = 6;
  const Vec x = random_vec(rng, n * in), w = random_vec(rng, out * in), c = random_vec(rng, n * out);
  Vec dx(sz(n * in)), dw(sz(out * in), 0.0f);
  cpu::matmul_wt_backward_input(c.data(), w.data(), dx.data(), n, in, out);
  cpu::matmul_wt_backward_weight(c.data(), x.data(), dw.data(), n, in, out);
  check_close(dx, numeric_grad([&](const DVec& xd) {
                return dot(ref_matmul_wt(xd, to_d(w), n, in, out), c);
              }, to_d(x)), kGradTol);
  check_close(dw, numeric_grad([&](const DVec& wd) {
                return dot(ref_matmul_wt(to_d(x), wd, n, in, out), c);
              }, to_d(w)), kGradTol);

  // Accumulation: the weight gradient adds, the input gradient adds under Store::Accumulate.
  Vec dw2 = dw, dx2 = dx;
  cpu::matmul_wt_backward_weight(c.data(), x.data(), dw2.data(), n, in, out);
  cpu::matmul_wt_backward_input(c.data(), w.data(), dx2.data(), n, in, out, cpu::Store::Accumulate);
  for (std::size_t i = 0; i < dw.size(); ++i) CHECK(dw2[i] == doctest::Approx(2.0f * dw[i]));
  for (std::size_t i = 0; i < dx.size(); ++i) CHECK(dx2[i] == doctest::Approx(2.0f * dx[i]));
  expect_invalid_argument(
      [&] { cpu::matmul_wt_backward_weight(c.data(), x.data(), dw.data(), -1, in, out); });
  expect_invalid_argument(
      [&] { cpu::matmul_wt_backward_input(c.data(), w.data(), dx.data(), n, -1, out); });
}

TEST_CASE("train.rope: varlen positions restart per sequence, backward is the inverse rotation") {
  std::mt19937 rng(4);
  const int nh = 4, nkv = 2, hs = 6;
  const float theta = 10000.0f;
  const Offsets offsets = {0, 3, 4, 8};
  const std::int64_t n = 8, dim = nh * hs, kv = nkv * hs;
  const Vec q = random_vec(rng, n * dim), k = random_vec(rng, n * kv);
  const Vec cq = random_vec(rng, n * dim), ck = random_vec(rng, n * kv);
  const auto pos = positions_of(offsets);

  Vec qv = q, kvv = k, qi = q, ki = k;
  cpu::rope_varlen(qv.data(), kvv.data(), offsets, nh, nkv, hs, theta);
  cpu::rope(qi.data(), ki.data(), pos.data(), n, nh, nkv, hs, theta);
  CHECK(qv == qi);
  CHECK(kvv == ki);

  Vec dq = cq, dk = ck;
  cpu::rope_backward(dq.data(), dk.data(), pos.data(), n, nh, nkv, hs, theta);
  check_close(dq, numeric_grad([&](const DVec& xd) {
                DVec r = xd;
                ref_rope(r, pos, dim, hs, theta);
                return dot(r, cq);
              }, to_d(q)), kGradTol);
  check_close(dk, numeric_grad([&](const DVec& xd) {
                DVec r = xd;
                ref_rope(r, pos, kv, hs, theta);
                return dot(r, ck);
              }, to_d(k)), kGradTol);
  // Rotations are orthogonal: backward undoes forward.
  cpu::rope_backward(qv.data(), kvv.data(), pos.data(), n, nh, nkv, hs, theta);
  check_close(qv, q, 1e-6);
  check_close(kvv, k, 1e-6);
}

TEST_CASE("train.attention_varlen: forward and lse vs reference, dq, dk, dv vs finite differences") {
  struct Case {
    Offsets offsets;
    int nh, nkv, hs;
  };
  // Lengths 3,1,4 with GQA; and a sequence longer than the 128-row attention block.
  for (const Case& cs : {Case{{0, 3, 4, 8}, 4, 2, 4}, Case{{0, 2, 135}, 2, 1, 4},
                         Case{{0, 5}, 3, 3, 2}}) {
    CAPTURE(cs.offsets.back());
    CAPTURE(cs.nh);
    std::mt19937 rng(5);
    const std::int64_t n = cs.offsets.back(), dim = cs.nh * cs.hs, kv = cs.nkv * cs.hs;
    const Vec q = random_vec(rng, n * dim, -1.5f, 1.5f), k = random_vec(rng, n * kv, -1.5f, 1.5f);
    const Vec v = random_vec(rng, n * kv), c = random_vec(rng, n * dim);
    Vec out(sz(n * dim)), lse(sz(n * cs.nh));
    cpu::attention_varlen_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), cs.offsets,
                                  cs.nh, cs.nkv, cs.hs);
    DVec lse_ref;
    const DVec out_ref =
        ref_attention(to_d(q), to_d(k), to_d(v), cs.offsets, cs.nh, cs.nkv, cs.hs, &lse_ref);
    check_close(out, out_ref, 1e-5);
    check_close(lse, lse_ref, 1e-5);

    Vec dq(q.size()), dk(k.size(), 7.0f), dv(v.size(), 7.0f);  // dk, dv are overwritten
    cpu::attention_varlen_backward(q.data(), k.data(), v.data(), out.data(), lse.data(), c.data(),
                                   dq.data(), dk.data(), dv.data(), cs.offsets, cs.nh, cs.nkv,
                                   cs.hs);
    const DVec qd = to_d(q), kd = to_d(k), vd = to_d(v);
    auto f = [&](const DVec& qq, const DVec& kk, const DVec& vv) {
      return dot(ref_attention(qq, kk, vv, cs.offsets, cs.nh, cs.nkv, cs.hs), c);
    };
    check_close(dq, numeric_grad([&](const DVec& x) { return f(x, kd, vd); }, qd), kGradTol);
    check_close(dk, numeric_grad([&](const DVec& x) { return f(qd, x, vd); }, kd), kGradTol);
    check_close(dv, numeric_grad([&](const DVec& x) { return f(qd, kd, x); }, vd), kGradTol);
  }
}

TEST_CASE("train.attention_varlen: equals cpu::attention run per sequence with an empty cache") {
  std::mt19937 rng(6);
  const int nh = 4, nkv = 2, hs = 8;
  const Offsets offsets = {0, 3, 4, 8, 140};
  const std::int64_t n = offsets.back(), dim = nh * hs, kv = nkv * hs;
  const Vec q = random_vec(rng, n * dim), k = random_vec(rng, n * kv), v = random_vec(rng, n * kv);
  Vec out(sz(n * dim)), ref(sz(n * dim));
  cpu::attention_varlen_forward(q.data(), k.data(), v.data(), out.data(), nullptr, offsets, nh,
                                nkv, hs);
  for (std::size_t s = 0; s + 1 < offsets.size(); ++s) {
    const std::int64_t o = offsets[s], len = offsets[s + 1] - o;
    cpu::attention(q.data() + o * dim, k.data() + o * kv, v.data() + o * kv, ref.data() + o * dim,
                   len, 0, nh, nkv, hs);
  }
  check_close(out, ref, 1e-5);
}

TEST_CASE("train.swiglu_backward: dgate, dup vs finite differences, h is cpu::swiglu's bits") {
  std::mt19937 rng(7);
  const std::int64_t n = 40;
  const Vec g = random_vec(rng, n, -6.0f, 6.0f), u = random_vec(rng, n, -2.0f, 2.0f);
  const Vec c = random_vec(rng, n);
  Vec dg(sz(n)), du(sz(n)), h(sz(n));
  cpu::swiglu_backward(g.data(), u.data(), c.data(), dg.data(), du.data(), n, h.data());
  Vec h_inf = g;
  cpu::swiglu(h_inf.data(), u.data(), n);
  CHECK(h == h_inf);
  check_close(dg, numeric_grad([&](const DVec& x) { return dot(ref_swiglu(x, to_d(u)), c); },
                               to_d(g)), kGradTol);
  check_close(du, numeric_grad([&](const DVec& x) { return dot(ref_swiglu(to_d(g), x), c); },
                               to_d(u)), kGradTol);
  // In place: dgate over gate, dup over up, h over dh.
  Vec g2 = g, u2 = u, c2 = c;
  cpu::swiglu_backward(g2.data(), u2.data(), c2.data(), g2.data(), u2.data(), n, c2.data());
  CHECK(g2 == dg);
  CHECK(u2 == du);
  CHECK(c2 == h);
}

TEST_CASE("train.cross_entropy: mean loss and dlogits vs finite differences, ignore -1, stable") {
  std::mt19937 rng(8);
  const std::int64_t n = 6, vocab = 11;
  const std::vector<std::int32_t> targets = {3, -1, 0, 10, -1, 3};
  const Vec logits = random_vec(rng, n * vocab, -4.0f, 4.0f);
  Vec dl(logits.size(), 9.0f);
  const cpu::CrossEntropyLoss loss =
      cpu::cross_entropy(logits.data(), targets.data(), n, vocab, dl.data());
  CHECK(loss.count == 4);
  auto f = [&](const DVec& l) { return ref_cross_entropy(l, targets, vocab); };
  CHECK(loss.mean() == doctest::Approx(f(to_d(logits))).epsilon(1e-6));
  check_close(dl, numeric_grad(f, to_d(logits)), kGradTol);
  for (std::int64_t j = 0; j < vocab; ++j) CHECK(dl[sz(1 * vocab + j)] == 0.0f);  // ignored row

  SUBCASE("grad_denominator scales the gradient (micro-batch accumulation)") {
    Vec dl2(logits.size());
    const auto l2 = cpu::cross_entropy(logits.data(), targets.data(), n, vocab, dl2.data(), 10.0);
    CHECK(l2.sum == loss.sum);
    for (std::size_t i = 0; i < dl.size(); ++i) CHECK(dl2[i] == doctest::Approx(dl[i] * 0.4f));
  }
  SUBCASE("in place, loss only, and all-ignored") {
    Vec inplace = logits;
    cpu::cross_entropy(inplace.data(), targets.data(), n, vocab, inplace.data());
    CHECK(inplace == dl);
    CHECK(cpu::cross_entropy(logits.data(), targets.data(), n, vocab, nullptr).sum == loss.sum);
    const std::vector<std::int32_t> none(sz(n), -1);
    const auto l0 = cpu::cross_entropy(logits.data(), none.data(), n, vocab, dl.data());
    CHECK(l0.count == 0);
    CHECK(l0.mean() == 0.0);
    CHECK(std::all_of(dl.begin(), dl.end(), [](float x) { return x == 0.0f; }));
  }
  SUBCASE("huge logits: log-softmax with the maximum subtracted stays finite and exact") {
    Vec big = logits;
    for (float& x : big) x = x * 1000.0f + 5e4f;
    Vec dbig(big.size());
    const auto lb = cpu::cross_entropy(big.data(), targets.data(), n, vocab, dbig.data());
    CHECK(std::isfinite(lb.sum));
    CHECK(lb.mean() == doctest::Approx(f(to_d(big))).epsilon(1e-5));
    for (float x : dbig) CHECK(std::isfinite(x));
  }
  SUBCASE("bad targets and denominators are refused") {
    const std::vector<std::int32_t> bad = {0, 11};
    expect_invalid_argument(
        [&] { cpu::cross_entropy(logits.data(), bad.data(), 2, vocab, dl.data()); });
    const std::vector<std::int32_t> neg = {-2};
    expect_invalid_argument(
        [&] { cpu::cross_entropy(logits.data(), neg.data(), 1, vocab, dl.data()); });
    expect_invalid_argument(
        [&] { cpu::cross_entropy(logits.data(), targets.data(), n, vocab, dl.data(), -1.0); });
  }
}

TEST_CASE("train.head: final norm + classifier + cross-entropy, BI then BW vs finite differences") {
  std::mt19937 rng(9);
  auto c = make_config(8, 12, 2, 1, 16);
  c.vocab_size = 13;
  const std::int64_t n = 5, dim = c.dim, vocab = c.vocab_size;
  const Vec x = random_vec(rng, n * dim, -2.0f, 2.0f), rms = random_vec(rng, dim, 0.5f, 1.5f);
  const Vec wcls = random_vec(rng, vocab * dim);
  const std::vector<std::int32_t> targets = {4, 12, -1, 0, 4};

  Vec logits(sz(n * vocab));
  cpu::head_forward(c, rms.data(), wcls.data(), x.data(), n, logits.data());
  cpu::HeadActivations acts;
  Vec dx(x.size());
  const auto loss = cpu::head_forward_backward_input(c, rms.data(), wcls.data(), x.data(),
                                                     targets.data(), n, dx.data(), acts);
  CHECK(acts.bytes() == sizeof(float) * sz(n * dim + n * vocab + dim));
  CHECK(loss.mean() == doctest::Approx(cpu::cross_entropy(logits.data(), targets.data(), n, vocab,
                                                          nullptr).mean()));
  Vec drms(sz(dim), 0.0f), dw(sz(vocab * dim), 0.0f);
  cpu::head_backward_weight(c, acts, drms.data(), dw.data());
  CHECK(acts.bytes() == 0);

  auto f = [&](const DVec& xx, const DVec& r, const DVec& w) {
    return ref_cross_entropy(ref_matmul_wt(ref_rmsnorm(xx, r, n, dim, c.norm_eps), w, n, dim, vocab),
                             targets, vocab);
  };
  const DVec xd = to_d(x), rd = to_d(rms), wd = to_d(wcls);
  CHECK(loss.mean() == doctest::Approx(f(xd, rd, wd)).epsilon(1e-5));
  check_close(dx, numeric_grad([&](const DVec& p) { return f(p, rd, wd); }, xd), kGradTol);
  check_close(drms, numeric_grad([&](const DVec& p) { return f(xd, p, wd); }, rd), kGradTol);
  check_close(dw, numeric_grad([&](const DVec& p) { return f(xd, rd, p); }, wd), kGradTol);

  expect_invalid_usage([&] { cpu::head_backward_weight(c, acts, drms.data(), dw.data()); });
}

// ---- the training decoder layer --------------------------------------------------------------

TEST_CASE("train.decoder.forward: equals the inference decoder_layer_forward on packed sequences") {
  struct Case {
    int dim, hidden, nh, nkv;
    Offsets offsets;
  };
  for (const Case& cs : {Case{16, 24, 4, 2, {0, 3, 4, 8}}, Case{64, 96, 8, 2, {0, 130, 137}},
                         Case{32, 40, 4, 4, {0, 1}}}) {
    CAPTURE(cs.dim);
    const auto cfg = make_config(cs.dim, cs.hidden, cs.nh, cs.nkv, 256);
    const Layer l = make_layer(cfg, 11);
    std::mt19937 rng(12);
    const std::int64_t n = cs.offsets.back(), kv = cfg.kv_dim();
    const Vec x = random_vec(rng, n * cfg.dim, -2.0f, 2.0f);

    Vec y(x.size());
    cpu::DecoderActivations acts;
    cpu::decoder_train_forward(cfg, l.view(), x.data(), y.data(), n, cs.offsets, acts);
    CHECK(acts.phase == cpu::DecoderActivations::Phase::Forward);

    // One cache slot per sequence (seq_len rows each): every slot's keys, then its values.
    const auto n_seq = static_cast<std::int64_t>(cs.offsets.size()) - 1;
    Vec cache(sz(2 * n_seq * cfg.seq_len * kv), std::numeric_limits<float>::quiet_NaN());
    std::vector<std::int64_t> first;
    std::vector<int> caps;
    std::vector<backend::SequenceSlice> slices;
    for (std::int64_t s = 0; s < n_seq; ++s) {
      first.push_back(s * cfg.seq_len);
      caps.push_back(cfg.seq_len);
      slices.push_back({std::int32_t(s), 0,
                        std::int32_t(cs.offsets[sz(s) + 1] - cs.offsets[sz(s)])});
    }
    const backend::KvCacheView view{cache.data(), cache.data() + n_seq * cfg.seq_len * kv,
                                    DType::F32, kv, first, caps};
    Vec xi = x;
    backend::DecoderBuffers<cpu::CpuBackend> scratch;
    cpu::CpuBackend b;
    backend::decoder_layer_forward(b, cfg, l.view(), xi.data(), n, slices, view, scratch);
    check_close(y, xi, 1e-5);

    // In place (x_out == x_in) gives the same bits.
    Vec inplace = x;
    cpu::decoder_train_forward(cfg, l.view(), inplace.data(), inplace.data(), n, cs.offsets, acts);
    CHECK(inplace == y);
  }
}

TEST_CASE("train.decoder.backward: BI then BW vs finite differences of sum(dy * y), dim 16") {
  // paper: Qi et al. 2023 (zero bubble), §2: B = BI (activation grads) + BW (weight grads).
  const auto cfg = make_config(16, 24, 4, 2, 32);
  const Layer l = make_layer(cfg, 21);
  const Offsets offsets = {0, 3, 4, 8};
  const std::int64_t n = offsets.back();
  std::mt19937 rng(22);
  const Vec x = random_vec(rng, n * cfg.dim, -2.0f, 2.0f), dy = random_vec(rng, n * cfg.dim);
  TrainResult r = run_train(l, x, dy, offsets);

  const std::array<DVec, kTensors> wd = to_d(l.t);
  const DVec xd = to_d(x);
  check_close(r.y, ref_layer(cfg, wd, xd, offsets), 1e-5);
  check_close(r.dx, numeric_grad([&](const DVec& p) { return dot(ref_layer(cfg, wd, p, offsets), dy); },
                                 xd),
              kGradTol);
  const auto g = r.grads.tensors();
  for (int i = 0; i < kTensors; ++i) {
    CAPTURE(std::string(kTensorNames[i]));
    const DVec ref = numeric_grad(
        [&](const DVec& p) {
          std::array<DVec, kTensors> w2 = wd;
          w2[sz(i)] = p;
          return dot(ref_layer(cfg, w2, xd, offsets), dy);
        },
        wd[sz(i)]);
    check_close(*g[sz(i)], ref, kGradTol);
  }
}

TEST_CASE("train.decoder: forward, BI and BW give the same bits at 1, 2 and 3 intra-op threads") {
  // Products split over output columns or dW's rows, attention over KV heads (dK, dV of a KV
  // head summed by one thread in the serial order): sizes above the 2e5-flop split threshold.
  const auto cfg = make_config(64, 96, 8, 2, 256);
  const Layer l = make_layer(cfg, 41);
  const Offsets offsets = {0, 130, 137, 200};
  std::mt19937 rng(42);
  const Vec x = random_vec(rng, offsets.back() * cfg.dim, -2.0f, 2.0f);
  const Vec dy = random_vec(rng, offsets.back() * cfg.dim);
  const int before = cpu::blas_threads();
  std::vector<TrainResult> runs;
  for (int threads : {1, 2, 3}) {
    cpu::set_blas_threads(threads);
    runs.push_back(run_train(l, x, dy, offsets));
  }
  cpu::set_blas_threads(before);
  for (std::size_t i = 1; i < runs.size(); ++i) {
    CAPTURE(i + 1);
    CHECK(runs[i].y == runs[0].y);
    CHECK(runs[i].dx == runs[0].dx);
    const auto g = runs[i].grads.tensors(), g0 = runs[0].grads.tensors();
    for (int t = 0; t < kTensors; ++t) {
      CAPTURE(std::string(kTensorNames[t]));
      CHECK(*g[sz(t)] == *g0[sz(t)]);
    }
  }
}

TEST_CASE("train.decoder.split: BI + BW equals decoder_backward, phases, memory, accumulation") {
  const auto cfg = make_config(16, 24, 4, 2, 32);
  const Layer l = make_layer(cfg, 31);
  const Offsets offsets = {0, 3, 4, 8};
  const std::int64_t n = offsets.back(), dim = cfg.dim, kv = cfg.kv_dim(), hid = cfg.hidden_dim;
  std::mt19937 rng(32);
  const Vec x = random_vec(rng, n * dim, -2.0f, 2.0f), dy = random_vec(rng, n * dim);
  const TrainResult split = run_train(l, x, dy, offsets);

  cpu::DecoderActivations acts;
  Vec y(x.size()), dx(x.size());
  cpu::DecoderGrads grads;
  grads.zero(cfg);
  expect_invalid_usage([&] { cpu::decoder_backward_input(cfg, l.view(), acts, dy.data(), dx.data()); });
  expect_invalid_usage([&] { cpu::decoder_backward_weight(cfg, acts, grads); });

  cpu::decoder_train_forward(cfg, l.view(), x.data(), y.data(), n, offsets, acts);
  // Documented stash: 6d + 2kv + 2f + H + 2 floats per token after the forward.
  const std::size_t index_bytes = sz(n) * sizeof(std::int32_t) + offsets.size() * sizeof(std::int64_t);
  CHECK(acts.bytes() ==
        sz(n * (6 * dim + 2 * kv + 2 * hid + cfg.n_heads + 2)) * sizeof(float) + index_bytes);
  expect_invalid_usage([&] { cpu::decoder_backward_weight(cfg, acts, grads); });

  SUBCASE("combined backward gives the same bits as BI then BW") {
    cpu::decoder_backward(cfg, l.view(), acts, dy.data(), dx.data(), grads);
    CHECK(y == split.y);
    CHECK(dx == split.dx);
    auto a = grads.tensors();
    auto b = std::as_const(split.grads).tensors();
    for (int i = 0; i < kTensors; ++i) CHECK(*a[sz(i)] == *b[sz(i)]);
    CHECK(acts.phase == cpu::DecoderActivations::Phase::Empty);
    CHECK(acts.bytes() == 0);
  }
  SUBCASE("BI stash, then BW accumulates into existing gradients and releases memory") {
    Vec g = dy;  // dx may alias dy
    cpu::decoder_backward_input(cfg, l.view(), acts, g.data(), g.data());
    CHECK(g == split.dx);
    CHECK(acts.phase == cpu::DecoderActivations::Phase::BackwardInput);
    CHECK(acts.bytes() == sz(n * (6 * dim + 2 * kv + 3 * hid) + 2 * dim) * sizeof(float) + index_bytes);
    expect_invalid_usage([&] { cpu::decoder_backward_input(cfg, l.view(), acts, dy.data(), dx.data()); });
    grads = split.grads;
    cpu::decoder_backward_weight(cfg, acts, grads);
    auto a = grads.tensors();
    auto b = std::as_const(split.grads).tensors();
    for (int i = 0; i < kTensors; ++i) {
      CAPTURE(std::string(kTensorNames[i]));
      DVec twice(b[sz(i)]->begin(), b[sz(i)]->end());
      for (double& e : twice) e *= 2.0;
      check_close(*a[sz(i)], twice, 1e-6);
    }
    CHECK(acts.bytes() == 0);
  }
  SUBCASE("clear() drops the stash (for recompute)") {
    acts.clear();
    CHECK(acts.bytes() == 0);
    expect_invalid_usage([&] { cpu::decoder_backward_input(cfg, l.view(), acts, dy.data(), dx.data()); });
  }
  SUBCASE("gradients of the wrong size are refused before anything runs") {
    cpu::DecoderGrads wrong;
    expect_invalid_argument(
        [&] { cpu::decoder_backward(cfg, l.view(), acts, dy.data(), dx.data(), wrong); });
    CHECK(acts.phase == cpu::DecoderActivations::Phase::Forward);
  }
}

TEST_CASE("train.decoder.packing: lengths 3,1,4 packed equal each sequence alone, grads summed") {
  const auto cfg = make_config(16, 24, 4, 2, 32);
  const Layer l = make_layer(cfg, 41);
  const Offsets offsets = {0, 3, 4, 8};
  const std::int64_t n = offsets.back(), dim = cfg.dim;
  std::mt19937 rng(42);
  const Vec x = random_vec(rng, n * dim, -2.0f, 2.0f), dy = random_vec(rng, n * dim);
  const TrainResult packed = run_train(l, x, dy, offsets);

  Vec y(x.size()), dx(x.size());
  cpu::DecoderGrads sum;
  sum.zero(cfg);
  cpu::DecoderActivations acts;
  for (std::size_t s = 0; s + 1 < offsets.size(); ++s) {
    const std::int64_t o = offsets[s], len = offsets[s + 1] - o;
    const Offsets one = {0, len};
    cpu::decoder_train_forward(cfg, l.view(), x.data() + o * dim, y.data() + o * dim, len, one,
                               acts);
    cpu::decoder_backward_input(cfg, l.view(), acts, dy.data() + o * dim, dx.data() + o * dim);
    cpu::decoder_backward_weight(cfg, acts, sum);  // accumulates sequence by sequence
  }
  check_close(y, packed.y, 1e-5);
  check_close(dx, packed.dx, 1e-5);
  auto a = sum.tensors();
  auto b = std::as_const(packed.grads).tensors();
  for (int i = 0; i < kTensors; ++i) {
    CAPTURE(std::string(kTensorNames[i]));
    check_close(*a[sz(i)], *b[sz(i)], 1e-5);
  }
}

TEST_CASE("train.decoder.errors: bad offsets, tokens, pointers raise InvalidArgument") {
  const auto cfg = make_config(16, 24, 4, 2, 8);
  const Layer l = make_layer(cfg, 51);
  std::mt19937 rng(52);
  const std::int64_t n = 8;
  Vec x = random_vec(rng, n * cfg.dim), y(x.size());
  cpu::DecoderActivations acts;
  auto fwd = [&](const Offsets& off, std::int64_t tokens) {
    return [&, off, tokens] {
      cpu::decoder_train_forward(cfg, l.view(), x.data(), y.data(), tokens, off, acts);
    };
  };
  expect_invalid_argument(fwd({0, 3, 3, 8}, n));   // not increasing (empty sequence)
  expect_invalid_argument(fwd({0, 5, 4, 8}, n));   // decreasing
  expect_invalid_argument(fwd({0, 3, 4, 7}, n));   // does not end at tokens
  expect_invalid_argument(fwd({1, 3, 8}, n));      // does not start at 0
  expect_invalid_argument(fwd({8}, n));            // no sequence
  expect_invalid_argument(fwd({}, n));
  expect_invalid_argument(fwd({0, 9}, 9));         // longer than seq_len = 8
  expect_invalid_argument(fwd({0}, 0));            // no tokens
  CHECK(acts.phase == cpu::DecoderActivations::Phase::Empty);
  expect_invalid_argument([&] {
    cpu::decoder_train_forward(cfg, l.view(), nullptr, y.data(), n, Offsets{0, 8}, acts);
  });
  auto w = l.view();
  w.w2 = nullptr;
  expect_invalid_argument(
      [&] { cpu::decoder_train_forward(cfg, w, x.data(), y.data(), n, Offsets{0, 8}, acts); });
  const Vec q(64), k(64);
  Vec o(64);
  expect_invalid_argument([&] {
    cpu::attention_varlen_forward(q.data(), k.data(), k.data(), o.data(), nullptr, Offsets{0, 2, 1},
                                  2, 2, 2);
  });
  expect_invalid_argument([&] {
    cpu::attention_varlen_forward(q.data(), k.data(), k.data(), o.data(), nullptr, Offsets{0, 2},
                                  3, 2, 2);  // 3 heads over 2 kv heads
  });
  expect_invalid_argument([&] { cpu::validate_offsets("t", Offsets{0, 2, 4}, 5, 10); });
  CHECK_NOTHROW(cpu::validate_offsets("t", Offsets{0, 2, 4}, 4, 2));
  expect_invalid_argument([&] { cpu::validate_offsets("t", Offsets{0, 2, 5}, 5, 2); });
}
