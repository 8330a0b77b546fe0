// The fault-injection scenario of transport/decorators.hpp, run by every rank of any Transport
// (threads in tests/model/test_generate_on.cpp, processes in tests/mpi/test_mpi_decorators.cpp):
// stories260K generates through generate_on with every rank checking each received activation
// (finite and within +-1e4); first cleanly, then with rank 0 flipping one bit of one activation
// of micro-batch 1. The checking decorator on rank 1 must reject it, naming itself, rank 0, the
// kind and the micro-batch; every other rank must stop with Aborted quoting that (no hang).
#pragma once

#include <brigade/engine/distributed.hpp>
#include <brigade/transport/decorators.hpp>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace brigade::test {

/// The tag of the scenario's own message (rank 1 tells rank 0 which element to flip); no engine
/// uses it.
inline constexpr int kTagFlipElement = 40;

/// The activation check: every value finite and within +-1e4 (stories260K's hidden states stay
/// far inside; a flipped top exponent bit of a value in (1e-3, 2) makes it > 3e35).
inline std::optional<std::string> bounded_activations(transport::ConstBytes p) {
  for (std::size_t i = 0; i + sizeof(float) <= p.size(); i += sizeof(float)) {
    float v = 0.0f;
    std::memcpy(&v, p.data() + i, sizeof v);
    if (!std::isfinite(v) || std::fabs(v) > 1e4f)
      return fmt::format("element {} = {} outside [-1e4, 1e4]", i / sizeof(float), v);
  }
  return std::nullopt;
}

/// What one rank saw.
struct FlipOutcome {
  std::vector<engine::SequenceResult> clean;  ///< the clean run's sequences (stage 0's rank)
  std::int64_t clean_inspected = 0;  ///< activations this rank checked in the clean run
  std::int64_t element = -1;         ///< the element rank 0 flipped (ranks 0 and 1)
  int corrupted = 0;                 ///< messages this rank corrupted
  bool threw = false;                ///< the corrupted run threw
  Errc code = Errc::Internal;        ///< its error code
  std::string what;                  ///< its message
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

  // 1. Clean: every activation passes the check; rank 1 keeps micro-batch 1's first one.
  std::vector<float> first;
  InspectingTransport<T> clean(t, MessageKind::Activation,
                               [&](const MessageHeader& h, int from, ConstBytes p) {
                                 if (h.microbatch == 1 && h.chunk == 0 && from == 0 && first.empty()) {
                                   first.resize(p.size() / sizeof(float));
                                   std::memcpy(first.data(), p.data(), p.size());
                                 }
                                 return bounded_activations(p);
                               });
  out.clean = engine::generate_on(clean, weights, part, req, opt).sequences;
  out.clean_inspected = clean.inspected();

  // 2. Rank 1 picks an element whose top exponent bit flip the check must see: |x| in (1e-3, 2).
  const auto one = MessageHeader::make(0, 0, DType::I32, {1});
  std::int32_t element = -1;
  if (t.rank() == 1) {
    for (std::size_t i = 0; i < first.size() && element < 0; ++i)
      if (std::fabs(first[i]) > 1e-3f && std::fabs(first[i]) < 2.0f)
        element = static_cast<std::int32_t>(i);
    auto s = t.isend(0, kTagFlipElement, one, as_bytes(std::span<const std::int32_t>(&element, 1)));
    t.wait(s, Deadline::after(30));
  } else if (t.rank() == 0) {
    auto r = t.irecv(1, kTagFlipElement, one,
                     as_writable_bytes(std::span<std::int32_t>(&element, 1)));
    t.wait(r, Deadline::after(30));
  }
  out.element = element;

  // 3. Corrupted: rank 0 flips bit 30 of that element of micro-batch 1's first activation.
  CorruptionSpec spec;
  spec.kind = MessageKind::Activation;
  spec.microbatch = 1;
  spec.chunk = 0;
  spec.rank = 0;
  spec.how = Corruption::FlipBit;
  spec.element = element < 0 ? 0 : element;
  spec.bit = 30;
  CorruptingTransport<T> bad(t, spec);
  InspectingTransport<CorruptingTransport<T>> checked(
      bad, MessageKind::Activation,
      [](const MessageHeader&, int, ConstBytes p) { return bounded_activations(p); });
  try {
    (void)engine::generate_on(checked, weights, part, req, opt);
  } catch (const Error& e) {
    out.threw = true;
    out.code = e.code();
    out.what = e.what();
  }
  out.corrupted = bad.corrupted();
  return out;
}

/// The message of the receiving rank's rejection, up to the element ("...: element "), which
/// every rank's error quotes.
inline std::string flip_rejection_prefix() {
  return fmt::format("rank 1: rejected the activation message from rank 0 for micro-batch 1 "
                     "(stage 1, chunk 0, tag {}): element ",
                     engine::detail::kTagActivation);
}

/// The checks every rank makes on its outcome.
inline void check_flip_outcome(const FlipOutcome& o, int rank) {
  CAPTURE(rank);
  INFO("message: " << o.what);
  if (rank == 0) CHECK(o.clean_inspected == 0);  // stage 0 receives tokens, not activations
  if (rank >= 1) CHECK(o.clean_inspected > 0);   // the check ran on every received activation
  CHECK(o.threw);
  CHECK(o.corrupted == (rank == 0 ? 1 : 0));
  if (rank == 1)
    CHECK(o.code == Errc::Rejected);
  else
    CHECK(o.code == Errc::Aborted);  // stopped by rank 1's abort, not at a deadline
  // Every rank names the receiving rank, the sender, the kind and the micro-batch.
  CHECK(o.what.find(flip_rejection_prefix()) != std::string::npos);
  if (rank <= 1) {
    CHECK(o.element >= 0);
    CHECK(o.what.find(flip_rejection_prefix() + std::to_string(o.element) + " = ") !=
          std::string::npos);
  }
}

}  // namespace brigade::test
