// prima.cpp's pipelined ring on stories260K: k rounds of per-rank windows (partition/ring.hpp),
// with and without mmap weight offload (PREFETCH on a background loader, RELEASE with madvise
// and posix_fadvise), against llama2.c's run.c; resident weight bytes measured with mincore.
#include <brigade/engine/inference.hpp>
#include <brigade/model/gguf.hpp>
#include <brigade/model/text.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/partition/ring.hpp>
#include <brigade/runtime/offload.hpp>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include "test_util.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>

using namespace brigade;
namespace fs = std::filesystem;

namespace {

const fs::path kModels = BRIGADE_MODEL_DIR;
const fs::path kGguf = fs::path(BRIGADE_DATA_DIR) / "stories260K.gguf";

struct Case {
  std::vector<int> prompt_ids, expect;  // expect: every position's token (prompt, generated)
  int steps = 0;
  std::string stdout_text;
};

std::vector<Case> reference_cases() {
  std::vector<Case> out;
  for (const auto& c : test::greedy_reference(kModels).cases)
    out.push_back({c.prompt_ids, c.tokens(), c.steps, c.stdout_text});
  return out;
}

/// n windows over L layers, sizes differing by at most one (earlier windows larger).
std::vector<int> spread(int L, int n) {
  std::vector<int> w;
  for (int i = 0; i < n; ++i) w.push_back(L / n + (i < L % n));
  return w;
}

/// The window list of a ring of `ranks` x `k` rounds over L layers: an even split when k
/// divides L (ring_window_sizes with no list), every window given otherwise.
std::vector<int> windows_for(int L, int ranks, int k) {
  if (L % k == 0 && L / k >= ranks) return partition::ring_window_sizes(L, ranks, k);
  return partition::ring_window_sizes(L, ranks, k, spread(L, ranks * k));
}

/// Copies a model file to a private path, so no other mapping of the same file (another
/// test's) keeps its pages in the page cache while this one releases them.
fs::path private_copy(const fs::path& from, const test::TempDir& dir) {
  const auto to = dir / from.filename().string();
  fs::copy_file(from, to);
  // Written back and dropped from the page cache, so the test starts with what it loads: pages
  // fresh from a write are not let go by POSIX_FADV_DONTNEED at once (dirty, or still in the
  // kernel's per-CPU LRU batches).
  const int fd = ::open(to.c_str(), O_RDONLY);
  REQUIRE(fd >= 0);
  CHECK(::fsync(fd) == 0);
  CHECK(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0);
  ::close(fd);
  return to;
}

}  // namespace

TEST_CASE("ring.stories260K: k = 1..5 rounds, llama2.c and GGUF, weight offload on and off, give "
          "run.c's tokens") {
  const auto cases = reference_cases();
  std::vector<std::pair<std::string, model::LlamaWeights>> models;
  models.emplace_back("llama2.c", model::load_llama2c_checkpoint(kModels / "stories260K.bin"));
  if (test::have_data(kGguf)) models.emplace_back("GGUF", model::load_gguf_llama(kGguf));
  for (const auto& [format, w] : models) {
    CAPTURE(format);
    REQUIRE(w.mapped);
    const model::ModelSpec spec(w.config);
    const int L = w.config.n_layers;
    REQUIRE(L == 5);
    for (int k = 1; k <= 5; ++k) {
      for (int ranks = 1; ranks * k <= L && ranks <= 2; ++ranks) {
        CAPTURE(k);
        CAPTURE(ranks);
        const auto sizes = windows_for(L, ranks, k);
        const auto part = partition::ring_partition(spec, ranks, sizes);
        REQUIRE(part.num_stages() == ranks * k);
        for (const bool offload : {false, true}) {
          CAPTURE(offload);
          std::vector<engine::GenerationRequest> req;
          for (const auto& c : cases) req.push_back({c.prompt_ids, c.steps});
          engine::InferenceOptions opt;
          opt.sampler.temperature = 0.0f;
          opt.weight_offload = offload;
          const auto rep = engine::generate(w, part, req, opt);
          REQUIRE(rep.sequences.size() == cases.size());
          // The GGUF file's context is 128 positions, shorter than the 256-step case: the run
          // stops there with run.c's first tokens (test_gguf.cpp), the one sampled at the last
          // position included.
          for (std::size_t i = 0; i < cases.size(); ++i) {
            const auto n = std::min(cases[i].expect.size(), static_cast<std::size_t>(w.config.seq_len) + 1);
            CHECK(rep.sequences[i].tokens ==
                  std::vector<int>(cases[i].expect.begin(), cases[i].expect.begin() + static_cast<std::ptrdiff_t>(n)));
          }
          REQUIRE(rep.resident_weight_bytes.size() == static_cast<std::size_t>(ranks));
          // The token walked the ring k times: every window computed, rank of window j is j mod ranks.
          std::set<int> ran;
          for (const auto& iv : rep.timeline.intervals())
            if (iv.op == Op::F) {
              ran.insert(iv.virtual_stage);
              CHECK(iv.rank == iv.virtual_stage % ranks);
            }
          CHECK(static_cast<int>(ran.size()) == ranks * k);
          int loads = 0, drops = 0;
          for (const auto& iv : rep.timeline.intervals()) {
            if (iv.op == Op::Prefetch) {
              ++loads;
              CHECK(iv.label == "background");
            }
            if (iv.op == Op::Release) {
              ++drops;
              CHECK(iv.label == "madvise+fadvise");
            }
          }
          CHECK((loads > 0) == offload);
          CHECK(loads == drops);
        }
      }
    }
  }
}

