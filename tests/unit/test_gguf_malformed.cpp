// GgufFile and load_gguf_llama on hand-built files: every malformed case of issue 14 is refused
// with a brigade::Error{BadFile} naming the field and the value seen.
#include <brigade/model/gguf.hpp>

#include "test_util.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

using namespace brigade;
namespace fs = std::filesystem;
using test::error_of;

namespace {

constexpr std::uint64_t k2p62 = std::uint64_t{1} << 62;

/// Builds GGUF bytes field by field, so a test can set any field to a hostile value.
struct Builder {
  std::uint32_t version = 3;
  std::optional<std::uint64_t> tensor_count, kv_count;  // override the true counts
  std::string meta;
  std::uint64_t n_kv = 0;
  struct Tensor {
    std::string name;
    std::vector<std::uint64_t> dims;
    std::uint32_t type = 0;
    std::optional<std::uint64_t> offset;
  };
  std::vector<Tensor> tensors;
  std::uint64_t alignment = 32;  // used to place tensors and the data section
  std::int64_t data_delta = 0;   // bytes added to (or cut from) the data section

  template <typename T>
  static void put(std::string& s, T v) {
    s.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  static void str(std::string& s, std::string_view v) {
    put<std::uint64_t>(s, v.size());
    s.append(v);
  }
  void key(std::string_view k, std::uint32_t type) {
    str(meta, k);
    put(meta, type);
    ++n_kv;
  }
  Builder& u32(std::string_view k, std::uint32_t v) {
    key(k, 4);
    put(meta, v);
    return *this;
  }
  Builder& f32(std::string_view k, float v) {
    key(k, 6);
    put(meta, v);
    return *this;
  }
  Builder& string(std::string_view k, std::string_view v) {
    key(k, 8);
    str(meta, v);
    return *this;
  }
  Builder& tensor(std::string name, std::vector<std::uint64_t> dims, std::uint32_t type = 0) {
    tensors.push_back({std::move(name), std::move(dims), type, std::nullopt});
    return *this;
  }

  static std::uint64_t bytes_of(const Tensor& t) {
    std::uint64_t n = 1;
    for (auto d : t.dims) n *= d;
    return t.type == 1 || t.type == 30 ? 2 * n : t.type == 8 ? n / 32 * 34 : 4 * n;
  }

  std::string build() const {
    std::string out = "GGUF";
    put(out, version);
    put<std::uint64_t>(out, tensor_count.value_or(tensors.size()));
    put<std::uint64_t>(out, kv_count.value_or(n_kv));
    out += meta;
    std::uint64_t at = 0, end = 0;
    for (const Tensor& t : tensors) {
      str(out, t.name);
      put<std::uint32_t>(out, static_cast<std::uint32_t>(t.dims.size()));
      for (auto d : t.dims) put(out, d);
      put(out, t.type);
      const std::uint64_t off = t.offset.value_or(at);
      put(out, off);
      const std::uint64_t b = bytes_of(t);
      at = (off + b + alignment - 1) / alignment * alignment;
      if (!t.offset) end = std::max(end, off + b);  // a test-set offset may lie anywhere
    }
    out.append((alignment - out.size() % alignment) % alignment, '\0');
    out.append(static_cast<std::size_t>(static_cast<std::int64_t>(end) + data_delta), '\0');
    return out;
  }
};

struct Files {
  test::TempDir dir{"brigade-gguf-bad"};
  int n = 0;
  fs::path write(const std::string& bytes) {
    const fs::path p = dir / fmt::format("f{}.gguf", n++);
    std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return p;
  }
  std::string open_error(const Builder& b) {
    const fs::path p = write(b.build());
    return error_of(Errc::BadFile, [&] { (void)model::GgufFile::open(p); });
  }
  std::string llama_error(const Builder& b) {
    const fs::path p = write(b.build());
    return error_of(Errc::BadFile, [&] { (void)model::load_gguf_llama(p); });
  }
};

/// A tiny valid llama file: dim 8, hidden 16, 2 heads, 2 KV heads, vocab 4, `blocks` blocks in
/// the metadata and `present` blocks of tensors.
Builder llama(std::uint32_t blocks, std::uint32_t present, std::uint32_t q_type = 0) {
  Builder b;
  b.string("general.architecture", "llama")
      .u32("llama.embedding_length", 8)
      .u32("llama.feed_forward_length", 16)
      .u32("llama.block_count", blocks)
      .u32("llama.attention.head_count", 2)
      .u32("llama.attention.head_count_kv", 2)
      .u32("llama.context_length", 16);
  b.tensor("token_embd.weight", {8, 4});
  for (std::uint32_t l = 0; l < present; ++l) {
    const std::string p = fmt::format("blk.{}.", l);
    b.tensor(p + "attn_norm.weight", {8})
        .tensor(p + "attn_q.weight", {8, 8}, q_type)
        .tensor(p + "attn_k.weight", {8, 8})
        .tensor(p + "attn_v.weight", {8, 8})
        .tensor(p + "attn_output.weight", {8, 8})
        .tensor(p + "ffn_norm.weight", {8})
        .tensor(p + "ffn_gate.weight", {8, 16})
        .tensor(p + "ffn_down.weight", {16, 8})
        .tensor(p + "ffn_up.weight", {8, 16});
  }
  b.tensor("output_norm.weight", {8});
  return b;
}

}  // namespace

TEST_CASE("gguf.valid: a hand-built file opens, and its tiny llama loads") {
  Files f;
  Builder b = llama(2, 2);
  const fs::path p = f.write(b.build());
  const model::GgufFile g = model::GgufFile::open(p);
  CHECK(g.version() == 3);
  CHECK(g.tensors().size() == 20);
  CHECK(g.get_int("llama.block_count") == 2);
  const model::LlamaWeights w = model::load_gguf_llama(g);
  CHECK(w.config.n_layers == 2);
  CHECK(w.config.vocab_size == 4);
  CHECK(w.config.shared_classifier);
  // Version 2 has the same layout.
  b.version = 2;
  CHECK(model::GgufFile::open(f.write(b.build())).version() == 2);
}

TEST_CASE("gguf.malformed: header (size, magic, version, counts of 2^62)") {
  Files f;
  CHECK(error_of(Errc::BadFile, [&] { (void)model::GgufFile::open(f.write("GGUF\3\0\0\0")); })
            .find("shorter than the GGUF header (magic, version, tensor count, metadata count) (24 bytes)") != std::string::npos);
  CHECK(error_of(Errc::BadFile, [&] { (void)model::GgufFile::open(f.dir / "missing.gguf"); })
            .find("GGUF file not found") != std::string::npos);
  CHECK(error_of(Errc::BadFile, [&] { (void)model::GgufFile::open(f.dir.path); })
            .find("is a directory") != std::string::npos);
  std::string bad = Builder{}.build();
  bad[0] = 'X';
  CHECK(error_of(Errc::BadFile, [&] { (void)model::GgufFile::open(f.write(bad)); })
            .find("starts with 'XGUF', not the GGUF magic") != std::string::npos);
  Builder v;
  v.version = 99;
  CHECK(f.open_error(v).find("GGUF version 99, expected 2 or 3") != std::string::npos);
  v.version = 1;
  CHECK(f.open_error(v).find("version 1 is the pre-2023 layout") != std::string::npos);
  v.version = 0x03000000;
  CHECK(f.open_error(v).find("big-endian") != std::string::npos);
  Builder t;
  t.tensor_count = k2p62;
  CHECK(f.open_error(t).find("tensor count 4611686018427387904") != std::string::npos);
  Builder k;
  k.kv_count = k2p62;
  CHECK(f.open_error(k).find("metadata key/value count 4611686018427387904") != std::string::npos);
  Builder k1;  // a file cut inside the second key's value
  k1.u32("a", 1).u32("b", 2);
  const std::string cut = k1.build().substr(0, 56);
  CHECK(error_of(Errc::BadFile, [&] { (void)model::GgufFile::open(f.write(cut)); })
            .find("metadata key 'b' (uint32) needs 4 bytes at offset 54, but the file ends 2 "
                  "bytes later") != std::string::npos);
}

TEST_CASE("gguf.malformed: metadata (string lengths past the end, unknown types, nesting, "
          "duplicates, arrays of 2^62)") {
  Files f;
  {  // a key whose length runs past the end
    Builder b;
    b.kv_count = 1;
    Builder::put<std::uint64_t>(b.meta, 1000);
    b.meta += "abc";
    CHECK(f.open_error(b).find("metadata key 0 has length 1000 at offset 24, past the end") !=
          std::string::npos);
  }
  {  // a string value whose length runs past the end
    Builder b;
    b.key("general.name", 8);
    Builder::put<std::uint64_t>(b.meta, k2p62);
    CHECK(f.open_error(b).find("metadata key 'general.name' (string) has length 4611686018427387904") !=
          std::string::npos);
  }
  {  // an unknown value type
    Builder b;
    b.key("x.y", 13);
    Builder::put<std::uint32_t>(b.meta, 0);
    CHECK(f.open_error(b).find("metadata key 'x.y' has value type 13") != std::string::npos);
  }
  {  // an array of an unknown element type
    Builder b;
    b.key("x.arr", 9);
    Builder::put<std::uint32_t>(b.meta, 77);
    Builder::put<std::uint64_t>(b.meta, 1);
    CHECK(f.open_error(b).find("metadata key 'x.arr' is an array of value type 77") !=
          std::string::npos);
  }
  {  // an array of 2^62 uint32 and of 2^62 strings
    for (std::uint32_t et : {4u, 8u}) {
      Builder b;
      b.key("x.big", 9);
      Builder::put<std::uint32_t>(b.meta, et);
      Builder::put<std::uint64_t>(b.meta, k2p62);
      CHECK(f.open_error(b).find("metadata key 'x.big' is an array of 4611686018427387904") !=
            std::string::npos);
    }
  }
  {  // arrays nested 10,000 deep
    Builder b;
    b.key("x.deep", 9);
    for (int i = 0; i < 10000; ++i) {
      Builder::put<std::uint32_t>(b.meta, 9);
      Builder::put<std::uint64_t>(b.meta, 1);
    }
    Builder::put<std::uint32_t>(b.meta, 0);
    Builder::put<std::uint64_t>(b.meta, 0);
    CHECK(f.open_error(b).find("metadata key 'x.deep' nests arrays 9 deep") != std::string::npos);
  }
  {  // nesting within the limit is read: [[1, 2], [3]]
    Builder b;
    b.key("x.nested", 9);
    Builder::put<std::uint32_t>(b.meta, 9);
    Builder::put<std::uint64_t>(b.meta, 2);
    Builder::put<std::uint32_t>(b.meta, 0);
    Builder::put<std::uint64_t>(b.meta, 2);
    b.meta += "\1\2";
    Builder::put<std::uint32_t>(b.meta, 0);
    Builder::put<std::uint64_t>(b.meta, 1);
    b.meta += "\3";
    const model::GgufFile g = model::GgufFile::open(f.write(b.build()));
    const model::GgufValue* v = g.find("x.nested");
    REQUIRE(v != nullptr);
    REQUIRE(v->arrays.size() == 2);
    CHECK(v->arrays[0].count == 2);
    CHECK(std::to_integer<int>(v->arrays[1].elements[0]) == 3);
  }
  {  // a key twice
    Builder b;
    b.u32("a.b", 1).u32("a.b", 2);
    CHECK(f.open_error(b).find("metadata key 'a.b' appears twice") != std::string::npos);
  }
  {  // a bool that is not 0 or 1
    Builder b;
    b.key("a.flag", 7);
    b.meta += '\x07';
    CHECK(f.open_error(b).find("metadata key 'a.flag' is a bool of value 7") != std::string::npos);
  }
}

TEST_CASE("gguf.malformed: general.alignment 0, not a power of two, or not a uint32") {
  Files f;
  for (std::uint32_t a : {0u, 48u, 3u}) {
    Builder b;
    b.u32("general.alignment", a);
    CHECK(f.open_error(b).find(fmt::format("'general.alignment' = {}, expected a power of two", a)) !=
          std::string::npos);
  }
  Builder s;
  s.string("general.alignment", "32");
  CHECK(f.open_error(s).find("'general.alignment' is string, expected uint32") != std::string::npos);
}

TEST_CASE("gguf.malformed: tensor infos (types, dimensions, overflow, duplicates, offsets, "
          "overlaps, data past the end)") {
  Files f;
  {
    Builder b;
    b.tensor("blk.0.attn_q.weight", {256, 4}, 12);
    CHECK(f.open_error(b).find("tensor blk.0.attn_q.weight has ggml type q4_K (12), which brigade "
                               "does not read") != std::string::npos);
  }
  {
    Builder b;
    b.tensor("t", {4}, 99);
    CHECK(f.open_error(b).find("tensor t has ggml type unknown (99)") != std::string::npos);
  }
  {
    Builder b;
    b.tensor("t", {1, 1, 1, 1, 1});
    CHECK(f.open_error(b).find("tensor t has 5 dimensions, expected 1 to 4") != std::string::npos);
    Builder z;
    z.tensor("t", {4, 0});
    CHECK(f.open_error(z).find("tensor t has dimension 1 = 0") != std::string::npos);
  }
  {  // a shape whose element count overflows 64 bits
    Builder b;
    b.tensor("t", {std::uint64_t{1} << 32, std::uint64_t{1} << 32});
    CHECK(f.open_error(b).find("tensor t has a shape whose element count overflows 64 bits (dimension 1 = 4294967296)") !=
          std::string::npos);
  }
  {
    Builder b;
    b.tensor("t", {33}, 8);
    CHECK(f.open_error(b).find("tensor t of type q8_0 has rows of 33 elements") != std::string::npos);
  }
  {
    Builder b;
    b.tensor("t", {4}).tensor("t", {4});
    CHECK(f.open_error(b).find("tensor t appears twice (tensors 0 and 1)") != std::string::npos);
  }
  {
    Builder b;
    b.tensor("a", {4}).tensor("b", {4});
    b.tensors[1].offset = 16;
    CHECK(f.open_error(b).find("tensor b has data offset 16, expected a multiple of the alignment 32") !=
          std::string::npos);
  }
  {
    Builder b;
    b.tensor("a", {16}).tensor("b", {16});
    b.tensors[1].offset = 32;  // a is 64 bytes at 0
    b.data_delta = 64;
    CHECK(f.open_error(b).find("tensors a (data offset 0, 64 bytes) and b (data offset 32) overlap") !=
          std::string::npos);
  }
  {
    Builder b;
    b.tensor("a", {16});
    b.data_delta = -4;
    CHECK(f.open_error(b).find("tensor a (f32, 16 elements, 64 bytes at data offset 0) runs past the end") !=
          std::string::npos);
    b.tensors[0].offset = k2p62;
    b.data_delta = 0;
    CHECK(f.open_error(b).find("at data offset 4611686018427387904) runs past the end") !=
          std::string::npos);
  }
  {  // a tensor name past the end of the file
    Builder b;
    b.tensor_count = 1;
    b.meta.clear();
    std::string bytes = b.build();
    bytes.resize(24);
    Builder::put<std::uint64_t>(bytes, 999);
    bytes += std::string(40, 'n');
    CHECK(error_of(Errc::BadFile, [&] { (void)model::GgufFile::open(f.write(bytes)); })
              .find("the name of tensor 0 has length 999") != std::string::npos);
  }
}

TEST_CASE("gguf.llama: block count vs tensors, missing and extra tensors, shapes, dtypes, RoPE "
          "scaling") {
  Files f;
  CHECK(f.llama_error(llama(1, 2)).find(
            "tensor blk.1.attn_norm.weight belongs to block 1, but metadata key "
            "'llama.block_count' = 1") != std::string::npos);
  // A block count of 2^31-1 with 2 blocks present is refused before anything is sized by it
  // (a fuzzer finding: the loader used to allocate a flag per block and tensor).
  CHECK(f.llama_error(llama(2147483647u, 2)).find(
            "metadata key 'llama.block_count' = 2147483647, but the file holds 20 tensors (each "
            "block has 9)") != std::string::npos);
  CHECK(f.llama_error(llama(3, 2)).find(
            "metadata key 'llama.block_count' = 3, but the file holds 20 tensors") !=
        std::string::npos);
  Builder missing = llama(2, 2);
  missing.tensors.erase(missing.tensors.begin() + 18);  // blk.1.ffn_up
  CHECK(f.llama_error(missing).find(
            "tensor blk.1.ffn_up.weight is missing (metadata key 'llama.block_count' = 2)") !=
        std::string::npos);
  Builder extra = llama(1, 1);
  extra.tensor("rope_freqs.weight", {4});
  CHECK(f.llama_error(extra).find("tensor rope_freqs.weight is not one brigade uses") !=
        std::string::npos);
  Builder odd = llama(1, 1);
  odd.tensor("blk.0.attn_qq.weight", {8, 8});
  CHECK(f.llama_error(odd).find("tensor blk.0.attn_qq.weight is not one of a llama block's") !=
        std::string::npos);
  Builder shape = llama(1, 1);
  shape.tensors[2].dims = {8, 4};  // blk.0.attn_q
  CHECK(f.llama_error(shape).find("tensor blk.0.attn_q.weight has shape [8, 4], expected [8, 8]") !=
        std::string::npos);
  // Matrices stay in their dtype (f16 here: read by the kernels); norm gains must be f32, and a
  // q8_0 matrix needs whole blocks per row (8 columns are not).
  const model::LlamaWeights typed = model::load_gguf_llama(f.write(llama(1, 1, 1).build()));
  CHECK(typed.layers[0].wq.dtype == DType::F16);
  CHECK(typed.layers[0].wk.dtype == DType::F32);
  Builder half_gain = llama(1, 1);
  half_gain.tensors[1].type = 1;  // blk.0.attn_norm
  CHECK(f.llama_error(half_gain).find("tensor blk.0.attn_norm.weight is f16; norm gains must be "
                                      "f32") != std::string::npos);
  // The message is computed before the check: an INFO must not hold an expression that runs
  // assertions itself (doctest evaluates it while logging an assertion, under its reporter's
  // lock, and deadlocked on the first logged assertion with -s).
  const std::string partial_blocks = f.llama_error(llama(1, 1, 8));
  CHECK(partial_blocks.find("blk.0.attn_q.weight") != std::string::npos);
  Builder scaled = llama(1, 1);
  scaled.string("llama.rope.scaling.type", "linear");
  CHECK(f.llama_error(scaled).find("metadata key 'llama.rope.scaling.type' is set") !=
        std::string::npos);
  Builder other = llama(1, 1);
  other.meta.clear();
  other.n_kv = 0;
  other.string("general.architecture", "gpt2");
  CHECK(f.llama_error(other).find("'general.architecture' = 'gpt2', expected 'llama'") !=
        std::string::npos);
  Builder no_heads = llama(1, 1);
  no_heads.meta.clear();
  no_heads.n_kv = 0;
  no_heads.string("general.architecture", "llama").u32("llama.embedding_length", 8);
  CHECK(f.llama_error(no_heads).find("metadata key 'llama.feed_forward_length' is missing") !=
        std::string::npos);
  Builder zero = llama(0, 0);
  CHECK(f.llama_error(zero).find("metadata key 'llama.block_count' = 0, expected 1 to") !=
        std::string::npos);
  Builder heads = llama(1, 1);
  heads.u32("llama.rope.dimension_count", 2);
  CHECK(f.llama_error(heads).find("'llama.rope.dimension_count' = 2, expected the head size 4") !=
        std::string::npos);
}
