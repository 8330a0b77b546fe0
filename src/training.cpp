// TrainingEngine: in-process pipeline training over the schedule IR.
#include "brigade/engine/training.hpp"
#include "brigade/batching/batcher.hpp"

#include "brigade/engine/threads.hpp"
#include "brigade/io/trace.hpp"
#include "brigade/schedule/lower.hpp"
#include "brigade/schedule/registry.hpp"
#include "brigade/schedule/validate.hpp"
#include "brigade/sim/simulator.hpp"
#include "brigade/transport/collectives.hpp"
#include "brigade/transport/in_process.hpp"
#include "brigade/tp/tensor_parallel.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <thread>

namespace brigade::engine {
inline namespace v0 {
namespace fs = std::filesystem;

struct TrainingEngine::Impl {
  Impl(const model::LlamaConfig& c, plan::Plan p, const TrainingOptions& o)
      : config(c), cfg(o), plan(std::move(p)), lowered(plan.schedule()), part(plan.partition()) {}
  model::LlamaConfig config;
  TrainingOptions cfg;
  plan::Plan plan;
  const schedule::Schedule& lowered;     // plan.schedule()
  const partition::Partition& part;      // plan.partition()
  int T = 1;                             // the TP degree
  // [TP rank][virtual stage]; one TP rank without tensor parallelism.
  std::vector<std::vector<std::unique_ptr<runtime::TrainStageBase>>> stages;
  std::vector<std::vector<std::unique_ptr<AdamW>>> optimizers;
  // With TP: one group per pipeline rank p, member t's endpoint and tp::Group at [p T + t].
  std::vector<std::unique_ptr<transport::InProcessGroup>> groups;
  std::vector<std::unique_ptr<transport::InProcessCollectives>> members;
  std::vector<std::unique_ptr<tp::GroupOver<transport::InProcessCollectives>>> tp_groups;
  std::int64_t steps = 0;
  bool skip_update = false;  // the last compute_gradients' DropDecision::skip_update

  [[nodiscard]] int N() const { return static_cast<int>(stages.front().size()); }
  /// True when the first and the last virtual stage hold copies of the shared classifier.
  [[nodiscard]] bool tied_across_stages() const {
    return config.shared_classifier && stages.front().size() > 1;
  }
  /// TP rank t's stages by virtual stage.
  [[nodiscard]] std::vector<runtime::TrainStageBase*> pipeline(int t) const {
    std::vector<runtime::TrainStageBase*> out;
    for (const auto& st : stages[static_cast<std::size_t>(t)]) out.push_back(st.get());
    return out;
  }
  /// Every stage, TP rank by TP rank.
  [[nodiscard]] std::vector<runtime::TrainStageBase*> all() const {
    std::vector<runtime::TrainStageBase*> out;
    for (int t = 0; t < T; ++t)
      for (auto* st : pipeline(t)) out.push_back(st);
    return out;
  }
  /// Virtual stage v's TP members (stage, optimizer), by TP rank.
  [[nodiscard]] std::vector<runtime::TrainStageBase*> members_of(int v) const {
    std::vector<runtime::TrainStageBase*> out;
    for (int t = 0; t < T; ++t) out.push_back(stages[static_cast<std::size_t>(t)][static_cast<std::size_t>(v)].get());
    return out;
  }
  [[nodiscard]] std::vector<AdamW*> optimizers_of(int v) const {
    std::vector<AdamW*> out;
    for (int t = 0; t < T; ++t)
      out.push_back(optimizers[static_cast<std::size_t>(t)][static_cast<std::size_t>(v)].get());
    return out;
  }
  /// Aborts every TP group (a rank failed).
  void abort_groups(const std::string& reason) noexcept {
    for (auto& g : groups) g->abort(reason);
  }
};

namespace detail {

DropDecision decide_drops(std::span<const MicrobatchDrops> per_rank,
                          std::span<const data::PackedBatch> batches) {
  const std::size_t M = batches.size();
  DropDecision d;
  std::vector<char> dropped(M, 0);
  for (const auto& r : per_rank) {
    BRIGADE_CHECK(r.dropped.size() == M && r.applied.size() == M, Errc::Internal,
                  "decide_drops: masks of {} and {} micro-batches for a step of {}",
                  r.dropped.size(), r.applied.size(), M);
    for (std::size_t m = 0; m < M; ++m) dropped[m] |= r.dropped[m];
  }
  double total = 0.0, kept = 0.0;
  for (std::size_t m = 0; m < M; ++m) {
    const auto real = static_cast<double>(real_targets(batches[m]));
    total += real;
    if (dropped[m] != 0) d.dropped.push_back(static_cast<int>(m));
    else kept += real;
  }
  for (const auto& r : per_rank)
    for (int m : d.dropped)
      if (r.applied[static_cast<std::size_t>(m)] != 0) d.skip_update = true;
  if (kept == 0.0) d.skip_update = true;
  if (!d.skip_update && !d.dropped.empty()) d.scale = total / kept;
  return d;
}

void apply_drops(const DropDecision& d, std::span<runtime::TrainStageBase* const> stages) {
  if (!d.skip_update && d.scale == 1.0) return;
  const auto f = static_cast<float>(d.skip_update ? 0.0 : d.scale);
  for (runtime::TrainStageBase* st : stages) {
    if (st == nullptr) continue;
    for (auto& p : st->params())
      for (std::int64_t i = 0; i < p.size; ++i) p.grad[i] = d.skip_update ? 0.0f : p.grad[i] * f;
  }
}

std::int64_t real_targets(const data::PackedBatch& batch) noexcept {
  return std::count_if(batch.targets.begin(), batch.targets.end(),
                       [](std::int32_t t) { return t != -1; });
}

double step_targets(std::span<const data::PackedBatch> batches) {
  std::int64_t real = 0;
  for (std::size_t i = 0; i < batches.size(); ++i) {
    BRIGADE_CHECK(batches[i].rows() >= 1, Errc::InvalidArgument,
                  "TrainingEngine: micro-batch {} is empty", i);
    real += real_targets(batches[i]);
  }
  BRIGADE_CHECK(real > 0, Errc::InvalidArgument,
                "TrainingEngine: no target to train on: the step's {} micro-batches hold only pad "
                "targets (-1)",
                batches.size());
  return static_cast<double>(real);
}

void check_step_plan(const plan::Plan& engine, const plan::Plan& step,
                     std::span<const data::PackedBatch> batches) {
  const auto& sh = step.shape();
  BRIGADE_CHECK(sh.mode == schedule::Mode::Training && sh.num_chunks == 1, Errc::InvalidArgument,
                "TrainingEngine: a step plan in {} mode with {} chunk(s) per micro-batch; "
                "training runs training plans of 1 chunk",
                schedule::to_string(sh.mode), sh.num_chunks);
  BRIGADE_CHECK(step.partition() == engine.partition(), Errc::InvalidArgument,
                "TrainingEngine: the step plan splits the layers into {} stages on {} ranks "
                "differently from the engine's {} stages on {} ranks; a step plan keeps the "
                "engine's partition",
                step.partition().num_stages(), step.partition().num_ranks(),
                engine.partition().num_stages(), engine.partition().num_ranks());
  BRIGADE_CHECK(static_cast<int>(batches.size()) == sh.num_microbatches, Errc::InvalidArgument,
                "TrainingEngine: {} micro-batches for a schedule of {}", batches.size(),
                sh.num_microbatches);
}

int step_tasks(std::span<const data::PackedBatch> batches) noexcept {
  int tasks = 0;
  for (const auto& b : batches)
    for (const auto t : b.tasks) tasks = std::max(tasks, t + 1);
  return tasks;
}

std::vector<cpu::CrossEntropyLoss> kept_task_loss(const runtime::TrainStageBase& tail,
                                                  std::span<const data::PackedBatch> batches,
                                                  std::span<const int> dropped) {
  std::vector<cpu::CrossEntropyLoss> out;
  std::size_t next = 0;
  for (int m = 0; m < static_cast<int>(batches.size()); ++m) {
    if (next < dropped.size() && dropped[next] == m) {
      ++next;
      continue;
    }
    const auto& per = tail.task_loss(m);
    if (per.empty()) continue;
    out.resize(static_cast<std::size_t>(step_tasks(batches)));
    for (std::size_t t = 0; t < per.size(); ++t) {
      out[t].sum += per[t].sum;
      out[t].count += per[t].count;
    }
  }
  return out;
}

double replica_mean_loss(std::span<const double> targets, std::span<const double> means) {
  double total = 0.0;
  for (const double t : targets) total += t;
  double mean = 0.0;
  for (std::size_t r = 0; r < targets.size() && r < means.size(); ++r)
    mean += means[r] * (targets[r] / total);
  return mean;
}

cpu::CrossEntropyLoss kept_loss(const runtime::TrainStageBase& tail, int microbatches,
                                std::span<const int> dropped) {
  cpu::CrossEntropyLoss t;
  std::size_t next = 0;
  for (int m = 0; m < microbatches; ++m) {
    if (next < dropped.size() && dropped[next] == m) {
      ++next;
      continue;
    }
    const auto l = tail.loss(m);
    t.sum += l.sum;
    t.count += l.count;
  }
  return t;
}

runtime::ParamRef find_param(runtime::TrainStageBase& stage, const std::string& name) {
  for (auto& p : stage.params())
    if (p.name == name) return p;
  brigade::detail::fail(Errc::Internal, "TrainingEngine: stage has no parameter {}", name);
}

void check_training_plan(const plan::Plan& plan, const model::LlamaConfig& model,
                         const TrainingOptions& options) {
  BRIGADE_CHECK(options.threads_per_rank >= 1, Errc::InvalidArgument,
                "TrainingEngine: threads_per_rank = {}, expected >= 1", options.threads_per_rank);
  BRIGADE_CHECK(options.tp >= 1, Errc::InvalidArgument, "TrainingEngine: tp = {}, expected >= 1",
                options.tp);
  if (options.tp > 1) tp::check_tensor_parallel_training(model, options.tp);
  BRIGADE_CHECK(is_float_dtype(options.pipeline_dtype), Errc::InvalidArgument,
                "TrainingEngine: pipeline dtype {}; expected f32, f16 or bf16",
                to_string(options.pipeline_dtype));
  const auto& sh = plan.shape();
  BRIGADE_CHECK(sh.mode == schedule::Mode::Training && sh.num_chunks == 1, Errc::InvalidArgument,
                "TrainingEngine: a plan in {} mode with {} chunk(s) per micro-batch; training "
                "runs training plans of 1 chunk",
                schedule::to_string(sh.mode), sh.num_chunks);
  const model::ModelSpec spec(model);
  BRIGADE_CHECK(plan.partition().num_layers() == spec.num_layers(), Errc::InvalidArgument,
                "TrainingEngine: the plan splits {} layers, the model has {}",
                plan.partition().num_layers(), spec.num_layers());
}

}  // namespace detail

plan::Plan training_plan(const model::LlamaConfig& model, const TrainingConfig& config) {
  BRIGADE_CHECK(config.seq_len_hint >= 1, Errc::InvalidArgument,
                "TrainingEngine: seq_len_hint = {}, expected >= 1", config.seq_len_hint);
  plan::PlanRequest req;
  req.schedule = config.schedule;
  req.params.ranks = config.ranks;
  req.params.microbatches = config.microbatches;
  req.params.virtual_stages = config.virtual_stages;
  req.partition = config.partition;
  const std::int64_t S = config.seq_len_hint;
  req.balance_for = {S, 1, static_cast<double>(S) / 2.0};
  req.layer_seconds = config.layer_seconds;
  const schedule::Schedule compute = schedule::generate(req.schedule, req.params);
  BRIGADE_CHECK(compute.shape.mode == schedule::Mode::Training, Errc::InvalidArgument,
                "TrainingEngine: schedule '{}' is an inference schedule", config.schedule);
  const int N = compute.shape.num_virtual_stages;
  BRIGADE_CHECK(N <= model.n_layers, Errc::InvalidArgument,
                "TrainingEngine: {} virtual stages ({} ranks x {}) for {} decoder layers", N,
                config.ranks, config.virtual_stages, model.n_layers);
  const model::ModelSpec spec(model);
  plan::Plan plan = plan::make_plan(spec, compute, req);
  if (!config.devices.empty()) {
    for (const auto& d : config.devices)
      cost::check_holds_weights(d, cost::model_weight_bytes(spec));
    cost::TrainingMemoryOptions mo;
    mo.workload = {1, config.seq_len_hint};
    cost::check_capacity(cost::training_memory(spec, plan, mo), config.devices, "training_plan");
  }
  return plan;
}

namespace detail {

std::unique_ptr<AdamW> make_stage_optimizer(runtime::TrainStageBase& stage, const AdamWConfig& config) {
  std::vector<ParamSlot> slots;
  // A replicated tensor (a TP stage's norm gains) counts in the norm on TP rank 0 only.
  for (auto& p : stage.params())
    slots.push_back({p.value, p.grad, p.size, p.decay, !p.replicated() || p.shard == 0});
  return std::make_unique<AdamW>(std::move(slots), config);
}

double tied_square_sum(runtime::TrainStageBase& tail) {
  const auto b = find_param(tail, "tok_embeddings");
  return square_sum(b.grad, b.size);
}

std::vector<double> grad_square_sums(std::span<AdamW* const> optimizers) {
  std::vector<double> out;
  for (auto* o : optimizers) out.push_back(o ? o->grad_square_sum() : 0.0);
  return out;
}

double step_optimizers(std::span<AdamW* const> optimizers, double norm) {
  double lr = 0.0;
  for (auto* o : optimizers)
    if (o) lr = o->step(norm);
  return lr;
}

double global_grad_norm(std::span<const double> per_stage, double tied) {
  double sq = 0.0;
  for (double x : per_stage) sq += x;
  sq -= tied;
  return std::sqrt(std::max(0.0, sq));
}

}  // namespace detail

TrainingEngine::TrainingEngine(const model::LlamaWeights& init, plan::Plan plan,
                               TrainingOptions options) {
  detail::check_training_plan(plan, init.config, options);
  impl_ = std::make_unique<Impl>(init.config, std::move(plan), options);
  auto& I = *impl_;
  I.T = options.tp;
  const int P = I.lowered.shape.num_ranks;
  if (I.T > 1) {
    for (int p = 0; p < P; ++p) {
      I.groups.push_back(std::make_unique<transport::InProcessGroup>(I.T));
      for (int t = 0; t < I.T; ++t) {
        I.members.push_back(std::make_unique<transport::InProcessCollectives>(*I.groups.back(), t));
        I.tp_groups.push_back(std::make_unique<tp::GroupOver<transport::InProcessCollectives>>(
            *I.members.back(), options.timeout_s));
      }
    }
  }
  I.stages.resize(static_cast<std::size_t>(I.T));
  I.optimizers.resize(static_cast<std::size_t>(I.T));
  for (int t = 0; t < I.T; ++t)
    for (int v = 0; v < I.lowered.shape.num_virtual_stages; ++v) {
      tp::Group* group =
          I.T > 1 ? I.tp_groups[static_cast<std::size_t>(I.lowered.shape.rank_of(v) * I.T + t)].get()
                  : nullptr;
      auto& mine = I.stages[static_cast<std::size_t>(t)];
      mine.push_back(runtime::make_train_stage(options.stages, init, I.part.stage(v), v, group));
      I.optimizers[static_cast<std::size_t>(t)].push_back(
          detail::make_stage_optimizer(*mine.back(), options.optimizer));
    }
}

TrainingEngine::~TrainingEngine() = default;

const plan::Plan& TrainingEngine::plan() const noexcept { return impl_->plan; }
std::int64_t TrainingEngine::steps() const noexcept { return impl_->steps; }

TrainingEngine::StepSetup TrainingEngine::begin_step(const plan::Plan& step,
                                                     std::span<const data::PackedBatch> batches,
                                                     std::size_t ranks, bool caller_transports) {
  auto& I = *impl_;
  BRIGADE_CHECK(!caller_transports || I.T == 1, Errc::InvalidArgument,
                "TrainingEngine: a TP {} engine runs its {} pipelines over its own in-process "
                "fabrics; compute_gradients over the caller's transports takes a TP 1 engine",
                I.T, I.T);
  detail::check_step_plan(I.plan, step, batches);
  BRIGADE_CHECK(ranks == static_cast<std::size_t>(step.shape().num_ranks), Errc::InvalidArgument,
                "TrainingEngine: {} transports for a plan of {} ranks", ranks,
                step.shape().num_ranks);
  StepSetup s;
  s.targets = detail::step_targets(batches);
  for (auto* st : I.all()) st->zero_grad();
  cpu::set_blas_threads(I.cfg.threads_per_rank);
  s.lowered = &step.schedule();
  s.stages = I.pipeline(0);
  s.timeout_s = I.cfg.timeout_s;
  s.dim = I.config.dim;
  s.windows = step.execution().windows;
  s.pipeline_dtype = I.cfg.pipeline_dtype;
  return s;
}

StepResult TrainingEngine::end_step(int P, std::chrono::steady_clock::time_point t0,
                                    std::span<const Timeline> tls, std::vector<double> peaks,
                                    std::span<const data::PackedBatch> batches,
                                    std::span<const MicrobatchDrops> drops) {
  auto& I = *impl_;
  StepResult res;
  res.peak_memory_bytes = std::move(peaks);
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  res.origin = t0;
  res.timeline = Timeline(P);
  for (const auto& tl : tls) res.timeline.merge(tl);
  const auto decision = detail::decide_drops(drops, batches);
  detail::apply_drops(decision, I.all());
  I.skip_update = decision.skip_update;
  res.dropped_microbatches = decision.dropped;
  res.update_skipped = decision.skip_update;
  // Every TP rank's tail computes the same loss; TP rank 0's is the step's.
  const auto& tail = *I.stages.front().back();
  const auto loss = detail::kept_loss(tail, static_cast<int>(batches.size()), decision.dropped);
  res.tokens = loss.count;
  res.loss = loss.mean();
  res.task_loss = detail::kept_task_loss(tail, batches, decision.dropped);
  // The tied classifier: both copies get the summed gradient (with TP, shard by shard: TP rank
  // t's embedding and head hold the same vocabulary rows).
  if (I.tied_across_stages()) {
    for (int t = 0; t < I.T; ++t) {
      const auto pipe = I.pipeline(t);
      auto a = detail::find_param(*pipe.front(), "tok_embeddings");
      auto b = detail::find_param(*pipe.back(), "tok_embeddings");
      for (std::int64_t i = 0; i < a.size; ++i) {
        const float g = a.grad[i] + b.grad[i];
        a.grad[i] = g;
        b.grad[i] = g;
      }
    }
  }
  return res;
}

StepResult TrainingEngine::compute_gradients_tp(const plan::Plan& step,
                                                std::span<const data::PackedBatch> batches) {
  auto& I = *impl_;
  const StepSetup s = begin_step(step, batches, static_cast<std::size_t>(step.shape().num_ranks),
                                 false);
  const int T = I.T, P = s.lowered->shape.num_ranks, G = T * P;
  std::vector<std::unique_ptr<transport::InProcessFabric>> fabrics;
  std::vector<std::vector<transport::InProcessTransport>> pipes;  // [TP rank][pipeline rank]
  for (int t = 0; t < T; ++t) {
    fabrics.push_back(std::make_unique<transport::InProcessFabric>(P));
    pipes.push_back(transport::endpoints(*fabrics.back()));
  }
  std::vector<Timeline> tls(static_cast<std::size_t>(G), Timeline(P));
  std::vector<double> peaks(static_cast<std::size_t>(G), 0.0);
  std::vector<MicrobatchDrops> drops(static_cast<std::size_t>(G));
  const auto t0 = std::chrono::steady_clock::now();
  run_grid(
      T, P,
      [&](int t, int p) {
        const auto g = static_cast<std::size_t>(p * T + t);
        const auto pipe = I.pipeline(t);
        std::vector<runtime::TrainStageBase*> mine(pipe.size(), nullptr);
        for (std::size_t v = 0; v < pipe.size(); ++v)
          if (s.lowered->shape.rank_of(static_cast<int>(v)) == p) mine[v] = pipe[v];
        peaks[g] = static_cast<double>(
            run_training_program(s.lowered->ranks[static_cast<std::size_t>(p)], s.lowered->shape,
                                 p, mine, batches, s.targets,
                                 pipes[static_cast<std::size_t>(t)][static_cast<std::size_t>(p)],
                                 t0, s.timeout_s, tls[g], s.dim, s.windows, &drops[g],
                                 s.pipeline_dtype)
                .peak_memory_bytes);
      },
      [&](const std::exception& e, const std::string& reason) {
        for (auto& pipe : pipes) transport::abort_others(pipe.front(), e);
        I.abort_groups(reason);
      });
  // One Timeline row per rank of the grid: pipeline t's rank p is global rank p T + t.
  Timeline grid(G);
  for (int g = 0; g < G; ++g)
    for (Interval iv : tls[static_cast<std::size_t>(g)].intervals()) {
      iv.rank = iv.rank * T + g % T;
      grid.add(std::move(iv));
    }
  return end_step(G, t0, std::span(&grid, 1), std::move(peaks), batches, drops);
}

StepResult TrainingEngine::compute_gradients(std::span<const data::PackedBatch> batches) {
  return compute_gradients(impl_->plan, batches);
}

StepResult TrainingEngine::compute_gradients(const plan::Plan& step,
                                             std::span<const data::PackedBatch> batches) {
  if (impl_->T > 1) return compute_gradients_tp(step, batches);
  transport::InProcessFabric fabric(step.shape().num_ranks);
  auto endpoints = transport::endpoints(fabric);
  return compute_gradients(std::span(endpoints), step, batches);
}

std::pair<double, double> TrainingEngine::optimizer_step() {
  auto& I = *impl_;
  if (I.skip_update) return {0.0, 0.0};
  const int N = I.N(), T = I.T, P = I.lowered.shape.num_ranks;
  // Each (TP member, pipeline rank) sums and updates its own stages' parameters on its own
  // thread, as each stage's device does in a distributed run: the update takes one rank's time,
  // not the pipeline's. Only the global norm waits for every rank.
  const auto on_each_rank = [&](const auto& fn) {  // fn(t, v) for the stages rank p holds
    run_grid(T, P, [&](int t, int p) {
      for (int v = 0; v < N; ++v)
        if (I.lowered.shape.rank_of(v) == p) fn(t, v);
    }, [](const std::exception&, const std::string&) {});
  };
  const auto at = [N](int t, int v) { return static_cast<std::size_t>(t * N + v); };
  const auto optimizer = [&](int t, int v) {
    return I.optimizers[static_cast<std::size_t>(t)][static_cast<std::size_t>(v)].get();
  };
  std::vector<double> sums(static_cast<std::size_t>(T * N), 0.0);
  on_each_rank([&](int t, int v) {
    if (auto* o = optimizer(t, v)) sums[at(t, v)] = o->grad_square_sum();
  });
  // Per virtual stage, its TP ranks' squared sums in TP-rank order (each shard once, each
  // replicated norm gain on TP rank 0 only); the tail's copy of the tied embedding counted once.
  std::vector<double> per_stage(static_cast<std::size_t>(N), 0.0);
  double tied = 0.0;
  for (int t = 0; t < T; ++t) {
    for (int v = 0; v < N; ++v) per_stage[static_cast<std::size_t>(v)] += sums[at(t, v)];
    if (I.tied_across_stages()) tied += detail::tied_square_sum(*I.pipeline(t).back());
  }
  const double norm = detail::global_grad_norm(per_stage, tied);
  std::vector<double> lrs(static_cast<std::size_t>(T * N), -1.0);
  on_each_rank([&](int t, int v) {
    if (auto* o = optimizer(t, v)) lrs[at(t, v)] = o->step(norm);
    I.stages[static_cast<std::size_t>(t)][static_cast<std::size_t>(v)]->upload_parameters();
  });
  double lr = 0.0;  // every optimizer has the same schedule: the last one's, as step_optimizers
  for (double x : lrs)
    if (x >= 0.0) lr = x;
  ++I.steps;
  return {lr, norm};
}

StepResult TrainingEngine::train_step(std::span<const data::PackedBatch> batches) {
  return train_step(impl_->plan, batches);
}

StepResult TrainingEngine::train_step(const plan::Plan& step,
                                      std::span<const data::PackedBatch> batches) {
  const auto t0 = std::chrono::steady_clock::now();
  StepResult r = compute_gradients(step, batches);
  const auto [lr, norm] = optimizer_step();
  r.lr = lr;
  r.grad_norm = norm;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

double TrainingEngine::evaluate(std::span<const data::PackedBatch> batches) {
  auto& I = *impl_;
  BRIGADE_CHECK(!batches.empty(), Errc::InvalidArgument, "TrainingEngine::evaluate: no batches");
  cpu::set_blas_threads(I.cfg.threads_per_rank);
  // TP rank t's stages in order, micro-batch by micro-batch (with TP one thread per TP rank:
  // the stages' collectives pair across them).
  const auto forward_all = [&](int t) {
    const auto pipe = I.pipeline(t);
    for (std::size_t i = 0; i < batches.size(); ++i) {
      const int mb = static_cast<int>(i);
      const float* x = nullptr;
      for (auto* s : pipe) {
        s->forward(mb, batches[i], x, 1.0, false);
        x = s->has_head() ? nullptr : s->output(mb).data();
      }
    }
  };
  if (I.T == 1)
    forward_all(0);
  else
    run_grid(I.T, 1, [&](int t, int) { forward_all(t); },
             [&](const std::exception&, const std::string& reason) { I.abort_groups(reason); });
  double sum = 0.0;
  std::int64_t count = 0;
  for (std::size_t i = 0; i < batches.size(); ++i) {
    const auto l = I.stages.front().back()->loss(static_cast<int>(i));
    sum += l.sum;
    count += l.count;
  }
  for (auto* s : I.all()) s->clear_microbatches();
  return count > 0 ? sum / static_cast<double>(count) : 0.0;
}

std::map<std::string, std::vector<float>> TrainingEngine::gradients() const {
  std::map<std::string, std::vector<float>> out;
  for (int v = 0; v < impl_->N(); ++v) detail::add_whole_gradients(impl_->members_of(v), out);
  return out;
}

void TrainingEngine::for_each_gradient(const std::function<void(std::span<float>)>& f) {
  for (auto* s : impl_->all())
    for (auto& p : s->params()) f(std::span<float>(p.grad, static_cast<std::size_t>(p.size)));
}

model::LlamaWeights TrainingEngine::export_weights() const {
  std::map<std::string, std::vector<float>> t;
  // Stage 0's embedding wins (written last); the tail's tied copy is identical anyway.
  for (int v = impl_->N() - 1; v >= 0; --v)
    for (auto& p : detail::whole_params(impl_->members_of(v), {})) t[p.name] = std::move(p.value);
  return detail::weights_from_tensors(impl_->config, t);
}

namespace detail {

model::LlamaWeights weights_from_tensors(const model::LlamaConfig& c,
                                         const std::map<std::string, std::vector<float>>& t) {
  const std::int64_t d = c.dim, kv = c.kv_dim(), h = c.hidden_dim, v = c.vocab_size;
  const std::int64_t per_layer = 2 * d + 2 * d * d + 2 * kv * d + 3 * d * h;
  const std::int64_t total = v * d + c.n_layers * per_layer + d + (c.shared_classifier ? 0 : v * d);
  auto buf = std::shared_ptr<float[]>(new float[static_cast<std::size_t>(total)]);
  float* p = buf.get();
  auto put = [&](const std::string& name, std::int64_t size) -> const float* {
    auto it = t.find(name);
    BRIGADE_CHECK(it != t.end() && static_cast<std::int64_t>(it->second.size()) == size,
                  Errc::Internal, "export_weights: tensor {} missing or of the wrong size", name);
    std::memcpy(p, it->second.data(), static_cast<std::size_t>(size) * sizeof(float));
    const float* at = p;
    p += size;
    return at;
  };
  model::LlamaWeights w;
  w.config = c;
  w.token_embedding = put("tok_embeddings", v * d);
  w.layers.resize(static_cast<std::size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    auto& L = w.layers[static_cast<std::size_t>(l)];
    const std::string pre = fmt::format("layers.{}.", l);
    L.rms_att = put(pre + "attention_norm", d);
    L.wq = put(pre + "wq", d * d);
    L.wk = put(pre + "wk", kv * d);
    L.wv = put(pre + "wv", kv * d);
    L.wo = put(pre + "wo", d * d);
    L.rms_ffn = put(pre + "ffn_norm", d);
    L.w1 = put(pre + "w1", h * d);
    L.w2 = put(pre + "w2", d * h);
    L.w3 = put(pre + "w3", h * d);
  }
  w.rms_final = put("norm", d);
  w.wcls = c.shared_classifier ? w.token_embedding : put("output", v * d);
  w.storage = std::shared_ptr<const void>(buf, buf.get());
  return w;
}

}  // namespace detail

namespace {
constexpr char kOptMagic[8] = {'B', 'R', 'G', 'D', 'O', 'P', 'T', '1'};

template <class V>
void put_raw(std::string& out, const V& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(V));
}
}  // namespace

namespace detail {

std::string optimizer_file_header(std::int64_t steps, std::int64_t data_position,
                                  std::int64_t entries) {
  std::string out(kOptMagic, 8);
  put_raw(out, steps);
  put_raw(out, data_position);
  put_raw(out, entries);
  return out;
}

std::vector<WholeParam> whole_params(std::span<runtime::TrainStageBase* const> members,
                                     std::span<AdamW* const> optimizers) {
  std::vector<std::vector<runtime::ParamRef>> refs;
  std::vector<std::vector<std::span<float>>> states;
  for (std::size_t t = 0; t < members.size(); ++t) {
    refs.push_back(members[t]->params());
    if (!optimizers.empty()) states.push_back(optimizers[t]->state());
    BRIGADE_CHECK(refs.back().size() == refs.front().size(), Errc::Internal,
                  "whole_params: TP rank {} has {} parameters, rank 0 {}", t, refs.back().size(),
                  refs.front().size());
  }
  const std::size_t K = refs.front().size();
  std::vector<WholeParam> out(K);
  for (std::size_t k = 0; k < K; ++k) {
    const auto& p0 = refs.front()[k];
    auto& w = out[k];
    w.name = p0.name;
    const auto n = static_cast<std::size_t>(p0.full_size());
    w.value.resize(n);
    if (!optimizers.empty()) {
      w.m.resize(n);
      w.v.resize(n);
    }
    for (std::size_t t = 0; t < members.size(); ++t) {
      const auto& p = refs[t][k];
      runtime::place_shard(p, p.shard, p.value, w.value.data());
      if (optimizers.empty()) continue;
      runtime::place_shard(p, p.shard, states[t][k].data(), w.m.data());
      runtime::place_shard(p, p.shard, states[t][K + k].data(), w.v.data());
    }
  }
  return out;
}

void add_whole_gradients(std::span<runtime::TrainStageBase* const> members,
                         std::map<std::string, std::vector<float>>& out) {
  std::vector<std::vector<runtime::ParamRef>> refs;
  for (auto* m : members) refs.push_back(m->params());
  for (std::size_t k = 0; k < refs.front().size(); ++k) {
    const auto& p0 = refs.front()[k];
    if (out.count(p0.name)) continue;
    auto& g = out[p0.name];
    g.resize(static_cast<std::size_t>(p0.full_size()));
    for (const auto& r : refs) runtime::place_shard(r[k], r[k].shard, r[k].grad, g.data());
  }
}

std::int64_t append_optimizer_entries(std::string& out, int v, std::span<const WholeParam> params) {
  for (const auto& p : params) {
    put_raw(out, static_cast<std::int32_t>(v));
    put_raw(out, static_cast<std::int32_t>(p.name.size()));
    out += p.name;
    put_raw(out, static_cast<std::int64_t>(p.value.size()));
    for (const auto* moments : {&p.m, &p.v})
      out.append(reinterpret_cast<const char*>(moments->data()), moments->size() * sizeof(float));
  }
  return static_cast<std::int64_t>(params.size());
}

std::pair<std::int64_t, std::int64_t> read_optimizer_file(
    const fs::path& dir, std::span<runtime::TrainStageBase* const> stages,
    std::span<AdamW* const> optimizers) {
  BRIGADE_CHECK(stages.size() == optimizers.size(), Errc::InvalidArgument,
                "read_optimizer_file: {} stages but {} optimizers", stages.size(),
                optimizers.size());
  const fs::path path = dir / "optimizer.bin";
  std::ifstream in(path, std::ios::binary);
  BRIGADE_CHECK(in.good(), Errc::BadFile, "{}: cannot open the optimizer state", path.string());
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string data = ss.str();
  std::size_t pos = 0;
  auto need = [&](std::size_t n, const char* what) {
    BRIGADE_CHECK(pos + n <= data.size(), Errc::BadFile,
                  "{}: truncated at byte {} while reading {} ({} bytes needed, file has {})",
                  path.string(), pos, what, n, data.size());
  };
  auto get = [&](auto& v, const char* what) {
    need(sizeof(v), what);
    std::memcpy(&v, data.data() + pos, sizeof(v));
    pos += sizeof(v);
  };
  need(8, "the magic");
  BRIGADE_CHECK(std::memcmp(data.data(), kOptMagic, 8) == 0, Errc::BadFile,
                "{}: bad magic, expected BRGDOPT1", path.string());
  pos = 8;
  std::int64_t steps = 0, position = 0, entries = 0;
  get(steps, "the step count");
  get(position, "the data position");
  get(entries, "the entry count");
  const bool all_here = std::all_of(stages.begin(), stages.end(), [](auto* s) { return s; });
  if (all_here) {
    std::int64_t expect = 0;
    for (auto* s : stages) expect += static_cast<std::int64_t>(s->params().size());
    BRIGADE_CHECK(entries == expect, Errc::BadFile,
                  "{}: {} parameter entries, this model and split have {}", path.string(), entries,
                  expect);
  }
  const int N = static_cast<int>(stages.size());
  std::vector<std::vector<runtime::ParamRef>> params(stages.size());
  std::vector<std::vector<std::span<float>>> state(stages.size());
  std::vector<std::size_t> next(stages.size(), 0);
  for (std::size_t v = 0; v < stages.size(); ++v) {
    if (!stages[v]) continue;
    params[v] = stages[v]->params();
    state[v] = optimizers[v]->state();
  }
  std::int32_t last_stage = 0;
  for (std::int64_t e = 0; e < entries; ++e) {
    std::int32_t stage = 0, len = 0;
    std::int64_t size = 0;
    get(stage, "a stage index");
    get(len, "a name length");
    need(static_cast<std::size_t>(std::max(0, len)), "a name");
    const std::string name = data.substr(pos, static_cast<std::size_t>(std::max(0, len)));
    pos += static_cast<std::size_t>(std::max(0, len));
    get(size, "a tensor size");
    BRIGADE_CHECK(stage >= last_stage && stage < N && size >= 0, Errc::BadFile,
                  "{}: entry (stage {}, {}, {} floats) after stage {}, the split has {} stages: "
                  "written for another model or split",
                  path.string(), stage, name, size, last_stage, N);
    last_stage = stage;
    const auto si = static_cast<std::size_t>(stage);
    const std::size_t bytes = static_cast<std::size_t>(size) * sizeof(float);
    if (!stages[si]) {  // held by another rank
      need(2 * bytes, "moments");
      pos += 2 * bytes;
      continue;
    }
    const std::size_t k = next[si]++;
    BRIGADE_CHECK(k < params[si].size() && name == params[si][k].name &&
                      size == params[si][k].full_size(),
                  Errc::BadFile,
                  "{}: entry (stage {}, {}, {} floats), expected (stage {}, {}, {} floats): "
                  "written for another model or split",
                  path.string(), stage, name, size, si,
                  k < params[si].size() ? params[si][k].name : std::string("none"),
                  k < params[si].size() ? params[si][k].full_size() : 0);
    // The entry holds the whole tensor's moments; a TP rank keeps its slice.
    const auto& p = params[si][k];
    std::vector<float> whole(static_cast<std::size_t>(size));
    for (auto span : {state[si][k], state[si][params[si].size() + k]}) {
      need(bytes, "moments");
      std::memcpy(whole.data(), data.data() + pos, bytes);
      runtime::take_shard(p, p.shard, whole.data(), span.data());
      pos += bytes;
    }
  }
  for (std::size_t v = 0; v < stages.size(); ++v) {
    if (!stages[v]) continue;
    BRIGADE_CHECK(next[v] == params[v].size(), Errc::BadFile,
                  "{}: {} entries for stage {}, it has {} parameters: written for another model "
                  "or split",
                  path.string(), next[v], v, params[v].size());
    optimizers[v]->set_steps(steps);
  }
  BRIGADE_CHECK(pos == data.size(), Errc::BadFile, "{}: {} bytes after the last entry",
                path.string(), data.size() - pos);
  return {steps, position};
}

}  // namespace detail

void TrainingEngine::save_checkpoint(const fs::path& dir, std::int64_t data_position) const {
  auto& I = *impl_;
  std::error_code ec;
  fs::create_directories(dir, ec);
  BRIGADE_CHECK(!ec, Errc::BadFile, "{}: cannot create the checkpoint folder: {}", dir.string(),
                ec.message());
  model::save_llama2c_checkpoint(dir / "model.bin", export_weights());
  std::string entries;
  std::int64_t count = 0;
  for (int v = 0; v < I.N(); ++v)
    count += detail::append_optimizer_entries(
        entries, v, detail::whole_params(I.members_of(v), I.optimizers_of(v)));
  io::write_file_atomic(dir / "optimizer.bin",
                        detail::optimizer_file_header(I.steps, data_position, count) + entries);
}

std::int64_t TrainingEngine::load_optimizer_state(const fs::path& dir) {
  auto& I = *impl_;
  std::int64_t position = 0;
  for (int t = 0; t < I.T; ++t) {  // each TP rank keeps its slices of the whole entries
    std::vector<AdamW*> optimizers;
    for (auto& o : I.optimizers[static_cast<std::size_t>(t)]) optimizers.push_back(o.get());
    const auto [steps, pos] = detail::read_optimizer_file(dir, I.pipeline(t), optimizers);
    I.steps = steps;
    position = pos;
  }
  return position;
}

std::vector<model::WorkItem> microbatch_work(std::span<const data::PackedBatch> batches) {
  std::vector<model::WorkItem> out;
  for (std::size_t m = 0; m < batches.size(); ++m) {
    const auto& b = batches[m];
    BRIGADE_CHECK(b.rows() >= 1 && b.offsets.size() >= 2, Errc::InvalidArgument,
                  "microbatch_work: micro-batch {} has {} rows in {} sequences", m, b.rows(),
                  b.offsets.empty() ? 0 : b.offsets.size() - 1);
    double attended = 0.0;
    for (std::size_t s = 0; s + 1 < b.offsets.size(); ++s)
      attended += batching::causal_pairs(b.offsets[s + 1] - b.offsets[s]);
    out.push_back(batching::varlen_work(b.rows(), static_cast<std::int64_t>(b.offsets.size()) - 1,
                                        attended));
  }
  return out;
}

namespace {

/// Inference rounds: 0 = prefill, 1 = every decode round; training: always 0.
int phase_of(const schedule::Shape& shape, int chunk) {
  return shape.mode == schedule::Mode::Inference && chunk > 0 ? 1 : 0;
}

}  // namespace

MeasuredCostModel::MeasuredCostModel(const schedule::Shape& shape, const Timeline& timeline,
                                     std::optional<cost::RooflineCostModel> sizes)
    : shape_(shape),
      mean_(static_cast<std::size_t>(kNumOps * shape.num_virtual_stages * 2), 0.0),
      latency_(static_cast<std::size_t>(shape.num_ranks * shape.num_ranks), 0.0),
      overhead_(static_cast<std::size_t>(shape.num_ranks), 0.0),
      sizes_(std::move(sizes)) {
  const int N = shape.num_virtual_stages;
  std::vector<int> n(mean_.size(), 0);
  // The first message of each SEND action (its post time) and each RECV's interval, by key.
  struct Key {
    Op op;
    int v, mb, chunk;
    auto operator<=>(const Key&) const = default;
  };
  std::map<Key, double> posted;
  std::map<Key, std::pair<double, double>> waited;
  // Per rank: its first start and last end, and the seconds in compute and in RECV waits.
  const auto P = static_cast<std::size_t>(shape.num_ranks);
  std::vector<double> first(P, std::numeric_limits<double>::infinity()), last(P, 0.0),
      accounted(P, 0.0);
  for (const auto& iv : timeline.intervals()) {
    if (iv.virtual_stage < 0 || iv.virtual_stage >= N || iv.rank < 0 ||
        iv.rank >= shape.num_ranks)
      continue;
    const auto r = static_cast<std::size_t>(iv.rank);
    first[r] = std::min(first[r], iv.start);
    if (iv.op != Op::SendF && iv.op != Op::SendB) {  // a SEND's interval runs past its post
      last[r] = std::max(last[r], iv.end);
      accounted[r] += iv.duration();
    }
    if (iv.op == Op::SendF || iv.op == Op::SendB) {
      auto [it, fresh] = posted.try_emplace({iv.op, iv.virtual_stage, iv.microbatch, iv.chunk},
                                            iv.start);
      if (!fresh) it->second = std::min(it->second, iv.start);
      continue;
    }
    if (iv.op == Op::RecvF || iv.op == Op::RecvB) {
      waited[{iv.op, iv.virtual_stage, iv.microbatch, iv.chunk}] = {iv.start, iv.end};
      continue;
    }
    const auto i = static_cast<std::size_t>(
        (static_cast<int>(iv.op) * N + iv.virtual_stage) * 2 + phase_of(shape, iv.chunk));
    mean_[i] += iv.duration();
    ++n[i];
    exact_[{static_cast<int>(iv.op), iv.virtual_stage, iv.microbatch, iv.chunk}] += iv.duration();
  }
  for (std::size_t i = 0; i < mean_.size(); ++i)
    if (n[i]) mean_[i] /= n[i];
  // The rest of each rank's time (the executor and the worker between actions: building and
  // copying messages, posting them and the receives, recording) is charged to its SENDs.
  std::vector<int> sends(P, 0);
  for (const auto& [k, t_post] : posted) ++sends[static_cast<std::size_t>(shape.rank_of(k.v))];
  for (std::size_t r = 0; r < P; ++r)
    if (sends[r] > 0 && last[r] > first[r])
      overhead_[r] = std::max(0.0, last[r] - first[r] - accounted[r]) / sends[r];
  // Delivery latency of a link: from the SEND's post to the end of its RECV, over the messages
  // whose receiver was already waiting when they were posted (otherwise the RECV's end says
  // when the receiver got there, not when the message arrived); the median of those.
  std::vector<std::vector<double>> samples(latency_.size());
  for (const auto& [k, t_post] : posted) {
    const auto recv = schedule::counterpart(shape, schedule::Action{k.op, k.v, k.mb, k.chunk});
    if (!recv) continue;
    const auto it = waited.find({recv->op, recv->virtual_stage, recv->microbatch, recv->chunk});
    if (it == waited.end() || it->second.first > t_post) continue;
    const int src = shape.rank_of(k.v), dst = shape.rank_of(recv->virtual_stage);
    const double latency = std::max(0.0, it->second.second - t_post);
    samples[static_cast<std::size_t>(src * shape.num_ranks + dst)].push_back(latency);
    message_latency_[{static_cast<int>(k.op), k.v, k.mb, k.chunk}] = latency;
  }
  for (std::size_t i = 0; i < samples.size(); ++i) {
    auto& x = samples[i];
    if (x.empty()) continue;
    std::nth_element(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(x.size() / 2), x.end());
    latency_[i] = std::max(0.0, x[x.size() / 2]);
  }
}

double MeasuredCostModel::compute_seconds(const schedule::Action& a) const noexcept {
  const int N = shape_.num_virtual_stages;
  if (is_communication(a.op) || a.virtual_stage < 0 || a.virtual_stage >= N) return 0.0;
  const auto i = static_cast<std::size_t>(
      (static_cast<int>(a.op) * N + a.virtual_stage) * 2 + phase_of(shape_, a.chunk));
  const auto it = exact_.find({static_cast<int>(a.op), a.virtual_stage, a.microbatch, a.chunk});
  if (it != exact_.end()) return it->second;
  const double m = mean_[i];
  // A phase the timeline never ran (e.g. no decode round): the other phase's mean.
  return m > 0.0 ? m : mean_[i ^ 1U];
}

double MeasuredCostModel::send_overhead_seconds(const schedule::Action& a) const noexcept {
  if (a.virtual_stage < 0 || a.virtual_stage >= shape_.num_virtual_stages) return 0.0;
  return overhead_[static_cast<std::size_t>(shape_.rank_of(a.virtual_stage))];
}

double MeasuredCostModel::message_latency_seconds(const schedule::Action& a) const noexcept {
  const auto it =
      message_latency_.find({static_cast<int>(a.op), a.virtual_stage, a.microbatch, a.chunk});
  if (it != message_latency_.end()) return it->second;
  if (a.virtual_stage < 0 || a.virtual_stage >= shape_.num_virtual_stages) return 0.0;
  const auto peer = schedule::counterpart(shape_, a);
  if (!peer) return 0.0;
  return link(shape_.rank_of(a.virtual_stage), shape_.rank_of(peer->virtual_stage)).latency_s;
}

cost::Link MeasuredCostModel::link(int src, int dst) const noexcept {
  const int P = shape_.num_ranks;
  if (src < 0 || dst < 0 || src >= P || dst >= P) return {};
  return {latency_[static_cast<std::size_t>(src * P + dst)],
          std::numeric_limits<double>::infinity()};
}

double simulated_bubble(const schedule::Schedule& lowered, const Timeline& timeline) {
  const MeasuredCostModel model(lowered.shape, timeline);
  sim::SimOptions opt;
  opt.record_timeline = false;
  return sim::simulate(lowered, model, opt).bubble_ratio;
}

}  // namespace v0
}  // namespace brigade::engine
