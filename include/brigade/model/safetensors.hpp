// safetensors (Hugging Face's tensor file) and Llama checkpoints in the Hugging Face layout
// (config.json + one or more .safetensors files): a checked reader over a read-only mmap, and
// the mapping to LlamaConfig / LlamaWeights with HF's Q/K row permutation undone. Every check
// and refusal is in docs/formats.md ("safetensors").
//
// Source: the safetensors format (github.com/huggingface/safetensors, README "Format"): an
// unsigned little-endian 64-bit header length N, N bytes of UTF-8 JSON mapping each tensor name
// to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the byte after the
// header), an optional "__metadata__" string map, then the data, with no gaps.
#pragma once

#include "brigade/core/dtype.hpp"
#include "brigade/model/weights.hpp"

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace brigade::model {
inline namespace v0 {

/// One tensor of a safetensors file: PyTorch's shape order (outermost first), so a Linear's
/// weight `out x in` row-major has shape {out, in}.
struct SafetensorsTensor {
  std::string name;
  std::string dtype_name;             ///< as the header spells it: "F32", "F16", "BF16"
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;    ///< 0 or more dimensions (a scalar has none)
  std::int64_t elements = 0;          ///< product of shape (1 for a scalar)
  std::uint64_t begin = 0, end = 0;   ///< byte range within the data section
  const std::byte* data = nullptr;    ///< into the mapping
};

/// A safetensors file opened for reading: the header checked in full, tensor data as views into
/// a read-only mmap. Copies share the mapping.
class SafetensorsFile {
 public:
  /// Largest header accepted, in bytes (the safetensors library's own limit: 100 MB).
  static constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

  /// Maps and checks `path`.
  /// @throws brigade::Error{BadFile} naming the file, the tensor and the value seen vs
  ///         expected: file missing / not a regular file / shorter than 8 bytes; a header
  ///         length past the end of the file or above kMaxHeaderBytes; a header that is not
  ///         valid JSON (the parser's message and byte position) or not an object; an entry
  ///         that is not an object with "dtype" (string), "shape" (array of integers >= 0),
  ///         "data_offsets" ([begin, end], begin <= end); a dtype brigade does not read (it
  ///         reads F32, F16, BF16; others named, e.g. "I64"); a shape whose element count
  ///         overflows 64 bits; end - begin not equal to elements x dtype bytes; an offset past
  ///         the end of the file; two tensors that overlap, a gap between tensors, or bytes
  ///         left after the last one; "__metadata__" not a map of strings
  static SafetensorsFile open(const std::filesystem::path& path);

  [[nodiscard]] const std::filesystem::path& path() const noexcept;
  /// Byte offset of the data section (8 + header length).
  [[nodiscard]] std::uint64_t data_offset() const noexcept;
  /// Tensors in data order.
  [[nodiscard]] const std::vector<SafetensorsTensor>& tensors() const noexcept;
  /// The tensor named `name`, or nullptr.
  [[nodiscard]] const SafetensorsTensor* find(std::string_view name) const noexcept;
  /// "__metadata__" entries (key, value), in header order.
  [[nodiscard]] const std::vector<std::pair<std::string, std::string>>& metadata() const noexcept;
  /// Keeps the mapping alive.
  [[nodiscard]] std::shared_ptr<const void> storage() const noexcept;

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

/// The Llama model of a Hugging Face checkpoint directory (or one .safetensors file with
/// config.json beside it): config.json ("model_type" "llama" or "architectures" holding
/// "LlamaForCausalLM") gives the config (hidden_size, intermediate_size, num_hidden_layers,
/// num_attention_heads, num_key_value_heads (default: heads), max_position_embeddings,
/// rms_norm_eps (default 1e-6), rope_theta (default 10000), vocab_size, tie_word_embeddings
/// (default false)); the tensors come from every .safetensors file of the directory (sorted
/// by name; each tensor in exactly one). q_proj and k_proj rows are permuted back from HF's
/// rotate-half order to the adjacent-pair order of brigade's RoPE (llama2.c export.py's
/// permute_reverse), into owned buffers; every other matrix is a view into its file's mapping,
/// in the file's dtype (F32, F16 or BF16: `WeightMatrix`). Norm gains stored as F16 or BF16
/// are widened (exactly) to float32 into owned buffers.
/// `mapped` is false, because the permuted copies cannot be re-read from a file.
/// @throws brigade::Error{BadFile} naming the file and key or tensor: config.json missing or
///         invalid JSON, another model type, a missing or out-of-range key, rope_scaling set,
///         head_dim other than hidden_size / heads; a tensor missing, of a shape that disagrees
///         with config.json (seen vs expected), a layer index >= num_hidden_layers, a tensor
///         brigade does not use, the same tensor in two files; a tensor whose address is not a
///         multiple of its element size; a NaN or infinite weight; SafetensorsFile::open's
///         checks
LlamaWeights load_safetensors_llama(const std::filesystem::path& path);

}  // namespace v0
}  // namespace brigade::model
