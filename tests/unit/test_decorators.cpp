// transport/decorators.hpp over InProcessTransport: tracing per kind and peer, inspection of
// received payloads (accept, drop, reject), their argument checks, and engine::run_ranks (the
// public thread driver) with and without the optional abort. Fault injection and the SENTINEL
// verifier are in test_verify.cpp; the end-to-end case (a flipped bit in one stories260K
// activation) is in tests/model/test_generate_on.cpp and tests/mpi/.
#include <brigade/engine/threads.hpp>
#include <brigade/transport/decorators.hpp>
#include <brigade/transport/in_process.hpp>

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <cstdint>
#include <cstring>
#include <vector>

using namespace brigade;
using namespace brigade::transport;
using test::error_of;

namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

ConstBytes cbytes(const std::vector<float>& v) { return as_bytes(std::span<const float>(v)); }
MutableBytes mbytes(std::vector<float>& v) { return as_writable_bytes(std::span<float>(v)); }

MessageHeader act(std::int64_t mb, std::int64_t n, std::int64_t chunk = 0) {
  return MessageHeader::make(mb, 1, DType::F32, {n}, chunk, MessageKind::Activation);
}

/// A Transport without abort (the optional part), over an InProcessTransport.
class NoAbort {
 public:
  explicit NoAbort(InProcessTransport t) : t_(t) {}
  [[nodiscard]] int rank() const { return t_.rank(); }
  [[nodiscard]] int world_size() const { return t_.world_size(); }
  Request isend(int p, int tag, const MessageHeader& h, ConstBytes b) { return t_.isend(p, tag, h, b); }
  Request irecv(int p, int tag, const MessageHeader& h, MutableBytes b) { return t_.irecv(p, tag, h, b); }
  void wait(Request& r, Deadline d) { t_.wait(r, d); }
  bool test(Request& r) { return t_.test(r); }

 private:
  InProcessTransport t_;
};

}  // namespace

// Decorators model the concept, and the optional abort exactly when their inner transport does.
static_assert(AbortableTransport<TracingTransport<InProcessTransport>>);
static_assert(AbortableTransport<InspectingTransport<TracingTransport<InProcessTransport>>>);
static_assert(Transport<TracingTransport<NoAbort>> && !AbortableTransport<TracingTransport<NoAbort>>);

TEST_CASE("transport.decorators: tracing counts messages and payload bytes per kind and peer") {
  InProcessFabric fabric(3);
  InProcessTransport t0(fabric, 0), t1(fabric, 1), t2(fabric, 2);
  TracingTransport s(t0), r(t1);
  const std::vector<float> a(4, 1.0f), g(6, 2.0f);
  std::vector<float> in(6);
  std::vector<Request> sends{s.isend(1, 0, act(0, 4), cbytes(a)), s.isend(1, 0, act(1, 4), cbytes(a)),
                             s.isend(2, 1, MessageHeader::make(0, 0, DType::F32, {6}, 0,
                                                               MessageKind::Gradient),
                                     cbytes(g))};
  for (int mb = 0; mb < 2; ++mb) {
    auto q = r.irecv(0, 0, act(mb, 4), mbytes(in));
    if (mb == 0)
      r.wait(q, Deadline::after(10));
    else
      CHECK(r.test(q));  // already there: test completes and counts it
  }
  for (auto& q : sends) s.wait(q, Deadline::after(10));
  CHECK(s.sent(MessageKind::Activation, 1).messages == 2);
  CHECK(s.sent(MessageKind::Activation, 1).bytes == 32);
  CHECK(s.sent(MessageKind::Gradient, 2).bytes == 24);
  CHECK(s.sent(MessageKind::Gradient, 1).messages == 0);
  CHECK(s.sent(MessageKind::Activation).bytes == 32);
  CHECK(s.sent(MessageKind::Gradient).messages == 1);
  CHECK(r.received(MessageKind::Activation, 0).messages == 2);
  CHECK(r.received(MessageKind::Activation, 0).bytes == 32);
  CHECK(r.received(MessageKind::Activation, 0).wait_s >= 0.0);
  CHECK(r.received(MessageKind::Token).messages == 0);
  const auto msg = error_of(Errc::InvalidArgument, [&] { (void)s.sent(MessageKind::Control, 3); });
  CHECK(contains(msg, "peer 3 outside [0, 3)"));
}

