// Schedule generators: free functions that return a compute-only Schedule (lower() adds the
// communication). Each documents its paper, its order and its closed forms.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/schedule/action.hpp"

#include <algorithm>
#include <cstdint>
#include <string_view>

namespace brigade::schedule {
inline namespace v0 {

/// Parameters every generator takes; each generator states which it honours.
struct Params {
  int ranks = 1;           ///< P: pipeline ranks (>= 1)
  int microbatches = 1;    ///< M: micro-batches (training) or sequence groups (inference), >= 1
  int virtual_stages = 1;  ///< V: virtual stages (model chunks) per rank, >= 1
  int decode_steps = 3;    ///< inference only: decode rounds after the prefill round (>= 0)
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
/// The rank runs V * M "virtual micro-batches" i = 0 .. VM-1; forward i is chunk
/// k = (i mod PV) div P on micro-batch (i div PV) * P + (i mod P), backward i the same with
/// chunk V - 1 - k. It runs a warm-up of min(2(P - r - 1) + (V - 1)P, VM) forwards, then
/// alternates forward warm-up + j and backward j, then drains the backwards.
///
/// Honours ranks, microbatches, virtual_stages; M must be a multiple of P when V > 1.
/// Closed form (per-rank costs F, B split evenly over the V chunks, free links):
/// bubble ratio (P - 1) / (V M + P - 1).
/// @throws brigade::Error{InvalidArgument} for counts < 1, or V > 1 with M not a multiple of P
inline Schedule interleaved_1f1b(const Params& p) {
  detail::check_params(p, "interleaved-1f1b", true);
  const int P = p.ranks, V = p.virtual_stages, M = p.microbatches;
  BRIGADE_CHECK(V == 1 || M % P == 0, Errc::InvalidArgument,
                "interleaved-1f1b: microbatches = {} is not a multiple of ranks = {} (Megatron's "
                "interleaved order runs micro-batches in groups of P)",
                M, P);
  Schedule s = empty_schedule(Shape::make(P, M, V));
  const int total = V * M, group = P * V;
  auto chunk_of = [&](int i, bool forward) {
    const int k = (i % group) / P;
    return forward ? k : V - 1 - k;
  };
  auto mb_of = [&](int i) { return (i / group) * P + i % P; };
  for (int r = 0; r < P; ++r) {
    auto& prog = s.ranks[static_cast<std::size_t>(r)];
    prog.reserve(2 * static_cast<std::size_t>(total));
    auto fwd = [&](int i) { prog.push_back({Op::F, r + chunk_of(i, true) * P, mb_of(i), 0}); };
    auto bwd = [&](int i) { prog.push_back({Op::B, r + chunk_of(i, false) * P, mb_of(i), 0}); };
    const int warmup = std::min(2 * (P - r - 1) + (V - 1) * P, total);
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
/// Rank r: warm-up forwards F(0) .. F(min(P - r, M) - 1); then for k = 0 .. M-1: BI(k), the
/// next forward F(k + P - r) if any, and BW(k - r) once k >= r (rank r defers its weight
/// gradients by r steps); then the deferred BW(M - r) .. BW(M - 1). At most P - r forwards are
/// waiting for their BI, as in 1F1B; counting an activation as held until its BW, every rank
/// peaks at P + 1 once M > P (BW(k - r) runs after the forward F(k + P - r) it shares a step
/// with, which keeps the forward on the critical path).
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
      if (k + P - r < M) prog.push_back({Op::F, r, k + P - r, 0});
      if (k >= r) prog.push_back({Op::BW, r, w++, 0});
    }
    while (w < M) prog.push_back({Op::BW, r, w++, 0});
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
