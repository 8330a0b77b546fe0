// The Transport concept: non-blocking point-to-point messages between ranks, with a checked
// header (what the message is, for which micro-batch and stage, dtype and shape) and deadlines.
// Models: InProcessTransport (threads); MpiTransport and NcclTransport in their own components;
// decorators over any model in transport/decorators.hpp.
#pragma once

#include "brigade/core/dtype.hpp"
#include "brigade/core/error.hpp"

#include <array>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace brigade::transport {
inline namespace v0 {

/// What a message carries, so that decorators (tracing, fault injection, integrity checks) can
/// select messages without knowing an engine's tag numbers. Every engine's send path sets it;
/// a receive expects one kind and check_header rejects another.
enum class MessageKind : std::int32_t {
  Control = 0,     ///< protocol traffic: clock starts, descriptors, sizes, gathered timelines
  Activation = 1,  ///< a stage's forward output (hidden states) sent to the next stage
  Gradient = 2,    ///< a gradient: d loss / d activation sent backward, or a parameter gradient
  Token = 3,       ///< sampled token ids sent back to the first stage
  KV = 4,          ///< key/value cache entries moved between ranks
  Weights = 5,     ///< parameters or optimizer state (loading, gathering a checkpoint)
};
/// Number of MessageKind values.
inline constexpr int kNumMessageKinds = 6;

/// Name of a message kind ("control", "activation", "gradient", "token", "kv", "weights").
constexpr const char* to_string(MessageKind k) noexcept {
  switch (k) {
    case MessageKind::Control: return "control";
    case MessageKind::Activation: return "activation";
    case MessageKind::Gradient: return "gradient";
    case MessageKind::Token: return "token";
    case MessageKind::KV: return "kv";
    case MessageKind::Weights: return "weights";
  }
  return "unknown";
}

/// Wildcard value for MessageHeader fields in an expected (receive-side) header.
inline constexpr std::int64_t kAny = -1;

/// Bit of MessageHeader::flags: the micro-batch this message belongs to was flagged by an
/// integrity check (transport/verify.hpp) on some rank this step; every rank that sees it drops
/// the micro-batch's contribution (its weight gradients and its loss) and sets the bit on what it
/// sends for that micro-batch, so the verdict travels with the micro-batch through the pipeline.
inline constexpr std::uint32_t kFlagDropped = 1u << 0;
/// Bit of MessageHeader::flags: the payload was corrupted by FaultInjectingTransport
/// (transport/faults.hpp). The ground truth of fault-injection experiments, so that a receiving
/// rank (in another process) can tell which of its verdicts were right; no check reads it.
inline constexpr std::uint32_t kFlagInjected = 1u << 1;

/// The header every message carries and every receive checks: the kind, micro-batch, the
/// destination stage, the chunk, dtype and shape (up to 4 dims, row-major). On the receive side,
/// microbatch, stage, chunk or any shape dimension may be kAny to accept whatever arrives (the
/// received header is then in the request's `header`); the kind must match exactly.
struct MessageHeader {
  MessageKind kind = MessageKind::Control;  ///< what the payload is
  std::int64_t microbatch = 0;            ///< micro-batch id, or kAny
  std::int64_t stage = 0;                 ///< stage (virtual stage) the message is for, or kAny
  /// Chunk of the receiving action (schedule::Action::chunk: the PACS/InfiniPipe chunk in
  /// training, the round in inference), or kAny.
  std::int64_t chunk = 0;
  DType dtype = DType::F32;               ///< element type
  std::int32_t ndim = 0;                  ///< number of dimensions in `shape`
  std::array<std::int64_t, 4> shape{};    ///< sizes, outermost first; kAny allowed when receiving
  /// Bits set by the sender (kFlagDropped); not compared by check_header: a receive cannot expect
  /// them, it reads them in the header that arrived.
  std::uint32_t flags = 0;

  /// A header for a payload of the given dims, for the receiving action's chunk `chunk`.
  /// @throws brigade::Error{InvalidArgument} for more than 4 dims
  static MessageHeader make(std::int64_t microbatch, std::int64_t stage, DType dtype,
                            std::initializer_list<std::int64_t> dims, std::int64_t chunk = 0,
                            MessageKind kind = MessageKind::Control) {
    MessageHeader h;
    h.kind = kind;
    h.microbatch = microbatch;
    h.stage = stage;
    h.chunk = chunk;
    h.dtype = dtype;
    BRIGADE_CHECK(dims.size() <= 4, Errc::InvalidArgument, "MessageHeader: {} dims, at most 4",
                  dims.size());
    h.ndim = static_cast<std::int32_t>(dims.size());
    std::size_t i = 0;
    for (auto d : dims) h.shape[i++] = d;
    return h;
  }
  /// Elements described by the shape (wildcards count as 0).
  [[nodiscard]] std::int64_t numel() const noexcept {
    std::int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[static_cast<std::size_t>(i)] < 0 ? 0 : shape[static_cast<std::size_t>(i)];
    return n;
  }
  /// Payload bytes described by the header.
  [[nodiscard]] std::size_t nbytes() const noexcept {
    return static_cast<std::size_t>(numel() / dtype_block_elements(dtype)) *
           dtype_block_bytes(dtype);
  }
  /// Readable form: "activation mb 3 stage 1 f32[512, 64]", with " chunk c" after the stage
  /// when c != 0 and " (dropped)" at the end when kFlagDropped is set.
  [[nodiscard]] std::string to_string() const {
    std::string s = fmt::format("{} mb {} stage {}{} {}[", transport::to_string(kind), microbatch,
                                stage,
                                chunk != 0 ? fmt::format(" chunk {}", chunk) : std::string(),
                                brigade::to_string(dtype));
    for (int i = 0; i < ndim; ++i) s += fmt::format("{}{}", i ? ", " : "", shape[static_cast<std::size_t>(i)]);
    return s + ((flags & kFlagDropped) != 0 ? "] (dropped)" : "]");
  }
  friend bool operator==(const MessageHeader&, const MessageHeader&) = default;
};

/// Whether a received header matches the expected one: the same kind, and every field and
/// shape entry equal where `expected` is not kAny (flags are not compared). check_header's test,
/// without the error.
inline bool header_matches(const MessageHeader& expected, const MessageHeader& got) noexcept {
  auto same = [](std::int64_t e, std::int64_t g) { return e == kAny || e == g; };
  if (expected.kind != got.kind || !same(expected.microbatch, got.microbatch) ||
      !same(expected.stage, got.stage) || !same(expected.chunk, got.chunk) ||
      !same(static_cast<std::int64_t>(expected.dtype), static_cast<std::int64_t>(got.dtype)) ||
      !same(expected.ndim, got.ndim))
    return false;
  for (int i = 0; i < expected.ndim && i < 4; ++i)
    if (!same(expected.shape[static_cast<std::size_t>(i)], got.shape[static_cast<std::size_t>(i)]))
      return false;
  return true;
}

/// Checks a received header against the expected one (kAny fields match anything; flags are
/// not compared).
/// @throws brigade::Error{HeaderMismatch} naming the peer, the field, the value seen and the value
///         expected
inline void check_header(const MessageHeader& expected, const MessageHeader& got, int self,
                         int peer, int tag) {
  if (header_matches(expected, got)) return;
  auto field = [&](const char* name, std::int64_t e, std::int64_t g) {
    BRIGADE_CHECK(e == kAny || e == g, Errc::HeaderMismatch,
                  "rank {}: message from rank {} (tag {}) has {} = {}, expected {} (received {}, "
                  "expected {})",
                  self, peer, tag, name, g, e, got.to_string(), expected.to_string());
  };
  BRIGADE_CHECK(expected.kind == got.kind, Errc::HeaderMismatch,
                "rank {}: message from rank {} (tag {}) has kind {}, expected {} (received "
                "{}, expected {})",
                self, peer, tag, transport::to_string(got.kind),
                transport::to_string(expected.kind), got.to_string(), expected.to_string());
  field("microbatch", expected.microbatch, got.microbatch);
  field("stage", expected.stage, got.stage);
  field("chunk", expected.chunk, got.chunk);
  field("dtype", static_cast<std::int64_t>(expected.dtype), static_cast<std::int64_t>(got.dtype));
  field("ndim", expected.ndim, got.ndim);
  for (int i = 0; i < expected.ndim; ++i) {
    const auto ui = static_cast<std::size_t>(i);
    BRIGADE_CHECK(expected.shape[ui] == kAny || expected.shape[ui] == got.shape[ui],
                  Errc::HeaderMismatch,
                  "rank {}: message from rank {} (tag {}) has shape[{}] = {}, expected {} "
                  "(received {}, expected {})",
                  self, peer, tag, i, got.shape[ui], expected.shape[ui], got.to_string(),
                  expected.to_string());
  }
}

/// Read-only payload bytes.
using ConstBytes = std::span<const std::byte>;
/// Writable payload bytes (a receive buffer; may be larger than the message).
using MutableBytes = std::span<std::byte>;

/// When a wait gives up.
struct Deadline {
  using Clock = std::chrono::steady_clock;
  Clock::time_point at = Clock::time_point::max();

  /// `seconds` from now.
  static Deadline after(double seconds) {
    Deadline d;
    d.at = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(seconds));
    return d;
  }
  /// Never: wait forever (use only where a peer cannot fail).
  static Deadline never() { return Deadline{}; }
};

