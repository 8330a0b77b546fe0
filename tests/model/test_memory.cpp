// The memory model per rank (cost/memory.hpp) on stories260K: its closed forms against what
// runtime::InferenceStage, runtime::TrainStage<>, engine::AdamW and the executor really allocate,
// and the capacity refusals of the plan builders and of `brigade generate --profile`.
#include <brigade/cost/memory.hpp>
#include <brigade/engine/inference.hpp>
#include <brigade/engine/training.hpp>
#include <brigade/io/trace.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/runtime/inference_stage.hpp>
#include <brigade/runtime/train_stage.hpp>

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <cstring>
#include <filesystem>
#include <random>

using namespace brigade;
namespace fs = std::filesystem;

namespace {

const fs::path kData = BRIGADE_MODEL_DIR;
const fs::path kProfiles = BRIGADE_PROFILE_DIR;

const model::LlamaWeights& stories() {
  static const auto w = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  return w;
}

/// A datasheet profile with the given capacity.
cost::DeviceProfile device(double capacity_bytes) {
  auto p = cost::load_profile(kProfiles / "nvidia_h100_sxm.json");
  p.memory_capacity_bytes = capacity_bytes;
  return p;
}

/// Three requests reserving 100, 37 and 512 (= seq_len, steps 0) KV positions.
std::vector<engine::GenerationRequest> requests() {
  return {{{1, 50, 60}, 100}, {{1, 2}, 37}, {{1}, 0}};
}

/// `m` micro-batches of one sequence of `rows` random tokens each.
std::vector<data::PackedBatch> batches(int m, int rows) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> tok(3, 511);
  std::vector<data::PackedBatch> out(static_cast<std::size_t>(m));
  for (auto& b : out) {
    for (int t = 0; t < rows; ++t) {
      b.inputs.push_back(tok(rng));
      b.targets.push_back(tok(rng));
    }
    b.offsets = {0, rows};
    b.tasks = {0};
    b.task_offsets = {0, rows};
  }
  return out;
}

}  // namespace

TEST_CASE("memory.inference: a dropped layer's KV cache and weight image are the stage's spares "
          "for its next adoption, so a layer moving back first-touches no fresh memory") {
  const auto& w = stories();
  const model::ModelSpec spec(w.config);
  const auto part = partition::uniform(spec, 2);
  const auto st = part.stage(0);  // the embedding and decoders 1 .. last - 1
  const int layer = st.last - 1;
  REQUIRE(spec.layer(layer).kind == model::LayerKind::Decoder);
  REQUIRE(st.last - st.first >= 3);
  const std::vector<int> caps{100, 37};
  runtime::InferenceStage stage(w, st, caps, {});
  int decoders = 0;
  for (int l = st.first; l < st.last; ++l)
    decoders += spec.layer(l).kind == model::LayerKind::Decoder ? 1 : 0;
  const std::size_t kv_all = stage.kv_cache_bytes();
  const std::size_t kv_layer = kv_all / static_cast<std::size_t>(decoders);
  CHECK(kv_layer == stage.kv_position_bytes() * (100 + 37));  // one layer's rows
  std::vector<std::byte> image(stage.migration_weight_bytes(layer));
  stage.read_migration_weights(layer, 0, image);
  CHECK(stage.spare_bytes() == 0);
  // The model's own layer: its KV cache stays as a spare; its weights are the model's.
  stage.drop(layer);
  CHECK(stage.range().last == layer);
  CHECK(stage.kv_cache_bytes() == kv_all - kv_layer);
  CHECK(stage.spare_bytes() == kv_layer);
  // Adopting it back takes that KV cache; the image is new.
  stage.begin_adopt(layer);
  CHECK(stage.spare_bytes() == 0);
  const std::byte* first_image = stage.adopt_weight_image().data();
  std::memcpy(stage.adopt_weight_image().data(), image.data(), image.size());
  stage.adopt();
  CHECK(stage.range().last == layer + 1);
  CHECK(stage.kv_cache_bytes() == kv_all);
  // An adopted layer leaves its image too, and the next adoption writes into the same bytes.
  stage.drop(layer);
  CHECK(stage.spare_bytes() == kv_layer + image.size());
  stage.begin_adopt(layer);
  CHECK(stage.spare_bytes() == 0);
  CHECK(stage.adopt_weight_image().data() == first_image);
  CHECK(stage.adopt_weight_image().size() == image.size());
}

