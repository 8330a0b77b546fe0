// brigade::Op: the kinds of work a rank does, shared by the schedule IR and the Timeline.
#pragma once

#include "brigade/core/error.hpp"

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

namespace brigade {
inline namespace v0 {

/// One kind of action in a rank's program (the schedule IR) or a Timeline interval.
///
/// F: forward; B: full backward; BI/BW: backward for inputs / for weights (zero-bubble split,
/// Qi et al. 2023); Recompute: re-run a forward whose activations were dropped;
/// SendF/RecvF: activations between stages; SendB/RecvB: gradients between stages;
/// Sample: pick the next token on the tail stage; Opt: optimizer step.
enum class Op : std::uint8_t { F, B, BI, BW, Recompute, SendF, RecvF, SendB, RecvB, Sample, Opt };

/// Number of enumerators of Op.
inline constexpr int kNumOps = 11;

/// Text form of an op as the schedule IR prints it: "F", "B", "BI", "BW", "RECOMPUTE",
/// "SEND_F", "RECV_F", "SEND_B", "RECV_B", "SAMPLE", "OPT".
constexpr std::string_view to_string(Op op) noexcept {
  constexpr std::array<std::string_view, kNumOps> names = {
      "F", "B", "BI", "BW", "RECOMPUTE", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "SAMPLE", "OPT"};
  return names[static_cast<std::size_t>(op)];
}

/// Inverse of to_string(Op); std::nullopt for an unknown name.
constexpr std::optional<Op> op_from_string(std::string_view s) noexcept {
  for (int i = 0; i < kNumOps; ++i)
    if (to_string(static_cast<Op>(i)) == s) return static_cast<Op>(i);
  return std::nullopt;
}

/// True for the four communication ops (SEND_F, RECV_F, SEND_B, RECV_B).
constexpr bool is_communication(Op op) noexcept {
  return op == Op::SendF || op == Op::RecvF || op == Op::SendB || op == Op::RecvB;
}

}  // namespace v0
}  // namespace brigade