/// A handle on one posted send or receive. Opaque to users; each transport keeps its own state
/// behind `state`. After a successful wait (or a test that returned true) `done` is true and,
/// for a receive, `header` holds the header that arrived.
struct Request {
  bool done = false;                 ///< completed (and, for a receive, checked and copied)
  bool is_recv = false;              ///< a receive (true) or a send (false)
  int peer = -1;                     ///< the other rank
  int tag = 0;                       ///< the tag it was posted with
  MessageHeader header;              ///< expected header (receive) or sent header (send)
  std::shared_ptr<void> state;       ///< transport-specific state

  /// A posted send (`is_recv` false) or receive: how every transport builds its handles.
  static Request posted(bool is_recv, int peer, int tag, const MessageHeader& header,
                        std::shared_ptr<void> state = {}) {
    Request r;
    r.is_recv = is_recv;
    r.peer = peer;
    r.tag = tag;
    r.header = header;
    r.state = std::move(state);
    return r;
  }
};

/// Non-blocking point-to-point transport between the ranks of one pipeline.
///
/// Pairing and ordering rules, for every model: a message sent by rank a to rank b with tag t
/// is received by the receive rank b posts for (a, t); messages between the same (a, b, t) are
/// received in the order they were sent, by receives in the order they were posted. A send
/// buffer may be reused as soon as the send's wait returns. The receive checks the arriving
/// header against the expected one (check_header) and throws HeaderMismatch on a difference;
/// a wait that passes its deadline throws PeerTimeout naming the peer.
///
/// The members, each of which the engines call:
/// - `rank()`, `world_size()`: this endpoint's rank in [0, world_size()) and the number of ranks;
/// - `isend(peer, tag, header, payload)`: posts a send of exactly header.nbytes() bytes (the
///   payload must stay valid until the send's wait returns);
/// - `irecv(peer, tag, expected, buffer)`: posts a receive into `buffer` (at least as large as
///   the message);
/// - `wait(request, deadline)`: completes a request or throws;
/// - `test(request)`: completes a request if it can without blocking (the executor's send
///   window retires completed sends with it).
/// Batched posting is not part of the concept: every model posts without blocking, so a batch is
/// a loop of isend / irecv (NcclTransport groups whatever is queued at its next flush, wait or
/// test, as NCCL needs a send and a receive to the same peer in one group).
///
/// The optional part is `abort` (concept AbortableTransport).
template <class T>
concept Transport = requires(T& t, const T& ct, const MessageHeader& h, ConstBytes src,
                             MutableBytes dst, Request& r, Deadline d) {
  { ct.rank() } -> std::same_as<int>;
  { ct.world_size() } -> std::same_as<int>;
  { t.isend(0, 0, h, src) } -> std::same_as<Request>;
  { t.irecv(0, 0, h, dst) } -> std::same_as<Request>;
  { t.wait(r, d) } -> std::same_as<void>;
  { t.test(r) } -> std::same_as<bool>;
};

