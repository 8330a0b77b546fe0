// llama2.c checkpoint loader and writer on self-made files, and synthetic weights.
#include "brigade/core/error.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/weights.hpp"

#include <doctest/doctest.h>

#include "test_util.hpp"
#include <unistd.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

using brigade::test::rel;

namespace fs = std::filesystem;
using brigade::Errc;
using brigade::Error;
using brigade::model::LlamaConfig;
using brigade::model::LlamaWeights;

namespace {

/// A temp directory for this file's cases.
struct TempDir : brigade::test::TempDir {
  TempDir() : brigade::test::TempDir("brigade-weights") {}
};

void write_bytes(const fs::path& p, const std::vector<char>& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

std::vector<char> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  REQUIRE(in.is_open());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// Header bytes for the 7 fields, followed by `floats` float32 values (all 0.5).
std::vector<char> checkpoint_bytes(const std::array<std::int32_t, 7>& header, std::size_t floats) {
  std::vector<char> out(28 + 4 * floats);
  std::memcpy(out.data(), header.data(), 28);
  const float v = 0.5f;
  for (std::size_t i = 0; i < floats; ++i) std::memcpy(out.data() + 28 + 4 * i, &v, 4);
  return out;
}

/// Floats after the header for the given fields (shared classifier when vocab > 0).
std::size_t floats_for(const std::array<std::int32_t, 7>& h) {
  const std::size_t d = static_cast<std::size_t>(h[0]), hid = static_cast<std::size_t>(h[1]),
                    L = static_cast<std::size_t>(h[2]), heads = static_cast<std::size_t>(h[3]),
                    kvh = static_cast<std::size_t>(h[4]),
                    v = static_cast<std::size_t>(std::abs(h[5])),
                    s = static_cast<std::size_t>(h[6]);
  const std::size_t hs = d / heads, kv = kvh * hs;
  std::size_t n = v * d + L * (2 * d + 2 * d * d + 2 * kv * d + 3 * hid * d) + d + s * hs;
  if (h[5] < 0) n += v * d;
  return n;
}

constexpr std::array<std::int32_t, 7> kTiny = {16, 24, 2, 4, 2, 32, 8};

/// Calls `f`, requires brigade::Error{BadFile} whose message contains every `needle`.
void require_bad_file(const std::function<void()>& f, std::initializer_list<std::string> needles) {
  try {
    f();
    FAIL("expected brigade::Error{BadFile}, nothing was thrown");
  } catch (const Error& e) {
    INFO("message: " << std::string(e.what()));
    CHECK(e.code() == Errc::BadFile);
    for (const auto& n : needles) {
      INFO("expected to contain: " << n);
      CHECK(std::string_view(e.what()).find(n) != std::string_view::npos);
    }
  }
}

LlamaConfig tiny_config(bool shared) {
  LlamaConfig c;
  c.dim = 16;
  c.hidden_dim = 24;
  c.n_layers = 3;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 40;
  c.seq_len = 12;
  c.shared_classifier = shared;
  return c;
}

/// Every tensor of `a` equals the one of `b`, byte for byte.
void check_same_tensors(const LlamaWeights& a, const LlamaWeights& b) {
  const LlamaConfig& c = a.config;
  const auto d = static_cast<std::size_t>(c.dim), h = static_cast<std::size_t>(c.hidden_dim),
             kv = static_cast<std::size_t>(c.kv_dim()), v = static_cast<std::size_t>(c.vocab_size);
  auto same = [](const float* x, const float* y, std::size_t n) {
    return std::memcmp(x, y, n * sizeof(float)) == 0;
  };
  CHECK(same(a.token_embedding.f32(), b.token_embedding.f32(), v * d));
  CHECK(same(a.wcls.f32(), b.wcls.f32(), v * d));
  CHECK(same(a.rms_final, b.rms_final, d));
  REQUIRE(a.layers.size() == b.layers.size());
  for (std::size_t i = 0; i < a.layers.size(); ++i) {
    const auto &x = a.layers[i], &y = b.layers[i];
    CAPTURE(i);
    CHECK(same(x.rms_att, y.rms_att, d));
    CHECK(same(x.wq.f32(), y.wq.f32(), d * d));
    CHECK(same(x.wk.f32(), y.wk.f32(), kv * d));
    CHECK(same(x.wv.f32(), y.wv.f32(), kv * d));
    CHECK(same(x.wo.f32(), y.wo.f32(), d * d));
    CHECK(same(x.rms_ffn, y.rms_ffn, d));
    CHECK(same(x.w1.f32(), y.w1.f32(), h * d));
    CHECK(same(x.w2.f32(), y.w2.f32(), d * h));
    CHECK(same(x.w3.f32(), y.w3.f32(), h * d));
  }
}

/// Mean and standard deviation of n floats.
std::pair<double, double> moments(const float* p, std::size_t n) {
  double s = 0, s2 = 0;
  for (std::size_t i = 0; i < n; ++i) {
    s += p[i];
    s2 += static_cast<double>(p[i]) * p[i];
  }
  const double mean = s / static_cast<double>(n);
  return {mean, std::sqrt(s2 / static_cast<double>(n) - mean * mean)};
}

}  // namespace

// ---- loader: well-formed files --------------------------------------------------------------

TEST_CASE("weights.load: a well-formed shared-classifier file maps every tensor in order") {
  TempDir dir;
  const auto p = dir / "ok.bin";
  // Each float holds its own index, so every pointer can be checked against its offset.
  const std::size_t n = floats_for(kTiny);
  std::vector<char> bytes = checkpoint_bytes(kTiny, n);
  for (std::size_t i = 0; i < n; ++i) {
    const auto v = static_cast<float>(i);
    std::memcpy(bytes.data() + 28 + 4 * i, &v, 4);
  }
  write_bytes(p, bytes);
  const LlamaWeights w = brigade::model::load_llama2c_checkpoint(p);
  CHECK(w.config.dim == 16);
  CHECK(w.config.hidden_dim == 24);
  CHECK(w.config.n_layers == 2);
  CHECK(w.config.n_heads == 4);
  CHECK(w.config.n_kv_heads == 2);
  CHECK(w.config.vocab_size == 32);
  CHECK(w.config.seq_len == 8);
  CHECK(w.config.shared_classifier);
  CHECK(w.storage != nullptr);
  // d=16, kv=8, hidden=24, L=2, vocab=32.
  const std::size_t emb = 32 * 16, rms_att = emb, wq = rms_att + 2 * 16, wk = wq + 2 * 256,
                    wv = wk + 2 * 128, wo = wv + 2 * 128, rms_ffn = wo + 2 * 256,
                    w1 = rms_ffn + 2 * 16, w2 = w1 + 2 * 384, w3 = w2 + 2 * 384,
                    rms_final = w3 + 2 * 384;
  CHECK(w.token_embedding.f32()[0] == 0.0f);
  CHECK(w.wcls == w.token_embedding);
  CHECK(w.layers.size() == 2);
  CHECK(w.layers[1].rms_att[0] == static_cast<float>(rms_att + 16));
  CHECK(w.layers[0].wq.f32()[0] == static_cast<float>(wq));
  CHECK(w.layers[1].wk.f32()[0] == static_cast<float>(wk + 128));
  CHECK(w.layers[1].wv.f32()[5] == static_cast<float>(wv + 128 + 5));
  CHECK(w.layers[1].wo.f32()[0] == static_cast<float>(wo + 256));
  CHECK(w.layers[0].rms_ffn[3] == static_cast<float>(rms_ffn + 3));
  CHECK(w.layers[1].w1.f32()[0] == static_cast<float>(w1 + 384));
  CHECK(w.layers[1].w2.f32()[0] == static_cast<float>(w2 + 384));
  CHECK(w.layers[1].w3.f32()[383] == static_cast<float>(w3 + 384 + 383));
  CHECK(w.rms_final[15] == static_cast<float>(rms_final + 15));
}

TEST_CASE("weights.load: a negative vocab_size reads wcls after the RoPE tables") {
  TempDir dir;
  const auto p = dir / "sep.bin";
  std::array<std::int32_t, 7> h = kTiny;
  h[5] = -32;
  const std::size_t n = floats_for(h);
  std::vector<char> bytes = checkpoint_bytes(h, n);
  const float marker = 7.0f;
  std::memcpy(bytes.data() + 28 + 4 * (n - 32 * 16), &marker, 4);  // first float of wcls
  write_bytes(p, bytes);
  const LlamaWeights w = brigade::model::load_llama2c_checkpoint(p);
  CHECK(w.config.vocab_size == 32);
  CHECK_FALSE(w.config.shared_classifier);
  CHECK(w.wcls != w.token_embedding);
  CHECK(w.wcls.f32()[0] == 7.0f);
  CHECK(w.wcls.f32()[1] == 0.5f);
}

TEST_CASE("weights.load: the mapping outlives the file name and copies share it") {
  TempDir dir;
  const auto p = dir / "ok.bin";
  write_bytes(p, checkpoint_bytes(kTiny, floats_for(kTiny)));
  LlamaWeights copy;
  {
    const LlamaWeights w = brigade::model::load_llama2c_checkpoint(p);
    copy = w;
    CHECK(copy.storage.use_count() == 2);
  }
  fs::remove(p);
  CHECK(copy.storage.use_count() == 1);
  CHECK(copy.layers[1].w3.f32()[10] == 0.5f);
}

// ---- loader: each malformed case ------------------------------------------------------------

TEST_CASE("weights.load: a missing file is BadFile naming the path") {
  TempDir dir;
  const auto p = dir / "nope.bin";
  require_bad_file([&] { (void)brigade::model::load_llama2c_checkpoint(p); },
                   {p.string(), "not found"});
}

TEST_CASE("weights.load: a file shorter than the 28-byte header is BadFile with its size") {
  TempDir dir;
  const auto p = dir / "short.bin";
  write_bytes(p, std::vector<char>(10, '\0'));
  require_bad_file([&] { (void)brigade::model::load_llama2c_checkpoint(p); },
                   {p.string(), "10 bytes", "28-byte"});
  write_bytes(p, {});
  require_bad_file([&] { (void)brigade::model::load_llama2c_checkpoint(p); },
                   {p.string(), "0 bytes", "28-byte"});
}

TEST_CASE("weights.load: a non-positive header field is BadFile naming the field") {
  const std::array<const char*, 7> names = {"dim",        "hidden_dim", "n_layers", "n_heads",
                                            "n_kv_heads", "vocab_size", "seq_len"};
  for (std::size_t field = 0; field < 7; ++field) {
    for (const std::int32_t bad : {0, -3}) {
      if (field == 5 && bad < 0) continue;  // a negative vocab_size is legal
      CAPTURE(field);
      CAPTURE(bad);
      TempDir dir;
      const auto p = dir / "field.bin";
      std::array<std::int32_t, 7> h = kTiny;
      h[field] = bad;
      write_bytes(p, checkpoint_bytes(h, floats_for(kTiny)));
      require_bad_file([&] { (void)brigade::model::load_llama2c_checkpoint(p); },
                       {p.string(), fmt::format("{} = {}", names[field], bad)});
    }
  }
}

TEST_CASE("weights.load: dim not divisible by n_heads is BadFile naming both") {
  TempDir dir;
  const auto p = dir / "heads.bin";
  std::array<std::int32_t, 7> h = kTiny;
  h[0] = 18;  // 18 % 4 != 0
  write_bytes(p, checkpoint_bytes(h, 4096));
  require_bad_file([&] { (void)brigade::model::load_llama2c_checkpoint(p); },
                   {p.string(), "dim = 18", "n_heads = 4"});
}

TEST_CASE("weights.load: n_heads not a multiple of n_kv_heads is BadFile naming both") {
  TempDir dir;
  const auto p = dir / "kv.bin";
  std::array<std::int32_t, 7> h = kTiny;
  h[0] = 24;  // head_size 6 with 4 heads
  h[4] = 3;
  write_bytes(p, checkpoint_bytes(h, 4096));
  require_bad_file([&] { (void)brigade::model::load_llama2c_checkpoint(p); },
                   {p.string(), "n_heads = 4", "n_kv_heads = 3"});
}

TEST_CASE("weights.load: an odd head size is BadFile naming it") {
  TempDir dir;
  const auto p = dir / "odd.bin";
  std::array<std::int32_t, 7> h = kTiny;
  h[0] = 12;  // head_size 3
  write_bytes(p, checkpoint_bytes(h, 4096));
  require_bad_file([&] { (void)brigade::model::load_llama2c_checkpoint(p); },
                   {p.string(), "head_size = 3"});
}

TEST_CASE("weights.load: a file one float short is BadFile with bytes seen and expected") {
  TempDir dir;
  const auto p = dir / "trunc.bin";
  const std::size_t n = floats_for(kTiny);
  write_bytes(p, checkpoint_bytes(kTiny, n - 1));
  require_bad_file([&] { (void)brigade::model::load_llama2c_checkpoint(p); },
                   {p.string(), fmt::format("{} bytes", 28 + 4 * (n - 1)),
                    fmt::format("expected {} bytes", 28 + 4 * n)});
}

TEST_CASE("weights.load: a file with trailing bytes is BadFile with bytes seen and expected") {
  TempDir dir;
  const auto p = dir / "long.bin";
  const std::size_t n = floats_for(kTiny);
  std::vector<char> bytes = checkpoint_bytes(kTiny, n);
  bytes.push_back('x');
  write_bytes(p, bytes);
  require_bad_file([&] { (void)brigade::model::load_llama2c_checkpoint(p); },
                   {p.string(), fmt::format("{} bytes", 28 + 4 * n + 1),
                    fmt::format("expected {} bytes", 28 + 4 * n)});
}

TEST_CASE("weights.load: a separate classifier missing from the file is BadFile with a hint") {
  TempDir dir;
  const auto p = dir / "nocls.bin";
  std::array<std::int32_t, 7> h = kTiny;
  h[5] = -32;
  write_bytes(p, checkpoint_bytes(h, floats_for(kTiny)));  // sized as if shared
  require_bad_file([&] { (void)brigade::model::load_llama2c_checkpoint(p); },
                   {p.string(), "vocab_size=-32", "should probably be positive",
                    fmt::format("expected {} bytes", 28 + 4 * floats_for(h))});
}

TEST_CASE("weights.load: a header whose sizes overflow 64 bits is BadFile, not a crash") {
  TempDir dir;
  const auto p = dir / "huge.bin";
  const std::array<std::int32_t, 7> h = {1 << 30, 1 << 30, 1 << 30, 2, 2, 1 << 30, 2};
  write_bytes(p, checkpoint_bytes(h, 16));
  require_bad_file([&] { (void)brigade::model::load_llama2c_checkpoint(p); },
                   {p.string(), "2^64"});
}

// ---- writer -----------------------------------------------------------------------------------

TEST_CASE("weights.save: synthetic weights round-trip byte for byte (shared and separate)") {
  for (const bool shared : {true, false}) {
    CAPTURE(shared);
    TempDir dir;
    const auto p = dir / "synth.bin";
    const LlamaWeights a = brigade::model::make_synthetic_weights(tiny_config(shared), 42);
    brigade::model::save_llama2c_checkpoint(p, a);
    CHECK_FALSE(fs::exists(dir / "synth.bin.tmp"));
    const LlamaConfig& c = a.config;
    const std::size_t floats =
        floats_for({c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads,
                    shared ? c.vocab_size : -c.vocab_size, c.seq_len});
    CHECK(fs::file_size(p) == 28 + 4 * floats);
    const std::vector<char> bytes = read_bytes(p);
    std::array<std::int32_t, 7> header{};
    std::memcpy(header.data(), bytes.data(), 28);
    CHECK(header[5] == (shared ? 40 : -40));

    const LlamaWeights b = brigade::model::load_llama2c_checkpoint(p);
    CHECK(b.config.dim == c.dim);
    CHECK(b.config.hidden_dim == c.hidden_dim);
    CHECK(b.config.n_layers == c.n_layers);
    CHECK(b.config.n_heads == c.n_heads);
    CHECK(b.config.n_kv_heads == c.n_kv_heads);
    CHECK(b.config.vocab_size == c.vocab_size);
    CHECK(b.config.seq_len == c.seq_len);
    CHECK(b.config.shared_classifier == shared);
    check_same_tensors(a, b);

    // Saving what was loaded gives the same file again.
    const auto q = dir / "again.bin";
    brigade::model::save_llama2c_checkpoint(q, b);
    CHECK(read_bytes(q) == bytes);
  }
}

TEST_CASE("weights.check_complete: a missing layer or tensor is named, and nothing is saved") {
  TempDir dir;
  const auto p = dir / "partial.bin";
  const LlamaWeights whole = brigade::model::make_synthetic_weights(tiny_config(true), 5);
  CHECK_NOTHROW(brigade::model::check_complete(whole, "x"));
  auto refused = [&](const LlamaWeights& w, const std::string& message) {
    CHECK_THROWS_WITH_AS(brigade::model::check_complete(w, "check(t)"),
                         ("check(t): " + message).c_str(), brigade::Error);
    const std::string saver = "save_llama2c_checkpoint(" + p.string() + "): " + message;
    CHECK_THROWS_WITH_AS(brigade::model::save_llama2c_checkpoint(p, w),
                         doctest::Contains(saver.c_str()), brigade::Error);
    CHECK_FALSE(std::filesystem::exists(p));
  };
  LlamaWeights w = whole;
  w.layers.pop_back();
  refused(w, "2 layers of weights, expected n_layers = 3");
  w = whole;
  w.rms_final = nullptr;
  refused(w, "token_embedding, rms_final or wcls is null");
  w = whole;
  w.layers[1].w2 = {};
  refused(w, "layer 1 tensor w2 is null");
  w = whole;
  w.layers[0].rms_att = nullptr;
  refused(w, "layer 0 tensor rms_att is null");
}

TEST_CASE("weights.save: RoPE tables hold cos and sin of pos * theta^(-2i/head_size)") {
  TempDir dir;
  const auto p = dir / "rope.bin";
  const LlamaConfig c = tiny_config(true);
  brigade::model::save_llama2c_checkpoint(p, brigade::model::make_synthetic_weights(c, 1));
  const std::vector<char> bytes = read_bytes(p);
  const std::size_t hs = static_cast<std::size_t>(c.head_size()), half = hs / 2,
                    table = static_cast<std::size_t>(c.seq_len) * half;
  const std::size_t real_at = bytes.size() - 2 * 4 * table, imag_at = bytes.size() - 4 * table;
  for (std::size_t pos = 0; pos < static_cast<std::size_t>(c.seq_len); ++pos) {
    for (std::size_t i = 0; i < half; ++i) {
      float re = 0, im = 0;
      std::memcpy(&re, bytes.data() + real_at + 4 * (pos * half + i), 4);
      std::memcpy(&im, bytes.data() + imag_at + 4 * (pos * half + i), 4);
      const double angle =
          static_cast<double>(pos) * std::pow(10000.0, -2.0 * static_cast<double>(i) / static_cast<double>(hs));
      CAPTURE(pos);
      CAPTURE(i);
      CHECK(re == doctest::Approx(std::cos(angle)).epsilon(1e-5));
      CHECK(im == doctest::Approx(std::sin(angle)).epsilon(1e-5));
    }
  }
}

TEST_CASE("weights.save: overwriting an existing checkpoint replaces it") {
  TempDir dir;
  const auto p = dir / "over.bin";
  write_bytes(p, std::vector<char>(5, 'x'));
  const LlamaWeights a = brigade::model::make_synthetic_weights(tiny_config(true), 3);
  brigade::model::save_llama2c_checkpoint(p, a);
  check_same_tensors(a, brigade::model::load_llama2c_checkpoint(p));
}

TEST_CASE("weights.save: an unwritable path is BadFile and leaves no temporary behind") {
  TempDir dir;
  const auto p = dir / "missing-dir" / "x.bin";
  const LlamaWeights a = brigade::model::make_synthetic_weights(tiny_config(true), 3);
  require_bad_file([&] { brigade::model::save_llama2c_checkpoint(p, a); }, {p.string()});
  CHECK_FALSE(fs::exists(p));
  CHECK_FALSE(fs::exists(dir / "missing-dir"));
}

TEST_CASE("weights.save: a failed rename removes the temporary and keeps the target") {
  TempDir dir;
  const auto p = dir / "target";
  fs::create_directories(p / "occupied");  // a non-empty directory cannot be replaced
  const LlamaWeights a = brigade::model::make_synthetic_weights(tiny_config(true), 3);
  require_bad_file([&] { brigade::model::save_llama2c_checkpoint(p, a); }, {p.string()});
  CHECK_FALSE(fs::exists(dir / "target.tmp"));
  CHECK(fs::is_directory(p / "occupied"));
}

TEST_CASE("weights.save: weights with missing layers are InvalidArgument") {
  TempDir dir;
  LlamaWeights a = brigade::model::make_synthetic_weights(tiny_config(true), 3);
  a.layers.pop_back();
  try {
    brigade::model::save_llama2c_checkpoint(dir / "x.bin", a);
    FAIL("expected brigade::Error");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::InvalidArgument);
    CHECK(std::string_view(e.what()).find("n_layers = 3") != std::string_view::npos);
  }
  CHECK_FALSE(fs::exists(dir / "x.bin.tmp"));
}

