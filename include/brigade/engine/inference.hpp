// Pipelined generation: stages on ranks, several sequences (micro-batches) in flight, the sampled
// token returning from the tail stage to the first.
#pragma once

#include "brigade/core/timeline.hpp"
#include "brigade/cost/memory.hpp"
#include "brigade/cost/profile.hpp"
#include "brigade/engine/executor.hpp"
#include "brigade/engine/threads.hpp"
#include "brigade/model/sampler.hpp"
#include "brigade/model/tokenizer.hpp"
#include "brigade/model/weights.hpp"
#include "brigade/partition/partition.hpp"
#include "brigade/plan/plan.hpp"
#include "brigade/runtime/inference_stage.hpp"
#include "brigade/runtime/offload.hpp"
#include "brigade/schedule/offload.hpp"
#include "brigade/schedule/rounds.hpp"
#include "brigade/transport/transport.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
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
  int blas_threads = 1;         ///< intra-op threads per stage thread (cpu::set_blas_threads)
  double timeout_s = 120.0;     ///< a stage waiting longer than this on a peer fails (PeerTimeout)
  ExecutorWindows windows;      ///< the executor's receive and send windows
  /// Weight offload (prima.cpp): every round, each rank PREFETCHes each of its virtual stages'
  /// weights one run ahead and RELEASEs them after (schedule::add_weight_offload on the round),
  /// so a rank holds at most two windows' weights at once. Executed with madvise on mapped
  /// weights (runtime::InferenceStageBase::prefetch_weights); owned (synthetic) weights stay
  /// resident and the ops are recorded as no-ops. Tokens do not change. The Plan's schedule
  /// stays the program without them; schedule::with_weight_offload(plan.schedule()) is the
  /// program that runs (what sim::simulate should be given to predict it).
  bool weight_offload = false;
  /// With weight_offload on mapped weights: PREFETCH hands the window to the rank's background
  /// loader (runtime::WeightPrefetcher: madvise WILLNEED and one read per page on a thread of
  /// its own, while the rank computes the current window or waits for its peers). False: a
  /// PREFETCH does nothing and the forward reads its pages by page faults (demand paging, still
  /// released after each run: the baseline prima.cpp compares against).
  bool background_prefetch = true;
  /// Element type of the activations sent between stages (Megatron-LM's `pipeline_dtype`): F32
  /// (exact: tokens identical at any split), or F16 / BF16, which halve the bytes on every link
  /// (each stage's input is rounded to nearest even once, so logits move by about the dtype's
  /// epsilon and greedy tokens can differ where two logits are that close). Compute stays
  /// float32. Tokens, descriptors and control messages are unaffected.
  DType pipeline_dtype = DType::F32;
  /// Tensor-parallel degree of every stage (Megatron-LM; brigade/tp/tensor_parallel.hpp): each
  /// pipeline rank becomes a group of `tp` ranks that split its layers' heads, MLP rows and
  /// vocabulary, joined by all-reduces. engine::generate(weights, plan, ...) then runs tp x
  /// ranks threads (tp pipelines, one per TP rank, whose stages p are one TP group each);
  /// generate_mpi splits the mpirun world into that grid; generate_on is given the group.
  /// Greedy tokens equal those of tp = 1 up to float rounding of the split sums.
  int tp = 1;
  /// Layer migrations (serve's dynamic rebalancer): the most bytes one MIGRATE part carries
  /// besides the rows its round wrote (weights and backlog of KV rows; the last part of a
  /// migration carries everything left). Bytes.
  std::size_t migration_part_bytes = std::size_t{1} << 20;
};

