// `brigade generate` as a user runs it: byte-exact stdout, metrics and trace files, clear errors.
#include <brigade/model/gguf.hpp>
#include <doctest/doctest.h>
#include "test_util.hpp"
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <regex>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <sys/wait.h>
#include <unistd.h>

namespace fs = std::filesystem;

namespace {

const fs::path kData = BRIGADE_MODEL_DIR;  // the committed models/

using brigade::test::run_cli;

std::string model_flags() {
  return "--model " + (kData / "stories260K.bin").string() + " --tokenizer " +
         (kData / "tok512.bin").string();
}

brigade::test::GreedyReference reference() { return brigade::test::greedy_reference(kData); }

}  // namespace

TEST_CASE("cli.generate: stdout is byte-identical to run.c, two prompts in flight, 3 stages" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  const auto ref = reference();
  const auto& c0 = ref.cases[0];  // empty prompt, 256 steps
  const auto& c1 = ref.cases[1];  // "Once upon a time", 64 steps
  // Same --steps for both prompts: run the 64-step case with both, compare each separately.
  const brigade::test::TempDir tmp("brigade_cli_generate");
  const fs::path metrics = tmp / "metrics.json";
  const fs::path trace = tmp / "trace.json";
  auto r = run_cli("generate " + model_flags() + " --temperature 0 --stages 3 --steps 64 " +
                   "--prompt \"Once upon a time\" --prompt \"Once upon a time\" --metrics " +
                   metrics.string() + " --trace " + trace.string());
  REQUIRE(r.rc == 0);
  const std::string one = c1.stdout_text;
  CHECK(r.out == one + one);
  CHECK(r.err.find("tokens/s") != std::string::npos);
  CHECK(r.err.find("TTFT") != std::string::npos);
  std::ifstream mf(metrics);
  const auto m = nlohmann::json::parse(mf);
  CHECK(m["generated_tokens"] == 120);
  CHECK(m["stage_stats"].size() == 3);
  CHECK(m["sequences"][0]["tokens"].size() == 65);
  std::ifstream tf(trace);
  const auto t = nlohmann::json::parse(tf);
  int rows = 0;
  for (const auto& ev : t["traceEvents"]) rows += ev["ph"] == "M";
  CHECK(rows == 3);

  auto r0 = run_cli("generate " + model_flags() + " --temperature 0 --stages 5 --partition uniform");
  REQUIRE(r0.rc == 0);
  CHECK(r0.out == c0.stdout_text);
}

TEST_CASE("cli.generate: BRIGADE_KERNEL_ISA picks the decode kernel (same tokens), and a bad one "
          "is refused by name" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  const auto& c1 = reference().cases[1];  // "Once upon a time", 64 steps
  const std::string args =
      " generate " + model_flags() + " --temperature 0 --steps 64 --prompt \"Once upon a time\"";
  // generic runs everywhere: the portable kernel gives run.c's bytes, as every kernel does
  auto r = brigade::test::run_shell("BRIGADE_KERNEL_ISA=generic " + std::string(BRIGADE_CLI) + args);
  REQUIRE(r.rc == 0);
  CHECK(r.out == c1.stdout_text);
  auto bad = brigade::test::run_shell("BRIGADE_KERNEL_ISA=sse9 " + std::string(BRIGADE_CLI) + args);
  CHECK(bad.rc != 0);
  CHECK(bad.out.empty());
  CHECK(bad.err.find("BRIGADE_KERNEL_ISA 'sse9'; expected generic, avx2 or avx512") !=
        std::string::npos);
}

TEST_CASE("cli.generate: --plan auto prints every candidate, runs its pick, same tokens as run.c" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  const auto ref = reference();
  const std::string one = ref.cases[1].stdout_text;  // "Once upon a time", 64 steps
  auto r = run_cli("generate " + model_flags() + " --temperature 0 --steps 64 --plan auto " +
                   "--cores 2 --prompt \"Once upon a time\" --prompt \"Once upon a time\" " +
                   "--prompt \"Once upon a time\"");
  REQUIRE(r.rc == 0);
  CHECK(r.out == one + one + one);  // greedy tokens do not depend on the plan
  // 2 cores, 3 sequences: 1 stage x {1, 2} threads x G in 1..3, 2 stages x 1 thread x G in 1..3.
  int candidates = 0, picks = 0;
  std::istringstream lines(r.err);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("plan: ", 0) == 0 && line.find("tokens/s predicted") != std::string::npos) {
      ++candidates;
      picks += line.rfind("plan: *", 0) == 0;
    }
  }
  CHECK(candidates == 9);
  CHECK(picks == 1);
  CHECK(r.err.find("GFLOP/s") != std::string::npos);
  auto bad = run_cli("generate " + model_flags() + " --plan sometimes");
  CHECK(bad.rc != 0);
  CHECK(bad.err.find("--plan") != std::string::npos);
  // What the planner chooses cannot also be given: nothing given is overridden silently.
  auto both = run_cli("generate " + model_flags() + " --plan auto --stages 2 --partition uniform");
  CHECK(both.rc != 0);
  CHECK(both.err.find("--plan auto chooses the stages, the split, the micro-batches and the "
                      "threads; drop --stages, --partition (or use --plan manual)") !=
        std::string::npos);
}

