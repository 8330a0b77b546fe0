// Background weight prefetch for the mmap offload of prima.cpp's pipelined ring (Li et al. 2025,
// "PRIMA.CPP", §3.2): a rank loads its next window's pages on a thread of its own while it
// computes the current window or waits for the other devices, and releases each window after
// its run, so what is prefetched is not evicted before it is used.
#pragma once

#include "brigade/runtime/inference_stage.hpp"

#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

namespace brigade::runtime {
inline namespace v0 {

/// One loader thread per rank. submit() queues a stage and returns at once; the thread runs
/// the stage's prefetch_weights() (madvise WILLNEED, then one read per page) for each queued
/// stage in order. settle() is what a RELEASE calls first: a queued load of that stage is
/// dropped, a running one is waited for, so release_weights() never races a load of the same
/// pages. Not copyable or movable; the destructor stops the thread after the load in progress.
class WeightPrefetcher {
 public:
  WeightPrefetcher();
  ~WeightPrefetcher();
  WeightPrefetcher(const WeightPrefetcher&) = delete;
  WeightPrefetcher& operator=(const WeightPrefetcher&) = delete;

  /// Queues a load of `stage`'s weight pages (a stage already queued is not queued twice).
  /// @throws brigade::Error the loader's error of an earlier load (madvise failed), if any
  void submit(InferenceStageBase* stage);
  /// Drops a queued load of `stage`, or waits for the one in progress.
  /// @throws brigade::Error the loader's error of an earlier load, if any
  void settle(InferenceStageBase* stage);
  /// Loads finished since construction (for tests and reports).
  [[nodiscard]] long loads() const;

 private:
  void loop();
  void rethrow_locked();

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<InferenceStageBase*> queue_;
  InferenceStageBase* running_ = nullptr;
  long loads_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: started after the members it reads
};

}  // namespace v0
}  // namespace brigade::runtime
