// `brigade convert`: a llama2.c or Hugging Face safetensors checkpoint (with a llama2.c tokenizer)
// to GGUF v3 with its matrices in f32, f16, bf16 or q8_0 (--dtype), and a GGUF Llama back to a
// llama2.c checkpoint (float32; and, with --tokenizer-out, its tokenizer.bin).
#include "cli.hpp"

#include <brigade/model/gguf.hpp>
#include <brigade/model/model_file.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>

#include <fmt/format.h>

#include <memory>
#include <string>

namespace {

struct ConvertArgs {
  std::string in, out, tokenizer, tokenizer_out;
  std::string dtype = "f32";  // --dtype: the GGUF file's matrices
};

int run(const ConvertArgs& a) {
  using namespace brigade;
  namespace model = brigade::model;
  if (model::model_file_format(a.in) == model::ModelFileFormat::Gguf) {
    BRIGADE_CHECK(a.tokenizer.empty(), Errc::InvalidArgument,
                  "convert: --tokenizer is for a llama2.c input; {} is GGUF and carries its own "
                  "(write it with --tokenizer-out)",
                  a.in);
    BRIGADE_CHECK(a.dtype == "f32", Errc::InvalidArgument,
                  "convert: --dtype {} is for a GGUF output; a llama2.c checkpoint (from the GGUF "
                  "input {}) is float32 only",
                  a.dtype, a.in);
    const model::GgufFile file = model::GgufFile::open(a.in);
    // f16, bf16 and q8_0 matrices widen to float32 exactly.
    const model::LlamaWeights w =
        model::convert_weights(model::load_gguf_llama(file), DType::F32);
    // Read the tokenizer before writing anything, so a bad one leaves no output behind.
    model::Tokenizer tok;
    if (!a.tokenizer_out.empty()) tok = model::load_gguf_tokenizer(file, w.config.vocab_size);
    model::save_llama2c_checkpoint(a.out, w);
    fmt::print(stderr, "convert: {} (GGUF v{}) -> {} (llama2.c checkpoint)\n", a.in,
               file.version(), a.out);
    if (!a.tokenizer_out.empty()) {
      tok.save_llama2c(a.tokenizer_out);
      fmt::print(stderr, "convert: tokenizer ({} tokens) -> {}\n", tok.vocab_size(),
                 a.tokenizer_out);
    }
    return 0;
  }
  // A llama2.c checkpoint or a Hugging Face safetensors checkpoint becomes GGUF.
  const std::string kind = model::model_file_format(a.in) == model::ModelFileFormat::Safetensors
                               ? "a safetensors checkpoint"
                               : "a llama2.c checkpoint";
  BRIGADE_CHECK(a.tokenizer_out.empty(), Errc::InvalidArgument,
                "convert: --tokenizer-out is for a GGUF input; {} is {}", a.in, kind);
  BRIGADE_CHECK(!a.tokenizer.empty(), Errc::InvalidArgument,
                "convert: {} to GGUF needs --tokenizer (the llama2.c tokenizer file to embed)",
                kind);
  const model::LlamaWeights w = model::load_model_weights(a.in);
  const model::Tokenizer tok = model::Tokenizer::load_llama2c(a.tokenizer, w.config.vocab_size);
  // Converted before anything is written: a shape q8_0 cannot hold is refused with no output.
  const model::LlamaWeights out = model::convert_weights(w, *parse_dtype(a.dtype));
  model::save_gguf_llama(a.out, out, tok);
  fmt::print(stderr, "convert: {} ({}) + {} -> {} (GGUF v3, {} matrices, f32 norms; {:.1f} MB of "
             "weights)\n", a.in, kind.substr(2), a.tokenizer, a.out, a.dtype,
             static_cast<double>(model::weight_bytes(out)) / 1e6);
  return 0;
}

std::function<int()> setup(CLI::App& sub) {
  auto a = std::make_shared<ConvertArgs>();
  sub.add_option("IN", a->in,
                 "model to read: a llama2.c checkpoint (.bin), a GGUF file, or a Hugging Face "
                 "safetensors checkpoint (directory or .safetensors file; format from its magic)")
      ->required();
  sub.add_option("OUT", a->out,
                 "file to write (atomically): GGUF v3 from a llama2.c or safetensors input, a "
                 "llama2.c checkpoint from a GGUF input")
      ->required();
  sub.add_option("--tokenizer", a->tokenizer,
                 "llama2.c tokenizer (.bin) to embed in the GGUF file (llama2.c or safetensors "
                 "input)");
  sub.add_option("--dtype", a->dtype,
                 "dtype of the GGUF file's weight matrices (llama.cpp's layouts; norm gains stay "
                 "f32): f32 (exact), f16 or bf16 (rounded to nearest even), q8_0 (llama.cpp's "
                 "blocks of 32; needs dim, hidden_dim and the KV width multiples of 32)")
      ->check(CLI::IsMember({"f32", "f16", "bf16", "q8_0"}))
      ->capture_default_str();
  sub.add_option("--tokenizer-out", a->tokenizer_out,
                 "also write the GGUF file's tokenizer as a llama2.c tokenizer.bin (GGUF input)");
  return [a] { return run(*a); };
}

const brigade::cli::Registrar registrar{
    {"convert", "Convert a model between llama2.c (.bin) and GGUF (f32, f16, bf16, q8_0), or "
                "safetensors to GGUF",
     setup}};

}  // namespace
