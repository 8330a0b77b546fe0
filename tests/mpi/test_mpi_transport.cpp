// MpiTransport under mpirun: the transport conformance suite (tests/transport_conformance.hpp)
// with one process per rank, and what only the MPI model has (abort notices, wait-for chains,
// tag range). Every rank runs every case; each case duplicates the world communicator, so a
// failed case leaves nothing behind for the next.
#include "collectives_conformance.hpp"
#include "transport_conformance.hpp"

#include <brigade/transport/mpi.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

using namespace brigade;
using namespace brigade::transport;

static_assert(Transport<MpiTransport>, "MpiTransport must model the Transport concept");

namespace {

/// Runs a program on this process's rank of a fresh MpiTransport (a duplicate of
/// MPI_COMM_WORLD), on the first min(world, size) ranks; then a barrier, so every control notice
/// and message of the case is delivered before any rank frees its communicator.
struct MpiDriver {
  template <class Program>
  static void run(int world, Program program) {
    MpiTransport t;
    REQUIRE(t.world_size() >= 2);
    const int w = std::min(world, t.world_size());
    std::exception_ptr error;
    try {
      if (t.rank() < w) program(t, w);
    } catch (...) {
      error = std::current_exception();
    }
    t.barrier(Deadline::after(120));
    if (error) std::rethrow_exception(error);
  }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TYPE_TO_STRING_AS("mpi", MpiDriver);
BRIGADE_TRANSPORT_CONFORMANCE(MpiDriver);

TEST_CASE("mpi.transport: bad peers, tags and sizes are rejected before anything is sent") {
  MpiTransport t;
  std::vector<float> v(3);
  const auto h = MessageHeader::make(0, 1, DType::F32, {3});
  const int n = t.world_size();
  const std::string bad_peer = fmt::format("peer {} outside [0, {})", n, n);
  CHECK_THROWS_WITH_AS(t.isend(n, 0, h, conformance::cbytes(v)),
                       doctest::Contains(bad_peer.c_str()), Error);
  CHECK_THROWS_WITH_AS(t.irecv(-1, 0, h, conformance::mbytes(v)),
                       doctest::Contains("peer -1 outside"), Error);
  CHECK_THROWS_WITH_AS(t.isend(0, -1, h, conformance::cbytes(v)), doctest::Contains("tag -1 outside"),
                       Error);
  CHECK_THROWS_WITH_AS(t.isend(0, t.max_tag() + 1, h, conformance::cbytes(v)),
                       doctest::Contains("outside [0, "), Error);
  CHECK_THROWS_WITH_AS(t.isend(0, 0, MessageHeader::make(0, 1, DType::F32, {4}), conformance::cbytes(v)),
                       doctest::Contains("of 12 bytes"), Error);
  CHECK_THROWS_WITH_AS(t.isend(0, 0, MessageHeader::make(0, 1, DType::F32, {kAny}), conformance::cbytes(v)),
                       doctest::Contains("wildcard shape[0]"), Error);
  CHECK(t.max_tag() >= MpiTransport::kGuaranteedMaxTag);
  Request empty;
  empty.is_recv = true;
  CHECK_THROWS_WITH_AS(t.wait(empty, Deadline::after(1)), doctest::Contains("empty request"), Error);
  MpiTransport moved = std::move(t);
  CHECK(moved.world_size() == n);
  CHECK_THROWS_WITH_AS((void)t.rank(), doctest::Contains("moved-from"), Error);  // NOLINT
  moved.barrier(Deadline::after(60));
}

TEST_CASE("mpi.transport: the largest tag works for inline and separate payloads") {
  MpiDriver::run(2, [](MpiTransport& t, int) {
    const int tag = t.max_tag();
    const std::int64_t big = 64 * 1024;  // floats: above the inline threshold
    if (t.rank() == 0) {
      std::vector<float> a(4, 1.5f), b(static_cast<std::size_t>(big), 2.5f);
      auto sa = t.isend(1, tag, MessageHeader::make(0, 1, DType::F32, {4}), conformance::cbytes(a));
      auto sb = t.isend(1, tag, MessageHeader::make(1, 1, DType::F32, {big}), conformance::cbytes(b));
      t.wait(sa, Deadline::after(10));
      t.wait(sb, Deadline::after(10));
    } else {
      std::vector<float> a(4), b(static_cast<std::size_t>(big));
      auto ra = t.irecv(0, tag, MessageHeader::make(0, 1, DType::F32, {4}), conformance::mbytes(a));
      auto rb = t.irecv(0, tag, MessageHeader::make(1, 1, DType::F32, {big}), conformance::mbytes(b));
      t.wait(rb, Deadline::after(10));
      t.wait(ra, Deadline::after(10));
      CHECK(a == std::vector<float>(4, 1.5f));
      CHECK(b.back() == 2.5f);
    }
  });
}

TEST_CASE("mpi.transport: abort() stops the peer's wait at once with Aborted quoting the reason") {
  MpiDriver::run(2, [](MpiTransport& t, int) {
    if (t.rank() == 0) {
      t.abort("stage 0 failed: boom");
      return;
    }
    std::vector<float> dst(1);
    auto r = t.irecv(0, 0, MessageHeader::make(0, 1, DType::F32, {1}), conformance::mbytes(dst));
    const auto t0 = std::chrono::steady_clock::now();
    const auto e = conformance::error_of([&] { t.wait(r, Deadline::after(30)); });
    CHECK(e.code() == Errc::Aborted);
    CHECK(conformance::contains(e.what(), "rank 1: stopping because rank 0 failed: stage 0 failed: boom"));
    CHECK(seconds_since(t0) < 10.0);
  });
}

TEST_CASE("mpi.transport: a send nobody receives times out naming the receiver, then completes") {
  MpiDriver::run(2, [](MpiTransport& t, int) {
    const std::int64_t big = 1 << 20;  // floats: 4 MiB, sent by rendezvous
    std::vector<float> v(static_cast<std::size_t>(big), 1.0f);
    const auto h = MessageHeader::make(0, 1, DType::F32, {big});
    if (t.rank() == 0) {
      auto s = t.isend(1, 2, h, conformance::cbytes(v));
      const auto e = conformance::error_of([&] { t.wait(s, Deadline::after(0.3)); });
      CHECK(e.code() == Errc::PeerTimeout);
      CHECK(conformance::contains(e.what(), "rank 1 did not take the message"));
      CHECK(conformance::contains(e.what(), "rank 1 stopped answering"));
      // Now let rank 1 receive it: the same send completes.
      auto go = t.isend(1, 3, MessageHeader::make(0, 1, DType::U8, {0}), {});
      t.wait(s, Deadline::after(30));
      t.wait(go, Deadline::after(30));
      CHECK(s.done);
    } else if (t.rank() == 1) {
      auto go = t.irecv(0, 3, MessageHeader::make(0, 1, DType::U8, {0}), {});
      t.wait(go, Deadline::after(30));
      auto r = t.irecv(0, 2, h, conformance::mbytes(v));
      t.wait(r, Deadline::after(30));
      CHECK(r.done);
    }
  });
}

TEST_CASE("mpi.transport: a timeout names the rank at the end of the wait-for chain") {
  // Rank 0 waits on rank 1, rank 1 waits on rank 2, rank 2 never sends: both name rank 2.
  MpiTransport probe;
  const bool enough = probe.world_size() >= 3;
  probe.barrier(Deadline::after(60));
  if (!enough) {
    MESSAGE("needs 3 ranks (mpirun -np 3); skipped");
    return;
  }
  MpiDriver::run(3, [](MpiTransport& t, int) {
    if (t.rank() == 2) return;
    std::vector<float> dst(1);
    const int peer = t.rank() + 1;
    auto r = t.irecv(peer, 1, MessageHeader::make(0, t.rank(), DType::F32, {1}),
                     conformance::mbytes(dst));
    const auto t0 = std::chrono::steady_clock::now();
    // Rank 1 gives up first; rank 0 hears of it and stops before its own, later deadline.
    const auto e = conformance::error_of(
        [&] { t.wait(r, Deadline::after(t.rank() == 0 ? 20.0 : 0.5)); });
    CHECK(e.code() == Errc::PeerTimeout);
    CHECK(conformance::contains(e.what(), "rank 2 stopped answering"));
    if (t.rank() == 0) {
      CHECK(conformance::contains(e.what(), "rank 1 waits on rank 2"));
      CHECK(seconds_since(t0) < 10.0);
    }
  });
}

TEST_CASE("mpi.collectives: MPI_Iallreduce, MPI_Iallgather and MPI_Ibcast over the world and over "
          "a group of the odd ranks give the collectives cases' exact values") {
  MpiCollectives world;
  test::collectives_cases(world);
  const int me = world.rank(), n = world.size();
  std::vector<int> odd;
  for (int r = 1; r < n; r += 2) odd.push_back(r);
  if (me % 2 == 1) {
    MpiCollectives group(odd);
    CHECK(group.size() == static_cast<int>(odd.size()));
    CHECK(group.rank() == me / 2);
    test::collectives_cases(group);
  } else {
    const auto msg = conformance::error_of([&] { MpiCollectives bad{std::span<const int>(odd)}; });
    CHECK(msg.code() == Errc::InvalidArgument);
    CHECK(conformance::contains(msg.what(), "this process is not in the group"));
  }
  const std::vector<int> twice{0, 0};
  CHECK(conformance::error_of([&] { MpiCollectives bad{std::span<const int>(twice)}; }).code() ==
        Errc::InvalidArgument);
}
