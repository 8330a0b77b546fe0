// Transport conformance: one set of doctest cases, templated over a driver that runs per-rank
// programs on some Transport model.
//
// A program is `template <Transport T> void name(T& t, int world)`: rank t.rank()'s side of one
// exchange among ranks [0, world). A driver is a type with
//   `template <class Program> static void run(int world, Program program)`
// that calls `program(t, w)` on every rank of a world of w ranks (w = world, or fewer where the
// driver has fewer ranks, never fewer than 2) and rethrows the first failure:
//   - InProcessDriver (below): w threads over one InProcessFabric;
//   - MpiDriver (tests/mpi/test_mpi_transport.cpp): the process's own rank under mpirun.
// A test binary includes this header once and writes BRIGADE_TRANSPORT_CONFORMANCE(Driver).
#pragma once

#include <brigade/engine/threads.hpp>
#include <brigade/transport/in_process.hpp>
#include <brigade/transport/transport.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

namespace conformance {

using namespace brigade;
using namespace brigade::transport;

template <class V>
ConstBytes cbytes(const std::vector<V>& v) {
  return as_bytes(std::span<const V>(v));
}
template <class V>
MutableBytes mbytes(std::vector<V>& v) {
  return as_writable_bytes(std::span<V>(v));
}

/// Calls `f` and returns the brigade::Error it throws (FAIL if it throws none).
template <class F>
Error error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  FAIL("no brigade::Error was thrown");
  return Error(Errc::Internal, "unreachable");
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// ---- per-rank programs ----------------------------------------------------------------------

/// Rank 0 sends 100 floats with a [10, 10] header on tag 7, flagged kFlagDropped; rank 1,
/// expecting no flags (a receive does not compare them), gets the bytes and the header, flags
/// included.
template <Transport T>
void pairing(T& t, int /*world*/) {
  std::vector<float> src(100);
  std::iota(src.begin(), src.end(), 0.5f);
  auto h = MessageHeader::make(3, 1, DType::F32, {10, 10}, 0, MessageKind::Activation);
  h.flags = kFlagDropped;
  if (t.rank() == 0) {
    auto s = t.isend(1, 7, h, cbytes(src));
    t.wait(s, Deadline::after(10));
    CHECK(s.done);
  } else if (t.rank() == 1) {
    std::vector<float> dst(100, -1.0f);
    auto expected = h;
    expected.flags = 0;
    auto r = t.irecv(0, 7, expected, mbytes(dst));
    t.wait(r, Deadline::after(10));
    CHECK(r.done);
    CHECK(r.header == h);
    CHECK(r.header.flags == kFlagDropped);
    CHECK(dst == src);
  }
}

/// Three messages on each of tags 1 and 2, interleaved; rank 1 drains tag 2 first (not blocked
/// behind tag 1), with a kAny micro-batch, then tag 1: each tag keeps its own order.
template <Transport T>
void ordering(T& t, int /*world*/) {
  if (t.rank() == 0) {
    std::vector<std::vector<std::int32_t>> bufs;
    for (int i = 0; i < 3; ++i) {
      bufs.push_back({i});
      bufs.push_back({100 + i});
    }
    std::vector<Request> sent;
    for (int i = 0; i < 3; ++i) {
      const auto ui = static_cast<std::size_t>(i);
      sent.push_back(t.isend(1, 1, MessageHeader::make(i, 1, DType::I32, {1}), cbytes(bufs[2 * ui])));
      sent.push_back(
          t.isend(1, 2, MessageHeader::make(i, 1, DType::I32, {1}), cbytes(bufs[2 * ui + 1])));
    }
    for (auto& s : sent) t.wait(s, Deadline::after(10));
  } else if (t.rank() == 1) {
    for (int i = 0; i < 3; ++i) {
      std::vector<std::int32_t> got(1);
      auto r = t.irecv(0, 2, MessageHeader::make(kAny, 1, DType::I32, {1}), mbytes(got));
      t.wait(r, Deadline::after(10));
      CHECK(got[0] == 100 + i);
      CHECK(r.header.microbatch == i);
    }
    for (int i = 0; i < 3; ++i) {
      std::vector<std::int32_t> got(1);
      auto r = t.irecv(0, 1, MessageHeader::make(i, 1, DType::I32, {1}), mbytes(got));
      t.wait(r, Deadline::after(10));
      CHECK(got[0] == i);
    }
  }
}

/// Two receives posted on one (peer, tag) and waited in reverse order take the messages in
/// posting order. Also for payloads above any inline threshold (256 KiB).
template <Transport T>
void posting_order(T& t, int /*world*/) {
  const std::int64_t big = 64 * 1024;  // floats: 256 KiB
  if (t.rank() == 0) {
    std::vector<std::int32_t> first{11}, second{22};
    std::vector<float> third(static_cast<std::size_t>(big), 3.0f), fourth(static_cast<std::size_t>(big), 4.0f);
    std::vector<Request> sent;
    sent.push_back(t.isend(1, 0, MessageHeader::make(0, 1, DType::I32, {1}), cbytes(first)));
    sent.push_back(t.isend(1, 0, MessageHeader::make(1, 1, DType::I32, {1}), cbytes(second)));
    sent.push_back(t.isend(1, 3, MessageHeader::make(2, 1, DType::F32, {big}), cbytes(third)));
    sent.push_back(t.isend(1, 3, MessageHeader::make(3, 1, DType::F32, {big}), cbytes(fourth)));
    for (auto& s : sent) t.wait(s, Deadline::after(10));
  } else if (t.rank() == 1) {
    std::vector<std::int32_t> a(1), b(1);
    auto ra = t.irecv(0, 0, MessageHeader::make(kAny, 1, DType::I32, {1}), mbytes(a));
    auto rb = t.irecv(0, 0, MessageHeader::make(kAny, 1, DType::I32, {1}), mbytes(b));
    t.wait(rb, Deadline::after(10));
    t.wait(ra, Deadline::after(10));
    CHECK(a[0] == 11);
    CHECK(b[0] == 22);
    CHECK(ra.header.microbatch == 0);
    CHECK(rb.header.microbatch == 1);
    std::vector<float> c(static_cast<std::size_t>(big)), d(static_cast<std::size_t>(big));
    auto rc = t.irecv(0, 3, MessageHeader::make(kAny, 1, DType::F32, {kAny}), mbytes(c));
    auto rd = t.irecv(0, 3, MessageHeader::make(kAny, 1, DType::F32, {kAny}), mbytes(d));
    t.wait(rd, Deadline::after(10));
    t.wait(rc, Deadline::after(10));
    CHECK(rc.header.microbatch == 2);
    CHECK(rd.header.microbatch == 3);
    CHECK(c.front() == 3.0f);
    CHECK(c.back() == 3.0f);
    CHECK(d.front() == 4.0f);
    CHECK(d.back() == 4.0f);
  }
}

/// Mismatched micro-batch, shape, chunk, and a buffer too small are HeaderMismatch errors naming the
/// field, the value seen and the value expected; each rejected message is consumed, so the next
/// receive on the channel gets the next message (small and large payloads alike).
template <Transport T>
void header_mismatch(T& t, int /*world*/) {
  const std::int64_t big = 256 * 1024;  // floats: 1 MiB
  if (t.rank() == 0) {
    std::vector<float> v(6, 1.0f), ok{1, 2, 3, 4, 5, 6};
    std::vector<float> large(static_cast<std::size_t>(big), 7.0f);
    std::vector<float> large_ok(static_cast<std::size_t>(big), 8.0f);
    const auto h = MessageHeader::make(0, 1, DType::F32, {2, 3});
    std::vector<Request> sent;
    for (int i = 0; i < 3; ++i) sent.push_back(t.isend(1, 0, h, cbytes(v)));
    sent.push_back(t.isend(1, 0, MessageHeader::make(0, 1, DType::F32, {2, 3}, 2), cbytes(v)));
    sent.push_back(t.isend(
        1, 0, MessageHeader::make(0, 1, DType::F32, {2, 3}, 0, MessageKind::Activation), cbytes(v)));
    sent.push_back(t.isend(
        1, 0, MessageHeader::make(9, 1, DType::F32, {2, 3}, 5, MessageKind::Gradient), cbytes(ok)));
    sent.push_back(t.isend(1, 4, MessageHeader::make(0, 1, DType::F32, {big}), cbytes(large)));
    sent.push_back(t.isend(1, 4, MessageHeader::make(1, 1, DType::F32, {big}), cbytes(large_ok)));
    for (auto& s : sent) t.wait(s, Deadline::after(10));
  } else if (t.rank() == 1) {
    std::vector<float> dst(6);
    {
      auto r = t.irecv(0, 0, MessageHeader::make(1, 1, DType::F32, {2, 3}), mbytes(dst));
      const auto e = error_of([&] { t.wait(r, Deadline::after(10)); });
      CHECK(e.code() == Errc::HeaderMismatch);
      CHECK(contains(e.what(), "microbatch = 0, expected 1"));
      CHECK(contains(e.what(), "from rank 0"));
    }
    {
      auto r = t.irecv(0, 0, MessageHeader::make(0, 1, DType::F32, {3, 2}), mbytes(dst));
      const auto e = error_of([&] { t.wait(r, Deadline::after(10)); });
      CHECK(e.code() == Errc::HeaderMismatch);
      CHECK(contains(e.what(), "shape[0] = 2, expected 3"));
    }
    {
      std::vector<float> small(5);
      auto r = t.irecv(0, 0, MessageHeader::make(0, 1, DType::F32, {kAny, 3}), mbytes(small));
      const auto e = error_of([&] { t.wait(r, Deadline::after(10)); });
      CHECK(e.code() == Errc::HeaderMismatch);
      CHECK(contains(e.what(), "has 24 bytes, the receive buffer holds 20"));
    }
    {
      auto r = t.irecv(0, 0, MessageHeader::make(0, 1, DType::F32, {2, 3}, 1), mbytes(dst));
      const auto e = error_of([&] { t.wait(r, Deadline::after(10)); });
      CHECK(e.code() == Errc::HeaderMismatch);
      CHECK(contains(e.what(), "chunk = 2, expected 1"));
    }
    {
      auto r = t.irecv(0, 0, MessageHeader::make(0, 1, DType::F32, {2, 3}, 0, MessageKind::Gradient),
                       mbytes(dst));
      const auto e = error_of([&] { t.wait(r, Deadline::after(10)); });
      CHECK(e.code() == Errc::HeaderMismatch);
      CHECK(contains(e.what(), "has kind activation, expected gradient"));
    }
    {
      auto r = t.irecv(0, 0, MessageHeader::make(9, 1, DType::F32, {2, 3}, 5, MessageKind::Gradient),
                       mbytes(dst));
      t.wait(r, Deadline::after(10));
      CHECK(dst == std::vector<float>{1, 2, 3, 4, 5, 6});
      CHECK(r.header.chunk == 5);
      CHECK(r.header.kind == MessageKind::Gradient);
    }
    std::vector<float> large(static_cast<std::size_t>(big), -1.0f);
    {
      auto r = t.irecv(0, 4, MessageHeader::make(1, 1, DType::F32, {big}), mbytes(large));
      const auto e = error_of([&] { t.wait(r, Deadline::after(10)); });
      CHECK(e.code() == Errc::HeaderMismatch);
      CHECK(contains(e.what(), "microbatch = 0, expected 1"));
    }
    {
      auto r = t.irecv(0, 4, MessageHeader::make(1, 1, DType::F32, {big}), mbytes(large));
      t.wait(r, Deadline::after(10));
      CHECK(large.front() == 8.0f);
      CHECK(large.back() == 8.0f);
    }
  }
}

/// A 64 MiB message arrives intact, then a zero-byte message with a [0] shape.
template <Transport T>
void large_and_empty(T& t, int /*world*/) {
  const std::size_t n = (64u << 20) / sizeof(float);
  const auto hn = MessageHeader::make(0, 1, DType::F32, {static_cast<std::int64_t>(n)});
  const auto h0 = MessageHeader::make(1, 1, DType::F32, {0});
  auto fill = [&](std::vector<float>& v) {
    for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i % 9973);
  };
  if (t.rank() == 0) {
    std::vector<float> big(n);
    fill(big);
    auto s = t.isend(1, 0, hn, cbytes(big));
    std::vector<float> none;
    auto z = t.isend(1, 0, h0, cbytes(none));
    t.wait(s, Deadline::after(60));
    t.wait(z, Deadline::after(60));
  } else if (t.rank() == 1) {
    std::vector<float> dst(n, -1.0f);
    auto r = t.irecv(0, 0, hn, mbytes(dst));
    std::vector<float> empty;
    auto rz = t.irecv(0, 0, h0, mbytes(empty));
    t.wait(r, Deadline::after(60));
    t.wait(rz, Deadline::after(60));
    std::vector<float> expect(n);
    fill(expect);
    CHECK(dst == expect);
    CHECK(rz.done);
    CHECK(rz.header.numel() == 0);
    CHECK(rz.header.ndim == 1);
  }
}

