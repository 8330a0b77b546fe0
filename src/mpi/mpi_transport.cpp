// MpiTransport and MpiSession over MPI_Isend/MPI_Irecv. The wire format and the failure protocol
// are described in include/brigade/transport/mpi.hpp.
#include "brigade/transport/mpi.hpp"

#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <exception>
#include <limits>
#include <map>
#include <thread>
#include <utility>

namespace brigade::transport {
inline namespace v0 {

static_assert(Transport<MpiTransport>, "MpiTransport must model the Transport concept");

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint32_t kMagic = 0x44475242u;  // "BRGD" in little-endian byte order
constexpr std::uint32_t kWireVersion = 5;  // 2: chunk after stage; 3: kind first; 4: flags;
                                           // 5: brigade::DType codes (f16, bf16)
constexpr int kControlTag = 0;
constexpr std::size_t kPieceBytes = std::size_t{1} << 30;  // largest MPI message of a payload

/// The record at the start of every message (trivially copyable, no padding).
struct WireHeader {
  std::uint32_t magic = kMagic;
  std::uint32_t version = kWireVersion;
  std::int32_t kind = 0;    // MessageKind
  std::uint32_t flags = 0;  // MessageHeader::flags
  std::int64_t microbatch = 0;
  std::int64_t stage = 0;
  std::int64_t chunk = 0;
  std::int32_t dtype = 0;
  std::int32_t ndim = 0;
  std::array<std::int64_t, 4> shape{};
  std::uint64_t nbytes = 0;       // payload bytes
  std::uint64_t piece_bytes = 0;  // payload bytes per MPI message of the payload stream
};
static_assert(sizeof(WireHeader) == 96, "the wire record is 96 bytes with no padding");

/// A control notice on kControlTag.
struct Notice {
  static constexpr std::int32_t kStalled = 1;  // `from` timed out waiting on `waits_on`
  static constexpr std::int32_t kFailed = 2;   // `from` failed: `text`
  std::int32_t kind = 0;
  std::int32_t from = -1;
  std::int32_t waits_on = -1;
  std::int32_t length = 0;
  std::array<char, 1008> text{};
};
static_assert(sizeof(Notice) == 1024);

std::string mpi_error_string(int rc) {
  std::array<char, MPI_MAX_ERROR_STRING> buf{};
  int len = 0;
  if (MPI_Error_string(rc, buf.data(), &len) != MPI_SUCCESS) return fmt::format("MPI error {}", rc);
  return std::string(buf.data(), static_cast<std::size_t>(len));
}

/// Throws Error{Mpi} naming the call when rc is not MPI_SUCCESS.
template <class... Args>
void mpi_check(int rc, fmt::format_string<Args...> what, Args&&... args) {
  if (rc == MPI_SUCCESS) return;
  detail::fail(Errc::Mpi, "{}: {}", fmt::format(what, std::forward<Args>(args)...),
               mpi_error_string(rc));
}

bool mpi_usable() noexcept {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init != 0 && fin == 0;
}

/// States whose MPI requests could not be completed or cancelled when their transport closed:
/// MPI may still write into their buffers, so they live until the process ends.
std::vector<std::shared_ptr<void>>& graveyard() {
  static std::vector<std::shared_ptr<void>> g;
  return g;
}

std::atomic<bool> g_session_exists{false};

}  // namespace

// ------------------------------------------------------------------------------------------
// MpiSession

MpiSession::MpiSession(int* argc, char*** argv) {
  BRIGADE_CHECK(!g_session_exists.exchange(true), Errc::InvalidUsage,
                "MpiSession: another MpiSession exists; create one per process");
  uncaught_ = std::uncaught_exceptions();
  try {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    BRIGADE_CHECK(fin == 0, Errc::InvalidUsage,
                  "MpiSession: MPI was already finalized and cannot be initialized again");
    int provided = MPI_THREAD_SINGLE;
    if (init == 0) {
      mpi_check(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided),
                "MPI_Init_thread(MPI_THREAD_MULTIPLE)");
      owner_ = true;
    } else {
      mpi_check(MPI_Query_thread(&provided), "MPI_Query_thread");
    }
    thread_level_ = provided == MPI_THREAD_MULTIPLE    ? 3
                    : provided == MPI_THREAD_SERIALIZED ? 2
                    : provided == MPI_THREAD_FUNNELED   ? 1
                                                        : 0;
    mpi_check(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN),
              "MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN)");
    mpi_check(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
    mpi_check(MPI_Comm_size(MPI_COMM_WORLD, &world_size_), "MPI_Comm_size");
  } catch (...) {
    g_session_exists = false;
    throw;
  }
}

MpiSession::~MpiSession() {
  if (owner_ && std::uncaught_exceptions() <= uncaught_) {
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin == 0) MPI_Finalize();
  }
  g_session_exists = false;
}

