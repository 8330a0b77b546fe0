// Llama weights: views into a mmap'd llama2.c checkpoint or an owned synthetic buffer, the
// matrices in their stored dtype (F32, F16, BF16, Q8_0; weight_matrix.hpp).
#pragma once

#include "brigade/core/dtype.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/weight_matrix.hpp"

#include <cstdint>
#include <filesystem>
#include <memory>
#include <vector>

namespace brigade::model {
inline namespace v0 {

/// One decoder layer's tensors, row-major, matrices `out x in` (llama2.c's layout): y = W x is
/// `y[i] = sum_j W[i*in + j] x[j]`. The matrices are typed views (F32, F16, BF16 or Q8_0, each
/// its own: a loader sets `wq = WeightMatrix(ptr, dtype)`); the RMSNorm gains are float32.
struct DecoderWeights {
  const float* rms_att = nullptr;  ///< [dim] attention RMSNorm gain
  WeightMatrix wq;                 ///< [dim x dim]
  WeightMatrix wk;                 ///< [kv_dim x dim]
  WeightMatrix wv;                 ///< [kv_dim x dim]
  WeightMatrix wo;                 ///< [dim x dim]
  const float* rms_ffn = nullptr;  ///< [dim] FFN RMSNorm gain
  WeightMatrix w1;                 ///< [hidden_dim x dim] gate
  WeightMatrix w2;                 ///< [dim x hidden_dim] down
  WeightMatrix w3;                 ///< [hidden_dim x dim] up
};

/// All weights of a Llama model. The pointers stay valid while `storage` (the mmap or the
/// owned buffer) lives; copies share it. The embedding table and the classifier are typed
/// views like the decoder matrices (the embedding lookup converts the rows it reads).
struct LlamaWeights {
  LlamaConfig config;
  WeightMatrix token_embedding;         ///< [vocab_size x dim]
  std::vector<DecoderWeights> layers;   ///< n_layers entries
  const float* rms_final = nullptr;     ///< [dim]
  WeightMatrix wcls;                    ///< [vocab_size x dim]; == token_embedding when shared
  std::shared_ptr<const void> storage;     ///< keeps the memory behind the pointers alive
  /// True when the tensors point into a read-only file mapping (load_llama2c_checkpoint): pages
  /// dropped with madvise(MADV_DONTNEED) are read back from the file on their next use. False
  /// for owned memory (make_synthetic_weights), where dropping pages would lose the weights.
  bool mapped = false;
};

/// Bytes of every weight tensor of `w` as stored (matrices in their dtype, the RMSNorm gains as
/// float32; a shared classifier counted once): the memory the weights occupy and the bytes one
/// forward pass over the whole model streams.
std::size_t weight_bytes(const LlamaWeights& w);

/// True when every matrix of `w` (decoder matrices, embedding, classifier) is F32.
bool all_f32(const LlamaWeights& w) noexcept;

/// Refuses weights with a non-F32 matrix where float32 master weights are needed (training,
/// writing a llama2.c file).
/// @throws brigade::Error{InvalidArgument} naming `what`, the first such tensor (and its layer)
///         and its dtype
void require_f32(const LlamaWeights& w, const char* what);

/// A copy of `w` (an F32 model) whose decoder matrices, embedding table and classifier are in
/// `dtype` (F16, BF16: rounded to nearest even; Q8_0: as quantize_rows, llama.cpp's
/// quantize_row_q8_0_ref), owned by the result's `storage`; the RMSNorm gains stay float32. A
/// shared classifier stays shared. F32 gives a view of the same memory (no copy). Converting
/// an F16/BF16/Q8_0 model back with dtype F32 dequantizes it (exact).
/// @throws brigade::Error{InvalidArgument} if `dtype` is not F32, F16, BF16 or Q8_0; if a
///         matrix of `w` is not F32 while `dtype` is not F32; if dtype is Q8_0 and dim or
///         hidden_dim is not a multiple of 32 (naming the tensor and its row length); if
///         w.layers.size() differs from n_layers or a tensor is null
LlamaWeights convert_weights(const LlamaWeights& w, DType dtype);

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
///         from n_layers, a tensor pointer is null, or a matrix is not F32 (require_f32; convert
///         it with convert_weights(w, DType::F32) first)
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
