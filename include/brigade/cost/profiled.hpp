// Layer times from a device profile (docs/profiles.md): the calibrated alternative to the
// default-rate roofline, for the balanced partition and the cost model.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/cost/profile.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/layer_cost.hpp"

#include <algorithm>
#include <cmath>
#include <functional>

namespace brigade::cost {
inline namespace v0 {

/// Seconds of the forward of layer `layer` of `spec` for `work` on `profile`, its products on
/// `threads` intra-op threads:
///
/// - products (decoder: Q, K, V, O, W1, W3, W2; LM head): each group of the same row count takes
///   max(FLOPs / profile.gemm_flops_per_s(rows, threads), weight bytes / bandwidth), so a decode
///   product of few rows is bound by streaming its weights and a prefill product by the FMA rate;
/// - attention: profile.attention_seconds(tokens, n_heads, head_size, work.context);
/// - everything else (norms, RoPE, SwiGLU, residuals, embedding rows, sampling) at the memory
///   bandwidth, by model::layer_cost's activation bytes;
///
/// where bandwidth is profile.core_bytes_per_s on one thread, else memory_bytes_per_s. The LM
/// head runs on `work.sequences` rows (the last token of each sequence), or on every token when
/// `every_token` (training computes logits at every position). Weights count 4 bytes (f32).
/// @throws brigade::Error{InvalidArgument} for a layer out of range or threads < 1
inline double profiled_layer_seconds(const model::ModelSpec& spec, int layer,
                                     const model::WorkItem& work, const DeviceProfile& profile,
                                     int threads = 1, bool every_token = false) {
  BRIGADE_CHECK(threads >= 1, Errc::InvalidArgument,
                "profiled_layer_seconds: threads = {}, expected >= 1", threads);
  const auto& c = spec.config();
  const double d = c.dim, h = c.hidden_dim, kv = c.kv_dim(), v = c.vocab_size;
  const std::int64_t T = std::max<std::int64_t>(1, work.tokens);
  const std::int64_t S = std::max<std::int64_t>(1, every_token ? work.tokens : work.sequences);
  const double bw = threads == 1 ? profile.core_bytes_per_s : profile.memory_bytes_per_s;
  constexpr double f = sizeof(float);
  auto product = [&](std::int64_t rows, double weights) {
    const double flops = 2.0 * static_cast<double>(rows) * weights;
    return std::max(flops / profile.gemm_flops_per_s(rows, threads), weights * f / bw);
  };
  const model::LayerCost lc = model::layer_cost(spec, layer, work);
  switch (spec.layer(layer).kind) {
    case model::LayerKind::Decoder: {
      const double proj = d * d + 2.0 * d * kv + d * d + 3.0 * d * h;
      const double kv_bytes = 2.0 * static_cast<double>(T) * std::max(1.0, work.context) * kv * f;
      return product(T, proj) +
             profile.attention_seconds(T, c.n_heads, c.head_size(), std::max(1.0, work.context)) +
             (lc.other_bytes - kv_bytes) / bw;
    }
    case model::LayerKind::LMHead:
      return product(S, d * v) + static_cast<double>(S) * (d + v) * f / bw;
    case model::LayerKind::FinalNorm:
      return 2.0 * static_cast<double>(S) * d * f / bw;
    case model::LayerKind::Embedding:
    case model::LayerKind::Sampler:
      return lc.bytes() / bw;
  }
  return 0.0;
}

}  // namespace v0
}  // namespace brigade::cost
