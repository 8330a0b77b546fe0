// stories260K on the GPU through the common executor: runtime::InferenceStage<CudaBackend>
// under engine::generate, two pipeline stages each on its own CudaBackend; float32 greedy
// generation gives llama2.c run.c's tokens exactly (models/reference/stories260K_greedy.json).
// The folder is the committed models/ (the environment variable BRIGADE_DATA_DIR overrides it,
// for the device machine).
#include "support.hpp"

#include <brigade/engine/inference.hpp>
#include <brigade/model/text.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/partition/partition.hpp>
#include <brigade/runtime/inference_stage.hpp>
#include <brigade/transport/in_process.hpp>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>

using namespace brigade;
namespace fs = std::filesystem;

namespace {

fs::path data_dir() {
  if (const char* env = std::getenv("BRIGADE_DATA_DIR"); env && *env) return env;
  return BRIGADE_MODEL_DIR;  // the committed models/
}

}  // namespace

TEST_SUITE("model") {
  TEST_CASE("cuda.stories260K: InferenceStage<CudaBackend>'s logits of BOS match run.c's") {
    const fs::path dir = data_dir();
    INFO("data folder: " << dir.string());
    REQUIRE_MESSAGE(fs::exists(dir / "stories260K.bin"),
                    "stories260K.bin not found in the committed models/ (or $BRIGADE_DATA_DIR)");
    const auto weights = model::load_llama2c_checkpoint(dir / "stories260K.bin");
    std::ifstream in(dir / "reference" / "stories260K_greedy.json");
    REQUIRE(in.good());
    const auto ref = nlohmann::json::parse(in);
    const model::ModelSpec spec(weights.config);
    const std::vector<int> caps = {weights.config.seq_len};
    // One stage with every layer up to the sampler, on the GPU.
    runtime::InferenceStage<cuda::CudaBackend> stage(weights, {0, 0, spec.num_layers() - 1}, caps,
                                                     {}, cuda::CudaBackend{});
    runtime::Microbatch mb;
    mb.seqs = {{0, 0, 1}};
    mb.token_ids = {1};  // BOS at position 0
    stage.forward(mb);
    REQUIRE(mb.rows == 1);
    REQUIRE(mb.width == weights.config.vocab_size);
    const auto want = ref.at("logits_bos_pos0_first16").get<std::vector<float>>();
    for (std::size_t i = 0; i < want.size(); ++i) {
      CAPTURE(i);
      CHECK(mb.act[i] == doctest::Approx(want[i]).epsilon(1e-4));
    }
  }

  TEST_CASE("cuda.stories260K: f32 greedy tokens and text equal run.c's through engine::generate") {
    const fs::path dir = data_dir();
    REQUIRE_MESSAGE(fs::exists(dir / "stories260K.bin"),
                    "stories260K.bin not found in the committed models/ (or $BRIGADE_DATA_DIR)");
    const auto weights = model::load_llama2c_checkpoint(dir / "stories260K.bin");
    const auto tok = model::Tokenizer::load_llama2c(dir / "tok512.bin", 512);
    std::ifstream in(dir / "reference" / "stories260K_greedy.json");
    REQUIRE(in.good());
    const auto ref = nlohmann::json::parse(in);
    std::vector<engine::GenerationRequest> requests;
    std::vector<std::vector<int>> expected;
    for (const auto& c : ref.at("cases")) {
      const auto prompt = c.at("prompt_ids").get<std::vector<int>>();
      requests.push_back({prompt, c.at("steps").get<int>()});
      expected.push_back(prompt);
      for (int t : c.at("generated_ids").get<std::vector<int>>())
        if (t != model::Tokenizer::kBos) expected.back().push_back(t);
    }
    // Two pipeline stages (ranks), every sequence in flight at once, each stage on its own GPU
    // backend (device 0).
    const model::ModelSpec spec(weights.config);
    const auto part = partition::uniform(spec, 2);
    const auto plan = engine::inference_plan(weights.config, part, requests);
    transport::InProcessFabric fabric(2);
    auto ranks = transport::endpoints(fabric);
    engine::InferenceOptions opt;
    opt.sampler.temperature = 0.0f;
    const auto report = engine::generate(std::span(ranks), weights, plan, requests, opt,
                                         [](int) { return cuda::CudaBackend(); });
    REQUIRE(report.sequences.size() == expected.size());
    std::size_t i = 0;
    for (const auto& c : ref.at("cases")) {
      const std::string name = c.at("name");
      CAPTURE(name);
      CHECK(report.sequences[i].tokens == expected[i]);
      CHECK(model::render_like_run_c(tok, report.sequences[i].tokens) ==
            c.at("stdout").get<std::string>());
      ++i;
    }
  }

}  // TEST_SUITE
