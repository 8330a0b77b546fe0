// brigade's CUDA kernels: RMSNorm, RoPE, QKV scatter into the KV caches, causal GQA attention
// (direct, and the softmax between the cuBLAS GEMMs of the GEMM path), SwiGLU, embedding,
// dtype conversion, random fill, argmax and multinomial sampling.
//
// One translation unit on purpose (nvcc is slow on the CI machines). No fmt, no Eigen, no
// brigade headers: launchers return cudaError_t and backend.cpp turns failures into
// brigade::Error. Compiled without fast math, so expf/sqrtf/cosf/sinf keep their documented
// accuracy (<= 2 ulp), close to run.c's libm calls.
#include "kernels.cuh"
#include "train_math.hpp"

#include <cuda_bf16.h>

#include <climits>
#include <cstdint>

namespace brigade::cuda::detail {
namespace {

using bf16 = __nv_bfloat16;

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kBlock = 256;        // threads of the row-wise kernels
constexpr int kAttnThreads = 128;  // threads of the direct attention kernel
constexpr int kAttnTile = 256;     // keys per tile of the direct attention kernel
constexpr int kSampleThreads = 1024;

template <class T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_float<bf16>(bf16 v) {
  return __bfloat162float(v);
}

template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

/// Sum over the block (blockDim.x a multiple of 32); every thread gets the result. `red` is
/// 32 floats of shared memory; the call begins with a barrier, so it may be reused at once.
__device__ float block_sum(float v, float* red) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int warps = static_cast<int>(blockDim.x) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < warps ? red[lane] : 0.0f;
    w = warp_sum(w);
    if (lane == 0) red[0] = w;
  }
  __syncthreads();
  return red[0];
}

/// Maximum over the block, as block_sum.
__device__ float block_max(float v, float* red) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int warps = static_cast<int>(blockDim.x) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < warps ? red[lane] : -INFINITY;
    w = warp_max(w);
    if (lane == 0) red[0] = w;
  }
  __syncthreads();
  return red[0];
}

// --- RMSNorm --------------------------------------------------------------------------------

template <class OutT>
__global__ void rmsnorm_kernel(const float* __restrict__ x, const float* __restrict__ w, OutT* out,
                               std::int64_t dim, float eps) {
  __shared__ float red[32];
  const std::int64_t row = blockIdx.x;
  const float* xr = x + row * dim;
  float ss = 0.0f;
  for (std::int64_t j = threadIdx.x; j < dim; j += blockDim.x) ss += xr[j] * xr[j];
  ss = block_sum(ss, red);
  // run.c: ss /= size; ss += eps; ss = 1 / sqrtf(ss); o[j] = weight[j] * (ss * x[j]).
  ss /= static_cast<float>(dim);
  ss += eps;
  const float inv = 1.0f / sqrtf(ss);
  OutT* o = out + row * dim;
  for (std::int64_t j = threadIdx.x; j < dim; j += blockDim.x)
    o[j] = from_float<OutT>(w[j] * (inv * xr[j]));
}

// --- RoPE -----------------------------------------------------------------------------------

/// One block per token; threads walk the (2i, 2i+1) pairs of q's heads, then k's. `freq[j]` is
/// run.c's 1 / theta^(2j / head_size), computed on the host with the CPU backend's expression.
__global__ void rope_kernel(float* q, std::int64_t q_stride, float* k, std::int64_t k_stride,
                            const std::int32_t* __restrict__ pos, const float* __restrict__ freq,
                            int n_heads, int n_kv_heads, int head_size) {
  const std::int64_t t = blockIdx.x;
  const int half = head_size / 2;
  const int q_pairs = n_heads * half;
  const int pairs = q_pairs + n_kv_heads * half;
  const float p = static_cast<float>(pos[t]);
  for (int i = static_cast<int>(threadIdx.x); i < pairs; i += static_cast<int>(blockDim.x)) {
    const bool is_q = i < q_pairs;
    const int pair = is_q ? i : i - q_pairs;
    float* e = (is_q ? q + t * q_stride : k + t * k_stride) + 2 * static_cast<std::int64_t>(pair);
    const float val = p * freq[pair % half];
    const float fcr = cosf(val);
    const float fci = sinf(val);
    const float v0 = e[0];
    const float v1 = e[1];
    e[0] = v0 * fcr - v1 * fci;
    e[1] = v0 * fci + v1 * fcr;
  }
}

