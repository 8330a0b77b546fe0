// Launchers of brigade's CUDA kernels (defined in kernels.cu), called from backend.cpp.
//
// Internal to brigade::cuda. Plain C++ over the CUDA runtime types: no fmt, no Eigen, no brigade
// headers, so that nvcc compiles kernels.cu without them. Every launcher enqueues on `stream`
// and returns cudaGetLastError() of its launch; the caller turns a failure into brigade::Error.
// Sizes are validated by the caller. Dtype codes: 0 = float32, 1 = bfloat16 (backend.cpp's code() maps brigade::DType to them).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace brigade::cuda::detail {

inline constexpr int kF32 = 0;
inline constexpr int kBF16 = 1;

/// One sequence of a packed micro-batch, as the kernels read it from device memory.
struct SeqDesc {
  std::int64_t offset;  ///< first row in the packed batch
  std::int64_t tokens;  ///< rows
  std::int64_t pos0;    ///< position of the first row
  void* k_cache;        ///< [capacity x kv_dim] in the layer's dtype
  void* v_cache;
};

/// out[t, :] = w * x[t, :] / sqrt(mean(x[t, :]^2) + eps); out in out_dtype. One block per row.
cudaError_t launch_rmsnorm(const float* x, const float* w, void* out, int out_dtype,
                           std::int64_t tokens, std::int64_t dim, float eps, cudaStream_t stream);

/// RoPE in place on q (row stride q_stride) and k (row stride k_stride), run.c's formula, with
/// freq[j] = 1 / theta^(2j / head_size) for j < head_size / 2 (device memory, made on the host).
cudaError_t launch_rope(float* q, std::int64_t q_stride, float* k, std::int64_t k_stride,
                        const std::int32_t* pos, const float* freq, std::int64_t tokens,
                        int n_heads, int n_kv_heads, int head_size, cudaStream_t stream);

/// Splits the QKV GEMM output (row t: q | k | v, row stride qkv_stride, float32): q to q_out
/// ([tokens x dim], dtype), k and v rows to row pos0 + (t - offset) of the token's sequence's
/// caches (dtype). tok_seq[t] is the sequence index of row t.
cudaError_t launch_qkv_scatter(const float* qkv, std::int64_t qkv_stride, std::int64_t tokens,
                               std::int64_t dim, std::int64_t kv_dim, const std::int32_t* tok_seq,
                               const SeqDesc* seqs, void* q_out, int dtype, cudaStream_t stream);

/// Causal GQA attention for rows [row_begin, row_begin + rows) of the packed batch, one block per
/// (row, head), online softmax over key tiles. q and out are [tokens x n_heads*head_size] in
/// dtype (whole batch; only the given rows are read and written); caches in dtype.
cudaError_t launch_attention_direct(const void* q, void* out, int dtype, std::int64_t row_begin,
                                    std::int64_t rows, const std::int32_t* tok_seq,
                                    const SeqDesc* seqs, int n_heads, int n_kv_heads, int head_size,
                                    cudaStream_t stream);

/// Causal softmax of score rows: s is [n_heads][rows][ld] float32 (raw q.k in the first `keys`
/// columns); row i of each head sees keys 0..first_visible - 1 + i. p[h][i][j] =
/// softmax(s / scale) for visible j, 0 for the other j < keys; p in p_dtype, same layout (may
/// alias s when float32).
cudaError_t launch_causal_softmax(const float* s, void* p, int p_dtype, int n_heads,
                                  std::int64_t rows, std::int64_t keys, std::int64_t ld,
                                  std::int64_t first_visible, float scale, cudaStream_t stream);

/// out[r, i] = silu(gate[r, i]) * up[r, i] for i < width; gate/up row strides given; out
/// contiguous [rows x width] in out_dtype.
cudaError_t launch_swiglu(const float* gate, const float* up, std::int64_t in_stride, void* out,
                          int out_dtype, std::int64_t rows, std::int64_t width,
                          cudaStream_t stream);