void MpiSession::abort(int code) noexcept {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort does not return; this keeps [[noreturn]] honest if it did
}

bool MpiSession::active() noexcept { return mpi_usable(); }

// ------------------------------------------------------------------------------------------
// MpiTransport

namespace {

struct SendState {
  std::vector<std::byte> wire;       // the record, followed by an inline payload
  std::vector<MPI_Request> reqs;     // record message, then payload pieces
};

struct RecvState {
  MessageHeader expected;            // what the receive accepts (kAny fields match anything)
  MutableBytes buffer;
  std::vector<std::byte> staging;    // the record message: record + inline payload
  MPI_Request head = MPI_REQUEST_NULL;
  std::vector<MPI_Request> body;     // payload pieces (large messages)
  std::vector<std::size_t> body_sizes;
  std::vector<std::byte> drain;      // where a rejected large payload goes
  bool head_done = false;
  MessageHeader got;
  std::exception_ptr error;          // HeaderMismatch (or a protocol error), thrown by wait
};

/// Tests every request in `reqs`; true when all are complete.
bool test_all(std::vector<MPI_Request>& reqs, const char* what, int peer, int tag,
              const std::vector<std::size_t>* sizes = nullptr) {
  if (reqs.empty()) return true;
  int flag = 0;
  std::vector<MPI_Status> st(reqs.size());
  const int rc = MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &flag, st.data());
  if (rc == MPI_ERR_IN_STATUS) {
    for (const auto& s : st)
      if (s.MPI_ERROR != MPI_SUCCESS && s.MPI_ERROR != MPI_ERR_PENDING)
        mpi_check(s.MPI_ERROR, "{} (rank {}, tag {})", what, peer, tag);
  }
  mpi_check(rc, "MPI_Testall: {} (rank {}, tag {})", what, peer, tag);
  if (!flag) return false;
  if (sizes != nullptr) {
    for (std::size_t i = 0; i < st.size(); ++i) {
      int count = 0;
      MPI_Get_count(&st[i], MPI_BYTE, &count);
      BRIGADE_CHECK(static_cast<std::size_t>(count) == (*sizes)[i], Errc::Mpi,
                    "{} from rank {} (tag {}): payload piece {} has {} bytes, the record "
                    "announced {}",
                    what, peer, tag, i, count, (*sizes)[i]);
    }
  }
  reqs.clear();
  return true;
}

}  // namespace

