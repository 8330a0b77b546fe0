// Training kernels of the Llama decoder on the CPU backend: backward of every forward kernel,
// variable-length causal attention (forward with log-sum-exp, backward by recomputation), cross-
// entropy, the LM head, and the decoder layer split into forward / backward-input /
// backward-weight. No per-token loops: the linear layers' backward products are OpenBLAS SGEMM
// when gemm_backend() is OpenBLAS (as their forward is), else Eigen products over RowMajor maps;
// attention's per-head products are Eigen's.
#include "brigade/backend/cpu_train.hpp"

#include "brigade/backend/cpu.hpp"
#include "brigade/backend/decoder.hpp"
#include "brigade/core/error.hpp"
#include "cpu_checks.hpp"
#include "cpu_elementwise.hpp"
#include "intra_op.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/weights.hpp"

// GCC 12 reports a false -Wuninitialized inside its own AVX-512 intrinsics when Eigen's
// vectorised exp() is inlined (GCC bug 105593, fixed in GCC 13); the code is correct.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <Eigen/Core>
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace brigade::cpu {
inline namespace v0 {
namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MapMat = Eigen::Map<RowMat>;
using ConstMapMat = Eigen::Map<const RowMat>;
using StridedMat = Eigen::Map<RowMat, 0, Eigen::OuterStride<>>;
using ConstStridedMat = Eigen::Map<const RowMat, 0, Eigen::OuterStride<>>;
using MapArr = Eigen::Map<Eigen::ArrayXf>;
using ConstMapArr = Eigen::Map<const Eigen::ArrayXf>;

/// Query rows per attention block: the score block is [kAttnBlock x keys] floats.
constexpr std::int64_t kAttnBlock = 128;

/// Flops of causal attention over the sequences of `offsets` (QK^T and PV, dim = heads x head
/// size): the size that decides whether it is split over threads.
double attention_flops(std::span<const std::int64_t> offsets, std::int64_t dim) {
  double f = 0;
  for (std::size_t s = 0; s + 1 < offsets.size(); ++s) {
    const double len = static_cast<double>(offsets[s + 1] - offsets[s]);
    f += 2.0 * len * len * static_cast<double>(dim);  // two products of len^2 / 2 x dim MACs
  }
  return f;
}

// Alignment-independent reductions and exp. Eigen peels an unaligned head of a dynamic-size Map
// with scalar code, so the order of a sum, and whether an element's exp takes the vector or the
// scalar path, would depend on where a buffer happens to start: two runs of the same step could
// differ in the last bits. These walk fixed 16-float blocks from index 0 (the tail padded into
// one block), so every result is bitwise reproducible. (Element-wise +, -, *, / are exact either
// way; the library is built with -ffp-contract=off so no path fuses them differently.)
using Block = Eigen::Array<float, 16, 1>;
constexpr std::int64_t kBlock = 16;

float dot_fixed(const float* a, const float* b, std::int64_t n) {
  Block acc = Block::Zero();
  std::int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock)
    acc += Eigen::Map<const Block>(a + i) * Eigen::Map<const Block>(b + i);
  for (std::int64_t j = 0; i + j < n; ++j) acc[j] += a[i + j] * b[i + j];
  return acc.sum();
}

float dot3_fixed(const float* a, const float* b, const float* c, std::int64_t n) {
  Block acc = Block::Zero();
  std::int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock)
    acc += Eigen::Map<const Block>(a + i) * Eigen::Map<const Block>(b + i) *
           Eigen::Map<const Block>(c + i);
  for (std::int64_t j = 0; i + j < n; ++j) acc[j] += a[i + j] * b[i + j] * c[i + j];
  return acc.sum();
}

/// out[i] = exp(in[i] / div - sub) for i < n (out may alias in); every element through the
/// vector exp. @return the sum of the outputs (fixed order)
float exp_affine_fixed(const float* in, float* out, std::int64_t n, float div, float sub) {
  Block acc = Block::Zero();
  std::int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const Block e = (Eigen::Map<const Block>(in + i) / div - sub).exp();
    if (out != nullptr) Eigen::Map<Block>(out + i) = e;
    acc += e;
  }
  if (i < n) {
    Block t = Block::Constant(-std::numeric_limits<float>::infinity());
    for (std::int64_t j = 0; i + j < n; ++j) t[j] = in[i + j] / div - sub;
    t = t.exp();  // padding: exp(-inf) = 0
    for (std::int64_t j = 0; i + j < n; ++j)
      if (out != nullptr) out[i + j] = t[j];
    acc += t;
  }
  return acc.sum();
}

std::size_t usize(std::int64_t n) { return static_cast<std::size_t>(n); }

/// Resizes `v` to at least `n` elements; never shrinks.
float* grow(std::vector<float>& v, std::int64_t n) {
  if (v.size() < usize(n)) v.resize(usize(n));
  return v.data();
}

/// Sets `v` to exactly `n` elements (contents unspecified unless `zero`).
float* sized(std::vector<float>& v, std::int64_t n, bool zero = false) {
  if (zero) {
    v.assign(usize(n), 0.0f);
  } else {
    v.resize(usize(n));
  }
  return v.data();
}

/// Frees a vector's memory (clear() keeps the capacity).
template <class T>
void release(std::vector<T>& v) noexcept {
  std::vector<T>().swap(v);
}

using detail::check_gemm_shape;
using detail::check_heads;

void check_weights(const char* what, const model::DecoderWeights& w) {
  BRIGADE_CHECK(w.rms_att && w.wq && w.wk && w.wv && w.wo && w.rms_ffn && w.w1 && w.w2 && w.w3,
                Errc::InvalidArgument, "{}: a DecoderWeights pointer is null; expected all 9 set",
                what);
  for (const model::WeightMatrix* m : {&w.wq, &w.wk, &w.wv, &w.wo, &w.w1, &w.w2, &w.w3})
    BRIGADE_CHECK(m->dtype == DType::F32, Errc::InvalidArgument,
                  "{}: training needs float32 weights; a matrix is {}", what,
                  to_string(m->dtype));
}

/// Position of every row within its sequence (offsets already validated).
std::vector<std::int32_t> positions(std::span<const std::int64_t> offsets) {
  std::vector<std::int32_t> pos(usize(offsets.back()));
  for (std::size_t s = 0; s + 1 < offsets.size(); ++s)
    for (std::int64_t t = offsets[s]; t < offsets[s + 1]; ++t)
      pos[usize(t)] = static_cast<std::int32_t>(t - offsets[s]);
  return pos;
}

/// RoPE's per-pair inverse frequencies, cpu::rope's float formula.
std::vector<float> rope_freqs(int head_size, float theta) {
  const int half = head_size / 2;
  std::vector<float> f(usize(half));
  for (int j = 0; j < half; ++j) {
    f[usize(j)] =
        1.0f / std::pow(theta, static_cast<float>(2 * j) / static_cast<float>(head_size));
  }
  return f;
}

