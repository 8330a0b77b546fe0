// --verify and --inject of `brigade train` and `brigade generate`: each rank's transport wrapped
// in a FaultInjectingTransport (its sends, when --inject picks the rank) under a
// VerifyingTransport (its receives, SENTINEL's monitors), the per-step counts for the metrics,
// the verdicts as Timeline marks, and the closing verdict report (docs/integrity.md).
#pragma once

#include <CLI/CLI.hpp>

#include <brigade/core/error.hpp>
#include <brigade/core/timeline.hpp>
#include <brigade/transport/faults.hpp>
#include <brigade/transport/verify.hpp>

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

namespace brigade::cli {

/// The integrity flags of a command.
struct IntegrityArgs {
  std::string verify;  ///< "" (no checks), log, drop, stop or quarantine
  std::string inject;  ///< "" or KIND:MAGNITUDE:RATE[:rank=R][:seed=S]
  double fpr = 1e-3;   ///< SentinelConfig::target_fpr
  double threshold = 0.0;  ///< SentinelConfig::threshold (0: calibrated online)

  /// Adds --verify, --inject, --verify-fpr and --verify-threshold to `sub`; `training` allows
  /// the drop policy.
  void add_options(CLI::App& sub, bool training) {
    sub.add_option("--verify", verify,
                   training ? "integrity checks of received activations and gradients "
                              "(SENTINEL; docs/integrity.md) and what a flagged message does: "
                              "log, drop (its micro-batch, on every rank), stop, quarantine"
                            : "integrity checks of received activations and tokens (SENTINEL; "
                              "docs/integrity.md) and what a flagged message does: log, stop, "
                              "quarantine")
        ->check(CLI::IsMember(training ? std::vector<std::string>{"log", "drop", "stop", "quarantine"}
                                       : std::vector<std::string>{"log", "stop", "quarantine"}));
    sub.add_option("--inject", inject,
                   "fault injection on the sending side, KIND:MAGNITUDE:RATE[:rank=R][:seed=S]: KIND "
                   "noise, scale, sign, zero, bitflip, replay or drift; MAGNITUDE relative to the "
                   "payload's norm; RATE the share of messages corrupted");
    sub.add_option("--verify-fpr", fpr,
                   "false-positive rate the calibrated threshold aims at, per checked message")
        ->capture_default_str();
    sub.add_option("--verify-threshold", threshold,
                   "a fixed deviation-score threshold instead of the calibrated one (0 = calibrated)")
        ->capture_default_str();
  }
  /// True when any integrity flag is in use.
  [[nodiscard]] bool active() const noexcept { return !verify.empty() || !inject.empty(); }
  /// Checks --inject before any work (its errors name the spec's field), and says on stderr when
  /// faults are injected with no check to see them.
  /// @throws brigade::Error{InvalidArgument} for a bad --inject
  void check(bool print) const {
    if (inject.empty()) return;
    (void)transport::parse_fault_spec(inject);
    if (verify.empty() && print)
      fmt::print(stderr, "brigade: notice: --inject without --verify: the corrupted messages are "
                         "delivered unchecked\n");
  }
};

/// `text` with "rank R: " before each line (what a process under mpirun prints).
inline std::string with_rank(const std::string& text, int rank) {
  std::string out;
  for (std::size_t at = 0, end; at < text.size(); at = end + 1) {
    end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    out += fmt::format("rank {}: {}\n", rank, text.substr(at, end - at));
  }
  return out;
}

/// What the integrity decorators counted.
struct IntegrityCounts {
  std::int64_t checked = 0;   ///< messages a monitor scored
  std::int64_t flagged = 0;   ///< of those, flagged
  std::int64_t injected = 0;  ///< messages corrupted by --inject
  std::int64_t caught = 0;    ///< flagged messages that were corrupted (kFlagInjected)
};

/// The decorator stacks of this process's ranks over `Base` endpoints (kept for the whole run:
/// the monitors learn across steps). With no --verify the verifier checks no kind; with no
/// --inject the injector picks no message: both then only forward.
template <transport::Transport Base>
class IntegrityStack {
 public:
  using Injector = transport::FaultInjectingTransport<Base>;
  using Verifier = transport::VerifyingTransport<Injector>;

  /// @param kinds the message kinds the monitors check (activations and gradients in training;
  ///        activations and tokens in generation)
  /// @param token_limit ids of Token payloads must be below it (the vocabulary)
  /// @throws brigade::Error{InvalidArgument} for a bad --inject or --verify value (naming it)
  IntegrityStack(std::span<Base> bases, const IntegrityArgs& a,
                 std::vector<transport::MessageKind> kinds, std::int64_t token_limit) {
    transport::FaultSpec spec;
    if (!a.inject.empty()) {
      spec = transport::parse_fault_spec(a.inject);
      spec.kinds = kinds;
      std::erase(spec.kinds, transport::MessageKind::Token);  // tokens: bitflip/zero/replay only
      if (spec.kind == transport::FaultKind::BitFlip || spec.kind == transport::FaultKind::Zero ||
          spec.kind == transport::FaultKind::Replay)
        spec.kinds = kinds;
    } else {
      spec.max_faults = 0;  // picks no message
    }
    transport::SentinelConfig cfg;
    cfg.target_fpr = a.fpr;
    cfg.threshold = a.threshold;
    cfg.token_limit = token_limit;
    const auto policy = a.verify.empty() ? transport::VerifyPolicy::Log
                                         : transport::parse_verify_policy(a.verify);
    if (a.verify.empty()) kinds.clear();
    verifiers_.reserve(bases.size());
    for (auto& b : bases) {
      auto& inj = injectors_.emplace_back(b, spec);
      verifiers_.emplace_back(inj, cfg, policy, kinds);
    }
  }
  IntegrityStack(const IntegrityStack&) = delete;
  IntegrityStack& operator=(const IntegrityStack&) = delete;