/// A Transport with the optional `abort(reason)`: called by a rank that failed, it makes the
/// pending and later waits of every other rank of the world throw Error{Aborted} quoting
/// `reason`, so they stop at once instead of at their deadlines. Best effort, never blocks, never
/// throws; a transport may ignore later calls after the first. Engines (generate_on,
/// train_on, engine::run_ranks) call it when they fail with an error that is not itself a
/// PeerTimeout or an Aborted; a Transport without it makes the other ranks stop at their
/// deadlines (PeerTimeout) instead.
template <class T>
concept AbortableTransport =
    Transport<T> && requires(T& t, const std::string& reason) { t.abort(reason); };

/// What an engine does when this rank fails with `e`: when `e` is the rank's own failure (not a
/// PeerTimeout or an Aborted, which are another rank's failure already announced) and T has
/// `abort`, calls `t.abort("rank R failed: <what>")` so the other ranks stop. Never throws.
template <Transport T>
void abort_others(T& t, const std::exception& e) noexcept {
  if constexpr (AbortableTransport<T>) {
    const auto* err = dynamic_cast<const Error*>(&e);
    if (err != nullptr && (err->code() == Errc::PeerTimeout || err->code() == Errc::Aborted))
      return;
    try {
      t.abort(fmt::format("rank {} failed: {}", t.rank(), e.what()));
    } catch (...) {  // abort is documented never to throw; formatting might
    }
  } else {
    (void)t;
    (void)e;
  }
}

/// The bytes of a contiguous span of trivially copyable values.
template <class V>
ConstBytes as_bytes(std::span<const V> v) noexcept {
  return std::as_bytes(v);
}
/// The writable bytes of a contiguous span of trivially copyable values.
template <class V>
MutableBytes as_writable_bytes(std::span<V> v) noexcept {
  return std::as_writable_bytes(v);
}

}  // namespace v0
}  // namespace brigade::transport