/// The last rank waits 0.2 s on the one before it, which never sends: PeerTimeout naming the
/// silent rank, no sooner than the deadline and well before 5 s; the request stays pending.
template <Transport T>
void deadline(T& t, int world) {
  const int waiter = world - 1, silent = world - 2;
  if (t.rank() != waiter) return;
  std::vector<float> dst(4);
  auto r = t.irecv(silent, 5, MessageHeader::make(0, waiter, DType::F32, {4}), mbytes(dst));
  const auto t0 = std::chrono::steady_clock::now();
  const auto e = error_of([&] { t.wait(r, Deadline::after(0.2)); });
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(e.code() == Errc::PeerTimeout);
  CHECK(contains(e.what(), "rank " + std::to_string(silent) + " stopped answering"));
  CHECK(waited >= 0.19);
  CHECK(waited < 5.0);
  CHECK_FALSE(t.test(r));
}

/// Ranks 0 and 1 each post a send to and a receive from the other before waiting on either.
template <Transport T>
void exchange(T& t, int /*world*/) {
  if (t.rank() > 1) return;
  const int me = t.rank(), peer = 1 - me;
  std::vector<std::int32_t> out = me == 0 ? std::vector<std::int32_t>{1, 2, 3}
                                          : std::vector<std::int32_t>{4, 5, 6};
  std::vector<std::int32_t> in(3, -1);
  std::vector<Request> reqs;
  reqs.push_back(t.isend(peer, 9, MessageHeader::make(0, peer, DType::I32, {3}), cbytes(out)));
  reqs.push_back(t.irecv(peer, 9, MessageHeader::make(0, me, DType::I32, {3}), mbytes(in)));
  CHECK_FALSE(reqs[0].is_recv);
  CHECK(reqs[1].is_recv);
  for (auto& r : reqs) t.wait(r, Deadline::after(10));
  CHECK(in == (me == 0 ? std::vector<std::int32_t>{4, 5, 6} : std::vector<std::int32_t>{1, 2, 3}));
}

