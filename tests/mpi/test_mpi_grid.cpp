// Tensor and data parallelism in training under mpirun: DistributedTrainer over a tp::MpiGrid
// (DP x PP x TP processes, TP fastest) on stories260K against the single-rank TrainingEngine run
// inside every process on all of the step's micro-batches. 2 processes: DP2 and TP2; 4
// processes: DP2 x TP2, DP2 x PP2 and TP2 x PP2. Every process checks its own gradient shards
// against its slices of the single rank's, the loss and the global norm; the checkpoint is
// written once, by world rank 0, as whole tensors equal to the single rank's after the step.
#include <brigade/data/corpus.hpp>
#include <brigade/engine/training.hpp>
#include <brigade/engine/training_distributed.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/tp/mpi_grid.hpp>
#include <brigade/transport/mpi.hpp>

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <filesystem>
#include <string>
#include <vector>

using namespace brigade;
namespace fs = std::filesystem;

namespace {

const fs::path kData = BRIGADE_MODEL_DIR;  // the committed models/

/// The grids of `world` processes this file runs.
std::vector<tp::Grid> grids_for(int world) {
  if (world == 2) return {{1, 1, 2}, {2, 1, 1}};
  if (world == 4) return {{2, 1, 2}, {1, 2, 2}, {2, 2, 1}};
  return {};
}

}  // namespace

TEST_CASE("mpi.grid: DistributedTrainer over DP x PP x TP processes gives the single rank's loss, "
          "gradient shards, norm and checkpoint") {
  const auto weights = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  const auto tok = model::Tokenizer::load_llama2c(kData / "tok512.bin", 512);
  const auto batches = test::story_batches(tok, 4);
  // The reference: one rank, every micro-batch, one step.
  engine::TrainingConfig whole;
  whole.microbatches = 4;
  engine::TrainingEngine ref(weights, whole);
  const auto want = ref.compute_gradients(batches);
  const auto ref_grads = ref.gradients();
  const double ref_norm = ref.optimizer_step().second;
  const auto ref_after = ref.export_weights();

  int world = 0;
  {
    transport::MpiTransport w;
    world = w.world_size();
  }
  const auto grids = grids_for(world);
  REQUIRE(!grids.empty());
  for (const tp::Grid& g : grids) {
    CAPTURE(g.describe());
    tp::MpiGrid grid(g, 60.0);
    engine::TrainingConfig cfg;
    cfg.ranks = g.pp;
    cfg.tp = g.tp;
    cfg.microbatches = 4 / g.dp;
    cfg.timeout_s = 60;
    engine::DistributedTrainer<transport::MpiTransport> trainer(
        grid.pipeline(), weights, cfg, {}, {grid.tp_group(), grid.dp_group()});
    const auto M = static_cast<std::size_t>(cfg.microbatches);
    const auto mine =
        std::span<const data::PackedBatch>(batches).subspan(static_cast<std::size_t>(grid.dp_rank()) * M, M);
    const auto got = trainer.compute_gradients(mine);
    CHECK(got.tokens == want.tokens);
    CHECK(got.loss == doctest::Approx(want.loss).epsilon(1e-6));
    // This process's shards against its slices of the single rank's whole gradients.
    const auto grads = trainer.gradients();
    const auto part = trainer.plan().partition();
    tp::Group* tpg = grid.tp_group();
    for (int v = 0; v < part.num_stages(); ++v) {
      if (part.stage(v).rank != grid.pp_rank()) continue;
      runtime::TrainStage<> stage(weights, part.stage(v), {}, tpg);  // describes the slices
      for (const auto& p : stage.params()) {
        CAPTURE(p.name);
        REQUIRE(grads.count(p.name) == 1);
        std::vector<float> slice(static_cast<std::size_t>(p.size));
        runtime::take_shard(p, p.shard, ref_grads.at(p.name).data(), slice.data());
        CHECK(test::relative_error(grads.at(p.name), slice) < 1e-5);
      }
    }
    const double norm = trainer.optimizer_step().second;
    CHECK(norm == doctest::Approx(ref_norm).epsilon(1e-6));
    // One checkpoint of whole tensors, written by world rank 0.
    const fs::path dir = fs::temp_directory_path() /
                         ("brigade-mpi-grid-" + std::to_string(world) + "-" + std::to_string(g.tp) +
                          std::to_string(g.pp) + std::to_string(g.dp));
    if (grid.world_rank() == 0) fs::remove_all(dir);
    trainer.save_checkpoint(dir, 0);  // every process returns once it is written
    if (grid.world_rank() == 0) {
      const auto saved = model::load_llama2c_checkpoint(dir / "model.bin");
      const auto n = static_cast<std::size_t>(weights.config.dim) * weights.config.vocab_size;
      const std::vector<float> a(saved.token_embedding.f32(), saved.token_embedding.f32() + n);
      const std::vector<float> b(ref_after.token_embedding.f32(), ref_after.token_embedding.f32() + n);
      CHECK(test::relative_error(a, b) < 1e-5);
      const auto wq = [&](const model::LlamaWeights& w) {
        const auto m = static_cast<std::size_t>(weights.config.dim) * weights.config.dim;
        return std::vector<float>(w.layers[1].wq.f32(), w.layers[1].wq.f32() + m);
      };
      CHECK(test::relative_error(wq(saved), wq(ref_after)) < 1e-5);
      CHECK(fs::exists(dir / "optimizer.bin"));
      fs::remove_all(dir);
    }
  }
}