TEST_CASE("memory.inference: KV cache and weights per rank are what InferenceStage reserves") {
  const auto& w = stories();
  const auto& c = w.config;
  const model::ModelSpec spec(c);
  REQUIRE(c.shared_classifier);
  const auto part = partition::uniform(spec, 2);
  const auto reqs = requests();
  const auto plan = engine::inference_plan(c, part, reqs);
  const auto mem = engine::inference_memory(c, plan, reqs);
  REQUIRE(mem.size() == 2);
  const std::vector<int> caps{100, 37, 512};
  const double positions = 100 + 37 + 512;
  for (int v = 0; v < 2; ++v) {
    const auto& st = part.stage(v);
    runtime::InferenceStage stage(w, st, caps, {});
    int decoders = 0;
    for (int l = st.first; l < st.last; ++l)
      decoders += spec.layer(l).kind == model::LayerKind::Decoder ? 1 : 0;
    // KV bytes = 2 x layers x kv_dim x positions x 4 (kv_dim 32 for stories260K).
    CHECK(mem[static_cast<std::size_t>(v)].kv_cache ==
          2.0 * decoders * c.kv_dim() * positions * 4.0);
    CHECK(mem[static_cast<std::size_t>(v)].kv_cache ==
          static_cast<double>(stage.kv_cache_bytes()));
    // One of the two stages holds the embedding, the other the (shared) classifier.
    CHECK(mem[static_cast<std::size_t>(v)].weights == static_cast<double>(stage.weight_bytes()));
  }
  CHECK(mem[0].weights + mem[1].weights ==
        cost::model_weight_bytes(spec) + 4.0 * c.vocab_size * c.dim);  // the table twice
  CHECK(cost::model_weight_bytes(spec) == 4.0 * static_cast<double>(c.num_parameters()));
  // Weight dtypes: matrices at 2 or 34/32 bytes, norm gains float32.
  const auto all = cost::stage_parameters(spec, {0, 0, spec.num_layers()}, true);
  CHECK(all.vector == (2 * c.n_layers + 1) * c.dim);
  CHECK(cost::model_weight_bytes(spec, brigade::DType::BF16) ==
        2.0 * all.matrix + 4.0 * all.vector);
  CHECK(cost::model_weight_bytes(spec, brigade::DType::Q8_0) ==
        34.0 / 32.0 * all.matrix + 4.0 * all.vector);
  const auto half =
      engine::inference_memory(c, plan, reqs, cost::layer_weight_bytes(spec, brigade::DType::F16));
  CHECK(half[1].weights == doctest::Approx(mem[1].weights / 2).epsilon(0.01));
  CHECK(half[1].kv_cache == mem[1].kv_cache);
  // A model held in F16 or Q8_0 is counted at the bytes it holds (model::layer_weight_bytes),
  // what its InferenceStages hold, and what the prediction for that dtype says.
  const std::vector<double> f32_layers = cost::layer_weight_bytes(spec);
  const auto model_f32 = model::layer_weight_bytes(w);
  CHECK(std::vector<double>(model_f32.begin(), model_f32.end()) == f32_layers);
  CHECK(f32_layers[0] == 4.0 * c.vocab_size * c.dim);
  CHECK(f32_layers[static_cast<std::size_t>(spec.num_layers() - 2)] == 0.0);  // shared head
  const model::LlamaWeights f16 = model::convert_weights(w, brigade::DType::F16);
  const auto held = model::layer_weight_bytes(f16);
  const std::vector<double> held_d(held.begin(), held.end());
  CHECK(held_d == cost::layer_weight_bytes(spec, brigade::DType::F16));
  const auto mem16 = engine::inference_memory(c, plan, reqs, held_d);
  for (int v = 0; v < 2; ++v) {
    runtime::InferenceStage stage(f16, part.stage(v), caps, {});
    CHECK(mem16[static_cast<std::size_t>(v)].weights == static_cast<double>(stage.weight_bytes()));
    CHECK(mem16[static_cast<std::size_t>(v)].weights < mem[static_cast<std::size_t>(v)].weights);
  }
  CHECK(static_cast<double>(model::weight_bytes(f16)) ==
        cost::model_weight_bytes(spec, brigade::DType::F16));
  CHECK(test::error_of(Errc::InvalidArgument,
                       [&] { (void)engine::inference_memory(c, plan, reqs, {1.0, 2.0}); })
            .find("inference_memory: layer_weight_bytes has 2 entries, the model 9 layers") !=
        std::string::npos);
  // Receive buffers: 2 groups (sequences {0, 1}: 3 + 2 prompt rows; {2}: 1 row); rank 1's four
  // window slots each sized for group 0's descriptor (3 x 3 int32) and 5 rows x max(dim, vocab)
  // floats; rank 0 receives the sampled tokens (3 x 2 int32).
  CHECK(mem[1].receive_buffers == 4.0 * (3 * 3 * 4 + 5.0 * std::max(c.dim, c.vocab_size) * 4));
  CHECK(mem[0].receive_buffers == 4.0 * (3 * 2 * 4));
  CHECK(mem[1].total() > mem[1].kv_cache + mem[1].weights);
}

