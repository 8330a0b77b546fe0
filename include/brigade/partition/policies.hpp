// Partition policies by name: the built-in splits ("uniform", "balanced") and the ones users
// register at run time (joint J2 of docs/architecture.md). Engines, planners and the CLI choose
// a split by name through make_partition().
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/core/registry.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/layer_cost.hpp"
#include "brigade/partition/partition.hpp"

#include <functional>
#include <span>
#include <string_view>
#include <vector>

namespace brigade::partition {
inline namespace v0 {

/// What a partition policy is asked for: how many stages, where each goes, and the work the
/// split is balanced for.
struct PolicyRequest {
  /// placement[v] = rank of virtual stage v (the schedule's shape decides it: v mod P, or the
  /// V shape); its size is the number of stages N.
  std::vector<int> placement;
  int num_ranks = 1;  ///< P
  /// The micro-batch the split is balanced for (tokens, sequences, mean attention context).
  model::WorkItem work{1, 1, 1.0};
  /// Training: the final norm and the LM head run on every token (logits and loss at every
  /// position) and stay together on the last stage. Inference: they run on the last token of
  /// each sequence, with the sampler.
  bool training = false;
  /// Seconds of a layer for a work item and phase: the roofline at default rates unless set
  /// (cost::ProfiledLayerTimes prices layers from a measured or hand-written device profile).
  model::LayerSeconds layer_seconds = model::roofline_layer_seconds();

  /// Per-layer seconds of `spec` for `item`: in inference its phase
  /// (model::inference_phase); in training forward + backward input + backward weight.
  /// @throws brigade::Error{InvalidArgument} if layer_seconds is empty
  [[nodiscard]] std::vector<double> costs(const model::ModelSpec& spec,
                                          const model::WorkItem& item) const {
    BRIGADE_CHECK(static_cast<bool>(layer_seconds), Errc::InvalidArgument,
                  "partition: PolicyRequest::layer_seconds is empty");
    std::vector<double> out;
    for (int l = 0; l < spec.num_layers(); ++l) {
      using model::Phase;
      out.push_back(training ? layer_seconds(spec, l, item, Phase::Forward) +
                                   layer_seconds(spec, l, item, Phase::BackwardInput) +
                                   layer_seconds(spec, l, item, Phase::BackwardWeight)
                             : layer_seconds(spec, l, item, model::inference_phase(item)));
    }
    return out;
  }

  /// N, the number of stages asked for.
  [[nodiscard]] int num_stages() const noexcept { return static_cast<int>(placement.size()); }
};

/// A policy: the split of `spec` into request.num_stages() stages placed as request.placement.
using PolicyFn = Partition (*)(const model::ModelSpec& spec, const PolicyRequest& request);

/// One entry of the policy table.
struct PolicyInfo {
  std::string_view name;     ///< e.g. "balanced"
  std::string_view summary;  ///< one line: what it balances and where it comes from
  PolicyFn make;             ///< the policy
};

/// `p`'s layer ranges with stage v placed on placement[v] of `num_ranks` ranks.
/// @throws brigade::Error{InvalidArgument} if the placement's size differs from p's stage
///         count, or as Partition's constructor (a rank out of range or unused)
inline Partition placed(const Partition& p, std::span<const int> placement, int num_ranks) {
  BRIGADE_CHECK(static_cast<int>(placement.size()) == p.num_stages(), Errc::InvalidArgument,
                "partition: a placement of {} stages for a split of {}", placement.size(),
                p.num_stages());
  std::vector<StageRange> st = p.stages();
  for (std::size_t v = 0; v < st.size(); ++v) st[v].rank = placement[v];
  return Partition(p.num_layers(), num_ranks, std::move(st));
}

/// The "uniform" policy: partition::uniform (decoder layers evenly, embedding with the first
/// stage, the head with the last), placed as asked.
/// @throws brigade::Error{InvalidArgument} as uniform() and placed()
inline Partition uniform_policy(const model::ModelSpec& spec, const PolicyRequest& request) {
  return placed(uniform(spec, request.num_stages()), request.placement, request.num_ranks);
}

/// The "balanced" policy: the exact min-max split (balanced()) of the cost of every layer for
/// request.work under request.layer_seconds (request.costs(): in training the forward and both
/// backward passes, the LM head priced for every token, and the final norm, LM head and loss
/// one unit that stays on the last stage; in inference the head and sampler priced per
/// sequence), so the tail stage is not overloaded in either.
/// @throws brigade::Error{InvalidArgument} if there are more stages than units to split (in
///         training: embedding + decoder layers + 1), or as placed()
inline Partition balanced_policy(const model::ModelSpec& spec, const PolicyRequest& request) {
  const int N = request.num_stages();
  if (!request.training)
    return placed(balanced(spec.num_layers(), N, request.costs(spec, request.work)),
                  request.placement, request.num_ranks);
  const auto layer = request.costs(spec, request.work);
  const int L = spec.config().n_layers;
  std::vector<double> units(layer.begin(), layer.begin() + L + 1);  // embedding, decoders
  double tail = 0.0;
  for (int l = L + 1; l < spec.num_layers(); ++l) tail += layer[static_cast<std::size_t>(l)];
  units.push_back(tail);  // final norm + LM head + loss: one unit
  // Units 0..L are layers 0..L; the last unit is the tail, so only the last stage's end moves.
  std::vector<StageRange> st = balanced(static_cast<int>(units.size()), N, units).stages();
  st.back().last = spec.num_layers();
  for (std::size_t v = 0; v < st.size(); ++v) st[v].rank = request.placement[v];
  return Partition(spec.num_layers(), request.num_ranks, std::move(st));
}

namespace detail {

inline Registry<PolicyInfo>& policy_table() {
  static Registry<PolicyInfo> table(
      "partition",
      {
          {"uniform", "decoder layers evenly by count, head on the last stage (Megatron's default)",
           &uniform_policy},
          {"balanced",
           "exact min-max split of every layer's cost (roofline or device profile) for the "
           "micro-batch's work",
           &balanced_policy},
      });
  return table;
}

}  // namespace detail

/// Every policy: "uniform", "balanced", then those added by register_policy() in order.
inline std::span<const PolicyInfo> policies() noexcept { return detail::policy_table().entries(); }

/// Adds a user's policy at run time, so engines (TrainingConfig::partition, plan::PlanRequest),
/// planners and the CLI find it by name like a built-in one. Name and summary are copied.
/// Register before lookups run on other threads.
/// @throws brigade::Error{InvalidArgument} for an empty name, a null `make`, a name already
///         taken, or more than 256 policies in all
inline void register_policy(const PolicyInfo& info) {
  detail::policy_table().add(info, info.make != nullptr);
}

/// The policy called `name`.
/// @throws brigade::Error{InvalidArgument} "unknown partition '<name>', expected one of: ..."
inline const PolicyInfo& find_policy(std::string_view name) {
  return detail::policy_table().find(name);
}

/// Runs the policy called `name` and checks that its split is what was asked: the model's
/// layers, request.num_stages() stages, stage v on request.placement[v] of request.num_ranks.
/// @throws brigade::Error{InvalidArgument} for an unknown name, an empty placement, the
///         policy's own errors, or a split that differs from the request (naming the stage)
inline Partition make_partition(const model::ModelSpec& spec, std::string_view name,
                                const PolicyRequest& request) {
  const auto& policy = find_policy(name);
  BRIGADE_CHECK(request.num_stages() >= 1, Errc::InvalidArgument,
                "partition '{}': no stages asked for (empty placement)", name);
  Partition p = policy.make(spec, request);
  BRIGADE_CHECK(p.num_layers() == spec.num_layers() && p.num_stages() == request.num_stages() &&
                    p.num_ranks() == request.num_ranks,
                Errc::InvalidArgument,
                "partition '{}' returned {} stages of {} layers on {} ranks, asked for {} stages "
                "of {} layers on {} ranks",
                name, p.num_stages(), p.num_layers(), p.num_ranks(), request.num_stages(),
                spec.num_layers(), request.num_ranks);
  for (int v = 0; v < p.num_stages(); ++v)
    BRIGADE_CHECK(p.stage(v).rank == request.placement[static_cast<std::size_t>(v)],
                  Errc::InvalidArgument,
                  "partition '{}' placed stage {} on rank {}, asked for rank {}", name, v,
                  p.stage(v).rank, request.placement[static_cast<std::size_t>(v)]);
  return p;
}

}  // namespace v0
}  // namespace brigade::partition
