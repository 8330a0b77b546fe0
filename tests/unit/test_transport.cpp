// Transport conformance: one suite, run on every model of the Transport concept.
#include <brigade/transport/in_process.hpp>

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
  std::vector<Request> submit(std::span<const P2POp>) { return {}; }
  void wait(Request&, Deadline) {}
};
static_assert(!Transport<NoTest>, "a type without test() must not model Transport");
static_assert(Transport<InProcessTransport>);

TEST_CASE_TEMPLATE("transport.conformance: pairing delivers the bytes and the header", World,
                   InProcessWorld) {
  World w(2);
  std::vector<float> src(100);
  std::iota(src.begin(), src.end(), 0.5f);
  auto h = MessageHeader::make(3, 1, DType::F32, {10, 10});
  auto s = w[0].isend(1, 7, h, cbytes(src));
  std::vector<float> dst(100, -1.0f);
  auto r = w[1].irecv(0, 7, h, mbytes(dst));
  w[1].wait(r, Deadline::after(5));
  w[0].wait(s, Deadline::after(5));
  CHECK(r.done);
  CHECK(r.header == h);
  CHECK(dst == src);
}

TEST_CASE_TEMPLATE("transport.conformance: order is kept per (peer, tag), across tags", World,
                   InProcessWorld) {
  World w(2);
  for (int i = 0; i < 3; ++i) {
    std::vector<std::int32_t> v{i};
    w[0].isend(1, 1, MessageHeader::make(i, 1, DType::I32, {1}), cbytes(v));
    std::vector<std::int32_t> u{100 + i};
    w[0].isend(1, 2, MessageHeader::make(i, 1, DType::I32, {1}), cbytes(u));
  }
  // Tag 2 first: its messages are not blocked behind tag 1's.
  for (int i = 0; i < 3; ++i) {
    std::vector<std::int32_t> got(1);
    auto r = w[1].irecv(0, 2, MessageHeader::make(kAny, 1, DType::I32, {1}), mbytes(got));
    w[1].wait(r, Deadline::after(5));
    CHECK(got[0] == 100 + i);
    CHECK(r.header.microbatch == i);
  }
  for (int i = 0; i < 3; ++i) {
    std::vector<std::int32_t> got(1);
    auto r = w[1].irecv(0, 1, MessageHeader::make(i, 1, DType::I32, {1}), mbytes(got));
    w[1].wait(r, Deadline::after(5));
    CHECK(got[0] == i);
  }
}

TEST_CASE_TEMPLATE("transport.conformance: receives match in posting order, not wait order",
                   World, InProcessWorld) {
  World w(2);
  std::vector<std::int32_t> a(1), b(1);
  auto ra = w[1].irecv(0, 0, MessageHeader::make(kAny, 1, DType::I32, {1}), mbytes(a));
  auto rb = w[1].irecv(0, 0, MessageHeader::make(kAny, 1, DType::I32, {1}), mbytes(b));
  std::vector<std::int32_t> first{11}, second{22};
  w[0].isend(1, 0, MessageHeader::make(0, 1, DType::I32, {1}), cbytes(first));
  w[0].isend(1, 0, MessageHeader::make(1, 1, DType::I32, {1}), cbytes(second));
  w[1].wait(rb, Deadline::after(5));
  w[1].wait(ra, Deadline::after(5));
  CHECK(a[0] == 11);
  CHECK(b[0] == 22);
}

