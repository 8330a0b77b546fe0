// MpiTransport: the Transport concept between processes (one MPI rank per pipeline rank), and
// MpiSession, the RAII owner of MPI_Init/MPI_Finalize. Declarations only: this header includes
// no <mpi.h> and compiles without MPI; using it needs the brigade::mpi component at link time.
#pragma once

#include "brigade/transport/collectives.hpp"
#include "brigade/transport/transport.hpp"

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

namespace brigade::transport {
inline namespace v0 {

/// The world size an MPI launcher announced in this process's environment, read without
/// initializing MPI: OMPI_COMM_WORLD_SIZE (OpenMPI's mpirun), PMI_SIZE (MPICH's hydra, Slurm with
/// PMI2) or PMIX_SIZE; 0 when none is set (the process was not started by an MPI launcher).
inline int mpi_world_size_from_env() noexcept {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
    if (const char* v = std::getenv(name); v != nullptr && *v != '\0') {
      const int n = std::atoi(v);
      if (n > 0) return n;
    }
  }
  return 0;
}

/// RAII owner of the MPI library for one process: initializes MPI on construction and finalizes
/// it on destruction. At most one may exist at a time.
///
/// Asks for MPI_THREAD_MULTIPLE (several threads may then each drive their own MpiTransport) and
/// accepts whatever level the library provides (see thread_level()). Sets MPI_ERRORS_RETURN on
/// MPI_COMM_WORLD, so a failing MPI call becomes brigade::Error{Mpi} instead of an abort.
/// If MPI was already initialized by someone else, the session adopts it and leaves finalizing
/// to its owner.
///
/// @code
///   brigade::transport::MpiSession mpi;                 // MPI_Init_thread
///   brigade::transport::MpiTransport t;                 // a private copy of MPI_COMM_WORLD
///   if (mpi.rank() == 0) { ... }
/// @endcode
class MpiSession {
 public:
  /// Initializes MPI (argc/argv may be null).
  /// @throws brigade::Error{Mpi} if MPI_Init_thread fails;
  ///         brigade::Error{InvalidUsage} if another MpiSession exists or MPI was finalized
  explicit MpiSession(int* argc = nullptr, char*** argv = nullptr);
  /// Finalizes MPI if this session initialized it, except while an exception unwinds the stack:
  /// MPI_Finalize waits for every other process, and one that hangs would keep this failing
  /// process from exiting (mpirun then reports the process that exited without finalizing).
  /// Never throws.
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  /// This process's rank in MPI_COMM_WORLD, in [0, world_size()).
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Number of processes in MPI_COMM_WORLD.
  [[nodiscard]] int world_size() const noexcept { return world_size_; }
  /// The thread support MPI provided: 0 single, 1 funneled, 2 serialized, 3 multiple (the
  /// MPI_THREAD_* values of the MPI standard's order).
  [[nodiscard]] int thread_level() const noexcept { return thread_level_; }
  /// True when MPI provided MPI_THREAD_MULTIPLE.
  [[nodiscard]] bool thread_multiple() const noexcept { return thread_level_ >= 3; }

  /// Ends every process of the job with `code` (MPI_Abort on MPI_COMM_WORLD).
  [[noreturn]] static void abort(int code) noexcept;

  /// True when MPI_Init has run and MPI_Finalize has not.
  [[nodiscard]] static bool active() noexcept;