// --- QKV scatter ----------------------------------------------------------------------------

template <class T>
__global__ void qkv_scatter_kernel(const float* __restrict__ qkv, std::int64_t qkv_stride,
                                   std::int64_t dim, std::int64_t kv_dim,
                                   const std::int32_t* __restrict__ tok_seq,
                                   const SeqDesc* __restrict__ seqs, T* q_out) {
  const std::int64_t t = blockIdx.x;
  const SeqDesc s = seqs[tok_seq[t]];
  const std::int64_t row = s.pos0 + (t - s.offset);
  const float* src = qkv + t * qkv_stride;
  T* qd = q_out + t * dim;
  T* kd = static_cast<T*>(s.k_cache) + row * kv_dim;
  T* vd = static_cast<T*>(s.v_cache) + row * kv_dim;
  for (std::int64_t i = threadIdx.x; i < dim; i += blockDim.x) qd[i] = from_float<T>(src[i]);
  for (std::int64_t i = threadIdx.x; i < kv_dim; i += blockDim.x) {
    kd[i] = from_float<T>(src[dim + i]);
    vd[i] = from_float<T>(src[dim + kv_dim + i]);
  }
}

// --- attention, direct ----------------------------------------------------------------------

/// One block per (query row, head). Scores of a tile of keys go to shared memory; the softmax is
/// online across tiles (running maximum m and sum l, the output accumulator rescaled by
/// exp(m_old - m_new)), so any context length fits in (2 head_size + kAttnTile) floats.
template <class T>
__global__ void attention_direct_kernel(const T* __restrict__ q, T* __restrict__ out,
                                        std::int64_t row_begin,
                                        const std::int32_t* __restrict__ tok_seq,
                                        const SeqDesc* __restrict__ seqs, int n_heads, int kv_mul,
                                        int head_size, float scale) {
  extern __shared__ float smem[];
  __shared__ float red[32];
  float* q_s = smem;
  float* acc = smem + head_size;
  float* p = smem + 2 * head_size;
  const int tid = static_cast<int>(threadIdx.x);
  const int nthreads = static_cast<int>(blockDim.x);
  const std::int64_t t = row_begin + blockIdx.x;
  const int h = static_cast<int>(blockIdx.y);
  const std::int64_t dim = static_cast<std::int64_t>(n_heads) * head_size;
  const std::int64_t kv_dim = static_cast<std::int64_t>(n_heads / kv_mul) * head_size;
  const SeqDesc s = seqs[tok_seq[t]];
  const std::int64_t n_keys = s.pos0 + (t - s.offset) + 1;
  const std::int64_t kv_off = static_cast<std::int64_t>(h / kv_mul) * head_size;
  const T* kb = static_cast<const T*>(s.k_cache) + kv_off;
  const T* vb = static_cast<const T*>(s.v_cache) + kv_off;

  for (int d = tid; d < head_size; d += nthreads) {
    q_s[d] = to_float(q[t * dim + static_cast<std::int64_t>(h) * head_size + d]);
    acc[d] = 0.0f;
  }
  __syncthreads();

  float m = -INFINITY;
  float l = 0.0f;
  for (std::int64_t j0 = 0; j0 < n_keys; j0 += kAttnTile) {
    const int nj = static_cast<int>(n_keys - j0 < kAttnTile ? n_keys - j0 : kAttnTile);
    float local_max = -INFINITY;
    for (int j = tid; j < nj; j += nthreads) {
      const T* kr = kb + (j0 + j) * kv_dim;
      float dot = 0.0f;
      for (int d = 0; d < head_size; ++d) dot += q_s[d] * to_float(kr[d]);
      const float sc = dot / scale;
      p[j] = sc;
      local_max = fmaxf(local_max, sc);
    }
    const float m_new = fmaxf(m, block_max(local_max, red));
    const float corr = expf(m - m_new);  // 0 on the first tile (m = -inf)
    float local_sum = 0.0f;
    for (int j = tid; j < nj; j += nthreads) {
      const float e = expf(p[j] - m_new);
      p[j] = e;
      local_sum += e;
    }
    l = l * corr + block_sum(local_sum, red);  // its barriers publish p
    for (int d = tid; d < head_size; d += nthreads) {
      float a = acc[d] * corr;
      const T* vc = vb + j0 * kv_dim + d;
      for (int j = 0; j < nj; ++j) a += p[j] * to_float(vc[static_cast<std::int64_t>(j) * kv_dim]);
      acc[d] = a;
    }
    m = m_new;
    __syncthreads();  // p is rewritten by the next tile
  }
  T* o = out + t * dim + static_cast<std::int64_t>(h) * head_size;
  for (int d = tid; d < head_size; d += nthreads) o[d] = from_float<T>(acc[d] / l);
}

