// Training kernels of the Llama decoder on the CPU backend: the backward of every forward kernel
// in cpu.hpp, variable-length causal attention with its backward, cross-entropy, and a decoder
// layer whose backward is split into backward-input (BI) and backward-weight (BW) for the
// zero-bubble schedules.
//
// Conventions (as cpu.hpp): float32 storage, row-major [tokens x width] activations, weight
// matrices `out x in` (llama2.c's layout). Sequences of one micro-batch are packed one after
// another and described by cu_seqlens-style offsets: `offsets` has n_seq + 1 entries,
// offsets[0] = 0, strictly increasing, offsets[n_seq] = tokens; sequence s owns rows
// [offsets[s], offsets[s+1]) and its tokens sit at positions 0, 1, ... (training sequences
// start at position 0). No padding, no compute across sequences.
//
// Gradient naming: for a forward y = f(x, w), `dy` is dLoss/dy (same shape as y), the kernel
// writes dx = dLoss/dx and ADDS dLoss/dw into `dw` (weight gradients always accumulate, so
// micro-batches and the tied classifier sum into one buffer).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace brigade::model {
inline namespace v0 {
struct LlamaConfig;
struct DecoderWeights;
}  // namespace v0
}  // namespace brigade::model

namespace brigade::backend {
inline namespace v0 {
struct DecoderSplit;
struct VocabSplit;
}  // namespace v0
}  // namespace brigade::backend

