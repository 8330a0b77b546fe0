// `brigade simulate`: generate (or read) a schedule, lower and validate it, simulate it over a
// cost model, and print / write makespan, bubble ratio, utilization and peak memory.
#include "cli.hpp"
#include "model_config.hpp"

#include <brigade/core/error.hpp>
#include <brigade/cost/cost_model.hpp>
#include <brigade/cost/profiled.hpp>
#include <brigade/io/input.hpp>
#include <brigade/io/trace.hpp>
#include <brigade/model/config.hpp>
#include <brigade/schedule.hpp>
#include <brigade/sim/simulator.hpp>
#include <brigade/sim/svg.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace sch = brigade::schedule;
using brigade::Errc;

struct Options {
  std::string schedule = "1f1b";
  std::string schedule_file;
  int ranks = 4;
  int microbatches = 8;
  int virtual_stages = 1;
  bool virtual_given = false;  // --virtual on the command line (else the generator's default)
  int decode_steps = 3;
  std::string model;
  std::string profile;  // a device profile: layer times and the first link from it
  std::string unit_costs;
  int batch = 1;
  int seq_len = 256;
  double flops = brigade::model::DeviceRates{}.flops_per_s;
  double mem_bandwidth = brigade::model::DeviceRates{}.bytes_per_s;
  std::optional<double> link_latency;
  std::optional<double> link_bandwidth;
  std::string trace, svg, metrics, save_schedule;
  int svg_width = 1000;
  bool rendezvous = false;
  bool offload = false;
  double weight_load = 0.0;
  double load_bandwidth = brigade::cost::RooflineOptions{}.weight_load_bytes_per_s;
  std::string pipeline_dtype = "f32";  // --pipeline-dtype: the roofline's message bytes
};

