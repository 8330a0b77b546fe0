// Fault injection on inter-stage payloads: the faults a Byzantine worker or faulty hardware puts
// on the activations, gradients and tokens a stage sends (issue 17; the threat model of SENTINEL,
// Dolatabadi et al., arXiv 2603.03592), applied by a sending-side decorator over any Transport
// or, for offline evaluation, to a buffer. transport/verify.hpp is the receiving side's check.
//
// @code
//   FaultInjectingTransport bad(base, parse_fault_spec("noise:0.1:0.05:rank=1:seed=7"));
//   VerifyingTransport checked(bad, SentinelConfig{}, VerifyPolicy::Drop);
// @endcode
#pragma once

#include "brigade/transport/decorators.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace brigade::transport {
inline namespace v0 {

/// What a fault does to a payload (magnitude m relative to the payload's L2 norm ||x||, see
/// FaultSpec::magnitude for each).
enum class FaultKind {
  Noise,   ///< adds Gaussian noise with ||delta|| = m ||x||                      (f32 only)
  Scale,   ///< x *= (1 + m)                                                       (f32 only)
  Sign,    ///< flips the sign of a random fraction min(1, m^2/4) of the elements (f32 only)
  Zero,    ///< zeroes a random fraction min(1, m^2) of the elements              (any dtype)
  BitFlip, ///< flips random bits of random elements until ||delta|| >= m ||x||    (any dtype)
  Replay,  ///< replaces the payload by an older one of the same stream            (any dtype)
  Drift,   ///< adds a fixed direction, ramping up over FaultSpec::drift_ramp faults (f32 only)
};

/// Name of a fault kind ("noise", "scale", "sign", "zero", "bitflip", "replay", "drift").
constexpr const char* to_string(FaultKind k) noexcept {
  switch (k) {
    case FaultKind::Noise: return "noise";
    case FaultKind::Scale: return "scale";
    case FaultKind::Sign: return "sign";
    case FaultKind::Zero: return "zero";
    case FaultKind::BitFlip: return "bitflip";
    case FaultKind::Replay: return "replay";
    case FaultKind::Drift: return "drift";
  }
  return "unknown";
}

/// The fault kind named `s` (the names of to_string(FaultKind)).
/// @throws brigade::Error{InvalidArgument} naming the value and the choices
inline FaultKind parse_fault_kind(std::string_view s) {
  for (FaultKind k : {FaultKind::Noise, FaultKind::Scale, FaultKind::Sign, FaultKind::Zero,
                      FaultKind::BitFlip, FaultKind::Replay, FaultKind::Drift})
    if (s == to_string(k)) return k;
  ::brigade::detail::fail(Errc::InvalidArgument,
               "fault kind '{}' is not one of noise, scale, sign, zero, bitflip, replay, drift",
               ::brigade::detail::excerpt(s));
}

/// Which messages a FaultInjectingTransport corrupts, and how.
///
/// A message is a candidate when it is sent by a rank in `ranks` (empty: any rank the decorator
/// wraps) to `peer` (kAny: any), its kind is in `kinds`, its header's micro-batch and chunk match
/// `microbatch` and `chunk` (kAny: any), its dtype suits the fault (Noise, Scale, Sign and Drift
/// change f32 payloads only; Zero, BitFlip and Replay any dtype) and fewer than `max_faults`
/// faults were injected; each candidate is corrupted with probability `rate`.
///
/// `magnitude` m is the size of the change relative to the payload's L2 norm ||x|| (elements
/// as numbers: f32 values, i32 ids, bytes as 0..255):
/// - Noise: delta = m ||x|| g / ||g||, g i.i.d. standard normal: ||delta|| = m ||x|| exactly;
/// - Scale: x *= (1 + m): ||delta|| = m ||x|| exactly;
/// - Sign: each element's sign is flipped with probability f = min(1, m^2 / 4): E ||delta||^2 =
///   4 f ||x||^2, so ||delta|| ~= m ||x|| for m <= 2 on a large tensor;
/// - Zero: each element is zeroed with probability f = min(1, m^2): ||delta|| ~= m ||x|| for
///   m <= 1 on a large tensor;
/// - BitFlip: flips one uniformly random bit (of 32, or of 8 for bytes) of a random element not
///   flipped before, until ||delta|| >= m ||x|| or every element was flipped once; an exponent bit
///   may make an f32 infinite or NaN (relative change inf): a real upset does that too;
/// - Replay: the payload is replaced by the first payload of the same stream (receiving rank,
///   kind, stage, byte size) the decorator saw (magnitude ignored); the stream's first message
///   itself cannot be replayed;
/// - Drift: x += m ||x|| min(1, k / drift_ramp) u / ||u|| on the k-th Drift fault (k from 1),
///   u a fixed direction of the payload's size (i.i.d. standard normal from (seed, size)): a slow
///   drift that reaches ||delta|| = m ||x|| after drift_ramp faults.
/// The faults are seeded: the same spec and the same traffic give the same corruptions.
struct FaultSpec {
  FaultKind kind = FaultKind::Noise;  ///< what the fault does
  double magnitude = 1.0;             ///< change relative to ||x||, > 0 and finite
  double rate = 1.0;                  ///< probability that a candidate is corrupted, in (0, 1]
  std::vector<int> ranks;             ///< sending ranks (>= 0) that corrupt; empty: every rank
  int peer = static_cast<int>(kAny);  ///< receiving rank, or kAny
  std::vector<MessageKind> kinds = {MessageKind::Activation, MessageKind::Gradient};  ///< non-empty
  std::int64_t microbatch = kAny;     ///< header.microbatch, or kAny
  std::int64_t chunk = kAny;          ///< header.chunk (the round in inference), or kAny
  std::int64_t max_faults = -1;       ///< at most this many faults (>= 0), or -1: no limit
  std::uint64_t seed = 0;             ///< of the coin, the noise, the chosen elements, u
  int drift_ramp = 100;               ///< Drift: faults over which the offset ramps up, >= 1
};

/// Checks a FaultSpec's fields.
/// @throws brigade::Error{InvalidArgument} naming the field, the value and the range
inline void validate(const FaultSpec& s) {
  BRIGADE_CHECK(std::isfinite(s.magnitude) && s.magnitude > 0, Errc::InvalidArgument,
                "fault spec: magnitude = {}, expected a finite number > 0", s.magnitude);
  BRIGADE_CHECK(s.rate > 0 && s.rate <= 1, Errc::InvalidArgument,
                "fault spec: rate = {}, expected in (0, 1]", s.rate);
  for (int r : s.ranks)
    BRIGADE_CHECK(r >= 0, Errc::InvalidArgument, "fault spec: rank = {}, expected >= 0", r);
  BRIGADE_CHECK(s.peer >= 0 || s.peer == kAny, Errc::InvalidArgument,
                "fault spec: peer = {}, expected >= 0 or kAny", s.peer);
  BRIGADE_CHECK(!s.kinds.empty(), Errc::InvalidArgument,
                "fault spec: kinds is empty, expected at least one message kind");
  for (MessageKind k : s.kinds)
    BRIGADE_CHECK(static_cast<int>(k) >= 0 && static_cast<int>(k) < kNumMessageKinds,
                  Errc::InvalidArgument, "fault spec: kinds holds {}, out of range [0, {})",
                  static_cast<int>(k), kNumMessageKinds);
  BRIGADE_CHECK(s.max_faults >= -1, Errc::InvalidArgument,
                "fault spec: max_faults = {}, expected >= 0 or -1 (no limit)", s.max_faults);
  BRIGADE_CHECK(s.drift_ramp >= 1, Errc::InvalidArgument,
                "fault spec: drift_ramp = {}, expected >= 1", s.drift_ramp);
}

/// Parses the CLI's `--inject` value "KIND:MAGNITUDE:RATE[:rank=R[,R...]][:seed=S]", e.g.
/// "bitflip:1:0.1:rank=0" or "noise:0.01:1:seed=7". KIND as parse_fault_kind; MAGNITUDE a
/// number > 0 (relative to the payload's norm); RATE in (0, 1]; the other fields keep
/// FaultSpec's defaults (activations and gradients, any peer, micro-batch and chunk).
/// @throws brigade::Error{InvalidArgument} naming the spec and the bad field
inline FaultSpec parse_fault_spec(std::string_view text) {
  const std::string quoted = ::brigade::detail::excerpt(text, 64);
  std::vector<std::string_view> parts;
  for (std::size_t b = 0;;) {
    const std::size_t e = text.find(':', b);
    parts.push_back(text.substr(b, e == std::string_view::npos ? e : e - b));
    if (e == std::string_view::npos) break;
    b = e + 1;
  }
  BRIGADE_CHECK(parts.size() >= 3, Errc::InvalidArgument,
                "fault spec '{}': expected KIND:MAGNITUDE:RATE[:rank=R][:seed=S]", quoted);
  FaultSpec s;
  try {
    s.kind = parse_fault_kind(parts[0]);
  } catch (const Error& e) {
    ::brigade::detail::fail(Errc::InvalidArgument, "fault spec '{}': {}", quoted, e.what());
  }
  auto number = [&](std::string_view v, const char* field, const char* range) {
    double x = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
    BRIGADE_CHECK(ec == std::errc() && end == v.data() + v.size() && !v.empty(),
                  Errc::InvalidArgument, "fault spec '{}': {} '{}' is not a number ({})", quoted,
                  field, ::brigade::detail::excerpt(v), range);
    return x;
  };
  auto integer = [&](std::string_view v, const char* field, auto& out) {
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
    BRIGADE_CHECK(ec == std::errc() && end == v.data() + v.size() && !v.empty(),
                  Errc::InvalidArgument, "fault spec '{}': {} '{}' is not a non-negative integer",
                  quoted, field, ::brigade::detail::excerpt(v));
  };
  s.magnitude = number(parts[1], "magnitude", "expected > 0");
  BRIGADE_CHECK(std::isfinite(s.magnitude) && s.magnitude > 0, Errc::InvalidArgument,
                "fault spec '{}': magnitude = {}, expected a finite number > 0", quoted,
                s.magnitude);
  s.rate = number(parts[2], "rate", "expected in (0, 1]");
  BRIGADE_CHECK(s.rate > 0 && s.rate <= 1, Errc::InvalidArgument,
                "fault spec '{}': rate = {}, expected in (0, 1]", quoted, s.rate);
  for (std::size_t i = 3; i < parts.size(); ++i) {
    const std::string_view p = parts[i];
    if (p.starts_with("rank=")) {
      std::string_view list = p.substr(5);
      for (std::size_t b = 0;;) {
        const std::size_t e = list.find(',', b);
        unsigned r = 0;
        integer(list.substr(b, e == std::string_view::npos ? e : e - b), "rank", r);
        BRIGADE_CHECK(r <= static_cast<unsigned>(std::numeric_limits<int>::max()),
                      Errc::InvalidArgument, "fault spec '{}': rank {} too large", quoted, r);
        s.ranks.push_back(static_cast<int>(r));
        if (e == std::string_view::npos) break;
        b = e + 1;
      }
    } else if (p.starts_with("seed=")) {
      integer(p.substr(5), "seed", s.seed);
    } else {
      ::brigade::detail::fail(Errc::InvalidArgument,
                   "fault spec '{}': unknown field '{}', expected rank=R or seed=S", quoted,
                   ::brigade::detail::excerpt(p));
    }
  }
  validate(s);
  return s;
}

namespace fault_detail {

/// Element i of a payload of `dtype` as a number (f32, f16 or bf16 value, i32 id, byte 0..255).
inline double element(DType dtype, const std::byte* p, std::size_t i) noexcept {
  if (dtype == DType::F16 || dtype == DType::BF16) {
    std::uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    return dtype == DType::F16 ? f16_to_f32(h) : bf16_to_f32(h);
  }
  if (dtype == DType::F32) {
    float v;
    std::memcpy(&v, p + 4 * i, 4);
    return v;
  }
  if (dtype == DType::I32) {
    std::int32_t v;
    std::memcpy(&v, p + 4 * i, 4);
    return v;
  }
  return static_cast<double>(std::to_integer<unsigned>(p[i]));
}
inline void set_f32(std::byte* p, std::size_t i, float v) noexcept { std::memcpy(p + 4 * i, &v, 4); }
inline float get_f32(const std::byte* p, std::size_t i) noexcept {
  float v;
  std::memcpy(&v, p + 4 * i, 4);
  return v;
}
/// Sum of squares of a payload's elements (as numbers), in double.
inline double squared_norm(DType dtype, ConstBytes x) noexcept {
  const std::size_t n = x.size() / dtype_block_bytes(dtype);
  double s = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double v = element(dtype, x.data(), i);
    s += v * v;
  }
  return s;
}
/// The fixed drift direction for `n` elements (i.i.d. standard normal from (seed, n)).
inline std::vector<double> drift_direction(std::uint64_t seed, std::size_t n) {
  std::mt19937_64 g(seed ^ (0x9E3779B97F4A7C15ull * (n + 1)));
  std::normal_distribution<double> nd;
  std::vector<double> u(n);
  for (auto& v : u) v = nd(g);
  return u;
}

}  // namespace fault_detail

