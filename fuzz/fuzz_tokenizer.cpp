// libFuzzer target: Tokenizer::load_llama2c on arbitrary bytes (the first two bytes choose
// vocab_size in 1..1024), then encode and decode with whatever vocabulary loaded.
#include "fuzz_util.hpp"

#include <brigade/core/error.hpp>
#include <brigade/model/tokenizer.hpp>

#include <string>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  const int vocab = 1 + ((data[0] | (data[1] << 8)) % 1024);
  brigade::fuzz::MemFile f(data + 2, size - 2);
  brigade::model::Tokenizer tok;
  try {
    tok = brigade::model::Tokenizer::load_llama2c(f.path(), vocab);
  } catch (const brigade::Error&) {
    return 0;
  }
  // Encode the input's own bytes (bounded) and a fixed sentence; decode every id.
  const std::string_view text(reinterpret_cast<const char*>(data), size < 256 ? size : 256);
  for (std::string_view s : {text, std::string_view("Once upon a time, \xC3\xA9t\xC3\xA9.")}) {
    try {
      const auto ids = tok.encode(s, true, true);
      std::string out;
      for (std::size_t i = 1; i < ids.size(); ++i)
        brigade::model::Tokenizer::append_printable(out, tok.decode(ids[i - 1], ids[i]));
    } catch (const brigade::Error&) {
      // a byte without its fallback token in a small vocabulary: a named error
    }
  }
  for (int id = 0; id < tok.vocab_size(); ++id) (void)tok.decode(brigade::model::Tokenizer::kBos, id);
  return 0;
}
