// SENTINEL integrity checks of inter-stage traffic (issue 17): momentum (EMA) statistics of every
// received activation, gradient and token stream, a deviation score per message, a threshold
// calibrated online to a target false-positive rate, and a policy for a flagged message.
//
// Sources: SENTINEL (Dolatabadi et al., "SENTINEL: Stagewise Integrity Verification for Pipeline
// Parallel Decentralized Training", arXiv 2603.03592, 2026): EMA monitors of the tensors each
// pipeline edge carries, verified on the receiving side without duplicating computation; the
// threshold calibration follows SPOT (Siffer et al., "Anomaly Detection in Streams with Extreme
// Value Theory", KDD 2017): a peaks-over-threshold generalized Pareto fit of the score tail.
// docs/integrity.md describes the method, the policies and the faults of transport/faults.hpp.
//
// @code
//   VerifyingTransport checked(base, SentinelConfig{}, VerifyPolicy::Drop);
//   engine::generate_on(checked, weights, partition, requests);
//   fmt::print("{} of {} messages flagged\n", checked.flagged(), checked.checked());
// @endcode
#pragma once

#include "brigade/transport/decorators.hpp"

#include <Eigen/Core>
#include <Eigen/Eigenvalues>
#include <Eigen/QR>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

namespace brigade::transport {
inline namespace v0 {

/// Settings of the SENTINEL monitors (one SentinelMonitor per stream; VerifyingTransport).
struct SentinelConfig {
  /// EMA momentum beta of the statistics' mean and variance, in (0, 1): each learned message
  /// moves them by (1 - beta) (by 1/n for the n-th message while 1/n > 1 - beta, so the first
  /// messages are averaged plainly instead of being pulled towards zero).
  double decay = 0.99;
  /// EMA momentum of each row key's reference (its mean row and log RMS), in (0, 1): the n-th
  /// learned message holding the key moves it by max(1 - key_decay, 1/n) (SentinelMonitor).
  double key_decay = 0.9;
  /// Messages a monitor learns from before it gives verdicts (>= 1); a non-finite payload is
  /// flagged even then. The calibrated threshold also needs 8 scores (collected from the
  /// ceil(warmup / 2)-th learned message on), so with warmup < 16 verdicts start a little later.
  int warmup = 16;
  /// False-positive rate the calibrated threshold aims at, in (0, 0.5).
  double target_fpr = 1e-3;
  /// A fixed score threshold (> 0), or 0: calibrated online (SentinelMonitor).
  double threshold = 0.0;
  /// Token (i32) payloads: every id must lie in [0, token_limit); 0 = no range check (>= 0).
  std::int64_t token_limit = 0;
  /// Float payloads: how many recent payloads of each stream ReplayGuard remembers (by a 64-bit
  /// hash of their bytes); a payload equal to one of them is flagged as a replay. 0 = no replay
  /// check (>= 0). 16 bytes per remembered payload.
  std::int64_t replay_memory = 4096;
  /// Learning gate, in (0, 1]: a message not flagged is learned only when every statistic's
  /// score is at most this share of its threshold in force (Assessment::learnable). A sender
  /// corrupting a share of its messages by less than the threshold would otherwise be learned:
  /// its faults widen the EMA variance (at 10% of messages, enough to hide themselves: z
  /// saturates near 1 / sqrt(rate)) and pull the key references. 1 = learn every message not
  /// flagged.
  double learn_below = 0.5;
  /// Message kinds whose streams score minor-share (SentinelMonitor, MinorSubspace), as
  /// VerifyingTransport keys its streams: gradients by default. It catches noise and sign flips
  /// in rows without a usual direction per token (stories260K's gradients: 86-90% of those of
  /// the payload's norm, against 1-26% without it); activations have one, which key-cos reads,
  /// and on the 42M shape's activations, whose distribution moves from step to step in the
  /// first hundred steps of training, it flagged 3.7-7.5% of clean messages (docs/integrity.md).
  std::vector<MessageKind> minor_share_kinds = {MessageKind::Gradient};
};

/// Checks a SentinelConfig's fields.
/// @throws brigade::Error{InvalidArgument} naming the field, its value and the range
inline void validate(const SentinelConfig& c) {
  BRIGADE_CHECK(c.decay > 0 && c.decay < 1, Errc::InvalidArgument,
                "sentinel config: decay = {}, expected in (0, 1)", c.decay);
  BRIGADE_CHECK(c.key_decay > 0 && c.key_decay < 1, Errc::InvalidArgument,
                "sentinel config: key_decay = {}, expected in (0, 1)", c.key_decay);
  BRIGADE_CHECK(c.warmup >= 1, Errc::InvalidArgument,
                "sentinel config: warmup = {}, expected >= 1", c.warmup);
  BRIGADE_CHECK(c.target_fpr > 0 && c.target_fpr < 0.5, Errc::InvalidArgument,
                "sentinel config: target_fpr = {}, expected in (0, 0.5)", c.target_fpr);
  BRIGADE_CHECK(std::isfinite(c.threshold) && c.threshold >= 0, Errc::InvalidArgument,
                "sentinel config: threshold = {}, expected > 0 (fixed) or 0 (calibrated)",
                c.threshold);
  BRIGADE_CHECK(c.token_limit >= 0, Errc::InvalidArgument,
                "sentinel config: token_limit = {}, expected >= 0 (0: no range check)",
                c.token_limit);
  BRIGADE_CHECK(c.replay_memory >= 0, Errc::InvalidArgument,
                "sentinel config: replay_memory = {}, expected >= 0 (0: no replay check)",
                c.replay_memory);
  BRIGADE_CHECK(c.learn_below > 0 && c.learn_below <= 1, Errc::InvalidArgument,
                "sentinel config: learn_below = {}, expected in (0, 1]", c.learn_below);
}

/// What a SentinelMonitor says about one message.
struct Assessment {
  /// The deviation score: the largest of the statistics' scores (SentinelMonitor); +inf for a
  /// payload with non-finite values; 0 before the monitor has learned two messages.
  double score = 0;
  /// The threshold in force: +inf during warm-up (and, calibrated, until 8 scores are known).
  double threshold = std::numeric_limits<double>::infinity();
  bool flagged = false;         ///< score > threshold, or non-finite values
  /// Not flagged, and every statistic's score at most config.learn_below times its threshold
  /// (always during warm-up): the monitor may learn the message (observe() does).
  bool learnable = false;
  const char* statistic = "";   ///< name of the statistic with the largest score
  std::string reason;           ///< empty unless flagged: which statistic deviated, by how much
};

/// The minor subspace of one stream's rows, for SentinelMonitor's "minor-share" statistic: the
/// least-variance directions of the rows' learned covariance, and how much more of a message's
/// energy lies in them than of the stream's recent messages'. This is the squared prediction
/// error (Q statistic) of multivariate statistical process control (J. E. Jackson and G. S.
/// Mudholkar, "Control Procedures for Residuals Associated With Principal Component Analysis",
/// Technometrics 21(3), 1979): clean rows put little energy in their stream's minor directions,
/// while noise (isotropic), sign flips and zeroed elements of a share of the elements spread
/// energy over every direction. It needs no usual direction per row, so it sees these faults in
/// gradients, whose rows have none per token, and in activations; scaling keeps every direction
/// and does not move it.
///
/// Rows are projected onto at most kDims dimensions first (a fixed random orthonormal [cols, p]
/// projection P, seeded by the width; none when cols <= kDims), which bounds the covariance to
/// p^2 doubles and its eigendecomposition to about 18 ms (p = 256, a 2-core Zen 5).
///
/// **Recent messages.** record() keeps up to kRows rows of a message (evenly strided) in a ring
/// of the kRecent newest, with its log share of energy in the minor subspace and whether it was
/// learned (SentinelMonitor records every message it does not flag, learned or not). A clean
/// message leaving the ring teaches the
/// covariance: its rows, normalized to unit length (a direction, whatever its norm: a training
/// run's gradients shrink by an e-fold in their first hundred messages), enter an EMA of their
/// second moment C [p, p] (momentum kDecay per kRows rows; plain averaging while the rows so far
/// are fewer). Once kFirstMessages messages were learned and C has learned kRefreshRows p rows,
/// and every kRefreshRows p rows after that, its eigendecomposition gives the basis V, its
/// p / kPart least-variance eigenvectors (B = P V [cols, k] in the stream's coordinates), and
/// the ring's shares are recomputed under it.
///
/// **The statistic** is relative: log(sum_r ||B' x_r||^2 / sum_r ||x_r||^2) of the message minus
/// the median of the same log share over the ring's messages of at least kMinRows rows. A basis
/// fitted to C goes stale as a training run changes its stream, and a training step moves every
/// message after it at once (on the 42M shape's activations, the 8 micro-batches of step 11
/// held 5.8 times the minor share of a reference that had stopped learning); the ring moves
/// with the stream, so the difference stays level across steps, drift and refreshes. The ring
/// holds the messages that were not learned too, and the median is what keeps the faults that
/// pass out of the reference: the first version compared against the pooled rows of learned messages only,
/// and a step that moved the stream past the learning gate (half the threshold) froze that
/// reference, so the clean messages after it were flagged until the monitor restarted (3.7-7.5%
/// of the 42M shape's clean activations; tests/unit/test_verify.cpp has such a stream). Each
/// fault in the ring moves the median by at most one rank.
///
/// Memory: p^2 doubles (512 KiB at p = 256), cols * (p + k) and kRecent * kRows * p floats. Not
/// thread-safe.
class MinorSubspace {
 public:
  /// Rows are projected onto at most this many dimensions before their covariance is learned.
  static constexpr std::int64_t kDims = 256;
  /// The minor subspace is the p / kPart least-variance directions (p the projected width).
  static constexpr std::int64_t kPart = 4;
  /// Rows of a message (evenly strided) that the ring records and the covariance learns.
  static constexpr std::int64_t kRows = 32;
  /// SentinelMonitor reads minor-share only of messages of at least this many rows, and the
  /// reference is the median over the ring's messages of as many: one row's share is far from
  /// normal (bounded above by 1, a long tail towards 0), and on a stationary synthetic stream of
  /// [1, 512] messages 1.1% of the clean ones were flagged (bench_checks).
  static constexpr std::int64_t kMinRows = 8;
  /// Messages in the ring of recent messages (two training steps of 8 micro-batches).
  static constexpr std::int64_t kRecent = 16;
  /// The statistic is read once the ring holds this many messages of at least kMinRows rows.
  static constexpr std::int64_t kMinReference = 4;
  /// The first basis needs this many learned messages (and kRefreshRows p rows in C).
  static constexpr std::int64_t kFirstMessages = 32;
  /// Rows the covariance learns between two eigendecompositions, in units of p (1,024 rows at
  /// p = 256: 32 training messages of 32 rows, or 1,024 decode messages of one sequence).
  static constexpr std::int64_t kRefreshRows = 4;
  /// EMA momentum of the covariance per kRows rows (a window of about 200 such messages: an
  /// estimate from few rows puts noise in its least-variance directions, the very ones read).
  static constexpr double kDecay = 0.995;

  /// A subspace for rows of `cols` values (>= 1).
  /// @throws brigade::Error{InvalidArgument} for cols < 1
  explicit MinorSubspace(std::int64_t cols) : cols_(cols) {
    BRIGADE_CHECK(cols >= 1, Errc::InvalidArgument, "MinorSubspace: cols = {}, expected >= 1",
                  cols);
    const std::int64_t p = std::min(cols, kDims);
    if (p < cols) {  // a random orthonormal [cols, p] projection, seeded by the width
      std::mt19937_64 gen(0x5e17e1ULL ^ static_cast<std::uint64_t>(cols));
      std::normal_distribution<double> normal;
      Eigen::MatrixXd g(cols, p);
      for (Eigen::Index j = 0; j < g.cols(); ++j)
        for (Eigen::Index i = 0; i < g.rows(); ++i) g(i, j) = normal(gen);
      const Eigen::MatrixXd q =
          Eigen::HouseholderQR<Eigen::MatrixXd>(g).householderQ() * Eigen::MatrixXd::Identity(cols, p);
      proj_ = q.cast<float>();
    }
    cov_ = Eigen::MatrixXd::Zero(p, p);
    ring_y_.resize(kRecent * kRows, p);
    ring_.resize(static_cast<std::size_t>(kRecent));
  }

  /// Records up to kRows rows (evenly strided) of the message x [rows, cols] (row-major) in the
  /// ring of recent messages, with its log share under the current basis, as clean when
  /// `learned` (the covariance learns its rows when it leaves the ring); all-zero and
  /// non-finite rows are skipped. The oldest message leaves the ring, and teaches the
  /// covariance if it was learned (class docstring; the basis is refreshed when due).
  /// @returns whether the message had a row to record
  /// @throws brigade::Error{InvalidArgument} for rows < 1 or x.size() != rows * cols
  bool record(std::span<const float> x, std::int64_t rows, bool learned) {
    check(x, rows);
    const std::int64_t take = std::min(rows, kRows);
    const RowMajor xm(x.data(), rows, cols_);
    picked_.resize(take, cols_);
    Eigen::Index kept = 0;
    double energy = 0;
    for (std::int64_t i = 0; i < take; ++i) {
      const auto row = xm.row(i * rows / take);
      const double e = static_cast<double>(row.squaredNorm());
      if (!(e > 0) || !std::isfinite(e)) continue;  // nothing to record
      picked_.row(kept++) = row;
      energy += e;
    }
    if (kept == 0) return false;
    Entry& slot = ring_[static_cast<std::size_t>(next_)];
    if (slot.rows > 0 && slot.learned) teach(next_, slot.rows);
    auto y = ring_y_.middleRows(next_ * kRows, kept);
    if (proj_.size() > 0)
      y.noalias() = picked_.topRows(kept) * proj_;
    else
      y = picked_.topRows(kept);
    slot = Entry{kept, energy, std::numeric_limits<double>::quiet_NaN(), learned};
    learned_ += learned ? 1 : 0;  // after teach(): the message counts from the next refresh on
    if (ready_basis()) slot.log_share = entry_share(next_);
    next_ = (next_ + 1) % kRecent;
    return true;
  }

  /// The minor-share statistic of x [rows, cols] (row-major), sum_sq = sum_r ||x_r||^2 (> 0):
  /// log(sum_r ||B' x_r||^2 / sum_sq) minus the median log share of the ring's messages of at
  /// least kMinRows rows (class docstring). One GEMM [rows, cols] x [cols, k].
  /// @throws brigade::Error{InvalidUsage} when not ready();
  ///         brigade::Error{InvalidArgument} for a bad shape or sum_sq <= 0
  double log_share(std::span<const float> x, std::int64_t rows, double sum_sq) {
    BRIGADE_CHECK(ready(), Errc::InvalidUsage,
                  "MinorSubspace::log_share: no basis yet, or fewer than {} recent messages of "
                  ">= {} rows",
                  kMinReference, kMinRows);
    check(x, rows);
    BRIGADE_CHECK(sum_sq > 0, Errc::InvalidArgument,
                  "MinorSubspace::log_share: sum of squares {}, expected > 0", sum_sq);
    z_.noalias() = RowMajor(x.data(), rows, cols_) * basis_;
    return std::log(static_cast<double>(z_.squaredNorm()) / sum_sq + 1e-300) - reference();
  }

  /// Whether log_share can be read: a basis exists and the ring holds at least kMinReference
  /// messages of at least kMinRows rows.
  [[nodiscard]] bool ready() const noexcept {
    if (!ready_basis()) return false;
    std::int64_t n = 0;
    for (const Entry& e : ring_) n += e.rows >= kMinRows && !std::isnan(e.log_share) ? 1 : 0;
    return n >= kMinReference;
  }
  /// Eigendecompositions so far.
  [[nodiscard]] std::int64_t refreshes() const noexcept { return refreshes_; }
  /// Messages recorded as clean (record).
  [[nodiscard]] std::int64_t learned() const noexcept { return learned_; }
  /// The width of the stream's rows.
  [[nodiscard]] std::int64_t cols() const noexcept { return cols_; }
  /// The projected width p (min(cols, kDims)).
  [[nodiscard]] std::int64_t dims() const noexcept { return cov_.rows(); }

 private:
  using RowMajor =
      Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;

  // One message of the ring: rows recorded (in ring_y_'s slot), their energy sum ||x_r||^2,
  // their log share under the current basis (NaN before the first), and whether it was learned.
  struct Entry {
    Eigen::Index rows = 0;
    double energy = 0;
    double log_share = std::numeric_limits<double>::quiet_NaN();
    bool learned = false;
  };

  void check(std::span<const float> x, std::int64_t rows) const {
    BRIGADE_CHECK(rows >= 1 && static_cast<std::int64_t>(x.size()) == rows * cols_,
                  Errc::InvalidArgument, "MinorSubspace: {} values are not a [{}, {}] matrix",
                  x.size(), rows, cols_);
  }

  [[nodiscard]] bool ready_basis() const noexcept { return basis_.size() > 0; }

  // The log share of ring slot s's rows under the current basis.
  double entry_share(std::int64_t s) const {
    const Entry& e = ring_[static_cast<std::size_t>(s)];
    const double minor =
        static_cast<double>((ring_y_.middleRows(s * kRows, e.rows) * basis_p_).squaredNorm());
    return std::log(minor / e.energy + 1e-300);
  }

  // The median log share of the ring's messages of at least kMinRows rows (ready()).
  double reference() {
    shares_.clear();
    for (const Entry& e : ring_)
      if (e.rows >= kMinRows && !std::isnan(e.log_share)) shares_.push_back(e.log_share);
    const auto mid = shares_.begin() + static_cast<std::ptrdiff_t>(shares_.size() / 2);
    std::nth_element(shares_.begin(), mid, shares_.end());
    if (shares_.size() % 2 == 1) return *mid;
    return 0.5 * (*mid + *std::max_element(shares_.begin(), mid));
  }

  // The covariance learns ring slot s's `rows` rows as unit directions; refreshes when due.
  void teach(std::int64_t s, Eigen::Index rows) {
    Eigen::MatrixXd y = ring_y_.middleRows(s * kRows, rows).cast<double>();
    for (Eigen::Index i = 0; i < y.rows(); ++i) y.row(i) /= y.row(i).norm();
    rows_ += rows;
    since_ += rows;
    // Momentum per row: `rows` rows move C as rows / kRows messages of kRows would; plain
    // averaging while the rows so far are fewer than the window.
    const double a =
        std::max(1.0 - std::pow(kDecay, static_cast<double>(rows) / static_cast<double>(kRows)),
                 static_cast<double>(rows) / static_cast<double>(rows_));
    cov_ *= 1 - a;
    cov_.noalias() += (a / static_cast<double>(rows)) * (y.transpose() * y);
    if (since_ < kRefreshRows * cov_.rows() || learned_ < kFirstMessages) return;
    since_ = 0;
    refresh();
  }

  void refresh() {
    const Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> eig(cov_);
    if (eig.info() != Eigen::Success) return;
    const Eigen::Index k = std::max<Eigen::Index>(1, cov_.rows() / kPart);
    basis_p_ = eig.eigenvectors().leftCols(k).cast<float>();  // ascending eigenvalues
    basis_ = proj_.size() > 0 ? (proj_ * basis_p_).eval() : basis_p_;
    for (std::int64_t s = 0; s < kRecent; ++s)  // the ring's messages under the new basis
      if (ring_[static_cast<std::size_t>(s)].rows > 0)
        ring_[static_cast<std::size_t>(s)].log_share = entry_share(s);
    ++refreshes_;
  }

  std::int64_t cols_;
  Eigen::MatrixXf proj_;     // [cols, p], empty when p = cols
  Eigen::MatrixXd cov_;      // [p, p]
  Eigen::MatrixXf basis_p_;  // [p, k]: V, empty before the first refresh
  Eigen::MatrixXf basis_;    // [cols, k]: P V
  // The ring of recent messages: slot s holds its projected rows in rows [s kRows, s kRows +
  // rows) of ring_y_.
  Eigen::MatrixXf ring_y_;
  std::vector<Entry> ring_;
  std::int64_t next_ = 0;
  std::int64_t learned_ = 0, rows_ = 0, since_ = 0, refreshes_ = 0;
  Eigen::MatrixXf picked_, z_;  // scratch
  std::vector<double> shares_;  // scratch
};

/// The EMA statistics of ONE stream of f32 messages [rows, cols] (cols fixed by the first
/// message), after SENTINEL (arXiv 2603.03592): each message is compared with momentum (EMA)
/// references learned from the stream's accepted messages.
///
/// Keyed references. Each row r of a message may carry a key k_r that the RECEIVER knows from
/// trusted data, not from the sender: in training, the input token id of the row for an
/// activation and its target token id for a gradient (every rank of a pipeline reads the same
/// data order: VerifyingTransport::expect). Rows without keys (inference, or no keys given)
/// all share one key. Per key the monitor keeps the EMA of its rows (a reference row, cols
/// floats) and of their log RMS (momentum config.key_decay; the n-th message that holds the key
/// moves them by max(1 - key_decay, 1/n), with the mean of that key's rows in the message; all-
/// zero rows are not learned, and after the key's first message one message moves its log RMS
/// by at most 1, its rows rescaled to match, so an outlier learned during warm-up does not
/// poison the reference).
/// A clean row is close to its key's reference whatever the text around it, where a message's
/// plain statistics (its RMS, its channel means and variances) move with the micro-batch's text;
/// noise, scaling, sign flips and zeroing move every row away from its own reference.
///
/// Statistics of x [rows, cols], over the rows whose key has been learned from at least
/// kKeyMinCount messages (one pass over x, O(rows * cols); no allocation once the keys are
/// known): the mean over those rows of cos(x_r, ref_k) - the key's EMA of that cosine
/// ("key-cos", scored one-sided: only a fall; each key has its own usual cosine, so a message's
/// mix of keys does not move it; a sign flip of a share p of the elements scales each row's
/// projection on its reference by 1 - 2p and keeps its norm, noise adds norm and no
/// projection); the mean over those rows of
/// log RMS(x_r) - the key's EMA log RMS ("key-norm": scaling, zeroing, noise); and, over all
/// rows, log(max |x| / RMS) ("peak-ratio", one-sided, only a rise: one exploded element, a bit
/// flip); and log(sum_r ||B' x_r||^2 / sum_r ||x_r||^2), the share of the message's energy in
/// the stream's minor subspace B ("minor-share", one-sided, only a rise: MinorSubspace; noise
/// and sign flips in rows without a usual direction per key, as gradients are; one GEMM
/// [rows, cols] x [cols, cols/4 or 64], relative to the stream's recent rows). A message with
/// no row of a learned key has no key statistics (scored 0, not learned by them); minor-share
/// is read from the subspace's first basis on, of messages of at least MinorSubspace::kMinRows
/// rows, and scored after a warm-up of its own (config.warmup values, then its EMAs restart
/// from their median and MAD). A non-finite value makes the score +inf (flagged at once, even
/// during warm-up).
///
/// Score: each statistic s is compared with its EMA mean mu and variance var over the stream's
/// learned messages (momentum config.decay), as a random-effects model: a key statistic is a
/// mean over n rows, so its spread is the spread between messages, tau^2 = var - (the EMA of
/// the messages' squared standard errors), plus this message's own, (the EMA of the rows'
/// variance) / n: z = |s - mu| / sqrt(tau^2 + rowvar / n + (1e-3 |mu|)^2 + 1e-300). An
/// 8-row micro-batch is judged with a band 4 times as wide as a 128-row one (peak-ratio and
/// minor-share have no rows: their tau^2 is var).
///
/// Warm-up: the first `warmup` messages are learned without verdicts (non-finite values aside);
/// at its end the EMAs restart from the median and 1.4826 x the median absolute deviation of the
/// (last 64) warm-up statistics, so faults in a minority of the warm-up messages do not stay in
/// them.
///
/// Learning: a learnable message (Assessment::learnable: not flagged, and every score at most
/// config.learn_below of its threshold) updates the EMAs (mu += a d; var = (1 - a)(var + a d^2
/// / c), a = max(1 - decay, 1/n)) and its keys' references; a flagged or suspicious one does
/// not (a corrupting sender must not drag the statistics or widen the band it is judged by).
/// After warm-up the deviation d = s - mu is clipped to +-2 sqrt(var), with c = E[min(z^2, 4)]
/// = 0.9205 for a standard normal z, so var stays unbiased on clean traffic (Huber's clipped
/// update, Huber 1964): faults that pass the gate move the EMAs by at most 2 standard
/// deviations each, and cannot hold a band that started wide (a training run's first steps)
/// at their own deviation. A lasting change of the stream would then be flagged for good, so
/// when kRestartFlags of the last kRecent scored messages were flagged the monitor starts over
/// (restarts()).
///
/// Thresholds: config.threshold for every statistic when > 0; else one per statistic,
/// calibrated from that statistic's scores of accepted messages as SPOT does (Siffer et al.,
/// KDD 2017, sec. 3-4) at q = target_fpr / kGroups (Bonferroni: the union over the statistics
/// stays within target_fpr): a reservoir of the last 1024 scores; the initial threshold t is
/// its 95% quantile (the top k = max(5, 5%) scores are the peaks); the excesses over t are
/// fitted by a generalized Pareto distribution (method of moments, shape xi clamped to [0,
/// 0.45]) and the threshold is its (1 - q) quantile t + sigma/xi ((q n / k)^-xi - 1) (t -
/// sigma ln(q n / k) for xi = 0). SPOT assumes anomalies are rare; a sender corrupting 10% of
/// its messages from the start would fill the peaks and lift the threshold over its own faults,
/// so it is capped by kBodyMargin times a bound from the reservoir's body, which a minority of
/// high scores hardly moves: an exponential tail through the median q50 and the upper quartile
/// q75, q50 + (q75 - q50) / ln 2 * ln(0.5 / q); and floored at kMinThreshold. The message is
/// flagged when a statistic exceeds its threshold; the Assessment names the statistic with the
/// largest score / threshold. Refitted after every n/16 new scores. Not thread-safe.
///
/// Memory: 4 cols + 32 bytes per key (the 42M shape, vocabulary 32000 x dim 512: at most 66 MB
/// per stream, only for the token ids that occur), 32 KiB of scores, O(rows) scratch, and the
/// stream's MinorSubspace (its own, or one shared: share_minor).
class SentinelMonitor {
 public:
  /// Statistics scored (the size of kNames); each has its own calibrated threshold.
  static constexpr int kGroups = 4;

  /// A monitor that scores minor-share when `minor_share` (VerifyingTransport: when the
  /// stream's kind is in config.minor_share_kinds); without it that statistic is never present.
  /// @throws brigade::Error{InvalidArgument} for a bad config (validate)
  explicit SentinelMonitor(const SentinelConfig& config = {}, bool minor_share = true)
      : config_(config), minor_on_(minor_share) {
    validate(config_);
    fitted_.fill(kInf);
  }

  /// The statistics and score of x [rows, cols] with row keys `keys` ([rows], or empty: every
  /// row has the one shared key) against what the monitor learned, and whether the threshold in
  /// force flags it. It changes nothing but scratch space and the record of recent verdicts
  /// (the restart rule: the 12th flag in 16 messages starts the monitor over, restarts(), and
  /// that Assessment's reason says so). learn() then learns this message, or decline() records
  /// that it was not learned (minor-share's reference counts both): x and
  /// keys must stay alive and unchanged until then (observe() does both). `scale` (> 0) is a
  /// factor the receiver knows its sender divided the payload by: the monitor compares x times
  /// `scale` (a training gradient row is d(mean loss)/dh, divided by the step's real targets, so
  /// RowKeys::gradient_scale is that count; the key-norm statistic would otherwise move with it).
  /// Cost: one pass over x plus O(rows log rows).
  /// @throws brigade::Error{InvalidArgument} for rows < 1, x.size() not a multiple of rows, a
  ///         width other than the stream's (the first message's), keys of another size than
  ///         rows, or a scale that is not finite and > 0
  Assessment assess(std::span<const float> x, std::int64_t rows,
                    std::span<const std::int32_t> keys = {}, double scale = 1.0) {
    BRIGADE_CHECK(rows >= 1 && !x.empty() && x.size() % static_cast<std::size_t>(rows) == 0,
                  Errc::InvalidArgument,
                  "SentinelMonitor: {} values are not a [rows = {}, cols] matrix", x.size(), rows);
    BRIGADE_CHECK(std::isfinite(scale) && scale > 0, Errc::InvalidArgument,
                  "SentinelMonitor: scale = {}, expected finite and > 0", scale);
    const auto cols = static_cast<std::int64_t>(x.size()) / rows;
    if (cols_ == 0) cols_ = cols;
    BRIGADE_CHECK(cols == cols_, Errc::InvalidArgument,
                  "SentinelMonitor: a message [{}, {}] in a stream of width {}", rows, cols, cols_);
    BRIGADE_CHECK(keys.empty() || static_cast<std::int64_t>(keys.size()) == rows,
                  Errc::InvalidArgument,
                  "SentinelMonitor: {} row keys for a message of {} rows", keys.size(), rows);
    assessed_ = false;
    Assessment a;
    a.threshold = threshold(0);
    scale_ = scale;
    if (!statistics(x, rows, keys)) {  // non-finite values
      a.score = kInf;
      a.flagged = true;
      a.statistic = "non-finite";
      a.reason = nonfinite_reason_;
      return a;
    }
    assessed_ = true;
    x_ = x;
    keys_ = keys;
    score_.fill(0);
    for (int g = 0; g < kGroups; ++g) {
      const auto d = static_cast<std::size_t>(g);
      if (count_[d] < (g == kMinor ? config_.warmup : 2) || !present_[d]) continue;
      const double diff = cur_[d] - mean_[d];
      // key-cos only scores a fall, peak-ratio and minor-share only a rise: faults lower the
      // one and raise the others.
      if ((g == kCos && diff > 0) || ((g == kPeak || g == kMinor) && diff < 0)) continue;
      const double floor = 1e-3 * std::fabs(mean_[d]);
      // Random effects: the spread between messages (tau^2: the EMA variance less the EMA of
      // the messages' squared standard errors) plus this message's own standard error, from
      // the rows' usual variance (a fault that scatters its rows does not widen its own band).
      const double between = std::max(0.0, var_[d] - se2_mean_[d]);
      score_[d] = std::fabs(diff) /
                  std::sqrt(between + row_var_mean_[d] / rows_[d] + floor * floor + 1e-300);
    }
    // The deciding statistic: the one furthest over (or closest to) its own threshold; during
    // warm-up (every threshold +inf) the largest score.
    int worst = 0;
    double worst_ratio = -1;
    for (int g = 0; g < kGroups; ++g) {
      const double t = threshold(g);
      const double s = score_[static_cast<std::size_t>(g)];
      const double ratio = std::isinf(t) ? 0.0 : s / t;
      if (ratio > worst_ratio ||
          (ratio == worst_ratio && s > score_[static_cast<std::size_t>(worst)])) {
        worst = g;
        worst_ratio = ratio;
      }
    }
    a.score = score_[static_cast<std::size_t>(worst)];
    a.threshold = threshold(worst);
    a.statistic = kNames[worst];
    a.flagged = a.score > a.threshold;
    flagged_ = a.flagged;
    a.learnable = !a.flagged;
    for (int g = 0; g < kGroups; ++g)
      a.learnable = a.learnable && !(score_[static_cast<std::size_t>(g)] >
                                     config_.learn_below * threshold(g));
    if (a.flagged) a.reason = reason(worst, rows);
    // A lasting change of the stream (most recent messages flagged, as no sender corrupting a
    // minority of its messages causes): the monitor starts over from this message on.
    recent_flags_ += (a.flagged ? 1 : 0) - (recent_[recent_next_] ? 1 : 0);
    recent_[recent_next_] = a.flagged;
    recent_next_ = (recent_next_ + 1) % kRecent;
    if (recent_flags_ >= kRestartFlags) {
      a.reason += fmt::format("; {} of the stream's last {} messages flagged: its monitor starts "
                              "over (restart {})",
                              recent_flags_, kRecent, restarts_ + 1);
      a.learnable = false;
      const std::int64_t restarts = restarts_ + 1;
      auto minor = std::move(minor_);
      const bool feeds = minor_feeds_;
      *this = SentinelMonitor(config_, minor_on_);
      restarts_ = restarts;
      minor_ = std::move(minor);  // the stream's subspace is not this monitor's to restart
      minor_feeds_ = feeds;
    }
    return a;
  }

  /// Learns the message assess() saw last (whose payload and keys must still be alive and
  /// unchanged): updates the statistics' EMAs and its keys' references, records it as clean in
  /// minor-share's ring of recent messages (MinorSubspace, when this monitor feeds one) and,
  /// once the monitor has learned ceil(warmup / 2) messages, adds its scores to the calibration
  /// reservoir.
  /// @throws brigade::Error{InvalidUsage} when nothing was assessed since the last learn or
  ///         decline, or the last message had non-finite values
  void learn() {
    BRIGADE_CHECK(assessed_, Errc::InvalidUsage,
                  "SentinelMonitor::learn: no finite message assessed since the last learn");
    assessed_ = false;
    if (learned_ >= std::max<std::int64_t>(2, (config_.warmup + 1) / 2)) add_scores();
    ++learned_;
    for (int g = 0; g < kGroups; ++g) {
      const auto d = static_cast<std::size_t>(g);
      if (!present_[d]) continue;  // no rows for this key statistic in this message
      ++count_[d];
      const double a = std::max(1.0 - config_.decay, 1.0 / static_cast<double>(count_[d]));
      double diff = cur_[d] - mean_[d];
      double sq = diff * diff;
      if ((g == kMinor ? count_[d] > config_.warmup : learned_ > config_.warmup) && var_[d] > 0) {
        // Huber's clipped update (class docstring, "Learning"): one message moves the EMAs by
        // at most kHuberClip of the spread.
        const double lim = kHuberClip * std::sqrt(var_[d]);
        diff = std::clamp(diff, -lim, lim);
        sq = diff * diff / kHuberConsistency;
      }
      mean_[d] += a * diff;
      var_[d] = (1 - a) * (var_[d] + a * sq);
      se2_mean_[d] += a * (row_var_[d] / rows_[d] - se2_mean_[d]);
      row_var_mean_[d] += a * (row_var_[d] - row_var_mean_[d]);
      if (g == kMinor && count_[d] <= config_.warmup) {
        minor_warm_.push_back(cur_[d]);
        if (count_[d] == config_.warmup) minor_robust_start();
      }
    }
    if (learned_ <= config_.warmup) {  // keep the last kWarmRows warm-up statistics
      auto& w = warm_[static_cast<std::size_t>(learned_ - 1) % kWarmRows];
      auto& w2 = warm_se2_[static_cast<std::size_t>(learned_ - 1) % kWarmRows];
      auto& w3 = warm_row_var_[static_cast<std::size_t>(learned_ - 1) % kWarmRows];
      w = cur_;
      for (std::size_t d = 0; d < w2.size(); ++d) w2[d] = row_var_[d] / rows_[d];
      w3 = row_var_;
      for (std::size_t d = 0; d < w.size(); ++d)
        if (!present_[d]) w[d] = w2[d] = w3[d] = std::numeric_limits<double>::quiet_NaN();
      if (learned_ == config_.warmup) robust_start();
    }
    learn_minor();
    learn_keys();
  }

  /// assess(x, rows, keys, scale), then learn() when the message is learnable.
  /// @throws brigade::Error{InvalidArgument} as assess
  Assessment observe(std::span<const float> x, std::int64_t rows,
                     std::span<const std::int32_t> keys = {}, double scale = 1.0) {
    Assessment a = assess(x, rows, keys, scale);
    if (a.learnable)
      learn();
    else if (assessed_)  // not after non-finite values, nor a restart
      decline();
    return a;
  }

  /// The message assess() saw last (whose payload must still be alive and unchanged) is not
  /// learned: with minor-share on, unless it was flagged, it is recorded in the stream
  /// subspace's ring of recent messages, whose median is the statistic's reference
  /// (MinorSubspace: a reference of learned messages only freezes when a training step moves the
  /// stream past the learning gate). observe() calls it for every message it does not learn;
  /// after assess() without learn(), call it to do the same.
  /// @throws brigade::Error{InvalidUsage} when nothing was assessed since the last learn or
  ///         decline, or the last message had non-finite values
  void decline() {
    BRIGADE_CHECK(assessed_, Errc::InvalidUsage,
                  "SentinelMonitor::decline: no finite message assessed since the last learn or "
                  "decline");
    assessed_ = false;
    if (!flagged_) record_minor(false);
  }

  /// Reads (and, when `feeds`, records its messages in and teaches) `subspace` for the
  /// minor-share statistic instead of a subspace of its own: StreamMonitor shares one per stream
  /// among its row buckets' monitors (the subspace is a property of the stream's rows, not of
  /// the messages' sizes), each message recorded once and each learned one teaching it once.
  /// Call before the first message.
  /// @throws brigade::Error{InvalidArgument} for a null subspace;
  ///         brigade::Error{InvalidUsage} after the first message
  void share_minor(std::shared_ptr<MinorSubspace> subspace, bool feeds) {
    BRIGADE_CHECK(subspace != nullptr, Errc::InvalidArgument,
                  "SentinelMonitor::share_minor: a null subspace");
    BRIGADE_CHECK(cols_ == 0, Errc::InvalidUsage,
                  "SentinelMonitor::share_minor: the monitor has seen messages");
    minor_ = std::move(subspace);
    minor_feeds_ = feeds;
  }

  /// The threshold in force for the next message on statistic `g` (an index into kNames):
  /// config.threshold when fixed, else that statistic's calibrated one; +inf during warm-up.
  /// @throws brigade::Error{InvalidArgument} for g outside [0, kGroups)
  [[nodiscard]] double threshold(int g) {
    BRIGADE_CHECK(g >= 0 && g < kGroups, Errc::InvalidArgument,
                  "SentinelMonitor::threshold: statistic {} outside [0, {})", g, kGroups);
    if (learned_ < config_.warmup) return kInf;
    if (config_.threshold > 0) return config_.threshold;
    if (reservoir_size_ < kMinScores) return kInf;
    if (since_fit_ > 0 && since_fit_ >= std::max<std::int64_t>(1, reservoir_size_ / 16)) {
      since_fit_ = 0;
      for (int k = 0; k < kGroups; ++k) fit(k);
    }
    return fitted_[static_cast<std::size_t>(g)];
  }
  /// Each statistic's score (in the order of kNames) of the message assessed last; zeros before
  /// the monitor learned two messages (two with keys, for the key statistics) or after a
  /// non-finite payload.
  [[nodiscard]] const std::array<double, kGroups>& scores() const noexcept { return score_; }
  /// Each statistic's value (in the order of kNames) of the message assessed last.
  [[nodiscard]] const std::array<double, kGroups>& statistics() const noexcept { return cur_; }
  /// Rows of the message assessed last whose key had a reference (the key statistics' rows).
  [[nodiscard]] std::int64_t covered() const noexcept { return covered_; }
  /// Messages learned.
  [[nodiscard]] std::int64_t learned() const noexcept { return learned_; }
  /// True while the monitor gives no verdicts (threshold() is +inf for every statistic): its
  /// first config.warmup messages, and, with calibrated thresholds, until kMinScores scores of
  /// accepted messages are in its reservoir.
  [[nodiscard]] bool warming_up() const noexcept {
    return learned_ < config_.warmup || (config_.threshold <= 0 && reservoir_size_ < kMinScores);
  }
  /// Times the monitor started over: kRestartFlags of the last kRecent messages it scored were
  /// flagged, a lasting change of the stream (the start of training, when gradients shrink
  /// fast, did it in replays) rather than a sender corrupting a minority of its messages. Its
  /// statistics, key references and thresholds are then learned again, from a new warm-up.
  [[nodiscard]] std::int64_t restarts() const noexcept { return restarts_; }
  /// Keys with a reference row.
  [[nodiscard]] std::size_t keys() const noexcept { return slots_.size(); }
  /// The stream's width (0 before the first message).
  [[nodiscard]] std::int64_t cols() const noexcept { return cols_; }
  /// The config.
  [[nodiscard]] const SentinelConfig& config() const noexcept { return config_; }
  /// Names of the statistics, in the order of their scores.
  static constexpr const char* kNames[] = {"key-cos", "key-norm", "peak-ratio", "minor-share"};
  /// Scores are kept for calibration in a reservoir of this many.
  static constexpr std::int64_t kReservoir = 1024;
  /// The restart rule (restarts()): kRestartFlags flagged among the last kRecent scored messages.
  static constexpr int kRecent = 16, kRestartFlags = 12;
  /// Scores the calibrated threshold needs before it gives verdicts.
  static constexpr std::int64_t kMinScores = 8;
  /// Warm-up statistics kept for the robust start (the last this many of the warm-up).
  static constexpr std::size_t kWarmRows = 64;
  /// Messages a key's reference must have learned from before its rows are compared with it.
  static constexpr std::int32_t kKeyMinCount = 2;
  /// The cap on the calibrated threshold over the body's exponential bound (class docstring).
  static constexpr double kBodyMargin = 1.0;
  /// A calibrated threshold is never below these (per statistic, in the order of kNames): the
  /// rare clean excursions of real traffic that a reservoir of scores cannot place. Over the
  /// 8,000 messages of 1,000 clean stories260K steps the largest clean scores are 7.3 (key-cos,
  /// one micro-batch whose 72 rows all sat 0.09 below their keys' usual cosine), 5.3 and 5.6;
  /// faults of the payload's norm in activations score 18 and more (docs/integrity.md). minor-
  /// share's clean scores stay lower (at most 4.0 over the gradient streams of stories260K and
  /// the 42M shape, one monitor per stream), where stories260K's gradient noise of the
  /// payload's norm scores 5.3 and more in nine replays of ten.
  static constexpr std::array<double, kGroups> kMinThreshold = {9, 7, 7, 5};

 private:
  static constexpr int kCos = 0, kNorm = 1, kPeak = 2, kMinor = 3;  // indices into kNames
  static constexpr double kInf = std::numeric_limits<double>::infinity();
  static constexpr double kTiny = 1e-300;  // log(0 + kTiny): a zeroed row's finite statistic
  static constexpr double kZeroRowLog = -300;  // a row's log RMS below this: an all-zero row
  static constexpr double kKeyClip = 1.0;  // the most one message moves a key's log RMS (e-fold)
  static constexpr double kHuberClip = 2.0;  // the clip of one message's deviation (sd units)
  // E[min(z^2, 4)] for a standard normal z: the clipped squares' mean, so var_ stays unbiased.
  static constexpr double kHuberConsistency = 0.920537;

  // End of warm-up: the EMAs restart from the median and the scaled median absolute deviation
  // (1.4826 MAD, the normal's sd) of the kept warm-up statistics (NaN: a message without key
  // statistics), which faults in a minority of the warm-up messages hardly move.
  void robust_start() {
    const std::size_t n = std::min<std::size_t>(static_cast<std::size_t>(config_.warmup), kWarmRows);
    std::vector<double> col;
    for (std::size_t d = 0; d < static_cast<std::size_t>(kGroups); ++d) {
      if (d == kMinor) continue;  // minor-share has a warm-up of its own (minor_robust_start)
      col.clear();
      for (std::size_t i = 0; i < n; ++i)
        if (!std::isnan(warm_[i][d])) col.push_back(warm_[i][d]);
      if (col.size() < 3) continue;
      std::tie(mean_[d], var_[d]) = median_and_variance(col);
      // The standard errors restart from their median: one outlier row (a bit flip's exploded
      // element) makes a huge one, which would hide the spread between messages for good.
      for (auto* warm : {&warm_se2_, &warm_row_var_}) {
        col.clear();
        for (std::size_t i = 0; i < n; ++i)
          if (!std::isnan((*warm)[i][d])) col.push_back((*warm)[i][d]);
        const auto mid = col.begin() + static_cast<std::ptrdiff_t>(col.size() / 2);
        std::nth_element(col.begin(), mid, col.end());
        (warm == &warm_se2_ ? se2_mean_ : row_var_mean_)[d] = *mid;
      }
    }
  }

  // The reference slot of `key`, or -1 when it has none yet (or fewer than kKeyMinCount
  // messages learned).
  [[nodiscard]] std::int32_t slot_of(std::int32_t key) const {
    const auto it = slots_.find(key);
    if (it == slots_.end() || count_of_[static_cast<std::size_t>(it->second)] < kKeyMinCount)
      return -1;
    return it->second;
  }

  // The statistics of x into cur_ (and per row: log RMS, key slot); false (and
  // nonfinite_reason_ set) for non-finite values. One pass: per row its sum of squares, max |x|
  // and the dot product with its key's reference row.
  bool statistics(std::span<const float> xs, std::int64_t rows,
                  std::span<const std::int32_t> keys) {
    // (float squares summed in double cannot overflow: a non-finite sum means a non-finite x)
    const float* x = xs.data();
    const auto uc = static_cast<std::size_t>(cols_);
    const auto ur = static_cast<std::size_t>(rows);
    row_log_.resize(ur);
    row_cos_.resize(ur);
    double q = 0, peak = 0, cos_sum = 0, norm_sum = 0, cos_sq = 0, norm_sq = 0;
    const double log_scale = std::log(scale_);
    covered_ = 0;
    std::int64_t cos_rows = 0;
    const std::int32_t shared = slot_of(0);
    for (std::size_t r = 0; r < ur; ++r) {
      const float* a = x + r * uc;
      const std::int32_t slot = keys.empty() ? shared : slot_of(keys[r]);
      const float* ref = slot >= 0 ? refs_.data() + static_cast<std::size_t>(slot) * uc : nullptr;
      double rq[4] = {0, 0, 0, 0}, rd[4] = {0, 0, 0, 0};
      float pk[4] = {0, 0, 0, 0};
      std::size_t j = 0;
      if (ref != nullptr) {
        for (; j + 4 <= uc; j += 4)
          for (std::size_t i = 0; i < 4; ++i) {
            const double v = a[j + i];
            rq[i] += v * v;
            rd[i] += v * static_cast<double>(ref[j + i]);
            const float m = std::fabs(a[j + i]);
            pk[i] = pk[i] < m ? m : pk[i];
          }
        for (; j < uc; ++j) {
          const double v = a[j];
          rq[0] += v * v;
          rd[0] += v * static_cast<double>(ref[j]);
          pk[0] = std::max(pk[0], std::fabs(a[j]));
        }
      } else {
        for (; j + 4 <= uc; j += 4)
          for (std::size_t i = 0; i < 4; ++i) {
            const double v = a[j + i];
            rq[i] += v * v;
            const float m = std::fabs(a[j + i]);
            pk[i] = pk[i] < m ? m : pk[i];
          }
        for (; j < uc; ++j) {
          const double v = a[j];
          rq[0] += v * v;
          pk[0] = std::max(pk[0], std::fabs(a[j]));
        }
      }
      const double ss = (rq[0] + rq[1]) + (rq[2] + rq[3]);
      q += ss;
      peak = std::max({peak, static_cast<double>(pk[0]), static_cast<double>(pk[1]),
                       static_cast<double>(pk[2]), static_cast<double>(pk[3])});
      row_log_[r] = 0.5 * std::log(ss / static_cast<double>(uc) + kTiny) + log_scale;
      if (ref != nullptr) {
        const auto s = static_cast<std::size_t>(slot);
        const double norms = std::sqrt(ss * ref_ss_[s]);
        row_cos_[r] = norms > 0 ? ((rd[0] + rd[1]) + (rd[2] + rd[3])) / norms : 0.0;
        const double dn = row_log_[r] - ref_log_[s];
        norm_sum += dn;
        norm_sq += dn * dn;
        ++covered_;
        if (cos_count_[s] >= kKeyMinCount) {  // the key has a usual cosine to compare with
          const double dc = row_cos_[r] - ref_cos_[s];
          cos_sum += dc;
          cos_sq += dc * dc;
          ++cos_rows;
        }
      } else {
        row_cos_[r] = std::numeric_limits<double>::quiet_NaN();
      }
    }
    if (!std::isfinite(q) || std::isnan(peak) || std::isinf(peak)) {
      const std::size_t n = ur * uc;
      std::size_t bad = 0, first = n;
      for (std::size_t i = 0; i < n; ++i)
        if (!std::isfinite(x[i])) {
          if (bad++ == 0) first = i;
        }
      nonfinite_reason_ = fmt::format(
          "{} non-finite value{} (the first, {}, at row {}, column {} of [{}, {}])", bad,
          bad == 1 ? "" : "s", x[first], first / uc, first % uc, rows, cols_);
      return false;
    }
    const double ms = q / static_cast<double>(ur * uc);
    cur_[kCos] = cos_sum / static_cast<double>(std::max<std::int64_t>(cos_rows, 1));
    cur_[kNorm] = norm_sum / static_cast<double>(std::max<std::int64_t>(covered_, 1));
    // Each key statistic's rows and their sample variance (0 for one row): its squared standard
    // error, the part of its spread a message's own size explains, is row_var_ / rows_.
    auto row_var = [](double sum, double sq, std::int64_t n) {
      if (n < 2) return 0.0;
      const double m = sum / static_cast<double>(n);
      return std::max(0.0, sq - m * sum) / static_cast<double>(n - 1);
    };
    rows_ = {static_cast<double>(std::max<std::int64_t>(cos_rows, 1)),
             static_cast<double>(std::max<std::int64_t>(covered_, 1)), 1.0, 1.0};
    row_var_ = {row_var(cos_sum, cos_sq, cos_rows), row_var(norm_sum, norm_sq, covered_), 0.0,
                0.0};
    cur_[kPeak] = ms > 0 ? std::log(peak / std::sqrt(ms)) : 0.0;
    // minor-share: the share of the message's energy in the learned minor subspace (one GEMM,
    // [rows, cols] x [cols, k]).
    bool minor = false;
    if (minor_on_ && !minor_) minor_ = std::make_shared<MinorSubspace>(cols_);
    if (minor_on_ && minor_->ready() && q > 0 && rows >= MinorSubspace::kMinRows) {
      cur_[kMinor] = minor_->log_share(xs, rows, q);
      minor = true;
    }
    present_ = {cos_rows > 0, covered_ > 0, true, minor};
    return true;
  }

  // The keys' references learn the message assessed last: per key, the mean of its rows and of
  // their log RMS, with momentum max(1 - key_decay, 1/n) for the key's n-th message.
  void learn_keys() {
    const auto uc = static_cast<std::size_t>(cols_);
    const std::size_t ur = x_.size() / uc;
    order_.resize(ur);
    for (std::size_t r = 0; r < ur; ++r) {
      const std::int32_t key = keys_.empty() ? 0 : keys_[r];
      auto [it, fresh] = slots_.try_emplace(key, static_cast<std::int32_t>(count_of_.size()));
      if (fresh) {
        count_of_.push_back(0);
        cos_count_.push_back(0);
        ref_cos_.push_back(0);
        ref_log_.push_back(0);
        ref_ss_.push_back(0);
        refs_.resize(refs_.size() + uc, 0.0f);
      }
      order_[r] = {it->second, static_cast<std::int32_t>(r)};
    }
    std::sort(order_.begin(), order_.end());
    acc_.resize(uc);
    for (std::size_t b = 0; b < ur;) {
      const std::int32_t slot = order_[b].first;
      std::size_t e = b;
      std::fill(acc_.begin(), acc_.end(), 0.0);
      double log_sum = 0, cos_sum = 0;
      std::size_t kept = 0;
      for (; e < ur && order_[e].first == slot; ++e) {
        const auto r = static_cast<std::size_t>(order_[e].second);
        if (row_log_[r] < kZeroRowLog) continue;  // an all-zero row teaches nothing
        const float* a = x_.data() + r * uc;
        for (std::size_t j = 0; j < uc; ++j) acc_[j] += scale_ * a[j];
        log_sum += row_log_[r];
        cos_sum += row_cos_[r];  // NaN when the key had no reference at assess time
        ++kept;
      }
      const auto s = static_cast<std::size_t>(slot);
      b = e;
      if (kept == 0) continue;
      const double n = static_cast<double>(kept);
      if (!std::isnan(cos_sum)) {
        const double ac = std::max(1.0 - config_.key_decay, 1.0 / static_cast<double>(++cos_count_[s]));
        ref_cos_[s] += ac * (cos_sum / n - ref_cos_[s]);
      }
      // After the key's first message, one message moves its log RMS by at most kKeyClip (its
      // rows rescaled to match): an unflagged outlier during warm-up (a bit flip's huge element)
      // cannot poison the reference for good.
      double log_mean = log_sum / n, scale = 1.0;
      if (count_of_[s] > 0 && std::fabs(log_mean - ref_log_[s]) > kKeyClip) {
        const double clipped = ref_log_[s] + std::clamp(log_mean - ref_log_[s], -kKeyClip, kKeyClip);
        scale = std::exp(clipped - log_mean);
        log_mean = clipped;
      }
      const double a = std::max(1.0 - config_.key_decay, 1.0 / static_cast<double>(++count_of_[s]));
      float* ref = refs_.data() + s * uc;
      double ss = 0;
      for (std::size_t j = 0; j < uc; ++j) {
        ref[j] = static_cast<float>(ref[j] + a * (scale * acc_[j] / n - ref[j]));
        ss += static_cast<double>(ref[j]) * ref[j];
      }
      ref_ss_[s] = ss;
      ref_log_[s] += a * (log_mean - ref_log_[s]);
    }
  }

  // minor-share: the stream's subspace learns the message assessed last (when this monitor
  // feeds it).
  void learn_minor() { record_minor(true); }

  // The message assessed last goes into the stream subspace's ring of recent messages (when
  // this monitor feeds it), marked clean when `learned`.
  void record_minor(bool learned) {
    if (minor_on_ && minor_feeds_ && minor_)
      (void)minor_->record(x_, static_cast<std::int64_t>(x_.size()) / cols_, learned);
  }

  // minor-share's own warm-up: its first config.warmup values (from the subspace's first basis
  // on) are learned without a score, then its EMAs restart from their median and 1.4826 MAD.
  void minor_robust_start() {
    if (minor_warm_.size() >= 3)
      std::tie(mean_[kMinor], var_[kMinor]) = median_and_variance(minor_warm_);
    minor_warm_.clear();
  }

  // The median of `col` (>= 1 value) and the variance of a normal whose standard deviation is
  // 1.4826 times the median absolute deviation (col is reordered and overwritten).
  static std::pair<double, double> median_and_variance(std::vector<double>& col) {
    const auto mid = col.begin() + static_cast<std::ptrdiff_t>(col.size() / 2);
    std::nth_element(col.begin(), mid, col.end());
    const double med = *mid;
    for (auto& v : col) v = std::fabs(v - med);
    std::nth_element(col.begin(), mid, col.end());
    return {med, 1.4826 * 1.4826 * *mid * *mid};
  }

  std::string reason(int g, std::int64_t rows) const {
    const auto d = static_cast<std::size_t>(g);
    const std::string over =
        g == kPeak || g == kMinor ? std::string()
                   : fmt::format(" over {} of {} rows with a learned key reference", covered_, rows);
    return fmt::format("{} = {:.4g}, EMA {:.4g} +- {:.3g} (z = {:.3g}){}", kNames[g], cur_[d],
                       mean_[d], std::sqrt(var_[d]), score_[d], over);
  }

  void add_scores() {
    for (std::size_t g = 0; g < static_cast<std::size_t>(kGroups); ++g)
      reservoir_[g * static_cast<std::size_t>(kReservoir) + static_cast<std::size_t>(next_)] =
          score_[g];
    next_ = (next_ + 1) % kReservoir;
    reservoir_size_ = std::min(reservoir_size_ + 1, kReservoir);
    ++since_fit_;
  }

  // SPOT's peaks-over-threshold fit of the reservoir, capped by the body's exponential bound
  // (class docstring).
  void fit(int g) {
    const auto n = static_cast<std::size_t>(reservoir_size_);
    std::copy_n(reservoir_.begin() + static_cast<std::ptrdiff_t>(g) * kReservoir, n,
                sorted_.begin());
    const std::size_t k = std::min(
        n / 4, std::max<std::size_t>(5, static_cast<std::size_t>(std::lround(0.05 * static_cast<double>(n)))));
    // Partial sort: the median, the upper quartile and the initial threshold t = the value
    // below the k largest, which end up in sorted_[n - k, n).
    auto at = [&](std::size_t i) { return sorted_.begin() + static_cast<std::ptrdiff_t>(i); };
    const std::size_t i50 = n / 2, i75 = 3 * n / 4, it = n - 1 - k;
    std::nth_element(at(0), at(i50), at(n));
    std::nth_element(at(i50 + 1), at(i75), at(n));
    std::nth_element(at(i75 + 1), at(it), at(n));
    const double q = config_.target_fpr / kGroups;  // Bonferroni over the statistics
    const double t = sorted_[it];
    double m1 = 0, m2 = 0;
    for (std::size_t i = it + 1; i < n; ++i) {
      const double y = sorted_[i] - t;
      m1 += y;
      m2 += y * y;
    }
    m1 /= static_cast<double>(k);
    const double var = m2 / static_cast<double>(k) - m1 * m1;
    double xi = var > 0 ? 0.5 * (1 - m1 * m1 / var) : 0.0;
    xi = std::clamp(xi, 0.0, 0.45);
    const double sigma = m1 * (1 - xi);  // the GPD's mean is sigma / (1 - xi)
    const double r = q * static_cast<double>(n) / static_cast<double>(k);
    const double spot = xi > 1e-6 ? t + sigma / xi * (std::pow(r, -xi) - 1) : t - sigma * std::log(r);
    const double q50 = sorted_[i50], q75 = sorted_[i75];
    const double body = q50 + (q75 - q50) / std::log(2.0) * std::log(0.5 / q);
    fitted_[static_cast<std::size_t>(g)] =
        std::max(std::min(spot, kBodyMargin * body), kMinThreshold[static_cast<std::size_t>(g)]);
  }

  SentinelConfig config_;
  std::int64_t cols_ = 0, learned_ = 0;
  std::array<double, kGroups> cur_{}, mean_{}, var_{}, score_{};
  // Per statistic: the rows the message's value averaged and their sample variance
  // (statistics()); the EMAs over learned messages of that variance and of the squared standard
  // error row_var_ / rows_ (var_ - se2_mean_: the spread between messages, tau^2).
  std::array<double, kGroups> rows_{}, row_var_{}, row_var_mean_{}, se2_mean_{};
  std::array<bool, kRecent> recent_{};  // the last kRecent verdicts (flagged), a ring
  int recent_next_ = 0, recent_flags_ = 0;
  std::int64_t restarts_ = 0;
  std::array<std::int64_t, kGroups> count_{};  // messages each statistic learned
  std::array<std::array<double, kGroups>, kWarmRows> warm_{};  // the last warm-up statistics
  std::array<std::array<double, kGroups>, kWarmRows> warm_se2_{}, warm_row_var_{};  // and these
  friend class StreamMonitor;  // reads assessed_ (whether decline() applies)
  bool assessed_ = false;
  bool flagged_ = false;  // the verdict of the message assessed last
  std::string nonfinite_reason_;
  // The message assessed last (learn() reads it) and its per-row log RMS.
  std::span<const float> x_;
  std::span<const std::int32_t> keys_;
  double scale_ = 1.0;  // its known scale (assess)
  std::vector<double> row_log_, row_cos_;  // per row: log RMS; cosine to its key's reference
  std::int64_t covered_ = 0;
  std::array<bool, kGroups> present_{};  // the message has rows for each statistic
  // Keyed references: key -> slot; per slot its reference row (refs_[slot * cols, +cols)), its
  // squared norm, its EMA log RMS and the messages it learned from.
  std::map<std::int32_t, std::int32_t> slots_;
  std::vector<float> refs_;
  std::vector<double> ref_ss_, ref_log_, ref_cos_;  // ref_cos_: EMA of its rows' cosine to it
  std::vector<std::int32_t> count_of_, cos_count_;   // messages learned; of them, with a cosine
  std::vector<std::pair<std::int32_t, std::int32_t>> order_;  // (slot, row), learn_keys scratch
  std::vector<double> acc_;                                   // one key's row sum (scratch)
  std::vector<double> reservoir_ =
      std::vector<double>(static_cast<std::size_t>(kGroups * kReservoir), 0.0);
  std::vector<double> sorted_ = std::vector<double>(kReservoir, 0.0);
  std::int64_t next_ = 0, reservoir_size_ = 0, since_fit_ = 0;
  std::array<double, kGroups> fitted_{};  // each statistic's calibrated threshold
  // minor-share: the stream's subspace (shared by the monitors of a StreamMonitor), whether
  // this monitor's learned messages feed it, and the statistic's values during its own warm-up.
  bool minor_on_ = true;  // scores minor-share (constructor)
  std::shared_ptr<MinorSubspace> minor_;
  bool minor_feeds_ = true;
  std::vector<double> minor_warm_;
};

/// Whether the ids of a Token payload lie in [0, limit): the empty string when they do, else
/// "token id X at entry P outside [0, limit)" for the first that does not (and how many).
inline std::string token_range_violation(std::span<const std::int32_t> ids, std::int64_t limit) {
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= limit) {
      if (bad++ == 0) first = i;
    }
  if (bad == 0) return {};
  return fmt::format("token id {} at entry {} outside [0, {}){}", ids[first], first, limit,
                     bad > 1 ? fmt::format(" ({} ids out of range)", bad) : std::string());
}

/// Replay detection for one stream: an EMA of statistics cannot tell a replayed payload (an
/// old, clean message sent again in place of a new one) from a fresh one, since its statistics
/// are those of clean traffic. Fresh activations and gradients are never bitwise equal to an
/// earlier message of their stream, except where the inputs are equal: two micro-batches of one
/// round holding the same sequences (identical prompts in flight, a repeated sample in a step).
/// So a payload is a replay when its bytes equal a remembered earlier payload of the stream,
/// unless that one came in the current round (the run of messages whose micro-batch ids have
/// only increased since the round's first), with the same chunk, for another micro-batch.
/// A stream whose payloads repeat on their own is not checked: one that repeats within its first
/// `learn` messages (the monitors' warm-up) turns the check off for good, e.g. the token
/// embeddings a stage holding only the embedding layer sends (a token's row is the same at every
/// position). Payloads are remembered by a 64-bit hash of their bytes (std::hash over the bytes;
/// a false match is a hash collision, about 2^-64 per pair), the last `memory` of them. O(bytes)
/// per message.
class ReplayGuard {
 public:
  /// The earlier message a payload repeats.
  struct Repeat {
    std::int64_t index = 0;       ///< its number in the stream (observe's `index`)
    std::int64_t microbatch = 0;  ///< its micro-batch
    std::int64_t chunk = 0;       ///< its chunk
  };

