// CudaLlama: a whole Llama model on one GPU (embedding, decoder layers, final norm, classifier),
// with a KV cache per sequence; run.c's greedy generation on top.
#include "brigade/backend/cuda.hpp"

#include "brigade/core/error.hpp"

#include <algorithm>

namespace brigade::cuda {
inline namespace v0 {
namespace {
std::size_t usize(std::int64_t n) { return static_cast<std::size_t>(n); }
}  // namespace

struct CudaLlama::Impl {
  CudaBackend* gpu = nullptr;
  model::LlamaConfig config;
  DType dtype = DType::F32;
  std::vector<int> capacities;
  std::vector<std::int64_t> cache_offsets;  // first KV row of each sequence
  std::int64_t cache_rows = 0;              // sum of capacities
  DeviceBuffer embedding;                   // [vocab x dim] float32
  std::vector<DeviceDecoderWeights> layers;
  DeviceBuffer rms_final;                   // [dim] float32
  DeviceBuffer wcls;                        // [vocab x dim] in dtype
  std::vector<DeviceBuffer> kv;             // per layer: K rows then V rows, in dtype
  DeviceBuffer ids, x, last, logits, next;  // grow-only activations
  std::vector<SequenceSlice> slices;
  std::vector<std::int32_t> ids_host;

  void* grow(DeviceBuffer& b, std::size_t bytes) {
    if (b.size() < bytes) {
      b = DeviceBuffer();
      b = gpu->allocate(std::max<std::size_t>(bytes, 256));
    }
    return b.data();
  }

  /// Runs every layer; leaves the logits of each sequence's last row in `logits`.
  void run(std::span<const Step> steps, std::span<const int> token_ids) {
    const auto& c = config;
    std::int64_t tokens = 0;
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const Step& s = steps[i];
      BRIGADE_CHECK(s.seq >= 0 && s.seq < static_cast<int>(capacities.size()),
                    Errc::InvalidArgument, "CudaLlama: sequence id {} outside [0, {})", s.seq,
                    capacities.size());
      BRIGADE_CHECK(s.tokens >= 1 && s.pos0 >= 0 &&
                        s.pos0 + s.tokens <= capacities[static_cast<std::size_t>(s.seq)],
                    Errc::InvalidArgument,
                    "CudaLlama: sequence {} positions [{}, {}) exceed its KV capacity {}", s.seq,
                    s.pos0, s.pos0 + s.tokens, capacities[static_cast<std::size_t>(s.seq)]);
      tokens += s.tokens;
    }
    BRIGADE_CHECK(static_cast<std::int64_t>(token_ids.size()) == tokens, Errc::InvalidArgument,
                  "CudaLlama: {} token ids for {} tokens", token_ids.size(), tokens);
    ids_host.assign(token_ids.begin(), token_ids.end());
    for (auto id : ids_host)
      BRIGADE_CHECK(id >= 0 && id < c.vocab_size, Errc::InvalidArgument,
                    "CudaLlama: token id {} outside the vocabulary [0, {})", id, c.vocab_size);
    const std::int64_t dim = c.dim;
    const std::size_t es = dtype_block_bytes(dtype);
    auto* d_ids = static_cast<std::int32_t*>(grow(ids, usize(tokens) * sizeof(std::int32_t)));
    auto* d_x = static_cast<float*>(grow(x, usize(tokens * dim) * sizeof(float)));
    gpu->upload(d_ids, ids_host.data(), ids_host.size() * sizeof(std::int32_t));
    gpu->embedding(embedding.as<float>(), d_ids, d_x, tokens, dim);

    slices.clear();
    std::int64_t off = 0;
    for (const Step& s : steps) {
      slices.push_back({off, s.tokens, s.pos0, nullptr, nullptr});
      off += s.tokens;
    }
    const std::int64_t kv_dim = c.kv_dim();
    for (std::size_t l = 0; l < layers.size(); ++l) {
      auto* base = static_cast<char*>(kv[l].data());
      for (std::size_t i = 0; i < steps.size(); ++i) {
        const std::int64_t row = cache_offsets[static_cast<std::size_t>(steps[i].seq)];
        slices[i].k_cache = base + usize(row * kv_dim) * es;
        slices[i].v_cache = base + usize((cache_rows + row) * kv_dim) * es;
      }
      gpu->decoder_layer_forward(c, layers[l], d_x, tokens, slices);
    }
    const auto n = static_cast<std::int64_t>(steps.size());
    auto* d_last = static_cast<float*>(grow(last, usize(n * dim) * sizeof(float)));
    for (std::int64_t i = 0; i < n; ++i) {
      const SequenceSlice& s = slices[static_cast<std::size_t>(i)];
      gpu->copy(d_last + i * dim, d_x + (s.offset + s.tokens - 1) * dim,
                usize(dim) * sizeof(float));
    }
    auto* d_logits = static_cast<float*>(grow(logits, usize(n * c.vocab_size) * sizeof(float)));
    gpu->classifier(d_last, rms_final.as<float>(), wcls.data(), dtype, d_logits, n, dim,
                    c.vocab_size, c.norm_eps);
  }
};

CudaLlama::CudaLlama(CudaBackend& backend, const model::LlamaWeights& weights, DType dtype,
                     std::span<const int> capacities)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.gpu = &backend;
  m.config = weights.config;
  m.dtype = dtype;
  const auto& c = m.config;
  c.validate("CudaLlama");
  BRIGADE_CHECK(dtype == DType::F32 || dtype == DType::BF16, Errc::InvalidArgument,
                "CudaLlama: dtype {} is not supported on the GPU (f32, bf16)", to_string(dtype));
  BRIGADE_CHECK(static_cast<int>(weights.layers.size()) == c.n_layers && weights.token_embedding &&
                    weights.rms_final && weights.wcls,
                Errc::InvalidArgument,
                "CudaLlama: the weights have {} layers for n_layers = {} (or a null tensor)",
                weights.layers.size(), c.n_layers);
  for (std::size_t i = 0; i < capacities.size(); ++i) {
    BRIGADE_CHECK(capacities[i] >= 1 && capacities[i] <= c.seq_len, Errc::InvalidArgument,
                  "CudaLlama: sequence {} needs {} positions, the model's seq_len is {}", i,
                  capacities[i], c.seq_len);
    m.cache_offsets.push_back(m.cache_rows);
    m.cache_rows += capacities[i];
  }
  m.capacities.assign(capacities.begin(), capacities.end());
  const std::int64_t dim = c.dim, vocab = c.vocab_size;
  // The embedding table and the classifier go up as float32 (a typed host table is
  // dequantized on the host first: exact).
  std::vector<float> emb_f32, cls_f32;
  auto host_f32 = [&](model::WeightMatrix t, std::vector<float>& buf) {
    if (t.dtype == brigade::DType::F32) return t.f32();
    buf.resize(usize(vocab * dim));
    model::dequantize_rows(t, dim, 0, vocab, buf.data());
    return static_cast<const float*>(buf.data());
  };
  m.embedding = backend.allocate(usize(vocab * dim) * sizeof(float));
  backend.upload(m.embedding.data(), host_f32(weights.token_embedding, emb_f32),
                 m.embedding.size());
  m.rms_final = backend.allocate(usize(dim) * sizeof(float));
  backend.upload(m.rms_final.data(), weights.rms_final, m.rms_final.size());
  m.wcls = backend.allocate(usize(vocab * dim) * dtype_block_bytes(dtype));
  const float* wcls = host_f32(weights.wcls, cls_f32);
  if (dtype == DType::F32) {
    backend.upload(m.wcls.data(), wcls, m.wcls.size());
  } else {
    DeviceBuffer tmp = backend.allocate(usize(vocab * dim) * sizeof(float));
    backend.upload(tmp.data(), wcls, tmp.size());
    backend.convert(tmp.data(), DType::F32, m.wcls.data(), dtype, vocab * dim);
    backend.synchronize();
  }
  for (const auto& lw : weights.layers) {
    m.layers.push_back(backend.upload_decoder_weights(c, lw, dtype));
    m.kv.push_back(backend.allocate(usize(2 * m.cache_rows * c.kv_dim()) * dtype_block_bytes(dtype)));
  }
  backend.synchronize();
}

