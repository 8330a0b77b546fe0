// brigade::cost: what an action costs. The CostModel concept is what the simulator reads; a
// roofline model prices real layers, a unit model checks closed forms.
#pragma once

#include "brigade/core/dtype.hpp"
#include "brigade/core/error.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/layer_cost.hpp"
#include "brigade/partition/partition.hpp"
#include "brigade/plan/plan.hpp"
#include "brigade/schedule/action.hpp"

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <vector>

namespace brigade::cost {
inline namespace v0 {

/// A point-to-point link: a message of `bytes` occupies the link for bytes / bytes_per_s seconds
/// (two messages on one link queue behind each other) and arrives latency_s after it leaves.
struct Link {
  double latency_s = 0.0;                                        ///< seconds, >= 0
  double bytes_per_s = std::numeric_limits<double>::infinity();  ///< bytes per second, > 0

  /// Seconds the link is busy with `bytes` (0 for an infinitely fast link or no bytes).
  [[nodiscard]] double occupancy_seconds(double bytes) const noexcept {
    return (bytes > 0.0 && std::isfinite(bytes_per_s)) ? bytes / bytes_per_s : 0.0;
  }
  /// Seconds from the start of a transfer of `bytes` to its arrival: latency + occupancy.
  [[nodiscard]] double transfer_seconds(double bytes) const noexcept {
    return latency_s + occupancy_seconds(bytes);
  }
  /// True when transfers cost nothing (no latency, infinite bandwidth).
  [[nodiscard]] bool is_free() const noexcept {
    return latency_s == 0.0 && !std::isfinite(bytes_per_s);
  }
  /// @throws brigade::Error{InvalidArgument} for a negative or NaN latency or a bandwidth <= 0
  void check() const {
    BRIGADE_CHECK(latency_s >= 0.0 && std::isfinite(latency_s), Errc::InvalidArgument,
                  "Link: latency {} s, expected finite and >= 0", latency_s);
    BRIGADE_CHECK(bytes_per_s > 0.0, Errc::InvalidArgument,
                  "Link: bandwidth {} bytes/s, expected > 0", bytes_per_s);
  }
};

/// What the simulator asks of a cost model, for actions of the schedule it was built for.
///
/// - `compute_seconds(a)`: seconds a compute action (F, B, BI, BW, RECOMPUTE, SAMPLE, OPT) keeps
///   its rank busy; 0 for communication actions.
/// - `activation_bytes(a)`: bytes the stash of a's (virtual stage, micro-batch) holds on its rank
///   once compute action `a` has run (training; 0 in inference): after F or RECOMPUTE what the
///   backward needs, after BI what the BW needs (it differs: training_stash() for a Llama),
///   after B or BW nothing. Not counted here: the F's output and the BI's input gradient waiting
///   to be sent (message_bytes() of the SEND they feed; the simulator adds them).
/// - `message_bytes(a)`: bytes a SEND_F/SEND_B moves (see schedule::counterpart()); also the size
///   of the receive buffer of its RECV.
/// - `link(src, dst)`: the link from rank src to rank dst.
///
/// Optional, read by the simulator when present: `send_overhead_seconds(a)`, the CPU seconds
/// the sender of SEND `a` spends copying and posting it (its rank is then neither busy nor free
/// to compute); `message_latency_seconds(a)`, the latency of SEND `a`'s message in place of its
/// link's. engine::MeasuredCostModel has both.
template <class C>
concept CostModel = requires(const C& c, const schedule::Action& a, int src, int dst) {
  { c.compute_seconds(a) } -> std::convertible_to<double>;
  { c.activation_bytes(a) } -> std::convertible_to<double>;
  { c.message_bytes(a) } -> std::convertible_to<double>;
  { c.link(src, dst) } -> std::convertible_to<Link>;
};

/// Optional member of a cost model: `weight_bytes(a)`, the bytes of the weights of action a's
/// virtual stage (its layers' parameters). The simulator reports per-rank resident weight bytes
/// from it (0 without it).
template <class C>
concept HasWeightBytes = requires(const C& c, const schedule::Action& a) {
  { c.weight_bytes(a) } -> std::convertible_to<double>;
};

/// Optional member of a cost model: `checkpoint_bytes(a)`, the bytes the stash of F `a`'s
/// (virtual stage, micro-batch) holds when its activations are dropped because a RECOMPUTE of
/// them follows later in the program (activation checkpointing: the stage keeps only its input).
/// Without it the simulator counts the message the F consumed (message_bytes() of the previous
/// virtual stage's SEND_F), 0 on virtual stage 0.
template <class C>
concept HasCheckpointBytes = requires(const C& c, const schedule::Action& a) {
  { c.checkpoint_bytes(a) } -> std::convertible_to<double>;
};

/// Optional member of a cost model: `weight_load_seconds(a)`, the seconds a PREFETCH `a` keeps
/// its rank's I/O lane busy loading its virtual stage's weights (from disk or host memory).
/// Without it a PREFETCH takes no time.
template <class C>
concept HasWeightLoad = requires(const C& c, const schedule::Action& a) {
  { c.weight_load_seconds(a) } -> std::convertible_to<double>;
};

/// Extra knobs of UnitCostModel.
struct UnitCostOptions {
  double sample = 0.0;         ///< seconds of a SAMPLE
  double message_bytes = 0.0;  ///< bytes of every SEND
  Link link{};                 ///< every link (default: free)
  /// Seconds to load one rank's whole share of weights (PREFETCH of virtual stage v costs
  /// weight_load / V_r, V_r = virtual stages on v's rank), >= 0.
  double weight_load = 0.0;
};

/// Unit costs, for closed forms: `forward` and `backward` are the time of one rank's whole
/// share of layers for one micro-batch, split evenly over the rank's virtual stages.
///
/// Without `weight`, `backward` is the full backward: op B costs backward, and a split BI or
/// BW costs backward / 2. With `weight`, `backward` is the BI time and `weight` the BW time,
/// and a full B costs backward + weight. RECOMPUTE costs a forward. SAMPLE costs `sample`
/// (default 0), OPT 0. Activations: one unit per micro-batch and rank (1 / V per virtual
/// stage). Messages carry UnitCostOptions::message_bytes (default 0) over its link (default free).
/// Weights: one unit per rank (1 / V per virtual stage), loaded by a PREFETCH in
/// UnitCostOptions::weight_load / V seconds.
class UnitCostModel {
 public:
  /// @param shape    the schedule's shape (its placement decides the split over virtual stages)
  /// @param forward  seconds of one rank's forward share for one micro-batch, >= 0
  /// @param backward seconds of the full backward share (or of BI when `weight` is given), >= 0
  /// @param weight   seconds of the BW share, if the backward is split
  /// @throws brigade::Error{InvalidArgument} for a negative or non-finite cost, or a bad link
  UnitCostModel(const schedule::Shape& shape, double forward, double backward,
                std::optional<double> weight = std::nullopt, UnitCostOptions options = {})
      : forward_(forward), backward_(backward), weight_(weight), opt_(options) {
    shape.check();
    auto ok = [](double x) { return x >= 0.0 && std::isfinite(x); };
    BRIGADE_CHECK(ok(forward) && ok(backward) && (!weight || ok(*weight)) && ok(options.sample) &&
                      ok(options.message_bytes) && ok(options.weight_load),
                  Errc::InvalidArgument,
                  "UnitCostModel: costs F={} B={} W={} sample={} message={} weight load={}, "
                  "expected finite and >= 0",
                  forward, backward, weight ? *weight : 0.0, options.sample, options.message_bytes,
                  options.weight_load);
    options.link.check();
    share_.resize(static_cast<std::size_t>(shape.num_virtual_stages));
    for (int v = 0; v < shape.num_virtual_stages; ++v)
      share_[static_cast<std::size_t>(v)] = 1.0 / shape.stages_on(shape.rank_of(v));
  }

  /// Seconds of a compute action; 0 for SEND/RECV.
  [[nodiscard]] double compute_seconds(const schedule::Action& a) const noexcept {
    const double s = share(a.virtual_stage);
    using schedule::Op;
    switch (a.op) {
      case Op::F:
      case Op::Recompute:
        return forward_ * s;
      case Op::B:
        return (weight_ ? backward_ + *weight_ : backward_) * s;
      case Op::BI:
        return (weight_ ? backward_ : backward_ / 2) * s;
      case Op::BW:
        return (weight_ ? *weight_ : backward_ / 2) * s;
      case Op::Sample:
        return opt_.sample;
      default:
        return 0.0;
    }
  }
  /// 1 / V units held after F, BI and RECOMPUTE (a rank's whole share for one micro-batch is
  /// one unit); 0 after B and BW.
  [[nodiscard]] double activation_bytes(const schedule::Action& a) const noexcept {
    using schedule::Op;
    return a.op == Op::F || a.op == Op::BI || a.op == Op::Recompute ? share(a.virtual_stage) : 0.0;
  }
  /// UnitCostOptions::message_bytes for every SEND.
  [[nodiscard]] double message_bytes(const schedule::Action&) const noexcept {
    return opt_.message_bytes;
  }
  /// UnitCostOptions::link for every pair.
  [[nodiscard]] Link link(int, int) const noexcept { return opt_.link; }
  /// 1 / V units of weights per virtual stage (a rank's whole share is one unit).
  [[nodiscard]] double weight_bytes(const schedule::Action& a) const noexcept {
    return share(a.virtual_stage);
  }
  /// UnitCostOptions::weight_load / V seconds per PREFETCH.
  [[nodiscard]] double weight_load_seconds(const schedule::Action& a) const noexcept {
    return opt_.weight_load * share(a.virtual_stage);
  }

 private:
  [[nodiscard]] double share(int v) const noexcept {
    return v >= 0 && static_cast<std::size_t>(v) < share_.size()
               ? share_[static_cast<std::size_t>(v)]
               : 1.0;
  }
  double forward_, backward_;
  std::optional<double> weight_;
  UnitCostOptions opt_;
  std::vector<double> share_;
};

/// Bytes a training stage (runtime::TrainStage over the CPU kernels, float32) holds for one
/// micro-batch between its passes, besides the messages it sends.
struct StageStash {
  double forward = 0.0;         ///< after F (or RECOMPUTE), until BI
  double backward_input = 0.0;  ///< after BI, until BW
  /// What is held once compute op `op` has run: `forward` after F or RECOMPUTE,
  /// `backward_input` after BI, 0 after B, BW and anything else.
  [[nodiscard]] double after(schedule::Op op) const noexcept {
    using schedule::Op;
    if (op == Op::F || op == Op::Recompute) return forward;
    return op == Op::BI ? backward_input : 0.0;
  }
};

/// What a training stage of layers [first, last) of `spec` keeps for one micro-batch of `tokens`
/// packed rows in `sequences` sequences: exactly the buffers of cpu::DecoderActivations and
/// cpu::HeadActivations (FlashAttention-2's recipe: the attention keeps its log-sum-exp, one
/// float per token and head, never the probabilities; Dao 2023, §3.1). Per layer, with
/// d = dim, kv = kv_dim, f = hidden_dim, H = n_heads, V = vocab_size, n = tokens, s = sequences:
/// - decoder, after F: n (6d + 2kv + 2f + H + 2) floats (x_in, xb_att, q, k, v, att, x_mid,
///   xb_ffn, h1, h3, lse, two inverse RMS) + n int32 positions + (s + 1) int64 offsets;
///   after BI: n (6d + 2kv + 3f) floats (xb_att, dq, dk, dv, att, d_mid, xb_ffn, dh1, dh3, dy,
///   hb) + 2d floats (norm-gain gradients) + the same positions and offsets;
/// - final norm (the tail: norm, LM head and loss run together, with the head's BI inside F):
///   2nd + d floats after F (normalised input, the gradient of the head's input, norm-gain
///   gradient), nd + d after BI (the gradient has moved on to the BI's output);
/// - LM head: nV floats (the logits' gradient) after F and after BI;
/// - embedding: nothing after F, nd floats after BI (the gradient at its output, for BW).
/// The stage's input (kept only when a RECOMPUTE follows) and the output or input gradient
/// waiting to be sent are n d floats each, counted with the messages, not here.
/// @throws brigade::Error{InvalidArgument} for a range outside the model or tokens < 1
inline StageStash training_stash(const model::ModelSpec& spec, partition::StageRange range,
                                 std::int64_t tokens, std::int64_t sequences) {
  BRIGADE_CHECK(range.first >= 0 && range.first < range.last && range.last <= spec.num_layers() &&
                    tokens >= 1 && sequences >= 1,
                Errc::InvalidArgument,
                "training_stash: layers [{}, {}) of {}, {} tokens in {} sequences", range.first,
                range.last, spec.num_layers(), tokens, sequences);
  const auto& c = spec.config();
  const double n = static_cast<double>(tokens), d = c.dim, kv = c.kv_dim(), f = c.hidden_dim,
               H = c.n_heads, V = c.vocab_size, f32 = 4.0;
  const double index_bytes = n * 4.0 + (static_cast<double>(sequences) + 1.0) * 8.0;
  StageStash s;
  for (int l = range.first; l < range.last; ++l) {
    switch (spec.layer(l).kind) {
      case model::LayerKind::Embedding:
        s.backward_input += n * d * f32;
        break;
      case model::LayerKind::Decoder:
        s.forward += n * (6 * d + 2 * kv + 2 * f + H + 2) * f32 + index_bytes;
        s.backward_input += (n * (6 * d + 2 * kv + 3 * f) + 2 * d) * f32 + index_bytes;
        break;
      case model::LayerKind::FinalNorm:
        s.forward += (2 * n * d + d) * f32;
        s.backward_input += (n * d + d) * f32;
        break;
      case model::LayerKind::LMHead:
        s.forward += n * V * f32;
        s.backward_input += n * V * f32;
        break;
      case model::LayerKind::Sampler:
        break;
    }
  }
  return s;
}

/// Bytes a training stage of layers `range` keeps for one micro-batch of `tokens` rows between
/// a forward that drops its activations and the RECOMPUTE that rebuilds them
/// (runtime::TrainStage with keep_activations = false): the float32 copy of its input, tokens x
/// dim floats, whatever the pipeline's dtype; nothing on the stage with the embedding (it
/// re-reads the token ids of the batch).
/// @throws brigade::Error{InvalidArgument} for a range outside the model or tokens < 1
inline double recompute_checkpoint_bytes(const model::ModelSpec& spec, partition::StageRange range,
                                         std::int64_t tokens) {
  BRIGADE_CHECK(range.first >= 0 && range.first < range.last && range.last <= spec.num_layers() &&
                    tokens >= 1,
                Errc::InvalidArgument, "recompute_checkpoint_bytes: layers [{}, {}) of {}, {} tokens",
                range.first, range.last, spec.num_layers(), tokens);
  return range.first == 0 ? 0.0
                          : static_cast<double>(tokens) * spec.config().dim * 4.0;
}

/// The work of one micro-batch, from which RooflineCostModel derives each action's WorkItem.
struct Workload {
  int batch = 1;      ///< sequences per micro-batch, >= 1
  int seq_len = 256;  ///< training: tokens per sequence; inference: prompt length; >= 1
};

/// Options of RooflineCostModel.
struct RooflineOptions {
  model::DeviceRates rates{};                  ///< every rank's rates...
  std::vector<model::DeviceRates> rank_rates;  ///< ...unless given per rank (size P)
  Link link{5e-6, 25e9};                       ///< every link: 5 us, 25 GB/s by default
  Workload workload{};
  /// Bytes per second a PREFETCH loads weights at (disk or host memory to the device), > 0;
  /// default 2 GB/s (an NVMe SSD's sequential read).
  double weight_load_bytes_per_s = 2e9;
  /// Layer times replacing the roofline on rates / rank_rates for every rank when set (the
  /// calibrated model: cost::ProfiledLayerTimes on a device profile). The optimizer step stays
  /// priced at the rates' bandwidth.
  model::LayerSeconds layer_seconds;
  /// Element type of the activations and gradients sent between stages (the engines'
  /// pipeline_dtype): a SEND moves tokens x dim values of it (f32, f16, bf16).
  DType pipeline_dtype = DType::F32;
};

/// Roofline costs (Williams et al. 2009) of a ModelSpec split by a Partition: each action's
/// time is the sum over its virtual stage's layers of
/// max(FLOPs / flops_per_s, bytes / bytes_per_s) from model::layer_cost() for its WorkItem.
///
/// WorkItems (work(): each micro-batch's from a plan::Plan's work, else B = workload.batch,
/// S = workload.seq_len for all; C = shape.num_chunks):
/// - training: tokens B*S/C per chunk, B sequences, context S/2 (causal mean); the final norm
///   and LM head run on every token (training logits), not only the last;
/// - inference round 0 (prefill): tokens B*S, context S/2; round c >= 1 (decode): tokens B,
///   context S + c.
///
/// Phases: F and RECOMPUTE cost the forward; BI and BW each cost one forward's FLOPs and bytes
/// (input and weight gradients are GEMMs of the forward's size), B = BI + BW; SAMPLE costs
/// the stage's Sampler layers, which F excludes; OPT reads and writes the weights three times
/// (AdamW: weights, two moments) at memory bandwidth. With RooflineOptions::layer_seconds set,
/// each layer's time comes from it instead, per phase: inference rounds in model::Phase::Prefill
/// (round 0) and Decode, training F and RECOMPUTE in Forward, BI in BackwardInput, BW in
/// BackwardWeight (so the calibrated model prices each pass as measured, not as a forward).
///
/// Weights: a virtual stage's bytes are its layers' weight_bytes (model::layer_cost); a PREFETCH
/// loads them in weight_bytes / RooflineOptions::weight_load_bytes_per_s seconds (prima.cpp's
/// disk offload, Li et al. 2025).
///
/// Memory (training only): activation_bytes() is training_stash() of the virtual stage for the
/// micro-batch's WorkItem (tokens and sequences; what our kernels keep: the attention's
/// log-sum-exp, not its probabilities), so a plan whose work is the step's micro-batches
/// (engine::microbatch_work) gives their memory to the byte; checkpoint_bytes() is what an F
/// keeps when a RECOMPUTE follows (recompute_checkpoint_bytes()). Messages: SEND_F/SEND_B move
/// tokens x dim values of the pipeline dtype; the inference token edge moves one int32 per
/// sequence.
class RooflineCostModel {
 public:
  /// @param spec      the model
  /// @param partition virtual stage v = partition stage v, on rank partition.stage(v).rank,
  ///                  which must equal shape.rank_of(v)
  /// @param shape     the shape of the schedules this model prices
  /// @throws brigade::Error{InvalidArgument} if the partition does not match the shape, the
  ///         workload or a rate is not positive, or rank_rates has the wrong size
  RooflineCostModel(const model::ModelSpec& spec, const partition::Partition& partition,
                    const schedule::Shape& shape, RooflineOptions options = {})
      : RooflineCostModel(spec, partition, shape, std::move(options), {}) {}

  /// Prices `plan`: its partition and shape, and the work of each micro-batch from plan.work()
  /// (options.workload for every micro-batch when the plan carries none); see work().
  /// @throws brigade::Error{InvalidArgument} as the other constructor
  RooflineCostModel(const model::ModelSpec& spec, const plan::Plan& plan,
                    RooflineOptions options = {})
      : RooflineCostModel(spec, plan.partition(), plan.shape(), std::move(options), plan.work()) {}

 private:
  RooflineCostModel(const model::ModelSpec& spec, const partition::Partition& partition,
                    const schedule::Shape& shape, RooflineOptions options,
                    std::span<const model::WorkItem> per_microbatch)
      : shape_(shape), opt_(std::move(options)),
        per_mb_(per_microbatch.begin(), per_microbatch.end()) {
    plan::check_placement(partition, shape_, "RooflineCostModel");
    BRIGADE_CHECK(opt_.workload.batch >= 1 && opt_.workload.seq_len >= 1, Errc::InvalidArgument,
                  "RooflineCostModel: batch {} and seq_len {}, expected both >= 1",
                  opt_.workload.batch, opt_.workload.seq_len);
    BRIGADE_CHECK(opt_.rank_rates.empty() ||
                      opt_.rank_rates.size() == static_cast<std::size_t>(shape_.num_ranks),
                  Errc::InvalidArgument, "RooflineCostModel: {} rank rates for {} ranks",
                  opt_.rank_rates.size(), shape_.num_ranks);
    auto check_rates = [](const model::DeviceRates& r) {
      BRIGADE_CHECK(r.flops_per_s > 0.0 && r.bytes_per_s > 0.0, Errc::InvalidArgument,
                    "RooflineCostModel: device rates {} FLOP/s and {} bytes/s, expected > 0",
                    r.flops_per_s, r.bytes_per_s);
    };
    check_rates(opt_.rates);
    for (const auto& r : opt_.rank_rates) check_rates(r);
    BRIGADE_CHECK(opt_.weight_load_bytes_per_s > 0.0, Errc::InvalidArgument,
                  "RooflineCostModel: weight load bandwidth {} bytes/s, expected > 0",
                  opt_.weight_load_bytes_per_s);
    opt_.link.check();
    BRIGADE_CHECK(is_float_dtype(opt_.pipeline_dtype), Errc::InvalidArgument,
                  "RooflineCostModel: pipeline dtype {}, expected f32, f16 or bf16",
                  to_string(opt_.pipeline_dtype));
    BRIGADE_CHECK(per_mb_.empty() ||
                      per_mb_.size() == static_cast<std::size_t>(shape_.num_microbatches),
                  Errc::InvalidArgument, "RooflineCostModel: work of {} micro-batches for {}",
                  per_mb_.size(), shape_.num_microbatches);
    const auto& cfg = spec.config();
    const int N = shape_.num_virtual_stages, C = shape_.num_chunks;
    const int Mw = per_mb_.empty() ? 1 : shape_.num_microbatches;
    table_.resize(static_cast<std::size_t>(N) * static_cast<std::size_t>(Mw) *
                  static_cast<std::size_t>(C));
    for (int v = 0; v < N; ++v) {
      const auto& st = partition.stage(v);
      const model::DeviceRates& rates = rates_of(st.rank);
      for (int m = 0; m < Mw; ++m)
      for (int c = 0; c < C; ++c) {
        const model::WorkItem w = work(m, c);
        model::WorkItem every_token = w;  // training logits: every position
        every_token.sequences = w.tokens;
        Entry e;
        double weight_bytes = 0.0;
        const bool training = shape_.mode == schedule::Mode::Training;
        for (int l = st.first; l < st.last; ++l) {
          const auto kind = spec.layer(l).kind;
          const bool per_token =
              training && (kind == model::LayerKind::FinalNorm || kind == model::LayerKind::LMHead);
          const model::LayerCost lc = model::layer_cost(spec, l, per_token ? every_token : w);
          weight_bytes += lc.weight_bytes;
          using model::Phase;
          if (opt_.layer_seconds) {
            const auto& ls = opt_.layer_seconds;
            if (!training) {
              const double t = ls(spec, l, w, c == 0 ? Phase::Prefill : Phase::Decode);
              (kind == model::LayerKind::Sampler ? e.sample : e.forward) += t;
              continue;
            }
            e.forward += ls(spec, l, w, Phase::Forward);
            e.backward_input += ls(spec, l, w, Phase::BackwardInput);
            e.backward_weight += ls(spec, l, w, Phase::BackwardWeight);
            continue;
          }
          const double t = model::roofline_seconds(lc, rates);
          if (kind == model::LayerKind::Sampler) {
            e.sample += t;
            continue;
          }
          e.forward += t;
          e.backward_input += t;
          e.backward_weight += t;
        }
        if (shape_.mode == schedule::Mode::Training) {
          e.stash = training_stash(spec, st, w.tokens, w.sequences);
          e.checkpoint = recompute_checkpoint_bytes(spec, st, w.tokens);
        }
        e.optimizer = 3.0 * 2.0 * weight_bytes / rates.bytes_per_s;
        e.weights = weight_bytes;
        e.message = static_cast<double>(w.tokens) * cfg.dim * dtype_element_bytes(opt_.pipeline_dtype);
        e.token_message = static_cast<double>(w.sequences) * 4.0;
        table_[index(v, m, c)] = e;
      }
    }
  }

 public:
  /// The WorkItem of micro-batch `microbatch`'s chunk (training) or round (inference) `chunk`.
  /// Its base is the plan's work of that micro-batch, or else B = workload.batch sequences of
  /// S = workload.seq_len tokens (B S tokens, context S / 2). Training: base tokens / C per chunk
  /// (at least 1), the base's sequences and context. Inference round 0 (prefill): the base;
  /// round c >= 1 (decode): one token per sequence at context base.tokens / base.sequences + c.
  [[nodiscard]] model::WorkItem work(int microbatch, int chunk) const noexcept {
    model::WorkItem base;
    if (per_mb_.empty()) {
      const std::int64_t B = opt_.workload.batch, S = opt_.workload.seq_len;
      base = {B * S, B, static_cast<double>(S) / 2.0};
    } else {
      base = per_mb_[static_cast<std::size_t>(
          std::clamp(microbatch, 0, static_cast<int>(per_mb_.size()) - 1))];
    }
    return plan::action_work(shape_, base, chunk);
  }

  /// Seconds of a compute action (see the class comment); 0 for SEND/RECV.
  [[nodiscard]] double compute_seconds(const schedule::Action& a) const noexcept {
    const Entry& e = entry(a);
    switch (a.op) {
      case schedule::Op::F:
      case schedule::Op::Recompute:
        return e.forward;
      case schedule::Op::BI:
        return e.backward_input;
      case schedule::Op::BW:
        return e.backward_weight;
      case schedule::Op::B:
        return e.backward_input + e.backward_weight;
      case schedule::Op::Sample:
        return e.sample;
      case schedule::Op::Opt:
        return e.optimizer;
      default:
        return 0.0;
    }
  }
  /// Bytes a's stash holds once `a` has run (training_stash(); the CostModel concept's
  /// semantics: F and RECOMPUTE the forward stash, BI the backward-input stash, else 0; 0 in
  /// inference).
  [[nodiscard]] double activation_bytes(const schedule::Action& a) const noexcept {
    return entry(a).stash.after(a.op);
  }
  /// Bytes an F's stash holds when a RECOMPUTE of it follows (cost::HasCheckpointBytes):
  /// recompute_checkpoint_bytes() of the virtual stage for the micro-batch's tokens; 0 in
  /// inference.
  [[nodiscard]] double checkpoint_bytes(const schedule::Action& a) const noexcept {
    return entry(a).checkpoint;
  }
  /// Bytes a SEND moves: the hidden state (or its gradient), or the sampled token ids.
  [[nodiscard]] double message_bytes(const schedule::Action& a) const noexcept {
    const bool token = shape_.mode == schedule::Mode::Inference &&
                       a.virtual_stage == shape_.num_virtual_stages - 1;
    return token ? entry(a).token_message : entry(a).message;
  }
  /// RooflineOptions::link for every pair.
  [[nodiscard]] Link link(int, int) const noexcept { return opt_.link; }
  /// Bytes of the weights of a's virtual stage (the sum of its layers' weight_bytes).
  [[nodiscard]] double weight_bytes(const schedule::Action& a) const noexcept {
    return entry(a).weights;
  }
  /// Seconds a PREFETCH of a's virtual stage loads its weights: weight_bytes(a) /
  /// RooflineOptions::weight_load_bytes_per_s.
  [[nodiscard]] double weight_load_seconds(const schedule::Action& a) const noexcept {
    return entry(a).weights / opt_.weight_load_bytes_per_s;
  }

  /// A Partition for `shape`: the layers split uniformly (partition::uniform) into
  /// shape.num_virtual_stages stages, stage v placed on shape.rank_of(v).
  /// @throws brigade::Error{InvalidArgument} if the model has fewer decoder layers than stages
  static partition::Partition placed_uniform(const model::ModelSpec& spec,
                                             const schedule::Shape& shape) {
    const partition::Partition u = partition::uniform(spec, shape.num_virtual_stages);
    std::vector<partition::StageRange> st = u.stages();
    for (int v = 0; v < shape.num_virtual_stages; ++v)
      st[static_cast<std::size_t>(v)].rank = shape.rank_of(v);
    return partition::Partition(spec.num_layers(), shape.num_ranks, std::move(st));
  }

 private:
  struct Entry {
    double forward = 0.0, backward_input = 0.0, backward_weight = 0.0, sample = 0.0,
           optimizer = 0.0, message = 0.0, token_message = 0.0, weights = 0.0;
    StageStash stash;         // zero in inference
    double checkpoint = 0.0;  // recompute_checkpoint_bytes; zero in inference
  };
  [[nodiscard]] std::size_t index(int v, int m, int c) const noexcept {
    const std::size_t Mw = per_mb_.empty() ? 1 : per_mb_.size();
    return (static_cast<std::size_t>(v) * Mw + static_cast<std::size_t>(m)) *
               static_cast<std::size_t>(shape_.num_chunks) +
           static_cast<std::size_t>(c);
  }
  [[nodiscard]] const Entry& entry(const schedule::Action& a) const noexcept {
    const int v = std::clamp(a.virtual_stage, 0, shape_.num_virtual_stages - 1);
    const int m = per_mb_.empty() ? 0 : std::clamp(a.microbatch, 0, shape_.num_microbatches - 1);
    const int c = std::clamp(a.chunk, 0, shape_.num_chunks - 1);
    return table_[index(v, m, c)];
  }
  [[nodiscard]] const model::DeviceRates& rates_of(int rank) const noexcept {
    return opt_.rank_rates.empty() ? opt_.rates : opt_.rank_rates[static_cast<std::size_t>(rank)];
  }

  schedule::Shape shape_;
  RooflineOptions opt_;
  std::vector<model::WorkItem> per_mb_;  // empty: opt_.workload for every micro-batch
  std::vector<Entry> table_;
};

static_assert(CostModel<UnitCostModel>, "UnitCostModel must model CostModel");
static_assert(CostModel<RooflineCostModel>, "RooflineCostModel must model CostModel");
static_assert(HasWeightBytes<UnitCostModel> && HasWeightLoad<UnitCostModel>);
static_assert(HasWeightBytes<RooflineCostModel> && HasWeightLoad<RooflineCostModel>);
static_assert(HasCheckpointBytes<RooflineCostModel>);

}  // namespace v0
}  // namespace brigade::cost
