// `brigade generate`: text generation with the model split into pipeline stages.
#include "cli.hpp"
#include "integrity.hpp"

#include <brigade/backend/cpu.hpp>
#include <brigade/config.hpp>
#include <brigade/engine/inference.hpp>
#include <brigade/io/input.hpp>
#include <brigade/io/trace.hpp>
#include <brigade/model/gguf.hpp>
#include <brigade/model/model_file.hpp>
#include <brigade/model/text.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/partition/partition.hpp>
#include <brigade/partition/policies.hpp>
#include <brigade/partition/halda.hpp>
#include <brigade/partition/ring.hpp>
#include <brigade/cost/memory.hpp>
#include <brigade/cost/profile.hpp>
#include <brigade/cost/profiled.hpp>
#include <brigade/plan/inference_plan.hpp>
#include <brigade/engine/distributed.hpp>
#include <brigade/engine/generate_mpi.hpp>  // declarations only; linked with brigade::mpi
#include <brigade/tp/tensor_parallel.hpp>
#include <brigade/transport/in_process.hpp>
#include <brigade/transport/mpi.hpp>  // mpi_world_size_from_env(); compiles without MPI

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <thread>

namespace {

struct GenerateArgs {
  std::string model, tokenizer, synthetic = "42M", prompt_file, trace, metrics, partition = "balanced";
  std::string profile = "auto";  // device profile of the balanced split: auto, none or a file
  std::string weights_dtype;  // --weights-dtype: the dtype the matrices are kept in; "": the file's
  std::string plan = "manual";  // manual (--stages/--threads/--microbatches) or auto (planner)
  int cores = 0;                // --plan auto: cores to plan for; 0 = all of this machine's
  std::vector<std::string> prompts;
  int steps = 256, stages = 2, microbatches = 0, threads = 1, ring = 1;
  int tp = 1;  // --tp: tensor-parallel degree of every stage
  float temperature = 1.0f, top_p = 0.9f;
  std::uint64_t seed = 42, model_seed = 1234;
  double timeout = 120.0;
  bool offload = false;  // --offload: PREFETCH/RELEASE every window each round
  std::vector<int> windows;  // --windows: ring window sizes in decoder layers (prima.cpp's w_m)
  double ram_budget = 0;     // --ram-budget: bytes of weights each rank may hold resident; 0: none
  bool no_prefetch = false;  // --no-prefetch: offload by demand paging (release only)
  std::string halda;         // --halda: devices file; Halda picks the ranks' windows and k
  std::string pipeline_dtype = "f32";  // --pipeline-dtype
  int fail_rank = -1, fail_after_steps = 1;  // fault injection (tests of runs under mpirun)
  brigade::cli::IntegrityArgs integrity;     // --verify, --inject
  CLI::Option* stages_option = nullptr;      // to tell an explicit --stages from the default
  CLI::Option* ring_option = nullptr;        // to tell an explicit --ring from the default
  // The choices --plan auto makes: given explicitly they conflict with it.
  std::vector<CLI::Option*> planned_options;
};

std::vector<std::string> read_prompt_file(const std::string& path) {
  std::istringstream in(
      brigade::io::read_input_file(path, "prompt file", brigade::io::kMaxPromptFileBytes));
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(line);
  BRIGADE_CHECK(!out.empty(), brigade::Errc::BadFile, "{}: no prompts (one per non-empty line)",
                path);
  return out;
}

/// Nothing the user gave is cut silently: a prompt longer than the model's context is an
/// error; --steps above seq_len, a prompt longer than --steps and more --microbatches than
/// sequences each get a one-line notice on stderr (printed by rank 0 only) saying what changed.
void check_lengths(const std::vector<brigade::engine::GenerationRequest>& requests,
                   const GenerateArgs& a, int seq_len, bool say) {
  using namespace brigade;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const auto n = static_cast<int>(requests[i].prompt.size());
    BRIGADE_CHECK(n <= seq_len, Errc::InvalidArgument,
                  "prompt {} is {} tokens (BOS included), more than the model's context of {} "
                  "positions (seq_len); shorten it",
                  i + 1, n, seq_len);
  }
  if (!say) return;
  if (a.steps > seq_len)
    fmt::print(stderr,
               "brigade: notice: --steps {} is more than the model's context of {} positions "
               "(seq_len); running {} positions per sequence\n",
               a.steps, seq_len, seq_len);
  const int steps = a.steps <= 0 || a.steps > seq_len ? seq_len : a.steps;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const auto n = static_cast<int>(requests[i].prompt.size());
    if (n > steps)
      fmt::print(stderr,
                 "brigade: notice: prompt {} is {} tokens (BOS included) but --steps {} runs {} "
                 "positions: its last {} tokens are not read and nothing is generated; use "
                 "--steps {} or more to read it all\n",
                 i + 1, n, a.steps, steps, n - steps, n + 1);
  }
  if (a.microbatches > static_cast<int>(requests.size()))
    fmt::print(stderr,
               "brigade: notice: --microbatches {} but only {} sequence(s): running {} "
               "micro-batch(es) of one sequence\n",
               a.microbatches, requests.size(), requests.size());
}