  /// Remembers the last `memory` payloads (>= 1); a repeat among the first `learn` messages
  /// (>= 0) turns the check off.
  /// @throws brigade::Error{InvalidArgument} if memory < 1 or learn < 0
  explicit ReplayGuard(std::int64_t memory, std::int64_t learn = 0)
      : memory_(memory), learn_(learn) {
    BRIGADE_CHECK(memory >= 1 && learn >= 0, Errc::InvalidArgument,
                  "ReplayGuard: memory = {}, learn = {}; expected memory >= 1 and learn >= 0",
                  memory, learn);
  }
  /// False once the stream repeated itself while learning (nothing is flagged after that).
  [[nodiscard]] bool active() const noexcept { return active_; }

  /// Checks message `index` of the stream (indices increase) and remembers it.
  /// @return the earlier message whose bytes it repeats, or nullopt (new bytes, or an exempt
  ///         same-round repeat)
  std::optional<Repeat> observe(ConstBytes payload, std::int64_t index, std::int64_t microbatch,
                                std::int64_t chunk) {
    if (!active_) return std::nullopt;
    const bool learning = seen_count_++ < learn_;
    if (microbatch <= last_microbatch_) round_start_ = index;
    last_microbatch_ = microbatch;
    const std::size_t h = std::hash<std::string_view>{}(
        std::string_view(reinterpret_cast<const char*>(payload.data()), payload.size()));
    std::optional<Repeat> out;
    if (const auto it = seen_.find(h); it != seen_.end()) {
      const Repeat& r = it->second;
      const bool same_round = r.index >= round_start_ && r.chunk == chunk &&
                              r.microbatch != microbatch;
      if (!same_round) out = r;
    }
    if (out && learning) {  // this stream repeats on its own: not checkable this way
      active_ = false;
      seen_.clear();
      order_.clear();
      return std::nullopt;
    }
    if (!out) {  // a replay is not remembered: the original stays the reference
      if (static_cast<std::int64_t>(order_.size()) == memory_) {
        seen_.erase(order_.front());
        order_.pop_front();
      }
      if (seen_.try_emplace(h, Repeat{index, microbatch, chunk}).second) order_.push_back(h);
    }
    return out;
  }