TEST_CASE("ring.offload: resident weights measured with mincore stay within two windows per rank "
          "(background prefetch and demand paging), below the whole model, and tokens hold") {
  const test::TempDir dir("brigade-ring");
  const auto path = private_copy(kModels / "stories260K.bin", dir);
  const auto w = model::load_llama2c_checkpoint(path);
  REQUIRE(w.mapped);
  const model::ModelSpec spec(w.config);
  const auto cases = reference_cases();
  const auto held = model::layer_weight_bytes(w);
  const std::vector<double> layer_bytes(held.begin(), held.end());
  const double model_bytes = std::accumulate(layer_bytes.begin(), layer_bytes.end(), 0.0);
  const double page = static_cast<double>(::sysconf(_SC_PAGESIZE));
  for (const auto& [ranks, k] : {std::pair{1, 5}, std::pair{2, 2}}) {
    const auto part = partition::ring_partition(spec, ranks, windows_for(5, ranks, k));
    const double tied = w.config.shared_classifier ? layer_bytes.front() : 0.0;
    const auto bound = partition::resident_weight_bytes(part, layer_bytes, true, tied);
    for (const bool background : {true, false}) {
      CAPTURE(ranks);
      CAPTURE(k);
      CAPTURE(background);
      engine::InferenceOptions opt;
      opt.sampler.temperature = 0.0f;
      opt.weight_offload = true;
      opt.background_prefetch = background;
      std::vector<engine::GenerationRequest> req{{cases[1].prompt_ids, cases[1].steps}};
      const auto rep = engine::generate(w, part, req, opt);
      CHECK(rep.sequences[0].tokens == cases[1].expect);
      for (int r = 0; r < ranks; ++r) {
        const double got = rep.resident_weight_bytes[static_cast<std::size_t>(r)];
        const double cap = bound[static_cast<std::size_t>(r)];
        MESSAGE("rank " << r << " of " << ranks << " x k " << k << (background ? " (background)" : " (demand)")
                        << ": peak resident " << got << " bytes, two-window bound " << cap
                        << ", model " << model_bytes);
        CHECK(got > 0);
        if (background) {
          // The prefetcher loads exactly a window (read-around is off); each tensor's range is
          // rounded out to whole pages at both ends (llama2.c stores each tensor kind for all
          // layers together, so a layer is 9 ranges): at most 2 pages per range over the bound.
          const double ranges = 9.0 * (5.0 / ranks) + 4;
          CHECK(got <= cap + 2 * ranges * page);
          CHECK(got < 0.8 * model_bytes);
        } else {
          // Demand paging: each fault reads around it (read_ahead_kb, megabytes here), so on a
          // 1 MB model the neighbouring windows come in too; only the tokens are checked.
          CHECK(got <= model_bytes + 8 * page);
        }
      }
    }
  }
}