/// The outcome of a run: per-sequence results and the measured Timeline (one row per rank).
struct InferenceReport {
  std::vector<SequenceResult> sequences;  ///< in request order
  /// Measured intervals, one row per rank: F (label prefill/decode), SAMPLE, RECV (the wait)
  /// and SEND (post to completion), each with its virtual stage, micro-batch and round (chunk).
  Timeline timeline{1};
  /// The steady-clock instant the timeline's 0 stands for (this process's clock): what places
  /// events measured beside the engine (VerifyingTransport's verdicts) on the timeline.
  std::chrono::steady_clock::time_point origin{};
  double wall_s = 0.0;                    ///< seconds from start to the last stage's end
  /// Per rank, the most bytes of its weights found resident at once (bytes): with weight
  /// offload on mapped weights, mincore(2) over its windows' pages after each forward (the
  /// window just run and the next one being loaded); otherwise its stages' weight bytes.
  std::vector<double> resident_weight_bytes;
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
inline constexpr int kTagDescriptor = 1;  // I32 [n_seq + 1, kDescriptorColumns]: (rows, width,
                                          // next_layer, state, move, parts), then per sequence (seq,
                                          // pos0, tokens, kv first row, kv capacity, emit);
                                          // n_seq = 0 closes the micro-batch (state 0) or
                                          // passes an idle round (state kIdle); kv capacity 0
                                          // leaves the stage's placement as it is
inline constexpr int kTagActivation = 2;  // F32 [rows, width] (rows = 0 with a closing descriptor)
inline constexpr int kTagToken = 3;       // I32 [n_seq, 3]: (seq, position, token) per sequence,
                                          // last virtual stage -> virtual stage 0 (token -1: a
                                          // prompt chunk that samples nothing)
inline constexpr int kTagMigrate = 4;     // U8 [bytes]: one part of a layer migration (its
                                          // weight bytes, then per KV segment the key rows and
                                          // the value rows), from the layer's owner to the
                                          // neighbour adopting it
inline constexpr int kTagSeconds = 5;     // F32 [k]: the seconds virtual stages 0 .. k - 1 spent
                                          // on this micro-batch's round (F; F + SAMPLE on the
                                          // last virtual stage), beside every descriptor and
                                          // token message when GenerationLayout::report_seconds
                                          // (k = 0 for a closed or idle round)
inline constexpr int kDescriptorColumns = 6;
inline constexpr int kIdle = 1;  // descriptor state: nothing to run this round, more to come

/// What virtual stage 0 is told at the start of a micro-batch's round: the sequences of its
/// previous round and the token each sampled (-1: none, a prompt chunk), and the time.
struct RoundInput {
  int microbatch = 0;
  int round = 0;
  std::span<const backend::SequenceSlice> previous;  ///< the micro-batch's last round
  std::span<const std::int32_t> sampled;             ///< one per previous sequence
  double now_s = 0.0;  ///< seconds since the run's origin
};

/// A layer move ordered by virtual stage 0's rebalancer (serve's dynamic policy): virtual stage
/// `from` hands the decoder layer at its end facing `to` (a neighbour: from - 1 or from + 1) to
/// `to`. Ordered in round D, it travels in round D's descriptors (header columns 4 and 5) to
/// every rank; the parts run in rounds D + 1 .. D + parts, and `to` owns the layer from round
/// D + parts + 1 on (every rank's plan changes at that round boundary).
struct MoveOrder {
  int from = 0;
  int to = 1;
  int parts = 1;  ///< rounds of parts (>= 1)
  friend bool operator==(const MoveOrder&, const MoveOrder&) = default;
};

/// The owner of the sequences on virtual stage 0: it records what the last round sampled and
/// builds each micro-batch's next round. engine::generate's SequenceBook (fixed groups, the
/// whole prompt at round 0) and serve's ServingBook (requests arriving over time, continuous
/// batching, chunked prefill, a KV block pool) are the two.
class MicrobatchSource {
 public:
  virtual ~MicrobatchSource() = default;
  /// Fills `out` (its id, seqs, token_ids, and optionally placement and emit) with micro-batch
  /// in.microbatch's round in.round. Returns false to close the micro-batch for good; true with
  /// no sequences for an idle round (the micro-batch travels empty and stays live).
  virtual bool next(const RoundInput& in, runtime::Microbatch& out) = 0;
  /// Asked when virtual stage 0's rank emits round `round`, before its micro-batches are built:
  /// a layer move to order in this round (MoveOrder), or none (the default).
  virtual std::optional<MoveOrder> rebalance(int /*round*/) { return std::nullopt; }
  /// With GenerationLayout::report_seconds: what every virtual stage measured on micro-batch
  /// `microbatch`'s round `round` (seconds[v]: virtual stage v's F, plus its SAMPLE on the last
  /// one; seconds). Called on virtual stage 0's rank when the round's tokens are back, i.e. at
  /// the micro-batch's next F there; the seconds of the other ranks travel with the round's
  /// descriptors and its token message (kTagSeconds), so no round waits for them. Default:
  /// ignored.
  virtual void measured(int /*microbatch*/, int /*round*/, std::span<const float> /*seconds*/) {}
};

/// Stage 0's book of sequences for engine::generate: builds prefill and decode micro-batches
/// and records tokens (round 0: prefill(); later rounds: advance(); empty closes the group).
class SequenceBook final : public MicrobatchSource {
 public:
  SequenceBook(std::span<const GenerationRequest> requests, int seq_len, int groups);
  bool next(const RoundInput& in, runtime::Microbatch& out) override {
    out = in.round == 0 ? prefill(in.microbatch)
                        : advance(in.microbatch, in.previous, in.sampled, in.now_s);
    return !out.seqs.empty();
  }
  /// The prefill micro-batch of group g (empty seqs when nothing in it needs a forward).
  runtime::Microbatch prefill(int g);
  /// Records the tokens sampled for the sequences `seqs` of micro-batch `id` at `now_s`; then
  /// returns the group's next decode micro-batch (empty seqs when the whole group is done).
  runtime::Microbatch advance(int id, std::span<const backend::SequenceSlice> seqs,
                              std::span<const std::int32_t> sampled, double now_s);
  /// Results, in request order.
  std::vector<SequenceResult> results() const { return results_; }