TEST_CASE("memory.training: weights, gradients, AdamW moments and activations per rank are what "
          "the stages allocate and the executor measures") {
  const auto& w = stories();
  const model::ModelSpec spec(w.config);
  engine::TrainingConfig cfg;
  cfg.ranks = 2;
  cfg.microbatches = 4;
  const auto base = engine::training_plan(w.config, cfg);
  const auto data = batches(4, 48);
  const plan::Plan plan(base.partition(), base.schedule(), engine::microbatch_work(data),
                        base.execution());
  const auto mem = cost::training_memory(spec, plan);
  REQUIRE(mem.size() == 2);
  for (int v = 0; v < 2; ++v) {
    runtime::TrainStage<> stage(w, plan.partition().stage(v));
    double params = 0.0;
    for (const auto& p : stage.params()) params += static_cast<double>(p.size);
    const auto& b = mem[static_cast<std::size_t>(v)];
    CHECK(b.weights == 4.0 * params);
    CHECK(b.gradients == 4.0 * params);
    const auto opt = engine::detail::make_stage_optimizer(stage, {});
    double moments = 0.0;
    for (const auto& s : opt->state()) moments += static_cast<double>(s.size());
    CHECK(b.optimizer_state == 4.0 * moments);
    CHECK(moments == 2.0 * params);
    CHECK(b.kv_cache == 0.0);
  }
  // The tail copies the shared classifier: its parameters count it, the first stage's the table.
  CHECK(mem[0].weights + mem[1].weights ==
        4.0 * (static_cast<double>(w.config.num_parameters()) +
               static_cast<double>(w.config.vocab_size) * w.config.dim));
  // Activations: the executor's measured peak, to the byte.
  engine::TrainingEngine eng(w, plan);
  const auto r = eng.compute_gradients(data);
  REQUIRE(r.peak_memory_bytes.size() == 2);
  CHECK(mem[0].activations == r.peak_memory_bytes[0]);
  CHECK(mem[1].activations == r.peak_memory_bytes[1]);
  CHECK(mem[0].activations > 0.0);
  // SGD with momentum keeps one moment, plain SGD none.
  cost::TrainingMemoryOptions sgd;
  sgd.optimizer_moments = 1;
  CHECK(cost::training_memory(spec, plan, sgd)[1].optimizer_state == mem[1].weights);
  sgd.optimizer_moments = -1;
  CHECK(test::error_of(Errc::InvalidArgument, [&] { (void)cost::training_memory(spec, plan, sgd); })
            .find("optimizer_moments = -1, tied_gradient_copies = 2, expected both >= 0") !=
        std::string::npos);
  // The tied embedding's gradient exchange (DistributedTrainer over InProcessTransport: the
  // received copy and the sent one): only its excess over the activation peak counts.
  const double exchange = 2.0 * 4.0 * w.config.vocab_size * w.config.dim;
  for (const auto& b : mem)
    CHECK(b.receive_buffers == std::max(0.0, exchange - b.activations));
  cost::TrainingMemoryOptions in_place;
  in_place.tied_gradient_copies = 0;
  CHECK(cost::training_memory(spec, plan, in_place)[1].receive_buffers == 0.0);
}

