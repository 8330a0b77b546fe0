// Partition: which layers of a ModelSpec each pipeline stage owns, and on which rank.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/layer_cost.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace brigade::partition {
inline namespace v0 {

/// One stage: the contiguous layer range [first, last) of a ModelSpec, run by `rank`. A rank
/// may run several stages (interleaved or V placements): they are its virtual stages, in
/// pipeline order.
struct StageRange {
  int rank = 0;   ///< the rank (worker) that runs it
  int first = 0;  ///< first ModelSpec layer, inclusive
  int last = 0;   ///< last ModelSpec layer, exclusive
  friend bool operator==(const StageRange&, const StageRange&) = default;
};

/// Stages in pipeline order (stage i feeds stage i + 1). A value type whose constructor checks
/// the invariants: every layer in exactly one stage, contiguous ranges in order, every stage
/// non-empty, ranks in [0, num_ranks) and every rank used.
class Partition {
 public:
  /// @param num_layers the ModelSpec's layer count
  /// @param num_ranks  the ranks (workers) the stages are placed on
  /// @param stages     in pipeline order
  /// @throws brigade::Error{InvalidArgument} naming the stage, the layer and the values when an
  ///         invariant does not hold
  Partition(int num_layers, int num_ranks, std::vector<StageRange> stages)
      : num_layers_(num_layers), num_ranks_(num_ranks), stages_(std::move(stages)) {
    BRIGADE_CHECK(num_ranks_ >= 1, Errc::InvalidArgument, "Partition: num_ranks = {}, expected >= 1",
                  num_ranks_);
    BRIGADE_CHECK(!stages_.empty(), Errc::InvalidArgument, "Partition: no stages");
    int expect = 0;
    std::vector<bool> used(static_cast<std::size_t>(num_ranks_), false);
    for (std::size_t i = 0; i < stages_.size(); ++i) {
      const auto& s = stages_[i];
      BRIGADE_CHECK(s.first == expect, Errc::InvalidArgument,
                    "Partition: stage {} starts at layer {}, expected layer {} (ranges must be "
                    "contiguous and cover every layer once)",
                    i, s.first, expect);
      BRIGADE_CHECK(s.last > s.first, Errc::InvalidArgument,
                    "Partition: stage {} is empty (layers [{}, {}))", i, s.first, s.last);
      BRIGADE_CHECK(s.rank >= 0 && s.rank < num_ranks_, Errc::InvalidArgument,
                    "Partition: stage {} is on rank {}, outside [0, {})", i, s.rank, num_ranks_);
      used[static_cast<std::size_t>(s.rank)] = true;
      expect = s.last;
    }
    BRIGADE_CHECK(expect == num_layers_, Errc::InvalidArgument,
                  "Partition: stages end at layer {}, expected {} (layers {}..{} are unassigned "
                  "or out of range)",
                  expect, num_layers_, std::min(expect, num_layers_), num_layers_ - 1);
    for (int r = 0; r < num_ranks_; ++r)
      BRIGADE_CHECK(used[static_cast<std::size_t>(r)], Errc::InvalidArgument,
                    "Partition: rank {} holds no stage", r);
  }

  [[nodiscard]] int num_stages() const noexcept { return static_cast<int>(stages_.size()); }
  [[nodiscard]] int num_ranks() const noexcept { return num_ranks_; }
  [[nodiscard]] int num_layers() const noexcept { return num_layers_; }
  [[nodiscard]] const std::vector<StageRange>& stages() const noexcept { return stages_; }
  /// Stage i.
  /// @throws brigade::Error{InvalidArgument} if i is out of range
  [[nodiscard]] const StageRange& stage(int i) const {
    BRIGADE_CHECK(i >= 0 && i < num_stages(), Errc::InvalidArgument,
                  "Partition::stage: index {} outside [0, {})", i, num_stages());
    return stages_[static_cast<std::size_t>(i)];
  }
  /// The stage owning ModelSpec layer `layer`.
  /// @throws brigade::Error{InvalidArgument} if layer is out of range
  [[nodiscard]] int stage_of_layer(int layer) const {
    for (int i = 0; i < num_stages(); ++i)
      if (layer >= stages_[static_cast<std::size_t>(i)].first &&
          layer < stages_[static_cast<std::size_t>(i)].last)
        return i;
    detail::fail(Errc::InvalidArgument, "Partition::stage_of_layer: layer {} outside [0, {})",
                 layer, num_layers_);
  }
  /// Human-readable form, e.g. "[0,3)@0 [3,9)@1".
  [[nodiscard]] std::string to_string() const {
    std::string s;
    for (const auto& st : stages_) {
      if (!s.empty()) s += ' ';
      s += fmt::format("[{},{})@{}", st.first, st.last, st.rank);
    }
    return s;
  }

  friend bool operator==(const Partition&, const Partition&) = default;

 private:
  int num_layers_;
  int num_ranks_;
  std::vector<StageRange> stages_;
};

/// Stage i on rank i: the partition of `num_layers` layers given by stage boundaries.
/// @param bounds num_stages + 1 increasing layer indices, bounds.front() == 0,
///               bounds.back() == num_layers
/// @throws brigade::Error{InvalidArgument} as Partition's constructor
inline Partition from_bounds(int num_layers, std::span<const int> bounds) {
  std::vector<StageRange> st;
  for (std::size_t i = 0; i + 1 < bounds.size(); ++i)
    st.push_back({static_cast<int>(i), bounds[i], bounds[i + 1]});
  const int ranks = static_cast<int>(st.size());
  return Partition(num_layers, ranks, std::move(st));
}

/// Uniform by layer count (Megatron's default): the L decoder layers are split into `stages`
/// runs whose sizes differ by at most one (earlier stages get the extra layers), the embedding
/// joins the first stage and the final norm, LM head and sampler join the last.
/// @throws brigade::Error{InvalidArgument} if stages < 1 or stages > L (a stage would be empty)
inline Partition uniform(const model::ModelSpec& spec, int stages) {
  const int L = spec.config().n_layers;
  BRIGADE_CHECK(stages >= 1 && stages <= L, Errc::InvalidArgument,
                "partition::uniform: {} stages for {} decoder layers, expected 1..{}", stages, L,
                L);
  std::vector<int> bounds{0};
  int d = 0;
  for (int s = 0; s < stages; ++s) {
    d += L / stages + (s < L % stages ? 1 : 0);
    bounds.push_back(s + 1 == stages ? spec.num_layers() : model::ModelSpec::decoder_layer(d));
  }
  return from_bounds(spec.num_layers(), bounds);
}

/// Balanced: the contiguous split of the layers into `stages` non-empty stages that minimises
/// the slowest stage's cost (the pipeline's bottleneck), by exact dynamic programming over
/// prefix sums, O(stages * n^2). Ties prefer the split whose sum of squared stage costs is
/// smaller, then earlier boundaries.
/// @param layer_costs one non-negative cost per ModelSpec layer (seconds, FLOPs, ...)
/// @throws brigade::Error{InvalidArgument} if stages is outside [1, layer count], the cost
///         count differs from the layer count, or a cost is negative or not finite
inline Partition balanced(int num_layers, int stages, std::span<const double> layer_costs) {
  const int n = num_layers;
  BRIGADE_CHECK(static_cast<int>(layer_costs.size()) == n, Errc::InvalidArgument,
                "partition::balanced: {} layer costs for {} layers", layer_costs.size(), n);
  BRIGADE_CHECK(stages >= 1 && stages <= n, Errc::InvalidArgument,
                "partition::balanced: {} stages for {} layers, expected 1..{}", stages, n, n);
  std::vector<double> prefix(static_cast<std::size_t>(n) + 1, 0.0);
  for (int i = 0; i < n; ++i) {
    const double c = layer_costs[static_cast<std::size_t>(i)];
    BRIGADE_CHECK(c >= 0.0 && c < std::numeric_limits<double>::infinity(), Errc::InvalidArgument,
                  "partition::balanced: layer {} has cost {}, expected finite and >= 0", i, c);
    prefix[static_cast<std::size_t>(i) + 1] = prefix[static_cast<std::size_t>(i)] + c;
  }
  auto range = [&](int a, int b) {
    return prefix[static_cast<std::size_t>(b)] - prefix[static_cast<std::size_t>(a)];
  };
  struct Cell {
    double worst = std::numeric_limits<double>::infinity();
    double squares = std::numeric_limits<double>::infinity();
    int cut = -1;
  };
  // best[s][i]: first i layers in s stages.
  std::vector<std::vector<Cell>> best(static_cast<std::size_t>(stages) + 1,
                                      std::vector<Cell>(static_cast<std::size_t>(n) + 1));
  best[0][0] = {0.0, 0.0, 0};
  for (int s = 1; s <= stages; ++s) {
    for (int i = s; i <= n - (stages - s); ++i) {
      Cell& cell = best[static_cast<std::size_t>(s)][static_cast<std::size_t>(i)];
      for (int j = s - 1; j < i; ++j) {
        const Cell& prev = best[static_cast<std::size_t>(s) - 1][static_cast<std::size_t>(j)];
        if (prev.cut < 0) continue;
        const double c = range(j, i);
        const double worst = std::max(prev.worst, c);
        const double squares = prev.squares + c * c;
        const double eps = 1e-12 * std::max(1.0, worst);
        if (worst < cell.worst - eps || (worst <= cell.worst + eps && squares < cell.squares - eps)) {
          cell = {worst, squares, j};
        }
      }
    }
  }
  std::vector<int> bounds(static_cast<std::size_t>(stages) + 1, 0);
  bounds[static_cast<std::size_t>(stages)] = n;
  for (int s = stages, i = n; s > 0; --s) {
    i = best[static_cast<std::size_t>(s)][static_cast<std::size_t>(i)].cut;
    bounds[static_cast<std::size_t>(s) - 1] = i;
  }
  return from_bounds(n, bounds);
}

/// Per-layer seconds of `spec` for inference `work` (phase model::inference_phase(work)) under
/// `times` (the roofline at default rates unless given; cost::ProfiledLayerTimes calibrated on
/// a device): the costs balanced() takes.
inline std::vector<double> layer_seconds(const model::ModelSpec& spec, const model::WorkItem& work,
                                         const model::LayerSeconds& times =
                                             model::roofline_layer_seconds()) {
  std::vector<double> out;
  for (int i = 0; i < spec.num_layers(); ++i)
    out.push_back(times(spec, i, work, model::inference_phase(work)));
  return out;
}

/// Balanced by the cost of every layer (embedding, LM head and sampling included, so the tail
/// stage is not overloaded) for inference `work` under `times` (layer_seconds()).
/// @throws brigade::Error{InvalidArgument} as balanced(int, int, span)
inline Partition balanced(const model::ModelSpec& spec, int stages, const model::WorkItem& work,
                          const model::LayerSeconds& times = model::roofline_layer_seconds()) {
  const auto costs = layer_seconds(spec, work, times);
  return balanced(spec.num_layers(), stages, costs);
}

/// Cost of each stage of `p` under `layer_costs` (sum over its layers).
/// @throws brigade::Error{InvalidArgument} if the cost count differs from the layer count
inline std::vector<double> stage_costs(const Partition& p, std::span<const double> layer_costs) {
  BRIGADE_CHECK(static_cast<int>(layer_costs.size()) == p.num_layers(), Errc::InvalidArgument,
                "partition::stage_costs: {} layer costs for {} layers", layer_costs.size(),
                p.num_layers());
  std::vector<double> out;
  for (const auto& s : p.stages()) {
    double c = 0.0;
    for (int l = s.first; l < s.last; ++l) c += layer_costs[static_cast<std::size_t>(l)];
    out.push_back(c);
  }
  return out;
}

}  // namespace v0
}  // namespace brigade::partition
