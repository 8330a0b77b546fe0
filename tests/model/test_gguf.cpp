// GGUF on real files: stories260K.gguf (ggml-org/tiny-llamas, made by llama.cpp's tooling)
// against stories260K.bin tensor by tensor and token by token at 1-5 stages, its tokenizer
// against tok512.bin, and the llama2.c <-> GGUF conversions (round trip exact).
#include <brigade/engine/inference.hpp>
#include <brigade/model/gguf.hpp>
#include <brigade/model/model_file.hpp>
#include <brigade/model/text.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>

#include "test_util.hpp"

#include <doctest/doctest.h>

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