/// Rotates every adjacent pair of `row` (heads of head_size) by the angle whose (cos, sin) are
/// cs[2j], cs[2j+1] for pair j of the head, with sin's sign flipped when `inverse`.
void rotate_row(float* row, std::int64_t width, int head_size, const std::vector<float>& cs,
                bool inverse) {
  for (std::int64_t i = 0; i < width; i += 2) {
    const std::size_t j = usize(i % head_size);
    const float c = cs[j], s = inverse ? -cs[j + 1] : cs[j + 1];
    const float v0 = row[i], v1 = row[i + 1];
    row[i] = v0 * c - v1 * s;
    row[i + 1] = v0 * s + v1 * c;
  }
}

/// Shared body of rope_varlen and rope_backward.
void rope_apply(float* q, float* k, const std::int32_t* pos, std::int64_t tokens, int n_heads,
                int n_kv_heads, int head_size, float theta, bool inverse) {
  const std::int64_t dim = static_cast<std::int64_t>(n_heads) * head_size;
  const std::int64_t kv_dim = static_cast<std::int64_t>(n_kv_heads) * head_size;
  const std::vector<float> f = rope_freqs(head_size, theta);
  std::vector<float> cs(usize(head_size));
  for (std::int64_t t = 0; t < tokens; ++t) {
    const float p = static_cast<float>(pos[t]);
    for (std::size_t j = 0; j < f.size(); ++j) {
      const float val = p * f[j];
      cs[2 * j] = std::cos(val);
      cs[2 * j + 1] = std::sin(val);
    }
    rotate_row(q + t * dim, dim, head_size, cs, inverse);
    rotate_row(k + t * kv_dim, kv_dim, head_size, cs, inverse);
  }
}

/// Checks that every gradient tensor has its DecoderWeights shape.
void check_grads(const char* what, const model::LlamaConfig& config, DecoderGrads& grads) {
  const std::int64_t dim = config.dim, kv_dim = config.kv_dim(), hidden = config.hidden_dim;
  const std::int64_t expected[] = {dim,          dim * dim, kv_dim * dim, kv_dim * dim,
                                   dim * dim,    dim,       hidden * dim, dim * hidden,
                                   hidden * dim};
  const char* names[] = {"rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3"};
  const std::vector<std::vector<float>*> g = grads.tensors();
  for (std::size_t i = 0; i < g.size(); ++i) {
    BRIGADE_CHECK(g[i]->size() == usize(expected[i]), Errc::InvalidArgument,
                  "{}: grads.{} has {} floats; expected {} (call "
                  "DecoderGrads::zero(config))",
                  what, names[i], g[i]->size(), expected[i]);
  }
}

}  // namespace

void validate_offsets(const char* what, std::span<const std::int64_t> offsets,
                      std::int64_t tokens, std::int64_t max_len) {
  BRIGADE_CHECK(offsets.size() >= 2, Errc::InvalidArgument,
                "{}: offsets has {} entries; expected n_seq + 1 >= 2", what, offsets.size());
  BRIGADE_CHECK(offsets[0] == 0, Errc::InvalidArgument, "{}: offsets[0] = {}; expected 0", what,
                offsets[0]);
  for (std::size_t s = 1; s < offsets.size(); ++s) {
    BRIGADE_CHECK(offsets[s] > offsets[s - 1], Errc::InvalidArgument,
                  "{}: offsets[{}] = {} after offsets[{}] = {}; expected strictly increasing "
                  "offsets (no empty sequence)",
                  what, s, offsets[s], s - 1, offsets[s - 1]);
    BRIGADE_CHECK(offsets[s] - offsets[s - 1] <= max_len, Errc::InvalidArgument,
                  "{}: sequence {} has {} tokens; expected at most {} (seq_len)", what, s - 1,
                  offsets[s] - offsets[s - 1], max_len);
  }
  BRIGADE_CHECK(offsets.back() == tokens, Errc::InvalidArgument,
                "{}: offsets end at {}; expected tokens = {}", what, offsets.back(), tokens);
}

// ---- per-kernel backward ------------------------------------------------------------------------

void embedding_backward(const float* dy, const std::int32_t* ids, float* dtable,
                        std::int64_t tokens, std::int64_t dim, std::int64_t vocab) {
  BRIGADE_CHECK(tokens >= 0 && dim > 0, Errc::InvalidArgument,
                "embedding_backward: tokens = {}, dim = {}; expected tokens >= 0, dim > 0", tokens,
                dim);
  for (std::int64_t t = 0; t < tokens; ++t) {
    BRIGADE_CHECK(ids[t] >= 0 && ids[t] < vocab, Errc::InvalidArgument,
                  "embedding_backward: ids[{}] = {}; expected in [0, vocab = {})", t, ids[t],
                  vocab);
  }
  for (std::int64_t t = 0; t < tokens; ++t) {
    MapArr(dtable + static_cast<std::int64_t>(ids[t]) * dim, dim) += ConstMapArr(dy + t * dim, dim);
  }
}

void rmsnorm_train(const float* x, const float* weight, float* out, float* inv_rms,
                   std::int64_t tokens, std::int64_t dim, float eps) {
  BRIGADE_CHECK(tokens >= 0 && dim > 0, Errc::InvalidArgument,
                "rmsnorm_train: tokens = {}, dim = {}; expected tokens >= 0 and dim > 0", tokens,
                dim);
  for (std::int64_t t = 0; t < tokens; ++t) {
    const float* xr = x + t * dim;
    float* o = out + t * dim;
    float ss = 0.0f;  // cpu::rmsnorm's float accumulation, in the same order
    for (std::int64_t j = 0; j < dim; ++j) ss += xr[j] * xr[j];
    ss /= static_cast<float>(dim);
    ss += eps;
    ss = 1.0f / std::sqrt(ss);
    inv_rms[t] = ss;
    for (std::int64_t j = 0; j < dim; ++j) o[j] = weight[j] * (ss * xr[j]);
  }
}

void rmsnorm_backward(const float* x, const float* weight, const float* inv_rms, const float* dy,
                      float* dx, float* dweight, std::int64_t tokens, std::int64_t dim,
                      Store store) {
  BRIGADE_CHECK(tokens >= 0 && dim > 0, Errc::InvalidArgument,
                "rmsnorm_backward: tokens = {}, dim = {}; expected tokens >= 0 and dim > 0",
                tokens, dim);
  const ConstMapArr w(weight, dim);
  for (std::int64_t t = 0; t < tokens; ++t) {
    const ConstMapArr xr(x + t * dim, dim), g(dy + t * dim, dim);
    const float r = inv_rms[t];
    if (dweight != nullptr) MapArr(dweight, dim) += g * xr * r;
    // d/dx of w * r * x: r * w * dy - x * r^3 * mean(w * dy * x).
    const float c = r * r * r * dot3_fixed(weight, dy + t * dim, x + t * dim, dim) /
                    static_cast<float>(dim);
    // The reduction above is complete before dx is written, so dx may alias x or dy.
    MapArr d(dx + t * dim, dim);
    if (store == Store::Overwrite) {
      d = r * (w * g) - c * xr;
    } else {
      d += r * (w * g) - c * xr;
    }
  }
}

