// TrainStage's device-backend path (B::host_memory false: parameters and gradients mirrored in the
// backend's memory, inputs uploaded and outputs downloaded per micro-batch, download_gradients
// after a step, upload_parameters after an update) run on the host: OffloadedCpu is the CPU
// backend declaring its memory not the host's, so TrainStage takes every edge CudaBackend takes
// while the kernels stay the CPU's. Same kernels, same order: the results must equal the plain
// CPU path bit for bit, step after step (a missed upload or download changes them).
#include <brigade/backend/cpu_backend.hpp>
#include <brigade/data/corpus.hpp>
#include <brigade/engine/training.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/runtime/train_stage.hpp>

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <filesystem>
#include <map>
#include <string>
#include <vector>

using namespace brigade;
namespace fs = std::filesystem;

namespace {

const fs::path kData = BRIGADE_MODEL_DIR;  // the committed models/

/// The CPU kernels behind a "device" memory: TrainStage mirrors everything and copies at every
/// edge, as for cuda::CudaBackend.
struct OffloadedCpu : cpu::CpuBackend {
  static constexpr bool host_memory = false;
};
static_assert(backend::TrainingBackend<OffloadedCpu>);

std::vector<data::PackedBatch> batches(const model::Tokenizer& tok, int m) {
  const auto samples = test::story_samples(tok);
  std::vector<data::PackedBatch> out(static_cast<std::size_t>(m));
  for (std::size_t i = 0; i < samples.size(); ++i) {
    auto& b = out[i % out.size()];
    if (b.offsets.empty()) b.offsets.push_back(0);
    const auto& ids = samples[i].tokens;
    for (std::size_t t = 0; t + 1 < ids.size(); ++t) {
      b.inputs.push_back(ids[t]);
      b.targets.push_back(ids[t + 1]);
    }
    b.offsets.push_back(b.rows());
    b.tasks.push_back(samples[i].task);
  }
  for (auto& b : out) b.task_offsets = b.offsets;  // one task span per sequence
  out[1].targets.back() = -1;  // a pad target
  return out;
}

}  // namespace

TEST_CASE("training.offload: stages on a non-host-memory backend train bit for bit like the CPU "
          "path through TrainingEngine (1f1b, zb-h1, interleaved, 3 steps with updates)") {
  const auto weights = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  const auto tok = model::Tokenizer::load_llama2c(kData / "tok512.bin", 512);
  const auto data = batches(tok, 4);
  struct Case {
    const char* schedule;
    int ranks, virtual_stages;
  };
  for (const Case c : {Case{"1f1b", 2, 1}, Case{"zb-h1", 3, 1}, Case{"interleaved-1f1b", 2, 2}}) {
    CAPTURE(c.schedule);
    engine::TrainingConfig cfg;
    cfg.schedule = c.schedule;
    cfg.ranks = c.ranks;
    cfg.virtual_stages = c.virtual_stages;
    cfg.microbatches = 4;
    engine::TrainingEngine host(weights, cfg);
    cfg.stages = runtime::train_stages_on([](int) { return OffloadedCpu{}; });
    engine::TrainingEngine offloaded(weights, cfg);
    for (int step = 0; step < 3; ++step) {
      CAPTURE(step);
      const auto a = host.train_step(data);
      const auto b = offloaded.train_step(data);
      CHECK(b.loss == a.loss);
      CHECK(b.tokens == a.tokens);
      CHECK(b.grad_norm == a.grad_norm);
      CHECK(offloaded.gradients() == host.gradients());
    }
    CHECK(offloaded.evaluate(data) == host.evaluate(data));
    const auto wa = host.export_weights(), wb = offloaded.export_weights();
    const auto n = static_cast<std::size_t>(weights.config.dim);
    CHECK(std::vector<float>(wb.rms_final, wb.rms_final + n) ==
          std::vector<float>(wa.rms_final, wa.rms_final + n));
  }
}

TEST_CASE("training.offload: RECOMPUTE, deferred BW and held bytes on a non-host-memory stage") {
  const auto weights = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  const auto tok = model::Tokenizer::load_llama2c(kData / "tok512.bin", 512);
  const auto data = batches(tok, 2);
  const int n = model::ModelSpec(weights.config).num_layers();
  runtime::TrainStage<> host(weights, {0, 0, n});
  runtime::TrainStage<OffloadedCpu> off(weights, {0, 0, n});
  const double denom = 100.0;
  for (int mb = 0; mb < 2; ++mb) {
    host.forward(mb, data[static_cast<std::size_t>(mb)], nullptr, denom, true);
    off.forward(mb, data[static_cast<std::size_t>(mb)], nullptr, denom, false);  // input only
    CHECK(off.held_bytes() > 0);
    off.recompute(mb);
    CHECK(off.loss(mb).sum == host.loss(mb).sum);
    CHECK(off.loss(mb).count == host.loss(mb).count);
    host.backward_input(mb, nullptr);
    off.backward_input(mb, nullptr);
  }
  for (int mb = 0; mb < 2; ++mb) {  // BW after both BIs, as a zero-bubble schedule
    host.backward_weight(mb);
    off.backward_weight(mb);
  }
  // Before the download the host copies of the gradients are still zero.
  const auto pa = host.params();
  auto pb = off.params();
  REQUIRE(pa.size() == pb.size());
  bool host_nonzero = false, off_zero = true;
  for (std::int64_t i = 0; i < pa[0].size; ++i) {
    host_nonzero = host_nonzero || pa[0].grad[i] != 0.0f;
    off_zero = off_zero && pb[0].grad[i] == 0.0f;
  }
  CHECK(host_nonzero);
  CHECK(off_zero);
  off.download_gradients();
  for (std::size_t i = 0; i < pa.size(); ++i) {
    CAPTURE(pa[i].name);
    CHECK(std::vector<float>(pb[i].grad, pb[i].grad + pb[i].size) ==
          std::vector<float>(pa[i].grad, pa[i].grad + pa[i].size));
  }
  off.zero_grad();
  off.download_gradients();
  for (const auto& p : off.params())
    for (std::int64_t i = 0; i < p.size; ++i) REQUIRE(p.grad[i] == 0.0f);
  CHECK(off.held_bytes() == 0);
}