// --- attention, causal softmax of the GEMM path ---------------------------------------------

/// One block per (row, head): as cpu::attention's row loop: scores / scale over the visible
/// keys, softmax with the maximum subtracted, zeros beyond.
template <class PT>
__global__ void causal_softmax_kernel(const float* s, PT* p, std::int64_t rows, std::int64_t keys,
                                      std::int64_t ld, std::int64_t first_visible, float scale) {
  __shared__ float red[32];
  const std::int64_t i = blockIdx.x;
  const std::int64_t h = blockIdx.y;
  const float* sr = s + (h * rows + i) * ld;
  PT* pr = p + (h * rows + i) * ld;
  const std::int64_t visible = first_visible + i;
  float mx = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < visible; j += blockDim.x) mx = fmaxf(mx, sr[j] / scale);
  mx = block_max(mx, red);
  float sum = 0.0f;
  for (std::int64_t j = threadIdx.x; j < visible; j += blockDim.x) sum += expf(sr[j] / scale - mx);
  sum = block_sum(sum, red);
  for (std::int64_t j = threadIdx.x; j < keys; j += blockDim.x) {
    const float v = j < visible ? expf(sr[j] / scale - mx) / sum : 0.0f;
    pr[j] = from_float<PT>(v);
  }
}

// --- SwiGLU, embedding, conversion, random fill -------------------------------------------

template <class OutT>
__global__ void swiglu_kernel(const float* gate, const float* up, std::int64_t in_stride, OutT* out,
                              std::int64_t rows, std::int64_t width) {
  const std::int64_t n = rows * width;
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = idx / width;
    const std::int64_t c = idx - r * width;
    float val = gate[r * in_stride + c];
    val *= 1.0f / (1.0f + expf(-val));  // run.c: silu
    val *= up[r * in_stride + c];
    out[idx] = from_float<OutT>(val);
  }
}

__global__ void embedding_kernel(const float* __restrict__ table,
                                 const std::int32_t* __restrict__ ids, float* __restrict__ out,
                                 std::int64_t dim) {
  const std::int64_t t = blockIdx.x;
  const float* row = table + static_cast<std::int64_t>(ids[t]) * dim;
  for (std::int64_t j = threadIdx.x; j < dim; j += blockDim.x) out[t * dim + j] = row[j];
}

template <class S, class D>
__global__ void convert_kernel(const S* __restrict__ src, D* __restrict__ dst, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[i] = from_float<D>(to_float(src[i]));
}

__device__ __forceinline__ std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

template <class T>
__global__ void fill_random_kernel(T* dst, std::int64_t n, std::uint64_t seed, float scale) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::uint64_t h = splitmix64(seed ^ splitmix64(static_cast<std::uint64_t>(i)));
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);  // 24 bits in [0, 1)
    dst[i] = from_float<T>((2.0f * u - 1.0f) * scale);
  }
}

// --- sampling -------------------------------------------------------------------------------

/// (value, index) maximum with the first index on ties; NaN never wins.
__device__ __forceinline__ void better(float& best, int& best_i, float v, int i) {
  if (v > best || (v == best && i < best_i)) {
    best = v;
    best_i = i;
  }
}