void matmul_wt_backward_input(const float* dy, const float* w, float* dx, std::int64_t tokens,
                              std::int64_t in, std::int64_t out_dim, Store store) {
  check_gemm_shape("matmul_wt_backward_input", tokens, in, out_dim);
  if (tokens == 0 || in == 0) return;
  MapMat d(dx, tokens, in);
  if (out_dim == 0) {
    if (store == Store::Overwrite) d.setZero();
    return;
  }
  // Fixed chunks of dx's columns (W's columns), one single-threaded product each: the same
  // products at any thread count (intra_op.hpp).
  const int threads = detail::intra_op_threads(2.0 * double(tokens) * double(in) * double(out_dim));
  const std::int64_t chunk = detail::gemm_chunk(in);
  const bool blas = gemm_backend() == GemmBackend::Blas;
  detail::parallel_chunks(in, chunk, threads, [&](std::int64_t i0, std::int64_t i1) {
    if (blas) {  // dx[:, i0:i1] (+)= dy W[:, i0:i1]: the forward's SGEMM, as matmul_wt uses it
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<blasint>(tokens),
                  static_cast<blasint>(i1 - i0), static_cast<blasint>(out_dim), 1.0f, dy,
                  static_cast<blasint>(out_dim), w + i0, static_cast<blasint>(in),
                  store == Store::Overwrite ? 0.0f : 1.0f, dx + i0, static_cast<blasint>(in));
      return;
    }
    const ConstMapMat g(dy, tokens, out_dim);
    const ConstStridedMat wm(w + i0, out_dim, i1 - i0, Eigen::OuterStride<>(in));
    auto dp = d.middleCols(i0, i1 - i0);
    if (store == Store::Overwrite) {
      dp.noalias() = g * wm;
    } else {
      dp.noalias() += g * wm;
    }
  });
}

void matmul_wt_backward_weight(const float* dy, const float* x, float* dw, std::int64_t tokens,
                               std::int64_t in, std::int64_t out_dim) {
  check_gemm_shape("matmul_wt_backward_weight", tokens, in, out_dim);
  if (tokens == 0 || in == 0 || out_dim == 0) return;
  // Fixed chunks of dW's rows (dy's columns), as above.
  const int threads = detail::intra_op_threads(2.0 * double(tokens) * double(in) * double(out_dim));
  const std::int64_t chunk = detail::gemm_chunk(out_dim);
  const bool blas = gemm_backend() == GemmBackend::Blas;
  detail::parallel_chunks(out_dim, chunk, threads, [&](std::int64_t n0, std::int64_t n1) {
    if (blas) {  // dW[n0:n1, :] += dy[:, n0:n1]^T x
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<blasint>(n1 - n0),
                  static_cast<blasint>(in), static_cast<blasint>(tokens), 1.0f, dy + n0,
                  static_cast<blasint>(out_dim), x, static_cast<blasint>(in), 1.0f, dw + n0 * in,
                  static_cast<blasint>(in));
      return;
    }
    const ConstStridedMat g(dy + n0, tokens, n1 - n0, Eigen::OuterStride<>(out_dim));
    MapMat(dw + n0 * in, n1 - n0, in).noalias() += g.transpose() * ConstMapMat(x, tokens, in);
  });
}

void rope_varlen(float* q, float* k, std::span<const std::int64_t> offsets, int n_heads,
                 int n_kv_heads, int head_size, float theta) {
  check_heads("rope_varlen", n_heads, n_kv_heads, head_size);
  BRIGADE_CHECK(!offsets.empty(), Errc::InvalidArgument,
                "rope_varlen: offsets is empty; expected n_seq + 1 >= 2 entries");
  validate_offsets("rope_varlen", offsets, offsets.back(), offsets.back());
  const std::vector<std::int32_t> pos = positions(offsets);
  rope_apply(q, k, pos.data(), offsets.back(), n_heads, n_kv_heads, head_size, theta, false);
}

void rope_backward(float* dq, float* dk, const std::int32_t* pos, std::int64_t tokens,
                   int n_heads, int n_kv_heads, int head_size, float theta) {
  check_heads("rope_backward", n_heads, n_kv_heads, head_size);
  BRIGADE_CHECK(tokens >= 0, Errc::InvalidArgument, "rope_backward: tokens = {}; expected >= 0",
                tokens);
  rope_apply(dq, dk, pos, tokens, n_heads, n_kv_heads, head_size, theta, true);
}

void attention_varlen_forward(const float* q, const float* k, const float* v, float* out,
                              float* lse, std::span<const std::int64_t> offsets, int n_heads,
                              int n_kv_heads, int head_size) {
  check_heads("attention_varlen_forward", n_heads, n_kv_heads, head_size);
  BRIGADE_CHECK(!offsets.empty(), Errc::InvalidArgument,
                "attention_varlen_forward: offsets is empty; expected n_seq + 1 >= 2 entries");
  validate_offsets("attention_varlen_forward", offsets, offsets.back(), offsets.back());
  const std::int64_t hs = head_size;
  const std::int64_t dim = static_cast<std::int64_t>(n_heads) * hs;
  const std::int64_t kv_dim = static_cast<std::int64_t>(n_kv_heads) * hs;
  const int kv_mul = n_heads / n_kv_heads;
  const float scale = std::sqrt(static_cast<float>(head_size));  // as cpu::attention
  std::int64_t longest = 0;
  for (std::size_t s = 0; s + 1 < offsets.size(); ++s)
    longest = std::max(longest, offsets[s + 1] - offsets[s]);
  const std::int64_t block = std::min(kAttnBlock, longest) * longest;
  // Parts over KV heads (each with the query heads that share it): the bits do not depend on
  // the thread count.
  const int threads = std::min(n_kv_heads, detail::intra_op_threads(attention_flops(offsets, dim)));
  std::vector<float> all_scores(usize(block * threads));

  detail::parallel_parts(threads, [&](int part) {
  std::int64_t g0 = 0, g1 = 0;
  detail::part_range(n_kv_heads, threads, part, 1, g0, g1);
  float* const scores = all_scores.data() + block * part;
  for (std::size_t s = 0; s + 1 < offsets.size(); ++s) {
    const std::int64_t o = offsets[s], len = offsets[s + 1] - offsets[s];
    for (int h = static_cast<int>(g0) * kv_mul; h < g1 * kv_mul; ++h) {
      const std::int64_t kv_off = static_cast<std::int64_t>(h / kv_mul) * hs;
      for (std::int64_t r0 = 0; r0 < len; r0 += kAttnBlock) {
        const std::int64_t rows = std::min(kAttnBlock, len - r0);
        const std::int64_t keys = r0 + rows;  // the block's last row sees keys 0..keys-1
        const ConstStridedMat qb(q + (o + r0) * dim + h * hs, rows, hs,
                                 Eigen::OuterStride<>(dim));
        const ConstStridedMat kb(k + o * kv_dim + kv_off, keys, hs, Eigen::OuterStride<>(kv_dim));
        const ConstStridedMat vb(v + o * kv_dim + kv_off, keys, hs, Eigen::OuterStride<>(kv_dim));
        MapMat sm(scores, rows, keys);
        sm.noalias() = qb * kb.transpose();
        for (std::int64_t i = 0; i < rows; ++i) {
          const std::int64_t visible = r0 + i + 1;
          MapArr row(scores + i * keys, visible);
          row /= scale;
          const float mx = row.maxCoeff();
          const float sum = exp_affine_fixed(row.data(), row.data(), visible, 1.0f, mx);
          row /= sum;
          if (lse != nullptr) lse[(o + r0 + i) * n_heads + h] = mx + std::log(sum);
          std::fill(scores + i * keys + visible, scores + (i + 1) * keys, 0.0f);
        }
        StridedMat(out + (o + r0) * dim + h * hs, rows, hs, Eigen::OuterStride<>(dim))
            .noalias() = sm * vb;
      }
    }
  }
  });
}

