// `brigade serve`: replays a serving trace (Azure or Mooncake) against a pipelined model with
// the serving engine (serve::serve; under mpirun serve::serve_on over an MpiTransport, one
// process per stage), once per split policy on the same arrivals, and reports mean/p50/p99 of
// end-to-end latency, TTFT and TPOT, and throughput.
#include "cli.hpp"

#include <brigade/backend/cpu.hpp>
#include <brigade/config.hpp>
#include <brigade/cost/profiled.hpp>
#include <brigade/io/trace.hpp>
#include <brigade/model/model_file.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/partition/policies.hpp>
#include <brigade/serve/predictor.hpp>
#include <brigade/serve/rebalance.hpp>
#include <brigade/serve/serving.hpp>
#include <brigade/serve/trace.hpp>
#include <brigade/transport/mpi.hpp>  // mpi_world_size_from_env(); compiles without MPI

#include <fmt/core.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <thread>

namespace brigade {
namespace {

struct ServeArgs {
  std::string trace, model, tokenizer, synthetic = "42M", metrics, timeline;
  std::string rebalance = "even";  // even, static, dynamic, or a comma list of them
  serve::RebalanceOptions dynamic;
  double part_mib = 1.0;
  std::string profile = "auto";
  int stages = 2, max_requests = 0, threads = 1;
  double rate_scale = 1.0, prompt_scale = 1.0, output_scale = 1.0, timeout = 120.0;
  float temperature = 0.0f, top_p = 0.9f;
  std::uint64_t seed = 42, model_seed = 1234, trace_seed = 1;
  bool ignore_eos = true;
  serve::ServeOptions serve;
  CLI::Option* stages_option = nullptr;  // to tell an explicit --stages from the default
};

nlohmann::json summary_json(const serve::LatencySummary& s) {
  return {{"mean", s.mean}, {"p50", s.p50}, {"p99", s.p99}};
}

// The 1-minute load average (/proc/loadavg's first field; -1 where it cannot be read): recorded
// beside each run, as the machine may be shared.
double load_average() {
  std::ifstream in("/proc/loadavg");
  double load = -1.0;
  if (!(in >> load)) return -1.0;
  return load;
}

// The path of run `policy`'s Timeline: `path` itself for one policy, else the policy's name
// before the extension (trace.json -> trace.static.json).
std::filesystem::path timeline_path(const std::string& path, const std::string& policy,
                                    bool several) {
  if (!several) return path;
  std::filesystem::path p(path);
  return p.parent_path() / (p.stem().string() + "." + policy + p.extension().string());
}

int run_serve(ServeArgs& a) {
  // Under mpirun: one process per stage, every process runs every policy, rank 0 reports (the
  // rank of stage 0 for every split here).
  const cli::MpiLaunch launch(-1);
  const bool under_mpi = launch.active();
  const bool prints = launch.rank() == 0;
  std::vector<std::string> policies;
  {
    std::stringstream ss(a.rebalance);
    for (std::string p; std::getline(ss, p, ',');) {
      BRIGADE_CHECK(p == "even" || p == "static" || p == "dynamic", Errc::InvalidArgument,
                    "--rebalance {}: expected even, static or dynamic (or a comma list of them)",
                    detail::excerpt(p));
      if (std::find(policies.begin(), policies.end(), p) == policies.end()) policies.push_back(p);
    }
    BRIGADE_CHECK(!policies.empty(), Errc::InvalidArgument, "--rebalance: no policy given");
  }
  const auto trace = serve::read_trace(a.trace);
  model::LlamaWeights weights =
      a.model.empty()
          ? model::make_synthetic_weights(model::named_config(a.synthetic), a.model_seed)
          : model::load_model_weights(a.model);
  if (!a.tokenizer.empty())  // the trace's prompts are ids; the file is checked against the model
    (void)model::Tokenizer::load_llama2c(a.tokenizer, weights.config.vocab_size);
  const model::ModelSpec spec(weights.config);
  a.stages = launch.ranks(a.stages, a.stages_option, "stage");
  BRIGADE_CHECK(a.stages >= 1 && a.stages <= spec.num_layers(), Errc::InvalidArgument,
                "--stages {} outside [1, {}] for a model of {} layers", a.stages,
                spec.num_layers(), spec.num_layers());
  cli::check_threads_startable(
      (under_mpi ? 1 : a.stages) * a.threads,
      under_mpi ? fmt::format("--threads {}", a.threads)
                : fmt::format("--stages {} x --threads {}", a.stages, a.threads));
  serve::TraceReplay replay;
  replay.rate_scale = a.rate_scale;
  replay.prompt_scale = a.prompt_scale;
  replay.output_scale = a.output_scale;
  replay.max_requests = a.max_requests;
  replay.seed = a.trace_seed;
  const auto requests = serve::trace_requests(trace, weights.config, replay);

  a.serve.ignore_eos = a.ignore_eos;
  a.serve.inference.sampler = {a.temperature, a.top_p, a.seed};
  a.serve.inference.blas_threads = a.threads;
  a.serve.inference.timeout_s = a.timeout;
  a.serve.inference.migration_part_bytes =
      static_cast<std::size_t>(std::max(1.0, a.part_mib * 1024 * 1024));
  const std::string model_name = a.model.empty() ? "synthetic " + a.synthetic : a.model;
  double prompt_sum = 0, output_sum = 0;
  for (const auto& r : requests) {
    prompt_sum += static_cast<double>(r.prompt.size());
    output_sum += r.max_new_tokens;
  }
  const double n = static_cast<double>(requests.size());
  if (prints) {
    fmt::print(stderr,
               "serve: {} requests of {} (rate x{}, prompts x{}, outputs x{}; mean prompt {:.0f}, "
               "mean output {:.0f} tokens, last arrival {:.1f} s) on {}, {} stages\n",
               requests.size(), a.trace, a.rate_scale, a.prompt_scale, a.output_scale,
               prompt_sum / n, output_sum / n, requests.back().arrival_s, model_name, a.stages);
    if (under_mpi)
      fmt::print(stderr, "transport: MPI, {} processes (one stage each)\n", a.stages);
  }

  // The calibrated layer times: the static split and the latency predictor's prior (under
  // mpirun every process must price the same split: --profile FILE, or the roofline).
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const auto resolved =
      cli::resolve_profile(a.profile, cores, under_mpi, cpu::cpu_model_name());
  const model::LayerSeconds layer_seconds =
      resolved.profile ? model::LayerSeconds(cost::ProfiledLayerTimes(
                             *resolved.profile, a.threads, std::max(a.threads, a.stages * a.threads)))
                       : model::roofline_layer_seconds();
  nlohmann::json runs = nlohmann::json::array();
  double even_mean = 0.0;
  for (const auto& policy : policies) {
    partition::Partition part = partition::uniform(spec, a.stages);
    if (policy == "static") {
      // Balanced once, for a full micro-batch of decodes at the trace's mean context, priced by
      // this machine's calibrated layer times (the LM head and sampler on the tail included).
      partition::PolicyRequest req;
      for (int v = 0; v < a.stages; ++v) req.placement.push_back(v);
      req.num_ranks = a.stages;
      req.work.sequences = a.serve.max_seqs;
      req.work.tokens = a.serve.max_seqs;
      req.work.context = std::max(1.0, (prompt_sum + output_sum / 2) / n);
      req.layer_seconds = layer_seconds;
      part = partition::make_partition(spec, "balanced", req);
    }
    std::vector<int> layers;
    for (const auto& st : part.stages()) layers.push_back(st.last - st.first);
    // dynamic: starts from the even split and moves layers while serving (DynaPipe).
    serve::ServeOptions so = a.serve;
    if (policy == "dynamic") {
      so.rebalance = a.dynamic;
      so.rebalance->layer_seconds = layer_seconds;
    }
    const double load_before = load_average();
    serve::ServeReport rep;
#if BRIGADE_HAS_MPI
    if (under_mpi) {
      transport::MpiTransport tp;
      rep = serve::serve_on(tp, weights, part, requests, so);
    } else
#endif
      rep = serve::serve(weights, part, requests, so);
    if (!prints) continue;  // rank 0 (stage 0's) holds the gathered report
    const auto e2e = rep.e2e(), ttft = rep.ttft(), tpot = rep.tpot();
    const double load_after = load_average();
    if (policy == "even") even_mean = e2e.mean;
    fmt::print(stderr,
               "serve: {:<6} layers per stage {}: e2e mean {:.3f} s p50 {:.3f} p99 {:.3f}; TTFT "
               "mean {:.3f} s p99 {:.3f}; TPOT mean {:.4f} s p99 {:.4f}; {:.1f} tokens/s; {} "
               "rounds, KV peak {}/{} blocks, queue peak {}; load average {:.1f} -> {:.1f}\n",
               policy, layers, e2e.mean, e2e.p50, e2e.p99, ttft.mean, ttft.p99, tpot.mean,
               tpot.p99, rep.tokens_per_s(), rep.rounds, rep.peak_kv_blocks, rep.kv_blocks,
               rep.peak_queue, load_before, load_after);
    nlohmann::json run = {{"rebalance", policy},
                          {"layers_per_stage", layers},
                          {"e2e_s", summary_json(e2e)},
                          {"ttft_s", summary_json(ttft)},
                          {"tpot_s", summary_json(tpot)},
                          {"throughput_tokens_per_s", rep.tokens_per_s()},
                          {"generated_tokens", rep.generated_tokens},
                          {"wall_s", rep.wall_s},
                          {"rounds", rep.rounds},
                          {"kv_blocks", rep.kv_blocks},
                          {"kv_block_size", rep.kv_block_size},
                          {"peak_kv_blocks", rep.peak_kv_blocks},
                          {"peak_queue", rep.peak_queue},
                          {"load_average_1min", {load_before, load_after}}};
    nlohmann::json moves = nlohmann::json::array();
    for (const auto& m : rep.moves) {
      fmt::print(stderr,
                 "serve: {:<6} move: layer {} stage {} -> {}, ordered in round {} ({:.2f} s), "
                 "parts in rounds {}-{}, {} from round {}; layers per stage then {}{}\n",
                 policy, m.layer, m.from, m.to, m.ordered_round, m.ordered_s, m.first_round,
                 m.switch_round - 1, m.forced ? "forced, switched" : "switched", m.switch_round,
                 m.layers_after,
                 m.checked_rounds > 0 && m.checked_measured_s > 0
                     ? fmt::format("; stages {} and {} then measured {:.3f} s over {} rounds, "
                                   "predicted {:+.1f}%",
                                   m.from, m.to, m.checked_measured_s, m.checked_rounds,
                                   100 * (m.checked_predicted_s / m.checked_measured_s - 1))
                     : std::string());
      moves.push_back({{"layer", m.layer},
                       {"from", m.from},
                       {"to", m.to},
                       {"ordered_round", m.ordered_round},
                       {"first_round", m.first_round},
                       {"switch_round", m.switch_round},
                       {"ordered_s", m.ordered_s},
                       {"forced", m.forced},
                       {"predicted_slowest_s", m.predicted_slowest_s},
                       {"predicted_round_s", m.predicted_round_s},
                       {"predicted_round_after_s", m.predicted_round_after_s},
                       {"required_gain", m.required_gain},
                       {"checked_rounds", m.checked_rounds},
                       {"checked_predicted_s", m.checked_predicted_s},
                       {"checked_measured_s", m.checked_measured_s},
                       {"bytes", m.bytes},
                       {"layers_per_stage_after", m.layers_after}});
    }
    run["moves"] = std::move(moves);
    if (so.rebalance) run["measured_rounds_per_stage"] = rep.measured_rounds;
    if (!rep.moves.empty()) {
      const auto impact = serve::migration_impact(rep);
      fmt::print(stderr,
                 "serve: {:<6} migrations: {}, {:.1f} MiB in parts, {:.3f} s in MIGRATE / "
                 "MIGRATE_RECV; migration rounds {:.2f}x the median of their neighbours on "
                 "average, a migration's slowest {:.2f}x (median), the slowest of all {:.2f}x "
                 "(windows of as many rounds without a migration: {:.2f}x, slowest {:.2f}x; "
                 "{} windows); the most a rank spent migrating in one round {:.1f}% of it "
                 "({})\n",
                 policy, impact.migrations, static_cast<double>(impact.migration_bytes) / (1 << 20),
                 impact.migration_seconds, impact.mean_round_ratio,
                 impact.median_max_round_ratio, impact.max_round_ratio,
                 impact.baseline_mean_round_ratio, impact.baseline_max_round_ratio,
                 impact.baseline_windows,
                 100 * impact.max_migration_share,
                 std::isinf(impact.max_added_ratio)
                     ? std::string("a rank migrated through a whole round")
                     : fmt::format("that round {:.2f}x as long as without it",
                                   impact.max_added_ratio));
      run["migration"] = {{"migrations", impact.migrations},
                          {"bytes", impact.migration_bytes},
                          {"seconds", impact.migration_seconds},
                          {"max_round_ratio_vs_neighbours", impact.max_round_ratio},
                          {"mean_round_ratio_vs_neighbours", impact.mean_round_ratio},
                          {"median_max_round_ratio_vs_neighbours", impact.median_max_round_ratio},
                          {"baseline_windows", impact.baseline_windows},
                          {"baseline_mean_round_ratio", impact.baseline_mean_round_ratio},
                          {"baseline_max_round_ratio", impact.baseline_max_round_ratio},
                          {"max_migration_share_of_round", impact.max_migration_share},
                          {"max_added_ratio", impact.max_added_ratio}};
    }
    std::vector<int> final_layers;
    for (const auto& st : rep.plans.back().second.stages())
      final_layers.push_back(st.last - st.first);
    run["layers_per_stage_at_end"] = final_layers;
    // The online latency predictor replayed over the run's rounds (predictor.hpp).
    const serve::StageLatencyPredictor fresh(cost::LatencyEstimator(spec, layer_seconds), part);
    nlohmann::json pred = nlohmann::json::array();
    for (const auto& e : serve::evaluate_predictor(rep, fresh)) {
      fmt::print(stderr,
                 "serve: {:<6} stage {} latency predictor over {} rounds: MAPE {:.1f}% online, "
                 "{:.1f}% on the held-out last 30% (calibrated cost model alone: {:.1f}%)\n",
                 policy, e.stage, e.rounds, 100 * e.online_mape, 100 * e.heldout_mape,
                 100 * e.prior_heldout_mape);
      pred.push_back({{"stage", e.stage},
                      {"rounds", e.rounds},
                      {"online_mape", e.online_mape},
                      {"heldout_mape", e.heldout_mape},
                      {"prior_heldout_mape", e.prior_heldout_mape}});
    }
    run["predictor"] = std::move(pred);
    if (policy != "even" && even_mean > 0)
      run["e2e_mean_improvement_vs_even"] = 1.0 - e2e.mean / even_mean;
    if (!a.timeline.empty()) {
      const auto path = timeline_path(a.timeline, policy, policies.size() > 1);
      io::write_chrome_trace(path, rep.timeline);
      fmt::print(stderr, "timeline: {}\n", path.string());
    }
    runs.push_back(std::move(run));
  }
  if (!a.metrics.empty() && prints) {
    const nlohmann::json m = {{"trace", a.trace},
                              {"model", model_name},
                              {"requests", requests.size()},
                              {"stages", a.stages},
                              {"transport", under_mpi ? "mpi" : "threads"},
                              {"rate_scale", a.rate_scale},
                              {"prompt_scale", a.prompt_scale},
                              {"output_scale", a.output_scale},
                              {"microbatches", a.serve.microbatches > 0 ? a.serve.microbatches
                                                                        : a.stages},
                              {"runs", runs}};
    io::write_file_atomic(a.metrics, m.dump(1) + "\n");
    fmt::print(stderr, "metrics: {}\n", a.metrics);
  }
  return 0;
}

std::function<int()> setup(CLI::App& sub) {
  auto a = std::make_shared<ServeArgs>();
  sub.add_option("--trace", a->trace,
                 "serving trace: Azure LLM inference CSV or Mooncake JSONL (docs/serving.md)")
      ->required();
  sub.add_option("--model", a->model, "model file (llama2.c, GGUF or safetensors); without it, "
                                      "a synthetic model");
  sub.add_option("--tokenizer", a->tokenizer,
                 "llama2.c tokenizer, checked against the model (the trace's prompts are ids)");
  sub.add_option("--synthetic", a->synthetic,
                 "size of the synthetic Llama used without --model: 260K, 15M, 42M, 110M, 1.1B")
      ->capture_default_str();
  sub.add_option("--model-seed", a->model_seed, "seed of the synthetic weights");
  a->stages_option =
      sub.add_option("--stages", a->stages,
                     "pipeline stages (one thread each; under mpirun: one process each, default "
                     "the number of processes)")
          ->check(cli::number_in(1, 4096, "a whole number from 1 to 4096"))
          ->capture_default_str();
  sub.add_option("--rebalance", a->rebalance,
                 "layer split: even (uniform decoders), static (balanced once on the calibrated "
                 "cost model, tail's LM head and sampler included), dynamic (from the even split, "
                 "boundary layers move between neighbours while serving, DynaPipe), or a comma "
                 "list, each run on the same arrivals")
      ->capture_default_str();
  sub.add_option("--rebalance-threshold", a->dynamic.threshold,
                 "dynamic: move when the predicted slowest stage exceeds the mean by this "
                 "fraction")
      ->check(cli::number_in(0.0, 100.0, "a number from 0 to 100"))
      ->capture_default_str();
  sub.add_option("--rebalance-patience", a->dynamic.patience,
                 "dynamic: rounds the imbalance must persist before a move (hysteresis)")
      ->check(cli::number_in(1, 1 << 20, "a whole number from 1"))
      ->capture_default_str();
  sub.add_option("--rebalance-cooldown", a->dynamic.cooldown,
                 "dynamic: rounds after a move switched before the next one (hysteresis)")
      ->check(cli::number_in(0, 1 << 20, "a whole number from 0"))
      ->capture_default_str();
  sub.add_option("--rebalance-window", a->dynamic.window,
                 "dynamic: micro-batch rounds a decision weighs, the most recent (0: 64 per "
                 "micro-batch)")
      ->check(cli::number_in(0, 1 << 20, "a whole number from 0"))
      ->capture_default_str();
  sub.add_option("--rebalance-min-gain", a->dynamic.min_gain,
                 "dynamic: move only when the predicted slowest stage drops by this fraction")
      ->check(cli::number_in(0.0, 0.99, "a number from 0 to 0.99"))
      ->capture_default_str();
  sub.add_option("--force-move-every", a->dynamic.force_every,
                 "dynamic: move a layer every N rounds regardless of the predictor (a "
                 "demonstration of migration; 0: the predictor decides)")
      ->check(cli::number_in(0, 1 << 20, "a whole number from 0"))
      ->capture_default_str();
  sub.add_option("--migration-part-mib", a->part_mib,
                 "dynamic: MiB of weights and KV rows one migration part carries per "
                 "micro-batch and round (the last part carries what is left)")
      ->check(cli::number_in(0.0, 1e6, "a number above 0", true))
      ->capture_default_str();
  sub.add_option("--rate-scale", a->rate_scale,
                 "divide the trace's arrival times by this (2 = twice its request rate)")
      ->check(cli::number_in(0.0, 1e9, "a number above 0", true))
      ->capture_default_str();
  sub.add_option("--prompt-scale", a->prompt_scale,
                 "multiply prompt lengths by this (the traces' contexts exceed small models'); a "
                 "request still longer than the context is an error")
      ->check(cli::number_in(0.0, 1e6, "a number above 0", true))
      ->capture_default_str();
  sub.add_option("--output-scale", a->output_scale, "multiply output lengths by this")
      ->check(cli::number_in(0.0, 1e6, "a number above 0", true))
      ->capture_default_str();
  sub.add_option("--max-requests", a->max_requests, "replay the first N requests (0: all)")
      ->check(cli::number_in(0, 100000000, "a whole number from 0"))
      ->capture_default_str();
  sub.add_option("--trace-seed", a->trace_seed, "seed of the prompts' token ids");
  sub.add_option("--metrics", a->metrics, "write mean/p50/p99 of e2e, TTFT, TPOT as JSON");
  sub.add_option("--timeline", a->timeline,
                 "write each run's Timeline as a Chrome trace (FILE.<policy>.json with several)");
  sub.add_option("--microbatches", a->serve.microbatches,
                 "micro-batches in flight (0: one per stage)")
      ->check(cli::number_in(0, 4096, "a whole number from 0 to 4096"));
  sub.add_option("--max-batch-tokens", a->serve.max_batch_tokens,
                 "tokens one micro-batch feeds per round")
      ->check(cli::number_in(1, 1 << 20, "a whole number from 1"))
      ->capture_default_str();
  sub.add_option("--max-seqs", a->serve.max_seqs, "sequences per micro-batch")
      ->check(cli::number_in(1, 1 << 16, "a whole number from 1"))
      ->capture_default_str();
  sub.add_option("--prefill-chunk", a->serve.prefill_chunk,
                 "prompt tokens of one sequence per round (chunked prefill)")
      ->check(cli::number_in(1, 1 << 20, "a whole number from 1"))
      ->capture_default_str();
  sub.add_option("--kv-block-size", a->serve.kv_block_size, "KV positions per block")
      ->check(cli::number_in(1, 1 << 16, "a whole number from 1"))
      ->capture_default_str();
  sub.add_option("--kv-blocks", a->serve.kv_blocks,
                 "blocks in the KV pool; requests queue when it is full (0: microbatches x "
                 "max-seqs of the longest request)")
      ->check(cli::number_in(0, 1 << 30, "a whole number from 0"));
  sub.add_flag("!--stop-on-bos", a->ignore_eos,
               "end a request when it samples BOS (default: run the trace's output length)");
  sub.add_option("--temperature", a->temperature, "sampling temperature (0 = greedy)")
      ->check(cli::number_in(0.0f, 100.0f, "a number from 0 to 100"))
      ->capture_default_str();
  sub.add_option("--top-p", a->top_p, "top-p (nucleus) sampling")
      ->check(cli::number_in(0.0f, 1.0f, "a number above 0 and at most 1", true))
      ->capture_default_str();
  sub.add_option("--seed", a->seed, "sampler seed (request i uses seed + i)");
  sub.add_option("--threads", a->threads, "intra-op threads per stage")
      ->check(cli::threads_range())
      ->capture_default_str();
  sub.add_option("--timeout", a->timeout, "seconds a stage waits on a peer before failing")
      ->check(cli::number_in(0.0, 1e6, "a number above 0", true));
  cli::add_profile_option(sub, a->profile);
  return [a] { return run_serve(*a); };
}

const cli::Registrar reg{{"serve",
                          "replay a serving trace: requests arriving over time, continuous "
                          "batching, chunked prefill, a KV block pool; latency percentiles",
                          setup}};

}  // namespace
}  // namespace brigade