/// ||corrupted - clean|| / ||clean|| over the elements of two payloads of `dtype` (numbers as
/// in FaultSpec): +inf when an element of either is not finite or when ||clean|| = 0 and they
/// differ, 0 when they are equal.
/// @throws brigade::Error{InvalidArgument} for payloads of different sizes
inline double relative_change(DType dtype, ConstBytes clean, ConstBytes corrupted) {
  BRIGADE_CHECK(clean.size() == corrupted.size(), Errc::InvalidArgument,
                "relative_change: payloads of {} and {} bytes", clean.size(), corrupted.size());
  const std::size_t n = clean.size() / dtype_block_bytes(dtype);
  double d2 = 0, x2 = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double a = fault_detail::element(dtype, clean.data(), i);
    const double b = fault_detail::element(dtype, corrupted.data(), i);
    if (!std::isfinite(a) || !std::isfinite(b)) return std::numeric_limits<double>::infinity();
    d2 += (b - a) * (b - a);
    x2 += a * a;
  }
  if (d2 == 0) return 0.0;
  return x2 == 0 ? std::numeric_limits<double>::infinity() : std::sqrt(d2 / x2);
}

/// Applies the fault `spec.kind` of magnitude `spec.magnitude` (FaultSpec) in place to the
/// payload `x` of `dtype` (a whole number of elements), drawing from `rng`. `previous` is an
/// older clean payload of the same stream for Replay (no change when it is empty or of another
/// size); `drift_step` is how many Drift faults came before this one (the k-th fault has
/// drift_step = k - 1). Cost O(x.size()); Drift also draws its direction, O(x.size()). Noise,
/// Scale, Sign and Drift change float payloads (f32; f16 and bf16 are widened to float32,
/// changed, and rounded back); Zero, BitFlip and Replay work on the bytes of any dtype.
/// @return whether x changed (false: x = 0 for Noise, Scale, Drift; nothing chosen for Sign or
///         Zero; no previous payload for Replay; a dtype the fault does not apply to)
/// @throws brigade::Error{InvalidArgument} for a bad spec (validate)
inline bool apply_fault(const FaultSpec& spec, DType dtype, MutableBytes x, std::mt19937_64& rng,
                        ConstBytes previous, std::int64_t drift_step) {
  validate(spec);
  const bool arithmetic = spec.kind == FaultKind::Noise || spec.kind == FaultKind::Scale ||
                          spec.kind == FaultKind::Sign || spec.kind == FaultKind::Drift;
  if (arithmetic && (dtype == DType::F16 || dtype == DType::BF16)) {
    // A 16-bit payload is corrupted as the float32 values it holds, then rounded back.
    const auto count = static_cast<std::int64_t>(x.size() / 2);
    std::vector<float> wide(static_cast<std::size_t>(count));
    convert_to_f32(x.data(), dtype, wide.data(), count);
    const bool changed = apply_fault(spec, DType::F32, std::as_writable_bytes(std::span(wide)),
                                     rng, previous, drift_step);
    if (changed) convert_from_f32(wide.data(), x.data(), dtype, count);
    return changed;
  }
  const std::size_t esize = dtype_block_bytes(dtype);
  const std::size_t n = x.size() / esize;
  const double m = spec.magnitude;
  const bool f32 = dtype == DType::F32;
  std::byte* p = x.data();
  switch (spec.kind) {
    case FaultKind::Noise: {
      if (!f32) return false;
      const double norm = std::sqrt(fault_detail::squared_norm(dtype, x));
      if (norm == 0 || !std::isfinite(norm)) return false;
      std::normal_distribution<double> nd;
      std::vector<double> g(n);
      double g2 = 0;
      for (auto& v : g) {
        v = nd(rng);
        g2 += v * v;
      }
      const double a = m * norm / std::sqrt(g2);
      for (std::size_t i = 0; i < n; ++i)
        fault_detail::set_f32(p, i, static_cast<float>(fault_detail::get_f32(p, i) + a * g[i]));
      return true;
    }
    case FaultKind::Scale: {
      if (!f32) return false;
      bool changed = false;
      for (std::size_t i = 0; i < n; ++i) {
        const float v = fault_detail::get_f32(p, i);
        changed |= v != 0;
        fault_detail::set_f32(p, i, static_cast<float>(v * (1.0 + m)));
      }
      return changed;
    }
    case FaultKind::Sign:
    case FaultKind::Zero: {
      const bool sign = spec.kind == FaultKind::Sign;
      if (sign && !f32) return false;
      std::bernoulli_distribution coin(std::min(1.0, sign ? m * m / 4 : m * m));
      bool changed = false;
      for (std::size_t i = 0; i < n; ++i) {
        if (!coin(rng)) continue;
        if (sign) {
          const float v = fault_detail::get_f32(p, i);
          changed |= v != 0;
          fault_detail::set_f32(p, i, -v);
        } else {
          for (std::size_t b = 0; b < esize; ++b) {
            changed |= p[i * esize + b] != std::byte{0};
            p[i * esize + b] = std::byte{0};
          }
        }
      }
      return changed;
    }
    case FaultKind::BitFlip: {
      if (n == 0) return false;
      const double target2 = m * m * fault_detail::squared_norm(dtype, x);
      std::vector<char> flipped(n, 0);
      std::uniform_int_distribution<std::size_t> pick(0, n - 1);
      std::uniform_int_distribution<std::size_t> bit(0, 8 * esize - 1);
      double d2 = 0;
      for (std::size_t done = 0; done < n;) {
        std::size_t i = pick(rng);
        while (flipped[i]) i = (i + 1) % n;  // the next element not flipped yet
        flipped[i] = 1;
        ++done;
        const double before = fault_detail::element(dtype, p, i);
        const std::size_t b = bit(rng);
        p[i * esize + b / 8] ^= std::byte{static_cast<unsigned char>(1u << (b % 8))};
        const double after = fault_detail::element(dtype, p, i);
        if (!std::isfinite(after)) break;  // inf or NaN: ||delta|| = inf
        d2 += (after - before) * (after - before);
        if (d2 >= target2 && d2 > 0) break;
      }
      return true;  // a flipped bit always changes the element
    }
    case FaultKind::Replay: {
      if (previous.size() != x.size() || previous.empty()) return false;
      const bool changed = std::memcmp(previous.data(), p, x.size()) != 0;
      std::memcpy(p, previous.data(), x.size());
      return changed;
    }
    case FaultKind::Drift: {
      if (!f32) return false;
      const double norm = std::sqrt(fault_detail::squared_norm(dtype, x));
      if (norm == 0 || !std::isfinite(norm)) return false;
      const auto u = fault_detail::drift_direction(spec.seed, n);
      double u2 = 0;
      for (double v : u) u2 += v * v;
      const double ramp = std::min(1.0, static_cast<double>(drift_step + 1) / spec.drift_ramp);
      const double a = m * norm * ramp / std::sqrt(u2);
      for (std::size_t i = 0; i < n; ++i)
        fault_detail::set_f32(p, i, static_cast<float>(fault_detail::get_f32(p, i) + a * u[i]));
      return true;
    }
  }
  return false;
}

