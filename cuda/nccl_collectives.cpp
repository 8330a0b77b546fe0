// NcclCollectives: Collectives over ncclAllReduce / ncclAllGather / ncclBroadcast on a
// non-blocking communicator. Each collective waits for the compute stream, is enqueued on the
// communication stream, and is followed by an event the host polls until the deadline.
#include "brigade/transport/nccl_collectives.hpp"

#include "check.hpp"

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>

namespace brigade::transport {
inline namespace v0 {

namespace {

template <class V>
constexpr ncclDataType_t nccl_type() {
  return std::is_same_v<V, float> ? ncclFloat32 : ncclFloat64;
}

constexpr ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::Sum ? ncclSum : ncclMax; }

}  // namespace

struct NcclCollectives::Impl {
  Options opt;
  int member = 0;
  int size = 1;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr;  // the compute stream's work before a collective
  cudaEvent_t done = nullptr;   // the last collective's completion
  bool in_flight = false;       // a collective was enqueued and not seen complete
  bool is_aborted = false;
  std::string abort_reason;

  ~Impl() {
    if (comm && !is_aborted) {
      static_cast<void>(cudaSetDevice(opt.device));
      // Orderly when the last collective finishes within a grace period: finalize, destroy.
      // Otherwise (a member is gone) abort, which cancels it.
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      bool clean = true;
      while (in_flight) {
        const cudaError_t e = cudaEventQuery(done);
        if (e != cudaErrorNotReady) {
          clean = e == cudaSuccess;
          break;
        }
        if (std::chrono::steady_clock::now() > until) {
          clean = false;
          break;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      if (clean) {
        ncclResult_t st = ncclCommFinalize(comm);
        while (st == ncclInProgress && std::chrono::steady_clock::now() <= until) {
          std::this_thread::sleep_for(std::chrono::microseconds(100));
          if (ncclCommGetAsyncError(comm, &st) != ncclSuccess) st = ncclInternalError;
        }
        clean = st == ncclSuccess;
      }
      if (clean) {
        static_cast<void>(ncclCommDestroy(comm));
      } else {
        static_cast<void>(ncclCommAbort(comm));
      }
      comm = nullptr;
    }
    if (done) static_cast<void>(cudaEventDestroy(done));
    if (ready) static_cast<void>(cudaEventDestroy(ready));
    if (stream) static_cast<void>(cudaStreamDestroy(stream));
  }

  void check_alive() const {
    BRIGADE_CHECK(!is_aborted, Errc::Aborted, "member {}: NCCL collectives aborted: {}", member,
                  abort_reason);
  }

  [[noreturn]] void abort_with(Errc code, const std::string& why) {
    if (!is_aborted && comm) static_cast<void>(ncclCommAbort(comm));
    comm = nullptr;
    is_aborted = true;
    in_flight = false;
    abort_reason = why;
    brigade::detail::fail(code, "{}", why);
  }

  /// ncclSuccess or ncclInProgress; aborts and throws Error{Nccl} on an asynchronous error.
  ncclResult_t async_state() {
    ncclResult_t st = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &st);
    if (r != ncclSuccess) st = r;
    if (st != ncclSuccess && st != ncclInProgress) {
      const char* last = ncclGetLastError(comm);
      abort_with(Errc::Nccl, fmt::format("member {}: NCCL reported an asynchronous error: {}{}{}",
                                         member, ncclGetErrorString(st),
                                         (last && *last) ? ": " : "",
                                         (last && *last) ? last : ""));
    }
    return st;
  }

  [[noreturn]] void timeout(const char* what) {
    abort_with(Errc::PeerTimeout,
               fmt::format("member {} of {}: {} did not complete before the deadline; a member "
                           "did not join or passed another size (NCCL communicator aborted)",
                           member, size, what));
  }

  /// Runs one collective: `enqueue(stream)` returns NCCL's status of the call.
  template <class F>
  void run(const char* what, Deadline deadline, F&& enqueue) {
    check_alive();
    BRIGADE_CUDA_CHECK(cudaSetDevice(opt.device));
    BRIGADE_CUDA_CHECK(cudaEventRecord(ready, opt.compute_stream));
    BRIGADE_CUDA_CHECK(cudaStreamWaitEvent(stream, ready, 0));
    const ncclResult_t r = enqueue(stream);
    if (r != ncclSuccess && r != ncclInProgress) {
      const char* last = ncclGetLastError(comm);
      abort_with(Errc::Nccl, fmt::format("member {}: {} refused by NCCL: {}{}{} (communicator "
                                         "aborted)",
                                         member, what, ncclGetErrorString(r),
                                         (last && *last) ? ": " : "", (last && *last) ? last : ""));
    }
    // Non-blocking communicator: the call may still be enqueueing.
    while (async_state() == ncclInProgress) {
      if (Deadline::Clock::now() >= deadline.at) timeout(what);
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    BRIGADE_CUDA_CHECK(cudaEventRecord(done, stream));
    in_flight = true;
    for (;;) {
      const cudaError_t e = cudaEventQuery(done);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) BRIGADE_CUDA_CHECK(e);
      async_state();
      if (Deadline::Clock::now() >= deadline.at) timeout(what);
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    in_flight = false;
  }

  template <class V>
  void all_reduce(std::span<V> data, ReduceOp op, Deadline deadline) {
    run("all_reduce", deadline, [&](cudaStream_t s) {
      return ncclAllReduce(data.data(), data.data(), data.size(), nccl_type<V>(), nccl_op(op),
                           comm, s);
    });
  }

  template <class V>
  void all_gather(std::span<const V> mine, std::span<V> all, Deadline deadline) {
    check_gather_sizes(member, size, mine.size(), all.size());
    run("all_gather", deadline, [&](cudaStream_t s) {
      return ncclAllGather(mine.data(), all.data(), mine.size(), nccl_type<V>(), comm, s);
    });
  }

  template <class V>
  void broadcast(std::span<V> data, int root, Deadline deadline) {
    check_root(member, size, root);
    run("broadcast", deadline, [&](cudaStream_t s) {
      return ncclBroadcast(data.data(), data.data(), data.size(), nccl_type<V>(), root, comm, s);
    });
  }
};

NcclCollectives::NcclCollectives(const NcclUniqueId& id, int member, int size, Options options)
    : impl_(std::make_unique<Impl>()) {
  BRIGADE_CHECK(size >= 1 && member >= 0 && member < size, Errc::InvalidArgument,
                "NcclCollectives: member {} outside [0, size = {})", member, size);
  BRIGADE_CHECK(options.init_timeout_s > 0, Errc::InvalidArgument,
                "NcclCollectives: init_timeout_s = {}; expected > 0", options.init_timeout_s);
  Impl& m = *impl_;
  m.opt = options;
  m.member = member;
  m.size = size;
  BRIGADE_CUDA_CHECK(cudaSetDevice(options.device));
  BRIGADE_CUDA_CHECK(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));
  BRIGADE_CUDA_CHECK(cudaEventCreateWithFlags(&m.ready, cudaEventDisableTiming));
  BRIGADE_CUDA_CHECK(cudaEventCreateWithFlags(&m.done, cudaEventDisableTiming));
  ncclUniqueId nid;
  static_assert(sizeof(nid) == sizeof(id.bytes), "ncclUniqueId is 128 bytes");
  std::memcpy(&nid, id.bytes.data(), sizeof(nid));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t r = ncclCommInitRankConfig(&m.comm, size, nid, member, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    m.comm = nullptr;
    BRIGADE_NCCL_CHECK(r, nullptr);
  }
  const auto deadline = Deadline::after(options.init_timeout_s);
  while (m.async_state() != ncclSuccess) {
    if (Deadline::Clock::now() >= deadline.at)
      m.abort_with(Errc::PeerTimeout,
                   fmt::format("member {}: NCCL communicator of {} members not complete after {} "
                               "s; another member did not join",
                               member, size, options.init_timeout_s));
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

NcclCollectives::~NcclCollectives() = default;
NcclCollectives::NcclCollectives(NcclCollectives&&) noexcept = default;
NcclCollectives& NcclCollectives::operator=(NcclCollectives&&) noexcept = default;

int NcclCollectives::rank() const { return impl_->member; }
int NcclCollectives::size() const { return impl_->size; }
bool NcclCollectives::aborted() const noexcept { return impl_->is_aborted; }
CUstream_st* NcclCollectives::comm_stream() const noexcept { return impl_->stream; }

void NcclCollectives::all_reduce(std::span<float> data, ReduceOp op, Deadline deadline) {
  impl_->all_reduce(data, op, deadline);
}
void NcclCollectives::all_reduce(std::span<double> data, ReduceOp op, Deadline deadline) {
  impl_->all_reduce(data, op, deadline);
}
void NcclCollectives::all_gather(std::span<const float> mine, std::span<float> all,
                                 Deadline deadline) {
  impl_->all_gather(mine, all, deadline);
}
void NcclCollectives::all_gather(std::span<const double> mine, std::span<double> all,
                                 Deadline deadline) {
  impl_->all_gather(mine, all, deadline);
}
void NcclCollectives::broadcast(std::span<float> data, int root, Deadline deadline) {
  impl_->broadcast(data, root, deadline);
}
void NcclCollectives::broadcast(std::span<double> data, int root, Deadline deadline) {
  impl_->broadcast(data, root, deadline);
}

void NcclCollectives::abort() {
  Impl& m = *impl_;
  if (m.is_aborted) return;
  if (m.comm) static_cast<void>(ncclCommAbort(m.comm));
  m.comm = nullptr;
  m.is_aborted = true;
  m.in_flight = false;
  m.abort_reason = fmt::format("member {}: abort() called", m.member);
}

}  // namespace v0
}  // namespace brigade::transport
