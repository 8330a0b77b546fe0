// The Collectives concept beside Transport: all-reduce, all-gather and broadcast over a group of
// ranks, for tensor and data parallelism. Models: InProcessCollectives (threads, here) and
// MpiCollectives (MPI_Iallreduce / MPI_Iallgather / MPI_Ibcast, transport/mpi.hpp).
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/transport/transport.hpp"

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <concepts>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

namespace brigade::transport {
inline namespace v0 {

/// The reduction of an all-reduce.
enum class ReduceOp { Sum, Max };

/// Collective operations over the ranks of one group (every member calls each one, in the same
/// order, with the same sizes and root). Element types: float and double.
///
/// - `rank()`, `size()`: this member's index in the group, in [0, size()), and the group size;
/// - `all_reduce(data, op, deadline)`: in place, every member ends with the elementwise
///   reduction of every member's `data` (the same bits on every member);
/// - `all_gather(mine, all, deadline)`: `all` (size() * mine.size() elements) receives member
///   r's `mine` at [r * mine.size(), (r + 1) * mine.size());
/// - `broadcast(data, root, deadline)`: every member's `data` becomes member `root`'s.
/// A collective a member does not join before `deadline` throws Error{PeerTimeout}; sizes that
/// disagree with the documented ones are Error{InvalidArgument} on the member that sees them.
template <class C>
concept Collectives = requires(C& c, const C& cc, std::span<float> f, std::span<const float> cf,
                               std::span<double> d, std::span<const double> cd, Deadline dl) {
  { cc.rank() } -> std::same_as<int>;
  { cc.size() } -> std::same_as<int>;
  { c.all_reduce(f, ReduceOp::Sum, dl) } -> std::same_as<void>;
  { c.all_reduce(d, ReduceOp::Sum, dl) } -> std::same_as<void>;
  { c.all_gather(cf, f, dl) } -> std::same_as<void>;
  { c.all_gather(cd, d, dl) } -> std::same_as<void>;
  { c.broadcast(f, 0, dl) } -> std::same_as<void>;
  { c.broadcast(d, 0, dl) } -> std::same_as<void>;
};

/// Checks an all-gather's output size: size() x the input's.
/// @throws brigade::Error{InvalidArgument} naming the member and the sizes
inline void check_gather_sizes(int member, int size, std::size_t mine, std::size_t all) {
  BRIGADE_CHECK(all == mine * static_cast<std::size_t>(size), Errc::InvalidArgument,
                "all_gather: member {}: output of {} elements, expected {} x {}", member, all,
                size, mine);
}
/// Checks a broadcast's root.
/// @throws brigade::Error{InvalidArgument} for a root outside [0, size)
inline void check_root(int member, int size, int root) {
  BRIGADE_CHECK(root >= 0 && root < size, Errc::InvalidArgument,
                "broadcast: member {}: root {} outside [0, {})", member, root, size);
}

/// The shared state of an in-process group of `size` members (threads): create one, then one
/// InProcessCollectives per member over it.
class InProcessGroup {
 public:
  /// @throws brigade::Error{InvalidArgument} if size < 1
  explicit InProcessGroup(int size) : size_(size), slots_(static_cast<std::size_t>(size)) {
    BRIGADE_CHECK(size >= 1, Errc::InvalidArgument, "InProcessGroup: size = {}, expected >= 1",
                  size);
  }
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;

  /// Members of the group.
  [[nodiscard]] int size() const noexcept { return size_; }

  /// Ends the group because a member (or a peer it depends on) failed with `reason`: every
  /// member's pending and later collectives throw Error{Aborted} quoting it, instead of waiting
  /// for their deadline. Never throws; the first reason is kept.
  void abort(const std::string& reason) noexcept {
    std::lock_guard lock(mu_);
    if (!aborted_) {
      aborted_ = true;
      try {
        reason_ = reason;
      } catch (...) {  // keep the flag without the text
      }
    }
    cv_.notify_all();
  }

 private:
  friend class InProcessCollectives;
  struct Slot {
    const void* data = nullptr;  // this member's input of the current collective
    std::size_t count = 0;       // its elements
  };

  /// Blocks until every member has arrived at the barrier of the current phase.
  /// @throws brigade::Error{PeerTimeout} naming the members that did not arrive
  void arrive(int member, Deadline deadline, const char* what) {
    std::unique_lock lock(mu_);
    const auto check_aborted = [&] {
      if (aborted_)
        detail::fail(Errc::Aborted, "group member {}: {}: the group was aborted: {}", member,
                     what, reason_);
    };
    check_aborted();
    const std::uint64_t phase = phase_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++phase_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_until(lock, deadline.at, [&] { return phase_ != phase || aborted_; })) {
      --arrived_;
      detail::fail(Errc::PeerTimeout,
                   "group member {}: {}: {} of {} members joined before the deadline", member,
                   what, arrived_ + 1, size_);
    }
    if (phase_ == phase) {  // woken by abort()
      --arrived_;
      check_aborted();
    }
  }

  int size_;
  std::vector<Slot> slots_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t phase_ = 0;
  bool aborted_ = false;
  std::string reason_;
};

/// One member's endpoint on an InProcessGroup; models Collectives. Reductions add in member
/// order (0, 1, ...), so every member gets the same bits and a run is deterministic. Each
/// collective is two barriers: inputs published, then every input read (only then does a member
/// overwrite its buffer with its result). Not for use by two threads on one member.
class InProcessCollectives {
 public:
  /// @throws brigade::Error{InvalidArgument} if member is outside [0, group.size())
  InProcessCollectives(InProcessGroup& group, int member) : g_(&group), me_(member) {
    BRIGADE_CHECK(member >= 0 && member < group.size(), Errc::InvalidArgument,
                  "InProcessCollectives: member {} outside [0, {})", member, group.size());
  }

