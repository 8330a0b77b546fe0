// Llama weights: views into a mmap'd llama2.c checkpoint or an owned synthetic buffer.
#pragma once

#include "brigade/model/config.hpp"

#include <cstdint>
#include <filesystem>
#include <memory>
#include <vector>

namespace brigade::model {
inline namespace v0 {

/// Pointers to one decoder layer's float32 tensors, row-major, matrices `out x in`
/// (llama2.c's layout): y = W x is `y[i] = sum_j W[i*in + j] x[j]`.
struct DecoderWeights {
  const float* rms_att = nullptr;  ///< [dim] attention RMSNorm gain
  const float* wq = nullptr;       ///< [dim x dim]
  const float* wk = nullptr;       ///< [kv_dim x dim]
  const float* wv = nullptr;       ///< [kv_dim x dim]
  const float* wo = nullptr;       ///< [dim x dim]
  const float* rms_ffn = nullptr;  ///< [dim] FFN RMSNorm gain
  const float* w1 = nullptr;       ///< [hidden_dim x dim] gate
  const float* w2 = nullptr;       ///< [dim x hidden_dim] down
  const float* w3 = nullptr;       ///< [hidden_dim x dim] up
};

/// All weights of a Llama model. The pointers stay valid while `storage` (the mmap or the
/// owned buffer) lives; copies share it.
struct LlamaWeights {
  LlamaConfig config;
  const float* token_embedding = nullptr;  ///< [vocab_size x dim]
  std::vector<DecoderWeights> layers;      ///< n_layers entries
  const float* rms_final = nullptr;        ///< [dim]
  const float* wcls = nullptr;             ///< [vocab_size x dim]; == token_embedding when shared
  std::shared_ptr<const void> storage;     ///< keeps the memory behind the pointers alive
  /// True when the tensors point into a read-only file mapping (load_llama2c_checkpoint): pages
  /// dropped with madvise(MADV_DONTNEED) are read back from the file on their next use. False
  /// for owned memory (make_synthetic_weights), where dropping pages would lose the weights.
  bool mapped = false;
};

/// Loads a llama2.c checkpoint (legacy format: 7 little-endian int32 header fields dim,
/// hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative vocab_size means a
/// separate classifier; then float32 tensors token_embedding, rms_att, wq, wk, wv, wo, rms_ffn,
/// w1, w2, w3, rms_final, freq_cis_real, freq_cis_imag [, wcls]). The file is mmap'd read-only;
/// nothing is copied. `storage` owns the mapping and its file descriptor (unmapped and closed
/// when the last copy goes); the RoPE tables are mapped but not exposed. docs/formats.md has
/// the byte layout.
/// @throws brigade::Error{BadFile} naming the file, the field and the values when the file is
///         missing, shorter than its header, has a non-positive or inconsistent header field
///         (LlamaConfig::validate's checks), implies more than 2^64 bytes, or its size differs
///         from the size the header implies (bytes seen and expected); when it is not a regular
///         file (saying which kind: a directory, a FIFO, a character device), or starts with
///         another format's magic (io::foreign_format: "is a GGUF file (llama.cpp)", safetensors,
///         a zip or pickle PyTorch file, ELF, ...); naming the tensor, the decoder layer
///         (counting from 0) and the element when a weight is NaN or infinite (the whole file
///         is scanned at load, at memory speed: docs/benchmarks.md)
LlamaWeights load_llama2c_checkpoint(const std::filesystem::path& path);

/// True when `path` is a regular file whose first 28 bytes are a valid llama2.c header (every
/// field positive, LlamaConfig::validate passes) and whose size is exactly the size that header
/// implies. Never throws; reads only the header. Used to name a checkpoint given where another
/// kind of file belongs (a tokenizer, a text corpus).
bool is_llama2c_checkpoint(const std::filesystem::path& path);

/// Writes `w` as a llama2.c legacy checkpoint (atomically: `path` + ".tmp", then rename; the
/// temporary is removed on failure). The header's vocab_size is negative when the classifier is
/// not shared, and wcls then follows the RoPE tables. RoPE tables are written as llama2.c's
/// export does: real[pos][i] = cos(float(pos) * theta^(-2i/head_size)), imag = sin, both
/// [seq_len x head_size/2] (float32 angle; within 1 ulp of the PyTorch-made tables).
/// @throws brigade::Error{InvalidArgument} if `w.config` is invalid, `w.layers.size()` differs
///         from n_layers, or a tensor pointer is null
/// @throws brigade::Error{InvalidArgument} naming the tensor, layer and element if a weight is
///         NaN or infinite (nothing is written)
/// @throws brigade::Error{BadFile} naming the file if it cannot be written or renamed
void save_llama2c_checkpoint(const std::filesystem::path& path, const LlamaWeights& w);

/// A randomly initialised model of the given shape, reproducible from `seed`: weights are
/// N(0, 0.02^2) (output projections wo, w2 scaled by 1/sqrt(2 n_layers), as GPT-2 and llama2.c's
/// train.py do), norm gains are 1. One owned buffer holds every tensor in the checkpoint's
/// order (RoPE tables included, wcls after them when not shared). Reproducible: the same seed
/// gives the same bytes (each tensor is a counter-based stream, so the result does not depend
/// on the number of threads used to fill it); different seeds give different weights. Runs on
/// std::thread::hardware_concurrency() threads; the 110M config takes well under a second.
/// @throws brigade::Error{InvalidArgument} if the config is invalid
LlamaWeights make_synthetic_weights(const LlamaConfig& config, std::uint64_t seed);

}  // namespace v0
}  // namespace brigade::model
