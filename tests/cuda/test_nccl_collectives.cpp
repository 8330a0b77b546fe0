// NcclCollectives: all-reduce (sum, max), all-gather and broadcast against values computed by
// hand, the refusals, and a member that never joins turned into PeerTimeout with the
// communicator aborted. One GPU: a one-member group; two or more: two members on two devices,
// one thread each (NCCL refuses two members of one communicator on one GPU).
#include "support.hpp"

#include <brigade/transport/nccl_collectives.hpp>

#include <cuda_runtime.h>

#include <exception>
#include <functional>
#include <span>
#include <thread>
#include <vector>

using namespace brigade;
using namespace brigade::transport;

namespace {

/// `n` elements of V on `device`, filled with `value` + index.
template <class V>
struct DeviceArray {
  cuda::DeviceBuffer buf;
  std::size_t n;
  DeviceArray(std::size_t count, V value, int device) : buf(count * sizeof(V), device), n(count) {
    std::vector<V> h(n);
    for (std::size_t i = 0; i < n; ++i) h[i] = value + static_cast<V>(i);
    buf.copy_from_host(h.data(), n * sizeof(V));
  }
  std::span<V> span() { return {static_cast<V*>(buf.data()), n}; }
  std::vector<V> host() const {
    std::vector<V> h(n);
    buf.copy_to_host(h.data(), n * sizeof(V));
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

NcclCollectives::Options on_device(int device) {
  NcclCollectives::Options o;
  o.device = device;
  o.init_timeout_s = 60;
  return o;
}

}  // namespace

TEST_SUITE("transport") {
  TEST_CASE("nccl_collectives.one_member: identity results, refusals, abort") {
    NcclCollectives c(NcclUniqueId::create(), 0, 1, on_device(0));
    REQUIRE(c.rank() == 0);
    REQUIRE(c.size() == 1);
    const auto dl = Deadline::after(30);
    DeviceArray<float> f(1000, 1.5f, 0);
    DeviceArray<double> d(100, -3.0, 0);
    const auto f0 = f.host();
    const auto d0 = d.host();
    c.all_reduce(f.span(), ReduceOp::Sum, dl);
    c.all_reduce(d.span(), ReduceOp::Max, dl);
    CHECK(f.host() == f0);
    CHECK(d.host() == d0);
    DeviceArray<float> all(1000, 0.0f, 0);
    c.all_gather(std::span<const float>(f.span()), all.span(), dl);
    CHECK(all.host() == f0);
    c.broadcast(d.span(), 0, dl);
    CHECK(d.host() == d0);
    DeviceArray<float> two(2000, 0.0f, 0);
    CHECK(code_of([&] { c.all_gather(std::span<const float>(f.span()), two.span(), dl); }) ==
          Errc::InvalidArgument);
    CHECK(code_of([&] { c.broadcast(f.span(), 1, dl); }) == Errc::InvalidArgument);
    CHECK_FALSE(c.aborted());
    c.abort();
    CHECK(c.aborted());
    CHECK(code_of([&] { c.all_reduce(f.span(), ReduceOp::Sum, dl); }) == Errc::Aborted);
    CHECK(code_of([] { NcclCollectives(NcclUniqueId::create(), 1, 1, on_device(0)); }) ==
          Errc::InvalidArgument);
  }

  TEST_CASE("nccl_collectives.two_members: sums, max, gather, broadcast, a silent member times "
            "out") {
    int devices = 0;
    REQUIRE(cudaGetDeviceCount(&devices) == cudaSuccess);
    if (devices < 2) {
      MESSAGE("one GPU: the two-member case needs two (NCCL refuses two members on one device)");
      return;
    }
    const auto id = NcclUniqueId::create();
    std::exception_ptr failure[2];
    std::vector<float> sum[2], mx[2], gathered[2];
    std::vector<double> bcast[2];
    Errc silent = Errc::Internal;
    auto body = [&](int member) {
      try {
        NcclCollectives c(id, member, 2, on_device(member));
        const auto dl = Deadline::after(60);
        // Member m holds 1000 m + i: the sum is 1000 + 2 i, the max 1000 + i.
        DeviceArray<float> s(4096, 1000.0f * static_cast<float>(member), member);
        DeviceArray<float> m(4096, 1000.0f * static_cast<float>(member), member);
        c.all_reduce(s.span(), ReduceOp::Sum, dl);
        c.all_reduce(m.span(), ReduceOp::Max, dl);
        DeviceArray<float> mine(16, 100.0f * static_cast<float>(member), member);
        DeviceArray<float> all(32, 0.0f, member);
        c.all_gather(std::span<const float>(mine.span()), all.span(), dl);
        DeviceArray<double> b(8, member == 1 ? 7.0 : -1.0, member);
        c.broadcast(b.span(), 1, dl);
        sum[member] = s.host();
        mx[member] = m.host();
        gathered[member] = all.host();
        bcast[member] = b.host();
        if (member == 0)  // member 1 never joins this one
          silent = code_of([&] { c.all_reduce(s.span(), ReduceOp::Sum, Deadline::after(2.0)); });
      } catch (...) {
        failure[member] = std::current_exception();
      }
    };
    std::thread m0(body, 0), m1(body, 1);
    m0.join();
    m1.join();
    for (auto& f : failure)
      if (f) std::rethrow_exception(f);
    for (int m = 0; m < 2; ++m) {
      REQUIRE(sum[m].size() == 4096);
      CHECK(sum[m][5] == 1010.0f);
      CHECK(mx[m][5] == 1005.0f);
      CHECK(gathered[m][3] == 3.0f);
      CHECK(gathered[m][16 + 3] == 103.0f);
      CHECK(bcast[m][2] == 9.0);
    }
    CHECK(silent == Errc::PeerTimeout);
  }
}  // TEST_SUITE
