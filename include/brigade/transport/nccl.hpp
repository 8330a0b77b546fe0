// NcclTransport: the Transport concept between GPUs, over NCCL send/recv.
//
// Declaration only: this header includes neither nccl.h nor cuda_runtime.h and compiles with
// plain g++ without CUDA; the implementation is in cuda/nccl_transport.cpp (link brigade::cuda).
#pragma once

#include "brigade/transport/transport.hpp"

#include <array>
#include <cstddef>
#include <memory>
#include <span>
#include <vector>

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace brigade::transport {
inline namespace v0 {

/// NCCL's 128-byte communicator id (ncclUniqueId), made by one rank and handed to every rank
/// (through threads, MPI_Bcast, a file...) before they construct their NcclTransport.
struct NcclUniqueId {
  std::array<std::byte, 128> bytes{};  ///< the opaque ncclUniqueId contents

  /// A fresh id (ncclGetUniqueId). Works without a GPU.
  /// @throws brigade::Error{Nccl} when NCCL cannot make one (no network interface, ...)
  static NcclUniqueId create();
};

/// One rank's endpoint of a pipeline over NCCL (ncclSend / ncclRecv). Models
/// brigade::transport::Transport.
///
/// Buffers: payload spans point to device memory on this rank's device (cudaMalloc'd); the
/// header travels in its own 128-byte message before the payload (both within one NCCL group)
/// and is checked with check_header on receipt.
///
/// Pairing and ordering: NCCL has no tags and matches sends to receives per pair of ranks in
/// posting order. So a send from rank a to rank b is received by the receive that b posted for
/// a in the same position, whatever the tags: between a and b, messages must be received in the
/// order they were sent. The tag travels in the header and a receive whose tag differs fails
/// with HeaderMismatch. A receive must give the full expected shape (no kAny dimension): NCCL
/// posts a receive with its exact byte count. A sender whose payload size differs from the
/// receiver's expected one cannot complete in NCCL: the wait on either side then ends at its
/// deadline with PeerTimeout.
///
/// Progress: isend and irecv queue their operation; the next flush, wait or test posts
/// everything queued as one NCCL group (ncclGroupStart/End) on the transport's own
/// communication stream, so sends and receives posted together progress together (NCCL's rule:
/// operations that must progress concurrently must be in one group). Groups run one after
/// another on the communication stream: a receive that the peer can satisfy only after a send
/// this rank has not yet flushed blocks the groups behind it, and ends in PeerTimeout at the
/// deadline; post a step's sends and receives together, then wait. Before a group starts, the
/// communication stream waits for the work enqueued so far on the compute stream (Options), so
/// sends read finished activations while later kernels keep computing: communication overlaps
/// compute.
///
/// Failure: the communicator is non-blocking (ncclConfig_t::blocking = 0). wait() polls the
/// completion event and ncclCommGetAsyncError until the deadline; at the deadline it aborts the
/// communicator (ncclCommAbort) and throws PeerTimeout naming the peer. After an abort every call
/// throws Error{Aborted}.
///
/// @code
///   auto id = brigade::transport::NcclUniqueId::create();       // on rank 0, then broadcast
///   brigade::transport::NcclTransport t(id, rank, 2, {.device = rank});
///   auto h = brigade::transport::MessageHeader::make(mb, 1, DType::F32, {rows, dim});
///   auto s = t.isend(1, 0, h, send_bytes);                      // queued
///   auto r = t.irecv(1, 0, h, recv_bytes);                      // queued
///   t.wait(r, brigade::transport::Deadline::after(30));         // one NCCL group: both
///   t.wait(s, brigade::transport::Deadline::after(30));
/// @endcode
class NcclTransport {
 public:
  /// Construction settings.
  struct Options {
    /// CUDA device of this rank.
    int device = 0;
    /// Seconds for all ranks to join the communicator (also bounds flush's wait for NCCL).
    double init_timeout_s = 120.0;
    /// Stream whose work every group waits for first (nullptr: the legacy default stream).
    CUstream_st* compute_stream = nullptr;
  };

  /// Joins the communicator `id` as `rank` of `world_size` (ncclCommInitRankConfig, non-blocking)
  /// and waits until every rank has joined.
  /// @throws brigade::Error{InvalidArgument} if rank is outside [0, world_size);
  ///         Error{PeerTimeout} if the other ranks do not join within init_timeout_s;
  ///         Error{Cuda} / Error{Nccl} when the device or NCCL fails
  NcclTransport(const NcclUniqueId& id, int rank, int world_size, Options options);
  /// As above with default Options (device 0).
  NcclTransport(const NcclUniqueId& id, int rank, int world_size);
  /// Waits for the groups in flight to finish (aborting instead when they cannot) and destroys
  /// the communicator.
  ~NcclTransport();
  NcclTransport(NcclTransport&&) noexcept;
  NcclTransport& operator=(NcclTransport&&) noexcept;
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  /// This endpoint's rank.
  [[nodiscard]] int rank() const;
  /// Number of ranks in the communicator.
  [[nodiscard]] int world_size() const;

  /// Queues a send of `payload` (device memory, exactly header.nbytes() bytes) to `peer`.
  /// @throws brigade::Error{InvalidArgument} for a bad peer, a wildcard in the header, or a
  ///         payload whose size differs from the header's; Error{Aborted} after an abort
  Request isend(int peer, int tag, const MessageHeader& header, ConstBytes payload);
  /// Queues a receive from `peer` into `buffer` (device memory of at least expected.nbytes()).
  /// @throws brigade::Error{InvalidArgument} for a bad peer, a shape with kAny, or a buffer
  ///         smaller than expected.nbytes(); Error{Aborted} after an abort
  Request irecv(int peer, int tag, const MessageHeader& expected, MutableBytes buffer);
  /// Posts everything queued as one NCCL group on the communication stream.
  /// @throws brigade::Error{Nccl} if NCCL refuses the group; Error{Aborted} after an abort
  void flush();
  /// Flushes if `r` is still queued, then blocks until it completes or `deadline` passes. For a
  /// receive, checks the header that arrived (and stores it in r.header).
  /// @throws brigade::Error{PeerTimeout} naming the peer at the deadline (the communicator is
  ///         aborted); Error{HeaderMismatch} for a header that differs from the expected one (or
  ///         carries another tag); Error{Nccl} for an asynchronous NCCL error; Error{Aborted}
  ///         after an abort
  void wait(Request& r, Deadline deadline);
  /// Flushes if `r` is still queued, then completes it if its group has finished; never blocks.
  /// @return true when `r` is complete
  /// @throws brigade::Error as wait() (except PeerTimeout)
  bool test(Request& r);
  /// Makes `stream` wait (on the device, without blocking the host) for the group that carries
  /// `r`, flushing first if needed: kernels enqueued on `stream` afterwards see the received data.
  /// The header is still checked only by wait() or test().
  void enqueue_wait(Request& r, CUstream_st* stream);
  /// Aborts the communicator (ncclCommAbort): operations in flight are cancelled, and every later
  /// call throws Error{Aborted}. Local only: it does not tell the other ranks (unlike the
  /// concept's optional abort(reason), AbortableTransport, which NcclTransport does not model;
  /// the other ranks stop at their deadlines).
  void abort();
  /// True after abort() or a timeout.
  [[nodiscard]] bool aborted() const noexcept;
  /// The communication stream.
  [[nodiscard]] CUstream_st* comm_stream() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

static_assert(Transport<NcclTransport>, "NcclTransport must model brigade::transport::Transport");

}  // namespace v0
}  // namespace brigade::transport