__global__ void argmax_kernel(const float* __restrict__ logits, std::int64_t vocab,
                              std::int32_t* __restrict__ out) {
  __shared__ float vals[32];
  __shared__ int idxs[32];
  const float* row = logits + static_cast<std::int64_t>(blockIdx.x) * vocab;
  float best = -INFINITY;
  int best_i = INT_MAX;
  for (std::int64_t j = threadIdx.x; j < vocab; j += blockDim.x)
    better(best, best_i, row[j], static_cast<int>(j));
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFullMask, best, o);
    const int oi = __shfl_xor_sync(kFullMask, best_i, o);
    better(best, best_i, ov, oi);
  }
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  if (lane == 0) {
    vals[warp] = best;
    idxs[warp] = best_i;
  }
  __syncthreads();
  if (warp == 0) {
    const int warps = static_cast<int>(blockDim.x) >> 5;
    best = lane < warps ? vals[lane] : -INFINITY;
    best_i = lane < warps ? idxs[lane] : INT_MAX;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(kFullMask, best, o);
      const int oi = __shfl_xor_sync(kFullMask, best_i, o);
      better(best, best_i, ov, oi);
    }
    if (lane == 0) out[blockIdx.x] = best_i == INT_MAX ? 0 : best_i;
  }
}

/// Inclusive prefix sum over the block; `total` receives the block's sum. `scratch` is 32 floats
/// of shared memory.
__device__ float block_inclusive_scan(float v, float* scratch, float* total) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int warps = static_cast<int>(blockDim.x) >> 5;
  for (int o = 1; o < 32; o <<= 1) {
    const float n = __shfl_up_sync(kFullMask, v, o);
    if (lane >= o) v += n;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < warps ? scratch[lane] : 0.0f;
    for (int o = 1; o < 32; o <<= 1) {
      const float n = __shfl_up_sync(kFullMask, w, o);
      if (lane >= o) w += n;
    }
    scratch[lane] = w;
  }
  __syncthreads();
  if (warp > 0) v += scratch[warp - 1];
  *total = scratch[warps - 1];
  return v;
}

/// One block per row: softmax(logits / temperature) in place (run.c's order: divide, maximum,
/// exp, sum, divide), then the first index whose CDF exceeds the coin.
__global__ void sample_multinomial_kernel(float* logits, std::int64_t vocab, float temperature,
                                          const float* __restrict__ coins,
                                          std::int32_t* __restrict__ out) {
  __shared__ float red[32];
  __shared__ int found;
  float* row = logits + static_cast<std::int64_t>(blockIdx.x) * vocab;
  float mx = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float v = row[j] / temperature;
    row[j] = v;
    mx = fmaxf(mx, v);
  }
  mx = block_max(mx, red);
  float sum = 0.0f;
  for (std::int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float e = expf(row[j] - mx);
    row[j] = e;
    sum += e;
  }
  sum = block_sum(sum, red);
  for (std::int64_t j = threadIdx.x; j < vocab; j += blockDim.x) row[j] /= sum;
  if (threadIdx.x == 0) found = INT_MAX;
  __syncthreads();
  const float coin = coins[blockIdx.x];
  float carry = 0.0f;
  for (std::int64_t base = 0; base < vocab; base += blockDim.x) {
    const std::int64_t j = base + threadIdx.x;
    const float pj = j < vocab ? row[j] : 0.0f;
    float total = 0.0f;
    const float cdf = carry + block_inclusive_scan(pj, red, &total);
    if (j < vocab && coin < cdf) atomicMin(&found, static_cast<int>(j));
    __syncthreads();
    if (found != INT_MAX) break;
    carry += total;
  }
  if (threadIdx.x == 0)
    out[blockIdx.x] = found == INT_MAX ? static_cast<std::int32_t>(vocab - 1) : found;
}

/// Blocks for a grid-stride loop over n elements.
unsigned grid_for(std::int64_t n, int block) {
  const std::int64_t blocks = (n + block - 1) / block;
  return static_cast<unsigned>(blocks < 65536 ? (blocks < 1 ? 1 : blocks) : 65536);
}

}  // namespace

