// `brigade plan`: which TP x PP x batch serves a model on a node of GPUs at which latency and
// throughput (plan/tp_planner.hpp); prints the Pareto front, each grid's extremes and the pick
// for the SLA, and writes the front as SVG and every plan as JSON.
//
// Its other mode, `--halda DEVICES.json` (plan_halda.hpp, issue 18), assigns prima.cpp's ring
// windows and GPU layers to home devices instead.
#include "cli.hpp"
#include "model_config.hpp"
#include "plan_halda.hpp"

#include <brigade/core/error.hpp>
#include <brigade/cost/profile.hpp>
#include <brigade/io/trace.hpp>
#include <brigade/model/config.hpp>
#include <brigade/plan/tp_planner.hpp>
#include <brigade/plan/tp_svg.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace brigade;

struct Options {
  std::string model, gpu = "h100", link = "nvlink", svg, json;
  int gpus = 8, input_len = 128, output_len = 128, max_batch = 4096, tp = 0, pp = 0, batch = 0;
  double slo_ttft = std::numeric_limits<double>::infinity();
  double slo_tpot = std::numeric_limits<double>::infinity();
};

/// The datasheet profile of `--gpu h100|h200` (profiles/nvidia_<name>_sxm.json: beside the
/// executable's install, share/brigade/profiles, else the source tree's profiles/), or a file.
/// @throws brigade::Error{InvalidArgument} for a name without a profile; as cost::load_profile
cost::DeviceProfile gpu_profile(const std::string& gpu) {
  namespace fs = std::filesystem;
  if (gpu != "h100" && gpu != "h200") return cost::load_profile(gpu);
  const std::string file = "nvidia_" + gpu + "_sxm.json";
  std::vector<fs::path> dirs;
  if (const char* d = std::getenv("BRIGADE_PROFILE_DIR"); d != nullptr && *d != '\0')
    dirs.emplace_back(d);
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) dirs.push_back(exe.parent_path().parent_path() / "share" / "brigade" / "profiles");
  dirs.emplace_back(BRIGADE_SOURCE_PROFILE_DIR);
  for (const auto& d : dirs)
    if (fs::exists(d / file, ec)) return cost::load_profile(d / file);
  std::string tried;
  for (const auto& d : dirs) tried += (tried.empty() ? "" : ", ") + d.string();
  detail::fail(Errc::InvalidArgument, "--gpu {}: {} not found in {} (set BRIGADE_PROFILE_DIR, or "
               "give the profile file)", gpu, file, tried);
}

nlohmann::json plan_json(const plan::TpPpPlan& p) {
  return {{"tp", p.grid.tp},
          {"pp", p.grid.pp},
          {"batch", p.batch},
          {"microbatches", p.microbatches},
          {"prefill_microbatches", p.prefill_microbatches},
          {"ttft_s", p.ttft_s},
          {"tpot_s", p.tpot_s},
          {"latency_s", p.latency_s},
          {"tokens_per_s", p.tokens_per_s},
          {"decode_bubble", p.decode_bubble},
          {"tp_comm_fraction", p.tp_comm_fraction},
          {"weight_bytes", p.memory.weight_bytes},
          {"kv_bytes", p.memory.kv_bytes},
          {"activation_bytes", p.memory.activation_bytes},
          {"fits", p.fits}};
}

void print_rows(const std::vector<plan::TpPpPlan>& rows) {
  fmt::print("  {:<10} {:>5} {:>3} {:>10} {:>9} {:>10} {:>10} {:>7} {:>8} {:>8}\n", "grid",
             "batch", "m", "TTFT ms", "TPOT ms", "latency s", "tokens/s", "bubble", "TP comm",
             "GB/GPU");
  for (const auto& p : rows)
    fmt::print("  {:<10} {:>5} {:>3} {:>10.1f} {:>9.2f} {:>10.2f} {:>10.1f} {:>6.0f}% {:>7.0f}% "
               "{:>8.1f}\n",
               fmt::format("TP{} x PP{}", p.grid.tp, p.grid.pp), p.batch, p.microbatches,
               p.ttft_s * 1e3, p.tpot_s * 1e3, p.latency_s, p.tokens_per_s,
               p.decode_bubble * 100.0, p.tp_comm_fraction * 100.0, p.memory.total() / 1e9);
}

