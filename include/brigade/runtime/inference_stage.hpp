// InferenceStage: the runtime owner of one stage's layer range for serving (prefill and decode).
#pragma once

#include "brigade/backend/cpu.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/sampler.hpp"
#include "brigade/model/weights.hpp"
#include "brigade/partition/partition.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

namespace brigade::runtime {
inline namespace v0 {

/// One sequence's part of a micro-batch.
struct SeqEntry {
  std::int32_t seq = 0;     ///< sequence id in [0, num_sequences)
  std::int32_t pos0 = 0;    ///< absolute position of its first new token
  std::int32_t tokens = 0;  ///< new tokens (the prompt length at prefill, 1 at decode)
};

/// A micro-batch as it moves down the pipeline: which sequences it holds, and its payload in the
/// form the next layer expects.
///
/// Before the embedding layer the payload is `token_ids` ([rows] ids); between the embedding and
/// the final norm it is the residual stream `act` [rows x dim] with rows = sum of tokens, packed
/// sequence after sequence; after the final norm only each sequence's last row is kept
/// ([n_seq x dim]); after the LM head `act` holds logits [n_seq x vocab]; after the sampler
/// `sampled` holds one token per sequence.
struct Microbatch {
  int id = 0;                          ///< micro-batch id
  std::vector<SeqEntry> seqs;          ///< sequences in row order
  int next_layer = 0;                  ///< ModelSpec layer this micro-batch enters next
  std::vector<std::int32_t> token_ids; ///< [rows] input ids (before the embedding)
  std::vector<float> act;              ///< [rows x width] row-major activations
  std::int64_t rows = 0;               ///< rows of `act`
  std::int64_t width = 0;              ///< columns of `act`
  std::vector<std::int32_t> sampled;   ///< [n_seq] sampled tokens (after the sampler)

  /// True when some sequence starts at position 0 (a prompt's prefill).
  [[nodiscard]] bool is_prefill() const noexcept {
    for (const auto& s : seqs)
      if (s.pos0 == 0) return true;
    return false;
  }
  /// Sum of new tokens over the sequences.
  [[nodiscard]] std::int64_t num_tokens() const noexcept {
    std::int64_t n = 0;
    for (const auto& s : seqs) n += s.tokens;
    return n;
  }
};

/// Runs the ModelSpec layers [range.first, range.last) of a Llama model on micro-batches, holding
/// the KV cache of every sequence for its decoder layers and, when it owns the sampler layer, one
/// Sampler per sequence (sequence i seeded with config.seed + i, so a single sequence samples as
/// llama2.c's run.c does with that seed).
class InferenceStage {
 public:
  /// @param weights    the model (shared, read-only)
  /// @param range      the layers this stage owns
  /// @param capacities KV-cache rows to reserve per sequence (its maximum positions)
  /// @param sampler    sampling settings (used only when the stage owns the sampler layer)
  /// @throws brigade::Error{InvalidArgument} if the range is outside the model or a capacity
  ///         exceeds the model's seq_len
  InferenceStage(const model::LlamaWeights& weights, partition::StageRange range,
                 std::span<const int> capacities, const model::SamplerConfig& sampler);

  /// Runs this stage's layers on `mb` in place, up to but not including the sampler layer:
  /// mb.next_layer must equal range().first; on return it equals range().last (or the sampler
  /// layer's index when the stage owns it: sample() runs that layer) and the payload has the
  /// form that layer expects.
  /// @throws brigade::Error{InvalidArgument} if mb enters at another layer, a sequence id is out
  ///         of range, or a position would exceed the sequence's KV capacity
  /// @throws brigade::Error{NonFinite} when a layer's output (activations, or the LM head's
  ///         logits) holds NaN or infinity, naming the stage's layer range, the micro-batch, the
  ///         layer, the sequence and position of the row and the column (every layer's output
  ///         is scanned once: docs/benchmarks.md has the cost)
  void forward(Microbatch& mb);

  /// Runs the sampler layer on `mb` (after forward() on the stage that owns it): one token per
  /// sequence from its logits ([n_seq x vocab]) into mb.sampled, with that sequence's Sampler.
  /// @throws brigade::Error{InvalidArgument} if the stage does not own the sampler or `mb` is
  ///         not at the sampler layer with [n_seq x vocab] logits
  void sample(Microbatch& mb);

  [[nodiscard]] const partition::StageRange& range() const noexcept { return range_; }
  /// True when the stage holds layer 0 (embedding).
  [[nodiscard]] bool owns_embedding() const noexcept { return range_.first == 0; }
  /// True when the stage holds the last layer (sampler).
  [[nodiscard]] bool owns_sampler() const noexcept { return range_.last == num_layers_; }
  /// Number of sequences the stage holds KV caches (and samplers) for.
  [[nodiscard]] int num_sequences() const noexcept { return static_cast<int>(capacities_.size()); }
  /// Bytes held by this stage's KV cache.
  [[nodiscard]] std::size_t kv_cache_bytes() const noexcept;

  /// Bytes of this stage's weights as stored: every tensor of its layers (the embedding table,
  /// each decoder's nine tensors, the final norm gain, the classifier; the sampler has none),
  /// each matrix in its dtype (F16/BF16: 2 bytes per weight, Q8_0: 34 per 32).
  [[nodiscard]] std::size_t weight_bytes() const noexcept { return weight_bytes_; }

  /// PREFETCH (prima.cpp's mmap offload): when the weights are mapped from a file
  /// (LlamaWeights::mapped), madvise(MADV_WILLNEED) over the pages of this stage's tensors,
  /// which starts reading them into the page cache asynchronously and returns; the next
  /// forward takes whatever has not arrived by page faults. Owned weights are always resident:
  /// nothing is done.
  /// @return true when the kernel was advised, false for owned weights
  /// @throws brigade::Error{Internal} naming the range and errno if madvise fails
  bool prefetch_weights();
  /// RELEASE: when the weights are mapped, madvise(MADV_DONTNEED) over the pages of this
  /// stage's tensors: the process drops them (its resident set shrinks) and the next use reads
  /// them back from the page cache or the file, so results do not change. The ranges are
  /// rounded out to whole pages, so a neighbouring tensor sharing a page is dropped too (and
  /// read back the same way). Owned weights: nothing is done (dropping anonymous pages would
  /// zero them).
  /// @return true when the kernel was advised, false for owned weights
  /// @throws brigade::Error{Internal} naming the range and errno if madvise fails
  bool release_weights();

 private:
  float* k_cache(int decoder, int seq);
  float* v_cache(int decoder, int seq);

  /// madvise(advice) over every page range of weight_pages_; false for owned weights.
  bool advise_weights(int advice, const char* name);

  const model::LlamaWeights* weights_;
  std::vector<std::pair<std::uintptr_t, std::size_t>> weight_pages_;  // page-aligned (start, bytes)
  std::size_t weight_bytes_ = 0;
  model::ModelSpec spec_;
  partition::StageRange range_;
  int num_layers_;
  std::vector<int> capacities_;
  std::vector<std::int64_t> cache_offsets_;      // per sequence, into one layer's cache
  std::int64_t cache_rows_total_ = 0;            // sum of capacities
  std::vector<std::vector<float>> kv_;           // per owned decoder layer: K then V
  int first_decoder_ = 0;                        // first owned decoder index
  std::vector<model::Sampler> samplers_;
  cpu::DecoderScratch scratch_;
  std::vector<float> tmp_;
};

}  // namespace v0
}  // namespace brigade::runtime