 private:
  std::vector<std::vector<int>> members_;  // per group, sequence ids
  std::vector<int> steps_;
  std::vector<SequenceResult> results_;
};

/// What every rank of a generation knows before it starts, computed identically on each from
/// the requests: the micro-batches (groups), the sequences of each prefill, the KV capacity of
/// every sequence, and the bound on rounds that sizes the inference Shape.
struct GenerationLayout {
  int groups = 1;
  std::vector<int> capacities;                          ///< positions per sequence
  std::vector<std::vector<backend::SequenceSlice>> prefill;  ///< per group: its round-0 sequences
  std::vector<std::int64_t> max_rows;                   ///< per group: prefill rows (>= 1)
  std::int64_t width = 1;  ///< widest activation between stages: max(dim, vocab) floats
  int max_rounds = 1;  ///< rounds of the longest group, its closing round included
  /// Serving (serve::serve): sequences join and leave the micro-batches between rounds, a
  /// prompt may be fed in chunks, and KV placements travel with the descriptors. The metadata
  /// check then is: a sequence at position 0 is new, any other continues where it stopped.
  bool dynamic = false;
  int max_seqs = 0;               ///< dynamic: most sequences in one micro-batch's round
  std::int64_t kv_pool_rows = 0;  ///< dynamic: KV rows of every stage's pool
  /// Every round's compute seconds of every virtual stage travel to virtual stage 0's rank
  /// (kTagSeconds beside each descriptor and token message) and reach the book there
  /// (MicrobatchSource::measured): serve's dynamic rebalancer, over any transport.
  bool report_seconds = false;
};

/// The layout of `requests` split into `groups` contiguous groups (group_of) for a model of
/// `config` (seq_len positions): a sequence of `steps` positions and a prompt of p tokens runs a prefill
/// round, steps - p decode rounds, and its group closes one round later.
/// @throws brigade::Error{InvalidArgument} for an empty prompt
GenerationLayout make_layout(std::span<const GenerationRequest> requests,
                             const model::LlamaConfig& config, int groups);

/// The inference Shape of a run: the partition's ranks, stages and placement, `layout.groups`
/// micro-batches and `layout.max_rounds` rounds (chunks).
schedule::Shape inference_shape(const partition::Partition& partition,
                                const GenerationLayout& layout);

/// Micro-batches of a generation of `n` requests on `ranks` ranks: `microbatches`, or
/// min(n, ranks) when 0; at most n.
inline int group_count(int n, int ranks, int microbatches) {
  return std::min(microbatches > 0 ? microbatches : std::min(n, ranks), n);
}

/// The work of each group's prefill (Plan::work): its prompt tokens, its sequences, and the
/// mean causal context of a prompt token ((p + 1) / 2 for a prompt of p tokens, averaged over
/// the group's tokens).
std::vector<model::WorkItem> prefill_work(const GenerationLayout& layout);

}  // namespace detail

/// The plan of a generation: `partition` (its placement: virtual stage -> rank), the requests
/// split into `microbatches` contiguous groups (0 = min(requests, ranks)), and the lowered
/// program of every rank with every group running the bound on rounds (prefill, decode rounds,
/// the closing round; schedule::append_inference_round, validated), with each group's prefill
/// as its work. engine::generate runs it (a group that finishes early stops earlier than the
/// plan's bound); sim::simulate predicts it. Every rank computes the same plan.
/// With `devices` (one profile for every rank, or one per rank), each device must hold the
/// model's weights (cost::check_holds_weights) and each rank's memory (inference_memory()) must
/// fit its device (cost::check_capacity).
/// @throws brigade::Error{InvalidArgument} for no requests, an empty prompt, microbatches < 0,
///         a partition of another model; a device whose memory_capacity_bytes is below the
///         model's weights (naming the field), a rank over its device's capacity
///         ("inference_plan: rank r (<largest parts>): B bytes do not fit in <device>'s C bytes
///         of memory"), devices neither 0, 1 nor ranks long
plan::Plan inference_plan(const model::LlamaConfig& config, const partition::Partition& partition,
                          std::span<const GenerationRequest> requests, int microbatches = 0,
                          std::span<const cost::DeviceProfile> devices = {});