void attention_varlen_backward(const float* q, const float* k, const float* v, const float* out,
                               const float* lse, const float* dout, float* dq, float* dk,
                               float* dv, std::span<const std::int64_t> offsets, int n_heads,
                               int n_kv_heads, int head_size) {
  check_heads("attention_varlen_backward", n_heads, n_kv_heads, head_size);
  BRIGADE_CHECK(!offsets.empty(), Errc::InvalidArgument,
                "attention_varlen_backward: offsets is empty; expected n_seq + 1 >= 2 entries");
  validate_offsets("attention_varlen_backward", offsets, offsets.back(), offsets.back());
  const std::int64_t tokens = offsets.back();
  const std::int64_t hs = head_size;
  const std::int64_t dim = static_cast<std::int64_t>(n_heads) * hs;
  const std::int64_t kv_dim = static_cast<std::int64_t>(n_kv_heads) * hs;
  const int kv_mul = n_heads / n_kv_heads;
  const float scale = std::sqrt(static_cast<float>(head_size));
  std::int64_t longest = 0;
  for (std::size_t s = 0; s + 1 < offsets.size(); ++s)
    longest = std::max(longest, offsets[s + 1] - offsets[s]);
  const std::int64_t block = std::min(kAttnBlock, longest) * longest;
  const std::int64_t rows_max = std::min(kAttnBlock, longest);
  std::fill(dk, dk + tokens * kv_dim, 0.0f);
  std::fill(dv, dv + tokens * kv_dim, 0.0f);
  // Parts over KV heads, as the forward: dK and dV of a KV head are summed by one part, over
  // sequences and then its query heads in order, whatever the thread count.
  const int threads =
      std::min(n_kv_heads, detail::intra_op_threads(2.0 * attention_flops(offsets, dim)));
  std::vector<float> all_p(usize(block * threads)), all_dp(usize(block * threads)),
      all_dsum(usize(rows_max * threads));

  detail::parallel_parts(threads, [&](int part) {
  std::int64_t g0 = 0, g1 = 0;
  detail::part_range(n_kv_heads, threads, part, 1, g0, g1);
  float* const pdata = all_p.data() + block * part;
  float* const dpdata = all_dp.data() + block * part;
  float* const dsum = all_dsum.data() + rows_max * part;
  for (std::size_t s = 0; s + 1 < offsets.size(); ++s) {
    const std::int64_t o = offsets[s], len = offsets[s + 1] - offsets[s];
    for (int h = static_cast<int>(g0) * kv_mul; h < g1 * kv_mul; ++h) {
      const std::int64_t kv_off = static_cast<std::int64_t>(h / kv_mul) * hs;
      for (std::int64_t r0 = 0; r0 < len; r0 += kAttnBlock) {
        const std::int64_t rows = std::min(kAttnBlock, len - r0);
        const std::int64_t keys = r0 + rows;
        const std::int64_t qoff = (o + r0) * dim + h * hs;
        const ConstStridedMat qb(q + qoff, rows, hs, Eigen::OuterStride<>(dim));
        const ConstStridedMat ob(out + qoff, rows, hs, Eigen::OuterStride<>(dim));
        const ConstStridedMat gob(dout + qoff, rows, hs, Eigen::OuterStride<>(dim));
        const ConstStridedMat kb(k + o * kv_dim + kv_off, keys, hs, Eigen::OuterStride<>(kv_dim));
        const ConstStridedMat vb(v + o * kv_dim + kv_off, keys, hs, Eigen::OuterStride<>(kv_dim));
        StridedMat dkb(dk + o * kv_dim + kv_off, keys, hs, Eigen::OuterStride<>(kv_dim));
        StridedMat dvb(dv + o * kv_dim + kv_off, keys, hs, Eigen::OuterStride<>(kv_dim));
        StridedMat dqb(dq + qoff, rows, hs, Eigen::OuterStride<>(dim));

        // P = exp(S / sqrt(hs) - lse), zero above the causal diagonal.
        MapMat pm(pdata, rows, keys);
        pm.noalias() = qb * kb.transpose();
        for (std::int64_t i = 0; i < rows; ++i) {
          const std::int64_t visible = r0 + i + 1;
          MapArr row(pdata + i * keys, visible);
          const float l = lse[(o + r0 + i) * n_heads + h];
          exp_affine_fixed(row.data(), row.data(), visible, scale, l);
          std::fill(pdata + i * keys + visible, pdata + (i + 1) * keys, 0.0f);
          dsum[i] = dot_fixed(gob.data() + i * dim, ob.data() + i * dim, hs);  // dO_i . O_i
        }
        dvb.noalias() += pm.transpose() * gob;
        MapMat dsm(dpdata, rows, keys);
        dsm.noalias() = gob * vb.transpose();  // dP
        // dS = P * (dP - D) / sqrt(hs): the softmax Jacobian and the score scale in one pass.
        for (std::int64_t i = 0; i < rows; ++i) {
          dsm.row(i).array() =
              pm.row(i).array() * (dsm.row(i).array() - dsum[i]) / scale;
        }
        dqb.noalias() = dsm * kb;
        dkb.noalias() += dsm.transpose() * qb;
      }
    }
  }
  });
}

void swiglu_backward(const float* gate, const float* up, const float* dh, float* dgate,
                     float* dup, std::int64_t n, float* h) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float g = gate[i], u = up[i], d = dh[i];
    const float sig = 1.0f / (1.0f + detail::exp_f32(-g));  // cpu::swiglu's e^x
    const float silu = g * sig;
    dup[i] = d * silu;
    dgate[i] = d * u * sig * (1.0f + g * (1.0f - sig));
    if (h != nullptr) h[i] = silu * u;  // cpu::swiglu: (g * (1 / (1 + e^-g))) * u
  }
}

