// safetensors: the checked reader over mmap and the Hugging Face Llama mapping (config.json,
// Q/K permutation undone). docs/formats.md ("safetensors") lists every check.
#include "brigade/model/safetensors.hpp"

#include "brigade/core/error.hpp"
#include "brigade/core/finite.hpp"
#include "brigade/io/input.hpp"
#include "layer_tensor.hpp"
#include "mapped_file.hpp"

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>

namespace brigade::model {
inline namespace v0 {

using nlohmann::json;

struct SafetensorsFile::Impl {
  std::filesystem::path path;
  std::shared_ptr<const void> mapping;
  std::uint64_t data_offset = 0;
  std::vector<SafetensorsTensor> tensors;
  std::unordered_map<std::string, std::size_t> index;
  std::vector<std::pair<std::string, std::string>> metadata;
};

namespace {

std::optional<DType> dtype_of(std::string_view s) {
  if (s == "F32") return DType::F32;
  if (s == "F16") return DType::F16;
  if (s == "BF16") return DType::BF16;
  return std::nullopt;
}

/// A non-negative integer JSON value that fits in int64, or nullopt.
std::optional<std::uint64_t> json_index(const json& v) {
  if (v.is_number_unsigned()) return v.get<std::uint64_t>();
  if (v.is_number_integer() && v.get<std::int64_t>() >= 0)
    return static_cast<std::uint64_t>(v.get<std::int64_t>());
  return std::nullopt;
}

}  // namespace

SafetensorsFile SafetensorsFile::open(const std::filesystem::path& path) {
  auto impl = std::make_shared<Impl>();
  impl->path = path;
  const std::string name = path.string();
  const detail::MappedFile m =
      detail::map_file(path, "safetensors file", 8, "the 8-byte safetensors header length");
  impl->mapping = m.mapping;
  std::uint64_t n = 0;
  std::memcpy(&n, m.bytes, 8);
  if (n > m.size - 8)
    detail::fail(Errc::BadFile,
                 "{}: header length {} runs past the end of the file ({} bytes after the 8-byte "
                 "length)",
                 name, n, m.size - 8);
  if (n > kMaxHeaderBytes)
    detail::fail(Errc::BadFile, "{}: header length {} is more than the limit of {} bytes", name, n,
                 kMaxHeaderBytes);
  const std::string_view text(reinterpret_cast<const char*>(m.bytes + 8), static_cast<std::size_t>(n));
  json header;
  try {
    header = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number overflow
    detail::fail(Errc::BadFile, "{}: the header is not valid JSON: {}", name, e.what());
  }
  if (!header.is_object())
    detail::fail(Errc::BadFile, "{}: the header is a JSON {}, expected an object", name,
                 header.type_name());
  impl->data_offset = 8 + n;
  const std::uint64_t data_bytes = m.size - impl->data_offset;
  for (const auto& [key, v] : header.items()) {
    const std::string tn = detail::excerpt(key, 80);
    if (key == "__metadata__") {
      if (!v.is_object())
        detail::fail(Errc::BadFile, "{}: __metadata__ is a JSON {}, expected an object of strings",
                     name, v.type_name());
      for (const auto& [mk, mv] : v.items()) {
        if (!mv.is_string())
          detail::fail(Errc::BadFile, "{}: __metadata__ entry '{}' is a JSON {}, expected a string",
                       name, detail::excerpt(mk, 80), mv.type_name());
        impl->metadata.emplace_back(mk, mv.get<std::string>());
      }
      continue;
    }
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets"))
      detail::fail(Errc::BadFile,
                   "{}: tensor {} is not an object with \"dtype\", \"shape\" and \"data_offsets\"",
                   name, tn);
    SafetensorsTensor t;
    t.name = key;
    if (!v["dtype"].is_string())
      detail::fail(Errc::BadFile, "{}: tensor {} has a dtype that is a JSON {}, expected a string",
                   name, tn, v["dtype"].type_name());
    t.dtype_name = v["dtype"].get<std::string>();
    const std::optional<DType> dt = dtype_of(t.dtype_name);
    if (!dt)
      detail::fail(Errc::BadFile,
                   "{}: tensor {} has dtype {}, which brigade does not read (it reads F32, F16 and "
                   "BF16)",
                   name, tn, detail::excerpt(t.dtype_name));
    t.dtype = *dt;
    const json& shape = v["shape"];
    if (!shape.is_array())
      detail::fail(Errc::BadFile, "{}: tensor {} has a shape that is a JSON {}, expected an array",
                   name, tn, shape.type_name());
    std::uint64_t elements = 1;
    for (std::size_t d = 0; d < shape.size(); ++d) {
      const std::optional<std::uint64_t> x = json_index(shape[d]);
      if (!x || *x > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        detail::fail(Errc::BadFile, "{}: tensor {} has dimension {} = {}, expected an integer >= 0",
                     name, tn, d, detail::excerpt(shape[d].dump()));
      if (__builtin_mul_overflow(elements, *x, &elements) ||
          elements > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        detail::fail(Errc::BadFile,
                     "{}: tensor {} has a shape whose element count overflows 64 bits (dimension "
                     "{} = {})",
                     name, tn, d, *x);
      t.shape.push_back(static_cast<std::int64_t>(*x));
    }
    t.elements = static_cast<std::int64_t>(elements);
    const json& off = v["data_offsets"];
    const std::optional<std::uint64_t> b = off.is_array() && off.size() == 2 ? json_index(off[0]) : std::nullopt;
    const std::optional<std::uint64_t> e = off.is_array() && off.size() == 2 ? json_index(off[1]) : std::nullopt;
    if (!b || !e || *b > *e)
      detail::fail(Errc::BadFile,
                   "{}: tensor {} has data_offsets {}, expected [begin, end] with 0 <= begin <= end",
                   name, tn, detail::excerpt(off.dump(), 64));
    t.begin = *b;
    t.end = *e;
    const std::uint64_t bytes = elements * dtype_block_bytes(t.dtype);  // elements < 2^63, size <= 4
    if (elements > std::numeric_limits<std::uint64_t>::max() / 4 || t.end - t.begin != bytes)
      detail::fail(Errc::BadFile,
                   "{}: tensor {} ({} {}) has data_offsets [{}, {}], {} bytes, expected {} bytes",
                   name, tn, t.dtype_name, fmt::format("[{}]", fmt::join(t.shape, ", ")), t.begin,
                   t.end, t.end - t.begin, bytes);
    if (t.end > data_bytes)
      detail::fail(Errc::BadFile,
                   "{}: tensor {} ends at data offset {}, past the end of the file (the data "
                   "section holds {} bytes)",
                   name, tn, t.end, data_bytes);
    t.data = m.bytes + impl->data_offset + t.begin;
    impl->tensors.push_back(std::move(t));
  }
  // The data section is covered exactly: no overlap, no gap, nothing after the last tensor.
  std::sort(impl->tensors.begin(), impl->tensors.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  std::uint64_t at = 0;
  std::string prev = "the start of the data section";
  for (const SafetensorsTensor& t : impl->tensors) {
    if (t.begin < at)
      detail::fail(Errc::BadFile, "{}: tensor {} (data offsets [{}, {}]) overlaps {} (which ends at {})",
                   name, detail::excerpt(t.name, 80), t.begin, t.end, prev, at);
    if (t.begin > at)
      detail::fail(Errc::BadFile,
                   "{}: a gap of {} bytes between {} (ending at {}) and tensor {} (beginning at {})",
                   name, t.begin - at, prev, at, detail::excerpt(t.name, 80), t.begin);
    at = t.end;
    prev = fmt::format("tensor {}", detail::excerpt(t.name, 80));
  }
  if (at != data_bytes)
    detail::fail(Errc::BadFile,
                 "{}: {} bytes follow the last tensor's data (it ends at data offset {}, the data "
                 "section holds {} bytes)",
                 name, data_bytes - at, at, data_bytes);
  for (std::size_t i = 0; i < impl->tensors.size(); ++i)
    impl->index.emplace(impl->tensors[i].name, i);
  SafetensorsFile f;
  f.impl_ = std::move(impl);
  return f;
}

const std::filesystem::path& SafetensorsFile::path() const noexcept { return impl_->path; }
std::uint64_t SafetensorsFile::data_offset() const noexcept { return impl_->data_offset; }
const std::vector<SafetensorsTensor>& SafetensorsFile::tensors() const noexcept {
  return impl_->tensors;
}
const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const noexcept {
  const auto it = impl_->index.find(std::string(name));
  return it == impl_->index.end() ? nullptr : &impl_->tensors[it->second];
}
const std::vector<std::pair<std::string, std::string>>& SafetensorsFile::metadata() const noexcept {
  return impl_->metadata;
}
std::shared_ptr<const void> SafetensorsFile::storage() const noexcept { return impl_->mapping; }

// ---- Hugging Face Llama ------------------------------------------------------------------

namespace {

/// The per-layer tensors of an HF Llama (model.layers.N.<suffix>.weight), in DecoderWeights
/// order.
constexpr std::array<LayerTensor, 9> kHfLayer = {{
    {"input_layernorm", &DecoderWeights::rms_att, nullptr},
    {"self_attn.q_proj", nullptr, &DecoderWeights::wq},
    {"self_attn.k_proj", nullptr, &DecoderWeights::wk},
    {"self_attn.v_proj", nullptr, &DecoderWeights::wv},
    {"self_attn.o_proj", nullptr, &DecoderWeights::wo},
    {"post_attention_layernorm", &DecoderWeights::rms_ffn, nullptr},
    {"mlp.gate_proj", nullptr, &DecoderWeights::w1},
    {"mlp.down_proj", nullptr, &DecoderWeights::w2},
    {"mlp.up_proj", nullptr, &DecoderWeights::w3},
}};

/// PyTorch shape {out, in} of a per-layer tensor ({dim} for the norms).
std::vector<std::int64_t> hf_shape(std::string_view suffix, const LlamaConfig& c) {
  const std::int64_t d = c.dim, h = c.hidden_dim, kv = c.kv_dim();
  if (suffix.ends_with("layernorm")) return {d};
  if (suffix == "self_attn.k_proj" || suffix == "self_attn.v_proj") return {kv, d};
  if (suffix == "mlp.gate_proj" || suffix == "mlp.up_proj") return {h, d};
  if (suffix == "mlp.down_proj") return {d, h};
  return {d, d};
}

/// What the loaded model owns: the files' mappings, the unpermuted Q/K copies (in the file's
/// dtype) and the norm gains widened to float32 from F16 or BF16.
struct HfStorage {
  std::vector<SafetensorsFile> files;
  std::vector<std::vector<std::byte>> matrices;
  std::vector<std::vector<float>> gains;
};

/// HF's rotate-half rows back to adjacent pairs, per head (llama2.c export.py's
/// permute_reverse): row 2i + c of a head is HF row c * head_size/2 + i. Rows of `row_bytes`
/// bytes are moved whole, so every dtype keeps its bits.
std::vector<std::byte> unpermute(const std::byte* w, int heads, int head_size,
                                 std::size_t row_bytes) {
  std::vector<std::byte> out(static_cast<std::size_t>(heads) *
                             static_cast<std::size_t>(head_size) * row_bytes);
  const int half = head_size / 2;
  for (int h = 0; h < heads; ++h)
    for (int i = 0; i < half; ++i)
      for (int c = 0; c < 2; ++c) {
        const auto dst = static_cast<std::size_t>(h * head_size + 2 * i + c);
        const auto src = static_cast<std::size_t>(h * head_size + c * half + i);
        std::memcpy(out.data() + dst * row_bytes, w + src * row_bytes, row_bytes);
      }
  return out;
}

}  // namespace

LlamaWeights load_safetensors_llama(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const bool is_dir = fs::is_directory(path, ec);
  const fs::path dir = is_dir ? path : path.parent_path();
  const fs::path config_path = dir / "config.json";
  const std::string cfg_name = config_path.string();
  const json cfg = [&] {
    const std::string text = io::read_input_file(config_path, "config.json", io::kMaxPromptFileBytes);
    try {
      return json::parse(text);
    } catch (const json::exception& e) {  // parse_error, out_of_range (number overflow)
      detail::fail(Errc::BadFile, "{}: not valid JSON: {}", cfg_name, e.what());
    }
  }();
  if (!cfg.is_object())
    detail::fail(Errc::BadFile, "{}: a JSON {}, expected an object", cfg_name, cfg.type_name());
  const bool llama =
      (cfg.contains("model_type") && cfg["model_type"] == "llama") ||
      (cfg.contains("architectures") && cfg["architectures"].is_array() &&
       std::find(cfg["architectures"].begin(), cfg["architectures"].end(), "LlamaForCausalLM") !=
           cfg["architectures"].end());
  if (!llama)
    detail::fail(Errc::BadFile,
                 "{}: model_type = {}, expected \"llama\" (brigade runs Llama-architecture models)",
                 cfg_name, cfg.contains("model_type") ? detail::excerpt(cfg["model_type"].dump(), 64) : "(absent)");
  auto get_int = [&](const char* key, std::optional<int> fallback) -> int {
    if (!cfg.contains(key) || cfg[key].is_null()) {
      if (fallback) return *fallback;
      detail::fail(Errc::BadFile, "{}: key \"{}\" is missing", cfg_name, key);
    }
    const json& v = cfg[key];
    if (!v.is_number_integer() || v.get<std::int64_t>() <= 0 ||
        v.get<std::int64_t>() > std::numeric_limits<int>::max())
      detail::fail(Errc::BadFile, "{}: key \"{}\" = {}, expected an integer from 1 to {}",
                   cfg_name, key, detail::excerpt(v.dump(), 64), std::numeric_limits<int>::max());
    return static_cast<int>(v.get<std::int64_t>());
  };
  auto get_float = [&](const char* key, float fallback) -> float {
    if (!cfg.contains(key) || cfg[key].is_null()) return fallback;
    const json& v = cfg[key];
    if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() <= 0.0)
      detail::fail(Errc::BadFile, "{}: key \"{}\" = {}, expected a finite number > 0", cfg_name,
                   key, detail::excerpt(v.dump(), 64));
    return static_cast<float>(v.get<double>());
  };
  LlamaWeights w;
  LlamaConfig& c = w.config;
  c.dim = get_int("hidden_size", std::nullopt);
  c.hidden_dim = get_int("intermediate_size", std::nullopt);
  c.n_layers = get_int("num_hidden_layers", std::nullopt);
  c.n_heads = get_int("num_attention_heads", std::nullopt);
  c.n_kv_heads = get_int("num_key_value_heads", c.n_heads);
  c.seq_len = get_int("max_position_embeddings", std::nullopt);
  c.vocab_size = get_int("vocab_size", std::nullopt);
  c.norm_eps = get_float("rms_norm_eps", 1e-6f);
  c.rope_theta = get_float("rope_theta", 10000.0f);
  if (cfg.contains("tie_word_embeddings") && !cfg["tie_word_embeddings"].is_boolean())
    detail::fail(Errc::BadFile, "{}: key \"tie_word_embeddings\" = {}, expected true or false",
                 cfg_name, detail::excerpt(cfg["tie_word_embeddings"].dump(), 64));
  c.shared_classifier = cfg.value("tie_word_embeddings", false);
  if (cfg.contains("rope_scaling") && !cfg["rope_scaling"].is_null())
    detail::fail(Errc::BadFile,
                 "{}: key \"rope_scaling\" = {}: brigade's RoPE has no scaling, so the model is "
                 "refused (it would give wrong tokens)",
                 cfg_name, detail::excerpt(cfg["rope_scaling"].dump(), 64));
  try {
    c.validate(cfg_name);
  } catch (const Error& e) {
    throw Error(Errc::BadFile, e.what());
  }
  if (cfg.contains("head_dim") && !cfg["head_dim"].is_null() &&
      get_int("head_dim", std::nullopt) != c.head_size())
    detail::fail(Errc::BadFile, "{}: key \"head_dim\" = {}, expected hidden_size / num_attention_heads = {}",
                 cfg_name, cfg["head_dim"].dump(), c.head_size());

  // The files: one named file, or every .safetensors file of the directory (sorted).
  auto storage = std::make_shared<HfStorage>();
  std::vector<fs::path> files;
  if (!is_dir) {
    files.push_back(path);
  } else {
    for (const auto& e : fs::directory_iterator(dir, ec))
      if (e.path().extension() == ".safetensors") files.push_back(e.path());
    std::sort(files.begin(), files.end());
    if (files.empty())
      detail::fail(Errc::BadFile, "{}: no .safetensors file in the directory", dir.string());
  }
  std::map<std::string, std::pair<const SafetensorsTensor*, std::string>, std::less<>> by_name;
  storage->files.reserve(files.size());
  for (const fs::path& p : files) {
    storage->files.push_back(SafetensorsFile::open(p));
    for (const SafetensorsTensor& t : storage->files.back().tensors()) {
      const auto [it, fresh] = by_name.emplace(t.name, std::pair{&t, p.string()});
      if (!fresh)
        detail::fail(Errc::BadFile, "{}: tensor {} is also in {}", p.string(),
                     detail::excerpt(t.name, 80), it->second.second);
    }
  }
  // A layer has 9 tensors: a layer count the files cannot hold is refused before anything is
  // sized by it.
  if (static_cast<std::uint64_t>(c.n_layers) * kHfLayer.size() > by_name.size())
    detail::fail(Errc::BadFile,
                 "{}: key \"num_hidden_layers\" = {}, but the checkpoint holds {} tensors (each "
                 "layer has {})",
                 cfg_name, c.n_layers, by_name.size(), kHfLayer.size());
  std::vector<std::uint8_t> seen(static_cast<std::size_t>(c.n_layers) * kHfLayer.size(), 0);
  for (const auto& [tname, entry] : by_name) {
    const SafetensorsTensor& t = *entry.first;
    const std::string& file = entry.second;
    std::vector<std::int64_t> expected;
    if (tname == "model.embed_tokens.weight" || tname == "lm_head.weight") {
      expected = {c.vocab_size, c.dim};
    } else if (tname == "model.norm.weight") {
      expected = {c.dim};
    } else if (tname.starts_with("model.layers.")) {
      const std::string_view rest = std::string_view(tname).substr(13);
      const std::size_t dot = std::min(rest.find('.'), rest.size());
      std::uint64_t layer = 0;
      const auto [end, err] = std::from_chars(rest.data(), rest.data() + dot, layer);
      const std::string_view tail = dot < rest.size() ? rest.substr(dot + 1) : std::string_view();
      const auto lt = std::find_if(kHfLayer.begin(), kHfLayer.end(), [&](const LayerTensor& x) {
        return tail.size() == x.suffix.size() + 7 && tail.starts_with(x.suffix) &&
               tail.ends_with(".weight");
      });
      if (err != std::errc() || end != rest.data() + dot ||
          rest.substr(0, dot) != std::to_string(layer) || lt == kHfLayer.end()) {
        if (tail == "self_attn.rotary_emb.inv_freq") continue;  // older exports; recomputed
        detail::fail(Errc::BadFile, "{}: tensor {} is not one of a Llama decoder layer's", file,
                     detail::excerpt(tname, 80));
      }
      if (layer >= static_cast<std::uint64_t>(c.n_layers))
        detail::fail(Errc::BadFile,
                     "{}: tensor {} belongs to layer {}, but {} says num_hidden_layers = {}", file,
                     tname, layer, cfg_name, c.n_layers);
      seen[layer * kHfLayer.size() + static_cast<std::size_t>(lt - kHfLayer.begin())] = 1;
      expected = hf_shape(lt->suffix, c);
    } else {
      detail::fail(Errc::BadFile, "{}: tensor {} is not one brigade uses for a Llama model", file,
                   detail::excerpt(tname, 80));
    }
    if (t.shape != expected)
      detail::fail(Errc::BadFile, "{}: tensor {} has shape [{}], expected [{}] from {}", file,
                   tname, fmt::join(t.shape, ", "), fmt::join(expected, ", "), cfg_name);
    // F32, F16 and BF16 (the reader refuses other dtypes): matrices are bound as typed views
    // (the kernels read them), norm gains widened to float32 below.
    const std::size_t elem = dtype_block_bytes(t.dtype);
    if (reinterpret_cast<std::uintptr_t>(t.data) % elem != 0)
      detail::fail(Errc::BadFile,
                   "{}: tensor {} ({}) starts at a file offset that is not a multiple of {} (the "
                   "header length is not padded to 8 bytes)",
                   file, tname, t.dtype_name, elem);
    const std::int64_t cols = t.shape.back();
    const std::size_t i =
        first_non_finite_weight(WeightMatrix(t.data, t.dtype), cols == 0 ? 0 : t.elements / cols, cols);
    if (i != static_cast<std::size_t>(t.elements))
      detail::fail(Errc::BadFile,
                   "{}: tensor {} ({}), element {} (row {}, column {}) is not finite: a model's "
                   "weights must be finite",
                   file, tname, t.dtype_name, i, i / static_cast<std::size_t>(cols),
                   i % static_cast<std::size_t>(cols));
  }
  for (std::size_t i = 0; i < seen.size(); ++i)
    if (!seen[i])
      detail::fail(Errc::BadFile, "{}: tensor model.layers.{}.{}.weight is missing ({} says num_hidden_layers = {})",
                   dir.string(), i / kHfLayer.size(), kHfLayer[i % kHfLayer.size()].suffix, cfg_name,
                   c.n_layers);
  auto tensor = [&](const std::string& tname) -> const SafetensorsTensor& {
    const auto it = by_name.find(tname);
    if (it == by_name.end())
      detail::fail(Errc::BadFile, "{}: tensor {} is missing", dir.string(), tname);
    return *it->second.first;
  };
  auto matrix = [&](const std::string& tname) {
    const SafetensorsTensor& t = tensor(tname);
    return WeightMatrix(t.data, t.dtype);
  };
  // A norm gain as float32: in place when the file has it so, else widened (exactly) into an
  // owned copy (HF's bf16 and fp16 checkpoints store the gains in the checkpoint's dtype).
  auto gain = [&](const std::string& tname) -> const float* {
    const SafetensorsTensor& t = tensor(tname);
    if (t.dtype == DType::F32) return reinterpret_cast<const float*>(t.data);
    std::vector<float>& g = storage->gains.emplace_back(static_cast<std::size_t>(t.elements));
    dequantize_rows(WeightMatrix(t.data, t.dtype), t.elements, 0, 1, g.data());
    return g.data();
  };
  w.token_embedding = matrix("model.embed_tokens.weight");
  w.rms_final = gain("model.norm.weight");
  if (c.shared_classifier) {
    if (by_name.count("lm_head.weight"))
      detail::fail(Errc::BadFile,
                   "{}: tensor lm_head.weight is present, but {} says tie_word_embeddings = true",
                   dir.string(), cfg_name);
    w.wcls = w.token_embedding;
  } else {
    w.wcls = matrix("lm_head.weight");
  }
  w.layers.assign(static_cast<std::size_t>(c.n_layers), DecoderWeights{});
  for (std::size_t l = 0; l < w.layers.size(); ++l)
    for (const LayerTensor& lt : kHfLayer) {
      const std::string tname = fmt::format("model.layers.{}.{}.weight", l, lt.suffix);
      if (lt.gain != nullptr) {
        w.layers[l].*lt.gain = gain(tname);
        continue;
      }
      WeightMatrix m = matrix(tname);
      if (lt.suffix == "self_attn.q_proj" || lt.suffix == "self_attn.k_proj") {
        const int heads = lt.suffix == "self_attn.q_proj" ? c.n_heads : c.n_kv_heads;
        storage->matrices.push_back(unpermute(static_cast<const std::byte*>(m.data), heads,
                                              c.head_size(), weight_row_bytes(m.dtype, c.dim)));
        m.data = storage->matrices.back().data();
      }
      w.layers[l].*lt.matrix = m;
    }
  w.storage = std::shared_ptr<const void>(storage, storage.get());
  w.mapped = false;
  return w;
}

}  // namespace v0
}  // namespace brigade::model