TEST_CASE("transport.decorators: inspection sees received payloads of its kinds before the "
          "caller, Drop flags the header, Reject names the receiving and sending ranks, the kind "
          "and the micro-batch") {
  InProcessFabric fabric(2);
  InProcessTransport t0(fabric, 0), t1(fabric, 1);
  std::vector<std::int64_t> seen;
  InspectingTransport in(t1, {MessageKind::Activation, MessageKind::Gradient},
                         [&](const MessageHeader& h, int from, ConstBytes p) -> CheckResult {
                           CHECK(from == 0);
                           seen.push_back(h.microbatch);
                           float first = 0.0f;
                           std::memcpy(&first, p.data(), sizeof first);
                           if (first > 100.0f) return {Verdict::Reject, fmt::format("first value {}", first)};
                           if (first < 0.0f) return {Verdict::Drop, "negative"};
                           return {};
                         });
  CHECK(in.inspects(MessageKind::Activation));
  CHECK(in.inspects(MessageKind::Gradient));
  CHECK_FALSE(in.inspects(MessageKind::Token));
  const std::vector<float> ok{1, 2}, bad{1000, 2}, neg{-1, 2};
  const auto grad = MessageHeader::make(5, 0, DType::F32, {2}, 0, MessageKind::Gradient);
  std::vector<float> dst(2);
  auto s1 = t0.isend(1, 7, act(3, 2, 2), cbytes(ok));
  auto s2 = t0.isend(1, 7, act(4, 2, 2), cbytes(bad));
  auto s3 = t0.isend(1, 8, MessageHeader::make(4, 1, DType::F32, {2}), cbytes(bad));  // control
  auto s4 = t0.isend(1, 9, grad, cbytes(neg));
  auto r1 = in.irecv(0, 7, act(kAny, 2, 2), mbytes(dst));
  CHECK(in.test(r1));
  CHECK(r1.done);
  CHECK(r1.header.microbatch == 3);
  CHECK(r1.header.flags == 0u);
  CHECK(dst == ok);
  auto r2 = in.irecv(0, 7, act(kAny, 2, 2), mbytes(dst));
  const auto msg = error_of(Errc::Rejected, [&] { in.wait(r2, Deadline::after(10)); });
  CHECK(msg == "rank 1: rejected the activation message from rank 0 for micro-batch 4 (stage 1, "
               "chunk 2, tag 7): first value 1000");
  auto r3 = in.irecv(0, 8, MessageHeader::make(4, 1, DType::F32, {2}), mbytes(dst));
  in.wait(r3, Deadline::after(10));  // not inspected: another kind
  auto r4 = in.irecv(0, 9, grad, mbytes(dst));
  in.wait(r4, Deadline::after(10));
  CHECK(r4.header.flags == kFlagDropped);  // Drop: delivered, flagged for the engine
  CHECK(r4.header.microbatch == 5);
  CHECK(dst == neg);
  CHECK(seen == std::vector<std::int64_t>{3, 4, 5});
  CHECK(in.inspected() == 3);
  CHECK(in.dropped() == 1);
  for (auto* r : {&s1, &s2, &s3, &s4}) t0.wait(*r, Deadline::after(10));
  CHECK(contains(error_of(Errc::InvalidArgument, [&] { InspectingTransport e(t1, MessageKind::KV, {}); }),
                       "an empty check"));
  // An empty list of kinds inspects nothing: the decorator only forwards.
  InspectingTransport none(t1, std::vector<MessageKind>{},
                           [](const MessageHeader&, int, ConstBytes) {
                             return CheckResult{Verdict::Reject, "never called"};
                           });
  CHECK_FALSE(none.inspects(MessageKind::Activation));
  auto s5 = t0.isend(1, 7, act(6, 2, 2), cbytes(bad));
  auto r5 = none.irecv(0, 7, act(kAny, 2, 2), mbytes(dst));
  none.wait(r5, Deadline::after(10));
  t0.wait(s5, Deadline::after(10));
  CHECK(dst == bad);
  CHECK(none.inspected() == 0);
}

TEST_CASE("engine.run_ranks: a failed rank aborts the others through the transport, without "
          "abort they stop at their deadline, the root cause is rethrown") {
  InProcessFabric fabric(3);
  auto eps = endpoints(fabric);
  std::vector<Errc> codes(3, Errc::Internal);
  auto body = [&](auto& t) {
    try {
      if (t.rank() == 1) brigade::detail::fail(Errc::BadFile, "rank 1's own failure");
      std::vector<float> dst(1);
      auto r = t.irecv(1, 0, MessageHeader::make(0, 0, DType::F32, {1}), mbytes(dst));
      t.wait(r, Deadline::after(t.rank() == 0 ? 60.0 : 0.3));
    } catch (const Error& e) {
      codes[static_cast<std::size_t>(t.rank())] = e.code();
      throw;
    }
  };
  SUBCASE("abortable: the waiting ranks wake with Aborted at once") {
    CHECK(contains(error_of(Errc::BadFile, [&] { engine::run_ranks(std::span(eps), body); }),
                         "rank 1's own failure"));
    CHECK(codes == std::vector<Errc>{Errc::Aborted, Errc::BadFile, Errc::Aborted});
  }
  SUBCASE("without abort: the waiting ranks stop at their own deadlines (PeerTimeout)") {
    std::vector<NoAbort> plain;
    for (auto& e : eps) plain.emplace_back(e);
    auto short_body = [&](NoAbort& t) {
      try {
        if (t.rank() == 1) brigade::detail::fail(Errc::BadFile, "rank 1's own failure");
        std::vector<float> dst(1);
        auto r = t.irecv(1, 0, MessageHeader::make(0, 0, DType::F32, {1}), mbytes(dst));
        t.wait(r, Deadline::after(0.3));
      } catch (const Error& e) {
        codes[static_cast<std::size_t>(t.rank())] = e.code();
        throw;
      }
    };
    CHECK(contains(error_of(Errc::BadFile, [&] { engine::run_ranks(std::span(plain), short_body); }),
                         "rank 1's own failure"));
    CHECK(codes == std::vector<Errc>{Errc::PeerTimeout, Errc::BadFile, Errc::PeerTimeout});
    CHECK_FALSE(fabric.aborted());
  }
}
