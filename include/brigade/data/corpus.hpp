// Text corpora for training: files or folders of text, split into samples, one task per file,
// tokenized, and packed into micro-batches of a fixed token budget.
#pragma once

#include "brigade/batching/batcher.hpp"
#include "brigade/core/error.hpp"
#include "brigade/model/tokenizer.hpp"

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace brigade::data {
inline namespace v0 {

/// One training sample: a token sequence (BOS first) and the task (source file) it came from.
struct Sample {
  int task = 0;             ///< index into Corpus::tasks
  std::vector<int> tokens;  ///< BOS, then the text's tokens; length >= 2
};

/// Samples of every task. A task is one file: the fortunes package's ~40 files (art, computers,
/// literature, ...) are ~40 tasks of very different sample lengths, the multi-task setting of
/// DynaPipe (training).
struct Corpus {
  std::vector<std::string> tasks;  ///< task names (file names), in load order
  std::vector<Sample> samples;     ///< every sample, task by task, in file order
  /// Samples longer than load_corpus's max_tokens, cut to that length (never silent: the
  /// caller reports it; brigade train prints a notice).
  std::int64_t truncated_samples = 0;
  std::int64_t truncated_tokens = 0;  ///< tokens cut off those samples

  /// Total tokens over all samples.
  [[nodiscard]] std::int64_t num_tokens() const noexcept {
    std::int64_t n = 0;
    for (const auto& s : samples) n += static_cast<std::int64_t>(s.tokens.size());
    return n;
  }
};

/// Splits one file's text into samples: a file holding lines that are exactly "%" is in fortune
/// format (samples between "%" lines); otherwise blank lines separate samples. Leading and
/// trailing blank lines of a sample are dropped, and empty samples are skipped.
std::vector<std::string> split_samples(std::string_view text);

/// The default corpus: the Debian package `fortunes` (/usr/share/games/fortunes).
std::filesystem::path default_corpus_path();

/// How a corpus source's files split into samples.
enum class SampleSplit : std::uint8_t {
  Paragraphs,  ///< split_samples: '%' lines (fortune format), else blank lines
  Documents,   ///< a whole file is one sample (blank lines at both ends dropped)
};

/// One task of a multi-task corpus: its name, its plain-text files and how they split.
struct CorpusSource {
  std::string task;                          ///< task name (Corpus::tasks)
  std::vector<std::filesystem::path> files;  ///< the task's files, in load order
  SampleSplit split = SampleSplit::Paragraphs;
};

/// Loads `sources`, one task per source in the given order (a source whose files hold no
/// sample is left out), each file checked and each sample tokenized and cut as load_corpus
/// does.
/// @param max_tokens longest sample kept, in tokens (>= 2)
/// @throws brigade::Error{BadFile} as load_corpus for each file (missing, unreadable, too large,
///         binary: naming the file), or if no source holds a sample ("no text samples found",
///         naming the sources); Error{InvalidArgument} if max_tokens < 2
Corpus load_sources(std::span<const CorpusSource> sources, const model::Tokenizer& tokenizer,
                    int max_tokens);

/// The multi-task corpus of plain text that Debian packages ship, found under `root` ("/" on
/// a Debian system; another root for tests), one task per source, short samples beside long
/// documents (docs/batching.md, "The Debian multi-task corpus", has its length histogram):
/// - `fortunes/<file>`: each file of usr/share/games/fortunes (package fortunes, fortunes-min)
///   split by '%' lines, one task per file (index files *.dat and symbolic links skipped);
/// - `common-licenses`: each license of usr/share/common-licenses (package base-files) as one
///   document (symbolic links such as GPL -> GPL-3 skipped);
/// - `copyright`: each usr/share/doc/<package>/copyright as one document (every package ships
///   one; symbolic links skipped);
/// - `readme-debian`: each usr/share/doc/<package>/README.Debian as one document.
/// Gzipped files (changelog.Debian.gz, manual pages, info pages) are not read: the corpus is
/// the plain files as installed. Files are sorted by path; sources without a file are left out.
/// @throws brigade::Error{BadFile} if none of the sources has a file under `root`
std::vector<CorpusSource> debian_sources(const std::filesystem::path& root = "/");

/// Loads a text file or every regular text file of a folder (sorted by name; symbolic links,
/// hidden files and fortune index files `*.dat` skipped), one task per file, and tokenizes each
/// sample as Tokenizer::encode(text, bos = true, eos = false), cut to `max_tokens` (counted in
/// Corpus::truncated_samples and truncated_tokens).
/// @param max_tokens longest sample kept, in tokens (>= 2)
/// @throws brigade::Error{BadFile} if the path does not exist, a file cannot be read, is not a
///         regular file, is larger than io::kMaxCorpusFileBytes, or is not text (naming the file
///         and why: another format's magic as io::foreign_format names it, a llama2.c checkpoint,
///         or the offset of the first NUL byte), or no sample is found;
///         Error{InvalidArgument} if max_tokens < 2
Corpus load_corpus(const std::filesystem::path& path, const model::Tokenizer& tokenizer,
                   int max_tokens);

/// Holds out every `every`-th sample of each task (the 0th, every-th, ...) for evaluation.
/// @return {training corpus, held-out corpus}; the task list is shared
/// @throws brigade::Error{InvalidArgument} if every < 2
std::pair<Corpus, Corpus> split_held_out(const Corpus& corpus, int every);

/// A micro-batch for training: sequences laid one after another by offsets (cu_seqlens), attention
/// within each sequence; pad rows (pack_padded, pack_rows) have target -1, which the loss skips. Row t predicts targets[t]; the last row of each sequence has no target inside the
/// sequence, so each sequence of n tokens contributes n - 1 rows (inputs = tokens[0..n-2],
/// targets = tokens[1..n-1]).
struct PackedBatch {
  std::vector<std::int32_t> inputs;    ///< [rows] input token ids
  std::vector<std::int32_t> targets;   ///< [rows] next-token targets
  std::vector<std::int64_t> offsets;   ///< [n_seq + 1] row offsets of the sequences, 0 first
  /// [n_spans] task of each span of rows (the per-task loss adds each span's row losses to its
  /// task); empty for a batch without tasks (no per-task split then)
  std::vector<std::int32_t> tasks;
  /// [n_spans + 1] row offsets of the task spans, 0 first, rows() last (empty when tasks is):
  /// one span per sequence by pack_offsets and pack_padded (a sequence's pad rows in its span),
  /// one per sample by pack_rows (a row's pad rows in its last sample's span)
  std::vector<std::int64_t> task_offsets;

  [[nodiscard]] std::int64_t rows() const noexcept {
    return static_cast<std::int64_t>(inputs.size());
  }
  [[nodiscard]] int num_sequences() const noexcept {
    return static_cast<int>(offsets.size()) - 1;
  }
};

/// Appends the first `rows` rows of `sample` to `batch` as one sequence: inputs
/// tokens[0 .. rows-1], targets tokens[1 .. rows], a new offset, and a task span of the
/// sample's task.
/// @throws brigade::Error{InvalidArgument} if rows < 1 or rows >= the sample's tokens
void append_sequence(PackedBatch& batch, const Sample& sample, std::int64_t rows);

/// The PackedBatch of a micro-batch packed by offsets (batching::OffsetsBatcher or
/// batching::DynamicBatcher over SampleLength{tokens - 1} of `samples`): mb.samples index
/// `samples`, each sample's n tokens give its n - 1 rows, one sequence per sample, in mb's order.
/// @throws brigade::Error{InvalidArgument} if an index is outside `samples` or a sample has
///         fewer than 2 tokens
PackedBatch pack_offsets(std::span<const Sample> samples, const batching::MicroBatch& mb);

/// The PackedBatch of a padding micro-batch (batching::PaddingBatcher over SampleLength{tokens -
/// 1} of `samples`): one sequence per sample, each of L rows, L = the longest sample's n - 1 in
/// the micro-batch; a sample's n - 1 real rows come first, then L - n + 1 pad rows (input
/// `pad_id`, target -1). Causal attention keeps the pad rows out of every real row, so the loss
/// and gradients equal pack_offsets' on the same samples; the forward still computes the pads.
/// @throws brigade::Error{InvalidArgument} as pack_offsets, or a pad_id < 0
PackedBatch pack_padded(std::span<const Sample> samples, const batching::MicroBatch& mb,
                        int pad_id = 0);

/// The PackedBatch of a micro-batch packed into fixed-length rows as Megatron-LM and T5 do
/// (batching::PackingBatcher{row_tokens}): each of mb's rows is one sequence of `row_tokens`
/// rows, its samples' n - 1 rows end to end (attention runs across the whole row, samples
/// included), then pad rows (input `pad_id`, target -1) to row_tokens. Each sample is a task
/// span of its own task.
/// @throws brigade::Error{InvalidArgument} as pack_offsets, a row whose samples exceed row_tokens
///         (naming the row), mb without row offsets, or a pad_id < 0
PackedBatch pack_rows(std::span<const Sample> samples, const batching::MicroBatch& mb,
                      std::int64_t row_tokens, int pad_id = 0);

/// The training stream of micro-batches packed by offsets: samples in stream order (shuffled
/// per epoch), grouped by batching::OffsetsBatcher{token_budget} (a sample that does not fit
/// in the current micro-batch starts the next one), each sample's n tokens giving n - 1 rows;
/// a sample longer than the budget is truncated to budget + 1 tokens.
class Packer {
 public:
  /// @param samples the stream's samples (kept by reference; must outlive the packer)
  /// @param token_budget rows per micro-batch (>= 1)
  /// @param seed shuffles the sample order each epoch (epoch e uses seed + e); 0 = file order
  /// @throws brigade::Error{InvalidArgument} if samples is empty or token_budget < 1
  Packer(std::span<const Sample> samples, int token_budget, std::uint64_t seed);

  /// The next micro-batch of the stream.
  /// @throws brigade::Error{InvalidArgument} if a sample has fewer than 2 tokens
  PackedBatch next();

  /// A global batch for a batcher (batching::*Batcher over SampleLength{tokens - 1}): the
  /// stream's next samples, in stream order, while their rows (n - 1 each, a sample cut to
  /// token_budget + 1 tokens as next() cuts it) total at most `rows`; at least one sample.
  /// Advances position() past them.
  /// @throws brigade::Error{InvalidArgument} if rows < 1 or a sample has fewer than 2 tokens
  std::vector<Sample> next_samples(std::int64_t rows);

  /// Position in the stream (samples consumed since the start), for checkpoints.
  [[nodiscard]] std::int64_t position() const noexcept { return position_; }
  /// Moves to stream position `pos` (as if next() had consumed `pos` samples).
  /// @throws brigade::Error{InvalidArgument} if pos < 0
  void seek(std::int64_t pos);

 private:
  const Sample& sample_at(std::int64_t pos);

  std::span<const Sample> samples_;
  int budget_;
  std::uint64_t seed_;
  std::int64_t position_ = 0;
  std::int64_t epoch_ = -1;
  std::vector<std::int32_t> order_;
};

}  // namespace v0
}  // namespace brigade::data
