// `brigade train|generate --verify ... --inject ...` as a user runs them (SENTINEL,
// docs/integrity.md): a clean run is never stopped, a corrupted one is caught, the drop policy
// keeps training, the counts reach the metrics, bad flags are one clear line.
#include <doctest/doctest.h>
#include "test_util.hpp"
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
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

fs::path temp(const std::string& name) {
  return fs::temp_directory_path() / ("brigade_integrity_" + std::to_string(::getpid()) + name);
}

}  // namespace

TEST_CASE("cli.generate.verify: a clean run checked with --verify stop prints run.c's text, "
          "bit flips in rank 0's activations stop it naming the ranks, the kind and the micro-batch" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  const auto ref = reference();
  const std::string one = ref.cases[1].stdout_text;  // "Once upon a time", 64 steps
  const fs::path metrics = temp("_gen.json");
  const std::string base = "generate " + model_flags() +
                           " --temperature 0 --steps 64 --stages 2 --prompt \"Once upon a time\"";
  auto clean = run_cli(base + " --verify stop --metrics " + metrics.string());
  CAPTURE(clean.err);
  REQUIRE(clean.rc == 0);
  CHECK(clean.out == one);
  {
    std::ifstream in(metrics);
    const auto m = nlohmann::json::parse(in);
    // Stage 1 checks 64 activations (the prompt's round and 63 decode rounds); stage 0 checks
    // the 63 returning tokens that are not the last.
    CHECK(m["checked"].get<int>() >= 120);
    CHECK(m["flagged"] == 0);
    CHECK(m["injected"] == 0);
  }
  CHECK(clean.err.find("integrity: ") != std::string::npos);
  CHECK(clean.err.find("verify: activation rank 0 -> 1:") != std::string::npos);
  auto bad = run_cli(base + " --verify stop --inject bitflip:1:1:rank=0:seed=5");
  CHECK(bad.rc != 0);
  CHECK(bad.err.find("rank 1: rejected the activation message from rank 0 for micro-batch 0") !=
        std::string::npos);
  // Generation has no micro-batch to drop.
  auto drop = run_cli(base + " --verify drop");
  CHECK(drop.rc != 0);
  CHECK(drop.err.find("--verify") != std::string::npos);
  fs::remove(metrics);
}

TEST_CASE("cli.train.verify: --verify drop under bit flips keeps training with finite losses "
          "and drops the corrupted micro-batches, --verify stop stops, the metrics count both" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  const fs::path metrics = temp("_train.jsonl");
  const std::string base = "train " + model_flags() +
                           " --stages 2 --microbatches 4 --tokens-per-microbatch 64 --steps 40";
  auto r = run_cli(base + " --verify drop --inject bitflip:1:0.1:rank=0:seed=3 --metrics " +
                   metrics.string());
  CAPTURE(r.err);
  REQUIRE(r.rc == 0);
  std::int64_t checked = 0, injected = 0, caught = 0, dropped = 0;
  int lines = 0;
  {
    std::ifstream in(metrics);
    for (std::string line; std::getline(in, line); ++lines) {
      const auto j = nlohmann::json::parse(line);
      CHECK(std::isfinite(j["loss"].get<double>()));
      checked += j["checked"].get<std::int64_t>();
      injected += j["injected"].get<std::int64_t>();
      caught += j["injected_flagged"].get<std::int64_t>();
      dropped += static_cast<std::int64_t>(j["dropped_microbatches"].size());
      CHECK(j["update_skipped"] == false);  // activations only: every flag is known in time
    }
  }
  CHECK(lines == 40);
  // Every activation and gradient of every step, but the gradients of dropped micro-batches
  // (computed from the zeros that replaced the flagged activation).
  CHECK(checked == 40 * 4 * 2 - dropped);
  CHECK(injected >= 8);        // about 10% of 160 activations
  CHECK(caught >= injected - 2);  // bit flips of the norm's size: all but those in warm-up
  CHECK(dropped >= caught);    // one dropped micro-batch per flagged activation
  CHECK(r.err.find(fmt::format("integrity: {} messages checked", checked)) != std::string::npos);

  auto stop = run_cli(base + " --verify stop --inject bitflip:1:0.1:rank=0:seed=3");
  CHECK(stop.rc != 0);
  CHECK(stop.err.find("rank 1: rejected the activation message from rank 0") != std::string::npos);
  auto q = run_cli(base + " --verify quarantine --inject bitflip:1:0.1:rank=0:seed=3");
  CHECK(q.rc != 0);
  CHECK(q.err.find("quarantine") != std::string::npos);
  fs::remove(metrics);
}

TEST_CASE("cli.integrity: bad --inject and --verify values are one clear line" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  const std::string base = "train " + model_flags() + " --steps 1 --tokens-per-microbatch 32";
  auto kind = run_cli(base + " --inject gamma:1:0.1");
  CHECK(kind.rc != 0);
  CHECK(kind.err.find("gamma") != std::string::npos);
  auto mag = run_cli(base + " --inject noise:abc:0.1");
  CHECK(mag.rc != 0);
  CHECK(mag.err.find("magnitude") != std::string::npos);
  auto rate = run_cli(base + " --inject noise:1:2");
  CHECK(rate.rc != 0);
  CHECK(rate.err.find("rate") != std::string::npos);
  auto policy = run_cli(base + " --verify sometimes");
  CHECK(policy.rc != 0);
  CHECK(policy.err.find("sometimes") != std::string::npos);
  // Checked before any work: one line, not after the corpus's notices.
  CHECK(std::count(kind.err.begin(), kind.err.end(), '\n') == 1);
  // A rank the pipeline does not have would corrupt nothing: refused.
  auto rank = run_cli(base + " --stages 2 --inject noise:1:0.1:rank=7");
  CHECK(rank.rc != 0);
  CHECK(rank.err.find("rank = 7, but the pipeline has ranks 0 to 1") != std::string::npos);
  // Faults with no check: said once.
  auto unchecked = run_cli(base + " --stages 2 --inject noise:1:0.5:rank=0");
  CHECK(unchecked.rc == 0);
  CHECK(unchecked.err.find("--inject without --verify") != std::string::npos);
}
