// The TP x PP planner: how to serve a dense Llama model on G GPUs of one node, and at which
// operating point (latency, throughput) each way of splitting it runs.
//
// A plan is (TP degree t, PP degree p, batch B) with t x p = G: p pipeline stages of
// contiguous decoder layers, each stage a tensor-parallel group of t GPUs (Megatron-LM's split,
// Shoeybi et al. 2019, §3: attention heads and the MLP's hidden dimension column-then-row
// parallel, one all-reduce after attention and one after the MLP; embedding and LM head split
// over the vocabulary). B sequences of `input_tokens` prompt tokens generate `output_tokens`
// tokens each as one static batch, split into m = min(p, B) micro-batches in flight (one per
// stage, as vLLM's pipeline-parallel engine runs them; the prompts are prefilled in as many
// micro-batches as is fastest). The cost of every plan comes in closed
// form from a device profile (docs/profiles.md) and the model's shapes: per-GPU products,
// attention and element-wise work at the profile's rates, ring all-reduces on the profile's
// link, the pipeline's bubbles, and the memory of the most loaded GPU (weights, KV cache, a
// layer's workspace). docs/tp_pp.md shows the fronts for Llama-3.1 70B and 405B on 8 GPUs.
#pragma once

#include "brigade/core/dtype.hpp"
#include "brigade/core/error.hpp"
#include "brigade/cost/profile.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/layer_cost.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace brigade::plan {
inline namespace v0 {

/// Seconds of a ring all-reduce of `bytes` (each member's buffer) over `ranks` members joined
/// by `link`: latency_s + 2 (ranks - 1) / ranks x bytes / bytes_per_s. The bandwidth term is the
/// ring's (reduce-scatter then all-gather, 2 (ranks - 1) steps of bytes / ranks each: Thakur,
/// Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in MPICH",
/// §4.4; Patarasuk & Yuan 2009); the latency is paid once, as a collective library runs the
/// steps as one pipelined kernel (NCCL's LL protocols) whose start-up (launch, the peers'
/// synchronisation: the link's latency_s) dominates the per-hop latency inside a node.
/// 0 for one member.
/// @throws brigade::Error{InvalidArgument} for ranks < 1 or bytes < 0
inline double ring_all_reduce_seconds(double bytes, int ranks, const cost::LinkProfile& link) {
  BRIGADE_CHECK(ranks >= 1 && bytes >= 0.0, Errc::InvalidArgument,
                "ring all-reduce: {} bytes over {} ranks; expected bytes >= 0 and ranks >= 1",
                bytes, ranks);
  if (ranks == 1) return 0.0;
  return link.latency_s + 2.0 * (ranks - 1) / ranks * bytes / link.bytes_per_s;
}

/// Seconds of a ring all-gather whose result is `bytes` (each member contributes bytes /
/// ranks): latency_s + (ranks - 1) / ranks x bytes / bytes_per_s (Thakur et al. 2005, §4.1;
/// the latency paid once, as ring_all_reduce_seconds()). 0 for one member.
/// @throws brigade::Error{InvalidArgument} for ranks < 1 or bytes < 0
inline double ring_all_gather_seconds(double bytes, int ranks, const cost::LinkProfile& link) {
  BRIGADE_CHECK(ranks >= 1 && bytes >= 0.0, Errc::InvalidArgument,
                "ring all-gather: {} bytes over {} ranks; expected bytes >= 0 and ranks >= 1",
                bytes, ranks);
  if (ranks == 1) return 0.0;
  return link.latency_s + (ranks - 1.0) / ranks * bytes / link.bytes_per_s;
}

/// The requests a plan serves: one static batch of equal requests.
struct ServingWorkload {
  int input_tokens = 128;   ///< prompt tokens per request, >= 1
  int output_tokens = 128;  ///< generated tokens per request, >= 1
};

/// A rank grid: p pipeline stages, each a tensor-parallel group of t GPUs (t x p GPUs).
struct TpPpGrid {
  int tp = 1;  ///< tensor-parallel degree t (GPUs per stage), >= 1
  int pp = 1;  ///< pipeline-parallel degree p (stages), >= 1
};

/// Checks that `grid` can split `config` over `gpus` GPUs: t x p = gpus, n_heads a multiple
/// of t (each GPU holds whole query heads), n_kv_heads a multiple of t or t a multiple of
/// n_kv_heads (then each KV head is replicated on t / n_kv_heads GPUs, as Megatron and vLLM
/// do), and p <= n_layers.
/// @throws brigade::Error{InvalidArgument} naming the degree and what it does not divide
inline void check_grid(const model::LlamaConfig& config, TpPpGrid grid, int gpus) {
  BRIGADE_CHECK(grid.tp >= 1 && grid.pp >= 1 && gpus >= 1, Errc::InvalidArgument,
                "grid TP {} x PP {} on {} GPUs: every degree must be >= 1", grid.tp, grid.pp, gpus);
  BRIGADE_CHECK(static_cast<std::int64_t>(grid.tp) * grid.pp == gpus, Errc::InvalidArgument,
                "grid TP {} x PP {} = {} ranks does not match the {} GPUs (TP x PP must equal "
                "the GPU count)",
                grid.tp, grid.pp, static_cast<std::int64_t>(grid.tp) * grid.pp, gpus);
  BRIGADE_CHECK(config.n_heads % grid.tp == 0, Errc::InvalidArgument,
                "TP {}: the model's {} attention heads are not divisible by the TP degree",
                grid.tp, config.n_heads);
  BRIGADE_CHECK(config.n_kv_heads % grid.tp == 0 || grid.tp % config.n_kv_heads == 0,
                Errc::InvalidArgument,
                "TP {}: the model's {} KV heads are neither divisible by the TP degree nor a "
                "divisor of it",
                grid.tp, config.n_kv_heads);
  BRIGADE_CHECK(grid.pp <= config.n_layers, Errc::InvalidArgument,
                "PP {}: more stages than the model's {} decoder layers", grid.pp,
                config.n_layers);
}

/// Bytes one GPU holds (the most loaded GPU of a plan).
struct RankMemory {
  double weight_bytes = 0.0;      ///< its share of the weights
  double kv_bytes = 0.0;          ///< its KV cache for the whole batch at full length
  double activation_bytes = 0.0;  ///< one layer's workspace for a prefill micro-batch, and logits
  /// The sum, bytes.
  [[nodiscard]] double total() const noexcept { return weight_bytes + kv_bytes + activation_bytes; }
};

/// One (TP, PP, batch) and its predicted operating point.
struct TpPpPlan {
  TpPpGrid grid;
  int batch = 1;         ///< sequences served together, B
  int microbatches = 1;  ///< decode micro-batches in flight, m = min(p, B)
  int prefill_microbatches = 1;  ///< micro-batches the prompts are prefilled in, in [m, B]
  double ttft_s = 0.0;   ///< time to first token: the batch's prefill through the pipeline, s
  double tpot_s = 0.0;   ///< time per output token: one decode round of the batch, s
  double latency_s = 0.0;     ///< a request's end-to-end time: ttft + (output - 1) tpot, s
  double tokens_per_s = 0.0;  ///< generated tokens per second: B x output / latency
  double decode_bubble = 0.0;  ///< idle fraction of the stages in a decode round, [0, 1)
  double tp_comm_fraction = 0.0;  ///< share of a decode round spent in TP all-reduces/gathers
  RankMemory memory;     ///< the most loaded GPU
  bool fits = true;      ///< memory.total() <= the profile's memory_capacity_bytes
  /// e.g. "TP4 x PP2, batch 16".
  [[nodiscard]] std::string describe() const {
    return "TP" + std::to_string(grid.tp) + " x PP" + std::to_string(grid.pp) + ", batch " +
           std::to_string(batch);
  }
};

namespace detail {

/// Bytes per weight and KV element of a profile's dtype (f32 4, f16/bf16 2).
/// @throws brigade::Error{InvalidArgument} for a dtype that is not a float type
inline double profile_element_bytes(const cost::DeviceProfile& profile) {
  const auto t = parse_dtype(profile.dtype);
  BRIGADE_CHECK(t.has_value() && is_float_dtype(*t), Errc::InvalidArgument,
                "profile {}: dtype '{}' is not a float type the planner can size (f32, f16, bf16)",
                profile.name, profile.dtype);
  return dtype_element_bytes(*t);
}

/// Decoder layers of stage `s` of `p`: L / p, the first L % p stages one more (the last stage,
/// which also holds the LM head, gets the fewer when they differ).
inline int stage_layers(int layers, int p, int s) { return layers / p + (s < layers % p ? 1 : 0); }

/// The per-GPU shapes of one TP degree.
struct TpShapes {
  double d, h, v, hd, q_heads, kv_heads, layer_weights;
  TpShapes(const model::LlamaConfig& c, int t)
      : d(c.dim), h(c.hidden_dim), v(c.vocab_size), hd(c.head_size()),
        q_heads(static_cast<double>(c.n_heads) / t),
        kv_heads(std::max(1.0, static_cast<double>(c.n_kv_heads) / t)),
        // Q and O: d x (d / t); K and V: d x (kv heads per GPU x head size); W1, W3, W2: d x h / t.
        layer_weights(2.0 * d * d / t + 2.0 * d * kv_heads * hd + 3.0 * d * h / t) {}
};

}  // namespace detail

/// The memory of the most loaded GPU of `grid` serving `batch` sequences of workload `w`, with
/// weights and KV cache in the profile's dtype (e bytes per element): per stage s of n_s layers,
/// weights n_s (Q, K, V, O, W1, W2, W3 per GPU + 2 norms of dim) + on the first stage the
/// embedding's vocabulary shard v d / t, on the last the LM head's v d / t and the final norm
/// (a tied classifier is held once when p = 1); KV cache n_s x 2 x (KV heads per GPU) x head
/// size x B x (input + output) elements; workspace: one layer of the prefill micro-batch,
/// rows x (4 dim + 2 hidden / t) elements, and the logits shard of its sequences in f32.
/// @throws brigade::Error{InvalidArgument} as check_grid() (with gpus = t x p), for batch < 1
inline RankMemory tp_rank_memory(const model::LlamaConfig& config, const cost::DeviceProfile& profile,
                                 TpPpGrid grid, int batch, const ServingWorkload& w) {
  check_grid(config, grid, grid.tp * grid.pp);
  BRIGADE_CHECK(batch >= 1 && w.input_tokens >= 1 && w.output_tokens >= 1, Errc::InvalidArgument,
                "tp_rank_memory: batch = {}, input = {}, output = {}; expected all >= 1", batch,
                w.input_tokens, w.output_tokens);
  const double e = detail::profile_element_bytes(profile);
  const detail::TpShapes sh(config, grid.tp);
  const int p = grid.pp, t = grid.tp;
  const int m = std::min(p, batch);
  const double mb = std::ceil(static_cast<double>(batch) / m);
  const double rows = mb * w.input_tokens;
  RankMemory worst;
  for (int s = 0; s < p; ++s) {
    const double n = detail::stage_layers(config.n_layers, p, s);
    RankMemory r;
    r.weight_bytes = n * (sh.layer_weights + 2.0 * sh.d) * e;
    const double shard = sh.v * sh.d / t * e;
    if (s == 0) r.weight_bytes += shard;
    if (s == p - 1) r.weight_bytes += sh.d * e + ((config.shared_classifier && p == 1) ? 0.0 : shard);
    r.kv_bytes = n * 2.0 * sh.kv_heads * sh.hd * e * batch *
                 (static_cast<double>(w.input_tokens) + w.output_tokens);
    r.activation_bytes = rows * (4.0 * sh.d + 2.0 * sh.h / t) * e +
                         (s == p - 1 ? mb * sh.v / t * 4.0 : 0.0);
    if (r.total() > worst.total()) worst = r;
  }
  return worst;
}

/// The operating point of `grid` serving `batch` sequences of `w` on GPUs of `profile` joined by
/// its link named `link` (TP all-reduces and PP hand-overs both use it). Per GPU, for a
/// micro-batch of b sequences and r rows (decode: r = b at the mean context input + output / 2;
/// prefill: r = b x input at mean context (input + 1) / 2), with bw = memory_bytes_per_s:
/// - a decoder layer: its products max(2 r W_t / gemm_flops_per_s(r), W_t e / bw) for the
///   per-GPU weights W_t (detail::TpShapes), attention on its heads (decode: the KV heads' rows,
///   profile phase decode; prefill: the query heads, phase forward, FlashAttention's causal
///   pass), element-wise r (6 dim + 3 hidden / t) e / bw, and two ring all-reduces of r x dim
///   x e bytes (after attention and after the MLP);
/// - the first stage adds the embedding (r dim e / bw), the last the LM head on one row per
///   sequence (its vocabulary shard) and the all-gather of the b x vocab logits (e bytes each);
/// - every stage but the last adds the hand-over of r x dim x e bytes to the next.
/// With stage times s_1..s_p of a micro-batch, a decode round (tpot) is max(m max s_i, sum s_i)
/// (the slowest stage paces m micro-batches; fewer than p leave bubbles) and the prefill (ttft)
/// sum s_i + (k - 1) max s_i for k micro-batches of ceil(B / k) prompts (GPipe's fill and
/// drain, Huang et al. 2019), k the fastest of m, 2 m, 4 m, ..., B (more micro-batches shrink
/// the fill and drain, fewer rows per product lower the GEMM rate). decode_bubble = 1 -
/// m sum s_i / (p tpot).
/// @throws brigade::Error{InvalidArgument} as check_grid() and tp_rank_memory(), for a link the
///         profile lacks, or an invalid profile
inline TpPpPlan evaluate_tp_pp(const model::LlamaConfig& config, const cost::DeviceProfile& profile,
                               TpPpGrid grid, int batch, const ServingWorkload& w,
                               std::string_view link = "nvlink") {
  profile.validate();
  TpPpPlan plan;
  plan.grid = grid;
  plan.batch = batch;
  plan.memory = tp_rank_memory(config, profile, grid, batch, w);
  plan.fits = plan.memory.total() <= profile.memory_capacity_bytes;
  const cost::LinkProfile& ln = profile.link(link);
  const double e = detail::profile_element_bytes(profile);
  const double bw = profile.memory_bytes_per_s;
  const detail::TpShapes sh(config, grid.tp);
  const int p = grid.pp, t = grid.tp;
  const int m = std::min(p, batch);
  plan.microbatches = m;
  const std::int64_t b = (batch + m - 1) / m;
  struct Times {
    std::vector<double> stage;
    double comm = 0.0;  // TP collectives of the slowest stage
  };
  auto stages = [&](std::int64_t rows, bool prefill, double context) {
    const double r = static_cast<double>(rows);
    const double attn =
        prefill ? profile.attention_seconds(rows, static_cast<int>(sh.q_heads),
                                            static_cast<int>(sh.hd), context, model::Phase::Forward)
                : profile.attention_seconds(rows, static_cast<int>(sh.kv_heads),
                                            static_cast<int>(sh.hd), context, model::Phase::Decode);
    const double products = std::max(2.0 * r * sh.layer_weights / profile.gemm_flops_per_s(rows),
                                     sh.layer_weights * e / bw);
    const double allreduce = 2.0 * ring_all_reduce_seconds(r * sh.d * e, t, ln);
    const double layer = products + attn + r * (6.0 * sh.d + 3.0 * sh.h / t) * e / bw + allreduce;
    const double head_w = sh.v * sh.d / t;
    const double bs = static_cast<double>(b);
    const double head = std::max(2.0 * bs * head_w / profile.gemm_flops_per_s(b), head_w * e / bw);
    const double gather = ring_all_gather_seconds(bs * sh.v * e, t, ln);
    Times out;
    double slowest = -1.0;
    for (int s = 0; s < p; ++s) {
      const int n = detail::stage_layers(config.n_layers, p, s);
      double st = n * layer;
      double comm = n * allreduce;
      if (s == 0) st += r * sh.d * e / bw;
      if (s == p - 1) {
        st += head + gather;
        comm += gather;
      } else {
        st += ln.latency_s + r * sh.d * e / ln.bytes_per_s;
      }
      out.stage.push_back(st);
      if (st > slowest) {
        slowest = st;
        out.comm = comm;
      }
    }
    return out;
  };
  auto sum_max = [](const std::vector<double>& v) {
    double sum = 0.0, mx = 0.0;
    for (double x : v) {
      sum += x;
      mx = std::max(mx, x);
    }
    return std::pair{sum, mx};
  };
  const Times dec = stages(b, false, w.input_tokens + w.output_tokens / 2.0);
  const auto [dsum, dmax] = sum_max(dec.stage);
  plan.tpot_s = std::max(m * dmax, dsum);
  // The prefill's micro-batches: m, 2 m, 4 m, ... up to B prompts, the fastest.
  plan.ttft_s = std::numeric_limits<double>::infinity();
  for (int k = m;; k = std::min(batch, 2 * k)) {
    const std::int64_t prompts = (batch + k - 1) / k;
    const auto [psum, pmax] = sum_max(stages(prompts * w.input_tokens, true,
                                             (w.input_tokens + 1) / 2.0).stage);
    const double ttft = psum + (k - 1) * pmax;
    if (ttft < plan.ttft_s) {
      plan.ttft_s = ttft;
      plan.prefill_microbatches = k;
    }
    if (k == batch) break;
  }
  plan.latency_s = plan.ttft_s + (w.output_tokens - 1) * plan.tpot_s;
  plan.tokens_per_s = static_cast<double>(batch) * w.output_tokens / plan.latency_s;
  plan.decode_bubble = std::max(0.0, 1.0 - m * dsum / (p * plan.tpot_s));
  plan.tp_comm_fraction = m * dec.comm / plan.tpot_s;
  return plan;
}

/// The batches the planner tries up to `max_batch`: 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers
/// of two and 1.5 x each), and max_batch itself.
/// @throws brigade::Error{InvalidArgument} for max_batch < 1
inline std::vector<int> serving_batches(int max_batch) {
  BRIGADE_CHECK(max_batch >= 1, Errc::InvalidArgument, "max_batch = {}, expected >= 1", max_batch);
  std::vector<int> out;
  for (std::int64_t p = 1; p <= max_batch; p *= 2) {
    out.push_back(static_cast<int>(p));
    if (p >= 2 && p * 3 / 2 <= max_batch) out.push_back(static_cast<int>(p * 3 / 2));
  }
  if (out.back() != max_batch) out.push_back(max_batch);
  return out;
}

/// What tp_pp_plans() searches.
struct TpPlannerOptions {
  int gpus = 8;                ///< GPUs of the node (t x p = gpus), >= 1
  int max_batch = 4096;        ///< batches serving_batches(max_batch), >= 1
  std::string link = "nvlink"; ///< the profile link between the GPUs
};

/// Every plan: each (t, p) with t x p = options.gpus that check_grid() accepts, at every batch
/// of serving_batches(options.max_batch); plans over memory are kept with fits = false. Ordered by
/// t descending (TP8 x PP1 first), then batch.
/// @throws brigade::Error{InvalidArgument} for gpus or max_batch < 1, a workload field < 1, no
///         grid that divides the model (naming the degrees tried), or as evaluate_tp_pp()
inline std::vector<TpPpPlan> tp_pp_plans(const model::LlamaConfig& config,
                                         const cost::DeviceProfile& profile,
                                         const ServingWorkload& w,
                                         const TpPlannerOptions& options = {}) {
  BRIGADE_CHECK(options.gpus >= 1 && options.max_batch >= 1, Errc::InvalidArgument,
                "tp_pp_plans: gpus = {}, max_batch = {}; expected both >= 1", options.gpus,
                options.max_batch);
  BRIGADE_CHECK(w.input_tokens >= 1 && w.output_tokens >= 1, Errc::InvalidArgument,
                "tp_pp_plans: input = {}, output = {} tokens; expected both >= 1", w.input_tokens,
                w.output_tokens);
  std::vector<TpPpPlan> plans;
  std::string refused;
  for (int t = options.gpus; t >= 1; --t) {
    if (options.gpus % t != 0) continue;
    const TpPpGrid g{t, options.gpus / t};
    try {
      check_grid(config, g, options.gpus);
    } catch (const Error& err) {
      refused += std::string(refused.empty() ? "" : "; ") + err.what();
      continue;
    }
    for (int b : serving_batches(options.max_batch))
      plans.push_back(evaluate_tp_pp(config, profile, g, b, w, options.link));
  }
  BRIGADE_CHECK(!plans.empty(), Errc::InvalidArgument, "no TP x PP grid splits the model over {} "
                "GPUs: {}", options.gpus, refused);
  return plans;
}

/// The Pareto front of the plans that fit: those no other fitting plan beats on both latency
/// (lower latency_s) and throughput (higher tokens_per_s by more than a relative 1e-4: a larger
/// batch at a saturated rate does not join the front), ordered by latency ascending.
inline std::vector<TpPpPlan> pareto_front(const std::vector<TpPpPlan>& plans) {
  std::vector<TpPpPlan> fit;
  for (const auto& p : plans)
    if (p.fits) fit.push_back(p);
  std::stable_sort(fit.begin(), fit.end(), [](const TpPpPlan& a, const TpPpPlan& b) {
    return a.latency_s < b.latency_s ||
           (a.latency_s == b.latency_s && a.tokens_per_s > b.tokens_per_s);
  });
  std::vector<TpPpPlan> front;
  double best = -1.0;
  for (const auto& p : fit)
    if (p.tokens_per_s > best * (1.0 + 1e-4)) {
      front.push_back(p);
      best = p.tokens_per_s;
    }
  return front;
}

/// The plan for a service-level objective: among the fitting plans with ttft_s <= slo_ttft_s
/// and tpot_s <= slo_tpot_s, the highest tokens_per_s (ties: lower latency); empty when none
/// meets both.
inline std::optional<TpPpPlan> pick_for_slo(const std::vector<TpPpPlan>& plans, double slo_ttft_s,
                                            double slo_tpot_s) {
  std::optional<TpPpPlan> best;
  for (const auto& p : plans) {
    if (!p.fits || p.ttft_s > slo_ttft_s || p.tpot_s > slo_tpot_s) continue;
    if (!best || p.tokens_per_s > best->tokens_per_s ||
        (p.tokens_per_s == best->tokens_per_s && p.latency_s < best->latency_s))
      best = p;
  }
  return best;
}

/// Checks that a plan's most loaded GPU fits the device.
/// @throws brigade::Error{InvalidArgument} "TP t x PP p, batch B: one GPU needs X GB (weights
///         W, KV cache K, workspace A) but <device> holds C GB"
inline void check_plan_fits(const TpPpPlan& plan, const cost::DeviceProfile& profile) {
  const RankMemory& r = plan.memory;
  BRIGADE_CHECK(plan.fits, Errc::InvalidArgument,
                "{}: one GPU needs {:.1f} GB (weights {:.1f}, KV cache {:.1f}, workspace {:.1f}) "
                "but {} holds {:.1f} GB",
                plan.describe(), r.total() / 1e9, r.weight_bytes / 1e9, r.kv_bytes / 1e9,
                r.activation_bytes / 1e9, profile.name, profile.memory_capacity_bytes / 1e9);
}

}  // namespace v0
}  // namespace brigade::plan
