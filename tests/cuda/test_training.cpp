// Training on the GPU through the common executor and engine: engine::TrainingEngine with every
// stage a runtime::TrainStage<CudaBackend> (runtime::train_stages_on), stories260K on two
// pipeline ranks, against the same engine on the CPU backend. Both compute in float32 (cuBLAS
// without TF32); the reductions run in other orders on the GPU, so the loss is held to 1e-5
// relative and every gradient and parameter tensor to 1e-4 relative L2 (measured on the CPU
// backend against itself across splits: below 1e-6; the bound leaves room for the GPU's orders).
#include "support.hpp"

#include <brigade/data/corpus.hpp>
#include <brigade/engine/training.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/runtime/train_stage.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

using namespace brigade;
namespace fs = std::filesystem;

namespace {

fs::path data_dir() {
  if (const char* env = std::getenv("BRIGADE_DATA_DIR"); env && *env) return env;
  return BRIGADE_MODEL_DIR;  // the committed models/
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1.0));
}

/// Four micro-batches of packed stories sentences (two or three sequences each); the last row of
/// micro-batch 1 has the pad target -1, which the loss must leave out.
std::vector<data::PackedBatch> batches(const model::Tokenizer& tok) {
  const char* texts[] = {"Once upon a time, there was a little girl named Lily.",
                         "She loved to play outside in the park.",
                         "One day, she saw a big, red ball.",
                         "Tom and his dog ran to the tree.",
                         "The sun was hot and the sky was blue.",
                         "Mom said, \"Let's go home and eat.\"",
                         "The cat jumped on the bed and slept.",
                         "Ben wanted to fly a kite with his friend.",
                         "They laughed and played all day long.",
                         "The bird sang a happy song."};
  std::vector<data::PackedBatch> out(4);
  for (std::size_t i = 0; i < std::size(texts); ++i) {
    auto& b = out[i % out.size()];
    if (b.offsets.empty()) b.offsets.push_back(0);
    const auto ids = tok.encode(texts[i], true, false);
    for (std::size_t t = 0; t + 1 < ids.size(); ++t) {
      b.inputs.push_back(ids[t]);
      b.targets.push_back(ids[t + 1]);
    }
    b.offsets.push_back(b.rows());
    b.tasks.push_back(0);
  }
  out[1].targets.back() = -1;
  return out;
}

}  // namespace

TEST_SUITE("training") {
  TEST_CASE("cuda.training: stories260K through TrainingEngine on CudaBackend follows the CPU "
            "backend's loss, gradients and updates (1f1b and zb-h1, 2 ranks)") {
    const auto weights = model::load_llama2c_checkpoint(data_dir() / "stories260K.bin");
    const auto tok = model::Tokenizer::load_llama2c(data_dir() / "tok512.bin", 512);
    const auto steps_batches = batches(tok);
    for (const char* schedule : {"1f1b", "zb-h1"}) {
      CAPTURE(schedule);
      engine::TrainingConfig cfg;
      cfg.schedule = schedule;
      cfg.ranks = 2;
      cfg.microbatches = 4;
      engine::TrainingEngine cpu_engine(weights, cfg);
      cfg.stages = runtime::train_stages_on([](int) { return cuda::CudaBackend(); });
      engine::TrainingEngine gpu_engine(weights, cfg);
      for (int step = 0; step < 3; ++step) {
        CAPTURE(step);
        const auto c = cpu_engine.compute_gradients(steps_batches);
        const auto g = gpu_engine.compute_gradients(steps_batches);
        CHECK(g.tokens == c.tokens);
        CHECK(g.loss == doctest::Approx(c.loss).epsilon(1e-5));
        const auto cg = cpu_engine.gradients();
        const auto gg = gpu_engine.gradients();
        REQUIRE(gg.size() == cg.size());
        for (const auto& [name, grad] : cg) {
          CAPTURE(name);
          REQUIRE(gg.count(name) == 1);
          CHECK(rel_l2(gg.at(name), grad) < 1e-4);
        }
        const auto [clr, cnorm] = cpu_engine.optimizer_step();
        const auto [glr, gnorm] = gpu_engine.optimizer_step();
        CHECK(glr == clr);
        CHECK(gnorm == doctest::Approx(cnorm).epsilon(1e-4));
      }
      // The parameters after three updates (uploaded to the GPU after each, read back here).
      const auto ce = cpu_engine.export_weights();
      const auto ge = gpu_engine.export_weights();
      CHECK(rel_l2(std::vector<float>(ge.rms_final, ge.rms_final + weights.config.dim),
                   std::vector<float>(ce.rms_final, ce.rms_final + weights.config.dim)) < 1e-4);
      // evaluate() runs forward only on the updated GPU parameters.
      CHECK(gpu_engine.evaluate(steps_batches) ==
            doctest::Approx(cpu_engine.evaluate(steps_batches)).epsilon(1e-5));
    }
  }

  TEST_CASE("cuda.training: CudaBackend's training members refuse bad targets, ids and phases") {
    const auto weights = model::load_llama2c_checkpoint(data_dir() / "stories260K.bin");
    const auto& c = weights.config;
    cuda::CudaBackend gpu;
    // A target outside the vocabulary: named, nothing stashed.
    const std::vector<std::int32_t> targets{1, c.vocab_size};
    auto t = gpu.allocate(targets.size() * 4);
    gpu.upload(t.data(), targets.data(), targets.size() * 4);
    auto x = gpu.allocate(2 * c.dim * 4);
    gpu.fill_zero(x.data(), 2 * c.dim * 4);
    auto w = gpu.allocate(c.vocab_size * c.dim * 4);
    gpu.fill_zero(w.data(), c.vocab_size * c.dim * 4);
    cuda::CudaHeadActivations head;
    CHECK_THROWS_WITH_AS(
        gpu.head_forward_backward_input(c, w.as<float>(), w.as<float>(), x.as<float>(),
                                        t.as<std::int32_t>(), 2, x.as<float>(), head, 0.0),
        doctest::Contains("targets[1] = 512"), brigade::Error);
    CHECK(head.bytes() == 0);
    // An id outside the vocabulary in the embedding's backward.
    CHECK_THROWS_WITH_AS(gpu.embedding_backward(x.as<float>(), t.as<std::int32_t>(), w.as<float>(),
                                                2, c.dim, c.vocab_size),
                         doctest::Contains("ids[1] = 512"), brigade::Error);
    // Backward passes out of order.
    cuda::CudaDecoderActivations acts;
    CHECK_THROWS_WITH_AS(gpu.decoder_backward_input(c, weights.layers[0], acts, x.as<float>(),
                                                    x.as<float>(), nullptr),
                         doctest::Contains("expected 1 (Forward"), brigade::Error);
    backend::DecoderGradTensors grads{};
    CHECK_THROWS_WITH_AS(gpu.decoder_backward_weight(c, acts, grads),
                         doctest::Contains("expected 2 (BackwardInput"), brigade::Error);
  }
}
