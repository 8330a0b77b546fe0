// `brigade train`: pipeline training of a Llama on text, driven by a schedule of the IR.
#include "cli.hpp"
#include "integrity.hpp"

#include <brigade/backend/cpu.hpp>
#include <brigade/batching/ahead.hpp>
#include <brigade/batching/dynamic.hpp>
#include <brigade/batching/order.hpp>
#include <brigade/config.hpp>
#include <brigade/cost/memory.hpp>
#include <brigade/cost/profiled.hpp>
#include <brigade/data/corpus.hpp>
#include <brigade/engine/data_parallel.hpp>
#include <brigade/engine/training.hpp>
#include <brigade/engine/training_distributed.hpp>
#include <brigade/io/trace.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/partition/partition.hpp>
#include <brigade/schedule/recompute.hpp>
#include <brigade/schedule/registry.hpp>
#include <brigade/sim/simulator.hpp>
#include <brigade/transport/in_process.hpp>
#include <brigade/tp/mpi_grid.hpp>   // declarations only; compiles without MPI
#include <brigade/tp/tensor_parallel.hpp>
#include <brigade/transport/mpi.hpp>  // mpi_world_size_from_env(); compiles without MPI

#include <fmt/core.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>
#include <unistd.h>

namespace {
namespace fs = std::filesystem;

struct TrainArgs {
  std::string model, tokenizer, synthetic = "260K", data, schedule = "1f1b", checkpoint_dir,
      trace, metrics, profile = "auto";
  int stages = 2, virtual_stages = 1, microbatches = 4, tokens_per_microbatch = 256, steps = 50,
      warmup = 10, checkpoint_every = 0, eval_every = 0;
  float lr = 1e-3f, weight_decay = 0.1f, clip = 1.0f;
  std::uint64_t seed = 42, model_seed = 1234;
  bool resume = false;
  double timeout = 120.0;
  std::string pipeline_dtype = "f32";  // --pipeline-dtype
  std::vector<std::string> batchings;  // --batching: one run per batcher, one after the other
  std::string batching;  // the run's batcher; empty: the Packer's stream under the fixed plan
  bool metrics_append = false;  // a later run of several --batching: add to the metrics file
  double memory_limit = 0.0;  // --memory-limit: bytes per micro-batch on a stage (0: the default)
  double rank_memory = 0.0;   // --rank-memory: bytes of activations per rank (0: the default)
  std::string recompute = "auto";  // --recompute auto|none
  int tp = 1, dp = 1;  // --tp: tensor-parallel degree of every stage; --dp: data-parallel replicas
  int fail_rank = -1, fail_after_steps = 1;  // fault injection (tests of runs under mpirun)
  brigade::cli::IntegrityArgs integrity;     // --verify, --inject
  CLI::Option* stages_option = nullptr;      // to tell an explicit --stages from the default
  CLI::Option* synthetic_option = nullptr;   // to tell an explicit --synthetic from the default
  CLI::Option* virtual_option = nullptr;     // to tell an explicit --virtual from the default
};

std::string format_eta(double s) {
  const int t = static_cast<int>(s + 0.5);
  return t >= 3600 ? fmt::format("{}h{:02}m", t / 3600, t % 3600 / 60)
                   : fmt::format("{}m{:02}s", t / 60, t % 60);
}

/// What run() prepared for the training loop.
struct RunData {
  const brigade::model::LlamaWeights& weights;
  const brigade::data::Corpus& corpus;
  const brigade::data::Corpus& train;
  const brigade::data::Corpus& held;
  const fs::path& data;
  int ranks;  ///< pipeline ranks (threads, or processes under MPI)
  bool mpi;   ///< started by mpirun: one process per rank
  std::string profile_origin;  ///< where the balanced split's layer times came from
  brigade::model::LayerSeconds layer_seconds;  ///< what the split (and --batching's cost) used
  int tp = 1;       ///< TP degree of every stage (--tp)
  int dp = 1;       ///< data-parallel replicas (--dp): a step takes dp x --microbatches batches
  int replica = 0;  ///< under mpirun: this process's replica (its share of a step's batches)
};

/// One step by a --batching batcher: its plan (the engine's partition, its own schedule and
/// micro-batches), the micro-batches, the pad rows and the cost model's prediction.
struct BatchedStep {
  std::optional<brigade::plan::Plan> plan;
  std::vector<brigade::data::PackedBatch> batches;
  std::int64_t padding = 0;        ///< pad rows the forward computes (target -1)
  double predicted_seconds = 0.0;  ///< DynaPipe's (S - 1) x slowest + sum, stage_cost seconds
  std::int64_t position = 0;       ///< the data stream's position after this step's samples
  std::vector<int> recomputed;     ///< the micro-batches (in the step's order) that recompute
};

/// A global batch of `samples` split by the --batching batcher: padding (samples_per_microbatch
/// = ceil(n / M), padded to each micro-batch's longest), packing (Megatron rows of
/// --tokens-per-microbatch tokens, one row per micro-batch), offsets (a token budget of
/// --tokens-per-microbatch) under --schedule with as many micro-batches as the batcher made;
/// dynamic (DynaPipe's DP under a memory limit per micro-batch, --memory-limit or one
/// --tokens-per-microbatch sequence's activations, each micro-batch in the fastest recompute
/// mode that fits, ordered by order_adaptive under --rank-memory per rank, default ranks x that
/// limit) under the adaptive schedule (or 1F1B). With an explicit --memory-limit the other
/// batchers' micro-batches are held to it too: one over it recomputes (choose_recompute, the
/// dynamic batcher's rule), one that fits in no mode is a named error.
/// The --batching memory limits: per micro-batch on a stage (--memory-limit, default one
/// --tokens-per-microbatch sequence's activations) and per rank (--rank-memory, default ranks x
/// the first).
struct MemoryCaps {
  double microbatch = 0.0, rank = 0.0;
};
MemoryCaps memory_caps(const TrainArgs& a, const brigade::batching::MicroBatchCost& cost, int P) {
  using namespace brigade;
  const std::int64_t budget = a.tokens_per_microbatch;
  MemoryCaps c;
  c.microbatch =
      a.memory_limit > 0.0
          ? a.memory_limit
          : cost.activation_bytes(batching::varlen_work(budget, 1, batching::causal_pairs(budget)));
  c.rank = a.rank_memory > 0.0 ? a.rank_memory : P * c.microbatch;
  return c;
}

BatchedStep batch_step(const TrainArgs& a, std::span<const brigade::data::Sample> samples,
                       const brigade::plan::Plan& base, const brigade::batching::MicroBatchCost& cost) {
  using namespace brigade;
  const int P = base.shape().num_ranks;
  std::vector<batching::SampleLength> lengths;
  for (const auto& smp : samples)
    lengths.push_back({static_cast<std::int64_t>(smp.tokens.size()) - 1, smp.task,
                       static_cast<std::int64_t>(lengths.size())});
  const std::int64_t budget = a.tokens_per_microbatch;
  const auto [limit, rank_limit] = memory_caps(a, cost, P);
  batching::DynamicOptions opt;
  opt.recompute = a.recompute == "auto";
  opt.peak_limit_bytes = rank_limit;
  BatchedStep out;
  std::vector<batching::MicroBatch> mbs;
  std::vector<double> seconds;
  if (a.batching == "dynamic") {
    const auto dyn = batching::DynamicBatcher(cost, P, limit, opt).solve(lengths);
    const auto ordered = batching::order_adaptive(dyn.costs, P, rank_limit);
    for (const int m : ordered.order) {
      const auto k = static_cast<std::size_t>(m);
      mbs.push_back(dyn.microbatches[k]);
      seconds.push_back(dyn.costs.seconds[k]);
      if (dyn.costs.recompute[k] != 0) out.recomputed.push_back(static_cast<int>(mbs.size()) - 1);
    }
    out.plan.emplace(base.partition(), ordered.schedule, batching::work_of(mbs));
  } else {
    if (a.batching == "padding") {
      const auto n = static_cast<int>(samples.size());
      mbs = batching::PaddingBatcher{(n + a.microbatches - 1) / a.microbatches}.plan(lengths);
    } else if (a.batching == "packing") {
      mbs = batching::PackingBatcher{a.tokens_per_microbatch, 1}.plan(lengths);
    } else {
      mbs = batching::OffsetsBatcher{budget}.plan(lengths);
    }
    std::vector<char> flags(mbs.size(), 0);
    for (std::size_t m = 0; m < mbs.size(); ++m) {
      if (a.memory_limit <= 0.0) {  // no cap given: the static batchers run as they are
        seconds.push_back(cost.seconds(mbs[m].work));
        continue;
      }
      const auto c = batching::choose_recompute(cost, mbs[m].work, limit, opt);
      BRIGADE_CHECK(c.fits, Errc::InvalidArgument,
                    "--batching {}: micro-batch {} ({} rows, {} samples) needs {} bytes of "
                    "activations on a stage, more than --memory-limit {} bytes{}",
                    a.batching, m, mbs[m].work.tokens, mbs[m].samples.size(), c.activation_bytes,
                    limit,
                    opt.recompute ? fmt::format(", and with full recompute it keeps {} bytes and "
                                                "peaks at {} (--rank-memory {} bytes)",
                                                c.checkpoint_bytes, c.activation_bytes, rank_limit)
                                  : std::string(" (--recompute none)"));
      seconds.push_back(c.seconds);
      if (c.mode == batching::Recompute::Full) {
        flags[m] = 1;
        out.recomputed.push_back(static_cast<int>(m));
      }
    }
    schedule::Params params;
    params.ranks = P;
    params.virtual_stages = base.shape().num_virtual_stages / P;
    params.microbatches = static_cast<int>(mbs.size());
    out.plan.emplace(base.partition(),
                     schedule::with_recompute(schedule::generate(a.schedule, params),
                                              out.recomputed.empty() ? std::span<const char>()
                                                                     : std::span<const char>(flags)),
                     batching::work_of(mbs));
  }
  for (const auto& mb : mbs) {
    out.padding += mb.padding_tokens();
    out.batches.push_back(a.batching == "padding"   ? data::pack_padded(samples, mb)
                          : a.batching == "packing" ? data::pack_rows(samples, mb, budget)
                                                    : data::pack_offsets(samples, mb));
  }
  out.predicted_seconds = batching::predicted_iteration_seconds(seconds, P);
  return out;
}

/// What one run of the training loop did (one row of the --batching table).
struct RunSummary {
  std::string batching;
  int steps = 0;
  std::int64_t tokens = 0;         ///< useful (non-pad) targets trained on
  std::int64_t padding = 0;        ///< pad rows computed
  double seconds = 0.0;            ///< measured step seconds, summed
  double predicted_seconds = 0.0;  ///< the cost model's iteration seconds, summed
  std::vector<double> peak_measured, peak_simulated;  ///< per rank, bytes, the most over steps
  double loss = 0.0;                                  ///< the last step's loss
  std::int64_t microbatches = 0;  ///< micro-batches run, over all steps
  std::int64_t recomputed = 0;    ///< of them, those that recomputed
};

/// What the loop calls to run a step over the integrity decorators and to read what they saw.
struct StepHooks {
  /// One training step over this process's decorated transports.
  std::function<brigade::engine::StepResult(const brigade::plan::Plan&,
                                            std::span<const brigade::data::PackedBatch>)>
      step;
  /// Integrity counts so far over every rank (collective under MPI: every rank calls it).
  std::function<brigade::cli::IntegrityCounts()> counts;
  /// Adds this process's verdicts since the last call to a step's timeline as marks.
  std::function<void(brigade::engine::StepResult&)> mark;
  /// This process's verdict report (empty without --verify and --inject).
  std::function<std::string()> report;
};

/// Pipeline 0 of replica 0's part of a step: its Timeline (P rows) and its ranks' peak memory.
/// On threads with TP or DP the step's Timeline has a row per rank of the grid (replica r's grid
/// rank g at row r G + g, pipeline rank p of TP rank 0 at g = p x tp); under mpirun it is already
/// the pipeline's (gathered on its rank 0).
std::pair<brigade::Timeline, std::vector<double>> pipeline_zero(const brigade::engine::StepResult& r,
                                                                const RunData& d) {
  if (d.mpi || (d.tp == 1 && d.dp == 1)) return {r.timeline, r.peak_memory_bytes};
  brigade::Timeline tl(d.ranks);
  for (brigade::Interval iv : r.timeline.intervals()) {
    if (iv.rank >= d.ranks * d.tp || iv.rank % d.tp != 0) continue;
    iv.rank /= d.tp;
    tl.add(std::move(iv));
  }
  std::vector<double> peaks;
  for (int p = 0; p < d.ranks; ++p)
    if (static_cast<std::size_t>(p * d.tp) < r.peak_memory_bytes.size())
      peaks.push_back(r.peak_memory_bytes[static_cast<std::size_t>(p * d.tp)]);
  return {std::move(tl), std::move(peaks)};
}

/// The training loop, shared by the in-process TrainingEngine and the per-process
/// DistributedTrainer (same member functions, every call collective for the latter); only
/// `root` prints and writes the metrics, the checkpoint's files and the trace.
template <class Engine>
RunSummary train_loop(Engine& eng, const TrainArgs& a, const RunData& d, bool root,
                      const StepHooks& hooks) {
  using namespace brigade;
  const fs::path ckpt = a.checkpoint_dir;
  auto say = [root]<class... A>(fmt::format_string<A...> f, A&&... args) {
    if (root) fmt::print(stderr, f, std::forward<A>(args)...);
  };
  data::Packer packer(d.train.samples, a.tokens_per_microbatch, a.seed);
  if (a.resume) packer.seek(eng.load_optimizer_state(ckpt));
  data::Packer eval_packer(d.held.samples, a.tokens_per_microbatch, 0);
  std::vector<data::PackedBatch> eval;
  for (int i = 0; i < std::max(1, std::min<int>(8, static_cast<int>(d.held.samples.size()) / 4)); ++i)
    eval.push_back(eval_packer.next());

  say("model: {} layers, dim {}, vocab {} | data: {} ({} tasks, {} train / {} held-out "
      "samples, {} tokens)\n"
      "schedule: {} on {} ranks x {} virtual, {} micro-batches of <= {} tokens{}\n",
      d.weights.config.n_layers, d.weights.config.dim, d.weights.config.vocab_size,
      d.data.string(), d.corpus.tasks.size(), d.train.samples.size(), d.held.samples.size(),
      d.corpus.num_tokens(), a.schedule, d.ranks, a.virtual_stages,
      d.dp > 1 ? fmt::format("{} (per replica) x {} replicas", a.microbatches, d.dp)
               : std::to_string(a.microbatches),
      a.tokens_per_microbatch,
      a.batching.empty() ? std::string()
                         : fmt::format("; batching {}: a global batch of <= {} tokens per step",
                                       a.batching,
                                       static_cast<std::int64_t>(a.microbatches) *
                                           a.tokens_per_microbatch));
  const auto cost = batching::stage_cost(model::ModelSpec(d.weights.config),
                                         eng.plan().partition(), d.layer_seconds);
  say("partition: {} (profile {})\n", eng.plan().partition().to_string(), d.profile_origin);
  if (a.batching == "dynamic" || a.memory_limit > 0.0) {
    const auto caps = memory_caps(a, cost, eng.plan().shape().num_ranks);
    say("memory: {:.6g} bytes of activations per micro-batch on a stage ({}), {:.6g} per rank "
        "({}); recompute {}\n",
        caps.microbatch,
        a.memory_limit > 0.0 ? "--memory-limit"
                             : fmt::format("one {}-token sequence's", a.tokens_per_microbatch),
        caps.rank, a.rank_memory > 0.0 ? "--rank-memory" : "ranks x the micro-batch limit",
        a.recompute);
  }
  const int grid_ranks = d.ranks * d.tp * d.dp;
  if (d.mpi && grid_ranks == d.ranks)
    say("transport: MPI, {} processes (one pipeline rank each)\n", d.ranks);
  else if (d.mpi)
    say("transport: MPI, {} processes (one TP rank of a stage of one replica each; grid {})\n",
        grid_ranks, tp::Grid{d.tp, d.ranks, d.dp}.describe());
  else if (grid_ranks > d.ranks)
    say("tensor x pipeline x data parallel: grid {} = {} threads\n",
        tp::Grid{d.tp, d.ranks, d.dp}.describe(), grid_ranks);
  const double eval_before = eng.evaluate(eval);
  say("held-out loss at step {}: {:.4f}\n", eng.steps(), eval_before);

  std::unique_ptr<std::ofstream> metrics;
  if (root && !a.metrics.empty()) {
    metrics = std::make_unique<std::ofstream>(
        a.metrics, a.resume || a.metrics_append ? std::ios::app : std::ios::trunc);
    BRIGADE_CHECK(metrics->good(), Errc::BadFile, "{}: cannot open for writing", a.metrics);
  }
  const bool tty = isatty(fileno(stderr)) != 0;
  Timeline trace_tl(d.ranks);
  double measured_sum = 0, simulated_sum = 0, seconds = 0;
  std::vector<double> peak_measured, peak_simulated;  // per rank, the most over the steps
  std::int64_t tokens = 0, padding = 0;
  double predicted_sum = 0;  // --batching: the cost model's iteration seconds, summed
  std::int64_t microbatches = 0, recomputed = 0;  // over the steps
  double last_loss = 0;
  int done = 0, dropped = 0, skipped = 0;
  cli::IntegrityCounts seen;  // the integrity counts up to the last step
  // The optimizer's step count does not advance on a skipped update: the loop counts its own.
  const std::int64_t first = eng.steps();
  // Each step's global batch and plan are made on a background thread while the step before
  // runs (DynaPipe plans ahead of execution): the same plans, in the same order, as planning
  // in the loop (only the planning thread touches the packer).
  batching::PlanAhead<BatchedStep> ahead(
      [&] {
        BatchedStep bs;
        if (a.batching.empty()) {
          // With DP a step is every replica's micro-batches, replica r's at [r M, (r + 1) M).
          for (int m = 0; m < a.microbatches * d.dp; ++m) bs.batches.push_back(packer.next());
        } else {
          bs = batch_step(a,
                          packer.next_samples(static_cast<std::int64_t>(a.microbatches) *
                                              a.tokens_per_microbatch),
                          eng.plan(), cost);
        }
        bs.position = packer.position();
        return bs;
      },
      std::max<std::int64_t>(0, a.steps - first));
  for (std::int64_t step = first; step < a.steps; ++step) {
    std::vector<double> step_peak_simulated;  // per rank, root only
    const BatchedStep bs = ahead.next();
    const auto& batches = bs.batches;
    const plan::Plan& step_plan = bs.plan ? *bs.plan : eng.plan();
    auto r = hooks.step(step_plan, batches);
    hooks.mark(r);
    const auto now = hooks.counts();
    dropped += static_cast<int>(r.dropped_microbatches.size());
    skipped += r.update_skipped ? 1 : 0;
    // The measured-vs-simulated columns are one pipeline's: with TP or DP on threads the
    // Timeline has a row per rank of the grid, pipeline 0 of replica 0 the rows p x tp.
    const auto [pipe_tl, pipe_peaks] = pipeline_zero(r, d);
    measured_sum += pipe_tl.bubble_ratio();
    if (root) {
      // One simulation of the step with its measured action costs and the memory of its
      // micro-batches (the plan with their work, priced by the roofline model's sizes).
      const auto replica_batches =
          std::span<const data::PackedBatch>(batches).first(batches.size() / static_cast<std::size_t>(d.dp));
      const plan::Plan with_work(step_plan.partition(), step_plan.schedule(),
                                 engine::microbatch_work(replica_batches), step_plan.execution());
      const engine::MeasuredCostModel costs(
          with_work.shape(), pipe_tl,
          cost::RooflineCostModel(model::ModelSpec(d.weights.config), with_work));
      sim::SimOptions so;
      so.record_timeline = false;
      const auto predicted = sim::simulate(with_work, costs, so);
      simulated_sum += predicted.bubble_ratio;
      peak_measured.resize(pipe_peaks.size(), 0.0);
      peak_simulated.resize(predicted.peak_memory_bytes.size(), 0.0);
      for (std::size_t k = 0; k < peak_measured.size(); ++k)
        peak_measured[k] = std::max(peak_measured[k], pipe_peaks[k]);
      for (std::size_t k = 0; k < peak_simulated.size(); ++k)
        peak_simulated[k] = std::max(peak_simulated[k], predicted.peak_memory_bytes[k]);
      step_peak_simulated = predicted.peak_memory_bytes;
    }
    padding += bs.padding;
    predicted_sum += bs.predicted_seconds;
    microbatches += static_cast<std::int64_t>(batches.size());
    recomputed += static_cast<std::int64_t>(bs.recomputed.size());
    seconds += r.seconds;
    tokens += r.tokens;
    ++done;
    if (step == first && !a.trace.empty()) trace_tl = r.timeline;
    const double tps = static_cast<double>(tokens) / seconds;
    const double eta = seconds / done * static_cast<double>(a.steps - step - 1);
    const int width = 24, filled = static_cast<int>(width * (step + 1) / a.steps);
    const std::string bar = std::string(static_cast<std::size_t>(filled), '#') +
                            std::string(static_cast<std::size_t>(width - filled), '.');
    std::string line = fmt::format("[{}] step {}/{} loss {:.4f} lr {:.2e} {:.0f} tokens/s ETA {}",
                                   bar, step + 1, a.steps, r.loss, r.lr, tps, format_eta(eta));
    if (!a.integrity.verify.empty())
      line += fmt::format(" | flagged {} of {}", now.flagged, now.checked);
    if (tty)
      say("\r{}", line);
    else if ((step + 1) % 10 == 0 || step + 1 == a.steps || step == first)
      say("{}\n", line);
    if (metrics) {
      nlohmann::json j{{"step", step + 1}, {"loss", r.loss}, {"tokens", r.tokens},
                       {"seconds", r.seconds}, {"lr", r.lr}, {"grad_norm", r.grad_norm},
                       {"bubble_measured", r.timeline.bubble_ratio()},
                       {"peak_memory_bytes", r.peak_memory_bytes}};
      j["useful_tokens_per_s"] = static_cast<double>(r.tokens) / r.seconds;
      j["peak_memory_bytes_simulated"] = step_peak_simulated;
      if (!r.task_loss.empty()) {
        // The mean loss of each task the step trained on, by the corpus's task names.
        nlohmann::json per = nlohmann::json::object();
        for (std::size_t t = 0; t < r.task_loss.size(); ++t)
          if (r.task_loss[t].count > 0)
            per[d.corpus.tasks.at(t)] = {{"loss", r.task_loss[t].mean()},
                                         {"tokens", r.task_loss[t].count}};
        j["task_loss"] = std::move(per);
      }
      if (!a.batching.empty()) {
        j["batching"] = a.batching;
        j["microbatches"] = batches.size();
        j["padding_tokens"] = bs.padding;
        j["predicted_seconds"] = bs.predicted_seconds;
        j["recompute_microbatches"] = bs.recomputed;
      }
      std::int64_t sent = 0;
      for (int rank = 0; rank < r.timeline.num_ranks(); ++rank) sent += r.timeline.bytes(rank, true);
      j["sent_bytes"] = sent;
      if (a.integrity.active()) {
        // This step's integrity counts over every rank, and what the drop policy did.
        j["checked"] = now.checked - seen.checked;
        j["flagged"] = now.flagged - seen.flagged;
        j["injected"] = now.injected - seen.injected;
        j["injected_flagged"] = now.caught - seen.caught;
        j["dropped_microbatches"] = r.dropped_microbatches;
        j["update_skipped"] = r.update_skipped;
      }
      *metrics << j.dump() << "\n";
      metrics->flush();
    }
    seen = now;
    last_loss = r.loss;
    const bool last = step + 1 == a.steps;
    if (!a.checkpoint_dir.empty() && (last || (a.checkpoint_every > 0 && (step + 1) % a.checkpoint_every == 0)))
      eng.save_checkpoint(ckpt, bs.position);
    if (a.eval_every > 0 && (step + 1) % a.eval_every == 0 && !last) {
      if (tty) say("\n");
      say("held-out loss at step {}: {:.4f}\n", step + 1, eng.evaluate(eval));
    }
  }
  if (tty && done) say("\n");
  const double eval_after = eng.evaluate(eval);
  say("held-out loss at step {}: {:.4f} (was {:.4f})\n", eng.steps(), eval_after, eval_before);
  if (done) {
    say("{} steps, {} tokens, {:.1f} tokens/s; bubble ratio measured {:.3f}, simulated "
        "{:.3f} for the same schedule and measured action costs\n",
        done, tokens, static_cast<double>(tokens) / seconds, measured_sum / done,
        simulated_sum / done);
    if (!a.batching.empty())
      say("batching {}: {:.1f} useful (non-pad) tokens/s measured, {:.1f} predicted by the cost "
          "model ((S - 1) x slowest + sum of micro-batch seconds); {} pad tokens computed; {} of "
          "{} micro-batches recomputed (full recompute where a micro-batch's activations did "
          "not fit)\n",
          a.batching, static_cast<double>(tokens) / seconds,
          static_cast<double>(tokens) / predicted_sum, padding, recomputed, microbatches);
    auto mib = [](const std::vector<double>& v) {
      std::string out;
      for (double x : v) out += fmt::format("{}{:.2f}", out.empty() ? "" : " ", x / (1 << 20));
      return out;
    };
    say("peak memory per rank (MiB of activations, messages held and window buffers): "
        "measured {}, simulated {}{}\n",
        mib(peak_measured), mib(peak_simulated),
        d.tp > 1 ? fmt::format(" (measured: TP rank 0 of each stage; simulated: the whole "
                               "stage, the memory model does not split TP {})",
                               d.tp)
                 : std::string());
    if (a.integrity.active()) {
      say("integrity: {} messages checked, {} flagged; {} micro-batches dropped, {} updates "
          "skipped; {} messages corrupted, {} of them flagged\n",
          seen.checked, seen.flagged, dropped, skipped, seen.injected, seen.caught);
    }
  }
  if (a.integrity.active()) {
    // Every process reports the streams its own ranks received.
    const std::string lines = hooks.report();
    if (!lines.empty()) fmt::print(stderr, "{}", lines);
  }
  if (!a.checkpoint_dir.empty())
    say("checkpoint: {} (brigade generate --model {})\n", (ckpt / "model.bin").string(),
        (ckpt / "model.bin").string());
  if (root && !a.trace.empty()) io::write_chrome_trace(a.trace, trace_tl, "rank");
  return {a.batching,    done,           tokens,    padding,      seconds,   predicted_sum,
          peak_measured, peak_simulated, last_loss, microbatches, recomputed};
}

/// The --batching table of several runs: useful tokens/s measured and predicted, pad tokens,
/// mean step seconds measured beside the cost model's, and each rank's peak memory simulated
/// beside measured.
std::string batching_table(std::span<const RunSummary> runs) {
  auto mib = [](const std::vector<double>& v) {
    std::string out;
    for (double x : v) out += fmt::format("{}{:.1f}", out.empty() ? "" : "/", x / (1 << 20));
    return out;
  };
  std::string out = fmt::format(
      "{:<9} {:>10} {:>10} {:>10} {:>12} {:>10} {:>10}  {:<24} {:<24}\n", "batching",
      "useful t/s", "predicted", "pad tokens", "recomputed", "step s", "predicted",
      "peak MiB/rank measured", "peak MiB/rank simulated");
  for (const auto& r : runs) {
    const double steps = std::max(1, r.steps);
    out += fmt::format("{:<9} {:>10.1f} {:>10.1f} {:>10} {:>12} {:>10.4f} {:>10.4f}  {:<24} {:<24}\n",
                       r.batching, static_cast<double>(r.tokens) / r.seconds,
                       static_cast<double>(r.tokens) / r.predicted_seconds, r.padding,
                       fmt::format("{}/{}", r.recomputed, r.microbatches), r.seconds / steps,
                       r.predicted_seconds / steps, mib(r.peak_measured), mib(r.peak_simulated));
  }
  const auto find = [&](const char* name) -> const RunSummary* {
    for (const auto& r : runs)
      if (r.batching == name) return &r;
    return nullptr;
  };
  if (const auto* dyn = find("dynamic")) {
    const auto rate = [](const RunSummary& r, bool measured) {
      return static_cast<double>(r.tokens) / (measured ? r.seconds : r.predicted_seconds);
    };
    for (const auto& r : runs)
      if (&r != dyn)
        out += fmt::format("dynamic / {}: {:.2f}x measured, {:.2f}x predicted\n", r.batching,
                           rate(*dyn, true) / rate(r, true), rate(*dyn, false) / rate(r, false));
  }
  return out;
}

int run(const TrainArgs& a) {
  using namespace brigade;
  // Under mpirun: one process per pipeline rank; rank 0 prints (README, "Several processes").
  const cli::MpiLaunch launch(a.fail_rank);
  const bool under_mpi = launch.active();
  a.integrity.check(launch.rank() == 0);
  // With --tp or --dp under mpirun the processes are the grid DP x PP x TP (TP fastest):
  // --stages = world / (tp x dp).
  const int per_stage = a.tp * a.dp;  // ranks per pipeline rank of the grid
  const int num_ranks = [&] {
    if (!under_mpi || per_stage == 1) return launch.ranks(a.stages, a.stages_option, "pipeline rank");
    const std::string degrees = a.tp > 1 && a.dp > 1 ? fmt::format("--tp {} x --dp {}", a.tp, a.dp)
                                : a.tp > 1         ? fmt::format("--tp {}", a.tp)
                                                   : fmt::format("--dp {}", a.dp);
    BRIGADE_CHECK(launch.world() % per_stage == 0, Errc::InvalidArgument,
                  "{} does not divide the {} processes mpirun started (the grid DP x PP x TP "
                  "needs --dp x --stages x --tp processes)",
                  degrees, launch.world());
    if (a.stages_option->count() > 0)
      tp::check_grid_ranks(tp::Grid{a.tp, a.stages, a.dp}, launch.world(),
                           "processes mpirun started");
    return launch.world() / per_stage;
  }();
  if (per_stage > 1) {
    // What the tensor- and data-parallel runs do not combine with (each its own path to build).
    const std::pair<bool, const char*> unsupported[] = {
        {a.integrity.active(), "--verify/--inject"},
        {a.fail_rank >= 0, "--fail-rank"},
        {a.dp > 1 && !a.batchings.empty(), "--batching (with --dp)"}};
    for (const auto& [given, flag] : unsupported)
      BRIGADE_CHECK(!given, Errc::InvalidArgument,
                    "--tp {} --dp {} does not combine with {} (tensor- and data-parallel training "
                    "runs plain transports, and a step's micro-batches go M to each replica)",
                    a.tp, a.dp, flag);
  }
  // Model: a checkpoint (or the last checkpoint with --resume), or a synthetic Llama.
  model::LlamaWeights weights;
  const fs::path ckpt = a.checkpoint_dir;
  if (a.resume) {
    BRIGADE_CHECK(!a.checkpoint_dir.empty(), Errc::InvalidArgument,
                  "--resume needs --checkpoint-dir (the folder of a previous run's checkpoint)");
    weights = model::load_llama2c_checkpoint(ckpt / "model.bin");
  } else if (!a.model.empty()) {
    weights = model::load_llama2c_checkpoint(a.model);
  } else {
    weights = model::make_synthetic_weights(model::named_config(a.synthetic), a.model_seed);
  }
  BRIGADE_CHECK(!a.tokenizer.empty() || (a.model.empty() && !a.resume) ||
                    (a.synthetic_option != nullptr && a.synthetic_option->count() > 0),
                Errc::InvalidArgument,
                "{} needs --tokenizer (the llama2.c tokenizer the model was trained with); pass "
                "--synthetic SIZE instead to resume a synthetic run with its made-up vocabulary",
                a.resume ? "--resume" : "--model");
  const model::Tokenizer tok =
      a.tokenizer.empty() ? model::Tokenizer::synthetic(weights.config.vocab_size, a.model_seed)
                          : model::Tokenizer::load_llama2c(a.tokenizer, weights.config.vocab_size);
  const fs::path data = a.data.empty() ? data::default_corpus_path() : fs::path(a.data);
  const int max_tokens = std::min(weights.config.seq_len, a.tokens_per_microbatch + 1);
  const auto corpus = cli::load_text_corpus(data.string(), tok, max_tokens);
  if (corpus.truncated_samples > 0 && launch.rank() == 0)
    fmt::print(stderr,
               "brigade: notice: {} of {} samples are longer than {} tokens ({}) and were cut to "
               "it, dropping {} of {} tokens; raise --tokens-per-microbatch to keep them whole\n",
               corpus.truncated_samples, corpus.samples.size(), max_tokens,
               max_tokens == weights.config.seq_len
                   ? fmt::format("the model's seq_len {}", weights.config.seq_len)
                   : fmt::format("--tokens-per-microbatch {} + 1", a.tokens_per_microbatch),
               corpus.truncated_tokens, corpus.num_tokens() + corpus.truncated_tokens);
  if (a.warmup > a.steps && launch.rank() == 0)
    fmt::print(stderr,
               "brigade: notice: --warmup {} is more than --steps {}: the learning rate warms up "
               "over all {} steps and never decays\n",
               a.warmup, a.steps, a.steps);
  // Heads, KV heads, the MLP and the vocabulary against --tp, before anything runs.
  if (a.tp > 1) tp::check_tensor_parallel_training(weights.config, a.tp);
  const auto [train, held] = data::split_held_out(corpus, 20);
  BRIGADE_CHECK(!train.samples.empty() && !held.samples.empty(), Errc::BadFile,
                "{}: too few samples to hold out 1 in 20 for evaluation ({} found)", data.string(),
                corpus.samples.size());

  engine::TrainingConfig cfg;
  cfg.schedule = a.schedule;
  cfg.ranks = num_ranks;
  cfg.virtual_stages = a.virtual_stages;
  cfg.microbatches = a.microbatches;
  cfg.optimizer.lr = a.lr;
  cfg.optimizer.min_lr = a.lr / 10;
  cfg.optimizer.warmup_steps = std::max(1, std::min(a.warmup, a.steps));
  cfg.optimizer.decay_steps = a.steps;
  cfg.optimizer.weight_decay = a.weight_decay;
  cfg.optimizer.clip_norm = a.clip;
  cfg.timeout_s = a.timeout;
  cfg.pipeline_dtype = *parse_dtype(a.pipeline_dtype);
  cfg.seq_len_hint = a.tokens_per_microbatch;
  cfg.tp = a.tp;
  // The balanced split prices each layer's forward and backward passes on this machine's
  // profile (one intra-op thread per rank, every rank's core busy).
  const cli::ResolvedProfile resolved = cli::resolve_profile(
      a.profile, std::max(1, static_cast<int>(std::thread::hardware_concurrency())), under_mpi,
      cpu::cpu_model_name());
  if (resolved.profile) {
    cfg.layer_seconds = cost::ProfiledLayerTimes(*resolved.profile, 1, num_ranks);
    // The plan must fit the device (cost::training_memory): under mpirun each rank its own
    // (training_plan checks cfg.devices), as threads all ranks together (TrainingEngine: each
    // stage copies its weights, the tied gradients are summed in place).
    if (under_mpi) {
      cfg.devices = {*resolved.profile};
    } else {
      const model::ModelSpec spec(weights.config);
      cost::check_holds_weights(*resolved.profile, cost::model_weight_bytes(spec));
      cost::TrainingMemoryOptions mo;
      mo.tied_gradient_copies = 0;
      mo.workload = {1, cfg.seq_len_hint};
      // --dp replicas each hold their own copies; a TP rank's shards of the weights, gradients
      // and moments add up to its stage's (TP is priced as the TP 1 pipeline).
      const auto pipeline = cost::training_memory(spec, engine::training_plan(weights.config, cfg), mo);
      std::vector<cost::MemoryBreakdown> ranks;
      for (int r = 0; r < a.dp; ++r) ranks.insert(ranks.end(), pipeline.begin(), pipeline.end());
      cost::check_one_process(ranks, *resolved.profile, "brigade train");
    }
  }
  const bool dynamic = std::find(a.batchings.begin(), a.batchings.end(), "dynamic") !=
                       a.batchings.end();
  BRIGADE_CHECK(!dynamic || a.virtual_stages == 1, Errc::InvalidArgument,
                "--batching dynamic runs DynaPipe's adaptive schedule over one stage per rank; "
                "--virtual {} (from --schedule {}) must be 1",
                a.virtual_stages, a.schedule);
  BRIGADE_CHECK(!a.batchings.empty() || (a.memory_limit <= 0.0 && a.rank_memory <= 0.0),
                Errc::InvalidArgument,
                "--memory-limit and --rank-memory hold the micro-batches of --batching; without "
                "--batching a step runs --microbatches micro-batches of the data stream");
  const bool several =
      std::set<std::string>(a.batchings.begin(), a.batchings.end()).size() > 1;
  BRIGADE_CHECK(!several || (a.checkpoint_dir.empty() && !a.resume), Errc::InvalidArgument,
                "--batching {}: several batchers run one after another from the same initial "
                "model; --checkpoint-dir and --resume take one batcher",
                fmt::join(a.batchings, ","));
  // One run per batcher (or one without --batching), each from the same weights on the same
  // global batches (the data order's seed restarts), the rows of one table at the end.
  std::vector<std::string> runs;
  for (const auto& b : a.batchings)
    if (std::find(runs.begin(), runs.end(), b) == runs.end()) runs.push_back(b);
  if (runs.empty()) runs.emplace_back();
  std::vector<RunSummary> summaries;
  const auto run_args = [&](const std::string& b) {
    TrainArgs one = a;
    one.batching = b;
    one.metrics_append = b != runs.front();
    if (several && !a.trace.empty()) {
      const fs::path t(a.trace);  // trace.json -> trace.<batching>.json
      one.trace = (t.parent_path() / (t.stem().string() + "." + b + t.extension().string())).string();
    }
    return one;
  };
  const auto print_table = [&](bool root) {
    if (root && several)
      fmt::print(stderr, "\n{} ranks, {} steps per batcher, the same samples:\n{}", num_ranks,
                 a.steps, batching_table(summaries));
    return 0;
  };
  const RunData d{weights, corpus, train, held, data, num_ranks, under_mpi,
                  resolved.profile ? resolved.profile->name + ", " + resolved.origin
                                   : resolved.origin,
                  cfg.layer_seconds, a.tp, a.dp};
  const std::vector<transport::MessageKind> checked{transport::MessageKind::Activation,
                                                    transport::MessageKind::Gradient};
#if BRIGADE_HAS_MPI
  if (under_mpi && per_stage > 1) {
    // The grid DP x PP x TP: this process's pipeline, its stages' TP group, its DP group.
    tp::MpiGrid grid(tp::Grid{a.tp, num_ranks, a.dp}, a.timeout);
    RunData dd = d;
    dd.replica = grid.dp_rank();
    for (const auto& batcher : runs) {
      const TrainArgs one = run_args(batcher);
      engine::DistributedTrainer<transport::MpiTransport> eng(
          grid.pipeline(), weights, cfg, {}, {grid.tp_group(), grid.dp_group()});
      const auto M = static_cast<std::size_t>(a.microbatches);
      const StepHooks hooks{[&](const plan::Plan& p, std::span<const data::PackedBatch> b) {
                              // Replica d trains on its share of the step's micro-batches.
                              return a.dp > 1 ? eng.train_step(p, b.subspan(dd.replica * M, M))
                                              : eng.train_step(p, b);
                            },
                            [] { return cli::IntegrityCounts{}; },
                            [](engine::StepResult&) {}, [] { return std::string(); }};
      summaries.push_back(train_loop(eng, one, dd, grid.world_rank() == 0, hooks));
    }
    return print_table(grid.world_rank() == 0);
  }
  if (under_mpi) {
    transport::MpiTransport tp;
    for (const auto& batcher : runs) {
      const TrainArgs one = run_args(batcher);
      cli::IntegrityStack<transport::MpiTransport> stack(std::span(&tp, 1), a.integrity, checked,
                                                         weights.config.vocab_size);
      auto& outer = stack.transports()[0];
      engine::DistributedTrainer<std::remove_reference_t<decltype(outer)>> eng(
          outer, weights, cfg, {a.fail_rank, a.fail_after_steps});
      // The counts of every process, summed (a collective each step, only with integrity flags).
      std::optional<transport::MpiCollectives> group;
      if (a.integrity.active()) group.emplace();
      const StepHooks hooks{[&](const plan::Plan& p, std::span<const data::PackedBatch> b) {
                              stack.expect(b);
                              return eng.train_step(p, b);
                            },
                            [&] {
                              const auto c = stack.counts();
                              if (!group) return c;
                              std::vector<double> v{
                                  static_cast<double>(c.checked), static_cast<double>(c.flagged),
                                  static_cast<double>(c.injected), static_cast<double>(c.caught)};
                              group->all_reduce(std::span(v), transport::ReduceOp::Sum,
                                                transport::Deadline::after(a.timeout));
                              return cli::IntegrityCounts{
                                  static_cast<std::int64_t>(v[0]), static_cast<std::int64_t>(v[1]),
                                  static_cast<std::int64_t>(v[2]), static_cast<std::int64_t>(v[3])};
                            },
                            [&](engine::StepResult& r) { stack.mark(r.timeline, r.origin); },
                            [&] { return cli::with_rank(stack.report(), tp.rank()); }};
      summaries.push_back(train_loop(eng, one, d, tp.rank() == 0, hooks));
    }
    return print_table(tp.rank() == 0);
  }
#endif
  if (per_stage > 1) {
    // Threads: dp replicas of tp pipelines of num_ranks ranks (TrainingEngine with TP, inside
    // DataParallelTrainer with --dp).
    for (const auto& batcher : runs) {
      const TrainArgs one = run_args(batcher);
      const StepHooks none{{}, [] { return cli::IntegrityCounts{}; }, [](engine::StepResult&) {},
                           [] { return std::string(); }};
      if (a.dp > 1) {
        engine::DataParallelTrainer eng(weights, cfg, a.dp);
        StepHooks hooks = none;
        hooks.step = [&](const plan::Plan&, std::span<const data::PackedBatch> b) {
          return eng.train_step(b);
        };
        summaries.push_back(train_loop(eng, one, d, true, hooks));
      } else {
        engine::TrainingEngine eng(weights, cfg);
        StepHooks hooks = none;
        hooks.step = [&](const plan::Plan& p, std::span<const data::PackedBatch> b) {
          return eng.train_step(p, b);
        };
        summaries.push_back(train_loop(eng, one, d, true, hooks));
      }
    }
    return print_table(true);
  }
  for (const auto& batcher : runs) {
    const TrainArgs one = run_args(batcher);
    transport::InProcessFabric fabric(num_ranks);
    auto endpoints = transport::endpoints(fabric);
    const std::span<transport::InProcessTransport> ranks(endpoints);
    cli::IntegrityStack<transport::InProcessTransport> stack(ranks, a.integrity, checked,
                                                             weights.config.vocab_size);
    engine::TrainingEngine eng(weights, cfg);
    const StepHooks hooks{[&](const plan::Plan& p, std::span<const data::PackedBatch> b) {
                            stack.expect(b);
                            return eng.train_step(stack.transports(), p, b);
                          },
                          [&] { return stack.counts(); },
                          [&](engine::StepResult& r) { stack.mark(r.timeline, r.origin); },
                          [&] { return stack.report(); }};
    summaries.push_back(train_loop(eng, one, d, true, hooks));
  }
  return print_table(true);
}

std::function<int()> setup(CLI::App& sub) {
  auto a = std::make_shared<TrainArgs>();
  sub.add_option("--model", a->model, "initial llama2.c checkpoint; without it, a synthetic model");
  a->synthetic_option = sub.add_option("--synthetic", a->synthetic, "size of the synthetic Llama without --model")
      ->capture_default_str();
  sub.add_option("--model-seed", a->model_seed, "seed of the synthetic weights")
      ->check(brigade::cli::number_in<std::uint64_t>(0, UINT64_MAX, "a whole number from 0 to 2^64-1"))
      ->capture_default_str();
  sub.add_option("--tokenizer", a->tokenizer, "llama2.c tokenizer (synthetic if absent)");
  sub.add_option("--data", a->data,
                 "text file or folder (one task per file; '%' lines or blank lines separate "
                 "samples), or 'debian': the multi-task corpus of Debian's plain text (fortunes, "
                 "common licenses, copyright files, README.Debian; docs/batching.md); default: "
                 "the fortunes package");
  sub.add_option("--seed", a->seed, "data-order seed")
      ->check(brigade::cli::number_in<std::uint64_t>(0, UINT64_MAX, "a whole number from 0 to 2^64-1"))
      ->capture_default_str();
  a->stages_option = sub.add_option("--stages", a->stages,
                                    "pipeline ranks (threads; under mpirun: processes, default "
                                    "and only value the number of processes)")
      ->check(brigade::cli::number_in<int>(1, 4096, "a whole number from 1 to 4096"))
      ->capture_default_str();
  sub.add_option("--schedule", a->schedule,
                 "gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v or dualpipe-v")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v"}))
      ->capture_default_str();
  a->virtual_option = sub.add_option("--virtual", a->virtual_stages,
                                     "virtual stages per rank (interleaved-1f1b; default 1, and 2 "
                                     "for zb-v and dualpipe-v, whose V shape has two per rank)")
      ->check(brigade::cli::number_in<int>(1, 1024, "a whole number from 1 to 1024"));
  sub.add_option("--microbatches", a->microbatches, "micro-batches per step")
      ->check(brigade::cli::number_in<int>(1, 65536, "a whole number from 1 to 65536"))->capture_default_str();
  sub.add_option("--tokens-per-microbatch", a->tokens_per_microbatch,
                 "token budget of a micro-batch (sequences packed by offsets; a longer sample is "
                 "cut, with a notice)")
      ->check(brigade::cli::number_in<int>(2, 1 << 20, "a whole number of tokens from 2 to 1048576"))
      ->capture_default_str();
  sub.add_option("--batching", a->batchings,
                 "split each step's global batch (--microbatches x --tokens-per-microbatch tokens "
                 "of samples) by a batcher, with a plan per step: padding, packing (Megatron "
                 "rows), offsets, or dynamic (DynaPipe's DP under the adaptive schedule); a comma "
                 "list runs each from the same model on the same samples, one after another, and "
                 "prints one table; default: none, --microbatches micro-batches packed by offsets "
                 "under the one plan of --schedule")
      ->delimiter(',')
      ->check(CLI::IsMember({"padding", "packing", "offsets", "dynamic"}));
  sub.add_option("--memory-limit", a->memory_limit,
                 "--batching: bytes of activations one micro-batch may keep on a stage from its "
                 "forward to its backward (DynaPipe's per-micro-batch limit); default: one "
                 "--tokens-per-microbatch sequence's, for dynamic only. Given, it holds every "
                 "batcher's micro-batches: one over it recomputes its stage's forward before the "
                 "backward (full recompute, where the stage input fits), one that fits in no way "
                 "is an error")
      ->check(brigade::cli::number_in<double>(0, 1e18, "a number of bytes above 0", true));
  sub.add_option("--rank-memory", a->rank_memory,
                 "--batching: bytes of activations one rank may hold at once (the adaptive "
                 "schedule's limit, and a recomputing micro-batch's peak); default: ranks x "
                 "--memory-limit")
      ->check(brigade::cli::number_in<double>(0, 1e18, "a number of bytes above 0", true));
  sub.add_option("--recompute", a->recompute,
                 "--batching: auto (a micro-batch whose activations do not fit --memory-limit "
                 "recomputes, DynaPipe's choice per micro-batch, priced in the DP) or none")
      ->check(CLI::IsMember({"auto", "none"}))
      ->capture_default_str();
  sub.add_option("--steps", a->steps,
                 "optimizer steps (the total, when resuming; keep it the same to continue exactly: "
                 "the learning-rate schedule depends on it)")
      ->check(brigade::cli::number_in<int>(1, 1 << 30, "a whole number from 1 to 2^30"))->capture_default_str();
  sub.add_option("--lr", a->lr, "peak learning rate (warm-up, then cosine to lr/10)")
      ->check(brigade::cli::number_in<float>(0, 1, "a number above 0 and at most 1", true))->capture_default_str();
  sub.add_option("--warmup", a->warmup, "warm-up steps")
      ->check(brigade::cli::number_in<int>(0, 1 << 30, "a whole number from 0 to 2^30"))->capture_default_str();
  sub.add_option("--weight-decay", a->weight_decay, "AdamW weight decay")
      ->check(brigade::cli::number_in<float>(0, 1, "a number from 0 to 1"))->capture_default_str();
  sub.add_option("--clip", a->clip, "global gradient-norm clip (0 = off)")
      ->check(brigade::cli::number_in<float>(0, 1e6f, "0 (off) or a norm up to 1e6"))->capture_default_str();
  sub.add_option("--checkpoint-dir", a->checkpoint_dir,
                 "folder for model.bin (llama2.c) and optimizer.bin, written at the end");
  sub.add_option("--checkpoint-every", a->checkpoint_every, "also checkpoint every N steps")
      ->check(brigade::cli::number_in<int>(0, 1 << 30, "0 (off) or a whole number of steps up to 2^30"));
  sub.add_flag("--resume", a->resume, "continue from --checkpoint-dir");
  sub.add_option("--eval-every", a->eval_every, "held-out loss every N steps")
      ->check(brigade::cli::number_in<int>(0, 1 << 30, "0 (off) or a whole number of steps up to 2^30"));
  sub.add_option("--timeout", a->timeout, "seconds a rank waits for a peer before failing")
      ->check(brigade::cli::number_in<double>(0, 604800, "a number of seconds above 0 and at most 604800 (a week)",
                           true))
      ->capture_default_str();
  sub.add_option("--tp", a->tp,
                 "tensor-parallel degree of every stage (Megatron-LM's split: heads, MLP rows, "
                 "vocabulary; the model's heads, KV heads, hidden_dim and vocabulary must divide "
                 "it). Threads: --stages x --tp (x --dp); under mpirun the processes are the grid "
                 "--dp x --stages x --tp, TP fastest")
      ->check(brigade::cli::number_in<int>(1, 1024, "a whole number from 1 to 1024"))
      ->capture_default_str();
  sub.add_option("--dp", a->dp,
                 "data-parallel replicas of the whole pipeline: each step is --dp x "
                 "--microbatches micro-batches, --microbatches per replica, the gradients "
                 "all-reduced before the update (the same update on every replica; checkpoints "
                 "written once)")
      ->check(brigade::cli::number_in<int>(1, 1024, "a whole number from 1 to 1024"))
      ->capture_default_str();
  brigade::cli::add_profile_option(sub, a->profile);
  brigade::cli::add_pipeline_dtype_option(sub, a->pipeline_dtype);
  sub.add_option("--trace", a->trace, "Chrome trace JSON of the first step's Timeline");
  sub.add_option("--metrics", a->metrics, "one JSON line per step (step, loss, tokens, seconds)");
  // Fault injection for tests of runs under mpirun (hidden from --help).
  a->integrity.add_options(sub, true);
  sub.add_option("--fail-rank", a->fail_rank,
                 "under mpirun: this rank exits with code 3 mid-run (fault injection)")
      ->group("");
  sub.add_option("--fail-after-steps", a->fail_after_steps,
                 "the --fail-rank rank exits when it starts the step after this many steps")
      ->check(brigade::cli::number_in<int>(1, 1 << 30, "a whole number from 1 to 2^30"))->group("");
  return [a] {
    if (a->virtual_option->count() == 0)
      a->virtual_stages = brigade::schedule::default_virtual_stages(a->schedule);
    return run(*a);
  };
}

const brigade::cli::Registrar reg{
    {"train", "Train a Llama split into pipeline stages with a schedule of the IR", setup}};

}  // namespace