 private:
  std::int64_t memory_, learn_;
  std::int64_t seen_count_ = 0;
  bool active_ = true;
  std::int64_t last_microbatch_ = std::numeric_limits<std::int64_t>::max();
  std::int64_t round_start_ = 0;
  std::map<std::size_t, Repeat> seen_;
  std::deque<std::size_t> order_;  // hashes in arrival order (oldest first)
};

/// The row keys of one training micro-batch (VerifyingTransport::expect): per row, the key its
/// activation row and its gradient row are compared under (SentinelMonitor's references).
struct RowKeys {
  std::vector<std::int32_t> activation;  ///< [rows]: the rows' input token ids
  std::vector<std::int32_t> gradient;    ///< [rows]: the rows' target token ids (-1: none)
  /// What the sender divided each gradient row by (SentinelMonitor::assess's scale): the step's
  /// real targets, since the loss is their mean (engine::detail::step_targets). Without it the
  /// gradients' norms move with the step's target count (over 1,000 stories260K steps of 260-512
  /// targets, that was a third of the spread of a message's key-norm). > 0.
  double gradient_scale = 1.0;
};

/// The row keys of a step's micro-batches, in order: for each batch (a data::PackedBatch, or
/// anything with `inputs` and `targets` vectors of int32 token ids, [rows] each), its input ids
/// as the activation keys and its target ids as the gradient keys; every batch's gradient_scale
/// is the step's real targets (targets other than -1, over all the batches; 1 when none).
template <class Batch>
std::vector<RowKeys> row_keys(std::span<const Batch> batches) {
  std::int64_t targets = 0;
  for (const auto& b : batches)
    for (const auto t : b.targets) targets += t >= 0 ? 1 : 0;
  const double scale = targets > 0 ? static_cast<double>(targets) : 1.0;
  std::vector<RowKeys> keys;
  keys.reserve(batches.size());
  for (const auto& b : batches) keys.push_back({b.inputs, b.targets, scale});
  return keys;
}

/// What VerifyingTransport does with a flagged message.
enum class VerifyPolicy {
  Log,         ///< record it and deliver it (the monitor still does not learn it)
  Drop,        ///< record it and deliver it with kFlagDropped set: the engine drops the micro-batch
  Stop,        ///< reject it: Error{Rejected} naming the ranks, kind, micro-batch, score, threshold
  Quarantine,  ///< reject it, saying the sender is quarantined and no replica can take over
};

/// Name of a policy ("log", "drop", "stop", "quarantine").
constexpr const char* to_string(VerifyPolicy p) noexcept {
  switch (p) {
    case VerifyPolicy::Log: return "log";
    case VerifyPolicy::Drop: return "drop";
    case VerifyPolicy::Stop: return "stop";
    case VerifyPolicy::Quarantine: return "quarantine";
  }
  return "unknown";
}

/// The policy named `s` ("log", "drop", "stop", "quarantine").
/// @throws brigade::Error{InvalidArgument} naming the value and the choices
inline VerifyPolicy parse_verify_policy(std::string_view s) {
  for (VerifyPolicy p :
       {VerifyPolicy::Log, VerifyPolicy::Drop, VerifyPolicy::Stop, VerifyPolicy::Quarantine})
    if (s == to_string(p)) return p;
  ::brigade::detail::fail(Errc::InvalidArgument,
                          "verify policy '{}' is not one of log, drop, stop, quarantine",
                          ::brigade::detail::excerpt(s));
}

/// One checked message's verdict (VerifyingTransport::verdicts()).
struct VerdictRecord {
  int from = -1;                            ///< sending rank
  int to = -1;                              ///< receiving rank (the verifier's)
  MessageKind kind = MessageKind::Control;  ///< the message's kind
  std::int64_t microbatch = 0;              ///< from the header that arrived
  std::int64_t stage = 0;                   ///< from the header that arrived
  std::int64_t chunk = 0;                   ///< from the header that arrived
  /// This message's number among the (from, kind) messages this receiver got, from 0 (checked
  /// or not); InjectionRecord::index counts the same on the sending side.
  std::int64_t index = 0;
  double score = 0;  ///< Assessment::score (token checks: 0, or +inf for an id out of range)
  /// The threshold in force: +inf during warm-up and for token checks (where the range decides).
  double threshold = std::numeric_limits<double>::infinity();
  bool flagged = false;                       ///< the message was flagged
  /// The sender's FaultInjectingTransport corrupted it (kFlagInjected): the ground truth of a
  /// fault-injection run, recorded beside the verdict; the check never reads it.
  bool injected = false;
  std::chrono::steady_clock::time_point at;   ///< when the check ran
  std::string reason;                         ///< empty unless flagged
};

/// The row bucket of VerifyingTransport's stream key (its docstring): floor(log2(rows)) (rows
/// below 1 count as 1).
[[nodiscard]] inline int stream_bucket(std::int64_t rows) noexcept {
  return std::bit_width(static_cast<std::uint64_t>(std::max<std::int64_t>(rows, 1))) - 1;
}

/// The monitors of one stream of VerifyingTransport (one sending rank, kind, stage, width and
/// whether its rows have keys): one SentinelMonitor per row bucket (stream_bucket), so that a
/// message is scored against messages of its own size (prefill-sized and decode-sized inference
/// messages; training chunks of 8 to 128 rows).
///
/// The stand-in: a bucket's monitor gives no verdicts during its warm-up
/// (SentinelMonitor::warming_up), and a rare size can stay there for a whole run (stories260K's
/// chunks of 8-15 rows: 8 messages in 1,000 steps). While it does, each of its messages is
/// judged by the monitor of the nearest bucket that gives verdicts (the larger of two equally
/// near), which assesses it without learning it; a message that monitor flags is flagged (its
/// reason names the stand-in) and not learned, one it would not learn (over
/// config.learn_below of a threshold) is not learned by its own bucket either, and every other
/// is learned by its own bucket's monitor. The key references and the random-effects score
/// (a statistic over n rows judged within the spread between messages plus its n's standard
/// error) are what make a monitor of other sizes a fair judge; the stand-in is used only until
/// the message's own bucket has warmed up, so an honest outlier of a frequent size is still
/// judged by its own size's spread (pooling every size into one monitor flagged one in a clean
/// 1,000-step run: docs/integrity.md, "Stream key"). Before any bucket gives verdicts (a
/// stream's first messages are spread over its sizes, so the most frequent bucket warms up only
/// after 1.5-2 warm-ups' worth of messages), the stand-in is a monitor of every size, which
/// learns every message the buckets learn until then and is dropped once a bucket is warm.
///
/// With minor-share on, the monitors share one MinorSubspace (the subspace is a property of the
/// stream's rows, not of the messages' sizes): the buckets' monitors teach it each message they
/// learn, the monitor of every size only reads it.
///
/// Memory: that of its monitors (SentinelMonitor) and the subspace; the monitor of every size,
/// until it is dropped. Not thread-safe.
class StreamMonitor {
 public:
  /// Monitors that score minor-share when `minor_share` (SentinelMonitor's constructor).
  /// @throws brigade::Error{InvalidArgument} for a bad config (validate)
  explicit StreamMonitor(const SentinelConfig& config = {}, bool minor_share = true)
      : config_(config), minor_on_(minor_share) {
    validate(config_);
    first_.emplace(config_, minor_on_);
  }

