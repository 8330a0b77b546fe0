// Differential tests of CudaBackend::decoder_layer_forward against the decoder layer on CpuBackend on
// a packed micro-batch (a prefill, a decode and a chunked prefill with pre-filled caches), in
// float32 and bfloat16, through each attention path.
#include "support.hpp"

#include <brigade/backend/cpu_backend.hpp>
#include <brigade/backend/decoder.hpp>
#include <brigade/model/weights.hpp>

#include <algorithm>
#include <cstdint>

using namespace brigade;
using namespace brigade::cuda::test;
using cuda::AttentionPath;
using cuda::CudaBackend;
using brigade::DType;

namespace {

struct Seq {
  std::int64_t tokens, pos0, capacity;
};

/// Runs one layer on the CPU and on the GPU over the same inputs and compares the change of the
/// residual stream and the cache rows the layer wrote.
void check_layer(const model::LlamaConfig& cfg, const std::vector<Seq>& seqs, DType dt,
                 AttentionPath path, double f32_tol) {
  CAPTURE(brigade::to_string(dt));
  CAPTURE(static_cast<int>(path));
  const auto weights = model::make_synthetic_weights(cfg, 42);
  const model::DecoderWeights& lw = weights.layers[0];
  const std::int64_t dim = cfg.dim, kv_dim = cfg.kv_dim();
  std::int64_t tokens = 0;
  for (const auto& s : seqs) tokens += s.tokens;
  const auto x0 = random_floats(tokens * dim, 5);

  // CPU reference: caches pre-filled with random rows below pos0 (earlier steps' keys/values),
  // sequence i in slot i of one layer cache (keys of every slot, then values).
  std::vector<std::vector<float>> kc, vc;
  std::vector<backend::SequenceSlice> cslices;
  std::vector<std::int64_t> first;
  std::vector<int> caps;
  std::int64_t cache_rows = 0;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    kc.push_back(random_floats(seqs[i].capacity * kv_dim, 300 + static_cast<unsigned>(i)));
    vc.push_back(random_floats(seqs[i].capacity * kv_dim, 400 + static_cast<unsigned>(i)));
    cslices.push_back({static_cast<std::int32_t>(i), static_cast<std::int32_t>(seqs[i].pos0),
                       static_cast<std::int32_t>(seqs[i].tokens)});
    first.push_back(cache_rows);
    caps.push_back(static_cast<int>(seqs[i].capacity));
    cache_rows += seqs[i].capacity;
  }
  auto kc0 = kc, vc0 = vc;  // the GPU starts from the same caches
  std::vector<float> cache(static_cast<std::size_t>(2 * cache_rows * kv_dim));
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    std::copy(kc[i].begin(), kc[i].end(), cache.begin() + first[i] * kv_dim);
    std::copy(vc[i].begin(), vc[i].end(), cache.begin() + (cache_rows + first[i]) * kv_dim);
  }
  const backend::KvCacheView view{cache.data(), cache.data() + cache_rows * kv_dim, DType::F32, kv_dim,
                                  first, caps};
  std::vector<float> x_ref = x0;
  backend::DecoderBuffers<cpu::CpuBackend> scratch;
  cpu::CpuBackend cpu_backend;
  backend::decoder_layer_forward(cpu_backend, cfg, lw, x_ref.data(), tokens, cslices, view,
                                 scratch);
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    std::copy_n(cache.begin() + first[i] * kv_dim, kc[i].size(), kc[i].begin());
    std::copy_n(cache.begin() + (cache_rows + first[i]) * kv_dim, vc[i].size(), vc[i].begin());
  }

  CudaBackend::Options opt;
  opt.attention = path;
  opt.attention_scratch_bytes = 64 * 1024;  // several row blocks on the GEMM path
  CudaBackend gpu(opt);
  const auto dw = gpu.upload_decoder_weights(cfg, lw, dt);
  auto gx = make_input(gpu, x0, DType::F32);
  // The same slots on the GPU: every slot's keys in one buffer, values in another, in dt.
  std::vector<float> k_all, v_all;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    k_all.insert(k_all.end(), kc0[i].begin(), kc0[i].end());
    v_all.insert(v_all.end(), vc0[i].begin(), vc0[i].end());
  }
  auto gk = make_input(gpu, k_all, dt);
  auto gv = make_input(gpu, v_all, dt);
  const backend::KvCacheView gcache{gk.data(), gv.data(), dt, kv_dim, first, caps};
  gpu.decoder_layer_forward(cfg, dw, gx.as<float>(), tokens, cslices, gcache);
  const auto x_gpu = gx.floats(DType::F32);
  gx.check_guards("x");

  // The layer's contribution (x_after - x_before): the residual would hide its errors.
  std::vector<float> d_ref(x0.size()), d_gpu(x0.size());
  for (std::size_t i = 0; i < x0.size(); ++i) {
    d_ref[i] = x_ref[i] - x0[i];
    d_gpu[i] = x_gpu[i] - x0[i];
  }
  check_close("decoder delta x", d_gpu, d_ref, tolerance(dt, f32_tol));
  const auto k_gpu = gk.floats(dt);
  const auto v_gpu = gv.floats(dt);
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    CAPTURE(i);
    const auto rows = static_cast<std::size_t>((seqs[i].pos0 + seqs[i].tokens) * kv_dim);
    const auto at = static_cast<std::size_t>(first[i] * kv_dim);
    check_close("k cache", std::span<const float>(k_gpu).subspan(at, rows),
                std::span<const float>(kc[i]).first(rows), tolerance(dt, f32_tol));
    check_close("v cache", std::span<const float>(v_gpu).subspan(at, rows),
                std::span<const float>(vc[i]).first(rows), tolerance(dt, f32_tol));
  }
  gk.check_guards("k cache");
  gv.check_guards("v cache");
}

