// lower(): the pass that turns a compute-only schedule into one with explicit communication.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/partition/partition.hpp"
#include "brigade/schedule/action.hpp"
#include "brigade/schedule/dataflow.hpp"

#include <utility>

namespace brigade::schedule {
inline namespace v0 {

namespace detail {

inline void check_program_shape(const Schedule& s, std::string_view pass) {
  s.shape.check();
  BRIGADE_CHECK(s.ranks.size() == static_cast<std::size_t>(s.shape.num_ranks),
                Errc::InvalidArgument, "{}: {} rank programs, expected shape.num_ranks = {}", pass,
                s.ranks.size(), s.shape.num_ranks);
}

inline void check_action_range(const Shape& sh, const Action& a, int rank, std::size_t index,
                               std::string_view pass) {
  BRIGADE_CHECK(
      a.virtual_stage >= 0 && a.virtual_stage < sh.num_virtual_stages && a.microbatch >= 0 &&
          a.microbatch < sh.num_microbatches && a.chunk >= 0 && a.chunk < sh.num_chunks,
      Errc::InvalidArgument,
      "{}: rank {} step {}: {} is outside the shape (stages {}, micro-batches {}, "
      "chunks {})",
      pass, rank, index, to_string(a), sh.num_virtual_stages, sh.num_microbatches, sh.num_chunks);
  BRIGADE_CHECK(sh.rank_of(a.virtual_stage) == rank, Errc::InvalidArgument,
                "{}: rank {} step {}: {} names virtual stage {}, which is placed on rank {}", pass,
                rank, index, to_string(a), a.virtual_stage, sh.rank_of(a.virtual_stage));
}

}  // namespace detail

/// Lowers a compute-only schedule by inserting SEND_F/RECV_F/SEND_B/RECV_B actions.
///
/// Every dataflow edge (see counterpart()) between virtual stages on different ranks gets one
/// send on the producer, placed right after the producing action, and one receive on the
/// consumer, placed right before the consuming action; edges within a rank get none. Compute
/// actions keep their order (strip_communication(lower(s)) == s). The inference token edge
/// (SAMPLE of round c on the last stage to F(0) of round c + 1) is lowered like any other.
///
/// @param compute per-rank programs without communication: compute ops (F, B, BI, BW,
///                RECOMPUTE, SAMPLE, OPT) and the memory ops (PREFETCH, RELEASE, MIGRATE), which
///                keep their place (they have no dataflow edges)
/// @return the lowered schedule; validate() on it succeeds iff `compute` is deadlock-free and
///         complete
/// @throws brigade::Error{InvalidArgument} if `compute` holds a communication op, its shape is
///         invalid, or an action lies outside the shape or on a rank other than its placement
/// @see Narayanan et al. 2021 (PTD-P), §2.2 (interleaved 1F1B and its placement)
inline Schedule lower(const Schedule& compute) {
  detail::check_program_shape(compute, "lower");
  const Shape& sh = compute.shape;
  Schedule out{sh, {}};
  out.ranks.resize(compute.ranks.size());
  for (int r = 0; r < sh.num_ranks; ++r) {
    const auto& in = compute.ranks[static_cast<std::size_t>(r)];
    auto& prog = out.ranks[static_cast<std::size_t>(r)];
    prog.reserve(in.size() * 2);
    for (std::size_t i = 0; i < in.size(); ++i) {
      const Action& a = in[i];
      BRIGADE_CHECK(!is_communication(a.op), Errc::InvalidArgument,
                    "lower: rank {} step {}: {} is a communication op; lower() takes a "
                    "compute-only schedule (strip_communication() removes them)",
                    r, i, to_string(a));
      detail::check_action_range(sh, a, r, i, "lower");
      if (const auto up = upstream_input(sh, a); up && sh.rank_of(up->virtual_stage) != r)
        prog.push_back(
            {a.op == Op::F ? Op::RecvF : Op::RecvB, a.virtual_stage, a.microbatch, a.chunk});
      prog.push_back(a);
      if (const auto send = downstream_send(sh, a)) {
        const auto peer = counterpart(sh, *send);
        if (peer && sh.rank_of(peer->virtual_stage) != r) prog.push_back(*send);
      }
    }
  }
  return out;
}

/// lower() with the placement taken from a Partition: virtual stage v runs on
/// `partition.stage(v).rank`. The shape's placement is replaced.
/// @throws brigade::Error{InvalidArgument} if the partition's stage or rank count differs from
///         the shape's, or as lower(const Schedule&)
inline Schedule lower(Schedule compute, const partition::Partition& partition) {
  BRIGADE_CHECK(partition.num_stages() == compute.shape.num_virtual_stages &&
                    partition.num_ranks() == compute.shape.num_ranks,
                Errc::InvalidArgument,
                "lower: the partition has {} stages on {} ranks, the schedule {} virtual stages "
                "on {} ranks",
                partition.num_stages(), partition.num_ranks(), compute.shape.num_virtual_stages,
                compute.shape.num_ranks);
  compute.shape.placement.assign(static_cast<std::size_t>(partition.num_stages()), 0);
  for (int v = 0; v < partition.num_stages(); ++v)
    compute.shape.placement[static_cast<std::size_t>(v)] = partition.stage(v).rank;
  return lower(compute);
}

/// The inverse of lower() on its output: every SEND/RECV removed, the other actions (compute
/// and memory ops) in order.
inline Schedule strip_communication(const Schedule& s) {
  Schedule out{s.shape, {}};
  out.ranks.resize(s.ranks.size());
  for (std::size_t r = 0; r < s.ranks.size(); ++r)
    for (const auto& a : s.ranks[r])
      if (!is_communication(a.op)) out.ranks[r].push_back(a);
  return out;
}

}  // namespace v0
}  // namespace brigade::schedule
