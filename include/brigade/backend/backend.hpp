// The Backend concept: the kernels a Llama decoder stage needs, over the backend's own memory,
// so that an outside engine can bring its kernels (a GPU, a vendor BLAS, a counting wrapper) and
// run them under brigade's stages, executor and engines.
//
// Shape of the seam (STYLE.md section 2): a named concept with a static_assert beside each model
// (oneTBB's named requirements); the hot loops are templates over it (runtime::InferenceStage<B>,
// runtime::TrainStage<B>, backend::decoder_layer_forward<B>); type erasure only at the edge
// where the executor holds the stages (runtime::InferenceStageBase).
//
// Conventions every model follows (the CPU kernels' in brigade/backend/cpu.hpp):
// - Activations are float32, row-major [rows x width]. The tokens of several sequences are packed
//   one after another (varlen, as cu_seqlens), described by a span of SequenceSlice in row order:
//   no padding, no compute across sequences.
// - Weight matrices are llama2.c's row-major [out x in], each a model::WeightMatrix {data, dtype}
//   whose data lies in the backend's memory (upload_weight puts it there); activations stay
//   float32 whatever the weights' dtype.
// - Every pointer a kernel takes is the backend's memory (B::host_memory says whether that is the
//   host's), except spans of SequenceSlice and KvCacheView::first_row, which are host memory.
// - Kernels may be asynchronous (a device backend enqueues them on its stream); download() and
//   synchronize() wait. On a host backend they are immediate.
// - Sizes are in elements unless named bytes. A kernel given a negative size, a head layout it
//   cannot run, or a dtype it does not read throws brigade::Error{InvalidArgument} naming it.
#pragma once

#include "brigade/core/dtype.hpp"
#include "brigade/model/weight_matrix.hpp"

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

namespace brigade::model {
inline namespace v0 {
struct LlamaConfig;
struct DecoderWeights;
}  // namespace v0
}  // namespace brigade::model

