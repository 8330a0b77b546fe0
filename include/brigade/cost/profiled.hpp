// Layer times from a device profile (docs/profiles.md): the calibrated model::LayerSeconds that
// the balanced partitions, the plan builders, the inference planner and the cost model read in
// place of the default-rate roofline.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/cost/profile.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/layer_cost.hpp"

#include <algorithm>
#include <cmath>
#include <memory>

namespace brigade::cost {
inline namespace v0 {

/// Seconds of each layer of a model for a work item and phase on a profiled device, composed
/// from the profile's measured primitives (a model::LayerSeconds: copy it into any field of
/// that type). With b = the bandwidth of `threads` cores while `active_cores` cores stream at
/// once, min(threads x core_bytes_per_s, memory_bytes_per_s x threads / active_cores):
///
/// - a product of r rows by a weight of W elements, in product p (forward y = x W^T, backward
///   input dx = dy W, backward weight dW += dy^T x) takes max(2 r W / gemm_flops_per_s(r,
///   threads, p, active_cores), W bytes / b), twice the weight bytes for the backward weight
///   (the gradient is read and written), so a product of few rows is bound by streaming its
///   weight and one of many rows by the FMA rate; the rate is the one measured while
///   active_cores cores ran products at once when the profile has it (GemmPoint::busy_cores);
/// - decoder, prefill and decode: the 7 projections (Q, K, V, O, W1, W3, W2) on `tokens` rows,
///   decode attention (profile.attention_seconds, phase decode) at work.context, and the
///   elementwise work (norms, RoPE, SwiGLU, residuals; model::layer_cost's activation bytes less
///   the KV rows) at b; training forward: the same with the training attention (phase forward);
///   backward input: the 7 backward-input products, the attention backward and twice the
///   elementwise bytes; backward weight: the 7 backward-weight products;
/// - LM head: prefill and decode on one row per sequence, its product and the logits at b;
///   training forward on every token: the product, the loss (softmax and its gradient, 3 reads
///   of the logits) and the head's input gradient (a backward-input product), because
///   runtime::TrainStage computes that gradient with the loss; backward input 0; backward
///   weight its backward-weight product;
/// - final norm: 2 rows of dim floats per row at b (prefill, decode: one row per sequence;
///   training forward: every token), backward input 4, backward weight 0;
/// - embedding: its row copies (layer_cost bytes) at b; backward weight the scatter-add of
///   the gradient rows (3 tokens x dim floats); backward input 0;
/// - sampler: its layer_cost bytes at b in inference, 0 in training.
///
/// Weights and activations count 4 bytes (f32).
class ProfiledLayerTimes {
 public:
  /// @param profile      the device (validated again here)
  /// @param threads      intra-op threads of each product, >= 1
  /// @param active_cores cores working at once (stages x threads in a pipeline on one device);
  ///                     0 means `threads`; otherwise >= threads
  /// @throws brigade::Error{InvalidArgument} for threads < 1, active_cores below threads, or
  ///         as DeviceProfile::validate()
  explicit ProfiledLayerTimes(DeviceProfile profile, int threads = 1, int active_cores = 0)
      : profile_(std::make_shared<const DeviceProfile>(std::move(profile))),
        threads_(threads), active_(active_cores == 0 ? threads : active_cores) {
    BRIGADE_CHECK(threads >= 1 && active_ >= threads, Errc::InvalidArgument,
                  "ProfiledLayerTimes: threads = {}, active cores = {}; expected threads >= 1 and "
                  "active cores >= threads (or 0)",
                  threads, active_cores);
    profile_->validate();
  }

  /// Seconds of layer `layer` of `spec` for `work` in `phase` (see the class comment).
  /// @throws brigade::Error{InvalidArgument} for a layer out of range
  double operator()(const model::ModelSpec& spec, int layer, const model::WorkItem& work,
                    model::Phase phase) const {
    using model::LayerKind;
    using model::Phase;
    const DeviceProfile& p = *profile_;
    const auto& c = spec.config();
    const double d = c.dim, h = c.hidden_dim, kv = c.kv_dim(), v = c.vocab_size;
    const bool training = model::is_training(phase);
    const std::int64_t T = std::max<std::int64_t>(1, work.tokens);
    const std::int64_t S = training ? T : std::max<std::int64_t>(1, work.sequences);
    const double ctx = std::max(1.0, work.context);
    const double bw = bandwidth();
    constexpr double f = sizeof(float);
    auto product = [&](std::int64_t rows, double weights, Phase which) {
      const double flops = 2.0 * static_cast<double>(rows) * weights;
      const double bytes = weights * f * (which == Phase::BackwardWeight ? 2.0 : 1.0);
      return std::max(flops / p.gemm_flops_per_s(rows, threads_, which, active_), bytes / bw);
    };
    const model::LayerCost lc = model::layer_cost(spec, layer, work);
    switch (spec.layer(layer).kind) {
      case LayerKind::Decoder: {
        const double proj = d * d + 2.0 * d * kv + d * d + 3.0 * d * h;
        const double kv_bytes = 2.0 * static_cast<double>(T) * ctx * kv * f;
        const double elementwise = (lc.other_bytes - kv_bytes) / bw;
        switch (phase) {
          case Phase::Prefill:
          case Phase::Decode:
            return product(T, proj, Phase::Forward) +
                   p.attention_seconds(T, c.n_heads, c.head_size(), ctx, Phase::Decode) +
                   elementwise;
          case Phase::Forward:
            return product(T, proj, Phase::Forward) +
                   p.attention_seconds(T, c.n_heads, c.head_size(), ctx, Phase::Forward) +
                   elementwise;
          case Phase::BackwardInput:
            return product(T, proj, Phase::BackwardInput) +
                   p.attention_seconds(T, c.n_heads, c.head_size(), ctx, Phase::BackwardInput) +
                   2.0 * elementwise;
          case Phase::BackwardWeight:
            return product(T, proj, Phase::BackwardWeight);
        }
        return 0.0;
      }
      case LayerKind::LMHead:
        switch (phase) {
          case Phase::Prefill:
          case Phase::Decode:
            return product(S, d * v, Phase::Forward) + static_cast<double>(S) * (d + v) * f / bw;
          case Phase::Forward:
            return product(T, d * v, Phase::Forward) + product(T, d * v, Phase::BackwardInput) +
                   3.0 * static_cast<double>(T) * v * f / bw;
          case Phase::BackwardInput:
            return 0.0;
          case Phase::BackwardWeight:
            return product(T, d * v, Phase::BackwardWeight);
        }
        return 0.0;
      case LayerKind::FinalNorm:
        if (phase == Phase::BackwardWeight) return 0.0;
        return (phase == Phase::BackwardInput ? 4.0 : 2.0) * static_cast<double>(S) * d * f / bw;
      case LayerKind::Embedding:
        if (phase == Phase::BackwardInput) return 0.0;
        if (phase == Phase::BackwardWeight) return 3.0 * static_cast<double>(T) * d * f / bw;
        return lc.bytes() / bw;
      case LayerKind::Sampler:
        return training ? 0.0 : lc.bytes() / bw;
    }
    return 0.0;
  }

  /// The profile the times come from.
  [[nodiscard]] const DeviceProfile& profile() const noexcept { return *profile_; }
  /// Intra-op threads of each product.
  [[nodiscard]] int threads() const noexcept { return threads_; }
  /// Cores working at once.
  [[nodiscard]] int active_cores() const noexcept { return active_; }
  /// Bytes per second the `threads` cores stream while `active_cores` cores stream at once:
  /// min(threads x core_bytes_per_s, memory_bytes_per_s x threads / active_cores).
  [[nodiscard]] double bandwidth() const noexcept {
    const DeviceProfile& p = *profile_;
    return std::min(threads_ * p.core_bytes_per_s,
                    p.memory_bytes_per_s * threads_ / static_cast<double>(active_));
  }

 private:
  std::shared_ptr<const DeviceProfile> profile_;
  int threads_;
  int active_;
};

}  // namespace v0
}  // namespace brigade::cost
