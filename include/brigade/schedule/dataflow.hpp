// The dataflow edges of the schedule IR: which action feeds which, and how a SEND pairs with
// its RECV. lower(), validate(), the simulator and the executor all read the edges from here.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/schedule/action.hpp"

#include <optional>

namespace brigade::schedule {
inline namespace v0 {

/// Pairing rule of the lowered IR. Every communication action names the virtual stage that
/// lives on its own rank, and the micro-batch and chunk (round) of the tensor it moves:
///
/// | action               | moves                          | counterpart (on the peer rank)   |
/// | -------------------- | ------------------------------ | -------------------------------- |
/// | SEND_F(v, m, c)      | output of F(v, m, c)           | RECV_F(v + 1, m, c)              |
/// | RECV_F(v, m, c)      | input of F(v, m, c)            | SEND_F(v - 1, m, c)              |
/// | SEND_B(v, m, c)      | input gradient of B/BI(v,m,c)  | RECV_B(v - 1, m, c)              |
/// | RECV_B(v, m, c)      | output gradient for B/BI(v,m,c)| SEND_B(v + 1, m, c)              |
///
/// Inference adds the token edge that closes the loop: SEND_F(N-1, m, c) carries the token
/// sampled by SAMPLE(N-1, m, c) to RECV_F(0, m, c + 1), the first stage's input of the next
/// round. The peer rank is `shape.rank_of(counterpart.virtual_stage)`; a transport tags the
/// message with the receiver's (virtual stage, micro-batch, chunk).
///
/// @return the matching action, or std::nullopt when `a` is a compute op or has no
///         counterpart in this shape (e.g. SEND_F from the last stage in training)
inline std::optional<Action> counterpart(const Shape& shape, const Action& a) noexcept {
  const int last = shape.num_virtual_stages - 1;
  const bool inference = shape.mode == Mode::Inference;
  switch (a.op) {
    case Op::SendF:
      if (a.virtual_stage < last)
        return Action{Op::RecvF, a.virtual_stage + 1, a.microbatch, a.chunk};
      if (inference && a.virtual_stage == last && a.chunk + 1 < shape.num_chunks)
        return Action{Op::RecvF, 0, a.microbatch, a.chunk + 1};
      return std::nullopt;
    case Op::RecvF:
      if (a.virtual_stage > 0) return Action{Op::SendF, a.virtual_stage - 1, a.microbatch, a.chunk};
      if (inference && a.virtual_stage == 0 && a.chunk > 0)
        return Action{Op::SendF, last, a.microbatch, a.chunk - 1};
      return std::nullopt;
    case Op::SendB:
      if (!inference && a.virtual_stage > 0)
        return Action{Op::RecvB, a.virtual_stage - 1, a.microbatch, a.chunk};
      return std::nullopt;
    case Op::RecvB:
      if (!inference && a.virtual_stage < last)
        return Action{Op::SendB, a.virtual_stage + 1, a.microbatch, a.chunk};
      return std::nullopt;
    default:
      return std::nullopt;
  }
}

/// The rank a communication action talks to: `shape.rank_of(counterpart(shape, a)->virtual_stage)`.
/// @throws brigade::Error{InvalidArgument} if `a` is not a communication op or has no
///         counterpart in this shape
inline int peer_rank(const Shape& shape, const Action& a) {
  const auto c = counterpart(shape, a);
  BRIGADE_CHECK(c.has_value(), Errc::InvalidArgument,
                "peer_rank: {} has no counterpart in a {} schedule of {} virtual stages",
                to_string(a), to_string(shape.mode), shape.num_virtual_stages);
  return shape.rank_of(c->virtual_stage);
}

/// The compute action whose result a RECV-side consumer needs, for the ops that take an input
/// from another virtual stage:
/// - F(v, m, c), v > 0: F(v - 1, m, c);
/// - F(0, m, c), inference, c > 0: SAMPLE(N - 1, m, c - 1);
/// - B/BI(v, m, c), training, v < N - 1: the backward of v + 1 (returned as op B; BI also fits).
/// @return std::nullopt when the action takes no input from another virtual stage
inline std::optional<Action> upstream_input(const Shape& shape, const Action& a) noexcept {
  const int last = shape.num_virtual_stages - 1;
  const bool inference = shape.mode == Mode::Inference;
  if (a.op == Op::F) {
    if (a.virtual_stage > 0) return Action{Op::F, a.virtual_stage - 1, a.microbatch, a.chunk};
    if (inference && a.chunk > 0) return Action{Op::Sample, last, a.microbatch, a.chunk - 1};
    return std::nullopt;
  }
  if ((a.op == Op::B || a.op == Op::BI) && !inference && a.virtual_stage < last)
    return Action{Op::B, a.virtual_stage + 1, a.microbatch, a.chunk};
  return std::nullopt;
}

/// The SEND a compute action's result needs when its consumer sits on another virtual stage:
/// F(v) -> SEND_F(v) for v < N - 1; SAMPLE(N-1, m, c) -> SEND_F(N-1, m, c) in inference when a
/// next round exists; B/BI(v) -> SEND_B(v) for v > 0 in training. Whether the send is needed
/// depends on the placement (see lower()).
/// @return std::nullopt when nothing downstream consumes the result on another stage
inline std::optional<Action> downstream_send(const Shape& shape, const Action& a) noexcept {
  const int last = shape.num_virtual_stages - 1;
  const bool inference = shape.mode == Mode::Inference;
  if (a.op == Op::F && a.virtual_stage < last)
    return Action{Op::SendF, a.virtual_stage, a.microbatch, a.chunk};
  if (a.op == Op::Sample && inference && a.virtual_stage == last && a.chunk + 1 < shape.num_chunks)
    return Action{Op::SendF, a.virtual_stage, a.microbatch, a.chunk};
  if ((a.op == Op::B || a.op == Op::BI) && !inference && a.virtual_stage > 0)
    return Action{Op::SendB, a.virtual_stage, a.microbatch, a.chunk};
  return std::nullopt;
}

}  // namespace v0
}  // namespace brigade::schedule
