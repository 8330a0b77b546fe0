// Halda (prima.cpp §4) over CBC against brute force over every window assignment.
#include <brigade/cost/memory.hpp>
#include <brigade/model/config.hpp>
#include <brigade/partition/halda.hpp>
#include <brigade/partition/ring.hpp>

#include <fmt/format.h>

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <array>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <functional>
#include <limits>
#include <random>

using brigade::test::rel;

using namespace brigade;
using partition::HaldaDevice;
using partition::HaldaModel;

namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;

/// A seeded home cluster: 2-3 devices, mixed OS and GPUs, memory from far too small to ample.
std::vector<HaldaDevice> seeded_devices(std::mt19937& rng, int M) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<HaldaDevice> out;
  for (int i = 0; i < M; ++i) {
    HaldaDevice d;
    d.name = "d" + std::to_string(i);
    const double r = u(rng);
    d.os = r < 0.3 ? "macos" : r < 0.8 ? "linux" : "android";
    const double g = u(rng);
    if (d.os == "macos") d.gpu = g < 0.5 ? "metal" : "none";
    else if (d.os == "linux") d.gpu = g < 0.5 ? "cuda" : "none";
    d.cpu_flops_per_s = (0.1 + u(rng)) * 1e12;
    d.cpu_memory_bytes_per_s = (10 + 60 * u(rng)) * 1e9;
    d.ram_bytes = (0.5 + 6 * u(rng)) * kGiB;
    d.disk_bytes_per_s = (0.3 + 3 * u(rng)) * 1e9;
    d.link_seconds = 0.002 * u(rng);
    if (d.gpu != "none") {
      d.gpu_flops_per_s = (2 + 15 * u(rng)) * 1e12;
      d.gpu_memory_bytes_per_s = (100 + 500 * u(rng)) * 1e9;
      d.vram_bytes = d.gpu == "metal" ? d.ram_bytes : (1 + 8 * u(rng)) * kGiB;
    }
    if (d.os == "android") d.swap_bytes = 0.5 * kGiB * u(rng);
    out.push_back(d);
  }
  return out;
}

/// A model of L layers of about 0.5 GiB (a 70B-class layer at 4.5 bits).
HaldaModel seeded_model(std::mt19937& rng, int L) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  HaldaModel m;
  m.layers = L;
  m.layer_bytes = (0.2 + 0.6 * u(rng)) * kGiB;
  m.kv_bytes = 0.02 * kGiB;
  m.layer_flops = 2 * m.layer_bytes * 8 / 4.5;
  m.vocab_size = 32000;
  m.input_bytes = 0.3 * kGiB;
  m.output_bytes = 0.3 * kGiB;
  m.output_flops = 2.0 * 32000 * 8192;
  return m;
}

struct Best {
  double t = std::numeric_limits<double>::infinity();
  std::vector<int> w, n;
  int k = 0;
};

/// Every k dividing L (k <= L / 2, or 1), every w with w_m >= 1 and sum L / k, every n with
/// 0 <= n_m <= w_m within VRAM (none without a GPU): the latency model at the cases each
/// assignment puts the devices in. With `cases` given, only assignments whose own cases are
/// those (the integer program of those cases).
Best brute_force(const std::vector<HaldaDevice>& devs, const HaldaModel& m,
                 const std::vector<int>* cases = nullptr, int only_k = 0) {
  const int M = static_cast<int>(devs.size());
  const double bp = m.layer_bytes + m.kv_bytes;
  Best best;
  for (int k = 1; k <= std::max(1, m.layers / 2); ++k) {
    if (m.layers % k != 0 || (only_k > 0 && k != only_k)) continue;
    const int W = m.layers / k;
    std::vector<int> w(static_cast<std::size_t>(M)), n(static_cast<std::size_t>(M));
    std::function<void(int, int)> place_w, place_n;
    place_n = [&](int i, int) {
      if (i == M) {
        const auto c = partition::halda_cases(devs, m, w, n, k);
        if (cases != nullptr && c != *cases) return;
        const double t = partition::halda_latency(devs, m, c, w, n, k);
        if (t < best.t - 1e-12) best = {t, w, n, k};
        return;
      }
      const auto& d = devs[static_cast<std::size_t>(i)];
      const int cap = d.gpu == "none" ? 0
                                      : std::min(w[static_cast<std::size_t>(i)],
                                                 static_cast<int>(std::floor(W * d.vram_bytes / (m.layers * bp) + 1e-9)));
      for (int x = 0; x <= cap; ++x) {
        n[static_cast<std::size_t>(i)] = x;
        place_n(i + 1, 0);
      }
    };
    place_w = [&](int i, int left) {
      if (i == M - 1) {
        if (left < 1) return;
        w[static_cast<std::size_t>(i)] = left;
        place_n(0, 0);
        return;
      }
      for (int x = 1; x <= left - (M - 1 - i); ++x) {
        w[static_cast<std::size_t>(i)] = x;
        place_w(i + 1, left - x);
      }
    };
    place_w(0, W);
  }
  return best;
}

}  // namespace

