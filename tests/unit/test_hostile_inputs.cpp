// Files and values a user (or an attacker) hands brigade: non-finite numbers, other formats,
// non-regular and oversized files, duplicate tokenizer pieces, hostile tokens. Each case checks
// the exact words of the error (issue 9).
#include "brigade/core/error.hpp"
#include "brigade/core/finite.hpp"
#include "brigade/data/corpus.hpp"
#include "brigade/io/input.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/tokenizer.hpp"
#include "brigade/model/weights.hpp"
#include "brigade/schedule/action.hpp"

#include <doctest/doctest.h>

#include "test_util.hpp"
#include <sys/stat.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using brigade::Errc;
using brigade::Error;
using brigade::model::LlamaWeights;
using brigade::model::Tokenizer;
using brigade::test::error_of;

namespace {

struct TempDir : brigade::test::TempDir {
  TempDir() : brigade::test::TempDir("brigade-hostile") {}
};

void write_bytes(const fs::path& p, std::string_view bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}


/// A small synthetic model (dim 16, 2 layers, vocab 32, separate classifier when `shared` is
/// false) saved to `path`.
LlamaWeights small_model(const fs::path& path, bool shared) {
  brigade::model::LlamaConfig c;
  c.dim = 16;
  c.hidden_dim = 24;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 32;
  c.seq_len = 8;
  c.shared_classifier = shared;
  auto w = brigade::model::make_synthetic_weights(c, 7);
  brigade::model::save_llama2c_checkpoint(path, w);
  return w;
}

/// Overwrites the float at `float_index` (counted from the end of the 28-byte header).
void poke_float(const fs::path& p, std::uint64_t float_index, float v) {
  std::fstream f(p, std::ios::binary | std::ios::in | std::ios::out);
  f.seekp(static_cast<std::streamoff>(28 + 4 * float_index));
  f.write(reinterpret_cast<const char*>(&v), 4);
  REQUIRE(f.good());
}

/// llama2.c tokenizer bytes for (score, piece) entries.
std::string tokenizer_bytes(const std::vector<std::pair<float, std::string>>& entries,
                            std::uint32_t max_len) {
  std::string out(4, '\0');
  std::memcpy(out.data(), &max_len, 4);
  for (const auto& [score, piece] : entries) {
    const auto len = static_cast<std::int32_t>(piece.size());
    out.append(reinterpret_cast<const char*>(&score), 4);
    out.append(reinterpret_cast<const char*>(&len), 4);
    out += piece;
  }
  return out;
}

}  // namespace

// ---- kind 1: non-finite numbers ----------------------------------------------------------

TEST_CASE("hostile.nonfinite: a NaN weight is refused at load naming tensor, layer and element") {
  TempDir dir;
  const auto p = dir / "nan.bin";
  (void)small_model(p, true);
  // rms_att of decoder 1, element 5: after the embedding (32 x 16) and decoder 0's 16 gains.
  poke_float(p, 32 * 16 + 16 + 5, std::nanf(""));
  CHECK(error_of(Errc::BadFile, [&] { (void)brigade::model::load_llama2c_checkpoint(p); }) ==
        p.string() + ": tensor rms_att of decoder layer 1 (layers count from 0), element 5 is "
                     "nan: a checkpoint's weights must be finite");
}

TEST_CASE("hostile.nonfinite: an infinity in a matrix names its row and column, wcls is checked") {
  TempDir dir;
  const auto p = dir / "inf.bin";
  (void)small_model(p, true);
  // token_embedding row 3, column 7.
  poke_float(p, 3 * 16 + 7, -std::numeric_limits<float>::infinity());
  CHECK(error_of(Errc::BadFile, [&] { (void)brigade::model::load_llama2c_checkpoint(p); }) ==
        p.string() + ": tensor token_embedding, element 55 (row 3, column 7) is -inf: a "
                     "checkpoint's weights must be finite");
  // A separate classifier is the file's last tensor.
  const auto q = dir / "wcls.bin";
  (void)small_model(q, false);
  const auto floats = (fs::file_size(q) - 28) / 4;
  poke_float(q, floats - 1, std::numeric_limits<float>::infinity());
  CHECK(error_of(Errc::BadFile, [&] { (void)brigade::model::load_llama2c_checkpoint(q); }) ==
        q.string() + ": tensor wcls, element 511 (row 31, column 15) is inf: a checkpoint's "
                     "weights must be finite");
}