/// out[t, :] = table[ids[t], :] (float32).
cudaError_t launch_embedding(const float* table, const std::int32_t* ids, float* out,
                             std::int64_t tokens, std::int64_t dim, cudaStream_t stream);

/// dst[i] = convert(src[i]).
cudaError_t launch_convert(const void* src, int src_dtype, void* dst, int dst_dtype, std::int64_t n,
                           cudaStream_t stream);

/// dst[i] = uniform [-scale, scale) from a hash of (seed, i).
cudaError_t launch_fill_random(void* dst, int dtype, std::int64_t n, std::uint64_t seed,
                               float scale, cudaStream_t stream);

/// out[r] = first argmax of logits[r, :].
cudaError_t launch_argmax(const float* logits, std::int64_t rows, std::int64_t vocab,
                          std::int32_t* out, cudaStream_t stream);

/// logits[r, :] <- softmax(logits[r, :] / temperature); out[r] = first i with coin[r] < CDF(i)
/// (vocab - 1 if none). coins is device memory [rows].
cudaError_t launch_sample_multinomial(float* logits, std::int64_t rows, std::int64_t vocab,
                                      float temperature, const float* coins, std::int32_t* out,
                                      cudaStream_t stream);

// ---- training (one thread per work item of cuda/train_math.hpp; host-tested there) ----------

/// rmsnorm_train_item for t < tokens.
cudaError_t launch_rmsnorm_train(const float* x, const float* w, float* out, float* inv_rms,
                                 std::int64_t tokens, std::int64_t dim, float eps,
                                 cudaStream_t stream);
/// rmsnorm_dweight_item for every column j < dim (accumulates into dw), then
/// rmsnorm_backward_item for t < tokens (dx, which may alias x: the columns are read first).
/// dw may be null (no gain gradient).
cudaError_t launch_rmsnorm_backward(const float* x, const float* w, const float* inv_rms,
                                    const float* dy, float* dx, float* dw, std::int64_t tokens,
                                    std::int64_t dim, bool accumulate, cudaStream_t stream);
/// swiglu_backward_item for i < n.
cudaError_t launch_swiglu_backward(const float* gate, const float* up, const float* dh,
                                   float* dgate, float* dup, float* h, std::int64_t n,
                                   cudaStream_t stream);
/// rope_item for every pair of q [tokens x dim] and k [tokens x kv_dim].
cudaError_t launch_rope_train(float* q, float* k, const std::int32_t* pos, const float* freq,
                              std::int64_t tokens, std::int64_t dim, std::int64_t kv_dim,
                              int head_size, bool inverse, cudaStream_t stream);
/// attention_forward_item for every (row, head).
cudaError_t launch_attention_train_forward(const float* q, const float* k, const float* v,
                                           float* out, float* lse, const std::int32_t* seq_begin,
                                           std::int64_t tokens, int n_heads, int n_kv_heads,
                                           int head_size, cudaStream_t stream);
/// attention_dsum_item, then attention_dq_item for every (row, head), then attention_dkv_item for
/// every (row, KV head). dsum is [tokens x n_heads] scratch.
cudaError_t launch_attention_train_backward(const float* q, const float* k, const float* v,
                                            const float* out, const float* lse,
                                            const float* dout, float* dsum, float* dq, float* dk,
                                            float* dv, const std::int32_t* seq_begin,
                                            const std::int32_t* seq_end, std::int64_t tokens,
                                            int n_heads, int n_kv_heads, int head_size,
                                            cudaStream_t stream);
/// cross_entropy_item for t < tokens.
cudaError_t launch_cross_entropy(const float* logits, const std::int32_t* targets, float* dlogits,
                                 double* row_loss, std::int64_t tokens, std::int64_t vocab,
                                 float inv_denom, cudaStream_t stream);
/// embedding_backward_item for every column j < dim.
cudaError_t launch_embedding_backward(const float* dy, const std::int32_t* ids, float* dtable,
                                      std::int64_t tokens, std::int64_t dim, cudaStream_t stream);
/// add_item for i < n.
cudaError_t launch_add(const float* src, float* dst, std::int64_t n, cudaStream_t stream);

}  // namespace brigade::cuda::detail
