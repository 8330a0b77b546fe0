// TrainStage: the runtime owner of one (virtual) stage's layers for training: its parameters,
// their gradients, and each micro-batch's stashed activations between forward and backward.
#pragma once

#include "brigade/backend/backend.hpp"
#include "brigade/backend/cpu_backend.hpp"
#include "brigade/backend/decoder.hpp"
#include "brigade/core/finite.hpp"
#include "brigade/data/corpus.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/weights.hpp"
#include "brigade/partition/partition.hpp"
#include "brigade/tp/tensor_parallel.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace brigade::runtime {
inline namespace v0 {

/// How a parameter of a stage is split over the stage's tensor-parallel group (Megatron-LM,
/// Shoeybi et al. 2019, §3; brigade/tp/tensor_parallel.hpp has the split). Every slice is one
/// contiguous block, the same size on every rank, rank r's at offset r (rows or columns).
enum class ParamSplit : std::uint8_t {
  Whole,    ///< the whole tensor on every rank (norm gains; everything without TP)
  Rows,     ///< rows [r rows, (r + 1) rows) of a [shards x rows, cols] tensor (Wq, Wk, Wv, W1,
            ///< W3 by heads and MLP rows; the embedding and the classifier by vocabulary rows)
  Columns,  ///< columns [r cols, (r + 1) cols) of every row of a [rows, shards x cols] tensor
            ///< (Wo by heads, W2 by MLP rows)
};

/// A named parameter tensor of a stage with its gradient, for optimizers and checkpoints.
struct ParamRef {
  /// "tok_embeddings", "layers.D.{attention_norm,wq,wk,wv,wo,ffn_norm,w1,w2,w3}", "norm", "output"
  std::string name;
  float* value = nullptr;      ///< [size] the stage's copy of the parameter (its shard)
  float* grad = nullptr;       ///< [size] its gradient, accumulated over micro-batches
  std::int64_t size = 0;
  bool decay = true;           ///< a matrix (weight decay applies), false for norm gains
  ParamSplit split = ParamSplit::Whole;  ///< how the tensor is split over the TP group
  std::int64_t rows = 1;       ///< rows of the slice held here (rows x cols = size; a gain: 1)
  std::int64_t cols = 0;       ///< columns of the slice held here
  int shard = 0;               ///< this stage's TP rank
  int shards = 1;              ///< the TP degree
  /// Rows of the whole tensor.
  [[nodiscard]] std::int64_t full_rows() const noexcept {
    return split == ParamSplit::Rows ? rows * shards : rows;
  }
  /// Columns of the whole tensor.
  [[nodiscard]] std::int64_t full_cols() const noexcept {
    return split == ParamSplit::Columns ? cols * shards : cols;
  }
  /// Elements of the whole tensor (size for a Whole one).
  [[nodiscard]] std::int64_t full_size() const noexcept { return full_rows() * full_cols(); }
  /// True for a whole tensor held by every rank of a TP group of more than one (the norm gains):
  /// its gradient is the same on every rank, so the global norm counts it on rank 0 only.
  [[nodiscard]] bool replicated() const noexcept {
    return split == ParamSplit::Whole && shards > 1;
  }
};

/// Copies rank `shard`'s slice of a whole tensor: out ([p.size]) = the slice of `full`
/// ([p.full_rows() x p.full_cols()], row-major) that rank holds under p's split.
inline void take_shard(const ParamRef& p, int shard, const float* full, float* out) {
  const auto r = static_cast<std::int64_t>(shard);
  switch (p.split) {
    case ParamSplit::Whole:
      std::copy_n(full, p.size, out);
      break;
    case ParamSplit::Rows:
      std::copy_n(full + r * p.rows * p.cols, p.size, out);
      break;
    case ParamSplit::Columns:
      for (std::int64_t i = 0; i < p.rows; ++i)
        std::copy_n(full + i * p.full_cols() + r * p.cols, p.cols, out + i * p.cols);
      break;
  }
}

/// The inverse of take_shard: writes rank `shard`'s slice `in` ([p.size]) into its place in
/// `full` ([p.full_rows() x p.full_cols()]). Called for every rank, it assembles the tensor.
inline void place_shard(const ParamRef& p, int shard, const float* in, float* full) {
  const auto r = static_cast<std::int64_t>(shard);
  switch (p.split) {
    case ParamSplit::Whole:
      std::copy_n(in, p.size, full);
      break;
    case ParamSplit::Rows:
      std::copy_n(in, p.size, full + r * p.rows * p.cols);
      break;
    case ParamSplit::Columns:
      for (std::int64_t i = 0; i < p.rows; ++i)
        std::copy_n(in + i * p.cols, p.cols, full + i * p.full_cols() + r * p.cols);
      break;
  }
}

/// What the training engines and the executor call on a stage, whatever its backend: the type
/// erasure at the edge where the engines hold their stages (runtime::TrainStage<B> is the one
/// model). Each member is documented at TrainStage.
class TrainStageBase {
 public:
  virtual ~TrainStageBase() = default;
  virtual void forward(int mb, const data::PackedBatch& batch, const float* x_in,
                       double grad_denominator, bool keep_activations = true) = 0;
  virtual void recompute(int mb) = 0;
  virtual void backward_input(int mb, const float* dy) = 0;
  virtual void backward_weight(int mb) = 0;
  virtual void skip_backward_weight(int mb) = 0;
  [[nodiscard]] virtual std::span<const float> output(int mb) const = 0;
  [[nodiscard]] virtual std::span<const float> grad_input(int mb) const = 0;
  virtual void release_output(int mb) = 0;
  virtual void release_grad_input(int mb) = 0;
  [[nodiscard]] virtual cpu::CrossEntropyLoss loss(int mb) const = 0;
  [[nodiscard]] virtual cpu::CrossEntropyLoss total_loss() const = 0;
  [[nodiscard]] virtual const std::vector<cpu::CrossEntropyLoss>& task_loss(int mb) const = 0;
  virtual void zero_grad() = 0;
  virtual void clear_microbatches() = 0;
  virtual void download_gradients() = 0;
  virtual void upload_parameters() = 0;
  [[nodiscard]] virtual std::vector<ParamRef> params() = 0;
  virtual void export_to(std::map<std::string, std::vector<float>>& out) const = 0;
  [[nodiscard]] virtual std::size_t held_bytes() const noexcept = 0;
  [[nodiscard]] virtual const partition::StageRange& range() const noexcept = 0;
  [[nodiscard]] virtual bool has_embedding() const noexcept = 0;
  [[nodiscard]] virtual bool has_head() const noexcept = 0;
};

/// One virtual stage of a training pipeline: ModelSpec layers [range.first, range.last).
///
/// In training the tail layers (final norm, LM head, and the loss in place of the sampler) must
/// sit on one stage; the loss is the cross-entropy of every packed row against its next token,
/// summed and divided by `grad_denominator` (the step's total target count, so accumulating
/// micro-batches gives the gradient of the mean over the whole step).
///
/// Per micro-batch it stashes what the backward needs: F fills it, BI turns it into what BW needs,
/// BW releases it. With `keep_activations = false`, F keeps only the stage's input and RECOMPUTE
/// rebuilds the rest before the backward (activation checkpointing at stage granularity).
///
/// The layers run on backend B (a backend::TrainingBackend: its embedding and its layer-level
/// training passes). The float32 master parameters and their gradients as params() gives them
/// are host memory (the optimizer, the gradient reductions and the checkpoints read them there),
/// and so are output() and grad_input() (what every Transport carries).
///
/// On a host-memory backend (cpu::CpuBackend) the kernels work on those host tensors in place.
/// On a device backend (B::host_memory false, cuda::CudaBackend) the stage keeps a copy of every
/// parameter and a gradient accumulator for each in the backend's memory, and the micro-batch's
/// stashes there too; the edges are explicit:
/// - F uploads the micro-batch's input (token ids, or the received activations; targets on the
///   tail) and downloads the output (not on the tail, whose head gradient stays on the device);
///   BI uploads the output gradient and downloads the input gradient;
/// - download_gradients() copies the accumulated gradients to the host (the engines call it after
///   a step's last BW, run_training_program), upload_parameters() copies the host parameters to
///   the backend (after the optimizer's update).
/// That is the ZeRO-Offload split (Ren et al. 2021, "ZeRO-Offload", section 4: gradients to the
/// host, the AdamW update on the host, parameters back): per step 2 x 4 bytes per parameter over
/// the host link (stories260K: 2 MB; a 7B model on one stage: 56 GB, about 1.1 s at 50 GB/s) and
/// the host's optimizer time, against no device memory for AdamW's moments (docs/cuda.md).
///
/// The header holds the definitions, so a user's TrainingBackend instantiates it;
/// TrainStage<cpu::CpuBackend> (the default, the one the training engines run unless given a
/// TrainStageFactory) is compiled once, in the library; TrainStage<cuda::CudaBackend> is
/// instantiated by its users (they link brigade::cuda and brigade::brigade).
///
/// Tensor parallelism (a `tp` group of t > 1 members; Megatron-LM, Shoeybi et al. 2019, §3):
/// the stage is member tp->rank()'s share of the layers (tp::shard_of): Wq, Wk, Wv, W1, W3 by
/// rows and Wo, W2 by columns of its query heads, KV heads and MLP rows (ParamSplit), the
/// embedding and the classifier by vocabulary rows, the norm gains whole. Forward: two
/// all-reduces per decoder (after Wo and after W2), one after the vocabulary-parallel embedding
/// (each id's row comes from the one rank that holds it, zeros elsewhere); the head computes its
/// vocabulary shard of the logits and the vocabulary-parallel cross-entropy
/// (cpu::vocab_parallel_cross_entropy: all-reduces of the row maxima, of the sums of exps and
/// of the target logits, no rank gathers the logits). Backward: the input gradient of every
/// column-parallel block (Wq/Wk/Wv, W1/W3, the classifier) is all-reduced before the replicated
/// RMSNorm's backward (Megatron's f operator), the embedding's BW scatters into the rows its
/// shard holds. The residual stream, the stage's input and output and its input gradient are
/// whole and equal on every member; every weight gradient is local (params() describes each
/// slice), the norm gains' are equal on every member. Every member of the group runs the same
/// calls in the same order (the collectives pair by order), and the group must outlive the
/// stage. Host-memory backends only (cpu::CpuBackend); training refuses a KV head replicated
/// over ranks (tp::check_tensor_parallel_training).
template <backend::TrainingBackend B = cpu::CpuBackend>
class TrainStage final : public TrainStageBase {
 public:
  /// Copies the parameters of its layers out of `init` (the float32 master weights; with a TP
  /// group, this member's slices of them).
  /// @param backend the backend the layers run on (the stage owns it)
  /// @param tp      the stage's tensor-parallel group (null or of size 1: the whole layers)
  /// @throws brigade::Error{InvalidArgument} if the range splits the final norm, LM head and
  ///         loss across stages, or lies outside the model; if a matrix of `init` is not F32
  ///         (model::require_f32 names it: F16/BF16/Q8_0 models are for inference only); a TP
  ///         degree the model does not divide (tp::check_tensor_parallel_training: heads, KV
  ///         heads, hidden_dim, vocabulary), or a TP group on a backend whose memory is not the
  ///         host's or whose training passes take no split
  TrainStage(const model::LlamaWeights& init, partition::StageRange range, B backend = B{},
             tp::Group* tp = nullptr);

  /// Forward of micro-batch `mb`. Input: `batch.inputs` when the stage holds the embedding, else
  /// `x_in` ([rows x dim]). Output: [rows x dim] activations (output()), or, on the tail stage,
  /// the loss (loss(mb)) with the head's backward-input already done.
  /// @throws brigade::Error{InvalidArgument} if x_in is missing or the batch is malformed
  /// @throws brigade::Error{NonFinite} naming the stage, micro-batch, layer, row and column when
  ///         a decoder's output holds NaN or infinity, or naming the loss when it is not finite
  void forward(int mb, const data::PackedBatch& batch, const float* x_in, double grad_denominator,
               bool keep_activations = true) override;
  /// Re-runs the forward of `mb` from its stashed input (after forward(..., false)).
  /// @throws brigade::Error{InvalidUsage} if mb has no stashed input
  void recompute(int mb) override;
  /// Backward-input of `mb`: dy ([rows x dim], the gradient of this stage's output; nullptr on the
  /// tail stage) to the gradient of its input (grad_input(mb); empty on the first stage).
  /// @throws brigade::Error{InvalidUsage} if mb has not been forwarded
  /// @throws brigade::Error{NonFinite} when the input gradient holds NaN or infinity
  void backward_input(int mb, const float* dy) override;
  /// Backward-weight of `mb`: adds its weight gradients, then frees its stash.
  /// @throws brigade::Error{InvalidUsage} if backward_input(mb) has not run
  void backward_weight(int mb) override;
  /// Backward-weight of a dropped micro-batch (one an integrity check flagged,
  /// transport::kFlagDropped): frees its stash as backward_weight does but adds nothing to the
  /// weight gradients. loss(mb) and grad_input(mb) stay readable.
  /// @throws brigade::Error{InvalidUsage} if backward_input(mb) has not run
  void skip_backward_weight(int mb) override;

  /// [rows x dim] output activations of `mb` (valid after forward until released).
  [[nodiscard]] std::span<const float> output(int mb) const override;
  /// [rows x dim] gradient of `mb`'s input (valid after backward_input until released).
  [[nodiscard]] std::span<const float> grad_input(int mb) const override;
  /// Drops `mb`'s output buffer (after it was sent or consumed).
  void release_output(int mb) override;
  /// Drops `mb`'s input-gradient buffer.
  void release_grad_input(int mb) override;
  /// Summed loss and counted targets of `mb` (tail stage only; zero elsewhere).
  [[nodiscard]] cpu::CrossEntropyLoss loss(int mb) const override;
  /// Loss of every micro-batch forwarded since zero_grad(), summed.
  [[nodiscard]] cpu::CrossEntropyLoss total_loss() const override;
  /// Per task of `mb` (tail stage only; empty elsewhere, for a batch without tasks, or on a
  /// backend whose head_forward_backward_input takes no per-row loss output): [largest task id
  /// of the batch + 1], the summed loss and counted targets of the rows of each task span
  /// (PackedBatch::tasks, task_offsets), count 0 for a task the batch lacks. The sums add up to
  /// loss(mb) to rounding (the same row losses, summed per task), the counts exactly.
  [[nodiscard]] const std::vector<cpu::CrossEntropyLoss>& task_loss(int mb) const override;

  /// Sets every gradient to zero (host and backend) and forgets the micro-batches of the last
  /// step.
  void zero_grad() override;
  /// Forgets the micro-batches (stashes, losses) but keeps the gradients.
  void clear_microbatches() override {
    micro_.clear();
    held_bytes_ = 0;
  }
  /// Makes params()' gradients (host) those the backend accumulated: a download of every
  /// gradient tensor (4 bytes per parameter) on a device backend, nothing on a host backend.
  /// Call it after the step's last BW and before anything reads the gradients (the engines do,
  /// at the end of run_training_program).
  /// @throws brigade::Error from the backend (Cuda)
  void download_gradients() override;
  /// Makes the backend's parameters params()' values (host): an upload of every parameter on a
  /// device backend, nothing on a host backend. Call it after the host values changed (the
  /// engines do after every optimizer update).
  /// @throws brigade::Error from the backend (Cuda)
  void upload_parameters() override;
  /// The stage's parameters with their gradients, in ModelSpec order. The token embedding is
  /// "tok_embeddings"; on the tail stage with a shared classifier the classifier is also named
  /// "tok_embeddings" (the engine sums the two gradients; both copies get the same update).
  /// With a TP group each is this member's slice (ParamRef::split, shard, shards).
  [[nodiscard]] std::vector<ParamRef> params() override;
  /// Copies this stage's parameters (with TP: its slices) into `out`, keyed by ParamRef::name.
  void export_to(std::map<std::string, std::vector<float>>& out) const override;
  /// Bytes this stage holds for its micro-batches right now (all of them): the capacities of
  /// their stashes (B::DecoderActivations, B::HeadActivations, the input kept for a
  /// RECOMPUTE, the embedding's output gradient) and of the outputs and input gradients not yet
  /// released (release_output, release_grad_input), on a device backend also the micro-batch's
  /// rows, token ids and targets in its memory. Not counted: parameters, gradients, kernel
  /// scratch. A running counter, updated by every call that changes a micro-batch: O(1).
  [[nodiscard]] std::size_t held_bytes() const noexcept override { return held_bytes_; }

  [[nodiscard]] const partition::StageRange& range() const noexcept override { return range_; }
  [[nodiscard]] bool has_embedding() const noexcept override { return range_.first == 0; }
  [[nodiscard]] bool has_head() const noexcept override { return has_head_; }

 private:
  struct Micro {
    const data::PackedBatch* batch = nullptr;
    double denominator = 1.0;
    std::vector<float> input;                  // stashed input (non-embedding stages)
    std::vector<float> output;                 // forward output / head dx (host backend)
    std::vector<typename B::DecoderActivations> acts;  // per owned decoder
    typename B::HeadActivations head;
    std::vector<float> grad_in;                // gradient of the input
    std::vector<float> emb_dy;                 // gradient at the embedding output (host backend)
    // Device backend only: the rows in the backend's memory (the residual stream in F, the
    // gradient in BI; on the tail the head's dx between F and BI, on the first stage the
    // embedding's output gradient between BI and BW), the token ids and the targets.
    typename B::Buffer rows, ids, targets;
    cpu::CrossEntropyLoss loss;
    std::vector<cpu::CrossEntropyLoss> task_loss;  // [tasks] on the tail stage
    bool forwarded = false, full = false, bi_done = false;
  };
  /// A host tensor and its copy in the backend's memory (device backends only).
  struct Mirror {
    float* host = nullptr;
    typename B::Buffer dev;
    std::size_t bytes = 0;
  };
  /// Whether B's training passes take a TP split (cpu::CpuBackend's do).
  static constexpr bool kSplit =
      B::host_memory &&
      requires(B& be, const model::LlamaConfig& c, const model::DecoderWeights& w, const float* cx,
               float* x, std::int64_t n, std::span<const std::int64_t> off,
               typename B::DecoderActivations& a, typename B::HeadActivations& h,
               const backend::DecoderGradTensors& g, typename B::TrainScratch* sc,
               const std::int32_t* ids, double d, double* rl, const backend::DecoderSplit* s,
               const backend::VocabSplit* vs) {
        be.decoder_train_forward(c, w, cx, x, n, off, a, sc, s);
        be.decoder_backward_input(c, w, a, cx, x, sc, s);
        be.decoder_backward_weight(c, a, g, s);
        be.head_forward_backward_input(c, cx, cx, cx, ids, n, x, h, d, rl, vs);
        be.head_backward_weight(c, h, x, x, vs);
      };
  /// The nine tensors of a decoder here (kDecoderNames' order): split, rows, columns.
  struct TensorShape {
    ParamSplit split;
    std::int64_t rows, cols;
  };
  [[nodiscard]] std::array<TensorShape, 9> decoder_shapes() const;
  /// A ParamRef of this stage's TP slice (shard_, split_) with its shape.
  [[nodiscard]] ParamRef param(std::string name, float* value, float* grad, TensorShape shape,
                               bool decay) const;
  /// Vocabulary rows held here (the shard's with TP, else the vocabulary).
  [[nodiscard]] std::int64_t vocab_rows() const noexcept {
    return tp_ != nullptr ? shard_.vocab : config_.vocab_size;
  }
  /// Where the kernels read `v`: v itself on a host backend; else a new mirror in `list` holding
  /// a copy of v (`upload`) or zeros.
  float* on_backend(std::vector<float>& v, std::vector<Mirror>& list, bool upload);
  /// The backend's gradient tensors of owned decoder i.
  backend::DecoderGradTensors decoder_grads(int i);
  Micro& micro(int mb, const char* what);
  const Micro& micro(int mb, const char* what) const;
  static std::size_t bytes_of(const Micro& m) noexcept;
  /// Runs `f` and moves held_bytes_ by the change of micro-batch mb's bytes (also on a throw).
  template <class F>
  void accounted(int mb, F&& f);
  void run_forward(int mb, Micro& m, const float* x_in);
  /// backward_weight (accumulate) or skip_backward_weight (not): frees the stash after.
  void finish_backward_weight(int mb, bool accumulate);

  B b_;
  model::LlamaConfig config_;
  partition::StageRange range_;
  // Tensor parallelism (tp_ non-null with more than one member).
  tp::Group* tp_ = nullptr;
  tp::Shard shard_;              // whole (rank 0 of 1) without TP
  backend::DecoderSplit split_;  // the decoders' share and the group's all-reduce
  backend::VocabSplit vsplit_;   // the head's vocabulary shard and its all-reduces
  std::vector<std::int32_t> tp_ids_;  // the embedding's ids in this shard (relative)
  std::vector<std::int64_t> tp_rows_; // and their rows
  std::vector<float> tp_rows_buf_;    // their looked-up rows, or their gradients
  int first_decoder_ = 0, num_decoders_ = 0;
  bool has_head_ = false;
  // Host: the master parameters and the gradients params() hands out.
  std::vector<float> embedding_, rms_final_, wcls_;
  std::vector<std::vector<float>> decoder_params_;  // per decoder: 9 tensors flattened in order
  std::vector<float> d_embedding_, d_rms_final_, d_wcls_;
  std::vector<std::vector<float>> d_decoders_;  // per decoder: 9 gradients flattened in order
  // Where the kernels read and write them (the host tensors, or their mirrors).
  float* k_embedding_ = nullptr;
  float* k_rms_final_ = nullptr;
  float* k_wcls_ = nullptr;
  float* kg_embedding_ = nullptr;
  float* kg_rms_final_ = nullptr;
  float* kg_wcls_ = nullptr;
  std::vector<float*> kg_decoders_;
  std::vector<model::DecoderWeights> decoders_;  // views of the kernels' copies
  std::vector<Mirror> param_mirrors_, grad_mirrors_;  // device backends only
  typename B::TrainScratch scratch_;
  std::vector<double> row_loss_;  // [rows] the tail's per-row losses of the last forward
  std::map<int, Micro> micro_;
  std::size_t held_bytes_ = 0;  // sum of bytes_of() over micro_
};

// ---- definitions (here so that a user's TrainingBackend instantiates TrainStage) ------------

namespace detail {

/// The nine tensors of a decoder layer, in DecoderWeights order, as ParamRef names them.
inline constexpr std::array<const char*, 9> kDecoderNames = {
    "attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3"};

/// Checks a micro-batch's task spans: none (tasks and task_offsets empty), or tasks[i] >= 0 for
/// each span and task_offsets = 0, increasing, ..., rows (one more entry than tasks).
/// @throws brigade::Error{InvalidArgument} naming micro-batch `mb` and what is wrong
inline void check_task_spans(const data::PackedBatch& b, int mb) {
  if (b.tasks.empty() && b.task_offsets.empty()) return;
  BRIGADE_CHECK(b.task_offsets.size() == b.tasks.size() + 1 && b.task_offsets.front() == 0 &&
                    b.task_offsets.back() == b.rows(),
                Errc::InvalidArgument,
                "TrainStage: micro-batch {} has {} tasks and {} task offsets (from {} to {}); "
                "expected tasks + 1 offsets from 0 to its {} rows",
                mb, b.tasks.size(), b.task_offsets.size(),
                b.task_offsets.empty() ? -1 : b.task_offsets.front(),
                b.task_offsets.empty() ? -1 : b.task_offsets.back(), b.rows());
  for (std::size_t i = 0; i < b.tasks.size(); ++i) {
    BRIGADE_CHECK(b.tasks[i] >= 0, Errc::InvalidArgument,
                  "TrainStage: micro-batch {} task span {} has task {}, expected >= 0", mb, i,
                  b.tasks[i]);
    BRIGADE_CHECK(b.task_offsets[i] < b.task_offsets[i + 1], Errc::InvalidArgument,
                  "TrainStage: micro-batch {} task offset {} is {} after {}, expected increasing",
                  mb, i + 1, b.task_offsets[i + 1], b.task_offsets[i]);
  }
}

/// The nine float32 tensors of `w` (kDecoderNames' order).
/// @throws brigade::Error{InvalidArgument} if a matrix is not F32
inline std::array<const float*, 9> decoder_ptrs(const model::DecoderWeights& w) {
  return {w.rms_att,     w.wq.f32(), w.wk.f32(), w.wv.f32(), w.wo.f32(),
          w.rms_ffn, w.w1.f32(), w.w2.f32(), w.w3.f32()};
}

/// Stops training when a stage's activation or gradient holds a NaN or an infinity, naming the
/// stage (its layer range), the micro-batch, what was checked and the bad row (a token of the
/// packed micro-batch) and column. One read of the buffer (its cost: docs/benchmarks.md).
/// @throws brigade::Error{NonFinite}
inline void check_stage_buffer(const std::vector<float>& x, std::int64_t rows,
                               std::int64_t width, partition::StageRange range, int mb,
                               std::string_view what) {
  check_finite(
      x.data(), rows, width,
      [&] {
        return fmt::format("non-finite value in training: stage of layers [{}, {}), micro-batch "
                           "{}, {}",
                           range.first, range.last, mb, what);
      },
      [](std::int64_t row) { return fmt::format("row {} (token {} of the micro-batch)", row, row); });
}

}  // namespace detail

template <backend::TrainingBackend B>
std::array<typename TrainStage<B>::TensorShape, 9> TrainStage<B>::decoder_shapes() const {
  const std::int64_t d = config_.dim, hs = config_.head_size();
  const std::int64_t q = std::int64_t{shard_.n_heads} * hs, kv = std::int64_t{shard_.n_kv_heads} * hs,
                     h = shard_.hidden;
  using S = ParamSplit;
  return {{{S::Whole, 1, d}, {S::Rows, q, d}, {S::Rows, kv, d}, {S::Rows, kv, d},
           {S::Columns, d, q}, {S::Whole, 1, d}, {S::Rows, h, d}, {S::Columns, d, h},
           {S::Rows, h, d}}};
}

template <backend::TrainingBackend B>
ParamRef TrainStage<B>::param(std::string name, float* value, float* grad, TensorShape shape,
                              bool decay) const {
  ParamRef p;
  p.name = std::move(name);
  p.value = value;
  p.grad = grad;
  p.size = shape.rows * shape.cols;
  p.decay = decay;
  p.split = shard_.size > 1 ? shape.split : ParamSplit::Whole;
  p.rows = shape.rows;
  p.cols = shape.cols;
  p.shard = shard_.rank;
  p.shards = shard_.size;
  return p;
}

template <backend::TrainingBackend B>
TrainStage<B>::TrainStage(const model::LlamaWeights& init, partition::StageRange range,
                          B backend, tp::Group* tp)
    : b_(std::move(backend)), config_(init.config), range_(range) {
  model::require_f32(init, "TrainStage");  // the master weights are float32
  if (tp != nullptr && tp->size() > 1) {
    BRIGADE_CHECK(kSplit, Errc::InvalidArgument,
                  "TrainStage [{}, {}): tensor parallelism (TP {}) runs on backends whose memory "
                  "is the host's and whose training passes take a split (cpu::CpuBackend); this "
                  "backend's do not",
                  range.first, range.last, tp->size());
    tp::check_tensor_parallel_training(config_, tp->size());
    tp_ = tp;
    shard_ = tp::shard_of(config_, tp->rank(), tp->size());
    split_ = tp::decoder_split(shard_, *tp_);
    vsplit_ = tp::vocab_split(shard_, *tp_);
  } else {
    shard_ = tp::shard_of(config_, 0, 1);
  }
  const model::ModelSpec spec(config_);
  const int n = spec.num_layers();
  BRIGADE_CHECK(range.first >= 0 && range.first < range.last && range.last <= n,
                Errc::InvalidArgument, "TrainStage: layers [{}, {}) outside the model's [0, {})",
                range.first, range.last, n);
  const int L = config_.n_layers;
  const int tail_first = L + 1;  // FinalNorm
  const bool any_tail = range.last > tail_first;
  BRIGADE_CHECK(!any_tail || (range.first <= tail_first && range.last == n), Errc::InvalidArgument,
                "TrainStage: layers [{}, {}) split the final norm, LM head and loss (layers "
                "[{}, {})) across stages; training keeps them on one stage",
                range.first, range.last, tail_first, n);
  has_head_ = any_tail;
  const auto d = static_cast<std::size_t>(config_.dim);
  const TensorShape vocab_shape{ParamSplit::Rows, vocab_rows(), config_.dim};
  const auto vd = static_cast<std::size_t>(vocab_rows()) * d;
  // A vocabulary-parallel table: this member's rows of the whole one.
  const auto vocab_slice = [&](std::vector<float>& dst, const float* full) {
    dst.resize(vd);
    take_shard(param("", nullptr, nullptr, vocab_shape, true), shard_.rank, full, dst.data());
  };
  if (has_embedding()) {
    vocab_slice(embedding_, init.token_embedding.f32());
    d_embedding_.assign(vd, 0.0f);
  }
  first_decoder_ = std::max(0, range.first - 1);
  num_decoders_ = std::max(0, std::min(range.last, L + 1) - std::max(range.first, 1));
  const auto shapes = decoder_shapes();
  std::array<std::int64_t, 9> sizes{};
  for (std::size_t t = 0; t < 9; ++t) sizes[t] = shapes[t].rows * shapes[t].cols;
  for (int i = 0; i < num_decoders_; ++i) {
    const auto& src = init.layers[static_cast<std::size_t>(first_decoder_ + i)];
    const auto ptrs = detail::decoder_ptrs(src);
    std::int64_t total = 0;
    for (std::size_t t = 0; t < 9; ++t) total += sizes[t];
    std::vector<float> flat(static_cast<std::size_t>(total));  // exactly the nine tensors
    float* at = flat.data();
    for (std::size_t t = 0; t < 9; ++t) {
      take_shard(param("", nullptr, nullptr, shapes[t], true), shard_.rank, ptrs[t], at);
      at += sizes[t];
    }
    decoder_params_.push_back(std::move(flat));
  }
  for (auto& flat : decoder_params_) {
    model::DecoderWeights w;
    const float* p = on_backend(flat, param_mirrors_, true);
    std::size_t t = 0;
    auto next = [&] {  // the nine tensors in decoder_ptrs' order
      const float* q = p;
      p += sizes[t++];
      return q;
    };
    w.rms_att = next();
    w.wq = next();
    w.wk = next();
    w.wv = next();
    w.wo = next();
    w.rms_ffn = next();
    w.w1 = next();
    w.w2 = next();
    w.w3 = next();
    decoders_.push_back(w);
    d_decoders_.emplace_back(flat.size(), 0.0f);
  }
  for (auto& g : d_decoders_) kg_decoders_.push_back(on_backend(g, grad_mirrors_, false));
  if (has_head_) {
    rms_final_.assign(init.rms_final, init.rms_final + d);
    d_rms_final_.assign(d, 0.0f);
    if (!(config_.shared_classifier && has_embedding())) {
      vocab_slice(wcls_, init.wcls.f32());
      d_wcls_.assign(vd, 0.0f);
    }
  }
  k_embedding_ = on_backend(embedding_, param_mirrors_, true);
  k_rms_final_ = on_backend(rms_final_, param_mirrors_, true);
  k_wcls_ = on_backend(wcls_, param_mirrors_, true);
  kg_embedding_ = on_backend(d_embedding_, grad_mirrors_, false);
  kg_rms_final_ = on_backend(d_rms_final_, grad_mirrors_, false);
  kg_wcls_ = on_backend(d_wcls_, grad_mirrors_, false);
}

template <backend::TrainingBackend B>
float* TrainStage<B>::on_backend(std::vector<float>& v, std::vector<Mirror>& list, bool upload) {
  if (v.empty()) return nullptr;
  if constexpr (B::host_memory) {
    static_cast<void>(list);
    static_cast<void>(upload);
    return v.data();
  } else {
    Mirror m;
    m.host = v.data();
    m.bytes = v.size() * sizeof(float);
    m.dev = b_.allocate(m.bytes);
    if (upload)
      b_.upload(m.dev.data(), m.host, m.bytes);
    else
      b_.fill_zero(m.dev.data(), m.bytes);
    auto* at = static_cast<float*>(m.dev.data());
    list.push_back(std::move(m));
    return at;
  }
}

template <backend::TrainingBackend B>
backend::DecoderGradTensors TrainStage<B>::decoder_grads(int i) {
  const auto shapes = decoder_shapes();
  backend::DecoderGradTensors g{};
  float* p = kg_decoders_[static_cast<std::size_t>(i)];
  for (std::size_t t = 0; t < 9; ++t) {
    g[t] = p;
    p += shapes[t].rows * shapes[t].cols;
  }
  return g;
}

template <backend::TrainingBackend B>
void TrainStage<B>::download_gradients() {
  for (auto& m : grad_mirrors_) b_.download(m.host, m.dev.data(), m.bytes);
}

template <backend::TrainingBackend B>
void TrainStage<B>::upload_parameters() {
  for (auto& m : param_mirrors_) b_.upload(m.dev.data(), m.host, m.bytes);
  if (!param_mirrors_.empty()) b_.synchronize();
}

template <backend::TrainingBackend B>
typename TrainStage<B>::Micro& TrainStage<B>::micro(int mb, const char* what) {
  auto it = micro_.find(mb);
  BRIGADE_CHECK(it != micro_.end() && it->second.forwarded, Errc::InvalidUsage,
                "TrainStage [{}, {}): {} of micro-batch {} before its forward", range_.first,
                range_.last, what, mb);
  return it->second;
}

template <backend::TrainingBackend B>
const typename TrainStage<B>::Micro& TrainStage<B>::micro(int mb, const char* what) const {
  return const_cast<TrainStage<B>*>(this)->micro(mb, what);
}

template <backend::TrainingBackend B>
void TrainStage<B>::run_forward(int mb, Micro& m, const float* x_in) {
  const auto& b = *m.batch;
  const std::int64_t rows = b.rows();
  const auto dim = static_cast<std::int64_t>(config_.dim);
  const auto n = static_cast<std::size_t>(rows * dim);
  float* x = nullptr;  // the rows where the kernels run
  if constexpr (B::host_memory) {
    m.output.resize(n);
    x = m.output.data();
  } else {
    m.rows = b_.allocate(n * sizeof(float));
    x = static_cast<float*>(m.rows.data());
  }
  if (has_embedding()) {
    const std::int32_t* ids = b.inputs.data();
    if constexpr (!B::host_memory) {
      const std::size_t bytes = b.inputs.size() * sizeof(std::int32_t);
      m.ids = b_.allocate(bytes);
      b_.upload(m.ids.data(), ids, bytes);
      ids = static_cast<const std::int32_t*>(m.ids.data());
    }
    if (tp_ != nullptr) {
      // Vocabulary-parallel: this shard's rows, zeros for the other ids, summed over the group
      // (each row has one non-zero term: the looked-up row, exactly).
      tp::ids_in_shard(b.inputs, shard_, tp_ids_, tp_rows_);
      const auto k = static_cast<std::int64_t>(tp_ids_.size());
      tp_rows_buf_.resize(static_cast<std::size_t>(k * dim));
      b_.embedding(model::WeightMatrix(k_embedding_), tp_ids_.data(), tp_rows_buf_.data(), k, dim);
      std::fill(x, x + rows * dim, 0.0f);
      for (std::int64_t i = 0; i < k; ++i)
        std::copy_n(tp_rows_buf_.data() + i * dim, dim,
                    x + tp_rows_[static_cast<std::size_t>(i)] * dim);
      tp_->all_reduce(std::span<float>(x, n));
    } else {
      b_.embedding(model::WeightMatrix(k_embedding_), ids, x, rows, dim);
    }
  } else if constexpr (B::host_memory) {
    std::copy_n(x_in, rows * dim, x);
  } else {
    b_.upload(x, x_in, n * sizeof(float));
  }
  m.acts.resize(static_cast<std::size_t>(num_decoders_));
  for (int i = 0; i < num_decoders_; ++i) {
    const auto& w = decoders_[static_cast<std::size_t>(i)];
    auto& acts = m.acts[static_cast<std::size_t>(i)];
    if constexpr (kSplit) {
      b_.decoder_train_forward(config_, w, x, x, rows, b.offsets, acts, &scratch_,
                               tp_ != nullptr ? &split_ : nullptr);
    } else {
      b_.decoder_train_forward(config_, w, x, x, rows, b.offsets, acts, &scratch_);
    }
    if constexpr (B::host_memory) {
      const int d = first_decoder_ + i;
      detail::check_stage_buffer(m.output, rows, dim, range_, mb,
                                 fmt::format("output of layer {} (decoder {})", d + 1, d));
    }
  }
  if (has_head_) {
    const float* wcls = k_wcls_ != nullptr ? k_wcls_ : k_embedding_;
    const std::int32_t* targets = b.targets.data();
    if constexpr (!B::host_memory) {
      const std::size_t bytes = b.targets.size() * sizeof(std::int32_t);
      m.targets = b_.allocate(bytes);
      b_.upload(m.targets.data(), targets, bytes);
      targets = static_cast<const std::int32_t*>(m.targets.data());
    }
    // The tail runs its head backward-input right away: its rows then hold the gradient of the
    // head's input, and the loss is known after F, as on Megatron's last stage.
    // Per-row losses when the batch has tasks and the backend reports them into host memory
    // (per-task loss; CpuBackend does, CudaBackend's head has no per-row output yet).
    constexpr bool kRowLoss =
        B::host_memory &&
        requires(B& be, const model::LlamaConfig& c, const float* cx, float* xx,
                 const std::int32_t* ids, std::int64_t nn, typename B::HeadActivations& h,
                 double d, double* rl) {
          be.head_forward_backward_input(c, cx, cx, cx, ids, nn, xx, h, d, rl);
        };
    static_assert(kRowLoss || !std::is_same_v<B, cpu::CpuBackend>,
                  "CpuBackend reports per-row losses");
    double* row_loss = nullptr;
    if constexpr (kRowLoss) {
      if (!b.tasks.empty()) {
        row_loss_.resize(static_cast<std::size_t>(rows));
        row_loss = row_loss_.data();
      }
      if constexpr (kSplit) {
        m.loss = b_.head_forward_backward_input(config_, k_rms_final_, wcls, x, targets, rows, x,
                                                m.head, m.denominator, row_loss,
                                                tp_ != nullptr ? &vsplit_ : nullptr);
      } else {
        m.loss = b_.head_forward_backward_input(config_, k_rms_final_, wcls, x, targets, rows, x,
                                                m.head, m.denominator, row_loss);
      }
    } else {
      m.loss = b_.head_forward_backward_input(config_, k_rms_final_, wcls, x, targets, rows, x,
                                              m.head, m.denominator);
    }
    BRIGADE_CHECK(std::isfinite(m.loss.sum), Errc::NonFinite,
                  "non-finite value in training: stage of layers [{}, {}), micro-batch {}, the "
                  "loss is {} over {} tokens",
                  range_.first, range_.last, mb, m.loss.sum, m.loss.count);
    if (row_loss != nullptr) {
      m.task_loss.assign(
          static_cast<std::size_t>(*std::max_element(b.tasks.begin(), b.tasks.end())) + 1, {});
      for (std::size_t s = 0; s < b.tasks.size(); ++s) {
        auto& t = m.task_loss[static_cast<std::size_t>(b.tasks[s])];
        for (auto r = b.task_offsets[s]; r < b.task_offsets[s + 1]; ++r) {
          if (b.targets[static_cast<std::size_t>(r)] == -1) continue;
          t.sum += row_loss[r];
          ++t.count;
        }
      }
    }
  } else if constexpr (!B::host_memory) {
    // One download of the stage's output, checked once (naming the stage's last layer).
    m.output.resize(n);
    b_.download(m.output.data(), x, n * sizeof(float));
    m.rows = {};
    const int d = first_decoder_ + num_decoders_ - 1;
    detail::check_stage_buffer(m.output, rows, dim, range_, mb,
                               fmt::format("output of the stage (layer {})", d + 1));
  }
  m.full = true;
}

template <backend::TrainingBackend B>
void TrainStage<B>::forward(int mb, const data::PackedBatch& batch, const float* x_in,
                         double grad_denominator, bool keep_activations) {
  accounted(mb, [&] {
    BRIGADE_CHECK(has_embedding() || x_in != nullptr, Errc::InvalidArgument,
                  "TrainStage [{}, {}): forward of micro-batch {} without an input activation",
                  range_.first, range_.last, mb);
    BRIGADE_CHECK(batch.rows() >= 1 && batch.targets.size() == batch.inputs.size() &&
                      batch.offsets.size() >= 2 && batch.offsets.back() == batch.rows(),
                  Errc::InvalidArgument,
                  "TrainStage: micro-batch {} is malformed ({} inputs, {} targets, offsets ending "
                  "at {})",
                  mb, batch.inputs.size(), batch.targets.size(),
                  batch.offsets.empty() ? -1 : batch.offsets.back());
    detail::check_task_spans(batch, mb);
    if (has_embedding())
      for (std::size_t i = 0; i < batch.inputs.size(); ++i)
        BRIGADE_CHECK(batch.inputs[i] >= 0 && batch.inputs[i] < config_.vocab_size,
                      Errc::InvalidArgument,
                      "TrainStage: micro-batch {} row {} has token id {}, outside the vocabulary "
                      "[0, {})",
                      mb, i, batch.inputs[i], config_.vocab_size);
    BRIGADE_CHECK(grad_denominator > 0, Errc::InvalidArgument,
                  "TrainStage: gradient denominator {} <= 0", grad_denominator);
    Micro& m = micro_[mb];
    m = Micro{};
    m.batch = &batch;
    m.denominator = grad_denominator;
    m.forwarded = true;
    if (!keep_activations && !has_embedding())
      m.input.assign(x_in, x_in + batch.rows() * config_.dim);
    run_forward(mb, m, x_in);
    if (!keep_activations) {
      for (auto& a : m.acts) a.clear();
      m.head = {};
      m.full = false;
      if (has_head_) {  // the head's gradient is rebuilt by the recompute
        m.output = {};
        m.rows = {};
      }
    }
  });
}

template <backend::TrainingBackend B>
void TrainStage<B>::recompute(int mb) {
  accounted(mb, [&] {
    Micro& m = micro(mb, "RECOMPUTE");
    BRIGADE_CHECK(has_embedding() || !m.input.empty(), Errc::InvalidUsage,
                  "TrainStage [{}, {}): RECOMPUTE of micro-batch {} without a stashed input",
                  range_.first, range_.last, mb);
    std::vector<float> out = m.output;  // a non-tail output may already be released
    run_forward(mb, m, has_embedding() ? nullptr : m.input.data());
    if (!has_head_) m.output = std::move(out);
    m.input.clear();
    m.input.shrink_to_fit();
  });
}

template <backend::TrainingBackend B>
void TrainStage<B>::backward_input(int mb, const float* dy) {
  accounted(mb, [&] {
    Micro& m = micro(mb, "BI");
    BRIGADE_CHECK(m.full, Errc::InvalidUsage,
                  "TrainStage [{}, {}): BI of micro-batch {} whose activations were dropped and "
                  "not recomputed",
                  range_.first, range_.last, mb);
    BRIGADE_CHECK(has_head_ || dy != nullptr, Errc::InvalidArgument,
                  "TrainStage [{}, {}): BI of micro-batch {} without an output gradient",
                  range_.first, range_.last, mb);
    const std::int64_t rows = m.batch->rows();
    const auto n = static_cast<std::size_t>(rows * config_.dim);
    std::vector<float> g;  // host backend: the gradient rows
    float* x = nullptr;    // where the kernels run
    if constexpr (B::host_memory) {
      if (has_head_) {
        g = std::move(m.output);
      } else {
        g.assign(dy, dy + n);
      }
      x = g.data();
    } else {
      if (!has_head_) {  // the tail's rows already hold the head's gradient
        m.rows = b_.allocate(n * sizeof(float));
        b_.upload(m.rows.data(), dy, n * sizeof(float));
      }
      x = static_cast<float*>(m.rows.data());
    }
    m.output = {};
    for (int i = num_decoders_ - 1; i >= 0; --i) {
      const auto& w = decoders_[static_cast<std::size_t>(i)];
      auto& acts = m.acts[static_cast<std::size_t>(i)];
      if constexpr (kSplit)
        b_.decoder_backward_input(config_, w, acts, x, x, &scratch_,
                                  tp_ != nullptr ? &split_ : nullptr);
      else
        b_.decoder_backward_input(config_, w, acts, x, x, &scratch_);
    }
    if constexpr (!B::host_memory) {
      g.resize(n);
      b_.download(g.data(), x, n * sizeof(float));
    }
    detail::check_stage_buffer(g, rows, config_.dim, range_, mb, "gradient of the stage's input");
    if constexpr (B::host_memory) {
      (has_embedding() ? m.emb_dy : m.grad_in) = std::move(g);
    } else if (!has_embedding()) {  // the first stage keeps its rows for the embedding's BW
      m.grad_in = std::move(g);
      m.rows = {};
    }
    m.bi_done = true;
  });
}

template <backend::TrainingBackend B>
void TrainStage<B>::backward_weight(int mb) { finish_backward_weight(mb, true); }

template <backend::TrainingBackend B>
void TrainStage<B>::skip_backward_weight(int mb) { finish_backward_weight(mb, false); }

template <backend::TrainingBackend B>
void TrainStage<B>::finish_backward_weight(int mb, bool accumulate) {
  accounted(mb, [&] {
    Micro& m = micro(mb, "BW");
    BRIGADE_CHECK(m.bi_done, Errc::InvalidUsage,
                  "TrainStage [{}, {}): BW of micro-batch {} before its BI", range_.first,
                  range_.last, mb);
    for (int i = 0; accumulate && i < num_decoders_; ++i) {
      auto& acts = m.acts[static_cast<std::size_t>(i)];
      if constexpr (kSplit)
        b_.decoder_backward_weight(config_, acts, decoder_grads(i),
                                   tp_ != nullptr ? &split_ : nullptr);
      else
        b_.decoder_backward_weight(config_, acts, decoder_grads(i));
    }
    if (accumulate && has_head_) {
      float* d_wcls = kg_wcls_ != nullptr ? kg_wcls_ : kg_embedding_;
      if constexpr (kSplit)
        b_.head_backward_weight(config_, m.head, kg_rms_final_, d_wcls,
                                tp_ != nullptr ? &vsplit_ : nullptr);
      else
        b_.head_backward_weight(config_, m.head, kg_rms_final_, d_wcls);
    }
    if (accumulate && has_embedding()) {
      if constexpr (B::host_memory) {
        if (tp_ != nullptr) {
          // Vocabulary-parallel: each rank scatters the gradients of the ids its rows hold.
          const std::int64_t dim = config_.dim;
          tp::ids_in_shard(m.batch->inputs, shard_, tp_ids_, tp_rows_);
          const auto k = static_cast<std::int64_t>(tp_ids_.size());
          tp_rows_buf_.resize(static_cast<std::size_t>(k * dim));
          for (std::int64_t i = 0; i < k; ++i)
            std::copy_n(m.emb_dy.data() + tp_rows_[static_cast<std::size_t>(i)] * dim, dim,
                        tp_rows_buf_.data() + i * dim);
          b_.embedding_backward(tp_rows_buf_.data(), tp_ids_.data(), kg_embedding_, k, dim,
                                shard_.vocab);
        } else {
          b_.embedding_backward(m.emb_dy.data(), m.batch->inputs.data(), kg_embedding_,
                                m.batch->rows(), config_.dim, config_.vocab_size);
        }
      } else
        b_.embedding_backward(static_cast<const float*>(m.rows.data()),
                              static_cast<const std::int32_t*>(m.ids.data()), kg_embedding_,
                              m.batch->rows(), config_.dim, config_.vocab_size);
    }
    const auto loss = m.loss;
    const auto* batch = m.batch;
    auto grad_in = std::move(m.grad_in);
    auto task_loss = std::move(m.task_loss);
    m = Micro{};
    m.loss = loss;
    m.task_loss = std::move(task_loss);
    m.batch = batch;
    m.grad_in = std::move(grad_in);
    m.forwarded = true;  // keeps loss(), task_loss() and grad_input() readable until zero_grad()
  });
}

template <backend::TrainingBackend B>
std::span<const float> TrainStage<B>::output(int mb) const { return micro(mb, "output").output; }
template <backend::TrainingBackend B>
std::span<const float> TrainStage<B>::grad_input(int mb) const { return micro(mb, "grad_input").grad_in; }

template <backend::TrainingBackend B>
void TrainStage<B>::release_output(int mb) {
  accounted(mb, [&] {
    Micro& m = micro(mb, "release_output");
    if (!has_head_) {
      m.output.clear();
      m.output.shrink_to_fit();
    }
  });
}

template <backend::TrainingBackend B>
void TrainStage<B>::release_grad_input(int mb) {
  accounted(mb, [&] {
    Micro& m = micro(mb, "release_grad_input");
    m.grad_in.clear();
    m.grad_in.shrink_to_fit();
  });
}

template <backend::TrainingBackend B>
cpu::CrossEntropyLoss TrainStage<B>::loss(int mb) const { return micro(mb, "loss").loss; }

template <backend::TrainingBackend B>
const std::vector<cpu::CrossEntropyLoss>& TrainStage<B>::task_loss(int mb) const {
  return micro(mb, "task_loss").task_loss;
}

template <backend::TrainingBackend B>
cpu::CrossEntropyLoss TrainStage<B>::total_loss() const {
  cpu::CrossEntropyLoss t;
  for (const auto& [mb, m] : micro_) {
    t.sum += m.loss.sum;
    t.count += m.loss.count;
  }
  return t;
}

template <backend::TrainingBackend B>
void TrainStage<B>::zero_grad() {
  clear_microbatches();
  std::fill(d_embedding_.begin(), d_embedding_.end(), 0.0f);
  std::fill(d_rms_final_.begin(), d_rms_final_.end(), 0.0f);
  std::fill(d_wcls_.begin(), d_wcls_.end(), 0.0f);
  for (auto& g : d_decoders_) std::fill(g.begin(), g.end(), 0.0f);
  for (auto& m : grad_mirrors_) b_.fill_zero(m.dev.data(), m.bytes);
}

template <backend::TrainingBackend B>
std::vector<ParamRef> TrainStage<B>::params() {
  std::vector<ParamRef> out;
  const TensorShape vocab_shape{ParamSplit::Rows, vocab_rows(), config_.dim};
  if (has_embedding())
    out.push_back(param("tok_embeddings", embedding_.data(), d_embedding_.data(), vocab_shape,
                        true));
  const auto shapes = decoder_shapes();
  for (int i = 0; i < num_decoders_; ++i) {
    float* p = decoder_params_[static_cast<std::size_t>(i)].data();
    float* g = d_decoders_[static_cast<std::size_t>(i)].data();
    for (std::size_t t = 0; t < 9; ++t) {
      out.push_back(param(fmt::format("layers.{}.{}", first_decoder_ + i, detail::kDecoderNames[t]),
                          p, g, shapes[t], t != 0 && t != 5));
      p += shapes[t].rows * shapes[t].cols;
      g += shapes[t].rows * shapes[t].cols;
    }
  }
  if (has_head_) {
    out.push_back(param("norm", rms_final_.data(), d_rms_final_.data(),
                        {ParamSplit::Whole, 1, config_.dim}, false));
    if (!wcls_.empty())
      out.push_back(param(config_.shared_classifier ? "tok_embeddings" : "output", wcls_.data(),
                          d_wcls_.data(), vocab_shape, true));
  }
  return out;
}

template <backend::TrainingBackend B>
void TrainStage<B>::export_to(std::map<std::string, std::vector<float>>& out) const {
  for (auto& p : const_cast<TrainStage<B>*>(this)->params())
    out[p.name].assign(p.value, p.value + p.size);
}

template <backend::TrainingBackend B>
std::size_t TrainStage<B>::bytes_of(const Micro& m) noexcept {
  std::size_t b = (m.input.capacity() + m.output.capacity() + m.grad_in.capacity() +
                   m.emb_dy.capacity()) *
                  sizeof(float);
  b += m.head.bytes();
  for (const auto& a : m.acts) b += a.bytes();
  b += m.rows.size() + m.ids.size() + m.targets.size();
  return b;
}

template <backend::TrainingBackend B>
template <class F>
void TrainStage<B>::accounted(int mb, F&& f) {
  auto bytes_now = [&] {
    const auto it = micro_.find(mb);
    return it == micro_.end() ? std::size_t{0} : bytes_of(it->second);
  };
  struct Update {
    TrainStage<B>* self;
    decltype(bytes_now)& now;
    std::size_t before;
    ~Update() { self->held_bytes_ = self->held_bytes_ - before + now(); }
  } update{this, bytes_now, bytes_now()};
  f();
}

extern template class TrainStage<cpu::CpuBackend>;

/// Makes virtual stage v's TrainStage of layers `range` from the float32 master weights `init`,
/// as member tp->rank() of the TP group `tp` (null without tensor parallelism; pass it to the
/// TrainStage): how an engine puts its stages on a backend. The engines call it once per virtual
/// stage (and TP rank) they hold, on the constructing thread. An empty factory means
/// TrainStage<cpu::CpuBackend>.
using TrainStageFactory = std::function<std::unique_ptr<TrainStageBase>(
    const model::LlamaWeights& init, const partition::StageRange& range, int v, tp::Group* tp)>;

/// A TrainStageFactory whose stage v runs on `make_backend(v)` (a backend::TrainingBackend, by
/// value), e.g. `train_stages_on([](int v) { return cuda::CudaBackend({.device = v % gpus}); })`.
/// A factory that shares state between its backends must make it safe across rank threads.
template <class MakeBackend>
  requires backend::TrainingBackend<std::invoke_result_t<MakeBackend&, int>>
TrainStageFactory train_stages_on(MakeBackend make_backend) {
  return [make_backend](const model::LlamaWeights& init, const partition::StageRange& range,
                        int v, tp::Group* tp) mutable -> std::unique_ptr<TrainStageBase> {
    using B = std::invoke_result_t<MakeBackend&, int>;
    return std::make_unique<TrainStage<B>>(init, range, make_backend(v), tp);
  };
}

/// factory(init, range, v, tp), or a TrainStage<cpu::CpuBackend> when the factory is empty.
/// @throws brigade::Error as TrainStage's constructor, or what the factory throws
inline std::unique_ptr<TrainStageBase> make_train_stage(const TrainStageFactory& factory,
                                                        const model::LlamaWeights& init,
                                                        const partition::StageRange& range, int v,
                                                        tp::Group* tp = nullptr) {
  if (factory) return factory(init, range, v, tp);
  return std::make_unique<TrainStage<cpu::CpuBackend>>(init, range, cpu::CpuBackend{}, tp);
}

}  // namespace v0
}  // namespace brigade::runtime