TEST_CASE("hostile.nonfinite: saving weights with a NaN writes nothing") {
  TempDir dir;
  auto w = small_model(dir / "a.bin", true);
  const_cast<float*>(w.layers[0].w2.f32())[24 + 2] = std::nanf("");  // row 1, column 2 of [16 x 24]
  const auto out = dir / "b.bin";
  CHECK(error_of(Errc::InvalidArgument, [&] { brigade::model::save_llama2c_checkpoint(out, w); }) ==
        "save_llama2c_checkpoint(" + out.string() +
            "): tensor w2 of decoder layer 0 (layers count from 0), element 26 (row 1, column 2) "
            "is nan: a checkpoint's weights must be finite");
  CHECK_FALSE(fs::exists(out));
  CHECK_FALSE(fs::exists(out.string() + ".tmp"));
}

TEST_CASE("hostile.nonfinite: a tokenizer merge score of NaN is refused naming the token") {
  TempDir dir;
  const auto p = dir / "tok.bin";
  write_bytes(p, tokenizer_bytes({{0, "<unk>"}, {0, "\n<s>\n"}, {std::nanf(""), "ab"}}, 8));
  CHECK(error_of(Errc::BadFile, [&] { (void)Tokenizer::load_llama2c(p, 3); }) ==
        p.string() + ": token 2 has merge score nan at offset 30, expected a finite number (BPE "
                     "merges compare scores)");
}

TEST_CASE("hostile.nonfinite: first_non_finite finds the first bad element in any block") {
  std::vector<float> x(5000, 1.0f);
  CHECK(brigade::first_non_finite(x.data(), x.size()) == 5000);
  x[4321] = std::numeric_limits<float>::infinity();
  x[4999] = std::nanf("");
  CHECK(brigade::first_non_finite(x.data(), x.size()) == 4321);
  x[17] = -std::numeric_limits<float>::infinity();
  CHECK(brigade::first_non_finite(x.data(), x.size()) == 17);
  x[17] = std::numeric_limits<float>::max();  // finite
  CHECK(brigade::first_non_finite(x.data(), x.size()) == 4321);
  CHECK(brigade::first_non_finite(x.data(), 0) == 0);
}

// ---- kind 6: hostile files ----------------------------------------------------------------

TEST_CASE("hostile.files: another format's magic is named, for --model and --tokenizer alike") {
  TempDir dir;
  struct Case {
    std::string bytes, name;
  };
  std::string st(8, '\0');
  const std::uint64_t hlen = 30;
  std::memcpy(st.data(), &hlen, 8);
  st += R"({"w":{"dtype":"F32"}}      )";
  const std::vector<Case> cases = {
      {std::string("GGUF\x03\0\0\0", 8) + std::string(40, '\0'), "a GGUF file (llama.cpp)"},
      {st + std::string(40, '\0'), "a safetensors file"},
      {std::string("PK\x03\x04", 4) + std::string(40, 'x'),
       "a zip archive (PyTorch .pt/.pth checkpoints are zip archives)"},
      {std::string("\x80\x02\x8a\x0a", 4) + std::string(40, 'x'),
       "a Python pickle (an older PyTorch checkpoint)"},
      {std::string("\x7f" "ELF\x02\x01\x01", 7) + std::string(40, '\0'),
       "an ELF executable or library"},
  };
  for (const auto& c : cases) {
    const auto p = dir / "file";
    write_bytes(p, c.bytes);
    CHECK(error_of(Errc::BadFile, [&] { (void)brigade::model::load_llama2c_checkpoint(p); }) ==
          p.string() + ": is " + c.name +
              ", not a llama2.c checkpoint (brigade reads llama2.c .bin checkpoints; llama2.c's "
              "export.py writes them)");
    CHECK(error_of(Errc::BadFile, [&] { (void)Tokenizer::load_llama2c(p, 512); }) ==
          p.string() + ": is " + c.name +
              ", not a llama2.c tokenizer (brigade reads llama2.c tokenizer.bin files; "
              "llama2.c's tokenizer.py writes them)");
  }
}

