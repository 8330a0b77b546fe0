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
  /// The executor's receive and send windows, for the memory of their buffers (peak_memory_bytes).
  schedule::Windows windows{};
};

/// What a simulation predicts. Times in seconds from the start of the run, memory in the cost
/// model's bytes.
struct SimResult {
  Timeline timeline;      ///< every compute interval, plus SEND/RECV intervals of positive length
  double makespan = 0.0;  ///< seconds from the first start to the last end
  double bubble_ratio = 0.0;  ///< idle rank-time / (P x makespan) = 1 - sum busy / (P makespan)
  std::vector<double> busy_seconds;  ///< per rank: seconds in compute actions
  std::vector<double> utilization;   ///< per rank: busy_seconds / makespan, in [0, 1]
  /// Per rank: the most bytes held at once between two actions (training; 0 in inference), the
  /// figure engine::execute measures (ExecutorStats::peak_memory_bytes), with the cost model's
  /// sizes: the stashes (activation_bytes() after F, BI, RECOMPUTE; 0 after B, BW; after an F
/// whose RECOMPUTE follows, cost::HasCheckpointBytes' checkpoint_bytes(), else the message the
/// F consumed) + received
  /// copies from their RECV until the F or BI that consumes them + each F's output and each BI's
  /// input gradient until their SEND (or the next virtual stage's F or BI, when it is on the same
  /// rank) + the receive window's buffers (recv_window slots, each as large as the largest message
  /// posted into it so far) + the send window's copies (send_window slots, likewise). Slots keep
  /// their buffers, so this depends only on each rank's program order, not on timing.
  std::vector<double> peak_memory_bytes;
  /// Per rank: the most forwards held at once, waiting for their backward to free them (B, or
  /// BW after BI); one per (virtual stage, micro-batch, chunk). Training only.
  std::vector<int> peak_stash;
  /// Per rank: the most weight bytes resident at once (cost model's weight_bytes; 0 without
  /// it). Every virtual stage placed on a rank is resident from the start unless the rank's
  /// first action on it is a PREFETCH; a PREFETCH adds its bytes when it starts, a RELEASE
  /// subtracts them.
  std::vector<double> peak_weight_bytes;
  /// Per rank: seconds compute actions waited for a PREFETCH of their virtual stage to finish.
  std::vector<double> io_wait_seconds;
  std::size_t actions = 0;   ///< actions simulated
  std::size_t messages = 0;  ///< SEND/RECV pairs delivered
};

