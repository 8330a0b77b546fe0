// The arithmetic of CudaBackend's training kernels, one work item per call: each function below
// is the whole body of one GPU thread (kernels.cu launches one thread per item and does nothing
// but compute the item's index), and the same function compiled by plain g++ is what the unit
// tests run on the host against the CPU backend's backward (brigade/backend/cpu_train.hpp). So the
// device code's formulas and indexing are checked on machines without a GPU; only the launch
// grid, the memory and cuBLAS are left to the device check.
//
// Pure C++ (no CUDA header): __host__ __device__ under nvcc, plain inline functions otherwise.
// Layouts are cpu_train.hpp's: row-major [tokens x width], packed sequences each starting at
// position 0; a row's sequence is [seq_begin[t], seq_end[t]) (int32 per row, made on the host
// from the cu_seqlens offsets). Float math follows the CPU kernels' formulas (the reduction
// orders differ, so results agree to rounding, not bit for bit).
#pragma once

#include <math.h>

#include <cstdint>

#if defined(__CUDACC__)
#define BRIGADE_HD __host__ __device__ inline
#else
#define BRIGADE_HD inline
#endif

namespace brigade::cuda::detail {

/// Dot product of n floats (float accumulation, in index order).
BRIGADE_HD float dot_n(const float* a, const float* b, std::int64_t n) {
  float s = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// ---- RMSNorm ----------------------------------------------------------------------------------

/// Item t of rmsnorm_train (cpu::rmsnorm_train's formula): inv_rms[t] = 1 / sqrt(mean(x[t]^2) +
/// eps), out[t, j] = w[j] * (inv_rms[t] * x[t, j]). out may alias x.
BRIGADE_HD void rmsnorm_train_item(const float* x, const float* w, float* out, float* inv_rms,
                                   std::int64_t t, std::int64_t dim, float eps) {
  const float* xr = x + t * dim;
  float* o = out + t * dim;
  float ss = 0.0f;
  for (std::int64_t j = 0; j < dim; ++j) ss += xr[j] * xr[j];
  ss /= static_cast<float>(dim);
  ss += eps;
  ss = 1.0f / sqrtf(ss);
  inv_rms[t] = ss;
  for (std::int64_t j = 0; j < dim; ++j) o[j] = w[j] * (ss * xr[j]);
}

/// Item t of the RMSNorm backward-input (cpu::rmsnorm_backward's dx): with r = inv_rms[t] and
/// c = r^3 mean_j(w_j dy_j x_j), dx[t, j] (=, or += when `accumulate`) r (w_j dy_j) - c x_j.
/// dx may alias x or dy (the row is reduced before it is written).
BRIGADE_HD void rmsnorm_backward_item(const float* x, const float* w, const float* inv_rms,
                                      const float* dy, float* dx, std::int64_t t,
                                      std::int64_t dim, bool accumulate) {
  const float* xr = x + t * dim;
  const float* g = dy + t * dim;
  float* d = dx + t * dim;
  const float r = inv_rms[t];
  float dot = 0.0f;
  for (std::int64_t j = 0; j < dim; ++j) dot += w[j] * g[j] * xr[j];
  const float c = r * r * r * dot / static_cast<float>(dim);
  for (std::int64_t j = 0; j < dim; ++j) {
    const float v = r * (w[j] * g[j]) - c * xr[j];
    d[j] = accumulate ? d[j] + v : v;
  }
}

/// Item j (a column) of the RMSNorm gain gradient: dw[j] += sum_t dy[t, j] x[t, j] inv_rms[t].
/// Run it before a backward-input that overwrites x.
BRIGADE_HD void rmsnorm_dweight_item(const float* x, const float* inv_rms, const float* dy,
                                     float* dw, std::int64_t j, std::int64_t tokens,
                                     std::int64_t dim) {
  float s = 0.0f;
  for (std::int64_t t = 0; t < tokens; ++t) s += dy[t * dim + j] * x[t * dim + j] * inv_rms[t];
  dw[j] += s;
}

// ---- SwiGLU -----------------------------------------------------------------------------------

/// Item i of cpu::swiglu_backward: du = dh silu(g), dg = dh u sig(g) (1 + g (1 - sig(g))), and
/// h = silu(g) u when h is not null. dgate may alias gate, dup up.
BRIGADE_HD void swiglu_backward_item(const float* gate, const float* up, const float* dh,
                                     float* dgate, float* dup, float* h, std::int64_t i) {
  const float g = gate[i], u = up[i], d = dh[i];
  const float sig = 1.0f / (1.0f + expf(-g));
  const float silu = g * sig;
  dup[i] = d * silu;
  dgate[i] = d * u * sig * (1.0f + g * (1.0f - sig));
  if (h != nullptr) h[i] = silu * u;
}

// ---- RoPE -------------------------------------------------------------------------------------

/// Item p of RoPE over packed training rows, in place: p indexes the adjacent pairs of q and k
/// row by row (row t has dim / 2 pairs of q, then kv_dim / 2 of k). Pair j of a head is rotated
/// by pos[t] * freq[j] (freq[j] = 1 / theta^(2j / head_size), made on the host as cpu::rope),
/// with cos/sin of that float angle; by the opposite angle when `inverse` (the backward:
/// cpu::rope_backward).
BRIGADE_HD void rope_item(float* q, float* k, const std::int32_t* pos, const float* freq,
                          std::int64_t p, std::int64_t dim, std::int64_t kv_dim, int head_size,
                          bool inverse) {
  const std::int64_t per_row = (dim + kv_dim) / 2;
  const std::int64_t t = p / per_row;
  std::int64_t i = 2 * (p % per_row);
  float* row = q + t * dim;
  if (i >= dim) {
    i -= dim;
    row = k + t * kv_dim;
  }
  const float val = static_cast<float>(pos[t]) * freq[(i % head_size) / 2];
  const float c = cosf(val);
  const float s = inverse ? -sinf(val) : sinf(val);
  const float v0 = row[i], v1 = row[i + 1];
  row[i] = v0 * c - v1 * s;
  row[i + 1] = v0 * s + v1 * c;
}

// ---- causal attention over packed sequences ---------------------------------------------------

/// Item (t, h) = item / n_heads, item % n_heads of cpu::attention_varlen_forward: query row t,
/// head h attends to keys seq_begin[t] .. t of KV head h / (n_heads / n_kv_heads); scores
/// q.k / sqrt(head_size), softmax with the maximum subtracted; writes out[t, h] (head_size
/// floats) and lse[t * n_heads + h] = max + log(sum of exp).
BRIGADE_HD void attention_forward_item(const float* q, const float* k, const float* v, float* out,
                                       float* lse, const std::int32_t* seq_begin,
                                       std::int64_t item, int n_heads, int n_kv_heads,
                                       int head_size) {
  const std::int64_t t = item / n_heads;
  const int h = static_cast<int>(item % n_heads);
  const std::int64_t hs = head_size, dim = static_cast<std::int64_t>(n_heads) * hs,
                     kv_dim = static_cast<std::int64_t>(n_kv_heads) * hs;
  const std::int64_t kv_off = static_cast<std::int64_t>(h / (n_heads / n_kv_heads)) * hs;
  const float scale = sqrtf(static_cast<float>(head_size));
  const float* qr = q + t * dim + h * hs;
  float* o = out + t * dim + h * hs;
  const std::int64_t j0 = seq_begin[t];
  float mx = -INFINITY;
  for (std::int64_t j = j0; j <= t; ++j) {
    const float s = dot_n(qr, k + j * kv_dim + kv_off, hs) / scale;
    mx = s > mx ? s : mx;
  }
  for (std::int64_t d = 0; d < hs; ++d) o[d] = 0.0f;
  float sum = 0.0f;
  for (std::int64_t j = j0; j <= t; ++j) {
    const float e = expf(dot_n(qr, k + j * kv_dim + kv_off, hs) / scale - mx);
    sum += e;
    const float* vr = v + j * kv_dim + kv_off;
    for (std::int64_t d = 0; d < hs; ++d) o[d] += e * vr[d];
  }
  for (std::int64_t d = 0; d < hs; ++d) o[d] /= sum;
  lse[t * n_heads + h] = mx + logf(sum);
}

/// Item (t, h) of D = rowsum(dO * O) per head: dsum[t * n_heads + h] = dout[t, h] . out[t, h]
/// (FlashAttention-2's D, Dao 2023, Algorithm 2).
BRIGADE_HD void attention_dsum_item(const float* dout, const float* out, float* dsum,
                                    std::int64_t item, int n_heads, int head_size) {
  const std::int64_t t = item / n_heads, h = item % n_heads;
  const std::int64_t off = t * n_heads * head_size + h * head_size;
  dsum[item] = dot_n(dout + off, out + off, head_size);
}

/// Item (t, h) of the attention backward's dQ: for the keys j of the row's causal window,
/// P = exp(q.k_j / sqrt(hs) - lse), dP = dO . v_j, dS = P (dP - D) / sqrt(hs), and
/// dq[t, h] = sum_j dS k_j (overwritten).
BRIGADE_HD void attention_dq_item(const float* q, const float* k, const float* v, const float* lse,
                                  const float* dsum, const float* dout, float* dq,
                                  const std::int32_t* seq_begin, std::int64_t item, int n_heads,
                                  int n_kv_heads, int head_size) {
  const std::int64_t t = item / n_heads;
  const int h = static_cast<int>(item % n_heads);
  const std::int64_t hs = head_size, dim = static_cast<std::int64_t>(n_heads) * hs,
                     kv_dim = static_cast<std::int64_t>(n_kv_heads) * hs;
  const std::int64_t kv_off = static_cast<std::int64_t>(h / (n_heads / n_kv_heads)) * hs;
  const float scale = sqrtf(static_cast<float>(head_size));
  const float* qr = q + t * dim + h * hs;
  const float* gr = dout + t * dim + h * hs;
  float* dqr = dq + t * dim + h * hs;
  const float l = lse[item], dd = dsum[item];
  for (std::int64_t d = 0; d < hs; ++d) dqr[d] = 0.0f;
  for (std::int64_t j = seq_begin[t]; j <= t; ++j) {
    const float* kr = k + j * kv_dim + kv_off;
    const float p = expf(dot_n(qr, kr, hs) / scale - l);
    const float ds = p * (dot_n(gr, v + j * kv_dim + kv_off, hs) - dd) / scale;
    for (std::int64_t d = 0; d < hs; ++d) dqr[d] += ds * kr[d];
  }
}

/// Item (j, g) = item / n_kv_heads, item % n_kv_heads of the attention backward's dK and dV: key
/// row j of KV head g, summed over the query rows t in [j, seq_end[j]) of its sequence and the
/// query heads h of g's group (in order): dv[j, g] = sum P dO_t, dk[j, g] = sum dS q_t
/// (overwritten; P and dS as attention_dq_item).
BRIGADE_HD void attention_dkv_item(const float* q, const float* k, const float* v,
                                   const float* lse, const float* dsum, const float* dout,
                                   float* dk, float* dv, const std::int32_t* seq_end,
                                   std::int64_t item, int n_heads, int n_kv_heads,
                                   int head_size) {
  const std::int64_t j = item / n_kv_heads;
  const int g = static_cast<int>(item % n_kv_heads);
  const int group = n_heads / n_kv_heads;
  const std::int64_t hs = head_size, dim = static_cast<std::int64_t>(n_heads) * hs,
                     kv_dim = static_cast<std::int64_t>(n_kv_heads) * hs;
  const float scale = sqrtf(static_cast<float>(head_size));
  const float* kr = k + j * kv_dim + g * hs;
  const float* vr = v + j * kv_dim + g * hs;
  float* dkr = dk + j * kv_dim + g * hs;
  float* dvr = dv + j * kv_dim + g * hs;
  for (std::int64_t d = 0; d < hs; ++d) {
    dkr[d] = 0.0f;
    dvr[d] = 0.0f;
  }
  for (std::int64_t t = j; t < seq_end[j]; ++t) {
    for (int h = g * group; h < (g + 1) * group; ++h) {
      const float* qr = q + t * dim + h * hs;
      const float* gr = dout + t * dim + h * hs;
      const std::int64_t th = t * n_heads + h;
      const float p = expf(dot_n(qr, kr, hs) / scale - lse[th]);
      const float ds = p * (dot_n(gr, vr, hs) - dsum[th]) / scale;
      for (std::int64_t d = 0; d < hs; ++d) {
        dvr[d] += p * gr[d];
        dkr[d] += ds * qr[d];
      }
    }
  }
}

// ---- cross-entropy, embedding, accumulation ---------------------------------------------------

/// Item t of cpu::cross_entropy: for target y = targets[t] != -1, dlogits[t] =
/// (softmax(logits[t]) - onehot(y)) * inv_denom and row_loss[t] = max + log(sum exp(l - max)) -
/// logits[t, y] (double); for y == -1 a zero gradient row and row_loss 0. The targets are
/// checked on the host. dlogits may alias logits.
BRIGADE_HD void cross_entropy_item(const float* logits, const std::int32_t* targets,
                                   float* dlogits, double* row_loss, std::int64_t t,
                                   std::int64_t vocab, float inv_denom) {
  const float* l = logits + t * vocab;
  float* d = dlogits + t * vocab;
  const std::int32_t y = targets[t];
  if (y < 0) {
    for (std::int64_t i = 0; i < vocab; ++i) d[i] = 0.0f;
    row_loss[t] = 0.0;
    return;
  }
  const float target_logit = l[y];  // before d (which may alias) is written
  float mx = l[0];
  for (std::int64_t i = 1; i < vocab; ++i) mx = l[i] > mx ? l[i] : mx;
  float sum = 0.0f;
  for (std::int64_t i = 0; i < vocab; ++i) {
    const float e = expf(l[i] - mx);
    d[i] = e;
    sum += e;
  }
  const float f = inv_denom / sum;
  for (std::int64_t i = 0; i < vocab; ++i) d[i] *= f;
  d[y] -= inv_denom;
  row_loss[t] = static_cast<double>(mx) + log(static_cast<double>(sum)) -
                static_cast<double>(target_logit);
}

/// Item j (a column) of cpu::embedding_backward: dtable[ids[t], j] += dy[t, j] for t in order
/// (one thread per column, so repeated ids add up without atomics). The ids are checked on the
/// host.
BRIGADE_HD void embedding_backward_item(const float* dy, const std::int32_t* ids, float* dtable,
                                        std::int64_t j, std::int64_t tokens, std::int64_t dim) {
  for (std::int64_t t = 0; t < tokens; ++t)
    dtable[static_cast<std::int64_t>(ids[t]) * dim + j] += dy[t * dim + j];
}

/// Item i of dst += src.
BRIGADE_HD void add_item(const float* src, float* dst, std::int64_t i) { dst[i] += src[i]; }

}  // namespace brigade::cuda::detail
