// brigade::sim: discrete-event simulation of a lowered schedule over a cost model. It writes
// the same Timeline the executor records, so predictions and measurements compare event by event.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/core/timeline.hpp"
#include "brigade/cost/cost_model.hpp"
#include "brigade/plan/plan.hpp"
#include "brigade/schedule/action.hpp"
#include "brigade/schedule/dataflow.hpp"
#include "brigade/schedule/validate.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace brigade::sim {
inline namespace v0 {

/// Options of simulate().
struct SimOptions {
  bool validate = true;         ///< run schedule::validate() first (its errors are the clear ones)
  bool record_timeline = true;  ///< fill SimResult::timeline (metrics are computed either way)
};

/// What a simulation predicts. Times in seconds from the start of the run, memory in the cost
/// model's bytes.
struct SimResult {
  Timeline timeline;      ///< every compute interval, plus SEND/RECV intervals of positive length
  double makespan = 0.0;  ///< seconds from the first start to the last end
  double bubble_ratio = 0.0;  ///< idle rank-time / (P x makespan) = 1 - sum busy / (P makespan)
  std::vector<double> busy_seconds;  ///< per rank: seconds in compute actions
  std::vector<double> utilization;   ///< per rank: busy_seconds / makespan, in [0, 1]
  /// Per rank: the most bytes of stashed activations held at once (training; 0 in inference).
  std::vector<double> peak_activation_bytes;
  /// Per rank: the most forwards held at once, waiting for their backward to free them (B, or
  /// BW after BI); one per (virtual stage, micro-batch, chunk). Training only.
  std::vector<int> peak_stash;
  std::size_t actions = 0;   ///< actions simulated
  std::size_t messages = 0;  ///< SEND/RECV pairs delivered
};

namespace detail {

/// One action's costs, gathered from the cost model before the run.
struct ActionCost {
  double seconds = 0.0;     ///< compute seconds; for a SEND, the link occupancy
  double latency = 0.0;     ///< for a SEND: the link latency
  double activation = 0.0;  ///< for an F: the bytes it stashes
  int peer = -1;            ///< for a SEND: the receiving rank
};

using CostTable = std::vector<std::vector<ActionCost>>;

/// The event loop over gathered costs (not a template: one copy for every cost model).
///
/// Each rank has a clock. A compute action starts at the clock and advances it by its
/// seconds. A SEND never blocks its rank: it leaves at max(clock, the time its link is free),
/// holds the link for its occupancy, and arrives latency later. A RECV advances the clock to
/// the message's arrival. Ranks whose RECV has no message yet wait on a worklist; a send wakes
/// its receiver. Link order is each sender's program order, so the result is exact without a
/// global event queue.
inline SimResult run(const schedule::Schedule& s, const CostTable& costs, const SimOptions& opt) {
  using schedule::Action;
  using schedule::Op;
  const auto& sh = s.shape;
  const int P = sh.num_ranks;
  const std::int64_t M = sh.num_microbatches, C = sh.num_chunks;
  const std::size_t keys =
      static_cast<std::size_t>(static_cast<std::int64_t>(sh.num_virtual_stages) * M * C);
  auto key = [&](const Action& a) {
    return static_cast<std::size_t>(
        (static_cast<std::int64_t>(a.virtual_stage) * M + a.microbatch) * C + a.chunk);
  };
  const double never = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> arrival_f(keys, never), arrival_b(keys, never);
  const bool training = sh.mode == schedule::Mode::Training;
  std::vector<double> stash(training ? keys : 0, 0.0);

  SimResult res;
  res.timeline = Timeline(P);
  const auto up = static_cast<std::size_t>(P);
  res.busy_seconds.assign(up, 0.0);
  res.peak_activation_bytes.assign(up, 0.0);
  res.peak_stash.assign(up, 0);
  std::vector<double> clock(up, 0.0), held_bytes(up, 0.0);
  std::vector<int> held(up, 0);
  std::vector<std::size_t> pc(up, 0);
  std::vector<char> blocked(up, 0);
  std::vector<std::vector<std::pair<int, double>>> link_free(up);  // (peer, free at)
  double t_begin = std::numeric_limits<double>::infinity(), t_end = 0.0;
  bool any = false;

  auto record = [&](int r, const Action& a, double start, double end) {
    any = true;
    t_begin = std::min(t_begin, start);
    t_end = std::max(t_end, end);
    if (!opt.record_timeline) return;
    Interval iv;
    iv.rank = r;
    iv.op = a.op;
    iv.virtual_stage = a.virtual_stage;
    iv.microbatch = a.microbatch;
    iv.chunk = a.chunk;
    iv.start = start;
    iv.end = end;
    if (!training) iv.label = a.chunk == 0 ? "prefill" : "decode";
    res.timeline.add(std::move(iv));
  };

  std::vector<int> work;
  for (int r = P - 1; r >= 0; --r) work.push_back(r);
  while (!work.empty()) {
    const int r = work.back();
    work.pop_back();
    const auto ur = static_cast<std::size_t>(r);
    const auto& prog = s.ranks[ur];
    const auto& row = costs[ur];
    std::size_t& i = pc[ur];
    double& t = clock[ur];
    blocked[ur] = 0;
    for (; i < prog.size(); ++i) {
      const Action& a = prog[i];
      const ActionCost& ac = row[i];
      switch (a.op) {
        case Op::RecvF:
        case Op::RecvB: {
          const double arr = (a.op == Op::RecvF ? arrival_f : arrival_b)[key(a)];
          if (std::isnan(arr)) {
            blocked[ur] = 1;
            break;
          }
          if (arr > t) {
            record(r, a, t, arr);
            t = arr;
          }
          ++res.messages;
          break;
        }
        case Op::SendF:
        case Op::SendB: {
          const Action peer = *schedule::counterpart(sh, a);
          auto& links = link_free[ur];
          auto it = std::find_if(links.begin(), links.end(),
                                 [&](const auto& l) { return l.first == ac.peer; });
          if (it == links.end()) it = links.insert(links.end(), {ac.peer, 0.0});
          const double leave = std::max(t, it->second);
          it->second = leave + ac.seconds;
          const double arrive = leave + ac.seconds + ac.latency;
          (a.op == Op::SendF ? arrival_f : arrival_b)[key(peer)] = arrive;
          if (arrive > t) record(r, a, t, arrive);
          const auto uq = static_cast<std::size_t>(ac.peer);
          if (blocked[uq] && pc[uq] < s.ranks[uq].size() && s.ranks[uq][pc[uq]] == peer) {
            blocked[uq] = 0;
            work.push_back(ac.peer);
          }
          break;
        }
        default: {
          record(r, a, t, t + ac.seconds);
          t += ac.seconds;
          res.busy_seconds[ur] += ac.seconds;
          if (!training) break;
          if (a.op == Op::F) {
            stash[key(a)] = ac.activation;
            held_bytes[ur] += ac.activation;
            ++held[ur];
            res.peak_activation_bytes[ur] = std::max(res.peak_activation_bytes[ur], held_bytes[ur]);
            res.peak_stash[ur] = std::max(res.peak_stash[ur], held[ur]);
          } else if (a.op == Op::B || a.op == Op::BW) {
            held_bytes[ur] -= stash[key(a)];
            --held[ur];
          }
          break;
        }
      }
      if (blocked[ur]) break;  // wait for the message; a SEND will put this rank back
      ++res.actions;
    }
  }
  for (int r = 0; r < P; ++r)
    BRIGADE_CHECK(
        pc[static_cast<std::size_t>(r)] == s.ranks[static_cast<std::size_t>(r)].size(),
        Errc::Deadlock,
        "simulate: rank {} is blocked at step {} ({}); run schedule::validate() for "
        "the wait-for cycle",
        r, pc[static_cast<std::size_t>(r)],
        schedule::to_string(s.ranks[static_cast<std::size_t>(r)][pc[static_cast<std::size_t>(r)]]));
  res.makespan = any ? t_end - t_begin : 0.0;
  res.utilization.assign(up, 0.0);
  double busy = 0.0;
  for (std::size_t r = 0; r < up; ++r) {
    busy += res.busy_seconds[r];
    res.utilization[r] = res.makespan > 0.0 ? res.busy_seconds[r] / res.makespan : 0.0;
  }
  res.bubble_ratio = res.makespan > 0.0 ? 1.0 - busy / (P * res.makespan) : 0.0;
  return res;
}

}  // namespace detail

/// Simulates a lowered schedule with the costs of `cost`.
///
/// Model: each rank runs its program in order. A compute action keeps its rank busy for
/// `cost_model.compute_seconds(a)`. A SEND does not block its rank (sends overlap compute); it
/// holds the link `cost_model.link(src, dst)` for message_bytes / bandwidth, queueing behind
/// earlier sends on that link, and arrives latency later. A RECV waits until its message has
/// arrived. Activations: an F stashes `cost_model.activation_bytes(a)` until its B (or BW) frees
/// them (training only). The metrics follow the Timeline's definitions: bubble ratio = idle
/// rank-time / (P x makespan), where busy time counts compute actions only.
///
/// @param lowered a lowered schedule (lower()'s output or hand-written with SEND/RECV)
/// @param cost_model a CostModel built for `lowered.shape`
/// @throws brigade::Error{Deadlock or InvalidArgument} as schedule::validate() (when
///         options.validate), or {Deadlock} if a rank cannot finish without validation
/// @throws brigade::Error{InvalidArgument} if the cost model returns a negative or non-finite
///         time or size
template <cost::CostModel Cost>
SimResult simulate(const schedule::Schedule& lowered, const Cost& cost_model,
                   const SimOptions& options = {}) {
  using schedule::Op;
  if (options.validate) {
    schedule::validate(lowered);
  } else {
    schedule::detail::check_program_shape(lowered, "simulate");
    for (int r = 0; r < lowered.shape.num_ranks; ++r) {
      const auto& prog = lowered.ranks[static_cast<std::size_t>(r)];
      for (std::size_t i = 0; i < prog.size(); ++i) {
        schedule::detail::check_action_range(lowered.shape, prog[i], r, i, "simulate");
        if (is_communication(prog[i].op))
          BRIGADE_CHECK(schedule::counterpart(lowered.shape, prog[i]).has_value(),
                        Errc::InvalidArgument, "simulate: rank {} step {}: {} has no counterpart",
                        r, i, schedule::to_string(prog[i]));
      }
    }
  }
  auto finite = [](double x) { return x >= 0.0 && std::isfinite(x); };
  detail::CostTable table(lowered.ranks.size());
  for (int r = 0; r < lowered.shape.num_ranks; ++r) {
    const auto& prog = lowered.ranks[static_cast<std::size_t>(r)];
    auto& out = table[static_cast<std::size_t>(r)];
    out.resize(prog.size());
    for (std::size_t i = 0; i < prog.size(); ++i) {
      const auto& a = prog[i];
      auto& c = out[i];
      if (a.op == Op::SendF || a.op == Op::SendB) {
        c.peer = schedule::peer_rank(lowered.shape, a);
        const cost::Link link = cost_model.link(r, c.peer);
        const double bytes = static_cast<double>(cost_model.message_bytes(a));
        BRIGADE_CHECK(finite(bytes) && finite(link.latency_s) && link.bytes_per_s > 0.0,
                      Errc::InvalidArgument,
                      "simulate: the cost model gives {} bytes over a link of {} s, {} bytes/s "
                      "for {}",
                      bytes, link.latency_s, link.bytes_per_s, schedule::to_string(a));
        c.seconds = link.occupancy_seconds(bytes);
        c.latency = link.latency_s;
      } else if (schedule::is_compute(a.op)) {
        c.seconds = static_cast<double>(cost_model.compute_seconds(a));
        BRIGADE_CHECK(finite(c.seconds), Errc::InvalidArgument,
                      "simulate: the cost model gives {} s for {}, expected finite and >= 0",
                      c.seconds, schedule::to_string(a));
        if (a.op == Op::F) {
          c.activation = static_cast<double>(cost_model.activation_bytes(a));
          BRIGADE_CHECK(finite(c.activation), Errc::InvalidArgument,
                        "simulate: the cost model gives {} activation bytes for {}", c.activation,
                        schedule::to_string(a));
        }
      }
    }
  }
  return detail::run(lowered, table, options);
}

/// Simulates `plan`'s lowered schedule (validated when the plan was built) with the costs of
/// `cost` (e.g. cost::RooflineCostModel(spec, plan), which prices each micro-batch's work).
/// @throws brigade::Error as simulate(const schedule::Schedule&, ...)
template <cost::CostModel Cost>
SimResult simulate(const plan::Plan& plan, const Cost& cost_model, SimOptions options = {}) {
  options.validate = false;  // the Plan's constructor validated it
  return simulate(plan.schedule(), cost_model, options);
}

/// The metrics of a simulation as JSON (what `brigade simulate --metrics` writes):
/// {"makespan_s", "bubble_ratio", "actions", "messages", "ranks": P, "busy_s": [...],
///  "utilization": [...], "peak_activation_bytes": [...], "peak_stash": [...]}.
inline nlohmann::json metrics_json(const SimResult& r) {
  return {{"makespan_s", r.makespan},       {"bubble_ratio", r.bubble_ratio},
          {"actions", r.actions},           {"messages", r.messages},
          {"ranks", r.busy_seconds.size()}, {"busy_s", r.busy_seconds},
          {"utilization", r.utilization},   {"peak_activation_bytes", r.peak_activation_bytes},
          {"peak_stash", r.peak_stash}};
}

}  // namespace v0
}  // namespace brigade::sim