/// apply_fault on an f32 payload (the form offline evaluation uses).
/// @throws brigade::Error{InvalidArgument} for a bad spec
inline bool apply_fault(const FaultSpec& spec, std::span<float> x, std::mt19937_64& rng,
                        std::span<const float> previous, std::int64_t drift_step) {
  return apply_fault(spec, DType::F32, std::as_writable_bytes(x), rng, std::as_bytes(previous),
                     drift_step);
}

/// One fault a FaultInjectingTransport injected.
struct InjectionRecord {
  int from = -1;                        ///< sending rank (this decorator's)
  int to = -1;                          ///< receiving rank
  MessageKind kind = MessageKind::Control;  ///< the message's kind
  std::int64_t microbatch = 0;          ///< header.microbatch
  std::int64_t stage = 0;               ///< header.stage
  std::int64_t chunk = 0;               ///< header.chunk
  /// The message's number among the (to, kind) messages this sender sent, from 0 (what
  /// VerdictRecord::index counts on the receiving side when messages arrive in order).
  std::int64_t index = 0;
  double relative_change = 0;           ///< ||corrupted - clean|| / ||clean|| (inf: non-finite)
};

/// Corrupts chosen outgoing payloads (FaultSpec) on the sending side, as a Byzantine rank or a
/// faulty link would: the inner transport sends a corrupted copy, the caller's buffer is left as
/// it is. A copy lives until its send completes through this decorator's wait or test (or as long
/// as the caller keeps the Request). Replay keeps one clean copy per stream (receiving rank,
/// kind, stage, byte size). Everything else is forwarded. Not thread-safe, as the transports.
template <Transport Inner>
class FaultInjectingTransport : public ForwardingTransport<Inner> {
 public:
  /// @throws brigade::Error{InvalidArgument} for a bad spec (validate), or a sending rank or peer
  ///         outside the inner transport's world (the spec would never corrupt anything)
  FaultInjectingTransport(Inner& inner, FaultSpec spec)
      : ForwardingTransport<Inner>(inner), spec_(validated(std::move(spec))), rng_(spec_.seed) {
    const int world = inner.world_size();
    for (int r : spec_.ranks)
      BRIGADE_CHECK(r < world, Errc::InvalidArgument,
                    "fault spec: rank = {}, but the pipeline has ranks 0 to {}", r, world - 1);
    BRIGADE_CHECK(spec_.peer == kAny || (spec_.peer >= 0 && spec_.peer < world),
                  Errc::InvalidArgument, "fault spec: peer = {}, but the pipeline has ranks 0 to {}",
                  spec_.peer, world - 1);
  }

