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

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
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
#include <vector>

namespace brigade::transport {
inline namespace v0 {

/// Settings of the SENTINEL monitors (one SentinelMonitor per stream; VerifyingTransport).
struct SentinelConfig {
  /// EMA momentum beta of the statistics' mean and variance, in (0, 1): each learned message
  /// moves them by (1 - beta) (by 1/n for the n-th message while 1/n > 1 - beta, so the first
  /// messages are averaged plainly instead of being pulled towards zero).
  double decay = 0.95;
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
};

/// Checks a SentinelConfig's fields.
/// @throws brigade::Error{InvalidArgument} naming the field, its value and the range
inline void validate(const SentinelConfig& c) {
  BRIGADE_CHECK(c.decay > 0 && c.decay < 1, Errc::InvalidArgument,
                "sentinel config: decay = {}, expected in (0, 1)", c.decay);
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
}

/// What a SentinelMonitor says about one message.
struct Assessment {
  /// The deviation score: the largest of the statistics' scores (SentinelMonitor); +inf for a
  /// payload with non-finite values; 0 before the monitor has learned two messages.
  double score = 0;
  /// The threshold in force: +inf during warm-up (and, calibrated, until 8 scores are known).
  double threshold = std::numeric_limits<double>::infinity();
  bool flagged = false;         ///< score > threshold, or non-finite values
  const char* statistic = "";   ///< name of the statistic with the largest score
  std::string reason;           ///< empty unless flagged: which statistic deviated, by how much
};

/// The EMA statistics of ONE stream of f32 messages [rows, cols] (cols fixed by the first
/// message), after SENTINEL (arXiv 2603.03592): each message's statistics are compared with the
/// exponential moving mean and variance of the same statistics over the stream's accepted
/// messages.
///
/// Statistics of x [rows, cols] (two passes over x, O(rows * cols); no allocation after the first
/// message of a row count): log RMS ("log-rms"); the mean ("mean"); max |x| / RMS ("peak-ratio":
/// one exploded element); the mean over the typical rows of cos(x_r, mu), mu the learned channel
/// means ("alignment": a sign flip of a share p of the elements scales each row's projection on
/// mu by 1 - 2p and keeps its norm; scored one-sided, only a fall, and only where |mu|^2 exceeds
/// the sampling noise of one message's channel means, sum of channel variances / rows: not on
/// gradients); the standard deviation of log row RMS over the rows ("row-spread"); over the
/// typical rows (norm at most 3x the median row's) the per-channel variance as its logarithm
/// ("channel-var", cols values; 0 for one row); the count of non-finite values. The per-channel
/// means are learned (they are mu) but not scored on their own.
///
/// Score: each statistic value s_d is compared with its EMA mean mu_d and variance var_d:
/// z_d = |s_d - mu_d| / sqrt(var_d + f_d^2), f_d = 1e-3 (|mu_d| + g) (g = 0 for the scalars,
/// mean |mu| + sqrt(mean var) over the vector for channel-var: a floor so that a constant
/// statistic does not divide by zero). A scalar scores z; channel-var scores the median of z_d
/// over the channels / 0.6745 (about 1 when the channels deviate as learned): the channels of
/// real traffic are correlated and heavy-tailed, so sum z_d^2 is far from chi-square (on
/// stories260K it flagged 1.1% of clean activations), where a median moves only when most
/// channels do (noise, scaling). A non-finite value makes the score +inf and the message is
/// flagged at once, even during warm-up.
///
/// Warm-up: the first `warmup` messages are learned without verdicts (non-finite values aside);
/// at its end the EMAs restart from the median and 1.4826 x the median absolute deviation of the
/// (last 64) warm-up statistics, so faults in a minority of the warm-up messages do not stay in
/// them.
///
/// Learning: an accepted message updates the EMAs (mu += a (s - mu); var = (1 - a)(var +
/// a (s - mu)^2), a = max(1 - decay, 1/n)); a flagged one does not (a corrupting sender must not
/// drag the statistics), so a sudden lasting change of a stream keeps being flagged (with Log or
/// Drop, until the stream returns to what the monitor learned).
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
/// q75, q50 + (q75 - q50) / ln 2 * ln(0.5 / q); and floored at kMinThreshold (6; 4 for
/// alignment). The message is flagged when a statistic exceeds its threshold; the Assessment
/// names the statistic with the largest score / threshold. Refitted after every n/16 new
/// scores. Not thread-safe.
class SentinelMonitor {
 public:
  /// Statistics scored (the size of kNames); each has its own calibrated threshold.
  static constexpr int kGroups = 6;

  /// @throws brigade::Error{InvalidArgument} for a bad config (validate)
  explicit SentinelMonitor(const SentinelConfig& config = {}) : config_(config) {
    validate(config_);
  }

  /// The statistics and score of x [rows, cols] against what the monitor learned, and whether
  /// the threshold in force flags it; changes nothing but scratch space (learn() then learns
  /// these statistics). Cost: two passes over x plus O(rows + cols).
  /// @throws brigade::Error{InvalidArgument} for rows < 1, x.size() not a multiple of rows, or a
  ///         width other than the stream's (the first message's)
  Assessment assess(std::span<const float> x, std::int64_t rows) {
    BRIGADE_CHECK(rows >= 1 && !x.empty() && x.size() % static_cast<std::size_t>(rows) == 0,
                  Errc::InvalidArgument,
                  "SentinelMonitor: {} values are not a [rows = {}, cols] matrix", x.size(), rows);
    const auto cols = static_cast<std::int64_t>(x.size()) / rows;
    if (cols_ == 0) init(cols);
    BRIGADE_CHECK(cols == cols_, Errc::InvalidArgument,
                  "SentinelMonitor: a message [{}, {}] in a stream of width {}", rows, cols, cols_);
    assessed_ = false;
    Assessment a;
    a.threshold = threshold(0);
    if (!statistics(x.data(), rows)) {  // non-finite values
      a.score = std::numeric_limits<double>::infinity();
      a.flagged = true;
      a.statistic = "non-finite";
      a.reason = nonfinite_reason_;
      return a;
    }
    assessed_ = true;
    score_.fill(0);
    if (learned_ >= 2) {
      for (int g = 0; g < kScalars; ++g) {
        const auto d = static_cast<std::size_t>(g);
        const double diff = cur_[d] - mean_[d];
        // alignment is one-sided: faults (sign flips, noise) only pull rows off the direction.
        score_[d] = g == kAlignment && (diff > 0 || !directed_)
                        ? 0.0
                        : std::fabs(diff) * std::sqrt(weight_[d]);
      }
      score_[kScalars] = channel_var_score();
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
    if (a.flagged) a.reason = reason(worst);
    return a;
  }

  /// Learns the statistics of the message assess() saw last: updates the EMAs and, once the
  /// monitor has learned ceil(warmup / 2) messages, adds its score to the calibration reservoir.
  /// @throws brigade::Error{InvalidUsage} when nothing was assessed since the last learn, or the
  ///         last message had non-finite values
  void learn() {
    BRIGADE_CHECK(assessed_, Errc::InvalidUsage,
                  "SentinelMonitor::learn: no finite message assessed since the last learn");
    assessed_ = false;
    if (learned_ >= std::max<std::int64_t>(2, (config_.warmup + 1) / 2)) add_scores();
    ++learned_;
    const double a = std::max(1.0 - config_.decay, 1.0 / static_cast<double>(learned_));
    for (std::size_t d = 0; d < cur_.size(); ++d) {
      const double diff = cur_[d] - mean_[d];
      mean_[d] += a * diff;
      var_[d] = (1 - a) * (var_[d] + a * diff * diff);
    }
    if (learned_ <= config_.warmup) {  // keep the last kWarmRows warm-up statistics
      const std::size_t rows = warm_.size() / cur_.size();
      std::copy(cur_.begin(), cur_.end(),
                warm_.begin() + static_cast<std::ptrdiff_t>(
                                    static_cast<std::size_t>(learned_ - 1) % rows * cur_.size()));
      if (learned_ == config_.warmup) robust_start();
    }
    update_denominators();
  }

  /// assess(x, rows), then learn() when the message is not flagged.
  /// @throws brigade::Error{InvalidArgument} as assess
  Assessment observe(std::span<const float> x, std::int64_t rows) {
    Assessment a = assess(x, rows);
    if (!a.flagged) learn();
    return a;
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
  /// the monitor learned two messages or after a non-finite payload.
  [[nodiscard]] const std::array<double, kGroups>& scores() const noexcept { return score_; }
  /// Messages learned.
  [[nodiscard]] std::int64_t learned() const noexcept { return learned_; }
  /// The stream's width (0 before the first message).
  [[nodiscard]] std::int64_t cols() const noexcept { return cols_; }
  /// The config.
  [[nodiscard]] const SentinelConfig& config() const noexcept { return config_; }
  /// Names of the statistics, in the order of their scores.
  static constexpr const char* kNames[] = {"log-rms",   "mean",       "peak-ratio",
                                           "alignment", "row-spread", "channel-var"};
  /// Scores are kept for calibration in a reservoir of this many.
  static constexpr std::int64_t kReservoir = 1024;
  /// Scores the calibrated threshold needs before it gives verdicts.
  static constexpr std::int64_t kMinScores = 8;
  /// Warm-up statistics kept for the robust start (the last this many of the warm-up).
  static constexpr std::size_t kWarmRows = 64;
  /// The cap on the calibrated threshold over the body's exponential bound (class docstring).
  static constexpr double kBodyMargin = 1.0;
  /// A calibrated threshold is never below these (per statistic, in the order of kNames): 4
  /// for alignment, a mean over the rows of their cosines whose clean scores have a near-normal
  /// tail; 6 for the others, whose rare clean excursions (one unusual micro-batch of text, one
  /// token's large gradient) a reservoir of scores cannot place (docs/integrity.md).
  static constexpr std::array<double, kGroups> kMinThreshold = {6, 6, 6, 4, 6, 6};

 private:
  static constexpr int kScalars = 5;    // log-rms, mean, peak-ratio, alignment, row-spread
  static constexpr int kAlignment = 3;  // its index (one-sided)
  static_assert(kGroups == kScalars + 1);  // and channel-var (the channel means: not scored)
  static constexpr double kInf = std::numeric_limits<double>::infinity();
  static constexpr double kTiny = 1e-300;  // log(0 + kTiny): a zeroed payload's finite statistic

  [[nodiscard]] std::pair<std::size_t, std::size_t> group(int g) const {
    const auto c = static_cast<std::size_t>(cols_);
    const auto k = static_cast<std::size_t>(kScalars);
    if (g < kScalars) return {static_cast<std::size_t>(g), static_cast<std::size_t>(g) + 1};
    return {k + c, k + 2 * c};  // channel-var; [k, k + c) holds the channel means
  }

  // The weights 1 / (var + floor^2) of the squared deviations (class docstring); no square root
  // per value, so the loops vectorize.
  void update_denominators() {
    for (int g = 0; g < kGroups; ++g) {
      const auto [b, e] = group(g);
      double scale = 0;
      if (e - b > 1) {
        double abs_mean[4] = {0, 0, 0, 0}, var[4] = {0, 0, 0, 0};
        std::size_t d = b;
        for (; d + 4 <= e; d += 4)
          for (std::size_t i = 0; i < 4; ++i) {
            abs_mean[i] += std::fabs(mean_[d + i]);
            var[i] += var_[d + i];
          }
        for (; d < e; ++d) {
          abs_mean[0] += std::fabs(mean_[d]);
          var[0] += var_[d];
        }
        const auto n = static_cast<double>(e - b);
        scale = (abs_mean[0] + abs_mean[1] + abs_mean[2] + abs_mean[3]) / n +
                std::sqrt((var[0] + var[1] + var[2] + var[3]) / n);
      }
      for (std::size_t d = b; d < e; ++d) {
        const double floor = 1e-3 * (std::fabs(mean_[d]) + scale) + 1e-30;
        weight_[d] = 1.0 / (var_[d] + floor * floor);
      }
    }
  }

  // End of warm-up: the EMAs restart from the median and the scaled median absolute deviation
  // (1.4826 MAD, the normal's sd) of the kept warm-up statistics, which faults in a minority of
  // the warm-up messages hardly move; then the warm-up buffer is released.
  void robust_start() {
    const std::size_t dims = cur_.size();
    const std::size_t n = std::min<std::size_t>(static_cast<std::size_t>(config_.warmup),
                                                warm_.size() / dims);
    if (n >= 3) {
      std::vector<double> col(n);
      auto mid = col.begin() + static_cast<std::ptrdiff_t>(n / 2);
      for (std::size_t d = 0; d < dims; ++d) {
        for (std::size_t i = 0; i < n; ++i) col[i] = warm_[i * dims + d];
        std::nth_element(col.begin(), mid, col.end());
        const double med = *mid;
        for (auto& v : col) v = std::fabs(v - med);
        std::nth_element(col.begin(), mid, col.end());
        mean_[d] = med;
        var_[d] = 1.4826 * 1.4826 * *mid * *mid;
      }
    }
    std::vector<double>().swap(warm_);
  }

  // channel-var: the median over the channels of |z_d|, / 0.6745 (the median of |N(0, 1)|), so
  // about 1 when the channels deviate as learned. The median, not sum z^2: the channels of real
  // traffic are correlated and heavy-tailed (docs/integrity.md, "The statistics").
  [[nodiscard]] double channel_var_score() {
    const auto [b, e] = group(kScalars);
    absz_.resize(e - b);
    for (std::size_t d = b; d < e; ++d)
      absz_[d - b] = std::fabs(cur_[d] - mean_[d]) * std::sqrt(weight_[d]);
    auto mid = absz_.begin() + static_cast<std::ptrdiff_t>(absz_.size() / 2);
    std::nth_element(absz_.begin(), mid, absz_.end());
    return *mid / 0.6744897501960817;
  }

  void init(std::int64_t cols) {
    cols_ = cols;
    const auto c = static_cast<std::size_t>(cols);
    const std::size_t dims = kScalars + 2 * c;
    cur_.assign(dims, 0);
    mean_.assign(dims, 0);
    var_.assign(dims, 0);
    weight_.assign(dims, 0);
    sum_.assign(c, 0);
    sq_.assign(c, 0);
    warm_.assign(std::min<std::size_t>(static_cast<std::size_t>(config_.warmup), kWarmRows) * dims, 0);
    reservoir_.assign(static_cast<std::size_t>(kGroups * kReservoir), 0);
    sorted_.assign(kReservoir, 0);
    fitted_.fill(kInf);
  }

  // The statistics of x into cur_; false (and nonfinite_reason_ set) for non-finite values.
  // Pass 1, per row r: the sum, the sum of squares ss_r (double) and max |x|. Pass 2: the
  // per-channel sums and sums of squares.
  bool statistics(const float* x, std::int64_t rows) {
    const std::int64_t c = cols_;
    const auto uc = static_cast<std::size_t>(c);
    const auto ur = static_cast<std::size_t>(rows);
    row_ss_.resize(ur);
    double s = 0, q = 0, peak = 0;
    for (std::size_t r = 0; r < ur; ++r) {
      const float* a = x + r * uc;
      double rs[4] = {0, 0, 0, 0}, rq[4] = {0, 0, 0, 0};
      float pk[4] = {0, 0, 0, 0};
      std::size_t j = 0;
      for (; j + 4 <= uc; j += 4)
        for (std::size_t i = 0; i < 4; ++i) {
          const double v = a[j + i];
          rs[i] += v;
          rq[i] += v * v;
          const float m = std::fabs(a[j + i]);
          pk[i] = pk[i] < m ? m : pk[i];
        }
      for (; j < uc; ++j) {
        const double v = a[j];
        rs[0] += v;
        rq[0] += v * v;
        const float m = std::fabs(a[j]);
        pk[0] = pk[0] < m ? m : pk[0];
      }
      const double ss = (rq[0] + rq[1]) + (rq[2] + rq[3]);
      row_ss_[r] = ss;
      s += (rs[0] + rs[1]) + (rs[2] + rs[3]);
      q += ss;
      peak = std::max({peak, static_cast<double>(pk[0]), static_cast<double>(pk[1]),
                       static_cast<double>(pk[2]), static_cast<double>(pk[3])});
    }
    if (!std::isfinite(s) || !std::isfinite(q) || std::isnan(peak) || std::isinf(peak)) {
      const std::size_t n = ur * uc;
      std::size_t bad = 0, first = n;
      for (std::size_t i = 0; i < n; ++i)
        if (!std::isfinite(x[i])) {
          if (bad++ == 0) first = i;
        }
      nonfinite_reason_ = fmt::format(
          "{} non-finite value{} (the first, {}, at row {}, column {} of [{}, {}])", bad,
          bad == 1 ? "" : "s", bad > 0 ? x[first] : 0.0f, first / uc, first % uc, rows, c);
      return false;
    }
    const double n = static_cast<double>(rows) * static_cast<double>(c);
    const double ms = q / n;
    cur_[0] = 0.5 * std::log(ms + kTiny);
    cur_[1] = s / n;
    cur_[2] = ms > 0 ? peak / std::sqrt(ms) : 0.0;
    // Row spread: the standard deviation of log row RMS over the rows.
    double lm = 0, lq = 0;
    for (std::size_t r = 0; r < ur; ++r) {
      const double l = 0.5 * std::log(row_ss_[r] / static_cast<double>(c) + kTiny);
      lm += l;
      lq += l * l;
    }
    lm /= static_cast<double>(rows);
    // (exactly 0 for one row: a decode message's rounding must not score against an EMA of 0)
    cur_[4] = rows == 1 ? 0.0 : std::sqrt(std::max(lq / static_cast<double>(rows) - lm * lm, 0.0));
    // Pass 2: channel sums over the typical rows, those whose norm is at most 3x the median
    // row's (double: finite values whose float squares would overflow stay finite). The few
    // rows of much larger norm (in a residual stream, the first token of each packed sequence)
    // are left out, so the channel statistics do not swing with how many sequences a micro-batch
    // packs; a fault that touches every row still shows in the typical ones.
    median_ss_.assign(row_ss_.begin(), row_ss_.end());
    auto mid = median_ss_.begin() + static_cast<std::ptrdiff_t>(ur / 2);
    std::nth_element(median_ss_.begin(), mid, median_ss_.end());
    const double cut = 9.0 * *mid;
    std::fill(sum_.begin(), sum_.end(), 0.0);
    std::fill(sq_.begin(), sq_.end(), 0.0);
    double* __restrict cs = sum_.data();
    double* __restrict cq = sq_.data();
    const double* ema = mean_.data() + kScalars;  // the channel means learned so far
    const double* ema_var = ema + uc;              // and the channel log variances
    double ema2 = 0, spread = 0;
    for (std::size_t j = 0; j < uc; ++j) {
      ema2 += ema[j] * ema[j];
      spread += std::exp(ema_var[j]);
    }
    std::int64_t kept = 0;
    double cos_sum = 0;  // over the typical rows: cos(x_r, ema)
    for (std::size_t r = 0; r < ur; ++r) {
      if (row_ss_[r] > cut) continue;
      ++kept;
      const float* a = x + r * uc;
      double dot[4] = {0, 0, 0, 0};
      std::size_t j = 0;
      for (; j + 4 <= uc; j += 4)
        for (std::size_t i = 0; i < 4; ++i) {
          const double y = a[j + i];
          cs[j + i] += y;
          cq[j + i] += y * y;
          dot[i] += y * ema[j + i];
        }
      for (; j < uc; ++j) {
        const double y = a[j];
        cs[j] += y;
        cq[j] += y * y;
        dot[0] += y * ema[j];
      }
      const double norms = std::sqrt(row_ss_[r] * ema2);
      if (norms > 0) cos_sum += ((dot[0] + dot[1]) + (dot[2] + dot[3])) / norms;
    }
    const double inv_rows = 1.0 / static_cast<double>(std::max<std::int64_t>(kept, 1));
    double* mean = cur_.data() + kScalars;
    double* var = mean + uc;
    for (std::size_t j = 0; j < uc; ++j) {
      mean[j] = cs[j] * inv_rows;
      // log variance: nearly symmetric where the variance itself is skewed (chi-square).
      var[j] = rows == 1 ? 0.0
                         : std::log(std::max(cq[j] * inv_rows - mean[j] * mean[j], 0.0) + kTiny);
    }
    // Alignment: the typical rows' mean cosine with the learned channel means (0 before any
    // message was learned). A sign flip of a share p of the elements scales each row's
    // projection on that direction by 1 - 2p and keeps its norm; noise adds norm and no
    // projection; so both pull it down (SENTINEL compares each message with the EMA of the
    // edge's tensors; this is that comparison as a direction).
    cur_[kAlignment] = cos_sum * inv_rows;
    // Scored only where the learned direction stands out of the sampling noise of one
    // message's channel means (squared norm above sum of channel variances / rows): gradients,
    // whose channel means are near 0, have no direction to be aligned with.
    directed_ = learned_ > 0 && kept > 1 && ema2 > spread * inv_rows;
    return true;
  }

  std::string reason(int g) const {
    const auto [b, e] = group(g);
    const double s = score_[static_cast<std::size_t>(g)];
    if (e - b == 1)
      return fmt::format("{} = {:.4g}, EMA {:.4g} +- {:.3g} (z = {:.3g})", kNames[g], cur_[b],
                         mean_[b], std::sqrt(var_[b]), s);
    std::size_t worst = b;
    double zmax = 0, z2 = 0;
    for (std::size_t d = b; d < e; ++d) {
      const double z = std::fabs(cur_[d] - mean_[d]) * std::sqrt(weight_[d]);
      z2 += z * z;
      if (z > zmax) {
        zmax = z;
        worst = d;
      }
    }
    return fmt::format(
        "{} deviates over its {} values (score {:.3g}: median |z| {:.3g}, rms z {:.3g}); the "
        "largest at index {}: {:.4g}, EMA {:.4g} +- {:.3g} (z = {:.3g})",
        kNames[g], e - b, s, s * 0.6744897501960817, std::sqrt(z2 / static_cast<double>(e - b)),
        worst - b, cur_[worst], mean_[worst], std::sqrt(var_[worst]), zmax);
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
  std::vector<double> cur_, mean_, var_, weight_;  // [kScalars, cols (channel means), cols]
  std::vector<double> sum_, sq_;                   // per-channel sums and sums of squares
  std::vector<double> row_ss_, median_ss_;         // per-row sums of squares, and a copy
  std::vector<double> warm_;  // the last warm-up statistics, [min(warmup, kWarmRows), dims]
  std::array<double, kGroups> score_{};
  bool directed_ = false;  // the learned channel means give alignment a direction (statistics())
  bool assessed_ = false;
  std::string nonfinite_reason_;
  std::vector<double> absz_;  // channel-var: |z| per channel (scratch)
  std::vector<double> reservoir_;  // [kGroups, kReservoir]: each statistic's accepted scores
  std::vector<double> sorted_;     // one statistic's, partially sorted by fit()
  std::int64_t next_ = 0, reservoir_size_ = 0, since_fit_ = 0;
  std::array<double, kGroups> fitted_{};  // each statistic's calibrated threshold
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

/// The SENTINEL verifier: an InspectingTransport whose check runs a SentinelMonitor per stream
/// on the RECEIVING rank (a sender cannot vouch for itself) and applies a VerifyPolicy to a
/// flagged message.
///
/// Streams: one monitor per (sending rank, kind, header.stage, floor(log2(rows)), cols), rows =
/// header.shape[0] and cols = the product of the other dims, so prefill-sized and decode-sized
/// messages are not scored against each other. Float payloads (f32; f16 and bf16 widened) of the
/// checked kinds go first through the stream's ReplayGuard (per sending rank, kind, stage and
/// payload size; SentinelConfig::replay_memory): a replay is flagged at once (score inf, also
/// during warm-up) and not learned; then through the monitors; I32 Token payloads through the range check [0, config.token_limit) when
/// token_limit > 0 (no EMA): a payload [n] holds n ids, a payload [n, k] n records whose last
/// column is the id (the inference engine's (sequence, position, token)); every other message
/// is not checked (and not recorded).
///
/// Policies (VerifyPolicy): Log and Drop deliver the payload (Drop with kFlagDropped in the
/// header the engine reads); Stop and Quarantine reject it (Error{Rejected}, InspectingTransport)
/// with the reason "integrity check: score S > threshold T: <statistic and deviation>";
/// Quarantine's reason says that rank F is quarantined and that no data-parallel replica exists
/// to take over its stages, so the run stops: brigade has no data-parallel replicas yet.
/// Every checked message appends a VerdictRecord (about 100 bytes and its reason); a monitor
/// holds about 64 cols + 16 rows bytes plus 16 KiB of scores (and, during warm-up,
/// 8 min(warmup, 64) (5 + 2 cols) bytes more).
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
  /// Streams (monitors) seen so far.
  [[nodiscard]] std::size_t streams() const noexcept { return state_->monitors.size(); }
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
    std::map<std::tuple<int, int, std::int64_t, int, std::int64_t>, SentinelMonitor> monitors;
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
        const int bucket = std::bit_width(static_cast<std::uint64_t>(rows)) - 1;
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
          auto& monitor =
              monitors
                  .try_emplace(std::tuple(from, static_cast<int>(h.kind), h.stage, bucket, cols),
                               config)
                  .first->second;
          a = monitor.observe(floats(payload, h.dtype, static_cast<std::size_t>(numel)), rows);
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
