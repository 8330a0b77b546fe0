// A model shape by name or from a JSON config file, for the commands that plan without weights
// (`brigade simulate`, `brigade plan-batches`, `brigade plan`).
#pragma once

#include <brigade/core/error.hpp>
#include <brigade/io/input.hpp>
#include <brigade/model/config.hpp>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>

namespace brigade::cli {

/// A model shape for the planners: a name of model::named_config (260K, 15M, 42M, 110M, 1.1B,
/// llama-3.1-70b, llama-3.1-405b) or a JSON file (a path with '/' or a .json name) of
/// LlamaConfig's fields: dim, hidden_dim, n_layers, n_heads, [n_kv_heads] (default n_heads),
/// vocab_size, seq_len, [shared_classifier] (default true).
/// @throws brigade::Error{BadFile} for a file that cannot be read, is not JSON, or lacks a field
///         or has one of the wrong type; {InvalidArgument} for an unknown name or an invalid shape
inline model::LlamaConfig load_model_config(const std::string& what) {
  namespace fs = std::filesystem;
  const bool is_file = what.find('/') != std::string::npos || fs::path(what).extension() == ".json";
  if (!is_file) return model::named_config(what);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(io::read_input_file(what, "model config", io::kMaxPromptFileBytes));
  } catch (const nlohmann::json::exception& e) {
    detail::fail(Errc::BadFile, "{}: not a JSON model config ({})", what,
                 detail::excerpt(e.what(), 160));
  }
  BRIGADE_CHECK(j.is_object(), Errc::BadFile, "{}: expected a JSON object of config fields", what);
  model::LlamaConfig c;
  auto field = [&](const char* name, int& out, bool required) {
    if (!j.contains(name)) {
      BRIGADE_CHECK(!required, Errc::BadFile, "{}: field '{}' is missing", what, name);
      return;
    }
    BRIGADE_CHECK(j[name].is_number_integer(), Errc::BadFile,
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
  if (j.contains("shared_classifier")) {
    BRIGADE_CHECK(j["shared_classifier"].is_boolean(), Errc::BadFile,
                  "{}: field 'shared_classifier' = {}, expected true or false", what,
                  j["shared_classifier"].dump());
    c.shared_classifier = j["shared_classifier"].get<bool>();
  }
  c.validate(what);
  return c;
}

}  // namespace brigade::cli