namespace brigade::backend {
inline namespace v0 {

/// One sequence's slice of a packed batch: the one description of "which rows of the batch are
/// which sequence at which positions" that the engines' micro-batches, the wire descriptors, the
/// stages and every backend's attention share.
///
/// A packed batch lists its slices in row order; slice i covers the rows after those of slices
/// 0..i-1 (its first row is the sum of their `tokens`), so a batch of slices {a, b, c} holds
/// a.tokens + b.tokens + c.tokens rows. Row t of the slice sits at absolute position pos0 + t of
/// sequence `seq`, whose keys and values live in the rows of the KV cache that `seq` indexes
/// (KvCacheView).
struct SequenceSlice {
  std::int32_t seq = 0;     ///< sequence id in [0, number of sequences): its KV-cache slot
  std::int32_t pos0 = 0;    ///< absolute position of the slice's first row (0 at a prefill)
  std::int32_t tokens = 0;  ///< rows of the slice: new tokens (the prompt at a prefill, 1 at decode)
  friend constexpr bool operator==(const SequenceSlice&, const SequenceSlice&) = default;
};

/// Rows of a packed batch: the sum of its slices' tokens.
constexpr std::int64_t packed_rows(std::span<const SequenceSlice> seqs) noexcept {
  std::int64_t n = 0;
  for (const auto& s : seqs) n += s.tokens;
  return n;
}

/// One decoder layer's KV cache for every sequence, in a backend's memory: keys and values of
/// sequence s at position p are row first_row[s] + p of `keys` and of `values`, each row kv_dim
/// elements of `dtype` (the backend's kv_cache_dtype()). A view: the stage owns the memory.
struct KvCacheView {
  void* keys = nullptr;                     ///< [rows x kv_dim] in dtype, backend memory
  void* values = nullptr;                   ///< [rows x kv_dim] in dtype, backend memory
  DType dtype = DType::F32;                 ///< element type of keys and values
  std::int64_t kv_dim = 0;                  ///< n_kv_heads * head_size
  std::span<const std::int64_t> first_row;  ///< host memory: first row of each sequence id
  std::span<const int> capacity;            ///< host memory: rows (positions) of each sequence id
};

/// The kernels of a Llama decoder stage's forward pass (inference), over memory the backend
/// owns. Models: cpu::CpuBackend (Eigen, OpenBLAS and brigade's small-M kernels, host memory),
/// cuda::CudaBackend (cuBLAS and brigade's CUDA kernels, device memory, float32), a user's type
/// (the installed-package test wraps CpuBackend to count GEMMs). What each member does, with
/// shapes, for `b` a B:
///
/// - `B::Buffer`: owning, movable memory of the backend; `data()` is its first byte (aligned for
///   float32 and int32), `size()` its bytes.
/// - `B::host_memory` (constexpr bool): true when the backend's memory is the host's, so a
///   stage runs the kernels in place on its micro-batches' vectors; false for a device, whose
///   stage copies a micro-batch in (upload) before its layers and out (download) after them.
/// - `b.allocate(bytes) -> B::Buffer`: `bytes` bytes, uninitialised.
///   @throws brigade::Error when out of memory (Cuda on a GPU)
/// - `b.upload(dst, src, bytes)`: host `src` to backend `dst`; `src` may be reused on return.
/// - `b.download(dst, src, bytes)`: backend `src` to host `dst`, after the work enqueued so far.
/// - `b.copy(dst, src, bytes)`: backend to backend.
/// - `b.synchronize()`: returns when every kernel enqueued so far has finished.
/// - `b.upload_weight(w, rows, cols) -> model::WeightMatrix`: the matrix w ([rows x cols] in
///   w.dtype, host memory, possibly mapped from a file) as the kernels read it: on a host backend
///   w itself (no copy: mapped weights stay mapped); on a device a copy the backend owns until
///   it is destroyed, possibly in another dtype (its compute dtype). Vectors (norm gains) are
///   rows = 1, F32, and stay F32.
/// - `b.kv_cache_dtype() -> DType`: the element type of the KV caches a stage allocates for it.
/// - `b.embedding(table, ids, out, tokens, dim)`: out[t, :] = table[ids[t], :] as float32;
///   table [vocab x dim] from upload_weight; ids [tokens] int32 in [0, vocab) (the stage checks
///   them on the host); out [tokens x dim].
/// - `b.rmsnorm(x, w, out, tokens, dim, eps)`: out[t, i] = w[i] x[t, i] / sqrt(mean(x[t, :]^2) +
///   eps) (run.c's); x, out [tokens x dim] (out may alias x); w [dim].
/// - `b.matmul_wt(x, w, out, tokens, in, out_dim, accumulate)`: out = x W^T, or out += x W^T when
///   `accumulate`; x [tokens x in] float32, w [out_dim x in] from upload_weight, out
///   [tokens x out_dim] float32, not aliasing x. Every projection and the classifier (logits =
///   x Wcls^T) is this call: a backend that counts it counts the stage's GEMMs.
/// - `b.rope(q, k, pos, tokens, n_heads, n_kv_heads, head_size, theta)`: run.c's rotary
///   embedding in place on adjacent pairs (freq = theta^(-(2i mod head_size)/head_size), angle =
///   pos * freq); q [tokens x n_heads*head_size], k [tokens x n_kv_heads*head_size], pos
///   [tokens] int32 absolute positions (backend memory).
/// - `b.attention(cache, q, k, v, out, seqs, n_heads, n_kv_heads, head_size)`: stores the
///   batch's k and v rows ([tokens x kv_dim], after RoPE) into rows pos0.. of each slice's
///   sequence in `cache`, then causal grouped-query attention: row t of a slice attends to its
///   sequence's cache rows 0..pos0 + t, query head h reads KV head h / (n_heads / n_kv_heads),
///   scores q.k / sqrt(head_size), softmax with the maximum subtracted, weighted sum of V rows;
///   q, out [tokens x n_heads*head_size] (out must not alias q), tokens = packed_rows(seqs). The
///   caller guarantees pos0 + tokens <= capacity[seq] (stages check it on the host).
/// - `b.swiglu(gate, up, n)`: gate[i] = silu(gate[i]) * up[i], silu(x) = x / (1 + exp(-x)).
///
/// Sampling stays on the host (model::Sampler over the downloaded logits), so greedy and seeded
/// sampling are the same on every backend.
template <class B>
concept Backend =
    std::movable<B> && std::movable<typename B::Buffer> &&
    requires(B& b, const B& cb, typename B::Buffer& buf, std::size_t bytes, void* dst,
             const void* src, model::WeightMatrix w, const float* cx, float* x,
             const std::int32_t* ids, std::int64_t n, int heads, float f, bool accumulate,
             const KvCacheView& cache, std::span<const SequenceSlice> seqs) {
      { B::host_memory } -> std::convertible_to<bool>;
      { b.allocate(bytes) } -> std::same_as<typename B::Buffer>;
      { buf.data() } -> std::same_as<void*>;
      { buf.size() } -> std::same_as<std::size_t>;
      b.upload(dst, src, bytes);
      b.download(dst, src, bytes);
      b.copy(dst, src, bytes);
      b.synchronize();
      { b.upload_weight(w, n, n) } -> std::same_as<model::WeightMatrix>;
      { cb.kv_cache_dtype() } -> std::same_as<DType>;
      b.embedding(w, ids, x, n, n);
      b.rmsnorm(cx, cx, x, n, n, f);
      b.matmul_wt(cx, w, x, n, n, n, accumulate);
      b.rope(x, x, ids, n, heads, heads, heads, f);
      b.attention(cache, cx, cx, cx, x, seqs, heads, heads, heads);
      b.swiglu(x, cx, n);
    };

/// The nine weight-gradient tensors of one decoder layer, in model::DecoderWeights order
/// (rms_att [dim], wq [dim x dim], wk [kv_dim x dim], wv [kv_dim x dim], wo [dim x dim],
/// rms_ffn [dim], w1 [hidden x dim], w2 [dim x hidden], w3 [hidden x dim]), float32 in the
/// backend's memory. The training stage owns them; backward-weight passes add into them.
using DecoderGradTensors = std::array<float*, 9>;

/// A Backend that also trains: the layer-level forward-with-stash and backward passes
/// runtime::TrainStage<B> runs, with the backward split into backward-input (BI) and
/// backward-weight (BW) for the zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline
/// Parallelism", section 2). Every pointer is the backend's memory (B::host_memory says whether
/// that is the host's): the parameters the stage keeps there, the micro-batch's activations and
/// gradients, token ids and targets; the sequence offsets are host memory. The training stage
/// keeps float32 master parameters and gradients in host memory too (the optimizer and the
/// checkpoints read them there; on a device backend it downloads the gradients after a step and
/// uploads the parameters after an update: runtime::TrainStage). Models: cpu::CpuBackend (its
/// members forward to brigade/backend/cpu_train.hpp: shapes, offsets and errors documented
/// there) and cuda::CudaBackend (the same math on a GPU, docs/cuda.md).
///
/// - `B::DecoderActivations`, `B::HeadActivations`: a micro-batch's stash between F, BI and BW,
///   each with `bytes()` (capacity held, in the backend's memory and the host's) and, for the
///   decoder's, `clear()`.
/// - `B::TrainScratch`: reusable work buffers.
/// - `b.fill_zero(dst, bytes)`: sets `bytes` bytes of backend memory to zero (gradients).
/// - `b.decoder_train_forward(config, w, x_in, x_out, tokens, offsets, acts, scratch)`: one
///   layer's forward over packed training sequences (offsets as cu_seqlens, host memory, every
///   sequence from position 0), stashing what the backward needs; w's tensors in backend memory.
/// - `b.decoder_backward_input(config, w, acts, dy, dx, scratch)` (BI) and
///   `b.decoder_backward_weight(config, acts, grads)` (BW, adds into the DecoderGradTensors).
/// - `b.head_forward_backward_input(config, rms_final, wcls, x, targets, tokens, dx, head,
///   denominator) -> cpu::CrossEntropyLoss`: final norm, classifier, cross-entropy over the
///   targets (pad -1 excluded, divided by `denominator`) and their backward-input;
///   `b.head_backward_weight(config, head, d_rms_final, d_wcls)`.
/// - `b.embedding_backward(dy, ids, dtable, tokens, dim, vocab)`: the lookup's scatter-add.
template <class B>
concept TrainingBackend =
    Backend<B> &&
    requires(B& b, const model::LlamaConfig& config, const model::DecoderWeights& w,
             const float* cx, float* x, void* dst, std::size_t bytes, std::int64_t n,
             std::span<const std::int64_t> offsets, typename B::DecoderActivations& acts,
             typename B::HeadActivations& head, const DecoderGradTensors& grads,
             typename B::TrainScratch* scratch, const std::int32_t* ids, double denominator) {
      { acts.bytes() } -> std::same_as<std::size_t>;
      acts.clear();
      { head.bytes() } -> std::same_as<std::size_t>;
      b.fill_zero(dst, bytes);
      b.decoder_train_forward(config, w, cx, x, n, offsets, acts, scratch);
      b.decoder_backward_input(config, w, acts, cx, x, scratch);
      b.decoder_backward_weight(config, acts, grads);
      b.head_forward_backward_input(config, cx, cx, cx, ids, n, x, head, denominator);
      b.head_backward_weight(config, head, x, x);
      b.embedding_backward(cx, ids, x, n, n, n);
    };

}  // namespace v0
}  // namespace brigade::backend