CudaLlama::~CudaLlama() = default;
CudaLlama::CudaLlama(CudaLlama&&) noexcept = default;
CudaLlama& CudaLlama::operator=(CudaLlama&&) noexcept = default;

const model::LlamaConfig& CudaLlama::config() const noexcept { return impl_->config; }

std::vector<float> CudaLlama::forward(std::span<const Step> steps, std::span<const int> ids) {
  impl_->run(steps, ids);
  std::vector<float> out(steps.size() * static_cast<std::size_t>(impl_->config.vocab_size));
  impl_->gpu->download(out.data(), impl_->logits.data(), out.size() * sizeof(float));
  return out;
}

std::vector<int> CudaLlama::forward_greedy(std::span<const Step> steps, std::span<const int> ids) {
  Impl& m = *impl_;
  m.run(steps, ids);
  const auto n = static_cast<std::int64_t>(steps.size());
  auto* d_next = static_cast<std::int32_t*>(m.grow(m.next, usize(n) * sizeof(std::int32_t)));
  m.gpu->argmax(m.logits.as<float>(), d_next, n, m.config.vocab_size);
  std::vector<std::int32_t> next(usize(n));
  m.gpu->download(next.data(), d_next, next.size() * sizeof(std::int32_t));
  return {next.begin(), next.end()};
}

std::vector<int> CudaLlama::generate_greedy(std::span<const int> prompt, int steps, int seq) {
  constexpr int kBos = 1;
  BRIGADE_CHECK(!prompt.empty(), Errc::InvalidArgument,
                "CudaLlama::generate_greedy: empty prompt; expected at least BOS");
  BRIGADE_CHECK(seq >= 0 && seq < static_cast<int>(impl_->capacities.size()), Errc::InvalidArgument,
                "CudaLlama::generate_greedy: sequence {} outside [0, {})", seq,
                impl_->capacities.size());
  const int plen = static_cast<int>(prompt.size());
  BRIGADE_CHECK(steps >= plen && steps <= impl_->capacities[static_cast<std::size_t>(seq)],
                Errc::InvalidArgument,
                "CudaLlama::generate_greedy: steps = {}; expected within [prompt length {}, "
                "capacity {}]",
                steps, plen, impl_->capacities[static_cast<std::size_t>(seq)]);
  std::vector<int> all(prompt.begin(), prompt.end());
  // run.c forwards positions 0..steps-1 and samples after every position >= plen - 1.
  Step step{seq, 0, plen};
  std::vector<int> ids(prompt.begin(), prompt.end());
  for (int pos = plen - 1; pos < steps; ++pos) {
    const int next = forward_greedy(std::span<const Step>(&step, 1), ids)[0];
    if (next == kBos) break;
    all.push_back(next);
    step = Step{seq, pos + 1, 1};
    ids.assign(1, next);
  }
  return all;
}

}  // namespace v0
}  // namespace brigade::cuda
