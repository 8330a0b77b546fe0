// FLOPs and bytes of each ModelSpec layer for a unit of work: the inputs of every cost model.
#pragma once

#include "brigade/model/config.hpp"

#include "brigade/core/error.hpp"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string_view>

namespace brigade::model {
inline namespace v0 {

/// The work one forward pass of a micro-batch does: `tokens` new tokens from `sequences`
/// sequences whose attention reads, on average, `context` positions (prompt length / 2 for a
/// prefill, the current length for a decode step).
struct WorkItem {
  std::int64_t tokens = 1;     ///< new tokens in the micro-batch (sum over its sequences)
  std::int64_t sequences = 1;  ///< sequences in the micro-batch
  double context = 1.0;        ///< mean number of positions each new token attends to
};

/// Cost of one layer for one WorkItem's forward pass.
struct LayerCost {
  double flops = 0.0;          ///< floating-point operations (a multiply-add counts 2)
  double weight_bytes = 0.0;   ///< weight bytes read (float32), once per micro-batch
  double other_bytes = 0.0;    ///< activation and KV-cache bytes read or written
  /// Total bytes moved.
  [[nodiscard]] double bytes() const noexcept { return weight_bytes + other_bytes; }
};

/// FLOPs and bytes of layer `layer` of `spec` for `work`, counted from the shapes:
/// - embedding: a row copy per token (no FLOPs);
/// - decoder: 2*tokens*(dim*(dim + 2 kv_dim + dim) + 3*dim*hidden) for the projections, plus
///   4*tokens*context*dim for the attention scores and the weighted sum, plus the norms, RoPE and
///   SwiGLU elementwise work; bytes = weights + activations + the KV rows read and written;
/// - final_norm: 4*dim per token;
/// - lm_head: 2*sequences*dim*vocab (logits only for each sequence's last token);
/// - sampler: ~ 8*vocab per sequence (softmax, top-p sort bound) and the logits read.
/// @throws brigade::Error{InvalidArgument} if layer is out of range
inline LayerCost layer_cost(const ModelSpec& spec, int layer, const WorkItem& work) {
  const auto& c = spec.config();
  const double d = c.dim, h = c.hidden_dim, kv = c.kv_dim(), v = c.vocab_size;
  const double t = static_cast<double>(work.tokens), s = static_cast<double>(work.sequences);
  const double ctx = std::max(1.0, work.context);
  constexpr double f = sizeof(float);
  LayerCost cost;
  switch (spec.layer(layer).kind) {
    case LayerKind::Embedding:
      cost.other_bytes = 2.0 * t * d * f;
      break;
    case LayerKind::Decoder: {
      const double proj = d * d + 2.0 * d * kv + d * d + 3.0 * d * h;
      cost.flops = 2.0 * t * proj + 4.0 * t * ctx * d + t * (8.0 * d + 6.0 * d + 4.0 * h);
      cost.weight_bytes = (proj + 2.0 * d) * f;
      cost.other_bytes = t * (6.0 * d + 2.0 * kv + 3.0 * h) * f + 2.0 * t * ctx * kv * f;
      break;
    }
    case LayerKind::FinalNorm:
      cost.flops = 4.0 * s * d;
      cost.weight_bytes = d * f;
      cost.other_bytes = 2.0 * s * d * f;
      break;
    case LayerKind::LMHead:
      cost.flops = 2.0 * s * d * v;
      cost.weight_bytes = d * v * f;
      cost.other_bytes = s * (d + v) * f;
      break;
    case LayerKind::Sampler:
      cost.flops = 8.0 * s * v;
      cost.other_bytes = 2.0 * s * v * f;
      break;
  }
  return cost;
}

/// A device's sustained rates, for roofline time = max(flops / flops_per_s, bytes / bytes_per_s).
struct DeviceRates {
  double flops_per_s = 60e9;   ///< sustained FP32 GEMM rate (default: one CPU core with AVX2/FMA)
  double bytes_per_s = 20e9;   ///< sustained memory bandwidth (default: one CPU core's share)
};

/// Roofline time of a LayerCost on a device, in seconds (Williams et al. 2009).
inline double roofline_seconds(const LayerCost& cost, const DeviceRates& rates) noexcept {
  return std::max(cost.flops / rates.flops_per_s, cost.bytes() / rates.bytes_per_s);
}

/// What a layer's kernels compute for a WorkItem. Inference runs Prefill (prompt tokens, KV
/// cache written) and Decode (one new token per sequence against its KV cache); training runs
/// Forward (activations kept for the backward), then BackwardInput (BI: the gradient of the
/// layer's input) and BackwardWeight (BW: the gradient of its weights), the split of Qi et al.
/// 2023 ("Zero Bubble Pipeline Parallelism", §2). A full backward B is BI + BW.
enum class Phase { Prefill, Decode, Forward, BackwardInput, BackwardWeight };

/// "prefill", "decode", "forward", "backward_input", "backward_weight".
constexpr std::string_view to_string(Phase p) noexcept {
  switch (p) {
    case Phase::Prefill: return "prefill";
    case Phase::Decode: return "decode";
    case Phase::Forward: return "forward";
    case Phase::BackwardInput: return "backward_input";
    case Phase::BackwardWeight: return "backward_weight";
  }
  return "?";
}

/// True for the training phases (Forward, BackwardInput, BackwardWeight): the final norm and
/// the LM head then run on every token (logits and loss at every position).
constexpr bool is_training(Phase p) noexcept {
  return p == Phase::Forward || p == Phase::BackwardInput || p == Phase::BackwardWeight;
}

/// The inference phase of a work item: Decode when it is one token per sequence, else Prefill.
constexpr Phase inference_phase(const WorkItem& w) noexcept {
  return w.tokens == w.sequences ? Phase::Decode : Phase::Prefill;
}

/// Seconds layer `layer` of a model takes for a WorkItem in a Phase: the one signature every
/// layer-time model has (the roofline below, cost::ProfiledLayerTimes on a device profile,
/// a user's), read by the partition policies, the plan builders and cost::RooflineCostModel.
/// In the training phases the callers pass the micro-batch's WorkItem; a model prices the LM
/// head and final norm on its `tokens` rows.
using LayerSeconds = std::function<double(const ModelSpec& spec, int layer, const WorkItem& work,
                                          Phase phase)>;

/// The roofline as LayerSeconds: roofline_seconds(layer_cost(...), rates) for every phase (a
/// backward pass costs its forward's FLOPs and bytes: the input and weight gradients are GEMMs
/// of the forward's size); in the training phases the LM head and final norm are priced on
/// every token.
/// @throws brigade::Error{InvalidArgument} for rates that are not positive
inline LayerSeconds roofline_layer_seconds(DeviceRates rates = {}) {
  BRIGADE_CHECK(rates.flops_per_s > 0.0 && rates.bytes_per_s > 0.0, Errc::InvalidArgument,
                "roofline: device rates {} FLOP/s and {} bytes/s, expected > 0",
                rates.flops_per_s, rates.bytes_per_s);
  return [rates](const ModelSpec& spec, int layer, const WorkItem& work, Phase phase) {
    WorkItem w = work;
    if (is_training(phase)) w.sequences = w.tokens;
    return roofline_seconds(layer_cost(spec, layer, w), rates);
  };
}

}  // namespace v0
}  // namespace brigade::model