  /// This member's index in the group.
  [[nodiscard]] int rank() const noexcept { return me_; }
  /// Members of the group.
  [[nodiscard]] int size() const noexcept { return g_->size(); }

  /// In place: every member's `data` becomes the elementwise sum (or max) over the members, added
  /// in member order.
  /// @throws brigade::Error{InvalidArgument} when the members' sizes differ; PeerTimeout
  template <class V>
    requires std::same_as<V, float> || std::same_as<V, double>
  void all_reduce(std::span<V> data, ReduceOp op, Deadline deadline) {
    run(data.data(), data.size(), deadline, "all_reduce", [&] {
      std::vector<V> out(data.size());
      for (int m = 0; m < size(); ++m) {
        const auto* in = input<V>(m, data.size(), "all_reduce");
        for (std::size_t i = 0; i < out.size(); ++i)
          out[i] = m == 0 ? in[i] : op == ReduceOp::Sum ? out[i] + in[i] : std::max(out[i], in[i]);
      }
      return out;
    }, data);
  }

  /// `all` receives member r's `mine` at [r * mine.size(), (r + 1) * mine.size()).
  /// @throws brigade::Error{InvalidArgument} if all.size() != size() * mine.size() or the
  ///         members' sizes differ; PeerTimeout
  template <class V>
    requires std::same_as<V, float> || std::same_as<V, double>
  void all_gather(std::span<const V> mine, std::span<V> all, Deadline deadline) {
    check_gather_sizes(me_, size(), mine.size(), all.size());
    run(mine.data(), mine.size(), deadline, "all_gather", [&] {
      std::vector<V> out(all.size());
      for (int m = 0; m < size(); ++m) {
        const auto* in = input<V>(m, mine.size(), "all_gather");
        std::copy(in, in + mine.size(), out.begin() + static_cast<std::ptrdiff_t>(m * mine.size()));
      }
      return out;
    }, all);
  }

  /// Every member's `data` becomes member `root`'s.
  /// @throws brigade::Error{InvalidArgument} for a root outside [0, size()) or sizes that differ;
  ///         PeerTimeout
  template <class V>
    requires std::same_as<V, float> || std::same_as<V, double>
  void broadcast(std::span<V> data, int root, Deadline deadline) {
    check_root(me_, size(), root);
    run(data.data(), data.size(), deadline, "broadcast", [&] {
      const auto* in = input<V>(root, data.size(), "broadcast");
      return std::vector<V>(in, in + data.size());
    }, data);
  }

 private:
  template <class V>
  const V* input(int member, std::size_t count, const char* what) const {
    const auto& s = g_->slots_[static_cast<std::size_t>(member)];
    BRIGADE_CHECK(s.count == count, Errc::InvalidArgument,
                  "{}: member {} has {} elements, member {} has {}", what, me_, count, member,
                  s.count);
    return static_cast<const V*>(s.data);
  }

  /// Publishes the input, computes this member's result once all inputs are there, writes it
  /// once every member has read the inputs.
  template <class V, class F>
  void run(const V* data, std::size_t count, Deadline deadline, const char* what, F&& compute,
           std::span<V> out) {
    g_->slots_[static_cast<std::size_t>(me_)] = {data, count};
    g_->arrive(me_, deadline, what);
    std::vector<V> result;
    std::exception_ptr error;
    try {
      result = compute();
    } catch (...) {
      error = std::current_exception();
    }
    g_->arrive(me_, deadline, what);  // every member has read every input
    if (error) std::rethrow_exception(error);
    std::copy(result.begin(), result.end(), out.begin());
  }

  InProcessGroup* g_;
  int me_;
};

static_assert(Collectives<InProcessCollectives>);

}  // namespace v0
}  // namespace brigade::transport
