// brigade::Timeline: what ran on which rank, when. Written by the executor and the simulator.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/core/op.hpp"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace brigade {
inline namespace v0 {

/// One interval of work on one rank.
struct Interval {
  int rank = 0;               ///< the rank (pipeline stage's worker) that did the work
  Op op = Op::F;              ///< what it did
  int virtual_stage = 0;      ///< which virtual stage (equal to the stage when not interleaved)
  int microbatch = 0;         ///< which micro-batch
  int chunk = 0;              ///< PACS/InfiniPipe chunk index (0 when unchunked); inference: the round
  double start = 0.0;         ///< seconds since the Timeline's origin
  double end = 0.0;           ///< seconds since the Timeline's origin, >= start
  std::int64_t tokens = 0;    ///< tokens processed by this interval (0 when not meaningful)
  /// Payload bytes a SEND or RECV interval moved (as its headers' dtype and shape give them: an
  /// f16 or bf16 message counts 2 bytes per element); 0 for every other op.
  std::int64_t bytes = 0;
  std::string label;          ///< optional free text ("prefill", "decode", ...)

  /// Length in seconds.
  [[nodiscard]] double duration() const noexcept { return end - start; }
};

/// An instant on one rank worth seeing beside its intervals: an integrity check's verdict on a
/// received message (transport/verify.hpp), a fault injected.
struct Mark {
  int rank = 0;        ///< the rank it happened on
  double at = 0.0;     ///< seconds since the Timeline's origin
  std::string name;    ///< short name ("verdict", "flagged", "fault")
  std::string detail;  ///< free text (what was checked, the score, the threshold)
};

/// Per-rank intervals of one run, measured (executor) or predicted (simulator), and marks.
///
/// Intervals of one rank may overlap only when they are communication (a send in flight while
/// the rank computes) or weight loads (a PREFETCH on the rank's I/O lane); busy time counts
/// compute intervals only (is_compute: neither SEND/RECV nor PREFETCH/RELEASE/MIGRATE).
class Timeline {
 public:
  /// An empty timeline for `num_ranks` ranks.
  /// @throws brigade::Error{InvalidArgument} if num_ranks < 1
  explicit Timeline(int num_ranks = 1) : num_ranks_(num_ranks) {
    BRIGADE_CHECK(num_ranks >= 1, Errc::InvalidArgument, "Timeline: num_ranks {} < 1", num_ranks);
  }

  /// Adds one interval.
  /// @throws brigade::Error{InvalidArgument} if its rank is outside [0, num_ranks) or end < start
  void add(Interval iv) {
    BRIGADE_CHECK(iv.rank >= 0 && iv.rank < num_ranks_, Errc::InvalidArgument,
                  "Timeline::add: rank {} outside [0, {})", iv.rank, num_ranks_);
    BRIGADE_CHECK(iv.end >= iv.start, Errc::InvalidArgument,
                  "Timeline::add: interval ends ({}) before it starts ({})", iv.end, iv.start);
    intervals_.push_back(std::move(iv));
  }

  /// Adds one mark (it takes no time and counts in no busy time or makespan).
  /// @throws brigade::Error{InvalidArgument} if its rank is outside [0, num_ranks)
  void add_mark(Mark m) {
    BRIGADE_CHECK(m.rank >= 0 && m.rank < num_ranks_, Errc::InvalidArgument,
                  "Timeline::add_mark: rank {} outside [0, {})", m.rank, num_ranks_);
    marks_.push_back(std::move(m));
  }

  /// Appends every interval and mark of `other` (same number of ranks).
  /// @throws brigade::Error{InvalidArgument} if the rank counts differ
  void merge(const Timeline& other) {
    BRIGADE_CHECK(other.num_ranks_ == num_ranks_, Errc::InvalidArgument,
                  "Timeline::merge: {} ranks vs {}", other.num_ranks_, num_ranks_);
    intervals_.insert(intervals_.end(), other.intervals_.begin(), other.intervals_.end());
    marks_.insert(marks_.end(), other.marks_.begin(), other.marks_.end());
  }

  [[nodiscard]] int num_ranks() const noexcept { return num_ranks_; }
  [[nodiscard]] const std::vector<Interval>& intervals() const noexcept { return intervals_; }
  [[nodiscard]] const std::vector<Mark>& marks() const noexcept { return marks_; }

  /// Earliest start over all intervals (0 when empty), seconds.
  [[nodiscard]] double begin() const noexcept {
    if (intervals_.empty()) return 0.0;
    double b = intervals_.front().start;
    for (const auto& iv : intervals_) b = std::min(b, iv.start);
    return b;
  }
  /// Latest end minus earliest start, seconds (0 when empty).
  [[nodiscard]] double makespan() const noexcept {
    if (intervals_.empty()) return 0.0;
    double e = intervals_.front().end;
    for (const auto& iv : intervals_) e = std::max(e, iv.end);
    return e - begin();
  }
  /// Seconds rank `r` spent in compute intervals (communication and memory ops excluded).
  [[nodiscard]] double busy(int r) const noexcept {
    double t = 0.0;
    for (const auto& iv : intervals_)
      if (iv.rank == r && is_compute(iv.op)) t += iv.duration();
    return t;
  }
  /// Payload bytes rank `r` sent (`sent` true: SEND intervals) or received (RECV intervals).
  [[nodiscard]] std::int64_t bytes(int r, bool sent) const noexcept {
    std::int64_t b = 0;
    for (const auto& iv : intervals_)
      if (iv.rank == r && (sent ? (iv.op == Op::SendF || iv.op == Op::SendB)
                                 : (iv.op == Op::RecvF || iv.op == Op::RecvB))) b += iv.bytes;
    return b;
  }
  /// busy(r) / makespan(), in [0, 1] (0 when the timeline is empty).
  [[nodiscard]] double utilization(int r) const noexcept {
    const double m = makespan();
    return m > 0.0 ? busy(r) / m : 0.0;
  }
  /// Idle rank-time over total rank-time: 1 - sum_r busy(r) / (num_ranks * makespan).
  [[nodiscard]] double bubble_ratio() const noexcept {
    const double m = makespan();
    if (m <= 0.0) return 0.0;
    double b = 0.0;
    for (int r = 0; r < num_ranks_; ++r) b += busy(r);
    return 1.0 - b / (num_ranks_ * m);
  }

 private:
  int num_ranks_;
  std::vector<Interval> intervals_;
  std::vector<Mark> marks_;
};

}  // namespace v0
}  // namespace brigade