TEST_CASE("hostile.files: a model and a tokenizer given in each other's place are named") {
  TempDir dir;
  const auto model = dir / "model.bin";
  (void)small_model(model, true);
  CHECK(error_of(Errc::BadFile, [&] { (void)Tokenizer::load_llama2c(model, 32); }) ==
        model.string() +
            ": is a llama2.c model checkpoint, not a tokenizer (were --model and --tokenizer "
            "swapped?)");
  const auto tok = dir / "tok.bin";
  write_bytes(tok, tokenizer_bytes({{0, "<unk>"}, {0, "\n<s>\n"}, {0, "\n</s>\n"}, {-1, "ab"}}, 7));
  CHECK(error_of(Errc::BadFile, [&] { (void)brigade::model::load_llama2c_checkpoint(tok); }) ==
        tok.string() +
            ": is a llama2.c tokenizer, not a model checkpoint (were --model and --tokenizer "
            "swapped?)");
  CHECK(brigade::model::is_llama2c_checkpoint(model));
  CHECK_FALSE(brigade::model::is_llama2c_checkpoint(tok));
}

TEST_CASE("hostile.files: a directory, a FIFO and /dev/zero are refused by kind, without reading") {
  TempDir dir;
  const auto fifo = dir / "fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const std::string d = dir.path.string();
  CHECK(error_of(Errc::BadFile, [&] { (void)brigade::model::load_llama2c_checkpoint(dir.path); }) ==
        d + ": is a directory, not a regular file (expected a llama2.c checkpoint)");
  CHECK(error_of(Errc::BadFile, [&] { (void)brigade::model::load_llama2c_checkpoint(fifo); }) ==
        fifo.string() + ": is a FIFO (named pipe), not a regular file (expected a llama2.c "
                        "checkpoint)");
  CHECK(error_of(Errc::BadFile, [&] { (void)Tokenizer::load_llama2c("/dev/zero", 512); }) ==
        "/dev/zero: is a character device, not a regular file (expected a tokenizer file)");
  CHECK(error_of(Errc::BadFile, [&] { (void)Tokenizer::load_llama2c(fifo, 512); }) ==
        fifo.string() + ": is a FIFO (named pipe), not a regular file (expected a tokenizer file)");
  CHECK(error_of(Errc::BadFile, [&] {
          (void)brigade::io::read_input_file("/dev/zero", "schedule file",
                                             brigade::io::kMaxScheduleFileBytes);
        }) == "/dev/zero: is a character device, not a regular file (expected a schedule file)");
  CHECK(error_of(Errc::BadFile, [&] {
          (void)brigade::io::read_input_file(dir / "missing", "prompt file", 100);
        }) == (dir / "missing").string() + ": prompt file not found (no such file)");
}

TEST_CASE("hostile.files: a file over its kind's limit is refused by size before it is read") {
  TempDir dir;
  const auto p = dir / "big.txt";
  write_bytes(p, std::string(1001, 'a'));
  CHECK(error_of(Errc::BadFile, [&] {
          (void)brigade::io::read_input_file(p, "schedule file", 1000);
        }) == p.string() + ": the schedule file is 1001 bytes, more than the limit of 1000 bytes");
  CHECK(brigade::io::read_input_file(p, "schedule file", 1001).size() == 1001);
  CHECK(brigade::io::kMaxScheduleFileBytes == 64u << 20);
}