cudaError_t launch_rmsnorm(const float* x, const float* w, void* out, int out_dtype,
                           std::int64_t tokens, std::int64_t dim, float eps, cudaStream_t stream) {
  if (tokens <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(tokens));
  if (out_dtype == kF32)
    rmsnorm_kernel<float><<<grid, kBlock, 0, stream>>>(x, w, static_cast<float*>(out), dim, eps);
  else
    rmsnorm_kernel<bf16><<<grid, kBlock, 0, stream>>>(x, w, static_cast<bf16*>(out), dim, eps);
  return cudaGetLastError();
}

cudaError_t launch_rope(float* q, std::int64_t q_stride, float* k, std::int64_t k_stride,
                        const std::int32_t* pos, const float* freq, std::int64_t tokens,
                        int n_heads, int n_kv_heads, int head_size, cudaStream_t stream) {
  if (tokens <= 0) return cudaSuccess;
  rope_kernel<<<static_cast<unsigned>(tokens), 128, 0, stream>>>(
      q, q_stride, k, k_stride, pos, freq, n_heads, n_kv_heads, head_size);
  return cudaGetLastError();
}

cudaError_t launch_qkv_scatter(const float* qkv, std::int64_t qkv_stride, std::int64_t tokens,
                               std::int64_t dim, std::int64_t kv_dim, const std::int32_t* tok_seq,
                               const SeqDesc* seqs, void* q_out, int dtype, cudaStream_t stream) {
  if (tokens <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(tokens));
  if (dtype == kF32)
    qkv_scatter_kernel<float><<<grid, kBlock, 0, stream>>>(qkv, qkv_stride, dim, kv_dim, tok_seq,
                                                           seqs, static_cast<float*>(q_out));
  else
    qkv_scatter_kernel<bf16><<<grid, kBlock, 0, stream>>>(qkv, qkv_stride, dim, kv_dim, tok_seq,
                                                          seqs, static_cast<bf16*>(q_out));
  return cudaGetLastError();
}

cudaError_t launch_attention_direct(const void* q, void* out, int dtype, std::int64_t row_begin,
                                    std::int64_t rows, const std::int32_t* tok_seq,
                                    const SeqDesc* seqs, int n_heads, int n_kv_heads, int head_size,
                                    cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(n_heads));
  const std::size_t smem = (2 * static_cast<std::size_t>(head_size) + kAttnTile) * sizeof(float);
  const int kv_mul = n_heads / n_kv_heads;
  const float scale = sqrtf(static_cast<float>(head_size));  // run.c: sqrtf(head_size)
  if (dtype == kF32)
    attention_direct_kernel<float><<<grid, kAttnThreads, smem, stream>>>(
        static_cast<const float*>(q), static_cast<float*>(out), row_begin, tok_seq, seqs, n_heads,
        kv_mul, head_size, scale);
  else
    attention_direct_kernel<bf16><<<grid, kAttnThreads, smem, stream>>>(
        static_cast<const bf16*>(q), static_cast<bf16*>(out), row_begin, tok_seq, seqs, n_heads,
        kv_mul, head_size, scale);
  return cudaGetLastError();
}

cudaError_t launch_causal_softmax(const float* s, void* p, int p_dtype, int n_heads,
                                  std::int64_t rows, std::int64_t keys, std::int64_t ld,
                                  std::int64_t first_visible, float scale, cudaStream_t stream) {
  if (rows <= 0 || n_heads <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(n_heads));
  if (p_dtype == kF32)
    causal_softmax_kernel<float><<<grid, kBlock, 0, stream>>>(s, static_cast<float*>(p), rows, keys,
                                                              ld, first_visible, scale);
  else
    causal_softmax_kernel<bf16><<<grid, kBlock, 0, stream>>>(s, static_cast<bf16*>(p), rows, keys,
                                                             ld, first_visible, scale);
  return cudaGetLastError();
}

cudaError_t launch_swiglu(const float* gate, const float* up, std::int64_t in_stride, void* out,
                          int out_dtype, std::int64_t rows, std::int64_t width,
                          cudaStream_t stream) {
  const std::int64_t n = rows * width;
  if (n <= 0) return cudaSuccess;
  if (out_dtype == kF32)
    swiglu_kernel<float><<<grid_for(n, kBlock), kBlock, 0, stream>>>(
        gate, up, in_stride, static_cast<float*>(out), rows, width);
  else
    swiglu_kernel<bf16><<<grid_for(n, kBlock), kBlock, 0, stream>>>(
        gate, up, in_stride, static_cast<bf16*>(out), rows, width);
  return cudaGetLastError();
}

