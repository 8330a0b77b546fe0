// The llama2.c loaders on the real files: stories260K.bin, tok512.bin, and run.c's reference
// output (models/reference/stories260K_greedy.json).
#include "brigade/core/error.hpp"
#include "brigade/model/tokenizer.hpp"
#include "brigade/model/weights.hpp"

#include <doctest/doctest.h>

#include "test_util.hpp"
#include <unistd.h>

#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

namespace fs = std::filesystem;
using brigade::Errc;
using brigade::Error;
using brigade::model::LlamaWeights;
using brigade::model::Tokenizer;

namespace {

fs::path data_dir() { return fs::path(BRIGADE_MODEL_DIR); }  // the committed models/

fs::path data_file(std::string_view name) {
  const fs::path p = data_dir() / name;
  INFO("committed model file: " << p.string());
  REQUIRE(fs::exists(p));
  return p;
}

std::vector<char> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  REQUIRE(in.is_open());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// The float at float index `k` after the 28-byte header, read from the raw bytes.
float float_at(const std::vector<char>& bytes, std::size_t k) {
  float v = 0;
  REQUIRE(28 + 4 * (k + 1) <= bytes.size());
  std::memcpy(&v, bytes.data() + 28 + 4 * k, 4);
  return v;
}

/// Bitwise equality of two floats (so -0 and 0 differ, as bytes do).
bool same_bits(float a, float b) { return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b); }

/// A temp directory for this file's cases.
struct TempDir : brigade::test::TempDir {
  TempDir() : brigade::test::TempDir("brigade-loaders") {}
};

// stories260K: dim 64, hidden 172, 5 layers, 8 heads, 4 kv heads (kv_dim 32), vocab 512,
// seq_len 512. Float offsets of each tensor after the header, computed here independently.
constexpr std::size_t D = 64, H = 172, L = 5, KV = 32, V = 512, S = 512, HALF = 4;
constexpr std::size_t kEmb = 0, kRmsAtt = kEmb + V * D, kWq = kRmsAtt + L * D,
                      kWk = kWq + L * D * D, kWv = kWk + L * KV * D, kWo = kWv + L * KV * D,
                      kRmsFfn = kWo + L * D * D, kW1 = kRmsFfn + L * D, kW2 = kW1 + L * H * D,
                      kW3 = kW2 + L * D * H, kRmsFinal = kW3 + L * H * D,
                      kFreqReal = kRmsFinal + D, kFreqImag = kFreqReal + S * HALF,
                      kTotal = kFreqImag + S * HALF;
static_assert(kTotal == 264128, "the README's float count");

brigade::test::GreedyReference reference() { return brigade::test::greedy_reference(data_dir()); }

}  // namespace

TEST_CASE("loaders.stories260K: header fields and a shared classifier") {
  const LlamaWeights w = brigade::model::load_llama2c_checkpoint(data_file("stories260K.bin"));
  CHECK(w.config.dim == 64);
  CHECK(w.config.hidden_dim == 172);
  CHECK(w.config.n_layers == 5);
  CHECK(w.config.n_heads == 8);
  CHECK(w.config.n_kv_heads == 4);
  CHECK(w.config.vocab_size == 512);
  CHECK(w.config.seq_len == 512);
  CHECK(w.config.shared_classifier);
  CHECK(w.config.head_size() == 8);
  CHECK(w.config.kv_dim() == 32);
  CHECK(w.config.num_parameters() == 260032);
  CHECK(w.wcls == w.token_embedding);
  CHECK(w.layers.size() == 5);
  CHECK(w.storage != nullptr);
  CHECK(fs::file_size(data_file("stories260K.bin")) == 28 + 4 * kTotal);
}

