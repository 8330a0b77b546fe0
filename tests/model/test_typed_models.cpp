// Models with F16, BF16 and Q8_0 weights: stories260K (and a synthetic model whose rows are whole
// Q8_0 blocks) generate with exactly the logits and tokens of the float32 engine run on the
// dequantized weights, at 1 and 3 stages; training refuses them.
#include <brigade/engine/inference.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/partition/partition.hpp>
#include <brigade/runtime/inference_stage.hpp>
#include <brigade/runtime/train_stage.hpp>

#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

using namespace brigade;
namespace fs = std::filesystem;

namespace {

const fs::path kData = BRIGADE_MODEL_DIR;

const model::LlamaWeights& stories() {
  static const model::LlamaWeights w = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  return w;
}

/// The logits of the last row after prefilling `prompt` and then decoding `steps` greedy tokens
/// one at a time, through the stages of `p` chained by hand; every step's logits appended.
std::vector<float> logits_trace(const model::LlamaWeights& w, const partition::Partition& p,
                                std::vector<int> prompt, int steps) {
  const model::ModelSpec spec(w.config);
  const int sampler_layer = spec.num_layers() - 1;
  std::vector<runtime::InferenceStage> stages;
  for (auto r : p.stages()) {
    r.last = std::min(r.last, sampler_layer);  // stop before the sampler: keep the logits
    if (r.first < r.last)
      stages.emplace_back(w, r, std::vector<int>{w.config.seq_len}, model::SamplerConfig{});
  }
  std::vector<float> trace;
  int pos = 0;
  std::vector<std::int32_t> ids(prompt.begin(), prompt.end());
  for (int s = 0; s <= steps; ++s) {
    runtime::Microbatch mb;
    mb.seqs = {{0, pos, static_cast<std::int32_t>(ids.size())}};
    mb.token_ids = ids;
    for (auto& st : stages) st.forward(mb);
    REQUIRE(mb.width == w.config.vocab_size);
    trace.insert(trace.end(), mb.act.begin(), mb.act.end());
    pos += static_cast<int>(ids.size());
    int best = 0;
    for (int i = 1; i < w.config.vocab_size; ++i)
      if (mb.act[static_cast<std::size_t>(i)] > mb.act[static_cast<std::size_t>(best)]) best = i;
    ids = {best};
  }
  return trace;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// `narrow` against the float32 engine on its dequantized copy: the logits of a 20-token prompt
/// and 12 decode steps, bit for bit, and the greedy tokens of two sequences at once, at 1 and 3
/// stages.
void check_same_as_dequantized(const model::LlamaWeights& narrow) {
  const model::LlamaWeights deq = model::convert_weights(narrow, DType::F32);
  CHECK(model::all_f32(deq));
  CHECK(!model::all_f32(narrow));
  const model::ModelSpec spec(narrow.config);
  const std::vector<int> prompt{1, 403, 407, 261, 378, 430, 270, 285, 334, 262,
                                290, 264, 373, 411, 266, 307, 320, 269, 288, 301};
  for (int stages : {1, 3}) {
    CAPTURE(stages);
    const auto part = partition::uniform(spec, stages);
    const auto a = logits_trace(narrow, part, prompt, 12);
    const auto b = logits_trace(deq, part, prompt, 12);
    CHECK(a.size() == 13 * static_cast<std::size_t>(narrow.config.vocab_size));
    CHECK(same_bits(a, b));
    std::vector<engine::GenerationRequest> req{{prompt, 40}, {{1, 300, 301}, 30}};
    engine::InferenceOptions opt;
    opt.sampler.temperature = 0.0f;
    const auto ra = engine::generate(narrow, part, req, opt);
    const auto rb = engine::generate(deq, part, req, opt);
    REQUIRE(ra.sequences.size() == 2);
    for (std::size_t i = 0; i < 2; ++i) {
      CHECK(ra.sequences[i].tokens == rb.sequences[i].tokens);
      CHECK(ra.sequences[i].generated > 0);
    }
  }
}

}  // namespace

TEST_CASE("typed_models.stories260K: F16 and BF16 weights give the float32 engine's logits and "
          "tokens on the dequantized weights, at 1 and 3 stages") {
  for (DType t : {DType::F16, DType::BF16}) {
    CAPTURE(to_string(t));
    const model::LlamaWeights narrow = model::convert_weights(stories(), t);
    CHECK(narrow.layers[2].w2.dtype == t);
    CHECK(narrow.wcls == narrow.token_embedding);  // still shared
    CHECK(narrow.layers[0].rms_att == stories().layers[0].rms_att);  // gains stay float32
    // Half the matrix bytes: 259,328 matrix weights (embedding 512 x 64, five layers of 45,312)
    // and 704 float32 gains.
    CHECK(model::weight_bytes(stories()) == 4u * (259328 + 704));
    CHECK(model::weight_bytes(narrow) == 2u * 259328 + 4u * 704);
    // A stage of the five decoder layers (ModelSpec layers 1..5) holds 45,312 two-byte weights
    // and two 64-float gains per layer.
    runtime::InferenceStage decoders(narrow, {0, 1, 6}, std::vector<int>{8}, {});
    CHECK(decoders.weight_bytes() == 5u * (2u * 45312 + 4u * 128));
    check_same_as_dequantized(narrow);
  }
}

TEST_CASE("typed_models: Q8_0 weights on a model of whole blocks (dim 64, hidden 192) give the "
          "float32 engine's logits and tokens on the dequantized weights") {
  model::LlamaConfig c;
  c.dim = 64;
  c.hidden_dim = 192;
  c.n_layers = 4;
  c.n_heads = 8;
  c.n_kv_heads = 4;
  c.vocab_size = 512;
  c.seq_len = 128;
  c.shared_classifier = false;
  const model::LlamaWeights f32 = model::make_synthetic_weights(c, 5);
  const model::LlamaWeights q8 = model::convert_weights(f32, DType::Q8_0);
  CHECK(q8.wcls.dtype == DType::Q8_0);
  CHECK(q8.wcls != q8.token_embedding);
  check_same_as_dequantized(q8);
}

TEST_CASE("typed_models.errors: Q8_0 needs whole blocks, conversions start from float32, and "
          "training and llama2.c files need float32 weights") {
  CHECK_THROWS_WITH_AS(model::convert_weights(stories(), DType::Q8_0),
                       "convert_weights: w2 of layer 0 has rows of 172 elements, not whole q8_0 "
                       "blocks of 32",
                       Error);
  const model::LlamaWeights f16 = model::convert_weights(stories(), DType::F16);
  CHECK_THROWS_WITH_AS(model::convert_weights(f16, DType::BF16),
                       "convert_weights: token_embedding is f16; only float32 weights convert to "
                       "bf16",
                       Error);
  CHECK_THROWS_AS(model::convert_weights(stories(), DType::I32), Error);
  CHECK_THROWS_WITH_AS(runtime::TrainStage(f16, {0, 0, 3}),
                       "TrainStage: needs float32 weights, but token_embedding is f16 (convert "
                       "the model with convert_weights(w, DType::F32) first)",
                       Error);
  const fs::path out = fs::temp_directory_path() / "brigade_typed_f16.bin";
  CHECK_THROWS_AS(model::save_llama2c_checkpoint(out, f16), Error);
  CHECK(!fs::exists(out));
  // Converting to F32 (or to the dtype it has) converts nothing that need not be.
  const model::LlamaWeights same = model::convert_weights(stories(), DType::F32);
  CHECK(same.layers[1].wq == stories().layers[1].wq);
}
