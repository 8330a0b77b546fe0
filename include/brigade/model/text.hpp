// Printing generated tokens exactly as llama2.c's run.c prints them.
#pragma once

#include "brigade/model/tokenizer.hpp"

#include <span>
#include <string>

namespace brigade::model {
inline namespace v0 {

/// The bytes run.c writes to stdout for a sequence whose token at each position is `tokens`
/// (BOS first): the decode of every token after the first, each given its predecessor
/// (Tokenizer::decode), filtered by Tokenizer::append_printable, then one final newline.
/// @throws brigade::Error{InvalidArgument} if a token is outside the vocabulary
inline std::string render_like_run_c(const Tokenizer& tok, std::span<const int> tokens) {
  std::string out;
  for (std::size_t i = 1; i < tokens.size(); ++i)
    Tokenizer::append_printable(out, tok.decode(tokens[i - 1], tokens[i]));
  out += '\n';
  return out;
}

}  // namespace v0
}  // namespace brigade::model