TEST_CASE("loaders.stories260K: tensor pointers read the file's floats at computed offsets") {
  const fs::path path = data_file("stories260K.bin");
  const std::vector<char> bytes = read_bytes(path);
  const LlamaWeights w = brigade::model::load_llama2c_checkpoint(path);
  // Every pointer is exactly its offset into the mapping: no copy was made.
  const auto* base = reinterpret_cast<const float*>(static_cast<const char*>(w.storage.get()) + 28);
  CHECK(w.token_embedding == base + kEmb);
  CHECK(w.layers[3].wk == base + kWk + 3 * KV * D);
  CHECK(w.rms_final == base + kRmsFinal);

  struct Probe {
    const char* what;
    const float* ptr;
    std::size_t offset;
  };
  const auto& ly = w.layers;
  const std::vector<Probe> probes = {
      {"token_embedding[100][7]", w.token_embedding.f32() + 100 * D + 7, kEmb + 100 * D + 7},
      {"token_embedding[511][63]", w.token_embedding.f32() + 511 * D + 63, kEmb + 511 * D + 63},
      {"rms_att[2][5]", ly[2].rms_att + 5, kRmsAtt + 2 * D + 5},
      {"wq[3][17][40]", ly[3].wq.f32() + 17 * D + 40, kWq + 3 * D * D + 17 * D + 40},
      {"wk[4][31][63]", ly[4].wk.f32() + 31 * D + 63, kWk + 4 * KV * D + 31 * D + 63},
      {"wv[1][0][0]", ly[1].wv.f32(), kWv + 1 * KV * D},
      {"wo[0][63][63]", ly[0].wo.f32() + 63 * D + 63, kWo + 63 * D + 63},
      {"rms_ffn[2][0]", ly[2].rms_ffn, kRmsFfn + 2 * D},
      {"w1[3][171][1]", ly[3].w1.f32() + 171 * D + 1, kW1 + 3 * H * D + 171 * D + 1},
      {"w2[4][63][171]", ly[4].w2.f32() + 63 * H + 171, kW2 + 4 * D * H + 63 * H + 171},
      {"w3[1][100]", ly[1].w3.f32() + 100, kW3 + 1 * H * D + 100},
      {"rms_final[63]", w.rms_final + 63, kRmsFinal + 63},
  };
  for (const Probe& p : probes) {
    CAPTURE(p.what);
    const float expected = float_at(bytes, p.offset);
    CHECK(std::isfinite(expected));
    CHECK(same_bits(*p.ptr, expected));
  }
  // The values are weights, not padding: norms are O(1) gains, matrices small and varied.
  CHECK(w.rms_final[0] != 0.0f);
  CHECK(ly[0].wq.f32()[0] != ly[0].wq.f32()[1]);
}

TEST_CASE("loaders.stories260K: load then save reproduces the file (RoPE tables within 1 ulp)") {
  const fs::path path = data_file("stories260K.bin");
  const std::vector<char> original = read_bytes(path);
  TempDir dir;
  const fs::path copy = dir.path / "copy.bin";
  brigade::model::save_llama2c_checkpoint(copy, brigade::model::load_llama2c_checkpoint(path));
  const std::vector<char> written = read_bytes(copy);
  REQUIRE(written.size() == original.size());

  // Header and every weight: byte-identical.
  const std::size_t tables_begin = 28 + 4 * kFreqReal, tables_end = 28 + 4 * kTotal;
  CHECK(std::memcmp(written.data(), original.data(), tables_begin) == 0);
  CHECK(tables_end == original.size());

  // The RoPE tables: run.c never reads them. The file's were computed by PyTorch's float32
  // cos/sin; brigade rounds double cos/sin of the same float32 angle, so a few entries differ
  // by one unit in the last place. Count them, and require nothing worse.
  std::size_t differing = 0;
  std::uint32_t worst_ulp = 0;
  for (std::size_t k = kFreqReal; k < kTotal; ++k) {
    const auto a = std::bit_cast<std::int32_t>(float_at(original, k));
    const auto b = std::bit_cast<std::int32_t>(float_at(written, k));
    if (a != b) ++differing;
    worst_ulp = std::max(worst_ulp, static_cast<std::uint32_t>(std::abs(a - b)));
  }
  MESSAGE("RoPE table entries that differ from stories260K.bin: " << differing << " of "
                                                                    << 2 * S * HALF
                                                                    << ", worst " << worst_ulp
                                                                    << " ulp");
  CHECK(worst_ulp <= 1);
  CHECK(differing < S * HALF / 4);
  // The tables are cos and sin of pos * 10000^(-2i/8).
  for (const std::size_t pos : {std::size_t{0}, std::size_t{1}, std::size_t{77}, S - 1}) {
    for (std::size_t i = 0; i < HALF; ++i) {
      const double angle = static_cast<double>(pos) * std::pow(10000.0, -2.0 * static_cast<double>(i) / 8.0);
      CAPTURE(pos);
      CAPTURE(i);
      CHECK(float_at(original, kFreqReal + pos * HALF + i) == doctest::Approx(std::cos(angle)).epsilon(1e-4));
      CHECK(float_at(original, kFreqImag + pos * HALF + i) == doctest::Approx(std::sin(angle)).epsilon(1e-4));
    }
  }
}

