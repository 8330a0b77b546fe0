// InProcessTransport: the conformance suite on threads, plus what only the in-process model has
// (fabric abort) and its argument checks.
#include "transport_conformance.hpp"

#include <brigade/transport/in_process.hpp>
#include <brigade/transport/mpi.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

using namespace brigade;
using namespace brigade::transport;

namespace {

/// A world of in-process ranks.
struct InProcessWorld {
  explicit InProcessWorld(int n) : fabric(n) {
    for (int r = 0; r < n; ++r) ranks.emplace_back(fabric, r);
  }
  InProcessTransport& operator[](int r) { return ranks[static_cast<std::size_t>(r)]; }
  InProcessFabric fabric;
  std::vector<InProcessTransport> ranks;
};

template <class V>
ConstBytes cbytes(const std::vector<V>& v) {
  return as_bytes(std::span<const V>(v));
}
template <class V>
MutableBytes mbytes(std::vector<V>& v) {
  return as_writable_bytes(std::span<V>(v));
}

}  // namespace

// Archetype: a type missing test() is not a Transport.
struct NoTest {
  int rank() const { return 0; }
  int world_size() const { return 1; }
  Request isend(int, int, const MessageHeader&, ConstBytes) { return {}; }
  Request irecv(int, int, const MessageHeader&, MutableBytes) { return {}; }
  void wait(Request&, Deadline) {}
};
static_assert(!Transport<NoTest>, "a type without test() must not model Transport");
// abort is the optional part: a Transport without it is not an AbortableTransport.
struct NoAbort : NoTest {
  bool test(Request&) { return true; }
};
static_assert(Transport<NoAbort> && !AbortableTransport<NoAbort>);
static_assert(AbortableTransport<InProcessTransport>);
// The MPI model's header compiles without MPI (only linking needs brigade::mpi).
static_assert(AbortableTransport<MpiTransport>);

// The conformance suite (tests/transport_conformance.hpp) on threads in one process; the same
// cases run on MpiTransport in tests/mpi/test_mpi_transport.cpp.
BRIGADE_TRANSPORT_CONFORMANCE(conformance::InProcessDriver);

TEST_CASE("transport.in_process: abort wakes a waiting rank with Aborted") {
  InProcessWorld w(2);
  std::vector<float> dst(1);
  auto r = w[1].irecv(0, 0, MessageHeader::make(0, 1, DType::F32, {1}), mbytes(dst));
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    w.fabric.abort("stage 0 failed: boom");
  });
  CHECK_THROWS_WITH_AS(w[1].wait(r, Deadline::after(30)), doctest::Contains("stage 0 failed: boom"),
                       Error);
  killer.join();
}

TEST_CASE("transport.in_process: bad peers and sizes are rejected") {
  InProcessWorld w(2);
  std::vector<float> v(3);
  CHECK_THROWS_WITH_AS(w[0].isend(2, 0, MessageHeader::make(0, 1, DType::F32, {3}), cbytes(v)),
                       doctest::Contains("peer 2 outside [0, 2)"), Error);
  CHECK_THROWS_WITH_AS(w[0].isend(1, 0, MessageHeader::make(0, 1, DType::F32, {4}), cbytes(v)),
                       doctest::Contains("of 12 bytes"), Error);
  CHECK_THROWS_AS(InProcessTransport(w.fabric, 5), Error);
  CHECK_THROWS_AS(InProcessFabric(0), Error);
}

TEST_CASE("transport.in_process: a send to a posted receive is copied straight into its buffer") {
  InProcessWorld w(2);
  std::vector<float> src{1.f, 2.f, 3.f}, dst(3, -1.f);
  const auto h = MessageHeader::make(0, 1, DType::F32, {3});
  auto r = w[1].irecv(0, 7, h, mbytes(dst));
  auto s = w[0].isend(1, 7, h, cbytes(src));
  CHECK(s.done);
  // Delivered before the receiver waits: the one copy went to the receive's buffer.
  CHECK(dst == std::vector<float>{1.f, 2.f, 3.f});
  src.assign(3, 9.f);  // the send's buffer is free at once
  CHECK(w[1].test(r));
  CHECK(r.header == h);
  CHECK(dst == std::vector<float>{1.f, 2.f, 3.f});
}

TEST_CASE("transport.in_process: receives posted before and after their sends keep the order") {
  InProcessWorld w(2);
  std::vector<std::int32_t> a(1), b(1), c(1);
  const auto h = MessageHeader::make(0, 1, DType::I32, {1});
  auto ra = w[1].irecv(0, 0, h, mbytes(a));  // posted first: the direct path
  for (std::int32_t v : {10, 20, 30}) {
    std::vector<std::int32_t> x{v};
    w[0].isend(1, 0, h, cbytes(x));
  }
  auto rb = w[1].irecv(0, 0, h, mbytes(b));  // posted after: from the channel
  auto rc = w[1].irecv(0, 0, h, mbytes(c));
  w[1].wait(rc, Deadline::after(5));
  w[1].wait(ra, Deadline::after(5));
  w[1].wait(rb, Deadline::after(5));
  CHECK(a[0] == 10);
  CHECK(b[0] == 20);
  CHECK(c[0] == 30);
}

TEST_CASE("transport.in_process: a posted receive that refuses the message names it at its wait") {
  InProcessWorld w(2);
  std::vector<float> small(2), v(3, 1.f);
  const auto h = MessageHeader::make(0, 1, DType::F32, {3});
  // The buffer is too small: the message waits in the channel and the wait refuses it.
  auto r1 = w[1].irecv(0, 0, MessageHeader::make(0, 1, DType::F32, {kAny}), mbytes(small));
  w[0].isend(1, 0, h, cbytes(v));
  CHECK(small == std::vector<float>{0.f, 0.f});
  CHECK_THROWS_WITH_AS(w[1].wait(r1, Deadline::after(5)),
                       doctest::Contains("has 12 bytes, the receive buffer holds 8"), Error);
  // Another header: the same, with the field named.
  std::vector<float> dst(3);
  auto r2 = w[1].irecv(0, 1, MessageHeader::make(0, 2, DType::F32, {3}), mbytes(dst));
  w[0].isend(1, 1, h, cbytes(v));
  CHECK(dst == std::vector<float>{0.f, 0.f, 0.f});
  CHECK_THROWS_WITH_AS(w[1].wait(r2, Deadline::after(5)), doctest::Contains("has stage = 1"),
                       Error);
}

TEST_CASE("transport.in_process: a receive given up before its message came is never written") {
  InProcessWorld w(2);
  const auto h = MessageHeader::make(0, 1, DType::I32, {4});
  std::vector<std::int32_t> gone(4, -7), next(4, 0);
  {
    auto abandoned = w[1].irecv(0, 0, h, mbytes(gone));
  }  // its rank unwound: the request is destroyed before the message is sent
  std::vector<std::int32_t> m1{1, 2, 3, 4}, m2{5, 6, 7, 8};
  w[0].isend(1, 0, h, cbytes(m1));  // the abandoned receive's message: dropped
  CHECK(gone == std::vector<std::int32_t>(4, -7));
  auto r = w[1].irecv(0, 0, h, mbytes(next));
  w[0].isend(1, 0, h, cbytes(m2));
  w[1].wait(r, Deadline::after(5));
  CHECK(next == m2);
}