/// The memory of every rank of `plan` (inference_plan() of `requests` for a model of `config`)
/// with each ModelSpec layer's weights taking `layer_weight_bytes` (model::layer_weight_bytes of
/// the loaded model, cost::layer_weight_bytes(spec, dtype) for a prediction; empty: float32):
/// cost::inference_memory with each sequence's KV positions (its effective steps, what
/// runtime::InferenceStage reserves).
/// @throws brigade::Error{InvalidArgument} as cost::inference_memory; for an empty prompt
std::vector<cost::MemoryBreakdown> inference_memory(const model::LlamaConfig& config,
                                                    const plan::Plan& plan,
                                                    std::span<const GenerationRequest> requests,
                                                    std::vector<double> layer_weight_bytes = {});

/// The inference side of the executor (engine::execute) on one rank: its InferenceStages (one
/// per virtual stage it holds), and its program, emitted round by round
/// (schedule::append_inference_round) over the micro-batches still running.
///
/// A round of a micro-batch on virtual stage v: RECV_F (a descriptor and the activations, or on
/// v = 0 the sampled tokens), F, on the last virtual stage SAMPLE, and SEND_F. Virtual stage 0
/// owns the sequences (the SequenceBook): at round 0 it embeds the group's prompts (prefill), at
/// each later round the tokens sampled in the previous one (decode). A group whose sequences
/// have all finished is closed: its F on virtual stage 0 sends an empty descriptor, which every
/// later virtual stage passes on, and from the next round on no rank runs it.
///
/// Metadata checks: every rank knows which sequences and positions each micro-batch holds at
/// round 0 (the layout) and that a later round holds, in order, a subset of the previous round's
/// sequences one position further. A descriptor or token message that disagrees stops the run
/// with Error{HeaderMismatch} naming the rank, the micro-batch, the round, the expected and the
/// seen sequence id and position.
class InferenceWorker {
 public:
  /// @param stages  stages[v] for the virtual stages on `rank` (null elsewhere)
  /// @param book    the SequenceBook when this rank holds virtual stage 0 (else null)
  /// @param weight_offload emit each round with schedule::add_weight_offload (PREFETCH and
  ///        RELEASE around every window's run; InferenceOptions::weight_offload)
  /// @param pipeline_dtype the activations' dtype between stages (InferenceOptions::pipeline_dtype)
  /// @param background_prefetch PREFETCH loads on the rank's WeightPrefetcher thread
  ///        (InferenceOptions::background_prefetch); false: PREFETCH does nothing
  /// @throws brigade::Error{InvalidArgument} if pipeline_dtype is not f32, f16 or bf16
  /// @param migration_part_bytes InferenceOptions::migration_part_bytes
  InferenceWorker(const schedule::Shape& shape, int rank,
                  std::span<runtime::InferenceStageBase* const> stages,
                  const detail::GenerationLayout& layout, detail::MicrobatchSource* book,
                  std::chrono::steady_clock::time_point t0, bool weight_offload = false,
                  DType pipeline_dtype = DType::F32, bool background_prefetch = true,
                  std::size_t migration_part_bytes = std::size_t{1} << 20);
  ~InferenceWorker();
  InferenceWorker(const InferenceWorker&) = delete;
  InferenceWorker& operator=(const InferenceWorker&) = delete;
  /// The most bytes of this rank's weights seen resident at once (InferenceReport::
  /// resident_weight_bytes): sampled with mincore after each forward under weight offload of
  /// mapped weights, else the stages' weight bytes.
  [[nodiscard]] double peak_resident_weight_bytes() const;

