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
///
/// Weight and cache movement (prima.cpp's mmap offload, Li et al. 2025; DynaPipe's KV-cache
/// migration): Prefetch: start loading the weights of the action's virtual stage into memory,
/// asynchronously (on the rank's I/O lane, overlapping compute; the next compute of that
/// virtual stage waits for it); Release: drop that virtual stage's weights after their last use
/// (a later compute needs a Prefetch first); Migrate: the action's virtual stage sends one part
/// of a decoder layer it hands to a neighbouring virtual stage (a share of the layer's weights
/// and the KV rows of the action's micro-batch's sequences for that layer not sent yet, as of
/// the action's round); MigrateRecv: the neighbour that adopts the layer receives that part
/// (DynaPipe's asynchronous KV-cache migration; the pairing and ordering rules are
/// schedule::validate()'s, docs/schedules.md).
enum class Op : std::uint8_t {
  F, B, BI, BW, Recompute, SendF, RecvF, SendB, RecvB, Sample, Opt, Prefetch, Release, Migrate,
  MigrateRecv
};

/// Number of enumerators of Op.
inline constexpr int kNumOps = 15;

/// Text form of an op as the schedule IR prints it: "F", "B", "BI", "BW", "RECOMPUTE",
/// "SEND_F", "RECV_F", "SEND_B", "RECV_B", "SAMPLE", "OPT", "PREFETCH", "RELEASE", "MIGRATE",
/// "MIGRATE_RECV".
constexpr std::string_view to_string(Op op) noexcept {
  constexpr std::array<std::string_view, kNumOps> names = {
      "F",      "B",      "BI",     "BW",  "RECOMPUTE", "SEND_F",  "RECV_F",  "SEND_B",
      "RECV_B", "SAMPLE", "OPT",    "PREFETCH",  "RELEASE", "MIGRATE", "MIGRATE_RECV"};
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

/// True for the four memory-movement ops (PREFETCH, RELEASE, MIGRATE, MIGRATE_RECV): they move
/// weights or KV cache, not activations, and are neither compute nor SEND/RECV.
constexpr bool is_memory_op(Op op) noexcept {
  return op == Op::Prefetch || op == Op::Release || op == Op::Migrate || op == Op::MigrateRecv;
}

/// True for the two halves of a layer migration (MIGRATE, MIGRATE_RECV): a message pair between
/// neighbouring virtual stages.
constexpr bool is_migration(Op op) noexcept { return op == Op::Migrate || op == Op::MigrateRecv; }

/// True for the compute ops (F, B, BI, BW, RECOMPUTE, SAMPLE, OPT): the ones that keep a rank's
/// compute lane busy and count as busy time in a Timeline.
constexpr bool is_compute(Op op) noexcept { return !is_communication(op) && !is_memory_op(op); }

}  // namespace v0
}  // namespace brigade
