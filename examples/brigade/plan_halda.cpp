// `brigade plan --halda`: Halda's assignment (prima.cpp §4) for a model over a home cluster's
// device profiles, with the even split and Halda without device removal beside it.
#include "plan_halda.hpp"

#include "cli.hpp"

#include <brigade/io/trace.hpp>
#include <brigade/model/config.hpp>
#include <brigade/model/model_file.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/partition/halda.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <memory>

namespace brigade::cli {

namespace {

const char* case_name(int c) {
  static const char* names[] = {"removed", "M1", "M2", "M3", "M4"};
  return names[c >= 0 && c <= 4 ? c : 0];
}

nlohmann::json result_json(const std::vector<partition::HaldaDevice>& devs,
                           const partition::HaldaModel& m, const partition::HaldaResult& r) {
  const auto mem = partition::halda_memory(devs, m, r);
  nlohmann::json d = nlohmann::json::array();
  for (std::size_t i = 0; i < devs.size(); ++i)
    d.push_back({{"name", devs[i].name},
                 {"case", case_name(r.cases[i])},
                 {"window", r.windows[i]},
                 {"gpu_layers", r.gpu_layers[i]},
                 {"layers", r.windows[i] * r.k},
                 {"ram_bytes", mem[i].ram_bytes},
                 {"vram_bytes", mem[i].vram_bytes},
                 {"disk_bytes_per_token", mem[i].disk_bytes_per_token}});
  return {{"k", r.k}, {"tpot_s", r.tpot_seconds}, {"devices", d}};
}

}  // namespace

void add_halda_plan_options(CLI::App& sub, HaldaPlanArgs& a) {
  sub.add_option("--halda", a.devices,
                 "prima.cpp's Halda: a devices file (brigade.halda_devices/1: per device os, gpu, "
                 "CPU/GPU FLOP/s and memory bandwidth, RAM, VRAM, disk read rate, link; "
                 "docs/ring.md) to assign ring windows and GPU layers for --model");
  sub.add_option("--weight-bits", a.weight_bits,
                 "--halda: bits per weight of the model as stored (4.5 = Q4_K, 8.5 = Q8_0, 16, "
                 "32); default: a model file's own, 4.5 for a named size")
      ->check(number_in<double>(0, 64, "a number of bits above 0 and at most 64", true));
  sub.add_option("--context", a.context, "--halda: KV-cache positions per layer (f16)")
      ->check(number_in<int>(1, 1 << 24, "a whole number from 1 to 16777216"))
      ->capture_default_str();
  sub.add_option("--ring", a.rounds, "--halda: only this k (rounds); 0 = every k dividing the layers")
      ->check(number_in<int>(0, 4096, "0 (all) or a whole number from 1 to 4096"));
  sub.add_flag("--no-device-removal", a.no_removal,
               "--halda: keep every device in the ring (Halda without device selection)");
}

int run_halda_plan(const HaldaPlanArgs& a) {
  const auto devices = partition::load_halda_devices(a.devices);
  BRIGADE_CHECK(!a.model.empty(), Errc::InvalidArgument,
                "--halda needs --model (a named size such as 1.1B, or a model file)");
  model::LlamaConfig config;
  double bits = a.weight_bits;
  std::error_code ec;
  if (std::filesystem::is_regular_file(a.model, ec) || std::filesystem::is_directory(a.model, ec)) {
    const auto w = model::load_model_weights(a.model);  // mapped: only the header is read
    config = w.config;
    if (bits <= 0)
      bits = 8.0 * static_cast<double>(model::weight_bytes(w)) /
             static_cast<double>(config.num_parameters());
  } else {
    config = model::named_config(a.model);
    if (bits <= 0) bits = 4.5;
  }
  const auto m = partition::HaldaModel::of(config, bits, a.context);
  partition::HaldaOptions o;
  o.fixed_k = a.rounds;
  o.remove_devices = !a.no_removal;
  const auto r = partition::halda(devices, m, o);
  partition::HaldaOptions keep = o;
  keep.remove_devices = false;
  const auto all = partition::halda(devices, m, keep);
  const auto even = partition::halda_even_split(devices, m);
  const auto mem = partition::halda_memory(devices, m, r);
  fmt::print("halda: {} ({} layers, {:.2f} bits per weight, {:.1f} MB per layer, context {}) over "
             "{} devices from {}\n",
             a.model, config.n_layers, bits, m.layer_bytes / 1e6, a.context, devices.size(),
             a.devices);
  fmt::print("  {:<28} {:>7} {:>4} {:>4} {:>6} {:>10} {:>10} {:>12}\n", "device", "case", "w", "n",
             "layers", "RAM MB", "VRAM MB", "disk MB/tok");
  for (std::size_t i = 0; i < devices.size(); ++i)
    fmt::print("  {:<28} {:>7} {:>4} {:>4} {:>6} {:>10.0f} {:>10.0f} {:>12.0f}\n", devices[i].name,
               case_name(r.cases[i]), r.windows[i], r.gpu_layers[i], r.windows[i] * r.k,
               mem[i].ram_bytes / 1e6, mem[i].vram_bytes / 1e6, mem[i].disk_bytes_per_token / 1e6);
  fmt::print("k = {} rounds, {} case iterations; predicted TPOT {:.1f} ms\n", r.k, r.iterations,
             r.tpot_seconds * 1e3);
  fmt::print("compare: even split (k = 1) {:.1f} ms, Halda without device removal {:.1f} ms (k = "
             "{}, windows {})\n",
             even.tpot_seconds * 1e3, all.tpot_seconds * 1e3, all.k,
             [&] {
               std::string w;
               for (const int x : all.windows) w += fmt::format("{}{}", w.empty() ? "" : ",", x);
               return w;
             }());
  if (!a.json.empty()) {
    const nlohmann::json j = {{"model", a.model},
                              {"layers", config.n_layers},
                              {"weight_bits", bits},
                              {"halda", result_json(devices, m, r)},
                              {"halda_without_removal", result_json(devices, m, all)},
                              {"even_split", result_json(devices, m, even)}};
    io::write_file_atomic(a.json, j.dump(1) + "\n");
    fmt::print("wrote {}\n", a.json);
  }
  return 0;
}

}  // namespace brigade::cli