TEST_CASE("halda: on seeded small clusters, each integer program's CBC optimum is brute force's "
          "for its cases, and Halda's result equals the brute-force optimum over all window "
          "assignments (prima.cpp's single start reaches it on most)") {
  int single_at_optimum = 0, instances = 0;
  for (unsigned seed = 1; seed <= 24; ++seed) {
    std::mt19937 rng(seed);
    const int M = 2 + static_cast<int>(seed % 2);
    const int L = std::array<int, 4>{4, 6, 8, 12}[seed % 4];
    const auto devs = seeded_devices(rng, M);
    const auto model = seeded_model(rng, L);
    CAPTURE(seed);
    CAPTURE(L);
    partition::HaldaOptions o;
    o.remove_devices = false;
    partition::HaldaResult r;
    try {
      r = partition::halda(devs, model, o);
    } catch (const Error& e) {
      // No assignment fits: brute force must find none either.
      CHECK(std::string(e.what()).find("no assignment of the") != std::string::npos);
      CHECK(std::isinf(brute_force(devs, model).t));
      continue;
    }
    ++instances;
    // The integer program of Halda's final cases and k: CBC's optimum is brute force's.
    const auto same_cases = brute_force(devs, model, &r.cases, r.k);
    REQUIRE(std::isfinite(same_cases.t));
    CHECK(r.tpot_seconds == rel(same_cases.t, 1e-9));
    CHECK(r.cases == partition::halda_cases(devs, model, r.windows, r.gpu_layers, r.k));
    // Over every assignment and every k.
    const auto all = brute_force(devs, model);
    CHECK(r.tpot_seconds == rel(all.t, 1e-9));
    CHECK(std::accumulate(r.windows.begin(), r.windows.end(), 0) * r.k == L);
    // prima.cpp's single start: optimal for its own cases, not always globally.
    partition::HaldaOptions single = o;
    single.all_case_starts = false;
    const auto p = partition::halda(devs, model, single);
    CHECK(p.tpot_seconds >= all.t * (1 - 1e-9));
    CHECK(p.tpot_seconds == rel(brute_force(devs, model, &p.cases, p.k).t, 1e-9));
    if (p.tpot_seconds <= all.t * (1 + 1e-9)) ++single_at_optimum;
  }
  MESSAGE("prima.cpp's single start at the global optimum on " << single_at_optimum << " of "
                                                              << instances << " seeded instances");
  CHECK(instances >= 12);
}

