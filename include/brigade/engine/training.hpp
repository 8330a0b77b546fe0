// Pipeline training: one executor that runs any lowered Schedule over TrainStages and a
// Transport, and the TrainingEngine around it (micro-batches, loss, AdamW, checkpoints).
#pragma once

#include "brigade/core/timeline.hpp"
#include "brigade/cost/cost_model.hpp"
#include "brigade/cost/memory.hpp"
#include "brigade/cost/profile.hpp"
#include "brigade/data/corpus.hpp"
#include "brigade/engine/executor.hpp"
#include "brigade/engine/optimizer.hpp"
#include "brigade/engine/threads.hpp"
#include "brigade/model/weights.hpp"
#include "brigade/partition/partition.hpp"
#include "brigade/plan/plan.hpp"
#include "brigade/runtime/train_stage.hpp"
#include "brigade/schedule/action.hpp"
#include "brigade/schedule/dataflow.hpp"
#include "brigade/transport/transport.hpp"

#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace brigade::engine {
inline namespace v0 {

/// One rank's record of the micro-batches of a step that an integrity check flagged
/// (transport::kFlagDropped, set by VerifyingTransport's "drop" policy on the receiving rank and
/// carried by every later message of the micro-batch), for the step's agreement
/// (detail::decide_drops).
struct MicrobatchDrops {
  std::vector<char> dropped;  ///< [M] 1: this rank received a message of the micro-batch flagged
  /// [M] 1: this rank added the micro-batch's weight gradients (its BW ran before any flag
  /// reached this rank): dropping it then needs the whole update skipped
  std::vector<char> applied;
};

/// The training side of the executor (engine::execute): one rank's TrainStages for one step.
///
/// F of the first virtual stage reads the micro-batch's token ids; F of another reads the
/// received activations (RECV_F) or, when the previous virtual stage is on this rank, its local
/// output. B is BI then BW. RECOMPUTE rebuilds a stage's activations from its stashed input: an
/// F whose (virtual stage, micro-batch) has a RECOMPUTE later in the program keeps only its
/// input. OPT and SAMPLE do nothing here (the engine steps the optimizer after the step).
/// PREFETCH and RELEASE are refused (Error{InvalidArgument}): the stages own and update their
/// weights.
/// Received activations and gradients are held per (virtual stage, micro-batch) from their RECV
/// until the F or BI that consumes them; a stage's output (input gradient) is released by its
/// SEND, or by the next virtual stage's F (BI) when that stage is on this rank.
///
/// Dropped micro-batches (SENTINEL's "drop" policy, docs/integrity.md): a received message whose
/// header carries transport::kFlagDropped marks its micro-batch dropped on this rank; its payload
/// is replaced by zeros (so the rest of the micro-batch's work stays finite whatever the corrupted
/// bytes were), every later message of the micro-batch this rank sends carries the flag, and its
/// BW frees the stash without adding weight gradients (TrainStage::skip_backward_weight). The
/// schedule itself runs unchanged, so no rank waits on a message that is not sent.
class TrainingWorker {
 public:
  /// @param program   the rank's lowered actions (read once, for the RECOMPUTE set)
  /// @param shape     the schedule's shape
  /// @param stages    stages[v] is virtual stage v's TrainStage (non-null for those on this rank)
  /// @param batches   the step's micro-batches
  /// @param grad_denominator the step's real targets (detail::step_targets: the loss is their mean)
  /// @param dim       the model width (columns of every message)
  /// @param pipeline_dtype the dtype of activations and gradients between stages
  ///        (TrainingOptions::pipeline_dtype)
  /// @throws brigade::Error{InvalidArgument} for an inference shape or one with chunks > 1
  ///         (chunked training, PACS, is simulated but not executed yet), or a pipeline dtype
  ///         other than f32, f16, bf16
  TrainingWorker(std::span<const schedule::Action> program, const schedule::Shape& shape, int rank,
                 std::span<runtime::TrainStageBase* const> stages,
                 std::span<const data::PackedBatch> batches, double grad_denominator, int dim,
                 DType pipeline_dtype = DType::F32)
      : shape_(&shape), rank_(rank), stages_(stages), batches_(batches),
        denominator_(grad_denominator), dim_(dim), pipeline_dtype_(pipeline_dtype) {
    BRIGADE_CHECK(is_float_dtype(pipeline_dtype), Errc::InvalidArgument,
                  "executor: pipeline dtype {}; expected f32, f16 or bf16",
                  to_string(pipeline_dtype));
    BRIGADE_CHECK(shape.mode == schedule::Mode::Training && shape.num_chunks == 1,
                  Errc::InvalidArgument,
                  "executor: a schedule in {} mode with {} chunk(s) per micro-batch; the "
                  "training worker runs training schedules of 1 chunk only",
                  schedule::to_string(shape.mode), shape.num_chunks);
    const auto keys = static_cast<std::size_t>(shape.num_virtual_stages) *
                      static_cast<std::size_t>(shape.num_microbatches);
    recomputed_.assign(keys, 0);
    drops_.dropped.assign(static_cast<std::size_t>(shape.num_microbatches), 0);
    drops_.applied.assign(static_cast<std::size_t>(shape.num_microbatches), 0);
    in_f_.resize(keys);
    in_b_.resize(keys);
    for (const auto& a : program)
      if (a.op == schedule::Op::Recompute) recomputed_[key(a.virtual_stage, a.microbatch)] = 1;
  }

  Work compute(const schedule::Action& a) {
    using schedule::Op;
    const int v = a.virtual_stage, mb = a.microbatch;
    switch (a.op) {
      case Op::F: {
        const bool keep = !recomputed_[key(v, mb)];
        auto& in = in_f_[key(v, mb)];
        const bool local = v > 0 && in.empty();
        const float* x = v == 0 ? nullptr : local ? local_output(v, mb) : in.data();
        stage(v).forward(mb, batch(mb), x, denominator_, keep);
        if (local) stage(v - 1).release_output(mb);
        else release(in);
        break;
      }
      case Op::Recompute:
        stage(v).recompute(mb);
        break;
      case Op::B:
        backward_input(v, mb);
        backward_weight(v, mb);
        break;
      case Op::BI:
        backward_input(v, mb);
        break;
      case Op::BW:
        backward_weight(v, mb);
        break;
      case Op::Prefetch:
      case Op::Release:
        ::brigade::detail::fail(Errc::InvalidArgument,
                                "executor: rank {}: {}: the training worker's stages own their "
                                "weights and update them in place, so it cannot release or "
                                "prefetch them (schedule::validate refuses weight ops in training)",
                                rank_, schedule::to_string(a));
      default:
        return {false, 0, {}};
    }
    return {true, batch(mb).rows(), {}};
  }

  void recv_messages(const schedule::Action& a, std::vector<MessageSpec>& out) {
    const std::int64_t rows = batch(a.microbatch).rows();
    const bool fwd = a.op == schedule::Op::RecvF;
    out.push_back({fwd ? kTagActivation : kTagGradient,
                   transport::MessageHeader::make(
                       a.microbatch, a.virtual_stage, pipeline_dtype_, {rows, dim_}, 0,
                       fwd ? transport::MessageKind::Activation : transport::MessageKind::Gradient),
                   dtype_bytes(pipeline_dtype_, rows * dim_)});
  }

  void received(const schedule::Action& a, std::span<const Received> msgs) {
    auto& dst = (a.op == schedule::Op::RecvF ? in_f_ : in_b_)[key(a.virtual_stage, a.microbatch)];
    const auto& p = msgs[0].payload;
    const std::int64_t n = msgs[0].header.numel();
    release(dst);
    dst.resize(static_cast<std::size_t>(n));
    copies_bytes_ += dst.capacity() * sizeof(float);
    if ((msgs[0].header.flags & transport::kFlagDropped) != 0) {
      drops_.dropped[static_cast<std::size_t>(a.microbatch)] = 1;
      std::fill(dst.begin(), dst.end(), 0.0f);
    } else {
      convert_to_f32(p.data(), msgs[0].header.dtype, dst.data(), n);
    }
  }

  /// The micro-batches this rank saw flagged, and those whose weight gradients it added.
  [[nodiscard]] const MicrobatchDrops& drops() const noexcept { return drops_; }

  /// Bytes held right now: the received copies plus every stage's TrainStage::held_bytes()
  /// (O(virtual stages)); what ExecutorStats::peak_memory_bytes adds to the windows.
  [[nodiscard]] std::size_t held_bytes() const noexcept {
    std::size_t b = copies_bytes_;
    for (const runtime::TrainStageBase* st : stages_)
      if (st != nullptr) b += st->held_bytes();
    return b;
  }

  void send(const schedule::Action& a, Outbox& out) {
    const bool fwd = a.op == schedule::Op::SendF;
    const int v = a.virtual_stage, mb = a.microbatch;
    auto src = fwd ? stage(v).output(mb) : stage(v).grad_input(mb);
    const auto peer = schedule::counterpart(*shape_, a);
    auto header = transport::MessageHeader::make(
        mb, peer->virtual_stage, pipeline_dtype_, {batch(mb).rows(), dim_}, 0,
        fwd ? transport::MessageKind::Activation : transport::MessageKind::Gradient);
    if (drops_.dropped[static_cast<std::size_t>(mb)] != 0) header.flags |= transport::kFlagDropped;
    if (pipeline_dtype_ == DType::F32) {
      out.add(fwd ? kTagActivation : kTagGradient, header, transport::as_bytes(src));
    } else {
      const auto n = static_cast<std::int64_t>(src.size());
      const auto wire = out.stage(dtype_bytes(pipeline_dtype_, n));  // converted in place
      convert_from_f32(src.data(), wire.data(), pipeline_dtype_, n);
      out.add(fwd ? kTagActivation : kTagGradient, header,
              transport::ConstBytes(wire.data(), wire.size()));
    }
    if (fwd)
      stage(v).release_output(mb);
    else
      stage(v).release_grad_input(mb);
  }

  /// Message tags of the training protocol.
  static constexpr int kTagActivation = 11;  ///< SEND_F -> RECV_F: [rows, dim], pipeline dtype
  static constexpr int kTagGradient = 12;    ///< SEND_B -> RECV_B: [rows, dim], pipeline dtype

 private:
  [[nodiscard]] std::size_t key(int v, int mb) const noexcept {
    return static_cast<std::size_t>(v) * static_cast<std::size_t>(shape_->num_microbatches) +
           static_cast<std::size_t>(mb);
  }
  runtime::TrainStageBase& stage(int v) const {
    BRIGADE_CHECK(v >= 0 && v < static_cast<int>(stages_.size()) &&
                      stages_[static_cast<std::size_t>(v)],
                  Errc::InvalidArgument, "executor: rank {} has no stage for virtual stage {}",
                  rank_, v);
    return *stages_[static_cast<std::size_t>(v)];
  }
  const data::PackedBatch& batch(int mb) const {
    BRIGADE_CHECK(mb >= 0 && mb < static_cast<int>(batches_.size()), Errc::InvalidArgument,
                  "executor: micro-batch {} outside the step's {} micro-batches", mb,
                  batches_.size());
    return batches_[static_cast<std::size_t>(mb)];
  }
  const float* local_output(int v, int mb) const {
    BRIGADE_CHECK(shape_->rank_of(v - 1) == rank_, Errc::Internal,
                  "executor: rank {}: F({}, {}) before its RECV_F", rank_, v, mb);
    return stage(v - 1).output(mb).data();
  }
  void backward_input(int v, int mb) {
    const bool tail = v == shape_->num_virtual_stages - 1;
    auto& in = in_b_[key(v, mb)];
    const float* dy = nullptr;
    if (!tail) {
      if (!in.empty()) {
        dy = in.data();
      } else {
        BRIGADE_CHECK(shape_->rank_of(v + 1) == rank_, Errc::Internal,
                      "executor: rank {}: backward({}, {}) before its RECV_B", rank_, v, mb);
        dy = stage(v + 1).grad_input(mb).data();
      }
    }
    stage(v).backward_input(mb, dy);
    if (!in.empty()) release(in);
    else if (!tail) stage(v + 1).release_grad_input(mb);
  }
  void backward_weight(int v, int mb) {
    const auto m = static_cast<std::size_t>(mb);
    if (drops_.dropped[m] != 0) {
      stage(v).skip_backward_weight(mb);
    } else {
      stage(v).backward_weight(mb);
      drops_.applied[m] = 1;
    }
  }
  void release(std::vector<float>& v) noexcept {
    copies_bytes_ -= v.capacity() * sizeof(float);
    std::vector<float>().swap(v);
  }

  const schedule::Shape* shape_;
  int rank_;
  std::span<runtime::TrainStageBase* const> stages_;
  std::span<const data::PackedBatch> batches_;
  double denominator_;
  int dim_;
  std::vector<char> recomputed_;
  MicrobatchDrops drops_;
  std::vector<std::vector<float>> in_f_, in_b_;  // received, per (virtual stage, micro-batch)
  std::size_t copies_bytes_ = 0;                 // capacities of in_f_ and in_b_
  DType pipeline_dtype_ = DType::F32;
};

/// Runs one rank's lowered program for one training step: engine::execute over a
/// TrainingWorker. The executor is the same for every generator (GPipe, 1F1B, interleaved,
/// ZB-H1, hand-written) and for inference; see execute() for the receive and send windows.
///
/// @param program   rank `rank`'s lowered actions
/// @param shape     the schedule's shape (placement: virtual stage -> rank)
/// @param stages    stages[v] is virtual stage v's TrainStage (non-null for those on this rank)
/// @param batches   the step's micro-batches (every rank sees all of them)
/// @param grad_denominator the step's real targets (detail::step_targets: the loss is their mean)
/// @param timeline  receives one interval per compute action, RECV wait and SEND, rank = `rank`
/// @param drops     when given, receives the micro-batches this rank saw flagged (TrainingWorker)
/// @param pipeline_dtype activations' and gradients' dtype between stages (TrainingWorker)
/// Ends with every stage's TrainStage::download_gradients (the step's gradients on the host).
/// @return the rank's peak memory (ExecutorStats; the stages should hold nothing at the start,
///         as after TrainStage::zero_grad)
/// @throws brigade::Error from the stages or the transport (PeerTimeout, HeaderMismatch, Aborted)
template <transport::Transport T>
ExecutorStats run_training_program(std::span<const schedule::Action> program, const schedule::Shape& shape,
                          int rank, std::span<runtime::TrainStageBase* const> stages,
                          std::span<const data::PackedBatch> batches, double grad_denominator,
                          T& transport, std::chrono::steady_clock::time_point t0,
                          double timeout_s, Timeline& timeline, int dim,
                          ExecutorWindows windows = {}, MicrobatchDrops* drops = nullptr,
                          DType pipeline_dtype = DType::F32) {
  TrainingWorker worker(program, shape, rank, stages, batches, grad_denominator, dim,
                        pipeline_dtype);
  FixedProgram source(program);
  const auto stats = execute(source, worker, transport,
                             ExecutorRun{&shape, rank, t0, timeout_s, windows}, timeline);
  // The step's gradients where the optimizer and the reductions read them (a device backend's
  // download: TrainStage::download_gradients).
  for (runtime::TrainStageBase* st : stages)
    if (st != nullptr) st->download_gradients();
  if (drops != nullptr) *drops = worker.drops();
  return stats;
}

/// How a training engine runs a plan: the optimizer, the wait limit and intra-op threads.
struct TrainingOptions {
  AdamWConfig optimizer;     ///< AdamW and its learning-rate schedule
  double timeout_s = 120.0;  ///< a rank waiting longer on a peer fails (PeerTimeout)
  int threads_per_rank = 1;  ///< intra-op GEMM threads of each rank (cpu::set_blas_threads)
  /// Element type of the activations and activation gradients sent between stages
  /// (Megatron-LM's `pipeline_dtype`): F32 (exact), or F16 / BF16, which halve the bytes on every
  /// link; each received tensor is rounded to nearest even once, the compute, the loss and the
  /// parameter gradients stay float32. F16's range ends at 65504: a larger activation or gradient
  /// arrives as infinity and stops the step (Error{NonFinite}).
  DType pipeline_dtype = DType::F32;
  /// Makes each virtual stage (its backend): empty for TrainStage<cpu::CpuBackend>;
  /// runtime::train_stages_on(f) for stages on the backends f(v) gives, e.g. cuda::CudaBackend
  /// (docs/cuda.md: parameters and gradients mirrored on the GPU, AdamW on the host).
  runtime::TrainStageFactory stages;
  /// Tensor-parallel degree t of every stage (Megatron-LM, Shoeybi et al. 2019, §3; the split of
  /// runtime::TrainStage): TrainingEngine runs t pipelines of P ranks, one thread each (t x P
  /// threads; global rank p t + i is TP rank i of pipeline rank p, tp::Grid's order), the t
  /// stages of one virtual stage joined by one in-process group per pipeline rank. A
  /// DistributedTrainer's degree is its TrainingGroups::tp group's size, which this must equal.
  /// The model must divide it (tp::check_tensor_parallel_training); host-memory backends only.
  int tp = 1;
};

/// A training run by names: the plan to build (training_plan()) and how to run it.
struct TrainingConfig : TrainingOptions {
  /// A training generator: gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v, dualpipe-v, or one added
  /// by schedule::register_generator.
  std::string schedule = "1f1b";
  int ranks = 1;           ///< P: pipeline ranks (threads)
  int virtual_stages = 1;  ///< V: virtual stages per rank (2 for zb-v and dualpipe-v)
  int microbatches = 1;    ///< M: micro-batches per step
  /// How layers are split over the P x V virtual stages: a partition policy
  /// (partition::policies(): "balanced", "uniform", or one added by partition::register_policy).
  std::string partition = "balanced";
  int seq_len_hint = 256;  ///< typical sequence length, for the balanced split's attention cost
  /// Seconds of a layer per work item and phase, what the balanced split prices the forward and
  /// both backward passes with: the roofline at default rates unless set (cost::ProfiledLayerTimes
  /// on a device profile is the calibrated split). Every process of a distributed run must be
  /// given the same times, so that they agree on the split.
  model::LayerSeconds layer_seconds = model::roofline_layer_seconds();
  /// The devices the ranks run on: empty (no capacity check), one profile for every rank, or one
  /// per rank. training_plan() refuses a plan whose rank does not fit (cost::training_memory
  /// with AdamW's two moments, micro-batches of one seq_len_hint-token sequence).
  std::vector<cost::DeviceProfile> devices;
};

/// The plan of a training run named by `config`: the generator's schedule, the split by the
/// policy config.partition (balanced for one `seq_len_hint`-token sequence per micro-batch, the
/// LM head priced for every token and kept with the final norm and loss on the last stage), and
/// the lowered, validated program of every rank. Identical inputs give identical plans, so every
/// process of a distributed run agrees on the split.
/// With config.devices, each device must hold the model's weights (cost::check_holds_weights)
/// and each rank's memory (cost::training_memory) must fit its device (cost::check_capacity).
/// @throws brigade::Error{InvalidArgument} for an unknown generator or policy, an inference
///         schedule, seq_len_hint < 1, more virtual stages than decoder
///         layers, or a configuration the generator rejects; a device whose
///         memory_capacity_bytes is below the model's weights (naming the field), or a rank over
///         its device's capacity ("training_plan: rank r (<largest parts>): B bytes do not fit
///         in <device>'s C bytes of memory"); devices neither 1 nor ranks long
plan::Plan training_plan(const model::LlamaConfig& model, const TrainingConfig& config);

/// What one step did.
struct StepResult {
  double loss = 0.0;             ///< mean cross-entropy over the step's real targets (nats)
  std::int64_t tokens = 0;       ///< real (non-pad, target != -1) targets in the step
  /// Per task (index = data::Sample::task, up to the step's largest task id): the summed loss
  /// (nats) and counted real targets of the kept micro-batches' rows of that task (count 0 for
  /// a task the step lacks); task_loss[t].mean() is task t's mean loss, and the counts add up
  /// to `tokens`, the sums to `loss` x `tokens` (to rounding). Empty when the batches carry no
  /// tasks (data::PackedBatch::tasks) or the backend reports no per-row losses.
  std::vector<cpu::CrossEntropyLoss> task_loss;
  double seconds = 0.0;          ///< wall time of forward + backward (+ optimizer)
  double lr = 0.0;               ///< learning rate used (0 when no optimizer step was taken)
  double grad_norm = 0.0;        ///< global gradient norm before clipping
  /// Micro-batches dropped this step (an integrity check flagged one of their messages, the
  /// "drop" policy): their loss and weight gradients are left out on every rank, the others'
  /// gradients rescaled to the mean over the rows kept; `loss` and `tokens` count the kept ones.
  std::vector<int> dropped_microbatches;
  /// True when the step's update is skipped on every rank: every micro-batch was dropped, or a
  /// rank had already added a dropped micro-batch's weight gradients when the flag was raised
  /// (a gradient flagged upstream of it). optimizer_step() then takes no step.
  bool update_skipped = false;
  Timeline timeline{1};          ///< measured intervals, one row per rank
  /// Per rank: the step's peak memory in bytes (ExecutorStats::peak_memory_bytes: activation
  /// stashes + received copies + outputs and input gradients waiting to be sent + the receive
  /// and send windows' buffers), what sim::simulate predicts as SimResult::peak_memory_bytes.
  /// DistributedTrainer: every rank's on rank 0, empty on the other ranks.
  std::vector<double> peak_memory_bytes;
  /// The steady-clock instant the timeline's 0 stands for (this process's clock): what places
  /// events measured beside the engine (VerifyingTransport's verdicts) on the timeline.
  std::chrono::steady_clock::time_point origin{};
};

/// Trains a Llama split into pipeline stages, one thread per rank over an InProcessTransport,
/// running a plan::Plan: its partition (virtual stage v's layers, on rank
/// `partition.stage(v).rank`; the embedding is in the first virtual stage, the final norm, LM
/// head and loss in the last) and its lowered schedule, every step. A shared classifier
/// is held by both the first and the last virtual stage: their two gradients are summed after
/// each step and both copies take the same update, so they stay equal (Megatron's embedding
/// group).
///
/// With TrainingOptions::tp = t > 1 every virtual stage is t TrainStages, TP rank i's holding
/// its slices (runtime::TrainStage's split), and a step runs t pipelines, each the ordinary
/// executor over its own InProcessFabric, on t x P threads; the stages of pipeline rank p join
/// in-process group p (transport::InProcessGroup: sums in member order) for their collectives.
/// Every pipeline computes the same loss; the tied classifier's shards are summed per pipeline
/// (TP rank i's embedding and head hold the same vocabulary rows); the global norm sums every
/// shard once and every replicated norm gain once (AdamW's ParamSlot::in_norm); each shard takes
/// its AdamW step. gradients(), export_weights() and the checkpoints assemble the shards into
/// whole tensors (runtime::place_shard), so they are those of a run without TP up to float
/// rounding (the split sums), and a checkpoint resumes at any TP degree. A step that fails
/// leaves the groups aborted (later steps throw Aborted): make a new engine.
class TrainingEngine {
 public:
  /// Runs `plan` (a training plan of one chunk per micro-batch for a model of init's layers).
  /// @throws brigade::Error{InvalidArgument} for an inference plan, one with chunks > 1, a
  ///         partition of another layer count, or threads_per_rank < 1
  TrainingEngine(const model::LlamaWeights& init, plan::Plan plan, TrainingOptions options = {});
  /// Runs training_plan(init.config, config) with config's options.
  /// @throws brigade::Error{InvalidArgument} as training_plan()
  TrainingEngine(const model::LlamaWeights& init, const TrainingConfig& config)
      : TrainingEngine(init, training_plan(init.config, config), config) {}
  ~TrainingEngine();
  TrainingEngine(const TrainingEngine&) = delete;
  TrainingEngine& operator=(const TrainingEngine&) = delete;

  /// Forward and backward of every micro-batch (config.microbatches of them) by the schedule;
  /// gradients of the mean loss are left in the stages (tied copies summed). No update.
  /// One thread per rank over the InProcessTransport endpoints of one InProcessFabric (the
  /// overload below).
  /// @throws brigade::Error{InvalidArgument} if the batch count differs from the configuration
  ///         or a batch is empty; any rank's error (the others are stopped)
  StepResult compute_gradients(std::span<const data::PackedBatch> batches);
  /// compute_gradients with one thread per rank (run_ranks), rank r over `transports[r]`: the
  /// caller's Transport, e.g. a decorator (transport/decorators.hpp) over InProcessTransport
  /// endpoints. Follow with optimizer_step() for an update.
  /// @throws brigade::Error{InvalidArgument} if transports.size() differs from the plan's ranks
  ///         or transports[r].rank() != r, or for an engine with TrainingOptions::tp > 1 (it runs
  ///         its pipelines over its own fabrics); as compute_gradients(batches)
  template <transport::Transport T>
  StepResult compute_gradients(std::span<T> transports,
                               std::span<const data::PackedBatch> batches) {
    return compute_gradients(transports, plan(), batches);
  }
  /// compute_gradients for one step of its own plan: `step` has the engine's partition (same
  /// layer ranges on the same ranks) but its own schedule, micro-batch count and work, e.g.
  /// DynaPipe's adaptive schedule over the dynamic batcher's micro-batches of this global batch
  /// (Jiang et al., DynaPipe, EuroSys '24, sections 4-5), or 1F1B over a padding batcher's.
  /// Steps with different plans run back to back; the optimizer state carries over.
  /// @param step    a training plan with plan().partition(); step.shape().num_microbatches ==
  ///                batches.size()
  /// @throws brigade::Error{InvalidArgument} if step's partition differs from the engine's
  ///         (naming both stage counts), it is not a 1-chunk training plan, or as
  ///         compute_gradients(batches)
  StepResult compute_gradients(const plan::Plan& step, std::span<const data::PackedBatch> batches);
  /// compute_gradients(step, batches) over the caller's transports (see the overload above).
  template <transport::Transport T>
  StepResult compute_gradients(std::span<T> transports, const plan::Plan& step,
                               std::span<const data::PackedBatch> batches) {
    const StepSetup s = begin_step(step, batches, transports.size(), true);
    for (std::size_t r = 0; r < transports.size(); ++r)
      BRIGADE_CHECK(transports[r].rank() == static_cast<int>(r), Errc::InvalidArgument,
                    "TrainingEngine: transports[{}] is rank {}, expected rank {}", r,
                    transports[r].rank(), r);
    const int P = s.lowered->shape.num_ranks;
    std::vector<Timeline> tls(static_cast<std::size_t>(P), Timeline(P));
    std::vector<double> peaks(static_cast<std::size_t>(P), 0.0);
    std::vector<MicrobatchDrops> drops(static_cast<std::size_t>(P));
    const auto t0 = std::chrono::steady_clock::now();
    run_ranks(transports, [&](T& tp) {
      const int r = tp.rank();
      std::vector<runtime::TrainStageBase*> mine(s.stages.size(), nullptr);
      for (std::size_t v = 0; v < s.stages.size(); ++v)
        if (s.lowered->shape.rank_of(static_cast<int>(v)) == r) mine[v] = s.stages[v];
      peaks[static_cast<std::size_t>(r)] = static_cast<double>(
          run_training_program(s.lowered->ranks[static_cast<std::size_t>(r)], s.lowered->shape,
                               r, mine, batches, s.targets, tp, t0, s.timeout_s,
                               tls[static_cast<std::size_t>(r)], s.dim, s.windows,
                               &drops[static_cast<std::size_t>(r)], s.pipeline_dtype)
              .peak_memory_bytes);
    });
    return end_step(P, t0, tls, std::move(peaks), batches, drops);
  }
  /// Global-norm clipping and one AdamW update of every stage, from the gradients left by
  /// compute_gradients(); nothing when that step's update was skipped (StepResult::update_skipped).
  /// Each (TP member, pipeline rank) sums its squared gradients and updates its own stages on
  /// its own thread, as each stage's device does in a distributed run; the global norm joins them.
  /// @return {learning rate, gradient norm before clipping}; {0, 0} for a skipped update
  /// @throws brigade::Error from a stage's upload_parameters() (a device backend)
  std::pair<double, double> optimizer_step();
  /// compute_gradients() then optimizer_step().
  StepResult train_step(std::span<const data::PackedBatch> batches);
  /// compute_gradients(step, batches) then optimizer_step(): one step of its own plan.
  /// @throws brigade::Error as compute_gradients(step, batches)
  StepResult train_step(const plan::Plan& step, std::span<const data::PackedBatch> batches);
  /// compute_gradients(transports, batches) then optimizer_step(): a step over the caller's
  /// transports, which may be kept from step to step (decorators that learn across steps, such
  /// as VerifyingTransport's monitors). @throws brigade::Error as compute_gradients
  template <transport::Transport T>
  StepResult train_step(std::span<T> transports, std::span<const data::PackedBatch> batches) {
    return train_step(transports, plan(), batches);
  }
  /// compute_gradients(transports, step, batches) then optimizer_step().
  /// @throws brigade::Error as compute_gradients(step, batches)
  template <transport::Transport T>
  StepResult train_step(std::span<T> transports, const plan::Plan& step,
                        std::span<const data::PackedBatch> batches) {
    const auto t0 = std::chrono::steady_clock::now();
    StepResult r = compute_gradients(transports, step, batches);
    const auto [lr, norm] = optimizer_step();
    r.lr = lr;
    r.grad_norm = norm;
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  }
  /// Mean cross-entropy of `batches` under the current parameters (forward only, no gradients;
  /// with TP one thread per TP rank).
  /// @throws brigade::Error{InvalidArgument} if batches is empty
  double evaluate(std::span<const data::PackedBatch> batches);

  /// Every parameter's gradient by name (the tied embedding once), after compute_gradients();
  /// whole tensors (with TP: the shards assembled).
  [[nodiscard]] std::map<std::string, std::vector<float>> gradients() const;
  /// Calls f on every gradient buffer in place (float32, a parameter's size; with TP a shard's),
  /// after compute_gradients() and before optimizer_step(): TP rank by TP rank, stage by stage in
  /// virtual-stage order, each stage's parameters in its order, a tied embedding on both stages
  /// that hold it. The order is the same for every engine of the same plan, so data-parallel
  /// replicas (engine::DataParallelTrainer) all-reduce them buffer by buffer.
  void for_each_gradient(const std::function<void(std::span<float>)>& f);
  /// The current parameters as a model (owned storage; with TP the shards assembled), for saving
  /// or generating.
  [[nodiscard]] model::LlamaWeights export_weights() const;

  /// Writes `dir/model.bin` (llama2.c format, loadable by `brigade generate`) and
  /// `dir/optimizer.bin` (AdamW moments, step, `data_position`), each atomically.
  /// @throws brigade::Error{BadFile} if a file cannot be written
  void save_checkpoint(const std::filesystem::path& dir, std::int64_t data_position) const;
  /// Restores the optimizer state written by save_checkpoint (the weights come from
  /// `dir/model.bin`, passed to the constructor). @return the saved data position
  /// @throws brigade::Error{BadFile} if the file is missing, truncated, or was written for another
  ///         model or split
  std::int64_t load_optimizer_state(const std::filesystem::path& dir);

  /// The plan every step runs (partition, lowered schedule).
  [[nodiscard]] const plan::Plan& plan() const noexcept;
  /// Optimizer steps taken.
  [[nodiscard]] std::int64_t steps() const noexcept;

 private:
  /// What every rank of a step needs (pointers into the engine).
  struct StepSetup {
    const schedule::Schedule* lowered = nullptr;  // the step plan's lowered schedule
    std::vector<runtime::TrainStageBase*> stages;     // by virtual stage
    double targets = 0.0;  // the step's real (non-pad) targets: the loss denominator
    double timeout_s = 0.0;
    int dim = 0;
    ExecutorWindows windows;
    DType pipeline_dtype = DType::F32;
  };
  /// Checks `step` against the engine's partition, the batches (and that `ranks` transports
  /// match the plan; `caller_transports`: the caller's, which a TP engine refuses), zeroes the
  /// gradients. StepSetup::stages are TP rank 0's.
  StepSetup begin_step(const plan::Plan& step, std::span<const data::PackedBatch> batches,
                       std::size_t ranks, bool caller_transports);
  /// The step's result from every rank's Timeline (`ranks` rows; with TP the grid's), peak and
  /// dropped micro-batches (agreed by detail::decide_drops and applied by detail::apply_drops);
  /// sums the tied gradients.
  StepResult end_step(int ranks, std::chrono::steady_clock::time_point t0, std::span<const Timeline> tls,
                      std::vector<double> peaks, std::span<const data::PackedBatch> batches,
                      std::span<const MicrobatchDrops> drops);
  /// compute_gradients(step, batches) of a TP engine: t x P threads over t fabrics.
  StepResult compute_gradients_tp(const plan::Plan& step, std::span<const data::PackedBatch> batches);

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

namespace detail {

/// What every rank does about a step's flagged micro-batches (SENTINEL's "drop" policy).
struct DropDecision {
  std::vector<int> dropped;   ///< micro-batches flagged on any rank, ascending
  bool skip_update = false;   ///< every micro-batch dropped, or one's gradients already added
  double scale = 1.0;         ///< factor on the kept gradients: total / kept real targets
};

/// The agreement of one step from every rank's MicrobatchDrops (`per_rank`, each [M] long), the
/// same on every rank: a micro-batch is dropped when any rank saw it flagged; the update is
/// skipped when a rank had added a dropped micro-batch's weight gradients (its flag reached that
/// rank after its BW) or nothing is kept; else the kept gradients are scaled by total targets /
/// kept targets (real targets, pad -1 excluded: the loss is the mean over the kept ones).
/// @throws brigade::Error{Internal} if the masks' lengths differ from batches.size()
DropDecision decide_drops(std::span<const MicrobatchDrops> per_rank,
                          std::span<const data::PackedBatch> batches);

/// Applies `d` to this rank's stages (null entries skipped): every gradient zeroed when the
/// update is skipped, else multiplied by d.scale (when it differs from 1).
void apply_drops(const DropDecision& d, std::span<runtime::TrainStageBase* const> stages);

/// The real targets of one micro-batch: its target rows other than pad (-1).
std::int64_t real_targets(const data::PackedBatch& batch) noexcept;

/// The real targets of a step, what its loss is the mean over: every target row but the pad
/// ones (target -1, which the cross-entropy skips), summed over `batches`.
/// @throws brigade::Error{InvalidArgument} for a micro-batch without rows ("micro-batch i is
///         empty") or a step without a real target ("no target to train on")
double step_targets(std::span<const data::PackedBatch> batches);

/// Checks that `step` can run on stages built for `engine`'s partition: the same partition and
/// a 1-chunk training schedule with batches.size() micro-batches.
/// @throws brigade::Error{InvalidArgument} naming what differs
void check_step_plan(const plan::Plan& engine, const plan::Plan& step,
                     std::span<const data::PackedBatch> batches);

/// The step's mean loss over data-parallel replicas: sum over r of means[r] * (targets[r] /
/// total), total = the sum of targets, both in replica order. Out of line, so the threads
/// (DataParallelTrainer) and the processes (DistributedTrainer) round it with the same
/// instructions: compiled inline in each caller, -march=native tuning may contract one into an
/// FMA and not the other, and the two losses then differ in the last bit.
/// @param targets each replica's real targets of the step (tokens), [replicas]
/// @param means   each replica's mean loss over them (nats per token), [replicas]
double replica_mean_loss(std::span<const double> targets, std::span<const double> means);

/// The summed loss of the tail stage's micro-batches not in `dropped` (ascending).
cpu::CrossEntropyLoss kept_loss(const runtime::TrainStageBase& tail, int microbatches,
                                std::span<const int> dropped);

/// The per-task loss of the tail stage's micro-batches not in `dropped` (ascending):
/// TrainStage::task_loss summed over them, [tasks] long (tasks = the largest task id in
/// `batches` + 1; empty when no batch carries tasks or the tail reports none).
std::vector<cpu::CrossEntropyLoss> kept_task_loss(const runtime::TrainStageBase& tail,
                                                  std::span<const data::PackedBatch> batches,
                                                  std::span<const int> dropped);

/// Tasks of a step: the largest task id over `batches` + 1 (0 when none carries tasks).
int step_tasks(std::span<const data::PackedBatch> batches) noexcept;

/// Checks that `plan` is one a training engine runs for a model of `model` with `options`.
/// @throws brigade::Error{InvalidArgument} as TrainingEngine's constructor
void check_training_plan(const plan::Plan& plan, const model::LlamaConfig& model,
                         const TrainingOptions& options);

/// AdamW over every parameter of `stage` (pointers into the stage: the stage must outlive it).
std::unique_ptr<AdamW> make_stage_optimizer(runtime::TrainStageBase& stage, const AdamWConfig& config);

/// The parameter of `stage` named `name` (the first one, in params() order).
/// @throws brigade::Error{Internal} if the stage has none
runtime::ParamRef find_param(runtime::TrainStageBase& stage, const std::string& name);

/// Sum of the squared gradient of the tail stage's tied classifier copy ("tok_embeddings"):
/// the global norm counts the tied embedding once, so this is subtracted from the stages' sum.
double tied_square_sum(runtime::TrainStageBase& tail);

/// The global gradient norm from each virtual stage's squared-gradient sum (`per_stage[v]`,
/// summed in v order) minus `tied` (tied_square_sum of the tail, 0 when not tied): the
/// arithmetic of TrainingEngine::optimizer_step, so every driver gets the same bits.
double global_grad_norm(std::span<const double> per_stage, double tied);

/// Each optimizer's squared-gradient sum (AdamW::grad_square_sum), null entries giving 0.
/// Compiled once in the library, so every driver gets the same bits whatever its own flags.
std::vector<double> grad_square_sums(std::span<AdamW* const> optimizers);

/// One AdamW step of every non-null optimizer with the global norm `norm` (in order), compiled
/// once in the library as grad_square_sums. @return the learning rate used (0 if none stepped)
double step_optimizers(std::span<AdamW* const> optimizers, double norm);

/// A model (owned storage) from tensors keyed by ParamRef::name, as TrainStage::export_to
/// writes them, for a model of `config`.
/// @throws brigade::Error{Internal} if a tensor is missing or of the wrong size
model::LlamaWeights weights_from_tensors(const model::LlamaConfig& config,
                                         const std::map<std::string, std::vector<float>>& tensors);

/// The fixed part of optimizer.bin: magic "BRGDOPT1", steps, data position, entry count
/// (int64 each, host byte order).
std::string optimizer_file_header(std::int64_t steps, std::int64_t data_position,
                                  std::int64_t entries);

/// One parameter of a virtual stage, whole: its TP shards assembled (runtime::place_shard),
/// with its AdamW moments, for a checkpoint.
struct WholeParam {
  std::string name;           ///< ParamRef::name
  std::vector<float> value;   ///< [full_size] the whole tensor
  std::vector<float> m, v;    ///< [full_size] its first and second moments (empty: not gathered)
};

/// Every parameter of one virtual stage, whole, in params() order: `members[t]` is TP rank t's
/// stage (one element without TP), `optimizers[t]` its AdamW (an empty span: values only).
/// @throws brigade::Error{Internal} if the members' parameter lists differ
std::vector<WholeParam> whole_params(std::span<runtime::TrainStageBase* const> members,
                                     std::span<AdamW* const> optimizers);

/// Adds every parameter's whole gradient of one virtual stage (members as whole_params) to
/// `out` by name, a name already there kept (the tied embedding once).
void add_whole_gradients(std::span<runtime::TrainStageBase* const> members,
                         std::map<std::string, std::vector<float>>& out);

/// Appends virtual stage `v`'s entries of optimizer.bin to `out`: per parameter, int32 stage,
/// int32 name length, the name, int64 size, then its first and second moments (size floats
/// each), whole tensors (a checkpoint of a tensor-parallel run holds the shards assembled, so it
/// resumes at any TP degree). The file is the header followed by the entries of v = 0, 1, ...,
/// N - 1.
/// @return the number of entries appended (params.size())
std::int64_t append_optimizer_entries(std::string& out, int v, std::span<const WholeParam> params);

/// Reads `dir/optimizer.bin` into the stages that are here: `stages[v]` and `optimizers[v]`
/// (both sized N, the split's virtual stages) are null for a stage held elsewhere, whose
/// entries are skipped. A stage of a TP rank keeps its slice of each whole entry
/// (runtime::take_shard). Sets each present optimizer's step count.
/// @return {optimizer steps, data position}
/// @throws brigade::Error{BadFile} if the file is missing, truncated, or was written for another
///         model or split
std::pair<std::int64_t, std::int64_t> read_optimizer_file(
    const std::filesystem::path& dir, std::span<runtime::TrainStageBase* const> stages,
    std::span<AdamW* const> optimizers);

}  // namespace detail

/// The work of each micro-batch, for a plan::Plan (and so for cost::RooflineCostModel, whose
/// memory is then exact for these batches): tokens = rows, sequences = offsets.size() - 1, and
/// the mean causal context sum over sequences of n (n + 1) / 2, divided by the rows.
/// @throws brigade::Error{InvalidArgument} for a micro-batch without rows or sequences
std::vector<model::WorkItem> microbatch_work(std::span<const data::PackedBatch> batches);

/// A cost model that replays measured timings, for the measured-vs-simulated comparison:
///
/// - compute: the measured duration of each action the Timeline holds (op, virtual stage,
///   micro-batch, chunk or round); for an action it does not hold, the mean of its (op, virtual
///   stage), separately for the prefill round and the decode rounds of an inference run;
/// - links: each (sender rank, receiver rank) pair's delivery latency, the median over its
///   messages of the time from the SEND's post to the end of the matching RECV (the wake-up,
///   the copy and the worker's check of what arrived), counting only messages whose receiver
///   was already waiting when they were posted; unlimited bandwidth; 0 for a pair with no such
///   message; and each such message's own latency (message_latency_seconds), the link's for the
///   others;
/// - send overhead: the part of each rank's run (first start to last end) in neither a compute
///   interval nor a RECV wait (the executor and the worker building, copying and posting
///   messages and receives between actions), divided evenly over its SEND actions;
/// - sizes (activation, checkpoint and message bytes): another model's, optionally; a roofline model of
///   the plan with the step's micro-batches as work (microbatch_work()) is exact for them, and
///   the simulator then predicts the run's peak memory; without one every size is 0 (the
///   simulator's memory columns are then zero). Sizes take no time: the links have unlimited
///   bandwidth, and the measured latency already holds the copy.
///
/// Simulating a schedule with it predicts the bubble of a run whose actions took those times.
class MeasuredCostModel {
 public:
  /// @param shape    the shape of the schedule that ran
  /// @param timeline a measured run (executor output) of a schedule of `shape`
  /// @param sizes activation_bytes() and message_bytes() come from it (see above); none: 0
  MeasuredCostModel(const schedule::Shape& shape, const Timeline& timeline,
                    std::optional<cost::RooflineCostModel> sizes = std::nullopt);
  /// Measured seconds of `a`, else the mean of its (op, virtual stage, prefill or decode); 0 for
  /// SEND/RECV and for pairs the timeline never ran.
  [[nodiscard]] double compute_seconds(const schedule::Action& a) const noexcept;
  /// The sizes model's stash after `a`; 0 without one.
  [[nodiscard]] double activation_bytes(const schedule::Action& a) const noexcept {
    return sizes_ ? sizes_->activation_bytes(a) : 0.0;
  }
  /// The sizes model's checkpoint_bytes (what an F keeps when a RECOMPUTE follows); 0 without
  /// one.
  [[nodiscard]] double checkpoint_bytes(const schedule::Action& a) const noexcept {
    return sizes_ ? sizes_->checkpoint_bytes(a) : 0.0;
  }
  /// The sizes model's message size; 0 without one (either way it takes no time).
  [[nodiscard]] double message_bytes(const schedule::Action& a) const noexcept {
    return sizes_ ? sizes_->message_bytes(a) : 0.0;
  }
  /// The measured delivery latency from rank src to rank dst, unlimited bandwidth.
  [[nodiscard]] cost::Link link(int src, int dst) const noexcept;
  /// The sender's measured seconds per SEND outside compute and waits (see above).
  [[nodiscard]] double send_overhead_seconds(const schedule::Action& a) const noexcept;
  /// SEND `a`'s own measured latency when its receiver was waiting for it, else its link's.
  [[nodiscard]] double message_latency_seconds(const schedule::Action& a) const noexcept;

 private:
  schedule::Shape shape_;
  std::vector<double> mean_;     // [((op * N) + v) * 2 + phase]
  std::vector<double> latency_;  // [src * P + dst], seconds
  std::vector<double> overhead_;  // per rank, seconds per SEND
  std::map<std::array<int, 4>, double> exact_;  // (op, v, mb, chunk) -> measured seconds
  std::map<std::array<int, 4>, double> message_latency_;  // SEND (op, v, mb, chunk) -> seconds
  std::optional<cost::RooflineCostModel> sizes_;
};

/// Bubble ratio the simulator predicts for `lowered` with the costs measured in `timeline`.
/// @throws brigade::Error as sim::simulate
double simulated_bubble(const schedule::Schedule& lowered, const Timeline& timeline);

}  // namespace v0
}  // namespace brigade::engine
