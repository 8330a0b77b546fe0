// with_recompute(): the pass that inserts RECOMPUTE actions for the micro-batches whose
// activations are dropped after their forward (activation checkpointing per micro-batch).
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/schedule/action.hpp"

#include <cstddef>
#include <span>
#include <vector>

namespace brigade::schedule {
inline namespace v0 {

/// Inserts, on every rank, a RECOMPUTE of (virtual stage v, micro-batch m, chunk c) right before
/// the first backward (B or BI) of that triple, for every micro-batch m with recompute[m] != 0;
/// the other actions keep their order. Run by the executor, the F of such a triple keeps only
/// its stage's input and the RECOMPUTE rebuilds the rest (engine::TrainingWorker,
/// runtime::TrainStage::recompute); the simulator counts the F's stash as the cost model's
/// checkpoint_bytes() until the RECOMPUTE (sim::SimResult::peak_memory_bytes). Placed before
/// the B in a compute-only schedule, the RECOMPUTE runs before lower()'s RECV_B of that B, so a
/// rank recomputes while the gradient is on its way (Megatron-LM likewise recomputes a layer
/// just before its backward; Korthikanti et al. 2022, section 5).
///
/// Works on any generator's output (1F1B, adaptive, zero-bubble: a BI's RECOMPUTE comes before
/// the BI; the BW needs nothing rebuilt), compute-only or lowered.
///
/// @param s         a training schedule
/// @param recompute [M] 1 for the micro-batches to recompute, or empty (s is returned as it is)
/// @return s with the RECOMPUTE actions
/// @throws brigade::Error{InvalidArgument} for an inference schedule (when recompute is not
///         empty), a recompute span of the wrong size, or a schedule that already recomputes a
///         flagged triple (naming the rank, step and action)
inline Schedule with_recompute(const Schedule& s, std::span<const char> recompute) {
  if (recompute.empty()) return s;
  const Shape& sh = s.shape;
  BRIGADE_CHECK(sh.mode == Mode::Training, Errc::InvalidArgument,
                "with_recompute: a {} schedule; recomputation is for training schedules",
                to_string(sh.mode));
  BRIGADE_CHECK(recompute.size() == static_cast<std::size_t>(sh.num_microbatches),
                Errc::InvalidArgument,
                "with_recompute: {} recompute flags for {} micro-batches (expected one each)",
                recompute.size(), sh.num_microbatches);
  Schedule out{sh, {}};
  out.ranks.resize(s.ranks.size());
  const auto keys = static_cast<std::size_t>(sh.num_virtual_stages) *
                    static_cast<std::size_t>(sh.num_microbatches) *
                    static_cast<std::size_t>(sh.num_chunks);
  std::vector<char> done(keys);
  for (std::size_t r = 0; r < s.ranks.size(); ++r) {
    std::fill(done.begin(), done.end(), 0);
    auto& prog = out.ranks[r];
    prog.reserve(s.ranks[r].size() + s.ranks[r].size() / 2);
    for (std::size_t i = 0; i < s.ranks[r].size(); ++i) {
      const Action& a = s.ranks[r][i];
      const bool flagged = a.microbatch >= 0 && a.microbatch < sh.num_microbatches &&
                           recompute[static_cast<std::size_t>(a.microbatch)] != 0;
      if (flagged && a.virtual_stage >= 0 && a.virtual_stage < sh.num_virtual_stages &&
          a.chunk >= 0 && a.chunk < sh.num_chunks) {
        const auto k = (static_cast<std::size_t>(a.virtual_stage) *
                            static_cast<std::size_t>(sh.num_microbatches) +
                        static_cast<std::size_t>(a.microbatch)) *
                           static_cast<std::size_t>(sh.num_chunks) +
                       static_cast<std::size_t>(a.chunk);
        BRIGADE_CHECK(a.op != Op::Recompute, Errc::InvalidArgument,
                      "with_recompute: rank {} step {}: {} already recomputes micro-batch {}", r,
                      i, to_string(a), a.microbatch);
        if ((a.op == Op::B || a.op == Op::BI) && done[k] == 0) {
          prog.push_back({Op::Recompute, a.virtual_stage, a.microbatch, a.chunk});
          done[k] = 1;
        }
      }
      prog.push_back(a);
    }
  }
  return out;
}

}  // namespace v0
}  // namespace brigade::schedule
