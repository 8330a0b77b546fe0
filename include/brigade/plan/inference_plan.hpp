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

/// A CPU's measured rates, the planner's inputs (measure_cpu_rates() fills them on this machine).
struct CpuRates {
  int cores = 2;                    ///< cores the plan may use, >= 1
  double flops_per_s = 35e9;        ///< one core's FP32 rate in decode products (multiply-add = 2)
  double box_flops_per_s = 70e9;    ///< all `cores` computing at once (their sum): below
                                    ///< cores * flops_per_s where cores are shared or throttled
  double core_bytes_per_s = 20e9;   ///< one core streaming alone (STREAM triad), bytes per second
  double box_bytes_per_s = 25e9;    ///< all `cores` streaming at once (their sum), bytes per second
  double fork_join_s = 3e-6;        ///< seconds per intra-op parallel product (OpenMP fork + join)
  double hop_s = 20e-6;             ///< seconds per micro-batch per stage outside the layers
                                    ///< (hand-over to the next stage, wake-up, bookkeeping)

  /// @throws brigade::Error{InvalidArgument} naming the field when one is outside its range
  void validate() const {
    BRIGADE_CHECK(cores >= 1, Errc::InvalidArgument, "CpuRates: cores = {}; expected >= 1", cores);
    auto pos = [](double v) { return v > 0.0 && std::isfinite(v); };
    BRIGADE_CHECK(pos(flops_per_s) && pos(box_flops_per_s) && pos(core_bytes_per_s) &&
                      pos(box_bytes_per_s),
                  Errc::InvalidArgument,
                  "CpuRates: flops_per_s = {}, box_flops_per_s = {}, core_bytes_per_s = {}, "
                  "box_bytes_per_s = {}; expected all finite and > 0",
                  flops_per_s, box_flops_per_s, core_bytes_per_s, box_bytes_per_s);
    BRIGADE_CHECK(fork_join_s >= 0.0 && std::isfinite(fork_join_s) && hop_s >= 0.0 &&
                      std::isfinite(hop_s),
                  Errc::InvalidArgument,
                  "CpuRates: fork_join_s = {}, hop_s = {}; expected both finite and >= 0",
                  fork_join_s, hop_s);
  }
};

/// Measures CpuRates on this machine in about half a second: a STREAM triad (3 x 32 MiB per
/// thread) on one core and on `cores` cores at once, matmul_wt's decode kernel on 16 rows of a
/// cached 1376 x 512 weight on one core and on `cores` cores at once, and an empty intra-op
/// parallel region (the fork/join cost).
/// @throws brigade::Error{InvalidArgument} if cores < 1
CpuRates measure_cpu_rates(int cores);

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

/// Intra-op parallel products per layer (matmul_wt calls): 7 per decoder layer, 1 LM head.
inline int products_of(model::LayerKind k) noexcept {
  return k == model::LayerKind::Decoder ? 7 : (k == model::LayerKind::LMHead ? 1 : 0);
}

/// Seconds one stage of `threads` cores takes for layers [first, last) on `work`, while
/// `active_cores` cores work at once (they share box_bytes_per_s and box_flops_per_s).
inline double stage_seconds(const model::ModelSpec& spec, int first, int last,
                            const model::WorkItem& work, int threads, int active_cores,
                            const CpuRates& r) {
  const double active = static_cast<double>(active_cores);
  const double per_core_bw = std::min(r.core_bytes_per_s, r.box_bytes_per_s / active);
  const double per_core_flops = std::min(r.flops_per_s, r.box_flops_per_s / active);
  model::DeviceRates rates;
  rates.flops_per_s = per_core_flops * threads;
  rates.bytes_per_s = per_core_bw * threads;
  double t = r.hop_s;
  for (int l = first; l < last; ++l) {
    t += model::roofline_seconds(model::layer_cost(spec, l, work), rates);
    if (threads > 1) t += r.fork_join_s * products_of(spec.layer(l).kind);
  }
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

/// Every plan for `workload` on `rates.cores` cores, fastest first (ties: fewer stages, then
/// fewer threads, then fewer micro-batches). Candidates: S stages in [1, min(cores, decoder
/// layers)], T threads in [1, cores / S], G micro-batches in [1, min(sequences, 4 S)], each with
/// partition::balanced for its decode micro-batch of ceil(N / G) sequences.
///
/// Predicted times (Williams et al. 2009 roofline per layer, model::layer_cost): a stage's time
/// for a micro-batch of b sequences is hop_s + sum over its layers of max(FLOPs / (T F),
/// bytes / (T B)) + fork_join_s per product when T > 1, with B = min(core_bytes_per_s,
/// box_bytes_per_s / (S T)) (the cores share the memory bus) and F = min(flops_per_s,
/// box_flops_per_s / (S T)). A decode round, in which every
/// sequence gains one token, takes max(G * slowest stage, sum of the stages): the pipeline is
/// paced by its slowest stage unless a micro-batch's next token waits on its previous one
/// crossing every stage (fewer micro-batches than stages). The prefill is the pipeline time of
/// the G prompt micro-batches (GPipe's (S + G - 1) form with unequal stages). tokens_per_s =
/// N * new_tokens / (prefill + new_tokens * round), decode context = prompt + new_tokens / 2.
/// @throws brigade::Error{InvalidArgument} for a workload field < 1 or invalid rates
inline std::vector<InferencePlan> inference_plans(const model::ModelSpec& spec,
                                                  const InferenceWorkload& workload,
                                                  const CpuRates& rates) {
  rates.validate();
  BRIGADE_CHECK(workload.sequences >= 1 && workload.prompt_tokens >= 1 && workload.new_tokens >= 1,
                Errc::InvalidArgument,
                "inference_plans: sequences = {}, prompt_tokens = {}, new_tokens = {}; expected "
                "all >= 1",
                workload.sequences, workload.prompt_tokens, workload.new_tokens);
  const int n = workload.sequences;
  const int max_stages = std::min(rates.cores, spec.config().n_layers);
  std::vector<InferencePlan> plans;
  for (int S = 1; S <= max_stages; ++S) {
    for (int T = 1; T * S <= rates.cores; ++T) {
      for (int G = 1; G <= std::min(n, 4 * S); ++G) {
        const int b = (n + G - 1) / G;
        model::WorkItem decode{b, b, workload.prompt_tokens + workload.new_tokens / 2.0};
        model::WorkItem prefill{static_cast<std::int64_t>(b) * workload.prompt_tokens, b,
                                workload.prompt_tokens / 2.0};
        model::DeviceRates split_rates{rates.flops_per_s, rates.core_bytes_per_s};
        const partition::Partition part = partition::balanced(spec, S, decode, split_rates);
        std::vector<double> dec, pre;
        for (const auto& st : part.stages()) {
          dec.push_back(detail::stage_seconds(spec, st.first, st.last, decode, T, S * T, rates));
          pre.push_back(detail::stage_seconds(spec, st.first, st.last, prefill, T, S * T, rates));
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
                                         const CpuRates& rates) {
  return inference_plans(spec, workload, rates).front();
}

}  // namespace v0
}  // namespace brigade::plan
