// runtime::WeightPrefetcher: the background loader of the mmap weight offload.
#include "brigade/runtime/offload.hpp"

#include <algorithm>

namespace brigade::runtime {
inline namespace v0 {

WeightPrefetcher::WeightPrefetcher() : thread_([this] { loop(); }) {}

WeightPrefetcher::~WeightPrefetcher() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
    queue_.clear();
  }
  cv_.notify_all();
  thread_.join();
}

void WeightPrefetcher::rethrow_locked() {
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void WeightPrefetcher::submit(InferenceStageBase* stage) {
  {
    std::lock_guard lock(mu_);
    rethrow_locked();
    if (running_ == stage || std::find(queue_.begin(), queue_.end(), stage) != queue_.end()) return;
    queue_.push_back(stage);
  }
  cv_.notify_all();
}

void WeightPrefetcher::settle(InferenceStageBase* stage) {
  std::unique_lock lock(mu_);
  queue_.erase(std::remove(queue_.begin(), queue_.end(), stage), queue_.end());
  cv_.wait(lock, [&] { return running_ != stage; });
  rethrow_locked();
}

long WeightPrefetcher::loads() const {
  std::lock_guard lock(mu_);
  return loads_;
}

void WeightPrefetcher::loop() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    running_ = queue_.front();
    queue_.pop_front();
    lock.unlock();
    std::exception_ptr err;
    try {
      running_->prefetch_weights();
    } catch (...) {
      err = std::current_exception();
    }
    lock.lock();
    if (err && !error_) error_ = err;
    ++loads_;
    running_ = nullptr;
    cv_.notify_all();
  }
}

}  // namespace v0
}  // namespace brigade::runtime
