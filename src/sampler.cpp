// run.c-compatible token sampler: greedy, multinomial and top-p over xorshift* draws.
#include "brigade/model/sampler.hpp"

#include "brigade/backend/cpu.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace brigade::model {
inline namespace v0 {
namespace {

/// First index of the largest value (ties go to the lowest index), as run.c's sample_argmax.
int argmax(std::span<const float> p) {
  int best = 0;
  float best_p = p[0];
  for (std::size_t i = 1; i < p.size(); ++i) {
    if (p[i] > best_p) {
      best_p = p[i];
      best = static_cast<int>(i);
    }
  }
  return best;
}

/// Walks the CDF of `p` until it passes `coin`; the last index if rounding leaves it short.
int sample_multinomial(std::span<const float> p, float coin) {
  float cdf = 0.0f;
  for (std::size_t i = 0; i < p.size(); ++i) {
    cdf += p[i];
    if (coin < cdf) return static_cast<int>(i);
  }
  return static_cast<int>(p.size()) - 1;
}

/// Nucleus sampling as run.c's sample_topp. Candidates are sorted by probability descending,
/// ties by index ascending (run.c's qsort leaves tie order unspecified).
int sample_top_p(std::span<const float> p, float top_p, float coin) {
  thread_local std::vector<std::pair<float, int>> cand;  // (prob, index), reused across calls
  cand.clear();
  const std::size_t n = p.size();
  if (n == 1) return 0;
  // Tokens below the cutoff cannot be in the nucleus (n - 1 of them could not reach 1 - top_p).
  const float cutoff = (1.0f - top_p) / static_cast<float>(n - 1);
  for (std::size_t i = 0; i < n; ++i) {
    if (p[i] >= cutoff) cand.emplace_back(p[i], static_cast<int>(i));
  }
  if (cand.empty()) {
    // Only possible when every probability is below the cutoff (a near-uniform distribution
    // with n * top_p < 1); run.c would read out of bounds here. Keep every token instead.
    for (std::size_t i = 0; i < n; ++i) cand.emplace_back(p[i], static_cast<int>(i));
  }
  std::sort(cand.begin(), cand.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  float cumulative = 0.0f;
  std::size_t last = cand.size() - 1;
  for (std::size_t i = 0; i < cand.size(); ++i) {
    cumulative += cand[i].first;
    if (cumulative > top_p) {
      last = i;
      break;
    }
  }
  const float r = coin * cumulative;
  float cdf = 0.0f;
  for (std::size_t i = 0; i <= last; ++i) {
    cdf += cand[i].first;
    if (r < cdf) return cand[i].second;
  }
  return cand[last].second;
}

}  // namespace

Sampler::Sampler(int vocab_size, SamplerConfig config)
    : vocab_size_(vocab_size), config_(config), state_(config.seed) {
  BRIGADE_CHECK(vocab_size >= 1, Errc::InvalidArgument,
                "Sampler: vocab_size = {}; expected >= 1", vocab_size);
  BRIGADE_CHECK(config.temperature >= 0.0f, Errc::InvalidArgument,
                "Sampler: temperature = {}; expected >= 0 (0 = greedy)", config.temperature);
  BRIGADE_CHECK(!std::isnan(config.top_p), Errc::InvalidArgument,
                "Sampler: top_p = {}; expected a number (<= 0 or >= 1 = full distribution)",
                config.top_p);
  BRIGADE_CHECK(config.seed != 0, Errc::InvalidArgument,
                "Sampler: seed = 0; expected non-zero (xorshift* would only ever return 0)");
}

float Sampler::random_f32() noexcept {
  state_ ^= state_ >> 12;
  state_ ^= state_ << 25;
  state_ ^= state_ >> 27;
  const auto u = static_cast<std::uint32_t>((state_ * 0x2545F4914F6CDD1DULL) >> 32);
  return static_cast<float>(u >> 8) / 16777216.0f;
}

int Sampler::sample(std::span<float> logits) {
  BRIGADE_CHECK(logits.size() == static_cast<std::size_t>(vocab_size_), Errc::InvalidArgument,
                "Sampler::sample: {} logits; expected vocab_size = {}", logits.size(),
                vocab_size_);
  if (config_.temperature == 0.0f) return argmax(logits);
  for (float& l : logits) l /= config_.temperature;
  cpu::softmax(logits.data(), static_cast<std::int64_t>(logits.size()));
  const float coin = random_f32();
  if (config_.top_p <= 0.0f || config_.top_p >= 1.0f) return sample_multinomial(logits, coin);
  return sample_top_p(logits, config_.top_p, coin);
}

}  // namespace v0
}  // namespace brigade::model
