// Planning the next global batch while the current step runs (DynaPipe, EuroSys '24, section 3:
// the planner prepares each iteration's micro-batches and schedule ahead of execution, so
// planning stays off the critical path).
#pragma once

#include "brigade/core/error.hpp"

#include <functional>
#include <future>
#include <utility>

namespace brigade::batching {
inline namespace v0 {

/// Runs a planning function one call ahead on a background thread: next() returns the plan
/// of the call made while the caller was busy and starts the following one. The calls run one
/// at a time, in order, each after the previous returned, so the plans are exactly those of
/// calling `plan` in a loop (the function may keep state: a data stream's position). At most
/// `limit` calls are made (the steps of a run; none is planned past the last).
///
/// Thread safety: `plan` runs on the background thread while the caller runs its step; it
/// must not touch what the step uses. The destructor waits for a call in flight.
template <class T>
class PlanAhead {
 public:
  /// Starts the first call.
  /// @param plan  makes one plan per call (an exception it throws is rethrown by next())
  /// @param limit calls to make in all (>= 0)
  /// @throws brigade::Error{InvalidArgument} if limit < 0 or plan is empty
  PlanAhead(std::function<T()> plan, long long limit) : plan_(std::move(plan)), left_(limit) {
    BRIGADE_CHECK(plan_ != nullptr, Errc::InvalidArgument, "PlanAhead: no planning function");
    BRIGADE_CHECK(limit >= 0, Errc::InvalidArgument, "PlanAhead: {} calls, expected >= 0", limit);
    start();
  }
  PlanAhead(const PlanAhead&) = delete;
  PlanAhead& operator=(const PlanAhead&) = delete;
  ~PlanAhead() {
    if (pending_.valid()) pending_.wait();
  }

  /// The next plan (waits for its call if it is still running), then starts the following call.
  /// @throws what the planning function threw for this plan
  /// @throws brigade::Error{InvalidUsage} after `limit` plans
  T next() {
    BRIGADE_CHECK(pending_.valid(), Errc::InvalidUsage,
                  "PlanAhead: all {} plans were taken", taken_);
    T out = pending_.get();
    ++taken_;
    start();
    return out;
  }

 private:
  void start() {
    if (left_ <= 0) return;
    --left_;
    pending_ = std::async(std::launch::async, plan_);
  }

  std::function<T()> plan_;
  long long left_ = 0, taken_ = 0;
  std::future<T> pending_;
};

}  // namespace v0
}  // namespace brigade::batching