  /// Scores and verdicts the f32 message x [rows, cols] (row-major) with its row keys and known
  /// scale, as SentinelMonitor::observe does, in its row bucket's monitor or, while that one
  /// warms up, by the stand-in (class docstring). The Assessment is the judging monitor's
  /// (threshold +inf when none gives verdicts yet); learnable says whether the message's own
  /// bucket learned it.
  /// @throws brigade::Error{InvalidArgument} as SentinelMonitor::assess (a width other than the
  ///   stream's, keys of another count than rows, a scale that is not finite and > 0)
  Assessment observe(std::span<const float> x, std::int64_t rows,
                     std::span<const std::int32_t> keys = {}, double scale = 1.0) {
    const int bucket = stream_bucket(rows);
    if (minor_on_ && !minor_ && rows >= 1 && !x.empty() &&
        x.size() % static_cast<std::size_t>(rows) == 0) {
      minor_ = std::make_shared<MinorSubspace>(static_cast<std::int64_t>(x.size()) / rows);
      if (first_) first_->share_minor(minor_, false);  // the buckets' monitors teach it
    }
    auto [slot, fresh] = monitors_.try_emplace(bucket, config_, minor_on_);
    auto& own = slot->second;
    if (fresh && minor_) own.share_minor(minor_, true);
    if (!own.warming_up()) {
      first_.reset();
      return own.observe(x, rows, keys, scale);
    }
    // A stand-in judges (assess, no learning); the message's own bucket records it for
    // minor-share's reference unless it is flagged.
    SentinelMonitor* judge = nullptr;
    int judge_bucket = -1;
    for (auto& [b, m] : monitors_) {
      if (b == bucket || m.warming_up()) continue;
      const int d = std::abs(b - bucket);
      if (judge == nullptr || d <= std::abs(judge_bucket - bucket)) {  // ascending: larger wins ties
        judge = &m;
        judge_bucket = b;
      }
    }
    if (judge != nullptr) {
      first_.reset();  // a bucket gives verdicts: the monitor of every size is no longer needed
    } else if (first_ && !first_->warming_up()) {
      judge = &*first_;
    }
    if (judge == nullptr) {  // nothing judges yet: the message is learned (warm-up)
      if (first_) (void)first_->observe(x, rows, keys, scale);
      return own.observe(x, rows, keys, scale);
    }
    const bool by_first = first_ && judge == &*first_;
    Assessment j = judge->assess(x, rows, keys, scale);
    if (j.flagged) {
      j.learnable = false;
      j.reason += by_first
                      ? fmt::format(" (judged by the monitor of every size while no size's has "
                                    "warmed up; this message's is of {}-{} rows)",
                                    std::int64_t{1} << bucket, (std::int64_t{2} << bucket) - 1)
                      : fmt::format(" (judged by the monitor of {}-{}-row messages while the one "
                                    "of {}-{} rows warms up)",
                                    std::int64_t{1} << judge_bucket,
                                    (std::int64_t{2} << judge_bucket) - 1,
                                    std::int64_t{1} << bucket, (std::int64_t{2} << bucket) - 1);
      ++stood_in_;
      return j;
    }
    const Assessment a = own.assess(x, rows, keys, scale);
    j.learnable = j.learnable && a.learnable;
    if (j.learnable) {
      own.learn();
      if (by_first) first_->learn();
    } else if (own.assessed_) {  // recorded for minor-share's reference all the same
      own.decline();
    }
    if (a.flagged) return a;
    ++stood_in_;
    return j;
  }