  /// Sends a corrupted copy when the message is chosen, its header marked kFlagInjected (the
  /// experiment's ground truth; no check reads it), else forwards.
  /// @throws brigade::Error as the inner isend
  Request isend(int peer, int tag, const MessageHeader& header, ConstBytes payload) {
    const std::int64_t index = count(peer, header.kind)++;
    if (!candidate(peer, header)) return this->inner_->isend(peer, tag, header, payload);
    const bool replay = spec_.kind == FaultKind::Replay;
    const std::vector<std::byte>* previous = nullptr;
    if (replay) {
      auto [it, fresh] = first_.try_emplace(
          std::tuple(peer, static_cast<int>(header.kind), header.stage, payload.size()));
      if (fresh) it->second.assign(payload.begin(), payload.end());
      else previous = &it->second;
    }
    if (!coin_(rng_) || (replay && previous == nullptr))
      return this->inner_->isend(peer, tag, header, payload);
    auto w = std::make_shared<InFlight>();
    w->copy.assign(payload.begin(), payload.end());
    const bool changed =
        apply_fault(spec_, header.dtype, MutableBytes(w->copy), rng_,
                    previous ? ConstBytes(*previous) : ConstBytes(), drift_steps_);
    if (!changed) return this->inner_->isend(peer, tag, header, payload);
    if (spec_.kind == FaultKind::Drift) ++drift_steps_;
    injected_.push_back({this->rank(), peer, header.kind, header.microbatch, header.stage,
                         header.chunk, index,
                         relative_change(header.dtype, payload, ConstBytes(w->copy))});
    // The ground truth travels with the message (kFlagInjected), for the receiving side's tally.
    MessageHeader marked = header;
    marked.flags |= kFlagInjected;
    w->inner = this->inner_->isend(peer, tag, marked, ConstBytes(w->copy));
    inflight_.push_back(w.get());
    return Request::posted(false, peer, tag, marked, std::move(w));
  }
  /// As the inner wait; a corrupted send's copy is released when it completes.
  /// @throws brigade::Error as the inner wait
  void wait(Request& r, Deadline deadline) {
    if (r.done) return;
    InFlight* w = ours(r);
    if (w == nullptr) return this->inner_->wait(r, deadline);
    this->inner_->wait(w->inner, deadline);
    release(r, w);
  }
  /// As the inner test; a corrupted send's copy is released when it completes.
  /// @throws brigade::Error as the inner test
  bool test(Request& r) {
    if (r.done) return true;
    InFlight* w = ours(r);
    if (w == nullptr) return this->inner_->test(r);
    if (!this->inner_->test(w->inner)) return false;
    release(r, w);
    return true;
  }

