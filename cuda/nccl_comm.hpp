// NcclComm: the non-blocking NCCL communicator that NcclTransport and NcclCollectives both hold
// (host .cpp files of brigade::cuda only, like check.hpp): joining it under a deadline, polling
// its asynchronous state, aborting it with a reason that every later call reports, and closing
// it in order (finalize, destroy) or, when its work does not drain, by abort.
#pragma once

#include "check.hpp"

#include <array>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

namespace brigade::cuda::detail {

class NcclComm {
 public:
  /// How the owner names itself in messages: e.g. {"rank", "NCCL transport", "ranks"} gives
  /// "rank 1: NCCL transport aborted: ..." and "... of 4 ranks not complete ...".
  struct Names {
    const char* member = "rank";
    const char* object = "NCCL communicator";
    const char* members = "ranks";
  };

  NcclComm() = default;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  /// Aborts a communicator its owner did not close().
  ~NcclComm() {
    if (comm_) static_cast<void>(ncclCommAbort(comm_));
  }

  /// Joins the communicator `id` (ncclUniqueId's 128 bytes) as `member` of `size`, non-blocking,
  /// and polls until every member has joined.
  /// @throws Error{Nccl} if NCCL refuses the call or reports an asynchronous error;
  ///         Error{PeerTimeout} (communicator aborted) if the others do not join within
  ///         `timeout_s` seconds.
  void init(const std::array<std::byte, 128>& id, int member, int size, double timeout_s,
            Names names) {
    names_ = names;
    member_ = member;
    ncclUniqueId nid;
    static_assert(sizeof(nid) == 128, "ncclUniqueId is 128 bytes");
    std::memcpy(&nid, id.data(), sizeof(nid));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t r = ncclCommInitRankConfig(&comm_, size, nid, member, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      comm_ = nullptr;
      BRIGADE_NCCL_CHECK(r, nullptr);
    }
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                           std::chrono::duration<double>(timeout_s));
    while (async_state() != ncclSuccess) {
      if (std::chrono::steady_clock::now() >= until)
        abort_with(
            Errc::PeerTimeout,
            fmt::format("{} {}: NCCL communicator of {} {} not complete after {} s; "
                        "another {} did not join",
                        names_.member, member, size, names_.members, timeout_s, names_.member));
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  [[nodiscard]] ncclComm_t get() const noexcept { return comm_; }
  [[nodiscard]] bool aborted() const noexcept { return aborted_; }

  /// @throws Error{Aborted} naming the reason once the communicator was aborted.
  void check_alive() const {
    BRIGADE_CHECK(!aborted_, Errc::Aborted, "{} {}: {} aborted: {}", names_.member, member_,
                  names_.object, reason_);
  }

  /// Aborts the communicator (cancelling its work) and remembers `why`; does not throw.
  void abort(std::string why) noexcept {
    if (aborted_) return;
    if (comm_) static_cast<void>(ncclCommAbort(comm_));
    comm_ = nullptr;
    aborted_ = true;
    reason_ = std::move(why);
  }

  /// Aborts with `why` and throws Error{code}(why).
  [[noreturn]] void abort_with(Errc code, const std::string& why) {
    abort(why);
    brigade::detail::fail(code, "{}", why);
  }

  /// ncclSuccess or ncclInProgress (a non-blocking call still enqueueing).
  /// @throws Error{Nccl} (communicator aborted) on an asynchronous error.
  ncclResult_t async_state() {
    ncclResult_t st = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &st);
    if (r != ncclSuccess) st = r;
    if (st != ncclSuccess && st != ncclInProgress)
      fail_call("NCCL reported an asynchronous error", st);
    return st;
  }

  /// Aborts and throws Error{Nccl} for `what` that NCCL answered with `r`.
  [[noreturn]] void fail_call(const std::string& what, ncclResult_t r) {
    const char* last = ncclGetLastError(comm_);
    abort_with(Errc::Nccl,
               fmt::format("{} {}: {}: {}{}{}", names_.member, member_, what, ncclGetErrorString(r),
                           (last && *last) ? ": " : "", (last && *last) ? last : ""));
  }

  /// Closes the communicator: when `drained(until)` says the owner's work in flight finished
  /// before `until` (a 10 s grace period), finalizes (polling, non-blocking) and destroys it;
  /// otherwise (a member is gone) aborts it, which cancels that work. Never throws.
  template <class Drained>
  void close(Drained&& drained) noexcept {
    if (!comm_ || aborted_) return;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    bool clean = drained(until);
    if (clean) {
      ncclResult_t st = ncclCommFinalize(comm_);
      while (st == ncclInProgress && std::chrono::steady_clock::now() <= until) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        if (ncclCommGetAsyncError(comm_, &st) != ncclSuccess) st = ncclInternalError;
      }
      clean = st == ncclSuccess;
    }
    if (clean) {
      static_cast<void>(ncclCommDestroy(comm_));
    } else {
      static_cast<void>(ncclCommAbort(comm_));
    }
    comm_ = nullptr;
  }

 private:
  ncclComm_t comm_ = nullptr;
  bool aborted_ = false;
  std::string reason_;
  Names names_;
  int member_ = 0;
};

}  // namespace brigade::cuda::detail
