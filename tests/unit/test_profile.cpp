// Device profiles: the JSON schema and its errors, look-ups, the datasheet profiles, and
// `brigade profile` measuring this machine.
#include <brigade/cost/profile.hpp>
#include <brigade/cost/profiled.hpp>
#include <brigade/partition/policies.hpp>
#include <brigade/io/trace.hpp>

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <filesystem>
#include <fstream>
#include <string>

using brigade::test::rel;

using namespace brigade;
namespace fs = std::filesystem;

namespace {

const fs::path kProfiles = BRIGADE_PROFILE_DIR;

/// A small valid profile, by hand.
cost::DeviceProfile sample() {
  cost::DeviceProfile p;
  p.name = "test box";
  p.kind = "cpu";
  p.source = "by hand";
  p.dtype = "f32";
  p.cores = 4;
  using model::Phase;
  p.gemm = {{Phase::Forward, 1, 1, 10e9},         {Phase::Forward, 16, 1, 50e9},
            {Phase::Forward, 256, 1, 90e9},       {Phase::Forward, 1, 4, 30e9},
            {Phase::BackwardInput, 256, 1, 60e9}, {Phase::BackwardWeight, 256, 1, 45e9}};
  p.attention = {{Phase::Decode, 100, 64, 1e-6},
                 {Phase::Decode, 1000, 64, 8e-6},
                 {Phase::Forward, 128, 64, 2e-6},
                 {Phase::BackwardInput, 128, 64, 5e-6}};
  p.core_bytes_per_s = 20e9;
  p.memory_bytes_per_s = 40e9;
  p.memory_capacity_bytes = 16e9;
  p.disk_bytes_per_s = 2e9;
  p.links = {{"in-process", 2e-6, 5e9}};
  return p;
}

std::string error_of(const nlohmann::json& j) {
  try {
    (void)cost::profile_from_json(j, "p.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("profile.json: a profile survives JSON both ways, look-ups interpolate as documented") {
  const auto p = sample();
  const auto q = cost::profile_from_json(cost::to_json(p));
  CHECK(cost::to_json(q) == cost::to_json(p));
  // Products: exact at points, linear in log(rows) between, flat outside; thread counts.
  CHECK(p.gemm_flops_per_s(16) == 50e9);
  CHECK(p.gemm_flops_per_s(4) == doctest::Approx(30e9));  // log 4 is halfway from 1 to 16
  CHECK(p.gemm_flops_per_s(4096) == 90e9);
  CHECK(p.gemm_flops_per_s(64, 4) == 30e9);   // only one point at 4 threads
  CHECK(p.gemm_flops_per_s(64, 2) == doctest::Approx(70e9));  // 2 threads: the 1-thread points
  // Each product has its own points.
  CHECK(p.gemm_flops_per_s(16, 1, model::Phase::BackwardInput) == 60e9);
  CHECK(p.gemm_flops_per_s(4096, 4, model::Phase::BackwardWeight) == 45e9);
  CHECK_THROWS_WITH_AS((void)p.gemm_flops_per_s(16, 1, model::Phase::Decode),
                       doctest::Contains("no 'decode' product"), Error);
  CHECK(p.attention_seconds(10, 8, 64, 256.0, model::Phase::BackwardInput) ==
        rel(10 * 8 * 5e-6 * 2.0));
  CHECK_THROWS_WITH_AS((void)p.attention_seconds(1, 1, 64, 8.0, model::Phase::BackwardWeight),
                       doctest::Contains("no 'backward_weight' attention points"), Error);
  // Attention: linear in context, proportional beyond the last point, per head and token.
  CHECK(p.attention_seconds(1, 1, 64, 550.0) == rel(4.5e-6));
  CHECK(p.attention_seconds(2, 8, 128, 2000.0) == rel(2 * 8 * 2 * 16e-6));
  CHECK(p.attention_seconds(1, 1, 64, 10.0) == rel(1e-6));
  CHECK(p.link("in-process").latency_s == 2e-6);
  CHECK_THROWS_WITH_AS((void)p.link("nvlink"),
                       doctest::Contains("has no link 'nvlink' (it has: in-process)"), Error);
  CHECK_NOTHROW(p.check_fits(15e9, "rank 0"));
  CHECK_THROWS_WITH_AS(p.check_fits(17e9, "rank 1 (weights and KV cache)"),
                       doctest::Contains("rank 1 (weights and KV cache): 17000000000 bytes do not "
                                         "fit in test box's 16000000000 bytes"),
                       Error);
}

TEST_CASE("profile.busy_cores: a product's rate while other cores run products too") {
  auto p = sample();
  using model::Phase;
  // One thread alone: 10 and 50 GFLOP/s; with 4 cores busy: 6 and 40 (as a 4-stage pipeline of
  // 1 thread each runs); 4 intra-op threads alone: 30.
  p.gemm.push_back({Phase::Forward, 1, 1, 6e9, 4});
  p.gemm.push_back({Phase::Forward, 16, 1, 40e9, 4});
  CHECK(p.gemm_flops_per_s(1, 1, Phase::Forward) == 10e9);        // alone
  CHECK(p.gemm_flops_per_s(1, 1, Phase::Forward, 1) == 10e9);     // 1 busy core = alone
  CHECK(p.gemm_flops_per_s(1, 1, Phase::Forward, 2) == 10e9);     // no point at <= 2 busy
  CHECK(p.gemm_flops_per_s(1, 1, Phase::Forward, 4) == 6e9);
  CHECK(p.gemm_flops_per_s(16, 1, Phase::Forward, 8) == 40e9);    // the largest <= 8
  CHECK(p.gemm_flops_per_s(4, 1, Phase::Forward, 4) == doctest::Approx(23e9));  // log-linear
  CHECK(p.gemm_flops_per_s(1, 4, Phase::Forward, 4) == 30e9);     // 4 threads: its own points
  CHECK(p.gemm_flops_per_s(16, 1, Phase::BackwardInput, 4) == 60e9);  // no busy points: alone
  CHECK_THROWS_WITH_AS((void)p.gemm_flops_per_s(1, 1, Phase::Forward, -1),
                       doctest::Contains("with -1 cores busy"), Error);
  // ProfiledLayerTimes reads the busy rate for S x T active cores.
  const model::ModelSpec spec(model::LlamaConfig{64, 128, 2, 4, 4, 32, 16});
  const model::WorkItem one{1, 1, 8.0};
  const double alone = cost::ProfiledLayerTimes(p, 1, 1)(spec, 1, one, Phase::Decode);
  const double busy = cost::ProfiledLayerTimes(p, 1, 4)(spec, 1, one, Phase::Decode);
  CHECK(busy > alone);
  // JSON: written only when set, read back; a count below the threads is refused by name.
  const auto j = cost::to_json(p);
  CHECK_FALSE(j["gemm"][0].contains("busy_cores"));
  CHECK(j["gemm"][6]["busy_cores"] == 4);
  CHECK(cost::to_json(cost::profile_from_json(j)) == j);
  auto bad = j;
  bad["gemm"][3]["busy_cores"] = 2;  // the 4-thread point
  CHECK(error_of(bad).find("field 'gemm[3].busy_cores' = 2, expected 0 (the product alone) or "
                           ">= threads") != std::string::npos);
  bad = j;
  bad["gemm"][6]["busy_cores"] = -3;
  CHECK(error_of(bad).find("gemm[6].busy_cores") != std::string::npos);
}

TEST_CASE("profile.errors: a bad profile names the field") {
  const auto good = cost::to_json(sample());
  auto without = [&](const char* key) {
    auto j = good;
    j.erase(key);
    return j;
  };
  CHECK(error_of(without("memory_bytes_per_s")) ==
        "p.json: field 'memory_bytes_per_s' is missing");
  CHECK(error_of(without("links")) == "p.json: field 'links' is missing");
  auto j = good;
  j["gemm"][1]["flops_per_s"] = -5.0;
  CHECK(error_of(j).find("field 'gemm[1].flops_per_s' = -5, expected > 0") != std::string::npos);
  j = good;
  j["links"][0]["bytes_per_s"] = 0.0;
  CHECK(error_of(j).find("field 'links[0].bytes_per_s' = 0, expected > 0") != std::string::npos);
  j = good;
  j["gemm"][0].erase("rows");
  CHECK(error_of(j) == "p.json: field 'gemm[0].rows' is missing");
  j = good;
  j["attention"][1]["context"] = 2.5;
  CHECK(error_of(j).find("field 'attention[1].context' = 2.5, expected a whole number") !=
        std::string::npos);
  j = good;
  j["cores"] = "four";
  CHECK(error_of(j).find("field 'cores' is \"four\", expected a number") != std::string::npos);
  j = good;
  j["schema"] = "other/9";
  CHECK(error_of(j).find("field 'schema' = 'other/9', expected 'brigade.device_profile/2'") !=
        std::string::npos);
  j = good;
  j["gemm"][4]["product"] = "sideways";
  CHECK(error_of(j).find("field 'gemm[4].product' = 'sideways', expected one of 'forward', "
                         "'backward_input', 'backward_weight'") != std::string::npos);
  j = good;
  j["gemm"].erase(5);  // the only backward_weight point
  CHECK(error_of(j).find("field 'gemm' has no 'backward_weight' product") != std::string::npos);
  j = good;
  j["attention"][2].erase("phase");
  CHECK(error_of(j) == "p.json: field 'attention[2].phase' is missing");
  j = good;
  j["kind"] = "tpu";
  CHECK(error_of(j).find("field 'kind' = 'tpu', expected 'cpu' or 'gpu'") != std::string::npos);
  j = good;
  j["attention"] = nlohmann::json::array();
  CHECK(error_of(j).find("need at least one entry each (6, 0, 1)") != std::string::npos);
  j = good;
  j["memory_capacity_bytes"] = -1;
  CHECK(error_of(j).find("field 'memory_capacity_bytes' = -1, expected > 0") !=
        std::string::npos);
  CHECK(error_of(nlohmann::json::array()) == "p.json: a profile is a JSON object");
  j = good;
  j["memory_bandwith"] = 1e9;
  CHECK(error_of(j).find("p.json: unknown field 'memory_bandwith' (the schema's fields: schema, "
                         "name,") == 0);
  // Files: not JSON, missing.
  const auto bad = fs::temp_directory_path() / "brigade_test_profile_bad.json";
  io::write_file_atomic(bad, "{\"schema\": ");
  CHECK_THROWS_WITH_AS((void)cost::load_profile(bad), doctest::Contains("not JSON"), Error);
  fs::remove(bad);
  CHECK_THROWS_AS((void)cost::load_profile("/nonexistent/p.json"), Error);
  // Saving validates first: nothing is written for a bad profile.
  auto p = sample();
  p.disk_bytes_per_s = 0.0;
  const auto out = fs::temp_directory_path() / "brigade_test_profile_unwritten.json";
  CHECK_THROWS_WITH_AS(cost::save_profile(out, p),
                       doctest::Contains("field 'disk_bytes_per_s' = 0, expected > 0"), Error);
  CHECK_FALSE(fs::exists(out));
}

TEST_CASE("profile.datasheets: the H100 and H200 profiles load and follow their rooflines") {
  const auto h200 = cost::load_profile(kProfiles / "nvidia_h200_sxm.json");
  const auto h100 = cost::load_profile(kProfiles / "nvidia_h100_sxm.json");
  CHECK(h200.kind == "gpu");
  // Decode is bandwidth-bound: one row moves 2 FLOP per bf16 weight (2 bytes) read.
  CHECK(h200.gemm_flops_per_s(1) == doctest::Approx(h200.memory_bytes_per_s));
  CHECK(h100.gemm_flops_per_s(1) == doctest::Approx(h100.memory_bytes_per_s));
  CHECK(h200.gemm_flops_per_s(8) / h100.gemm_flops_per_s(8) == doctest::Approx(4.8 / 3.35));
  CHECK(h200.gemm_flops_per_s(4096) == doctest::Approx(989e12));
  // Attention at 32768 positions: K and V rows of 128 bf16 read at the memory bandwidth.
  CHECK(h200.attention_seconds(1, 1, 128, 32768) ==
        rel(2.0 * 32768 * 128 * 2 / 4.8e12, 0.01));
  CHECK(h200.memory_capacity_bytes > h100.memory_capacity_bytes);
  CHECK(h200.link("nvlink").bytes_per_s == 4.5e11);
}

TEST_CASE("profile.cli: brigade profile measures this machine, --check reads a profile") {
  if (std::string(BRIGADE_CLI).empty()) return;
  const auto out = fs::temp_directory_path() / "brigade_test_profile.json";
  const auto r = test::run_cli("profile --quick --cores 1 --out " + out.string());
  REQUIRE(r.rc == 0);
  const auto p = cost::load_profile(out);
  CHECK(p.kind == "cpu");
  CHECK(p.cores == 1);
  CHECK(p.gemm.size() == 5);  // --quick: forward 1, 16, 64 rows, both backwards 64, one thread
  CHECK(p.attention.size() == 4);  // decode at 64 and 512, training forward and backward at 32
  CHECK(p.links.at(0).transport == "in-process");
  CHECK(p.memory_capacity_bytes > 1e8);
  CHECK(p.source.find("measured by brigade profile") == 0);
  CHECK(r.err.find("written: " + out.string()) != std::string::npos);
  fs::remove(out);
  const auto ok = test::run_cli("profile --check " + (kProfiles / "nvidia_h100_sxm.json").string());
  CHECK(ok.rc == 0);
  CHECK(ok.err.find("profile: NVIDIA H100 SXM (gpu, bf16, 1 cores)") == 0);
  const auto no_tmp = test::run_shell("TMPDIR=/nonexistent " + std::string(BRIGADE_CLI) +
                                      " profile --quick --cores 1 --out " + out.string());
  CHECK(no_tmp.rc != 0);
  CHECK(no_tmp.err.find("error (BadFile): profile: no temporary directory for the disk file") !=
        std::string::npos);
  CHECK_FALSE(fs::exists(out));
  const auto none = test::run_cli("profile");
  CHECK(none.rc != 0);
  CHECK(none.err.find("give --out FILE to measure this machine, or --check FILE") !=
        std::string::npos);
  const auto bad = fs::temp_directory_path() / "brigade_test_profile_cli_bad.json";
  io::write_file_atomic(bad, "{\"schema\": \"brigade.device_profile/2\", \"name\": \"x\"}");
  const auto b = test::run_cli("profile --check " + bad.string());
  CHECK(b.rc != 0);
  CHECK(b.err.find("field 'kind' is missing") != std::string::npos);
  fs::remove(bad);
}

TEST_CASE("profile.layer_times: a layer's time from the profile's products, attention and "
          "bandwidth, per phase, the balanced policy splits by it") {
  using model::Phase;
  const model::ModelSpec spec(model::named_config("42M"));  // dim 512, hidden 1376, vocab 32000
  const auto p = sample();  // products 10 GFLOP/s at 1 row, 50 at 16, 90 at 256; 20 GB/s one core
  const cost::ProfiledLayerTimes one_core(p);
  const double d = 512, h = 1376, v = 32000, kv = 512;
  const double proj = 2 * d * d + 2 * d * kv + 3 * d * h;
  // Decode, 16 sequences at context 550: products at 50 GFLOP/s (their 4-byte weights would take
  // proj * 4 / 20e9 = 0.63 ms, less than the 1.0 ms of FLOPs); attention 4.5 us per token-head.
  const model::WorkItem decode{16, 16, 550.0};
  const double act = 16 * (6 * d + 2 * kv + 3 * h) * 4.0;
  CHECK(one_core(spec, 1, decode, Phase::Decode) ==
        rel(2 * 16 * proj / 50e9 + 16 * 8 * 4.5e-6 + act / 20e9));
  // One row: bound by streaming the weights.
  const double one = one_core(spec, 1, {1, 1, 10.0}, Phase::Decode);
  CHECK(one >= proj * 4 / 20e9);
  CHECK(one == rel(std::max(2 * proj / 10e9, proj * 4 / 20e9) + 8 * 1e-6 +
                   (6 * d + 2 * kv + 3 * h) * 4.0 / 20e9));
  // LM head: rows are sequences in inference; every token in training, where the forward also
  // computes the head's input gradient (with the loss) and the backward input is empty.
  CHECK(one_core(spec, 10, decode, Phase::Decode) ==
        rel(2 * 16 * d * v / 50e9 + 16 * (d + v) * 4 / 20e9));
  const model::WorkItem train{256, 1, 128.0};
  CHECK(one_core(spec, 10, train, Phase::Forward) ==
        rel(2 * 256 * d * v / 90e9 + 2 * 256 * d * v / 60e9 + 3 * 256 * v * 4 / 20e9));
  CHECK(one_core(spec, 10, train, Phase::BackwardInput) == 0.0);
  CHECK(one_core(spec, 10, train, Phase::BackwardWeight) ==
        rel(2 * 256 * d * v / 45e9));
  // Decoder, training: forward with the training attention (2 us per token-head at 128), the
  // backward input with its backward (5 us) and twice the elementwise bytes, the backward
  // weight its 7 products alone.
  const double act256 = 256 * (6 * d + 2 * kv + 3 * h) * 4.0;
  CHECK(one_core(spec, 1, train, Phase::Forward) ==
        rel(2 * 256 * proj / 90e9 + 256 * 8 * 2e-6 + act256 / 20e9));
  CHECK(one_core(spec, 1, train, Phase::BackwardInput) ==
        rel(2 * 256 * proj / 60e9 + 256 * 8 * 5e-6 + 2 * act256 / 20e9));
  CHECK(one_core(spec, 1, train, Phase::BackwardWeight) ==
        rel(2 * 256 * proj / 45e9));
  // On 4 threads the 4-thread points and the all-core bandwidth; with 2 stages of 4 threads
  // busy at once (8 cores), half of it.
  const cost::ProfiledLayerTimes four(p, 4);
  CHECK(four(spec, 10, decode, Phase::Decode) ==
        rel(std::max(2 * 16 * d * v / 30e9, d * v * 4 / 40e9) + 16 * (d + v) * 4 / 40e9));
  const cost::ProfiledLayerTimes shared(p, 4, 8);
  CHECK(shared.bandwidth() == doctest::Approx(20e9));
  CHECK_THROWS_AS(cost::ProfiledLayerTimes(p, 0), Error);
  CHECK_THROWS_WITH_AS(cost::ProfiledLayerTimes(p, 4, 2),
                       doctest::Contains("threads = 4, active cores = 2"), Error);
  // The balanced policy with these times matches balanced() over the same per-layer costs.
  partition::PolicyRequest req;
  req.placement = {0, 1};
  req.num_ranks = 2;
  req.work = decode;
  req.layer_seconds = one_core;
  std::vector<double> costs;
  for (int l = 0; l < spec.num_layers(); ++l)
    costs.push_back(one_core(spec, l, decode, Phase::Decode));
  const auto expect = partition::balanced(spec.num_layers(), 2, costs);
  CHECK(partition::make_partition(spec, "balanced", req).to_string() == expect.to_string());
  // Training: the split balances forward + both backward passes.
  req.training = true;
  req.work = train;
  std::vector<double> units;
  double tail = 0;
  for (int l = 0; l < spec.num_layers(); ++l) {
    const double c = one_core(spec, l, train, Phase::Forward) +
                     one_core(spec, l, train, Phase::BackwardInput) +
                     one_core(spec, l, train, Phase::BackwardWeight);
    if (l <= spec.config().n_layers) units.push_back(c);
    else tail += c;
  }
  units.push_back(tail);
  auto st = partition::balanced(static_cast<int>(units.size()), 2, units).stages();
  CHECK(partition::make_partition(spec, "balanced", req).stage(0).last == st[0].last);
}