  /// The monitor of row bucket `bucket` (stream_bucket), or nullptr before its first message.
  [[nodiscard]] const SentinelMonitor* bucket(int bucket) const {
    const auto it = monitors_.find(bucket);
    return it == monitors_.end() ? nullptr : &it->second;
  }
  /// Row buckets seen (monitors).
  [[nodiscard]] std::size_t buckets() const noexcept { return monitors_.size(); }
  /// Messages judged by a stand-in (a monitor of another row bucket, or of every size).
  [[nodiscard]] std::int64_t stood_in() const noexcept { return stood_in_; }

 private:
  SentinelConfig config_;
  std::map<int, SentinelMonitor> monitors_;  // row bucket -> monitor
  // The monitor of every size, until a bucket gives verdicts (class docstring).
  std::optional<SentinelMonitor> first_;
  std::int64_t stood_in_ = 0;
  // The stream's minor subspace, shared by its monitors (SentinelMonitor::share_minor).
  bool minor_on_ = true;
  std::shared_ptr<MinorSubspace> minor_;
};

/// The SENTINEL verifier: an InspectingTransport whose check runs a SentinelMonitor per stream
/// on the RECEIVING rank (a sender cannot vouch for itself) and applies a VerifyPolicy to a
/// flagged message.
///
/// Streams: one StreamMonitor per (sending rank, kind, header.stage, cols, keyed), holding one
/// monitor per row bucket floor(log2(rows)) (stream_bucket), rows = header.shape[0] and cols =
/// the product of the other dims, so prefill-sized and decode-sized messages are not scored
/// against each other; a bucket still in its warm-up is judged by the nearest warm one
/// (StreamMonitor, "the stand-in"). Float payloads
/// (f32; f16 and bf16 widened) of the checked kinds go first through the stream's ReplayGuard
/// (per sending rank, kind, stage and payload size; SentinelConfig::replay_memory): a replay is
/// flagged at once (score inf, also during warm-up) and not learned; then through the monitors;
/// I32 Token payloads through the range check [0, config.token_limit) when token_limit > 0 (no
/// EMA): a payload [n] holds n ids, a payload [n, k] n records whose last
/// column is the id (the inference engine's (sequence, position, token)); every other message
/// is not checked (and not recorded).
///
/// Policies (VerifyPolicy): Log and Drop deliver the payload (Drop with kFlagDropped in the
/// header the engine reads); Stop and Quarantine reject it (Error{Rejected}, InspectingTransport)
/// with the reason "integrity check: score S > threshold T: <statistic and deviation>";
/// Quarantine's reason says that rank F is quarantined and that no data-parallel replica exists
/// to take over its stages, so the run stops: brigade has no data-parallel replicas yet.
/// Row keys (expect()): the receiver's trusted knowledge of what each row of a training
/// message holds (the row's input token id for an activation, its target id for a gradient),
/// from the data order every rank reads; a message whose micro-batch has keys of its row count
/// is scored against per-key references (SentinelMonitor), any other in a stream of its own with
/// one shared key.
/// Every checked message appends a VerdictRecord (about 100 bytes and its reason); a monitor
/// holds 4 cols + 32 bytes per key it learned and 32 KiB of scores, and there is one
/// MinorSubspace per gradient stream (min(cols, 256)^2 doubles, (cols + 512) p + cols p/4
/// floats: 1.6 MiB for cols 512).
/// Movable (the state lives behind a shared pointer). Not thread-safe.
template <Transport Inner>
class VerifyingTransport : public InspectingTransport<Inner> {
  struct State;