TEST_CASE("halda: a device that only slows the ring is removed: without removal it keeps a "
          "window and the predicted TPOT is higher") {
  HaldaModel m;
  m.layers = 8;
  m.layer_bytes = 0.5 * kGiB;
  m.kv_bytes = 0.01 * kGiB;
  m.layer_flops = 2e9;
  m.vocab_size = 32000;
  m.input_bytes = m.output_bytes = 0.25 * kGiB;
  m.output_flops = 5e8;
  HaldaDevice fast;
  fast.name = "desktop";
  fast.gpu = "cuda";
  fast.cpu_flops_per_s = 1e12;
  fast.cpu_memory_bytes_per_s = 50e9;
  fast.gpu_flops_per_s = 1e13;
  fast.gpu_memory_bytes_per_s = 500e9;
  fast.ram_bytes = 8 * kGiB;
  fast.vram_bytes = 8 * kGiB;
  fast.disk_bytes_per_s = 3e9;
  HaldaDevice slow;
  slow.name = "phone";
  slow.os = "android";
  slow.cpu_flops_per_s = 5e10;
  slow.cpu_memory_bytes_per_s = 5e9;
  slow.ram_bytes = 0.6 * kGiB;
  slow.disk_bytes_per_s = 0.5e9;
  slow.link_seconds = 0.01;
  const std::vector<HaldaDevice> devs{fast, slow};
  const auto kept = partition::halda(devs, m);
  CHECK(kept.windows[1] == 0);
  CHECK(kept.windows[0] * kept.k == 8);
  CHECK(kept.cases[1] == 0);
  CHECK(kept.kept() == std::vector<int>{0});
  partition::HaldaOptions no;
  no.remove_devices = false;
  const auto all = partition::halda(devs, m, no);
  CHECK(all.windows[1] >= 1);
  CHECK(all.tpot_seconds > kept.tpot_seconds);
  // The latency model by hand for the single desktop: 8 layers on its GPU, k = 1 (all in VRAM:
  // case M4), plus the head's LM head and one embedding row read from disk.
  const double t_gpu = std::max(m.layer_flops / 1e13, m.layer_bytes / 500e9);
  const double t_out = std::max(m.output_flops / 1e12, m.output_bytes / 50e9);
  const double want = kept.k * (kept.windows[0] * std::max(m.layer_flops / 1e12, m.layer_bytes / 50e9) +
                                kept.gpu_layers[0] * (t_gpu - std::max(m.layer_flops / 1e12, m.layer_bytes / 50e9))) +
                      t_out + (m.input_bytes / m.vocab_size) / 3e9;
  CHECK(kept.tpot_seconds == rel(want, 1e-12));
  CHECK(kept.gpu_layers[0] == kept.windows[0]);
}

TEST_CASE("halda: bad profiles and models are named") {
  HaldaModel m;
  m.layers = 4;
  m.layer_bytes = 1e6;
  HaldaDevice d;
  d.name = "x";
  const auto msg = [](auto f) { return test::error_of(Errc::InvalidArgument, f); };
  CHECK(msg([&] { (void)partition::halda({d}, m); }).find("device 0 (x): cpu_flops_per_s = 0, expected a positive number") !=
        std::string::npos);
  d.cpu_flops_per_s = d.cpu_memory_bytes_per_s = d.ram_bytes = d.disk_bytes_per_s = 1e9;
  d.os = "windows";
  CHECK(msg([&] { (void)partition::halda({d}, m); }).find("os 'windows', expected macos, linux or android") !=
        std::string::npos);
  d.os = "linux";
  d.gpu = "metal";
  CHECK(msg([&] { (void)partition::halda({d}, m); }).find("gpu metal needs os macos") != std::string::npos);
  d.gpu = "none";
  partition::HaldaOptions o;
  o.fixed_k = 3;
  CHECK(msg([&] { (void)partition::halda({d}, m, o); }).find("k = 3 does not divide the model's 4 layers") !=
        std::string::npos);
  CHECK(msg([&] { (void)partition::halda({}, m); }).find("halda: no devices") != std::string::npos);
  // A device whose RAM and disk cannot serve the model is still assigned (it reads from disk);
  // a layer that does not fit a device's memory budget in M4... one device, 4 layers: feasible.
  const auto r = partition::halda({d}, m);
  CHECK(r.windows == std::vector<int>{4 / r.k});
}

