// Measuring a link of a device profile over any Transport: the in-process fabric between two
// threads (cost::measure_profile), or two MPI processes (`brigade profile` under mpirun).
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/cost/profile.hpp"
#include "brigade/transport/transport.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <limits>
#include <string>
#include <vector>

namespace brigade::cost {
inline namespace v0 {
namespace detail {

inline double probe_now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// Typical time of `fn`: the median over repetitions filling about `budget` seconds (at least
/// 5, the first a warm-up that does not count). The median, not the best: a cost model
/// predicts what a run usually takes, and on a shared machine the best repetition is a moment
/// no run sees for long.
template <class Fn>
double typical_seconds(double budget, Fn&& fn) {
  std::vector<double> times;
  const double start = probe_now_s();
  for (int rep = 0; rep < 5 || (probe_now_s() - start < budget && rep < 10000); ++rep) {
    const double t0 = probe_now_s();
    fn();
    if (rep > 0) times.push_back(probe_now_s() - t0);
  }
  std::nth_element(times.begin(), times.begin() + static_cast<std::ptrdiff_t>(times.size() / 2),
                   times.end());
  return times[times.size() / 2];
}

}  // namespace detail

/// Bytes of the large messages measure_link() times (16 MiB).
inline constexpr std::size_t kLinkProbeBytes = std::size_t{16} << 20;

/// Measures the link between this rank and `peer` of `transport`: the leader times ping-pongs
/// of empty messages (latency = half the median round trip) and of kLinkProbeBytes messages
/// (bandwidth = bytes / half the median round trip), each within `budget` seconds; the other side
/// echoes every message until the leader's one-byte stop message. Both sides must call it, one
/// with leader = true. Tags `tag` and `tag + 1` are used.
/// @returns the link named `name` on the leader; on the echoing side a LinkProfile with only
///          the name set
/// @throws brigade::Error from the transport (a peer that does not answer within 60 s:
///         PeerTimeout)
template <transport::Transport T>
LinkProfile measure_link(T& tp, int peer, bool leader, std::string name, double budget,
                         int tag = 1) {
  namespace tr = transport;
  std::vector<std::byte> buf(kLinkProbeBytes), back(kLinkProbeBytes);
  const auto wait = [&](tr::Request& r) { tp.wait(r, tr::Deadline::after(60.0)); };
  if (!leader) {
    for (;;) {
      auto r = tp.irecv(peer, tag,
                        tr::MessageHeader::make(0, 0, brigade::DType::U8, {tr::kAny}),
                        tr::MutableBytes(buf));
      wait(r);
      if (r.header.nbytes() == 1) return {std::move(name), 0.0, 0.0};  // stop
      auto s = tp.isend(peer, tag + 1, r.header, tr::ConstBytes(buf.data(), r.header.nbytes()));
      wait(s);
    }
  }
  auto round_trip = [&](std::size_t n) {
    const auto h = tr::MessageHeader::make(0, 0, brigade::DType::U8, {static_cast<std::int64_t>(n)});
    auto s = tp.isend(peer, tag, h, tr::ConstBytes(buf.data(), n));
    auto r = tp.irecv(peer, tag + 1, h, tr::MutableBytes(back.data(), n));
    wait(s);
    wait(r);
  };
  const double latency = detail::typical_seconds(budget, [&] { round_trip(0); }) / 2.0;
  const double bandwidth =
      static_cast<double>(kLinkProbeBytes) /
      (detail::typical_seconds(budget, [&] { round_trip(kLinkProbeBytes); }) / 2.0);
  const auto stop = tr::MessageHeader::make(0, 0, brigade::DType::U8, {1});
  auto s = tp.isend(peer, tag, stop, tr::ConstBytes(buf.data(), 1));
  wait(s);
  return {std::move(name), latency, bandwidth};
}

}  // namespace v0
}  // namespace brigade::cost