TEST_CASE("ring.offload: WeightPrefetcher loads a released stage's pages in the background: "
          "settle waits for it and RELEASE leaves none resident") {
  const test::TempDir dir("brigade-prefetch");
  const auto w = model::load_llama2c_checkpoint(private_copy(kModels / "stories260K.bin", dir));
  const model::ModelSpec spec(w.config);
  const std::vector<int> caps{8};
  runtime::InferenceStage stage(w, {0, 1, 3}, caps, model::SamplerConfig{0.0f, 0.9f, 1});
  const double page = static_cast<double>(::sysconf(_SC_PAGESIZE));
  // What loading touched (the NaN scan: every page) goes from the process and the page cache.
  CHECK(stage.resident_weight_bytes() >= stage.weight_bytes());
  CHECK(runtime::release_model_pages(w));
  CHECK(stage.resident_weight_bytes() == 0);
  // Pages a neighbouring layer's tensors share, if the neighbour is mapped: 2 per range.
  const double shared = 2.0 * page * static_cast<double>(stage.weight_pages().size());
  runtime::WeightPrefetcher loader;
  loader.submit(&stage);
  loader.submit(&stage);  // queued once
  loader.settle(&stage);
  CHECK(loader.loads() <= 1);
  if (loader.loads() == 1) {  // not dropped from the queue before it started: loaded in full
    CHECK(stage.resident_weight_bytes() >= stage.weight_bytes());
  }
  CHECK(stage.prefetch_weights());
  CHECK(stage.resident_weight_bytes() >= stage.weight_bytes());
  CHECK(stage.release_weights());
  CHECK(stage.resident_weight_bytes() <= shared);
  // Owned weights: nothing to load or drop; resident is their size.
  const auto owned = model::make_synthetic_weights(model::named_config("260K"), 3);
  runtime::InferenceStage mine(owned, {0, 1, 3}, caps, model::SamplerConfig{0.0f, 0.9f, 1});
  CHECK_FALSE(mine.release_weights());
  CHECK_FALSE(runtime::release_model_pages(owned));
  CHECK(mine.resident_weight_bytes() == mine.weight_bytes());
}

TEST_CASE("ring.errors: k not dividing the layers, a window list that does not cover them, and a "
          "RAM budget below the resident windows are named before anything runs") {
  using partition::ring_window_sizes;
  const auto msg = [](auto f) { return test::error_of(Errc::InvalidArgument, f); };
  CHECK(msg([] { (void)ring_window_sizes(5, 1, 2); }).find(
            "k = 2 rounds does not divide the model's 5 decoder layers") != std::string::npos);
  CHECK(msg([] { (void)ring_window_sizes(5, 1, 2); }).find("use k in {1, 5}") != std::string::npos);
  CHECK(msg([] { (void)ring_window_sizes(4, 3, 2); }).find(
            "3 ranks x k = 2 rounds need at least 6 decoder layers, the model has 4") !=
        std::string::npos);
  const std::vector<int> two{2, 2};
  CHECK(msg([&] { (void)ring_window_sizes(5, 2, 1, two); }).find(
            "the window list 2,2 covers 4 decoder layers (1 round(s)), the model has 5") !=
        std::string::npos);
  CHECK(msg([&] { (void)ring_window_sizes(12, 2, 2, two); }).find(
            "the window list 2,2 covers 8 decoder layers (2 round(s)), the model has 12") !=
        std::string::npos);
  const std::vector<int> three{1, 1, 1};
  CHECK(msg([&] { (void)ring_window_sizes(3, 2, 2, three); }).find(
            "has 3 entries, expected 2 (one per rank, the same every round) or 4") !=
        std::string::npos);
  const std::vector<int> zero{0, 5};
  CHECK(msg([&] { (void)ring_window_sizes(5, 2, 1, zero); }).find("window 0 of the list 0,5 has 0 layers") !=
        std::string::npos);
  // Exact values: prima.cpp's form (w_m repeated) and the full list.
  CHECK(ring_window_sizes(8, 2, 2, two) == std::vector<int>{2, 2, 2, 2});
  CHECK(ring_window_sizes(5, 2, 1) == std::vector<int>{3, 2});
  CHECK(ring_window_sizes(10, 2, 2) == std::vector<int>{3, 2, 3, 2});

  const auto w = model::load_llama2c_checkpoint(kModels / "stories260K.bin");
  const model::ModelSpec spec(w.config);
  const auto part = partition::ring_partition(spec, 1, ring_window_sizes(5, 1, 5));
  CHECK(part.to_string() == "[0,2)@0 [2,3)@0 [3,4)@0 [4,5)@0 [5,9)@0");
  const auto held = model::layer_weight_bytes(w);
  const std::vector<double> bytes(held.begin(), held.end());
  const auto off = partition::resident_weight_bytes(part, bytes, true);
  const auto on = partition::resident_weight_bytes(part, bytes, false);
  // Offload: the largest pair of consecutive windows (cyclic); without: all five.
  double pair = 0;
  std::vector<double> win;
  for (const auto& s : part.stages()) {
    double b = 0;
    for (int l = s.first; l < s.last; ++l) b += bytes[static_cast<std::size_t>(l)];
    win.push_back(b);
  }
  for (std::size_t i = 0; i < win.size(); ++i) pair = std::max(pair, win[i] + win[(i + 1) % win.size()]);
  CHECK(off[0] == pair);
  CHECK(on[0] == std::accumulate(win.begin(), win.end(), 0.0));
  const double budget = pair - 1;
  const auto e = msg([&] {
    partition::check_ring_budget(part, bytes, true, std::span(&budget, 1), "--ram-budget");
  });
  CHECK(e.find("--ram-budget: rank 0 holds") != std::string::npos);
  CHECK(e.find("weight offload on: two windows at a time), over its RAM budget of") != std::string::npos);
  const double enough = pair;
  partition::check_ring_budget(part, bytes, true, std::span(&enough, 1), "--ram-budget");
  CHECK(msg([&] {
          partition::check_ring_budget(part, bytes, false, std::span(&enough, 1), "x");
        }).find("use weight offload (--offload)") != std::string::npos);
}