/// F,B[,W] as non-negative numbers.
std::vector<double> parse_unit_costs(const std::string& text) {
  std::vector<double> out;
  std::size_t p = 0;
  while (p <= text.size()) {
    std::size_t q = text.find(',', p);
    if (q == std::string::npos) q = text.size();
    const std::string item = text.substr(p, q - p);
    std::size_t used = 0;
    double v = -1.0;
    try {
      v = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    BRIGADE_CHECK(
        used == item.size() && !item.empty() && v >= 0.0 && std::isfinite(v), Errc::InvalidArgument,
        "--unit-costs '{}': '{}' is not a non-negative number (expected F,B[,W])", text, item);
    out.push_back(v);
    p = q + 1;
  }
  BRIGADE_CHECK(out.size() == 2 || out.size() == 3, Errc::InvalidArgument,
                "--unit-costs '{}': {} values, expected F,B or F,B,W", text, out.size());
  return out;
}

int run(const Options& o) {
  // 1. The schedule: generated, or read from a file (lowered there if it is compute-only).
  sch::Schedule compute, lowered;
  std::string name = o.schedule;
  if (!o.schedule_file.empty()) {
    name = o.schedule_file;
    sch::Schedule s;
    try {
      s = sch::parse_schedule(brigade::io::read_input_file(o.schedule_file, "schedule file",
                                                           brigade::io::kMaxScheduleFileBytes));
    } catch (const brigade::Error& e) {
      if (e.code() != Errc::InvalidArgument) throw;
      brigade::detail::fail(Errc::InvalidArgument, "{}: {}", o.schedule_file, e.what());
    }
    bool has_comm = false;
    for (const auto& prog : s.ranks)
      for (const auto& a : prog) has_comm |= brigade::is_communication(a.op);
    lowered = has_comm ? s : sch::lower(s);
    compute = sch::strip_communication(lowered);
  } else {
    const int V = o.virtual_given ? o.virtual_stages : sch::default_virtual_stages(o.schedule);
    compute = sch::generate(o.schedule, {o.ranks, o.microbatches, V, o.decode_steps});
    lowered = sch::lower(compute);
  }
  if (o.offload) lowered = sch::with_weight_offload(lowered);
  const auto& shape = lowered.shape;
  sch::ExecutionModel exec;
  if (o.rendezvous) exec.sends = sch::SendSemantics::Rendezvous;
  const auto proof = sch::validate(lowered, exec);
  if (!o.save_schedule.empty())
    brigade::io::write_file_atomic(o.save_schedule, sch::to_text(lowered));

  // 2. The cost model and the simulation.
  brigade::sim::SimResult r;
  std::string costs;
  nlohmann::json cost_json;
  brigade::sim::SimOptions sim_opt;
  sim_opt.validate = false;  // done above
  const bool use_model = !o.model.empty();
  if (use_model) {
    const brigade::model::ModelSpec spec(brigade::cli::load_model_config(o.model));
    brigade::cost::RooflineOptions ro;
    ro.rates = {o.flops, o.mem_bandwidth};
    std::optional<brigade::cost::DeviceProfile> profile;
    if (!o.profile.empty()) {  // one device per rank: its layer times and its first link
      profile = brigade::cost::load_profile(o.profile);
      ro.layer_seconds = brigade::cost::ProfiledLayerTimes(*profile);
      ro.rates.bytes_per_s = profile->memory_bytes_per_s;  // the optimizer step
      ro.link = {profile->links.front().latency_s, profile->links.front().bytes_per_s};
    }
    ro.workload = {o.batch, o.seq_len};
    ro.weight_load_bytes_per_s = o.load_bandwidth;
    ro.pipeline_dtype = *brigade::parse_dtype(o.pipeline_dtype);
    if (o.link_latency) ro.link.latency_s = *o.link_latency;
    if (o.link_bandwidth) ro.link.bytes_per_s = *o.link_bandwidth;
    const auto part = brigade::cost::RooflineCostModel::placed_uniform(spec, shape);
    const brigade::cost::RooflineCostModel cm(spec, part, shape, ro);
    r = brigade::sim::simulate(lowered, cm, sim_opt);
    const std::string device =
        profile ? fmt::format("profile {} ({})", profile->name, o.profile)
                : fmt::format("{:g} FLOP/s, {:g} B/s", o.flops, o.mem_bandwidth);
    costs = fmt::format(
        "{}, model {} ({} decoder layers), batch {} x {} tokens, "
        "{}, link {:g} s + bytes / {:g} B/s, weight loads {:g} B/s; "
        "partition {}",
        profile ? "profiled" : "roofline", o.model, spec.config().n_layers, o.batch, o.seq_len,
        device, ro.link.latency_s, ro.link.bytes_per_s, ro.weight_load_bytes_per_s,
        part.to_string());
    cost_json = {{"kind", profile ? "profiled" : "roofline"},
                 {"profile", profile ? profile->name : std::string()},
                 {"model", o.model},
                 {"batch", o.batch},
                 {"seq_len", o.seq_len},
                 {"flops_per_s", o.flops},
                 {"bytes_per_s", o.mem_bandwidth},
                 {"link_latency_s", ro.link.latency_s},
                 {"link_bytes_per_s", ro.link.bytes_per_s},
                 {"weight_load_bytes_per_s", ro.weight_load_bytes_per_s},
                 {"partition", part.to_string()}};
  } else {
    const auto u = parse_unit_costs(o.unit_costs.empty() ? "1,2" : o.unit_costs);
    const std::optional<double> w = u.size() == 3 ? std::optional<double>(u[2]) : std::nullopt;
    brigade::cost::UnitCostOptions uo;
    if (o.link_latency) uo.link.latency_s = *o.link_latency;
    if (o.link_bandwidth) {
      uo.link.bytes_per_s = *o.link_bandwidth;
      uo.message_bytes = 1.0;  // one unit message per SEND
    }
    uo.weight_load = o.weight_load;
    const brigade::cost::UnitCostModel cm(shape, u[0], u[1], w, uo);
    r = brigade::sim::simulate(lowered, cm, sim_opt);
    costs = w ? fmt::format("unit F={:g} B(BI)={:g} W(BW)={:g} per rank and micro-batch", u[0],
                            u[1], *w)
              : fmt::format("unit F={:g} B={:g} per rank and micro-batch", u[0], u[1]);
    costs += uo.link.is_free() ? ", links free"
                               : fmt::format(", link {:g} s + {:g} unit/s", uo.link.latency_s,
                                             uo.link.bytes_per_s);
    if (o.weight_load > 0.0)
      costs += fmt::format(", a rank's weights load in {:g}", o.weight_load);
    cost_json = {{"kind", "unit"}, {"F", u[0]}, {"B", u[1]}, {"weight_load", o.weight_load}};
    if (w) cost_json["W"] = *w;
  }

  // 3. Report.
  const int P = shape.num_ranks;
  const int V = shape.num_virtual_stages / P;
  auto per_rank = [&](auto const& values, auto fmt_one) {
    std::string s;
    if (P <= 16) {
      for (int k = 0; k < P; ++k)
        s += fmt::format("{}{}", k ? " " : "", fmt_one(values[static_cast<std::size_t>(k)]));
    } else {
      const auto [lo, hi] = std::minmax_element(values.begin(), values.end());
      s = fmt::format("min {} max {} (rank 0: {})", fmt_one(*lo), fmt_one(*hi), fmt_one(values[0]));
    }
    return s;
  };
  fmt::print("schedule     {}: P={} M={} V={} stages={}{} ({} mode)\n", name, P,
             shape.num_microbatches, V, shape.num_virtual_stages,
             shape.mode == sch::Mode::Inference ? fmt::format(" rounds={}", shape.num_chunks) : "",
             sch::to_string(shape.mode));
  fmt::print("validated    {} actions ({} compute), {} messages, completes without deadlock\n",
             proof.actions, proof.compute_actions, proof.messages);
  fmt::print("semantics    {}\n", proof.semantics);
  fmt::print("costs        {}\n", costs);
  fmt::print("makespan     {:.6g} s\n", r.makespan);
  fmt::print("bubble       {:.6f} ({:.2f}% idle rank-time)\n", r.bubble_ratio,
             100 * r.bubble_ratio);
  fmt::print("utilization  {}\n",
             per_rank(r.utilization, [](double x) { return fmt::format("{:.4f}", x); }));
  if (shape.mode == sch::Mode::Training) {
    fmt::print("peak stash   {} micro-batch activations per rank\n",
               per_rank(r.peak_stash, [](int x) { return fmt::format("{}", x); }));
    fmt::print("peak memory  {} {}\n",
               per_rank(r.peak_memory_bytes, [](double x) { return fmt::format("{:.4g}", x); }),
               use_model ? "bytes per rank (stashes + messages held + receive/send windows)"
               : o.link_bandwidth
                   ? "units (1 = a rank's activations for one micro-batch, or one message)"
                   : "units (1 = a rank's activations for one micro-batch)");
  }

  if (proof.weight_actions > 0) {
    fmt::print("weights      peak {} {}; {} PREFETCH/RELEASE\n",
               per_rank(r.peak_weight_bytes, [](double x) { return fmt::format("{:.4g}", x); }),
               use_model ? "bytes resident per rank" : "units resident per rank (1 = all of a rank's)",
               proof.weight_actions);
    fmt::print("I/O wait     {}\n",
               per_rank(r.io_wait_seconds, [](double x) { return fmt::format("{:.4g}", x); }));
  }

  if (!o.trace.empty()) brigade::io::write_chrome_trace(o.trace, r.timeline);
  if (!o.svg.empty()) {
    brigade::sim::SvgOptions so;
    so.title = fmt::format("{}  P={} M={}{}  bubble {:.1f}%", name, P, shape.num_microbatches,
                           V > 1 ? fmt::format(" V={}", V) : "", 100 * r.bubble_ratio);
    so.seconds = use_model;
    so.width = o.svg_width;
    brigade::sim::write_svg(o.svg, r.timeline, so);
  }
  if (!o.metrics.empty()) {
    nlohmann::json j = brigade::sim::metrics_json(r);
    j["schedule"] = name;
    j["microbatches"] = shape.num_microbatches;
    j["virtual_stages_per_rank"] = V;
    j["mode"] = std::string(sch::to_string(shape.mode));
    j["costs"] = cost_json;
    brigade::io::write_file_atomic(o.metrics, j.dump(2) + "\n");
  }
  return 0;
}

std::function<int()> setup(CLI::App& sub) {
  auto o = std::make_shared<Options>();
  std::string names;
  for (const auto& g : sch::generators()) {
    if (!names.empty()) names += ", ";
    names += g.name;
  }
  auto* sched =
      sub.add_option("--schedule", o->schedule, "Generator: " + names)->capture_default_str();
  auto* file = sub.add_option("--schedule-file", o->schedule_file,
                              "Read a schedule in the text form (docs/schedules.md), lower it if "
                              "it is compute-only, validate and simulate it");
  auto* ranks = sub.add_option("--ranks", o->ranks, "Pipeline ranks P")
                    ->check(brigade::cli::number_in<int>(1, 4096, "a whole number from 1 to 4096"))
                    ->capture_default_str();
  auto* mbs = sub.add_option("--microbatches", o->microbatches,
                             "Micro-batches M (inference: sequence groups)")
                  ->check(brigade::cli::number_in<int>(1, 65536, "a whole number from 1 to 65536"))
                  ->capture_default_str();
  auto* virt = sub.add_option("--virtual", o->virtual_stages,
                              "Virtual stages per rank V (default 1; 2 for zb-v and dualpipe-v)")
                   ->check(brigade::cli::number_in<int>(1, 1024, "a whole number from 1 to 1024"))
                   ->capture_default_str();
  auto* dec = sub.add_option("--decode-steps", o->decode_steps,
                             "Inference: decode rounds after the prefill")
                  ->check(brigade::cli::number_in<int>(0, 1 << 20, "a whole number from 0 to 1048576"))
                  ->capture_default_str();
  file->excludes(sched)->excludes(ranks)->excludes(mbs)->excludes(virt)->excludes(dec);
  auto* model = sub.add_option("--model", o->model,
                               "Roofline costs for a named size (260K, 15M, 42M, 110M, 1.1B) or a "
                               "JSON config file with dim, hidden_dim, n_layers, n_heads, "
                               "[n_kv_heads], vocab_size, seq_len");
  auto* unit = sub.add_option("--unit-costs", o->unit_costs,
                              "F,B[,W]: seconds of one rank's share of layers for one micro-batch, "
                              "split evenly over its virtual stages; without W, B is the full "
                              "backward (default 1,2 when --model is absent)");
  model->excludes(unit);
  sub.add_option("--batch", o->batch, "Roofline: sequences per micro-batch")
      ->check(brigade::cli::number_in<int>(1, 1 << 20, "a whole number from 1 to 1048576"))->capture_default_str();
  sub.add_option("--seq-len", o->seq_len,
                 "Roofline: tokens per sequence (inference: prompt length)")
      ->check(brigade::cli::number_in<int>(1, 1 << 24, "a whole number from 1 to 16777216"))->capture_default_str();
  sub.add_option("--profile", o->profile,
                 "With --model: a device profile (docs/profiles.md; e.g. profiles/nvidia_h100_sxm.json), "
                 "one device per rank: layer times per pass from it, the link from its first "
                 "entry (--link-latency / --link-bandwidth still override)")
      ->needs(model);
  sub.add_option("--flops", o->flops, "Roofline: device FLOP/s")
      ->check(brigade::cli::number_in<double>(0, 1e18, "a number of FLOP/s above 0 and at most 1e18", true))
      ->capture_default_str();
  sub.add_option("--mem-bandwidth", o->mem_bandwidth, "Roofline: device memory bytes/s")
      ->check(brigade::cli::number_in<double>(0, 1e16, "a number of bytes/s above 0 and at most 1e16", true))
      ->capture_default_str();
  sub.add_option("--link-latency", o->link_latency,
                 "Link latency in seconds (default: 5e-6 with --model, 0 with unit costs)")
      ->check(brigade::cli::number_in<double>(0, 3600, "a number of seconds from 0 to 3600"));
  sub.add_option("--link-bandwidth", o->link_bandwidth,
                 "Link bytes/s (default: 25e9 with --model, infinite with unit costs; with unit "
                 "costs every message is 1 unit)")
      ->check(brigade::cli::number_in<double>(0, 1e16, "a number of bytes/s above 0 and at most 1e16", true));
  sub.add_option("--trace", o->trace, "Write a Chrome trace (chrome://tracing, Perfetto) JSON");
  sub.add_option("--svg", o->svg, "Write an SVG timeline (ranks as rows)");
  sub.add_option("--svg-width", o->svg_width, "SVG width in px")
      ->check(brigade::cli::number_in<int>(100, 100000, "a whole number of pixels from 100 to 100000"))
      ->capture_default_str();
  sub.add_option("--metrics", o->metrics,
                 "Write makespan, bubble ratio, utilization and peak memory as JSON");
  sub.add_option("--save-schedule", o->save_schedule,
                 "Write the lowered schedule in the text form");
  sub.add_flag("--offload", o->offload,
               "Weight offload (prima.cpp; inference): PREFETCH each window's weights one run "
               "ahead and RELEASE them after (schedule::with_weight_offload)");
  auto* weight_load = sub.add_option("--weight-load", o->weight_load,
                 "Unit costs: seconds to load one rank's whole share of weights (a PREFETCH of a "
                 "window costs this / V)")
      ->check(brigade::cli::number_in<double>(0, 1e9, "a number of seconds from 0 to 1e9"))
      ->capture_default_str();
  auto* load_bw = sub.add_option("--load-bandwidth", o->load_bandwidth,
                 "Roofline: bytes/s a PREFETCH loads weights at (disk or host memory)")
      ->check(brigade::cli::number_in<double>(0, 1e16, "a number of bytes/s above 0 and at most 1e16", true))
      ->capture_default_str();
  weight_load->excludes(model);
  load_bw->needs(model);
  brigade::cli::add_pipeline_dtype_option(sub, o->pipeline_dtype)->needs(model);
  sub.add_flag("--rendezvous", o->rendezvous,
               "Validate for a transport whose sends complete only when received (large MPI or "
               "NCCL messages), with the executor's default windows");
  return [o, virt] {
    o->virtual_given = virt->count() > 0;
    return run(*o);
  };
}

const brigade::cli::Registrar registrar{
    {"simulate", "Simulate a pipeline schedule: makespan, bubble ratio, peak memory", setup}};

}  // namespace
