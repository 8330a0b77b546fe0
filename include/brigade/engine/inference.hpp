// Pipelined generation: stages on ranks, several sequences (micro-batches) in flight, the sampled
// token returning from the tail stage to the first.
#pragma once

#include "brigade/core/timeline.hpp"
#include "brigade/model/sampler.hpp"
#include "brigade/model/tokenizer.hpp"
#include "brigade/model/weights.hpp"
#include "brigade/partition/partition.hpp"
#include "brigade/runtime/inference_stage.hpp"
#include "brigade/transport/transport.hpp"

#include <chrono>
#include <cstdint>
#include <deque>
#include <span>
#include <vector>

namespace brigade::engine {
inline namespace v0 {

/// One sequence to generate.
struct GenerationRequest {
  std::vector<int> prompt;  ///< prompt token ids, BOS first (as Tokenizer::encode(text, true, false))
  int steps = 256;          ///< positions to run, prompt included (run.c's -n); 0 = the model's
                            ///< seq_len; values above seq_len are clamped to it, as run.c does
};

/// What happened to one sequence.
struct SequenceResult {
  std::vector<int> tokens;   ///< the token at every position fed or produced: prompt, then
                             ///< generated ids (a terminating BOS is not included)
  int prompt_tokens = 0;     ///< prompt length
  int generated = 0;         ///< tokens sampled (a terminating BOS included)
  bool stopped_on_bos = false;  ///< generation ended because BOS was sampled
  double ttft_s = 0.0;       ///< seconds from the start of the run to its first sampled token
  double done_s = 0.0;       ///< seconds from the start of the run to its last sampled token
  /// Time per output token after the first, seconds (0 with fewer than 2 generated tokens).
  [[nodiscard]] double tpot_s() const noexcept {
    return generated > 1 ? (done_s - ttft_s) / (generated - 1) : 0.0;
  }
};

/// Settings of a pipelined generation run.
struct InferenceOptions {
  int microbatches = 0;         ///< sequence groups in flight; 0 = min(sequences, stages)
  model::SamplerConfig sampler; ///< sampling (temperature 0 = greedy)
  int blas_threads = 1;         ///< BLAS threads per stage thread
  double timeout_s = 120.0;     ///< a stage waiting longer than this on a peer fails (PeerTimeout)
};

/// The outcome of a run: per-sequence results and the measured Timeline (one row per stage).
struct InferenceReport {
  std::vector<SequenceResult> sequences;  ///< in request order
  Timeline timeline{1};                   ///< F (prefill/decode) and SAMPLE intervals per stage
  double wall_s = 0.0;                    ///< seconds from start to the last stage's end
  std::int64_t prompt_tokens = 0;         ///< prompt tokens prefilled
  std::int64_t generated_tokens = 0;      ///< tokens sampled
  /// generated_tokens / wall_s.
  [[nodiscard]] double tokens_per_s() const noexcept {
    return wall_s > 0 ? static_cast<double>(generated_tokens) / wall_s : 0.0;
  }
};

/// Positions a request runs: steps clamped to [1, seq_len] (0 meaning seq_len), as run.c does.
inline int effective_steps(const GenerationRequest& r, int seq_len) {
  return (r.steps <= 0 || r.steps > seq_len) ? seq_len : r.steps;
}

/// Sequence `i`'s micro-batch when `n` sequences are split into `groups` contiguous groups.
inline int group_of(int i, int n, int groups) {
  // The first n % groups groups hold one sequence more.
  const int base = n / groups, extra = n % groups;
  const int big = extra * (base + 1);
  return i < big ? i / (base + 1) : extra + (i - big) / base;
}

namespace detail {

/// Message tags of the inference protocol.
inline constexpr int kTagDescriptor = 1;  // I32 [n_seq + 1, 3]: (rows, width, next_layer), then
                                          // (seq, pos0, tokens) per sequence; n_seq = 0 ends a
                                          // micro-batch
inline constexpr int kTagActivation = 2;  // F32 [rows, width]
inline constexpr int kTagToken = 3;       // I32 [n_seq]: sampled tokens, tail -> first stage

/// Stage 0's book of sequences: builds prefill and decode micro-batches and records tokens.
class SequenceBook {
 public:
  SequenceBook(std::span<const GenerationRequest> requests, int seq_len, int groups);
  /// The prefill micro-batch of group g (empty seqs when nothing in it needs a forward).
  runtime::Microbatch prefill(int g);
  /// Records the tokens sampled for mb at `now_s`; then returns the next decode micro-batch of the
  /// group (empty seqs when the whole group is done).
  runtime::Microbatch advance(const runtime::Microbatch& mb, std::span<const std::int32_t> sampled,
                              double now_s);
  /// Results, in request order.
  std::vector<SequenceResult> results() const { return results_; }
  [[nodiscard]] int capacity(int seq) const { return steps_[static_cast<std::size_t>(seq)]; }
  [[nodiscard]] std::vector<int> capacities() const { return steps_; }

 private:
  std::vector<std::vector<int>> members_;  // per group, sequence ids
  std::vector<int> steps_;
  std::vector<SequenceResult> results_;
  std::vector<bool> done_;
};

}  // namespace detail
}  // namespace v0
}  // namespace brigade::engine