  /// The row keys of the step to come (VerifyingTransport::expect): each micro-batch's input
  /// ids key its activation rows and its target ids its gradient rows, from the data every rank
  /// reads.
  template <class Batch>
  void expect(std::span<const Batch> batches) {
    for (auto& v : verifiers_) v.expect(transport::row_keys(batches));
  }

  /// The outermost transports, one per rank of this process.
  std::span<Verifier> transports() noexcept { return verifiers_; }

  /// Totals over this process's ranks so far.
  /// Totals over this process's ranks so far: messages checked and flagged by its verifiers
  /// (caught: flagged ones that carried kFlagInjected), messages corrupted by its injectors.
  /// Under mpirun a corrupted message is counted by the sender's process and caught by the
  /// receiver's: sum the counts over the processes.
  [[nodiscard]] IntegrityCounts counts() const {
    IntegrityCounts c;
    for (const auto& v : verifiers_) {
      c.checked += v.checked();
      c.flagged += v.flagged();
      for (const auto& r : v.verdicts()) c.caught += r.flagged && r.injected ? 1 : 0;
    }
    for (const auto& inj : injectors_) c.injected += static_cast<std::int64_t>(inj.injected().size());
    return c;
  }

  /// Adds a mark per verdict given since the last call to `tl` (whose 0 is `origin`), on the
  /// receiving rank's row: "flagged" or "checked", with the kind, sender, micro-batch, score and
  /// threshold.
  void mark(Timeline& tl, std::chrono::steady_clock::time_point origin) {
    marked_.resize(verifiers_.size(), 0);
    for (std::size_t i = 0; i < verifiers_.size(); ++i) {
      const auto& vs = verifiers_[i].verdicts();
      for (std::size_t k = marked_[i]; k < vs.size(); ++k) {
        const auto& r = vs[k];
        if (r.to < 0 || r.to >= tl.num_ranks()) continue;
        tl.add_mark({r.to, std::chrono::duration<double>(r.at - origin).count(),
                     r.flagged ? "flagged" : "checked",
                     fmt::format("{} from rank {} mb {} stage {}: score {:.3g}, threshold {:.3g}{}",
                                 transport::to_string(r.kind), r.from, r.microbatch, r.stage,
                                 r.score, r.threshold, r.reason.empty() ? "" : "; " + r.reason)});
      }
      marked_[i] = vs.size();
    }
  }

  /// One line per (sender, receiver, kind) stream this process checked: messages, flagged, the
  /// highest score after the monitor's warm-up and the last threshold; then what --inject did
  /// and how much of it was caught.
  [[nodiscard]] std::string report() const {
    struct Row {
      std::int64_t checked = 0, flagged = 0;
      double max_score = 0.0, threshold = 0.0;
    };
    std::map<std::tuple<int, int, int>, Row> rows;
    for (const auto& v : verifiers_)
      for (const auto& r : v.verdicts()) {
        auto& row = rows[{r.from, r.to, static_cast<int>(r.kind)}];
        ++row.checked;
        row.flagged += r.flagged ? 1 : 0;
        // The highest score after the warm-up (a verdict with a finite threshold), or a flag.
        if (std::isfinite(r.threshold) || r.flagged)
          row.max_score = std::isfinite(r.score) ? std::max(row.max_score, r.score) : r.score;
        if (std::isfinite(r.threshold)) row.threshold = r.threshold;
      }
    std::string out;
    for (const auto& [key, row] : rows)
      out += fmt::format("verify: {} rank {} -> {}: {} checked, {} flagged, highest score after "
                         "warm-up {:.3g}, threshold {:.3g}\n",
                         transport::to_string(static_cast<transport::MessageKind>(std::get<2>(key))),
                         std::get<0>(key), std::get<1>(key), row.checked, row.flagged,
                         row.max_score, row.threshold);
    const auto c = counts();
    if (c.injected > 0)
      out += fmt::format("inject: {} messages corrupted, {} of them flagged ({:.1f}%); {} "
                         "flagged messages were clean\n",
                         c.injected, c.caught,
                         100.0 * static_cast<double>(c.caught) / static_cast<double>(c.injected),
                         c.flagged - c.caught);
    return out;
  }

 private:
  std::deque<Injector> injectors_;  // deque: a verifier points at its injector
  std::vector<Verifier> verifiers_;
  std::vector<std::size_t> marked_;
};

}  // namespace brigade::cli