 private:
  int rank_ = 0;
  int world_size_ = 1;
  int thread_level_ = 0;
  bool owner_ = false;
  int uncaught_ = 0;  // std::uncaught_exceptions() at construction
};

/// One rank's endpoint of a Transport between MPI processes. Models brigade::transport::Transport
/// with MPI_Isend/MPI_Irecv on a private duplicate of a communicator.
///
/// Pairing and ordering: a message that rank a sends to rank b with tag t is received by a
/// receive that rank b posts for (a, t); messages between the same (a, b, t) are received in the
/// order they were sent, by receives in the order they were posted (MPI's non-overtaking rule;
/// the order of waits does not matter). Rank b needs to post the receive with the same dtype,
/// the same ndim, and a buffer at least as large as the payload; micro-batch, stage and shape
/// dimensions may be kAny on the receive side.
///
/// Wire format (version 5): every message starts with a 96-byte header record (magic, version,
/// kind, flags, micro-batch, stage, chunk, dtype, ndim, shape[4], payload bytes, piece bytes) on MPI tag
/// 1 + 2t. A record of another version is refused (Error{Mpi} naming both versions).
/// A payload of at most kInlineBytes travels in the same MPI message, right after the record
/// (one message, one copy on each side). A larger payload follows as a second stream on MPI tag
/// 2 + 2t, sent straight from the caller's buffer and received straight into the caller's buffer
/// (no copy), split into pieces of at most `piece bytes` (1 GiB) so counts fit MPI's int. The
/// receiver handles the records of one (peer, tag) in posting order and posts each payload
/// receive as soon as its record arrived, so the payload stream stays in step with the record
/// stream; every wait() and test() handles the arrived records of all channels with receives
/// posted, not only its own, so a posted receive takes its payload whichever request the rank
/// is waiting on (a large send completes once its receive is posted, as schedule::validate's
/// rendezvous model assumes). MPI tag 0 carries control notices (see below).
///
/// Sends: the payload buffer must stay valid and unchanged until the send's wait returns.
/// Receives: the buffer must stay valid until the receive's wait or test completes it.
///
/// Failure detection: wait() polls MPI_Test until the deadline. When the deadline passes it
/// tells every other rank "I wait on peer p" (a control notice), listens a little longer (a
/// grace of a quarter of the wait's timeout, between 0.05 s and 2 s) for the peer's own notice,
/// and throws Error{PeerTimeout} naming the rank at the end of the wait-for chain: if p reported
/// that it waits on q, q is named ("rank q stopped answering"); a cycle is reported as a
/// deadlock. A notice from the peer itself ends the wait early. abort() tells every rank that
/// this one failed; their waits then throw Error{Aborted} with the reason.
///
/// Not thread-safe: one thread at a time per MpiTransport (give each thread its own).
class MpiTransport {
 public:
  /// Payloads up to this many bytes travel inside the header's MPI message.
  static constexpr std::size_t kInlineBytes = 16 * 1024;
  /// The largest user tag every MPI supports (MPI guarantees MPI_TAG_UB >= 32767; user tag t
  /// uses MPI tags 1 + 2t and 2 + 2t).
  static constexpr int kGuaranteedMaxTag = (32767 - 2) / 2;

  /// Duplicates MPI_COMM_WORLD (collective: every rank of the world must construct one, in the
  /// same order as its other collective calls).
  /// @throws brigade::Error{InvalidUsage} if MPI is not initialized (create an MpiSession first);
  ///         brigade::Error{Mpi} if duplicating the communicator fails
  MpiTransport();
  /// Duplicates the communicator `*native_comm` points to (an `MPI_Comm*`; collective over it).
  /// @throws brigade::Error{InvalidArgument} if native_comm is null; as MpiTransport()
  explicit MpiTransport(const void* native_comm);
  /// Cancels receives still pending, frees the duplicated communicator. Never throws.
  ~MpiTransport();
  /// Takes over `other`'s communicator and pending requests; every member of the moved-from
  /// transport then throws Error{InvalidUsage}.
  MpiTransport(MpiTransport&& other) noexcept;
  /// As the move constructor; the communicator held before is freed first.
  MpiTransport& operator=(MpiTransport&& other) noexcept;
  MpiTransport(const MpiTransport&) = delete;
  MpiTransport& operator=(const MpiTransport&) = delete;

  /// This process's rank in the communicator.
  [[nodiscard]] int rank() const;
  /// Number of ranks in the communicator.
  [[nodiscard]] int world_size() const;
  /// The largest user tag this MPI supports (at least kGuaranteedMaxTag).
  [[nodiscard]] int max_tag() const;

  /// Posts a send of `payload` (exactly header.nbytes() bytes) to `peer` with `tag`.
  /// @throws brigade::Error{InvalidArgument} for a peer outside [0, world_size()), a tag outside
  ///         [0, max_tag()], a header with a wildcard, or a payload whose size differs from the
  ///         header's; Error{Mpi} if MPI_Isend fails
  Request isend(int peer, int tag, const MessageHeader& header, ConstBytes payload);

  /// Posts a receive of the next message from `peer` with `tag` into `buffer`, which may be
  /// larger than the message.
  /// @throws brigade::Error{InvalidArgument} for a bad peer or tag; Error{Mpi} if MPI_Irecv fails
  Request irecv(int peer, int tag, const MessageHeader& expected, MutableBytes buffer);

  /// Drives `r` to completion or until `deadline`. For a receive, checks the header
  /// (check_header), leaves the payload in the buffer and the received header in `r.header`.
  /// @throws brigade::Error{PeerTimeout} naming the peer (or the rank the peer waits on) when
  ///         the deadline passes; Error{HeaderMismatch} when the header differs or the buffer is
  ///         too small (the message is consumed either way); Error{Aborted} when another rank
  ///         called abort(); Error{Mpi} when an MPI call fails
  void wait(Request& r, Deadline deadline);

  /// Completes `r` if it can without blocking.
  /// @return true when `r` is complete
  /// @throws brigade::Error as wait(), except PeerTimeout
  bool test(Request& r);

