// Row-major products as column-major cuBLAS calls: the operands, leading dimensions and batch
// strides of every GEMM CudaBackend issues, as plain data.
//
// Pure C++ (no CUDA): the unit tests evaluate these plans with reference_gemm() on the CPU
// against the CPU kernels, so the layout arithmetic is checked on machines without a GPU.
#pragma once

#include <cstdint>

namespace brigade::cuda::detail {

/// One (strided-batched) column-major GEMM: for b in [0, batch):
///   C_b = alpha * op(A_b) * op(B_b) + beta * C_b, with op(A_b) m x k, op(B_b) k x n, C_b m x n,
/// A_b = A + offset_a + b * stride_a (column-major, leading dimension lda), likewise B and C.
/// op(X) = X^T when trans_x. All counts in elements.
struct GemmPlan {
  bool trans_a = false;
  bool trans_b = false;
  std::int64_t m = 0, n = 0, k = 0;
  std::int64_t lda = 0, ldb = 0, ldc = 0;
  std::int64_t offset_a = 0, offset_b = 0, offset_c = 0;
  std::int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  std::int64_t batch = 1;
};

/// out[T x N] = x[T x K] * W[N x K]^T, all row-major with the given row strides.
/// Row-major out is column-major out^T [N x T] = W * x^T: A = W (stored as col-major W^T, so
/// op = T), B = x (stored as col-major x^T, op = N).
constexpr GemmPlan plan_linear(std::int64_t tokens, std::int64_t in, std::int64_t out,
                               std::int64_t x_stride, std::int64_t w_stride,
                               std::int64_t out_stride) noexcept {
  GemmPlan p;
  p.trans_a = true;
  p.trans_b = false;
  p.m = out;
  p.n = tokens;
  p.k = in;
  p.lda = w_stride;
  p.ldb = x_stride;
  p.ldc = out_stride;
  return p;
}

/// Contiguous plan_linear.
constexpr GemmPlan plan_linear(std::int64_t tokens, std::int64_t in, std::int64_t out) noexcept {
  return plan_linear(tokens, in, out, in, in, out);
}

/// Backward-input of out = x W^T (cpu::matmul_wt_backward_input): dx[T x in] = dy[T x out] W,
/// all row-major and contiguous. Row-major dx is column-major dx^T [in x T] = W^T dy^T: A = W
/// (stored as col-major W^T [in x out], op = N), B = dy (col-major dy^T [out x T], op = N).
constexpr GemmPlan plan_linear_backward_input(std::int64_t tokens, std::int64_t in,
                                              std::int64_t out) noexcept {
  GemmPlan p;
  p.m = in;
  p.n = tokens;
  p.k = out;
  p.lda = in;
  p.ldb = out;
  p.ldc = in;
  return p;
}

/// Backward-weight of out = x W^T (cpu::matmul_wt_backward_weight): dW[out x in] += dy^T x, with
/// beta = 1. Row-major dW is column-major dW^T [in x out] = x^T dy: A = x (col-major x^T
/// [in x T], op = N), B = dy (col-major dy^T [out x T], op = T).
constexpr GemmPlan plan_linear_backward_weight(std::int64_t tokens, std::int64_t in,
                                               std::int64_t out) noexcept {
  GemmPlan p;
  p.trans_b = true;
  p.m = in;
  p.n = out;
  p.k = tokens;
  p.lda = in;
  p.ldb = out;
  p.ldc = in;
  return p;
}

/// Attention scores of one block of query rows, for the query heads h = j * group + member
/// (j over the KV heads, as the batch): S[h][i][j'] = sum_d Q[i, h*hs + d] * K[j', j*hs + d].
///   A = K (rows keys, row stride kv_stride): col-major K^T, op = T  -> m = keys
///   B = Q (rows `rows`, row stride q_stride): col-major Q^T, op = N  -> n = rows
///   C = S laid out [n_heads][rows][keys_ld] row-major (keys_ld >= keys: padded rows keep the
///       tensor cores' 16-byte alignment): col-major [keys x rows], ldc = keys_ld.
/// A points at the cache's row 0, B at the block's first query row, C at S.
constexpr GemmPlan plan_scores(std::int64_t rows, std::int64_t keys, std::int64_t keys_ld,
                               int n_heads, int n_kv_heads, int head_size, int member,
                               std::int64_t q_stride, std::int64_t kv_stride) noexcept {
  const std::int64_t group = n_heads / n_kv_heads;
  GemmPlan p;
  p.trans_a = true;
  p.trans_b = false;
  p.m = keys;
  p.n = rows;
  p.k = head_size;
  p.lda = kv_stride;
  p.ldb = q_stride;
  p.ldc = keys_ld;
  p.offset_a = 0;
  p.offset_b = static_cast<std::int64_t>(member) * head_size;
  p.offset_c = static_cast<std::int64_t>(member) * rows * keys_ld;
  p.stride_a = head_size;
  p.stride_b = group * head_size;
  p.stride_c = group * rows * keys_ld;
  p.batch = n_kv_heads;
  return p;
}

/// Attention output of one block: O[i, h*hs + d] = sum_j' P[h][i][j'] * V[j', (h/group)*hs + d].
///   A = V (col-major V^T [hs x keys], lda = kv_stride, op = N) -> m = head_size
///   B = P ([n_heads][rows][keys_ld]: col-major P^T [keys x rows], ldb = keys_ld, op = N)
///                                                                -> n = rows, k = keys
///   C = O (col-major O^T [hs x rows], ldc = out_stride).
constexpr GemmPlan plan_pv(std::int64_t rows, std::int64_t keys, std::int64_t keys_ld, int n_heads,
                           int n_kv_heads, int head_size, int member, std::int64_t kv_stride,
                           std::int64_t out_stride) noexcept {
  const std::int64_t group = n_heads / n_kv_heads;
  GemmPlan p;
  p.trans_a = false;
  p.trans_b = false;
  p.m = head_size;
  p.n = rows;
  p.k = keys;
  p.lda = kv_stride;
  p.ldb = keys_ld;
  p.ldc = out_stride;
  p.offset_a = 0;
  p.offset_b = static_cast<std::int64_t>(member) * rows * keys_ld;
  p.offset_c = static_cast<std::int64_t>(member) * head_size;
  p.stride_a = head_size;
  p.stride_b = group * rows * keys_ld;
  p.stride_c = group * head_size;
  p.batch = n_kv_heads;
  return p;
}

/// Evaluates a plan on the host with cuBLAS's column-major semantics (float, double
/// accumulation): the reference the unit tests hold the plans to.
inline void reference_gemm(const GemmPlan& p, const float* a, const float* b, float* c, float alpha,
                           float beta) {
  for (std::int64_t bt = 0; bt < p.batch; ++bt) {
    const float* ab = a + p.offset_a + bt * p.stride_a;
    const float* bb = b + p.offset_b + bt * p.stride_b;
    float* cb = c + p.offset_c + bt * p.stride_c;
    for (std::int64_t j = 0; j < p.n; ++j) {
      for (std::int64_t i = 0; i < p.m; ++i) {
        double s = 0.0;
        for (std::int64_t l = 0; l < p.k; ++l) {
          const float av = p.trans_a ? ab[l + i * p.lda] : ab[i + l * p.lda];
          const float bv = p.trans_b ? bb[j + l * p.ldb] : bb[l + j * p.ldb];
          s += static_cast<double>(av) * static_cast<double>(bv);
        }
        float& cv = cb[i + j * p.ldc];
        cv = static_cast<float>(alpha * s + (beta == 0.0f ? 0.0 : beta * static_cast<double>(cv)));
      }
    }
  }
}

}  // namespace brigade::cuda::detail
