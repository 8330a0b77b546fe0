// Typed weight matrices (model/weight_matrix.hpp) and typed models (model/weights.hpp):
// row layouts, exact dequantization, llama.cpp's Q8_0 quantization, convert_weights.
#include "brigade/model/weight_matrix.hpp"

#include "brigade/core/error.hpp"
#include "brigade/core/finite.hpp"
#include "brigade/model/weights.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace brigade::model {
inline namespace v0 {

namespace {

constexpr std::int64_t kQ8Block = 32;
constexpr std::size_t kQ8Bytes = 34;

std::size_t usize(std::int64_t n) { return static_cast<std::size_t>(n); }

void dequantize_q8_0_row(const std::byte* row, std::int64_t cols, float* out) {
  for (std::int64_t b = 0; b < cols / kQ8Block; ++b) {
    const std::byte* block = row + usize(b) * kQ8Bytes;
    std::uint16_t h;
    std::memcpy(&h, block, 2);
    const float d = f16_to_f32(h);
    const auto* q = reinterpret_cast<const std::int8_t*>(block + 2);
    for (std::int64_t i = 0; i < kQ8Block; ++i)
      out[b * kQ8Block + i] = static_cast<float>(q[i]) * d;
  }
}

void quantize_q8_0_row(const float* x, std::int64_t cols, std::byte* row) {
  for (std::int64_t b = 0; b < cols / kQ8Block; ++b) {
    const float* xb = x + b * kQ8Block;
    float amax = 0.0f;
    for (std::int64_t i = 0; i < kQ8Block; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    std::byte* block = row + usize(b) * kQ8Bytes;
    const std::uint16_t h = f32_to_f16(d);
    std::memcpy(block, &h, 2);
    auto* q = reinterpret_cast<std::int8_t*>(block + 2);
    for (std::int64_t i = 0; i < kQ8Block; ++i)
      q[i] = static_cast<std::int8_t>(std::round(xb[i] * id));
  }
}

}  // namespace

const float* WeightMatrix::f32() const {
  BRIGADE_CHECK(dtype == DType::F32, Errc::InvalidArgument,
                "a {} weight matrix is read where float32 is needed", to_string(dtype));
  return static_cast<const float*>(data);
}

void check_weight_shape(DType t, std::int64_t cols, const char* what) {
  BRIGADE_CHECK(is_weight_dtype(t), Errc::InvalidArgument,
                "{}: dtype {} is not a weight dtype (f32, f16, bf16, q8_0)", what, to_string(t));
  BRIGADE_CHECK(cols >= 0, Errc::InvalidArgument, "{}: row length {} is negative", what, cols);
  BRIGADE_CHECK(t != DType::Q8_0 || cols % kQ8Block == 0, Errc::InvalidArgument,
                "{}: q8_0 rows of {} elements are not whole blocks of 32 (rows are never padded)",
                what, cols);
}

std::size_t weight_row_bytes(DType t, std::int64_t cols) {
  check_weight_shape(t, cols, "weight_row_bytes");
  return dtype_bytes(t, cols);
}

void dequantize_rows(WeightMatrix w, std::int64_t cols, std::int64_t row0, std::int64_t rows,
                     float* out) {
  check_weight_shape(w.dtype, cols, "dequantize_rows");
  BRIGADE_CHECK(row0 >= 0 && rows >= 0, Errc::InvalidArgument,
                "dequantize_rows: row0 = {}, rows = {}; expected both >= 0", row0, rows);
  if (w.dtype == DType::Q8_0) {
    for (std::int64_t r = 0; r < rows; ++r)
      dequantize_q8_0_row(weight_row(w, cols, row0 + r), cols, out + r * cols);
    return;
  }
  convert_to_f32(weight_row(w, cols, row0), w.dtype, out, rows * cols);
}

std::size_t first_non_finite_weight(WeightMatrix w, std::int64_t rows, std::int64_t cols) {
  check_weight_shape(w.dtype, cols, "first_non_finite_weight");
  BRIGADE_CHECK(rows >= 0, Errc::InvalidArgument, "first_non_finite_weight: rows = {}; expected >= 0",
                rows);
  const std::size_t n = usize(rows) * usize(cols);
  const auto* bytes = static_cast<const std::byte*>(w.data);
  switch (w.dtype) {
    case DType::F32:
      return brigade::first_non_finite(static_cast<const float*>(w.data), n);
    case DType::F16:
    case DType::BF16: {
      const std::uint16_t exp_mask = w.dtype == DType::F16 ? 0x7c00 : 0x7f80;
      for (std::size_t i = 0; i < n; ++i) {
        std::uint16_t h;
        std::memcpy(&h, bytes + 2 * i, 2);
        if ((h & exp_mask) == exp_mask) return i;
      }
      return n;
    }
    case DType::Q8_0:
      for (std::size_t b = 0; b < n / 32; ++b) {
        std::uint16_t d;
        std::memcpy(&d, bytes + 34 * b, 2);
        if ((d & 0x7c00) == 0x7c00) return 32 * b;
      }
      return n;
    default:
      return n;  // check_weight_shape refused it
  }
}

void quantize_rows(const float* src, std::int64_t rows, std::int64_t cols, DType t, void* dst) {
  check_weight_shape(t, cols, "quantize_rows");
  BRIGADE_CHECK(rows >= 0, Errc::InvalidArgument, "quantize_rows: rows = {}; expected >= 0", rows);
  if (t == DType::Q8_0) {
    const std::size_t row_bytes = weight_row_bytes(t, cols);
    for (std::int64_t r = 0; r < rows; ++r)
      quantize_q8_0_row(src + r * cols, cols, static_cast<std::byte*>(dst) + usize(r) * row_bytes);
    return;
  }
  convert_from_f32(src, dst, t, rows * cols);
}

namespace {

/// Calls f(name, layer, matrix, rows, cols) for every matrix of a model (layer -1 outside the
/// decoder), the classifier only when it is not shared.
template <class F>
void for_each_matrix(const LlamaConfig& c, const LlamaWeights& w, F&& f) {
  const std::int64_t d = c.dim, kv = c.kv_dim(), h = c.hidden_dim, v = c.vocab_size;
  f("token_embedding", -1, w.token_embedding, v, d);
  for (std::size_t i = 0; i < w.layers.size(); ++i) {
    const DecoderWeights& x = w.layers[i];
    const int li = static_cast<int>(i);
    f("wq", li, x.wq, d, d);
    f("wk", li, x.wk, kv, d);
    f("wv", li, x.wv, kv, d);
    f("wo", li, x.wo, d, d);
    f("w1", li, x.w1, h, d);
    f("w2", li, x.w2, d, h);
    f("w3", li, x.w3, h, d);
  }
  if (!c.shared_classifier) f("wcls", -1, w.wcls, v, d);
}

std::string tensor_name(const char* name, int layer) {
  return layer < 0 ? std::string(name) : fmt::format("{} of layer {}", name, layer);
}

}  // namespace

std::vector<std::size_t> layer_weight_bytes(const LlamaWeights& w) {
  const LlamaConfig& c = w.config;
  BRIGADE_CHECK(static_cast<int>(w.layers.size()) == c.n_layers, Errc::InvalidArgument,
                "layer_weight_bytes: {} decoder layers; the config has n_layers = {}",
                w.layers.size(), c.n_layers);
  std::vector<std::size_t> bytes(w.layers.size() + 4, 0);
  const std::size_t gain = usize(c.dim) * sizeof(float);
  for (std::size_t i = 1; i <= w.layers.size(); ++i) bytes[i] = 2 * gain;
  bytes[w.layers.size() + 1] = gain;  // the final norm
  for_each_matrix(c, w, [&](const char* name, int layer, WeightMatrix m, std::int64_t rows,
                            std::int64_t cols) {
    // The embedding table is ModelSpec layer 0, decoder l is l + 1, the classifier n_layers + 2.
    const std::size_t at = layer >= 0                                  ? usize(layer) + 1
                           : std::string_view(name) == "token_embedding" ? 0
                                                                         : w.layers.size() + 2;
    bytes[at] += usize(rows) * weight_row_bytes(m.dtype, cols);
  });
  return bytes;
}

std::size_t weight_bytes(const LlamaWeights& w) {
  std::size_t total = 0;
  for (const std::size_t b : layer_weight_bytes(w)) total += b;
  return total;
}

bool all_f32(const LlamaWeights& w) noexcept {
  bool all = true;
  for_each_matrix(w.config, w, [&](const char*, int, WeightMatrix m, std::int64_t, std::int64_t) {
    all = all && m.dtype == DType::F32;
  });
  return all;
}

void require_f32(const LlamaWeights& w, const char* what) {
  for_each_matrix(w.config, w, [&](const char* name, int layer, WeightMatrix m, std::int64_t,
                                   std::int64_t) {
    BRIGADE_CHECK(m.dtype == DType::F32, Errc::InvalidArgument,
                  "{}: needs float32 weights, but {} is {} (convert the model with "
                  "convert_weights(w, DType::F32) first)",
                  what, tensor_name(name, layer), to_string(m.dtype));
  });
}

LlamaWeights convert_weights(const LlamaWeights& w, DType dtype) {
  const LlamaConfig& c = w.config;
  c.validate("convert_weights");
  BRIGADE_CHECK(is_weight_dtype(dtype), Errc::InvalidArgument,
                "convert_weights: dtype {} is not a weight dtype (f32, f16, bf16, q8_0)",
                to_string(dtype));
  BRIGADE_CHECK(static_cast<int>(w.layers.size()) == c.n_layers, Errc::InvalidArgument,
                "convert_weights: {} decoder layers; the config has n_layers = {}",
                w.layers.size(), c.n_layers);
  BRIGADE_CHECK(w.rms_final != nullptr, Errc::InvalidArgument,
                "convert_weights: rms_final is null");
  for (std::size_t i = 0; i < w.layers.size(); ++i)
    BRIGADE_CHECK(w.layers[i].rms_att && w.layers[i].rms_ffn, Errc::InvalidArgument,
                  "convert_weights: an RMSNorm gain of layer {} is null", i);
  // Check everything (and size the buffer) before converting anything.
  bool same = true;
  std::size_t total = 0;
  for_each_matrix(c, w, [&](const char* name, int layer, WeightMatrix m, std::int64_t rows,
                            std::int64_t cols) {
    const std::string t = tensor_name(name, layer);
    BRIGADE_CHECK(m.data != nullptr, Errc::InvalidArgument, "convert_weights: {} is null", t);
    BRIGADE_CHECK(is_weight_dtype(m.dtype), Errc::InvalidArgument,
                  "convert_weights: {} is {}, not a weight dtype (f32, f16, bf16, q8_0)", t,
                  to_string(m.dtype));
    if (m.dtype == dtype) return;  // kept as it is
    BRIGADE_CHECK(dtype != DType::Q8_0 || cols % kQ8Block == 0, Errc::InvalidArgument,
                  "convert_weights: {} has rows of {} elements, not whole q8_0 blocks of 32", t,
                  cols);
    same = false;
    total += (usize(rows) * weight_row_bytes(dtype, cols) + 63) / 64 * 64;
  });
  if (same) return w;

  auto buffer = std::make_shared<std::vector<std::byte>>(total);
  LlamaWeights out = w;
  std::size_t at = 0;
  std::vector<float> rows_f32;
  auto convert = [&](WeightMatrix m, std::int64_t rows, std::int64_t cols) {
    if (m.dtype == dtype) return m;  // the same view: exact, and no copy
    auto* dst = buffer->data() + at;
    at += (usize(rows) * weight_row_bytes(dtype, cols) + 63) / 64 * 64;
    if (dtype == DType::F32) {
      dequantize_rows(m, cols, 0, rows, reinterpret_cast<float*>(dst));
    } else if (m.dtype == DType::F32) {
      quantize_rows(m.f32(), rows, cols, dtype, dst);
    } else {
      // Narrow to another narrow type through float32 (the dequantization is exact), a block
      // of rows at a time.
      const std::int64_t block = std::max<std::int64_t>(1, 65536 / cols);
      rows_f32.resize(usize(std::min(block, rows) * cols));
      const std::size_t row_bytes = weight_row_bytes(dtype, cols);
      for (std::int64_t r = 0; r < rows; r += block) {
        const std::int64_t n = std::min(block, rows - r);
        dequantize_rows(m, cols, r, n, rows_f32.data());
        quantize_rows(rows_f32.data(), n, cols, dtype, dst + usize(r) * row_bytes);
      }
    }
    return WeightMatrix(dst, dtype);
  };
  const std::int64_t d = c.dim, kv = c.kv_dim(), h = c.hidden_dim, v = c.vocab_size;
  out.token_embedding = convert(w.token_embedding, v, d);
  for (std::size_t i = 0; i < w.layers.size(); ++i) {
    const DecoderWeights& x = w.layers[i];
    DecoderWeights& y = out.layers[i];
    y.wq = convert(x.wq, d, d);
    y.wk = convert(x.wk, kv, d);
    y.wv = convert(x.wv, kv, d);
    y.wo = convert(x.wo, d, d);
    y.w1 = convert(x.w1, h, d);
    y.w2 = convert(x.w2, d, h);
    y.w3 = convert(x.w3, h, d);
  }
  out.wcls = c.shared_classifier ? out.token_embedding : convert(w.wcls, v, d);
  // The norm gains (and anything else of `w`) stay in w's storage: keep both alive.
  struct Both {
    std::shared_ptr<const void> old;
    std::shared_ptr<std::vector<std::byte>> converted;
  };
  out.storage = std::make_shared<Both>(Both{w.storage, buffer});
  out.mapped = false;
  return out;
}

}  // namespace v0
}  // namespace brigade::model
