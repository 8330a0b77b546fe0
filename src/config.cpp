// Named Llama shapes (llama2.c's TinyStories family, TinyLlama, and Llama-3.1 70B / 405B).
#include "brigade/model/config.hpp"

#include <array>

namespace brigade::model {
inline namespace v0 {
namespace {

struct Named {
  std::string_view name;
  LlamaConfig config;
};

LlamaConfig make(int dim, int hidden, int layers, int heads, int kv_heads, int vocab, int seq) {
  LlamaConfig c;
  c.dim = dim;
  c.hidden_dim = hidden;
  c.n_layers = layers;
  c.n_heads = heads;
  c.n_kv_heads = kv_heads;
  c.vocab_size = vocab;
  c.seq_len = seq;
  return c;
}

// Llama 3.1 (Meta, "The Llama 3 Herd of Models", 2024, Table 3; the published config.json):
// untied embeddings, RoPE base 500000, 128K context.
LlamaConfig llama31(int dim, int hidden, int layers, int heads) {
  LlamaConfig c = make(dim, hidden, layers, heads, 8, 128256, 131072);
  c.rope_theta = 500000.0f;
  c.shared_classifier = false;
  return c;
}

const std::array<Named, 7>& table() {
  static const std::array<Named, 7> t = {{
      {"260K", make(64, 172, 5, 8, 4, 512, 512)},
      {"15M", make(288, 768, 6, 6, 6, 32000, 256)},
      {"42M", make(512, 1376, 8, 8, 8, 32000, 1024)},
      {"110M", make(768, 2048, 12, 12, 12, 32000, 1024)},
      {"1.1B", make(2048, 5632, 22, 32, 4, 32000, 2048)},
      {"llama-3.1-70b", llama31(8192, 28672, 80, 64)},
      {"llama-3.1-405b", llama31(16384, 53248, 126, 128)},
  }};
  return t;
}

}  // namespace

LlamaConfig named_config(std::string_view name) {
  for (const auto& n : table())
    if (n.name == name) return n.config;
  std::string known;
  for (const auto& n : table()) known += (known.empty() ? "" : ", ") + std::string(n.name);
  detail::fail(Errc::InvalidArgument, "unknown model size '{}', expected one of: {}", name, known);
}

std::vector<std::string> named_config_names() {
  std::vector<std::string> out;
  for (const auto& n : table()) out.emplace_back(n.name);
  return out;
}

}  // namespace v0
}  // namespace brigade::model