cudaError_t launch_embedding(const float* table, const std::int32_t* ids, float* out,
                             std::int64_t tokens, std::int64_t dim, cudaStream_t stream) {
  if (tokens <= 0) return cudaSuccess;
  embedding_kernel<<<static_cast<unsigned>(tokens), kBlock, 0, stream>>>(table, ids, out, dim);
  return cudaGetLastError();
}

cudaError_t launch_convert(const void* src, int src_dtype, void* dst, int dst_dtype, std::int64_t n,
                           cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const unsigned grid = grid_for(n, kBlock);
  if (src_dtype == kF32 && dst_dtype == kF32)
    convert_kernel<float, float>
        <<<grid, kBlock, 0, stream>>>(static_cast<const float*>(src), static_cast<float*>(dst), n);
  else if (src_dtype == kF32)
    convert_kernel<float, bf16>
        <<<grid, kBlock, 0, stream>>>(static_cast<const float*>(src), static_cast<bf16*>(dst), n);
  else if (dst_dtype == kF32)
    convert_kernel<bf16, float>
        <<<grid, kBlock, 0, stream>>>(static_cast<const bf16*>(src), static_cast<float*>(dst), n);
  else
    convert_kernel<bf16, bf16>
        <<<grid, kBlock, 0, stream>>>(static_cast<const bf16*>(src), static_cast<bf16*>(dst), n);
  return cudaGetLastError();
}

cudaError_t launch_fill_random(void* dst, int dtype, std::int64_t n, std::uint64_t seed,
                               float scale, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const unsigned grid = grid_for(n, kBlock);
  if (dtype == kF32)
    fill_random_kernel<float>
        <<<grid, kBlock, 0, stream>>>(static_cast<float*>(dst), n, seed, scale);
  else
    fill_random_kernel<bf16><<<grid, kBlock, 0, stream>>>(static_cast<bf16*>(dst), n, seed, scale);
  return cudaGetLastError();
}

cudaError_t launch_argmax(const float* logits, std::int64_t rows, std::int64_t vocab,
                          std::int32_t* out, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  argmax_kernel<<<static_cast<unsigned>(rows), kSampleThreads, 0, stream>>>(logits, vocab, out);
  return cudaGetLastError();
}

cudaError_t launch_sample_multinomial(float* logits, std::int64_t rows, std::int64_t vocab,
                                      float temperature, const float* coins, std::int32_t* out,
                                      cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  sample_multinomial_kernel<<<static_cast<unsigned>(rows), kSampleThreads, 0, stream>>>(
      logits, vocab, temperature, coins, out);
  return cudaGetLastError();
}

// ---- training: one thread per item of train_math.hpp; the kernels only compute the index -----