TEST_CASE("ring.halda: brigade generate --halda runs Halda's windows and prints run.c's text and "
          "brigade plan --halda prints the assignment beside the even split" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  const test::TempDir dir("brigade-halda");
  // Two CPU devices with ample memory for stories260K: both stay in M4.
  nlohmann::json devs = {{"schema", "brigade.halda_devices/1"}, {"devices", nlohmann::json::array()}};
  for (const char* name : {"a", "b"})
    devs["devices"].push_back({{"name", name}, {"os", "linux"}, {"cpu_flops_per_s", 1e11},
                               {"cpu_memory_bytes_per_s", 1e10}, {"ram_bytes", 1e9},
                               {"disk_bytes_per_s", 1e9}, {"link_seconds", 1e-4}});
  const auto file = dir / "devices.json";
  std::ofstream(file) << devs.dump();
  const auto cases = reference_cases();
  const std::string model = "--model " + (kModels / "stories260K.bin").string() + " --tokenizer " +
                            (kModels / "tok512.bin").string();
  const auto r = test::run_cli("generate " + model + " --halda " + file.string() +
                               " --temperature 0 --steps 64 --prompt \"Once upon a time\" --offload");
  REQUIRE(r.rc == 0);
  CHECK(r.out == cases[1].stdout_text);
  CHECK(r.err.find("halda: k = 1, predicted TPOT") != std::string::npos);
  CHECK(r.err.find("halda: a: window ") != std::string::npos);
  const auto both = test::run_cli("generate " + model + " --halda " + file.string() + " --stages 2");
  CHECK(both.rc != 0);
  CHECK(both.err.find("--halda chooses the ranks, k and the windows; drop --stages") != std::string::npos);

  const auto json = dir / "plan.json";
  const auto p = test::run_cli("plan --halda " + (fs::path(BRIGADE_PROFILE_DIR) / "prima_home_cluster.json").string() +
                               " --model 1.1B --weight-bits 16 --json " + json.string());
  REQUIRE(p.rc == 0);
  CHECK(p.out.find("D3 desktop i9 + RTX 2080 Ti") != std::string::npos);
  CHECK(p.out.find("compare: even split (k = 1)") != std::string::npos);
  std::ifstream in(json);
  const auto j = nlohmann::json::parse(in);
  int layers = 0;
  for (const auto& d : j["halda"]["devices"]) layers += d["layers"].get<int>();
  CHECK(layers == 22);
  CHECK(j["halda"]["tpot_s"].get<double>() > 0);
  CHECK(j["halda"]["tpot_s"].get<double>() <= j["even_split"]["tpot_s"].get<double>() * (1 + 1e-12));
  // The named Llama-3.1 shapes of the TP x PP planner (same subcommand) work here too: 80 layers.
  const auto big = test::run_cli("plan --halda " + (fs::path(BRIGADE_PROFILE_DIR) / "prima_home_cluster.json").string() +
                                 " --model llama-3.1-70b --json " + json.string());
  REQUIRE(big.rc == 0);
  std::ifstream in70(json);
  const auto j70 = nlohmann::json::parse(in70);
  CHECK(j70["layers"].get<int>() == 80);
  const auto bad = test::run_cli("plan --halda " + file.string() + "x --model 1.1B");
  CHECK(bad.rc != 0);
  CHECK(bad.err.find("cannot read the devices file") != std::string::npos);
}
