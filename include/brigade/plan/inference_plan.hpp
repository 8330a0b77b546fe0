// The inference planner: how to spend a CPU's cores on pipelined generation.
//
// A plan is (stages S, intra-op threads per stage T, micro-batches G): S pipeline stages (a
// balanced partition), each a thread that owns T cores for its products (S * T <= cores), and
// the N sequences split into G micro-batches of ceil(N / G) sequences. Decode is bound by the
// weight stream at few rows per product and by the FMA units at many, so the plan trades
// rows per weight read (fewer, larger micro-batches), pipeline overlap (more stages and at least
// S micro-batches) and intra-op threads (fork/join per product, shared memory bandwidth); the
// planner predicts each candidate's time with a roofline of every layer (model::layer_cost) on
// measured rates and picks the fastest. The result is an engine::InferenceOptions value
// (microbatches, blas_threads) and a partition, nothing else.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/cost/profiled.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/layer_cost.hpp"
#include "brigade/partition/partition.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace brigade::plan {
inline namespace v0 {

/// What is to be generated.
struct InferenceWorkload {
  int sequences = 1;      ///< sequences generated together, >= 1
  int prompt_tokens = 1;  ///< prompt length per sequence, >= 1
  int new_tokens = 64;    ///< tokens generated per sequence, >= 1
};

/// One way to run the workload, with its predicted time.
struct InferencePlan {
  int stages = 1;                 ///< pipeline stages (one stage thread each)
  int threads = 1;                ///< intra-op threads per stage (InferenceOptions::blas_threads)
  int microbatches = 1;           ///< sequence groups in flight (InferenceOptions::microbatches)
  std::vector<int> bounds;        ///< stage boundaries in ModelSpec layers (partition::from_bounds)
  double decode_round_s = 0.0;    ///< predicted seconds for every sequence to decode one token
  double prefill_s = 0.0;         ///< predicted seconds to prefill every prompt
  double tokens_per_s = 0.0;      ///< predicted generated tokens per second, prefill included

  /// The partition, as partition::from_bounds(num_layers, bounds).
  [[nodiscard]] partition::Partition partition(int num_layers) const {
    return partition::from_bounds(num_layers, bounds);
  }
  /// e.g. "2 stages x 1 thread, 2 micro-batches of 16".
  [[nodiscard]] std::string describe(int sequences) const {
    const int per = (sequences + microbatches - 1) / microbatches;
    return std::to_string(stages) + (stages == 1 ? " stage x " : " stages x ") +
           std::to_string(threads) + (threads == 1 ? " thread, " : " threads, ") +
           std::to_string(microbatches) +
           (microbatches == 1 ? " micro-batch of " : " micro-batches of ") + std::to_string(per);
  }
};

namespace detail {

/// Seconds one stage of layers [first, last) takes for `work` under `times`, plus `hop_s`.
inline double stage_seconds(const model::ModelSpec& spec, int first, int last,
                            const model::WorkItem& work, const cost::ProfiledLayerTimes& times,
                            double hop_s) {
  double t = hop_s;
  for (int l = first; l < last; ++l) t += times(spec, l, work, model::inference_phase(work));
  return t;
}

/// Pipeline time of G micro-batches through stages of the given per-micro-batch times: the first
/// micro-batch crosses every stage, then the slowest stage paces the other G - 1.
inline double pipeline_seconds(const std::vector<double>& stage_s, int microbatches) {
  double sum = 0.0, slowest = 0.0;
  for (double s : stage_s) {
    sum += s;
    slowest = std::max(slowest, s);
  }
  return sum + (microbatches - 1) * slowest;
}

}  // namespace detail

/// Every plan for `workload` on `cores` cores of the device `profile` describes (0: its
/// profile.cores), fastest first (ties: fewer stages, then fewer threads, then fewer
/// micro-batches). Candidates: S stages in [1, min(cores, decoder layers)], T threads in
/// [1, cores / S], G micro-batches in [1, min(sequences, 4 S)], each with partition::balanced
/// for its decode micro-batch of ceil(N / G) sequences under the same layer times.
///
/// Predicted times: a stage's time for a micro-batch of b sequences is the hand-over latency
/// (the profile's "in-process" link, 0 without one) plus its layers' cost::ProfiledLayerTimes
/// on T threads while S T cores work at once (they share the memory bandwidth). A decode
/// round, in which every sequence gains one token, takes max(G * slowest stage, sum of the
/// stages): the pipeline is paced by its slowest stage unless a micro-batch's next token waits
/// on its previous one crossing every stage (fewer micro-batches than stages). The prefill is
/// the pipeline time of the G prompt micro-batches (GPipe's (S + G - 1) form with unequal
/// stages). tokens_per_s = N * new_tokens / (prefill + new_tokens * round), decode context =
/// prompt + new_tokens / 2.
/// @throws brigade::Error{InvalidArgument} for a workload field < 1, cores < 0, or an invalid
///         profile
inline std::vector<InferencePlan> inference_plans(const model::ModelSpec& spec,
                                                  const InferenceWorkload& workload,
                                                  const cost::DeviceProfile& profile,
                                                  int cores = 0) {
  profile.validate();
  BRIGADE_CHECK(cores >= 0, Errc::InvalidArgument, "inference_plans: cores = {}, expected >= 1",
                cores);
  if (cores == 0) cores = profile.cores;
  BRIGADE_CHECK(workload.sequences >= 1 && workload.prompt_tokens >= 1 && workload.new_tokens >= 1,
                Errc::InvalidArgument,
                "inference_plans: sequences = {}, prompt_tokens = {}, new_tokens = {}; expected "
                "all >= 1",
                workload.sequences, workload.prompt_tokens, workload.new_tokens);
  double hop_s = 0.0;
  for (const auto& l : profile.links)
    if (l.transport == "in-process") hop_s = l.latency_s;
  const int n = workload.sequences;
  const int max_stages = std::min(cores, spec.config().n_layers);
  std::vector<InferencePlan> plans;
  for (int S = 1; S <= max_stages; ++S) {
    for (int T = 1; T * S <= cores; ++T) {
      const cost::ProfiledLayerTimes times(profile, T, S * T);
      for (int G = 1; G <= std::min(n, 4 * S); ++G) {
        const int b = (n + G - 1) / G;
        model::WorkItem decode{b, b, workload.prompt_tokens + workload.new_tokens / 2.0};
        model::WorkItem prefill{static_cast<std::int64_t>(b) * workload.prompt_tokens, b,
                                workload.prompt_tokens / 2.0};
        const partition::Partition part = partition::balanced(spec, S, decode, times);
        std::vector<double> dec, pre;
        for (const auto& st : part.stages()) {
          dec.push_back(detail::stage_seconds(spec, st.first, st.last, decode, times, hop_s));
          pre.push_back(detail::stage_seconds(spec, st.first, st.last, prefill, times, hop_s));
        }
        InferencePlan p;
        p.stages = S;
        p.threads = T;
        p.microbatches = G;
        p.bounds.push_back(0);
        for (const auto& st : part.stages()) p.bounds.push_back(st.last);
        double sum = 0.0, slowest = 0.0;
        for (double s : dec) {
          sum += s;
          slowest = std::max(slowest, s);
        }
        p.decode_round_s = std::max(G * slowest, sum);
        p.prefill_s = detail::pipeline_seconds(pre, G);
        p.tokens_per_s = static_cast<double>(n) * workload.new_tokens /
                         (p.prefill_s + workload.new_tokens * p.decode_round_s);
        plans.push_back(std::move(p));
      }
    }
  }
  std::stable_sort(plans.begin(), plans.end(), [](const InferencePlan& a, const InferencePlan& b) {
    return a.tokens_per_s > b.tokens_per_s * (1.0 + 1e-9);
  });
  return plans;
}

/// The fastest of inference_plans().
/// @throws brigade::Error{InvalidArgument} as inference_plans()
inline InferencePlan best_inference_plan(const model::ModelSpec& spec,
                                         const InferenceWorkload& workload,
                                         const cost::DeviceProfile& profile, int cores = 0) {
  return inference_plans(spec, workload, profile, cores).front();
}

}  // namespace v0
}  // namespace brigade::plan