  /// ProgramSource: appends the next round's lowered actions (append_inference_round) over the
  /// micro-batches still running, with add_weight_offload when weight offload is on; false once
  /// none is left or the shape's rounds are used up.
  ///
  /// Layer moves (DynaPipe; detail::MoveOrder): the rank of virtual stage 0 asks its book for a
  /// move each round and writes it into that round's descriptors; every rank reads it there.
  /// Over the move's part rounds c, the owner `from` emits MIGRATE(from, m, c) right after its
  /// F (and SEND_F) of (m, c), for every live micro-batch m, and the adopting neighbour `to`
  /// emits MIGRATE_RECV(to, m, c) in round c + 1 right before F(to, m, c + 1) (first in the
  /// round for a micro-batch that closed in c). A part carries a share of the layer's weights
  /// (at most migration_part_bytes, all that is left in the last round) and the KV rows of
  /// (m, c)'s sequences not sent yet (within the same budget; all of them in the last round):
  /// both sides compute each part's content from the sequences of (m, c), so the receive is
  /// posted with its exact size. The owner drops the layer when it emits the round after the
  /// last part; the neighbour adopts it on receiving the first part of the last round (the
  /// weights are complete then) and runs it from that round on.
  bool fill(std::vector<schedule::Action>& out);
  /// The rank a MIGRATE or MIGRATE_RECV exchanges its part with (the executor's Worker hook).
  /// @throws brigade::Error{InvalidArgument} when no migration is under way on this rank
  int migration_peer(const schedule::Action& a) const;
  /// F: virtual stage 0 builds the round's micro-batch from the SequenceBook (prefill or the
  /// sampled tokens; an empty one closes the group), every stage runs its layers; SAMPLE: one
  /// token per sequence. A closed micro-batch computes nothing (Work::ran false).
  /// PREFETCH: on mapped weights the stage goes to the rank's WeightPrefetcher (label
  /// "background"; "demand paging" without background_prefetch, where nothing is done);
  /// RELEASE: settles that load, then the stage's release_weights() (label "madvise+fadvise"),
  /// keeping the pages it shares with the rank's other windows held since their PREFETCH (the
  /// tied embedding table of window 0 and the head's output layers).
  /// Owned weights: recorded no-ops (label "owned: resident").
  /// @throws brigade::Error{InvalidArgument} for another op, or a compute on a virtual stage
  ///         whose weights were released and not prefetched since; the stage's errors
  Work compute(const schedule::Action& a);
  /// RECV_F on virtual stage 0: the tokens (I32 [kAny, 3]); elsewhere the descriptor and the
  /// activations in the pipeline dtype (buffers sized for the group's prefill); with
  /// layout.report_seconds each also the round's seconds so far (F32 [kAny], kTagSeconds).
  void recv_messages(const schedule::Action& a, std::vector<MessageSpec>& out);
  /// Checks what arrived against the sequences this rank expects and keeps it.
  /// @throws brigade::Error{HeaderMismatch} naming the rank, micro-batch, round, the expected and
  ///         the seen sequence and position, or a descriptor that disagrees with its activations
  void received(const schedule::Action& a, std::span<const Received> msgs);
  /// SEND_F: the descriptor and the activations (converted to the pipeline dtype: f16 and bf16
  /// round to nearest even) to the next virtual stage, or from the last
  /// virtual stage the sampled (seq, position, token) rows to virtual stage 0 (nothing once the
  /// micro-batch is closed); with layout.report_seconds each followed by the seconds of the
  /// round on virtual stages 0 .. a.virtual_stage (F32, kTagSeconds).
  void send(const schedule::Action& a, Outbox& out);

 private:
  runtime::InferenceStageBase& stage(int v) const;
  /// One part of the migration under way: weight bytes [w0, w1) and KV segments (first pool
  /// row, rows), bytes in all.
  struct Part {
    std::size_t w0 = 0, w1 = 0;
    std::vector<std::pair<std::int64_t, std::int64_t>> segments;
    std::size_t bytes = 0;
    bool last = false;  // a part of the last round
  };
  /// The migration under way on this rank (it holds `from` or `to`).
  struct Migration {
    detail::MoveOrder order;
    int layer = -1;         // the ModelSpec layer that moves
    int first = 0, last = 0;  // rounds of the parts
    bool sending = false;   // this rank holds `from`
    bool receiving = false;  // this rank holds `to`
    bool adopted = false;
    std::size_t weight_bytes = 0, weight_sent = 0;
    std::size_t row_bytes = 0;               // one position's key and value rows
    std::vector<std::int32_t> sent;          // per sequence id: positions sent
    std::map<std::pair<int, int>, Part> posted;  // (micro-batch, round) -> part to receive
  };
  /// The next part of micro-batch m in round c over the sequences `seqs` of (m, c): advances the
  /// replicated state (weights and rows sent), identically on both sides.
  Part plan_part(int c, std::span<const backend::SequenceSlice> seqs,
                 const runtime::InferenceStageBase& st);
  /// Starts, ends or continues the move this rank takes part in at round round_ and adds its
  /// MIGRATE / MIGRATE_RECV actions to the round's program out[begin..].
  void migration_actions(std::vector<schedule::Action>& out, std::size_t begin,
                         const std::vector<char>& was_live);
  /// layout.report_seconds: posts micro-batch a.microbatch's seconds so far (none when `empty`)
  /// to virtual stage `to` for round `chunk`.
  void send_seconds(const schedule::Action& a, int to, int chunk, bool empty, Outbox& out);
  /// Keeps the seconds that arrived for RECV_F `a`: `expected` values when the round ran
  /// (`ran`), none otherwise.
  /// @throws brigade::Error{HeaderMismatch} for another count
  void take_seconds(const schedule::Action& a, const Received& msg, int expected, bool ran);
  /// Checks the sequences of micro-batch m's round message from `peer` against what this rank
  /// expects, and records them as the round's sequences.
  void check_sequences(int m, std::span<const backend::SequenceSlice> seen, int peer);

