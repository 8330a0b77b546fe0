// NcclCollectives: the Collectives concept between GPUs, over NCCL's ncclAllReduce,
// ncclAllGather and ncclBroadcast.
//
// Declaration only: this header includes neither nccl.h nor cuda_runtime.h and compiles with
// plain g++ without CUDA; the implementation is in cuda/nccl_collectives.cpp (link
// brigade::cuda).
#pragma once

#include "brigade/transport/collectives.hpp"
#include "brigade/transport/nccl.hpp"

#include <memory>
#include <span>

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace brigade::transport {
inline namespace v0 {

/// One member's endpoint of a group of GPUs over an NCCL communicator; models Collectives. The
/// spans are device memory of this member's device (float or double elements). Each call
/// enqueues the NCCL collective on the member's communication stream after the work already on
/// `Options::compute_stream`, then waits (polling, never blocking in NCCL) until it completes
/// or the deadline passes.
///
/// Sizes: NCCL carries no sizes, so members that pass different counts are not told; the
/// collective then cannot complete and ends at the deadline like a member that never joins.
/// Reductions are NCCL's (ring or tree, in NCCL's order): the same bits on every member, not
/// necessarily the same as InProcessCollectives' member-order sums.
///
/// Failure: the communicator is non-blocking (ncclConfig_t::blocking = 0). At the deadline the
/// member aborts the communicator (ncclCommAbort) and throws PeerTimeout; after an abort every
/// call throws Error{Aborted}. An asynchronous NCCL error aborts and throws Error{Nccl}.
///
/// @code
///   auto id = brigade::transport::NcclUniqueId::create();   // on member 0, then shared
///   brigade::transport::NcclCollectives c(id, member, 2, {.device = member});
///   c.all_reduce(std::span<float>(device_ptr, n), ReduceOp::Sum, Deadline::after(30));
/// @endcode
class NcclCollectives {
 public:
  /// Construction settings.
  struct Options {
    int device = 0;                        ///< CUDA device of this member
    double init_timeout_s = 120.0;         ///< seconds for every member to join the communicator
    CUstream_st* compute_stream = nullptr; ///< work every collective waits for (nullptr: legacy
                                           ///< default stream)
  };

  /// Joins the communicator `id` as `member` of `size` (ncclCommInitRankConfig, non-blocking)
  /// and waits until every member has joined.
  /// @throws brigade::Error{InvalidArgument} if member is outside [0, size); {PeerTimeout} if the
  ///         others do not join within init_timeout_s; {Cuda} / {Nccl} when the device or NCCL
  ///         fails
  NcclCollectives(const NcclUniqueId& id, int member, int size, Options options);
  /// Destroys the communicator (aborts it when a collective is still in flight). Never throws.
  ~NcclCollectives();
  NcclCollectives(NcclCollectives&&) noexcept;
  NcclCollectives& operator=(NcclCollectives&&) noexcept;
  NcclCollectives(const NcclCollectives&) = delete;
  NcclCollectives& operator=(const NcclCollectives&) = delete;

  /// This member's index in the group.
  [[nodiscard]] int rank() const;
  /// Members of the group.
  [[nodiscard]] int size() const;

  /// In place (device memory): every member's `data` becomes the elementwise sum or max over the
  /// members (ncclAllReduce, ncclSum / ncclMax).
  /// @throws brigade::Error{PeerTimeout} at the deadline (communicator aborted); {Nccl};
  ///         {Aborted} after an abort
  void all_reduce(std::span<float> data, ReduceOp op, Deadline deadline);
  /// As above for doubles.
  void all_reduce(std::span<double> data, ReduceOp op, Deadline deadline);
  /// `all` (device memory, size() x mine.size() elements) receives member r's `mine` at
  /// [r * mine.size(), (r + 1) * mine.size()) (ncclAllGather).
  /// @throws brigade::Error{InvalidArgument} if all.size() != size() * mine.size(); as
  ///         all_reduce()
  void all_gather(std::span<const float> mine, std::span<float> all, Deadline deadline);
  /// As above for doubles.
  void all_gather(std::span<const double> mine, std::span<double> all, Deadline deadline);
  /// Every member's `data` (device memory) becomes member `root`'s (ncclBroadcast).
  /// @throws brigade::Error{InvalidArgument} for a root outside [0, size()); as all_reduce()
  void broadcast(std::span<float> data, int root, Deadline deadline);
  /// As above for doubles.
  void broadcast(std::span<double> data, int root, Deadline deadline);

  /// Aborts the communicator (ncclCommAbort); every later call throws Error{Aborted}. Local:
  /// the other members stop at their deadlines.
  void abort();
  /// True after abort() or a timeout.
  [[nodiscard]] bool aborted() const noexcept;
  /// The communication stream.
  [[nodiscard]] CUstream_st* comm_stream() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

static_assert(Collectives<NcclCollectives>, "NcclCollectives must model Collectives");

}  // namespace v0
}  // namespace brigade::transport