TEST_CASE("hostile.files: two ids holding one piece are refused naming the piece and both ids") {
  TempDir dir;
  const auto p = dir / "dup.bin";
  write_bytes(p, tokenizer_bytes({{0, "<unk>"}, {0, "\n<s>\n"}, {0, "\n</s>\n"}, {-1, " the"},
                                  {-2, "x"}, {-3, " the"}},
                                 8));
  CHECK(error_of(Errc::BadFile, [&] { (void)Tokenizer::load_llama2c(p, 6); }) ==
        p.string() + ": tokens 3 and 5 hold the same piece ' the' (4 bytes); each piece must have "
                     "one id, or encoding is ambiguous (tokenizer.bin files exported before "
                     "llama2.c kept byte tokens as \"<0xXX>\" repeat pieces this way)");
}

TEST_CASE("hostile.files: a 5 MB token is quoted as a 32-byte excerpt, control bytes escaped") {
  const std::string token(5'000'000, 'X');
  const std::string text = "shape ranks=1 microbatches=1\nrank 0: " + token + "\n";
  const std::string msg = error_of(Errc::InvalidArgument,
                                   [&] { (void)brigade::schedule::parse_schedule(text); });
  CHECK(msg == "schedule text, line 2, column 9: action '" + std::string(32, 'X') +
                   "... (5000000 bytes)': expected a virtual-stage number (0..2^31-1) at the start");
  CHECK(brigade::detail::excerpt(std::string("0F\x01\n\\", 5)) == "0F\\x01\\x0A\\x5C");
  const std::string shape = "shape ranks=1 microbatches=1 mode=" + std::string(100, 'q');
  CHECK(error_of(Errc::InvalidArgument, [&] { (void)brigade::schedule::parse_schedule(shape); }) ==
        "schedule text, line 1, column 35: mode='" + std::string(32, 'q') +
            "... (100 bytes)', expected training or inference");
}

// ---- kind 2: training data that is not text -----------------------------------------------

TEST_CASE("hostile.corpus: binary files, model files and devices are not trained on") {
  TempDir dir;
  const auto tok = Tokenizer::synthetic(300, 1);
  const auto bin = dir / "data.bin";
  write_bytes(bin, std::string("hello\0world", 11));
  CHECK(error_of(Errc::BadFile, [&] { (void)brigade::data::load_corpus(bin, tok, 64); }) ==
        bin.string() + ": is a binary file, not text (a NUL byte at offset 5; training data must "
                       "be UTF-8 text)");
  const auto model = dir / "model.bin";
  (void)small_model(model, true);
  CHECK(error_of(Errc::BadFile, [&] { (void)brigade::data::load_corpus(model, tok, 64); }) ==
        model.string() + ": is a llama2.c model checkpoint, not text (training data must be UTF-8 "
                         "text; the model goes to --model)");
  CHECK(error_of(Errc::BadFile, [&] { (void)brigade::data::load_corpus("/dev/zero", tok, 64); }) ==
        "/dev/zero: is a character device, not a regular file (expected a text file)");
}

TEST_CASE("hostile.corpus: samples cut to max_tokens are counted, never silent") {
  TempDir dir;
  const auto tok = Tokenizer::synthetic(300, 1);
  const auto txt = dir / "t.txt";
  write_bytes(txt, "a b c d e f g h\n\nab\n");  // 17 and 4 tokens with BOS and the dummy prefix
  const auto c = brigade::data::load_corpus(txt, tok, 5);
  REQUIRE(c.samples.size() == 2);
  const auto full0 = tok.encode("a b c d e f g h", true, false).size();
  const auto full1 = tok.encode("ab", true, false).size();
  const auto cut = static_cast<std::int64_t>(std::max<std::size_t>(full0, 5) - 5 +
                                             std::max<std::size_t>(full1, 5) - 5);
  CHECK(c.truncated_samples == (full0 > 5) + (full1 > 5));
  CHECK(c.truncated_tokens == cut);
  CHECK(c.samples[0].tokens.size() == 5);
}