 public:
  /// Verifies the received messages of `kinds` (default: activations, gradients and tokens).
  /// Verifies nothing (only forwards) when `kinds` is empty.
  /// @throws brigade::Error{InvalidArgument} for a bad config (validate)
  VerifyingTransport(Inner& inner, SentinelConfig config, VerifyPolicy policy,
                     std::vector<MessageKind> kinds = {MessageKind::Activation,
                                                       MessageKind::Gradient, MessageKind::Token})
      : VerifyingTransport(inner, std::make_shared<State>(config, policy, inner.rank()),
                           kinds) {}

  /// The row keys of the micro-batches to come, indexed by the header's micro-batch id
  /// (replacing those given before): the activation and gradient messages of micro-batch m are
  /// scored with keys[m].activation / keys[m].gradient when that vector has the message's row
  /// count. Call between steps (not while a receive is in flight). The keys must come from the
  /// receiver's own data (the trusted data order), never from a message. Gradient rows are
  /// compared times keys[m].gradient_scale.
  /// @throws brigade::Error{InvalidArgument} for a gradient_scale that is not finite and > 0
  ///         (naming the micro-batch); the keys in force are then left as they were
  void expect(std::vector<RowKeys> keys) {
    for (std::size_t m = 0; m < keys.size(); ++m)
      BRIGADE_CHECK(std::isfinite(keys[m].gradient_scale) && keys[m].gradient_scale > 0,
                    Errc::InvalidArgument,
                    "VerifyingTransport::expect: micro-batch {}'s gradient_scale = {}, expected "
                    "finite and > 0 (the step's real targets)",
                    m, keys[m].gradient_scale);
    state_->expected = std::move(keys);
  }

