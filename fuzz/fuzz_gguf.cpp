// libFuzzer target: GgufFile::open on arbitrary bytes, then every metadata getter on every key,
// load_gguf_llama and load_gguf_tokenizer on whatever opened; a malformed file must give a
// brigade::Error, never a crash, a hang or a sanitizer report.
#include "fuzz_util.hpp"

#include <brigade/core/error.hpp>
#include <brigade/model/gguf.hpp>

#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace model = brigade::model;
  brigade::fuzz::MemFile f(data, size);
  std::optional<model::GgufFile> file;
  try {
    file = model::GgufFile::open(f.path());
  } catch (const brigade::Error&) {
    return 0;
  }
  // Every typed getter on every key: a wrong type is a named Error, never a misread.
  for (const std::string& key : file->keys()) {
    auto attempt = [](auto&& get) {
      try {
        get();
      } catch (const brigade::Error&) {
      }
    };
    attempt([&] { (void)file->get_int(key); });
    attempt([&] { (void)file->get_float(key); });
    attempt([&] { (void)file->get_bool(key); });
    attempt([&] { (void)file->get_string(key); });
    attempt([&] { (void)file->get_strings(key); });
    attempt([&] { (void)file->get_floats(key); });
    attempt([&] { (void)file->get_ints(key); });
  }
  // Touch the first and last byte of every tensor: the reader placed them inside the mapping.
  unsigned sum = 0;
  for (const model::GgufTensor& t : file->tensors())
    if (t.bytes) sum += std::to_integer<unsigned>(t.data[0]) + std::to_integer<unsigned>(t.data[t.bytes - 1]);
  (void)sum;
  try {
    const model::LlamaWeights w = model::load_gguf_llama(*file);
    (void)model::load_gguf_tokenizer(*file, w.config.vocab_size);
  } catch (const brigade::Error&) {
  }
  try {
    const model::Tokenizer tok = model::load_gguf_tokenizer(*file);
    (void)tok.encode("Once upon a time", true, false);
  } catch (const brigade::Error&) {
  }
  return 0;
}