int run_tp_pp(const Options& o) {
  BRIGADE_CHECK(!o.model.empty(), Errc::InvalidArgument,
                "plan: --model is required (llama-3.1-70b, llama-3.1-405b, another named size, "
                "or a JSON config file)");
  const model::LlamaConfig config = cli::load_model_config(o.model);
  const cost::DeviceProfile profile = gpu_profile(o.gpu);
  const plan::ServingWorkload w{o.input_len, o.output_len};
  const double elem = plan::detail::profile_element_bytes(profile);
  std::vector<plan::TpPpPlan> plans;
  if (o.tp > 0 || o.pp > 0) {
    // One grid: the flags given, the other degree from the GPU count.
    const int tp = o.tp > 0 ? o.tp : (o.gpus % o.pp == 0 ? o.gpus / o.pp : 0);
    const int pp = o.pp > 0 ? o.pp : (o.gpus % o.tp == 0 ? o.gpus / o.tp : 0);
    BRIGADE_CHECK(tp > 0 && pp > 0, Errc::InvalidArgument,
                  "--{} {} does not divide the {} GPUs", o.tp > 0 ? "tp" : "pp",
                  o.tp > 0 ? o.tp : o.pp, o.gpus);
    plan::check_grid(config, {tp, pp}, o.gpus);
    if (o.batch > 0) {
      plans.push_back(plan::evaluate_tp_pp(config, profile, {tp, pp}, o.batch, w, o.link));
    } else {
      for (int b : plan::serving_batches(o.max_batch))
        plans.push_back(plan::evaluate_tp_pp(config, profile, {tp, pp}, b, w, o.link));
    }
    plan::check_plan_fits(plans.front(), profile);  // the smallest batch of the grid
  } else {
    BRIGADE_CHECK(o.batch == 0, Errc::InvalidArgument,
                  "--batch needs a grid (--tp and/or --pp); without one the planner searches "
                  "batches 1 to --max-batch");
    plans = plan::tp_pp_plans(config, profile, w, {o.gpus, o.max_batch, o.link});
    const plan::TpPpPlan* least = &plans.front();
    for (const auto& p : plans)
      if (p.memory.total() < least->memory.total()) least = &p;
    BRIGADE_CHECK(least->fits, Errc::InvalidArgument,
                  "no plan of {} fits {} x {}: the smallest, {}, needs {:.1f} GB per GPU (weights "
                  "{:.1f}) but one holds {:.1f} GB",
                  o.model, o.gpus, profile.name, least->describe(), least->memory.total() / 1e9,
                  least->memory.weight_bytes / 1e9, profile.memory_capacity_bytes / 1e9);
  }
  fmt::print("plan: {} ({:.1f} B parameters, {:.1f} GB of {} weights) on {} x {} ({:.1f} GB, "
             "link {}); input {} tokens, output {} tokens\n",
             o.model, static_cast<double>(config.num_parameters()) / 1e9,
             static_cast<double>(config.num_parameters()) * elem / 1e9, profile.dtype, o.gpus,
             profile.name, profile.memory_capacity_bytes / 1e9, o.link, o.input_len,
             o.output_len);

  const auto front = plan::pareto_front(plans);
  const bool slo = std::isfinite(o.slo_ttft) || std::isfinite(o.slo_tpot);
  const auto pick = plan::pick_for_slo(plans, o.slo_ttft, o.slo_tpot);

  int over = 0;
  for (const auto& p : plans) over += p.fits ? 0 : 1;
  fmt::print("\n{} plans, {} over memory; Pareto front of (latency, throughput):\n", plans.size(),
             over);
  print_rows(front);

  // Each grid's two ends: its lowest latency (batch 1) and its highest throughput.
  std::vector<plan::TpPpPlan> ends;
  for (std::size_t i = 0; i < plans.size();) {
    std::size_t j = i;
    const plan::TpPpPlan* fast = nullptr;
    const plan::TpPpPlan* wide = nullptr;
    for (; j < plans.size() && plans[j].grid.tp == plans[i].grid.tp; ++j) {
      if (!plans[j].fits) continue;
      if (!fast || plans[j].latency_s < fast->latency_s) fast = &plans[j];
      if (!wide || plans[j].tokens_per_s > wide->tokens_per_s) wide = &plans[j];
    }
    if (fast) ends.push_back(*fast);
    if (wide && wide != fast) ends.push_back(*wide);
    i = j;
  }
  fmt::print("\nper grid, lowest latency and highest throughput:\n");
  print_rows(ends);

  if (slo) {
    fmt::print("\nSLA: TTFT <= {} s, TPOT <= {} s\n", o.slo_ttft, o.slo_tpot);
    if (pick) {
      fmt::print("pick: {}: TTFT {:.1f} ms, TPOT {:.2f} ms, {:.1f} tokens/s, {:.1f} GB per GPU\n",
                 pick->describe(), pick->ttft_s * 1e3, pick->tpot_s * 1e3, pick->tokens_per_s,
                 pick->memory.total() / 1e9);
    } else {
      fmt::print("pick: no plan meets the SLA\n");
    }
  }
  if (!o.svg.empty()) {
    plan::write_front_svg(o.svg, plans, front, pick,
                          fmt::format("{} on {} x {}, input {}, output {}", o.model, o.gpus,
                                      profile.name, o.input_len, o.output_len));
    fmt::print("wrote {}\n", o.svg);
  }
  if (!o.json.empty()) {
    nlohmann::json j = {{"model", o.model},
                        {"gpu", profile.name},
                        {"gpus", o.gpus},
                        {"input_tokens", o.input_len},
                        {"output_tokens", o.output_len},
                        {"plans", nlohmann::json::array()},
                        {"front", nlohmann::json::array()}};
    for (const auto& p : plans) j["plans"].push_back(plan_json(p));
    for (const auto& p : front) j["front"].push_back(plan_json(p));
    if (pick) j["pick"] = plan_json(*pick);
    io::write_file_atomic(o.json, j.dump(1));
    fmt::print("wrote {}\n", o.json);
  }
  return slo && !pick ? 1 : 0;
}