namespace {

/// A cross-entropy's counted targets (checked: -1 or an id in [0, vocab)) and the gradient's
/// 1 / denominator (grad_denominator when > 0, else the counted targets).
std::pair<std::int64_t, float> count_targets(const char* what, const std::int32_t* targets,
                                             std::int64_t tokens, std::int64_t vocab,
                                             double grad_denominator) {
  BRIGADE_CHECK(grad_denominator >= 0.0, Errc::InvalidArgument,
                "{}: grad_denominator = {}; expected >= 0 (0 = mean over targets)", what,
                grad_denominator);
  std::int64_t count = 0;
  for (std::int64_t t = 0; t < tokens; ++t) {
    BRIGADE_CHECK(targets[t] == -1 || (targets[t] >= 0 && targets[t] < vocab),
                  Errc::InvalidArgument,
                  "{}: targets[{}] = {}; expected -1 (ignore) or an id in [0, {})", what, t,
                  targets[t], vocab);
    if (targets[t] != -1) ++count;
  }
  const double denom = grad_denominator > 0.0
                           ? grad_denominator
                           : static_cast<double>(std::max<std::int64_t>(count, 1));
  return {count, static_cast<float>(1.0 / denom)};
}

}  // namespace

CrossEntropyLoss cross_entropy(const float* logits, const std::int32_t* targets,
                               std::int64_t tokens, std::int64_t vocab, float* dlogits,
                               double grad_denominator, double* row_loss) {
  BRIGADE_CHECK(tokens >= 0 && vocab > 0, Errc::InvalidArgument,
                "cross_entropy: tokens = {}, vocab = {}; expected tokens >= 0 and vocab > 0",
                tokens, vocab);
  CrossEntropyLoss loss;
  const auto [count, inv_denom] =
      count_targets("cross_entropy", targets, tokens, vocab, grad_denominator);
  loss.count = count;
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::int32_t y = targets[t];
    if (y == -1) {
      if (dlogits != nullptr) std::fill(dlogits + t * vocab, dlogits + (t + 1) * vocab, 0.0f);
      if (row_loss != nullptr) row_loss[t] = 0.0;
      continue;
    }
    const ConstMapArr row(logits + t * vocab, vocab);
    const float target_logit = row[y];  // read before dlogits (which may alias) is written
    const float mx = row.maxCoeff();
    float sum = 0.0f;
    if (dlogits != nullptr) {
      MapArr d(dlogits + t * vocab, vocab);
      sum = exp_affine_fixed(logits + t * vocab, dlogits + t * vocab, vocab, 1.0f, mx);
      d *= inv_denom / sum;
      d[y] -= inv_denom;
    } else {
      sum = exp_affine_fixed(logits + t * vocab, nullptr, vocab, 1.0f, mx);
    }
    const double l = static_cast<double>(mx) + std::log(static_cast<double>(sum)) -
                     static_cast<double>(target_logit);
    if (row_loss != nullptr) row_loss[t] = l;
    loss.sum += l;
  }
  return loss;
}

CrossEntropyLoss vocab_parallel_cross_entropy(const float* logits, const std::int32_t* targets,
                                              std::int64_t tokens, std::int64_t vocab_size,
                                              const backend::VocabSplit& split, float* dlogits,
                                              double grad_denominator, double* row_loss) {
  const std::int64_t v = split.vocab, v0 = split.vocab0;
  BRIGADE_CHECK(tokens >= 0 && v > 0 && v0 >= 0 && v0 + v <= vocab_size && split.all_reduce &&
                    split.all_reduce_max,
                Errc::InvalidArgument,
                "vocab_parallel_cross_entropy: tokens = {}, a shard of rows [{}, {}) of a "
                "vocabulary of {}; expected tokens >= 0, a non-empty shard inside it and both "
                "all-reduces",
                tokens, v0, v0 + v, vocab_size);
  CrossEntropyLoss loss;
  const auto [count, inv_denom] = count_targets("vocab_parallel_cross_entropy", targets, tokens,
                                                vocab_size, grad_denominator);
  loss.count = count;
  const auto in_shard = [&](std::int32_t y) { return y >= v0 && y < v0 + v; };
  // 1. The row maxima over the whole vocabulary: each shard's, then the group's maximum.
  std::vector<float> mx(usize(tokens));
  for (std::int64_t t = 0; t < tokens; ++t) mx[usize(t)] = ConstMapArr(logits + t * v, v).maxCoeff();
  split.all_reduce_max(mx.data(), tokens);
  // 2. Each shard's sum of exp(logit - max) and its target logit (0 when the target lies in
  //    another shard), then the group's sums: [sums | target logits], one all-reduce.
  std::vector<float> red(usize(2 * tokens), 0.0f);
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::int32_t y = targets[t];
    if (y != -1 && in_shard(y)) red[usize(tokens + t)] = logits[t * v + (y - v0)];
    red[usize(t)] = exp_affine_fixed(logits + t * v, dlogits == nullptr ? nullptr : dlogits + t * v,
                                     v, 1.0f, mx[usize(t)]);
  }
  split.all_reduce(red.data(), 2 * tokens);
  // 3. Loss log(sum) + max - target logit; dlogits = (softmax - onehot) / denominator on the
  //    shard's columns.
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::int32_t y = targets[t];
    if (y == -1) {
      if (dlogits != nullptr) std::fill(dlogits + t * v, dlogits + (t + 1) * v, 0.0f);
      if (row_loss != nullptr) row_loss[t] = 0.0;
      continue;
    }
    const float sum = red[usize(t)];
    if (dlogits != nullptr) {
      MapArr(dlogits + t * v, v) *= inv_denom / sum;
      if (in_shard(y)) dlogits[t * v + (y - v0)] -= inv_denom;
    }
    const double l = static_cast<double>(mx[usize(t)]) + std::log(static_cast<double>(sum)) -
                     static_cast<double>(red[usize(tokens + t)]);
    if (row_loss != nullptr) row_loss[t] = l;
    loss.sum += l;
  }
  return loss;
}

// ---- the LM head ------------------------------------------------------------------------------

void head_forward(const model::LlamaConfig& config, const float* rms_final, const float* wcls,
                  const float* x, std::int64_t tokens, float* logits) {
  config.validate("head_forward");
  BRIGADE_CHECK(tokens >= 0, Errc::InvalidArgument, "head_forward: tokens = {}; expected >= 0",
                tokens);
  if (tokens == 0) return;
  BRIGADE_CHECK(rms_final && wcls && x && logits, Errc::InvalidArgument,
                "head_forward: a null pointer among rms_final, wcls, x, logits");
  const std::int64_t dim = config.dim;
  std::vector<float> xn(usize(tokens * dim));
  cpu::rmsnorm(x, rms_final, xn.data(), tokens, dim, config.norm_eps);
  cpu::matmul_wt(xn.data(), wcls, logits, tokens, dim, config.vocab_size);
}

