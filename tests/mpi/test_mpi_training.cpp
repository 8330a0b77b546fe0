// Distributed training under mpirun: DistributedTrainer over an MpiTransport, one process per
// pipeline rank, against the in-process TrainingEngine (threads) run inside every process for the
// same schedule, split and micro-batches. Gradients, loss, gradient norm and the held-out loss
// must be bitwise equal; a checkpoint gathered to rank 0 must load in-process.
#include <brigade/data/corpus.hpp>
#include <brigade/engine/training.hpp>
#include <brigade/engine/training_distributed.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/transport/mpi.hpp>

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

using namespace brigade;
namespace fs = std::filesystem;

namespace {

const fs::path kData = BRIGADE_MODEL_DIR;  // the committed models/

/// Ten short stories as samples, micro-batches of at most 48 tokens from them.
std::vector<data::Sample> story_samples() {
  static const auto tok = model::Tokenizer::load_llama2c(kData / "tok512.bin", 512);
  return test::story_samples(tok);
}

}  // namespace

TEST_CASE("mpi.training: one process per rank gives the in-process engine's gradients, loss, "
          "norm and held-out loss bit for bit (1f1b, zb-h1)") {
  const auto weights = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  const auto samples = story_samples();
  for (const char* schedule : {"1f1b", "zb-h1"}) {
    CAPTURE(schedule);
    transport::MpiTransport tp;
    engine::TrainingConfig cfg;
    cfg.schedule = schedule;
    cfg.ranks = tp.world_size();
    cfg.microbatches = 4;
    cfg.timeout_s = 60;
    data::Packer packer(samples, 48, 3);
    std::vector<data::PackedBatch> batches;
    for (int m = 0; m < cfg.microbatches; ++m) batches.push_back(packer.next());

    engine::TrainingEngine ref(weights, cfg);
    engine::DistributedTrainer<transport::MpiTransport> dist(tp, weights, cfg);
    const auto want = ref.compute_gradients(batches);
    const auto got = dist.compute_gradients(batches);
    CHECK(got.loss == want.loss);
    CHECK(got.tokens == want.tokens);
    // The per-task loss travels from the tail rank to every rank: the in-process engine's bits.
    REQUIRE(want.task_loss.size() == 3);
    REQUIRE(got.task_loss.size() == want.task_loss.size());
    for (std::size_t t = 0; t < want.task_loss.size(); ++t) {
      CHECK(got.task_loss[t].sum == want.task_loss[t].sum);
      CHECK(got.task_loss[t].count == want.task_loss[t].count);
    }
    const auto ref_grads = ref.gradients();
    const auto grads = dist.gradients();
    CHECK(!grads.empty());
    for (const auto& [name, g] : grads) {
      CAPTURE(name);
      REQUIRE(ref_grads.count(name) == 1);
      CHECK(g == ref_grads.at(name));  // bitwise, every element
    }
    if (tp.rank() == 0) CHECK(got.timeline.num_ranks() == tp.world_size());
    // Memory depends on each rank's program and micro-batches, not on the transport: every
    // rank's peak (gathered on rank 0) is the in-process engine's to the byte.
    if (tp.rank() == 0) {
      CHECK(got.peak_memory_bytes == want.peak_memory_bytes);
    } else {
      CHECK(got.peak_memory_bytes.empty());
    }
    const auto [lr_ref, norm_ref] = ref.optimizer_step();
    const auto [lr, norm] = dist.optimizer_step();
    CHECK(lr == lr_ref);
    CHECK(norm == norm_ref);
    std::vector<data::PackedBatch> eval{packer.next(), packer.next()};
    CHECK(dist.evaluate(eval) == ref.evaluate(eval));

    // The checkpoint gathered to rank 0 is TrainingEngine's, byte for byte.
    const fs::path dir = fs::temp_directory_path() /
                         ("brigade_mpi_train_" + std::string(schedule) + "_" +
                          std::to_string(tp.world_size()));
    const fs::path ref_dir = dir / "ref";
    dist.save_checkpoint(dir, 17);
    if (tp.rank() == 0) {
      ref.save_checkpoint(ref_dir, 17);
      for (const char* f : {"model.bin", "optimizer.bin"}) {
        CAPTURE(f);
        CHECK(fs::file_size(dir / f) == fs::file_size(ref_dir / f));
        std::ifstream a(dir / f, std::ios::binary), b(ref_dir / f, std::ios::binary);
        const std::string sa((std::istreambuf_iterator<char>(a)), {});
        const std::string sb((std::istreambuf_iterator<char>(b)), {});
        CHECK(sa == sb);
      }
    }
    tp.barrier(transport::Deadline::after(60));
    CHECK(dist.load_optimizer_state(dir) == 17);
    CHECK(dist.steps() == 1);
    tp.barrier(transport::Deadline::after(60));
    if (tp.rank() == 0) fs::remove_all(dir);
  }
}