  const schedule::Shape* shape_;
  int rank_;
  std::span<runtime::InferenceStageBase* const> stages_;
  const detail::GenerationLayout* layout_;
  detail::MicrobatchSource* book_;
  std::chrono::steady_clock::time_point t0_;
  int round_ = -1;
  std::vector<char> live_;    // per micro-batch: runs in the current round
  std::vector<char> closed_;  // per micro-batch: closed in the current round
  std::vector<char> known_;   // per micro-batch: cur_ holds the current round's sequences
  std::vector<char> idle_;    // per micro-batch: nothing to run in the current round
  std::vector<std::int32_t> next_pos_;  // dynamic layouts: per sequence id, its next position
  bool weight_offload_ = false;
  DType pipeline_dtype_ = DType::F32;
  std::unique_ptr<runtime::WeightPrefetcher> prefetcher_;  // with offload of mapped weights
  double peak_resident_ = 0;  // the most weight bytes seen resident at once (mincore)
  bool offload_mapped_ = false;  // weight offload over mapped weights: the ops really advise
  std::vector<std::pair<std::uintptr_t, std::size_t>> pages_;  // this rank's weight pages
  std::vector<char> released_;  // per virtual stage: weights released, not prefetched since
                                // (with offload every stage starts released: nothing is held)
  std::vector<std::pair<std::uintptr_t, std::size_t>> keep_;  // a RELEASE's pages still held
  std::vector<std::vector<backend::SequenceSlice>> prev_, cur_;  // sequences of the last/this round
  std::vector<runtime::Microbatch> slot_;          // per micro-batch: the payload held here
  std::vector<std::vector<std::int32_t>> tokens_;  // per micro-batch: (seq, pos, token) received
  std::vector<std::int32_t> scratch_;
  std::size_t part_bytes_;       // InferenceOptions::migration_part_bytes
  // layout.report_seconds: per micro-batch, the seconds of its round on virtual stages 0 .. k - 1
  // (received with its descriptor or tokens, then this rank's own appended)
  std::vector<std::vector<float>> seconds_;
  std::optional<std::pair<int, detail::MoveOrder>> ordered_;  // (round, move) read or ordered
  std::optional<Migration> mig_;
};

/// Makes the Backend of each inference stage (brigade/backend/backend.hpp): f(v) returns the
/// backend of virtual stage v by value. The engines call it once per virtual stage, on the thread
/// (or process) of the rank that holds the stage, before the run; the stage owns what it returns.
/// A factory that shares state between its backends (a counter, a device pool) must make that
/// state safe to use from several rank threads at once.
template <class F>
concept BackendFactory = std::copy_constructible<F> && requires(F& f, int v) {
  { f(v) } -> backend::Backend;
};

/// The default BackendFactory: a cpu::CpuBackend for every stage.
struct CpuBackends {
  /// A CpuBackend (stateless).
  cpu::CpuBackend operator()(int /*virtual_stage*/) const noexcept { return {}; }
};