namespace {

constexpr int kItemThreads = 128;

__device__ __forceinline__ std::int64_t item_index() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

unsigned item_grid(std::int64_t n) {
  return static_cast<unsigned>((n + kItemThreads - 1) / kItemThreads);
}

__global__ void rmsnorm_train_kernel(const float* x, const float* w, float* out, float* inv_rms,
                                     std::int64_t tokens, std::int64_t dim, float eps) {
  const std::int64_t t = item_index();
  if (t < tokens) rmsnorm_train_item(x, w, out, inv_rms, t, dim, eps);
}

__global__ void rmsnorm_dweight_kernel(const float* x, const float* inv_rms, const float* dy,
                                       float* dw, std::int64_t tokens, std::int64_t dim) {
  const std::int64_t j = item_index();
  if (j < dim) rmsnorm_dweight_item(x, inv_rms, dy, dw, j, tokens, dim);
}

__global__ void rmsnorm_backward_kernel(const float* x, const float* w, const float* inv_rms,
                                        const float* dy, float* dx, std::int64_t tokens,
                                        std::int64_t dim, bool accumulate) {
  const std::int64_t t = item_index();
  if (t < tokens) rmsnorm_backward_item(x, w, inv_rms, dy, dx, t, dim, accumulate);
}

__global__ void swiglu_backward_kernel(const float* gate, const float* up, const float* dh,
                                       float* dgate, float* dup, float* h, std::int64_t n) {
  const std::int64_t i = item_index();
  if (i < n) swiglu_backward_item(gate, up, dh, dgate, dup, h, i);
}

__global__ void rope_train_kernel(float* q, float* k, const std::int32_t* pos, const float* freq,
                                  std::int64_t pairs, std::int64_t dim, std::int64_t kv_dim,
                                  int head_size, bool inverse) {
  const std::int64_t p = item_index();
  if (p < pairs) rope_item(q, k, pos, freq, p, dim, kv_dim, head_size, inverse);
}

__global__ void attention_train_forward_kernel(const float* q, const float* k, const float* v,
                                               float* out, float* lse,
                                               const std::int32_t* seq_begin, std::int64_t items,
                                               int n_heads, int n_kv_heads, int head_size) {
  const std::int64_t i = item_index();
  if (i < items)
    attention_forward_item(q, k, v, out, lse, seq_begin, i, n_heads, n_kv_heads, head_size);
}

__global__ void attention_dsum_kernel(const float* dout, const float* out, float* dsum,
                                      std::int64_t items, int n_heads, int head_size) {
  const std::int64_t i = item_index();
  if (i < items) attention_dsum_item(dout, out, dsum, i, n_heads, head_size);
}

__global__ void attention_dq_kernel(const float* q, const float* k, const float* v,
                                    const float* lse, const float* dsum, const float* dout,
                                    float* dq, const std::int32_t* seq_begin, std::int64_t items,
                                    int n_heads, int n_kv_heads, int head_size) {
  const std::int64_t i = item_index();
  if (i < items)
    attention_dq_item(q, k, v, lse, dsum, dout, dq, seq_begin, i, n_heads, n_kv_heads, head_size);
}

__global__ void attention_dkv_kernel(const float* q, const float* k, const float* v,
                                     const float* lse, const float* dsum, const float* dout,
                                     float* dk, float* dv, const std::int32_t* seq_end,
                                     std::int64_t items, int n_heads, int n_kv_heads,
                                     int head_size) {
  const std::int64_t i = item_index();
  if (i < items)
    attention_dkv_item(q, k, v, lse, dsum, dout, dk, dv, seq_end, i, n_heads, n_kv_heads,
                       head_size);
}

__global__ void cross_entropy_kernel(const float* logits, const std::int32_t* targets,
                                     float* dlogits, double* row_loss, std::int64_t tokens,
                                     std::int64_t vocab, float inv_denom) {
  const std::int64_t t = item_index();
  if (t < tokens) cross_entropy_item(logits, targets, dlogits, row_loss, t, vocab, inv_denom);
}

__global__ void embedding_backward_kernel(const float* dy, const std::int32_t* ids, float* dtable,
                                          std::int64_t tokens, std::int64_t dim) {
  const std::int64_t j = item_index();
  if (j < dim) embedding_backward_item(dy, ids, dtable, j, tokens, dim);
}

__global__ void add_kernel(const float* src, float* dst, std::int64_t n) {
  const std::int64_t i = item_index();
  if (i < n) add_item(src, dst, i);
}

}  // namespace

cudaError_t launch_rmsnorm_train(const float* x, const float* w, float* out, float* inv_rms,
                                 std::int64_t tokens, std::int64_t dim, float eps,
                                 cudaStream_t stream) {
  if (tokens <= 0) return cudaSuccess;
  rmsnorm_train_kernel<<<item_grid(tokens), kItemThreads, 0, stream>>>(x, w, out, inv_rms, tokens,
                                                                      dim, eps);
  return cudaGetLastError();
}