CrossEntropyLoss head_forward_backward_input(const model::LlamaConfig& config,
                                             const float* rms_final, const float* wcls,
                                             const float* x, const std::int32_t* targets,
                                             std::int64_t tokens, float* dx,
                                             HeadActivations& acts, double grad_denominator,
                                             double* row_loss, const backend::VocabSplit* split) {
  config.validate("head_forward_backward_input");
  BRIGADE_CHECK(tokens >= 1, Errc::InvalidArgument,
                "head_forward_backward_input: tokens = {}; expected >= 1", tokens);
  BRIGADE_CHECK(rms_final && wcls && x && targets && dx, Errc::InvalidArgument,
                "head_forward_backward_input: a null pointer among rms_final, wcls, x, targets, "
                "dx");
  const std::int64_t dim = config.dim;
  const std::int64_t vocab = split != nullptr ? split->vocab : config.vocab_size;
  acts = HeadActivations{};
  acts.tokens = tokens;
  std::vector<float> inv_rms(usize(tokens));
  float* xn = sized(acts.xn, tokens * dim);
  float* dl = sized(acts.dlogits, tokens * vocab);
  rmsnorm_train(x, rms_final, xn, inv_rms.data(), tokens, dim, config.norm_eps);
  cpu::matmul_wt(xn, wcls, dl, tokens, dim, vocab);
  CrossEntropyLoss loss;
  try {
    loss = split != nullptr
               ? vocab_parallel_cross_entropy(dl, targets, tokens, config.vocab_size, *split, dl,
                                              grad_denominator, row_loss)
               : cross_entropy(dl, targets, tokens, vocab, dl, grad_denominator, row_loss);
  } catch (...) {
    acts = HeadActivations{};
    throw;
  }
  std::vector<float> dxn(usize(tokens * dim));
  matmul_wt_backward_input(dl, wcls, dxn.data(), tokens, dim, vocab);
  // The classifier is column-parallel over the vocabulary: each shard's input gradient is a
  // partial sum (Megatron's f operator in the backward).
  if (split != nullptr) split->all_reduce(dxn.data(), tokens * dim);
  rmsnorm_backward(x, rms_final, inv_rms.data(), dxn.data(), dx, sized(acts.d_rms, dim, true),
                   tokens, dim);
  return loss;
}

void head_backward_weight(const model::LlamaConfig& config, HeadActivations& acts,
                          float* d_rms_final, float* d_wcls, const backend::VocabSplit* split) {
  const std::int64_t dim = config.dim;
  const std::int64_t vocab = split != nullptr ? split->vocab : config.vocab_size;
  BRIGADE_CHECK(acts.tokens >= 1 && acts.xn.size() == usize(acts.tokens * dim) &&
                    acts.dlogits.size() == usize(acts.tokens * vocab) &&
                    acts.d_rms.size() == usize(dim),
                Errc::InvalidUsage,
                "head_backward_weight: acts holds no head_forward_backward_input stash for this "
                "config (tokens = {}, xn {} floats, dlogits {} floats)",
                acts.tokens, acts.xn.size(), acts.dlogits.size());
  BRIGADE_CHECK(d_rms_final && d_wcls, Errc::InvalidArgument,
                "head_backward_weight: d_rms_final or d_wcls is null");
  matmul_wt_backward_weight(acts.dlogits.data(), acts.xn.data(), d_wcls, acts.tokens, dim, vocab);
  MapArr(d_rms_final, dim) += ConstMapArr(acts.d_rms.data(), dim);
  acts = HeadActivations{};
}

// ---- the training decoder layer ---------------------------------------------------------------

void DecoderGrads::zero(const model::LlamaConfig& config) {
  config.validate("DecoderGrads::zero");
  const std::int64_t dim = config.dim, kv = config.kv_dim(), hidden = config.hidden_dim;
  sized(rms_att, dim, true);
  sized(wq, dim * dim, true);
  sized(wk, kv * dim, true);
  sized(wv, kv * dim, true);
  sized(wo, dim * dim, true);
  sized(rms_ffn, dim, true);
  sized(w1, hidden * dim, true);
  sized(w2, dim * hidden, true);
  sized(w3, hidden * dim, true);
}

std::vector<std::vector<float>*> DecoderGrads::tensors() {
  return {&rms_att, &wq, &wk, &wv, &wo, &rms_ffn, &w1, &w2, &w3};
}

std::vector<const std::vector<float>*> DecoderGrads::tensors() const {
  return {&rms_att, &wq, &wk, &wv, &wo, &rms_ffn, &w1, &w2, &w3};
}

std::size_t DecoderActivations::bytes() const noexcept {
  std::size_t floats = 0;
  for (const std::vector<float>* vec :
       {&x_in, &inv_rms_att, &xb_att, &q, &k, &v, &lse, &att, &x_mid, &inv_rms_ffn, &xb_ffn, &h1,
        &h3, &d_mid, &dy, &hb, &d_rms_att, &d_rms_ffn})
    floats += vec->capacity();
  return floats * sizeof(float) + pos.capacity() * sizeof(std::int32_t) +
         offsets.capacity() * sizeof(std::int64_t);
}

void DecoderActivations::clear() noexcept {
  phase = Phase::Empty;
  tokens = 0;
  release(offsets);
  release(pos);
  for (std::vector<float>* vec :
       {&x_in, &inv_rms_att, &xb_att, &q, &k, &v, &lse, &att, &x_mid, &inv_rms_ffn, &xb_ffn, &h1,
        &h3, &d_mid, &dy, &hb, &d_rms_att, &d_rms_ffn})
    release(*vec);
}

namespace {

/// The widths of one rank's share of a decoder layer: the whole layer, or a TP split's.
struct LayerWidths {
  int n_heads, n_kv_heads;
  std::int64_t q_dim, kv_dim, hidden;
};

LayerWidths widths_of(const model::LlamaConfig& config, const backend::DecoderSplit* split) {
  const int hs = config.head_size();
  LayerWidths w{split ? split->n_heads : config.n_heads,
                split ? split->n_kv_heads : config.n_kv_heads, 0, 0,
                split ? split->hidden : config.hidden_dim};
  w.q_dim = std::int64_t{w.n_heads} * hs;
  w.kv_dim = std::int64_t{w.n_kv_heads} * hs;
  return w;
}

void check_split(const char* what, const model::LlamaConfig& config,
                 const backend::DecoderSplit* split) {
  if (split == nullptr) return;
  BRIGADE_CHECK(split->n_heads >= 1 && split->n_kv_heads >= 1 && split->hidden >= 1 &&
                    split->n_heads <= config.n_heads && split->n_kv_heads <= config.n_kv_heads &&
                    split->hidden <= config.hidden_dim && split->n_heads % split->n_kv_heads == 0 &&
                    split->all_reduce,
                Errc::InvalidArgument,
                "{}: a TP split of {} query heads, {} KV heads and {} MLP rows does not fit a "
                "layer of {}, {} and {} (or has no all-reduce)",
                what, split->n_heads, split->n_kv_heads, split->hidden, config.n_heads,
                config.n_kv_heads, config.hidden_dim);
}

/// A row-parallel product added to the residual stream `res` ([tokens x dim]) into `out`:
/// out = res + in W^T, or with a split the group's sum of (res +) in W_r^T (the residual on the
/// rank that adds it), Megatron's g operator.
void row_parallel(const float* in, const float* w, const float* res, float* out,
                  std::int64_t tokens, std::int64_t in_dim, std::int64_t dim,
                  const backend::DecoderSplit* split) {
  const std::int64_t n = tokens * dim;
  if (split == nullptr || split->adds_residual)
    std::copy(res, res + n, out);
  else
    std::fill(out, out + n, 0.0f);
  cpu::matmul_wt_accumulate(in, w, out, tokens, in_dim, dim);
  if (split != nullptr) split->all_reduce(out, n);
}

}  // namespace