namespace detail {

/// One action's costs, gathered from the cost model before the run.
struct ActionCost {
  double seconds = 0.0;     ///< compute seconds; for a SEND, the link occupancy
  double latency = 0.0;     ///< for a SEND: the link latency
  double overhead = 0.0;    ///< for a SEND: seconds the sender's CPU spends posting it
  int peer = -1;            ///< for a SEND: the receiving rank
  double weights = 0.0;     ///< for a PREFETCH or RELEASE: the weight bytes it loads or frees
};

/// Per rank: the weight bytes resident when the run starts (every virtual stage placed there
/// whose first action on the rank is not a PREFETCH).
using InitialWeights = std::vector<double>;

using CostTable = std::vector<std::vector<ActionCost>>;

/// The event loop over gathered costs (not a template: one copy for every cost model).
///
/// Each rank has a clock. A compute action starts at the clock and advances it by its
/// seconds. A SEND advances the clock by its overhead only (the sender's CPU time to post it),
/// then leaves at max(clock, the time its link is free),
/// holds the link for its occupancy, and arrives latency later. A RECV advances the clock to
/// the message's arrival. Ranks whose RECV has no message yet wait on a worklist; a send wakes
/// its receiver. Link order is each sender's program order, so the result is exact without a
/// global event queue.
///
/// Weights: each rank also has an I/O lane with its own clock. A PREFETCH of virtual stage v
/// starts at max(rank clock, I/O lane free), holds the lane for its seconds (the rank's compute
/// clock does not move: the load overlaps compute), and the next compute action of v starts no
/// earlier than the load's end (the difference is I/O wait). Resident bytes start at `initial`
/// and change by a PREFETCH (+) and a RELEASE (-) in program order.
inline SimResult run(const schedule::Schedule& s, const CostTable& costs, const SimOptions& opt,
                     const InitialWeights& initial) {
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

  SimResult res;
  res.timeline = Timeline(P);
  const auto up = static_cast<std::size_t>(P);
  res.busy_seconds.assign(up, 0.0);
  res.peak_weight_bytes = initial;
  res.io_wait_seconds.assign(up, 0.0);
  std::vector<double> resident = initial, io_free(up, 0.0);
  std::vector<double> weights_ready(static_cast<std::size_t>(sh.num_virtual_stages), 0.0);
  std::vector<double> clock(up, 0.0);
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
          t += ac.overhead;  // the sender copies and posts it (not busy: no compute interval)
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
        case Op::Prefetch: {
          const double start = std::max(t, io_free[ur]);
          io_free[ur] = start + ac.seconds;
          weights_ready[static_cast<std::size_t>(a.virtual_stage)] = io_free[ur];
          resident[ur] += ac.weights;
          res.peak_weight_bytes[ur] = std::max(res.peak_weight_bytes[ur], resident[ur]);
          record(r, a, start, io_free[ur]);
          break;
        }
        case Op::Release:
          resident[ur] -= ac.weights;
          record(r, a, t, t);
          break;
        case Op::Migrate:  // refused before the run (no cost model of a migration's parts)
        case Op::MigrateRecv:
          break;
        default: {
          const double ready = weights_ready[static_cast<std::size_t>(a.virtual_stage)];
          if (ready > t) {
            res.io_wait_seconds[ur] += ready - t;
            t = ready;
          }
          record(r, a, t, t + ac.seconds);
          t += ac.seconds;
          res.busy_seconds[ur] += ac.seconds;
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

/// The memory of every rank as engine::execute holds it (SimResult::peak_memory_bytes, whose
/// comment lists what is counted), and the most forwards held at once (peak_stash). Walks each
/// rank's program in order: the executor's memory between two actions depends on nothing else.
/// @throws brigade::Error{InvalidArgument} if the cost model gives a negative or non-finite size
template <cost::CostModel Cost>
void peak_memory(const schedule::Schedule& s, const Cost& cost, const schedule::Windows& windows,
                 SimResult& res) {
  using schedule::Action;
  using schedule::Op;
  const auto& sh = s.shape;
  const auto up = static_cast<std::size_t>(sh.num_ranks);
  res.peak_memory_bytes.assign(up, 0.0);
  res.peak_stash.assign(up, 0);
  if (sh.mode != schedule::Mode::Training) return;
  BRIGADE_CHECK(windows.recv_window >= 1 && windows.send_window >= 1, Errc::InvalidArgument,
                "simulate: windows recv {} send {}, expected both >= 1", windows.recv_window,
                windows.send_window);
  const int N = sh.num_virtual_stages;
  const std::int64_t M = sh.num_microbatches, C = sh.num_chunks;
  const auto keys = static_cast<std::size_t>(N * M * C);
  auto key = [&](int v, int mb, int c) {
    return static_cast<std::size_t>((static_cast<std::int64_t>(v) * M + mb) * C + c);
  };
  auto size = [&](double b, const Action& a, const char* what) {
    BRIGADE_CHECK(b >= 0.0 && std::isfinite(b), Errc::InvalidArgument,
                  "simulate: the cost model gives {} {} bytes for {}", b, what,
                  schedule::to_string(a));
    return b;
  };
  auto message = [&](Op send, int v, int mb, int c) {
    const Action a{send, v, mb, c};
    return size(static_cast<double>(cost.message_bytes(a)), a, "message");
  };
  // What an F keeps when a RECOMPUTE of it follows: the cost model's checkpoint_bytes, else the
  // message it consumed (nothing on virtual stage 0).
  auto checkpoint = [&](const Action& f) {
    if constexpr (cost::HasCheckpointBytes<Cost>)
      return size(static_cast<double>(cost.checkpoint_bytes(f)), f, "checkpoint");
    else
      return f.virtual_stage > 0 ? message(Op::SendF, f.virtual_stage - 1, f.microbatch, f.chunk)
                                 : 0.0;
  };
  const auto W = static_cast<std::size_t>(windows.recv_window);
  const auto SW = static_cast<std::size_t>(windows.send_window);
  std::vector<double> stash(keys), out(keys), grad(keys), in_f(keys), in_b(keys);
  std::vector<char> recomputed(keys);
  std::vector<double> recv_slot(W), send_slot(SW);
  for (std::size_t ur = 0; ur < up; ++ur) {
    const int r = static_cast<int>(ur);
    const auto& prog = s.ranks[ur];
    for (auto* v : {&stash, &out, &grad, &in_f, &in_b}) std::fill(v->begin(), v->end(), 0.0);
    std::fill(recomputed.begin(), recomputed.end(), 0);
    std::fill(recv_slot.begin(), recv_slot.end(), 0.0);
    std::fill(send_slot.begin(), send_slot.end(), 0.0);
    for (const auto& a : prog)
      if (a.op == Op::Recompute) recomputed[key(a.virtual_stage, a.microbatch, a.chunk)] = 1;
    double bytes = 0.0, peak = 0.0;
    int held = 0, peak_held = 0;
    auto set = [&](double& slot, double b) {
      bytes += b - slot;
      slot = b;
    };
    auto grow = [&](double& slot, double b) { set(slot, std::max(slot, b)); };
    std::size_t next_post = 0, posted = 0, done = 0, sent = 0;
    for (const Action& a : prog) {
      // The executor posts receives in program order, at most W ahead of the one it waits on.
      for (; posted - done < W && next_post < prog.size(); ++next_post) {
        const Action& p = prog[next_post];
        if (p.op != Op::RecvF && p.op != Op::RecvB) continue;
        const Action from = *schedule::counterpart(sh, p);
        grow(recv_slot[posted++ % W], message(from.op, from.virtual_stage, from.microbatch, from.chunk));
      }
      peak = std::max(peak, bytes);
      const int v = a.virtual_stage, mb = a.microbatch, c = a.chunk;
      const std::size_t k = key(v, mb, c);
      switch (a.op) {
        case Op::RecvF:
        case Op::RecvB: {
          ++done;
          const Action from = *schedule::counterpart(sh, a);
          set((a.op == Op::RecvF ? in_f : in_b)[k],
              message(from.op, from.virtual_stage, from.microbatch, from.chunk));
          break;
        }
        case Op::SendF:
        case Op::SendB:
          grow(send_slot[sent++ % SW], message(a.op, v, mb, c));
          set((a.op == Op::SendF ? out : grad)[k], 0.0);
          break;
        case Op::F:
          set(in_f[k], 0.0);
          if (v > 0 && sh.rank_of(v - 1) == r) set(out[key(v - 1, mb, c)], 0.0);
          set(stash[k], !recomputed[k] ? size(static_cast<double>(cost.activation_bytes(a)), a,
                                              "activation")
                        : checkpoint(a));
          if (v < N - 1) set(out[k], message(Op::SendF, v, mb, c));
          peak_held = std::max(peak_held, ++held);
          break;
        case Op::Recompute:
          set(stash[k], size(static_cast<double>(cost.activation_bytes(a)), a, "activation"));
          break;
        case Op::BI:
        case Op::B:
          set(in_b[k], 0.0);
          if (v < N - 1 && sh.rank_of(v + 1) == r) set(grad[key(v + 1, mb, c)], 0.0);
          set(stash[k], size(static_cast<double>(cost.activation_bytes(a)), a, "activation"));
          if (v > 0) set(grad[k], message(Op::SendB, v, mb, c));
          if (a.op == Op::B) --held;
          break;
        case Op::BW:
          set(stash[k], size(static_cast<double>(cost.activation_bytes(a)), a, "activation"));
          --held;
          break;
        default:
          break;
      }
      peak = std::max(peak, bytes);
    }
    res.peak_memory_bytes[ur] = peak;
    res.peak_stash[ur] = peak_held;
  }
}

}  // namespace detail

/// Simulates a lowered schedule with the costs of `cost`.
///
/// Model: each rank runs its program in order. A compute action keeps its rank busy for
/// `cost_model.compute_seconds(a)`. A SEND does not wait for its link (sends overlap compute);
/// only a cost model's optional `send_overhead_seconds(a)` (the sender's CPU time to copy and
/// post it, idle rather than busy time; 0 when the model has none) advances its rank. It holds
/// the link `cost_model.link(src, dst)` for message_bytes / bandwidth, queueing behind
/// earlier sends on that link, and arrives latency later. A RECV waits until its message has
/// arrived. Memory (training only): SimResult::peak_memory_bytes, from
/// `cost_model.activation_bytes()` (each stash as it is after F, BI, RECOMPUTE, B, BW),
/// `cost_model.message_bytes()` (received copies, outputs waiting for their SEND, and the
/// buffers of `options.windows`). The metrics follow the Timeline's definitions: bubble ratio = idle
/// rank-time / (P x makespan), where busy time counts compute actions only.
///
/// Weights (prima.cpp's offload): every virtual stage placed on a rank is resident from the
/// start, unless the rank's first action on it is a PREFETCH. A PREFETCH runs on the rank's
/// I/O lane, a clock of its own, for `cost_model.weight_load_seconds(a)` (an optional member,
/// cost::HasWeightLoad; 0 without it), queueing behind earlier loads of that rank but never
/// blocking compute; the next compute action of its virtual stage waits for it (reported as
/// io_wait_seconds). Resident bytes (`cost_model.weight_bytes(a)`, optional,
/// cost::HasWeightBytes) grow at a PREFETCH and shrink at a RELEASE; their per-rank maximum is
/// peak_weight_bytes. MIGRATE and MIGRATE_RECV are refused: a migration's parts carry the KV
/// rows of the sequences live at the time, which the cost model does not know (serving
/// measures them: docs/serving.md).
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
  if (options.validate) schedule::validate(lowered);
  {
    schedule::detail::check_program_shape(lowered, "simulate");
    for (int r = 0; r < lowered.shape.num_ranks; ++r) {
      const auto& prog = lowered.ranks[static_cast<std::size_t>(r)];
      for (std::size_t i = 0; i < prog.size(); ++i) {
        schedule::detail::check_action_range(lowered.shape, prog[i], r, i, "simulate");
        BRIGADE_CHECK(!is_migration(prog[i].op), Errc::InvalidArgument,
                      "simulate: rank {} step {}: {}: the simulator has no cost for a layer "
                      "migration (its parts carry the KV rows of the sequences live when it "
                      "runs, which a schedule does not know); simulate the plans before and "
                      "after the move",
                      r, i, schedule::to_string(prog[i]));
        if (is_communication(prog[i].op))
          BRIGADE_CHECK(schedule::counterpart(lowered.shape, prog[i]).has_value(),
                        Errc::InvalidArgument, "simulate: rank {} step {}: {} has no counterpart",
                        r, i, schedule::to_string(prog[i]));
      }
    }
  }
  auto finite = [](double x) { return x >= 0.0 && std::isfinite(x); };
  auto weight_bytes = [&](const schedule::Action& a) {
    double b = 0.0;
    if constexpr (cost::HasWeightBytes<Cost>) b = static_cast<double>(cost_model.weight_bytes(a));
    BRIGADE_CHECK(finite(b), Errc::InvalidArgument,
                  "simulate: the cost model gives {} weight bytes for virtual stage {}, expected "
                  "finite and >= 0",
                  b, a.virtual_stage);
    return b;
  };
  // Weights resident at the start: every virtual stage placed on a rank whose first action
  // on it there is not a PREFETCH.
  detail::InitialWeights initial(lowered.ranks.size(), 0.0);
  {
    std::vector<char> first_prefetch(static_cast<std::size_t>(lowered.shape.num_virtual_stages),
                                     0),
        seen(first_prefetch.size(), 0);
    for (const auto& prog : lowered.ranks)
      for (const auto& a : prog) {
        const auto v = static_cast<std::size_t>(a.virtual_stage);
        if (is_communication(a.op) || seen[v]) continue;
        seen[v] = 1;
        first_prefetch[v] = a.op == Op::Prefetch;
      }
    for (int v = 0; v < lowered.shape.num_virtual_stages; ++v)
      if (!first_prefetch[static_cast<std::size_t>(v)])
        initial[static_cast<std::size_t>(lowered.shape.rank_of(v))] +=
            weight_bytes(schedule::Action{Op::F, v, 0, 0});
  }
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
        if constexpr (requires { cost_model.message_latency_seconds(a); }) {
          c.latency = static_cast<double>(cost_model.message_latency_seconds(a));
          BRIGADE_CHECK(finite(c.latency), Errc::InvalidArgument,
                        "simulate: the cost model gives {} s of latency for {}", c.latency,
                        schedule::to_string(a));
        }
        if constexpr (requires { cost_model.send_overhead_seconds(a); }) {
          c.overhead = static_cast<double>(cost_model.send_overhead_seconds(a));
          BRIGADE_CHECK(finite(c.overhead), Errc::InvalidArgument,
                        "simulate: the cost model gives {} s of send overhead for {}", c.overhead,
                        schedule::to_string(a));
        }
      } else if (a.op == Op::Prefetch || a.op == Op::Release) {
        c.weights = weight_bytes(a);
        if constexpr (cost::HasWeightLoad<Cost>)
          if (a.op == Op::Prefetch) c.seconds = static_cast<double>(cost_model.weight_load_seconds(a));
        BRIGADE_CHECK(finite(c.seconds), Errc::InvalidArgument,
                      "simulate: the cost model gives {} s to load the weights of {}, expected "
                      "finite and >= 0",
                      c.seconds, schedule::to_string(a));
      } else if (schedule::is_compute(a.op)) {
        c.seconds = static_cast<double>(cost_model.compute_seconds(a));
        BRIGADE_CHECK(finite(c.seconds), Errc::InvalidArgument,
                      "simulate: the cost model gives {} s for {}, expected finite and >= 0",
                      c.seconds, schedule::to_string(a));
      }
    }
  }
  SimResult res = detail::run(lowered, table, options, initial);
  detail::peak_memory(lowered, cost_model, options.windows, res);
  return res;
}

