// Transport conformance subset for NcclTransport: pairing and order, the header check (fields and
// tag), refusals, and a silent peer turned into PeerTimeout with the communicator aborted.
// With one GPU the checks run on a one-rank communicator that sends to itself (NCCL pairs a
// send and a receive to self in one group); with two or more GPUs, two ranks on two devices,
// one thread each. (NCCL refuses two ranks of one communicator on the same GPU.)
#include "support.hpp"

#include <brigade/transport/nccl.hpp>

#include <cuda_runtime.h>

#include <chrono>
#include <exception>
#include <functional>
#include <thread>

using namespace brigade;
using namespace brigade::transport;
using namespace brigade::cuda::test;

namespace {

/// Device buffer of `n` floats, filled with `value` + index.
struct DeviceFloats {
  cuda::DeviceBuffer buf;
  std::size_t n;
  DeviceFloats(std::size_t count, float value, int device) : buf(count * 4, device), n(count) {
    std::vector<float> h(n);
    for (std::size_t i = 0; i < n; ++i) h[i] = value + static_cast<float>(i);
    buf.copy_from_host(h.data(), n * 4);
  }
  ConstBytes bytes() const { return {static_cast<const std::byte*>(buf.data()), n * 4}; }
  MutableBytes wbytes() { return {static_cast<std::byte*>(buf.data()), n * 4}; }
  std::vector<float> host() const {
    std::vector<float> h(n);
    buf.copy_to_host(h.data(), n * 4);
    return h;
  }
};

Errc code_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const brigade::Error& e) {
    return e.code();
  }
  FAIL("expected a brigade::Error");
  return Errc::Internal;
}

NcclTransport::Options on_device(int device) {
  NcclTransport::Options o;
  o.device = device;
  o.init_timeout_s = 60;
  return o;
}

}  // namespace

