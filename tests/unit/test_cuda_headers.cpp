// The CUDA component's public headers compile with plain g++ and no CUDA on the include path
// (they declare over opaque handles), whether or not brigade::cuda was built; and the layout
// arithmetic of CudaBackend's cuBLAS calls (cuda/gemm_plan.hpp, pure C++) reproduces the CPU
// kernels when evaluated on the host with cuBLAS's column-major semantics. Nothing here needs a
// GPU or links brigade::cuda.
#include <brigade/backend/cpu.hpp>
#include <brigade/backend/cuda.hpp>
#include <brigade/config.hpp>
#include <brigade/transport/nccl.hpp>
#include <brigade/transport/nccl_collectives.hpp>

#include "../../cuda/gemm_plan.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#if defined(CUDART_VERSION) || defined(NCCL_MAJOR) || defined(__CUDA_RUNTIME_H__)
#error "brigade's public CUDA headers must not include cuda_runtime.h or nccl.h"
#endif

using namespace brigade;

static_assert(transport::Transport<transport::NcclTransport>);
static_assert(transport::Collectives<transport::NcclCollectives>);
static_assert(!std::is_copy_constructible_v<cuda::DeviceBuffer>);
static_assert(std::is_nothrow_move_constructible_v<cuda::DeviceBuffer>);
static_assert(std::is_nothrow_move_constructible_v<cuda::CudaBackend>);
static_assert(BRIGADE_HAS_CUDA == 0 || BRIGADE_HAS_CUDA == 1);

namespace {

std::vector<float> randoms(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

}  // namespace

TEST_CASE("cuda.headers: names and values usable without CUDA") {
  static_assert(backend::Backend<cuda::CudaBackend>);
  static_assert(!cuda::CudaBackend::host_memory);
  const backend::SequenceSlice s{0, 2, 4};
  CHECK(s.tokens == 4);
  const cuda::CudaBackend::Options o;
  CHECK(o.device == 0);
  CHECK(o.attention == cuda::AttentionPath::Auto);
  const transport::NcclUniqueId id;
  CHECK(id.bytes.size() == 128);
}

TEST_CASE("cuda.gemm_plan: plan_linear is x W^T (cpu::matmul_wt), plain and strided") {
  const std::int64_t tokens = 7, in = 12, out = 10;
  const auto x = randoms(tokens * in, 1);
  const auto w = randoms(out * in, 2);
  std::vector<float> ref(tokens * out), got(tokens * out, NAN);
  cpu::matmul_wt(x.data(), w.data(), ref.data(), tokens, in, out);
  cuda::detail::reference_gemm(cuda::detail::plan_linear(tokens, in, out), w.data(), x.data(),
                               got.data(), 1.0f, 0.0f);
  CHECK(rel_err(got, ref) < 1e-6);
  // Output rows inside a wider buffer (the fused QKV GEMM's layout).
  const std::int64_t stride = out + 5;
  std::vector<float> wide(tokens * stride, 0.0f);
  cuda::detail::reference_gemm(cuda::detail::plan_linear(tokens, in, out, in, in, stride), w.data(),
                               x.data(), wide.data(), 1.0f, 0.0f);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t n = 0; n < out; ++n)
      CHECK(std::abs(wide[t * stride + n] - ref[t * out + n]) < 1e-5f);
}

TEST_CASE(
    "cuda.gemm_plan: scores, causal softmax and PV plans reproduce cpu::attention "
    "(GQA, padded score rows, a block of rows inside a sequence)") {
  const int n_heads = 6, n_kv = 2, hs = 4;
  const std::int64_t dim = n_heads * hs, kv_dim = n_kv * hs;
  const std::int64_t tokens = 5, pos0 = 3, keys_total = pos0 + tokens;
  const auto q = randoms(tokens * dim, 3);
  const auto k = randoms(keys_total * kv_dim, 4);
  const auto v = randoms(keys_total * kv_dim, 5);
  std::vector<float> ref(tokens * dim);
  cpu::attention(q.data(), k.data(), v.data(), ref.data(), tokens, pos0, n_heads, n_kv, hs);

  // Rows [2, 5) of the sequence as one block, as CudaBackend's GEMM path does.
  const std::int64_t r0 = 2, rows = 3, keys = pos0 + r0 + rows, ld = (keys + 7) / 8 * 8;
  std::vector<float> s(static_cast<std::size_t>(n_heads * rows * ld), NAN);
  const int group = n_heads / n_kv;
  for (int member = 0; member < group; ++member)
    cuda::detail::reference_gemm(
        cuda::detail::plan_scores(rows, keys, ld, n_heads, n_kv, hs, member, dim, kv_dim), k.data(),
        q.data() + r0 * dim, s.data(), 1.0f, 0.0f);
  for (int h = 0; h < n_heads; ++h)
    for (std::int64_t i = 0; i < rows; ++i) {
      float* row = s.data() + (h * rows + i) * ld;
      const std::int64_t visible = pos0 + r0 + i + 1;
      for (std::int64_t j = 0; j < visible; ++j) row[j] /= std::sqrt(static_cast<float>(hs));
      cpu::softmax(row, visible);
      for (std::int64_t j = visible; j < keys; ++j) row[j] = 0.0f;
    }
  std::vector<float> out(tokens * dim, NAN);
  for (int member = 0; member < group; ++member)
    cuda::detail::reference_gemm(
        cuda::detail::plan_pv(rows, keys, ld, n_heads, n_kv, hs, member, kv_dim, dim), v.data(),
        s.data(), out.data() + r0 * dim, 1.0f, 0.0f);
  std::vector<float> got(out.begin() + r0 * dim, out.end());
  std::vector<float> want(ref.begin() + r0 * dim, ref.end());
  CHECK(rel_err(got, want) < 1e-5);
  for (std::int64_t i = 0; i < r0 * dim; ++i) CHECK(std::isnan(out[static_cast<std::size_t>(i)]));
}
