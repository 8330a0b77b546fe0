// safetensors and Hugging Face Llama checkpoints: stories260K written in HF's layout (Q/K rows
// permuted as HF's convert_llama_weights_to_hf.py does, config.json) loads back to exactly the
// llama2.c weights and run.c's tokens; malformed headers and configs are refused by name.
#include <brigade/engine/inference.hpp>
#include <brigade/model/gguf.hpp>
#include <brigade/model/model_file.hpp>
#include <brigade/model/safetensors.hpp>
#include <brigade/model/weights.hpp>

#include "test_util.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

using namespace brigade;
namespace fs = std::filesystem;
using nlohmann::json;
using test::error_of;

namespace {

const fs::path kData = BRIGADE_MODEL_DIR;

struct Entry {
  std::string name, dtype = "F32";
  std::vector<std::int64_t> shape;
  std::string bytes;
};

/// A safetensors file: the JSON header (padded with spaces to 8 bytes), then the data.
std::string safetensors_bytes(const std::vector<Entry>& entries, const json& extra = json::object()) {
  json h = extra;
  std::uint64_t at = 0;
  std::string data;
  for (const Entry& e : entries) {
    h[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {at, at + e.bytes.size()}}};
    at += e.bytes.size();
    data += e.bytes;
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const std::uint64_t n = text.size();
  std::memcpy(out.data(), &n, 8);
  return out + text + data;
}

std::string raw(std::string header_text, std::string data = "") {
  std::string out(8, '\0');
  const std::uint64_t n = header_text.size();
  std::memcpy(out.data(), &n, 8);
  return out + header_text + data;
}

void write(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string floats(const float* p, std::size_t n) {
  return {reinterpret_cast<const char*>(p), n * sizeof(float)};
}

/// HF's permutation of Meta's Q/K rows (convert_llama_weights_to_hf.py's permute): HF row
/// c * half + i of each head is Meta row 2i + c.
std::string hf_permute(const float* w, int heads, int head_size, int cols) {
  std::vector<float> out(static_cast<std::size_t>(heads * head_size * cols));
  const int half = head_size / 2;
  for (int h = 0; h < heads; ++h)
    for (int i = 0; i < half; ++i)
      for (int c = 0; c < 2; ++c)
        std::memcpy(out.data() + (h * head_size + c * half + i) * cols,
                    w + (h * head_size + 2 * i + c) * cols, static_cast<std::size_t>(cols) * 4);
  return floats(out.data(), out.size());
}

/// stories260K in the HF layout: config.json and the entries (one list; the caller splits it
/// into files).
std::pair<json, std::vector<Entry>> hf_stories260K(const model::LlamaWeights& w) {
  const model::LlamaConfig& c = w.config;
  const json cfg = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"},
                    {"hidden_size", c.dim}, {"intermediate_size", c.hidden_dim},
                    {"num_hidden_layers", c.n_layers}, {"num_attention_heads", c.n_heads},
                    {"num_key_value_heads", c.n_kv_heads}, {"max_position_embeddings", c.seq_len},
                    {"rms_norm_eps", 1e-5}, {"rope_theta", 10000.0}, {"vocab_size", c.vocab_size},
                    {"tie_word_embeddings", true}, {"rope_scaling", nullptr},
                    {"torch_dtype", "float32"}};
  const auto d = static_cast<std::size_t>(c.dim), h = static_cast<std::size_t>(c.hidden_dim),
             kv = static_cast<std::size_t>(c.kv_dim()), v = static_cast<std::size_t>(c.vocab_size);
  const std::int64_t D = c.dim, H = c.hidden_dim, KV = c.kv_dim(), V = c.vocab_size;
  std::vector<Entry> e;
  e.push_back({"model.embed_tokens.weight", "F32", {V, D}, floats(w.token_embedding.f32(), v * d)});
  for (std::size_t l = 0; l < w.layers.size(); ++l) {
    const model::DecoderWeights& x = w.layers[l];
    const std::string p = fmt::format("model.layers.{}.", l);
    e.push_back({p + "input_layernorm.weight", "F32", {D}, floats(x.rms_att, d)});
    e.push_back({p + "self_attn.q_proj.weight", "F32", {D, D}, hf_permute(x.wq.f32(), c.n_heads, c.head_size(), c.dim)});
    e.push_back({p + "self_attn.k_proj.weight", "F32", {KV, D}, hf_permute(x.wk.f32(), c.n_kv_heads, c.head_size(), c.dim)});
    e.push_back({p + "self_attn.v_proj.weight", "F32", {KV, D}, floats(x.wv.f32(), kv * d)});
    e.push_back({p + "self_attn.o_proj.weight", "F32", {D, D}, floats(x.wo.f32(), d * d)});
    e.push_back({p + "post_attention_layernorm.weight", "F32", {D}, floats(x.rms_ffn, d)});
    e.push_back({p + "mlp.gate_proj.weight", "F32", {H, D}, floats(x.w1.f32(), h * d)});
    e.push_back({p + "mlp.down_proj.weight", "F32", {D, H}, floats(x.w2.f32(), d * h)});
    e.push_back({p + "mlp.up_proj.weight", "F32", {H, D}, floats(x.w3.f32(), h * d)});
  }
  e.push_back({"model.norm.weight", "F32", {D}, floats(w.rms_final, d)});
  return {cfg, e};
}

bool same(const float* a, const float* b, std::size_t n) { return std::memcmp(a, b, n * 4) == 0; }

/// run.c's greedy case 1 of the reference ("Once upon a time", 64 positions): its prompt and
/// the whole token sequence (prompt, then the generated ids).
std::pair<std::vector<int>, std::vector<int>> run_c_greedy_case() {
  const auto c = test::greedy_reference(kData).cases.at(1);
  return {c.prompt_ids, c.tokens()};
}

/// The entries with every F32 tensor rounded to "BF16" or "F16" (to nearest even).
std::vector<Entry> to_16bit(std::vector<Entry> entries, const std::string& dtype) {
  for (Entry& e : entries) {
    const std::size_t n = e.bytes.size() / 4;
    std::string out(2 * n, '\0');
    for (std::size_t i = 0; i < n; ++i) {
      float f;
      std::memcpy(&f, e.bytes.data() + 4 * i, 4);
      const std::uint16_t h = dtype == "BF16" ? f32_to_bf16(f) : f32_to_f16(f);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
    e.dtype = dtype;
    e.bytes = std::move(out);
  }
  return entries;
}

}  // namespace

TEST_CASE("safetensors.stories260K: the HF layout loads back to llama2.c's weights bit for bit "
          "(Q/K unpermuted) and gives run.c's tokens, from one file and from two shards") {
  const model::LlamaWeights b = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  const auto [cfg, entries] = hf_stories260K(b);
  test::TempDir dir("brigade-st");
  write(dir / "config.json", cfg.dump());
  write(dir / "model.safetensors", safetensors_bytes(entries, {{"__metadata__", {{"format", "pt"}}}}));
  fs::create_directory(dir / "sharded");
  write(dir / "sharded" / "config.json", cfg.dump());
  const std::vector<Entry> first(entries.begin(), entries.begin() + 20),
      second(entries.begin() + 20, entries.end());
  write(dir / "sharded" / "model-00001-of-00002.safetensors", safetensors_bytes(first));
  write(dir / "sharded" / "model-00002-of-00002.safetensors", safetensors_bytes(second));

  const model::SafetensorsFile f = model::SafetensorsFile::open(dir / "model.safetensors");
  CHECK(f.tensors().size() == entries.size());
  CHECK(f.data_offset() % 8 == 0);
  REQUIRE(f.metadata().size() == 1);
  CHECK(f.metadata()[0].second == "pt");
  const model::SafetensorsTensor* q = f.find("model.layers.0.self_attn.q_proj.weight");
  REQUIRE(q != nullptr);
  CHECK(q->shape == std::vector<std::int64_t>{64, 64});

  for (const fs::path& src : {dir / "model.safetensors", dir / "sharded"}) {
    CAPTURE(src);
    const model::LlamaWeights g = model::load_safetensors_llama(src);
    const model::LlamaConfig& c = g.config;
    CHECK(c.dim == 64);
    CHECK(c.n_kv_heads == 4);
    CHECK(c.seq_len == 512);
    CHECK(c.norm_eps == 1e-5f);
    CHECK(c.shared_classifier);
    CHECK_FALSE(g.mapped);
    const auto d = 64u, h = 172u, kv = 32u;
    CHECK(same(g.token_embedding.f32(), b.token_embedding.f32(), 512 * d));
    CHECK(same(g.rms_final, b.rms_final, d));
    for (std::size_t l = 0; l < 5; ++l) {
      CAPTURE(l);
      CHECK(same(g.layers[l].wq.f32(), b.layers[l].wq.f32(), d * d));
      CHECK(same(g.layers[l].wk.f32(), b.layers[l].wk.f32(), kv * d));
      CHECK(same(g.layers[l].wv.f32(), b.layers[l].wv.f32(), kv * d));
      CHECK(same(g.layers[l].wo.f32(), b.layers[l].wo.f32(), d * d));
      CHECK(same(g.layers[l].w1.f32(), b.layers[l].w1.f32(), h * d));
      CHECK(same(g.layers[l].w2.f32(), b.layers[l].w2.f32(), d * h));
      CHECK(same(g.layers[l].w3.f32(), b.layers[l].w3.f32(), h * d));
      CHECK(same(g.layers[l].rms_att, b.layers[l].rms_att, d));
      CHECK(same(g.layers[l].rms_ffn, b.layers[l].rms_ffn, d));
    }
  }
  // The format comes from the magic (a directory is an HF checkpoint).
  CHECK(model::model_file_format(dir / "sharded") == model::ModelFileFormat::Safetensors);
  CHECK(model::model_file_format(dir / "model.safetensors") == model::ModelFileFormat::Safetensors);
  CHECK(model::load_model_weights(dir / "model.safetensors").config.n_layers == 5);
  // run.c's greedy tokens ("Once upon a time", 64 steps) at 1 and 3 stages.
  const auto [prompt, expected] = run_c_greedy_case();
  const model::LlamaWeights g = model::load_safetensors_llama(dir / "sharded");
  for (int stages : {1, 3}) {
    const std::vector<engine::GenerationRequest> req{{prompt, 64}};
    engine::InferenceOptions opt;
    opt.sampler.temperature = 0.0f;
    const auto rep = engine::generate(g, partition::uniform(model::ModelSpec(g.config), stages), req, opt);
    CHECK(rep.sequences.at(0).tokens == expected);
  }
}

TEST_CASE("safetensors.stories260K in BF16 and F16: matrices bound in their dtype with "
          "convert_weights' bits, gains widened, run.c's tokens at 1 and 3 stages") {
  const model::LlamaWeights b = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  const auto [cfg, entries] = hf_stories260K(b);
  test::TempDir dir("brigade-st16");
  const auto [prompt, expected] = run_c_greedy_case();
  for (DType dt : {DType::BF16, DType::F16}) {
    const std::string name(dt == DType::BF16 ? "BF16" : "F16");
    CAPTURE(name);
    const fs::path d = dir / name;
    fs::create_directory(d);
    json c = cfg;
    c["torch_dtype"] = dt == DType::BF16 ? "bfloat16" : "float16";
    write(d / "config.json", c.dump());
    write(d / "model.safetensors", safetensors_bytes(to_16bit(entries, name)));
    const model::LlamaWeights g = model::load_safetensors_llama(d);
    const model::LlamaWeights want = model::convert_weights(b, dt);
    auto same_matrix = [](model::WeightMatrix x, model::WeightMatrix y, std::size_t elements) {
      return x.dtype == y.dtype && std::memcmp(x.data, y.data, 2 * elements) == 0;
    };
    auto rounded = [&](float f) { return dt == DType::BF16 ? bf16_to_f32(f32_to_bf16(f)) : f16_to_f32(f32_to_f16(f)); };
    const auto d64 = 64u, h = 172u, kv = 32u;
    CHECK(same_matrix(g.token_embedding, want.token_embedding, 512 * d64));
    CHECK(g.wcls == g.token_embedding);
    for (std::size_t l = 0; l < 5; ++l) {
      CAPTURE(l);
      const model::DecoderWeights &x = g.layers[l], &y = want.layers[l];
      CHECK(same_matrix(x.wq, y.wq, d64 * d64));  // unpermuted row by row in the file's dtype
      CHECK(same_matrix(x.wk, y.wk, kv * d64));
      CHECK(same_matrix(x.wv, y.wv, kv * d64));
      CHECK(same_matrix(x.wo, y.wo, d64 * d64));
      CHECK(same_matrix(x.w1, y.w1, h * d64));
      CHECK(same_matrix(x.w2, y.w2, d64 * h));
      CHECK(same_matrix(x.w3, y.w3, h * d64));
      int off = 0;
      for (std::size_t i = 0; i < d64; ++i) {
        off += x.rms_att[i] != rounded(b.layers[l].rms_att[i]);
        off += x.rms_ffn[i] != rounded(b.layers[l].rms_ffn[i]);
      }
      CHECK(off == 0);
    }
    std::vector<std::vector<int>> tokens;
    for (int stages : {1, 3}) {
      const std::vector<engine::GenerationRequest> req{{prompt, 64}};
      engine::InferenceOptions opt;
      opt.sampler.temperature = 0.0f;
      tokens.push_back(engine::generate(g, partition::uniform(model::ModelSpec(g.config), stages), req, opt)
                           .sequences.at(0).tokens);
    }
    CHECK(tokens[0] == tokens[1]);
    CHECK(tokens[0] == expected);
  }
}

TEST_CASE("safetensors.malformed: header lengths past the end, invalid JSON, overlaps, gaps, "
          "sizes, dtypes") {
  test::TempDir dir("brigade-st-bad");
  int n = 0;
  auto err = [&](const std::string& bytes) {
    const fs::path p = dir / fmt::format("f{}.safetensors", n++);
    write(p, bytes);
    return error_of(Errc::BadFile, [&] { (void)model::SafetensorsFile::open(p); });
  };
  auto has = [](const std::string& msg, std::string_view part) {
    INFO(msg);
    return msg.find(part) != std::string::npos;
  };
  CHECK(has(err("abc"), "shorter than the 8-byte safetensors header length"));
  std::string past(8, '\0');
  const std::uint64_t big = std::uint64_t{1} << 62;
  std::memcpy(past.data(), &big, 8);
  CHECK(has(err(past + "{}"), "header length 4611686018427387904 runs past the end of the file (2 bytes"));
  CHECK(has(err(raw("{\"a\": ")), "the header is not valid JSON: [json.exception.parse_error.101]"));
  // A number JSON cannot hold (fuzz_safetensors found nlohmann's out_of_range escaping): refused
  // as invalid JSON, not a crash.
  CHECK(has(err(raw(R"({"b": {"dtype": "BF16", "shape": [40e0000000000000000000073709551615]}})")),
            "the header is not valid JSON: [json.exception.out_of_range.406] number overflow "
            "parsing '40e0000000000000000000073709551615'"));
  CHECK(has(err(raw("[1, 2]")), "the header is a JSON array, expected an object"));
  const std::string f16(8, '\0');
  CHECK(has(err(raw(R"({"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", f16)),
            "tensor a has dtype I64, which brigade does not read"));
  CHECK(has(err(raw(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", f16)),
            "tensor a (F32 [3]) has data_offsets [0, 8], 8 bytes, expected 12 bytes"));
  CHECK(has(err(raw(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", f16)),
            "tensor a has a shape whose element count overflows 64 bits (dimension 1 = 4294967296)"));
  CHECK(has(err(raw(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,8]}})", f16)),
            "tensor a has dimension 0 = -1, expected an integer >= 0"));
  CHECK(has(err(raw(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", f16)),
            "tensor a ends at data offset 16, past the end of the file (the data section holds 8 bytes)"));
  CHECK(has(err(raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", f16)),
            "tensor b (data offsets [4, 8]) overlaps tensor a (which ends at 8)"));
  CHECK(has(err(raw(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[0],"data_offsets":[8,8]}})", f16)),
            "a gap of 4 bytes between tensor a (ending at 4) and tensor b (beginning at 8)"));
  CHECK(has(err(raw(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", f16)),
            "4 bytes follow the last tensor's data"));
  CHECK(has(err(raw(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", f16)),
            "tensor a has data_offsets [4,0], expected [begin, end] with 0 <= begin <= end"));
  CHECK(has(err(raw(R"({"a":{"dtype":"F32"}})", f16)),
            "tensor a is not an object with \"dtype\", \"shape\" and \"data_offsets\""));
  CHECK(has(err(raw(R"({"__metadata__":{"k":1}})")), "__metadata__ entry 'k' is a JSON number, expected a string"));
}

TEST_CASE("safetensors.llama: shapes that disagree with config.json, layers past "
          "num_hidden_layers, missing tensors, dtypes, RoPE scaling are refused by name") {
  const model::LlamaWeights b = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  const auto [cfg, entries] = hf_stories260K(b);
  test::TempDir dir("brigade-st-llama");
  int n = 0;
  auto err = [&](const json& c, const std::vector<Entry>& e) {
    const fs::path d = dir / fmt::format("m{}", n++);
    fs::create_directory(d);
    write(d / "config.json", c.dump());
    write(d / "model.safetensors", safetensors_bytes(e));
    return error_of(Errc::BadFile, [&] { (void)model::load_safetensors_llama(d); });
  };
  auto has = [](const std::string& msg, std::string_view part) {
    INFO(msg);
    return msg.find(part) != std::string::npos;
  };
  json c = cfg;
  c["intermediate_size"] = 128;
  CHECK(has(err(c, entries), "tensor model.layers.0.mlp.down_proj.weight has shape [64, 172], expected [64, 128] from"));
  c = cfg;
  c["num_hidden_layers"] = 4;
  CHECK(has(err(c, entries), "tensor model.layers.4.input_layernorm.weight belongs to layer 4, but"));
  std::vector<Entry> gone = entries;
  gone.erase(gone.begin() + 45);  // model.layers.4.mlp.up_proj
  CHECK(has(err(cfg, gone), "tensor model.layers.4.mlp.up_proj.weight is missing"));
  c = cfg;
  c["num_hidden_layers"] = 2147483647;
  CHECK(has(err(c, entries), "key \"num_hidden_layers\" = 2147483647, but the checkpoint holds 47 tensors"));
  c = cfg;
  c["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  CHECK(has(err(c, entries), "key \"rope_scaling\" = {\"factor\":2.0,\"type\":\"linear\"}: brigade's RoPE has no scaling"));
  c = cfg;
  c["model_type"] = "mistral";
  c["architectures"] = {"MistralForCausalLM"};
  CHECK(has(err(c, entries), "model_type = \"mistral\", expected \"llama\""));
  c = cfg;
  c.erase("hidden_size");
  CHECK(has(err(c, entries), "key \"hidden_size\" is missing"));
  {  // a config.json number JSON cannot hold: invalid JSON, not an escaped exception
    const fs::path d = dir / "overflow";
    fs::create_directory(d);
    write(d / "config.json", R"({"model_type": "llama", "hidden_size": 1e999})");
    write(d / "model.safetensors", safetensors_bytes(entries));
    CHECK(has(error_of(Errc::BadFile, [&] { (void)model::load_safetensors_llama(d); }),
              "config.json: not valid JSON: [json.exception.out_of_range.406] number overflow "
              "parsing '1e999'"));
  }
  {  // a 2-byte tensor first (an older export's inv_freq, skipped) puts every F32 tensor at 2 mod 4
    std::vector<Entry> odd = entries;
    odd.insert(odd.begin(), {"model.layers.0.self_attn.rotary_emb.inv_freq", "F16", {1}, std::string(2, '\0')});
    CHECK(has(err(cfg, odd), "tensor model.embed_tokens.weight (F32) starts at a file offset that is not a multiple of 4"));
  }
  {  // a NaN in a BF16 matrix: named with its row and column
    std::vector<Entry> nan = to_16bit(entries, "BF16");
    nan[4].bytes[2 * (64 * 3 + 5) + 1] = '\x7f';  // model.layers.0.self_attn.v_proj: row 3, column 5
    nan[4].bytes[2 * (64 * 3 + 5)] = '\xc0';
    CHECK(has(err(cfg, nan), "tensor model.layers.0.self_attn.v_proj.weight (BF16), element 197 (row 3, column 5) is not finite"));
  }
  std::vector<Entry> extra = entries;
  extra.push_back({"model.layers.0.self_attn.q_norm.weight", "F32", {64}, std::string(256, '\0')});
  CHECK(has(err(cfg, extra), "tensor model.layers.0.self_attn.q_norm.weight is not one of a Llama decoder layer's"));
  std::vector<Entry> tied = entries;
  tied.push_back({"lm_head.weight", "F32", {512, 64}, tied[0].bytes});
  CHECK(has(err(cfg, tied), "tensor lm_head.weight is present, but"));
  c = cfg;
  c["tie_word_embeddings"] = false;
  const model::LlamaWeights sep = [&] {
    const fs::path d = dir / "sep";
    fs::create_directory(d);
    write(d / "config.json", c.dump());
    write(d / "model.safetensors", safetensors_bytes(tied));
    return model::load_safetensors_llama(d);
  }();
  CHECK_FALSE(sep.config.shared_classifier);
  CHECK(same(sep.wcls.f32(), b.token_embedding.f32(), 512 * 64));
  CHECK(has(error_of(Errc::BadFile, [&] { (void)model::load_safetensors_llama(dir / "none"); }),
            "config.json"));
}

TEST_CASE("safetensors.convert: brigade convert turns an HF checkpoint into a GGUF file with "
          "llama2.c's Q/K order" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  const model::LlamaWeights b = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  const auto [cfg, entries] = hf_stories260K(b);
  test::TempDir dir("brigade-st-convert");
  write(dir / "config.json", cfg.dump());
  write(dir / "model.safetensors", safetensors_bytes(entries));
  const auto r = test::run_cli("convert " + dir.path.string() + " " + (dir / "m.gguf").string() +
                               " --tokenizer " + (kData / "tok512.bin").string());
  REQUIRE(r.rc == 0);
  const model::LlamaWeights g = model::load_gguf_llama(dir / "m.gguf");
  for (std::size_t l = 0; l < 5; ++l) {
    CHECK(same(g.layers[l].wq.f32(), b.layers[l].wq.f32(), 64 * 64));
    CHECK(same(g.layers[l].wk.f32(), b.layers[l].wk.f32(), 32 * 64));
  }
  const auto t = test::run_cli("convert " + dir.path.string() + " " + (dir / "n.gguf").string());
  CHECK(t.rc == 2);
  CHECK(t.err.find("convert: a safetensors checkpoint to GGUF needs --tokenizer") != std::string::npos);
}
