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
};

/// Loads a llama2.c checkpoint (legacy format: 7 little-endian int32 header fields dim,
/// hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative vocab_size means a
/// separate classifier; then float32 tensors token_embedding, rms_att, wq, wk, wv, wo, rms_ffn,
/// w1, w2, w3, rms_final, freq_cis_real, freq_cis_imag [, wcls]). The file is mmap'd read-only;
/// nothing is copied.
/// @throws brigade::Error{BadFile} naming the file, the field and the values when the file is
///         missing, shorter than its header, has a non-positive or inconsistent header field, or
///         its size differs from the size the header implies
LlamaWeights load_llama2c_checkpoint(const std::filesystem::path& path);

/// Writes `w` as a llama2.c legacy checkpoint (atomically: a temporary file, then rename).
/// RoPE tables are written as run.c's export does (cos/sin of pos * freq).
/// @throws brigade::Error{BadFile} if the file cannot be written
void save_llama2c_checkpoint(const std::filesystem::path& path, const LlamaWeights& w);

/// A randomly initialised model of the given shape, reproducible from `seed`: weights are
/// N(0, 0.02^2) (output projections wo, w2 scaled by 1/sqrt(2 n_layers), as GPT-2 and llama2.c's
/// train.py do), norm gains are 1.
/// @throws brigade::Error{InvalidArgument} if the config is invalid
LlamaWeights make_synthetic_weights(const LlamaConfig& config, std::uint64_t seed);

}  // namespace v0
}  // namespace brigade::model
