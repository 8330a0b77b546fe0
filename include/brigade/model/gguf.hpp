// GGUF, llama.cpp's model file (versions 2 and 3): a checked reader over a read-only mmap that
// copies no tensor data, the Llama-architecture mapping to LlamaConfig / LlamaWeights, the
// tokenizer from GGUF metadata, and a GGUF v3 writer for llama2.c models. The byte layout, every
// check and every refusal are in docs/formats.md ("GGUF").
//
// Source: the GGUF specification (ggml/docs/gguf.md in ggml-org/ggml): header "GGUF", uint32
// version, uint64 tensor_count, uint64 metadata_kv_count; key/value pairs; tensor infos; the data
// section at the next multiple of general.alignment (default 32).
#pragma once

#include "brigade/core/dtype.hpp"
#include "brigade/model/tokenizer.hpp"
#include "brigade/model/weights.hpp"

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace brigade::model {
inline namespace v0 {

/// GGUF metadata value types, numbered as the specification's gguf_metadata_value_type.
enum class GgufValueType : std::uint32_t {
  U8 = 0,
  I8 = 1,
  U16 = 2,
  I16 = 3,
  U32 = 4,
  I32 = 5,
  F32 = 6,
  Bool = 7,
  String = 8,
  Array = 9,
  U64 = 10,
  I64 = 11,
  F64 = 12,
};

/// Name of a value type as the specification spells it ("uint32", "string", "array", ...);
/// "unknown" for a number outside 0..12.
std::string_view to_string(GgufValueType t) noexcept;

/// One metadata value. Scalars are decoded; strings and numeric array elements stay in the
/// mapping (views into it, valid while the GgufFile's storage lives).
struct GgufValue {
  GgufValueType type = GgufValueType::U8;
  /// Integer types and Bool: the value (signed types sign-extended, stored two's complement).
  std::uint64_t bits = 0;
  /// F32 and F64: the value.
  double number = 0.0;
  /// String: the bytes (UTF-8 by the specification; not validated).
  std::string_view string;
  /// Array: the element type and the number of elements.
  GgufValueType element_type = GgufValueType::U8;
  std::uint64_t count = 0;
  /// Array of a numeric or Bool type: `count` packed little-endian elements in the mapping.
  const std::byte* elements = nullptr;
  /// Array of String: the `count` strings.
  std::vector<std::string_view> strings;
  /// Array of Array: the `count` nested arrays.
  std::vector<GgufValue> arrays;
};

/// One tensor of a GGUF file. ggml's shape order: shape[0] is the innermost (contiguous)
/// dimension, so a matrix `out x in` (row-major, brigade's and llama2.c's layout) has
/// shape {in, out}.
struct GgufTensor {
  std::string name;
  std::uint32_t ggml_type = 0;        ///< ggml_type number (F32 = 0, F16 = 1, Q8_0 = 8, BF16 = 30)
  DType dtype = DType::F32;           ///< the same type as a brigade DType
  std::vector<std::int64_t> shape;    ///< 1 to 4 dimensions, each >= 1, innermost first
  std::int64_t elements = 0;          ///< product of shape
  std::uint64_t offset = 0;           ///< bytes from the start of the data section
  std::uint64_t bytes = 0;            ///< elements / dtype_block_elements * dtype_block_bytes
  const std::byte* data = nullptr;    ///< into the mapping
};

/// A GGUF file opened for reading: the header, metadata and tensor table, checked in full
/// before anything is returned; tensor data are views into a read-only mmap (nothing copied).
/// Copies share the mapping.
class GgufFile {
 public:
  /// Largest nesting of arrays in arrays accepted (the specification sets none; llama.cpp
  /// reads none).
  static constexpr int kMaxArrayDepth = 8;
  /// Default general.alignment (bytes) of the data section and of each tensor's offset.
  static constexpr std::uint64_t kDefaultAlignment = 32;

  /// Maps and checks `path`. Every count, string length, array depth, value and tensor type,
  /// dimension count (1..4), dimension (>= 1), element count, shape product (64-bit overflow
  /// checked), offset and alignment is checked against the file size in 64-bit arithmetic
  /// before it is used.
  /// @throws brigade::Error{BadFile} naming the file, the field (the metadata key or tensor
  ///         name) and the value seen vs expected: file missing / not a regular file / shorter
  ///         than the 24-byte header; magic not "GGUF" (io::foreign_format names other formats);
  ///         version not 2 or 3 (1 is the pre-2023 layout; a big-endian file reads as a byte-
  ///         swapped version); a count, string or array running past the end of the file; an
  ///         unknown value type; arrays nested deeper than kMaxArrayDepth; a duplicate key;
  ///         general.alignment not a uint32, 0 or not a power of two; an unknown ggml tensor
  ///         type or one brigade does not read (named: "q4_K (12)"); a Q8_0 row not a multiple
  ///         of 32; a duplicate tensor name; an offset not a multiple of the alignment; tensors
  ///         that overlap; data past the end of the file
  static GgufFile open(const std::filesystem::path& path);

  [[nodiscard]] const std::filesystem::path& path() const noexcept;
  [[nodiscard]] std::uint32_t version() const noexcept;
  /// general.alignment, or kDefaultAlignment (bytes).
  [[nodiscard]] std::uint64_t alignment() const noexcept;
  /// Byte offset of the data section in the file.
  [[nodiscard]] std::uint64_t data_offset() const noexcept;
  /// Size of the file in bytes.
  [[nodiscard]] std::uint64_t file_bytes() const noexcept;
  /// Keeps the mapping alive (for LlamaWeights::storage).
  [[nodiscard]] std::shared_ptr<const void> storage() const noexcept;

  /// Metadata keys in file order.
  [[nodiscard]] const std::vector<std::string>& keys() const noexcept;
  /// The value of `key`, or nullptr.
  [[nodiscard]] const GgufValue* find(std::string_view key) const noexcept;
  /// Integer value of `key` (any integer type).
  /// @throws brigade::Error{BadFile} naming the key when absent, not an integer type, or a
  ///         uint64 above INT64_MAX
  [[nodiscard]] std::int64_t get_int(std::string_view key) const;
  /// Floating-point value of `key` (float32 or float64).
  /// @throws brigade::Error{BadFile} naming the key when absent or of another type
  [[nodiscard]] double get_float(std::string_view key) const;
  /// @throws brigade::Error{BadFile} naming the key when absent or not a bool
  [[nodiscard]] bool get_bool(std::string_view key) const;
  /// @throws brigade::Error{BadFile} naming the key when absent or not a string
  [[nodiscard]] std::string_view get_string(std::string_view key) const;
  /// Elements of an array of strings.
  /// @throws brigade::Error{BadFile} naming the key when absent or not an array of strings
  [[nodiscard]] const std::vector<std::string_view>& get_strings(std::string_view key) const;
  /// Elements of an array of float32 or float64, as float.
  /// @throws brigade::Error{BadFile} naming the key when absent or of another type
  [[nodiscard]] std::vector<float> get_floats(std::string_view key) const;
  /// Elements of an array of any integer type, as int64.
  /// @throws brigade::Error{BadFile} naming the key when absent, of another type, or holding
  ///         a uint64 above INT64_MAX
  [[nodiscard]] std::vector<std::int64_t> get_ints(std::string_view key) const;

  /// Tensors in file order.
  [[nodiscard]] const std::vector<GgufTensor>& tensors() const noexcept;
  /// The tensor named `name`, or nullptr.
  [[nodiscard]] const GgufTensor* find_tensor(std::string_view name) const noexcept;

  GgufFile(const GgufFile&);
  GgufFile& operator=(const GgufFile&);
  GgufFile(GgufFile&&) noexcept;
  GgufFile& operator=(GgufFile&&) noexcept;
  ~GgufFile();

 private:
  struct Impl;
  GgufFile();
  std::shared_ptr<const Impl> impl_;
};

/// Name of ggml tensor type `type` as llama.cpp spells it ("f32", "q4_K", "bf16", ...), or
/// "unknown".
std::string_view ggml_type_name(std::uint32_t type) noexcept;

/// The Llama model of a GGUF file (general.architecture "llama"). Config: dim =
/// llama.embedding_length, hidden_dim = llama.feed_forward_length, n_layers = llama.block_count,
/// n_heads = llama.attention.head_count, n_kv_heads = llama.attention.head_count_kv (default
/// n_heads), seq_len = llama.context_length, rope_theta = llama.rope.freq_base (default 10000),
/// norm_eps = llama.attention.layer_norm_rms_epsilon (default 1e-5), vocab_size = rows of
/// token_embd.weight, shared_classifier = output.weight absent. Tensors token_embd,
/// blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_down, ffn_up},
/// output_norm, output (".weight" each) are views into the mapping (`storage` owns it,
/// `mapped` is true). llama.cpp's GGUF files keep Q and K in Meta's interleaved order, the
/// adjacent-pair RoPE brigade computes, so nothing is permuted (docs/formats.md).
/// @throws brigade::Error{BadFile} naming the file and the key or tensor: another architecture;
///         a missing, mistyped or out-of-range key; llama.rope.dimension_count != head size;
///         RoPE scaling (llama.rope.scaling.type other than "none"); a missing tensor, one of
///         another shape (seen vs expected), a tensor brigade does not use (e.g. rope_freqs),
///         a blk.N tensor with N >= block_count; a weight whose dtype brigade cannot use
///         (matrices are bound in their dtype if f32, f16, bf16 or q8_0; norm gains must be
///         f32); a NaN or infinite weight; a config failing
///         LlamaConfig::validate; vocabulary sizes that disagree (llama.vocab_size,
///         tokenizer.ggml.tokens, token_embd, output)
///
/// With options.defer_finite_check the tensors are bound without reading their data (the
/// mapping's pages stay on disk) and LlamaWeights::check_finite scans a layer range's tensors
/// when a stage first uses it, with the same error.
LlamaWeights load_gguf_llama(const GgufFile& file, const LoadOptions& options = {});

/// load_gguf_llama(GgufFile::open(path), options).
LlamaWeights load_gguf_llama(const std::filesystem::path& path, const LoadOptions& options = {});

/// The tokenizer of a GGUF file with tokenizer.ggml.model == "llama" (SentencePiece BPE):
/// tokenizer.ggml.tokens, .scores, .token_type, .bos_token_id, .eos_token_id. Pieces are
/// turned into llama2.c's form as its tokenizer.py export does (U+2581 "▁" becomes " "; BOS and
/// EOS become "\n<s>\n" and "\n</s>\n"), so the same vocabulary gives the same ids as its
/// tokenizer.bin, and Tokenizer's run.c encode (byte fallback "<0xXX>" at ids 3..258) applies.
/// @throws brigade::Error{BadFile} naming the file and key: tokenizer.ggml.model absent or not
///         "llama"; tokens, scores or token_type of different lengths; bos/eos ids other than 1
///         and 2, or byte tokens "<0x00>".."<0xFF>" not at ids 3..258 (run.c's byte fallback);
///         a vocabulary other than `vocab_size` tokens (when vocab_size > 0); a duplicate piece
///         or non-finite score (Tokenizer::from_vocabulary)
Tokenizer load_gguf_tokenizer(const GgufFile& file, int vocab_size = 0);

/// Writes `w` and `tok` as a GGUF v3 file (general.architecture "llama", alignment 32, the
/// tokenizer as tokenizer.ggml.* with pieces in SentencePiece form), atomically (`path` +
/// ".tmp", fsync, rename; the temporary is removed on failure). Every matrix (token_embd, the
/// blocks' attn_q/k/v/output and ffn_gate/down/up, output) is written in the dtype `w` holds it
/// in, in llama.cpp's layouts: f32 (ggml type 0), f16 (1), bf16 (30), q8_0 (8: blocks of 32
/// values, a binary16 scale and 32 int8, 34 bytes); the norm gains are f32, as llama.cpp writes
/// them in every file type. To write another dtype, convert first:
/// `save_gguf_llama(path, convert_weights(w, DType::F16), tok)` (`brigade convert --dtype`).
/// load_gguf_llama and load_gguf_tokenizer read back the same config, weights (bit for bit, in
/// the same dtypes) and vocabulary.
/// @throws brigade::Error{InvalidArgument} if `w` fails check_complete (config, layer count,
///         null tensors), a matrix is of a dtype other than those four (naming the tensor), or
///         tok.vocab_size() != w.config.vocab_size
/// @throws brigade::Error{BadFile} naming the file if it cannot be written or renamed
void save_gguf_llama(const std::filesystem::path& path, const LlamaWeights& w,
                     const Tokenizer& tok);

}  // namespace v0
}  // namespace brigade::model
