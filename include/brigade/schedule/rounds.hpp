// Inference programs emitted round by round: the lowered actions of one round (one prefill or
// decode step of every live micro-batch) for one rank, so the executor can run generation
// without knowing up front how many rounds each micro-batch needs.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/schedule/action.hpp"
#include "brigade/schedule/dataflow.hpp"

#include <span>
#include <vector>

namespace brigade::schedule {
inline namespace v0 {

/// Appends rank `rank`'s lowered actions of round `round` of an inference schedule to `out`:
/// for each of its virtual stages v in ascending order, for each micro-batch m with
/// `live[m] != 0` in ascending order: RECV_F(v, m, round) when v's input comes from another
/// rank (from v - 1, or for v = 0 and round > 0 the sampled token of the last virtual stage),
/// F(v, m, round), SAMPLE(v, m, round) on the last virtual stage, and SEND_F(v, m, round) when
/// the consumer (v + 1, or the next round's v = 0) sits on another rank and exists in `shape`.
///
/// With every micro-batch live, rounds 0 .. C-1 concatenated equal rank `rank`'s program of
/// `lower(inference(p))` for C = 1 + p.decode_steps rounds (the generator's order, Mode::Inference,
/// chunk = round). `shape.num_chunks` is an upper bound on the rounds, which the executor's
/// peers need (the token edge of the last possible round has no counterpart).
/// @throws brigade::Error{InvalidArgument} if the shape is not an inference shape, the rank or
///         round is outside it, or `live` does not have one entry per micro-batch
inline void append_inference_round(const Shape& shape, int rank, int round,
                                   std::span<const char> live, std::vector<Action>& out) {
  BRIGADE_CHECK(shape.mode == Mode::Inference, Errc::InvalidArgument,
                "append_inference_round: a {} shape, expected inference", to_string(shape.mode));
  BRIGADE_CHECK(rank >= 0 && rank < shape.num_ranks && round >= 0 && round < shape.num_chunks,
                Errc::InvalidArgument,
                "append_inference_round: rank {} round {} outside ranks [0, {}) rounds [0, {})",
                rank, round, shape.num_ranks, shape.num_chunks);
  BRIGADE_CHECK(live.size() == static_cast<std::size_t>(shape.num_microbatches),
                Errc::InvalidArgument,
                "append_inference_round: {} liveness flags for {} micro-batches", live.size(),
                shape.num_microbatches);
  const int last = shape.num_virtual_stages - 1;
  for (int v = 0; v <= last; ++v) {
    if (shape.rank_of(v) != rank) continue;
    for (int m = 0; m < shape.num_microbatches; ++m) {
      if (!live[static_cast<std::size_t>(m)]) continue;
      const Action f{Op::F, v, m, round};
      if (const auto up = upstream_input(shape, f); up && shape.rank_of(up->virtual_stage) != rank)
        out.push_back({Op::RecvF, v, m, round});
      out.push_back(f);
      Action producer = f;
      if (v == last) {
        producer = {Op::Sample, v, m, round};
        out.push_back(producer);
      }
      if (const auto send = downstream_send(shape, producer)) {
        const auto peer = counterpart(shape, *send);
        if (peer && shape.rank_of(peer->virtual_stage) != rank) out.push_back(*send);
      }
    }
  }
}

}  // namespace v0
}  // namespace brigade::schedule