  /// Returns once every rank of the communicator has called barrier() (MPI_Ibarrier, polled
  /// like wait; control notices are collected meanwhile, but an abort() elsewhere does not end
  /// it). A barrier that timed out stays posted and the next call resumes it; a transport
  /// destroyed with one pending keeps its communicator until MPI_Finalize.
  /// @throws brigade::Error{PeerTimeout} when the deadline passes (MPI does not say which rank is
  ///         missing); Error{Mpi}
  void barrier(Deadline deadline);

  /// The optional abort of the Transport concept (AbortableTransport): tells every other rank
  /// that this one failed with `reason`; their pending and later waits throw Error{Aborted}
  /// quoting it. Best effort, never blocks, never throws.
  void abort(const std::string& reason) noexcept;

 private:
  struct Impl;
  Impl& self() const;  // throws Error{InvalidUsage} on a moved-from transport
  std::unique_ptr<Impl> impl_;
};

static_assert(AbortableTransport<MpiTransport>, "MpiTransport must model AbortableTransport");

/// The Collectives concept over MPI: MPI_Iallreduce, MPI_Iallgather and MPI_Ibcast (the MPI
/// library's own algorithms) on a private communicator of a group of MPI_COMM_WORLD's ranks,
/// polled with MPI_Test until the deadline. Each call stages its data in buffers the object owns,
/// so a collective that times out (MPI cannot cancel one) never writes into the caller's memory
/// later; the object is then broken: later calls throw Error{InvalidUsage}, and its communicator
/// is left to MPI_Finalize. Not thread-safe: one thread per MpiCollectives.
class MpiCollectives {
 public:
  /// A group of every rank of MPI_COMM_WORLD (MPI_Comm_dup; collective over the world).
  /// @throws brigade::Error{InvalidUsage} if MPI is not initialized; Error{Mpi}
  MpiCollectives();
  /// A group of the given MPI_COMM_WORLD ranks, member r = world_ranks[r] (MPI_Comm_create_group;
  /// collective over those ranks only, which must all pass the same list).
  /// @throws brigade::Error{InvalidArgument} if this process is not in the list, the list is empty,
  ///         has a rank outside the world or a repeated rank; InvalidUsage; Error{Mpi}
  explicit MpiCollectives(std::span<const int> world_ranks);
  /// A group of the ranks of the communicator `*native_comm` points to (an `MPI_Comm*`, e.g. one
  /// of MPI_Comm_split; duplicated: collective over it), member r = its rank r.
  /// @throws brigade::Error{InvalidArgument} if native_comm is null; InvalidUsage; Error{Mpi}
  explicit MpiCollectives(const void* native_comm);
  /// Frees the communicator (unless a collective timed out). Never throws.
  ~MpiCollectives();
  MpiCollectives(const MpiCollectives&) = delete;
  MpiCollectives& operator=(const MpiCollectives&) = delete;

  /// This process's index in the group.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Members of the group.
  [[nodiscard]] int size() const noexcept { return size_; }

  /// MPI_Iallreduce (MPI_SUM or MPI_MAX) in place.
  /// @throws brigade::Error{PeerTimeout} at the deadline; Error{Mpi}; Error{InvalidUsage} when broken
  void all_reduce(std::span<float> data, ReduceOp op, Deadline deadline);
  /// As the float overload, on doubles.
  void all_reduce(std::span<double> data, ReduceOp op, Deadline deadline);
  /// MPI_Iallgather: `all` receives member r's `mine` at [r * mine.size(), (r + 1) * mine.size()).
  /// @throws brigade::Error{InvalidArgument} if all.size() != size() * mine.size(); as all_reduce
  void all_gather(std::span<const float> mine, std::span<float> all, Deadline deadline);
  /// As the float overload, on doubles.
  void all_gather(std::span<const double> mine, std::span<double> all, Deadline deadline);
  /// MPI_Ibcast from member `root`.
  /// @throws brigade::Error{InvalidArgument} for a root outside [0, size()); as all_reduce
  void broadcast(std::span<float> data, int root, Deadline deadline);
  /// As the float overload, on doubles.
  void broadcast(std::span<double> data, int root, Deadline deadline);

 private:
  enum class Kind { AllReduce, AllGather, Broadcast };
  void run(Kind kind, bool is_double, const void* in, std::size_t in_count, void* out,
           std::size_t out_count, ReduceOp op, int root, Deadline deadline);

  void* comm_ = nullptr;  // an MPI_Comm, allocated (the header includes no <mpi.h>)
  int rank_ = 0;
  int size_ = 1;
  bool broken_ = false;
  std::vector<std::byte> staging_;
};

static_assert(Collectives<MpiCollectives>, "MpiCollectives must model Collectives");

}  // namespace v0
}  // namespace brigade::transport