TEST_CASE_TEMPLATE("transport.conformance: a header mismatch is an error naming the field", World,
                   InProcessWorld) {
  World w(2);
  std::vector<float> v(6, 1.0f), dst(6);
  w[0].isend(1, 0, MessageHeader::make(0, 1, DType::F32, {2, 3}), cbytes(v));
  SUBCASE("microbatch") {
    auto r = w[1].irecv(0, 0, MessageHeader::make(1, 1, DType::F32, {2, 3}), mbytes(dst));
    try {
      w[1].wait(r, Deadline::after(5));
      FAIL("no error");
    } catch (const Error& e) {
      CHECK(e.code() == Errc::HeaderMismatch);
      CHECK(std::string(e.what()).find("microbatch = 0, expected 1") != std::string::npos);
      CHECK(std::string(e.what()).find("from rank 0") != std::string::npos);
    }
  }
  SUBCASE("shape") {
    auto r = w[1].irecv(0, 0, MessageHeader::make(0, 1, DType::F32, {3, 2}), mbytes(dst));
    try {
      w[1].wait(r, Deadline::after(5));
      FAIL("no error");
    } catch (const Error& e) {
      CHECK(e.code() == Errc::HeaderMismatch);
      CHECK(std::string(e.what()).find("shape[0] = 2, expected 3") != std::string::npos);
    }
  }
  SUBCASE("buffer too small") {
    std::vector<float> small(5);
    auto r = w[1].irecv(0, 0, MessageHeader::make(0, 1, DType::F32, {kAny, 3}), mbytes(small));
    CHECK_THROWS_WITH_AS(w[1].wait(r, Deadline::after(5)),
                         doctest::Contains("has 24 bytes, the receive buffer holds 20"), Error);
  }
}

TEST_CASE_TEMPLATE("transport.conformance: 64 MiB and zero-byte messages", World, InProcessWorld) {
  World w(2);
  const std::size_t n = (64u << 20) / sizeof(float);
  std::vector<float> big(n);
  for (std::size_t i = 0; i < n; ++i) big[i] = static_cast<float>(i % 9973);
  std::thread sender([&] {
    auto s = w[0].isend(1, 0, MessageHeader::make(0, 1, DType::F32, {static_cast<std::int64_t>(n)}),
                        cbytes(big));
    w[0].wait(s, Deadline::after(30));
    std::vector<float> none;
    auto z = w[0].isend(1, 0, MessageHeader::make(1, 1, DType::F32, {0}), cbytes(none));
    w[0].wait(z, Deadline::after(30));
  });
  std::vector<float> dst(n, -1.0f);
  auto r = w[1].irecv(0, 0, MessageHeader::make(0, 1, DType::F32, {static_cast<std::int64_t>(n)}),
                      mbytes(dst));
  w[1].wait(r, Deadline::after(30));
  std::vector<float> empty;
  auto rz = w[1].irecv(0, 0, MessageHeader::make(1, 1, DType::F32, {0}), mbytes(empty));
  w[1].wait(rz, Deadline::after(30));
  sender.join();
  CHECK(dst == big);
  CHECK(rz.done);
  CHECK(rz.header.numel() == 0);
}

TEST_CASE_TEMPLATE("transport.conformance: a silent peer becomes PeerTimeout at the deadline",
                   World, InProcessWorld) {
  World w(3);
  std::vector<float> dst(4);
  auto r = w[2].irecv(1, 5, MessageHeader::make(0, 2, DType::F32, {4}), mbytes(dst));
  const auto t0 = std::chrono::steady_clock::now();
  try {
    w[2].wait(r, Deadline::after(0.2));
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::PeerTimeout);
    CHECK(std::string(e.what()).find("rank 1 stopped answering") != std::string::npos);
  }
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(waited >= 0.19);
  CHECK(waited < 5.0);
  CHECK_FALSE(w[2].test(r));
}

TEST_CASE_TEMPLATE("transport.conformance: batch submit pairs simultaneous sends and receives",
                   World, InProcessWorld) {
  World w(2);
  std::vector<std::int32_t> to1{1, 2, 3}, to0{4, 5, 6}, at0(3), at1(3);
  auto exchange = [&](int me, std::vector<std::int32_t>& out, std::vector<std::int32_t>& in) {
    const int peer = 1 - me;
    std::vector<P2POp> ops(2);
    ops[0] = {true, peer, 9, MessageHeader::make(0, peer, DType::I32, {3}), cbytes(out), {}};
    ops[1] = {false, peer, 9, MessageHeader::make(0, me, DType::I32, {3}), {}, mbytes(in)};
    auto reqs = w[me].submit(ops);
    for (auto& r : reqs) w[me].wait(r, Deadline::after(5));
  };
  std::thread t([&] { exchange(1, to0, at1); });
  exchange(0, to1, at0);
  t.join();
  CHECK(at1 == to1);
  CHECK(at0 == to0);
}

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