  /// Every checked message's verdict, in the order they were checked.
  [[nodiscard]] const std::vector<VerdictRecord>& verdicts() const noexcept {
    return state_->records;
  }
  /// Messages checked.
  [[nodiscard]] std::int64_t checked() const noexcept {
    return static_cast<std::int64_t>(state_->records.size());
  }
  /// Messages flagged.
  [[nodiscard]] std::int64_t flagged() const noexcept { return state_->flagged; }
  /// Monitors made so far: one per stream and row bucket (StreamMonitor).
  [[nodiscard]] std::size_t streams() const noexcept {
    std::size_t n = 0;
    for (const auto& [key, m] : state_->monitors) n += m.buckets();
    return n;
  }
  /// The config.
  [[nodiscard]] const SentinelConfig& config() const noexcept { return state_->config; }
  /// The policy.
  [[nodiscard]] VerifyPolicy policy() const noexcept { return state_->policy; }

 private:
  struct State {
    State(const SentinelConfig& c, VerifyPolicy p, int self) : config(c), policy(p), to(self) {
      validate(config);
    }
    SentinelConfig config;
    VerifyPolicy policy;
    int to;
    // (from, kind, stage, cols, keyed) -> the stream's monitors, one per row bucket
    std::map<std::tuple<int, int, std::int64_t, std::int64_t, bool>, StreamMonitor> monitors;
    std::vector<RowKeys> expected;  // expect(): per micro-batch
    // (from, kind, stage, payload bytes) -> the stream's replay check
    std::map<std::tuple<int, int, std::int64_t, std::size_t>, ReplayGuard> replays;
    std::map<std::pair<int, int>, std::int64_t> received;  // (from, kind) -> messages
    std::vector<VerdictRecord> records;
    std::int64_t flagged = 0;
    std::vector<float> aligned;  // a payload widened to float32, or one not float-aligned

