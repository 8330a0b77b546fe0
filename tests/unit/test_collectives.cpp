// InProcessCollectives: the collectives cases (tests/collectives_conformance.hpp) on threads, a
// member that never joins (PeerTimeout) and members whose sizes disagree (InvalidArgument).
#include <brigade/transport/collectives.hpp>

#include <doctest/doctest.h>

#include "collectives_conformance.hpp"
#include "test_util.hpp"

#include <chrono>
#include <exception>
#include <string>
#include <thread>
#include <vector>

using namespace brigade;
using namespace brigade::transport;

namespace {

/// Runs body(member) on `n` threads over one group; rethrows the first failure.
template <class F>
void on_group(int n, F body) {
  InProcessGroup group(n);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  {
    std::vector<std::jthread> threads;
    for (int m = 0; m < n; ++m)
      threads.emplace_back([&, m] {
        try {
          InProcessCollectives c(group, m);
          body(c);
        } catch (...) {
          errors[static_cast<std::size_t>(m)] = std::current_exception();
        }
      });
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace

TEST_CASE("collectives.in_process: all-reduce, all-gather and broadcast are exact on 1, 2, 3 and "
          "5 members") {
  for (int n : {1, 2, 3, 5}) {
    CAPTURE(n);
    on_group(n, [](InProcessCollectives& c) { test::collectives_cases(c); });
  }
}

TEST_CASE("collectives.in_process: a member that does not join is PeerTimeout, sizes that "
          "disagree are InvalidArgument on every member") {
  const auto msg = test::error_of(Errc::PeerTimeout, [] {
    on_group(2, [](InProcessCollectives& c) {
      if (c.rank() == 1) return;  // never joins
      std::vector<float> v(1);
      c.all_reduce(std::span<float>(v), ReduceOp::Sum, Deadline::after(0.2));
    });
  });
  CHECK(msg.find("group member 0: all_reduce: 1 of 2 members joined before the deadline") !=
        std::string::npos);
  const auto sizes = test::error_of(Errc::InvalidArgument, [] {
    on_group(2, [](InProcessCollectives& c) {
      std::vector<float> v(static_cast<std::size_t>(c.rank()) + 1);
      c.all_reduce(std::span<float>(v), ReduceOp::Sum, Deadline::after(10));
    });
  });
  CHECK(sizes.find("all_reduce: member 0 has 1 elements, member 1 has 2") != std::string::npos);
  CHECK(test::error_of(Errc::InvalidArgument, [] { InProcessGroup g(0); })
            .find("size = 0, expected >= 1") != std::string::npos);
  InProcessGroup g(2);
  CHECK(test::error_of(Errc::InvalidArgument, [&] { InProcessCollectives c(g, 2); })
            .find("member 2 outside [0, 2)") != std::string::npos);
}

TEST_CASE("collectives.in_process: abort() ends a member's pending collective at once with "
          "Aborted quoting the reason, and every later one") {
  InProcessGroup g(2);
  std::string pending, later;
  std::thread waiter([&] {
    InProcessCollectives c(g, 0);
    std::vector<float> v(1);
    pending = test::error_of(Errc::Aborted, [&] {
      c.all_reduce(std::span<float>(v), ReduceOp::Sum, Deadline::after(60));  // member 1 never comes
    });
    later = test::error_of(Errc::Aborted, [&] {
      c.broadcast(std::span<float>(v), 0, Deadline::after(60));
    });
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  g.abort("rank 3 failed: out of memory");
  waiter.join();
  CHECK(pending.find("group member 0: all_reduce: the group was aborted: rank 3 failed: out of "
                     "memory") != std::string::npos);
  CHECK(later.find("broadcast: the group was aborted") != std::string::npos);
}
