// The serving engine: requests arrive over time and are generated on the pipelined inference
// executor with continuous batching, chunked prefill and a block KV-cache pool.
#pragma once

#include "brigade/core/timeline.hpp"
#include "brigade/engine/distributed.hpp"
#include "brigade/engine/inference.hpp"
#include "brigade/model/layer_cost.hpp"
#include "brigade/model/weights.hpp"
#include "brigade/partition/partition.hpp"

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace brigade::serve {
inline namespace v0 {

/// One request of a serving run.
struct ServeRequest {
  double arrival_s = 0.0;   ///< seconds after the run's start at which it arrives (>= 0)
  std::vector<int> prompt;  ///< prompt token ids, BOS first
  /// Tokens to sample at most (>= 1); the request ends earlier on a sampled BOS unless
  /// ServeOptions::ignore_eos. Its KV cache holds prompt + max_new_tokens - 1 positions (the
  /// last sampled token is not fed), which must fit the model's seq_len.
  int max_new_tokens = 1;
};

/// One layer move of a serving run (times in seconds from the run's start; rounds are the
/// executor's rounds).
struct LayerMove {
  int ordered_round = 0;  ///< the round whose descriptors carried the order
  int first_round = 0;    ///< the round of the first part (ordered_round + 1)
  int switch_round = 0;   ///< the first round the new owner runs the layer
  int from = 0;           ///< the stage that held the layer
  int to = 0;             ///< the neighbour that adopts it
  int layer = 0;          ///< the ModelSpec layer that moved
  double ordered_s = 0.0; ///< when it was ordered
  bool forced = false;    ///< RebalanceOptions::force_every (not the predictor) ordered it
  /// The predicted seconds per micro-batch round of the slowest stage before the move, over
  /// the recent rounds (the imbalance that started the decision; 0 for a forced move).
  double predicted_slowest_s = 0.0;
  /// The predicted seconds per executor round before and after the move: the recent rounds
  /// simulated through the pipeline (Rebalancer, sim::simulate) with the layers as they were
  /// and as they would be (0 for a forced move).
  double predicted_round_s = 0.0, predicted_round_after_s = 0.0;
  /// The least fraction the move had to lower the predicted round by: RebalanceOptions::
  /// min_gain (twice for a reversal) plus the predictor's error measured on the moves before
  /// (Rebalancer::moved_prediction_error() when it was ordered; 0 for a forced move).
  double required_gain = 0.0;
  /// The move checked against what followed it: over the stage rounds of stages `from` and
  /// `to` measured from switch_round on (at most the decision window's, and only until the
  /// next move is ordered), the seconds the predictor as fitted when the move was ordered
  /// gives them with the new layers (checked_predicted_s) and the seconds measured
  /// (checked_measured_s): checked_predicted_s / checked_measured_s - 1 is the predictor's
  /// error on the split it had not run, which the next moves must gain beyond (Rebalancer).
  int checked_rounds = 0;
  double checked_predicted_s = 0.0, checked_measured_s = 0.0;
  /// Bytes the migration was sized for when ordered: the layer's weight image and the KV rows
  /// of the live sequences (float32 keys and values).
  std::int64_t bytes = 0;
  std::vector<int> layers_after;  ///< layers per stage from switch_round on
};

/// Settings of the dynamic rebalancer (DynaPipe, inference: layers move between neighbouring
/// stages when the predicted per-stage latency is imbalanced).
struct RebalanceOptions {
  /// Imbalance: the predicted slowest stage exceeds the mean over the stages by more than this
  /// fraction (0.1 = 10%).
  double threshold = 0.10;
  /// Hysteresis: the imbalance must persist this many consecutive rounds before a move.
  int patience = 4;
  /// Hysteresis: rounds after a move's switch round before the next move may be ordered;
  /// doubled after each move in a row that undid the one before (Rebalancer).
  int cooldown = 16;
  /// Measured rounds per stage before the first move (the predictor's fit warms up).
  int warmup = 8;
  /// The load a decision weighs: the last `window` micro-batch rounds built (0: the last 64
  /// rounds of every micro-batch). A move holds for at least `cooldown` rounds plus its
  /// migration's, so it is judged on the load of a span several times that long, not on the
  /// last round's mix: with two rounds per micro-batch the rebalancer followed every swing
  /// between prompt-chunk and decode rounds (16 moves on the mixed workload against 7, 3 on the
  /// code trace against 1), and its mean e2e latency against the even split was +4.4% on the
  /// mixed workload against -4.5% at 64 per micro-batch, +3.4% against +3.2% on the code trace
  /// (Intel Xeon, 2 micro-batches; docs/serving.md, "The decision window").
  int window = 0;
  /// A move is made only when it lowers the predicted seconds per executor round by at least
  /// this fraction plus the predictor's measured error on the splits it moved to before (the
  /// mean |LayerMove::checked_predicted_s / checked_measured_s - 1| of the earlier moves
  /// checked over at least 16 stage rounds; 0 before any): the predictor's per-round error is
  /// tens of percent on a shared machine, and on a split it has not run it priced stage 0's
  /// decoders 10-13% low (docs/serving.md), so a move for a smaller predicted gain would buy a
  /// migration's copying for what may be noise.
  double min_gain = 0.05;
  /// Add the predictor's error measured on the earlier moves to min_gain (above); false: the
  /// moves are still checked (LayerMove::checked_*), and min_gain alone gates.
  bool gate_on_moved_error = true;
  /// Testing and demonstration: order a move every `force_every` rounds after the previous
  /// switch, regardless of the predictor, cycling over the boundaries and alternating the
  /// direction (0: off, the predictor decides).
  int force_every = 0;
  /// The predictor's prior (calibrated layer times: cost::ProfiledLayerTimes); empty: the
  /// roofline (model::roofline_layer_seconds()).
  model::LayerSeconds layer_seconds;
};

/// Settings of a serving run (the scheduler's knobs follow Orca's iteration-level scheduling
/// and Sarathi-Serve's chunked prefill; the KV pool is vLLM's block manager, kv_blocks.hpp).
struct ServeOptions {
  /// Micro-batches in flight (each a set of sequences that changes between rounds);
  /// 0 = one per pipeline rank.
  int microbatches = 0;
  /// Tokens one micro-batch feeds in one round at most (tokens): one per decoding sequence
  /// first, then prompt chunks. Must be >= max_seqs.
  int max_batch_tokens = 256;
  /// Sequences one micro-batch holds at most.
  int max_seqs = 16;
  /// Prompt tokens of one sequence fed in one round at most (chunked prefill: a long prompt
  /// is spread over rounds so that the decodes beside it keep running).
  int prefill_chunk = 64;
  /// KV positions per block.
  int kv_block_size = 16;
  /// Blocks in the KV pool (every stage holds kv_blocks x kv_block_size rows per decoder
  /// layer); a request is admitted only when its blocks are free, else it queues.
  /// 0 = microbatches x max_seqs sequences of the longest request.
  int kv_blocks = 0;
  /// Keep sampling after a BOS (trace replay: every request runs its max_new_tokens).
  bool ignore_eos = false;
  /// DynaPipe's live rebalancing (rebalance.hpp): set, layers move between neighbouring stages
  /// while serving, starting from the partition serve() is given (one stage per rank). The
  /// rebalancer runs on virtual stage 0's rank; every rank's measured compute seconds reach it
  /// with the round's own messages (engine::detail::kTagSeconds), over any transport. Unset:
  /// the partition stays.
  std::optional<RebalanceOptions> rebalance;
  /// Sampler, intra-op threads, peer timeout (the longest gap between arrivals is added, as
  /// the first stage waits for arrivals), executor windows, pipeline dtype. `microbatches` and
  /// `weight_offload` of it are not used.
  engine::InferenceOptions inference;
};

/// What happened to one request (times in seconds from the run's start).
struct RequestMetrics {
  double arrival_s = 0.0;      ///< when it arrived
  double admitted_s = 0.0;     ///< when its KV blocks were allocated and its prefill began
  double first_token_s = 0.0;  ///< when its first sampled token reached the first stage
  double done_s = 0.0;         ///< when its last sampled token reached the first stage
  int prompt_tokens = 0;
  int generated = 0;           ///< tokens sampled (a terminating BOS included)
  bool stopped_on_bos = false;
  std::vector<int> tokens;     ///< prompt, then generated ids (a terminating BOS not included)
  /// Time to first token: first_token_s - arrival_s.
  [[nodiscard]] double ttft_s() const noexcept { return first_token_s - arrival_s; }
  /// End-to-end latency: done_s - arrival_s.
  [[nodiscard]] double e2e_s() const noexcept { return done_s - arrival_s; }
  /// Time per output token after the first (0 with fewer than 2 tokens).
  [[nodiscard]] double tpot_s() const noexcept {
    return generated > 1 ? (done_s - first_token_s) / (generated - 1) : 0.0;
  }
  /// Seconds queued before admission.
  [[nodiscard]] double queue_s() const noexcept { return admitted_s - arrival_s; }
};

/// The features of one micro-batch's round as the first stage built it: what every stage's F
/// (and the tail's SAMPLE) of that round computes. The online latency predictor
/// (predictor.hpp) is fitted against them.
struct RoundFeatures {
  int microbatch = 0;
  int round = 0;                ///< the executor's round (Interval::chunk)
  int decode_seqs = 0;          ///< sequences fed one generated token
  double decode_context = 0.0;  ///< mean positions a decode token attends to (its position + 1)
  int prefill_tokens = 0;       ///< prompt tokens fed (chunks)
  int prefill_seqs = 0;         ///< sequences fed a prompt chunk
  double prefill_context = 0.0; ///< mean positions a prompt token attends to
  int sampled = 0;              ///< sequences the sampler draws for (emit)
  /// Seconds the book slept before building this micro-batch round, waiting for the next
  /// request to arrive while nothing ran anywhere (0 under load): idle time in the round's
  /// window, not work (migration_impact leaves it out of the round's time).
  double idle_s = 0.0;
};

/// Mean, median and 99th percentile of a sample (seconds); percentiles by linear
/// interpolation between order statistics (numpy's default).
struct LatencySummary {
  double mean = 0.0, p50 = 0.0, p99 = 0.0;
};

/// The summary of `values` (all 0 when empty).
LatencySummary summarize(std::vector<double> values);

/// The outcome of a serving run.
struct ServeReport {
  std::vector<RequestMetrics> requests;  ///< in request order
  Timeline timeline{1};                  ///< measured intervals, one row per rank
  double wall_s = 0.0;                   ///< seconds from start to the last stage's end
  std::int64_t generated_tokens = 0;     ///< tokens sampled over all requests
  int rounds = 0;                        ///< rounds the first stage ran
  int kv_blocks = 0;                     ///< blocks of the pool
  int kv_block_size = 0;                 ///< positions per block
  int peak_kv_blocks = 0;                ///< most blocks in use at once
  int peak_queue = 0;                    ///< most requests arrived and waiting for KV blocks
  /// Every micro-batch round that ran, in the order the first stage built them.
  std::vector<RoundFeatures> round_features;
  /// The plans the stages ran, each with the round it starts at (one, at round 0, without
  /// rebalancing).
  std::vector<std::pair<int, partition::Partition>> plans;
  /// The layer moves made (ServeOptions::rebalance).
  std::vector<LayerMove> moves;
  /// ServeOptions::rebalance: per stage, the micro-batch rounds whose measured seconds reached
  /// the rebalancer (every round that ran: the seconds come back with its tokens); empty
  /// without rebalancing.
  std::vector<int> measured_rounds;
  /// The plan of round `round` (plans).
  [[nodiscard]] const partition::Partition& plan_at(int round) const;
  LatencySummary e2e() const;   ///< over requests, e2e_s
  LatencySummary ttft() const;  ///< over requests, ttft_s
  LatencySummary tpot() const;  ///< over requests with >= 2 generated tokens, tpot_s
  /// generated_tokens / wall_s (tokens per second).
  [[nodiscard]] double tokens_per_s() const noexcept {
    return wall_s > 0 ? static_cast<double>(generated_tokens) / wall_s : 0.0;
  }
};

namespace detail {

/// One serving run as each of its ranks sets it up (serve_on): the inputs checked and what every
/// rank derives from them identically (the KV pool's size, the layout, the inference shape, the
/// inference options with the peer timeout raised by the longest gap between arrivals); on the
/// rank of virtual stage 0 also the ServingBook (arrivals, admission, continuous batching,
/// chunked prefill, the KV block pool) and the dynamic rebalancer, which own the run's
/// per-request metrics, rounds and moves.
class ServingRun {
 public:
  /// @throws brigade::Error{InvalidArgument} as serve()
  ServingRun(const model::LlamaWeights& weights, const partition::Partition& partition,
             std::span<const ServeRequest> requests, const ServeOptions& options);
  ~ServingRun();
  ServingRun(const ServingRun&) = delete;
  ServingRun& operator=(const ServingRun&) = delete;
  [[nodiscard]] const schedule::Shape& shape() const noexcept;
  [[nodiscard]] const engine::detail::GenerationLayout& layout() const noexcept;
  [[nodiscard]] const engine::InferenceOptions& inference() const noexcept;
  /// The rank of virtual stage 0.
  [[nodiscard]] int root() const noexcept;
  /// Virtual stage 0's book, whose clock starts at `t0` (arrival times are seconds after it);
  /// made on the first call (on the root rank only).
  engine::detail::MicrobatchSource* book(std::chrono::steady_clock::time_point t0);
  /// The root rank's report after the run: the book's metrics, rounds and moves, with
  /// `timeline` (every rank's, gathered) and `wall_s`.
  /// @throws brigade::Error{InvalidUsage} if book() was never called
  ServeReport report(Timeline timeline, double wall_s);

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace detail

/// Runs this rank's part of a serving run over `transport` (the SPMD form of serve(); under
/// MPI, one process per rank, over transport::MpiTransport): every rank of the transport's world
/// calls it with the same weights, partition, requests and options. The rank of virtual stage 0
/// holds the ServingBook (requests arrive in its clock) and, with options.rebalance, the
/// rebalancer; a layer move it orders rides that round's descriptors to every rank, and every
/// rank's measured compute seconds ride the round's descriptors and token message back to it
/// (engine::detail::kTagSeconds: no round waits for them); the migrations' parts go over the
/// same transport (MIGRATE / MIGRATE_RECV).
///
/// Protocol, as engine::generate_on: the rank of stage 0 starts every rank's clock with a
/// message (a common origin to within one message latency), each rank runs
/// engine::run_inference_rank, then every other rank sends its Timeline to the rank of stage 0.
/// A rank that fails with an error aborts the others (transport::abort_others).
/// @return on the rank of virtual stage 0: the full report (every request's metrics, the
///         Timeline of all ranks, the rounds, plans and moves; wall_s = the latest end over all
///         ranks). On other ranks: this rank's intervals and wall_s (its end) only.
/// @throws brigade::Error{InvalidArgument} as serve(), or for a partition whose rank count
///         differs from transport.world_size(); the stages' and the transport's errors
///         (PeerTimeout, HeaderMismatch, Aborted, Mpi)
template <transport::Transport T>
ServeReport serve_on(T& transport, const model::LlamaWeights& weights,
                     const partition::Partition& partition, std::span<const ServeRequest> requests,
                     const ServeOptions& options = {}) {
  const int me = transport.rank();
  detail::ServingRun run(weights, partition, requests, options);
  BRIGADE_CHECK(partition.num_ranks() == transport.world_size(), Errc::InvalidArgument,
                "serve_on: the partition has {} ranks, the transport's world has {} (run one "
                "process per rank, e.g. mpirun -np {})",
                partition.num_ranks(), transport.world_size(), partition.num_ranks());
  const auto& io = run.inference();
  cpu::set_blas_threads(io.blas_threads);
  Timeline timeline(partition.num_ranks());
  double wall_s = 0.0;
  try {
    const auto t0 = engine::detail::start_together(transport, run.root(), io.timeout_s);
    engine::run_inference_rank(transport, weights, run.shape(), partition, run.layout(),
                               me == run.root() ? run.book(t0) : nullptr, io, t0, timeline);
    const double end_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    wall_s = engine::detail::gather_timelines(transport, run.root(), timeline, end_s, 0.0,
                                              nullptr, io.timeout_s);
  } catch (const std::exception& e) {
    transport::abort_others(transport, e);
    throw;
  }
  if (me != run.root()) {
    ServeReport mine;
    mine.timeline = std::move(timeline);
    mine.wall_s = wall_s;
    return mine;
  }
  return run.report(std::move(timeline), wall_s);
}

/// Serves `requests` on the model split by `partition`: serve_on on one thread per rank over
/// the InProcessTransports of one fabric, with the one inference executor
/// (engine::run_inference_rank): the first
/// stage's ServingBook admits requests as they arrive (FIFO) while their KV blocks are free,
/// and each round builds every micro-batch from its live sequences (one decode token each, then
/// prompt chunks of at most prefill_chunk tokens within max_batch_tokens) and the admitted
/// ones; a finished request frees its blocks at once. With nothing to run and a request still
/// to arrive, the first stage waits for it. Greedy tokens are those of engine::generate (and
/// run.c) whatever the arrival times, chunking and split.
/// @throws brigade::Error{InvalidArgument} for no requests, an empty prompt, max_new_tokens <
///         1, a negative or non-finite arrival, a request whose prompt + max_new_tokens - 1
///         positions exceed seq_len ("request i ... longer than the model's context") or the
///         KV pool, options out of range, a partition of another model; the stages' errors
ServeReport serve(const model::LlamaWeights& weights, const partition::Partition& partition,
                  std::span<const ServeRequest> requests, const ServeOptions& options = {});

}  // namespace v0
}  // namespace brigade::serve