TEST_CASE("cli.generate: --ring K / --windows put k rounds of windows on the ranks and still "
          "print run.c's text. K not dividing the layers, windows not covering them, a RAM "
          "budget or a profile too small are named before anything runs" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  const auto ref = reference();
  const std::string one = ref.cases[1].stdout_text;
  const std::string story = " --temperature 0 --steps 64 --prompt \"Once upon a time\"";
  // 2 ranks x 2 rounds, every window given (stories260K has 5 decoder layers).
  auto r = run_cli("generate " + model_flags() + " --stages 2 --ring 2 --windows 2,1,1,1" + story);
  REQUIRE(r.rc == 0);
  CHECK(r.out == one);
  CHECK(r.err.find("window 2: layers [4, 5) on rank 0, rank busy") != std::string::npos);
  // The output layers (final norm, LM head, sampler) on the head, after the last window.
  CHECK(r.err.find("window 3: layers [5, 6) on rank 1, rank busy") != std::string::npos);
  CHECK(r.err.find("output 4: layers [6, 9) on rank 0, rank busy") != std::string::npos);
  // 1 rank, k = 5 (even: one layer per window), with offload and a RAM budget it fits.
  const auto tag = std::to_string(::getpid());
  const auto metrics = (std::filesystem::temp_directory_path() / ("ring-" + tag + ".json")).string();
  auto five = run_cli("generate " + model_flags() + " --stages 1 --ring 5 --offload --ram-budget 700000 --metrics " +
                      metrics + story);
  REQUIRE(five.rc == 0);
  CHECK(five.out == one);
  CHECK(five.err.find("window 4: layers [5, 9) on rank 0") != std::string::npos);
  CHECK(five.err.find("rank 0: at most ") != std::string::npos);
  {
    std::ifstream in(metrics);
    const auto j = nlohmann::json::parse(in);
    CHECK(j["ring"] == 5);
    CHECK(j["offload"] == true);
    CHECK(j["prefetch"] == "background");
    REQUIRE(j["resident_weight_bytes"].size() == 1);
    CHECK(j["resident_weight_bytes"][0].get<double>() > 0);
  }
  std::filesystem::remove(metrics);
  auto bad = run_cli("generate " + model_flags() + " --stages 2 --ring 2");
  CHECK(bad.rc != 0);
  CHECK(bad.err.find("k = 2 rounds does not divide the model's 5 decoder layers") !=
        std::string::npos);
  auto cover = run_cli("generate " + model_flags() + " --stages 2 --windows 2,2");
  CHECK(cover.rc != 0);
  CHECK(cover.err.find("the window list 2,2 covers 4 decoder layers (1 round(s)), the model has 5") !=
        std::string::npos);
  auto budget = run_cli("generate " + model_flags() + " --stages 1 --ring 5 --offload --ram-budget 100000");
  CHECK(budget.rc != 0);
  CHECK(budget.err.find("--ram-budget: rank 0 holds") != std::string::npos);
  CHECK(budget.out.empty());
  // A profile whose memory cannot hold the two windows a rank keeps under offload.
  nlohmann::json prof;
  {
    std::ifstream in(std::filesystem::path(BRIGADE_PROFILE_DIR) / "nvidia_h100_sxm.json");
    prof = nlohmann::json::parse(in);
  }
  prof["name"] = "tiny";
  prof["memory_capacity_bytes"] = 100000;
  const auto pfile = (std::filesystem::temp_directory_path() / ("tiny-" + tag + ".json")).string();
  std::ofstream(pfile) << prof.dump();
  auto small = run_cli("generate " + model_flags() + " --stages 1 --ring 5 --offload --profile " + pfile);
  CHECK(small.rc != 0);
  CHECK(small.err.find("profile tiny: rank 0 holds") != std::string::npos);
  auto whole = run_cli("generate " + model_flags() + " --stages 1 --profile " + pfile);
  CHECK(whole.rc != 0);
  CHECK(whole.err.find("profile tiny: memory_capacity_bytes = 100000 is smaller than the model's weights") !=
        std::string::npos);
  std::filesystem::remove(pfile);
  auto np = run_cli("generate " + model_flags() + " --stages 1 --no-prefetch");
  CHECK(np.rc != 0);
  CHECK(np.err.find("--no-prefetch changes how --offload loads windows; give --offload too") !=
        std::string::npos);
}