std::function<int()> setup(CLI::App& sub) {
  auto o = std::make_shared<Options>();
  sub.add_option("--model", o->model,
                 "the model: llama-3.1-70b, llama-3.1-405b, another named size (260K ... 1.1B), "
                 "or a JSON config file (dim, hidden_dim, n_layers, n_heads, [n_kv_heads], "
                 "vocab_size, seq_len, [shared_classifier])");
  sub.add_option("--gpus", o->gpus, "GPUs of the node; TP x PP equals it")
      ->check(cli::number_in<int>(1, 4096, "a whole number from 1 to 4096"))
      ->capture_default_str();
  sub.add_option("--gpu", o->gpu,
                 "the GPU: h100 or h200 (the SXM datasheet profiles shipped in profiles/), or a "
                 "profile file (docs/profiles.md)")
      ->capture_default_str();
  sub.add_option("--link", o->link, "the profile link between the GPUs")->capture_default_str();
  sub.add_option("--slo-ttft", o->slo_ttft, "SLA: time to first token, seconds")
      ->check(cli::number_in<double>(0.0, 1e9, "a number of seconds above 0", true));
  sub.add_option("--slo-tpot", o->slo_tpot, "SLA: time per output token, seconds")
      ->check(cli::number_in<double>(0.0, 1e9, "a number of seconds above 0", true));
  sub.add_option("--input-len", o->input_len, "prompt tokens per request")
      ->check(cli::number_in<int>(1, 1 << 24, "a whole number from 1 to 16777216"))
      ->capture_default_str();
  sub.add_option("--output-len", o->output_len, "generated tokens per request")
      ->check(cli::number_in<int>(1, 1 << 24, "a whole number from 1 to 16777216"))
      ->capture_default_str();
  sub.add_option("--max-batch", o->max_batch, "largest batch searched (1, 2, 3, 4, 6, 8, 12, ... up to it)")
      ->check(cli::number_in<int>(1, 65536, "a whole number from 1 to 65536"))
      ->capture_default_str();
  sub.add_option("--tp", o->tp, "only this TP degree (PP = GPUs / TP unless --pp is given)")
      ->check(cli::number_in<int>(1, 4096, "a whole number from 1 to 4096"));
  sub.add_option("--pp", o->pp, "only this PP degree (TP = GPUs / PP unless --tp is given)")
      ->check(cli::number_in<int>(1, 4096, "a whole number from 1 to 4096"));
  sub.add_option("--batch", o->batch, "only this batch (with --tp and/or --pp)")
      ->check(cli::number_in<int>(1, 65536, "a whole number from 1 to 65536"));
  sub.add_option("--svg", o->svg, "write the plot of every plan and the front to this SVG file");
  sub.add_option("--json", o->json,
                 "write every plan, the front and the pick (with --halda: the assignment and the "
                 "comparison) to this JSON file");
  auto halda = std::make_shared<cli::HaldaPlanArgs>();
  cli::add_halda_plan_options(sub, *halda);
  return [o, halda] {
    if (halda->devices.empty()) return run_tp_pp(*o);
    halda->model = o->model;
    halda->json = o->json;
    return cli::run_halda_plan(*halda);
  };
}

const cli::Registrar registrar{
    {"plan",
     "TP x PP x batch for serving a model on a node of GPUs: the latency-throughput Pareto front "
     "and the pick for a TTFT/TPOT SLA (exit 1 when no plan meets it); with --halda, prima.cpp's "
     "ring windows and GPU layers on home devices",
     setup}};

}  // namespace
