// Token sampling: greedy, temperature, top-p (nucleus), seeded and reproducible.
#pragma once

#include "brigade/core/error.hpp"

#include <cstdint>
#include <span>

namespace brigade::model {
inline namespace v0 {

/// How the tail stage picks the next token.
struct SamplerConfig {
  float temperature = 0.0f;  ///< 0 = greedy (argmax); > 0 divides the logits before softmax
  float top_p = 0.9f;        ///< nucleus threshold; <= 0 or >= 1 samples the full distribution
  std::uint64_t seed = 42;   ///< xorshift* state seed (must be non-zero)
};

/// run.c's sampler, so that a seed gives the tokens llama2.c gives: argmax at temperature 0;
/// otherwise softmax(logits / temperature) and either multinomial sampling (top_p outside
/// (0, 1)) or nucleus sampling (Holtzman et al. 2019): candidates with p >= (1 - top_p)/(n - 1),
/// sorted descending (ties by index), truncated where the cumulative probability first exceeds
/// top_p; if no token reaches the cutoff (only for near-uniform distributions with
/// vocab_size * top_p < 1) all tokens are candidates. The coin
/// is xorshift* (Marsaglia 2003; Vigna 2016), one draw per sampled token.
class Sampler {
 public:
  /// @throws brigade::Error{InvalidArgument} if vocab_size < 1, temperature < 0 (or NaN),
  ///         top_p is NaN, or seed == 0
  Sampler(int vocab_size, SamplerConfig config);

  /// Picks a token from `logits` ([vocab_size]); overwrites logits with probabilities when
  /// temperature > 0.
  /// @throws brigade::Error{InvalidArgument} if logits.size() != vocab_size
  int sample(std::span<float> logits);

  /// The next xorshift* draw as run.c's random_f32: a float in [0, 1).
  float random_f32() noexcept;

  [[nodiscard]] const SamplerConfig& config() const noexcept { return config_; }

 private:
  int vocab_size_;
  SamplerConfig config_;
  std::uint64_t state_;
};

}  // namespace v0
}  // namespace brigade::model