namespace brigade::cpu {
inline namespace v0 {

/// Whether a kernel overwrites its input-gradient output or adds into it.
enum class Store : std::uint8_t {
  Overwrite,   ///< out = result
  Accumulate,  ///< out += result
};

/// Checks cu_seqlens-style offsets of a packed micro-batch.
/// @param what     names the caller in messages
/// @param offsets  n_seq + 1 row offsets (n_seq >= 1)
/// @param tokens   rows in the micro-batch
/// @param max_len  longest allowed sequence (config.seq_len: RoPE positions are < max_len)
/// @throws brigade::Error{InvalidArgument} if offsets has fewer than 2 entries, offsets[0] != 0,
///         an entry is not greater than the one before (empty or decreasing sequence), the last
///         entry differs from `tokens`, or a sequence is longer than `max_len`; the message
///         names the index, the value seen and the value expected
void validate_offsets(const char* what, std::span<const std::int64_t> offsets,
                      std::int64_t tokens, std::int64_t max_len);

// ---- per-kernel backward ----------------------------------------------------------------------

/// Scatter-add backward of cpu::embedding (out[t, :] = table[ids[t], :]):
/// dtable[ids[t], :] += dy[t, :] for every t (repeated ids add up).
/// @param dy     [tokens x dim]
/// @param ids    [tokens] token ids
/// @param dtable [vocab x dim] gradient of the table, accumulated
/// @throws brigade::Error{InvalidArgument} if tokens < 0, dim < 1, or an id is outside
///         [0, vocab) (nothing is written then)
void embedding_backward(const float* dy, const std::int32_t* ids, float* dtable,
                        std::int64_t tokens, std::int64_t dim, std::int64_t vocab);

/// cpu::rmsnorm that also records each row's inverse RMS for the backward:
/// inv_rms[t] = 1 / sqrt(mean_i(x[t, :]^2) + eps), out[t, i] = weight[i] * (inv_rms[t] * x[t, i])
/// (the same float formula, hence the same bits, as cpu::rmsnorm).
/// @param x       [tokens x dim]
/// @param weight  [dim]
/// @param out     [tokens x dim]; may alias x
/// @param inv_rms [tokens]
/// @throws brigade::Error{InvalidArgument} if tokens < 0 or dim < 1
void rmsnorm_train(const float* x, const float* weight, float* out, float* inv_rms,
                   std::int64_t tokens, std::int64_t dim, float eps);

/// Backward of RMSNorm y = w * r * x with r = (mean(x^2) + eps)^(-1/2), per row:
///   dx = r * (w * dy) - x * r^3 * mean_i(w_i dy_i x_i),   dweight += sum_t dy * r * x.
/// @param x       [tokens x dim] the forward's input
/// @param weight  [dim]
/// @param inv_rms [tokens] r of each row, from rmsnorm_train
/// @param dy      [tokens x dim]
/// @param dx      [tokens x dim], written or added per `store`; may alias x or dy (each row is
///                reduced before it is written)
/// @param dweight [dim] accumulated; nullptr skips the weight gradient
/// @throws brigade::Error{InvalidArgument} if tokens < 0 or dim < 1
void rmsnorm_backward(const float* x, const float* weight, const float* inv_rms, const float* dy,
                      float* dx, float* dweight, std::int64_t tokens, std::int64_t dim,
                      Store store = Store::Overwrite);

/// Backward-input of y = x W^T (cpu::matmul_wt): dx = dy W, one GEMM.
/// @param dy [tokens x out_dim]
/// @param w  [out_dim x in]
/// @param dx [tokens x in], written or added per `store`; must not alias dy
/// @throws brigade::Error{InvalidArgument} if a size is negative
void matmul_wt_backward_input(const float* dy, const float* w, float* dx, std::int64_t tokens,
                              std::int64_t in, std::int64_t out_dim,
                              Store store = Store::Overwrite);

/// Backward-weight of y = x W^T: dW += dy^T x, one GEMM. Separate from the backward-input so a
/// zero-bubble schedule can defer it (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §2).
/// @param dy [tokens x out_dim]
/// @param x  [tokens x in] the forward's input
/// @param dw [out_dim x in], accumulated
/// @throws brigade::Error{InvalidArgument} if a size is negative
void matmul_wt_backward_weight(const float* dy, const float* x, float* dw, std::int64_t tokens,
                               std::int64_t in, std::int64_t out_dim);

/// Rotary position embedding with positions taken from packed offsets (token t of a sequence
/// is at position t): cpu::rope's float formula, in place on q and k.
/// @param q [tokens x n_heads*head_size], k [tokens x n_kv_heads*head_size]
/// @throws brigade::Error{InvalidArgument} for bad offsets (validate_offsets, no length limit)
///         or heads as in cpu::rope
void rope_varlen(float* q, float* k, std::span<const std::int64_t> offsets, int n_heads,
                 int n_kv_heads, int head_size, float theta);

/// Backward of cpu::rope: each pair is a rotation by angle a, so its gradient is the rotation
/// by -a, (da, db) -> (da cos + db sin, -da sin + db cos), with the forward's float cos/sin.
/// In place on dq [tokens x n_heads*head_size] and dk [tokens x n_kv_heads*head_size].
/// @param pos [tokens] the positions the forward used
/// @throws brigade::Error{InvalidArgument} as cpu::rope
void rope_backward(float* dq, float* dk, const std::int32_t* pos, std::int64_t tokens,
                   int n_heads, int n_kv_heads, int head_size, float theta);

/// Causal grouped-query attention over packed variable-length sequences, saving the softmax's
/// log-sum-exp for the backward (FlashAttention-2's recipe: Dao 2023, §3.1).
///
/// Row t of sequence s (global row offsets[s] + t) attends to rows offsets[s] .. offsets[s] + t
/// of k and v only. Query head h reads KV head h / (n_heads / n_kv_heads). Scores are
/// q.k / sqrt(head_size), softmax with the maximum subtracted, weighted sum of v rows; per head,
/// blocks of query rows are matrix products (no per-token dot loops).
/// @param q   [tokens x n_heads*head_size] (after RoPE)
/// @param k   [tokens x n_kv_heads*head_size] (after RoPE)
/// @param v   [tokens x n_kv_heads*head_size]
/// @param out [tokens x n_heads*head_size]; must not alias q, k, v
/// @param lse [tokens x n_heads] log(sum_j exp(score_j)) per row and head (scaled scores);
///            nullptr when not needed
/// @throws brigade::Error{InvalidArgument} for bad offsets (validate_offsets, no length limit)
///         or heads as in cpu::rope
void attention_varlen_forward(const float* q, const float* k, const float* v, float* out,
                              float* lse, std::span<const std::int64_t> offsets, int n_heads,
                              int n_kv_heads, int head_size);

/// Backward of attention_varlen_forward. The probabilities are recomputed from q, k and lse
/// (P = exp(S - lse)), so nothing quadratic in the sequence length is stored. Per sequence,
/// head and block of query rows: dV += P^T dO, dP = dO V^T, D = rowsum(dO * O),
/// dS = P * (dP - D), dQ = dS K / sqrt(hs), dK += dS^T Q / sqrt(hs) (Dao 2023, Algorithm 2).
/// Query heads sharing a KV head add into its dk and dv columns.
/// @param q, k, v, out, lse  as given to and produced by the forward
/// @param dout [tokens x n_heads*head_size]
/// @param dq   [tokens x n_heads*head_size], overwritten
/// @param dk   [tokens x n_kv_heads*head_size], overwritten
/// @param dv   [tokens x n_kv_heads*head_size], overwritten
/// @throws brigade::Error{InvalidArgument} as attention_varlen_forward
void attention_varlen_backward(const float* q, const float* k, const float* v, const float* out,
                               const float* lse, const float* dout, float* dq, float* dk,
                               float* dv, std::span<const std::int64_t> offsets, int n_heads,
                               int n_kv_heads, int head_size);

/// Backward of cpu::swiglu h = silu(g) * u, silu(g) = g * sigmoid(g), element-wise:
///   du = dh * silu(g),   dg = dh * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))).
/// Every output element depends only on the inputs at the same index, so dgate may alias gate,
/// dup may alias up, and h may alias dh.
/// @param gate [n] g (the W1 projection before the activation)
/// @param up   [n] u (the W3 projection)
/// @param dh   [n] gradient of the output
/// @param dgate, dup [n] outputs
/// @param h    [n] if not nullptr, receives the forward output silu(g) * u (cpu::swiglu's bits)
void swiglu_backward(const float* gate, const float* up, const float* dh, float* dgate,
                     float* dup, std::int64_t n, float* h = nullptr);

/// Summed cross-entropy of a batch and how many tokens it counts.
struct CrossEntropyLoss {
  double sum = 0.0;         ///< sum over counted tokens of -log softmax(logits)[target] (nats)
  std::int64_t count = 0;   ///< tokens with a target (target != -1)
  /// Mean loss per counted token (0 when none is counted).
  [[nodiscard]] double mean() const noexcept {
    return count > 0 ? sum / static_cast<double>(count) : 0.0;
  }
};

/// Cross-entropy of logits against targets, with its gradient.
///
/// Per row with target y: loss = logsumexp(logits) - logits[y], the log-sum-exp taken with the
/// row maximum subtracted (stable for any finite logits). The gradient of
/// sum(loss) / denominator is dlogits = (softmax(logits) - onehot(y)) / denominator, where
/// denominator = `grad_denominator` if > 0, else the number of counted tokens (so the default
/// is the gradient of the mean; a caller accumulating micro-batches passes the step's total).
/// Rows with target -1 are ignored: loss 0 and a zero gradient row.
/// @param logits   [tokens x vocab]
/// @param targets  [tokens] ids in [0, vocab), or -1 to ignore
/// @param dlogits  [tokens x vocab], overwritten; may alias logits; nullptr for the loss only
/// @param row_loss [tokens] if not nullptr, receives each row's loss (nats; 0 for a row with
///                 target -1); the returned sum is their sum in row order (per-task losses)
/// @throws brigade::Error{InvalidArgument} if tokens < 0, vocab < 1, a target is outside
///         [0, vocab) and not -1, or grad_denominator < 0
CrossEntropyLoss cross_entropy(const float* logits, const std::int32_t* targets,
                               std::int64_t tokens, std::int64_t vocab, float* dlogits,
                               double grad_denominator = 0.0, double* row_loss = nullptr);

/// Cross-entropy of a vocabulary-parallel classifier's logits, Megatron-LM's
/// vocab_parallel_cross_entropy (Shoeybi et al. 2019, §3): each rank of a TP group holds the
/// logits of its vocabulary rows [split.vocab0, split.vocab0 + split.vocab) only, and no rank
/// gathers the whole rows. Per row: the maximum logit m (each shard's, then split.all_reduce_max
/// over the group), the sum of exp(logit - m) and the target's logit (0 on the shards that do
/// not hold it; both summed over the group by one split.all_reduce of 2 x tokens floats); loss =
/// log(sum) + m - target logit, and this shard's gradient (softmax - onehot) / denominator on its
/// columns. Every member of the group must call it with the same rows, targets and denominator
/// (the collectives pair by call order); each gets the same loss, row losses and sums.
/// Exps and sums as cross_entropy (fixed 16-float blocks).
/// @param logits     [tokens x split.vocab] this shard's logits
/// @param targets    [tokens] ids in [0, vocab_size), or -1 to ignore
/// @param vocab_size the whole vocabulary
/// @param dlogits    [tokens x split.vocab], overwritten; may alias logits; nullptr for the loss
/// @param grad_denominator, row_loss as cross_entropy
/// @throws brigade::Error{InvalidArgument} if tokens < 0, the shard is empty or outside the
///         vocabulary, an all-reduce is missing, a target is outside [0, vocab_size) and not -1,
///         or grad_denominator < 0; the all-reduces' errors (PeerTimeout, Aborted)
CrossEntropyLoss vocab_parallel_cross_entropy(const float* logits, const std::int32_t* targets,
                                              std::int64_t tokens, std::int64_t vocab_size,
                                              const backend::VocabSplit& split, float* dlogits,
                                              double grad_denominator = 0.0,
                                              double* row_loss = nullptr);

// ---- the LM head: final RMSNorm, classifier GEMM, cross-entropy -------------------------------

/// What the head's backward-weight needs, kept between head_forward_backward_input and
/// head_backward_weight. Memory: (dim + vocab) floats per token plus dim floats; the logits'
/// gradient dominates (vocab 32000: 125 KiB per token). Reset it (`= {}`) to drop it.
struct HeadActivations {
  std::int64_t tokens = 0;
  std::vector<float> xn;       ///< [tokens x dim] normalised input of the classifier
  std::vector<float> dlogits;  ///< [tokens x vocab] gradient of the logits
  std::vector<float> d_rms;    ///< [dim] this micro-batch's gradient of the final norm's gain
  /// Bytes allocated by the vectors (their capacities).
  [[nodiscard]] std::size_t bytes() const noexcept {
    return (xn.capacity() + dlogits.capacity() + d_rms.capacity()) * sizeof(float);
  }
};

/// Logits of the head: logits = rmsnorm(x, rms_final) wcls^T.
/// @param x       [tokens x dim] final residual stream
/// @param rms_final [dim], wcls [vocab x dim] (the token embedding when shared)
/// @param logits  [tokens x vocab]
/// @throws brigade::Error{InvalidArgument} if the config is invalid, tokens < 0, or a pointer
///         is null while tokens > 0
void head_forward(const model::LlamaConfig& config, const float* rms_final, const float* wcls,
                  const float* x, std::int64_t tokens, float* logits);

/// Head forward, loss, and backward-input in one call (the last stage runs them back to back):
/// xn = rmsnorm(x), logits = xn wcls^T, loss and dlogits by cross_entropy, dx by the GEMM and
/// RMSNorm backward. Stashes xn, dlogits and the norm-gain gradient for head_backward_weight.
/// @param dx      [tokens x dim], overwritten; may alias x
/// @param acts    overwritten
/// @param grad_denominator as cross_entropy
/// @param row_loss [tokens] if not nullptr, each row's loss, as cross_entropy
/// @param split   null: the whole classifier (wcls [vocab x dim]). Else one TP rank's
///                vocabulary shard (Megatron's column-parallel output layer): wcls holds rows
///                [split->vocab0, + split->vocab), the loss is vocab_parallel_cross_entropy's
///                (the same on every rank of the group), acts.dlogits holds the shard's columns,
///                and the classifier's input gradient is summed over the group (split->all_reduce)
///                before the final norm's backward, so dx and the norm gain's gradient are whole
///                and equal on every rank
/// @return the summed loss and the counted tokens
/// @throws brigade::Error{InvalidArgument} if the config is invalid, tokens < 1, a pointer is
///         null, or as cross_entropy / vocab_parallel_cross_entropy (acts is left empty then)
CrossEntropyLoss head_forward_backward_input(const model::LlamaConfig& config,
                                             const float* rms_final, const float* wcls,
                                             const float* x, const std::int32_t* targets,
                                             std::int64_t tokens, float* dx,
                                             HeadActivations& acts,
                                             double grad_denominator = 0.0,
                                             double* row_loss = nullptr,
                                             const backend::VocabSplit* split = nullptr);

/// Head backward-weight: d_wcls += dlogits^T xn, d_rms_final += the stashed norm gradient; then
/// releases acts' memory. With a shared classifier pass the embedding's gradient as d_wcls.
/// @param d_rms_final [dim], d_wcls [vocab x dim] (with a split: [split->vocab x dim], the
///        shard's rows), both accumulated
/// @param split the split the stash was made with (null: none)
/// @throws brigade::Error{InvalidUsage} if acts does not hold a head_forward_backward_input stash
void head_backward_weight(const model::LlamaConfig& config, HeadActivations& acts,
                          float* d_rms_final, float* d_wcls,
                          const backend::VocabSplit* split = nullptr);

// ---- the training decoder layer ---------------------------------------------------------------

/// Gradients of one decoder layer, one owned vector per DecoderWeights tensor, same shapes.
/// Backward passes add into them (gradient accumulation across micro-batches).
struct DecoderGrads {
  std::vector<float> rms_att;  ///< [dim]
  std::vector<float> wq;       ///< [dim x dim]
  std::vector<float> wk;       ///< [kv_dim x dim]
  std::vector<float> wv;       ///< [kv_dim x dim]
  std::vector<float> wo;       ///< [dim x dim]
  std::vector<float> rms_ffn;  ///< [dim]
  std::vector<float> w1;       ///< [hidden_dim x dim]
  std::vector<float> w2;       ///< [dim x hidden_dim]
  std::vector<float> w3;       ///< [hidden_dim x dim]

  /// Sizes every tensor for `config` and sets it to zero.
  /// @throws brigade::Error{InvalidArgument} if the config is invalid
  void zero(const model::LlamaConfig& config);
  /// The nine tensors in DecoderWeights order (rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3).
  [[nodiscard]] std::vector<std::vector<float>*> tensors();
  /// Read-only view of the nine tensors, same order.
  [[nodiscard]] std::vector<const std::vector<float>*> tensors() const;
};

/// Work buffers of the training layer (grown on demand, shared by all micro-batches of a stage
/// since they hold nothing between calls).
struct DecoderTrainScratch {
  std::vector<float> a, b;
};

/// What one micro-batch's forward stashes for its backward, and what the backward-input stashes
/// for the backward-weight. The caller owns it: reset it (`= {}` or clear()) to drop it, e.g.
/// to recompute the forward later.
///
/// Memory per token, in floats (dim = d, kv_dim = kv, hidden_dim = f, n_heads = H):
/// - after decoder_train_forward: 6d + 2kv + 2f + H + 2 (x_in, xb_att, q, k, v, att, x_mid,
///   xb_ffn, h1, h3, lse, both inverse RMS); dim 512, kv 512, f 1376, H 8: 26.8 KiB per token.
/// - after decoder_backward_input: 6d + 2kv + 3f (xb_att, dq, dk, dv, att, d_mid, xb_ffn, dh1,
///   dh3, dy, hb; 32.1 KiB per token for the shape above) plus 2d per micro-batch (the norm-gain
///   gradients).
/// - after decoder_backward_weight: nothing (memory released).
/// With a TP split (backend::DecoderSplit) the rank's widths replace dim in q, att and dq, kv in
/// k, v, dk and dv, hidden in h1, h3, hb, dh1 and dh3, n_heads in lse; the dim-wide rows (x_in,
/// xb_att, x_mid, xb_ffn, d_mid, dy) are whole on every rank.
struct DecoderActivations {
  /// Which pass the stash is ready for.
  enum class Phase : std::uint8_t {
    Empty,           ///< nothing stashed
    Forward,         ///< filled by decoder_train_forward; ready for decoder_backward_input
    BackwardInput,   ///< filled by decoder_backward_input; ready for decoder_backward_weight
  };
  Phase phase = Phase::Empty;
  std::int64_t tokens = 0;
  std::vector<std::int64_t> offsets;  ///< the micro-batch's sequence offsets
  std::vector<std::int32_t> pos;      ///< [tokens] position of each row within its sequence
  // Forward stash.
  std::vector<float> x_in;     ///< [tokens x dim] layer input (attention RMSNorm input)
  std::vector<float> inv_rms_att;  ///< [tokens]
  std::vector<float> xb_att;   ///< [tokens x dim] normalised input of wq, wk, wv
  std::vector<float> q;        ///< [tokens x dim] after RoPE; dq after backward-input
  std::vector<float> k;        ///< [tokens x kv_dim] after RoPE; dk after backward-input
  std::vector<float> v;        ///< [tokens x kv_dim]; dv after backward-input
  std::vector<float> lse;      ///< [tokens x n_heads] attention log-sum-exp
  std::vector<float> att;      ///< [tokens x dim] attention output, input of wo
  std::vector<float> x_mid;    ///< [tokens x dim] residual after attention (FFN norm input)
  std::vector<float> inv_rms_ffn;  ///< [tokens]
  std::vector<float> xb_ffn;   ///< [tokens x dim] normalised input of w1, w3
  std::vector<float> h1;       ///< [tokens x hidden] gate pre-activation; dh1 after BI
  std::vector<float> h3;       ///< [tokens x hidden] up projection; dh3 after BI
  // Backward-input stash (besides q, k, v, h1, h3 reused for their gradients).
  std::vector<float> d_mid;    ///< [tokens x dim] gradient of x_mid = output gradient of wo
  std::vector<float> dy;       ///< [tokens x dim] gradient of the layer output (of w2)
  std::vector<float> hb;       ///< [tokens x hidden] silu(h1) * h3, input of w2
  std::vector<float> d_rms_att;  ///< [dim] this micro-batch's rms_att gradient
  std::vector<float> d_rms_ffn;  ///< [dim] this micro-batch's rms_ffn gradient

  /// Bytes allocated by the vectors (capacities, positions and offsets included; the kernels
  /// size every buffer exactly, so this is the per-token figure above times tokens).
  [[nodiscard]] std::size_t bytes() const noexcept;
  /// Drops the stash and releases its memory; phase becomes Empty.
  void clear() noexcept;
};

/// Training forward of one Llama decoder layer over a packed micro-batch, as
/// backend::decoder_layer_forward (run.c's layer) with every sequence starting at position 0 and no
/// KV cache: x_out = x_mid + (silu(xb_ffn W1^T) * (xb_ffn W3^T)) W2^T with
/// x_mid = x_in + attention(RoPE(xb_att Wq^T), RoPE(xb_att Wk^T), xb_att Wv^T) Wo^T,
/// xb_* the RMSNorms. Fills `acts` (phase Forward) with what the backward needs.
/// @param x_in   [tokens x dim]
/// @param x_out  [tokens x dim]; may alias x_in
/// @param offsets sequence offsets, see the file comment; each sequence at most seq_len long
/// @param acts   overwritten
/// @param split  null: the whole layer. Else one tensor-parallel rank's share (Megatron-LM,
///               Shoeybi et al. 2019, §3; `w` holds tp::shard_decoder's slices: Wq, Wk, Wv, W1,
///               W3 rows, Wo and W2 columns): q, k, v and attention on its heads, its partial
///               att Wo_r^T (the residual added on the rank with split->adds_residual) summed over
///               the group by split->all_reduce into x_mid, likewise the MLP's W2 into x_out; x_in,
///               x_mid and x_out are whole and equal on every rank. The stash holds the rank's
///               widths (q and att its heads', h1 and h3 its MLP rows')
/// @throws brigade::Error{InvalidArgument} if the config is invalid, a weight pointer is null,
///         tokens < 1, x_in or x_out is null, the offsets are bad (validate_offsets), or the
///         split does not fit the config; the split's all-reduce errors
void decoder_train_forward(const model::LlamaConfig& config, const model::DecoderWeights& w,
                           const float* x_in, float* x_out, std::int64_t tokens,
                           std::span<const std::int64_t> offsets, DecoderActivations& acts,
                           DecoderTrainScratch* scratch = nullptr,
                           const backend::DecoderSplit* split = nullptr);

/// Backward-input (BI) of the layer: dx = dLoss/dx_in from dy = dLoss/dx_out, through the FFN
/// (W2, SwiGLU, W1/W3, RMSNorm), the residual, Wo, attention, RoPE, Wq/Wk/Wv and RMSNorm. Keeps
/// what decoder_backward_weight needs: the output gradient of every GEMM and its input, and the
/// two norm-gain gradients (phase becomes BackwardInput). Touches no weight gradient.
/// @param dy  [tokens x dim]
/// @param dx  [tokens x dim], overwritten; may alias dy
/// @param split the forward's split (null: none). The input gradient of each column-parallel
///        block (of xb_ffn through W1 and W3, of xb_att through Wq, Wk and Wv) is a partial sum
///        on each rank: split->all_reduce sums it over the group (Megatron's f operator in the
///        backward) before the replicated RMSNorm's backward, so dx and the norm gains'
///        gradients are whole and equal on every rank: two all-reduces of [tokens x dim]
/// @throws brigade::Error{InvalidUsage} if acts is not in phase Forward
/// @throws brigade::Error{InvalidArgument} if the config or a pointer is invalid, or the stash's
///         widths are not the split's; the split's all-reduce errors
void decoder_backward_input(const model::LlamaConfig& config, const model::DecoderWeights& w,
                            DecoderActivations& acts, const float* dy, float* dx,
                            DecoderTrainScratch* scratch = nullptr,
                            const backend::DecoderSplit* split = nullptr);

/// Backward-weight (BW) of the layer: adds every weight gradient (seven GEMMs dW += dY^T X and
/// the two norm gains) into `grads`, then releases acts' memory (phase Empty).
/// @param grads sized for config (DecoderGrads::zero), accumulated
/// @throws brigade::Error{InvalidUsage} if acts is not in phase BackwardInput
/// @throws brigade::Error{InvalidArgument} if a gradient tensor has the wrong size
void decoder_backward_weight(const model::LlamaConfig& config, DecoderActivations& acts,
                             DecoderGrads& grads);

/// decoder_backward_weight into nine caller-owned tensors (rms_att, wq, wk, wv, wo, rms_ffn, w1,
/// w2, w3: DecoderWeights order and shapes, float32, accumulated): what runtime::TrainStage
/// passes (backend::DecoderGradTensors).
/// @param split the forward's split (null: none): the tensors are then the shapes of the rank's
///        slices (wq [q x dim], wk and wv [kv x dim], wo [dim x q], w1 and w3 [hidden x dim], w2
///        [dim x hidden] of its heads and MLP rows), each gradient local to the rank; the norm
///        gains' are whole (the same on every rank)
/// @throws brigade::Error{InvalidUsage} if acts is not in phase BackwardInput
/// @throws brigade::Error{InvalidArgument} if a tensor pointer is null or the stash's widths
///         are not the split's
void decoder_backward_weight(const model::LlamaConfig& config, DecoderActivations& acts,
                             const std::array<float*, 9>& grads,
                             const backend::DecoderSplit* split = nullptr);

/// Full backward of the layer: decoder_backward_input then decoder_backward_weight.
/// @throws brigade::Error as those two
void decoder_backward(const model::LlamaConfig& config, const model::DecoderWeights& w,
                      DecoderActivations& acts, const float* dy, float* dx, DecoderGrads& grads,
                      DecoderTrainScratch* scratch = nullptr);

}  // namespace v0
}  // namespace brigade::cpu
