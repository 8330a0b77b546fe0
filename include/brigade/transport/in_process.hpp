// InProcessTransport: the Transport concept between threads of one process.
#pragma once

#include "brigade/transport/transport.hpp"

#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

namespace brigade::transport {
inline namespace v0 {

/// The shared state of `world_size` in-process ranks: one FIFO channel per (source, destination,
/// tag). Create one fabric, then one InProcessTransport per rank (thread) over it.
///
/// Sends complete at once, so their buffer can be reused immediately: a send whose receive is
/// already posted copies its payload straight into the receive's buffer (one copy, nothing
/// allocated: what a layer migration's megabyte parts need), any other is copied into the
/// channel until its receive takes it. The k-th receive posted on a channel takes the k-th
/// message sent on it, whatever order the waits come in.
class InProcessFabric {
 public:
  /// @throws brigade::Error{InvalidArgument} if world_size < 1
  explicit InProcessFabric(int world_size) : world_size_(world_size) {
    BRIGADE_CHECK(world_size >= 1, Errc::InvalidArgument,
                  "InProcessFabric: world_size = {}, expected >= 1", world_size);
  }
  InProcessFabric(const InProcessFabric&) = delete;
  InProcessFabric& operator=(const InProcessFabric&) = delete;

  [[nodiscard]] int world_size() const noexcept { return world_size_; }

  /// Wakes every waiter with Error{Aborted, reason}; later waits fail the same way. Used when one
  /// rank fails so the others stop instead of waiting for it.
  void abort(std::string reason) {
    {
      std::lock_guard lock(mu_);
      if (!aborted_) abort_reason_ = std::move(reason);
      aborted_ = true;
    }
    cv_.notify_all();
  }
  /// True once abort() was called.
  [[nodiscard]] bool aborted() const {
    std::lock_guard lock(mu_);
    return aborted_;
  }

 private:
  friend class InProcessTransport;
  struct Message {
    MessageHeader header;
    std::vector<std::byte> payload;
  };
  // A posted receive. A sender that finds it posted copies into `buffer` under `copy_mu`;
  // the receive's handle (RecvHandle) sets `abandoned` under the same mutex when it is
  // destroyed, so a receive given up before its message came (its rank failed and unwound)
  // never has its freed buffer written.
  struct RecvState {
    std::uint64_t sequence = 0;
    MutableBytes buffer;
    MessageHeader expected;
    std::mutex copy_mu;
    bool abandoned = false;  // under copy_mu
    bool delivered = false;  // under the fabric's lock: the payload is in `buffer`
    MessageHeader got;       // the delivered header, once delivered
  };
  struct RecvHandle {
    std::shared_ptr<RecvState> st;
    RecvHandle(const RecvHandle&) = delete;
    RecvHandle& operator=(const RecvHandle&) = delete;
    explicit RecvHandle(std::shared_ptr<RecvState> s) : st(std::move(s)) {}
    ~RecvHandle() {
      std::lock_guard lock(st->copy_mu);
      st->abandoned = true;
    }
  };
  struct Channel {
    std::map<std::uint64_t, Message> pending;  // by send sequence number, not yet received
    // Receives posted before their message was sent, by sequence number.
    std::map<std::uint64_t, std::shared_ptr<RecvState>> waiting;
    std::uint64_t sent = 0;                    // messages sent so far
    std::uint64_t posted = 0;                  // receives posted so far
  };
  using Key = std::tuple<int, int, int>;  // (source, destination, tag)

  int world_size_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<Key, Channel> channels_;
  bool aborted_ = false;
  std::string abort_reason_;
};

/// One rank's endpoint on an InProcessFabric. Models brigade::transport::Transport.
class InProcessTransport {
 public:
  /// @param fabric shared by all ranks; must outlive the transport
  /// @param rank   this endpoint's rank in [0, fabric.world_size())
  /// @throws brigade::Error{InvalidArgument} if rank is out of range
  InProcessTransport(InProcessFabric& fabric, int rank) : fabric_(&fabric), rank_(rank) {
    BRIGADE_CHECK(rank >= 0 && rank < fabric.world_size(), Errc::InvalidArgument,
                  "InProcessTransport: rank {} outside [0, {})", rank, fabric.world_size());
  }

  [[nodiscard]] int rank() const { return rank_; }
  [[nodiscard]] int world_size() const { return fabric_->world_size(); }

  /// Sends `payload` (exactly header.nbytes() bytes) to `peer` with `tag`. Completes at once.
  /// @throws brigade::Error{InvalidArgument} for a bad peer, a header with wildcards, or a
  ///         payload whose size differs from the header's
  Request isend(int peer, int tag, const MessageHeader& header, ConstBytes payload) {
    check_peer(peer);
    for (int i = 0; i < header.ndim; ++i)
      BRIGADE_CHECK(header.shape[static_cast<std::size_t>(i)] >= 0, Errc::InvalidArgument,
                    "rank {}: send to rank {} with wildcard shape[{}]", rank_, peer, i);
    BRIGADE_CHECK(payload.size() == header.nbytes(), Errc::InvalidArgument,
                  "rank {}: send to rank {} (tag {}) of {} bytes, header {} says {} bytes", rank_,
                  peer, tag, payload.size(), header.to_string(), header.nbytes());
    // The sequence number and the posted receive, if any, are taken under the fabric's lock;
    // the copy is made outside it: a large payload (a layer migration's part) does not hold up
    // the other ranks' sends and receives.
    std::shared_ptr<InProcessFabric::RecvState> direct;
    std::uint64_t seq = 0;
    InProcessFabric::Channel* ch = nullptr;
    {
      std::lock_guard lock(fabric_->mu_);
      ch = &fabric_->channels_[{rank_, peer, tag}];
      seq = ch->sent++;
      if (const auto it = ch->waiting.find(seq); it != ch->waiting.end()) {
        // A receive that would refuse this message takes it from the channel instead, where
        // its wait names the mismatch.
        if (header_matches(it->second->expected, header) &&
            payload.size() <= it->second->buffer.size())
          direct = std::move(it->second);
        ch->waiting.erase(it);
      }
    }
    if (direct) {
      {
        std::lock_guard copying(direct->copy_mu);
        if (!direct->abandoned && !payload.empty())
          std::memcpy(direct->buffer.data(), payload.data(), payload.size());
      }
      std::lock_guard lock(fabric_->mu_);
      direct->got = header;
      direct->delivered = true;
    } else {
      InProcessFabric::Message msg{header, std::vector<std::byte>(payload.begin(), payload.end())};
      std::lock_guard lock(fabric_->mu_);
      ch->pending.emplace(seq, std::move(msg));
    }
    fabric_->cv_.notify_all();
    Request r = Request::posted(false, peer, tag, header);
    r.done = true;  // eager: the payload is already in the channel
    return r;
  }

  /// Posts a receive of the next message from `peer` with `tag` into `buffer`.
  /// @throws brigade::Error{InvalidArgument} for a bad peer
  Request irecv(int peer, int tag, const MessageHeader& expected, MutableBytes buffer) {
    check_peer(peer);
    auto st = std::make_shared<InProcessFabric::RecvState>();
    st->buffer = buffer;
    st->expected = expected;
    {
      std::lock_guard lock(fabric_->mu_);
      auto& ch = fabric_->channels_[{peer, rank_, tag}];
      st->sequence = ch.posted++;
      if (ch.pending.count(st->sequence) == 0) ch.waiting.emplace(st->sequence, st);
    }
    return Request::posted(true, peer, tag, expected,
                           std::make_shared<InProcessFabric::RecvHandle>(std::move(st)));
  }

  /// Blocks until `r` completes or `deadline` passes. For a receive, checks the header, copies
  /// the payload into the buffer and stores the received header in `r.header`.
  /// @throws brigade::Error{PeerTimeout} naming the peer when the deadline passes;
  ///         Error{HeaderMismatch} when the header differs or the buffer is too small;
  ///         Error{Aborted} when the fabric was aborted
  void wait(Request& r, Deadline deadline) {
    if (r.done) return;
    BRIGADE_CHECK(r.state != nullptr, Errc::InvalidUsage, "rank {}: wait on an empty request",
                  rank_);
    std::unique_lock lock(fabric_->mu_);
    auto& ch = fabric_->channels_[{r.peer, rank_, r.tag}];
    auto* st = state(r);
    auto ready = [&] {
      return fabric_->aborted_ || st->delivered || ch.pending.count(st->sequence) != 0;
    };
    if (!fabric_->cv_.wait_until(lock, deadline.at, ready)) {
      detail::fail(Errc::PeerTimeout,
                   "rank {}: no message from rank {} (tag {}, expecting {}) before the deadline; "
                   "rank {} stopped answering",
                   rank_, r.peer, r.tag, r.header.to_string(), r.peer);
    }
    if (delivered_locked(r)) return;
    auto msg = take_locked(r, ch);
    lock.unlock();  // the payload is copied outside the fabric's lock
    finish(r, std::move(msg));
  }

  /// The optional abort of the Transport concept (AbortableTransport): aborts the fabric, so
  /// every rank's pending and later waits throw Error{Aborted} quoting `reason` (the first
  /// reason wins). Never throws.
  void abort(const std::string& reason) noexcept {
    try {
      fabric_->abort(reason);
    } catch (...) {  // copying the reason failed: abort without it
      fabric_->abort(std::string());
    }
  }

  /// Completes `r` if its message has arrived; never blocks.
  /// @return true when `r` is complete
  /// @throws brigade::Error as wait()
  bool test(Request& r) {
    if (r.done) return true;
    std::unique_lock lock(fabric_->mu_);
    auto& ch = fabric_->channels_[{r.peer, rank_, r.tag}];
    auto* st = state(r);
    if (!fabric_->aborted_ && !st->delivered && ch.pending.count(st->sequence) == 0) return false;
    if (delivered_locked(r)) return true;
    auto msg = take_locked(r, ch);
    lock.unlock();
    finish(r, std::move(msg));
    return true;
  }

 private:
  static InProcessFabric::RecvState* state(const Request& r) {
    return static_cast<InProcessFabric::RecvHandle*>(r.state.get())->st.get();
  }

  /// Completes `r` if a sender copied its message into the buffer (the fabric's lock held).
  /// @throws brigade::Error{Aborted} when the fabric was aborted
  bool delivered_locked(Request& r) {
    if (fabric_->aborted_)
      detail::fail(Errc::Aborted, "rank {}: transport aborted: {}", rank_, fabric_->abort_reason_);
    auto* st = state(r);
    if (!st->delivered) return false;
    r.header = st->got;
    r.done = true;
    return true;
  }

  void check_peer(int peer) const {
    BRIGADE_CHECK(peer >= 0 && peer < world_size(), Errc::InvalidArgument,
                  "rank {}: peer {} outside [0, {})", rank_, peer, world_size());
  }

  /// Takes `r`'s message out of its channel (the fabric's lock held).
  /// @throws brigade::Error{Aborted} when the fabric was aborted
  InProcessFabric::Message take_locked(Request& r, InProcessFabric::Channel& ch) {
    if (fabric_->aborted_)
      detail::fail(Errc::Aborted, "rank {}: transport aborted: {}", rank_, fabric_->abort_reason_);
    auto it = ch.pending.find(state(r)->sequence);
    InProcessFabric::Message msg = std::move(it->second);
    ch.pending.erase(it);
    return msg;
  }

  /// Checks `msg` against `r` and copies its payload into the receive buffer (no lock held).
  /// @throws brigade::Error{HeaderMismatch} for another header or a buffer too small
  void finish(Request& r, InProcessFabric::Message msg) {
    auto* st = state(r);
    check_header(r.header, msg.header, rank_, r.peer, r.tag);
    BRIGADE_CHECK(msg.payload.size() <= st->buffer.size(), Errc::HeaderMismatch,
                  "rank {}: message from rank {} (tag {}, {}) has {} bytes, the receive buffer "
                  "holds {}",
                  rank_, r.peer, r.tag, msg.header.to_string(), msg.payload.size(),
                  st->buffer.size());
    if (!msg.payload.empty()) std::memcpy(st->buffer.data(), msg.payload.data(), msg.payload.size());
    r.header = msg.header;
    r.done = true;
  }

  InProcessFabric* fabric_;
  int rank_;
};

static_assert(AbortableTransport<InProcessTransport>);

/// One InProcessTransport per rank of `fabric`, rank r at index r (what engine::run_ranks takes).
inline std::vector<InProcessTransport> endpoints(InProcessFabric& fabric) {
  std::vector<InProcessTransport> out;
  out.reserve(static_cast<std::size_t>(fabric.world_size()));
  for (int r = 0; r < fabric.world_size(); ++r) out.emplace_back(fabric, r);
  return out;
}

}  // namespace v0
}  // namespace brigade::transport
