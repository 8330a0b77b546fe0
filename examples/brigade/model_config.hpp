// The model shape a CLI subcommand prices: a named size or a JSON file of LlamaConfig fields
// (`simulate --model`, `plan-batches --model`).
#pragma once

#include <brigade/core/error.hpp>
#include <brigade/io/input.hpp>
#include <brigade/model/config.hpp>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>

namespace brigade::cli {

/// A named size (brigade::model::named_config) or a JSON file with LlamaConfig's fields (dim,
/// hidden_dim, n_layers, n_heads, optional n_kv_heads, vocab_size, seq_len).
/// @throws brigade::Error{BadFile} for a file that is not a JSON object, a missing or
///         non-integer field; {InvalidArgument} for an unknown name or an invalid config
inline brigade::model::LlamaConfig load_model_config(const std::string& what) {
  namespace fs = std::filesystem;
  const bool is_file = what.find('/') != std::string::npos || fs::path(what).extension() == ".json";
  if (!is_file) return brigade::model::named_config(what);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(
        brigade::io::read_input_file(what, "model config", brigade::io::kMaxPromptFileBytes));
  } catch (const nlohmann::json::exception& e) {
    brigade::detail::fail(brigade::Errc::BadFile, "{}: not a JSON model config ({})", what,
                          brigade::detail::excerpt(e.what(), 160));
  }
  BRIGADE_CHECK(j.is_object(), brigade::Errc::BadFile, "{}: expected a JSON object of config fields", what);
  brigade::model::LlamaConfig c;
  auto field = [&](const char* name, int& out, bool required) {
    if (!j.contains(name)) {
      BRIGADE_CHECK(!required, brigade::Errc::BadFile, "{}: field '{}' is missing", what, name);
      return;
    }
    BRIGADE_CHECK(j[name].is_number_integer(), brigade::Errc::BadFile,
                  "{}: field '{}' = {}, expected an integer", what, name, j[name].dump());
    out = j[name].get<int>();
  };
  field("dim", c.dim, true);
  field("hidden_dim", c.hidden_dim, true);
  field("n_layers", c.n_layers, true);
  field("n_heads", c.n_heads, true);
  c.n_kv_heads = c.n_heads;
  field("n_kv_heads", c.n_kv_heads, false);
  field("vocab_size", c.vocab_size, true);
  field("seq_len", c.seq_len, true);
  c.validate(what);
  return c;
}

}  // namespace brigade::cli