/// Bytes the TP ranks of one process copy beside the model (each stage's column slices of Wo
/// and W2: together one more copy of those matrices); 0 for tp = 1.
double tp_copied_bytes(const brigade::model::LlamaWeights& w, int tp) {
  if (tp == 1) return 0.0;
  const auto& c = w.config;
  double bytes = 0.0;
  for (const auto& l : w.layers)
    bytes += static_cast<double>(c.dim) * static_cast<double>(
                 brigade::model::weight_row_bytes(l.wo.dtype, c.dim) +
                 brigade::model::weight_row_bytes(l.w2.dtype, c.hidden_dim));
  return bytes;
}

int run(const GenerateArgs& a) {
  using namespace brigade;
  // Under mpirun: one process per stage; rank 0 prints (README, "Several processes (MPI)").
  const cli::MpiLaunch launch(a.fail_rank);
  const bool under_mpi = launch.active();
  a.integrity.check(launch.rank() == 0);
  // With --tp under mpirun the processes are the grid TP x PP (TP fastest): --stages = world / tp.
  const int num_stages = [&] {
    if (!under_mpi || a.tp == 1) return launch.ranks(a.stages, a.stages_option, "stage");
    BRIGADE_CHECK(launch.world() % a.tp == 0, Errc::InvalidArgument,
                  "--tp {} does not divide the {} processes mpirun started (the grid TP x PP "
                  "needs --tp x --stages processes)",
                  a.tp, launch.world());
    if (a.stages_option->count() > 0)
      tp::check_grid_ranks(tp::Grid{a.tp, a.stages, 1}, launch.world(),
                           "processes mpirun started");
    return launch.world() / a.tp;
  }();
  if (a.tp > 1) {
    // What tensor-parallel stages do not run (each would be its own path to build).
    const std::pair<bool, const char*> unsupported[] = {
        {a.plan == "auto", "--plan auto"},         {!a.halda.empty(), "--halda"},
        {a.ring_option->count() > 0 || !a.windows.empty(), "--ring/--windows"},
        {a.offload, "--offload"},                  {a.ram_budget > 0, "--ram-budget"},
        {a.integrity.active(), "--verify/--inject"}, {a.fail_rank >= 0, "--fail-rank"}};
    for (const auto& [given, flag] : unsupported)
      BRIGADE_CHECK(!given, Errc::InvalidArgument,
                    "--tp {} does not combine with {} (tensor-parallel stages run one layer "
                    "range per pipeline rank, resident, without transport decorators)",
                    a.tp, flag);
  }
  // Model and tokenizer: real files, or a synthetic Llama of a named size.
  model::LlamaWeights weights;
  model::Tokenizer tok;
  std::string model_name;
  if (!a.model.empty()) {
    // With --offload the scan for NaN and infinite weights runs on each window when a stage
    // first loads it (LoadOptions::defer_finite_check), so the load reads no weight pages.
    model::LoadOptions load;
    load.defer_finite_check = a.offload;
    // The format from the file's magic: a GGUF file carries its tokenizer.
    if (model::model_file_format(a.model) == model::ModelFileFormat::Gguf) {
      const model::GgufFile file = model::GgufFile::open(a.model);
      weights = model::load_gguf_llama(file, load);
      tok = a.tokenizer.empty() ? model::load_gguf_tokenizer(file, weights.config.vocab_size)
                                : model::Tokenizer::load_llama2c(a.tokenizer, weights.config.vocab_size);
    } else {
      weights = model::load_model_weights(a.model, load);
      BRIGADE_CHECK(!a.tokenizer.empty(), Errc::InvalidArgument,
                    "--model with a llama2.c or safetensors checkpoint needs --tokenizer (the "
                    "llama2.c tokenizer file)");
      tok = model::Tokenizer::load_llama2c(a.tokenizer, weights.config.vocab_size);
    }
    model_name = a.model;
  } else {
    weights = model::make_synthetic_weights(model::named_config(a.synthetic), a.model_seed);
    tok = a.tokenizer.empty() ? model::Tokenizer::synthetic(weights.config.vocab_size, a.model_seed)
                              : model::Tokenizer::load_llama2c(a.tokenizer, weights.config.vocab_size);
    model_name = "synthetic " + a.synthetic;
  }
  if (!a.weights_dtype.empty()) {
    // Converted once at load (matrices already in that dtype kept as they are); the kernels
    // read the narrow type directly.
    const std::size_t loaded_bytes = model::weight_bytes(weights);
    weights = model::convert_weights(weights, *parse_dtype(a.weights_dtype));
    if (launch.rank() == 0)
      fmt::print(stderr, "weights: {} ({:.1f} MB; {:.1f} MB as loaded)\n", a.weights_dtype,
                 model::weight_bytes(weights) / 1e6, loaded_bytes / 1e6);
  }
  const model::ModelSpec spec(weights.config);
  tp::check_tensor_parallel(weights.config, a.tp);  // heads, KV heads, MLP, vocabulary vs --tp

  std::vector<std::string> prompts = a.prompts;
  if (!a.prompt_file.empty()) {
    auto more = read_prompt_file(a.prompt_file);
    prompts.insert(prompts.end(), more.begin(), more.end());
  }
  if (prompts.empty()) prompts.emplace_back("");
  std::vector<engine::GenerationRequest> requests;
  for (const auto& p : prompts) requests.push_back({tok.encode(p, true, false), a.steps});
  check_lengths(requests, a, weights.config.seq_len, launch.rank() == 0);

  // --plan auto: the planner picks stages x threads x micro-batches from predicted times on
  // rates measured here, and prints every candidate beside its pick.
  const int cores = a.cores > 0 ? a.cores
                                : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const cli::ResolvedProfile resolved =
      cli::resolve_profile(a.profile, cores, under_mpi, cpu::cpu_model_name());
  const std::optional<cost::DeviceProfile>& profile = resolved.profile;
  std::optional<plan::InferencePlan> planned;
  if (a.plan == "auto") {
    BRIGADE_CHECK(!under_mpi, Errc::InvalidArgument,
                  "--plan auto plans threads on one machine; under mpirun give --stages");
    std::string given;
    for (const auto* o : a.planned_options)
      if (o->count() > 0) given += (given.empty() ? "" : ", ") + o->get_name();
    BRIGADE_CHECK(given.empty(), Errc::InvalidArgument,
                  "--plan auto chooses the stages, the split, the micro-batches and the threads; "
                  "drop {} (or use --plan manual)",
                  given);
    BRIGADE_CHECK(profile.has_value(), Errc::InvalidArgument,
                  "--plan auto predicts times from a device profile; give --profile auto or a "
                  "profile file, not --profile none");
    plan::InferenceWorkload wl;
    wl.sequences = static_cast<int>(requests.size());
    std::size_t longest = 1;
    for (const auto& r : requests) longest = std::max(longest, r.prompt.size());
    wl.prompt_tokens = static_cast<int>(longest);
    wl.new_tokens = std::max(1, engine::effective_steps(requests[0], weights.config.seq_len) -
                                    wl.prompt_tokens);
    const auto plans = plan::inference_plans(spec, wl, *profile, cores);
    fmt::print(stderr,
               "plan: {} cores, profile {} ({}): decode product of 16 rows {:.1f} GFLOP/s (1 "
               "core), {:.1f} GFLOP/s ({} cores); triad {:.1f} GB/s (1 core), {:.1f} GB/s ({} "
               "cores)\n",
               cores, profile->name, resolved.origin, profile->gemm_flops_per_s(16, 1) * 1e-9,
               profile->gemm_flops_per_s(16, cores) * 1e-9, cores,
               profile->core_bytes_per_s * 1e-9, profile->memory_bytes_per_s * 1e-9, cores);
    for (std::size_t i = 0; i < plans.size(); ++i)
      fmt::print(stderr, "plan: {} {:>9.1f} tokens/s predicted  {}\n", i == 0 ? "*" : " ",
                 plans[i].tokens_per_s, plans[i].describe(wl.sequences));
    planned = plans.front();
  }
  // --halda: prima.cpp's Halda over the devices file picks k and the windows w_m; the devices
  // it keeps are the ranks (one each), in the file's order.
  std::optional<partition::HaldaResult> halda;
  std::vector<int> halda_windows;
  if (!a.halda.empty()) {
    BRIGADE_CHECK(!planned && a.windows.empty() && a.ring_option->count() == 0 &&
                      a.stages_option->count() == 0,
                  Errc::InvalidArgument,
                  "--halda chooses the ranks, k and the windows; drop --stages, --ring, --windows "
                  "and --plan auto");
    const auto devices = partition::load_halda_devices(a.halda);
    const double bits = 8.0 * static_cast<double>(model::weight_bytes(weights)) /
                        static_cast<double>(weights.config.num_parameters());
    halda = partition::halda(
        devices, partition::HaldaModel::of(weights.config, bits, weights.config.seq_len));
    for (const int i : halda->kept()) halda_windows.push_back(halda->windows[static_cast<std::size_t>(i)]);
    BRIGADE_CHECK(!under_mpi || static_cast<int>(halda_windows.size()) == num_stages,
                  Errc::InvalidArgument,
                  "--halda keeps {} of the {} devices of {}; mpirun started {} processes (start {})",
                  halda_windows.size(), devices.size(), a.halda, num_stages, halda_windows.size());
    if (launch.rank() == 0) {
      for (std::size_t i = 0; i < devices.size(); ++i)
        fmt::print(stderr, "halda: {}: window {} layers, {} GPU layers (case M{}){}\n",
                   devices[i].name, halda->windows[i], halda->gpu_layers[i], halda->cases[i],
                   halda->windows[i] == 0 ? " removed" : "");
      fmt::print(stderr, "halda: k = {}, predicted TPOT on those devices {:.1f} ms (GPU layers "
                 "run on this machine's CPU)\n", halda->k, halda->tpot_seconds * 1e3);
    }
  }
  const int stages_used = planned ? planned->stages
                                  : halda ? static_cast<int>(halda_windows.size()) : num_stages;
  BRIGADE_CHECK(stages_used >= 1 && stages_used <= weights.config.n_layers + 4, Errc::InvalidArgument,
                "--stages {} outside [1, {}] for a model of {} layers", stages_used,
                weights.config.n_layers + 4, spec.num_layers());
  // Every stage thread (one per stage here, one per process under mpirun) with its intra-op threads.
  const int threads_used = planned ? planned->threads : a.threads;
  cli::check_threads_startable(
      (under_mpi ? 1 : stages_used * a.tp) * threads_used,
      under_mpi ? fmt::format("--threads {}", threads_used)
                : a.tp > 1 ? fmt::format("--stages {} x --tp {} x --threads {}", stages_used,
                                         a.tp, threads_used)
                           : fmt::format("--stages {} x --threads {}", stages_used, threads_used));
  // Ring windows (prima.cpp): k = --ring rounds of one window per rank over the decoder
  // layers, --windows sizes them; without either, one stage per rank from the policy.
  BRIGADE_CHECK(!planned || (a.ring_option->count() == 0 && a.windows.empty()), Errc::InvalidArgument,
                "--plan auto picks one layer range per stage; give --stages with --ring/--windows");
  // An explicit --ring (k = 1 included: one window per rank, the output layers on the head)
  // makes a ring plan.
  const bool ring_mode = a.ring_option->count() > 0 || !a.windows.empty() || halda.has_value();
  const std::vector<int>& window_list = halda ? halda_windows : a.windows;
  // --windows without --ring: k from the list (M x k entries, or M entries repeated L / sum times).
  int ring_rounds = halda ? halda->k : a.ring;
  if (!a.windows.empty() && a.ring_option->count() == 0) {
    const auto n = static_cast<int>(a.windows.size());
    const int sum = std::accumulate(a.windows.begin(), a.windows.end(), 0);
    ring_rounds = n == stages_used ? std::max(1, sum > 0 ? weights.config.n_layers / sum : 1)
                                   : std::max(1, n / stages_used);
  }
  const partition::Partition part = [&] {
    if (planned) return planned->partition(spec.num_layers());
    if (ring_mode)
      return partition::ring_partition(
          spec, stages_used,
          partition::ring_window_sizes(weights.config.n_layers, stages_used, ring_rounds, window_list));
    // The policy by name (partition::policies()); "balanced" balances the decode step that
    // dominates generation: one token per sequence of a micro-batch, attending to half the
    // run's positions on average.
    partition::PolicyRequest req;
    req.num_ranks = stages_used;
    for (int s = 0; s < stages_used; ++s) req.placement.push_back(s);
    const int groups = a.microbatches > 0 ? a.microbatches
                                          : std::min<int>(static_cast<int>(requests.size()), num_stages);
    req.work.sequences = std::max<std::int64_t>(1, static_cast<std::int64_t>(requests.size()) / groups);
    req.work.tokens = req.work.sequences;
    req.work.context = std::max(1.0, engine::effective_steps(requests[0], weights.config.seq_len) / 2.0);
    if (profile)  // each stage's products on --threads threads, stages x threads cores busy
      req.layer_seconds = cost::ProfiledLayerTimes(*profile, a.threads,
                                                   std::max(a.threads, stages_used * a.threads));
    return partition::make_partition(spec, a.partition, req);
  }();
  const int rounds = ring_mode ? ring_rounds : 1;
  const std::vector<std::size_t> layer_bytes_held = model::layer_weight_bytes(weights);
  const std::vector<double> layer_bytes(layer_bytes_held.begin(), layer_bytes_held.end());
  const double tied = weights.config.shared_classifier ? layer_bytes.front() : 0.0;
  // The weights each rank keeps resident must fit its RAM budget (--ram-budget), before anything runs.
  if (a.ram_budget > 0)
    partition::check_ring_budget(part, layer_bytes, a.offload && weights.mapped,
                                 std::span(&a.ram_budget, 1), "--ram-budget", tied);

  engine::InferenceOptions opt;
  opt.microbatches = planned ? planned->microbatches : a.microbatches;
  opt.sampler = {a.temperature, a.top_p, a.seed};
  opt.blas_threads = planned ? planned->threads : a.threads;
  opt.timeout_s = a.timeout;
  opt.weight_offload = a.offload;
  opt.background_prefetch = !a.no_prefetch;
  BRIGADE_CHECK(!a.no_prefetch || a.offload, Errc::InvalidArgument,
                "--no-prefetch changes how --offload loads windows; give --offload too");
  opt.pipeline_dtype = *parse_dtype(a.pipeline_dtype);
  opt.tp = a.tp;
  // With a profile, the plan must fit the device: the weights, then the memory of the ranks
  // (cost::inference_memory: weights, KV cache, buffers) against memory_capacity_bytes; each
  // rank on its own under mpirun, all of them together (one copy of the weights) as threads.
  if (profile) {
    // The bytes the weights take as held: without --weights-dtype a GGUF file's F16 or Q8_0
    // matrices stay in their dtype. With weight offload of a mapped file a rank holds only the
    // windows it runs (two at a time): the profile must hold those, not the whole model.
    const bool offloaded = a.offload && weights.mapped;
    const double held = static_cast<double>(model::weight_bytes(weights));
    if (offloaded)
      partition::check_ring_budget(part, layer_bytes, true,
                                   std::span(&profile->memory_capacity_bytes, 1),
                                   fmt::format("profile {}", profile->name), tied);
    else
      cost::check_holds_weights(*profile, held, "as loaded");
    // A TP rank holds its slices of each layer (tp::shard_layer_bytes) and the KV cache of its
    // KV heads; activations and buffers are the whole stream's (replicated).
    std::vector<double> rank_layer_bytes = layer_bytes;
    for (int l = 0; l < spec.num_layers(); ++l)
      rank_layer_bytes[static_cast<std::size_t>(l)] = tp::shard_layer_bytes(
          weights.config, spec.layer(l).kind, layer_bytes[static_cast<std::size_t>(l)], a.tp);
    auto mem = engine::inference_memory(
        weights.config, engine::inference_plan(weights.config, part, requests, opt.microbatches),
        requests, rank_layer_bytes);
    const double kv_share = static_cast<double>(tp::shard_of(weights.config, 0, a.tp).n_kv_heads) /
                            weights.config.n_kv_heads;
    for (auto& m : mem) m.kv_cache *= kv_share;
    const auto resident = partition::resident_weight_bytes(part, layer_bytes, offloaded, tied);
    if (offloaded)
      for (std::size_t r = 0; r < mem.size(); ++r) mem[r].weights = resident[r];
    if (a.tp > 1) {  // every TP rank of a stage as its own row: global rank p x tp + t
      std::vector<cost::MemoryBreakdown> grid;
      for (const auto& m : mem)
        for (int t = 0; t < a.tp; ++t) {
          grid.push_back(m);
          grid.back().rank = m.rank * a.tp + t;
        }
      mem = std::move(grid);
    }
    if (under_mpi)
      cost::check_capacity(mem, std::span<const cost::DeviceProfile>(&*profile, 1),
                           "brigade generate");
    else
      cost::check_one_process(mem, *profile, "brigade generate",
                              offloaded ? std::accumulate(resident.begin(), resident.end(), 0.0)
                                        : held + tp_copied_bytes(weights, a.tp));
  }
  // Every rank's transport under the integrity decorators (they only forward without --verify
  // and --inject): received activations and returning tokens are what the monitors check.
  const std::vector<transport::MessageKind> checked{transport::MessageKind::Activation,
                                                    transport::MessageKind::Token};
  engine::InferenceReport report;
  cli::IntegrityCounts counts;
  std::string verdicts;  // this process's verdict report
#if BRIGADE_HAS_MPI
  if (under_mpi && a.tp > 1) {
    report = engine::generate_mpi(weights, part, requests, opt);
    // World rank 0 of the grid: TP rank 0 of pipeline 0's stage-0 rank prints.
    if (launch.rank() != part.stage(0).rank * a.tp) return 0;
  } else if (under_mpi) {
    transport::MpiTransport tp;
    cli::IntegrityStack<transport::MpiTransport> stack(std::span(&tp, 1), a.integrity, checked,
                                                       weights.config.vocab_size);
    report = engine::generate_on(stack.transports()[0], weights, part, requests, opt,
                                 {a.fail_rank, a.fail_after_steps});
    stack.mark(report.timeline, report.origin);
    counts = stack.counts();
    fmt::print(stderr, "{}", cli::with_rank(stack.report(), tp.rank()));
    if (a.integrity.active()) {  // every process's counts, summed
      transport::MpiCollectives group;
      std::vector<double> v{static_cast<double>(counts.checked), static_cast<double>(counts.flagged),
                            static_cast<double>(counts.injected), static_cast<double>(counts.caught)};
      group.all_reduce(std::span(v), transport::ReduceOp::Sum, transport::Deadline::after(a.timeout));
      counts = {static_cast<std::int64_t>(v[0]), static_cast<std::int64_t>(v[1]),
                static_cast<std::int64_t>(v[2]), static_cast<std::int64_t>(v[3])};
    }
    if (launch.rank() != part.stage(0).rank) return 0;  // stage 0's rank prints
  } else
#endif
  if (a.tp > 1) {  // threads: --stages x --tp, tp pipelines joined by one group per stage
    report = engine::generate(
        weights, engine::inference_plan(weights.config, part, requests, opt.microbatches),
        requests, opt);
  } else {
    transport::InProcessFabric fabric(stages_used);
    auto endpoints = transport::endpoints(fabric);
    const std::span<transport::InProcessTransport> ranks(endpoints);
    cli::IntegrityStack<transport::InProcessTransport> stack(ranks, a.integrity, checked,
                                                             weights.config.vocab_size);
    report = engine::generate(stack.transports(), weights,
                              engine::inference_plan(weights.config, part, requests, opt.microbatches),
                              requests, opt);
    stack.mark(report.timeline, report.origin);
    counts = stack.counts();
    verdicts = stack.report();
  }

  for (const auto& s : report.sequences) {
    const auto text = model::render_like_run_c(tok, s.tokens);
    std::fwrite(text.data(), 1, text.size(), stdout);
  }
  std::fflush(stdout);

  // Summary on stderr (and as JSON with --metrics).
  double ttft = 0, tpot = 0;
  int with_tpot = 0;
  for (const auto& s : report.sequences) {
    ttft += s.ttft_s;
    if (s.generated > 1) {
      tpot += s.tpot_s();
      ++with_tpot;
    }
  }
  ttft /= static_cast<double>(report.sequences.size());
  if (with_tpot) tpot /= with_tpot;
  const int S = part.num_stages();
  fmt::print(stderr, "model: {} ({} layers, dim {}), {} stage(s), partition {}: {}\n", model_name,
             weights.config.n_layers, weights.config.dim, S,
             ring_mode ? fmt::format("ring, k = {}{}", rounds, halda ? " (Halda)" : "")
             : profile ? fmt::format("{} (profile {}, {})", a.partition, profile->name,
                                     resolved.origin)
                       : fmt::format("{} (profile {})", a.partition, resolved.origin),
             part.to_string());
  if (under_mpi)
    fmt::print(stderr, "transport: MPI, {} processes ({} each)\n", stages_used * a.tp,
               rounds > 1 ? fmt::format("{} ring windows", rounds)
               : a.tp > 1 ? fmt::format("one TP rank of a stage; grid TP {} x PP {}", a.tp,
                                        stages_used)
                          : std::string("one stage"));
  else if (a.tp > 1)
    fmt::print(stderr, "tensor parallel: grid TP {} x PP {} = {} threads\n", a.tp, stages_used,
               a.tp * stages_used);
  fmt::print(stderr,
             "sequences: {}, prompt tokens: {}, generated tokens: {}, wall: {:.3f} s\n"
             "throughput: {:.1f} tokens/s, mean TTFT: {:.2f} ms, mean TPOT: {:.2f} ms\n",
             report.sequences.size(), report.prompt_tokens, report.generated_tokens, report.wall_s,
             report.tokens_per_s(), ttft * 1e3, tpot * 1e3);
  std::int64_t link_bytes = 0;
  for (int r = 0; r < report.timeline.num_ranks(); ++r) link_bytes += report.timeline.bytes(r, true);
  if (stages_used > 1)
    fmt::print(stderr, "between ranks: {:.3f} MB sent ({} activations)\n", link_bytes / 1e6,
               a.pipeline_dtype);
  nlohmann::json stages = nlohmann::json::array();
  // The Timeline's row of a stage's rank: with --tp on threads, the grid's global rank of its TP
  // rank 0 (p x tp); under mpirun the gathered rows are pipeline 0's (TP rank 0 of each stage).
  const int row_scale = (a.tp > 1 && !under_mpi) ? a.tp : 1;
  for (int s = 0; s < S; ++s) {
    const auto& r = part.stage(s);
    const double busy =
        report.wall_s > 0 ? report.timeline.busy(r.rank * row_scale) / report.wall_s : 0.0;
    if (ring_mode)
      fmt::print(stderr, "{} {}: layers [{}, {}) on rank {}, rank busy {:.1f}%\n",
                 spec.layer(r.first).kind == model::LayerKind::FinalNorm ? "output" : "window", s,
                 r.first, r.last, r.rank, busy * 100);
    else
      fmt::print(stderr, "stage {}: layers [{}, {}), busy {:.1f}%\n", s, r.first, r.last,
                 busy * 100);
    stages.push_back({{"stage", s}, {"first_layer", r.first}, {"last_layer", r.last},
                      {"busy_fraction", busy},
                      {"rank_sent_bytes", report.timeline.bytes(r.rank * row_scale, true)}});
  }
  nlohmann::json resident = nlohmann::json::array();
  for (std::size_t r = 0; r < report.resident_weight_bytes.size(); ++r) {
    const double b = report.resident_weight_bytes[r];
    resident.push_back(b);
    if (a.offload || a.ram_budget > 0)
      fmt::print(stderr, "rank {}: at most {:.1f} MB of weights resident{}{}\n", r, b / 1e6,
                 a.offload && weights.mapped ? " (mincore)" : "",
                 a.ram_budget > 0 ? fmt::format(", RAM budget {:.1f} MB", a.ram_budget / 1e6)
                                  : std::string());
  }
  if (a.integrity.active()) {
    fmt::print(stderr, "{}", verdicts);
    fmt::print(stderr, "integrity: {} messages checked, {} flagged; {} messages corrupted, {} of "
               "them flagged\n", counts.checked, counts.flagged, counts.injected, counts.caught);
  }
  if (!a.trace.empty()) {
    io::write_chrome_trace(a.trace, report.timeline);
    fmt::print(stderr, "trace: {} (open it in https://ui.perfetto.dev or chrome://tracing)\n",
               a.trace);
  }
  if (!a.metrics.empty()) {
    nlohmann::json seqs = nlohmann::json::array();
    for (const auto& s : report.sequences)
      seqs.push_back({{"prompt_tokens", s.prompt_tokens}, {"generated", s.generated},
                      {"stopped_on_bos", s.stopped_on_bos}, {"ttft_s", s.ttft_s},
                      {"tpot_s", s.tpot_s()}, {"tokens", s.tokens}});
    nlohmann::json m = {{"model", model_name},
                        {"stages", stages_used},
                        {"tp", a.tp},
                        {"ring", rounds},
                        {"partition", ring_mode ? std::string("ring") : a.partition},
                        {"microbatches", opt.microbatches > 0
                                             ? std::min<int>(opt.microbatches, static_cast<int>(requests.size()))
                                             : std::min<int>(static_cast<int>(requests.size()), stages_used)},
                        {"wall_s", report.wall_s},
                        {"prompt_tokens", report.prompt_tokens},
                        {"generated_tokens", report.generated_tokens},
                        {"tokens_per_s", report.tokens_per_s()},
                        {"pipeline_dtype", a.pipeline_dtype},
                        {"sent_bytes", link_bytes},
                        {"ttft_s_mean", ttft},
                        {"tpot_s_mean", tpot},
                        {"stage_stats", stages},
                        {"offload", a.offload},
                        {"prefetch", a.offload ? (a.no_prefetch ? "demand paging" : "background")
                                               : "none"},
                        {"ram_budget_bytes", a.ram_budget},
                        {"resident_weight_bytes", resident},
                        {"sequences", seqs}};
    if (a.integrity.active()) {
      m["checked"] = counts.checked;
      m["flagged"] = counts.flagged;
      m["injected"] = counts.injected;
      m["injected_flagged"] = counts.caught;
    }
    io::write_file_atomic(a.metrics, m.dump(1) + "\n");
    fmt::print(stderr, "metrics: {}\n", a.metrics);
  }
  return 0;
}

