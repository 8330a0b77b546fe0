// GGUF on real files: stories260K.gguf (ggml-org/tiny-llamas, made by llama.cpp's tooling)
// against stories260K.bin tensor by tensor and token by token at 1-5 stages, its tokenizer
// against tok512.bin, and the llama2.c <-> GGUF conversions (round trip exact).
#include <brigade/engine/inference.hpp>
#include <brigade/model/weight_matrix.hpp>
#include <brigade/model/gguf.hpp>
#include <brigade/model/model_file.hpp>
#include <brigade/model/text.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>

#include "test_util.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

using namespace brigade;
namespace fs = std::filesystem;

namespace {

const fs::path kData = BRIGADE_MODEL_DIR;  // the committed models/
// stories260K.gguf (ggml-org/tiny-llamas) is not committed: it lives in the data folder
// (BRIGADE_DATA_DIR, ../shared/data by default); the cases that read it skip without it.
const fs::path kGguf = fs::path(BRIGADE_DATA_DIR) / "stories260K.gguf";

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

bool same_floats(const float* a, const float* b, std::size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("gguf.stories260K: the header, metadata and tensor table") {
  if (!test::have_data(kGguf)) return;
  const model::GgufFile f = model::GgufFile::open(kGguf);
  CHECK(f.version() == 3);
  CHECK(f.alignment() == 32);
  CHECK(f.data_offset() % 32 == 0);
  CHECK(f.file_bytes() == 1185376);
  CHECK(f.get_string("general.architecture") == "llama");
  CHECK(f.get_int("llama.block_count") == 5);
  CHECK(f.get_int("llama.embedding_length") == 64);
  CHECK(f.get_int("llama.feed_forward_length") == 172);
  CHECK(f.get_int("llama.attention.head_count") == 8);
  CHECK(f.get_int("llama.attention.head_count_kv") == 4);
  CHECK(f.get_strings("tokenizer.ggml.tokens").size() == 512);
  // llama.cpp's convert-llama2c-to-ggml made it: context 128 (stories260K.bin says 512), and
  // the shared classifier is stored a second time as output.weight.
  CHECK(f.get_int("llama.context_length") == 128);
  // 1 embedding + 5 x 9 block tensors + the final norm + the classifier.
  CHECK(f.tensors().size() == 48);
  const model::GgufTensor* q = f.find_tensor("blk.0.attn_q.weight");
  REQUIRE(q != nullptr);
  CHECK(q->dtype == DType::F32);
  CHECK(q->shape == std::vector<std::int64_t>{64, 64});
  CHECK(q->bytes == 64 * 64 * 4);
  CHECK(f.find_tensor("output.weight") != nullptr);
  CHECK(f.find("no.such.key") == nullptr);
  CHECK_THROWS_WITH_AS(static_cast<void>(f.get_int("general.architecture")),
                       doctest::Contains("metadata key 'general.architecture' is string, expected an integer"),
                       Error);
  CHECK_THROWS_WITH_AS(static_cast<void>(f.get_string("no.such.key")),
                       doctest::Contains("metadata key 'no.such.key' is missing"), Error);
}

TEST_CASE("gguf.stories260K: every weight equals stories260K.bin bit for bit (no Q/K permutation)") {
  if (!test::have_data(kGguf)) return;
  const model::LlamaWeights g = model::load_gguf_llama(kGguf);
  const model::LlamaWeights b = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  const model::LlamaConfig& c = g.config;
  CHECK(c.dim == b.config.dim);
  CHECK(c.hidden_dim == b.config.hidden_dim);
  CHECK(c.n_layers == b.config.n_layers);
  CHECK(c.n_heads == b.config.n_heads);
  CHECK(c.n_kv_heads == b.config.n_kv_heads);
  CHECK(c.vocab_size == b.config.vocab_size);
  CHECK(c.seq_len == 128);  // the file's llama.context_length; stories260K.bin has 512
  CHECK_FALSE(c.shared_classifier);  // output.weight is present (a copy of token_embd)
  CHECK(c.rope_theta == 10000.0f);
  CHECK(c.norm_eps == 1e-5f);
  CHECK(g.mapped);
  CHECK(g.wcls != g.token_embedding);
  const auto d = static_cast<std::size_t>(c.dim), h = static_cast<std::size_t>(c.hidden_dim),
             kv = static_cast<std::size_t>(c.kv_dim()), v = static_cast<std::size_t>(c.vocab_size);
  CHECK(same_floats(g.token_embedding.f32(), b.token_embedding.f32(), v * d));
  CHECK(same_floats(g.rms_final, b.rms_final, d));
  CHECK(same_floats(g.wcls.f32(), b.wcls.f32(), v * d));
  for (std::size_t l = 0; l < g.layers.size(); ++l) {
    CAPTURE(l);
    const model::DecoderWeights &x = g.layers[l], &y = b.layers[l];
    CHECK(same_floats(x.rms_att, y.rms_att, d));
    // llama.cpp's converters keep Meta's interleaved Q/K rows, the adjacent-pair RoPE of
    // llama2.c: wq and wk are the same bytes, nothing to undo.
    CHECK(same_floats(x.wq.f32(), y.wq.f32(), d * d));
    CHECK(same_floats(x.wk.f32(), y.wk.f32(), kv * d));
    CHECK(same_floats(x.wv.f32(), y.wv.f32(), kv * d));
    CHECK(same_floats(x.wo.f32(), y.wo.f32(), d * d));
    CHECK(same_floats(x.rms_ffn, y.rms_ffn, d));
    CHECK(same_floats(x.w1.f32(), y.w1.f32(), h * d));
    CHECK(same_floats(x.w2.f32(), y.w2.f32(), d * h));
    CHECK(same_floats(x.w3.f32(), y.w3.f32(), h * d));
  }
}

TEST_CASE("gguf.stories260K: the tokenizer from the metadata is tok512.bin (pieces, scores, ids)") {
  if (!test::have_data(kGguf)) return;
  const model::GgufFile f = model::GgufFile::open(kGguf);
  const model::Tokenizer g = model::load_gguf_tokenizer(f, 512);
  const model::Tokenizer b = model::Tokenizer::load_llama2c(kData / "tok512.bin", 512);
  REQUIRE(g.vocab_size() == 512);
  for (int i = 0; i < 512; ++i) {
    CAPTURE(i);
    CHECK(g.piece(i) == b.piece(i));
    CHECK(g.score(i) == b.score(i));
  }
  CHECK(g.max_token_length() == b.max_token_length());
  for (const std::string_view text :
       {"Once upon a time, there was a little girl named Lily.", "", " ", "  two  spaces",
        "Tom and Jane went to the park. \"Look!\" said Tom.\nThe end.", "caf\xC3\xA9 \xE2\x82\xAC 5",
        "\xF0\x9F\x98\x80 emoji and a tab\t."}) {
    CAPTURE(text);
    CHECK(g.encode(text, true, false) == b.encode(text, true, false));
    CHECK(g.encode(text, false, true) == b.encode(text, false, true));
  }
  CHECK_THROWS_WITH_AS(static_cast<void>(model::load_gguf_tokenizer(f, 32000)),
                       doctest::Contains("holds 512 tokens, expected the model's vocab_size = 32000"),
                       Error);
}

TEST_CASE("gguf.stories260K: greedy tokens equal run.c's (stories260K.bin's reference) at 1-5 "
          "stages") {
  if (!test::have_data(kGguf)) return;
  const model::GgufFile f = model::GgufFile::open(kGguf);
  const model::LlamaWeights w = model::load_gguf_llama(f);
  const model::Tokenizer tok = model::load_gguf_tokenizer(f, w.config.vocab_size);
  const auto ref = test::greedy_reference(kData);
  const model::ModelSpec spec(w.config);
  for (int stages = 1; stages <= 5; ++stages) {
    CAPTURE(stages);
    for (const auto& c : ref.cases) {
      CAPTURE(c.prompt);
      REQUIRE(tok.encode(c.prompt, true, false) == c.prompt_ids);
      std::vector<int> expected = c.tokens();
      // The GGUF's context is 128 positions: the run stops there, and its tokens are the first
      // 128 of run.c's 512-position run (a causal model: later positions change nothing before).
      const int steps = std::min(c.steps, w.config.seq_len);
      const bool whole = steps == c.steps;
      if (!whole) expected.resize(static_cast<std::size_t>(steps + 1));
      const std::vector<engine::GenerationRequest> req{{c.prompt_ids, steps}};
      engine::InferenceOptions opt;
      opt.sampler.temperature = 0.0f;
      const auto rep = engine::generate(w, partition::uniform(spec, stages), req, opt);
      REQUIRE(rep.sequences.size() == 1);
      CHECK(rep.sequences[0].tokens == expected);
      if (whole)
        CHECK(model::render_like_run_c(tok, rep.sequences[0].tokens) == c.stdout_text);
    }
  }
}

TEST_CASE("gguf.convert: llama2.c -> GGUF -> llama2.c is byte-identical, and so is the tokenizer") {
  test::TempDir dir("brigade-gguf");
  // A checkpoint brigade wrote (its RoPE tables are the ones save_llama2c_checkpoint computes;
  // stories260K.bin's own differ from those in 199 floats by 1 ulp: docs/formats.md).
  const model::LlamaWeights orig = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  model::save_llama2c_checkpoint(dir / "a.bin", orig);
  const model::Tokenizer tok = model::Tokenizer::load_llama2c(kData / "tok512.bin", 512);
  model::save_gguf_llama(dir / "a.gguf", model::load_llama2c_checkpoint(dir / "a.bin"), tok);
  CHECK_FALSE(fs::exists(dir / "a.gguf.tmp"));
  const model::GgufFile f = model::GgufFile::open(dir / "a.gguf");
  CHECK(f.version() == 3);
  model::save_llama2c_checkpoint(dir / "b.bin", model::load_gguf_llama(f));
  CHECK(slurp(dir / "a.bin") == slurp(dir / "b.bin"));
  // Header and every weight of stories260K.bin itself survive the trip (the RoPE tables,
  // which run.c does not read, are recomputed).
  const std::string original = slurp(kData / "stories260K.bin"), back = slurp(dir / "b.bin");
  REQUIRE(original.size() == back.size());
  const std::size_t tables = 28 + 4 * (264128 - 4096);
  CHECK(original.compare(0, tables, back, 0, tables) == 0);
  // The tokenizer: tok512.bin -> GGUF metadata -> tokenizer.bin is the same bytes.
  model::load_gguf_tokenizer(f, 512).save_llama2c(dir / "tok.bin");
  CHECK(slurp(dir / "tok.bin") == slurp(kData / "tok512.bin"));

  // A separate classifier travels as output.weight.
  model::LlamaWeights sep = model::make_synthetic_weights(model::named_config("260K"), 7);
  sep.config.shared_classifier = false;
  std::vector<float> cls(512 * 64);
  for (std::size_t i = 0; i < cls.size(); ++i) cls[i] = 0.001f * static_cast<float>(i % 97);
  sep.wcls = cls.data();
  model::save_gguf_llama(dir / "sep.gguf", sep, tok);
  const model::LlamaWeights sep2 = model::load_gguf_llama(dir / "sep.gguf");
  CHECK_FALSE(sep2.config.shared_classifier);
  CHECK(same_floats(sep2.wcls.f32(), cls.data(), cls.size()));
  CHECK(model::GgufFile::open(dir / "sep.gguf").find_tensor("output.weight") != nullptr);
  // An incomplete model is refused by name (model::check_complete) and nothing is written.
  sep.layers[0].wq = {};
  CHECK_THROWS_WITH_AS(model::save_gguf_llama(dir / "partial.gguf", sep, tok),
                       doctest::Contains("): layer 0 tensor wq is null"), Error);
  CHECK_FALSE(fs::exists(dir / "partial.gguf"));
}

namespace {

/// True when every tensor of `a` and `b` has the same dtype and bytes (matrices at their
/// stored size, gains as float32).
bool same_weights(const model::LlamaWeights& a, const model::LlamaWeights& b) {
  const auto& c = a.config;
  const std::int64_t d = c.dim, h = c.hidden_dim, kv = c.kv_dim(), v = c.vocab_size;
  bool ok = true;
  auto matrix = [&](model::WeightMatrix x, model::WeightMatrix y, std::int64_t rows, std::int64_t cols) {
    ok = ok && x.dtype == y.dtype &&
         std::memcmp(x.data, y.data, model::weight_row_bytes(x.dtype, cols) * static_cast<std::size_t>(rows)) == 0;
  };
  auto gain = [&](const float* x, const float* y) { ok = ok && same_floats(x, y, static_cast<std::size_t>(d)); };
  matrix(a.token_embedding, b.token_embedding, v, d);
  for (std::size_t l = 0; l < a.layers.size(); ++l) {
    const auto &x = a.layers[l], &y = b.layers[l];
    gain(x.rms_att, y.rms_att);
    gain(x.rms_ffn, y.rms_ffn);
    matrix(x.wq, y.wq, d, d);
    matrix(x.wk, y.wk, kv, d);
    matrix(x.wv, y.wv, kv, d);
    matrix(x.wo, y.wo, d, d);
    matrix(x.w1, y.w1, h, d);
    matrix(x.w2, y.w2, d, h);
    matrix(x.w3, y.w3, h, d);
  }
  gain(a.rms_final, b.rms_final);
  matrix(a.wcls, b.wcls, v, d);
  return ok && a.config.shared_classifier == b.config.shared_classifier;
}

}  // namespace

TEST_CASE("gguf.convert: stories260K written as f16 and bf16 GGUF loads back to convert_weights' "
          "bits in llama.cpp's tensor types (gains f32), f16 gives run.c's tokens, and q8_0 "
          "round-trips a model of whole blocks") {
  test::TempDir dir("brigade-gguf-dtype");
  const model::LlamaWeights orig = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  const model::Tokenizer tok = model::Tokenizer::load_llama2c(kData / "tok512.bin", 512);
  const auto ref = test::greedy_reference(kData);
  const std::size_t f32_file = [&] {
    model::save_gguf_llama(dir / "f32.gguf", orig, tok);
    return static_cast<std::size_t>(fs::file_size(dir / "f32.gguf"));
  }();
  for (const auto& [t, ggml] : {std::pair{DType::F16, 1u}, std::pair{DType::BF16, 30u}}) {
    CAPTURE(to_string(t));
    const model::LlamaWeights narrow = model::convert_weights(orig, t);
    const auto path = dir / fmt::format("{}.gguf", to_string(t));
    model::save_gguf_llama(path, narrow, tok);
    CHECK_FALSE(fs::exists(path.string() + ".tmp"));
    const model::GgufFile f = model::GgufFile::open(path);
    CHECK(f.find_tensor("token_embd.weight")->ggml_type == ggml);
    CHECK(f.find_tensor("blk.4.ffn_down.weight")->ggml_type == ggml);
    CHECK(f.find_tensor("blk.0.attn_norm.weight")->ggml_type == 0u);  // f32 gains
    CHECK(f.find_tensor("output_norm.weight")->ggml_type == 0u);
    CHECK(f.find_tensor("output.weight") == nullptr);  // the classifier stays shared
    // 259,328 matrix values at 2 bytes instead of 4 (tensor data aligned to 32 bytes).
    const std::size_t size = static_cast<std::size_t>(fs::file_size(path));
    CHECK(f32_file - size >= 2u * 259328 - 32u * 48);
    CHECK(f32_file - size <= 2u * 259328 + 32u * 48);
    const model::LlamaWeights back = model::load_gguf_llama(f);
    CHECK(back.layers[3].w1.dtype == t);
    CHECK(back.wcls == back.token_embedding);
    CHECK(same_weights(back, narrow));
    if (t == DType::F16) {  // run.c's greedy story ("Once upon a time", 64 steps) at 2 stages
      const auto& c = ref.cases[1];
      const std::vector<engine::GenerationRequest> req{{c.prompt_ids, c.steps}};
      engine::InferenceOptions opt;
      opt.sampler.temperature = 0.0f;
      const auto rep = engine::generate(back, partition::uniform(model::ModelSpec(back.config), 2), req, opt);
      CHECK(rep.sequences[0].tokens == c.tokens());
      CHECK(model::render_like_run_c(model::load_gguf_tokenizer(f, 512), rep.sequences[0].tokens) ==
            c.stdout_text);
    }
  }
  // q8_0: stories260K's hidden_dim 172 is not whole blocks of 32 (named, before a byte is
  // written); a model of whole blocks with its own classifier round-trips bit for bit.
  CHECK_THROWS_WITH_AS((void)model::convert_weights(orig, DType::Q8_0),
                       doctest::Contains("w2 of layer 0 has rows of 172 elements, not whole q8_0 "
                                         "blocks of 32"),
                       Error);
  model::LlamaConfig c = model::named_config("260K");  // dim 64, 8 heads, 4 KV heads
  c.hidden_dim = 192;
  c.n_layers = 2;
  c.shared_classifier = false;
  const auto q8 = model::convert_weights(model::make_synthetic_weights(c, 9), DType::Q8_0);
  model::save_gguf_llama(dir / "q8.gguf", q8, tok);
  const model::GgufFile fq = model::GgufFile::open(dir / "q8.gguf");
  CHECK(fq.find_tensor("output.weight")->ggml_type == 8u);
  CHECK(fq.find_tensor("blk.1.ffn_down.weight")->ggml_type == 8u);
  CHECK(fq.find_tensor("blk.1.ffn_down.weight")->bytes == 64u * (192 / 32) * 34);
  CHECK(same_weights(model::load_gguf_llama(fq), q8));
}

TEST_CASE("gguf.format: the loader is chosen from the magic") {
  if (!test::have_data(kGguf)) return;
  CHECK(model::model_file_format(kGguf) == model::ModelFileFormat::Gguf);
  CHECK(model::model_file_format(kData / "stories260K.bin") == model::ModelFileFormat::Llama2c);
  CHECK(model::load_model_weights(kGguf).config.n_layers == 5);
  CHECK(model::load_model_weights(kData / "stories260K.bin").config.n_layers == 5);
  // A GGUF where a llama2.c file belongs, and the other way round, are named.
  CHECK_THROWS_WITH_AS(model::load_llama2c_checkpoint(kGguf),
                       doctest::Contains("is a GGUF file (llama.cpp)"), Error);
  CHECK_THROWS_WITH_AS(model::GgufFile::open(kData / "stories260K.bin"),
                       doctest::Contains("not the GGUF magic 'GGUF'"), Error);
}