model::LlamaConfig small_config() {
  model::LlamaConfig c;
  c.dim = 64;
  c.hidden_dim = 172;
  c.n_layers = 1;
  c.n_heads = 8;
  c.n_kv_heads = 4;
  c.vocab_size = 32;
  c.seq_len = 128;
  return c;
}

}  // namespace

TEST_SUITE("decoder") {
  TEST_CASE(
      "cuda.decoder_layer_forward: stories260K-shaped layer, prefill + decode + chunked "
      "prefill packed, every attention path, f32 and bf16, vs the CPU layer") {
    const auto cfg = small_config();
    const std::vector<Seq> seqs = {{20, 0, 40}, {1, 30, 31}, {7, 5, 12}};
    for (DType dt : {DType::F32, DType::BF16})
      for (AttentionPath path : {AttentionPath::Direct, AttentionPath::Gemm, AttentionPath::Auto})
        check_layer(cfg, seqs, dt, path, 2e-5);
  }

  TEST_CASE(
      "cuda.decoder_layer_forward: wider layer (dim 256, 8 heads, 2 KV heads, head 32), "
      "two long prefills") {
    model::LlamaConfig cfg = small_config();
    cfg.dim = 256;
    cfg.hidden_dim = 688;
    cfg.n_kv_heads = 2;
    cfg.seq_len = 256;
    const std::vector<Seq> seqs = {{100, 0, 100}, {90, 37, 200}};
    for (DType dt : {DType::F32, DType::BF16})
      check_layer(cfg, seqs, dt, AttentionPath::Auto, 2e-5);
  }

  TEST_CASE("cuda.decoder_layer_forward: bad slices and positions are refused like the CPU's") {
    const auto cfg = small_config();
    const auto weights = model::make_synthetic_weights(cfg, 1);
    CudaBackend gpu;
    const auto dw = gpu.upload_decoder_weights(cfg, weights.layers[0], DType::F32);
    Guarded x(gpu, 4 * 64, 4), keys(gpu, 256 * 32, 4), values(gpu, 256 * 32, 4);
    const std::vector<std::int64_t> first{0, 128};
    const std::vector<int> caps{128, 128};
    const backend::KvCacheView cache{keys.data(), values.data(), DType::F32, cfg.kv_dim(), first,
                                     caps};
    auto expect_invalid = [&](std::vector<backend::SequenceSlice> s, std::int64_t tokens,
                              backend::KvCacheView c) {
      try {
        gpu.decoder_layer_forward(cfg, dw, x.as<float>(), tokens, s, c);
        FAIL("expected brigade::Error{InvalidArgument}");
      } catch (const brigade::Error& e) {
        CHECK(e.code() == brigade::Errc::InvalidArgument);
      }
    };
    expect_invalid({{0, 0, 3}}, 4, cache);                 // does not cover
    expect_invalid({{0, 126, 4}}, 4, cache);               // beyond seq_len
    expect_invalid({{2, 0, 4}}, 4, cache);                 // a sequence the cache does not hold
    expect_invalid({{0, 0, 0}, {1, 0, 4}}, 4, cache);      // an empty slice
    backend::KvCacheView wrong = cache;
    wrong.dtype = DType::BF16;                             // not the weights' dtype
    expect_invalid({{0, 0, 4}}, 4, wrong);
    backend::KvCacheView null_keys = cache;
    null_keys.keys = nullptr;                              // no cache memory
    expect_invalid({{0, 0, 4}}, 4, null_keys);
  }

}  // TEST_SUITE
