// Llama weights: views into a mmap'd llama2.c checkpoint or an owned synthetic buffer, the
// matrices in their stored dtype (F32, F16, BF16, Q8_0; weight_matrix.hpp).
#pragma once

#include "brigade/core/dtype.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/weight_matrix.hpp"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string_view>
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
  /// Set when the loader deferred its scan for NaN and infinite weights
  /// (LoadOptions::defer_finite_check): check_finite(first, last) scans the tensors of ModelSpec
  /// layers [first, last) (the embedding table for layer 0, a decoder's nine tensors, the final
  /// norm's gain, the classifier: the embedding table when shared) and throws the loader's
  /// error, Errc::BadFile naming the file, the tensor and the element, as the load would have.
  /// runtime::InferenceStage runs it over its range before its first forward (or its first
  /// background load), so a window's pages are read when the window is first used, not at load.
  /// Empty: every weight was scanned at load. Copies share the function (it holds `storage`).
  std::function<void(int first, int last)> check_finite;
};

/// How a loader (load_llama2c_checkpoint, load_gguf_llama, load_model_weights) reads the weights.
struct LoadOptions {
  /// False (default): every weight is scanned for NaN and infinity at load (reading the whole
  /// file once). True: the tensors are bound without reading them and
  /// LlamaWeights::check_finite scans each layer range when it is first used: the mmap weight
  /// offload of a model larger than RAM (prima.cpp's setting), where reading the whole file at
  /// load would page in everything the offload keeps out.
  bool defer_finite_check = false;
};

/// Checks that `w` is a whole model for its config: LlamaConfig::validate passes, it has
/// n_layers decoder layers, and the embedding, the final norm, the classifier (unless shared)
/// and every tensor of every layer are set. The savers (save_llama2c_checkpoint,
/// save_gguf_llama) call it before writing anything.
/// @param what names the caller in messages, e.g. "save_gguf_llama(out.gguf)"
/// @throws brigade::Error{InvalidArgument} "<what>: ..." naming the layer count, or the layer
///         and tensor (rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3) that is missing
void check_complete(const LlamaWeights& w, std::string_view what);

/// Bytes of the weights of each ModelSpec layer of `w` as stored (matrices in their dtype, the
/// RMSNorm gains as float32), in ModelSpec order: the embedding table, each decoder (its seven
/// matrices and two gains), the final norm's gain, the classifier (0 when it is shared: its
/// table is the embedding's), the sampler (0); n_layers + 4 entries. The memory checks read
/// these (cost::InferenceMemoryOptions::layer_weight_bytes), so a model loaded in F16 or Q8_0 is
/// counted at the bytes it holds.
/// @throws brigade::Error{InvalidArgument} if w.layers.size() differs from n_layers
std::vector<std::size_t> layer_weight_bytes(const LlamaWeights& w);

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

/// `w` with its decoder matrices, embedding table and classifier in `dtype`; the RMSNorm gains
/// stay float32 (views of w's), and a shared classifier stays shared. Per matrix:
/// - already `dtype`: kept as it is (the same view, bit for bit; no copy). A model whose matrices
///   are all `dtype` comes back as `w` itself.
/// - F32 to F16 or BF16: rounded to nearest, ties to even; F32 to Q8_0: as quantize_rows
///   (llama.cpp's quantize_row_q8_0_ref).
/// - F16, BF16 or Q8_0 to F32: dequantized, exact (every such value is a float32).
/// - between narrow types (F16 <-> BF16, F16/BF16 -> Q8_0, Q8_0 -> F16/BF16): dequantized to
///   float32 (exact), then converted as from F32: so rounded once, to nearest even for F16 and
///   BF16 (a BF16 value outside F16's range becomes infinity, one below its subnormals 0), and
///   as llama.cpp's Q8_0 quantization of those float32 values for Q8_0.
/// Converted matrices are owned by the result's `storage` (which keeps w's alive too).
/// @throws brigade::Error{InvalidArgument} if `dtype` is not F32, F16, BF16 or Q8_0; if a
///         matrix of `w` is of another dtype; if a matrix converted to Q8_0 has rows that are
///         not whole blocks of 32 (naming the tensor and its row length); if w.layers.size()
///         differs from n_layers or a tensor is null
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
///         is scanned at load, at memory speed: docs/benchmarks.md; with
///         options.defer_finite_check, each layer range when a stage first uses it:
///         LlamaWeights::check_finite)
LlamaWeights load_llama2c_checkpoint(const std::filesystem::path& path,
                                     const LoadOptions& options = {});

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
