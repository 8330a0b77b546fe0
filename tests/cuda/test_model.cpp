// stories260K on the GPU: float32 greedy generation gives llama2.c run.c's tokens exactly
// (models/reference/stories260K_greedy.json); the folder is the committed models/ (the
// environment variable BRIGADE_DATA_DIR overrides it, for the device machine).
#include "support.hpp"

#include <brigade/model/text.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>

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
  TEST_CASE("cuda.stories260K: f32 greedy tokens and text equal run.c's, first logits match") {
    const fs::path dir = data_dir();
    INFO("data folder: " << dir.string());
    REQUIRE_MESSAGE(fs::exists(dir / "stories260K.bin"),
                    "stories260K.bin not found in the committed models/ (or $BRIGADE_DATA_DIR)");
    const auto weights = model::load_llama2c_checkpoint(dir / "stories260K.bin");
    const auto tok = model::Tokenizer::load_llama2c(dir / "tok512.bin", 512);
    std::ifstream in(dir / "reference" / "stories260K_greedy.json");
    REQUIRE(in.good());
    const auto ref = nlohmann::json::parse(in);

    cuda::CudaBackend gpu;
    const int capacity = weights.config.seq_len;
    const std::vector<int> caps = {capacity, capacity};
    cuda::CudaLlama model(gpu, weights, brigade::DType::F32, caps);

    // Logits of BOS at position 0.
    const std::vector<cuda::CudaLlama::Step> step = {{1, 0, 1}};
    const std::vector<int> bos = {1};
    const auto logits = model.forward(step, bos);
    const auto want = ref.at("logits_bos_pos0_first16").get<std::vector<float>>();
    for (std::size_t i = 0; i < want.size(); ++i) {
      CAPTURE(i);
      CHECK(logits[i] == doctest::Approx(want[i]).epsilon(1e-4));
    }

    for (const auto& c : ref.at("cases")) {
      const std::string name = c.at("name");
      CAPTURE(name);
      const auto prompt = c.at("prompt_ids").get<std::vector<int>>();
      const int steps = c.at("steps");
      std::vector<int> expected = prompt;
      for (int t : c.at("generated_ids").get<std::vector<int>>())
        if (t != model::Tokenizer::kBos) expected.push_back(t);
      const auto got = model.generate_greedy(prompt, steps, 0);
      CHECK(got == expected);
      CHECK(model::render_like_run_c(tok, got) == c.at("stdout").get<std::string>());
    }
  }

  TEST_CASE("cuda.stories260K: bf16 generation runs and mostly agrees with f32") {
    const fs::path dir = data_dir();
    REQUIRE_MESSAGE(fs::exists(dir / "stories260K.bin"),
                    "stories260K.bin not found in the committed models/ (or $BRIGADE_DATA_DIR)");
    const auto weights = model::load_llama2c_checkpoint(dir / "stories260K.bin");
    cuda::CudaBackend gpu;
    const std::vector<int> caps = {weights.config.seq_len};
    cuda::CudaLlama f32(gpu, weights, brigade::DType::F32, caps);
    cuda::CudaLlama b16(gpu, weights, brigade::DType::BF16, caps);
    const std::vector<int> prompt = {1, 403, 407, 261, 378};  // "Once upon a time"
    const auto a = f32.generate_greedy(prompt, 40);
    const auto b = b16.generate_greedy(prompt, 40);
    REQUIRE(b.size() > prompt.size());
    std::size_t same = 0;
    while (same < std::min(a.size(), b.size()) && a[same] == b[same]) ++same;
    MESSAGE("bf16 follows the f32 tokens for " << same << " of " << a.size() << " positions");
    CHECK(same >= prompt.size() + 1);  // at least the first generated token agrees
  }

}  // TEST_SUITE
