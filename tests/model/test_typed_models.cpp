// Models with F16, BF16 and Q8_0 weights: stories260K (and a synthetic model whose rows are whole
// Q8_0 blocks) generate with exactly the logits and tokens of the float32 engine run on the
// dequantized weights, at 1 and 3 stages; training refuses them.
#include <brigade/engine/inference.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/partition/partition.hpp>
#include <brigade/runtime/inference_stage.hpp>
#include <brigade/runtime/train_stage.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
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
  std::vector<runtime::InferenceStage<>> stages;
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

/// A Llama config whose rows are whole Q8_0 blocks (dim 64, hidden 192; 8 heads, 4 KV heads;
/// seq_len 128).
model::LlamaConfig whole_blocks(int layers, int vocab, bool shared_classifier) {
  model::LlamaConfig c;
  c.dim = 64;
  c.hidden_dim = 192;
  c.n_layers = layers;
  c.n_heads = 8;
  c.n_kv_heads = 4;
  c.vocab_size = vocab;
  c.seq_len = 128;
  c.shared_classifier = shared_classifier;
  return c;
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
  const model::LlamaWeights f32 = model::make_synthetic_weights(whole_blocks(4, 512, false), 5);
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
  CHECK_THROWS_WITH_AS(model::convert_weights(f16, DType::Q8_0),
                       "convert_weights: w2 of layer 0 has rows of 172 elements, not whole q8_0 "
                       "blocks of 32",
                       Error);
  CHECK_THROWS_WITH_AS(model::convert_weights(stories(), DType::I32),
                       "convert_weights: dtype i32 is not a weight dtype (f32, f16, bf16, q8_0)",
                       Error);
  model::LlamaWeights odd = stories();
  odd.layers[3].w1 = model::WeightMatrix(odd.layers[3].w1.data, DType::I32);
  CHECK_THROWS_WITH_AS(model::convert_weights(odd, DType::F16),
                       "convert_weights: w1 of layer 3 is i32, not a weight dtype (f32, f16, "
                       "bf16, q8_0)",
                       Error);
  CHECK_THROWS_WITH_AS(runtime::TrainStage<>(f16, {0, 0, 3}),
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

namespace {

/// A one-layer model of whole Q8_0 blocks (dim 64, hidden 192, vocab 64, a shared classifier)
/// whose embedding table is `table` (vocab x dim elements of `t`; the classifier too).
model::LlamaWeights with_table(const model::LlamaWeights& base, const void* table, DType t) {
  model::LlamaWeights w = base;
  w.token_embedding = model::WeightMatrix(table, t);
  w.wcls = w.token_embedding;
  return w;
}

model::LlamaWeights block_model(DType t) {
  return model::convert_weights(model::make_synthetic_weights(whole_blocks(1, 64, true), 11), t);
}

std::vector<std::uint16_t> halves(model::WeightMatrix m, std::size_t n) {
  std::vector<std::uint16_t> out(n);
  std::memcpy(out.data(), m.data, n * 2);
  return out;
}

}  // namespace

TEST_CASE("typed_models.convert: the same dtype is kept bit for bit, F16 <-> BF16 and narrow "
          "<-> Q8_0 round once through float32") {
  const std::size_t n = 64 * 64;
  SUBCASE("F16 to F16 and to BF16") {
    const model::LlamaWeights base = block_model(DType::F16);
    std::vector<std::uint16_t> table = halves(base.token_embedding, n);
    // 1 + 3 * 2^-10 (below half a BF16 step: down), 1 + 2^-8 and 1 + 3 * 2^-8 (ties: to even),
    // 65504 (F16's largest: rounds up to 65536 in BF16), -0.0.
    const std::vector<std::uint16_t> in{0x3C03, 0x3C04, 0x3C0C, 0x7BFF, 0x8000};
    std::copy(in.begin(), in.end(), table.begin());
    const model::LlamaWeights w = with_table(base, table.data(), DType::F16);
    const model::LlamaWeights same = model::convert_weights(w, DType::F16);
    CHECK(same.token_embedding == w.token_embedding);  // the same view
    CHECK(same.layers[0].w2 == w.layers[0].w2);
    const model::LlamaWeights bf = model::convert_weights(w, DType::BF16);
    CHECK(bf.token_embedding.dtype == DType::BF16);
    CHECK(bf.wcls == bf.token_embedding);
    CHECK(bf.layers[0].w2.dtype == DType::BF16);
    const auto out = halves(bf.token_embedding, in.size());
    CHECK(out == std::vector<std::uint16_t>{0x3F80, 0x3F80, 0x3F82, 0x4780, 0x8000});
    // Every other element: the BF16 rounding of the F16 value's float32.
    const auto all = halves(bf.token_embedding, n);
    for (std::size_t i = in.size(); i < n; ++i)
      REQUIRE(all[i] == f32_to_bf16(f16_to_f32(table[i])));
  }
  SUBCASE("BF16 to F16") {
    const model::LlamaWeights base = block_model(DType::BF16);
    std::vector<std::uint16_t> table = halves(base.token_embedding, n);
    // 1 + 2^-7 (exact in F16), 65536 (past F16's largest: infinity), 2^-26 (below half F16's
    // smallest subnormal: zero), -3.
    const std::vector<std::uint16_t> in{0x3F81, 0x4780, 0x3280, 0xC040};
    std::copy(in.begin(), in.end(), table.begin());
    const model::LlamaWeights h =
        model::convert_weights(with_table(base, table.data(), DType::BF16), DType::F16);
    CHECK(halves(h.token_embedding, in.size()) ==
          std::vector<std::uint16_t>{0x3C08, 0x7C00, 0x0000, 0xC200});
  }
  SUBCASE("F16 to Q8_0 and Q8_0 to F16, BF16, F32") {
    const model::LlamaWeights base = block_model(DType::F16);
    std::vector<std::uint16_t> table = halves(base.token_embedding, n);
    // The first block: 127, 1, -63.5, then zeros: amax 127, scale 1, q = round half away.
    std::fill(table.begin(), table.begin() + 32, std::uint16_t{0});
    table[0] = 0x57F0;  // 127
    table[1] = 0x3C00;  // 1
    table[2] = 0xD3F0;  // -63.5
    const model::LlamaWeights q =
        model::convert_weights(with_table(base, table.data(), DType::F16), DType::Q8_0);
    CHECK(q.token_embedding.dtype == DType::Q8_0);
    const auto* b = static_cast<const std::uint8_t*>(q.token_embedding.data);
    CHECK(b[0] == 0x00);
    CHECK(b[1] == 0x3C);  // d = 1.0 as F16, little-endian
    CHECK(static_cast<std::int8_t>(b[2]) == 127);
    CHECK(static_cast<std::int8_t>(b[3]) == 1);
    CHECK(static_cast<std::int8_t>(b[4]) == -64);
    CHECK(b[5] == 0);

    // A Q8_0 block d = 0.5, q = 127, -3, 1: 63.5, -1.5, 0.5 in F16, BF16 and F32.
    const model::LlamaWeights q8 = block_model(DType::Q8_0);
    std::vector<std::uint8_t> blocks(64 * 2 * 34);
    std::memcpy(blocks.data(), q8.token_embedding.data, blocks.size());
    blocks[0] = 0x00;
    blocks[1] = 0x38;
    std::fill(blocks.begin() + 2, blocks.begin() + 34, std::uint8_t{0});
    blocks[2] = 127;
    blocks[3] = static_cast<std::uint8_t>(-3);
    blocks[4] = 1;
    const model::LlamaWeights w = with_table(q8, blocks.data(), DType::Q8_0);
    CHECK(halves(model::convert_weights(w, DType::F16).token_embedding, 4) ==
          std::vector<std::uint16_t>{0x53F0, 0xBE00, 0x3800, 0x0000});
    CHECK(halves(model::convert_weights(w, DType::BF16).token_embedding, 4) ==
          std::vector<std::uint16_t>{0x427E, 0xBFC0, 0x3F00, 0x0000});
    const model::LlamaWeights f32 = model::convert_weights(w, DType::F32);
    const float* f = f32.token_embedding.f32();
    CHECK(f[0] == 63.5f);
    CHECK(f[1] == -1.5f);
    CHECK(f[2] == 0.5f);
    CHECK(model::convert_weights(w, DType::Q8_0).token_embedding == w.token_embedding);
  }
}
