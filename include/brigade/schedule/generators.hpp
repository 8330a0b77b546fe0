// Schedule generators: free functions that return a compute-only Schedule (lower() adds the
// communication). Each documents its paper, its order and its closed forms.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/schedule/action.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string_view>
#include <utility>
#include <vector>

namespace brigade::schedule {
inline namespace v0 {

/// Parameters every generator takes; each generator states which it honours.
struct Params {
  int ranks = 1;           ///< P: pipeline ranks (>= 1)
  int microbatches = 1;    ///< M: micro-batches (training) or sequence groups (inference), >= 1
  int virtual_stages = 1;  ///< V: virtual stages (model chunks) per rank, >= 1
  int decode_steps = 3;    ///< inference only: decode rounds after the prefill round (>= 0)
  /// adaptive only: bytes of activations micro-batch m keeps on a rank from its F to its B
  /// (the rank that holds the most, e.g. batching::MicroBatchCost::activation_bytes), [M] or
  /// empty (then every micro-batch counts 1 byte), each finite and >= 0.
  std::vector<double> microbatch_bytes = {};
  /// adaptive only: bytes micro-batch m holds at its peak on a rank, >= microbatch_bytes[m]:
  /// what its stash grows to during its own passes (a micro-batch whose activations are dropped
  /// after F keeps microbatch_bytes = its checkpoint until its RECOMPUTE, then its whole stash
  /// until the backward frees it), [M] or empty (then equal to microbatch_bytes).
  std::vector<double> microbatch_peak_bytes = {};
  /// adaptive only: bytes of micro-batch activations one rank may hold at once (> 0); infinity:
  /// no limit.
  double memory_limit_bytes = std::numeric_limits<double>::infinity();
};

namespace detail {

inline void check_params(const Params& p, std::string_view name, bool allow_virtual) {
  BRIGADE_CHECK(p.ranks >= 1, Errc::InvalidArgument, "{}: ranks = {}, expected >= 1", name,
                p.ranks);
  BRIGADE_CHECK(p.microbatches >= 1, Errc::InvalidArgument, "{}: microbatches = {}, expected >= 1",
                name, p.microbatches);
  BRIGADE_CHECK(p.virtual_stages >= 1, Errc::InvalidArgument,
                "{}: virtual stages per rank = {}, expected >= 1", name, p.virtual_stages);
  BRIGADE_CHECK(allow_virtual || p.virtual_stages == 1, Errc::InvalidArgument,
                "{}: virtual stages per rank = {}, but {} places one stage per rank (expected 1; "
                "use interleaved-1f1b or inference for V > 1)",
                name, p.virtual_stages, name);
  const std::int64_t actions = static_cast<std::int64_t>(p.ranks) * p.virtual_stages *
                               p.microbatches * (1 + std::max(0, p.decode_steps)) * 3;
  BRIGADE_CHECK(actions <= (std::int64_t{1} << 27), Errc::InvalidArgument,
                "{}: ranks x virtual x micro-batches = {} x {} x {} is too large (more than 2^27 "
                "actions)",
                name, p.ranks, p.virtual_stages, p.microbatches);
}

}  // namespace detail

/// GPipe (Huang et al. 2019, §2.2 "Performance Optimization"): every rank runs the forward of
/// all M micro-batches, then all M backwards in micro-batch order.
///
/// Rank r: F(r,0) .. F(r,M-1), B(r,0) .. B(r,M-1). Honours ranks, microbatches (V must be 1).
/// Closed forms (costs F, B per rank and micro-batch, free links): makespan (M + P - 1)(F + B),
/// bubble ratio (P - 1) / (M + P - 1); every rank stashes all M micro-batches' activations.
/// @throws brigade::Error{InvalidArgument} for ranks or microbatches < 1, or V != 1
inline Schedule gpipe(const Params& p) {
  detail::check_params(p, "gpipe", false);
  Schedule s = empty_schedule(Shape::make(p.ranks, p.microbatches));
  for (int r = 0; r < p.ranks; ++r) {
    auto& prog = s.ranks[static_cast<std::size_t>(r)];
    prog.reserve(2 * static_cast<std::size_t>(p.microbatches));
    for (int m = 0; m < p.microbatches; ++m) prog.push_back({Op::F, r, m, 0});
    for (int m = 0; m < p.microbatches; ++m) prog.push_back({Op::B, r, m, 0});
  }
  return s;
}

/// 1F1B, the PipeDream-Flush schedule (Narayanan et al. 2021, "Memory-Efficient
/// Pipeline-Parallel DNN Training", §3; also PTD-P §2.2.1): after a warm-up of
/// min(P - r - 1, M) forwards, rank r alternates one forward and one backward, then drains the
/// remaining backwards.
///
/// Honours ranks, microbatches (V must be 1). Closed forms (free links): the same bubble as
/// GPipe, (P - 1) / (M + P - 1), but rank r stashes at most min(P - r, M) micro-batches
/// (rank 0: min(P, M)) instead of M.
/// @throws brigade::Error{InvalidArgument} for ranks or microbatches < 1, or V != 1
inline Schedule one_f_one_b(const Params& p) {
  detail::check_params(p, "1f1b", false);
  Schedule s = empty_schedule(Shape::make(p.ranks, p.microbatches));
  const int M = p.microbatches;
  for (int r = 0; r < p.ranks; ++r) {
    auto& prog = s.ranks[static_cast<std::size_t>(r)];
    prog.reserve(2 * static_cast<std::size_t>(M));
    const int warmup = std::min(p.ranks - r - 1, M);
    int f = 0, b = 0;
    for (; f < warmup; ++f) prog.push_back({Op::F, r, f, 0});
    while (f < M) {
      prog.push_back({Op::F, r, f++, 0});
      prog.push_back({Op::B, r, b++, 0});
    }
    while (b < M) prog.push_back({Op::B, r, b++, 0});
  }
  return s;
}

/// Interleaved 1F1B (Narayanan et al. 2021, PTD-P, §2.2.2) in Megatron-LM's order: rank r holds
/// V model chunks, virtual stages r, r + P, ..., r + (V-1)P (round-robin placement).
///
/// Micro-batches run in groups: floor(M / P) groups (one group of M when M < P) whose sizes
/// differ by at most one, the larger first, so every group holds at least P micro-batches
/// when M >= P (exactly P each when P divides M). Within a group every micro-batch runs chunk 0,
/// then every one chunk 1, and so on; this table orders the rank's V * M forwards, and the same
/// table with chunk k replaced by V - 1 - k its backwards. The rank runs a warm-up of
/// min(2(P - r - 1) + (V - 1)G, VM) forwards (G: the first group's size), then alternates
/// forward warm-up + j and backward j, then drains the backwards. When P divides M, forward i
/// is chunk (i mod PV) div P of micro-batch (i div PV) P + (i mod P).
///
/// Megatron-LM (megatron/core/pipeline_parallel/schedules.py, get_schedule_table and
/// get_pp_rank_microbatches) takes one group size G = microbatch_group_size_per_vp_stage for
/// every group but the last (the remainder) and refuses a last group smaller than P, which
/// "introduces dependency bubbles" (under the eager-send semantics of validate() it deadlocks,
/// e.g. P = 4, M = 5, V = 3 in groups of 4 and 1). PyTorch's ScheduleInterleaved1F1B runs
/// floor(M / P) rounds of M / floor(M / P) micro-batches and refuses M when the rounds do not
/// divide it (P = 4, M = 11). This order is PyTorch's wherever PyTorch runs, Megatron's with
/// G = the first group's size wherever that leaves a last group of at least P (P = 4: M = 6, 11,
/// 14), and otherwise spreads the remainder so that no group is smaller than P (P = 4, M = 13:
/// groups 5, 4, 4, where Megatron's G = 5 would leave 3). Every M >= 1 is accepted.
///
/// Honours ranks, microbatches, virtual_stages. Closed form (per-rank costs F, B split evenly
/// over the V chunks, free links), when P divides M: bubble ratio (P - 1) / (V M + P - 1);
/// rank r stashes min(2(P - r - 1) + (V - 1)P + 1, VM) chunks at its peak. Otherwise the larger
/// groups make the bubble larger than that (never smaller).
/// @throws brigade::Error{InvalidArgument} for counts < 1
inline Schedule interleaved_1f1b(const Params& p) {
  detail::check_params(p, "interleaved-1f1b", true);
  const int P = p.ranks, V = p.virtual_stages, M = p.microbatches;
  Schedule s = empty_schedule(Shape::make(P, M, V));
  const int total = V * M;
  struct Unit {
    int chunk, microbatch;
  };
  std::vector<Unit> table;  // Megatron's schedule table: forward i runs table[i]
  table.reserve(static_cast<std::size_t>(total));
  const int rounds = std::max(1, M / P), big = M % rounds;
  const int group0 = M / rounds + (big > 0 ? 1 : 0);  // the first (largest) group
  for (int g = 0, g0 = 0; g < rounds; ++g) {
    const int g1 = g0 + M / rounds + (g < big ? 1 : 0);
    for (int k = 0; k < V; ++k)
      for (int m = g0; m < g1; ++m) table.push_back({k, m});
    g0 = g1;
  }
  for (int r = 0; r < P; ++r) {
    auto& prog = s.ranks[static_cast<std::size_t>(r)];
    prog.reserve(2 * static_cast<std::size_t>(total));
    auto fwd = [&](int i) {
      const Unit u = table[static_cast<std::size_t>(i)];
      prog.push_back({Op::F, r + u.chunk * P, u.microbatch, 0});
    };
    auto bwd = [&](int i) {
      const Unit u = table[static_cast<std::size_t>(i)];
      prog.push_back({Op::B, r + (V - 1 - u.chunk) * P, u.microbatch, 0});
    };
    const int warmup = std::min(2 * (P - r - 1) + (V - 1) * group0, total);
    for (int i = 0; i < warmup; ++i) fwd(i);
    for (int j = 0; j < total - warmup; ++j) {
      fwd(warmup + j);
      bwd(j);
    }
    for (int j = total - warmup; j < total; ++j) bwd(j);
  }
  return s;
}

/// ZB-H1, the handcrafted zero-bubble schedule of Qi et al. 2023, "Zero Bubble Pipeline
/// Parallelism", §3 (Figure 3, top): the backward is split into BI (gradient for the input, on
/// the critical path) and BW (gradient for the weights, deferrable).
///
/// Rank r: warm-up forwards F(0) .. F(min(P - r, M) - 1); then for k = 0 .. M-1: BI(k), BW(k - r)
/// once k >= r (rank r defers its weight gradients by r steps), then the next forward
/// F(k + P - r) if any; then the deferred BW(M - r) .. BW(M - 1). This is the steady-state order
/// of PyTorch's zero-bubble schedules (BI, BW, then F): the BW that frees an activation runs
/// before the forward that stashes the next one, so counting an activation as held until its
/// BW, rank r holds at most min(P, M) micro-batches, 1F1B's rank-0 figure (running the forward
/// before the BW would peak at P + 1 once M > P, for the same makespan).
///
/// Honours ranks, microbatches (V must be 1). Closed form (free links, M >= P): bubble time
/// (P - 1)(F + BI - BW) per rank, so with F = BI = BW = 1 the ratio is (P - 1) / (3M + P - 1).
/// @throws brigade::Error{InvalidArgument} for ranks or microbatches < 1, or V != 1
inline Schedule zero_bubble_h1(const Params& p) {
  detail::check_params(p, "zb-h1", false);
  const int P = p.ranks, M = p.microbatches;
  Schedule s = empty_schedule(Shape::make(P, M));
  for (int r = 0; r < P; ++r) {
    auto& prog = s.ranks[static_cast<std::size_t>(r)];
    prog.reserve(3 * static_cast<std::size_t>(M));
    const int warmup = std::min(P - r, M);
    for (int f = 0; f < warmup; ++f) prog.push_back({Op::F, r, f, 0});
    int w = 0;
    for (int k = 0; k < M; ++k) {
      prog.push_back({Op::BI, r, k, 0});
      if (k >= r) prog.push_back({Op::BW, r, w++, 0});
      if (k + P - r < M) prog.push_back({Op::F, r, k + P - r, 0});
    }
    while (w < M) prog.push_back({Op::BW, r, w++, 0});
  }
  return s;
}

namespace detail {

/// Checks the parameters of a V-shaped generator: V must be 2 (the shape's two chunks).
inline void check_v_params(const Params& p, std::string_view name) {
  check_params(p, name, true);
  BRIGADE_CHECK(p.virtual_stages == 2, Errc::InvalidArgument,
                "{}: virtual stages per rank = {}, but {} places exactly 2 per rank in a V "
                "(expected 2)",
                name, p.virtual_stages, name);
}

/// Appends compute actions of one rank of a V-shaped schedule, counting each (chunk, op)'s
/// micro-batches: chunk 0 is virtual stage r, chunk 1 is 2P - 1 - r. Actions whose micro-batch
/// reaches `limit` are dropped (ZB-V builds its order for max(M, 2P - 1) and keeps the first M).
struct VRankBuilder {
  std::vector<Action>& prog;
  int stage[2];
  int limit;
  int next_f[2] = {0, 0}, next_b[2] = {0, 0}, next_w[2] = {0, 0};

  void emit(Op op, int chunk, int microbatch) {
    if (microbatch < limit) prog.push_back({op, stage[chunk], microbatch, 0});
  }
  void f(int c) { emit(Op::F, c, next_f[c]++); }
  /// Full backward (B): input and weight gradients at once.
  void b(int c) { emit(Op::B, c, next_b[c]++); }
  /// BI of the next micro-batch of chunk c; returns that micro-batch.
  int bi(int c) {
    emit(Op::BI, c, next_b[c]);
    return next_b[c]++;
  }
  /// BW of chunk c's oldest micro-batch whose BW has not run (for orders without full B).
  void bw(int c) { emit(Op::BW, c, next_w[c]++); }
};

}  // namespace detail

/// ZB-V, the V-shaped zero-bubble schedule of Qi et al. 2023, "Zero Bubble Pipeline
/// Parallelism", §6, in the order of PyTorch's ScheduleZBVZeroBubble. Placement
/// Shape::make_v(P, M): rank r holds chunk 0 = virtual stage r and chunk 1 = 2P - 1 - r.
///
/// Rank r, with counters per chunk, on M' = max(M, 2P - 1) micro-batches: 2(P - r) - 1
/// forwards of chunk 0; r times F1, F0; P - r times F1, BI1, BW1; then while chunk 0 has
/// forwards left or chunk 1 trails it: F0 (if any left), BI0, BW0, F1, BI1, BW1; then r times
/// BI0, BI1 (weight gradients deferred); P - r times BI0 then the oldest deferred BW0; then the
/// deferred BW1, then the deferred BW0. Actions on micro-batches >= M are dropped.
///
/// Honours ranks, microbatches; V must be 2. The paper's claims for F = BI = BW and free links:
/// zero bubble in the steady state, 1F1B's peak activation memory. Simulated with F = BI = BW = 1
/// per chunk and M >= 2P: every rank idles exactly P - 1 (the first forward's trip to the tip of
/// the V, before the steady state), ratio (P - 1) / (6M + P - 1), and holds 2P chunks = P
/// micro-batches of a whole rank's layers (tests/unit/test_sim_closed_forms.cpp).
/// @throws brigade::Error{InvalidArgument} for ranks or microbatches < 1, or V != 2
inline Schedule zero_bubble_v(const Params& p) {
  detail::check_v_params(p, "zb-v");
  const int P = p.ranks, M = p.microbatches, Mx = std::max(M, 2 * P - 1);
  Schedule s = empty_schedule(Shape::make_v(P, M));
  for (int r = 0; r < P; ++r) {
    auto& prog = s.ranks[static_cast<std::size_t>(r)];
    prog.reserve(6 * static_cast<std::size_t>(M));
    detail::VRankBuilder v{prog, {r, 2 * P - 1 - r}, M};
    for (int i = 0; i < 2 * (P - r) - 1; ++i) v.f(0);
    for (int i = 0; i < r; ++i) {
      v.f(1);
      v.f(0);
    }
    for (int i = 0; i < P - r; ++i) {
      v.f(1);
      v.bi(1);
      v.bw(1);
    }
    while (v.next_f[1] < v.next_f[0] || v.next_f[0] < Mx) {
      if (v.next_f[0] < Mx) v.f(0);
      v.bi(0);
      v.bw(0);
      v.f(1);
      v.bi(1);
      v.bw(1);
    }
    for (int i = 0; i < r; ++i) {
      v.bi(0);
      v.bi(1);
    }
    for (int i = 0; i < P - r; ++i) {
      v.bi(0);
      v.bw(0);
    }
    while (v.next_w[1] < v.next_b[1]) v.bw(1);
    while (v.next_w[0] < v.next_b[0]) v.bw(0);
  }
  return s;
}

/// DualPipeV: the V-shaped ("cut-in-half", Sea AI Lab) form of DeepSeek-V3's DualPipe
/// (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §3.2.1), in the order of
/// deepseek-ai/DualPipe's dualpipev.py. Placement Shape::make_v(P, M): rank r holds chunk 0 =
/// virtual stage r and chunk 1 = 2P - 1 - r. Needs M >= 2P.
///
/// Rank r, with per-chunk counters (micro-batches in order) and a FIFO of deferred weight
/// gradients: (1) 2(P - r - 1) forwards F0; (2) r + 1 times F0, F1; (3) P - r - 1 times BI1,
/// the oldest deferred BW, F1; (4) M - 2P + r + 1 times the overlapped pairs (F0 & B1), then
/// (F1 & B0); (5) P - r - 1 times B1, then (F1 & B0); (6) r + 1 times a backward of chunk 1 then
/// of chunk 0, full B until the middle iteration, BI (weight gradient deferred) from there on
/// (odd ranks switch before chunk 1's, even ranks between the two); (7) P - r - 1 times the
/// oldest deferred BW, then BI0; (8) the deferred BWs.
///
/// The overlapped chunk "F & B" is a forward of one chunk immediately followed by the full
/// backward of the other chunk: two adjacent compute actions. lower() puts the forward's
/// SEND_F right after it and the backward's RECV_B right before the backward, so with the
/// executor's eager sends and pre-posted receives the forward's output travels while the
/// backward runs and the backward's gradient arrives while the forward runs: the
/// communication of each is hidden behind the other's compute. (DualPipe also overlaps the
/// two computations with each other, which pays off with expert-parallel all-to-all; here the
/// pair costs F + B.)
///
/// Honours ranks, microbatches; V must be 2. deepseek-ai/DualPipe's table for DualPipe with
/// PP = 2P stages: bubble (PP/2 - 1)(F&B + B - 3W) per device, activation memory PP + 1 chunk
/// micro-batches per device, 1x parameters in the V form; see docs/schedules.md for what the
/// simulator measures.
/// @throws brigade::Error{InvalidArgument} for ranks or microbatches < 1, V != 2 or M < 2P
inline Schedule dualpipe_v(const Params& p) {
  detail::check_v_params(p, "dualpipe-v");
  const int P = p.ranks, M = p.microbatches;
  BRIGADE_CHECK(M >= 2 * P, Errc::InvalidArgument,
                "dualpipe-v: microbatches = {}, expected at least 2 x ranks = {} (DualPipeV's "
                "warm-up fills both chunks of every rank)",
                M, 2 * P);
  Schedule s = empty_schedule(Shape::make_v(P, M));
  for (int r = 0; r < P; ++r) {
    auto& prog = s.ranks[static_cast<std::size_t>(r)];
    prog.reserve(6 * static_cast<std::size_t>(M));
    detail::VRankBuilder v{prog, {r, 2 * P - 1 - r}, M};
    std::vector<std::pair<int, int>> deferred;  // (chunk, micro-batch) waiting for BW, oldest first
    std::size_t next_deferred = 0;
    auto defer = [&](int c) { deferred.emplace_back(c, v.bi(c)); };
    auto pop_weight = [&] {
      if (next_deferred == deferred.size()) return;
      const auto [c, mb] = deferred[next_deferred++];
      v.emit(Op::BW, c, mb);
    };
    auto pair = [&](int fc, int bc) {  // the overlapped chunk F & B
      v.f(fc);
      v.b(bc);
    };
    for (int i = 0; i < 2 * (P - r - 1); ++i) v.f(0);
    for (int i = 0; i < r + 1; ++i) {
      v.f(0);
      v.f(1);
    }
    for (int i = 0; i < P - r - 1; ++i) {
      defer(1);
      pop_weight();
      v.f(1);
    }
    for (int i = 0; i < M - 2 * P + r + 1; ++i) {
      pair(0, 1);
      pair(1, 0);
    }
    for (int i = 0; i < P - r - 1; ++i) {
      v.b(1);
      pair(1, 0);
    }
    bool zb = false;
    const int half = (r + 1) / 2;
    for (int i = 0; i < r + 1; ++i) {
      if (i == half && r % 2 == 1) zb = true;
      zb ? defer(1) : v.b(1);
      if (i == half && r % 2 == 0) zb = true;
      zb ? defer(0) : v.b(0);
    }
    for (int i = 0; i < P - r - 1; ++i) {
      pop_weight();
      defer(0);
    }
    while (next_deferred < deferred.size()) pop_weight();
  }
  return s;
}

/// Pipelined inference: prefill and decode of M sequence groups (micro-batches) over
/// 1 + decode_steps rounds. `chunk` is the round: 0 = prefill, r >= 1 = the r-th decode step
/// (Mode::Inference, num_chunks = 1 + decode_steps).
///
/// Rank r, for each round c, for each of its virtual stages v = r, r + P, ... in order, for each
/// micro-batch m: F(v, m, c), and on the last virtual stage SAMPLE(N-1, m, c) right after it.
/// The sampled token returns to virtual stage 0 for round c + 1 (lower() turns that edge into
/// SEND_F(N-1, m, c) -> RECV_F(0, m, c + 1)). With M >= P the pipeline stays full: while
/// group m's token travels back, the other groups keep every rank busy. V > 1 walks the ring
/// of ranks V times per token (prima.cpp's pipelined ring).
///
/// Honours ranks, microbatches, virtual_stages, decode_steps.
/// @throws brigade::Error{InvalidArgument} for counts < 1 or decode_steps < 0
inline Schedule inference(const Params& p) {
  detail::check_params(p, "inference", true);
  BRIGADE_CHECK(p.decode_steps >= 0, Errc::InvalidArgument,
                "inference: decode_steps = {}, expected >= 0", p.decode_steps);
  const int P = p.ranks, V = p.virtual_stages, M = p.microbatches, rounds = 1 + p.decode_steps;
  Schedule s = empty_schedule(Shape::make(P, M, V, rounds, Mode::Inference));
  const int last = P * V - 1;
  for (int r = 0; r < P; ++r) {
    auto& prog = s.ranks[static_cast<std::size_t>(r)];
    for (int c = 0; c < rounds; ++c)
      for (int k = 0; k < V; ++k) {
        const int v = r + k * P;
        for (int m = 0; m < M; ++m) {
          prog.push_back({Op::F, v, m, c});
          if (v == last) prog.push_back({Op::Sample, v, m, c});
        }
      }
  }
  return s;
}

}  // namespace v0
}  // namespace brigade::schedule