std::function<int()> setup(CLI::App& sub) {
  auto a = std::make_shared<GenerateArgs>();
  sub.add_option("--model", a->model,
                 "model: a llama2.c checkpoint (.bin), a GGUF file, or a Hugging Face safetensors "
                 "checkpoint (its directory, or a .safetensors file beside config.json); the "
                 "format comes from the magic; without it, a synthetic model");
  sub.add_option("--tokenizer", a->tokenizer,
                 "llama2.c tokenizer (.bin); needed with a llama2.c or safetensors checkpoint, "
                 "optional with a GGUF file (which carries its own)");
  sub.add_option("--synthetic", a->synthetic,
                 "size of the synthetic Llama used without --model: 260K, 15M, 42M, 110M, 1.1B")
      ->capture_default_str();
  sub.add_option("--weights-dtype", a->weights_dtype,
                 "dtype the weight matrices are kept in (converted at load): f32, f16, bf16 "
                 "(rounded to nearest even) or q8_0 (llama.cpp's blocks of 32; needs dim and "
                 "hidden_dim multiples of 32); activations stay f32. Default: as the file "
                 "holds them (a GGUF file's f16/bf16/q8_0 tensors stay so; llama2.c, "
                 "safetensors and synthetic models are f32)")
      ->check(CLI::IsMember({"f32", "f16", "bf16", "q8_0"}));
  sub.add_option("--model-seed", a->model_seed, "seed of the synthetic weights")
      ->check(brigade::cli::number_in<std::uint64_t>(0, UINT64_MAX, "a whole number from 0 to 2^64-1"))
      ->capture_default_str();
  sub.add_option("--prompt", a->prompts, "a prompt; repeat for several sequences in flight");
  sub.add_option("--prompt-file", a->prompt_file, "a file of prompts, one per line");
  sub.add_option("--steps", a->steps, "positions per sequence, prompt included (run.c's -n); 0 = seq_len")
      ->check(brigade::cli::number_in<int>(0, 1 << 24, "0 (the model's seq_len) or a whole number from 1 to "
                                       "16777216"))
      ->capture_default_str();
  sub.add_option("--temperature", a->temperature, "0 = greedy")
      ->check(brigade::cli::number_in<float>(0, 100, "a number from 0 (greedy) to 100"))->capture_default_str();
  sub.add_option("--top-p", a->top_p,
                 "nucleus threshold: sample from the most likely tokens whose probabilities add "
                 "up to top-p; 1 = the full distribution")
      ->check(brigade::cli::number_in<float>(0, 1, "a number above 0 and at most 1 (1 = the full distribution)",
                          true))
      ->capture_default_str();
  sub.add_option("--seed", a->seed, "sampler seed (sequence i uses seed + i)")
      ->check(brigade::cli::number_in<std::uint64_t>(1, std::uint64_t{1} << 63, "a whole number from 1 to 2^63"))
      ->capture_default_str();
  a->stages_option = sub.add_option("--stages", a->stages,
                                    "pipeline stages (one thread each; under mpirun: one process "
                                    "each, default the number of processes)")
      ->check(brigade::cli::number_in<int>(1, 4096, "a whole number from 1 to 4096"))->capture_default_str();
  sub.add_option("--tp", a->tp,
                 "tensor-parallel degree of every stage (Megatron-LM: attention heads, MLP rows "
                 "and the vocabulary split over N ranks joined by all-reduces; docs/tp_pp.md); "
                 "threads: --stages x --tp; under mpirun the processes are the grid --tp x "
                 "--stages, TP fastest")
      ->check(brigade::cli::number_in<int>(1, 1024, "a whole number from 1 to 1024"))
      ->capture_default_str();
  a->ring_option = sub.add_option("--ring", a->ring,
                 "ring rounds k (prima.cpp's pipelined ring): the decoder layers are split into k "
                 "rounds of one window per rank (window j on rank j mod --stages; the output "
                 "layers on rank 0, the head, after the last window), and the token "
                 "walks the ring of ranks k times per position; k must divide the decoder layers "
                 "unless --windows sizes the windows")
      ->check(brigade::cli::number_in<int>(1, 1024, "a whole number from 1 to 1024"))
      ->capture_default_str();
  sub.add_option("--windows", a->windows,
                 "ring window sizes in decoder layers, comma-separated: one per rank (prima.cpp's "
                 "w_m, the same every round; k = layers / sum) or one per window of every round "
                 "(--stages x k entries); they must cover the decoder layers exactly")
      ->delimiter(',')
      ->check(brigade::cli::number_in<int>(1, 1 << 20, "a whole number of layers from 1"));
  sub.add_flag("--offload", a->offload,
               "weight offload (prima.cpp): each rank prefetches a window's weights one run "
               "ahead (madvise WILLNEED on the mapped checkpoint) and releases them after its "
               "run (madvise and posix_fadvise DONTNEED), every round; the scan for NaN and "
               "infinite weights runs on each window when it is first loaded, not on the whole "
               "file at load; synthetic weights stay resident");
  sub.add_option("--halda", a->halda,
                 "prima.cpp's Halda: a devices file (brigade.halda_devices/1, docs/ring.md); it "
                 "picks k and each device's window, drops devices that slow the ring, and the "
                 "devices kept become the ranks (under mpirun: one process each)");
  sub.add_flag("--no-prefetch", a->no_prefetch,
               "with --offload: do not load the next window in the background; each forward "
               "reads its pages by page faults (demand paging) and they are still released "
               "after it (the baseline of prima.cpp's comparison)");
  sub.add_option("--ram-budget", a->ram_budget,
                 "bytes of weights each rank may hold resident (with --offload: the two windows "
                 "it holds at a time); a split that needs more is refused before anything runs; "
                 "0 = no budget")
      ->check(brigade::cli::number_in<double>(0, 1e18, "a number of bytes from 0 (no budget)"))
      ->capture_default_str();
  std::vector<std::string> policies;
  for (const auto& p : brigade::partition::policies()) policies.emplace_back(p.name);
  auto* partition_option = sub.add_option("--partition", a->partition,
                 "a partition policy: uniform (by layer count), balanced (by cost), or one "
                 "registered with partition::register_policy")
      ->check(CLI::IsMember(policies))->capture_default_str();
  brigade::cli::add_profile_option(sub, a->profile);
  brigade::cli::add_pipeline_dtype_option(sub, a->pipeline_dtype);
  a->planned_options.push_back(a->stages_option);
  a->planned_options.push_back(partition_option);
  a->planned_options.push_back(sub.add_option("--microbatches", a->microbatches,
                 "sequence groups in flight; 0 = min(sequences, stages)")
      ->check(brigade::cli::number_in<int>(0, 65536, "0 (automatic) or a whole number from 1 to 65536"))
      ->capture_default_str());
  a->planned_options.push_back(sub.add_option(
      "--threads", a->threads,
      "intra-op threads per stage (products, attention, RoPE and SwiGLU split over them)")
      ->check(brigade::cli::threads_range())->capture_default_str());
  sub.add_option("--plan", a->plan,
                 "manual (--stages, --threads, --microbatches) or auto (the planner picks them from "
                 "predicted times on rates measured here, and prints every candidate)")
      ->check(CLI::IsMember({"manual", "auto"}))->capture_default_str();
  sub.add_option("--cores", a->cores, "--plan auto: cores to use; 0 = all of this machine's")
      ->check(brigade::cli::number_in<int>(0, 4096, "0 (all) or a whole number from 1 to 4096"))
      ->capture_default_str();
  sub.add_option("--timeout", a->timeout, "seconds a stage waits for a peer before failing")
      ->check(brigade::cli::number_in<double>(0, 604800, "a number of seconds above 0 and at most 604800 (a week)",
                           true))
      ->capture_default_str();
  sub.add_option("--trace", a->trace, "write the Timeline as Chrome trace JSON");
  sub.add_option("--metrics", a->metrics, "write the summary as JSON");
  // Fault injection for tests of runs under mpirun (hidden from --help).
  a->integrity.add_options(sub, false);
  sub.add_option("--fail-rank", a->fail_rank,
                 "under mpirun: this rank exits with code 3 mid-run (fault injection)")
      ->group("");
  sub.add_option("--fail-after-steps", a->fail_after_steps,
                 "the --fail-rank rank exits after receiving this many micro-batch inputs")
      ->check(brigade::cli::number_in<int>(1, 1 << 30, "a whole number from 1 to 2^30"))->group("");
  return [a] { return run(*a); };
}

const brigade::cli::Registrar reg{
    {"generate", "Generate text with the model split into pipeline stages", setup}};

}  // namespace