struct MpiTransport::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  int max_tag = MpiTransport::kGuaranteedMaxTag;

  // Receives whose record has not arrived yet, per (peer, tag), in posting order.
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<RecvState>>> channels;
  // Receives whose payload pieces are posted, and sends not yet complete: kept alive here while
  // MPI may still touch their buffers.
  std::vector<std::shared_ptr<RecvState>> bodies;
  std::vector<std::shared_ptr<SendState>> sends;

  // Control notices.
  Notice inbox;
  MPI_Request inbox_req = MPI_REQUEST_NULL;
  std::vector<std::pair<std::unique_ptr<Notice>, MPI_Request>> outbox;
  std::map<int, int> waits_on;  // rank -> the rank it reported waiting on
  int failed_rank = -1;
  std::string failed_reason;
  MPI_Request barrier_req = MPI_REQUEST_NULL;  // a barrier that timed out, still posted

  explicit Impl(MPI_Comm parent) {
    BRIGADE_CHECK(mpi_usable(), Errc::InvalidUsage,
                  "MpiTransport: MPI is not initialized (create a brigade::transport::MpiSession "
                  "first) or was already finalized");
    mpi_check(MPI_Comm_dup(parent, &comm), "MPI_Comm_dup");
    mpi_check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    mpi_check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
    mpi_check(MPI_Comm_size(comm, &size), "MPI_Comm_size");
    int* ub = nullptr;
    int flag = 0;
    mpi_check(MPI_Comm_get_attr(comm, MPI_TAG_UB, &ub, &flag), "MPI_Comm_get_attr(MPI_TAG_UB)");
    if (flag && ub != nullptr) max_tag = (*ub - 2) / 2;
    post_inbox();
  }

  ~Impl() {
    if (!mpi_usable()) return;
    // Give MPI a moment to finish what can finish; cancel receives; park the rest.
    if (inbox_req != MPI_REQUEST_NULL) {
      MPI_Cancel(&inbox_req);
      MPI_Wait(&inbox_req, MPI_STATUS_IGNORE);
    }
    auto settle = [](MPI_Request& req, bool cancel, const std::shared_ptr<void>& owner) {
      if (req == MPI_REQUEST_NULL) return;
      if (cancel) MPI_Cancel(&req);
      const auto until = Clock::now() + std::chrono::milliseconds(50);
      int flag = 0;
      while (MPI_Test(&req, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && !flag &&
             Clock::now() < until) {
        std::this_thread::yield();
      }
      if (!flag && req != MPI_REQUEST_NULL) {
        MPI_Request_free(&req);
        if (owner) graveyard().push_back(owner);
      }
    };
    for (auto& [key, ch] : channels)
      for (auto& st : ch) settle(st->head, true, st);
    for (auto& st : bodies)
      for (auto& req : st->body) settle(req, true, st);
    for (auto& st : sends)
      for (auto& req : st->reqs) settle(req, false, st);
    for (auto& [notice, req] : outbox) {
      std::shared_ptr<Notice> keep(notice.release());
      settle(req, false, keep);
    }
    // A nonblocking barrier can be neither cancelled nor freed; while one is pending the
    // communicator must stay (it is left to MPI_Finalize).
    if (barrier_req != MPI_REQUEST_NULL) {
      const auto until = Clock::now() + std::chrono::milliseconds(50);
      int flag = 0;
      while (MPI_Test(&barrier_req, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && !flag &&
             Clock::now() < until) {
        std::this_thread::yield();
      }
      if (!flag) return;
    }
    MPI_Comm_free(&comm);
  }

  void check_peer_tag(int peer, int tag) const {
    BRIGADE_CHECK(peer >= 0 && peer < size, Errc::InvalidArgument,
                  "rank {}: peer {} outside [0, {})", rank, peer, size);
    BRIGADE_CHECK(tag >= 0 && tag <= max_tag, Errc::InvalidArgument,
                  "rank {}: tag {} outside [0, {}] (MpiTransport uses MPI tags 1 + 2t and 2 + 2t)",
                  rank, tag, max_tag);
  }

  // ---- control notices ----

  void post_inbox() {
    mpi_check(MPI_Irecv(&inbox, sizeof(Notice), MPI_BYTE, MPI_ANY_SOURCE, kControlTag, comm,
                        &inbox_req),
              "MPI_Irecv (control notices)");
  }

  void poll_control() {
    for (;;) {
      int flag = 0;
      MPI_Status status;
      mpi_check(MPI_Test(&inbox_req, &flag, &status), "MPI_Test (control notices)");
      if (!flag) break;
      const Notice n = inbox;
      if (n.kind == Notice::kStalled && n.from >= 0 && n.from < size) {
        waits_on[n.from] = n.waits_on;
      } else if (n.kind == Notice::kFailed && failed_rank < 0 && n.from >= 0 && n.from < size) {
        failed_rank = n.from;
        const auto len = static_cast<std::size_t>(
            std::clamp<std::int32_t>(n.length, 0, static_cast<std::int32_t>(n.text.size())));
        failed_reason.assign(n.text.data(), len);
      }
      post_inbox();
    }
    // Forget notices that went out.
    std::erase_if(outbox, [](auto& e) {
      int flag = 0;
      MPI_Test(&e.second, &flag, MPI_STATUS_IGNORE);
      return flag != 0;
    });
  }

  void broadcast(std::int32_t kind, int waits_on_rank, std::string_view text) noexcept {
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      auto n = std::make_unique<Notice>();
      n->kind = kind;
      n->from = rank;
      n->waits_on = waits_on_rank;
      const auto len = std::min(text.size(), n->text.size());
      std::memcpy(n->text.data(), text.data(), len);
      n->length = static_cast<std::int32_t>(len);
      MPI_Request req = MPI_REQUEST_NULL;
      if (MPI_Isend(n.get(), sizeof(Notice), MPI_BYTE, r, kControlTag, comm, &req) == MPI_SUCCESS)
        outbox.emplace_back(std::move(n), req);
    }
  }

  void throw_if_aborted() const {
    if (failed_rank >= 0)
      detail::fail(Errc::Aborted, "rank {}: stopping because rank {} failed: {}", rank,
                   failed_rank, failed_reason);
  }

  // ---- sends ----

  Request isend(int peer, int tag, const MessageHeader& header, ConstBytes payload) {
    check_peer_tag(peer, tag);
    for (int i = 0; i < header.ndim; ++i)
      BRIGADE_CHECK(header.shape[static_cast<std::size_t>(i)] >= 0, Errc::InvalidArgument,
                    "rank {}: send to rank {} with wildcard shape[{}]", rank, peer, i);
    BRIGADE_CHECK(payload.size() == header.nbytes(), Errc::InvalidArgument,
                  "rank {}: send to rank {} (tag {}) of {} bytes, header {} says {} bytes", rank,
                  peer, tag, payload.size(), header.to_string(), header.nbytes());
    if (sends.size() > 64) sweep_sends();
    WireHeader w;
    w.kind = static_cast<std::int32_t>(header.kind);
    w.flags = header.flags;
    w.microbatch = header.microbatch;
    w.stage = header.stage;
    w.chunk = header.chunk;
    w.dtype = static_cast<std::int32_t>(header.dtype);
    w.ndim = header.ndim;
    w.shape = header.shape;
    w.nbytes = payload.size();
    w.piece_bytes = kPieceBytes;
    const bool inline_payload = payload.size() <= kInlineBytes;
    auto st = std::make_shared<SendState>();
    st->wire.resize(sizeof(WireHeader) + (inline_payload ? payload.size() : 0));
    std::memcpy(st->wire.data(), &w, sizeof(WireHeader));
    if (inline_payload && !payload.empty())
      std::memcpy(st->wire.data() + sizeof(WireHeader), payload.data(), payload.size());
    st->reqs.push_back(MPI_REQUEST_NULL);
    mpi_check(MPI_Isend(st->wire.data(), static_cast<int>(st->wire.size()), MPI_BYTE, peer,
                        1 + 2 * tag, comm, &st->reqs.back()),
              "rank {}: MPI_Isend of a record to rank {} (tag {})", rank, peer, tag);
    if (!inline_payload) {
      for (std::size_t off = 0; off < payload.size(); off += kPieceBytes) {
        const std::size_t n = std::min(kPieceBytes, payload.size() - off);
        st->reqs.push_back(MPI_REQUEST_NULL);
        // MPI-3 send buffers are const; the cast is for MPI-2 style prototypes.
        mpi_check(MPI_Isend(const_cast<std::byte*>(payload.data() + off), static_cast<int>(n),
                            MPI_BYTE, peer, 2 + 2 * tag, comm, &st->reqs.back()),
                  "rank {}: MPI_Isend of {} payload bytes to rank {} (tag {})", rank, n, peer, tag);
      }
    }
    sends.push_back(st);
    return Request::posted(false, peer, tag, header, std::move(st));
  }

  void sweep_sends() {
    std::erase_if(sends, [&](auto& st) {
      int flag = 0;
      MPI_Testall(static_cast<int>(st->reqs.size()), st->reqs.data(), &flag, MPI_STATUSES_IGNORE);
      return flag != 0;
    });
  }

  bool progress_send(Request& r) {
    auto* st = static_cast<SendState*>(r.state.get());
    if (!test_all(st->reqs, "send", r.peer, r.tag)) return false;
    std::erase_if(sends, [&](auto& s) { return s.get() == st; });
    r.done = true;
    return true;
  }

  // ---- receives ----

  Request irecv(int peer, int tag, const MessageHeader& expected, MutableBytes buffer) {
    check_peer_tag(peer, tag);
    auto st = std::make_shared<RecvState>();
    st->expected = expected;
    st->buffer = buffer;
    st->staging.resize(sizeof(WireHeader) + kInlineBytes);
    mpi_check(MPI_Irecv(st->staging.data(), static_cast<int>(st->staging.size()), MPI_BYTE, peer,
                        1 + 2 * tag, comm, &st->head),
              "rank {}: MPI_Irecv from rank {} (tag {})", rank, peer, tag);
    channels[{peer, tag}].push_back(st);
    return Request::posted(true, peer, tag, expected, std::move(st));
  }

  /// Handles the records that arrived on (peer, tag), in posting order; stops at the first that
  /// has not, so payload receives are posted in the order of the record stream.
  void advance(int peer, int tag) {
    auto it = channels.find({peer, tag});
    if (it == channels.end()) return;
    auto& ch = it->second;
    while (!ch.empty()) {
      auto st = ch.front();
      int flag = 0;
      MPI_Status status;
      mpi_check(MPI_Test(&st->head, &flag, &status), "rank {}: MPI_Test of a receive from rank {} "
                "(tag {})", rank, peer, tag);
      if (!flag) return;
      ch.pop_front();
      on_record(*st, status, peer, tag);
      if (!st->body.empty()) bodies.push_back(st);
    }
  }

  /// advance() on every channel with receives posted: a receive makes progress whichever request
  /// the rank waits on, so a send whose receive is posted completes (the rendezvous semantics
  /// the executor's windows and schedule::validate assume). Without it a payload of a channel
  /// the rank is not waiting on (a migration part beside the descriptors) would not be
  /// received until the rank waits on that very receive, and its sender could block on it.
  void advance_all() {
    for (auto& [key, ch] : channels)
      if (!ch.empty()) advance(key.first, key.second);
  }

  void on_record(RecvState& st, const MPI_Status& status, int peer, int tag) {
    st.head_done = true;
    int count = 0;
    MPI_Get_count(&status, MPI_BYTE, &count);
    WireHeader w;
    if (static_cast<std::size_t>(count) < sizeof(WireHeader)) {
      st.error = std::make_exception_ptr(Error(
          Errc::Mpi, fmt::format("rank {}: a {}-byte message from rank {} (tag {}) is not a "
                                 "brigade message (shorter than its 96-byte record)",
                                 rank, count, peer, tag)));
      return;
    }
    std::memcpy(&w, st.staging.data(), sizeof(WireHeader));
    if (w.magic != kMagic || w.version != kWireVersion || w.ndim < 0 || w.ndim > 4 || w.kind < 0 ||
        w.kind >= kNumMessageKinds || w.dtype < 0 || w.dtype >= kNumDTypes ||
        w.piece_bytes == 0) {
      st.error = std::make_exception_ptr(Error(
          Errc::Mpi, fmt::format("rank {}: the message from rank {} (tag {}) has record magic "
                                 "{:#x} version {} (kind {}, dtype {}, ndim {}), expected {:#x} version {}",
                                 rank, peer, tag, w.magic, w.version, w.kind, w.dtype, w.ndim,
                                 kMagic, kWireVersion)));
      return;
    }
    st.got.kind = static_cast<MessageKind>(w.kind);
    st.got.flags = w.flags;
    st.got.microbatch = w.microbatch;
    st.got.stage = w.stage;
    st.got.chunk = w.chunk;
    st.got.dtype = static_cast<DType>(w.dtype);
    st.got.ndim = w.ndim;
    st.got.shape = w.shape;
    const bool inline_payload = w.nbytes <= kInlineBytes;
    const std::size_t carried = static_cast<std::size_t>(count) - sizeof(WireHeader);
    if (inline_payload && carried != w.nbytes) {
      st.error = std::make_exception_ptr(Error(
          Errc::Mpi, fmt::format("rank {}: the message from rank {} (tag {}) carries {} payload "
                                 "bytes, its record says {}",
                                 rank, peer, tag, carried, w.nbytes)));
      return;
    }
    // Check the header and the room; a rejected message is still consumed whole.
    try {
      check_header(st.expected, st.got, rank, peer, tag);
      BRIGADE_CHECK(w.nbytes <= st.buffer.size(), Errc::HeaderMismatch,
                    "rank {}: message from rank {} (tag {}, {}) has {} bytes, the receive buffer "
                    "holds {}",
                    rank, peer, tag, st.got.to_string(), w.nbytes, st.buffer.size());
    } catch (...) {
      st.error = std::current_exception();
    }
    if (inline_payload) {
      if (!st.error && w.nbytes > 0)
        std::memcpy(st.buffer.data(), st.staging.data() + sizeof(WireHeader), w.nbytes);
      st.staging = {};
      return;
    }
    st.staging = {};
    std::byte* target = st.buffer.data();
    if (st.error) {
      st.drain.resize(w.nbytes);
      target = st.drain.data();
    }
    for (std::uint64_t off = 0; off < w.nbytes; off += w.piece_bytes) {
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(w.piece_bytes, w.nbytes - off));
      st.body.push_back(MPI_REQUEST_NULL);
      st.body_sizes.push_back(n);
      mpi_check(MPI_Irecv(target + off, static_cast<int>(n), MPI_BYTE, peer, 2 + 2 * tag, comm,
                          &st.body.back()),
                "rank {}: MPI_Irecv of {} payload bytes from rank {} (tag {})", rank, n, peer, tag);
    }
  }

  bool progress_recv(Request& r) {
    auto* st = static_cast<RecvState*>(r.state.get());
    if (!st->head_done) {
      advance(r.peer, r.tag);
      if (!st->head_done) return false;
    }
    if (st->error) {
      // The payload (if any) drains in the background; the error is this receive's outcome.
      std::rethrow_exception(st->error);
    }
    if (!test_all(st->body, "receive", r.peer, r.tag, &st->body_sizes)) return false;
    std::erase_if(bodies, [&](auto& s) { return s.get() == st; });
    r.header = st->got;
    r.done = true;
    return true;
  }

  bool progress(Request& r) {
    if (!(r.is_recv ? progress_recv(r) : progress_send(r))) return false;
    waits_on.erase(r.peer);  // the peer answered: an older stall report of its is stale
    return true;
  }

  // ---- waiting ----

  std::string attribute(const Request& r, double waited_s) const {
    std::string what =
        r.is_recv
            ? fmt::format("rank {}: no message from rank {} (tag {}, expecting {}) before the "
                          "deadline (waited {:.3g} s)",
                          rank, r.peer, r.tag, r.header.to_string(), waited_s)
            : fmt::format("rank {}: rank {} did not take the message sent with tag {} ({}) "
                          "before the deadline (waited {:.3g} s)",
                          rank, r.peer, r.tag, r.header.to_string(), waited_s);
    std::vector<int> chain{rank, r.peer};
    for (;;) {
      const auto it = waits_on.find(chain.back());
      if (it == waits_on.end() || it->second < 0) break;
      const int next = it->second;
      if (std::find(chain.begin(), chain.end(), next) != chain.end()) {
        std::string cycle;
        const auto from = std::find(chain.begin(), chain.end(), next);
        for (auto c = from; c != chain.end(); ++c) cycle += fmt::format("{} -> ", *c);
        return fmt::format("{}; ranks {}{} wait on each other (a deadlock, no rank stopped)", what,
                           cycle, next);
      }
      what += fmt::format("; rank {} waits on rank {}", chain.back(), next);
      chain.push_back(next);
    }
    return fmt::format("{}; rank {} stopped answering", what, chain.back());
  }

  void wait(Request& r, Deadline deadline) {
    if (r.done) return;
    BRIGADE_CHECK(r.state != nullptr, Errc::InvalidUsage, "rank {}: wait on an empty request",
                  rank);
    const auto start = Clock::now();
    const bool finite = deadline.at != Clock::time_point::max();
    const double timeout_s =
        finite ? std::chrono::duration<double>(deadline.at - start).count() : 8.0;
    const auto grace = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(std::clamp(0.25 * timeout_s, 0.05, 2.0)));
    bool announced = false;
    auto give_up = Clock::time_point::max();
    for (;;) {
      if (progress(r)) return;
      advance_all();
      poll_control();
      throw_if_aborted();
      const auto now = Clock::now();
      if (!announced && now >= deadline.at) {
        // Tell the others whom this rank waits on, then listen for the peer's own report.
        announced = true;
        broadcast(Notice::kStalled, r.peer, {});
        give_up = std::min(give_up, now + grace);
      }
      if (give_up == Clock::time_point::max() && waits_on.count(r.peer) != 0) {
        // The peer itself gave up waiting on someone: its message will not come. Listen a
        // little longer for the rest of the chain.
        give_up = now + grace;
      }
      if (now >= give_up) {
        if (!announced) broadcast(Notice::kStalled, r.peer, {});
        detail::fail(Errc::PeerTimeout, "{}",
                     attribute(r, std::chrono::duration<double>(now - start).count()));
      }
      // Data in flight (payload pieces posted): keep polling closely, MPI may need the calls.
      const bool moving = r.is_recv ? !static_cast<RecvState*>(r.state.get())->body.empty()
                                    : static_cast<SendState*>(r.state.get())->reqs.size() > 1;
      backoff(now - start, moving);
    }
  }

  void barrier(Deadline deadline) {
    // A barrier that timed out stays posted (MPI cannot cancel it); the next call resumes it.
    if (barrier_req == MPI_REQUEST_NULL)
      mpi_check(MPI_Ibarrier(comm, &barrier_req), "rank {}: MPI_Ibarrier", rank);
    const auto start = Clock::now();
    for (;;) {
      int flag = 0;
      mpi_check(MPI_Test(&barrier_req, &flag, MPI_STATUS_IGNORE), "rank {}: MPI_Test of a barrier",
                rank);
      if (flag) return;
      poll_control();
      const auto now = Clock::now();
      if (now >= deadline.at)
        detail::fail(Errc::PeerTimeout,
                     "rank {}: not every rank of {} reached the barrier before the deadline "
                     "({:.3g} s)",
                     rank, size, std::chrono::duration<double>(now - start).count());
      backoff(now - start, false);
    }
  }

  /// Spin briefly (latency), then yield, then sleep (oversubscribed ranks need the core).
  static void backoff(Clock::duration idle, bool moving) {
    if (idle < std::chrono::microseconds(50)) return;
    if (moving || idle < std::chrono::milliseconds(2)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  bool test(Request& r) {
    if (r.done) return true;
    BRIGADE_CHECK(r.state != nullptr, Errc::InvalidUsage, "rank {}: test on an empty request",
                  rank);
    if (progress(r)) return true;
    advance_all();
    poll_control();
    throw_if_aborted();
    return false;
  }
};

MpiTransport::MpiTransport() : impl_(std::make_unique<Impl>(MPI_COMM_WORLD)) {}

MpiTransport::MpiTransport(const void* native_comm) {
  BRIGADE_CHECK(native_comm != nullptr, Errc::InvalidArgument,
                "MpiTransport: native_comm is null; pass the address of an MPI_Comm");
  impl_ = std::make_unique<Impl>(*static_cast<const MPI_Comm*>(native_comm));
}

MpiTransport::~MpiTransport() = default;
MpiTransport::MpiTransport(MpiTransport&& other) noexcept = default;
MpiTransport& MpiTransport::operator=(MpiTransport&& other) noexcept = default;

MpiTransport::Impl& MpiTransport::self() const {
  BRIGADE_CHECK(impl_ != nullptr, Errc::InvalidUsage, "MpiTransport: use of a moved-from transport");
  return *impl_;
}

int MpiTransport::rank() const { return self().rank; }
int MpiTransport::world_size() const { return self().size; }
int MpiTransport::max_tag() const { return self().max_tag; }

Request MpiTransport::isend(int peer, int tag, const MessageHeader& header, ConstBytes payload) {
  return self().isend(peer, tag, header, payload);
}

Request MpiTransport::irecv(int peer, int tag, const MessageHeader& expected, MutableBytes buffer) {
  return self().irecv(peer, tag, expected, buffer);
}

void MpiTransport::wait(Request& r, Deadline deadline) { self().wait(r, deadline); }

void MpiTransport::barrier(Deadline deadline) { self().barrier(deadline); }

bool MpiTransport::test(Request& r) { return self().test(r); }

void MpiTransport::abort(const std::string& reason) noexcept {
  if (impl_ == nullptr || !mpi_usable()) return;
  try {
    impl_->broadcast(Notice::kFailed, -1, reason);
  } catch (...) {
  }
}

}  // namespace v0
}  // namespace brigade::transport