// ---- the in-process driver -----------------------------------------------------------------

/// Runs a program on `world` threads, one InProcessTransport each over one fabric, through
/// engine::run_ranks (a rank that throws aborts the fabric; the root cause is rethrown).
struct InProcessDriver {
  template <class Program>
  static void run(int world, Program program) {
    InProcessFabric fabric(world);
    auto eps = endpoints(fabric);
    engine::run_ranks(std::span(eps), [&](InProcessTransport& t) { program(t, world); });
  }
};

}  // namespace conformance

TYPE_TO_STRING_AS("in_process", conformance::InProcessDriver);

// ---- the cases -----------------------------------------------------------------------------

TEST_CASE_TEMPLATE_DEFINE("transport.conformance: pairing delivers the bytes and the header", D,
                          conformance_pairing) {
  D::run(2, [](auto& t, int w) { conformance::pairing(t, w); });
}
TEST_CASE_TEMPLATE_DEFINE("transport.conformance: order is kept per (peer, tag), across tags", D,
                          conformance_ordering) {
  D::run(2, [](auto& t, int w) { conformance::ordering(t, w); });
}
TEST_CASE_TEMPLATE_DEFINE("transport.conformance: receives match in posting order, not wait order",
                          D, conformance_posting_order) {
  D::run(2, [](auto& t, int w) { conformance::posting_order(t, w); });
}
TEST_CASE_TEMPLATE_DEFINE("transport.conformance: a header mismatch is an error naming the field",
                          D, conformance_header_mismatch) {
  D::run(2, [](auto& t, int w) { conformance::header_mismatch(t, w); });
}
TEST_CASE_TEMPLATE_DEFINE("transport.conformance: 64 MiB and zero-byte messages", D,
                          conformance_large_and_empty) {
  D::run(2, [](auto& t, int w) { conformance::large_and_empty(t, w); });
}
TEST_CASE_TEMPLATE_DEFINE("transport.conformance: a silent peer becomes PeerTimeout at the deadline",
                          D, conformance_deadline) {
  D::run(3, [](auto& t, int w) { conformance::deadline(t, w); });
}
TEST_CASE_TEMPLATE_DEFINE("transport.conformance: simultaneous sends and receives both ways pair up",
                          D, conformance_exchange) {
  D::run(2, [](auto& t, int w) { conformance::exchange(t, w); });
}

/// Instantiates every conformance case for `Driver` (once per test binary).
#define BRIGADE_TRANSPORT_CONFORMANCE(Driver)                         \
  TEST_CASE_TEMPLATE_INVOKE(conformance_pairing, Driver);             \
  TEST_CASE_TEMPLATE_INVOKE(conformance_ordering, Driver);            \
  TEST_CASE_TEMPLATE_INVOKE(conformance_posting_order, Driver);       \
  TEST_CASE_TEMPLATE_INVOKE(conformance_header_mismatch, Driver);     \
  TEST_CASE_TEMPLATE_INVOKE(conformance_large_and_empty, Driver);     \
  TEST_CASE_TEMPLATE_INVOKE(conformance_deadline, Driver);            \
  TEST_CASE_TEMPLATE_INVOKE(conformance_exchange, Driver)
