// A model file in any format brigade reads, chosen by its magic: llama2.c, GGUF, safetensors.
#pragma once

#include "brigade/model/weights.hpp"

#include <cstdint>
#include <filesystem>

namespace brigade::model {
inline namespace v0 {

/// File formats brigade reads a model from.
enum class ModelFileFormat : std::uint8_t {
  Llama2c,      ///< llama2.c's legacy float32 checkpoint (no magic)
  Gguf,         ///< GGUF (magic "GGUF"): load_gguf_llama, gguf.hpp
  Safetensors,  ///< a Hugging Face checkpoint: a directory with config.json, or a file
                ///< starting with a uint64 header length and '{': load_safetensors_llama
};

/// The format of `path`: Safetensors for a directory holding config.json or a file whose first
/// 10 bytes are a safetensors header start (io::foreign_format's test), Gguf for "GGUF", Llama2c otherwise
/// (load_llama2c_checkpoint then names any other format it recognises). Never throws.
ModelFileFormat model_file_format(const std::filesystem::path& path);

/// Loads a model in the format model_file_format names: load_llama2c_checkpoint or
/// load_gguf_llama with `options`, or load_safetensors_llama (its weights are not a file
/// mapping, so they are always scanned at load: options.defer_finite_check does not apply).
/// @throws brigade::Error{BadFile} as the chosen loader
LlamaWeights load_model_weights(const std::filesystem::path& path, const LoadOptions& options = {});

}  // namespace v0
}  // namespace brigade::model
