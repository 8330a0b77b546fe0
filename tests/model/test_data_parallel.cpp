// Data parallelism of a training pipeline (engine::DataParallelTrainer) on stories260K: DP2
// replicas, each on half of a step's micro-batches, end with the single pipeline's gradients over
// all of them, and take the same update.
#include <brigade/data/corpus.hpp>
#include <brigade/engine/data_parallel.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <filesystem>

using namespace brigade;
namespace fs = std::filesystem;

namespace {

const fs::path kData = BRIGADE_MODEL_DIR;  // the committed models/

/// The story samples in file order, packed into `n` micro-batches of at most 24 rows.
std::vector<data::PackedBatch> story_batches(int n) {
  static const auto tok = model::Tokenizer::load_llama2c(kData / "tok512.bin", 512);
  return test::story_batches(tok, n);
}

}  // namespace

TEST_CASE("dp.gradients: DP2 replicas of 1 and 2 pipeline ranks give the single pipeline's loss "
          "and gradients over the whole step to 1e-5 relative per tensor") {
  const auto weights = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  const auto batches = story_batches(4);
  engine::TrainingConfig whole;
  whole.microbatches = 4;
  engine::TrainingEngine ref(weights, whole);
  const auto ref_step = ref.compute_gradients(batches);
  const auto ref_grads = ref.gradients();
  for (int ranks : {1, 2}) {
    CAPTURE(ranks);
    engine::TrainingConfig cfg;
    cfg.ranks = ranks;
    cfg.microbatches = 2;  // per replica: 2 x 2 = the step's 4
    engine::DataParallelTrainer dp(weights, cfg, 2);
    const auto step = dp.compute_gradients(batches);
    CHECK(step.tokens == ref_step.tokens);
    CHECK(step.loss == doctest::Approx(ref_step.loss).epsilon(1e-5));
    CHECK(step.timeline.num_ranks() == 2 * ranks);
    for (int r = 0; r < 2; ++r) {
      CAPTURE(r);
      const auto grads = dp.replica(r).gradients();
      REQUIRE(grads.size() == ref_grads.size());
      for (const auto& [name, g] : ref_grads) {
        CAPTURE(name);
        CHECK(test::relative_error(grads.at(name), g) < 1e-5);
      }
    }
    // Half the step alone is not the step: the all-reduce is what makes them equal.
    engine::TrainingEngine half(weights, cfg);
    half.compute_gradients(std::span(batches).first(2));
    CHECK(test::relative_error(half.gradients().at("layers.0.wq"), ref_grads.at("layers.0.wq")) >
          1e-3);
    // One update on every replica: the same global norm, the same weights, bit for bit.
    const auto [lr, norm] = dp.optimizer_step();
    CHECK(lr > 0.0);
    CHECK(norm > 0.0);
    const auto w0 = dp.replica(0).gradients(), w1 = dp.replica(1).gradients();
    CHECK(w0 == w1);
    const auto e0 = dp.replica(0).export_weights(), e1 = dp.replica(1).export_weights();
    const auto n = static_cast<std::size_t>(weights.config.dim) * weights.config.vocab_size;
    const auto* a = static_cast<const float*>(e0.token_embedding.data);
    const auto* b = static_cast<const float*>(e1.token_embedding.data);
    CHECK(std::equal(a, a + n, b));
  }
}

TEST_CASE("dp.errors: a DP degree below 1 and a step of the wrong size are refused") {
  const auto weights = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  engine::TrainingConfig cfg;
  cfg.microbatches = 2;
  CHECK_THROWS_WITH_AS(engine::DataParallelTrainer(weights, cfg, 0),
                       doctest::Contains("dp = 0, expected >= 1"), Error);
  engine::DataParallelTrainer dp(weights, cfg, 2);
  const auto three = story_batches(3);
  CHECK_THROWS_WITH_AS(dp.compute_gradients(three),
                       doctest::Contains("3 batches for 2 replicas x 2 micro-batches"), Error);
}
