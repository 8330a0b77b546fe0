// Weight offload as a pass over a rank's program: PREFETCH each virtual stage's weights one run
// ahead of its use and RELEASE them after it (prima.cpp's mmap offload with prefetching).
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/schedule/action.hpp"

#include <cstddef>
#include <utility>
#include <vector>

namespace brigade::schedule {
inline namespace v0 {

/// Adds weight offload to the actions `program[from, end)` of one rank (a whole lowered program,
/// or one round of one, as append_inference_round() emits it).
///
/// The fragment's compute actions fall into runs: maximal stretches of compute on one virtual
/// stage (SEND/RECV in between do not break a run). With runs v_1 .. v_n, run k's span reaches
/// from the end of span k - 1 (the fragment's start for k = 1) to its last compute action and
/// the SENDs right after it. The pass inserts, at the start of span k, PREFETCH(v_1) when k = 1
/// and PREFETCH(v_{k+1}) when k < n (the next window loads while this one computes), and at its
/// end RELEASE(v_k). So a rank holds at most two virtual stages' weights at once, whatever the
/// number it runs, and every window of the fragment is loaded and dropped once per run: the
/// pipelined ring with disk offload of prima.cpp (Li et al. 2025, "PRIMA.CPP: Speeding Up
/// 70B-Scale LLM Inference on Low-Resource Everyday Home Clusters": weights are mmap'd, a
/// window's are prefetched before its forward and released after it).
///
/// A PREFETCH carries the micro-batch and chunk of the first compute it serves, a RELEASE those
/// of the last; the fragment's first virtual stage must not be resident when it starts (it is
/// not, for the first fragment or one after an earlier fragment this pass produced).
///
/// @throws brigade::Error{InvalidArgument} if `from` is past the end or the fragment already
///         holds a PREFETCH, RELEASE or MIGRATE (naming the step)
inline void add_weight_offload(std::vector<Action>& program, std::size_t from = 0) {
  BRIGADE_CHECK(from <= program.size(), Errc::InvalidArgument,
                "add_weight_offload: fragment start {} past the program's {} actions", from,
                program.size());
  struct Run {
    std::size_t first, last;  // first and last compute action of the run
  };
  std::vector<Run> runs;
  for (std::size_t i = from; i < program.size(); ++i) {
    const Action& a = program[i];
    BRIGADE_CHECK(!is_memory_op(a.op), Errc::InvalidArgument,
                  "add_weight_offload: step {} is already {}; the pass adds PREFETCH and RELEASE "
                  "to a program without them",
                  i, to_string(a));
    if (!is_compute(a.op)) continue;
    if (!runs.empty() && program[runs.back().first].virtual_stage == a.virtual_stage)
      runs.back().last = i;
    else
      runs.push_back({i, i});
  }
  if (runs.empty()) return;
  std::vector<Action> out(program.begin(), program.begin() + static_cast<std::ptrdiff_t>(from));
  out.reserve(program.size() + 2 * runs.size() + 1);
  std::size_t i = from;
  for (std::size_t k = 0; k < runs.size(); ++k) {
    const Action& head = program[runs[k].first];
    if (k == 0) out.push_back({Op::Prefetch, head.virtual_stage, head.microbatch, head.chunk});
    if (k + 1 < runs.size()) {
      const Action& next = program[runs[k + 1].first];
      out.push_back({Op::Prefetch, next.virtual_stage, next.microbatch, next.chunk});
    }
    std::size_t end = runs[k].last + 1;
    while (end < program.size() &&
           (program[end].op == Op::SendF || program[end].op == Op::SendB))
      ++end;
    for (; i < end; ++i) out.push_back(program[i]);
    const Action& tail = program[runs[k].last];
    out.push_back({Op::Release, tail.virtual_stage, tail.microbatch, tail.chunk});
  }
  for (; i < program.size(); ++i) out.push_back(program[i]);
  program = std::move(out);
}

/// add_weight_offload() on every rank's program of a lowered schedule.
/// @throws brigade::Error{InvalidArgument} as add_weight_offload()
inline Schedule with_weight_offload(Schedule lowered) {
  for (auto& prog : lowered.ranks) add_weight_offload(prog);
  return lowered;
}

}  // namespace v0
}  // namespace brigade::schedule