void decoder_train_forward(const model::LlamaConfig& config, const model::DecoderWeights& w,
                           const float* x_in, float* x_out, std::int64_t tokens,
                           std::span<const std::int64_t> offsets, DecoderActivations& acts,
                           DecoderTrainScratch* scratch, const backend::DecoderSplit* split) {
  config.validate("decoder_train_forward");
  check_weights("decoder_train_forward", w);
  check_split("decoder_train_forward", config, split);
  BRIGADE_CHECK(tokens >= 1, Errc::InvalidArgument,
                "decoder_train_forward: tokens = {}; expected >= 1", tokens);
  BRIGADE_CHECK(x_in != nullptr && x_out != nullptr, Errc::InvalidArgument,
                "decoder_train_forward: x_in or x_out is null");
  validate_offsets("decoder_train_forward", offsets, tokens, config.seq_len);
  DecoderTrainScratch local;
  DecoderTrainScratch& sc = scratch != nullptr ? *scratch : local;

  const std::int64_t dim = config.dim;
  const LayerWidths lw = widths_of(config, split);
  const std::int64_t q_dim = lw.q_dim, kv_dim = lw.kv_dim, hidden = lw.hidden;
  const int hs = config.head_size();
  acts.clear();
  acts.tokens = tokens;
  acts.offsets.assign(offsets.begin(), offsets.end());
  acts.pos = positions(offsets);
  acts.x_in.assign(x_in, x_in + tokens * dim);  // before x_out (which may alias) is written

  // Attention block (with a split: this rank's heads, then the group's sum after Wo).
  float* xb = sized(acts.xb_att, tokens * dim);
  rmsnorm_train(acts.x_in.data(), w.rms_att, xb, sized(acts.inv_rms_att, tokens), tokens, dim,
                config.norm_eps);
  float* q = sized(acts.q, tokens * q_dim);
  float* k = sized(acts.k, tokens * kv_dim);
  float* v = sized(acts.v, tokens * kv_dim);
  cpu::matmul_wt(xb, w.wq, q, tokens, dim, q_dim);
  cpu::matmul_wt(xb, w.wk, k, tokens, dim, kv_dim);
  cpu::matmul_wt(xb, w.wv, v, tokens, dim, kv_dim);
  rope_apply(q, k, acts.pos.data(), tokens, lw.n_heads, lw.n_kv_heads, hs, config.rope_theta,
             false);
  float* att = sized(acts.att, tokens * q_dim);
  attention_varlen_forward(q, k, v, att, sized(acts.lse, tokens * lw.n_heads), offsets,
                           lw.n_heads, lw.n_kv_heads, hs);
  row_parallel(att, w.wo.f32(), acts.x_in.data(), sized(acts.x_mid, tokens * dim), tokens, q_dim,
               dim, split);

  // FFN block (with a split: this rank's MLP rows, then the group's sum after W2).
  float* xf = sized(acts.xb_ffn, tokens * dim);
  rmsnorm_train(acts.x_mid.data(), w.rms_ffn, xf, sized(acts.inv_rms_ffn, tokens), tokens, dim,
                config.norm_eps);
  float* h1 = sized(acts.h1, tokens * hidden);
  float* h3 = sized(acts.h3, tokens * hidden);
  cpu::matmul_wt(xf, w.w1, h1, tokens, dim, hidden);
  cpu::matmul_wt(xf, w.w3, h3, tokens, dim, hidden);
  float* hb = grow(sc.a, tokens * hidden);
  std::copy(h1, h1 + tokens * hidden, hb);
  cpu::swiglu(hb, h3, tokens * hidden);
  row_parallel(hb, w.w2.f32(), acts.x_mid.data(), x_out, tokens, hidden, dim, split);
  acts.phase = DecoderActivations::Phase::Forward;
}

