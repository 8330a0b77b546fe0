// One set of cases for every model of transport::Collectives, run by every member of a group:
// on threads over an InProcessGroup (tests/unit/test_collectives.cpp) and in processes over
// MpiCollectives (tests/mpi/test_mpi_transport.cpp, under mpirun).
#pragma once

#include <brigade/transport/collectives.hpp>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <string>
#include <vector>

namespace brigade::test {

/// All-reduce (sum, max; float, double), all-gather and broadcast with member-dependent values
/// whose results are exact in floating point, then the argument checks.
template <transport::Collectives C>
void collectives_cases(C& c) {
  using transport::Deadline;
  using transport::ReduceOp;
  const int n = c.size(), me = c.rank();
  CAPTURE(me);
  const auto dl = [] { return Deadline::after(30); };
  // Sum of (member + 1) * (i + 1) over the members: (i + 1) n (n + 1) / 2, exact in float.
  std::vector<float> f(5);
  for (std::size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>((me + 1) * (static_cast<int>(i) + 1));
  c.all_reduce(std::span<float>(f), ReduceOp::Sum, dl());
  for (std::size_t i = 0; i < f.size(); ++i)
    CHECK(f[i] == static_cast<float>((static_cast<int>(i) + 1) * n * (n + 1) / 2));
  std::vector<double> d{0.5 * me, -1.0 * me};
  c.all_reduce(std::span<double>(d), ReduceOp::Max, dl());
  CHECK(d == std::vector<double>{0.5 * (n - 1), 0.0});
  // All-gather: member m's [m, 10 m + 0.25].
  const std::vector<double> mine{static_cast<double>(me), 10.0 * me + 0.25};
  std::vector<double> all(2 * static_cast<std::size_t>(n), -1.0);
  c.all_gather(std::span<const double>(mine), std::span<double>(all), dl());
  for (int m = 0; m < n; ++m) {
    CHECK(all[2 * static_cast<std::size_t>(m)] == m);
    CHECK(all[2 * static_cast<std::size_t>(m) + 1] == 10.0 * m + 0.25);
  }
  // Broadcast from the last member.
  std::vector<float> b(3, static_cast<float>(me));
  c.broadcast(std::span<float>(b), n - 1, dl());
  CHECK(b == std::vector<float>(3, static_cast<float>(n - 1)));
  // Argument checks (local: no member posts anything).
  std::vector<float> wrong(2 * static_cast<std::size_t>(n) + 1);
  const std::vector<float> two(2);
  try {
    c.all_gather(std::span<const float>(two), std::span<float>(wrong), dl());
    FAIL("all_gather accepted a wrong output size");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::InvalidArgument);
    CHECK(std::string(e.what()).find(fmt::format("output of {} elements, expected {} x 2",
                                                 wrong.size(), n)) != std::string::npos);
  }
  try {
    c.broadcast(std::span<float>(b), n, dl());
    FAIL("broadcast accepted a root outside the group");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::InvalidArgument);
    CHECK(std::string(e.what()).find(fmt::format("root {} outside [0, {})", n, n)) !=
          std::string::npos);
  }
}

}  // namespace brigade::test
