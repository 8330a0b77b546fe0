// Differential tests: every CudaBackend kernel against the CPU backend on random inputs, with a
// per-kernel tolerance (relative L2: float32 ~1e-5, bfloat16 ~1e-2), outputs poisoned with NaN
// before each run and guard bands around them checked after. Run only with a GPU (main.cpp).
#include "support.hpp"

#include <brigade/backend/cpu.hpp>
#include <brigade/model/sampler.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>

using namespace brigade;
using namespace brigade::cuda::test;
using cuda::AttentionPath;
using cuda::CudaBackend;
using brigade::DType;

namespace {

CudaBackend& gpu() {
  static CudaBackend backend;
  return backend;
}

const DType kDtypes[] = {DType::F32, DType::BF16};

}  // namespace

TEST_SUITE("kernels") {
  TEST_CASE("cuda.rmsnorm: f32 and bf16 outputs vs cpu::rmsnorm (tokens 7, dim 96)") {
    const std::int64_t tokens = 7, dim = 96;
    const auto x = random_floats(tokens * dim, 1);
    const auto w = random_floats(dim, 2);
    std::vector<float> ref(x.size());
    cpu::rmsnorm(x.data(), w.data(), ref.data(), tokens, dim, 1e-5f);
    for (DType dt : kDtypes) {
      CAPTURE(brigade::to_string(dt));
      auto gx = make_input(gpu(), x, DType::F32);
      auto gw = make_input(gpu(), w, DType::F32);
      Guarded out(gpu(), x.size(), brigade::dtype_block_bytes(dt));
      gpu().rmsnorm(gx.as<float>(), gw.as<float>(), out.data(), dt, tokens, dim, 1e-5f);
      check_close("rmsnorm", out.floats(dt), ref, tolerance(dt));
      out.check_guards("rmsnorm out");
      gx.check_guards("rmsnorm x");
    }
  }

  TEST_CASE(
      "cuda.matmul_wt: f32 and bf16 GEMMs with fp32 accumulation vs cpu::matmul_wt, "
      "odd shapes, plain and accumulating") {
    struct Shape {
      std::int64_t tokens, in, out;
    };
    for (const Shape s : {Shape{33, 96, 80}, Shape{1, 64, 512}, Shape{130, 257, 63}}) {
      CAPTURE(s.tokens);
      CAPTURE(s.in);
      CAPTURE(s.out);
      const auto x = random_floats(s.tokens * s.in, 3);
      const auto w = random_floats(s.out * s.in, 4, 0.05f);
      const auto base = random_floats(s.tokens * s.out, 5);
      std::vector<float> ref(base.size()), ref_acc = base;
      cpu::matmul_wt(x.data(), w.data(), ref.data(), s.tokens, s.in, s.out);
      cpu::matmul_wt_accumulate(x.data(), w.data(), ref_acc.data(), s.tokens, s.in, s.out);
      for (DType dt : kDtypes) {
        CAPTURE(brigade::to_string(dt));
        auto gx = make_input(gpu(), x, dt);
        auto gw = make_input(gpu(), w, dt);
        Guarded out(gpu(), ref.size(), 4);
        gpu().matmul_wt(gx.data(), gw.data(), dt, out.data(), DType::F32, s.tokens, s.in, s.out);
        check_close("matmul_wt", out.floats(DType::F32), ref, tolerance(dt));
        out.check_guards("matmul_wt out");

        auto acc = make_input(gpu(), base, DType::F32);
        gpu().matmul_wt(gx.data(), gw.data(), dt, acc.data(), DType::F32, s.tokens, s.in, s.out,
                        /*accumulate=*/true);
        check_close("matmul_wt accumulate", acc.floats(DType::F32), ref_acc, tolerance(dt));
        acc.check_guards("matmul_wt accumulate out");

        if (dt == DType::BF16) {
          Guarded out16(gpu(), ref.size(), 2);
          gpu().matmul_wt(gx.data(), gw.data(), dt, out16.data(), DType::BF16, s.tokens, s.in,
                          s.out);
          check_close("matmul_wt bf16 out", out16.floats(DType::BF16), ref, tolerance(dt));
          out16.check_guards("matmul_wt bf16 out");
        }
      }
    }
  }

  TEST_CASE("cuda.rope: adjacent pairs, run.c's frequencies, positions up to 511 vs cpu::rope") {
    const std::int64_t tokens = 9;
    const int n_heads = 6, n_kv = 2, hs = 16;
    auto q = random_floats(tokens * n_heads * hs, 6);
    auto k = random_floats(tokens * n_kv * hs, 7);
    std::vector<std::int32_t> pos = {0, 1, 2, 17, 100, 255, 256, 400, 511};
    auto gq = make_input(gpu(), q, DType::F32);
    auto gk = make_input(gpu(), k, DType::F32);
    Guarded gpos(gpu(), pos.size(), 4);
    gpos.set(pos.data());
    gpu().rope(gq.as<float>(), gk.as<float>(), gpos.as<std::int32_t>(), tokens, n_heads, n_kv, hs,
               10000.0f);
    cpu::rope(q.data(), k.data(), pos.data(), tokens, n_heads, n_kv, hs, 10000.0f);
    check_close("rope q", gq.floats(DType::F32), q, 1e-5);
    check_close("rope k", gk.floats(DType::F32), k, 1e-5);
    gq.check_guards("rope q");
    gk.check_guards("rope k");
  }

  TEST_CASE(
      "cuda.attention: varlen GQA with KV caches (prefill, decode, chunked prefill), "
      "direct and GEMM paths, f32 and bf16, vs cpu::attention") {
    const int n_heads = 8, n_kv = 2, hs = 16;
    const std::int64_t dim = n_heads * hs, kv_dim = n_kv * hs;
    struct Seq {
      std::int64_t tokens, pos0, capacity;
    };
    const std::vector<Seq> seqs = {{5, 0, 8}, {1, 17, 20}, {40, 9, 64}, {70, 0, 70}};
    std::int64_t tokens = 0;
    for (const auto& s : seqs) tokens += s.tokens;
    const auto q = random_floats(tokens * dim, 8);
    std::vector<std::vector<float>> kc, vc;
    std::vector<float> ref(tokens * dim);
    std::int64_t off = 0;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      kc.push_back(random_floats(seqs[i].capacity * kv_dim, 100 + static_cast<unsigned>(i)));
      vc.push_back(random_floats(seqs[i].capacity * kv_dim, 200 + static_cast<unsigned>(i)));
      cpu::attention(q.data() + off * dim, kc[i].data(), vc[i].data(), ref.data() + off * dim,
                     seqs[i].tokens, seqs[i].pos0, n_heads, n_kv, hs);
      off += seqs[i].tokens;
    }
    // A backend with a tiny scratch budget makes the GEMM path walk several row blocks.
    CudaBackend::Options small;
    small.attention_scratch_bytes = 16 * 1024;
    CudaBackend blocked(small);
    for (DType dt : kDtypes) {
      for (AttentionPath path : {AttentionPath::Direct, AttentionPath::Gemm, AttentionPath::Auto}) {
        for (CudaBackend* b : {&gpu(), &blocked}) {
          CAPTURE(brigade::to_string(dt));
          CAPTURE(static_cast<int>(path));
          CAPTURE(b == &blocked);
          auto gq = make_input(*b, q, dt);
          // Sequence i in slot i of one cache: every slot's keys in one buffer, values in another.
          std::vector<float> k_all, v_all;
          std::vector<std::int64_t> first;
          std::vector<int> caps;
          std::vector<backend::SequenceSlice> slices;
          for (std::size_t i = 0; i < seqs.size(); ++i) {
            first.push_back(static_cast<std::int64_t>(k_all.size()) / kv_dim);
            caps.push_back(static_cast<int>(seqs[i].capacity));
            k_all.insert(k_all.end(), kc[i].begin(), kc[i].end());
            v_all.insert(v_all.end(), vc[i].begin(), vc[i].end());
            slices.push_back({static_cast<std::int32_t>(i), static_cast<std::int32_t>(seqs[i].pos0),
                              static_cast<std::int32_t>(seqs[i].tokens)});
          }
          auto gk = make_input(*b, k_all, dt);
          auto gv = make_input(*b, v_all, dt);
          const backend::KvCacheView cache{gk.data(), gv.data(), dt, kv_dim, first, caps};
          Guarded out(*b, ref.size(), brigade::dtype_block_bytes(dt));
          b->attention(dt, gq.data(), out.data(), slices, cache, n_heads, n_kv, hs, path);
          check_close("attention", out.floats(dt), ref, tolerance(dt, 2e-5));
          out.check_guards("attention out");
          gk.check_guards("k cache");
        }
      }
    }
  }

  TEST_CASE("cuda.attention: slices the cache does not hold are refused") {
    Guarded dummy(gpu(), 16, 4);
    const std::vector<std::int64_t> first{0};
    const std::vector<int> caps{4};
    const backend::KvCacheView cache{dummy.data(), dummy.data(), DType::F32, 2, first, caps};
    auto expect_invalid = [&](std::vector<backend::SequenceSlice> s) {
      try {
        gpu().attention(DType::F32, dummy.data(), dummy.data(), s, cache, 2, 1, 2);
        FAIL("expected brigade::Error");
      } catch (const brigade::Error& e) {
        CHECK(e.code() == brigade::Errc::InvalidArgument);
      }
    };
    expect_invalid({{1, 0, 2}});          // sequence 1: the cache holds one
    expect_invalid({{0, 3, 2}});          // positions [3, 5) past its capacity 4
    expect_invalid({{0, 0, 0}});          // an empty slice
  }

  TEST_CASE("cuda.swiglu: f32 in place and bf16 out vs cpu::swiglu") {
    const std::int64_t n = 1000;
    const auto g = random_floats(n, 9, 3.0f);
    const auto u = random_floats(n, 10);
    std::vector<float> ref = g;
    cpu::swiglu(ref.data(), u.data(), n);
    for (DType dt : kDtypes) {
      CAPTURE(brigade::to_string(dt));
      auto gg = make_input(gpu(), g, DType::F32);
      auto gu = make_input(gpu(), u, DType::F32);
      Guarded out(gpu(), n, brigade::dtype_block_bytes(dt));
      gpu().swiglu(gg.as<float>(), gu.as<float>(), out.data(), dt, n);
      check_close("swiglu", out.floats(dt), ref, tolerance(dt));
      out.check_guards("swiglu out");
    }
    auto gg = make_input(gpu(), g, DType::F32);
    auto gu = make_input(gpu(), u, DType::F32);
    gpu().swiglu(gg.as<float>(), gu.as<float>(), gg.data(), DType::F32, n);  // in place
    check_close("swiglu in place", gg.floats(DType::F32), ref, 1e-5);
  }

  TEST_CASE("cuda.embedding: rows copied exactly") {
    const std::int64_t vocab = 50, dim = 24, tokens = 6;
    const auto table = random_floats(vocab * dim, 11);
    std::vector<std::int32_t> ids = {0, 49, 7, 7, 1, 30};
    std::vector<float> ref(tokens * dim);
    cpu::embedding(table.data(), ids.data(), ref.data(), tokens, dim);
    auto gt = make_input(gpu(), table, DType::F32);
    Guarded gids(gpu(), ids.size(), 4);
    gids.set(ids.data());
    Guarded out(gpu(), ref.size(), 4);
    gpu().embedding(gt.as<float>(), gids.as<std::int32_t>(), out.as<float>(), tokens, dim);
    CHECK(out.floats(DType::F32) == ref);
    out.check_guards("embedding out");
  }

  TEST_CASE("cuda.convert: float32 -> bfloat16 rounds to nearest even, and back exactly") {
    auto v = random_floats(4097, 12, 100.0f);
    v[0] = 0.0f;
    v[1] = -0.0f;
    v[2] = 1.0f + 1.0f / 256.0f;  // a tie: rounds to even
    auto src = make_input(gpu(), v, DType::F32);
    Guarded b16(gpu(), v.size(), 2);
    Guarded back(gpu(), v.size(), 4);
    gpu().convert(src.data(), DType::F32, b16.data(), DType::BF16,
                  static_cast<std::int64_t>(v.size()));
    gpu().convert(b16.data(), DType::BF16, back.data(), DType::F32,
                  static_cast<std::int64_t>(v.size()));
    std::vector<float> ref(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) ref[i] = from_bf16(to_bf16(v[i]));
    CHECK(back.floats(DType::F32) == ref);
    b16.check_guards("bf16");
    back.check_guards("back");
  }

  TEST_CASE("cuda.classifier: rmsnorm then x Wcls^T, f32 and bf16 weights") {
    const std::int64_t rows = 3, dim = 64, vocab = 512;
    const auto x = random_floats(rows * dim, 13);
    const auto rms = random_floats(dim, 14);
    const auto w = random_floats(vocab * dim, 15, 0.1f);
    std::vector<float> xn(x.size()), ref(rows * vocab);
    cpu::rmsnorm(x.data(), rms.data(), xn.data(), rows, dim, 1e-5f);
    cpu::matmul_wt(xn.data(), w.data(), ref.data(), rows, dim, vocab);
    for (DType dt : kDtypes) {
      CAPTURE(brigade::to_string(dt));
      auto gx = make_input(gpu(), x, DType::F32);
      auto gr = make_input(gpu(), rms, DType::F32);
      auto gw = make_input(gpu(), w, dt);
      Guarded logits(gpu(), ref.size(), 4);
      gpu().classifier(gx.as<float>(), gr.as<float>(), gw.data(), dt, logits.as<float>(), rows, dim,
                       vocab, 1e-5f);
      check_close("classifier", logits.floats(DType::F32), ref, tolerance(dt));
      logits.check_guards("logits");
    }
  }

  TEST_CASE("cuda.argmax: first index of the maximum, as run.c") {
    const std::int64_t rows = 5, vocab = 32000;
    auto logits = random_floats(rows * vocab, 16);
    logits[1 * vocab + 700] = 50.0f;  // planted ties: the first wins
    logits[1 * vocab + 9000] = 50.0f;
    logits[3 * vocab + 0] = 60.0f;
    logits[4 * vocab + vocab - 1] = 70.0f;
    std::vector<std::int32_t> ref(rows);
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* row = logits.data() + r * vocab;
      std::int32_t best = 0;
      for (std::int64_t j = 1; j < vocab; ++j)
        if (row[j] > row[best]) best = static_cast<std::int32_t>(j);
      ref[static_cast<std::size_t>(r)] = best;
    }
    auto gl = make_input(gpu(), logits, DType::F32);
    Guarded out(gpu(), rows, 4);
    gpu().argmax(gl.as<float>(), out.as<std::int32_t>(), rows, vocab);
    CHECK(out.ints() == ref);
    out.check_guards("argmax out");
  }

  TEST_CASE(
      "cuda.sample: temperature sampling with the CPU sampler's coins gives its tokens and "
      "probabilities") {
    const std::int64_t rows = 16, vocab = 512;
    const float temperature = 0.9f;
    const auto logits = random_floats(rows * vocab, 17, 2.0f);
    std::vector<float> coins;
    std::vector<std::int32_t> ref_tokens;
    std::vector<float> ref_probs = logits;
    for (std::int64_t r = 0; r < rows; ++r) {
      const model::SamplerConfig sc{temperature, 1.0f, 1000 + static_cast<std::uint64_t>(r)};
      model::Sampler for_coin(static_cast<int>(vocab), sc);
      coins.push_back(for_coin.random_f32());
      model::Sampler ref(static_cast<int>(vocab), sc);
      ref_tokens.push_back(ref.sample(
          std::span<float>(ref_probs.data() + r * vocab, static_cast<std::size_t>(vocab))));
    }
    auto gl = make_input(gpu(), logits, DType::F32);
    Guarded out(gpu(), rows, 4);
    gpu().sample(gl.as<float>(), rows, vocab, temperature, 1.0f, coins, out.as<std::int32_t>());
    CHECK(out.ints() == ref_tokens);
    check_close("sample probabilities", gl.floats(DType::F32), ref_probs, 1e-5);
    out.check_guards("sample out");
    CHECK_THROWS_AS(
        gpu().sample(gl.as<float>(), rows, vocab, temperature, 0.9f, coins, out.as<std::int32_t>()),
        brigade::Error);
  }

}  // TEST_SUITE
