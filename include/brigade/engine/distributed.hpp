// Distributed generation: every rank (thread or process) runs its own stage over any Transport,
// then the Timeline is gathered to the rank of stage 0. The MPI driver (engine::generate_mpi, in
// brigade::mpi) is this function over an MpiTransport.
#pragma once

#include "brigade/backend/cpu.hpp"
#include "brigade/engine/inference.hpp"
#include "brigade/transport/decorators.hpp"

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <span>
#include <string>
#include <vector>

namespace brigade::engine {
inline namespace v0 {

/// Test-only fault injection for multi-process runs: rank `rank` ends its process with
/// `std::_Exit(3)` (no cleanup, no MPI_Finalize, as a crash would) right after it has received
/// its `after_steps`-th micro-batch input: activations for a stage > 0, sampled tokens for
/// stage 0 (transport::ExitAfterSteps). It prints one line on stderr first. The CLI's
/// `--fail-rank R --fail-after-steps K`.
struct FaultInjection {
  int rank = -1;        ///< the rank that exits; -1 = no fault
  int after_steps = 1;  ///< micro-batch inputs it receives before exiting, >= 1
};

namespace detail {

/// Message tags of the distributed drivers generate_on and serve::serve_on (after the inference
/// protocol's 1..5).
inline constexpr int kTagRunStart = 6;   // Bytes [0]: the stage-0 rank starts every rank's clock
inline constexpr int kTagGatherSize = 7; // Bytes [8]: size of the next message (uint64)
inline constexpr int kTagGather = 8;     // Bytes [n]: one rank's timeline and end time (JSON)

/// One rank's Timeline intervals, end time and peak memory (bytes; ExecutorStats) as JSON text.
inline std::string encode_rank_result(const Timeline& tl, double end_s,
                                      double peak_memory_bytes = 0.0) {
  nlohmann::json iv = nlohmann::json::array();
  for (const auto& i : tl.intervals())
    iv.push_back({i.rank, static_cast<int>(i.op), i.virtual_stage, i.microbatch, i.chunk, i.start,
                  i.end, i.tokens, i.label, i.bytes});
  return nlohmann::json{
      {"end_s", end_s}, {"intervals", iv}, {"peak_memory_bytes", peak_memory_bytes}}
      .dump();
}

/// Inverse of encode_rank_result: adds the intervals to `tl`, stores the peak memory in
/// `*peak_memory_bytes` (when given), returns the end time.
/// @throws brigade::Error{Internal} for text that is not encode_rank_result's output
inline double decode_rank_result(const std::string& text, int from_rank, Timeline& tl,
                                 double* peak_memory_bytes = nullptr) {
  try {
    const auto j = nlohmann::json::parse(text);
    if (peak_memory_bytes != nullptr)
      *peak_memory_bytes = j.at("peak_memory_bytes").get<double>();
    for (const auto& a : j.at("intervals")) {
      Interval i;
      i.rank = a.at(0).get<int>();
      const int op = a.at(1).get<int>();
      BRIGADE_CHECK(op >= 0 && op < kNumOps, Errc::Internal, "op {} out of range", op);
      i.op = static_cast<Op>(op);
      i.virtual_stage = a.at(2).get<int>();
      i.microbatch = a.at(3).get<int>();
      i.chunk = a.at(4).get<int>();
      i.start = a.at(5).get<double>();
      i.end = a.at(6).get<double>();
      i.tokens = a.at(7).get<std::int64_t>();
      i.label = a.at(8).get<std::string>();
      i.bytes = a.at(9).get<std::int64_t>();
      tl.add(std::move(i));
    }
    return j.at("end_s").get<double>();
  } catch (const Error& e) {
    brigade::detail::fail(Errc::Internal, "generate_on: rank {} sent an unreadable timeline: {}", from_rank,
                 e.what());
  } catch (const std::exception& e) {
    brigade::detail::fail(Errc::Internal, "generate_on: rank {} sent an unreadable timeline: {}", from_rank,
                 e.what());
  }
}

/// A common clock origin for the ranks of one run: the rank `root` sends every other rank a
/// start message (kTagRunStart) and each rank takes its clock when it has it (to within one
/// message latency of the others).
/// @return this rank's origin (steady clock)
/// @throws the transport's errors (PeerTimeout after timeout_s, Aborted)
template <transport::Transport T>
std::chrono::steady_clock::time_point start_together(T& pipe, int root, double timeout_s) {
  const int me = pipe.rank();
  const auto deadline = [&] { return transport::Deadline::after(timeout_s); };
  const auto header = [](int to) {
    return transport::MessageHeader::make(0, to, DType::U8, {0});
  };
  if (me == root) {
    std::vector<transport::Request> starts;
    for (int r = 0; r < pipe.world_size(); ++r)
      if (r != root) starts.push_back(pipe.isend(r, kTagRunStart, header(r), {}));
    for (auto& r : starts) pipe.wait(r, deadline());
  } else {
    auto r = pipe.irecv(root, kTagRunStart, header(me), {});
    pipe.wait(r, deadline());
  }
  return std::chrono::steady_clock::now();
}

/// Gathers every rank's Timeline to the rank `root` (kTagGatherSize, kTagGather): another rank
/// sends its intervals, its end time `end_s` and its peak resident weight bytes `peak_bytes`;
/// the root adds the intervals to `timeline` and, when `peaks` is given (one entry per rank),
/// stores each rank's peak bytes there.
/// @return on the root the latest end over all ranks (seconds); elsewhere `end_s`
/// @throws the transport's errors; Error{Internal} for a rank's unreadable result
template <transport::Transport T>
double gather_timelines(T& pipe, int root, Timeline& timeline, double end_s, double peak_bytes,
                        std::vector<double>* peaks, double timeout_s) {
  const int me = pipe.rank();
  const auto deadline = [&] { return transport::Deadline::after(timeout_s); };
  const auto header = [](std::int64_t nbytes) {
    return transport::MessageHeader::make(0, 0, DType::U8, {nbytes});
  };
  if (me != root) {
    const std::string text = encode_rank_result(timeline, end_s, peak_bytes);
    const std::uint64_t size = text.size();
    auto rs = pipe.isend(root, kTagGatherSize, header(8),
                         std::as_bytes(std::span<const std::uint64_t>(&size, 1)));
    auto rt = pipe.isend(root, kTagGather, header(static_cast<std::int64_t>(text.size())),
                         std::as_bytes(std::span<const char>(text.data(), text.size())));
    pipe.wait(rs, deadline());
    pipe.wait(rt, deadline());
    return end_s;
  }
  for (int from = 0; from < pipe.world_size(); ++from) {
    if (from == root) continue;
    std::uint64_t size = 0;
    auto rs = pipe.irecv(from, kTagGatherSize, header(8),
                         std::as_writable_bytes(std::span<std::uint64_t>(&size, 1)));
    pipe.wait(rs, deadline());
    std::string text(static_cast<std::size_t>(size), '\0');
    auto rt = pipe.irecv(from, kTagGather, header(static_cast<std::int64_t>(size)),
                         std::as_writable_bytes(std::span<char>(text.data(), text.size())));
    pipe.wait(rt, deadline());
    double peak = 0.0;
    end_s = std::max(end_s, decode_rank_result(text, from, timeline, &peak));
    if (peaks != nullptr) (*peaks)[static_cast<std::size_t>(from)] = peak;
  }
  return end_s;
}

}  // namespace detail

/// Runs this rank's part of a pipelined generation over `transport`: the stages s with
/// `partition.stage(s).rank == transport.rank()` (one, or several ring windows). Every rank of
/// the transport's world calls it with the same weights, partition, requests and options (the
/// SPMD form of engine::generate; under MPI, one process per rank).
///
/// Protocol: the rank of stage 0 sends every other rank a start message (tag 6) and every rank
/// starts its clock when it has it, so the Timelines of all ranks share one origin (to within one
/// message latency); then each rank runs run_inference_rank; then every other rank sends its
/// Timeline intervals and end time to the rank of stage 0 (tags 7 and 8), which merges them.
/// Greedy output is token for token that of engine::generate for the same partition.
///
/// When this rank fails with an error other than PeerTimeout or Aborted, it calls
/// `transport.abort(reason)` if the transport has one (transport::abort_others; InProcessTransport
/// and MpiTransport do), so the other ranks stop with Error{Aborted} quoting the reason instead of
/// waiting for their deadline.
///
/// Tensor parallelism: with `tp_group` (options.tp members) this rank is member
/// tp_group->rank() of its stage's TP group and `transport` joins the ranks of its pipeline (one
/// per stage, the same TP index; generate_mpi builds both from the mpirun world); every pipeline
/// of the grid runs this same protocol, so each pipeline's stage-0 rank gets a full report.
///
/// @param fault test-only: makes rank `fault.rank` exit mid-run (see FaultInjection)
/// @param tp_group this rank's TP group (null: TP 1); its size must equal options.tp
/// @return on the rank of stage 0: the full report (every sequence; the Timeline of all stages;
///         wall_s = the latest end over all ranks). On other ranks: no sequences, token counts 0,
///         this stage's intervals only, wall_s = this rank's end.
/// @throws brigade::Error{InvalidArgument} for the inputs engine::generate rejects, a partition
///         whose rank count differs from transport.world_size(), or a bad FaultInjection; a TP
///         group whose size differs from options.tp, or a TP degree the model does not divide
///         (tp::check_tensor_parallel); any error of the stage, the transport or the group
///         (PeerTimeout naming the rank that stopped answering, HeaderMismatch, Aborted, Mpi)
template <transport::Transport T>
InferenceReport generate_on(T& transport, const model::LlamaWeights& weights,
                            const partition::Partition& partition,
                            std::span<const GenerationRequest> requests,
                            const InferenceOptions& options = {}, FaultInjection fault = {},
                            tp::Group* tp_group = nullptr) {
  const int me = transport.rank();
  const int world = transport.world_size();
  BRIGADE_CHECK((tp_group != nullptr ? tp_group->size() : 1) == options.tp, Errc::InvalidArgument,
                "generate_on: options.tp = {} but the TP group has {} members",
                options.tp, tp_group != nullptr ? tp_group->size() : 1);
  tp::check_tensor_parallel(weights.config, options.tp);
  BRIGADE_CHECK(partition.num_ranks() == world, Errc::InvalidArgument,
                "generate_on: the partition has {} ranks, the transport's world has {} (run one "
                "process per rank, e.g. mpirun -np {})",
                partition.num_ranks(), world, partition.num_ranks());
  BRIGADE_CHECK(fault.rank < world, Errc::InvalidArgument,
                "generate_on: fault injection on rank {}, outside [0, {})", fault.rank, world);
  BRIGADE_CHECK(fault.rank < 0 || fault.after_steps >= 1, Errc::InvalidArgument,
                "generate_on: fault injection after {} steps, expected >= 1", fault.after_steps);
  // Every rank builds the same plan from the same arguments.
  const plan::Plan plan = inference_plan(weights.config, partition, requests, options.microbatches);
  const auto layout = check_inference_plan(plan, weights.config, requests, options, "generate_on");
  const int P = partition.num_ranks();
  const int root = partition.stage(0).rank;
  const int groups = plan.shape().num_microbatches;

  cpu::set_blas_threads(options.blas_threads);
  detail::SequenceBook book(requests, weights.config.seq_len, groups);
  transport::ExitAfterSteps<T> pipe(transport, fault.rank == me ? fault.after_steps : 0);

  InferenceReport report;
  report.timeline = Timeline(P);
  try {
    const auto t0 = detail::start_together(pipe, root, options.timeout_s);
    report.origin = t0;
    const double resident = run_inference_rank(pipe, weights, plan, layout,
                                               me == root ? &book : nullptr, options, t0,
                                               report.timeline, CpuBackends{}, tp_group);
    report.resident_weight_bytes.assign(static_cast<std::size_t>(P), 0.0);
    report.resident_weight_bytes[static_cast<std::size_t>(me)] = resident;
    const double end_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    report.wall_s = detail::gather_timelines(pipe, root, report.timeline, end_s, resident,
                                             &report.resident_weight_bytes, options.timeout_s);
    if (me != root) return report;
  } catch (const std::exception& e) {
    transport::abort_others(transport, e);
    throw;
  }
  report.sequences = book.results();
  for (const auto& r : report.sequences) {
    report.generated_tokens += r.generated;
    report.prompt_tokens += r.prompt_tokens;
  }
  return report;
}

}  // namespace v0
}  // namespace brigade::engine