TEST_CASE("cli.generate: --pipeline-dtype bf16 sends half the activation bytes and prints run.c's "
          "story, an unknown dtype is refused" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  const auto ref = reference();
  const std::string story = ref.cases[1].stdout_text;
  const auto tag = std::to_string(::getpid());
  std::map<std::string, nlohmann::json> metrics;
  for (const std::string dtype : {"f32", "bf16"}) {
    const fs::path path = fs::temp_directory_path() / ("brigade_cli_dtype_" + dtype + tag + ".json");
    auto r = run_cli("generate " + model_flags() + " --temperature 0 --stages 2 --steps 64 " +
                     "--prompt \"Once upon a time\" --pipeline-dtype " + dtype + " --metrics " +
                     path.string());
    REQUIRE(r.rc == 0);
    CHECK(r.out == story);
    CHECK(r.err.find("MB sent (" + dtype + " activations)") != std::string::npos);
    std::ifstream in(path);
    metrics[dtype] = nlohmann::json::parse(in);
    fs::remove(path);
    CHECK(metrics[dtype]["pipeline_dtype"] == dtype);
  }
  // Prompt rows once, then one row per decode step, 64 columns, 2 bytes saved per value.
  const std::int64_t prompt = static_cast<std::int64_t>(ref.cases[1].prompt_ids.size());
  const std::int64_t generated = metrics["f32"]["generated_tokens"];
  CHECK(metrics["f32"]["sent_bytes"].get<std::int64_t>() -
            metrics["bf16"]["sent_bytes"].get<std::int64_t>() ==
        (prompt + generated - 1) * 64 * 2);
  auto bad = run_cli("generate " + model_flags() + " --pipeline-dtype q8_0");
  CHECK(bad.rc != 0);
  CHECK(bad.err.find("--pipeline-dtype") != std::string::npos);
  CHECK(bad.err.find("q8_0") != std::string::npos);
}

TEST_CASE("cli.generate: bad input gets one clear line and a non-zero exit" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  SUBCASE("unknown flag") {
    auto r = run_cli("generate --no-such-flag");
    CHECK(r.rc != 0);
    CHECK(r.err.find("--no-such-flag") != std::string::npos);
  }
  SUBCASE("missing model file") {
    auto r = run_cli("generate --model /nonexistent/model.bin");
    CHECK(r.rc != 0);
    CHECK(r.err.find("/nonexistent/model.bin") != std::string::npos);
  }
  SUBCASE("model without tokenizer") {
    auto r = run_cli("generate --model " + (kData / "stories260K.bin").string());
    CHECK(r.rc != 0);
    CHECK(r.err.find("--model with a llama2.c or safetensors checkpoint needs --tokenizer") !=
          std::string::npos);
  }
  SUBCASE("too many stages") {
    auto r = run_cli("generate " + model_flags() + " --stages 12");
    CHECK(r.rc != 0);
    CHECK(r.err.find("--stages 12 outside [1, 9]") != std::string::npos);
  }
  SUBCASE("unknown synthetic size") {
    auto r = run_cli("generate --synthetic 7B");
    CHECK(r.rc != 0);
    CHECK(r.err.find("unknown model size '7B'") != std::string::npos);
  }
  SUBCASE("a truncated checkpoint") {
    const brigade::test::TempDir tmp("brigade_truncated");
    const fs::path bad = tmp / "stories260K_first_1000_bytes.bin";
    {
      std::ifstream in(kData / "stories260K.bin", std::ios::binary);
      std::string bytes(1000, '\0');
      in.read(bytes.data(), 1000);
      std::ofstream out(bad, std::ios::binary);
      out.write(bytes.data(), 1000);
    }
    auto r = run_cli("generate --model " + bad.string() + " --tokenizer " +
                     (kData / "tok512.bin").string());
    CHECK(r.rc != 0);
    CHECK(r.err.find(bad.string()) != std::string::npos);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  }
}

