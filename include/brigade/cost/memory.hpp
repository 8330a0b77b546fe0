// brigade::cost memory model: the bytes each rank of a plan holds (weights by dtype, gradients,
// optimizer state, stashed activations, KV cache, receive buffers, kernel workspace), and the
// check of a plan against the device capacities of cost::DeviceProfile. The activation figure of
// training is the simulator's (sim::simulate's peak_memory_bytes, which engine::execute measures
// to the byte); the other parts are closed forms of what runtime::TrainStage, engine::AdamW,
// runtime::InferenceStage and the executor allocate. docs/architecture.md ("Memory model").
#pragma once

#include "brigade/core/dtype.hpp"
#include "brigade/core/error.hpp"
#include "brigade/cost/cost_model.hpp"
#include "brigade/cost/profile.hpp"
#include "brigade/model/config.hpp"
#include "brigade/partition/partition.hpp"
#include "brigade/plan/plan.hpp"
#include "brigade/sim/simulator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace brigade::cost {
inline namespace v0 {


/// The parameters of a stage, in elements: matrices (stored at the weight dtype) and vectors
/// (norm gains, always float32).
struct StageParameters {
  std::int64_t matrix = 0;  ///< elements of the embedding table, projections and classifier
  std::int64_t vector = 0;  ///< elements of the RMSNorm gains
  /// All elements.
  [[nodiscard]] std::int64_t total() const noexcept { return matrix + vector; }
  /// Bytes with matrices stored as `t` and vectors as float32.
  [[nodiscard]] double bytes(DType t) const noexcept {
    return static_cast<double>(matrix) * dtype_element_bytes(t) +
           static_cast<double>(vector) * 4.0;
  }
};

/// The parameters of the ModelSpec layers `range` of `spec`: the embedding table (vocab x dim),
/// each decoder's nine tensors (two dim gains; wq, wo dim x dim; wk, wv kv_dim x dim; w1, w3
/// hidden x dim; w2 dim x hidden), the final norm gain (dim), the classifier (vocab x dim;
/// counted unless `classifier_is_embedding`: a shared classifier whose table the same holder
/// already counts); the sampler has none.
/// @throws brigade::Error{InvalidArgument} for a range outside the model
inline StageParameters stage_parameters(const model::ModelSpec& spec, partition::StageRange range,
                                        bool classifier_is_embedding = false) {
  BRIGADE_CHECK(range.first >= 0 && range.first < range.last && range.last <= spec.num_layers(),
                Errc::InvalidArgument, "stage_parameters: layers [{}, {}) outside the model's [0, {})",
                range.first, range.last, spec.num_layers());
  const auto& c = spec.config();
  const std::int64_t d = c.dim, kv = c.kv_dim(), h = c.hidden_dim, v = c.vocab_size;
  StageParameters p;
  for (int l = range.first; l < range.last; ++l) {
    switch (spec.layer(l).kind) {
      case model::LayerKind::Embedding: p.matrix += v * d; break;
      case model::LayerKind::Decoder:
        p.matrix += 2 * d * d + 2 * kv * d + 3 * h * d;
        p.vector += 2 * d;
        break;
      case model::LayerKind::FinalNorm: p.vector += d; break;
      case model::LayerKind::LMHead:
        if (!classifier_is_embedding) p.matrix += v * d;
        break;
      case model::LayerKind::Sampler: break;
    }
  }
  return p;
}

/// Bytes of the whole model's weights stored as `dtype` (one copy; a shared classifier once).
inline double model_weight_bytes(const model::ModelSpec& spec,
                                 DType dtype = DType::F32) {
  return stage_parameters(spec, {0, 0, spec.num_layers()}, spec.config().shared_classifier)
      .bytes(dtype);
}

/// Bytes of each ModelSpec layer's weights with the matrices stored as `dtype` (the gains as
/// float32; the classifier 0 when shared): the prediction for a model not loaded yet, in the
/// form model::layer_weight_bytes gives for a loaded one. spec.num_layers() entries.
inline std::vector<double> layer_weight_bytes(const model::ModelSpec& spec,
                                              DType dtype = DType::F32) {
  std::vector<double> out(static_cast<std::size_t>(spec.num_layers()));
  for (int l = 0; l < spec.num_layers(); ++l)
    out[static_cast<std::size_t>(l)] =
        stage_parameters(spec, {0, l, l + 1}, spec.config().shared_classifier).bytes(dtype);
  return out;
}

/// What one rank holds at its peak, in bytes, by part. Parts that do not apply are 0 (no
/// gradients in inference, no KV cache in training).
struct MemoryBreakdown {
  int rank = 0;                  ///< the pipeline rank, in [0, ranks)
  double weights = 0.0;          ///< the parameters of its virtual stages, at the weight dtype
  double gradients = 0.0;        ///< training: one float32 per parameter (TrainStage's grads)
  double optimizer_state = 0.0;  ///< training: the optimizer's moments per parameter (AdamW: 2)
  /// Training: the simulator's peak (sim::SimResult::peak_memory_bytes: stashes, received copies,
  /// outputs and input gradients waiting to be sent, the receive and send windows' buffers).
  /// Inference: each micro-batch's payload held between rounds and the send window's copies.
  double activations = 0.0;
  double kv_cache = 0.0;         ///< inference: K and V rows reserved for every sequence
  /// Inference: the receive window's buffers. Training: the part of the tied embedding's
  /// gradient exchange above `activations` (the exchange runs after the step's program, when
  /// the stashes and windows are freed, so only its excess raises the peak); the windows'
  /// buffers of the program are in `activations`, as the simulator counts them.
  double receive_buffers = 0.0;
  double workspace = 0.0;        ///< kernel scratch of its stages (largest micro-batch)

  /// Sum of the parts, bytes.
  [[nodiscard]] double total() const noexcept {
    return weights + gradients + optimizer_state + activations + kv_cache + receive_buffers +
           workspace;
  }
  /// The `n` largest non-zero parts, largest first, as "KV cache 268435456 bytes, weights
  /// 87556096 bytes, ...".
  [[nodiscard]] std::string largest_parts(int n = 3) const {
    std::array<std::pair<double, std::string_view>, 7> parts{{{weights, "weights"},
                                                              {gradients, "gradients"},
                                                              {optimizer_state, "optimizer state"},
                                                              {activations, "activations"},
                                                              {kv_cache, "KV cache"},
                                                              {receive_buffers, "receive buffers"},
                                                              {workspace, "workspace"}}};
    std::stable_sort(parts.begin(), parts.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    std::string out;
    const auto shown = static_cast<std::size_t>(std::clamp(n, 0, static_cast<int>(parts.size())));
    for (std::size_t i = 0; i < shown && parts[i].first > 0.0; ++i)
      out += fmt::format("{}{} {:.0f} bytes", out.empty() ? "" : ", ", parts[i].second,
                         parts[i].first);
    return out;
  }
};

/// What a training run keeps besides what the plan says.
struct TrainingMemoryOptions {
  /// Float32 moment buffers the optimizer allocates per parameter: 2 for engine::AdamW (m and
  /// v, what TrainingEngine and DistributedTrainer build), 1 for SGD with momentum, 0 for plain
  /// SGD. >= 0.
  int optimizer_moments = 2;
  /// Float32 vocab x dim copies of the tied embedding's gradient each of the two ranks holds
  /// while exchanging it, when the classifier is shared and the first and last virtual stages
  /// sit on different ranks (engine::DistributedTrainer): 2 over InProcessTransport (the
  /// received gradient and the transport's copy of the sent one, made at isend), 1 over a
  /// transport that sends from the caller's buffer (MpiTransport), 0 for TrainingEngine (it
  /// sums the two stages' gradients in place). >= 0.
  int tied_gradient_copies = 2;
  /// The micro-batch every micro-batch is taken to be when the plan carries no work
  /// (Plan::work() empty); a plan built with engine::microbatch_work is exact.
  Workload workload{};
};

/// Per-rank memory of a training plan (engine::TrainingEngine / DistributedTrainer on the CPU
/// stages, float32):
/// - weights and gradients: float32 copies of each virtual stage's parameters
///   (runtime::TrainStage); a shared classifier is copied on the tail stage unless it also holds
///   the embedding (the tied pair of Megatron's embedding group);
/// - optimizer state: `optimizer_moments` float32 per parameter;
/// - activations: sim::simulate(plan, RooflineCostModel(spec, plan)).peak_memory_bytes[rank]:
///   cost::training_stash per (virtual stage, micro-batch) plus messages and windows, the figure
///   engine::execute measures (ExecutorStats::peak_memory_bytes);
/// - receive buffers: on the ranks of the first and the last virtual stage of a shared
///   classifier, tied_gradient_copies x vocab x dim floats less `activations` (at least 0): the
///   tied gradient's exchange after the program;
/// - workspace: cpu::DecoderTrainScratch of each virtual stage with decoders, n (hidden + dim)
///   floats for its largest micro-batch of n tokens.
/// Not counted: the caller's initial weights (LlamaWeights), timelines, memory the BLAS library
/// allocates itself.
/// @return one breakdown per rank, rank order
/// @throws brigade::Error{InvalidArgument} for an inference plan, optimizer_moments < 0; as
///         RooflineCostModel and sim::simulate
inline std::vector<MemoryBreakdown> training_memory(const model::ModelSpec& spec,
                                                    const plan::Plan& plan,
                                                    const TrainingMemoryOptions& options = {}) {
  const auto& sh = plan.shape();
  BRIGADE_CHECK(sh.mode == schedule::Mode::Training, Errc::InvalidArgument,
                "training_memory: the plan is an inference plan");
  BRIGADE_CHECK(options.optimizer_moments >= 0 && options.tied_gradient_copies >= 0,
                Errc::InvalidArgument,
                "training_memory: optimizer_moments = {}, tied_gradient_copies = {}, expected "
                "both >= 0",
                options.optimizer_moments, options.tied_gradient_copies);
  RooflineOptions ro;
  ro.workload = options.workload;
  const RooflineCostModel sizes(spec, plan, ro);
  sim::SimOptions so;
  so.record_timeline = false;
  const sim::SimResult sim = sim::simulate(plan, sizes, so);
  std::int64_t max_tokens = 0;
  for (int m = 0; m < sh.num_microbatches; ++m)
    max_tokens = std::max(max_tokens, sizes.work(m, 0).tokens);
  const auto& c = spec.config();
  std::vector<MemoryBreakdown> out(static_cast<std::size_t>(sh.num_ranks));
  for (int r = 0; r < sh.num_ranks; ++r) out[static_cast<std::size_t>(r)].rank = r;
  for (int v = 0; v < sh.num_virtual_stages; ++v) {
    const auto& st = plan.partition().stage(v);
    auto& b = out[static_cast<std::size_t>(st.rank)];
    const bool tied = c.shared_classifier && st.first == 0;
    const double n = static_cast<double>(stage_parameters(spec, st, tied).total());
    b.weights += 4.0 * n;
    b.gradients += 4.0 * n;
    b.optimizer_state += 4.0 * options.optimizer_moments * n;
    bool decoders = false;
    for (int l = st.first; l < st.last; ++l)
      decoders = decoders || spec.layer(l).kind == model::LayerKind::Decoder;
    if (decoders)
      b.workspace += 4.0 * static_cast<double>(max_tokens) * (c.hidden_dim + c.dim);
  }
  const int first = sh.rank_of(0), last = sh.rank_of(sh.num_virtual_stages - 1);
  const double exchange = c.shared_classifier && first != last
                              ? 4.0 * options.tied_gradient_copies *
                                    static_cast<double>(c.vocab_size) * c.dim
                              : 0.0;
  for (int r = 0; r < sh.num_ranks; ++r) {
    auto& b = out[static_cast<std::size_t>(r)];
    b.activations = sim.peak_memory_bytes[static_cast<std::size_t>(r)];
    if (r == first || r == last) b.receive_buffers = std::max(0.0, exchange - b.activations);
  }
  return out;
}

/// What an inference run keeps besides what the plan says.
struct InferenceMemoryOptions {
  /// Bytes of each ModelSpec layer's weights as held (spec.num_layers() entries):
  /// model::layer_weight_bytes of a loaded model (its matrices in the dtypes the file or
  /// model::convert_weights gave them), or layer_weight_bytes(spec, dtype) for a prediction.
  /// Empty: float32 (layer_weight_bytes(spec)).
  std::vector<double> layer_weight_bytes;
  /// KV positions reserved per sequence (runtime::InferenceStage's capacities: a request's
  /// effective steps, prompt included; engine::detail::GenerationLayout::capacities), one entry
  /// per sequence, each >= 1.
  std::vector<int> kv_positions;
};

/// Per-rank memory of an inference plan (engine::inference_plan: round 0 of micro-batch m is its
/// prefill, Plan::work()[m] = {prompt tokens, sequences, ...}), as runtime::InferenceStage and
/// engine::InferenceWorker allocate it (float32 activations and KV cache). Weights and KV cache
/// are exact; the small parts (receive buffers, activations, workspace) are the sizes the worker
/// and the kernels ask for at the largest micro-batch, not a replay of every buffer's capacity:
/// - weights: the distinct tensors of the rank's virtual stages, options.layer_weight_bytes of
///   their layers (the shared classifier, the embedding's bytes, once per rank);
/// - KV cache: per decoder layer on the rank, K and V rows of kv_dim floats for every reserved
///   position: 2 x layers x kv_dim x sum(kv_positions) x 4 bytes;
/// - receive buffers: the receive window's slots (recv_window of them, at most one per RECV of
///   the rank's program), each sized for the largest message of the rank's receives (a
///   micro-batch's descriptor, 3 int32 per sequence + 3, and its prefill rows x max(dim, vocab)
///   floats; on virtual stage 0 the sampled tokens, 3 int32 per sequence);
/// - activations: per micro-batch, its payload held on the rank between rounds (prefill rows x
///   dim floats, and sequences x vocab floats of logits on the rank with the LM head), and the
///   send window's copies (send_window slots, each the largest message the rank sends);
/// - workspace: per virtual stage with decoders, cpu::DecoderScratch for the largest prefill of
///   n rows (n (2 dim + 2 kv_dim + 2 hidden) floats) and, with the LM head, sequences x vocab
///   floats of logits scratch.
/// @return one breakdown per rank, rank order
/// @throws brigade::Error{InvalidArgument} for a training plan, a plan without work, a
///         kv_positions entry < 1 or above the model's seq_len, or layer_weight_bytes neither
///         empty nor spec.num_layers() long
inline std::vector<MemoryBreakdown> inference_memory(const model::ModelSpec& spec,
                                                     const plan::Plan& plan,
                                                     const InferenceMemoryOptions& options) {
  const auto& sh = plan.shape();
  const auto& c = spec.config();
  BRIGADE_CHECK(sh.mode == schedule::Mode::Inference, Errc::InvalidArgument,
                "inference_memory: the plan is a training plan");
  BRIGADE_CHECK(static_cast<int>(plan.work().size()) == sh.num_microbatches, Errc::InvalidArgument,
                "inference_memory: the plan carries no prefill work (engine::inference_plan "
                "gives each micro-batch's)");
  double positions = 0.0;
  for (std::size_t i = 0; i < options.kv_positions.size(); ++i) {
    const int p = options.kv_positions[i];
    BRIGADE_CHECK(p >= 1 && p <= c.seq_len, Errc::InvalidArgument,
                  "inference_memory: sequence {} reserves {} KV positions, expected [1, {}]", i,
                  p, c.seq_len);
    positions += p;
  }
  const std::vector<double> layer_bytes = options.layer_weight_bytes.empty()
                                              ? layer_weight_bytes(spec)
                                              : options.layer_weight_bytes;
  BRIGADE_CHECK(static_cast<int>(layer_bytes.size()) == spec.num_layers(), Errc::InvalidArgument,
                "inference_memory: layer_weight_bytes has {} entries, the model {} layers",
                layer_bytes.size(), spec.num_layers());
  const double f32 = 4.0, d = c.dim, kv = c.kv_dim(), h = c.hidden_dim, V = c.vocab_size;
  const double width = std::max(d, V);
  const auto work = plan.work();
  double max_rows = 0.0, max_seqs = 0.0;
  for (const auto& w : work) {
    max_rows = std::max(max_rows, static_cast<double>(w.tokens));
    max_seqs = std::max(max_seqs, static_cast<double>(w.sequences));
  }
  const int N = sh.num_virtual_stages;
  std::vector<MemoryBreakdown> out(static_cast<std::size_t>(sh.num_ranks));
  for (int r = 0; r < sh.num_ranks; ++r) {
    auto& b = out[static_cast<std::size_t>(r)];
    b.rank = r;
    bool embedding = false, head = false;
    double largest_recv = 0.0, largest_send = 0.0;
    std::size_t recvs = 0;
    for (int v = 0; v < N; ++v) {
      const auto& st = plan.partition().stage(v);
      if (st.rank != r) continue;
      bool decoders = false, stage_head = false, sampler = false;
      for (int l = st.first; l < st.last; ++l) {
        b.weights += layer_bytes[static_cast<std::size_t>(l)];
        const auto kind = spec.layer(l).kind;
        decoders = decoders || kind == model::LayerKind::Decoder;
        stage_head = stage_head || kind == model::LayerKind::LMHead;
        sampler = sampler || kind == model::LayerKind::Sampler;
        if (kind == model::LayerKind::Decoder) b.kv_cache += 2.0 * kv * positions * f32;
      }
      embedding = embedding || st.first == 0;
      head = head || stage_head;
      if (decoders) b.workspace += max_rows * (2 * d + 2 * kv + 2 * h) * f32;
      if (stage_head) b.workspace += max_seqs * V * f32;
      for (const auto& w : work) {
        const double seqs = static_cast<double>(w.sequences);
        if (v == 0) {
          largest_recv = std::max(largest_recv, 3.0 * std::max(seqs, 1.0) * 4.0);
        } else {
          largest_recv = std::max(largest_recv,
                                  3.0 * (seqs + 1) * 4.0 + static_cast<double>(w.tokens) * width * f32);
        }
        // What it sends on: tokens from the sampler, logits after the LM head, else the stream.
        const double payload = sampler ? 3.0 * seqs * 4.0
                               : stage_head ? seqs * V * f32
                                            : static_cast<double>(w.tokens) * d * f32;
        largest_send = std::max(largest_send, 3.0 * (seqs + 1) * 4.0 + payload);
      }
    }
    const auto& prog = plan.schedule().ranks[static_cast<std::size_t>(r)];
    std::size_t sends = 0;
    for (const auto& a : prog) {
      recvs += a.op == schedule::Op::RecvF ? 1 : 0;
      sends += a.op == schedule::Op::SendF ? 1 : 0;
    }
    const auto windows = plan.execution().windows;
    b.receive_buffers =
        static_cast<double>(std::min<std::size_t>(recvs, static_cast<std::size_t>(windows.recv_window))) *
        largest_recv;
    b.activations =
        static_cast<double>(std::min<std::size_t>(sends, static_cast<std::size_t>(windows.send_window))) *
        largest_send;
    for (const auto& w : work) {
      b.activations += static_cast<double>(w.tokens) * d * f32;
      if (head) b.activations += static_cast<double>(w.sequences) * V * f32;
    }
    // A shared classifier is the embedding table: once per rank that holds the LM head.
    if (head && c.shared_classifier && !embedding) b.weights += layer_bytes[0];
  }
  return out;
}

/// Checks every rank of `ranks` against its device: `devices` holds one profile for all ranks
/// or one per rank (rank order).
/// @param who names the plan in the message ("training_plan", "brigade generate")
/// @throws brigade::Error{InvalidArgument} "<who>: rank r (KV cache X bytes, weights Y bytes,
///         activations Z bytes): T bytes do not fit in <device>'s C bytes of memory" (the three
///         largest parts, DeviceProfile::check_fits) for the first rank over capacity; if
///         `devices` is empty or neither 1 nor ranks.size() long
inline void check_capacity(std::span<const MemoryBreakdown> ranks,
                           std::span<const DeviceProfile> devices, std::string_view who) {
  BRIGADE_CHECK(devices.size() == 1 || devices.size() == ranks.size(), Errc::InvalidArgument,
                "{}: {} device profiles for {} ranks, expected 1 or {}", who, devices.size(),
                ranks.size(), ranks.size());
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const auto& dev = devices.size() == 1 ? devices[0] : devices[i];
    dev.check_fits(ranks[i].total(),
                   fmt::format("{}: rank {} ({})", who, ranks[i].rank, ranks[i].largest_parts()));
  }
}

/// What ranks hold together when they run as threads of one process (engine::generate,
/// engine::TrainingEngine): their parts summed, rank -1. With `shared_weights` >= 0 those bytes
/// replace the sum of the ranks' weights: engine::generate's ranks read the caller's one copy
/// of the model (model_weight_bytes), where each rank of its own process holds its own share
/// (TrainingEngine's stages copy theirs: leave it negative).
inline MemoryBreakdown one_process(std::span<const MemoryBreakdown> ranks,
                                   double shared_weights = -1.0) {
  MemoryBreakdown all;
  all.rank = -1;
  for (const auto& b : ranks) {
    all.weights += b.weights;
    all.gradients += b.gradients;
    all.optimizer_state += b.optimizer_state;
    all.activations += b.activations;
    all.kv_cache += b.kv_cache;
    all.receive_buffers += b.receive_buffers;
    all.workspace += b.workspace;
  }
  if (shared_weights >= 0.0) all.weights = shared_weights;
  return all;
}

/// Checks ranks that run as threads of one process on one device: one_process(ranks,
/// shared_weights) against device.memory_capacity_bytes.
/// @throws brigade::Error{InvalidArgument} "<who>: N ranks as threads of one process (<largest
///         parts>): T bytes do not fit in <device>'s C bytes of memory"
inline void check_one_process(std::span<const MemoryBreakdown> ranks, const DeviceProfile& device,
                              std::string_view who, double shared_weights = -1.0) {
  const MemoryBreakdown all = one_process(ranks, shared_weights);
  device.check_fits(all.total(), fmt::format("{}: {} ranks as threads of one process ({})", who,
                                             ranks.size(), all.largest_parts()));
}

/// Checks that a device can hold the whole model's weights, `weight_bytes` (model_weight_bytes
/// of a spec, or model::weight_bytes of a loaded model), stored as `held_as` ("f32", "f16",
/// "as loaded"; for the message). A profile that cannot is of no use for the model, whatever
/// the split.
/// @throws brigade::Error{InvalidArgument} "profile <name>: memory_capacity_bytes = C is smaller
///         than the model's weights (W bytes, <held_as>)"
inline void check_holds_weights(const DeviceProfile& device, double weight_bytes,
                                std::string_view held_as = "f32") {
  BRIGADE_CHECK(device.memory_capacity_bytes >= weight_bytes, Errc::InvalidArgument,
                "profile {}: memory_capacity_bytes = {:.0f} is smaller than the model's weights "
                "({:.0f} bytes, {})",
                device.name, device.memory_capacity_bytes, weight_bytes, held_as);
}

}  // namespace v0
}  // namespace brigade::cost
