// The model loader chosen by the file's magic.
#include "brigade/model/model_file.hpp"

#include "brigade/io/input.hpp"
#include "brigade/model/gguf.hpp"
#include "brigade/model/safetensors.hpp"

#include <system_error>

namespace brigade::model {
inline namespace v0 {

ModelFileFormat model_file_format(const std::filesystem::path& path) {
  std::error_code ec;
  // A directory is a Hugging Face checkpoint when it holds config.json; any other directory
  // goes to the llama2.c loader, which names it as a directory.
  if (std::filesystem::is_directory(path, ec))
    return std::filesystem::exists(path / "config.json", ec) ? ModelFileFormat::Safetensors
                                                             : ModelFileFormat::Llama2c;
  const std::string head = io::read_head(path, 16);
  if (head.starts_with("GGUF")) return ModelFileFormat::Gguf;
  if (io::foreign_format(head) == "a safetensors file") return ModelFileFormat::Safetensors;
  return ModelFileFormat::Llama2c;
}

LlamaWeights load_model_weights(const std::filesystem::path& path, const LoadOptions& options) {
  switch (model_file_format(path)) {
    case ModelFileFormat::Gguf: return load_gguf_llama(path, options);
    case ModelFileFormat::Safetensors: return load_safetensors_llama(path);
    case ModelFileFormat::Llama2c: break;
  }
  return load_llama2c_checkpoint(path, options);
}

}  // namespace v0
}  // namespace brigade::model