// issue 20: the V-shaped schedules under mpirun: rank v holds virtual stages v and 2P-1-v, the
// head shares rank 0 with the embedding, rank P-1 hands its forward to itself.
TEST_CASE("mpi.training: f16 and bf16 pipeline dtypes travel between processes: gradients and "
          "loss equal the in-process engine's at the same dtype bit for bit, at half the bytes") {
  const auto weights = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  const auto samples = story_samples();
  data::Packer packer(samples, 48, 5);
  std::vector<data::PackedBatch> batches;
  for (int m = 0; m < 4; ++m) batches.push_back(packer.next());
  std::int64_t rows = 0;
  for (const auto& b : batches) rows += b.rows();
  for (const DType dtype : {DType::F16, DType::BF16}) {
    CAPTURE(to_string(dtype));
    transport::MpiTransport tp;
    engine::TrainingConfig cfg;
    cfg.ranks = tp.world_size();
    cfg.microbatches = 4;
    cfg.timeout_s = 60;
    cfg.pipeline_dtype = dtype;
    engine::TrainingEngine ref(weights, cfg);
    engine::DistributedTrainer<transport::MpiTransport> dist(tp, weights, cfg);
    const auto want = ref.compute_gradients(batches);
    const auto got = dist.compute_gradients(batches);
    CHECK(got.loss == want.loss);
    const auto ref_grads = ref.gradients();
    for (const auto& [name, g] : dist.gradients()) {
      CAPTURE(name);
      CHECK(g == ref_grads.at(name));
    }
    if (tp.rank() == 0) {  // the gathered timeline: 2 bytes per value on every link
      const int P = tp.world_size();
      for (int r = 0; r < P; ++r)
        CHECK(got.timeline.bytes(r, true) ==
              rows * weights.config.dim * 2 * ((r + 1 < P) + (r > 0)));
    }
  }
}

TEST_CASE("mpi.training.v-shapes: zb-v and dualpipe-v give the in-process engine's gradients "
          "bit for bit and the single-stage gradients to 1e-5") {
  // stories260K's shape with 8 decoder layers, so 4 processes x 2 chunks fit.
  auto config = model::named_config("260K");
  config.n_layers = 8;
  const auto weights = model::make_synthetic_weights(config, 20);
  const auto samples = story_samples();
  for (const char* schedule : {"zb-v", "dualpipe-v"}) {
    CAPTURE(schedule);
    transport::MpiTransport tp;
    engine::TrainingConfig cfg;
    cfg.schedule = schedule;
    cfg.ranks = tp.world_size();
    cfg.virtual_stages = 2;
    cfg.microbatches = 2 * tp.world_size();
    cfg.timeout_s = 60;
    data::Packer packer(samples, 48, 5);
    std::vector<data::PackedBatch> batches;
    for (int m = 0; m < cfg.microbatches; ++m) batches.push_back(packer.next());

    engine::TrainingConfig one_cfg;
    one_cfg.schedule = "gpipe";
    one_cfg.microbatches = cfg.microbatches;
    engine::TrainingEngine one(weights, one_cfg);
    engine::TrainingEngine ref(weights, cfg);
    engine::DistributedTrainer<transport::MpiTransport> dist(tp, weights, cfg);
    const auto single = one.compute_gradients(batches);
    const auto want = ref.compute_gradients(batches);
    const auto got = dist.compute_gradients(batches);
    CHECK(got.loss == want.loss);
    CHECK(got.loss == doctest::Approx(single.loss).epsilon(1e-5));
    const auto ref_grads = ref.gradients();
    const auto one_grads = one.gradients();
    const auto grads = dist.gradients();
    CHECK(!grads.empty());
    for (const auto& [name, g] : grads) {
      CAPTURE(name);
      REQUIRE(ref_grads.count(name) == 1);
      CHECK(g == ref_grads.at(name));  // bitwise, every element
      REQUIRE(one_grads.count(name) == 1);
      CHECK(test::relative_error(g, one_grads.at(name)) < 1e-5);
    }
    const auto [lr_ref, norm_ref] = ref.optimizer_step();
    const auto [lr, norm] = dist.optimizer_step();
    CHECK(norm == norm_ref);
    std::vector<data::PackedBatch> eval{packer.next(), packer.next()};
    CHECK(dist.evaluate(eval) == ref.evaluate(eval));
  }
}
