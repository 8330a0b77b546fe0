// The integrity-check scenario of transport/faults.hpp and transport/verify.hpp, run by every rank
// of any Transport (threads in tests/model/test_generate_on.cpp, processes in
// tests/mpi/test_mpi_decorators.cpp): stories260K generates through generate_on with every rank
// verifying each received activation (VerifyingTransport, SENTINEL monitors, policy Stop); first
// cleanly (no message may be flagged), then with rank 0 flipping bits in one decode activation of
// micro-batch 1 (FaultInjectingTransport, bitflip of magnitude 1: bits flipped until the change
// is at least the payload's norm). The verifier on rank 1 must reject it, naming itself, rank 0,
// the kind and the micro-batch; every other rank must stop with Aborted quoting that (no hang).
#pragma once

#include <brigade/engine/distributed.hpp>
#include <brigade/transport/faults.hpp>
#include <brigade/transport/verify.hpp>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <string>
#include <vector>

namespace brigade::test {

/// The decode round (header chunk) whose activation of micro-batch 1 rank 0 corrupts: late
/// enough that rank 1's monitor of that stream is past its warm-up and calibration.
inline constexpr std::int64_t kFlipRound = 40;

/// What one rank saw.
struct FlipOutcome {
  std::vector<engine::SequenceResult> clean;  ///< the clean run's sequences (stage 0's rank)
  std::int64_t clean_checked = 0;   ///< activations this rank checked in the clean run
  std::int64_t clean_flagged = 0;   ///< of which flagged (must be 0)
  std::vector<transport::InjectionRecord> injected;  ///< faults this rank injected
  bool threw = false;               ///< the corrupted run threw
  Errc code = Errc::Internal;       ///< its error code
  std::string what;                 ///< its message
};

/// Runs the scenario on this rank of `t` (world >= 2, one stage per rank).
template <transport::Transport T>
FlipOutcome flip_one_activation(T& t, const model::LlamaWeights& weights,
                                std::span<const engine::GenerationRequest> req,
                                const engine::InferenceOptions& opt) {
  using namespace transport;
  const partition::Partition part =
      partition::uniform(model::ModelSpec(weights.config), t.world_size());
  FlipOutcome out;

  // 1. Clean: the verifier checks every activation and flags none.
  VerifyingTransport<T> clean(t, SentinelConfig{}, VerifyPolicy::Stop, {MessageKind::Activation});
  out.clean = engine::generate_on(clean, weights, part, req, opt).sequences;
  out.clean_checked = clean.checked();
  out.clean_flagged = clean.flagged();

  // 2. Corrupted: rank 0 flips bits of micro-batch 1's activation of decode round kFlipRound.
  FaultSpec spec;
  spec.kind = FaultKind::BitFlip;
  spec.magnitude = 1.0;
  spec.ranks = {0};
  spec.kinds = {MessageKind::Activation};
  spec.microbatch = 1;
  spec.chunk = kFlipRound;
  spec.max_faults = 1;
  spec.seed = 17;
  FaultInjectingTransport<T> bad(t, spec);
  VerifyingTransport<FaultInjectingTransport<T>> checked(bad, SentinelConfig{}, VerifyPolicy::Stop,
                                                         {MessageKind::Activation});
  try {
    (void)engine::generate_on(checked, weights, part, req, opt);
  } catch (const Error& e) {
    out.threw = true;
    out.code = e.code();
    out.what = e.what();
  }
  out.injected = bad.injected();
  return out;
}

/// The start of the receiving rank's rejection, which every rank's error quotes.
inline std::string flip_rejection_prefix() {
  return fmt::format("rank 1: rejected the activation message from rank 0 for micro-batch 1 "
                     "(stage 1, chunk {}, tag {}): integrity check: score ",
                     kFlipRound, engine::detail::kTagActivation);
}

/// The checks every rank makes on its outcome.
inline void check_flip_outcome(const FlipOutcome& o, int rank) {
  CAPTURE(rank);
  INFO("message: " << o.what);
  if (rank == 0) CHECK(o.clean_checked == 0);  // stage 0 receives tokens, not activations
  if (rank >= 1) CHECK(o.clean_checked > 2 * kFlipRound);  // every received activation
  CHECK(o.clean_flagged == 0);                             // no false alarm on the clean run
  CHECK(o.threw);
  REQUIRE(o.injected.size() == (rank == 0 ? 1u : 0u));
  if (rank == 0) {
    const auto& f = o.injected[0];
    CHECK(f.from == 0);
    CHECK(f.to == 1);
    CHECK(f.kind == transport::MessageKind::Activation);
    CHECK(f.microbatch == 1);
    CHECK(f.chunk == kFlipRound);
    CHECK(f.relative_change >= 1.0);  // bitflip of magnitude 1: at least the payload's norm
  }
  if (rank == 1)
    CHECK(o.code == Errc::Rejected);
  else
    CHECK(o.code == Errc::Aborted);  // stopped by rank 1's abort, not at a deadline
  // Every rank names the receiving rank, the sender, the kind, the micro-batch and the score.
  CHECK(o.what.find(flip_rejection_prefix()) != std::string::npos);
}

}  // namespace brigade::test