// ---- synthetic weights --------------------------------------------------------------------

TEST_CASE("weights.synthetic: same seed gives the same bytes and another seed different ones") {
  const LlamaConfig c = tiny_config(false);
  const LlamaWeights a = brigade::model::make_synthetic_weights(c, 7);
  const LlamaWeights b = brigade::model::make_synthetic_weights(c, 7);
  const LlamaWeights other = brigade::model::make_synthetic_weights(c, 8);
  check_same_tensors(a, b);
  const auto d = static_cast<std::size_t>(c.dim);
  CHECK(std::memcmp(a.layers[0].wq.f32(), other.layers[0].wq.f32(), d * d * 4) != 0);
  CHECK(std::memcmp(a.token_embedding.f32(), other.token_embedding.f32(), 40 * d * 4) != 0);
  CHECK(std::memcmp(a.wcls.f32(), other.wcls.f32(), 40 * d * 4) != 0);
  // Tensors are independent streams: wk and wv differ although they have the same shape.
  CHECK(std::memcmp(a.layers[0].wk.f32(), a.layers[0].wv.f32(), 8 * d * 4) != 0);
}

TEST_CASE("weights.synthetic: N(0, 0.02^2) with wo and w2 scaled by 1/sqrt(2 n_layers) and unit norms") {
  LlamaConfig c = tiny_config(true);
  c.dim = 128;
  c.hidden_dim = 256;
  c.n_heads = 4;
  c.n_kv_heads = 4;
  c.n_layers = 8;
  const LlamaWeights w = brigade::model::make_synthetic_weights(c, 11);
  const std::size_t n = 8 * 128 * 128;  // wq / wo are contiguous across layers
  const auto [mq, sq] = moments(w.layers[0].wq.f32(), n);
  CHECK(std::abs(mq) < 2e-4);
  CHECK(sq == rel(0.02, 0.01));
  const auto [mo, so] = moments(w.layers[0].wo.f32(), n);
  CHECK(std::abs(mo) < 1e-4);
  CHECK(so == rel(0.02 / 4.0, 0.01));
  const auto [m2, s2] = moments(w.layers[0].w2.f32(), 8 * 128 * 256);
  CHECK(std::abs(m2) < 1e-4);
  CHECK(s2 == rel(0.02 / 4.0, 0.01));
  for (const auto& layer : w.layers)
    for (int i = 0; i < c.dim; ++i) {
      CHECK(layer.rms_att[i] == 1.0f);
      CHECK(layer.rms_ffn[i] == 1.0f);
    }
  for (int i = 0; i < c.dim; ++i) CHECK(w.rms_final[i] == 1.0f);
  CHECK(w.wcls == w.token_embedding);
}

TEST_CASE("weights.synthetic: an invalid config is InvalidArgument") {
  LlamaConfig c = tiny_config(true);
  c.n_kv_heads = 3;
  CHECK_THROWS_AS((void)brigade::model::make_synthetic_weights(c, 1), Error);
  try {
    (void)brigade::model::make_synthetic_weights(c, 1);
  } catch (const Error& e) {
    CHECK(e.code() == Errc::InvalidArgument);
  }
}

TEST_CASE("weights.synthetic: the 110M config is generated with the right shape") {
  const LlamaConfig c = brigade::model::named_config("110M");
  const LlamaWeights w = brigade::model::make_synthetic_weights(c, 5);
  REQUIRE(w.layers.size() == 12);
  const std::size_t d = 768, h = 2048;
  // The last float of the last tensor is generated (the buffer is fully written).
  const float last = w.layers[11].w3.f32()[h * d - 1];
  CHECK(std::isfinite(last));
  CHECK(last != 0.0f);
  const auto [m, s] = moments(w.token_embedding.f32(), 32000 * d);
  CHECK(std::abs(m) < 1e-4);
  CHECK(s == rel(0.02, 0.01));
}