namespace brigade::engine {
inline namespace v0 {

/// Runs one stage of a pipelined generation over any Transport (threads, MPI processes, ...).
///
/// Every stage s sits on rank `partition.stage(s).rank` (one stage per rank). Stage 0 owns the
/// sequences: it embeds each group's prompt (prefill, one batch of all prompt tokens), then, each
/// time the group's sampled tokens return from the tail stage, the group's next tokens (decode,
/// one row per live sequence). Stages in between receive a descriptor and the activations, run
/// their layers, and pass them on; the tail stage samples and sends the tokens back to stage 0.
/// All `groups` micro-batches are in flight at once, so the stages work concurrently. Messages
/// between two stages keep their order, so every stage sees the groups in the same order. A
/// group whose sequences have all finished is closed by an empty descriptor that travels down.
///
/// @param book      stage 0's SequenceBook (ignored on other stages; may be null there)
/// @param t0        the run's time origin for the Timeline
/// @param timeline  where this stage's intervals go (rank = stage index)
/// @throws brigade::Error from the stage or the transport (PeerTimeout when a peer stops
///         answering for `timeout_s`, HeaderMismatch, Aborted)
template <transport::Transport T>
void run_inference_stage(runtime::InferenceStage& stage, int stage_index,
                         const partition::Partition& partition, int groups, T& transport,
                         detail::SequenceBook* book, std::chrono::steady_clock::time_point t0,
                         double timeout_s, Timeline& timeline) {
  using transport::DType;
  using transport::kAny;
  using transport::MessageHeader;
  const int S = partition.num_stages();
  const int next_rank = stage_index + 1 < S ? partition.stage(stage_index + 1).rank : -1;
  const int prev_rank = stage_index > 0 ? partition.stage(stage_index - 1).rank : -1;
  const int first_rank = partition.stage(0).rank;
  const int last_rank = partition.stage(S - 1).rank;
  auto now = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  auto deadline = [&] { return transport::Deadline::after(timeout_s); };

  auto compute = [&](runtime::Microbatch& mb, bool prefill) {
    const double a = now();
    stage.forward(mb);
    Interval iv;
    iv.rank = stage_index;
    iv.op = Op::F;
    iv.virtual_stage = stage_index;
    iv.microbatch = mb.id;
    iv.start = a;
    iv.end = now();
    iv.tokens = mb.num_tokens();
    iv.label = prefill ? "prefill" : "decode";
    timeline.add(std::move(iv));
  };
  auto send_down = [&](const runtime::Microbatch& mb) {
    std::vector<std::int32_t> desc;
    desc.push_back(static_cast<std::int32_t>(mb.rows));
    desc.push_back(static_cast<std::int32_t>(mb.width));
    desc.push_back(mb.next_layer);
    for (const auto& s : mb.seqs) desc.insert(desc.end(), {s.seq, s.pos0, s.tokens});
    const auto rows = static_cast<std::int64_t>(desc.size() / 3);
    auto rd = transport.isend(next_rank, detail::kTagDescriptor,
                              MessageHeader::make(mb.id, stage_index + 1, DType::I32, {rows, 3}),
                              transport::as_bytes(std::span<const std::int32_t>(desc)));
    transport.wait(rd, deadline());
    if (mb.seqs.empty()) return;
    auto ra = transport.isend(
        next_rank, detail::kTagActivation,
        MessageHeader::make(mb.id, stage_index + 1, DType::F32, {mb.rows, mb.width}),
        transport::as_bytes(std::span<const float>(mb.act)));
    transport.wait(ra, deadline());
  };
  auto send_tokens = [&](const runtime::Microbatch& mb) {
    auto r = transport.isend(
        first_rank, detail::kTagToken,
        MessageHeader::make(mb.id, 0, DType::I32, {static_cast<std::int64_t>(mb.sampled.size())}),
        transport::as_bytes(std::span<const std::int32_t>(mb.sampled)));
    transport.wait(r, deadline());
  };

  if (stage_index == 0) {
    std::deque<runtime::Microbatch> in_flight;
    auto launch = [&](runtime::Microbatch mb, bool prefill) {
      if (mb.seqs.empty()) {
        if (S > 1) send_down(mb);  // closes the group downstream
        return;
      }
      compute(mb, prefill);
      if (S > 1) send_down(mb);
      in_flight.push_back(std::move(mb));
    };
    for (int g = 0; g < groups; ++g) launch(book->prefill(g), true);
    std::vector<std::int32_t> tokens;
    while (!in_flight.empty()) {
      runtime::Microbatch mb = std::move(in_flight.front());
      in_flight.pop_front();
      if (S > 1) {
        tokens.assign(mb.seqs.size(), 0);
        auto r = transport.irecv(
            last_rank, detail::kTagToken,
            MessageHeader::make(mb.id, 0, DType::I32, {static_cast<std::int64_t>(tokens.size())}),
            transport::as_writable_bytes(std::span<std::int32_t>(tokens)));
        transport.wait(r, deadline());
      } else {
        tokens = mb.sampled;
      }
      launch(book->advance(mb, tokens, now()), false);
    }
    return;
  }

  // Stages 1..S-1: receive, compute, pass on (or sample and return the tokens).
  int closed = 0;
  std::vector<std::int32_t> desc;
  while (closed < groups) {
    // A descriptor holds at most one row per sequence plus the shape row.
    desc.assign(static_cast<std::size_t>(3 * (stage.num_sequences() + 1)), 0);
    auto rd = transport.irecv(prev_rank, detail::kTagDescriptor,
                              MessageHeader::make(kAny, stage_index, DType::I32, {kAny, 3}),
                              transport::as_writable_bytes(std::span<std::int32_t>(desc)));
    transport.wait(rd, deadline());
    runtime::Microbatch mb;
    mb.id = static_cast<int>(rd.header.microbatch);
    const auto n_seq = rd.header.shape[0] - 1;
    if (n_seq == 0) {
      ++closed;
      if (stage_index + 1 < S) send_down(mb);
      continue;
    }
    mb.rows = desc[0];
    mb.width = desc[1];
    mb.next_layer = desc[2];
    for (std::int64_t i = 0; i < n_seq; ++i) {
      const auto o = static_cast<std::size_t>(3 * (i + 1));
      mb.seqs.push_back({desc[o], desc[o + 1], desc[o + 2]});
    }
    mb.act.resize(static_cast<std::size_t>(mb.rows * mb.width));
    auto ra = transport.irecv(
        prev_rank, detail::kTagActivation,
        MessageHeader::make(mb.id, stage_index, DType::F32, {mb.rows, mb.width}),
        transport::as_writable_bytes(std::span<float>(mb.act)));
    transport.wait(ra, deadline());
    compute(mb, mb.is_prefill());
    if (stage_index + 1 < S) {
      send_down(mb);
    } else {
      send_tokens(mb);
    }
  }
}

/// Generates every request with the model split by `partition`, one thread per stage over an
/// InProcessTransport. Greedy output (temperature 0) is the same token for token for every
/// partition and micro-batch count; with one request and a seed it samples as run.c does.
/// @throws brigade::Error{InvalidArgument} for an empty prompt, a prompt not starting at a valid
///         token, a partition of another model or with several stages on one rank;
///         any stage's error (the other stages are stopped and the first error is rethrown)
InferenceReport generate(const model::LlamaWeights& weights, const partition::Partition& partition,
                         std::span<const GenerationRequest> requests,
                         const InferenceOptions& options = {});

}  // namespace v0
}  // namespace brigade::engine