TEST_CASE("memory.capacity: plans over a device's capacity are refused naming the rank, the "
          "largest parts and the bytes, a device smaller than the weights names the field") {
  const auto& w = stories();
  const auto& c = w.config;
  const model::ModelSpec spec(c);
  const double weights = cost::model_weight_bytes(spec);

  SUBCASE("training") {
    engine::TrainingConfig cfg;
    cfg.ranks = 2;
    cfg.microbatches = 4;
    cfg.seq_len_hint = 64;
    const auto plan = engine::training_plan(c, cfg);
    cost::TrainingMemoryOptions mo;
    mo.workload = {1, 64};
    const auto mem = cost::training_memory(spec, plan, mo);
    // Fits: one device for all, or one per rank.
    cfg.devices = {device(std::max(mem[0].total(), mem[1].total()))};
    CHECK(engine::training_plan(c, cfg) == plan);
    // Rank 1 over its own device.
    const double small = mem[1].total() - 1.0;
    cfg.devices = {device(mem[0].total()), device(small)};
    const auto e = test::error_of(Errc::InvalidArgument, [&] { (void)engine::training_plan(c, cfg); });
    CHECK(e.find(fmt::format("training_plan: rank 1 ({}): {:.0f} bytes do not fit in NVIDIA "
                             "H100 SXM's {:.0f} bytes of memory",
                             mem[1].largest_parts(), mem[1].total(), small)) != std::string::npos);
    CHECK(mem[1].largest_parts().find("optimizer state") == 0);  // AdamW's moments lead
    // A device smaller than the model's weights.
    cfg.devices = {device(1000.0)};
    CHECK(test::error_of(Errc::InvalidArgument, [&] { (void)engine::training_plan(c, cfg); })
              .find(fmt::format("profile NVIDIA H100 SXM: memory_capacity_bytes = 1000 is "
                                "smaller than the model's weights ({:.0f} bytes, f32)",
                                weights)) != std::string::npos);
    cfg.devices = {device(1e12), device(1e12), device(1e12)};
    CHECK(test::error_of(Errc::InvalidArgument, [&] { (void)engine::training_plan(c, cfg); })
              .find("training_plan: 3 device profiles for 2 ranks, expected 1 or 2") !=
          std::string::npos);
  }

  SUBCASE("inference") {
    const auto part = partition::uniform(spec, 2);
    const auto reqs = requests();
    const auto plan = engine::inference_plan(c, part, reqs);
    const auto mem = engine::inference_memory(c, plan, reqs);
    const std::vector<cost::DeviceProfile> fits{device(mem[0].total() + 1.0)};
    CHECK(engine::inference_plan(c, part, reqs, 0, fits) == plan);
    const double small = mem[0].total() - 1.0;
    const std::vector<cost::DeviceProfile> tight{device(small)};
    const auto e =
        test::error_of(Errc::InvalidArgument, [&] { (void)engine::inference_plan(c, part, reqs, 0, tight); });
    CHECK(e.find(fmt::format("inference_plan: rank 0 ({}): {:.0f} bytes do not fit in NVIDIA "
                             "H100 SXM's {:.0f} bytes of memory",
                             mem[0].largest_parts(), mem[0].total(), small)) != std::string::npos);
    CHECK(mem[0].largest_parts().find("KV cache") != std::string::npos);
    const std::vector<cost::DeviceProfile> tiny{device(weights - 1.0)};
    CHECK(test::error_of(Errc::InvalidArgument,
                         [&] { (void)engine::inference_plan(c, part, reqs, 0, tiny); })
              .find("memory_capacity_bytes = " + fmt::format("{:.0f}", weights - 1.0)) !=
          std::string::npos);
  }

  SUBCASE("brigade generate --profile") {
    if (std::string_view(BRIGADE_CLI).empty()) return;
    test::TempDir dir;
    const auto file = dir / "small.json";
    // Holds the weights, not a rank's share of them with the KV cache of 4 x 512 positions
    // (2 x 2 layers x 32 x 2048 x 4 bytes = 1 MiB, more than the whole model's weights).
    cost::save_profile(file, device(weights + 1.0));
    const auto r = test::run_cli("generate --model " + (kData / "stories260K.bin").string() +
                                 " --tokenizer " + (kData / "tok512.bin").string() +
                                 " --stages 2 --steps 512 --prompt a --prompt b --prompt c "
                                 "--prompt d --profile " + file.string());
    CHECK(r.rc != 0);
    // Both ranks are threads of this process: their memory is checked together.
    CHECK(r.err.find("brigade generate: 2 ranks as threads of one process (KV cache ") !=
          std::string::npos);
    CHECK(r.err.find("bytes do not fit in NVIDIA H100 SXM's") != std::string::npos);
    cost::save_profile(file, device(1000.0));
    const auto t = test::run_cli("generate --model " + (kData / "stories260K.bin").string() +
                                 " --tokenizer " + (kData / "tok512.bin").string() +
                                 " --stages 2 --steps 64 --profile " + file.string());
    CHECK(t.rc != 0);
    CHECK(t.err.find("memory_capacity_bytes = 1000 is smaller than the model's weights") !=
          std::string::npos);
    // Training: weights, gradients and AdamW's moments of every stage exceed 3x the weights.
    cost::save_profile(file, device(3.0 * weights));
    const auto u = test::run_cli("train --model " + (kData / "stories260K.bin").string() +
                                 " --tokenizer " + (kData / "tok512.bin").string() +
                                 " --stages 2 --microbatches 2 --tokens-per-microbatch 64 "
                                 "--steps 1 --profile " + file.string());
    CHECK(u.rc != 0);
    CHECK(u.err.find("brigade train: 2 ranks as threads of one process (optimizer state ") !=
          std::string::npos);
  }
  // The ranks of one process together: their parts summed, the shared weights once.
  const std::vector<cost::MemoryBreakdown> two{{0, 10, 1, 2, 3, 4, 5, 6}, {1, 20, 1, 2, 3, 4, 5, 6}};
  const auto all = cost::one_process(two, 25.0);
  CHECK(all.rank == -1);
  CHECK(all.weights == 25.0);
  CHECK(all.total() == 25.0 + 2 * (1 + 2 + 3 + 4 + 5 + 6));
  CHECK(cost::one_process(two).weights == 30.0);
}