TEST_CASE("cli.train: a short run checkpoints a model that generate loads, with metrics per step" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  const fs::path dir =
      fs::temp_directory_path() / ("brigade_cli_train_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const fs::path metrics = dir / "metrics.jsonl";
  fs::create_directories(dir);
  auto r = run_cli("train " + model_flags() + " --stages 2 --schedule zb-h1 --microbatches 2 " +
                   "--tokens-per-microbatch 64 --steps 4 --checkpoint-dir " + dir.string() +
                   " --metrics " + metrics.string());
  REQUIRE(r.rc == 0);
  CHECK(r.err.find("bubble ratio measured") != std::string::npos);
  // The peak memory per rank, measured and simulated for the same steps: the same figures.
  std::smatch mem;
  REQUIRE(std::regex_search(r.err, mem,
                            std::regex(R"(peak memory per rank \([^)]*\): measured ([0-9. ]+), )"
                                       R"(simulated ([0-9. ]+)\n)")));
  CHECK(mem[1].str() == mem[2].str());
  std::ifstream mf(metrics);
  int lines = 0;
  for (std::string line; std::getline(mf, line); ++lines) {
    const auto j = nlohmann::json::parse(line);
    CHECK(j["step"] == lines + 1);
    CHECK(j["loss"].get<double>() > 0.0);
    CHECK(j["tokens"].get<int>() > 0);
    REQUIRE(j["peak_memory_bytes"].size() == 2);
    CHECK(j["peak_memory_bytes"][0].get<double>() > 0.0);
    CHECK(j["peak_memory_bytes"][1].get<double>() > 0.0);
  }
  CHECK(lines == 4);
  auto g = run_cli("generate --model " + (dir / "model.bin").string() + " --tokenizer " +
                   (kData / "tok512.bin").string() + " --steps 8 --temperature 0");
  CHECK(g.rc == 0);
  CHECK(!g.out.empty());
  fs::remove_all(dir);
}

TEST_CASE("cli.train: zb-v and dualpipe-v run with the V shape's two chunks per rank by default" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  for (const char* schedule : {"zb-v", "dualpipe-v"}) {
    CAPTURE(schedule);
    auto r = run_cli("train " + model_flags() + " --stages 2 --schedule " + schedule +
                     " --microbatches 4 --tokens-per-microbatch 64 --steps 2");
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    CHECK(r.err.find(std::string("schedule: ") + schedule + " on 2 ranks x 2 virtual") !=
          std::string::npos);
    CHECK(r.err.find("bubble ratio measured") != std::string::npos);
  }
  auto bad = run_cli("train " + model_flags() + " --stages 2 --schedule zb-v --virtual 3");
  CHECK(bad.rc != 0);
  CHECK(bad.err.find("zb-v: virtual stages per rank = 3") != std::string::npos);
}

// issue 15: the four batchers in one run, one after another from the same model on the same
// global batches (the same samples each step): padding, offsets and dynamic attend within each
// sample, so their first step's loss is the same to 1e-5 (packing attends across a row of
// several samples). Useful tokens are the same for all; one table compares them; each step's
// metrics give the mean loss per task.
TEST_CASE("cli.train: --batching padding,packing,offsets,dynamic runs the four in one process on "
          "the same samples with a plan per step, one table, per-task loss, bad values are named" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  const fs::path dir =
      fs::temp_directory_path() / ("brigade_cli_batching_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path metrics = dir / "m.jsonl";
  auto r = run_cli("train " + model_flags() + " --stages 2 --microbatches 4 " +
                   "--tokens-per-microbatch 64 --steps 2 --batching padding,packing,offsets,dynamic "
                   "--metrics " + metrics.string());
  CAPTURE(r.err);
  REQUIRE(r.rc == 0);
  std::map<std::string, std::vector<nlohmann::json>> steps;
  std::ifstream mf(metrics);
  for (std::string line; std::getline(mf, line);) {
    auto j = nlohmann::json::parse(line);
    steps[j["batching"].get<std::string>()].push_back(std::move(j));
  }
  REQUIRE(steps.size() == 4);
  for (const std::string b : {"padding", "packing", "offsets", "dynamic"}) {
    CAPTURE(b);
    CHECK(r.err.find("batching " + b + ": ") != std::string::npos);
    REQUIRE(steps[b].size() == 2);
    for (const auto& j : steps[b]) {
      CHECK(j["microbatches"].get<int>() >= 1);
      CHECK(j["useful_tokens_per_s"].get<double>() > 0.0);
      CHECK(j["predicted_seconds"].get<double>() > 0.0);
      REQUIRE(j["peak_memory_bytes"].size() == 2);
      CHECK(j["peak_memory_bytes"] == j["peak_memory_bytes_simulated"]);
      // Per task: the fortunes file names, tokens adding up to the step's, losses weighting
      // to the step's loss.
      REQUIRE(j.contains("task_loss"));
      std::int64_t tokens = 0;
      double weighted = 0.0;
      for (const auto& [task, t] : j["task_loss"].items()) {
        CHECK(task.find('/') == std::string::npos);
        tokens += t["tokens"].get<std::int64_t>();
        weighted += t["loss"].get<double>() * t["tokens"].get<double>();
      }
      CHECK(j["task_loss"].size() >= 2);
      CHECK(tokens == j["tokens"].get<std::int64_t>());
      CHECK(weighted / static_cast<double>(tokens) ==
            doctest::Approx(j["loss"].get<double>()).epsilon(1e-9));
    }
  }
  for (int s = 0; s < 2; ++s) {
    CAPTURE(s);
    const auto tokens = steps["offsets"][s]["tokens"].get<std::int64_t>();
    for (const char* b : {"padding", "packing", "dynamic"})
      CHECK(steps[b][s]["tokens"].get<std::int64_t>() == tokens);
    CHECK(steps["offsets"][s]["padding_tokens"] == 0);
    CHECK(steps["dynamic"][s]["padding_tokens"] == 0);
    CHECK(steps["packing"][s]["padding_tokens"].get<std::int64_t>() > 0);
  }
  const double loss = steps["offsets"][0]["loss"].get<double>();
  CHECK(steps["padding"][0]["loss"].get<double>() == doctest::Approx(loss).epsilon(1e-5));
  CHECK(steps["dynamic"][0]["loss"].get<double>() == doctest::Approx(loss).epsilon(1e-5));
  // One table: a row per batcher, dynamic's gain over each of the others.
  const auto table = r.err.find("2 ranks, 2 steps per batcher, the same samples:");
  REQUIRE(table != std::string::npos);
  for (const char* b : {"padding", "packing", "offsets"})
    CHECK(r.err.find(std::string("dynamic / ") + b + ": ", table) != std::string::npos);
  CHECK(r.err.find("peak MiB/rank measured", table) != std::string::npos);
  fs::remove_all(dir);

  auto bad = run_cli("train " + model_flags() + " --batching offsets,sorted");
  CHECK(bad.rc != 0);
  CHECK(std::count(bad.err.begin(), bad.err.end(), '\n') == 1);
  CHECK(bad.err.find("--batching: sorted not in {padding,packing,offsets,dynamic}") !=
        std::string::npos);
  auto v = run_cli("train " + model_flags() + " --stages 2 --schedule zb-v --batching dynamic");
  CHECK(v.rc != 0);
  CHECK(v.err.find("--batching dynamic runs DynaPipe's adaptive schedule over one stage per rank") !=
        std::string::npos);
  auto c = run_cli("train " + model_flags() + " --batching offsets,dynamic --checkpoint-dir " +
                   (dir / "ck").string());
  CHECK(c.rc != 0);
  CHECK(c.err.find("--checkpoint-dir and --resume take one batcher") != std::string::npos);
}

// issue 15: a memory limit tighter than the longest samples: DynaPipe's DP recomputes the
// micro-batches that do not fit (and says which, per step), offsets' micro-batches over the
// limit recompute by the same rule, the simulated peak per rank is the measured one, the loss
// is what attention within each sample gives without recompute; without recompute the limit is
// a named error.
TEST_CASE("cli.train: --memory-limit makes micro-batches that do not fit recompute, listed per "
          "step, --recompute none refuses them by name" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  const fs::path dir =
      fs::temp_directory_path() / ("brigade_cli_recompute_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path metrics = dir / "m.jsonl";
  // Samples up to 128 tokens; at most 600 kB held per micro-batch on a stage (a 64-token
  // sequence's activations are about 760 kB on these stages), 3.1 MB per rank.
  const std::string base = "train " + model_flags() + " --profile none --stages 2 --microbatches 4 " +
                           "--tokens-per-microbatch 128 --steps 2 --memory-limit 600000 " +
                           "--rank-memory 3100000";
  auto r = run_cli(base + " --batching offsets,dynamic --metrics " + metrics.string());
  CAPTURE(r.err);
  REQUIRE(r.rc == 0);
  CHECK(r.err.find("memory: 600000 bytes of activations per micro-batch on a stage "
                   "(--memory-limit), 3.1e+06 per rank (--rank-memory); recompute auto") !=
        std::string::npos);
  std::map<std::string, std::vector<nlohmann::json>> steps;
  std::ifstream mf(metrics);
  for (std::string line; std::getline(mf, line);) {
    auto j = nlohmann::json::parse(line);
    steps[j["batching"].get<std::string>()].push_back(std::move(j));
  }
  REQUIRE(steps["offsets"].size() == 2);
  REQUIRE(steps["dynamic"].size() == 2);
  std::size_t offsets_recomputed = 0;
  for (const std::string b : {"offsets", "dynamic"})
    for (const auto& j : steps[b]) {
      CAPTURE(b);
      REQUIRE(j["recompute_microbatches"].is_array());
      for (const auto& m : j["recompute_microbatches"]) {
        CHECK(m.get<int>() >= 0);
        CHECK(m.get<int>() < j["microbatches"].get<int>());
      }
      if (b == "offsets") offsets_recomputed += j["recompute_microbatches"].size();
      CHECK(j["peak_memory_bytes"] == j["peak_memory_bytes_simulated"]);
    }
  CHECK(offsets_recomputed >= 1);
  for (int s = 0; s < 2; ++s)
    CHECK(steps["dynamic"][s]["loss"].get<double>() ==
          doctest::Approx(steps["offsets"][s]["loss"].get<double>()).epsilon(1e-5));
  CHECK(r.err.find(" micro-batches recomputed (full recompute where") != std::string::npos);
  CHECK(r.err.find("recomputed     step s") != std::string::npos);  // the table's column

  auto none = run_cli(base + " --batching dynamic --recompute none");
  CHECK(none.rc != 0);
  CHECK(none.err.find("more than the micro-batch memory limit of 600000 bytes") != std::string::npos);
  auto off = run_cli(base + " --batching offsets --recompute none");
  CHECK(off.rc != 0);
  CHECK(off.err.find("more than --memory-limit 600000 bytes (--recompute none)") != std::string::npos);
  auto alone = run_cli("train " + model_flags() + " --memory-limit 600000");
  CHECK(alone.rc != 0);
  CHECK(alone.err.find("--memory-limit and --rank-memory hold the micro-batches of --batching") !=
        std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("cli.train: bad input gets one clear line and a non-zero exit" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  auto r = run_cli("train --schedule nope");
  CHECK(r.rc != 0);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(r.err.find("nope") != std::string::npos);
  auto r2 = run_cli("train --resume");
  CHECK(r2.rc != 0);
  CHECK(r2.err.find("--resume needs --checkpoint-dir") != std::string::npos);
  auto r3 = run_cli("train " + model_flags() + " --stages 9");
  CHECK(r3.rc != 0);
  CHECK(r3.err.find("9 virtual stages") != std::string::npos);
  auto r5 = run_cli("train --model " + (kData / "stories260K.bin").string() + " --steps 1");
  CHECK(r5.rc != 0);
  CHECK(r5.err.find("--model needs --tokenizer") != std::string::npos);
  auto r6 = run_cli("train --steps -1");
  CHECK(r6.rc == 2);
  CHECK(r6.err.size() < 200);  // a range, not a 300-digit number
  auto r4 = run_cli("train " + model_flags() + " --data /nonexistent/corpus");
  CHECK(r4.rc != 0);
  CHECK(r4.err.find("/nonexistent/corpus") != std::string::npos);
}

TEST_CASE("cli.generate: --profile auto measures this machine once and reuses it, none and a "
          "file are taken as given" * doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  const auto ref = reference();
  const std::string one = ref.cases[1].stdout_text;  // "Once upon a time", 64 steps
  const fs::path cache = fs::temp_directory_path() / fmt::format("brigade_cache_{}", ::getpid());
  fs::remove_all(cache);
  const std::string env = "XDG_CACHE_HOME=" + cache.string() + " ";
  const std::string args = " generate " + model_flags() +
                           " --temperature 0 --steps 64 --stages 2 --cores 2 --prompt \"Once upon a time\"";
  auto first = brigade::test::run_shell(env + BRIGADE_CLI + args);
  REQUIRE(first.rc == 0);
  CHECK(first.out == one);  // the split changes no token
  const fs::path cached = cache / "brigade" / "profile-2c-v4.json";
  CHECK(fs::exists(cached));
  CHECK(first.err.find("profile: measuring this machine (2 cores") != std::string::npos);
  CHECK(first.err.find(", measured now, cached " + cached.string() + ")") != std::string::npos);
  auto second = brigade::test::run_shell(env + BRIGADE_CLI + args);
  REQUIRE(second.rc == 0);
  CHECK(second.out == one);
  CHECK(second.err.find("measuring") == std::string::npos);
  CHECK(second.err.find(", cached " + cached.string() + ")") != std::string::npos);
  // A cache of another machine (another CPU name) is measured again and replaced.
  auto j = nlohmann::json::parse(std::ifstream(cached));
  j["name"] = "Some Other CPU (2 cores, avx2 decode kernel)";
  std::ofstream(cached) << j.dump();
  auto third = brigade::test::run_shell(env + BRIGADE_CLI + args);
  REQUIRE(third.rc == 0);
  CHECK(third.err.find("profile: measuring this machine") != std::string::npos);
  // none: the roofline; a file: that profile; a missing file: an error naming it.
  auto none = brigade::test::run_shell(env + BRIGADE_CLI + args + " --profile none");
  REQUIRE(none.rc == 0);
  CHECK(none.out == one);
  CHECK(none.err.find("partition balanced (profile none: roofline at default rates)") !=
        std::string::npos);
  auto file = brigade::test::run_shell(env + BRIGADE_CLI + args + " --profile " + cached.string());
  REQUIRE(file.rc == 0);
  CHECK(file.err.find("(profile ") != std::string::npos);
  CHECK(file.err.find(", " + cached.string() + ")") != std::string::npos);
  auto missing = brigade::test::run_shell(env + BRIGADE_CLI + args + " --profile /nonexistent/p.json");
  CHECK(missing.rc != 0);
  CHECK(missing.err.find("/nonexistent/p.json") != std::string::npos);
  // A machine that cannot be measured (no temporary directory for the disk figure) gets the
  // roofline and a notice, and the same tokens.
  fs::remove_all(cache);
  auto unmeasured = brigade::test::run_shell("TMPDIR=/nonexistent " + env + BRIGADE_CLI + args);
  REQUIRE(unmeasured.rc == 0);
  CHECK(unmeasured.out == one);
  CHECK(unmeasured.err.find("profile: could not measure this machine (profile: no temporary "
                            "directory for the disk file") != std::string::npos);
  CHECK(unmeasured.err.find("(profile auto, not measured: roofline at default rates)") !=
        std::string::npos);
  auto planless = brigade::test::run_shell(env + BRIGADE_CLI + " generate " + model_flags() +
                                           " --plan auto --profile none");
  CHECK(planless.rc != 0);
  CHECK(planless.err.find("--plan auto predicts times from a device profile") != std::string::npos);
  fs::remove_all(cache);
}

TEST_CASE("cli.generate: a GGUF model (format from its magic, tokenizer from the file) prints "
          "run.c's text, convert round-trips llama2.c <-> GGUF" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  if (!brigade::test::have_data(fs::path(BRIGADE_DATA_DIR) / "stories260K.gguf")) return;
  const auto ref = reference();
  const std::string one = ref.cases[1].stdout_text;  // "Once upon a time", 64 steps
  const std::string gguf = (fs::path(BRIGADE_DATA_DIR) / "stories260K.gguf").string();
  auto r = run_cli("generate --model " + gguf +
                   " --temperature 0 --stages 2 --steps 64 --prompt \"Once upon a time\"");
  REQUIRE(r.rc == 0);
  CHECK(r.out == one);
  // A llama2.c tokenizer given beside a GGUF model replaces the embedded one (the same here).
  auto t = run_cli("generate --model " + gguf + " --tokenizer " + (kData / "tok512.bin").string() +
                   " --temperature 0 --steps 64 --prompt \"Once upon a time\"");
  REQUIRE(t.rc == 0);
  CHECK(t.out == one);

  brigade::test::TempDir dir("brigade-cli-convert");
  auto c1 = run_cli("convert " + (kData / "stories260K.bin").string() + " " +
                    (dir / "m.gguf").string() + " --tokenizer " + (kData / "tok512.bin").string());
  REQUIRE(c1.rc == 0);
  auto c2 = run_cli("convert " + (dir / "m.gguf").string() + " " + (dir / "m.bin").string() +
                    " --tokenizer-out " + (dir / "tok.bin").string());
  REQUIRE(c2.rc == 0);
  fs::create_directory(dir / "again");  // the same file name: general.name is its stem
  auto c3 = run_cli("convert " + (dir / "m.bin").string() + " " + (dir / "again" / "m.gguf").string() +
                    " --tokenizer " + (dir / "tok.bin").string());
  REQUIRE(c3.rc == 0);
  auto slurp = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  CHECK(slurp(dir / "m.gguf") == slurp(dir / "again" / "m.gguf"));
  CHECK(slurp(dir / "tok.bin") == slurp(kData / "tok512.bin"));
  auto g = run_cli("generate --model " + (dir / "m.bin").string() + " --tokenizer " +
                   (dir / "tok.bin").string() + " --temperature 0 --steps 64 --prompt \"Once upon a time\"");
  REQUIRE(g.rc == 0);
  CHECK(g.out == one);
}

TEST_CASE("cli.convert: --dtype f16 writes an f16 GGUF (half the file) that prints run.c's story, and "
          "a bad --dtype, q8_0 on stories260K's shape and --dtype to a llama2.c file are named "
          "errors that write nothing" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  const auto ref = reference();
  const std::string one = ref.cases[1].stdout_text;  // "Once upon a time", 64 steps
  brigade::test::TempDir dir("brigade-cli-convert-dtype");
  const std::string in = (kData / "stories260K.bin").string() + " ";
  const std::string tok = " --tokenizer " + (kData / "tok512.bin").string();
  auto h = run_cli("convert " + in + (dir / "h.gguf").string() + tok + " --dtype f16");
  REQUIRE(h.rc == 0);
  CHECK(h.err.find("(GGUF v3, f16 matrices, f32 norms; 0.5 MB of weights)") != std::string::npos);
  CHECK(brigade::model::GgufFile::open(dir / "h.gguf").find_tensor("blk.0.attn_q.weight")->ggml_type == 1u);
  auto g = run_cli("generate --model " + (dir / "h.gguf").string() +
                   " --temperature 0 --stages 2 --steps 64 --prompt \"Once upon a time\"");
  REQUIRE(g.rc == 0);
  CHECK(g.out == one);
  // The f16 GGUF back to llama2.c: widened to float32 exactly (f16 values are float32 values).
  auto back = run_cli("convert " + (dir / "h.gguf").string() + " " + (dir / "h.bin").string());
  REQUIRE(back.rc == 0);
  CHECK(fs::file_size(dir / "h.bin") == fs::file_size(kData / "stories260K.bin"));
  auto bad = run_cli("convert " + in + (dir / "x.gguf").string() + tok + " --dtype q4_0");
  CHECK(bad.rc != 0);
  CHECK(bad.err.find("--dtype: q4_0 not in {f32,f16,bf16,q8_0}") != std::string::npos);
  auto q = run_cli("convert " + in + (dir / "q.gguf").string() + tok + " --dtype q8_0");
  CHECK(q.rc != 0);
  CHECK(q.err.find("convert_weights: w2 of layer 0 has rows of 172 elements, not whole q8_0 "
                   "blocks of 32") != std::string::npos);
  auto to_bin = run_cli("convert " + (dir / "h.gguf").string() + " " + (dir / "y.bin").string() +
                        " --dtype f16");
  CHECK(to_bin.rc != 0);
  CHECK(to_bin.err.find("--dtype f16 is for a GGUF output; a llama2.c checkpoint (from the GGUF "
                        "input") != std::string::npos);
  for (const char* f : {"x.gguf", "q.gguf", "q.gguf.tmp", "y.bin", "y.bin.tmp"}) CHECK_FALSE(fs::exists(dir / f));
}

TEST_CASE("cli.generate: --weights-dtype keeps the matrices in f16 (run.c's story still, at half "
          "the bytes), q8_0 needs rows of whole blocks" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  const auto ref = reference();
  const std::string one = ref.cases[1].stdout_text;  // "Once upon a time", 64 steps
  auto r = run_cli("generate " + model_flags() + " --temperature 0 --stages 3 --steps 64 " +
                   "--prompt \"Once upon a time\" --weights-dtype f16");
  REQUIRE(r.rc == 0);
  CHECK(r.out == one);
  CHECK(r.err.find("weights: f16 (0.5 MB; 1.0 MB as loaded)") != std::string::npos);
  auto q = run_cli("generate " + model_flags() + " --weights-dtype q8_0");
  CHECK(q.rc != 0);
  CHECK(q.err.find("convert_weights: w2 of layer 0 has rows of 172 elements, not whole q8_0 "
                   "blocks of 32") != std::string::npos);
  auto bad = run_cli("generate " + model_flags() + " --weights-dtype q4_0");
  CHECK(bad.rc != 0);
  CHECK(bad.err.find("--weights-dtype") != std::string::npos);
}

TEST_CASE("cli.generate: --tp 2 prints run.c's text on TP2 x PP1 and TP2 x PP2 threads, and grids and "
          "plans it cannot run are refused before anything runs" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  const auto ref = reference();
  const std::string once = ref.cases[1].stdout_text;  // "Once upon a time", 64 steps
  const auto tag = std::to_string(::getpid());
  const fs::path metrics = fs::temp_directory_path() / ("brigade_cli_tp_" + tag + ".json");
  for (int stages : {1, 2}) {
    CAPTURE(stages);
    auto r = run_cli("generate " + model_flags() + " --temperature 0 --steps 64 --prompt \"Once "
                     "upon a time\" --tp 2 --stages " + std::to_string(stages) + " --metrics " +
                     metrics.string());
    REQUIRE(r.rc == 0);
    CHECK(r.out == once);
    CHECK(r.err.find("tensor parallel: grid TP 2 x PP " + std::to_string(stages) + " = " +
                     std::to_string(2 * stages) + " threads") != std::string::npos);
    std::ifstream mf(metrics);
    const auto m = nlohmann::json::parse(mf);
    CHECK(m["tp"] == 2);
    CHECK(m["generated_tokens"] == 60);
  }
  fs::remove(metrics);
  auto heads = run_cli("generate " + model_flags() + " --tp 3");
  CHECK(heads.rc != 0);
  CHECK(heads.err.find("TP 3: the model's 8 attention heads are not divisible by the TP degree") !=
        std::string::npos);
  CHECK(heads.out.empty());
  auto hidden = run_cli("generate " + model_flags() + " --tp 8 --stages 1");
  CHECK(hidden.rc != 0);
  CHECK(hidden.err.find("TP 8: the model's hidden_dim 172 is not divisible by the TP degree") !=
        std::string::npos);
  auto offload = run_cli("generate " + model_flags() + " --tp 2 --stages 1 --ring 5 --offload");
  CHECK(offload.rc != 0);
  CHECK(offload.err.find("--tp 2 does not combine with --ring/--windows") != std::string::npos);
  // A plan over memory: a profile that holds the model (1.06 MB) and TP 1 x PP 2, but not the
  // four TP ranks' slices with their copied Wo and W2 columns, KV caches and buffers.
  nlohmann::json prof;
  {
    std::ifstream in(std::filesystem::path(BRIGADE_PROFILE_DIR) / "nvidia_h100_sxm.json");
    prof = nlohmann::json::parse(in);
  }
  prof["name"] = "tiny";
  prof["memory_capacity_bytes"] = 1.3e6;
  const auto pfile = (fs::temp_directory_path() / ("tiny-tp-" + tag + ".json")).string();
  std::ofstream(pfile) << prof.dump();
  const std::string run = "generate " + model_flags() + " --temperature 0 --steps 64 --prompt "
                          "\"Once upon a time\" --stages 2 --profile " + pfile;
  auto fits = run_cli(run);
  CHECK(fits.rc == 0);
  auto over = run_cli(run + " --tp 2");
  CHECK(over.rc != 0);
  CHECK(over.err.find("brigade generate: 4 ranks as threads of one process") != std::string::npos);
  CHECK(over.err.find("do not fit in tiny's 1300000 bytes of memory") != std::string::npos);
  CHECK(over.out.empty());
  fs::remove(pfile);
}