  /// The faults injected so far, in the order they were sent.
  [[nodiscard]] const std::vector<InjectionRecord>& injected() const noexcept { return injected_; }
  /// The spec.
  [[nodiscard]] const FaultSpec& spec() const noexcept { return spec_; }

 private:
  struct InFlight {
    Request inner;                // the inner transport's send of the copy
    std::vector<std::byte> copy;  // the corrupted payload
  };
  static FaultSpec validated(FaultSpec s) {
    validate(s);
    return s;
  }
  [[nodiscard]] InFlight* ours(const Request& r) const {
    if (r.is_recv || !r.state) return nullptr;
    auto it = std::find(inflight_.begin(), inflight_.end(), r.state.get());
    return it == inflight_.end() ? nullptr : *it;
  }
  void release(Request& r, InFlight* w) {
    inflight_.erase(std::find(inflight_.begin(), inflight_.end(), w));
    r.done = true;
    r.state.reset();
  }
  [[nodiscard]] bool candidate(int peer, const MessageHeader& h) const {
    const bool f32_only = spec_.kind == FaultKind::Noise || spec_.kind == FaultKind::Scale ||
                          spec_.kind == FaultKind::Sign || spec_.kind == FaultKind::Drift;
    return (spec_.max_faults < 0 ||
            static_cast<std::int64_t>(injected_.size()) < spec_.max_faults) &&
           std::find(spec_.kinds.begin(), spec_.kinds.end(), h.kind) != spec_.kinds.end() &&
           (spec_.ranks.empty() ||
            std::find(spec_.ranks.begin(), spec_.ranks.end(), this->rank()) != spec_.ranks.end()) &&
           (spec_.peer == kAny || spec_.peer == peer) &&
           (spec_.microbatch == kAny || spec_.microbatch == h.microbatch) &&
           (spec_.chunk == kAny || spec_.chunk == h.chunk) && (!f32_only || is_float_dtype(h.dtype)) &&
           h.nbytes() > 0;
  }
  std::int64_t& count(int peer, MessageKind kind) { return sent_[{peer, static_cast<int>(kind)}]; }

  FaultSpec spec_;
  std::mt19937_64 rng_;
  std::bernoulli_distribution coin_{spec_.rate};
  std::int64_t drift_steps_ = 0;
  std::map<std::pair<int, int>, std::int64_t> sent_;  // (to, kind) -> messages sent
  std::map<std::tuple<int, int, std::int64_t, std::size_t>, std::vector<std::byte>> first_;
  std::vector<InFlight*> inflight_;  // corrupted sends not completed yet (owned by their Request)
  std::vector<InjectionRecord> injected_;
};

}  // namespace v0
}  // namespace brigade::transport