TEST_CASE("halda: Llama-3-70B (Q4_K) on prima.cpp's four home devices: Halda, Halda without "
          "device removal and the even split (docs/ring.md)") {
  const auto devs = partition::load_halda_devices(std::filesystem::path(BRIGADE_PROFILE_DIR) /
                                                  "prima_home_cluster.json");
  REQUIRE(devs.size() == 4);
  model::LlamaConfig c;  // Llama-3-70B's published config.json
  c.dim = 8192;
  c.hidden_dim = 28672;
  c.n_layers = 80;
  c.n_heads = 64;
  c.n_kv_heads = 8;
  c.vocab_size = 128256;
  c.seq_len = 8192;
  c.shared_classifier = false;
  const auto m = HaldaModel::of(c, 4.5, 4096);
  const auto h = partition::halda(devs, m);
  partition::HaldaOptions keep;
  keep.remove_devices = false;
  const auto all = partition::halda(devs, m, keep);
  const auto even = partition::halda_even_split(devs, m);
  for (const auto* r : {&h, &all, &even}) {
    CHECK(std::accumulate(r->windows.begin(), r->windows.end(), 0) * r->k == 80);
    for (std::size_t i = 0; i < 4; ++i) CHECK(r->gpu_layers[i] <= r->windows[i]);
  }
  CHECK(h.tpot_seconds <= all.tpot_seconds * (1 + 1e-12));
  CHECK(all.tpot_seconds <= even.tpot_seconds * (1 + 1e-12));
  const auto line = [&](const char* what, const partition::HaldaResult& r) {
    std::string s = fmt::format("{}: k = {}, TPOT {:.0f} ms;", what, r.k, r.tpot_seconds * 1e3);
    for (std::size_t i = 0; i < devs.size(); ++i)
      s += fmt::format(" {} M{} w={} n={}", devs[i].name, r.cases[i], r.windows[i], r.gpu_layers[i]);
    return s;
  };
  MESSAGE(line("Halda", h));
  MESSAGE(line("Halda without device removal", all));
  MESSAGE(line("even split", even));
}

TEST_CASE("halda: the ring plan of Halda's windows holds what Halda's memory model puts on each "
          "device, the head's output layers included") {
  // A small untied Llama at f32 (Halda's bytes at 32 bits are the stored bytes): three CPU
  // devices with ample RAM (all M4: everything resident), the head first.
  model::LlamaConfig c = model::named_config("260K");  // dim 64, hidden 172, vocab 512
  c.n_layers = 6;
  c.shared_classifier = false;
  const int context = 32;
  const auto m = HaldaModel::of(c, 32, context);
  std::vector<HaldaDevice> devs;
  for (int i = 0; i < 3; ++i) {
    HaldaDevice d;
    d.name = fmt::format("d{}", i);
    d.cpu_flops_per_s = (1 + i) * 1e11;
    d.cpu_memory_bytes_per_s = 2e10;
    d.ram_bytes = 1e9;
    d.disk_bytes_per_s = 1e9;
    d.link_seconds = 1e-5;
    devs.push_back(d);
  }
  partition::HaldaOptions keep;
  keep.remove_devices = false;
  const auto h = partition::halda(devs, m, keep);
  REQUIRE(h.kept().size() == 3);
  const auto mem = partition::halda_memory(devs, m, h);
  const model::ModelSpec spec(c);
  const auto part = partition::ring_partition(
      spec, 3, partition::ring_window_sizes(c.n_layers, 3, h.k, h.windows));
  const auto bytes = cost::layer_weight_bytes(spec);
  const auto held = partition::resident_weight_bytes(part, bytes, false);
  // Halda's head holds one embedding row (prima.cpp pages in the rows it reads); the plan
  // counts the whole table. The output layers (b_o: final norm and LM head) are on the head
  // in both.
  for (std::size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    const double kv = h.k * h.windows[i] * m.kv_bytes;
    const double head = i == 0 ? m.input_bytes - m.input_bytes / m.vocab_size : 0.0;
    CHECK(held[i] == doctest::Approx(mem[i].ram_bytes - kv + head).epsilon(1e-12));
  }
  CHECK(part.stage(part.num_stages() - 1).rank == 0);
  CHECK(bytes[static_cast<std::size_t>(spec.num_layers() - 2)] + bytes[static_cast<std::size_t>(spec.num_layers() - 3)] ==
        doctest::Approx(m.output_bytes).epsilon(1e-12));
}