/// Runs this rank's part of a pipelined generation over `transport`: builds the InferenceStages
/// of the virtual stages `shape` places on `transport.rank()` (layers from `partition`, KV
/// capacities from `layout`, a pool of layout.kv_pool_rows rows), each on the backend
/// `make_backend(v)` gives it, and runs the executor over an InferenceWorker whose stage-0
/// micro-batches come from `book`. Every rank calls it with the same arguments (`book` only on
/// the rank of virtual stage 0, null elsewhere).
/// With `tp` (a group of more than one member) every stage of this rank is that TP group's
/// member tp->rank() (runtime::InferenceStage's tp): `transport` then joins the ranks of this
/// member's pipeline (the ranks of the same TP index in every stage's group).
/// @return the rank's peak resident weight bytes (InferenceWorker::peak_resident_weight_bytes)
/// @throws brigade::Error{InvalidArgument} if options.tp differs from the group's size (1
///         without a group); from the stages, the backends, the transport or the group
///         (PeerTimeout, HeaderMismatch, Aborted)
template <transport::Transport T, BackendFactory MakeBackend = CpuBackends>
double run_inference_rank(T& transport, const model::LlamaWeights& weights,
                          const schedule::Shape& shape, const partition::Partition& partition,
                          const detail::GenerationLayout& layout, detail::MicrobatchSource* book,
                        const InferenceOptions& options, std::chrono::steady_clock::time_point t0,
                        Timeline& timeline, MakeBackend make_backend = {},
                        tp::Group* tp = nullptr) {
  using Stage = runtime::InferenceStage<std::invoke_result_t<MakeBackend&, int>>;
  BRIGADE_CHECK((tp != nullptr ? tp->size() : 1) == options.tp, Errc::InvalidArgument,
                "run_inference_rank: options.tp = {} but the rank's TP group has {} members "
                "(TP grids run through engine::generate, generate_on and generate_mpi)",
                options.tp, tp != nullptr ? tp->size() : 1);
  const int me = transport.rank();
  std::vector<std::unique_ptr<Stage>> owned;
  std::vector<runtime::InferenceStageBase*> stages(
      static_cast<std::size_t>(shape.num_virtual_stages), nullptr);
  for (int v = 0; v < shape.num_virtual_stages; ++v) {
    if (shape.rank_of(v) != me) continue;
    owned.push_back(std::make_unique<Stage>(weights, partition.stage(v), layout.capacities,
                                            options.sampler, make_backend(v),
                                            layout.kv_pool_rows, tp));
    stages[static_cast<std::size_t>(v)] = owned.back().get();
  }
  InferenceWorker worker(shape, me, stages, layout, book, t0, options.weight_offload,
                         options.pipeline_dtype, options.background_prefetch,
                         options.migration_part_bytes);
  execute(worker, worker, transport,
          ExecutorRun{&shape, me, t0, options.timeout_s, options.windows}, timeline);
  return worker.peak_resident_weight_bytes();
}

/// run_inference_rank over `plan`'s shape and partition.
/// @return the rank's peak resident weight bytes
template <transport::Transport T, BackendFactory MakeBackend = CpuBackends>
double run_inference_rank(T& transport, const model::LlamaWeights& weights, const plan::Plan& plan,
                          const detail::GenerationLayout& layout, detail::MicrobatchSource* book,
                          const InferenceOptions& options, std::chrono::steady_clock::time_point t0,
                          Timeline& timeline, MakeBackend make_backend = {},
                          tp::Group* tp = nullptr) {
  return run_inference_rank(transport, weights, plan.shape(), plan.partition(), layout, book, options,
                     t0, timeline, std::move(make_backend), tp);
}

/// Checks that `plan` is the inference plan of `requests` for a model of `config` (what
/// inference_plan() builds: an inference shape, the model's layers, one group per micro-batch,
/// the requests' bound on rounds and prefill work) and of `options`, and returns the
/// requests' layout. `who` names the caller in the messages.
/// @throws brigade::Error{InvalidArgument} naming what differs
detail::GenerationLayout check_inference_plan(const plan::Plan& plan,
                                              const model::LlamaConfig& config,
                                              std::span<const GenerationRequest> requests,
                                              const InferenceOptions& options,
                                              std::string_view who);

