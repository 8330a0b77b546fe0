// Decorators over any Transport: a forwarding base, byte and time tracing per message kind and
// peer, a rank that exits (fault injection for multi-process runs) and an inspection hook that
// checks received payloads before the engine sees them. Payload corruption is in
// transport/faults.hpp (FaultInjectingTransport), the SENTINEL integrity checks built on the
// inspection hook in transport/verify.hpp (VerifyingTransport). Each decorator is itself a
// Transport (and an AbortableTransport when its inner one is), so they compose:
//
// @code
//   InProcessTransport base(fabric, r);
//   FaultInjectingTransport bad(base, parse_fault_spec("bitflip:1:0.1:rank=0"));
//   VerifyingTransport checked(bad, SentinelConfig{}, VerifyPolicy::Stop);
//   engine::generate_on(checked, weights, partition, requests);
// @endcode
#pragma once

#include "brigade/transport/transport.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace brigade::transport {
inline namespace v0 {

/// A Transport that forwards every member to `inner`: derive from it and redefine only what the
/// decorator changes (members of the derived class hide the base's; engines call them on the
/// derived type, so no virtual call is involved). `abort` exists exactly when `Inner` has it.
/// The inner transport must outlive the decorator.
template <Transport Inner>
class ForwardingTransport {
 public:
  /// Decorates `inner` (not owned; it must outlive the decorator).
  explicit ForwardingTransport(Inner& inner) noexcept : inner_(&inner) {}

  /// inner().rank().
  [[nodiscard]] int rank() const { return inner_->rank(); }
  /// inner().world_size().
  [[nodiscard]] int world_size() const { return inner_->world_size(); }
  /// inner().isend(...). @throws brigade::Error as the inner transport
  Request isend(int peer, int tag, const MessageHeader& header, ConstBytes payload) {
    return inner_->isend(peer, tag, header, payload);
  }
  /// inner().irecv(...). @throws brigade::Error as the inner transport
  Request irecv(int peer, int tag, const MessageHeader& expected, MutableBytes buffer) {
    return inner_->irecv(peer, tag, expected, buffer);
  }
  /// inner().wait(...). @throws brigade::Error as the inner transport
  void wait(Request& r, Deadline deadline) { inner_->wait(r, deadline); }
  /// inner().test(...). @throws brigade::Error as the inner transport
  bool test(Request& r) { return inner_->test(r); }
  /// inner().abort(reason); present only when the inner transport has abort. Never throws.
  void abort(const std::string& reason) noexcept
    requires AbortableTransport<Inner>
  {
    inner_->abort(reason);
  }

  /// The decorated transport.
  [[nodiscard]] Inner& inner() const noexcept { return *inner_; }

 protected:
  /// inner().wait(r), then `done(r)` when this call is the one that completed `r`.
  template <class F>
  void wait_then(Request& r, Deadline deadline, F&& done) {
    if (r.done) return;
    inner_->wait(r, deadline);
    done(r);
  }
  /// inner().test(r), then `done(r)` when this call is the one that completed `r`.
  template <class F>
  bool test_then(Request& r, F&& done) {
    if (r.done) return true;
    if (!inner_->test(r)) return false;
    done(r);
    return true;
  }

  Inner* inner_;
};

// ------------------------------------------------------------------------------------------------
// Tracing

/// Traffic of one (direction, message kind, peer): messages, payload bytes, and the seconds
/// spent blocked in wait() on them.
struct TrafficStats {
  std::int64_t messages = 0;  ///< messages posted (sends) or completed (receives)
  std::int64_t bytes = 0;     ///< payload bytes (header.nbytes(); the header record not counted)
  double wait_s = 0.0;        ///< seconds inside wait() for these requests (steady clock)

  TrafficStats& operator+=(const TrafficStats& o) noexcept {
    messages += o.messages;
    bytes += o.bytes;
    wait_s += o.wait_s;
    return *this;
  }
};

/// Records bytes and wait time per message kind and per peer, separately for sends and
/// receives. A send is counted when posted (its bytes are header.nbytes()); a receive when it
/// completes (the bytes of the header that arrived). Not thread-safe, as the transports.
template <Transport Inner>
class TracingTransport : public ForwardingTransport<Inner> {
  using Base = ForwardingTransport<Inner>;

 public:
  /// Traces `inner` (not owned), starting from zero counts.
  explicit TracingTransport(Inner& inner)
      : Base(inner),
        sent_(static_cast<std::size_t>(kNumMessageKinds * inner.world_size())),
        received_(sent_.size()) {}

  /// Posts through the inner transport and counts the send. @throws brigade::Error as the inner
  Request isend(int peer, int tag, const MessageHeader& header, ConstBytes payload) {
    Request r = this->inner_->isend(peer, tag, header, payload);
    auto& s = cell(sent_, header.kind, peer);
    ++s.messages;
    s.bytes += static_cast<std::int64_t>(payload.size());
    return r;
  }
  /// Waits through the inner transport, adding the seconds blocked to the request's (kind,
  /// peer); counts a receive it completes. @throws brigade::Error as the inner
  void wait(Request& r, Deadline deadline) {
    if (r.done) return;
    const auto t0 = std::chrono::steady_clock::now();
    this->inner_->wait(r, deadline);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    cell(r.is_recv ? received_ : sent_, r.header.kind, r.peer).wait_s += s;
    if (r.is_recv) count_received(r);
  }
  /// Tests through the inner transport; counts a receive it completes.
  /// @throws brigade::Error as the inner
  bool test(Request& r) {
    return this->test_then(r, [&](Request& done) {
      if (done.is_recv) count_received(done);
    });
  }

  /// Sends to `peer` of `kind`.
  /// @throws brigade::Error{InvalidArgument} for a peer outside [0, world_size())
  [[nodiscard]] TrafficStats sent(MessageKind kind, int peer) const {
    return cell(sent_, kind, peer);
  }
  /// Receives from `peer` of `kind`.
  /// @throws brigade::Error{InvalidArgument} for a peer outside [0, world_size())
  [[nodiscard]] TrafficStats received(MessageKind kind, int peer) const {
    return cell(received_, kind, peer);
  }
  /// Sends of `kind` to every peer.
  [[nodiscard]] TrafficStats sent(MessageKind kind) const { return total(sent_, kind); }
  /// Receives of `kind` from every peer.
  [[nodiscard]] TrafficStats received(MessageKind kind) const { return total(received_, kind); }

 private:
  void count_received(const Request& r) {
    auto& s = cell(received_, r.header.kind, r.peer);
    ++s.messages;
    s.bytes += static_cast<std::int64_t>(r.header.nbytes());
  }
  template <class V>
  auto& cell(V& v, MessageKind kind, int peer) const {
    const int w = this->world_size();
    BRIGADE_CHECK(peer >= 0 && peer < w, Errc::InvalidArgument,
                  "TracingTransport: peer {} outside [0, {})", peer, w);
    const int k = static_cast<int>(kind);
    BRIGADE_CHECK(k >= 0 && k < kNumMessageKinds, Errc::InvalidArgument,
                  "TracingTransport: message kind {} out of range", k);
    return v[static_cast<std::size_t>(k * w + peer)];
  }
  [[nodiscard]] TrafficStats total(const std::vector<TrafficStats>& v, MessageKind kind) const {
    TrafficStats t;
    for (int p = 0; p < this->world_size(); ++p) t += cell(v, kind, p);
    return t;
  }

  std::vector<TrafficStats> sent_, received_;  // [kind * world_size + peer]
};

// ------------------------------------------------------------------------------------------------
// Fault injection

/// Fault injection for multi-process runs: ends the process with `std::_Exit(3)` (no cleanup, no
/// MPI_Finalize, as a crash would), after one line on stderr, right after `after_steps` receives
/// of micro-batch inputs (kind Activation or Token) have completed; after_steps = 0 never does.
/// What the CLI's `--fail-rank R --fail-after-steps K` wraps rank R's transport in.
template <Transport Inner>
class ExitAfterSteps : public ForwardingTransport<Inner> {
 public:
  /// @throws brigade::Error{InvalidArgument} if after_steps < 0
  ExitAfterSteps(Inner& inner, int after_steps)
      : ForwardingTransport<Inner>(inner), limit_(after_steps) {
    BRIGADE_CHECK(after_steps >= 0, Errc::InvalidArgument,
                  "ExitAfterSteps: after_steps = {}, expected >= 0", after_steps);
  }

  /// Waits through the inner transport; exits after the limit-th completed input receive.
  /// @throws brigade::Error as the inner
  void wait(Request& r, Deadline deadline) {
    this->wait_then(r, deadline, [&](Request& done) { count(done); });
  }
  /// Tests through the inner transport; exits as wait().
  /// @throws brigade::Error as the inner
  bool test(Request& r) {
    return this->test_then(r, [&](Request& done) { count(done); });
  }

 private:
  void count(const Request& r) {
    if (limit_ <= 0 || !r.is_recv ||
        (r.header.kind != MessageKind::Activation && r.header.kind != MessageKind::Token))
      return;
    if (++steps_ < limit_) return;
    fmt::print(stderr, "brigade: fault injection: rank {} exits (code 3) after {} step(s)\n",
               this->rank(), steps_);
    std::fflush(stderr);
    std::fflush(stdout);
    std::_Exit(3);
  }

  int limit_;
  int steps_ = 0;
};

// ------------------------------------------------------------------------------------------------
// Inspection

/// What an inspection decides about one received message.
enum class Verdict {
  Accept,  ///< deliver it as it is
  Drop,    ///< deliver it with kFlagDropped set in the header the caller reads (the engine drops
           ///< the micro-batch's contribution: transport.hpp, kFlagDropped)
  Reject,  ///< refuse it: the wait (or test) throws Error{Rejected}
};

/// A check's verdict and, for Drop and Reject, why (quoted in the Rejected error).
struct CheckResult {
  Verdict verdict = Verdict::Accept;  ///< what to do with the message
  std::string reason;                 ///< why (empty for Accept)
};

/// A check of one received payload: the header that arrived, the sending rank, the payload bytes
/// (exactly header.nbytes(), in the caller's receive buffer). Returns the verdict.
using PayloadCheck =
    std::function<CheckResult(const MessageHeader& header, int from, ConstBytes payload)>;

/// Runs `check` on every received payload whose kind is one of `kinds`, on the receiving rank,
/// after the inner transport completed the receive and before the caller (the engine) sees it:
/// the joint where integrity checks (transport/verify.hpp, SENTINEL) plug in. The verdict:
/// - Accept: the receive completes as usual;
/// - Drop: the receive completes and the request's header (what the caller reads after wait or
///   test) has `flags |= kFlagDropped`; the payload is delivered;
/// - Reject: the wait (or test) throws Error{Rejected} "rank R: rejected the <kind> message from
///   rank F for micro-batch M (stage S, chunk C, tag T): <reason>", naming this (receiving) rank
///   and the sending rank. The engines then abort the other ranks through the transport
///   (AbortableTransport), which stop with Error{Aborted} quoting it.
template <Transport Inner>
class InspectingTransport : public ForwardingTransport<Inner> {
 public:
  /// Inspects the received messages of the given kinds (none: the decorator only forwards).
  /// @throws brigade::Error{InvalidArgument} for an empty check or a kind out of range
  InspectingTransport(Inner& inner, const std::vector<MessageKind>& kinds, PayloadCheck check)
      : ForwardingTransport<Inner>(inner), check_(std::move(check)) {
    BRIGADE_CHECK(static_cast<bool>(check_), Errc::InvalidArgument,
                  "InspectingTransport: an empty check");
    for (MessageKind k : kinds) {
      const int i = static_cast<int>(k);
      BRIGADE_CHECK(i >= 0 && i < kNumMessageKinds, Errc::InvalidArgument,
                    "InspectingTransport: message kind {} out of range [0, {})", i,
                    kNumMessageKinds);
      kinds_ |= 1u << i;
    }
  }
  /// Inspects the received messages of one kind.
  /// @throws brigade::Error{InvalidArgument} for an empty check
  InspectingTransport(Inner& inner, MessageKind kind, PayloadCheck check)
      : InspectingTransport(inner, std::vector<MessageKind>{kind}, std::move(check)) {}

  /// Posts the receive; one of an inspected kind remembers its buffer for the check.
  Request irecv(int peer, int tag, const MessageHeader& expected, MutableBytes buffer) {
    Request inner = this->inner_->irecv(peer, tag, expected, buffer);
    if (!inspects(expected.kind)) return inner;
    auto w = std::make_shared<Posted>(Posted{std::move(inner), buffer});
    return Request::posted(true, peer, tag, expected, std::move(w));
  }
  /// As the inner wait; then checks an inspected receive.
  /// @throws brigade::Error{Rejected} when the check rejects the payload; as the inner wait
  void wait(Request& r, Deadline deadline) {
    if (r.done) return;
    Posted* p = posted(r);
    if (p == nullptr) return this->inner_->wait(r, deadline);
    this->inner_->wait(p->inner, deadline);
    finish(r, *p);
  }
  /// As the inner test; then checks an inspected receive that completed.
  /// @throws brigade::Error as wait()
  bool test(Request& r) {
    if (r.done) return true;
    Posted* p = posted(r);
    if (p == nullptr) return this->inner_->test(r);
    if (!this->inner_->test(p->inner)) return false;
    finish(r, *p);
    return true;
  }

  /// Whether received messages of `kind` are inspected.
  [[nodiscard]] bool inspects(MessageKind kind) const noexcept {
    const int i = static_cast<int>(kind);
    return i >= 0 && i < kNumMessageKinds && (kinds_ >> i & 1u) != 0;
  }
  /// Payloads checked so far (whatever the verdict).
  [[nodiscard]] std::int64_t inspected() const noexcept { return inspected_; }
  /// Payloads delivered with kFlagDropped set (verdict Drop) so far.
  [[nodiscard]] std::int64_t dropped() const noexcept { return dropped_; }

 private:
  struct Posted {
    Request inner;        // the inner transport's request
    MutableBytes buffer;  // the caller's receive buffer
  };
  [[nodiscard]] Posted* posted(const Request& r) const {
    return r.is_recv && inspects(r.header.kind) ? static_cast<Posted*>(r.state.get()) : nullptr;
  }
  void finish(Request& r, Posted& p) {
    r.header = p.inner.header;
    r.done = true;
    const MutableBytes buffer = p.buffer;
    r.state.reset();  // the inner request is complete (p is gone); the buffer holds the payload
    ++inspected_;
    const auto n = std::min(r.header.nbytes(), buffer.size());
    CheckResult v = check_(r.header, r.peer, ConstBytes(buffer.data(), n));
    if (v.verdict == Verdict::Drop) {
      r.header.flags |= kFlagDropped;
      ++dropped_;
    } else if (v.verdict == Verdict::Reject) {
      ::brigade::detail::fail(Errc::Rejected,
                              "rank {}: rejected the {} message from rank {} for micro-batch {} "
                              "(stage {}, chunk {}, tag {}): {}",
                              this->rank(), to_string(r.header.kind), r.peer,
                              r.header.microbatch, r.header.stage, r.header.chunk, r.tag,
                              v.reason);
    }
  }

  std::uint32_t kinds_ = 0;  // bit k: MessageKind k is inspected
  PayloadCheck check_;
  std::int64_t inspected_ = 0, dropped_ = 0;
};

}  // namespace v0
}  // namespace brigade::transport