// ---- MpiCollectives ----------------------------------------------------------------------------

namespace brigade::transport {
inline namespace v0 {

namespace {

MPI_Comm& comm_of(void* p) { return *static_cast<MPI_Comm*>(p); }

/// The MPI_Comm of a new MpiCollectives: usable MPI checked, errors returned.
void* new_comm() {
  BRIGADE_CHECK(mpi_usable(), Errc::InvalidUsage,
                "MpiCollectives: MPI is not initialized (create a brigade::transport::MpiSession "
                "first) or was already finalized");
  return new MPI_Comm(MPI_COMM_NULL);
}

}  // namespace

MpiCollectives::MpiCollectives() : comm_(new_comm()) {
  mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &comm_of(comm_)), "MpiCollectives: MPI_Comm_dup");
  mpi_check(MPI_Comm_set_errhandler(comm_of(comm_), MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  mpi_check(MPI_Comm_rank(comm_of(comm_), &rank_), "MPI_Comm_rank");
  mpi_check(MPI_Comm_size(comm_of(comm_), &size_), "MPI_Comm_size");
}

MpiCollectives::MpiCollectives(const void* native_comm) {
  BRIGADE_CHECK(native_comm != nullptr, Errc::InvalidArgument,
                "MpiCollectives: native_comm is null; pass the address of an MPI_Comm");
  comm_ = new_comm();
  mpi_check(MPI_Comm_dup(*static_cast<const MPI_Comm*>(native_comm), &comm_of(comm_)),
            "MpiCollectives: MPI_Comm_dup");
  mpi_check(MPI_Comm_set_errhandler(comm_of(comm_), MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  mpi_check(MPI_Comm_rank(comm_of(comm_), &rank_), "MPI_Comm_rank");
  mpi_check(MPI_Comm_size(comm_of(comm_), &size_), "MPI_Comm_size");
}

MpiCollectives::MpiCollectives(std::span<const int> world_ranks) : comm_(new_comm()) {
  int world = 0, me = 0;
  mpi_check(MPI_Comm_size(MPI_COMM_WORLD, &world), "MPI_Comm_size");
  mpi_check(MPI_Comm_rank(MPI_COMM_WORLD, &me), "MPI_Comm_rank");
  std::vector<int> sorted(world_ranks.begin(), world_ranks.end());
  std::sort(sorted.begin(), sorted.end());
  const auto fail_arg = [&](const std::string& why) {
    delete static_cast<MPI_Comm*>(comm_);
    comm_ = nullptr;
    detail::fail(Errc::InvalidArgument, "MpiCollectives: world rank {}: {}", me, why);
  };
  if (sorted.empty()) fail_arg("an empty group");
  if (sorted.front() < 0 || sorted.back() >= world)
    fail_arg(fmt::format("a group rank outside [0, {})", world));
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
    fail_arg("a group rank listed twice");
  if (!std::binary_search(sorted.begin(), sorted.end(), me))
    fail_arg("this process is not in the group");
  MPI_Group world_group = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
  mpi_check(MPI_Comm_group(MPI_COMM_WORLD, &world_group), "MPI_Comm_group");
  const int rc = MPI_Group_incl(world_group, static_cast<int>(world_ranks.size()),
                                world_ranks.data(), &group);
  MPI_Group_free(&world_group);
  mpi_check(rc, "MPI_Group_incl");
  const int rc2 = MPI_Comm_create_group(MPI_COMM_WORLD, group, 0, &comm_of(comm_));
  MPI_Group_free(&group);
  mpi_check(rc2, "MPI_Comm_create_group");
  mpi_check(MPI_Comm_set_errhandler(comm_of(comm_), MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  mpi_check(MPI_Comm_rank(comm_of(comm_), &rank_), "MPI_Comm_rank");
  mpi_check(MPI_Comm_size(comm_of(comm_), &size_), "MPI_Comm_size");
}

MpiCollectives::~MpiCollectives() {
  if (comm_ == nullptr) return;
  if (!broken_ && mpi_usable() && comm_of(comm_) != MPI_COMM_NULL) MPI_Comm_free(&comm_of(comm_));
  if (!broken_) delete static_cast<MPI_Comm*>(comm_);
  // A broken one keeps its MPI_Comm (and the staging buffer a pending collective may still
  // write, leaked with it) for MPI_Finalize.
}

void MpiCollectives::run(Kind kind, bool is_double, const void* in, std::size_t in_count,
                         void* out, std::size_t out_count, ReduceOp op, int root,
                         Deadline deadline) {
  BRIGADE_CHECK(!broken_, Errc::InvalidUsage,
                "MpiCollectives: member {}: a previous collective timed out; the group is unusable",
                rank_);
  const std::size_t esize = is_double ? sizeof(double) : sizeof(float);
  BRIGADE_CHECK(in_count <= static_cast<std::size_t>(std::numeric_limits<int>::max()) &&
                    out_count <= static_cast<std::size_t>(std::numeric_limits<int>::max()),
                Errc::InvalidArgument, "MpiCollectives: {} elements, at most {}", out_count,
                std::numeric_limits<int>::max());
  const MPI_Datatype type = is_double ? MPI_DOUBLE : MPI_FLOAT;
  // Staging: [out_count] result, then (all-gather) [in_count] input.
  const std::size_t stage_in = kind == Kind::AllGather ? in_count : 0;
  staging_.resize((out_count + stage_in) * esize);
  std::byte* result = staging_.data();
  std::byte* input = staging_.data() + out_count * esize;
  if (kind == Kind::AllGather)
    std::memcpy(input, in, in_count * esize);
  else
    std::memcpy(result, in, out_count * esize);
  MPI_Request req = MPI_REQUEST_NULL;
  const char* what = "";
  switch (kind) {
    case Kind::AllReduce:
      what = "MPI_Iallreduce";
      mpi_check(MPI_Iallreduce(MPI_IN_PLACE, result, static_cast<int>(out_count), type,
                               op == ReduceOp::Sum ? MPI_SUM : MPI_MAX, comm_of(comm_), &req),
                "member {}: MPI_Iallreduce", rank_);
      break;
    case Kind::AllGather:
      what = "MPI_Iallgather";
      mpi_check(MPI_Iallgather(input, static_cast<int>(in_count), type, result,
                               static_cast<int>(in_count), type, comm_of(comm_), &req),
                "member {}: MPI_Iallgather", rank_);
      break;
    case Kind::Broadcast:
      what = "MPI_Ibcast";
      mpi_check(MPI_Ibcast(result, static_cast<int>(out_count), type, root, comm_of(comm_), &req),
                "member {}: MPI_Ibcast", rank_);
      break;
  }
  const auto start = Clock::now();
  for (;;) {
    int flag = 0;
    mpi_check(MPI_Test(&req, &flag, MPI_STATUS_IGNORE), "member {}: MPI_Test of {}", rank_, what);
    if (flag) break;
    const auto now = Clock::now();
    if (now >= deadline.at) {
      broken_ = true;
      new std::vector<std::byte>(std::move(staging_));  // MPI may still write it: never freed
      detail::fail(Errc::PeerTimeout,
                   "member {}: {} over {} members did not complete before the deadline ({:.3g} "
                   "s); MPI does not say which member is missing",
                   rank_, what, size_, std::chrono::duration<double>(now - start).count());
    }
    if (now - start < std::chrono::microseconds(50)) continue;
    if (now - start < std::chrono::milliseconds(2))
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  std::memcpy(out, result, out_count * esize);
}

void MpiCollectives::all_reduce(std::span<float> data, ReduceOp op, Deadline deadline) {
  run(Kind::AllReduce, false, data.data(), data.size(), data.data(), data.size(), op, 0, deadline);
}
void MpiCollectives::all_reduce(std::span<double> data, ReduceOp op, Deadline deadline) {
  run(Kind::AllReduce, true, data.data(), data.size(), data.data(), data.size(), op, 0, deadline);
}

void MpiCollectives::all_gather(std::span<const float> mine, std::span<float> all,
                                Deadline deadline) {
  check_gather_sizes(rank_, size_, mine.size(), all.size());
  run(Kind::AllGather, false, mine.data(), mine.size(), all.data(), all.size(), ReduceOp::Sum, 0,
      deadline);
}
void MpiCollectives::all_gather(std::span<const double> mine, std::span<double> all,
                                Deadline deadline) {
  check_gather_sizes(rank_, size_, mine.size(), all.size());
  run(Kind::AllGather, true, mine.data(), mine.size(), all.data(), all.size(), ReduceOp::Sum, 0,
      deadline);
}
void MpiCollectives::broadcast(std::span<float> data, int root, Deadline deadline) {
  check_root(rank_, size_, root);
  run(Kind::Broadcast, false, data.data(), data.size(), data.data(), data.size(), ReduceOp::Sum,
      root, deadline);
}
void MpiCollectives::broadcast(std::span<double> data, int root, Deadline deadline) {
  check_root(rank_, size_, root);
  run(Kind::Broadcast, true, data.data(), data.size(), data.data(), data.size(), ReduceOp::Sum,
      root, deadline);
}

}  // namespace v0
}  // namespace brigade::transport
