// NcclCollectives: Collectives over ncclAllReduce / ncclAllGather / ncclBroadcast on a
// non-blocking communicator. Each collective waits for the compute stream, is enqueued on the
// communication stream, and is followed by an event the host polls until the deadline.
#include "brigade/transport/nccl_collectives.hpp"

#include "check.hpp"
#include "nccl_comm.hpp"

#include <chrono>
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
  cuda::detail::NcclComm comm;
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr;  // the compute stream's work before a collective
  cudaEvent_t done = nullptr;   // the last collective's completion
  bool in_flight = false;       // a collective was enqueued and not seen complete

  ~Impl() {
    static_cast<void>(cudaSetDevice(opt.device));
    // Orderly when the last collective finishes within the grace period; otherwise (a member is
    // gone) the communicator is aborted, which cancels it.
    comm.close([&](auto until) {
      while (in_flight) {
        const cudaError_t e = cudaEventQuery(done);
        if (e != cudaErrorNotReady) return e == cudaSuccess;
        if (std::chrono::steady_clock::now() > until) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      return true;
    });
    if (done) static_cast<void>(cudaEventDestroy(done));
    if (ready) static_cast<void>(cudaEventDestroy(ready));
    if (stream) static_cast<void>(cudaStreamDestroy(stream));
  }

  [[noreturn]] void timeout(const char* what) {
    in_flight = false;
    comm.abort_with(Errc::PeerTimeout,
                    fmt::format("member {} of {}: {} did not complete before the deadline; a "
                                "member did not join or passed another size (NCCL communicator "
                                "aborted)",
                                member, size, what));
  }

  /// Runs one collective: `enqueue(stream)` returns NCCL's status of the call.
  template <class F>
  void run(const char* what, Deadline deadline, F&& enqueue) {
    comm.check_alive();
    BRIGADE_CUDA_CHECK(cudaSetDevice(opt.device));
    BRIGADE_CUDA_CHECK(cudaEventRecord(ready, opt.compute_stream));
    BRIGADE_CUDA_CHECK(cudaStreamWaitEvent(stream, ready, 0));
    const ncclResult_t r = enqueue(stream);
    if (r != ncclSuccess && r != ncclInProgress)
      comm.fail_call(fmt::format("{} refused by NCCL (communicator aborted)", what), r);
    // Non-blocking communicator: the call may still be enqueueing.
    while (comm.async_state() == ncclInProgress) {
      if (Deadline::Clock::now() >= deadline.at) timeout(what);
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    BRIGADE_CUDA_CHECK(cudaEventRecord(done, stream));
    in_flight = true;
    for (;;) {
      const cudaError_t e = cudaEventQuery(done);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) BRIGADE_CUDA_CHECK(e);
      comm.async_state();
      if (Deadline::Clock::now() >= deadline.at) timeout(what);
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    in_flight = false;
  }

  template <class V>
  void all_reduce(std::span<V> data, ReduceOp op, Deadline deadline) {
    run("all_reduce", deadline, [&](cudaStream_t s) {
      return ncclAllReduce(data.data(), data.data(), data.size(), nccl_type<V>(), nccl_op(op),
                           comm.get(), s);
    });
  }

  template <class V>
  void all_gather(std::span<const V> mine, std::span<V> all, Deadline deadline) {
    check_gather_sizes(member, size, mine.size(), all.size());
    run("all_gather", deadline, [&](cudaStream_t s) {
      return ncclAllGather(mine.data(), all.data(), mine.size(), nccl_type<V>(), comm.get(), s);
    });
  }

  template <class V>
  void broadcast(std::span<V> data, int root, Deadline deadline) {
    check_root(member, size, root);
    run("broadcast", deadline, [&](cudaStream_t s) {
      return ncclBroadcast(data.data(), data.data(), data.size(), nccl_type<V>(), root, comm.get(),
                           s);
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
  m.comm.init(id.bytes, member, size, options.init_timeout_s,
              {"member", "NCCL collectives", "members"});
}

NcclCollectives::~NcclCollectives() = default;
NcclCollectives::NcclCollectives(NcclCollectives&&) noexcept = default;
NcclCollectives& NcclCollectives::operator=(NcclCollectives&&) noexcept = default;

int NcclCollectives::rank() const { return impl_->member; }
int NcclCollectives::size() const { return impl_->size; }
bool NcclCollectives::aborted() const noexcept { return impl_->comm.aborted(); }
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
  m.in_flight = false;
  m.comm.abort(fmt::format("member {}: abort() called", m.member));
}

}  // namespace v0
}  // namespace brigade::transport
