// The executor: one loop that walks a rank's lowered action list (training or inference) over a
// Worker (what the actions compute on) and a Transport, with bounded receive and send windows,
// and records the Timeline.
#pragma once

#include "brigade/core/timeline.hpp"
#include "brigade/schedule/action.hpp"
#include "brigade/schedule/dataflow.hpp"
#include "brigade/schedule/validate.hpp"
#include "brigade/transport/transport.hpp"

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string_view>
#include <vector>

namespace brigade::engine {
inline namespace v0 {

/// Receive and send windows of the executor, the semantics schedule::validate() models
/// (schedule::ExecutionModel):
///
/// - Receives: the executor posts the RECV actions of the program in program order, at most
///   `recv_window` of them ahead of the one it waits on (so receive buffers are bounded by the
///   window, not by the number of micro-batches). Messages of one (peer, tag) match the posted
///   receives in order (the Transport's rule), so the k-th receive a rank posts for a channel
///   takes the k-th message sent on it.
/// - Sends: posted when the SEND action is reached, asynchronously (the rank goes on computing);
///   at most `send_window` messages are in flight: posting one more first waits for the oldest.
///   All are completed at the end of the program.
using ExecutorWindows = schedule::Windows;

/// One message of a RECV action, as the Worker describes it: the tag, the expected header
/// (kAny fields allowed) and the receive buffer's size in bytes (at least the largest message).
struct MessageSpec {
  int tag = 0;
  transport::MessageHeader header;
  std::size_t capacity = 0;  ///< bytes
};

/// One message a RECV action received: the header that arrived and its payload bytes (valid
/// during Worker::received only).
struct Received {
  transport::MessageHeader header;
  transport::ConstBytes payload;
};

/// What a compute action did, for its Timeline interval.
struct Work {
  bool ran = true;              ///< false: nothing to do (no interval is recorded)
  std::int64_t tokens = 0;      ///< tokens (rows) processed
  std::string_view label;       ///< free text ("prefill", "decode"; may be empty)
  /// Seconds at the action's start the worker spent waiting on input from outside the
  /// pipeline (a serving book waiting for the next request to arrive): not the action's work,
  /// so its interval starts after them and the wait shows as idle time.
  double waited_s = 0.0;
};

/// Where a Worker's SEND puts its messages: each `add` copies the payload into a buffer of the
/// executor's send pool and posts it to the action's peer.
class Outbox {
 public:
  virtual ~Outbox() = default;
  /// Posts one message (`payload` exactly header.nbytes() bytes) with `tag` to the action's peer.
  /// The payload is copied unless it is the span stage() returned.
  virtual void add(int tag, const transport::MessageHeader& header,
                   transport::ConstBytes payload) = 0;
  /// The `nbytes` bytes the next add() sends from, for a worker to write a payload in place (a
  /// converted activation, a migration part gathered from the weights and the KV cache): an
  /// add() of exactly this span posts it without a copy. Valid until that add().
  virtual transport::MutableBytes stage(std::size_t nbytes) = 0;
};

/// What an executor runs the actions on: the stages of one rank with their messages.
///
/// - `compute(a)`: runs compute action `a` (F, B, BI, BW, RECOMPUTE, SAMPLE, ...), and the
///   weight ops PREFETCH and RELEASE of `a.virtual_stage` (a worker that cannot load or drop
///   weights refuses them with an Error naming why, or returns a Work whose label says it did
///   nothing);
/// - `recv_messages(a, out)`: appends the messages RECV action `a` receives, in order;
/// - `received(a, msgs)`: hands over what arrived for `a` (the bytes are valid only during the
///   call: the worker copies what it keeps);
/// - `send(a, out)`: posts the messages of SEND action `a` through the Outbox (zero or more).
///
/// A Worker may also report the bytes it holds for the program right now, `held_bytes()` ->
/// std::size_t (an O(1) counter; see ExecutorStats): the executor then adds it to its own.
///
/// A Worker that migrates layers (MIGRATE / MIGRATE_RECV, DynaPipe) also has
/// `migration_peer(a)` -> int: the rank the part of migration action `a` goes to or comes from
/// (the IR pairs a migration with a neighbour that only the plan change names). MIGRATE then
/// runs like a SEND (`send(a, out)` posts the part), MIGRATE_RECV like a RECV (posted in the
/// receive window with `recv_messages`, handed over with `received`).
template <class W>
concept Worker = requires(W& w, const schedule::Action& a, std::vector<MessageSpec>& specs,
                          std::span<const Received> msgs, Outbox& out) {
  { w.compute(a) } -> std::same_as<Work>;
  { w.recv_messages(a, specs) } -> std::same_as<void>;
  { w.received(a, msgs) } -> std::same_as<void>;
  { w.send(a, out) } -> std::same_as<void>;
};

/// Where the executor takes its actions from: `fill(out)` appends the next part of the program
/// (all of it for a fixed training program; one round at a time for inference) and returns
/// false when the program has ended. It is called again only once everything it gave has run,
/// so a source may decide the next part from what the previous one did.
template <class S>
concept ProgramSource = requires(S& s, std::vector<schedule::Action>& out) {
  { s.fill(out) } -> std::same_as<bool>;
};

/// A ProgramSource over a fixed, fully known action list (a training step).
class FixedProgram {
 public:
  /// @param program the rank's lowered actions; must outlive the source
  explicit FixedProgram(std::span<const schedule::Action> program) : program_(program) {}
  /// The whole program on the first call; false afterwards.
  bool fill(std::vector<schedule::Action>& out) {
    if (given_) return false;
    given_ = true;
    out.assign(program_.begin(), program_.end());
    return true;
  }

 private:
  std::span<const schedule::Action> program_;
  bool given_ = false;
};

/// What one executor run measured.
struct ExecutorStats {
  /// The most bytes held at once, sampled after each receive posting and after each action: the
  /// capacities of the receive window's buffers (each slot keeps the largest message posted into
  /// it) and of the send window's copies (likewise), plus the Worker's held_bytes() when it has
  /// one (training: the stashes, received copies, and outputs and input gradients waiting to be
  /// sent; runtime::TrainStage::held_bytes). Not counted: parameters, gradients, kernel scratch,
  /// the transport's own buffers, bookkeeping (vectors of requests, maps). sim::simulate predicts
  /// this figure (SimResult::peak_memory_bytes).
  std::size_t peak_memory_bytes = 0;
};

/// Settings of one executor run.
struct ExecutorRun {
  const schedule::Shape* shape = nullptr;  ///< placement (peers of SEND/RECV) and mode
  int rank = 0;                            ///< the rank whose program this is
  std::chrono::steady_clock::time_point t0{};  ///< the Timeline's origin
  double timeout_s = 120.0;                ///< a wait longer than this on a peer fails
  ExecutorWindows windows{};
};

namespace detail {

/// A receive posted ahead: the action and the requests and buffers of its messages. Slots are
/// reused (their buffers keep their capacity), so a steady-state step allocates nothing.
struct RecvSlot {
  schedule::Action action;
  std::size_t count = 0;                       // messages in use
  std::vector<std::vector<std::byte>> buffers;
  // After the buffers, so destroyed before them: a transport that writes into a posted
  // receive's buffer from another thread (InProcessTransport) stops when its request goes.
  std::vector<transport::Request> requests;
};

/// Makes `buf` exactly `n` bytes long, growing its allocation to exactly n when it is smaller
/// (std::vector::resize may double it), so that byte counts are the bytes asked for.
/// @return the growth of the allocation in bytes
inline std::size_t fit(std::vector<std::byte>& buf, std::size_t n) {
  const std::size_t before = buf.capacity();
  if (before < n) buf.reserve(n);
  buf.resize(n);
  return buf.capacity() - before;
}

/// A send in flight, with the copy of its payload.
struct SendSlot {
  schedule::Action action;
  transport::Request request;
  std::vector<std::byte> buffer;
  double posted_s = 0.0;
};

/// The executor's send window: at most `capacity` sends in flight, each with its own copy of the
/// payload; retired in posting order (`on_done` is called for each).
template <transport::Transport T>
class SendRing final : public Outbox {
 public:
  template <class OnDone, class DeadlineFn>
  SendRing(T& tp, std::size_t capacity, OnDone on_done, DeadlineFn deadline)
      : tp_(&tp), slots_(capacity), on_done_(std::move(on_done)), deadline_(std::move(deadline)) {}

  /// The SEND action the next add() calls belong to.
  void begin(int peer, const schedule::Action& a, double posted_s) {
    peer_ = peer;
    action_ = a;
    posted_s_ = posted_s;
  }
  transport::MutableBytes stage(std::size_t nbytes) override {
    if (count_ == slots_.size()) retire(true);
    auto& s = slots_[(head_ + count_) % slots_.size()];
    bytes_ += fit(s.buffer, nbytes);
    return {s.buffer.data(), nbytes};
  }
  void add(int tag, const transport::MessageHeader& header,
           transport::ConstBytes payload) override {
    if (count_ == slots_.size()) retire(true);
    auto& s = slots_[(head_ + count_) % slots_.size()];
    const bool staged = !payload.empty() && payload.data() == s.buffer.data();
    bytes_ += fit(s.buffer, payload.size());
    if (!payload.empty() && !staged) std::memcpy(s.buffer.data(), payload.data(), payload.size());
    s.action = action_;
    s.posted_s = posted_s_;
    s.request = tp_->isend(peer_, tag, header, transport::ConstBytes(s.buffer));
    ++count_;
  }
  /// Retires the completed sends at the head of the window, without blocking.
  void reap() {
    while (count_ > 0 && retire(false)) {
    }
  }
  /// Waits for every send in flight.
  void drain() {
    while (count_ > 0) retire(true);
  }
  /// Bytes allocated by the slots' copies (slots keep their buffers after the send completes).
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }

 private:
  bool retire(bool block) {
    auto& s = slots_[head_];
    if (block) {
      tp_->wait(s.request, deadline_());
    } else if (!tp_->test(s.request)) {
      return false;
    }
    on_done_(s);
    head_ = (head_ + 1) % slots_.size();
    --count_;
    return true;
  }

  T* tp_;
  std::vector<SendSlot> slots_;
  std::function<void(const SendSlot&)> on_done_;
  std::function<transport::Deadline()> deadline_;
  std::size_t head_ = 0, count_ = 0, bytes_ = 0;
  int peer_ = 0;
  schedule::Action action_;
  double posted_s_ = 0.0;
};

}  // namespace detail

/// Runs one rank's lowered program: the actions `source` gives, in order, over `worker` and
/// `transport`, and records one Timeline interval per compute action that ran (op, virtual
/// stage, micro-batch, chunk = round in inference), per PREFETCH and RELEASE (the worker's call:
/// with madvise, the time to issue the advice, not the asynchronous read it starts), per RECV
/// (the wait, with the bytes its messages carried) and per message of a SEND (from its post to
/// when the executor saw it complete, with the message's bytes). Receive and send buffers live in
/// slots reused across the run (no allocation per action once their capacity is reached).
///
/// Semantics (what schedule::validate() models, ExecutionModel): RECVs are posted in program
/// order within `run.windows.recv_window`; a RECV action waits for its messages; sends are
/// asynchronous within `run.windows.send_window` and completed at the end.
///
/// @return the run's peak memory (ExecutorStats)
/// @throws brigade::Error{InvalidArgument} for windows < 1 or a missing shape, or a MIGRATE or
///         MIGRATE_RECV for a worker without migration_peer(); the worker's and the transport's
///         errors
///         (PeerTimeout, HeaderMismatch, Aborted)
template <ProgramSource Source, Worker Wk, transport::Transport T>
ExecutorStats execute(Source& source, Wk& worker, T& transport, const ExecutorRun& run,
                      Timeline& timeline) {
  using schedule::Action;
  using schedule::Op;
  BRIGADE_CHECK(run.shape != nullptr, Errc::InvalidArgument, "execute: no shape");
  BRIGADE_CHECK(run.windows.recv_window >= 1 && run.windows.send_window >= 1,
                Errc::InvalidArgument, "execute: windows recv {} send {}, expected both >= 1",
                run.windows.recv_window, run.windows.send_window);
  const schedule::Shape& shape = *run.shape;
  auto now = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - run.t0).count();
  };
  auto deadline = [&] { return transport::Deadline::after(run.timeout_s); };
  auto record = [&](const Action& a, Op op, double start, double end, std::int64_t tokens,
                    std::string_view label, std::size_t bytes = 0) {
    Interval iv;
    iv.rank = run.rank;
    iv.op = op;
    iv.virtual_stage = a.virtual_stage;
    iv.microbatch = a.microbatch;
    iv.chunk = a.chunk;
    iv.start = start;
    iv.end = end;
    iv.tokens = tokens;
    iv.bytes = static_cast<std::int64_t>(bytes);
    iv.label = std::string(label);
    timeline.add(std::move(iv));
  };

  // Receive window: a ring of slots, posted in program order.
  const auto W = static_cast<std::size_t>(run.windows.recv_window);
  std::vector<detail::RecvSlot> recv(W);
  std::size_t recv_head = 0, recv_count = 0;  // ring of posted receives
  std::vector<MessageSpec> specs;
  std::vector<Received> got;

  // Send window: a ring of slots in posting order.
  detail::SendRing<T> sends(transport, static_cast<std::size_t>(run.windows.send_window),
                            [&](const detail::SendSlot& s) {
                              record(s.action, s.action.op, s.posted_s, now(), 0, {},
                                     s.buffer.size());
                            },
                            deadline);

  // Memory: the windows' buffers plus what the worker reports, sampled between actions.
  ExecutorStats stats;
  std::size_t recv_bytes = 0;
  auto sample = [&] {
    std::size_t b = recv_bytes + sends.bytes();
    if constexpr (requires { { worker.held_bytes() } -> std::convertible_to<std::size_t>; })
      b += worker.held_bytes();
    stats.peak_memory_bytes = std::max(stats.peak_memory_bytes, b);
  };

  // The peer rank of a SEND/RECV (the shape's placement) or of a migration (the worker's).
  auto peer_of = [&](const Action& a) -> int {
    if (!is_migration(a.op)) return schedule::peer_rank(shape, a);
    if constexpr (requires { { worker.migration_peer(a) } -> std::convertible_to<int>; }) {
      return worker.migration_peer(a);
    } else {
      ::brigade::detail::fail(Errc::InvalidArgument,
                              "execute: rank {}: {}: this worker does not migrate layers (a layer "
                              "migration moves an inference stage's weights and KV cache)",
                              run.rank, schedule::to_string(a));
    }
  };

  std::vector<Action> program;
  std::size_t pc = 0, post = 0;  // next action to run, next action to consider for posting
  auto post_receives = [&] {
    while (recv_count < W && post < program.size()) {
      const Action& a = program[post++];
      if (a.op != Op::RecvF && a.op != Op::RecvB && a.op != Op::MigrateRecv) continue;
      auto& slot = recv[(recv_head + recv_count) % W];
      slot.action = a;
      specs.clear();
      worker.recv_messages(a, specs);
      slot.count = specs.size();
      if (slot.requests.size() < specs.size()) {
        slot.requests.resize(specs.size());
        slot.buffers.resize(specs.size());
      }
      const int peer = peer_of(a);
      for (std::size_t i = 0; i < specs.size(); ++i) {
        auto& buf = slot.buffers[i];
        if (buf.size() < specs[i].capacity) recv_bytes += detail::fit(buf, specs[i].capacity);
        slot.requests[i] = transport.irecv(peer, specs[i].tag, specs[i].header,
                                           transport::MutableBytes(buf.data(), specs[i].capacity));
      }
      ++recv_count;
    }
  };

  for (;;) {
    if (pc == program.size()) {
      program.clear();
      pc = post = 0;
      if (!source.fill(program)) break;
      continue;
    }
    post_receives();
    sample();
    const Action a = program[pc++];
    const double start = now();
    switch (a.op) {
      case Op::RecvF:
      case Op::RecvB:
      case Op::MigrateRecv: {
        BRIGADE_CHECK(recv_count > 0 && recv[recv_head].action == a, Errc::Internal,
                      "execute: rank {}: {} was not posted", run.rank, schedule::to_string(a));
        auto& slot = recv[recv_head];
        got.clear();
        std::size_t moved = 0;
        for (std::size_t i = 0; i < slot.count; ++i) {
          auto& r = slot.requests[i];
          transport.wait(r, deadline());
          got.push_back({r.header, transport::ConstBytes(slot.buffers[i].data(),
                                                         r.header.nbytes())});
          moved += r.header.nbytes();
        }
        recv_head = (recv_head + 1) % W;
        --recv_count;
        worker.received(a, got);
        record(a, a.op, start, now(), 0, {}, moved);
        break;
      }
      case Op::SendF:
      case Op::SendB:
      case Op::Migrate: {
        sends.begin(peer_of(a), a, start);
        worker.send(a, sends);
        break;
      }
      default: {
        const Work w = worker.compute(a);
        if (w.ran) record(a, a.op, start + w.waited_s, now(), w.tokens, w.label);
        break;
      }
    }
    // Reap the sends that have completed meanwhile (in order), without blocking.
    sends.reap();
    sample();
  }
  sends.drain();
  return stats;
}

}  // namespace v0
}  // namespace brigade::engine