/// Simulates `plan`'s lowered schedule (validated when the plan was built) with the costs of
/// `cost` (e.g. cost::RooflineCostModel(spec, plan), which prices each micro-batch's work),
/// under the plan's executor windows (plan.execution().windows replaces options.windows).
/// @throws brigade::Error as simulate(const schedule::Schedule&, ...)
template <cost::CostModel Cost>
SimResult simulate(const plan::Plan& plan, const Cost& cost_model, SimOptions options = {}) {
  options.validate = false;  // the Plan's constructor validated it
  options.windows = plan.execution().windows;
  return simulate(plan.schedule(), cost_model, options);
}

/// The metrics of a simulation as JSON (what `brigade simulate --metrics` writes):
/// {"makespan_s", "bubble_ratio", "actions", "messages", "ranks": P, "busy_s": [...],
///  "utilization": [...], "peak_memory_bytes": [...], "peak_stash": [...],
///  "peak_weight_bytes": [...], "io_wait_s": [...]}.
inline nlohmann::json metrics_json(const SimResult& r) {
  return {{"makespan_s", r.makespan},       {"bubble_ratio", r.bubble_ratio},
          {"actions", r.actions},           {"messages", r.messages},
          {"ranks", r.busy_seconds.size()}, {"busy_s", r.busy_seconds},
          {"utilization", r.utilization},   {"peak_memory_bytes", r.peak_memory_bytes},
          {"peak_stash", r.peak_stash},     {"peak_weight_bytes", r.peak_weight_bytes},
          {"io_wait_s", r.io_wait_seconds}};
}

}  // namespace v0
}  // namespace brigade::sim