void decoder_backward_input(const model::LlamaConfig& config, const model::DecoderWeights& w,
                            DecoderActivations& acts, const float* dy, float* dx,
                            DecoderTrainScratch* scratch, const backend::DecoderSplit* split) {
  config.validate("decoder_backward_input");
  check_weights("decoder_backward_input", w);
  check_split("decoder_backward_input", config, split);
  BRIGADE_CHECK(acts.phase == DecoderActivations::Phase::Forward, Errc::InvalidUsage,
                "decoder_backward_input: activations are in phase {}; expected {} (Forward: run "
                "decoder_train_forward first)",
                static_cast<int>(acts.phase), static_cast<int>(DecoderActivations::Phase::Forward));
  BRIGADE_CHECK(dy != nullptr && dx != nullptr, Errc::InvalidArgument,
                "decoder_backward_input: dy or dx is null");
  const std::int64_t tokens = acts.tokens;
  const std::int64_t dim = config.dim;
  const LayerWidths lw = widths_of(config, split);
  const std::int64_t q_dim = lw.q_dim, kv_dim = lw.kv_dim, hidden = lw.hidden;
  const int hs = config.head_size();
  BRIGADE_CHECK(acts.x_in.size() == usize(tokens * dim) && acts.h1.size() == usize(tokens * hidden) &&
                    acts.q.size() == usize(tokens * q_dim),
                Errc::InvalidArgument,
                "decoder_backward_input: activations of {} tokens do not match this config "
                "(dim = {}, {} MLP rows, {} query heads)",
                tokens, dim, hidden, lw.n_heads);
  DecoderTrainScratch local;
  DecoderTrainScratch& sc = scratch != nullptr ? *scratch : local;
  acts.dy.assign(dy, dy + tokens * dim);  // before dx (which may alias) is written
  // The input gradient of a column-parallel block is a partial sum on each rank; the group's
  // sum (Megatron's f operator in the backward) is the whole gradient, which then flows into the
  // replicated RMSNorm's backward.
  const auto f_backward = [&](float* g) {
    if (split != nullptr) split->all_reduce(g, tokens * dim);
  };

  // FFN block: x_out = x_mid + hb W2^T, hb = silu(h1) * h3, h1/h3 = xb_ffn W1^T / W3^T.
  float* dhb = grow(sc.a, tokens * hidden);
  matmul_wt_backward_input(acts.dy.data(), w.w2.f32(), dhb, tokens, hidden, dim);
  float* hb = sized(acts.hb, tokens * hidden);
  swiglu_backward(acts.h1.data(), acts.h3.data(), dhb, acts.h1.data(), acts.h3.data(),
                  tokens * hidden, hb);  // h1, h3 now hold dh1, dh3
  float* dxb = grow(sc.b, tokens * dim);
  matmul_wt_backward_input(acts.h1.data(), w.w1.f32(), dxb, tokens, dim, hidden);
  matmul_wt_backward_input(acts.h3.data(), w.w3.f32(), dxb, tokens, dim, hidden, Store::Accumulate);
  f_backward(dxb);
  acts.d_mid = acts.dy;
  rmsnorm_backward(acts.x_mid.data(), w.rms_ffn, acts.inv_rms_ffn.data(), dxb, acts.d_mid.data(),
                   sized(acts.d_rms_ffn, dim, true), tokens, dim, Store::Accumulate);
  release(acts.x_mid);
  release(acts.inv_rms_ffn);

  // Attention block: x_mid = x_in + att Wo^T.
  float* datt = grow(sc.a, tokens * q_dim);
  matmul_wt_backward_input(acts.d_mid.data(), w.wo.f32(), datt, tokens, q_dim, dim);
  std::vector<float> dq(usize(tokens * q_dim)), dk(usize(tokens * kv_dim)),
      dv(usize(tokens * kv_dim));
  attention_varlen_backward(acts.q.data(), acts.k.data(), acts.v.data(), acts.att.data(),
                            acts.lse.data(), datt, dq.data(), dk.data(), dv.data(), acts.offsets,
                            lw.n_heads, lw.n_kv_heads, hs);
  rope_apply(dq.data(), dk.data(), acts.pos.data(), tokens, lw.n_heads, lw.n_kv_heads, hs,
             config.rope_theta, true);
  acts.q = std::move(dq);
  acts.k = std::move(dk);
  acts.v = std::move(dv);
  release(acts.lse);
  matmul_wt_backward_input(acts.q.data(), w.wq.f32(), dxb, tokens, dim, q_dim);
  matmul_wt_backward_input(acts.k.data(), w.wk.f32(), dxb, tokens, dim, kv_dim, Store::Accumulate);
  matmul_wt_backward_input(acts.v.data(), w.wv.f32(), dxb, tokens, dim, kv_dim, Store::Accumulate);
  f_backward(dxb);
  std::copy(acts.d_mid.begin(), acts.d_mid.end(), dx);
  rmsnorm_backward(acts.x_in.data(), w.rms_att, acts.inv_rms_att.data(), dxb, dx,
                   sized(acts.d_rms_att, dim, true), tokens, dim, Store::Accumulate);
  release(acts.x_in);
  release(acts.inv_rms_att);
  acts.phase = DecoderActivations::Phase::BackwardInput;
}

void decoder_backward_weight(const model::LlamaConfig& config, DecoderActivations& acts,
                             DecoderGrads& grads) {
  config.validate("decoder_backward_weight");
  check_grads("decoder_backward_weight", config, grads);
  decoder_backward_weight(config, acts,
                          std::array<float*, 9>{grads.rms_att.data(), grads.wq.data(),
                                                grads.wk.data(), grads.wv.data(), grads.wo.data(),
                                                grads.rms_ffn.data(), grads.w1.data(),
                                                grads.w2.data(), grads.w3.data()});
}

void decoder_backward_weight(const model::LlamaConfig& config, DecoderActivations& acts,
                             const std::array<float*, 9>& g, const backend::DecoderSplit* split) {
  config.validate("decoder_backward_weight");
  check_split("decoder_backward_weight", config, split);
  BRIGADE_CHECK(acts.phase == DecoderActivations::Phase::BackwardInput, Errc::InvalidUsage,
                "decoder_backward_weight: activations are in phase {}; expected {} "
                "(BackwardInput: run decoder_backward_input first)",
                static_cast<int>(acts.phase),
                static_cast<int>(DecoderActivations::Phase::BackwardInput));
  for (std::size_t i = 0; i < g.size(); ++i)
    BRIGADE_CHECK(g[i] != nullptr, Errc::InvalidArgument,
                  "decoder_backward_weight: gradient tensor {} is null", i);
  const std::int64_t tokens = acts.tokens;
  const std::int64_t dim = config.dim;
  const LayerWidths lw = widths_of(config, split);
  const std::int64_t q_dim = lw.q_dim, kv_dim = lw.kv_dim, hidden = lw.hidden;
  BRIGADE_CHECK(acts.xb_att.size() == usize(tokens * dim) &&
                    acts.hb.size() == usize(tokens * hidden) &&
                    acts.att.size() == usize(tokens * q_dim),
                Errc::InvalidArgument,
                "decoder_backward_weight: activations of {} tokens do not match this config "
                "(dim = {}, {} MLP rows, {} query heads)",
                tokens, dim, hidden, lw.n_heads);
  // Every weight gradient of a split layer is local: dY^T X of this rank's slices.
  matmul_wt_backward_weight(acts.q.data(), acts.xb_att.data(), g[1], tokens, dim, q_dim);
  matmul_wt_backward_weight(acts.k.data(), acts.xb_att.data(), g[2], tokens, dim, kv_dim);
  matmul_wt_backward_weight(acts.v.data(), acts.xb_att.data(), g[3], tokens, dim, kv_dim);
  matmul_wt_backward_weight(acts.d_mid.data(), acts.att.data(), g[4], tokens, q_dim, dim);
  matmul_wt_backward_weight(acts.h1.data(), acts.xb_ffn.data(), g[6], tokens, dim, hidden);
  matmul_wt_backward_weight(acts.h3.data(), acts.xb_ffn.data(), g[8], tokens, dim, hidden);
  matmul_wt_backward_weight(acts.dy.data(), acts.hb.data(), g[7], tokens, hidden, dim);
  MapArr(g[0], dim) += ConstMapArr(acts.d_rms_att.data(), dim);
  MapArr(g[5], dim) += ConstMapArr(acts.d_rms_ffn.data(), dim);
  acts.clear();
}

void decoder_backward(const model::LlamaConfig& config, const model::DecoderWeights& w,
                      DecoderActivations& acts, const float* dy, float* dx, DecoderGrads& grads,
                      DecoderTrainScratch* scratch) {
  config.validate("decoder_backward");
  check_grads("decoder_backward", config, grads);  // before BI changes acts
  decoder_backward_input(config, w, acts, dy, dx, scratch);
  decoder_backward_weight(config, acts, grads);
}

}  // namespace v0
}  // namespace brigade::cpu