/// Generates every request by `plan` with one thread per rank (run_ranks), rank r over
/// `transports[r]`: the caller's Transport, e.g. a decorator (transport/decorators.hpp) over the
/// InProcessTransport endpoints of one InProcessFabric; virtual stage v's layers run on the
/// Backend `make_backend(v)` (the caller's kernels: a type modelling backend::Backend; the
/// default, CpuBackends, gives every stage a cpu::CpuBackend). Otherwise as
/// generate(weights, plan, ...).
/// @code
///   // a user Backend (e.g. one wrapping cpu::CpuBackend) on every stage:
///   auto report = engine::generate(std::span(transports), weights, plan, requests, options,
///                                  [&](int) { return MyBackend{...}; });
/// @endcode
/// @throws brigade::Error{InvalidArgument} if transports.size() differs from the plan's ranks or
///         transports[r].rank() != r, or options.tp > 1 (tensor parallelism runs through
///         generate(weights, plan, ...), generate_on or generate_mpi); as generate(weights,
///         plan, ...); the backends' errors
template <transport::Transport T, BackendFactory MakeBackend = CpuBackends>
InferenceReport generate(std::span<T> transports, const model::LlamaWeights& weights,
                         const plan::Plan& plan, std::span<const GenerationRequest> requests,
                         const InferenceOptions& options = {}, MakeBackend make_backend = {}) {
  BRIGADE_CHECK(options.tp == 1, Errc::InvalidArgument,
                "generate: options.tp = {} over the caller's {} transports; tensor parallelism "
                "runs through generate(weights, plan, ...) (threads) or generate_on with a TP group",
                options.tp, transports.size());
  const auto layout = check_inference_plan(plan, weights.config, requests, options, "generate");
  const int P = plan.shape().num_ranks;
  BRIGADE_CHECK(transports.size() == static_cast<std::size_t>(P), Errc::InvalidArgument,
                "generate: {} transports for a plan of {} ranks", transports.size(), P);
  for (int r = 0; r < P; ++r)
    BRIGADE_CHECK(transports[static_cast<std::size_t>(r)].rank() == r, Errc::InvalidArgument,
                  "generate: transports[{}] is rank {}, expected rank {}", r,
                  transports[static_cast<std::size_t>(r)].rank(), r);
  const int root = plan.shape().rank_of(0);
  cpu::set_blas_threads(options.blas_threads);
  detail::SequenceBook book(requests, weights.config.seq_len, plan.shape().num_microbatches);
  std::vector<Timeline> timelines(static_cast<std::size_t>(P), Timeline(P));
  std::vector<double> resident(static_cast<std::size_t>(P), 0.0);
  const auto t0 = std::chrono::steady_clock::now();
  run_ranks(transports, [&](T& tp) {
    const int r = tp.rank();
    resident[static_cast<std::size_t>(r)] =
        run_inference_rank(tp, weights, plan, layout, r == root ? &book : nullptr, options, t0,
                           timelines[static_cast<std::size_t>(r)], make_backend);
  });

  InferenceReport report;
  report.resident_weight_bytes = std::move(resident);
  report.timeline = Timeline(P);
  report.origin = t0;
  for (const auto& tl : timelines) report.timeline.merge(tl);
  report.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  report.sequences = book.results();
  for (const auto& r : report.sequences) {
    report.generated_tokens += r.generated;
    report.prompt_tokens += r.prompt_tokens;
  }
  return report;
}

/// Generates every request by `plan` (from inference_plan() for these requests, or a planner),
/// one thread per rank over an InProcessTransport (the generate above over
/// transport::endpoints of one InProcessFabric). A rank may hold several stages (ring windows,
/// partition::ring_partition): the token then walks the ring of ranks several times per position
/// (prima.cpp's pipelined ring). Greedy output (temperature 0) is the same token for token for
/// every partition, placement and micro-batch count; with one request and a seed it samples as
/// run.c does. options.microbatches must be 0 or (clamped to the requests) the plan's.
///
/// With options.tp = t > 1: t x ranks threads, the grid TP t x PP ranks (tp::Grid: the thread
/// of pipeline rank p and TP rank i is global rank p t + i): t pipelines over their own InProcessTransports, one per TP
/// rank, and per pipeline rank p one InProcessGroup of its t members (the stage's all-reduces
/// and all-gather, brigade/tp/tensor_parallel.hpp). Every pipeline samples the same tokens; the
/// report's sequences are pipeline 0's, its Timeline has one row per global rank, and
/// resident_weight_bytes one entry per global rank (each its weight slices).
/// @throws brigade::Error{InvalidArgument} as check_inference_plan(), for a prompt not starting
///         at a valid token, as tp::check_tensor_parallel (heads, KV heads, hidden_dim or
///         vocabulary not divisible by options.tp), options.tp < 1; any stage's error (the other
///         stages are stopped and the first error is rethrown); Error{Internal} if two TP
///         pipelines sampled different tokens
InferenceReport generate(const model::LlamaWeights& weights, const plan::Plan& plan,
                         std::span<const GenerationRequest> requests,
                         const InferenceOptions& options = {});

/// generate(weights, inference_plan(weights.config, partition, requests,
/// options.microbatches), requests, options): the model split by `partition`.
/// @throws brigade::Error{InvalidArgument} for an empty prompt, a prompt not starting at a valid
///         token, a partition of another model; any stage's error
InferenceReport generate(const model::LlamaWeights& weights, const partition::Partition& partition,
                         std::span<const GenerationRequest> requests,
                         const InferenceOptions& options = {});

}  // namespace v0
}  // namespace brigade::engine
