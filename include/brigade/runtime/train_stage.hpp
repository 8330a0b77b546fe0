// TrainStage: the runtime owner of one (virtual) stage's layers for training: its parameters,
// their gradients, and each micro-batch's stashed activations between forward and backward.
#pragma once

#include "brigade/backend/cpu.hpp"
#include "brigade/backend/cpu_train.hpp"
#include "brigade/data/corpus.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/weights.hpp"
#include "brigade/partition/partition.hpp"

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace brigade::runtime {
inline namespace v0 {

/// A named parameter tensor of a stage with its gradient, for optimizers and checkpoints.
struct ParamRef {
  /// "tok_embeddings", "layers.D.{attention_norm,wq,wk,wv,wo,ffn_norm,w1,w2,w3}", "norm", "output"
  std::string name;
  float* value = nullptr;      ///< [size] the stage's copy of the parameter
  float* grad = nullptr;       ///< [size] its gradient, accumulated over micro-batches
  std::int64_t size = 0;
  bool decay = true;           ///< a matrix (weight decay applies), false for norm gains
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
class TrainStage {
 public:
  /// Copies the parameters of its layers out of `init` (the float32 master weights).
  /// @throws brigade::Error{InvalidArgument} if the range splits the final norm, LM head and
  ///         loss across stages, or lies outside the model; if a matrix of `init` is not F32
  ///         (model::require_f32 names it: F16/BF16/Q8_0 models are for inference only)
  TrainStage(const model::LlamaWeights& init, partition::StageRange range);

  /// Forward of micro-batch `mb`. Input: `batch.inputs` when the stage holds the embedding, else
  /// `x_in` ([rows x dim]). Output: [rows x dim] activations (output()), or, on the tail stage,
  /// the loss (loss(mb)) with the head's backward-input already done.
  /// @throws brigade::Error{InvalidArgument} if x_in is missing or the batch is malformed
  /// @throws brigade::Error{NonFinite} naming the stage, micro-batch, layer, row and column when
  ///         a decoder's output holds NaN or infinity, or naming the loss when it is not finite
  void forward(int mb, const data::PackedBatch& batch, const float* x_in, double grad_denominator,
               bool keep_activations = true);
  /// Re-runs the forward of `mb` from its stashed input (after forward(..., false)).
  /// @throws brigade::Error{InvalidUsage} if mb has no stashed input
  void recompute(int mb);
  /// Backward-input of `mb`: dy ([rows x dim], the gradient of this stage's output; nullptr on the
  /// tail stage) to the gradient of its input (grad_input(mb); empty on the first stage).
  /// @throws brigade::Error{InvalidUsage} if mb has not been forwarded
  /// @throws brigade::Error{NonFinite} when the input gradient holds NaN or infinity
  void backward_input(int mb, const float* dy);
  /// Backward-weight of `mb`: adds its weight gradients, then frees its stash.
  /// @throws brigade::Error{InvalidUsage} if backward_input(mb) has not run
  void backward_weight(int mb);
  /// Backward-weight of a dropped micro-batch (one an integrity check flagged,
  /// transport::kFlagDropped): frees its stash as backward_weight does but adds nothing to the
  /// weight gradients. loss(mb) and grad_input(mb) stay readable.
  /// @throws brigade::Error{InvalidUsage} if backward_input(mb) has not run
  void skip_backward_weight(int mb);

  /// [rows x dim] output activations of `mb` (valid after forward until released).
  [[nodiscard]] std::span<const float> output(int mb) const;
  /// [rows x dim] gradient of `mb`'s input (valid after backward_input until released).
  [[nodiscard]] std::span<const float> grad_input(int mb) const;
  /// Drops `mb`'s output buffer (after it was sent or consumed).
  void release_output(int mb);
  /// Drops `mb`'s input-gradient buffer.
  void release_grad_input(int mb);
  /// Summed loss and counted targets of `mb` (tail stage only; zero elsewhere).
  [[nodiscard]] cpu::CrossEntropyLoss loss(int mb) const;
  /// Loss of every micro-batch forwarded since zero_grad(), summed.
  [[nodiscard]] cpu::CrossEntropyLoss total_loss() const;

  /// Sets every gradient to zero and forgets the micro-batches of the last step.
  void zero_grad();
  /// Forgets the micro-batches (stashes, losses) but keeps the gradients.
  void clear_microbatches() {
    micro_.clear();
    held_bytes_ = 0;
  }
  /// The stage's parameters with their gradients, in ModelSpec order. The token embedding is
  /// "tok_embeddings"; on the tail stage with a shared classifier the classifier is also named
  /// "tok_embeddings" (the engine sums the two gradients; both copies get the same update).
  [[nodiscard]] std::vector<ParamRef> params();
  /// Copies this stage's parameters into `out`, keyed by ParamRef::name.
  void export_to(std::map<std::string, std::vector<float>>& out) const;
  /// Bytes this stage holds for its micro-batches right now (all of them): the capacities of
  /// their stashes (cpu::DecoderActivations, cpu::HeadActivations, the input kept for a
  /// RECOMPUTE, the embedding's output gradient) and of the outputs and input gradients not yet
  /// released (release_output, release_grad_input). Not counted: parameters, gradients, kernel
  /// scratch. A running counter, updated by every call that changes a micro-batch: O(1).
  [[nodiscard]] std::size_t held_bytes() const noexcept { return held_bytes_; }

  [[nodiscard]] const partition::StageRange& range() const noexcept { return range_; }
  [[nodiscard]] bool has_embedding() const noexcept { return range_.first == 0; }
  [[nodiscard]] bool has_head() const noexcept { return has_head_; }

 private:
  struct Micro {
    const data::PackedBatch* batch = nullptr;
    double denominator = 1.0;
    std::vector<float> input;                  // stashed input (non-embedding stages)
    std::vector<float> output;                 // forward output / head dx
    std::vector<cpu::DecoderActivations> acts; // per owned decoder
    cpu::HeadActivations head;
    std::vector<float> grad_in;                // gradient of the input
    std::vector<float> emb_dy;                 // gradient at the embedding output
    cpu::CrossEntropyLoss loss;
    bool forwarded = false, full = false, bi_done = false;
  };
  Micro& micro(int mb, const char* what);
  const Micro& micro(int mb, const char* what) const;
  static std::size_t bytes_of(const Micro& m) noexcept;
  /// Runs `f` and moves held_bytes_ by the change of micro-batch mb's bytes (also on a throw).
  template <class F>
  void accounted(int mb, F&& f);
  void run_forward(int mb, Micro& m, const float* x_in);
  /// backward_weight (accumulate) or skip_backward_weight (not): frees the stash after.
  void finish_backward_weight(int mb, bool accumulate);

  model::LlamaConfig config_;
  partition::StageRange range_;
  int first_decoder_ = 0, num_decoders_ = 0;
  bool has_head_ = false;
  std::vector<float> embedding_, rms_final_, wcls_;
  std::vector<std::vector<float>> decoder_params_;  // per decoder: 9 tensors flattened in order
  std::vector<model::DecoderWeights> decoders_;
  std::vector<float> d_embedding_, d_rms_final_, d_wcls_;
  std::vector<cpu::DecoderGrads> d_decoders_;
  cpu::DecoderTrainScratch scratch_;
  std::map<int, Micro> micro_;
  std::size_t held_bytes_ = 0;  // sum of bytes_of() over micro_
};

}  // namespace v0
}  // namespace brigade::runtime
