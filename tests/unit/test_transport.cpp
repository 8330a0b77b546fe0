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