cudaError_t launch_rmsnorm_backward(const float* x, const float* w, const float* inv_rms,
                                    const float* dy, float* dx, float* dw, std::int64_t tokens,
                                    std::int64_t dim, bool accumulate, cudaStream_t stream) {
  if (tokens <= 0) return cudaSuccess;
  if (dw != nullptr) {
    rmsnorm_dweight_kernel<<<item_grid(dim), kItemThreads, 0, stream>>>(x, inv_rms, dy, dw, tokens,
                                                                       dim);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  rmsnorm_backward_kernel<<<item_grid(tokens), kItemThreads, 0, stream>>>(x, w, inv_rms, dy, dx,
                                                                         tokens, dim, accumulate);
  return cudaGetLastError();
}

cudaError_t launch_swiglu_backward(const float* gate, const float* up, const float* dh,
                                   float* dgate, float* dup, float* h, std::int64_t n,
                                   cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  swiglu_backward_kernel<<<item_grid(n), kItemThreads, 0, stream>>>(gate, up, dh, dgate, dup, h,
                                                                   n);
  return cudaGetLastError();
}

cudaError_t launch_rope_train(float* q, float* k, const std::int32_t* pos, const float* freq,
                              std::int64_t tokens, std::int64_t dim, std::int64_t kv_dim,
                              int head_size, bool inverse, cudaStream_t stream) {
  const std::int64_t pairs = tokens * ((dim + kv_dim) / 2);
  if (pairs <= 0) return cudaSuccess;
  rope_train_kernel<<<item_grid(pairs), kItemThreads, 0, stream>>>(q, k, pos, freq, pairs, dim,
                                                                  kv_dim, head_size, inverse);
  return cudaGetLastError();
}

cudaError_t launch_attention_train_forward(const float* q, const float* k, const float* v,
                                           float* out, float* lse, const std::int32_t* seq_begin,
                                           std::int64_t tokens, int n_heads, int n_kv_heads,
                                           int head_size, cudaStream_t stream) {
  const std::int64_t items = tokens * n_heads;
  if (items <= 0) return cudaSuccess;
  attention_train_forward_kernel<<<item_grid(items), kItemThreads, 0, stream>>>(
      q, k, v, out, lse, seq_begin, items, n_heads, n_kv_heads, head_size);
  return cudaGetLastError();
}

cudaError_t launch_attention_train_backward(const float* q, const float* k, const float* v,
                                            const float* out, const float* lse,
                                            const float* dout, float* dsum, float* dq, float* dk,
                                            float* dv, const std::int32_t* seq_begin,
                                            const std::int32_t* seq_end, std::int64_t tokens,
                                            int n_heads, int n_kv_heads, int head_size,
                                            cudaStream_t stream) {
  const std::int64_t items = tokens * n_heads;
  if (items <= 0) return cudaSuccess;
  attention_dsum_kernel<<<item_grid(items), kItemThreads, 0, stream>>>(dout, out, dsum, items,
                                                                      n_heads, head_size);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  attention_dq_kernel<<<item_grid(items), kItemThreads, 0, stream>>>(
      q, k, v, lse, dsum, dout, dq, seq_begin, items, n_heads, n_kv_heads, head_size);
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  const std::int64_t kv_items = tokens * n_kv_heads;
  attention_dkv_kernel<<<item_grid(kv_items), kItemThreads, 0, stream>>>(
      q, k, v, lse, dsum, dout, dk, dv, seq_end, kv_items, n_heads, n_kv_heads, head_size);
  return cudaGetLastError();
}

cudaError_t launch_cross_entropy(const float* logits, const std::int32_t* targets, float* dlogits,
                                 double* row_loss, std::int64_t tokens, std::int64_t vocab,
                                 float inv_denom, cudaStream_t stream) {
  if (tokens <= 0) return cudaSuccess;
  cross_entropy_kernel<<<item_grid(tokens), kItemThreads, 0, stream>>>(
      logits, targets, dlogits, row_loss, tokens, vocab, inv_denom);
  return cudaGetLastError();
}

cudaError_t launch_embedding_backward(const float* dy, const std::int32_t* ids, float* dtable,
                                      std::int64_t tokens, std::int64_t dim, cudaStream_t stream) {
  if (tokens <= 0 || dim <= 0) return cudaSuccess;
  embedding_backward_kernel<<<item_grid(dim), kItemThreads, 0, stream>>>(dy, ids, dtable, tokens,
                                                                        dim);
  return cudaGetLastError();
}

cudaError_t launch_add(const float* src, float* dst, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  add_kernel<<<item_grid(n), kItemThreads, 0, stream>>>(src, dst, n);
  return cudaGetLastError();
}

}  // namespace brigade::cuda::detail
