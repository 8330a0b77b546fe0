// The batching joint: training samples (lengths, tasks) in, micro-batches with their work out.
// Padding, packing into fixed-length rows (Megatron-LM / T5) and packing by offsets live here;
// the dynamic batcher of DynaPipe (Jiang et al. 2024) is brigade/batching/dynamic.hpp.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/model/layer_cost.hpp"

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <span>
#include <vector>

namespace brigade::batching {
inline namespace v0 {

/// One sample as a batcher sees it: its length and where it came from.
struct SampleLength {
  std::int64_t tokens = 1;  ///< rows the model processes for it (tokens - 1 of a text sample's ids)
  int task = 0;             ///< its task (data::Corpus::tasks index)
  std::int64_t index = 0;   ///< the caller's id of the sample (named in errors)
};

/// One micro-batch: the samples it holds, laid out in rows, and the work the cost model and
/// the simulator price it by (a plan::Plan's work() entry).
struct MicroBatch {
  /// Positions in the batcher's input span, in layout order.
  std::vector<std::int64_t> samples;
  /// [rows + 1] offsets into `samples`: row r holds samples[row_offsets[r] .. row_offsets[r+1]).
  /// Padding: one sample per row; packing: the samples of each fixed-length row; offsets and
  /// dynamic: one row of varlen sequences (attention within each sample, cu_seqlens).
  std::vector<std::int64_t> row_offsets;
  /// tokens: rows the forward runs, padding included; sequences: attention groups (padded rows,
  /// packed rows, or samples); context: mean positions each token attends to (causal).
  model::WorkItem work;
  std::int64_t useful_tokens = 0;  ///< sum of the samples' tokens (work.tokens less padding)
  std::int64_t longest = 0;        ///< the longest sample's tokens

  /// Padding tokens: work.tokens - useful_tokens.
  [[nodiscard]] std::int64_t padding_tokens() const noexcept {
    return work.tokens - useful_tokens;
  }
  [[nodiscard]] int num_rows() const noexcept {
    return static_cast<int>(row_offsets.size()) - 1;
  }
};

/// The joint: a batcher maps a global batch's samples to micro-batches, each sample in exactly
/// one micro-batch, or throws brigade::Error naming the sample that fits none.
template <class B>
concept Batcher = requires(const B& b, std::span<const SampleLength> samples) {
  { b.plan(samples) } -> std::same_as<std::vector<MicroBatch>>;
};

namespace detail {

inline void check_samples(std::span<const SampleLength> samples, const char* who) {
  BRIGADE_CHECK(!samples.empty(), Errc::InvalidArgument, "{}: no samples (an empty global batch)",
                who);
  for (const auto& s : samples)
    BRIGADE_CHECK(s.tokens >= 1, Errc::InvalidArgument, "{}: sample {} has {} tokens, expected >= 1",
                  who, s.index, s.tokens);
}

}  // namespace detail

/// Causal attention positions of one sequence of l tokens, l (l + 1) / 2 (token p attends p + 1).
constexpr double causal_pairs(std::int64_t l) noexcept {
  return static_cast<double>(l) * static_cast<double>(l + 1) / 2.0;
}

/// The work of `sequences` varlen sequences packed by offsets (attention within each): `tokens`
/// rows, context = the sum of their causal_pairs over the rows. The one formula for the work of
/// packed micro-batches (batchers here, engine::microbatch_work for materialised batches).
constexpr model::WorkItem varlen_work(std::int64_t tokens, std::int64_t sequences,
                                      double pairs) noexcept {
  return {tokens, sequences, pairs / static_cast<double>(tokens)};
}

/// The micro-batch of the samples at `positions` (indices into `samples`) packed by offsets:
/// one row of varlen sequences, no padding, attention within each sample; work = {useful
/// tokens, samples, sum l (l + 1) / 2 / tokens}. Shared by OffsetsBatcher and DynamicBatcher.
inline MicroBatch varlen_microbatch(std::span<const SampleLength> samples,
                                    std::vector<std::int64_t> positions) {
  MicroBatch mb;
  double pairs = 0.0;
  for (const auto i : positions) {
    const auto l = samples[static_cast<std::size_t>(i)].tokens;
    mb.useful_tokens += l;
    mb.longest = std::max(mb.longest, l);
    pairs += causal_pairs(l);
  }
  const auto n = static_cast<std::int64_t>(positions.size());
  mb.samples = std::move(positions);
  mb.row_offsets = {0, n};
  mb.work = varlen_work(mb.useful_tokens, n, pairs);
  return mb;
}

/// Padding: `samples_per_microbatch` consecutive samples per micro-batch (the last may hold
/// fewer), each padded to the micro-batch's longest; the plain data-loader of most trainers.
/// Work: tokens = n x longest, sequences = n, context = (longest + 1) / 2 (pad positions are
/// computed like real ones).
struct PaddingBatcher {
  int samples_per_microbatch = 1;  ///< >= 1

  /// @throws brigade::Error{InvalidArgument} for an empty input, a sample under 1 token, or
  ///         samples_per_microbatch < 1
  [[nodiscard]] std::vector<MicroBatch> plan(std::span<const SampleLength> samples) const {
    detail::check_samples(samples, "PaddingBatcher");
    BRIGADE_CHECK(samples_per_microbatch >= 1, Errc::InvalidArgument,
                  "PaddingBatcher: {} samples per micro-batch, expected >= 1",
                  samples_per_microbatch);
    std::vector<MicroBatch> out;
    const auto n = static_cast<std::int64_t>(samples.size());
    for (std::int64_t first = 0; first < n; first += samples_per_microbatch) {
      const auto last = std::min<std::int64_t>(n, first + samples_per_microbatch);
      MicroBatch mb;
      for (std::int64_t i = first; i < last; ++i) {
        const auto l = samples[static_cast<std::size_t>(i)].tokens;
        mb.row_offsets.push_back(i - first);
        mb.samples.push_back(i);
        mb.useful_tokens += l;
        mb.longest = std::max(mb.longest, l);
      }
      mb.row_offsets.push_back(last - first);
      mb.work = {(last - first) * mb.longest, last - first,
                 static_cast<double>(mb.longest + 1) / 2.0};
      out.push_back(std::move(mb));
    }
    return out;
  }
};

/// Packing as Megatron-LM and T5 do it: samples laid end to end, in order, into rows of
/// `row_tokens` (a sample that does not fit in the current row's rest starts the next row; the
/// row's tail is padding), `rows_per_microbatch` rows per micro-batch (the last may hold fewer).
/// Attention runs across the whole row (a causal mask over the row, not per sample), so each
/// row costs row_tokens squared: work = {rows x row_tokens tokens, rows sequences, context
/// (row_tokens + 1) / 2}.
struct PackingBatcher {
  int row_tokens = 512;          ///< tokens per row (the model's sequence length), >= 1
  int rows_per_microbatch = 1;   ///< >= 1

  /// @throws brigade::Error{InvalidArgument} for an empty input, a sample under 1 token, a
  ///         parameter < 1, or a sample longer than row_tokens (naming the sample and the row)
  [[nodiscard]] std::vector<MicroBatch> plan(std::span<const SampleLength> samples) const {
    detail::check_samples(samples, "PackingBatcher");
    BRIGADE_CHECK(row_tokens >= 1 && rows_per_microbatch >= 1, Errc::InvalidArgument,
                  "PackingBatcher: {} tokens per row, {} rows per micro-batch; expected >= 1",
                  row_tokens, rows_per_microbatch);
    std::vector<MicroBatch> out;
    MicroBatch mb;
    std::int64_t row_used = 0;
    auto close_microbatch = [&] {
      const auto rows = static_cast<std::int64_t>(mb.row_offsets.size());
      mb.row_offsets.push_back(static_cast<std::int64_t>(mb.samples.size()));
      mb.work = {rows * row_tokens, rows, static_cast<double>(row_tokens + 1) / 2.0};
      out.push_back(std::move(mb));
      mb = {};
    };
    for (std::size_t i = 0; i < samples.size(); ++i) {
      const auto& s = samples[i];
      BRIGADE_CHECK(s.tokens <= row_tokens, Errc::InvalidArgument,
                    "PackingBatcher: sample {} has {} tokens, longer than a row of {} tokens",
                    s.index, s.tokens, row_tokens);
      if (mb.row_offsets.empty() || row_used + s.tokens > row_tokens) {
        if (static_cast<int>(mb.row_offsets.size()) == rows_per_microbatch) close_microbatch();
        mb.row_offsets.push_back(static_cast<std::int64_t>(mb.samples.size()));
        row_used = 0;
      }
      mb.samples.push_back(static_cast<std::int64_t>(i));
      mb.useful_tokens += s.tokens;
      mb.longest = std::max(mb.longest, s.tokens);
      row_used += s.tokens;
    }
    close_microbatch();
    return out;
  }
};

/// Packing by offsets (cu_seqlens): consecutive samples, in order, into micro-batches of at
/// most `token_budget` tokens; a sample that does not fit in the current micro-batch starts the
/// next one. No padding; attention within each sample (varlen_microbatch's work). The grouping
/// rule of data::Packer's training stream.
struct OffsetsBatcher {
  std::int64_t token_budget = 256;  ///< tokens per micro-batch, >= 1

  /// @throws brigade::Error{InvalidArgument} for an empty input, a sample under 1 token,
  ///         token_budget < 1, or a sample longer than the budget (naming the sample and budget)
  [[nodiscard]] std::vector<MicroBatch> plan(std::span<const SampleLength> samples) const {
    detail::check_samples(samples, "OffsetsBatcher");
    BRIGADE_CHECK(token_budget >= 1, Errc::InvalidArgument,
                  "OffsetsBatcher: token budget {}, expected >= 1", token_budget);
    std::vector<MicroBatch> out;
    const auto n = static_cast<std::int64_t>(samples.size());
    std::vector<std::int64_t> current;
    std::int64_t used = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const auto& s = samples[static_cast<std::size_t>(i)];
      BRIGADE_CHECK(s.tokens <= token_budget, Errc::InvalidArgument,
                    "OffsetsBatcher: sample {} has {} tokens, more than the token budget of {} "
                    "per micro-batch",
                    s.index, s.tokens, token_budget);
      if (used + s.tokens > token_budget) {
        out.push_back(varlen_microbatch(samples, std::move(current)));
        current.clear();
        used = 0;
      }
      current.push_back(i);
      used += s.tokens;
    }
    out.push_back(varlen_microbatch(samples, std::move(current)));
    return out;
  }
};

static_assert(Batcher<PaddingBatcher> && Batcher<PackingBatcher> && Batcher<OffsetsBatcher>);

/// The micro-batches' work, in order: what plan::PlanRequest::work and plan::Plan take.
inline std::vector<model::WorkItem> work_of(std::span<const MicroBatch> microbatches) {
  std::vector<model::WorkItem> w;
  w.reserve(microbatches.size());
  for (const auto& mb : microbatches) w.push_back(mb.work);
  return w;
}

}  // namespace v0
}  // namespace brigade::batching
