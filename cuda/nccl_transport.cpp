// NcclTransport: Transport over ncclSend/ncclRecv on a non-blocking communicator.
//
// Operations are queued by isend/irecv and posted as one NCCL group per flush. Each message is
// two NCCL operations to the same peer, in order: a 128-byte wire header (from a device staging
// slot), then the payload. After the group, the received headers are copied back to pinned host
// memory and an event is recorded; wait/test complete a request once that event has fired.
#include "brigade/transport/nccl.hpp"

#include "check.hpp"
#include "nccl_comm.hpp"

#include <chrono>
#include <cstring>
#include <deque>
#include <string>
#include <thread>
#include <utility>

namespace brigade::transport {
inline namespace v0 {
namespace {

constexpr std::size_t kSlot = 128;             // bytes of one wire header
constexpr std::uint32_t kMagic = 0x44475242u;  // "BRGD"
constexpr std::uint32_t kWireVersion = 5;      // 2: chunk after stage; 3: kind; 4: flags;
                                               // 5: brigade::DType codes (f16, bf16)

/// The header as it travels. Fixed layout, trivially copyable, at most kSlot bytes.
struct WireHeader {
  std::uint32_t magic;
  std::uint32_t version;
  std::int32_t tag;
  std::int32_t sender;
  std::int32_t kind;    // MessageKind
  std::uint32_t flags;  // MessageHeader::flags
  std::int64_t microbatch;
  std::int64_t stage;
  std::int64_t chunk;
  std::int32_t dtype;
  std::int32_t ndim;
  std::int64_t shape[4];
  std::uint64_t nbytes;
};
static_assert(sizeof(WireHeader) <= kSlot, "the wire header must fit its 128-byte slot");

/// One flushed NCCL group: staging for its headers and the event that marks its completion.
struct Batch {
  enum class State { Enqueuing, InFlight, Done };
  State state = State::Done;
  std::size_t slots = 0;      // capacity, in headers
  std::size_t used = 0;       // headers in the current use
  std::byte* host = nullptr;  // pinned [slots x kSlot]
  void* device = nullptr;     // [slots x kSlot]
  cudaEvent_t done = nullptr;
  int device_id = 0;

  Batch(std::size_t n, int dev) : slots(n), device_id(dev) {
    void* h = nullptr;
    BRIGADE_CUDA_CHECK(cudaMallocHost(&h, n * kSlot));
    host = static_cast<std::byte*>(h);
    const cudaError_t e = cudaMalloc(&device, n * kSlot);
    if (e != cudaSuccess) {
      static_cast<void>(cudaFreeHost(host));
      brigade::cuda::detail::fail_cuda(e, "cudaMalloc(header slots)", __FILE__, __LINE__);
    }
    BRIGADE_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  }
  ~Batch() {
    if (done) static_cast<void>(cudaEventDestroy(done));
    if (device) static_cast<void>(cudaFree(device));
    if (host) static_cast<void>(cudaFreeHost(host));
  }
  Batch(const Batch&) = delete;
  Batch& operator=(const Batch&) = delete;
};

/// What a Request's `state` points to.
struct OpState {
  bool is_send = false;
  int peer = 0;
  int tag = 0;
  MessageHeader header;  // sent, or expected
  const void* send_ptr = nullptr;
  void* recv_ptr = nullptr;
  std::size_t nbytes = 0;        // payload bytes posted
  std::shared_ptr<Batch> batch;  // null while queued
  std::size_t slot = 0;
};

}  // namespace

NcclUniqueId NcclUniqueId::create() {
  ncclUniqueId id;
  BRIGADE_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
  NcclUniqueId out;
  static_assert(sizeof(id) == sizeof(out.bytes), "ncclUniqueId is 128 bytes");
  std::memcpy(out.bytes.data(), &id, sizeof(id));
  return out;
}

struct NcclTransport::Impl {
  Options opt;
  int rank = 0;
  int world = 1;
  cuda::detail::NcclComm nccl;
  cudaStream_t stream = nullptr;
  cudaEvent_t compute_ready = nullptr;
  std::vector<std::shared_ptr<OpState>> queued;
  std::deque<std::shared_ptr<Batch>> in_flight;  // in flush order
  std::vector<std::shared_ptr<Batch>> pool;      // finished batches for reuse

  ~Impl() {
    static_cast<void>(cudaSetDevice(opt.device));
    // Orderly when the groups in flight finish within the grace period; otherwise (a peer is
    // gone) the communicator is aborted, which cancels them.
    nccl.close([&](auto until) {
      for (auto& b : in_flight) {
        for (;;) {
          if (b->state == Batch::State::Enqueuing) {
            ncclResult_t st = ncclSuccess;
            if (ncclCommGetAsyncError(nccl.get(), &st) != ncclSuccess ||
                (st != ncclSuccess && st != ncclInProgress))
              return false;
            if (st == ncclSuccess) {  // enqueued: add the completion event (errors ignored)
              static_cast<void>(cudaEventRecord(b->done, stream));
              b->state = Batch::State::InFlight;
            }
          } else if (cudaEventQuery(b->done) != cudaErrorNotReady) {
            break;
          }
          if (std::chrono::steady_clock::now() > until) return false;
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
      }
      return true;
    });
    in_flight.clear();
    pool.clear();
    if (compute_ready) static_cast<void>(cudaEventDestroy(compute_ready));
    if (stream) static_cast<void>(cudaStreamDestroy(stream));
  }

  void set_device() const {
    int cur = -1;
    BRIGADE_CUDA_CHECK(cudaGetDevice(&cur));
    if (cur != opt.device) BRIGADE_CUDA_CHECK(cudaSetDevice(opt.device));
  }

  void check_peer(int peer) const {
    BRIGADE_CHECK(peer >= 0 && peer < world, Errc::InvalidArgument,
                  "rank {}: peer {} outside [0, {})", rank, peer, world);
  }

  /// Enqueues what follows a group once NCCL has put it on the stream: the copy of the received
  /// headers back to the host, and the completion event.
  void finish_enqueue(Batch& b) {
    BRIGADE_CUDA_CHECK(
        cudaMemcpyAsync(b.host, b.device, b.used * kSlot, cudaMemcpyDeviceToHost, stream));
    BRIGADE_CUDA_CHECK(cudaEventRecord(b.done, stream));
    b.state = Batch::State::InFlight;
  }

  /// Advances every batch as far as it can go without blocking.
  void progress() {
    for (auto& b : in_flight) {
      if (b->state == Batch::State::Enqueuing) {
        if (nccl.async_state() == ncclInProgress) return;  // later batches wait behind it
        finish_enqueue(*b);
      }
      if (b->state == Batch::State::InFlight) {
        const cudaError_t e = cudaEventQuery(b->done);
        if (e == cudaErrorNotReady) return;
        BRIGADE_CUDA_CHECK(e);
        b->state = Batch::State::Done;
      }
    }
    while (!in_flight.empty() && in_flight.front()->state == Batch::State::Done) {
      pool.push_back(std::move(in_flight.front()));
      in_flight.pop_front();
    }
  }

  /// Waits (polling) until no group is still being enqueued by NCCL, so the next one may start.
  void settle_enqueue(Deadline deadline) {
    for (;;) {
      bool enqueuing = false;
      for (auto& b : in_flight)
        if (b->state == Batch::State::Enqueuing) enqueuing = true;
      if (!enqueuing) return;
      progress();
      if (Deadline::Clock::now() >= deadline.at)
        nccl.abort_with(Errc::PeerTimeout,
                        fmt::format("rank {}: NCCL did not finish enqueueing a group before the "
                                    "deadline; communicator aborted",
                                    rank));
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  std::shared_ptr<Batch> acquire(std::size_t n) {
    for (std::size_t i = 0; i < pool.size(); ++i) {
      // Reusable once no Request still holds it (its headers were read at completion).
      if (pool[i]->slots >= n && pool[i].use_count() == 1) {
        auto b = std::move(pool[i]);
        pool.erase(pool.begin() + static_cast<std::ptrdiff_t>(i));
        return b;
      }
    }
    return std::make_shared<Batch>(std::max<std::size_t>(n, 16), opt.device);
  }

  void flush(Deadline deadline) {
    nccl.check_alive();
    if (queued.empty()) return;
    set_device();
    settle_enqueue(deadline);
    auto batch = acquire(queued.size());
    batch->used = queued.size();
    std::memset(batch->host, 0, batch->used * kSlot);
    for (std::size_t i = 0; i < queued.size(); ++i) {
      OpState& op = *queued[i];
      if (!op.is_send) continue;
      WireHeader w{};
      w.magic = kMagic;
      w.version = kWireVersion;
      w.tag = op.tag;
      w.sender = rank;
      w.kind = static_cast<std::int32_t>(op.header.kind);
      w.flags = op.header.flags;
      w.microbatch = op.header.microbatch;
      w.stage = op.header.stage;
      w.chunk = op.header.chunk;
      w.dtype = static_cast<std::int32_t>(op.header.dtype);
      w.ndim = op.header.ndim;
      for (std::size_t d = 0; d < 4; ++d) w.shape[d] = op.header.shape[d];
      w.nbytes = op.nbytes;
      std::memcpy(batch->host + i * kSlot, &w, sizeof(w));
    }
    // The sends read what the compute stream produced: the communication stream waits for it.
    BRIGADE_CUDA_CHECK(cudaEventRecord(compute_ready, opt.compute_stream));
    BRIGADE_CUDA_CHECK(cudaStreamWaitEvent(stream, compute_ready, 0));
    BRIGADE_CUDA_CHECK(cudaMemcpyAsync(batch->device, batch->host, batch->used * kSlot,
                                       cudaMemcpyHostToDevice, stream));
    auto* dev = static_cast<std::byte*>(batch->device);
    BRIGADE_NCCL_CHECK(ncclGroupStart(), nccl.get());
    for (std::size_t i = 0; i < queued.size(); ++i) {
      OpState& op = *queued[i];
      std::byte* slot = dev + i * kSlot;
      if (op.is_send) {
        BRIGADE_NCCL_CHECK(ncclSend(slot, kSlot, ncclChar, op.peer, nccl.get(), stream),
                           nccl.get());
        if (op.nbytes > 0)
          BRIGADE_NCCL_CHECK(
              ncclSend(op.send_ptr, op.nbytes, ncclChar, op.peer, nccl.get(), stream), nccl.get());
      } else {
        BRIGADE_NCCL_CHECK(ncclRecv(slot, kSlot, ncclChar, op.peer, nccl.get(), stream),
                           nccl.get());
        if (op.nbytes > 0)
          BRIGADE_NCCL_CHECK(
              ncclRecv(op.recv_ptr, op.nbytes, ncclChar, op.peer, nccl.get(), stream), nccl.get());
      }
      op.batch = batch;
      op.slot = i;
    }
    const ncclResult_t r = ncclGroupEnd();
    queued.clear();
    if (r == ncclInProgress) {
      batch->state = Batch::State::Enqueuing;
    } else if (r != ncclSuccess) {
      nccl.fail_call(
          fmt::format("NCCL refused a group of {} operations (communicator aborted)", batch->used),
          r);
    } else {
      finish_enqueue(*batch);
    }
    in_flight.push_back(std::move(batch));
  }

  /// Checks the received header of a completed receive and fills the request.
  void complete(Request& r, OpState& op) {
    if (op.is_send) {
      r.done = true;
      op.batch.reset();
      return;
    }
    WireHeader w{};
    std::memcpy(&w, op.batch->host + op.slot * kSlot, sizeof(w));
    BRIGADE_CHECK(w.magic == kMagic && w.version == kWireVersion, Errc::HeaderMismatch,
                  "rank {}: message from rank {} (tag {}) carries no brigade header (magic {:#x}, "
                  "version {}; expected {:#x}, {})",
                  rank, op.peer, op.tag, w.magic, w.version, kMagic, kWireVersion);
    BRIGADE_CHECK(w.kind >= 0 && w.kind < kNumMessageKinds && w.dtype >= 0 && w.dtype < kNumDTypes,
                  Errc::HeaderMismatch,
                  "rank {}: message from rank {} (tag {}) has kind {} and dtype {}; expected a "
                  "kind below {} and a dtype below {}",
                  rank, op.peer, op.tag, w.kind, w.dtype, kNumMessageKinds, kNumDTypes);
    MessageHeader got;
    got.kind = static_cast<MessageKind>(w.kind);
    got.flags = w.flags;
    got.microbatch = w.microbatch;
    got.stage = w.stage;
    got.chunk = w.chunk;
    got.dtype = static_cast<DType>(w.dtype);
    got.ndim = w.ndim;
    for (std::size_t d = 0; d < 4; ++d) got.shape[d] = w.shape[d];
    BRIGADE_CHECK(w.tag == op.tag, Errc::HeaderMismatch,
                  "rank {}: message from rank {} has tag {}, expected tag {} (NCCL matches "
                  "messages in order, not by tag; received {}, expected {})",
                  rank, op.peer, w.tag, op.tag, got.to_string(), op.header.to_string());
    check_header(op.header, got, rank, op.peer, op.tag);
    BRIGADE_CHECK(w.nbytes == op.nbytes, Errc::HeaderMismatch,
                  "rank {}: message from rank {} (tag {}) has {} payload bytes, the receive "
                  "posted {}",
                  rank, op.peer, op.tag, w.nbytes, op.nbytes);
    r.header = got;
    r.done = true;
    op.batch.reset();  // the header is read: the batch may be reused
  }

  OpState& state_of(Request& r) const {
    BRIGADE_CHECK(r.state != nullptr, Errc::InvalidUsage, "rank {}: wait on an empty request",
                  rank);
    return *static_cast<OpState*>(r.state.get());
  }

  std::string describe(const OpState& op) const {
    return op.is_send
               ? fmt::format("send to rank {} (tag {}, {})", op.peer, op.tag, op.header.to_string())
               : fmt::format("receive from rank {} (tag {}, expecting {})", op.peer, op.tag,
                             op.header.to_string());
  }
};

NcclTransport::NcclTransport(const NcclUniqueId& id, int rank, int world_size)
    : NcclTransport(id, rank, world_size, Options{}) {}

NcclTransport::NcclTransport(const NcclUniqueId& id, int rank, int world_size, Options options)
    : impl_(std::make_unique<Impl>()) {
  BRIGADE_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, Errc::InvalidArgument,
                "NcclTransport: rank {} outside [0, world_size = {})", rank, world_size);
  BRIGADE_CHECK(options.init_timeout_s > 0, Errc::InvalidArgument,
                "NcclTransport: init_timeout_s = {}; expected > 0", options.init_timeout_s);
  Impl& m = *impl_;
  m.opt = options;
  m.rank = rank;
  m.world = world_size;
  BRIGADE_CUDA_CHECK(cudaSetDevice(options.device));
  BRIGADE_CUDA_CHECK(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));
  BRIGADE_CUDA_CHECK(cudaEventCreateWithFlags(&m.compute_ready, cudaEventDisableTiming));
  m.nccl.init(id.bytes, rank, world_size, options.init_timeout_s,
              {"rank", "NCCL transport", "ranks"});
}

NcclTransport::~NcclTransport() = default;
NcclTransport::NcclTransport(NcclTransport&&) noexcept = default;
NcclTransport& NcclTransport::operator=(NcclTransport&&) noexcept = default;

int NcclTransport::rank() const { return impl_->rank; }
int NcclTransport::world_size() const { return impl_->world; }
bool NcclTransport::aborted() const noexcept { return impl_->nccl.aborted(); }
CUstream_st* NcclTransport::comm_stream() const noexcept { return impl_->stream; }

Request NcclTransport::isend(int peer, int tag, const MessageHeader& header, ConstBytes payload) {
  Impl& m = *impl_;
  m.nccl.check_alive();
  m.check_peer(peer);
  for (int i = 0; i < header.ndim; ++i)
    BRIGADE_CHECK(header.shape[static_cast<std::size_t>(i)] >= 0, Errc::InvalidArgument,
                  "rank {}: send to rank {} with wildcard shape[{}]", m.rank, peer, i);
  BRIGADE_CHECK(header.ndim >= 0 && header.ndim <= 4, Errc::InvalidArgument,
                "rank {}: send to rank {} with ndim = {}; expected 0..4", m.rank, peer,
                header.ndim);
  BRIGADE_CHECK(payload.size() == header.nbytes(), Errc::InvalidArgument,
                "rank {}: send to rank {} (tag {}) of {} bytes, header {} says {} bytes", m.rank,
                peer, tag, payload.size(), header.to_string(), header.nbytes());
  auto st = std::make_shared<OpState>();
  st->is_send = true;
  st->peer = peer;
  st->tag = tag;
  st->header = header;
  st->send_ptr = payload.data();
  st->nbytes = payload.size();
  m.queued.push_back(st);
  return Request::posted(false, peer, tag, header, std::move(st));
}

Request NcclTransport::irecv(int peer, int tag, const MessageHeader& expected,
                             MutableBytes buffer) {
  Impl& m = *impl_;
  m.nccl.check_alive();
  m.check_peer(peer);
  BRIGADE_CHECK(expected.ndim >= 0 && expected.ndim <= 4, Errc::InvalidArgument,
                "rank {}: receive from rank {} with ndim = {}; expected 0..4", m.rank, peer,
                expected.ndim);
  for (int i = 0; i < expected.ndim; ++i)
    BRIGADE_CHECK(expected.shape[static_cast<std::size_t>(i)] >= 0, Errc::InvalidArgument,
                  "rank {}: receive from rank {} (tag {}) with shape[{}] = kAny; NcclTransport "
                  "needs the full expected shape (NCCL posts a receive with its exact byte count)",
                  m.rank, peer, tag, i);
  BRIGADE_CHECK(buffer.size() >= expected.nbytes(), Errc::InvalidArgument,
                "rank {}: receive from rank {} (tag {}, expecting {}) into a buffer of {} bytes; "
                "expected at least {}",
                m.rank, peer, tag, expected.to_string(), buffer.size(), expected.nbytes());
  auto st = std::make_shared<OpState>();
  st->is_send = false;
  st->peer = peer;
  st->tag = tag;
  st->header = expected;
  st->recv_ptr = buffer.data();
  st->nbytes = expected.nbytes();
  m.queued.push_back(st);
  return Request::posted(true, peer, tag, expected, std::move(st));
}

void NcclTransport::flush() { impl_->flush(Deadline::after(impl_->opt.init_timeout_s)); }

void NcclTransport::wait(Request& r, Deadline deadline) {
  if (r.done) return;
  Impl& m = *impl_;
  OpState& op = m.state_of(r);
  m.nccl.check_alive();
  if (!op.batch) m.flush(deadline);
  m.set_device();
  for (;;) {
    m.progress();
    if (op.batch->state == Batch::State::Done) {
      m.complete(r, op);
      return;
    }
    if (op.batch->state == Batch::State::InFlight) m.nccl.async_state();
    if (Deadline::Clock::now() >= deadline.at)
      m.nccl.abort_with(
          Errc::PeerTimeout,
          fmt::format("rank {}: {} did not complete before the deadline; rank {} stopped "
                      "answering (NCCL communicator aborted)",
                      m.rank, m.describe(op), op.peer));
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

bool NcclTransport::test(Request& r) {
  if (r.done) return true;
  Impl& m = *impl_;
  OpState& op = m.state_of(r);
  m.nccl.check_alive();
  if (!op.batch) m.flush(Deadline::after(m.opt.init_timeout_s));
  m.set_device();
  m.progress();
  if (op.batch->state != Batch::State::Done) {
    if (op.batch->state == Batch::State::InFlight) m.nccl.async_state();
    return false;
  }
  m.complete(r, op);
  return true;
}

void NcclTransport::enqueue_wait(Request& r, CUstream_st* stream) {
  if (r.done) return;  // the host already saw the group finish
  Impl& m = *impl_;
  OpState& op = m.state_of(r);
  m.nccl.check_alive();
  if (!op.batch) m.flush(Deadline::after(m.opt.init_timeout_s));
  m.set_device();
  m.settle_enqueue(Deadline::after(m.opt.init_timeout_s));
  BRIGADE_CUDA_CHECK(cudaStreamWaitEvent(stream, op.batch->done, 0));
}

void NcclTransport::abort() {
  Impl& m = *impl_;
  m.nccl.abort(fmt::format("rank {}: abort() called", m.rank));
}

}  // namespace v0
}  // namespace brigade::transport
