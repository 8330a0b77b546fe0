// The Llama decoder layer's forward pass written once over the Backend concept: every backend
// (CpuBackend, a user's, a device's) runs the same sequence of kernels, so a backend that only
// provides the kernels gets the whole layer.
#pragma once

#include "brigade/backend/backend.hpp"
#include "brigade/core/error.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/weights.hpp"

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

namespace brigade::backend {
inline namespace v0 {

/// Reusable work memory of decoder_layer_forward on backend B, grown on demand (no allocation
/// in steady state): float32 buffers of the normalised input, q, k, v, and the FFN's two hidden
/// activations; the positions of the batch's rows (built on the host, uploaded).
template <Backend B>
struct DecoderBuffers {
  typename B::Buffer xb, q, k, v, hb, hb2, pos, part;
  std::vector<std::int32_t> pos_host;

  /// `buf` holding at least `bytes` bytes (reallocated, contents dropped, when smaller).
  static void* grow(B& b, typename B::Buffer& buf, std::size_t bytes) {
    if (buf.size() < bytes) buf = b.allocate(bytes);
    return buf.data();
  }
};

/// Checks a packed batch's slices for a decoder layer of `config`: each slice has tokens >= 1 and
/// positions [pos0, pos0 + tokens) within [0, seq_len); the slices cover `tokens` rows.
/// @throws brigade::Error{InvalidArgument} naming `who`, the slice and what was expected
inline void check_slices(const char* who, const model::LlamaConfig& config, std::int64_t tokens,
                         std::span<const SequenceSlice> seqs) {
  std::int64_t rows = 0;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const SequenceSlice& s = seqs[i];
    BRIGADE_CHECK(s.tokens >= 1, Errc::InvalidArgument,
                  "{}: sequence {} (slice {}) has tokens = {}; expected >= 1", who, s.seq, i,
                  s.tokens);
    BRIGADE_CHECK(s.pos0 >= 0 && std::int64_t{s.pos0} + s.tokens <= config.seq_len,
                  Errc::InvalidArgument,
                  "{}: sequence {} (slice {}) spans positions [{}, {}); expected within "
                  "[0, seq_len = {})",
                  who, s.seq, i, s.pos0, std::int64_t{s.pos0} + s.tokens, config.seq_len);
    rows += s.tokens;
  }
  BRIGADE_CHECK(rows == tokens, Errc::InvalidArgument,
                "{}: the {} sequences cover {} rows; expected tokens = {}", who, seqs.size(), rows,
                tokens);
}

/// One tensor-parallel rank's share of a decoder layer (Megatron-LM, Shoeybi et al. 2019, §3;
/// the slices are tp::shard_decoder's): its query heads and KV heads (Wq, Wk, Wv column-parallel
/// by heads, Wo row-parallel over the same heads), its MLP rows (W1, W3 column-parallel, W2
/// row-parallel), and the group's sum of a partial layer output.
struct DecoderSplit {
  int n_heads = 0;          ///< this rank's query heads
  int n_kv_heads = 0;       ///< this rank's KV heads (its cache holds only these)
  std::int64_t hidden = 0;  ///< this rank's MLP rows
  bool adds_residual = false;  ///< true on one rank of the group (rank 0): its partial sum
                               ///< starts from the residual stream, so the group's sum is
                               ///< x + the layer's output
  /// In place, the elementwise sum over the group of a [tokens x dim] float32 buffer in the
  /// backend's memory (tp::Group::all_reduce on a host backend).
  std::function<void(float* data, std::int64_t count)> all_reduce;
};

/// One tensor-parallel rank's share of the LM head in training: the vocabulary rows of its
/// shard of the classifier (Megatron-LM's column-parallel output layer, Shoeybi et al. 2019,
/// §3; tp::Shard's vocab0 and vocab) and the group's collectives over host float32 buffers
/// that the vocabulary-parallel cross-entropy needs (cpu::vocab_parallel_cross_entropy).
struct VocabSplit {
  std::int64_t vocab0 = 0;  ///< first vocabulary row of this rank's shard
  std::int64_t vocab = 0;   ///< rows of its shard
  /// In place, the elementwise sum over the group of `count` floats (tp::Group::all_reduce).
  std::function<void(float* data, std::int64_t count)> all_reduce;
  /// In place, the elementwise maximum over the group (tp::Group::all_reduce_max).
  std::function<void(float* data, std::int64_t count)> all_reduce_max;
};

/// One Llama decoder layer over a packed micro-batch (prefill and decode alike), in place on the
/// residual stream, as run.c's forward() for one layer, on backend `b`:
///   xb = rmsnorm(x, rms_att); q, k, v = xb Wq^T, xb Wk^T, xb Wv^T; RoPE(q, k, positions);
///   attention (k, v stored in each sequence's cache rows pos0..; causal GQA over the cache);
///   x += att Wo^T; xb = rmsnorm(x, rms_ffn); x += (silu(xb W1^T) * (xb W3^T)) W2^T.
/// The projections are GEMMs over all `tokens` rows at once: 7 matmul_wt calls per layer.
/// @param w      the layer's weights in b's memory (each matrix from b.upload_weight)
/// @param x      [tokens x dim] float32 residual stream in b's memory, updated in place
/// @param seqs   the slices in row order, covering `tokens` rows (host memory)
/// @param cache  this layer's KV cache (rows pos0 + tokens of each sequence must fit its capacity)
/// @param split  null: the whole layer. Else one TP rank's share (weights `w` are its slices,
///               `cache` holds its KV heads): q, k, v and the attention on its heads, then its
///               partial output p = att Wo_r^T (rank 0: x + att Wo_r^T) is summed over the group
///               into x; the MLP likewise with its hidden rows: two all-reduces per layer
/// @throws brigade::Error{InvalidArgument} if the config is invalid, a weight is null, a slice
///         has tokens < 1, positions beyond seq_len or its sequence's capacity, or the slices do
///         not cover `tokens` rows; a kernel's error; the split's all-reduce errors
template <Backend B>
void decoder_layer_forward(B& b, const model::LlamaConfig& config, const model::DecoderWeights& w,
                           float* x, std::int64_t tokens, std::span<const SequenceSlice> seqs,
                           const KvCacheView& cache, DecoderBuffers<B>& buf,
                           const DecoderSplit* split = nullptr) {
  config.validate("decoder_layer_forward");
  BRIGADE_CHECK(tokens >= 0, Errc::InvalidArgument,
                "decoder_layer_forward: tokens = {}; expected >= 0", tokens);
  BRIGADE_CHECK(w.rms_att && w.wq && w.wk && w.wv && w.wo && w.rms_ffn && w.w1 && w.w2 && w.w3,
                Errc::InvalidArgument,
                "decoder_layer_forward: a DecoderWeights pointer is null; expected all 9 set");
  BRIGADE_CHECK(tokens == 0 || x != nullptr, Errc::InvalidArgument,
                "decoder_layer_forward: x is null with tokens = {}", tokens);
  check_slices("decoder_layer_forward", config, tokens, seqs);
  for (const SequenceSlice& s : seqs) {
    const auto seq = static_cast<std::size_t>(s.seq);
    BRIGADE_CHECK(s.seq >= 0 && seq < cache.first_row.size() && seq < cache.capacity.size() &&
                      cache.keys != nullptr && cache.values != nullptr,
                  Errc::InvalidArgument,
                  "decoder_layer_forward: sequence {} has no KV cache (the cache holds {} "
                  "sequences)",
                  s.seq, cache.first_row.size());
    BRIGADE_CHECK(std::int64_t{s.pos0} + s.tokens <= cache.capacity[seq], Errc::InvalidArgument,
                  "decoder_layer_forward: sequence {} positions [{}, {}) exceed its KV capacity {}",
                  s.seq, s.pos0, std::int64_t{s.pos0} + s.tokens, cache.capacity[seq]);
  }
  if (tokens == 0) return;

  const std::int64_t dim = config.dim;
  const int hs = config.head_size();
  const int n_heads = split ? split->n_heads : config.n_heads;
  const int n_kv_heads = split ? split->n_kv_heads : config.n_kv_heads;
  const std::int64_t q_dim = std::int64_t{n_heads} * hs;
  const std::int64_t kv_dim = std::int64_t{n_kv_heads} * hs;
  const std::int64_t hidden = split ? split->hidden : config.hidden_dim;
  const auto f32 = [&](typename B::Buffer& m, std::int64_t n) {
    return static_cast<float*>(
        DecoderBuffers<B>::grow(b, m, static_cast<std::size_t>(n) * sizeof(float)));
  };
  float* xb = f32(buf.xb, tokens * dim);
  float* q = f32(buf.q, tokens * q_dim);
  float* k = f32(buf.k, tokens * kv_dim);
  float* v = f32(buf.v, tokens * kv_dim);
  float* hb = f32(buf.hb, tokens * hidden);
  float* hb2 = f32(buf.hb2, tokens * hidden);
  buf.pos_host.clear();
  for (const SequenceSlice& s : seqs)
    for (std::int32_t t = 0; t < s.tokens; ++t) buf.pos_host.push_back(s.pos0 + t);
  const std::size_t pos_bytes = buf.pos_host.size() * sizeof(std::int32_t);
  auto* pos = static_cast<std::int32_t*>(DecoderBuffers<B>::grow(b, buf.pos, pos_bytes));
  b.upload(pos, buf.pos_host.data(), pos_bytes);

  // A row-parallel product added to the residual stream: x += in W^T, or with a split, the
  // group's sum of (x +) in W_r^T (the residual on rank 0 only) written back to x.
  const auto row_parallel = [&](const float* in, model::WeightMatrix wm, std::int64_t in_dim) {
    if (split == nullptr) {
      b.matmul_wt(in, wm, x, tokens, in_dim, dim, true);
      return;
    }
    float* part = f32(buf.part, tokens * dim);
    const std::size_t bytes = static_cast<std::size_t>(tokens * dim) * sizeof(float);
    if (split->adds_residual) b.copy(part, x, bytes);
    b.matmul_wt(in, wm, part, tokens, in_dim, dim, split->adds_residual);
    split->all_reduce(part, tokens * dim);
    b.copy(x, part, bytes);
  };
  // Attention block: the QKV projections as three GEMMs over every row of every sequence.
  b.rmsnorm(x, w.rms_att, xb, tokens, dim, config.norm_eps);
  b.matmul_wt(xb, w.wq, q, tokens, dim, q_dim, false);
  b.matmul_wt(xb, w.wk, k, tokens, dim, kv_dim, false);
  b.matmul_wt(xb, w.wv, v, tokens, dim, kv_dim, false);
  b.rope(q, k, pos, tokens, n_heads, n_kv_heads, hs, config.rope_theta);
  b.attention(cache, q, k, v, xb, seqs, n_heads, n_kv_heads, hs);
  row_parallel(xb, w.wo, q_dim);

  // FFN block: x += (silu(xb W1^T) * (xb W3^T)) W2^T.
  b.rmsnorm(x, w.rms_ffn, xb, tokens, dim, config.norm_eps);
  b.matmul_wt(xb, w.w1, hb, tokens, dim, hidden, false);
  b.matmul_wt(xb, w.w3, hb2, tokens, dim, hidden, false);
  b.swiglu(hb, hb2, tokens * hidden);
  row_parallel(hb, w.w2, hidden);
}

}  // namespace v0
}  // namespace brigade::backend
