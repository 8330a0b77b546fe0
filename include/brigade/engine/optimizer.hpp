// AdamW with decoupled weight decay, global-norm gradient clipping, and a warm-up + cosine
// learning-rate schedule.
#pragma once

#include "brigade/core/error.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <span>
#include <vector>

namespace brigade::engine {
inline namespace v0 {

/// Hyper-parameters of AdamW (Loshchilov & Hutter 2019, Algorithm 2) and its schedule.
struct AdamWConfig {
  float lr = 5e-4f;            ///< peak learning rate
  float min_lr = 5e-5f;        ///< learning rate at the end of the cosine decay
  int warmup_steps = 10;       ///< linear warm-up from lr / warmup_steps to lr
  int decay_steps = 1000;      ///< cosine decay from lr (after warm-up) to min_lr at this step
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;   ///< decoupled decay, applied to matrices only (not norm gains)
  float clip_norm = 1.0f;      ///< global gradient-norm clip; <= 0 disables clipping

  /// Learning rate at optimizer step `step` (0-based): linear warm-up over `warmup_steps`, then
  /// cosine decay to min_lr at `decay_steps`, then min_lr (as llama2.c's train.py).
  [[nodiscard]] float lr_at(std::int64_t step) const noexcept {
    if (step < warmup_steps) return lr * static_cast<float>(step + 1) / static_cast<float>(warmup_steps);
    if (step >= decay_steps) return min_lr;
    const double ratio = static_cast<double>(step - warmup_steps) /
                         static_cast<double>(std::max(1, decay_steps - warmup_steps));
    const double coeff = 0.5 * (1.0 + std::cos(std::numbers::pi * ratio));
    return min_lr + static_cast<float>(coeff) * (lr - min_lr);
  }
};

/// One parameter tensor under the optimizer: its values, its gradient and its AdamW moments.
struct ParamSlot {
  float* value = nullptr;       ///< [size] parameter, updated in place
  const float* grad = nullptr;  ///< [size] gradient of the loss
  std::int64_t size = 0;
  bool decay = true;            ///< apply weight decay (false for norm gains)
  /// Counted in this optimizer's part of the global gradient norm (grad_square_sum). False for
  /// a tensor another rank also holds whole (a norm gain on TP rank > 0 of a tensor-parallel
  /// stage, runtime::ParamRef::replicated): the global norm counts each shard once and each
  /// replicated tensor once, as Megatron-LM does (its param_is_not_tensor_parallel_duplicate).
  bool in_norm = true;
};

namespace detail {
/// Sum of x[i]^2 over i in [0, n), in double, in a fixed order: element i goes to partial sum
/// i mod 8, and the 8 partial sums are added in lane order at the end. Independent partial sums
/// let the compiler vectorise the loop without reassociating it, so every build and ISA gives
/// the same bits. n <= 0 gives 0.
[[nodiscard]] inline double square_sum(const float* x, std::int64_t n) noexcept {
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lane[l] += static_cast<double>(x[i + l]) * x[i + l];
  for (int l = 0; i < n; ++i, ++l) lane[l] += static_cast<double>(x[i]) * x[i];
  double s = 0.0;
  for (double v : lane) s += v;
  return s;
}
}  // namespace detail

/// AdamW over a fixed list of parameter tensors. The moment buffers are owned and can be saved and
/// restored (checkpoint resume continues the exact same trajectory).
class AdamW {
 public:
  /// @throws brigade::Error{InvalidArgument} if a slot has a null pointer or a negative size
  AdamW(std::vector<ParamSlot> slots, AdamWConfig config) : slots_(std::move(slots)), config_(config) {
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      BRIGADE_CHECK(slots_[i].value && slots_[i].grad && slots_[i].size >= 0,
                    Errc::InvalidArgument, "AdamW: parameter {} has a null pointer or size {}", i,
                    slots_[i].size);
      m_.emplace_back(static_cast<std::size_t>(slots_[i].size), 0.0f);
      v_.emplace_back(static_cast<std::size_t>(slots_[i].size), 0.0f);
    }
  }

  /// Sum of squared gradients over this optimizer's slots counted in the norm
  /// (ParamSlot::in_norm): one rank's part of the global norm.
  [[nodiscard]] double grad_square_sum() const noexcept {
    double s = 0.0;
    for (const auto& p : slots_)
      if (p.in_norm) s += detail::square_sum(p.grad, p.size);
    return s;
  }

  /// One update with the global gradient norm `global_norm` (over every rank's parameters):
  /// gradients are scaled by min(1, clip_norm / global_norm), then
  /// m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr (m_hat / (sqrt(v_hat) + eps) + wd p).
  /// @return the learning rate used
  float step(double global_norm) {
    const float lr = config_.lr_at(step_);
    const float scale = (config_.clip_norm > 0 && global_norm > config_.clip_norm)
                            ? static_cast<float>(config_.clip_norm / global_norm)
                            : 1.0f;
    ++step_;
    const float b1 = config_.beta1, b2 = config_.beta2, eps = config_.eps;
    const float bc1 = 1.0f - std::pow(b1, static_cast<float>(step_));
    const float bc2 = 1.0f - std::pow(b2, static_cast<float>(step_));
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      const auto& p = slots_[k];
      // Four distinct buffers, and the hyper-parameters in locals: the loop vectorises (its
      // division and square root are correctly rounded in any width, so the bits do not
      // depend on it).
      float* __restrict value = p.value;
      const float* __restrict grad = p.grad;
      float* __restrict m = m_[k].data();
      float* __restrict v = v_[k].data();
      const float wd = p.decay ? config_.weight_decay : 0.0f;
      for (std::int64_t i = 0; i < p.size; ++i) {
        const float g = grad[i] * scale;
        m[i] = b1 * m[i] + (1.0f - b1) * g;
        v[i] = b2 * v[i] + (1.0f - b2) * g * g;
        const float mhat = m[i] / bc1, vhat = v[i] / bc2;
        value[i] -= lr * (mhat / (std::sqrt(vhat) + eps) + wd * value[i]);
      }
    }
    return lr;
  }

  /// Optimizer steps taken.
  [[nodiscard]] std::int64_t steps() const noexcept { return step_; }
  [[nodiscard]] const AdamWConfig& config() const noexcept { return config_; }
  /// The moment buffers (first moments then second moments, slot by slot), for checkpoints.
  [[nodiscard]] std::vector<std::span<float>> state() {
    std::vector<std::span<float>> out;
    for (auto& m : m_) out.emplace_back(m);
    for (auto& v : v_) out.emplace_back(v);
    return out;
  }
  /// Sets the number of steps taken (after restoring state()).
  void set_steps(std::int64_t s) noexcept { step_ = s; }

 private:
  std::vector<ParamSlot> slots_;
  AdamWConfig config_;
  std::vector<std::vector<float>> m_, v_;
  std::int64_t step_ = 0;
};

}  // namespace v0
}  // namespace brigade::engine