TEST_CASE("loaders.tok512: vocabulary layout as the data README describes") {
  const Tokenizer t = Tokenizer::load_llama2c(data_file("tok512.bin"), 512);
  CHECK(t.vocab_size() == 512);
  CHECK(t.max_token_length() == 7);
  CHECK(t.piece(0) == "<unk>");
  CHECK(t.piece(1) == "\n<s>\n");
  CHECK(t.piece(2) == "\n</s>\n");
  CHECK(t.piece(3) == "<0x00>");
  CHECK(t.piece(258) == "<0xFF>");
  CHECK(t.piece(410) == " ");
  CHECK(t.piece(403) == " Once");
  for (int id = 259; id < 512; ++id) {
    CAPTURE(id);
    CHECK(t.score(id) == static_cast<float>(-(id - 259)));
  }
}

TEST_CASE("loaders.tok512: a wrong vocab_size is BadFile either way") {
  const fs::path p = data_file("tok512.bin");
  try {
    (void)Tokenizer::load_llama2c(p, 511);
    FAIL("expected BadFile");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::BadFile);
    CHECK(std::string_view(e.what()).find("vocab_size = 511") != std::string_view::npos);
  }
  try {
    (void)Tokenizer::load_llama2c(p, 513);
    FAIL("expected BadFile");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::BadFile);
    CHECK(std::string_view(e.what()).find("after 512 tokens") != std::string_view::npos);
  }
}

TEST_CASE("loaders.tok512: encode matches run.c") {
  const Tokenizer t = Tokenizer::load_llama2c(data_file("tok512.bin"), 512);
  CHECK(t.encode("Once upon a time", true, false) == std::vector<int>{1, 403, 407, 261, 378});
  CHECK(t.encode("", true, false) == std::vector<int>{1});
  CHECK(t.encode("Once upon a time", true, true) ==
        std::vector<int>{1, 403, 407, 261, 378, 2});
  for (const auto& c : reference().cases) {
    CAPTURE(c.name);
    CHECK(t.encode(c.prompt, true, false) == c.prompt_ids);
  }
}

TEST_CASE("loaders.tok512: byte fallback for a character absent from the vocabulary") {
  const Tokenizer t = Tokenizer::load_llama2c(data_file("tok512.bin"), 512);
  // u-umlaut (U+00FC, bytes C3 BC) has no token: its bytes + 3 follow the dummy prefix.
  const std::vector<int> ids = t.encode("\xC3\xBC", false, false);
  CHECK(ids == std::vector<int>{410, 0xC3 + 3, 0xBC + 3});
  CHECK(t.piece(0xC3 + 3) == "<0xC3>");
  CHECK(t.decode(410, 0xC3 + 3) == "\xC3");
  CHECK(t.decode(0xC3 + 3, 0xBC + 3) == "\xBC");
  CHECK(t.decode(1, 0x0A + 3) == "\n");
  // Printed as run.c prints it: single non-printable bytes are dropped.
  std::string out;
  for (std::size_t i = 1; i < ids.size(); ++i)
    Tokenizer::append_printable(out, t.decode(ids[i - 1], ids[i]));
  CHECK(out.empty());
}

TEST_CASE("loaders.tok512: decoding each reference case reproduces run.c's stdout byte for byte") {
  const Tokenizer t = Tokenizer::load_llama2c(data_file("tok512.bin"), 512);
  const auto cases = reference().cases;
  REQUIRE(cases.size() >= 2);
  for (const auto& c : cases) {
    CAPTURE(c.name);
    const std::vector<int> ids = c.tokens();  // without a BOS run.c stopped on
    std::string out;
    for (std::size_t i = 1; i < ids.size(); ++i)
      Tokenizer::append_printable(out, t.decode(ids[i - 1], ids[i]));
    out += '\n';
    CHECK(out.size() == c.stdout_text.size());
    CHECK(out == c.stdout_text);
  }
}