    CheckResult check(const MessageHeader& h, int from, ConstBytes payload) {
      const std::int64_t index = received[{from, static_cast<int>(h.kind)}]++;
      // A message of a micro-batch already dropped upstream (kFlagDropped) is not checked: its
      // payload was computed from the zeros that replaced the flagged one, and learning it would
      // drag the statistics.
      if ((h.flags & kFlagDropped) != 0) return {};
      Assessment a;
      const std::int64_t numel = h.numel();
      if (is_float_dtype(h.dtype) && numel > 0 && payload.size() >= h.nbytes()) {
        const std::int64_t rows = h.ndim >= 1 ? std::max<std::int64_t>(1, h.shape[0]) : 1;
        const std::int64_t cols = numel / rows;
        std::optional<ReplayGuard::Repeat> repeat;
        if (config.replay_memory > 0) {
          const ConstBytes bytes = payload.first(h.nbytes());
          repeat = replays
                       .try_emplace(std::tuple(from, static_cast<int>(h.kind), h.stage,
                                               bytes.size()),
                                    config.replay_memory, config.warmup)
                       .first->second.observe(bytes, index, h.microbatch, h.chunk);
        }
        if (repeat) {  // flagged at once, warm-up or not; the monitor does not learn it
          a.score = std::numeric_limits<double>::infinity();
          a.flagged = true;
          a.statistic = "replay";
          a.reason = fmt::format("replay: the payload is bitwise the one of message {} "
                                 "(micro-batch {}, chunk {}) of this stream",
                                 repeat->index, repeat->microbatch, repeat->chunk);
        } else {
          std::span<const std::int32_t> keys;
          double scale = 1.0;
          if (h.microbatch >= 0 && h.microbatch < static_cast<std::int64_t>(expected.size())) {
            const auto& k = expected[static_cast<std::size_t>(h.microbatch)];
            const bool gradient = h.kind == MessageKind::Gradient;
            const auto& v = gradient ? k.gradient : k.activation;
            if (static_cast<std::int64_t>(v.size()) == rows) {
              keys = v;
              if (gradient) scale = k.gradient_scale;  // checked by expect()
            }
          }
          auto& monitor = monitors
                              .try_emplace(std::tuple(from, static_cast<int>(h.kind), h.stage,
                                                      cols, !keys.empty()),
                                           config,
                                           std::find(config.minor_share_kinds.begin(),
                                                     config.minor_share_kinds.end(),
                                                     h.kind) != config.minor_share_kinds.end())
                              .first->second;
          a = monitor.observe(floats(payload, h.dtype, static_cast<std::size_t>(numel)), rows,
                              keys, scale);
        }
      } else if (h.dtype == DType::I32 && h.kind == MessageKind::Token && config.token_limit > 0 &&
                 numel > 0) {
        // [n] holds ids; [n, k] holds records whose last column is the id (the inference
        // engine's (sequence, position, token)).
        const std::int64_t width = h.ndim >= 2 ? numel / std::max<std::int64_t>(1, h.shape[0]) : 1;
        std::vector<std::int32_t> ids(static_cast<std::size_t>(numel / width));
        for (std::size_t i = 0; i < ids.size(); ++i)
          std::memcpy(&ids[i], payload.data() + ((static_cast<std::int64_t>(i) + 1) * width - 1) * 4,
                      sizeof(std::int32_t));
        a.reason = token_range_violation(ids, config.token_limit);
        a.flagged = !a.reason.empty();
        a.score = a.flagged ? std::numeric_limits<double>::infinity() : 0.0;
      } else {
        return {};
      }
      records.push_back({from, to, h.kind, h.microbatch, h.stage, h.chunk, index, a.score,
                         a.threshold, a.flagged, (h.flags & kFlagInjected) != 0,
                         std::chrono::steady_clock::now(), a.reason});
      if (!a.flagged) return {};
      ++flagged;
      // Non-finite values, replays and token ids out of range are flagged at any threshold
      // (score inf).
      const std::string why =
          std::isinf(a.threshold)
              ? fmt::format("score inf: {}", a.reason)
              : fmt::format("score {:.4g} > threshold {:.4g}: {}", a.score, a.threshold,
                            a.reason);
      switch (policy) {
        case VerifyPolicy::Log: return {};
        case VerifyPolicy::Drop: return {Verdict::Drop, "integrity check: " + why};
        case VerifyPolicy::Stop: return {Verdict::Reject, "integrity check: " + why};
        case VerifyPolicy::Quarantine:
          return {Verdict::Reject,
                  fmt::format("integrity check: {}; rank {} is quarantined, and no data-parallel "
                              "replica exists to take over its stages, so the run stops",
                              why, from)};
      }
      return {};
    }

    /// The payload's n values as float32: a view of an aligned f32 payload, else a copy
    /// (f16 and bf16 widened exactly).
    std::span<const float> floats(ConstBytes p, DType dtype, std::size_t n) {
      if (dtype == DType::F32 && reinterpret_cast<std::uintptr_t>(p.data()) % alignof(float) == 0)
        return {reinterpret_cast<const float*>(p.data()), n};
      aligned.resize(n);
      if (dtype == DType::F32)
        std::memcpy(aligned.data(), p.data(), n * sizeof(float));
      else
        convert_to_f32(p.data(), dtype, aligned.data(), static_cast<std::int64_t>(n));
      return aligned;
    }
  };

  VerifyingTransport(Inner& inner, std::shared_ptr<State> state,
                     const std::vector<MessageKind>& kinds)
      : InspectingTransport<Inner>(
            inner, kinds,
            [s = state.get()](const MessageHeader& h, int from, ConstBytes p) {
              return s->check(h, from, p);
            }),
        state_(std::move(state)) {}

  std::shared_ptr<State> state_;
};

}  // namespace v0
}  // namespace brigade::transport
