// DynaPipe's memory-aware adaptive schedule for micro-batches of unequal size (Jiang et al.
// 2024, "DynaPipe: Optimizing Multi-task Training through Dynamic Pipelines", EuroSys '24, §5).
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/schedule/action.hpp"
#include "brigade/schedule/generators.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <deque>
#include <utility>
#include <vector>

namespace brigade::schedule {
inline namespace v0 {

/// DynaPipe's memory-aware adaptive schedule (Jiang et al. 2024, §5 "Memory-aware adaptive
/// scheduling"; the cyclic scheduler of awslabs/optimizing-multitask-training-through-dynamic-
/// pipelines, dynapipe/schedule_opt/cyclic_schedule.py): the order each rank runs the forwards
/// and backwards of micro-batches whose activations differ in size, found by running the
/// pipeline in lock-step cycles.
///
/// Micro-batches enter rank 0 in id order (the caller chooses the order; DynaPipe searches it,
/// batching::order_adaptive). Each rank keeps a queue of ready forwards and one of ready
/// backwards, first in first out. In every cycle each rank runs the head of its backward queue,
/// if any (freeing that micro-batch's microbatch_bytes), then the head of its forward queue if
/// its microbatch_bytes fit under memory_limit_bytes beside what the rank holds (adding them);
/// a forward that does not fit waits for a later cycle. What a cycle completes becomes ready
/// in the next one: F on rank r readies F on rank r + 1 (on the last rank, its own B), B on
/// rank r readies B on rank r - 1. The order in which each rank ran its actions is the
/// schedule; the executor then runs each rank's list as fast as its messages arrive (the
/// paper's "wait-free" execution of the cyclic order), so the cycles fix the order, not the
/// timing. Equal micro-batches without a limit: rank r runs F(m) in cycle m + r and B(m) in
/// cycle m + 2P - 1 - r, so it holds up to min(2(P - r) - 1, M) micro-batches; a limit of k
/// micro-batches caps that at k (k = P gives 1F1B's order on rank 0).
///
/// Micro-batches whose activations are dropped after F and rebuilt by a RECOMPUTE before their
/// backward (schedule::with_recompute, DynaPipe's recomputation per micro-batch) hold
/// microbatch_bytes (their checkpoint) from F to RECOMPUTE and microbatch_peak_bytes from
/// RECOMPUTE to B, on one rank one such micro-batch at a time (a RECOMPUTE runs just before its
/// B). A forward is therefore admitted when what the rank holds, plus its microbatch_bytes, plus
/// the largest peak - bytes among the micro-batches then in flight (it included), fits the
/// limit: what the rank holds at any point between actions, and during the admitted forward
/// itself (which builds the whole stash before dropping it), stays under the limit. Without
/// peaks this is the rule above.
///
/// Every rank sends and receives each channel in the same order (the queues are FIFO and every
/// rank sees micro-batches in the order rank 0 injected them), so every receive matches the
/// next message of its channel: lower() gives a schedule validate() proves deadlock-free under
/// eager sends.
///
/// Honours ranks, microbatches, microbatch_bytes, microbatch_peak_bytes, memory_limit_bytes
/// (V must be 1).
/// @throws brigade::Error{InvalidArgument} for ranks or microbatches < 1, V != 1, a
///         microbatch_bytes or microbatch_peak_bytes of the wrong size or with a negative or
///         non-finite entry, a peak below its bytes, a limit that is not > 0, or a micro-batch
///         whose peak alone exceeds the limit (naming it, its bytes and the limit: no order
///         could run it)
inline Schedule adaptive(const Params& p) {
  detail::check_params(p, "adaptive", false);
  const int P = p.ranks, M = p.microbatches;
  BRIGADE_CHECK(p.microbatch_bytes.empty() ||
                    p.microbatch_bytes.size() == static_cast<std::size_t>(M),
                Errc::InvalidArgument,
                "adaptive: {} micro-batch byte counts for {} micro-batches (expected none or one "
                "each)",
                p.microbatch_bytes.size(), M);
  BRIGADE_CHECK(p.memory_limit_bytes > 0.0 && !std::isnan(p.memory_limit_bytes),
                Errc::InvalidArgument, "adaptive: memory limit {} bytes, expected > 0",
                p.memory_limit_bytes);
  BRIGADE_CHECK(p.microbatch_peak_bytes.empty() ||
                    p.microbatch_peak_bytes.size() == static_cast<std::size_t>(M),
                Errc::InvalidArgument,
                "adaptive: {} micro-batch peak byte counts for {} micro-batches (expected none "
                "or one each)",
                p.microbatch_peak_bytes.size(), M);
  auto bytes = [&](int m) {
    return p.microbatch_bytes.empty() ? 1.0 : p.microbatch_bytes[static_cast<std::size_t>(m)];
  };
  auto extra = [&](int m) {  // peak - bytes: what its RECOMPUTE adds for a while
    return p.microbatch_peak_bytes.empty()
               ? 0.0
               : p.microbatch_peak_bytes[static_cast<std::size_t>(m)] - bytes(m);
  };
  for (int m = 0; m < M; ++m) {
    const double b = bytes(m);
    BRIGADE_CHECK(b >= 0.0 && std::isfinite(b), Errc::InvalidArgument,
                  "adaptive: micro-batch {} keeps {} bytes, expected finite and >= 0", m, b);
    const double e = extra(m);
    BRIGADE_CHECK(std::isfinite(e) && e >= 0.0, Errc::InvalidArgument,
                  "adaptive: micro-batch {} peaks at {} bytes, expected finite and at least the "
                  "{} bytes it keeps",
                  m, b + e, b);
    BRIGADE_CHECK(b + e <= p.memory_limit_bytes, Errc::InvalidArgument,
                  "adaptive: micro-batch {} {} {} bytes of activations on a rank, more than "
                  "the memory limit of {} bytes",
                  m, e > 0.0 ? "peaks at" : "keeps", b + e, p.memory_limit_bytes);
  }
  Schedule s = empty_schedule(Shape::make(P, M));
  const auto up = static_cast<std::size_t>(P);
  std::vector<std::deque<int>> fq(up), bq(up);
  std::vector<std::vector<std::pair<bool, int>>> ready(up);  // (backward?, micro-batch) next cycle
  std::vector<double> held(up, 0.0);
  std::vector<int> in_flight(up, 0);  // micro-batches between F and B (held is exactly 0 at 0)
  std::vector<std::vector<int>> flying(up);  // those micro-batches (for their largest extra)
  auto largest_extra = [&](std::size_t r, int with) {
    double e = extra(with);
    for (const int m : flying[r]) e = std::max(e, extra(m));
    return e;
  };
  for (int m = 0; m < M; ++m) fq[0].push_back(m);
  for (std::int64_t done = 0, total = 2 * std::int64_t{P} * M; done < total;) {
    std::int64_t ran = 0;
    for (int r = 0; r < P; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      auto& prog = s.ranks[ur];
      if (!bq[ur].empty()) {
        const int m = bq[ur].front();
        bq[ur].pop_front();
        prog.push_back({Op::B, r, m, 0});
        held[ur] = --in_flight[ur] == 0 ? 0.0 : held[ur] - bytes(m);
        flying[ur].erase(std::find(flying[ur].begin(), flying[ur].end(), m));
        if (r > 0) ready[ur - 1].emplace_back(true, m);
        ++ran;
      }
      if (!fq[ur].empty()) {
        const int m = fq[ur].front();
        // Tested against what the rank holds now; with nothing held every micro-batch fits
        // (checked above).
        if (in_flight[ur] == 0 ||
            held[ur] + bytes(m) + largest_extra(ur, m) <= p.memory_limit_bytes) {
          fq[ur].pop_front();
          prog.push_back({Op::F, r, m, 0});
          held[ur] += bytes(m);
          ++in_flight[ur];
          flying[ur].push_back(m);
          ready[r + 1 < P ? ur + 1 : ur].emplace_back(r + 1 == P, m);
          ++ran;
        }
      }
    }
    for (std::size_t r = 0; r < up; ++r) {
      for (const auto& [backward, m] : ready[r]) (backward ? bq[r] : fq[r]).push_back(m);
      ready[r].clear();
    }
    // A cycle without progress is impossible: the last rank's forward fits (its B runs one
    // cycle later), and every rank holding bytes has a backward on its way back.
    BRIGADE_CHECK(ran > 0, Errc::Internal, "adaptive: no action could run in a cycle");
    done += ran;
  }
  return s;
}

}  // namespace v0
}  // namespace brigade::schedule
