// Llama-family model configuration and the ModelSpec layer list that partitions split.
#pragma once

#include "brigade/core/error.hpp"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace brigade::model {
inline namespace v0 {

/// Hyper-parameters of a Llama-family decoder-only transformer (llama2.c's Config plus the
/// constants run.c hard-codes).
struct LlamaConfig {
  int dim = 0;              ///< model width (embedding size)
  int hidden_dim = 0;       ///< SwiGLU FFN inner width
  int n_layers = 0;         ///< number of decoder layers
  int n_heads = 0;          ///< query heads
  int n_kv_heads = 0;       ///< key/value heads (grouped-query attention: n_heads % n_kv_heads == 0)
  int vocab_size = 0;       ///< tokens in the vocabulary
  int seq_len = 0;          ///< maximum positions (context length)
  float rope_theta = 10000.0f;  ///< RoPE base
  float norm_eps = 1e-5f;       ///< RMSNorm epsilon, added to mean(x^2)
  bool shared_classifier = true;  ///< LM head reuses the token-embedding matrix

  /// dim / n_heads.
  [[nodiscard]] int head_size() const noexcept { return n_heads > 0 ? dim / n_heads : 0; }
  /// n_kv_heads * head_size(): width of K and V rows.
  [[nodiscard]] int kv_dim() const noexcept { return n_kv_heads * head_size(); }

  /// Parameter count (embedding, decoder layers, final norm, and the classifier when separate).
  [[nodiscard]] std::int64_t num_parameters() const noexcept {
    const std::int64_t d = dim, h = hidden_dim, kv = kv_dim(), v = vocab_size;
    const std::int64_t per_layer = 2 * d + d * d * 2 + 2 * d * kv + 3 * d * h;
    return v * d + n_layers * per_layer + d + (shared_classifier ? 0 : v * d);
  }

  /// Checks the fields against each other.
  /// @param what names the source in messages (a file path, "synthetic 110M", ...)
  /// @throws brigade::Error{InvalidArgument} naming the field, its value and what was expected
  void validate(std::string_view what) const {
    auto positive = [&](int v, std::string_view field) {
      BRIGADE_CHECK(v > 0, Errc::InvalidArgument, "{}: {} = {}, expected > 0", what, field, v);
    };
    positive(dim, "dim");
    positive(hidden_dim, "hidden_dim");
    positive(n_layers, "n_layers");
    positive(n_heads, "n_heads");
    positive(n_kv_heads, "n_kv_heads");
    positive(vocab_size, "vocab_size");
    positive(seq_len, "seq_len");
    BRIGADE_CHECK(dim % n_heads == 0, Errc::InvalidArgument,
                  "{}: dim = {} is not a multiple of n_heads = {}", what, dim, n_heads);
    BRIGADE_CHECK(head_size() % 2 == 0, Errc::InvalidArgument,
                  "{}: head_size = {} is odd; RoPE needs adjacent pairs", what, head_size());
    BRIGADE_CHECK(n_kv_heads <= n_heads && n_heads % n_kv_heads == 0, Errc::InvalidArgument,
                  "{}: n_heads = {} is not a multiple of n_kv_heads = {}", what, n_heads,
                  n_kv_heads);
  }
};

/// By name: "260K" (stories260K's shape, vocab 512), "15M", "42M", "110M" (TinyStories, vocab
/// 32000), "1.1B" (TinyLlama-1.1B), and "llama-3.1-70b" and "llama-3.1-405b" (Meta 2024, "The
/// Llama 3 Herd of Models", Table 3: untied embeddings, 8 KV heads, vocab 128256).
/// @throws brigade::Error{InvalidArgument} for an unknown name, listing the known ones
LlamaConfig named_config(std::string_view name);

/// Names accepted by named_config(), in size order.
std::vector<std::string> named_config_names();

/// The kind of one layer of a ModelSpec.
enum class LayerKind : std::uint8_t { Embedding, Decoder, FinalNorm, LMHead, Sampler };

/// Name of a layer kind ("embedding", "decoder", "final_norm", "lm_head", "sampler").
constexpr std::string_view to_string(LayerKind k) noexcept {
  switch (k) {
    case LayerKind::Embedding: return "embedding";
    case LayerKind::Decoder: return "decoder";
    case LayerKind::FinalNorm: return "final_norm";
    case LayerKind::LMHead: return "lm_head";
    case LayerKind::Sampler: return "sampler";
  }
  return "?";
}

/// One layer of a ModelSpec.
struct LayerSpec {
  LayerKind kind = LayerKind::Decoder;
  int decoder_index = -1;  ///< index among decoder layers, or -1 for the other kinds
};

/// The ordered layer list a Partition splits: Embedding, Decoder x L, FinalNorm, LMHead,
/// Sampler (L + 4 layers). Sampling and the LM head are layers with costs, so the tail
/// stage's extra work is visible to every partition policy (DynaPipe, inference).
class ModelSpec {
 public:
  /// @throws brigade::Error{InvalidArgument} if the config is invalid
  explicit ModelSpec(LlamaConfig config) : config_(config) {
    config_.validate("ModelSpec");
    layers_.push_back({LayerKind::Embedding, -1});
    for (int i = 0; i < config_.n_layers; ++i) layers_.push_back({LayerKind::Decoder, i});
    layers_.push_back({LayerKind::FinalNorm, -1});
    layers_.push_back({LayerKind::LMHead, -1});
    layers_.push_back({LayerKind::Sampler, -1});
  }

  [[nodiscard]] const LlamaConfig& config() const noexcept { return config_; }
  [[nodiscard]] const std::vector<LayerSpec>& layers() const noexcept { return layers_; }
  /// Number of layers, L + 4.
  [[nodiscard]] int num_layers() const noexcept { return static_cast<int>(layers_.size()); }
  /// Layer i (0 <= i < num_layers()).
  /// @throws brigade::Error{InvalidArgument} if i is out of range
  [[nodiscard]] const LayerSpec& layer(int i) const {
    BRIGADE_CHECK(i >= 0 && i < num_layers(), Errc::InvalidArgument,
                  "ModelSpec::layer: index {} outside [0, {})", i, num_layers());
    return layers_[static_cast<std::size_t>(i)];
  }
  /// ModelSpec index of decoder layer d (= d + 1).
  [[nodiscard]] static constexpr int decoder_layer(int d) noexcept { return d + 1; }

 private:
  LlamaConfig config_;
  std::vector<LayerSpec> layers_;
};

}  // namespace v0
}  // namespace brigade::model