TEST_SUITE("transport") {
  TEST_CASE(
      "nccl.self: one rank sends to itself: pairing, order, header check, refusals, timeout") {
    const auto id = NcclUniqueId::create();
    NcclTransport t(id, 0, 1, on_device(0));
    REQUIRE(t.rank() == 0);
    REQUIRE(t.world_size() == 1);
    const auto dl = Deadline::after(30);

    SUBCASE("a send and a receive flushed as one group; payload and header arrive") {
      DeviceFloats src(1000, 1.0f, 0), dst(1000, -7.0f, 0);
      const auto h = MessageHeader::make(3, 1, DType::F32, {10, 100});
      auto expected = h;
      expected.microbatch = kAny;
      std::vector<Request> reqs;
      reqs.push_back(t.isend(0, 5, h, src.bytes()));
      reqs.push_back(t.irecv(0, 5, expected, dst.wbytes()));
      t.flush();
      for (auto& r : reqs) t.wait(r, dl);
      CHECK(reqs[1].header == h);
      CHECK(dst.host() == src.host());
    }

    SUBCASE("isend/irecv queue; the first wait posts them together; messages keep their order") {
      DeviceFloats a(64, 100.0f, 0), b(64, 200.0f, 0), c(64, 300.0f, 0);
      DeviceFloats ra(64, 0.0f, 0), rb(64, 0.0f, 0), rc(64, 0.0f, 0);
      std::vector<Request> sends, recvs;
      for (int mb = 0; mb < 3; ++mb) {
        const auto h = MessageHeader::make(mb, 0, DType::F32, {64});
        sends.push_back(t.isend(0, 0, h, (mb == 0 ? a : mb == 1 ? b : c).bytes()));
        recvs.push_back(t.irecv(0, 0, h, (mb == 0 ? ra : mb == 1 ? rb : rc).wbytes()));
      }
      t.wait(recvs[2], dl);
      for (auto& r : recvs) t.wait(r, dl);
      for (auto& r : sends) CHECK(t.test(r));
      CHECK(ra.host() == a.host());
      CHECK(rb.host() == b.host());
      CHECK(rc.host() == c.host());
    }

    SUBCASE(
        "a header that differs, or another tag, is HeaderMismatch; the transport stays usable") {
      DeviceFloats src(16, 1.0f, 0), dst(16, 0.0f, 0);
      const auto h = MessageHeader::make(1, 2, DType::F32, {16});
      auto other_mb = h;
      other_mb.microbatch = 2;
      t.isend(0, 0, h, src.bytes());
      auto r = t.irecv(0, 0, other_mb, dst.wbytes());
      CHECK(code_of([&] { t.wait(r, dl); }) == Errc::HeaderMismatch);
      t.isend(0, 4, h, src.bytes());
      auto r2 = t.irecv(0, 9, h, dst.wbytes());
      CHECK(code_of([&] { t.wait(r2, dl); }) == Errc::HeaderMismatch);
      t.isend(0, 0, h, src.bytes());
      auto r3 = t.irecv(0, 0, h, dst.wbytes());
      t.wait(r3, dl);
      CHECK(dst.host() == src.host());
    }

    SUBCASE("refusals: wildcard receive shape, short buffer, size mismatch, bad peer") {
      DeviceFloats buf(16, 0.0f, 0);
      auto any = MessageHeader::make(0, 0, DType::F32, {kAny});
      CHECK(code_of([&] { t.irecv(0, 0, any, buf.wbytes()); }) == Errc::InvalidArgument);
      const auto big = MessageHeader::make(0, 0, DType::F32, {32});
      CHECK(code_of([&] { t.irecv(0, 0, big, buf.wbytes()); }) == Errc::InvalidArgument);
      CHECK(code_of([&] { t.isend(0, 0, big, buf.bytes()); }) == Errc::InvalidArgument);
      const auto h = MessageHeader::make(0, 0, DType::F32, {16});
      CHECK(code_of([&] { t.isend(1, 0, h, buf.bytes()); }) == Errc::InvalidArgument);
    }

    SUBCASE("a receive nobody answers ends in PeerTimeout at the deadline; then Aborted") {
      DeviceFloats dst(16, 0.0f, 0);
      const auto h = MessageHeader::make(0, 0, DType::F32, {16});
      auto r = t.irecv(0, 0, h, dst.wbytes());
      const auto start = Deadline::Clock::now();
      // NCCL either waits for a send that never comes (PeerTimeout at the deadline) or refuses a
      // lone receive from self when the group is posted (Nccl); both must end the wait.
      const Errc e = code_of([&] { t.wait(r, Deadline::after(1.0)); });
      MESSAGE("a lone receive from self ended with " << brigade::to_string(e));
      CHECK((e == Errc::PeerTimeout || e == Errc::Nccl));
      CHECK(Deadline::Clock::now() - start < std::chrono::seconds(20));
      CHECK(t.aborted());
      CHECK(code_of([&] { t.isend(0, 0, h, dst.bytes()); }) == Errc::Aborted);
    }
  }

  TEST_CASE(
      "nccl.two_ranks: ranks 0 and 1 on two GPUs exchange both ways, a silent peer times "
      "out") {
    int devices = 0;
    REQUIRE(cudaGetDeviceCount(&devices) == cudaSuccess);
    if (devices < 2) {
      MESSAGE("one GPU: the two-rank case needs two (NCCL refuses two ranks on one device)");
      return;
    }
    const auto id = NcclUniqueId::create();
    std::exception_ptr failure[2];
    std::vector<float> got[2];
    auto body = [&](int rank) {
      try {
        NcclTransport t(id, rank, 2, on_device(rank));
        const int peer = 1 - rank;
        DeviceFloats mine(4096, 1000.0f * static_cast<float>(rank), rank), theirs(4096, 0.0f, rank);
        const auto out_h = MessageHeader::make(7, peer, DType::F32, {4096});
        const auto in_h = MessageHeader::make(7, rank, DType::F32, {4096});
        std::vector<Request> reqs;
        reqs.push_back(t.isend(peer, 1, out_h, mine.bytes()));
        reqs.push_back(t.irecv(peer, 1, in_h, theirs.wbytes()));
        for (auto& r : reqs) t.wait(r, Deadline::after(60));
        got[rank] = theirs.host();
        if (rank == 0) {  // rank 1 never sends this one
          auto r = t.irecv(1, 2, in_h, theirs.wbytes());
          CHECK(code_of([&] { t.wait(r, Deadline::after(2.0)); }) == Errc::PeerTimeout);
        }
      } catch (...) {
        failure[rank] = std::current_exception();
      }
    };
    std::thread r0(body, 0), r1(body, 1);
    r0.join();
    r1.join();
    for (auto& f : failure)
      if (f) std::rethrow_exception(f);
    REQUIRE(got[0].size() == 4096);
    CHECK(got[0][5] == 1005.0f);
    CHECK(got[1][5] == 5.0f);
  }

}  // TEST_SUITE
