// InferenceStage: the runtime owner of one stage's layer range for serving (prefill and decode).
#pragma once

#include "brigade/backend/backend.hpp"
#include "brigade/backend/cpu_backend.hpp"
#include "brigade/backend/decoder.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/sampler.hpp"
#include "brigade/model/weights.hpp"
#include "brigade/partition/partition.hpp"
#include "brigade/tp/tensor_parallel.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

namespace brigade::runtime {
inline namespace v0 {

/// Where one sequence's KV cache lives in a stage's pool: rows [first_row, first_row + capacity)
/// of each owned decoder layer's keys (and values). Positions 0 .. capacity - 1.
struct KvPlacement {
  std::int32_t first_row = 0;  ///< first row of the sequence in the pool
  std::int32_t capacity = 0;   ///< rows (positions) reserved for it
  friend constexpr bool operator==(const KvPlacement&, const KvPlacement&) = default;
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
  std::vector<backend::SequenceSlice> seqs;  ///< sequences in row order
  int next_layer = 0;                  ///< ModelSpec layer this micro-batch enters next
  std::vector<std::int32_t> token_ids; ///< [rows] input ids (before the embedding)
  std::vector<float> act;              ///< [rows x width] row-major activations
  std::int64_t rows = 0;               ///< rows of `act`
  std::int64_t width = 0;              ///< columns of `act`
  std::vector<std::int32_t> sampled;   ///< [n_seq] sampled tokens (after the sampler); -1 for
                                       ///< a sequence whose `emit` is 0
  /// Per sequence (empty: none changes): where its KV cache lives in every stage's pool, set by
  /// the owner of the sequences (serve::KvBlockManager) and applied by each stage before its
  /// layers (InferenceStageBase::place_sequences). A serving engine moves sequences in and out
  /// of the pool between rounds this way; engine::generate places them once, at construction.
  std::vector<KvPlacement> placement;
  /// Per sequence (empty: every sequence): 1 when the sampler draws its next token this round,
  /// 0 for a chunk of a prompt that is not its last (chunked prefill: the sampler is not run,
  /// so a seeded sampler's draws do not depend on the chunking).
  std::vector<std::uint8_t> emit;

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

/// What the executor drives on every inference stage, whatever its Backend: the layer range, the
/// KV-cache capacities and the samplers, the host-side checks, sampling, and the weight-offload
/// advice over the host weights (type erasure at the edge: the engines hold stages of any Backend
/// through this base; the layers' kernels run in InferenceStage<B>::forward, a template).
///
/// Holds the ModelSpec layers [range.first, range.last) of a Llama model, the KV cache of every
/// sequence for its decoder layers and, when it owns the sampler layer, one Sampler per sequence
/// (sequence i seeded with config.seed + i, so a single sequence samples as llama2.c's run.c does
/// with that seed).
class InferenceStageBase {
 public:
  virtual ~InferenceStageBase() = default;

  /// Runs this stage's layers on `mb` in place, up to but not including the sampler layer:
  /// mb.next_layer must equal range().first; on return it equals range().last (or the sampler
  /// layer's index when the stage owns it: sample() runs that layer) and the payload (host
  /// memory) has the form that layer expects.
  /// @throws brigade::Error{InvalidArgument} if mb enters at another layer, a sequence id is out
  ///         of range, a token id is outside the vocabulary, or a position would exceed the
  ///         sequence's KV capacity
  /// @throws brigade::Error{NonFinite} when a layer's output (activations, or the LM head's
  ///         logits) holds NaN or infinity, naming the stage's layer range, the micro-batch, the
  ///         layer, the sequence and position of the row and the column (on a host-memory
  ///         backend every layer's output is scanned once: docs/benchmarks.md has the cost; on a
  ///         device backend the stage's output, once it is downloaded, naming its last layer)
  /// @throws brigade::Error{BadFile} check_weights_finite()'s, before any layer runs, when the
  ///         loader deferred its scan and the stage's weights hold a NaN or an infinity
  virtual void forward(Microbatch& mb) = 0;

  /// Runs the sampler layer on `mb` (after forward() on the stage that owns it): one token per
  /// sequence from its logits ([n_seq x vocab], host memory) into mb.sampled, with that
  /// sequence's Sampler; -1 for a sequence whose mb.emit entry is 0 (its sampler is not drawn).
  /// @throws brigade::Error{InvalidArgument} if the stage does not own the sampler or `mb` is
  ///         not at the sampler layer with [n_seq x vocab] logits
  void sample(Microbatch& mb);

  [[nodiscard]] const partition::StageRange& range() const noexcept { return range_; }
  /// True when the stage holds layer 0 (embedding).
  [[nodiscard]] bool owns_embedding() const noexcept { return range_.first == 0; }
  /// True when the stage holds the last layer (sampler).
  [[nodiscard]] bool owns_sampler() const noexcept { return range_.last == num_layers_; }
  /// Applies mb.placement: sequence mb.seqs[i] gets the pool rows mb.placement[i] (the id space
  /// grows as needed; a placement at position 0 also gives the sequence a fresh Sampler seeded
  /// sampler.seed + seq, as at construction). forward() calls it before its layers.
  /// @throws brigade::Error{InvalidArgument} if placement is neither empty nor one per sequence,
  ///         or a placement lies outside the pool (kv_cache_rows()) or exceeds seq_len
  void place_sequences(const Microbatch& mb);
  /// Rows of each owned decoder layer's KV pool: the sum of the constructor's capacities, or its
  /// pool_rows when larger.
  [[nodiscard]] std::int64_t kv_pool_rows() const noexcept { return cache_rows_total_; }
  /// Number of sequences the stage holds KV caches (and samplers) for.
  [[nodiscard]] int num_sequences() const noexcept { return static_cast<int>(capacities_.size()); }
  /// Bytes held by this stage's KV cache (in the backend's memory and kv_cache_dtype()).
  [[nodiscard]] std::size_t kv_cache_bytes() const noexcept { return kv_bytes_; }

  /// Bytes of this stage's weights as stored on the host: every tensor of its layers (the
  /// embedding table, each decoder's nine tensors, the final norm gain, the classifier; the
  /// sampler has none), each matrix in its dtype (F16/BF16: 2 bytes per weight, Q8_0: 34 per 32).
  [[nodiscard]] std::size_t weight_bytes() const noexcept { return weight_bytes_; }

  /// The scan for NaN and infinite weights a loader deferred (LlamaWeights::check_finite, set
  /// by LoadOptions::defer_finite_check), over this stage's layers, once: the first call reads
  /// every byte of the stage's tensors; later calls return at once (a call while another
  /// thread scans waits for it; a scan that threw runs again, and throws again). Nothing when
  /// the loader scanned at load. forward() and prefetch_weights() call it first, so no output
  /// is computed from a window that was not scanned.
  /// @throws brigade::Error{BadFile} the loader's error naming the file, tensor and element
  void check_weights_finite();

  /// PREFETCH (prima.cpp's mmap offload): when the weights are mapped from a file
  /// (LlamaWeights::mapped), advises the kernel over the page ranges of this stage's tensors:
  /// madvise(MADV_WILLNEED) over each range of up to 8 MiB (in pieces of 2 MiB: one call reads
  /// at most 8 MB ahead on Linux 6.18), madvise(MADV_SEQUENTIAL) over each larger one (the
  /// reads below then fault it in with the kernel's read-ahead, at most one read-ahead window
  /// past its end; several times faster than MADV_WILLNEED there), then check_weights_finite() (the first load of a model
  /// whose scan was deferred reads the window there) and one read per page, so every page is
  /// resident in this process when it returns. It blocks for the disk:
  /// runtime::WeightPrefetcher runs it on a thread of its own while the rank computes or
  /// waits. Owned weights are always resident: nothing is done.
  /// @return true when the pages were loaded, false for owned weights
  /// @throws brigade::Error{Internal} naming the range and errno if madvise fails;
  ///         check_weights_finite()'s error
  bool prefetch_weights();
  /// RELEASE: when the weights are mapped, madvise(MADV_DONTNEED) over the pages of this
  /// stage's tensors (the process drops them: its resident set shrinks), then
  /// posix_fadvise(POSIX_FADV_DONTNEED) over the same file range (the page cache lets go of the
  /// pages no other mapping holds, so the memory is really free; prima.cpp's release). The next
  /// use reads them back from the file, so results do not change. The ranges are rounded out to
  /// whole pages, so a neighbouring tensor sharing a page is dropped too (and read back the same
  /// way). Pages under `keep` (page-aligned, sorted, merged (address, bytes) ranges: the
  /// weight_pages() of the rank's other windows still held, such as the output layers' stage
  /// whose tied LM head reads the embedding table of window 0) are left resident. Owned
  /// weights: nothing is done (dropping anonymous pages would zero them).
  /// @return true when the kernel was advised, false for owned weights
  /// @throws brigade::Error{Internal} naming the range and errno if madvise or posix_fadvise fails
  bool release_weights(std::span<const std::pair<std::uintptr_t, std::size_t>> keep = {});
  /// Bytes of this stage's weight pages resident in memory now: mincore(2) over its page
  /// ranges (whole pages, so up to a page more per range than weight_bytes() at the ends) for
  /// mapped weights; weight_bytes() for owned ones.
  /// @throws brigade::Error{Internal} naming the range and errno if mincore fails
  [[nodiscard]] std::size_t resident_weight_bytes() const;
  /// The page-aligned (address, bytes) ranges of this stage's tensors, sorted and merged.
  [[nodiscard]] std::span<const std::pair<std::uintptr_t, std::size_t>> weight_pages() const noexcept {
    return weight_pages_;
  }
  /// The model this stage's layers come from.
  [[nodiscard]] const model::LlamaWeights& weights() const noexcept { return *weights_; }

  // ---- layer migration (DynaPipe's live layer moves; engine::InferenceWorker drives them) ----
  // A decoder layer at one end of this stage's range moves to the neighbouring stage: the old
  // owner sends its weights and the KV rows of the live sequences in parts (read_*), the new
  // owner allocates the layer (begin_adopt), writes the parts in (adopt_weight_image,
  // write_kv_rows), and at the round boundary where ownership switches the new owner
  // adopt()s it and the old one drop()s it. KV rows are addressed by pool row: every stage's
  // pool has the same rows and every sequence the same placement (kv_first_row).

  /// Bytes of the weight image of decoder layer `layer` (a ModelSpec layer index) that a
  /// migration carries: its nine tensors in model::DecoderWeights order, each in its stored
  /// dtype, each starting at a multiple of 64 bytes.
  /// @throws brigade::Error{InvalidArgument} if `layer` is not a decoder layer
  [[nodiscard]] std::size_t migration_weight_bytes(int layer) const;
  /// Copies bytes [offset, offset + out.size()) of that image from the host weights.
  /// @throws brigade::Error{InvalidArgument} for a range outside the image or a non-decoder
  void read_migration_weights(int layer, std::size_t offset, std::span<std::byte> out) const;
  /// Bytes of one position of one layer's KV cache: its key row and its value row (2 x kv_dim
  /// elements of the backend's kv_cache_dtype()).
  [[nodiscard]] virtual std::size_t kv_position_bytes() const = 0;
  /// The first pool row of sequence `seq` (its placement; 0 for a sequence never placed).
  [[nodiscard]] std::int64_t kv_first_row(int seq) const noexcept {
    const auto id = static_cast<std::size_t>(seq);
    return seq >= 0 && id < cache_offsets_.size() ? cache_offsets_[id] : 0;
  }
  /// Copies pool rows [row, row + rows) of owned decoder layer `layer`'s KV cache to `out`
  /// (rows x kv_position_bytes() bytes: the key rows, then the value rows).
  /// @throws brigade::Error{InvalidArgument} if the stage does not hold the layer or the rows
  ///         leave the pool
  virtual void read_kv_rows(int layer, std::int64_t row, std::int64_t rows, std::byte* out) = 0;
  /// Starts adopting decoder layer `layer`, adjacent to this stage's range (range().first - 1
  /// or range().last): its KV cache (the pool's rows) and its weight image, taken from what an
  /// earlier drop() left (spare_bytes(); memory already touched, so the parts' copies do not
  /// first-touch fresh pages) or allocated when there is none of the size.
  /// @throws brigade::Error{InvalidArgument} if `layer` is not an adjacent decoder or an
  ///         adoption is already under way; the backend's errors (out of memory)
  virtual void begin_adopt(int layer) = 0;
  /// The weight image of the layer being adopted (migration_weight_bytes(layer) bytes, host),
  /// which the parts fill.
  /// @throws brigade::Error{InvalidArgument} when no adoption is under way
  virtual std::span<std::byte> adopt_weight_image() = 0;
  /// Writes pool rows [row, row + rows) of decoder layer `layer`'s KV cache from `in` (the
  /// layout of read_kv_rows): the layer being adopted, or one the stage holds.
  /// @throws brigade::Error{InvalidArgument} if the stage neither adopts nor holds the layer or
  ///         the rows leave the pool
  virtual void write_kv_rows(int layer, std::int64_t row, std::int64_t rows, const std::byte* in) = 0;
  /// Completes the adoption: the layer joins the range (its weights uploaded from the image).
  /// @throws brigade::Error{InvalidArgument} when no adoption is under way
  virtual void adopt() = 0;
  /// Drops decoder layer `layer`, the first or the last of the range (the stage keeps at least
  /// one layer): the range shrinks, and its KV cache and (for a layer this stage adopted) its
  /// weight image stay with the stage as spares for its next begin_adopt (spare_bytes()).
  /// Fresh memory is dear to first touch (2.3 ms per MiB on the 2-core AMD EPYC VM of
  /// docs/serving.md, against 0.04 ms per MiB for memory touched before), and a layer that
  /// moved away tends to move back.
  /// @throws brigade::Error{InvalidArgument} if `layer` is not a decoder at an end of the range
  ///         or is the stage's only layer
  virtual void drop(int layer) = 0;
  /// Bytes the spares of dropped layers hold (KV caches and weight images; not in
  /// kv_cache_bytes()).
  [[nodiscard]] virtual std::size_t spare_bytes() const noexcept = 0;
  /// True when the weights are mapped from a file (LlamaWeights::mapped): PREFETCH and RELEASE
  /// really load and drop pages.
  [[nodiscard]] bool mapped() const noexcept { return weights_->mapped; }

 protected:
  /// @param weights    the model (shared, read-only, host memory)
  /// @param range      the layers this stage owns
  /// @param capacities KV-cache rows to reserve per sequence (its maximum positions)
  /// @param sampler    sampling settings (used only when the stage owns the sampler layer)
  /// @param pool_rows  KV rows per layer to reserve at least (a serving pool, filled by
  ///                   place_sequences); the capacities are placed from row 0 on
  /// @throws brigade::Error{InvalidArgument} if the range is outside the model or a capacity
  ///         exceeds the model's seq_len, or pool_rows < 0
  InferenceStageBase(const model::LlamaWeights& weights, partition::StageRange range,
                     std::span<const int> capacities, const model::SamplerConfig& sampler,
                     std::int64_t pool_rows = 0);

  /// Checks that `mb` enters at range().first with sequences this stage holds, within their
  /// capacities; with the embedding, that its token ids are in the vocabulary.
  /// @throws brigade::Error{InvalidArgument} as forward()
  void check_entry(const Microbatch& mb) const;
  InferenceStageBase(InferenceStageBase&&) noexcept = default;
  InferenceStageBase& operator=(InferenceStageBase&&) noexcept = default;
  /// Stops the run when layer `l`'s output in `mb` (host memory) holds a NaN or an infinity.
  /// @throws brigade::Error{NonFinite} as forward()
  void check_layer_output(const Microbatch& mb, int l) const;
  /// The KV cache of one decoder layer at `base` (keys, then values; kv_cache_rows() rows each
  /// of kv_dim_ elements) in elements of `dtype`.
  [[nodiscard]] backend::KvCacheView kv_view(void* base, DType dtype) const;
  /// Rows of one layer's keys (or values): the sum of the capacities.
  [[nodiscard]] std::int64_t kv_cache_rows() const noexcept { return cache_rows_total_; }
  /// The decoder index of ModelSpec layer `layer`.
  /// @throws brigade::Error{InvalidArgument} naming `what` if it is not a decoder
  [[nodiscard]] int decoder_of(int layer, const char* what) const;
  /// The range becomes `r` (one layer more or less at an end); decoder counts and weight
  /// bytes follow.
  void set_range(partition::StageRange r);

  const model::LlamaWeights* weights_;
  model::ModelSpec spec_;
  partition::StageRange range_;
  int num_layers_;
  int first_decoder_ = -1;                       // first owned decoder index (-1: none)
  int num_decoders_ = 0;                         // owned decoder layers
  std::int64_t kv_dim_ = 0;                      // a cache row: the KV heads held x head size
  std::size_t kv_bytes_ = 0;                     // set by the derived stage
  std::size_t weight_bytes_ = 0;                 // the stage's tensors (a TP stage: its slices)

 private:
  /// madvise(advice) over every page range of `ranges` (weight_pages_ or part of it) in pieces
  /// of 2 MiB; false for owned weights.
  bool advise_weights(std::span<const std::pair<std::uintptr_t, std::size_t>> ranges, int advice,
                      const char* name);

  std::vector<std::pair<std::uintptr_t, std::size_t>> weight_pages_;  // page-aligned (start, bytes)
  std::unique_ptr<std::once_flag> scanned_ = std::make_unique<std::once_flag>();  // check_weights_finite
  unsigned touched_ = 0;  // what prefetch_weights' page reads summed (kept so they are not elided)
  std::vector<int> capacities_;
  std::vector<std::int64_t> cache_offsets_;      // per sequence, its first row in a layer's cache
  std::int64_t cache_rows_total_ = 0;            // sum of capacities
  std::vector<model::Sampler> samplers_;
  model::SamplerConfig sampler_config_;
};

/// The weight image of decoder `d` of `weights` that a layer migration carries (DynaPipe): the
/// byte offsets of its nine tensors (model::DecoderWeights order, each in its stored dtype, each
/// at a multiple of 64 bytes), then the image's size in bytes.
std::array<std::size_t, 10> decoder_image_layout(const model::LlamaWeights& weights, int d);

/// Drops every page of a mapped model from this process (madvise MADV_DONTNEED over the whole
/// mapping) and from the page cache (posix_fadvise POSIX_FADV_DONTNEED over the file): what
/// loading touched (the loaders scan every weight for NaN) is let go, so under weight offload a
/// rank then holds only the windows it loads. The InferenceWorker calls it when weight offload
/// starts on mapped weights.
/// @return true when the pages were dropped, false for owned weights or a mapping not made by
///         the loaders
/// @throws brigade::Error{Internal} naming errno if madvise or posix_fadvise fails
bool release_model_pages(const model::LlamaWeights& weights);

/// Bytes of the pages under `ranges` (address, bytes; any order, may overlap) resident in memory
/// now: mincore(2) over their union rounded out to whole pages, each page counted once.
/// @throws brigade::Error{Internal} naming the range and errno if mincore fails (an address
///         that is not mapped)
std::size_t resident_bytes(std::span<const std::pair<std::uintptr_t, std::size_t>> ranges);

/// An inference stage whose layers run on backend B (brigade/backend/backend.hpp): B's kernels,
/// B's memory for the weights it uploads, the KV caches and the work buffers. With a host-memory
/// backend (CpuBackend) the layers run in place on the micro-batch's vectors; with a device
/// backend the stage uploads the micro-batch's payload before its layers and downloads the
/// result after them (the payload between stages is host memory, what every Transport carries).
///
/// The header holds the definitions, so a user's Backend instantiates it:
/// runtime::InferenceStage<MyBackend>; InferenceStage<cpu::CpuBackend> (the default) is compiled
/// once, in the library.
template <backend::Backend B = cpu::CpuBackend>
class InferenceStage final : public InferenceStageBase {
 public:
  /// Uploads this stage's weights with backend.upload_weight and allocates its KV caches
  /// (kv_cache_dtype(), capacities summed or pool_rows when larger, for each owned decoder
  /// layer).
  /// @param backend the backend the layers run on (the stage owns it)
  /// @param pool_rows KV rows per layer to reserve at least (InferenceStageBase)
  /// @param tp the stage's tensor-parallel group (null or of size 1: the whole layers). With
  ///        t > 1 members this stage is member tp->rank()'s share (tp::shard_of, the split in
  ///        brigade/tp/tensor_parallel.hpp): its slices of the weights, the KV cache of its KV
  ///        heads, and per forward one all-reduce after the embedding, two per decoder layer and
  ///        one all-gather of the logits; every member of the group must run the same
  ///        micro-batches in the same order (each is the stage of its own pipeline, fed the same
  ///        activations). The group must outlive the stage.
  /// @throws brigade::Error{InvalidArgument} as InferenceStageBase; as tp::shard_of (heads, KV
  ///         heads, hidden_dim or vocabulary not divisible by the TP degree); a TP group on a
  ///         backend whose memory is not the host's; the backend's errors (out of memory)
  InferenceStage(const model::LlamaWeights& weights, partition::StageRange range,
                 std::span<const int> capacities, const model::SamplerConfig& sampler,
                 B backend = B{}, std::int64_t pool_rows = 0, tp::Group* tp = nullptr);

  void forward(Microbatch& mb) override;

  std::size_t kv_position_bytes() const override {
    return 2 * dtype_bytes(b_.kv_cache_dtype(), weights_->config.kv_dim());
  }
  void read_kv_rows(int layer, std::int64_t row, std::int64_t rows, std::byte* out) override;
  void begin_adopt(int layer) override;
  std::span<std::byte> adopt_weight_image() override;
  void write_kv_rows(int layer, std::int64_t row, std::int64_t rows, const std::byte* in) override;
  [[nodiscard]] std::size_t spare_bytes() const noexcept override { return spare_bytes_; }
  void adopt() override;
  void drop(int layer) override;

  /// The backend the layers run on.
  [[nodiscard]] B& backend() noexcept { return b_; }
  /// This stage's TP shard (size 1: the whole model's layers).
  [[nodiscard]] const tp::Shard& shard() const noexcept { return shard_; }

 private:
  /// Vocabulary-parallel embedding: x [tokens x dim] = the rows of mb.token_ids found in this
  /// shard (zero rows elsewhere), summed over the group (each row has one non-zero term: exact).
  void embed_vocab_parallel(const Microbatch& mb, float* x);
  /// Vocabulary-parallel LM head: this shard's logits of the n_seq rows of x, all-gathered
  /// into logits [n_seq x vocab] (the same bits as the whole head's: each logit is one row's
  /// product, computed by one member).
  void head_vocab_parallel(const float* x, float* logits, std::int64_t n_seq);

  /// Floats at `n` in b_'s memory: the host vector `host` on a host backend, else `dev`
  /// (grown, contents dropped, when smaller).
  float* buffer(std::vector<float>& host, typename B::Buffer& dev, std::int64_t n);
  /// Uploads decoder `d`'s tensors from `h` (host views) with b_.upload_weight.
  model::DecoderWeights upload_decoder(const model::DecoderWeights& h);
  /// Copies `rows` pool rows from `row` between the KV buffer `kv` (keys, then values) and the
  /// host bytes `host` (key rows, then value rows): to the host when `read`, else from it.
  void copy_kv_rows(typename B::Buffer& kv, std::int64_t row, std::int64_t rows, std::byte* host,
                    bool read);

  B b_;
  model::WeightMatrix embedding_, wcls_;         // in b_'s memory
  const float* rms_final_ = nullptr;             // in b_'s memory
  std::vector<model::DecoderWeights> layers_;    // per owned decoder, in b_'s memory
  std::vector<typename B::Buffer> kv_;           // per owned decoder: K rows then V rows
  // Per owned decoder: its migrated weight image (host; null for the model's own weights),
  // which the backend's views may point into.
  std::vector<std::shared_ptr<std::byte[]>> images_;
  int adopting_ = -1;                            // the layer being adopted (-1: none)
  typename B::Buffer adopt_kv_{};                // its KV cache while the parts arrive
  // Its weight image, left uninitialised: the parts overwrite every byte, and a zero fill of
  // a whole layer (12.6 MB for the 42M shape) in begin_adopt would fall outside every op.
  std::shared_ptr<std::byte[]> adopt_image_;
  std::size_t adopt_image_bytes_ = 0;
  // What drop() left for the next adoption: KV caches (each the pool's rows of one layer), and
  // weight images with their sizes (only images no backend view points into any more).
  std::vector<typename B::Buffer> spare_kv_;
  std::vector<std::pair<std::shared_ptr<std::byte[]>, std::size_t>> spare_images_;
  std::size_t spare_bytes_ = 0;
  backend::DecoderBuffers<B> scratch_;
  std::vector<float> tmp_;                       // host backends: the final norm's and head's
  typename B::Buffer x_dev_, tmp_dev_, ids_dev_; // device backends: activations, ids
  // Tensor parallelism (tp_ non-null with more than one member).
  tp::Group* tp_ = nullptr;
  tp::Shard shard_;
  backend::DecoderSplit split_;
  std::vector<std::vector<std::byte>> tp_storage_;  // per decoder: its Wo and W2 column slices
  std::vector<std::int32_t> tp_ids_;             // the embedding's ids in this shard
  std::vector<std::int64_t> tp_rows_;            // and their rows
  std::vector<float> tp_gather_;                 // the all-gathered logits shards
};

template <backend::Backend B>
InferenceStage<B>::InferenceStage(const model::LlamaWeights& weights, partition::StageRange range,
                                  std::span<const int> capacities,
                                  const model::SamplerConfig& sampler, B backend,
                                  std::int64_t pool_rows, tp::Group* tp)
    : InferenceStageBase(weights, range, capacities, sampler, pool_rows),
      b_(std::move(backend)) {
  const auto& c = weights.config;
  if (tp != nullptr && tp->size() > 1) {
    BRIGADE_CHECK(B::host_memory, Errc::InvalidArgument,
                  "InferenceStage [{}, {}): tensor parallelism (TP {}) runs on backends whose "
                  "memory is the host's; this backend's is a device's",
                  range.first, range.last, tp->size());
    tp_ = tp;
    shard_ = tp::shard_of(c, tp->rank(), tp->size());
    split_ = tp::decoder_split(shard_, *tp_);
    kv_dim_ = std::int64_t{shard_.n_kv_heads} * c.head_size();
  }
  const bool split = tp_ != nullptr;
  const std::int64_t dim = c.dim, hs = c.head_size();
  const std::int64_t kv = kv_dim_, vocab = split ? shard_.vocab : c.vocab_size;
  const std::int64_t q_dim = split ? shard_.n_heads * hs : dim;
  const std::int64_t hid = split ? shard_.hidden : c.hidden_dim;
  const auto vec = [&](const float* p, std::int64_t n) {
    return b_.upload_weight(model::WeightMatrix(p), 1, n).f32();
  };
  // A vocabulary-parallel stage holds rows [vocab0, vocab0 + vocab) of the embedding and head.
  const auto vocab_rows = [&](model::WeightMatrix m) {
    return split ? model::WeightMatrix(model::weight_row(m, dim, shard_.vocab0), m.dtype) : m;
  };
  std::size_t held = 0;  // bytes of the tensors (slices) this stage reads
  const auto count = [&](model::WeightMatrix m, std::int64_t rows, std::int64_t in) {
    held += static_cast<std::size_t>(rows) * model::weight_row_bytes(m.dtype, in);
  };
  if (owns_embedding()) {
    embedding_ = b_.upload_weight(vocab_rows(weights.token_embedding), vocab, dim);
    count(weights.token_embedding, vocab, dim);
  }
  for (int i = 0; i < num_decoders_; ++i) {
    const auto& full = weights.layers[static_cast<std::size_t>(first_decoder_ + i)];
    layers_.push_back(upload_decoder(full));
    images_.emplace_back();
    held += 2 * static_cast<std::size_t>(dim) * sizeof(float);
    count(full.wq, q_dim, dim);
    count(full.wk, kv, dim);
    count(full.wv, kv, dim);
    count(full.wo, dim, q_dim);
    count(full.w1, hid, dim);
    count(full.w2, dim, hid);
    count(full.w3, hid, dim);
    const std::size_t bytes = 2 * dtype_bytes(b_.kv_cache_dtype(), kv_cache_rows() * kv);
    kv_.push_back(b_.allocate(bytes));
    kv_bytes_ += bytes;
  }
  const int tail = c.n_layers + 1;  // FinalNorm, then LMHead
  if (range.first <= tail && range.last > tail) {
    rms_final_ = vec(weights.rms_final, dim);
    held += static_cast<std::size_t>(dim) * sizeof(float);
  }
  if (range.first <= tail + 1 && range.last > tail + 1) {
    wcls_ = b_.upload_weight(vocab_rows(weights.wcls), vocab, dim);
    count(weights.wcls, vocab, dim);
  }
  if (split) weight_bytes_ = held;  // the slices; otherwise the base's count of the tensors
  b_.synchronize();
}

template <backend::Backend B>
model::DecoderWeights InferenceStage<B>::upload_decoder(const model::DecoderWeights& full) {
  const auto& c = weights_->config;
  // A tensor-parallel stage holds its shard of the layer (its heads, its MLP rows).
  const bool split = tp_ != nullptr;
  const std::int64_t dim = c.dim, kv = kv_dim_;
  const std::int64_t q_dim = split ? std::int64_t{shard_.n_heads} * c.head_size() : dim;
  const std::int64_t hid = split ? shard_.hidden : c.hidden_dim;
  const model::DecoderWeights h =
      split ? tp::shard_decoder(full, c, shard_, tp_storage_.emplace_back()) : full;
  const auto vec = [&](const float* p, std::int64_t n) {
    return b_.upload_weight(model::WeightMatrix(p), 1, n).f32();
  };
  model::DecoderWeights d;
  d.rms_att = vec(h.rms_att, dim);
  d.wq = b_.upload_weight(h.wq, q_dim, dim);
  d.wk = b_.upload_weight(h.wk, kv, dim);
  d.wv = b_.upload_weight(h.wv, kv, dim);
  d.wo = b_.upload_weight(h.wo, dim, q_dim);
  d.rms_ffn = vec(h.rms_ffn, dim);
  d.w1 = b_.upload_weight(h.w1, hid, dim);
  d.w2 = b_.upload_weight(h.w2, dim, hid);
  d.w3 = b_.upload_weight(h.w3, hid, dim);
  return d;
}

template <backend::Backend B>
void InferenceStage<B>::copy_kv_rows(typename B::Buffer& kv, std::int64_t row, std::int64_t rows,
                                     std::byte* host, bool read) {
  const DType t = b_.kv_cache_dtype();
  const std::int64_t kvd = weights_->config.kv_dim();
  BRIGADE_CHECK(row >= 0 && rows >= 0 && row + rows <= kv_cache_rows(), Errc::InvalidArgument,
                "InferenceStage [{}, {}): KV rows [{}, {}) outside the pool of {} rows",
                range_.first, range_.last, row, row + rows, kv_cache_rows());
  const std::size_t bytes = dtype_bytes(t, rows * kvd);
  auto* base = static_cast<std::byte*>(kv.data());
  std::byte* keys = base + dtype_bytes(t, row * kvd);
  std::byte* values = base + dtype_bytes(t, (kv_cache_rows() + row) * kvd);
  if (read) {
    b_.download(host, keys, bytes);
    b_.download(host + bytes, values, bytes);
  } else {
    b_.upload(keys, host, bytes);
    b_.upload(values, host + bytes, bytes);
  }
}

template <backend::Backend B>
void InferenceStage<B>::read_kv_rows(int layer, std::int64_t row, std::int64_t rows,
                                     std::byte* out) {
  const int d = decoder_of(layer, "read_kv_rows");
  BRIGADE_CHECK(first_decoder_ >= 0 && d >= first_decoder_ && d < first_decoder_ + num_decoders_,
                Errc::InvalidArgument,
                "InferenceStage [{}, {}): read_kv_rows of layer {}, which it does not hold",
                range_.first, range_.last, layer);
  copy_kv_rows(kv_[static_cast<std::size_t>(d - first_decoder_)], row, rows, out, true);
}

template <backend::Backend B>
void InferenceStage<B>::begin_adopt(int layer) {
  BRIGADE_CHECK(adopting_ < 0, Errc::InvalidArgument,
                "InferenceStage [{}, {}): adopting layer {} while layer {} is under way",
                range_.first, range_.last, layer, adopting_);
  (void)decoder_of(layer, "begin_adopt");
  BRIGADE_CHECK(layer == range_.first - 1 || layer == range_.last, Errc::InvalidArgument,
                "InferenceStage [{}, {}): layer {} is not adjacent to the range", range_.first,
                range_.last, layer);
  const std::size_t bytes = kv_position_bytes() * static_cast<std::size_t>(kv_cache_rows());
  if (!spare_kv_.empty()) {  // the pool's rows, as every layer's; its stale rows are never
                             // read: the parts write every live sequence's
    adopt_kv_ = std::move(spare_kv_.back());
    spare_kv_.pop_back();
    spare_bytes_ -= bytes;
  } else {
    adopt_kv_ = b_.allocate(bytes);
  }
  adopt_image_bytes_ = migration_weight_bytes(layer);
  const auto img = std::find_if(spare_images_.begin(), spare_images_.end(),
                                [&](const auto& i) { return i.second == adopt_image_bytes_; });
  if (img != spare_images_.end()) {
    adopt_image_ = std::move(img->first);
    spare_images_.erase(img);
    spare_bytes_ -= adopt_image_bytes_;
  } else {
    adopt_image_ = std::make_shared_for_overwrite<std::byte[]>(adopt_image_bytes_);
  }
  adopting_ = layer;
}

template <backend::Backend B>
std::span<std::byte> InferenceStage<B>::adopt_weight_image() {
  BRIGADE_CHECK(adopting_ >= 0, Errc::InvalidArgument,
                "InferenceStage [{}, {}): no layer is being adopted", range_.first, range_.last);
  return {adopt_image_.get(), adopt_image_bytes_};
}

template <backend::Backend B>
void InferenceStage<B>::write_kv_rows(int layer, std::int64_t row, std::int64_t rows,
                                      const std::byte* in) {
  auto* host = const_cast<std::byte*>(in);  // copy_kv_rows only reads it when writing
  if (layer == adopting_) {
    copy_kv_rows(adopt_kv_, row, rows, host, false);
    return;
  }
  const int d = decoder_of(layer, "write_kv_rows");
  BRIGADE_CHECK(first_decoder_ >= 0 && d >= first_decoder_ && d < first_decoder_ + num_decoders_,
                Errc::InvalidArgument,
                "InferenceStage [{}, {}): write_kv_rows of layer {}, which it neither holds nor "
                "adopts",
                range_.first, range_.last, layer);
  copy_kv_rows(kv_[static_cast<std::size_t>(d - first_decoder_)], row, rows, host, false);
}

template <backend::Backend B>
void InferenceStage<B>::adopt() {
  BRIGADE_CHECK(adopting_ >= 0, Errc::InvalidArgument,
                "InferenceStage [{}, {}): no layer is being adopted", range_.first, range_.last);
  const int layer = adopting_;
  const int d = decoder_of(layer, "adopt");
  const auto off = decoder_image_layout(*weights_, d);
  const auto& h = weights_->layers[static_cast<std::size_t>(d)];
  const std::byte* img = adopt_image_.get();
  auto at = [&](int k, DType t) { return model::WeightMatrix(img + off[static_cast<std::size_t>(k)], t); };
  model::DecoderWeights view;
  view.rms_att = reinterpret_cast<const float*>(img + off[0]);
  view.wq = at(1, h.wq.dtype);
  view.wk = at(2, h.wk.dtype);
  view.wv = at(3, h.wv.dtype);
  view.wo = at(4, h.wo.dtype);
  view.rms_ffn = reinterpret_cast<const float*>(img + off[5]);
  view.w1 = at(6, h.w1.dtype);
  view.w2 = at(7, h.w2.dtype);
  view.w3 = at(8, h.w3.dtype);
  const bool front = layer == range_.first - 1;
  const auto pos = front ? std::size_t{0} : layers_.size();
  layers_.insert(layers_.begin() + static_cast<std::ptrdiff_t>(pos), upload_decoder(view));
  images_.insert(images_.begin() + static_cast<std::ptrdiff_t>(pos), adopt_image_);
  kv_.insert(kv_.begin() + static_cast<std::ptrdiff_t>(pos), std::move(adopt_kv_));
  kv_bytes_ += kv_position_bytes() * static_cast<std::size_t>(kv_cache_rows());
  adopt_kv_ = typename B::Buffer{};
  adopt_image_.reset();
  adopt_image_bytes_ = 0;
  adopting_ = -1;
  partition::StageRange r = range_;
  (front ? r.first : r.last) = front ? layer : layer + 1;
  set_range(r);
  b_.synchronize();
}

template <backend::Backend B>
void InferenceStage<B>::drop(int layer) {
  (void)decoder_of(layer, "drop");
  const bool front = layer == range_.first, back = layer == range_.last - 1;
  BRIGADE_CHECK((front || back) && range_.last - range_.first >= 2, Errc::InvalidArgument,
                "InferenceStage [{}, {}): cannot drop layer {}: only a decoder at an end of a "
                "range of two layers or more moves",
                range_.first, range_.last, layer);
  b_.synchronize();
  const auto pos = static_cast<std::ptrdiff_t>(front ? 0 : layers_.size() - 1);
  const auto i = static_cast<std::size_t>(pos);
  layers_.erase(layers_.begin() + pos);  // the backend's views into the image go with it
  if (auto image = std::move(images_[i]); image && image.use_count() == 1) {
    const std::size_t bytes = migration_weight_bytes(layer);
    spare_images_.emplace_back(std::move(image), bytes);
    spare_bytes_ += bytes;
  }
  images_.erase(images_.begin() + pos);
  const std::size_t kv_bytes = kv_position_bytes() * static_cast<std::size_t>(kv_cache_rows());
  spare_kv_.push_back(std::move(kv_[i]));
  spare_bytes_ += kv_bytes;
  kv_.erase(kv_.begin() + pos);
  kv_bytes_ -= kv_bytes;
  partition::StageRange r = range_;
  (front ? r.first : r.last) = front ? layer + 1 : layer;
  set_range(r);
}

template <backend::Backend B>
float* InferenceStage<B>::buffer(std::vector<float>& host, typename B::Buffer& dev,
                                 std::int64_t n) {
  if constexpr (B::host_memory) {
    host.resize(static_cast<std::size_t>(n));
    return host.data();
  } else {
    return static_cast<float*>(backend::DecoderBuffers<B>::grow(
        b_, dev, static_cast<std::size_t>(n) * sizeof(float)));
  }
}

template <backend::Backend B>
void InferenceStage<B>::forward(Microbatch& mb) {
  using model::LayerKind;
  const auto& c = weights_->config;
  check_weights_finite();
  place_sequences(mb);
  check_entry(mb);
  const auto n_seq = static_cast<std::int64_t>(mb.seqs.size());
  const std::int64_t tokens = mb.num_tokens();
  // The activations in b_'s memory: mb.act itself on a host backend, else a device copy.
  float* x = nullptr;
  if (spec_.layer(range_.first).kind != LayerKind::Embedding) {
    if constexpr (B::host_memory) {
      x = mb.act.data();
    } else {
      x = buffer(tmp_, x_dev_, mb.rows * mb.width);
      b_.upload(x, mb.act.data(), static_cast<std::size_t>(mb.rows * mb.width) * sizeof(float));
    }
  }
  int last_run = -1;  // the last layer run (-1: only the sampler)
  bool at_sampler = false;
  for (int l = range_.first; l < range_.last && !at_sampler; ++l) {
    const auto& layer = spec_.layer(l);
    switch (layer.kind) {
      case LayerKind::Embedding: {
        mb.rows = tokens;
        mb.width = c.dim;
        const std::int32_t* ids = mb.token_ids.data();
        if constexpr (B::host_memory) {
          mb.act.resize(static_cast<std::size_t>(tokens * c.dim));
          x = mb.act.data();
        } else {
          x = buffer(tmp_, x_dev_, tokens * c.dim);
          const std::size_t bytes = mb.token_ids.size() * sizeof(std::int32_t);
          auto* d_ids = static_cast<std::int32_t*>(
              backend::DecoderBuffers<B>::grow(b_, ids_dev_, bytes));
          b_.upload(d_ids, ids, bytes);
          ids = d_ids;
        }
        if (tp_ != nullptr) {
          if constexpr (B::host_memory) embed_vocab_parallel(mb, x);
        } else {
          b_.embedding(embedding_, ids, x, tokens, c.dim);
        }
        break;
      }
      case LayerKind::Decoder: {
        const int d = layer.decoder_index;
        BRIGADE_CHECK(mb.rows == tokens && mb.width == c.dim, Errc::InvalidArgument,
                      "InferenceStage: decoder {} got activations [{} x {}], expected [{} x {}]",
                      d, mb.rows, mb.width, tokens, c.dim);
        const auto i = static_cast<std::size_t>(d - first_decoder_);
        backend::decoder_layer_forward(b_, c, layers_[i], x, tokens, mb.seqs,
                                       kv_view(kv_[i].data(), b_.kv_cache_dtype()), scratch_,
                                       tp_ != nullptr ? &split_ : nullptr);
        break;
      }
      case LayerKind::FinalNorm: {
        // Only each sequence's last row feeds the LM head.
        float* last = buffer(tmp_, tmp_dev_, n_seq * c.dim);
        std::int64_t row = 0;
        for (std::int64_t i = 0; i < n_seq; ++i) {
          row += mb.seqs[static_cast<std::size_t>(i)].tokens;
          b_.copy(last + i * c.dim, x + (row - 1) * c.dim,
                  static_cast<std::size_t>(c.dim) * sizeof(float));
        }
        if constexpr (B::host_memory) {
          mb.act.resize(static_cast<std::size_t>(n_seq * c.dim));
          x = mb.act.data();
        }
        b_.rmsnorm(last, rms_final_, x, n_seq, c.dim, c.norm_eps);
        mb.rows = n_seq;
        break;
      }
      case LayerKind::LMHead: {
        float* logits = buffer(tmp_, tmp_dev_, n_seq * c.vocab_size);
        if (tp_ != nullptr) {
          if constexpr (B::host_memory) head_vocab_parallel(x, logits, n_seq);
        } else {
          b_.matmul_wt(x, wcls_, logits, n_seq, c.dim, c.vocab_size, false);
        }
        if constexpr (B::host_memory) {
          mb.act.swap(tmp_);
        } else {
          std::swap(x_dev_, tmp_dev_);
        }
        x = logits;
        mb.width = c.vocab_size;
        break;
      }
      case LayerKind::Sampler:
        at_sampler = true;  // sample() runs it
        continue;
    }
    last_run = l;
    if constexpr (B::host_memory) check_layer_output(mb, l);
  }
  if constexpr (!B::host_memory) {
    mb.act.resize(static_cast<std::size_t>(mb.rows * mb.width));
    b_.download(mb.act.data(), x, mb.act.size() * sizeof(float));
    if (last_run >= 0) check_layer_output(mb, last_run);
  }
  mb.next_layer = at_sampler ? num_layers_ - 1 : range_.last;
}

template <backend::Backend B>
void InferenceStage<B>::embed_vocab_parallel(const Microbatch& mb, float* x) {
  const auto& c = weights_->config;
  const auto tokens = static_cast<std::int64_t>(mb.token_ids.size());
  tp::ids_in_shard(mb.token_ids, shard_, tp_ids_, tp_rows_);
  const auto n = static_cast<std::int64_t>(tp_ids_.size());
  tp_gather_.resize(static_cast<std::size_t>(n * c.dim));
  b_.embedding(embedding_, tp_ids_.data(), tp_gather_.data(), n, c.dim);
  std::fill(x, x + tokens * c.dim, 0.0f);
  for (std::int64_t i = 0; i < n; ++i)
    std::copy_n(tp_gather_.data() + i * c.dim, c.dim, x + tp_rows_[static_cast<std::size_t>(i)] * c.dim);
  tp_->all_reduce(std::span<float>(x, static_cast<std::size_t>(tokens * c.dim)));
}

template <backend::Backend B>
void InferenceStage<B>::head_vocab_parallel(const float* x, float* logits, std::int64_t n_seq) {
  const auto& c = weights_->config;
  const std::int64_t v = shard_.vocab, t = shard_.size;
  std::vector<float>& mine = tp_gather_;
  mine.resize(static_cast<std::size_t>(n_seq * v * (t + 1)));
  float* shard = mine.data();
  float* all = mine.data() + n_seq * v;
  b_.matmul_wt(x, wcls_, shard, n_seq, c.dim, v, false);
  tp_->all_gather(std::span<const float>(shard, static_cast<std::size_t>(n_seq * v)),
                  std::span<float>(all, static_cast<std::size_t>(n_seq * v * t)));
  // all is [member][sequence][v]; logits are [sequence][member v + j].
  for (std::int64_t r = 0; r < t; ++r)
    for (std::int64_t i = 0; i < n_seq; ++i)
      std::copy_n(all + (r * n_seq + i) * v, v, logits + i * c.vocab_size + r * v);
}

extern template class InferenceStage<cpu::CpuBackend>;

}  // namespace v0
}  // namespace brigade::runtime
