// CudaBackend: device memory, streams and events, and the decoder's forward pass on cuBLAS and
// the kernels of kernels.cu. Host code (g++): validation and messages here, arithmetic on the GPU.
#include "brigade/backend/cuda.hpp"

#include "check.hpp"
#include "gemm_plan.hpp"
#include "kernels.cuh"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <utility>

namespace brigade::cuda {
inline namespace v0 {
namespace {

using detail::GemmPlan;
using detail::SeqDesc;

/// The kernels' dtype code of `t`; the CUDA backend computes in float32 and bfloat16 only.
int code(DType t) {
  BRIGADE_CHECK(t == DType::F32 || t == DType::BF16, Errc::InvalidArgument,
                "CudaBackend: dtype {} is not supported on the GPU (f32, bf16)", to_string(t));
  return t == DType::F32 ? detail::kF32 : detail::kBF16;
}
cudaDataType_t cuda_type(DType t) { return code(t) == detail::kF32 ? CUDA_R_32F : CUDA_R_16BF; }
std::size_t usize(std::int64_t n) { return static_cast<std::size_t>(n); }

/// Makes `device` current for the calling thread for the guard's lifetime.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    BRIGADE_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) BRIGADE_CUDA_CHECK(cudaSetDevice(device));
    device_ = device;
  }
  ~DeviceGuard() {
    if (previous_ >= 0 && previous_ != device_) static_cast<void>(cudaSetDevice(previous_));
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  int device_ = -1;
};

void check_heads(const char* what, int n_heads, int n_kv_heads, int head_size) {
  BRIGADE_CHECK(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0, Errc::InvalidArgument,
                "{}: n_heads = {}, n_kv_heads = {}; expected both > 0 and n_heads a multiple "
                "of n_kv_heads",
                what, n_heads, n_kv_heads);
  BRIGADE_CHECK(head_size > 0 && head_size % 2 == 0, Errc::InvalidArgument,
                "{}: head_size = {}; expected a positive even number", what, head_size);
}

/// The slices must each have >= 1 token and positions >= 0 (within max_pos when max_pos > 0)
/// and cover `tokens` rows; each slice's sequence must be in `cache` (whose dtype must be
/// `dtype` and kv_dim `kv_dim`) with pos0 + tokens within its capacity.
void check_slices(const char* what, std::int64_t tokens, std::span<const backend::SequenceSlice> seqs,
                  const backend::KvCacheView& cache, DType dtype, std::int64_t kv_dim,
                  std::int64_t max_pos) {
  BRIGADE_CHECK(tokens >= 0, Errc::InvalidArgument, "{}: tokens = {}; expected >= 0", what, tokens);
  BRIGADE_CHECK(cache.dtype == dtype && cache.kv_dim == kv_dim && cache.keys != nullptr &&
                    cache.values != nullptr,
                Errc::InvalidArgument,
                "{}: a {} KV cache of kv_dim {}; expected {} with kv_dim {} and keys and values set",
                what, to_string(cache.dtype), cache.kv_dim, to_string(dtype), kv_dim);
  std::int64_t rows = 0;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const backend::SequenceSlice& s = seqs[i];
    BRIGADE_CHECK(s.tokens >= 1, Errc::InvalidArgument,
                  "{}: sequence {} (slice {}) has tokens = {}; expected >= 1", what, s.seq, i,
                  s.tokens);
    BRIGADE_CHECK(s.pos0 >= 0 && (max_pos <= 0 || std::int64_t{s.pos0} + s.tokens <= max_pos),
                  Errc::InvalidArgument,
                  "{}: sequence {} (slice {}) spans positions [{}, {}); expected within [0, "
                  "seq_len = {})",
                  what, s.seq, i, s.pos0, std::int64_t{s.pos0} + s.tokens, max_pos);
    const auto seq = static_cast<std::size_t>(s.seq);
    BRIGADE_CHECK(s.seq >= 0 && seq < cache.first_row.size() && seq < cache.capacity.size(),
                  Errc::InvalidArgument,
                  "{}: sequence {} has no KV cache (the cache holds {} sequences)", what, s.seq,
                  cache.first_row.size());
    BRIGADE_CHECK(std::int64_t{s.pos0} + s.tokens <= cache.capacity[seq], Errc::InvalidArgument,
                  "{}: sequence {} positions [{}, {}) exceed its KV capacity {}", what, s.seq,
                  s.pos0, std::int64_t{s.pos0} + s.tokens, cache.capacity[seq]);
    rows += s.tokens;
  }
  BRIGADE_CHECK(rows == tokens, Errc::InvalidArgument,
                "{}: the {} sequences cover {} rows; expected tokens = {}", what, seqs.size(), rows,
                tokens);
}

/// The kernels' form of checked slices: each slice's first row in the packed batch and its
/// sequence's cache rows as device addresses (SeqDesc is kernels.cuh's device-side POD).
void resolve(std::span<const backend::SequenceSlice> seqs, const backend::KvCacheView& cache,
             std::vector<SeqDesc>& out) {
  out.clear();
  const std::size_t row_bytes = dtype_bytes(cache.dtype, cache.kv_dim);
  std::int64_t offset = 0;
  for (const auto& s : seqs) {
    const auto first = static_cast<std::size_t>(cache.first_row[static_cast<std::size_t>(s.seq)]);
    out.push_back(SeqDesc{offset, s.tokens, s.pos0,
                          static_cast<std::byte*>(cache.keys) + first * row_bytes,
                          static_cast<std::byte*>(cache.values) + first * row_bytes});
    offset += s.tokens;
  }
}

void check_int(const char* what, std::int64_t v) {
  BRIGADE_CHECK(v >= 0 && v <= INT_MAX, Errc::InvalidArgument,
                "{}: a GEMM dimension or leading dimension is {}; expected within [0, 2^31 - 1]",
                what, v);
}

}  // namespace

// --- devices, buffers, streams, events ---------------------------------------------------------

DeviceInfo probe_devices() noexcept {
  DeviceInfo info;
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    info.reason = std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
    static_cast<void>(cudaGetLastError());  // clear the sticky-free error state
    return info;
  }
  if (count <= 0) {
    info.reason = "cudaGetDeviceCount reported 0 devices";
    return info;
  }
  info.count = count;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    info.reason = "cudaGetDeviceProperties(0) failed";
    info.count = 0;
    return info;
  }
  info.available = true;
  info.name = prop.name;
  info.compute_major = prop.major;
  info.compute_minor = prop.minor;
  return info;
}

DeviceBuffer::DeviceBuffer(std::size_t bytes, int device) : size_(bytes) {
  if (bytes == 0) return;
  int previous = -1;
  if (device >= 0) {
    BRIGADE_CUDA_CHECK(cudaGetDevice(&previous));
    if (previous != device) BRIGADE_CUDA_CHECK(cudaSetDevice(device));
  }
  const cudaError_t e = cudaMalloc(&data_, bytes);
  if (device >= 0 && previous >= 0 && previous != device)
    static_cast<void>(cudaSetDevice(previous));
  if (e != cudaSuccess) {
    data_ = nullptr;
    size_ = 0;
    brigade::detail::fail(Errc::Cuda, "cudaMalloc of {} bytes failed: {} ({})", bytes,
                          cudaGetErrorName(e), cudaGetErrorString(e));
  }
}

DeviceBuffer::~DeviceBuffer() {
  if (data_) static_cast<void>(cudaFree(data_));
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (data_) static_cast<void>(cudaFree(data_));
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void DeviceBuffer::copy_from_host(const void* src, std::size_t bytes, std::size_t offset) {
  BRIGADE_CHECK(offset <= size_ && bytes <= size_ - offset, Errc::InvalidArgument,
                "DeviceBuffer::copy_from_host: bytes [{}, {}) outside the buffer's {} bytes",
                offset, offset + bytes, size_);
  if (bytes == 0) return;
  // cudaMemcpy from pageable memory may return before the DMA lands, and kernels on
  // non-blocking streams do not wait for the legacy stream: wait for the copy itself.
  BRIGADE_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(data_) + offset, src, bytes,
                                     cudaMemcpyHostToDevice, cudaStreamLegacy));
  BRIGADE_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

void DeviceBuffer::copy_to_host(void* dst, std::size_t bytes, std::size_t offset) const {
  BRIGADE_CHECK(offset <= size_ && bytes <= size_ - offset, Errc::InvalidArgument,
                "DeviceBuffer::copy_to_host: bytes [{}, {}) outside the buffer's {} bytes", offset,
                offset + bytes, size_);
  if (bytes == 0) return;
  BRIGADE_CUDA_CHECK(
      cudaMemcpy(dst, static_cast<const char*>(data_) + offset, bytes, cudaMemcpyDeviceToHost));
}

Stream::Stream() {
  cudaStream_t s = nullptr;
  BRIGADE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = s;
}

Stream::~Stream() {
  if (stream_) static_cast<void>(cudaStreamDestroy(stream_));
}

Stream::Stream(Stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    if (stream_) static_cast<void>(cudaStreamDestroy(stream_));
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

void Stream::synchronize() const { BRIGADE_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

Event::Event() {
  cudaEvent_t e = nullptr;
  BRIGADE_CUDA_CHECK(cudaEventCreate(&e));
  event_ = e;
}

Event::~Event() {
  if (event_) static_cast<void>(cudaEventDestroy(event_));
}

Event::Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    if (event_) static_cast<void>(cudaEventDestroy(event_));
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

void Event::record(CUstream_st* stream) { BRIGADE_CUDA_CHECK(cudaEventRecord(event_, stream)); }

void Event::wait_on(CUstream_st* stream) const {
  BRIGADE_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
}

void Event::synchronize() const { BRIGADE_CUDA_CHECK(cudaEventSynchronize(event_)); }

bool Event::query() const {
  const cudaError_t e = cudaEventQuery(event_);
  if (e == cudaErrorNotReady) return false;
  BRIGADE_CUDA_CHECK(e);
  return true;
}

float Event::elapsed_ms_since(const Event& start) const {
  float ms = 0.0f;
  BRIGADE_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, event_));
  return ms;
}

// --- the backend -------------------------------------------------------------------------------

struct CudaBackend::Impl {
  Options opt;
  Stream stream;
  cublasHandle_t blas = nullptr;
  DeviceBuffer blas_workspace;
  // Grow-only scratch.
  DeviceBuffer meta;  // SeqDesc[n_seq] | tok_seq[tokens] | pos[tokens]
  DeviceBuffer xb_buf, qkv_buf, q_buf, att_buf, h13_buf, hb_buf;
  DeviceBuffer scores, probs;
  DeviceBuffer coins;
  DeviceBuffer freq;  // RoPE frequencies for (freq_head_size, freq_theta)
  int freq_head_size = 0;
  float freq_theta = 0.0f;
  std::vector<std::byte> staging;
  std::vector<float> freq_host;
  std::vector<SeqDesc> resolved;  // the slices of the current call (resolve())
  std::vector<DeviceBuffer> weights;  // upload_weight's copies
  std::vector<float> dequantized;     // upload_weight's host staging for typed matrices

  explicit Impl(Options o) : opt(o) {}
  ~Impl() {
    if (blas) static_cast<void>(cublasDestroy(blas));
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  cudaStream_t s() const { return stream.native(); }

  void* grow(DeviceBuffer& b, std::size_t bytes) {
    if (b.size() < bytes) {
      b = DeviceBuffer();
      b = DeviceBuffer(std::max<std::size_t>(bytes, 256), opt.device);
    }
    return b.data();
  }

  /// Uploads the per-sequence descriptors, then each row's sequence index and position.
  /// Returns {SeqDesc*, tok_seq*, pos*} in device memory.
  struct Meta {
    const SeqDesc* seqs;
    const std::int32_t* tok_seq;
    const std::int32_t* pos;
  };
  Meta upload_meta(std::int64_t tokens, std::span<const SeqDesc> slices) {
    const std::size_t n_seq = slices.size();
    const std::size_t seq_bytes = n_seq * sizeof(SeqDesc);
    const std::size_t ints = usize(tokens) * sizeof(std::int32_t);
    const std::size_t total = seq_bytes + 2 * ints;
    staging.resize(total);
    auto* descs = reinterpret_cast<SeqDesc*>(staging.data());
    auto* tok_seq = reinterpret_cast<std::int32_t*>(staging.data() + seq_bytes);
    auto* pos = reinterpret_cast<std::int32_t*>(staging.data() + seq_bytes + ints);
    for (std::size_t i = 0; i < n_seq; ++i) {
      const SeqDesc& sl = slices[i];
      descs[i] = sl;
      for (std::int64_t t = 0; t < sl.tokens; ++t) {
        tok_seq[sl.offset + t] = static_cast<std::int32_t>(i);
        pos[sl.offset + t] = static_cast<std::int32_t>(sl.pos0 + t);
      }
    }
    auto* dev = static_cast<std::byte*>(grow(meta, total));
    // Pageable source: the driver stages it before returning, so `staging` may be reused.
    BRIGADE_CUDA_CHECK(cudaMemcpyAsync(dev, staging.data(), total, cudaMemcpyHostToDevice, s()));
    return {reinterpret_cast<const SeqDesc*>(dev),
            reinterpret_cast<const std::int32_t*>(dev + seq_bytes),
            reinterpret_cast<const std::int32_t*>(dev + seq_bytes + ints)};
  }

  /// run.c's RoPE frequencies for (head_size, theta), computed with the CPU backend's expression.
  const float* rope_freq(int head_size, float theta) {
    if (freq_head_size != head_size || freq_theta != theta || freq.empty()) {
      const int half = head_size / 2;
      freq_host.resize(usize(half));
      for (int j = 0; j < half; ++j) {
        const int head_dim = 2 * j;
        freq_host[usize(j)] =
            1.0f / std::pow(theta, static_cast<float>(head_dim) / static_cast<float>(head_size));
      }
      grow(freq, freq_host.size() * sizeof(float));
      BRIGADE_CUDA_CHECK(cudaMemcpyAsync(freq.data(), freq_host.data(),
                                         freq_host.size() * sizeof(float), cudaMemcpyHostToDevice,
                                         s()));
      freq_head_size = head_size;
      freq_theta = theta;
    }
    return freq.as<float>();
  }

  /// One cuBLAS GEMM (strided-batched when plan.batch > 1) with float32 accumulation.
  void gemm(const GemmPlan& p, const void* a, const void* b, DType ab_type, void* c, DType c_type,
            float alpha, float beta) {
    for (std::int64_t v : {p.m, p.n, p.k, p.lda, p.ldb, p.ldc, p.batch}) check_int("gemm", v);
    if (p.m == 0 || p.n == 0 || p.batch == 0) return;
    const std::size_t ab = dtype_block_bytes(ab_type);
    const std::size_t cb = dtype_block_bytes(c_type);
    const auto* pa = static_cast<const char*>(a) + usize(p.offset_a) * ab;
    const auto* pb = static_cast<const char*>(b) + usize(p.offset_b) * ab;
    auto* pc = static_cast<char*>(c) + usize(p.offset_c) * cb;
    const cublasOperation_t ta = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const auto m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
    const auto lda = static_cast<int>(p.lda), ldb = static_cast<int>(p.ldb),
               ldc = static_cast<int>(p.ldc);
    if (p.batch == 1) {
      BRIGADE_CUBLAS_CHECK(cublasGemmEx(blas, ta, tb, m, n, k, &alpha, pa, cuda_type(ab_type), lda,
                                        pb, cuda_type(ab_type), ldb, &beta, pc, cuda_type(c_type),
                                        ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    } else {
      BRIGADE_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
          blas, ta, tb, m, n, k, &alpha, pa, cuda_type(ab_type), lda, p.stride_a, pb,
          cuda_type(ab_type), ldb, p.stride_b, &beta, pc, cuda_type(c_type), ldc, p.stride_c,
          static_cast<int>(p.batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
  }

  /// Attention of the GEMM path for one sequence: blocks of query rows, S = Q K^T (batched over
  /// KV heads, one call per member of a query group), causal softmax, O = P V.
  void attention_gemm(DType dtype, const void* q, void* out, const SeqDesc& sl, int n_heads,
                      int n_kv_heads, int head_size) {
    const std::int64_t dim = static_cast<std::int64_t>(n_heads) * head_size;
    const std::int64_t kv_dim = static_cast<std::int64_t>(n_kv_heads) * head_size;
    const int group = n_heads / n_kv_heads;
    const std::size_t es = dtype_block_bytes(dtype);
    const std::int64_t max_keys = sl.pos0 + sl.tokens;
    const std::int64_t max_ld = (max_keys + 7) / 8 * 8;
    const std::size_t per_row = static_cast<std::size_t>(n_heads) * usize(max_ld) *
                                (sizeof(float) + (dtype == DType::F32 ? 0 : es));
    std::int64_t block = static_cast<std::int64_t>(opt.attention_scratch_bytes / per_row);
    if (block >= 64) block = block / 64 * 64;
    block = std::clamp<std::int64_t>(block, 1, sl.tokens);
    const float scale = std::sqrt(static_cast<float>(head_size));  // run.c: sqrtf(head_size)
    for (std::int64_t r0 = 0; r0 < sl.tokens; r0 += block) {
      const std::int64_t rows = std::min(block, sl.tokens - r0);
      const std::int64_t keys = sl.pos0 + r0 + rows;
      const std::int64_t ld = (keys + 7) / 8 * 8;
      const std::size_t elems = static_cast<std::size_t>(n_heads) * usize(rows) * usize(ld);
      auto* sc = static_cast<float*>(grow(scores, elems * sizeof(float)));
      void* pr = dtype == DType::F32 ? static_cast<void*>(sc) : grow(probs, elems * es);
      const auto* qb = static_cast<const char*>(q) + usize((sl.offset + r0) * dim) * es;
      auto* ob = static_cast<char*>(out) + usize((sl.offset + r0) * dim) * es;
      for (int member = 0; member < group; ++member)
        gemm(detail::plan_scores(rows, keys, ld, n_heads, n_kv_heads, head_size, member, dim,
                                 kv_dim),
             sl.k_cache, qb, dtype, sc, DType::F32, 1.0f, 0.0f);
      BRIGADE_CUDA_CHECK(detail::launch_causal_softmax(sc, pr, code(dtype), n_heads, rows, keys, ld,
                                                       sl.pos0 + r0 + 1, scale, s()));
      for (int member = 0; member < group; ++member)
        gemm(detail::plan_pv(rows, keys, ld, n_heads, n_kv_heads, head_size, member, kv_dim, dim),
             sl.v_cache, pr, dtype, ob, dtype, 1.0f, 0.0f);
    }
  }

  /// Attention over packed sequences: Direct for runs of short sequences, Gemm for long ones.
  void attention(DType dtype, const void* q, void* out, std::span<const SeqDesc> seqs,
                 const Meta& m, int n_heads, int n_kv_heads, int head_size, AttentionPath path) {
    if (path == AttentionPath::Auto) path = opt.attention;
    auto use_gemm = [&](const SeqDesc& sl) {
      if (path == AttentionPath::Gemm) return true;
      if (path == AttentionPath::Direct) return false;
      return sl.tokens >= opt.gemm_attention_min_tokens;
    };
    std::size_t i = 0;
    while (i < seqs.size()) {
      if (use_gemm(seqs[i])) {
        attention_gemm(dtype, q, out, seqs[i], n_heads, n_kv_heads, head_size);
        ++i;
        continue;
      }
      const std::int64_t row0 = seqs[i].offset;
      std::int64_t rows = 0;
      while (i < seqs.size() && !use_gemm(seqs[i])) rows += seqs[i++].tokens;
      BRIGADE_CUDA_CHECK(detail::launch_attention_direct(
          q, out, code(dtype), row0, rows, m.tok_seq, m.seqs, n_heads, n_kv_heads, head_size, s()));
    }
  }
};

CudaBackend::CudaBackend() : CudaBackend(Options{}) {}

CudaBackend::CudaBackend(Options options) {
  const DeviceInfo info = probe_devices();
  BRIGADE_CHECK(info.available, Errc::Cuda, "CudaBackend: no usable CUDA device: {}", info.reason);
  BRIGADE_CHECK(options.device >= 0 && options.device < info.count, Errc::Cuda,
                "CudaBackend: device {} requested; this machine has {} device(s)", options.device,
                info.count);
  BRIGADE_CHECK(options.gemm_attention_min_tokens >= 1 && options.attention_scratch_bytes > 0,
                Errc::InvalidArgument,
                "CudaBackend: gemm_attention_min_tokens = {}, attention_scratch_bytes = {}; "
                "expected >= 1 and > 0",
                options.gemm_attention_min_tokens, options.attention_scratch_bytes);
  BRIGADE_CUDA_CHECK(cudaSetDevice(options.device));
  impl_ = std::make_unique<Impl>(options);
  BRIGADE_CUBLAS_CHECK(cublasCreate(&impl_->blas));
  BRIGADE_CUBLAS_CHECK(cublasSetStream(impl_->blas, impl_->s()));
  // float32 GEMMs stay float32 (no TF32); bf16 operands use the tensor cores.
  BRIGADE_CUBLAS_CHECK(cublasSetMathMode(impl_->blas, CUBLAS_DEFAULT_MATH));
  constexpr std::size_t kWorkspace = std::size_t{32} << 20;
  impl_->blas_workspace = DeviceBuffer(kWorkspace, options.device);
  BRIGADE_CUBLAS_CHECK(cublasSetWorkspace(impl_->blas, impl_->blas_workspace.data(), kWorkspace));
}

CudaBackend::~CudaBackend() {
  if (impl_) {
    static_cast<void>(cudaSetDevice(impl_->opt.device));
    static_cast<void>(cudaStreamSynchronize(impl_->s()));
  }
}

CudaBackend::CudaBackend(CudaBackend&&) noexcept = default;
CudaBackend& CudaBackend::operator=(CudaBackend&&) noexcept = default;

int CudaBackend::device() const noexcept { return impl_->opt.device; }
const CudaBackend::Options& CudaBackend::options() const noexcept { return impl_->opt; }
CUstream_st* CudaBackend::stream() const noexcept { return impl_->s(); }

void CudaBackend::synchronize() {
  DeviceGuard g(impl_->opt.device);
  impl_->stream.synchronize();
}

DeviceBuffer CudaBackend::allocate(std::size_t bytes) {
  return DeviceBuffer(bytes, impl_->opt.device);
}

void CudaBackend::upload(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  DeviceGuard g(impl_->opt.device);
  BRIGADE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, impl_->s()));
}

void CudaBackend::download(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  DeviceGuard g(impl_->opt.device);
  BRIGADE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, impl_->s()));
  impl_->stream.synchronize();
}

void CudaBackend::copy(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  DeviceGuard g(impl_->opt.device);
  BRIGADE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, impl_->s()));
}

void CudaBackend::convert(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                          std::int64_t n) {
  BRIGADE_CHECK(n >= 0, Errc::InvalidArgument, "CudaBackend::convert: n = {}; expected >= 0", n);
  DeviceGuard g(impl_->opt.device);
  BRIGADE_CUDA_CHECK(
      detail::launch_convert(src, code(src_dtype), dst, code(dst_dtype), n, impl_->s()));
}

void CudaBackend::fill_random(void* dst, DType dtype, std::int64_t n, std::uint64_t seed,
                              float scale) {
  BRIGADE_CHECK(n >= 0, Errc::InvalidArgument, "CudaBackend::fill_random: n = {}; expected >= 0",
                n);
  DeviceGuard g(impl_->opt.device);
  BRIGADE_CUDA_CHECK(detail::launch_fill_random(dst, code(dtype), n, seed, scale, impl_->s()));
}

void CudaBackend::rmsnorm(const float* x, const float* w, void* out, DType out_dtype,
                          std::int64_t tokens, std::int64_t dim, float eps) {
  BRIGADE_CHECK(tokens >= 0 && dim > 0, Errc::InvalidArgument,
                "CudaBackend::rmsnorm: tokens = {}, dim = {}; expected tokens >= 0 and dim > 0",
                tokens, dim);
  DeviceGuard g(impl_->opt.device);
  BRIGADE_CUDA_CHECK(
      detail::launch_rmsnorm(x, w, out, code(out_dtype), tokens, dim, eps, impl_->s()));
}

void CudaBackend::matmul_wt(const void* x, const void* w, DType in_dtype, void* out,
                            DType out_dtype, std::int64_t tokens, std::int64_t in,
                            std::int64_t out_dim, bool accumulate) {
  BRIGADE_CHECK(tokens >= 0 && in >= 0 && out_dim >= 0, Errc::InvalidArgument,
                "CudaBackend::matmul_wt: shape tokens = {}, in = {}, out = {}; expected all >= 0",
                tokens, in, out_dim);
  BRIGADE_CHECK(!(in_dtype == DType::F32 && out_dtype == DType::BF16), Errc::InvalidArgument,
                "CudaBackend::matmul_wt: float32 operands with a bf16 output; expected the "
                "output float32");
  if (tokens == 0 || out_dim == 0) return;
  DeviceGuard g(impl_->opt.device);
  if (in == 0) {
    if (!accumulate)
      BRIGADE_CUDA_CHECK(
          cudaMemsetAsync(out, 0, usize(tokens * out_dim) * dtype_block_bytes(out_dtype), impl_->s()));
    return;
  }
  impl_->gemm(detail::plan_linear(tokens, in, out_dim), w, x, in_dtype, out, out_dtype, 1.0f,
              accumulate ? 1.0f : 0.0f);
}

void CudaBackend::rope(float* q, float* k, const std::int32_t* pos, std::int64_t tokens,
                       int n_heads, int n_kv_heads, int head_size, float theta) {
  check_heads("CudaBackend::rope", n_heads, n_kv_heads, head_size);
  BRIGADE_CHECK(tokens >= 0, Errc::InvalidArgument, "CudaBackend::rope: tokens = {}; expected >= 0",
                tokens);
  if (tokens == 0) return;
  DeviceGuard g(impl_->opt.device);
  const float* freq = impl_->rope_freq(head_size, theta);
  BRIGADE_CUDA_CHECK(detail::launch_rope(q, static_cast<std::int64_t>(n_heads) * head_size, k,
                                         static_cast<std::int64_t>(n_kv_heads) * head_size, pos,
                                         freq, tokens, n_heads, n_kv_heads, head_size, impl_->s()));
}

void CudaBackend::attention(DType dtype, const void* q, void* out,
                            std::span<const backend::SequenceSlice> seqs,
                            const backend::KvCacheView& cache, int n_heads, int n_kv_heads,
                            int head_size, AttentionPath path) {
  check_heads("CudaBackend::attention", n_heads, n_kv_heads, head_size);
  const std::int64_t tokens = backend::packed_rows(seqs);
  check_slices("CudaBackend::attention", tokens, seqs, cache, dtype,
               static_cast<std::int64_t>(n_kv_heads) * head_size, 0);
  if (tokens == 0) return;
  DeviceGuard g(impl_->opt.device);
  resolve(seqs, cache, impl_->resolved);
  const Impl::Meta m = impl_->upload_meta(tokens, impl_->resolved);
  impl_->attention(dtype, q, out, impl_->resolved, m, n_heads, n_kv_heads, head_size, path);
}

void CudaBackend::swiglu(const float* gate, const float* up, void* out, DType out_dtype,
                         std::int64_t n) {
  BRIGADE_CHECK(n >= 0, Errc::InvalidArgument, "CudaBackend::swiglu: n = {}; expected >= 0", n);
  DeviceGuard g(impl_->opt.device);
  BRIGADE_CUDA_CHECK(detail::launch_swiglu(gate, up, n, out, code(out_dtype), 1, n, impl_->s()));
}

void CudaBackend::embedding(const float* table, const std::int32_t* ids, float* out,
                            std::int64_t tokens, std::int64_t dim) {
  BRIGADE_CHECK(tokens >= 0 && dim > 0, Errc::InvalidArgument,
                "CudaBackend::embedding: tokens = {}, dim = {}; expected >= 0 and > 0", tokens,
                dim);
  DeviceGuard g(impl_->opt.device);
  BRIGADE_CUDA_CHECK(detail::launch_embedding(table, ids, out, tokens, dim, impl_->s()));
}

void CudaBackend::classifier(const float* x, const float* rms, const void* wcls, DType w_dtype,
                             float* logits, std::int64_t rows, std::int64_t dim, std::int64_t vocab,
                             float eps) {
  BRIGADE_CHECK(rows >= 0 && dim > 0 && vocab > 0, Errc::InvalidArgument,
                "CudaBackend::classifier: rows = {}, dim = {}, vocab = {}; expected >= 0, > 0, > 0",
                rows, dim, vocab);
  if (rows == 0) return;
  DeviceGuard g(impl_->opt.device);
  void* xb = impl_->grow(impl_->xb_buf, usize(rows * dim) * dtype_block_bytes(w_dtype));
  BRIGADE_CUDA_CHECK(detail::launch_rmsnorm(x, rms, xb, code(w_dtype), rows, dim, eps, impl_->s()));
  impl_->gemm(detail::plan_linear(rows, dim, vocab), wcls, xb, w_dtype, logits, DType::F32, 1.0f,
              0.0f);
}

void CudaBackend::argmax(const float* logits, std::int32_t* out, std::int64_t rows,
                         std::int64_t vocab) {
  BRIGADE_CHECK(rows >= 0 && vocab > 0 && vocab <= INT_MAX, Errc::InvalidArgument,
                "CudaBackend::argmax: rows = {}, vocab = {}; expected rows >= 0 and vocab in "
                "[1, 2^31)",
                rows, vocab);
  DeviceGuard g(impl_->opt.device);
  BRIGADE_CUDA_CHECK(detail::launch_argmax(logits, rows, vocab, out, impl_->s()));
}

void CudaBackend::sample(float* logits, std::int64_t rows, std::int64_t vocab, float temperature,
                         float top_p, std::span<const float> coins, std::int32_t* out) {
  BRIGADE_CHECK(temperature > 0.0f, Errc::InvalidArgument,
                "CudaBackend::sample: temperature = {}; expected > 0 (use argmax for greedy)",
                temperature);
  BRIGADE_CHECK(!(top_p > 0.0f && top_p < 1.0f), Errc::InvalidArgument,
                "CudaBackend::sample: top_p = {} asks for nucleus sampling, which runs on the "
                "host (model::Sampler); expected top_p <= 0 or >= 1 (the full distribution)",
                top_p);
  BRIGADE_CHECK(
      rows >= 0 && vocab > 0 && vocab <= INT_MAX && static_cast<std::int64_t>(coins.size()) == rows,
      Errc::InvalidArgument,
      "CudaBackend::sample: rows = {}, vocab = {}, {} coins; expected one coin per row "
      "and vocab in [1, 2^31)",
      rows, vocab, coins.size());
  if (rows == 0) return;
  DeviceGuard g(impl_->opt.device);
  auto* c = static_cast<float*>(impl_->grow(impl_->coins, coins.size() * sizeof(float)));
  BRIGADE_CUDA_CHECK(cudaMemcpyAsync(c, coins.data(), coins.size() * sizeof(float),
                                     cudaMemcpyHostToDevice, impl_->s()));
  BRIGADE_CUDA_CHECK(
      detail::launch_sample_multinomial(logits, rows, vocab, temperature, c, out, impl_->s()));
}

DeviceDecoderWeights CudaBackend::upload_decoder_weights(const model::LlamaConfig& config,
                                                         const model::DecoderWeights& w,
                                                         DType dtype) {
  config.validate("CudaBackend::upload_decoder_weights");
  BRIGADE_CHECK(w.rms_att && w.wq && w.wk && w.wv && w.wo && w.rms_ffn && w.w1 && w.w2 && w.w3,
                Errc::InvalidArgument,
                "CudaBackend::upload_decoder_weights: a DecoderWeights pointer is null; expected "
                "all 9 set");
  code(dtype);  // f32 or bf16, else InvalidArgument
  DeviceGuard g(impl_->opt.device);
  const std::int64_t dim = config.dim, kv = config.kv_dim(), hidden = config.hidden_dim;
  const std::size_t es = dtype_block_bytes(dtype);
  DeviceDecoderWeights d;
  d.dtype = dtype;
  d.rms_att = allocate(usize(dim) * sizeof(float));
  d.rms_ffn = allocate(usize(dim) * sizeof(float));
  d.wqkv = allocate(usize((dim + 2 * kv) * dim) * es);
  d.wo = allocate(usize(dim * dim) * es);
  d.w13 = allocate(usize(2 * hidden * dim) * es);
  d.w2 = allocate(usize(dim * hidden) * es);
  upload(d.rms_att.data(), w.rms_att, usize(dim) * sizeof(float));
  upload(d.rms_ffn.data(), w.rms_ffn, usize(dim) * sizeof(float));
  // Matrices: float32 rows uploaded through a staging buffer, converted into place. A typed
  // host matrix (F16, BF16, Q8_0) is dequantized on the host first (exact).
  DeviceBuffer tmp;
  std::vector<float> host;
  auto put = [&](DeviceBuffer& dst, std::int64_t row0, model::WeightMatrix m, std::int64_t rows,
                 std::int64_t cols) {
    const std::int64_t n = rows * cols;
    const float* src = nullptr;
    if (m.dtype == brigade::DType::F32) {
      src = m.f32();
    } else {
      synchronize();  // the previous upload may still read `host`
      host.resize(usize(n));
      model::dequantize_rows(m, cols, 0, rows, host.data());
      src = host.data();
    }
    void* at = static_cast<char*>(dst.data()) + usize(row0 * cols) * es;
    if (dtype == DType::F32) {
      upload(at, src, usize(n) * sizeof(float));
      return;
    }
    if (tmp.size() < usize(n) * sizeof(float)) {
      synchronize();  // the previous conversion may still read tmp
      tmp = allocate(usize(n) * sizeof(float));
    }
    upload(tmp.data(), src, usize(n) * sizeof(float));
    convert(tmp.data(), DType::F32, at, dtype, n);
  };
  put(d.wqkv, 0, w.wq, dim, dim);
  put(d.wqkv, dim, w.wk, kv, dim);
  put(d.wqkv, dim + kv, w.wv, kv, dim);
  put(d.wo, 0, w.wo, dim, dim);
  put(d.w13, 0, w.w1, hidden, dim);
  put(d.w13, hidden, w.w3, hidden, dim);
  put(d.w2, 0, w.w2, dim, hidden);
  synchronize();
  return d;
}

// --- the Backend concept ------------------------------------------------------------------------

model::WeightMatrix CudaBackend::upload_weight(model::WeightMatrix w, std::int64_t rows,
                                               std::int64_t cols) {
  BRIGADE_CHECK(rows >= 0 && cols >= 0 && w.data != nullptr, Errc::InvalidArgument,
                "CudaBackend::upload_weight: [{} x {}] at {}; expected sizes >= 0 and data",
                rows, cols, w.data);
  const float* host = nullptr;
  if (w.dtype == DType::F32) {
    host = w.f32();
  } else {
    impl_->dequantized.resize(usize(rows * cols));
    model::dequantize_rows(w, cols, 0, rows, impl_->dequantized.data());
    host = impl_->dequantized.data();
  }
  DeviceBuffer b = allocate(std::max<std::size_t>(usize(rows * cols) * sizeof(float), 256));
  upload(b.data(), host, usize(rows * cols) * sizeof(float));
  const model::WeightMatrix out(b.as<float>());
  impl_->weights.push_back(std::move(b));
  return out;
}

void CudaBackend::embedding(model::WeightMatrix table, const std::int32_t* ids, float* out,
                            std::int64_t tokens, std::int64_t dim) {
  embedding(table.f32(), ids, out, tokens, dim);
}

void CudaBackend::rmsnorm(const float* x, const float* w, float* out, std::int64_t tokens,
                          std::int64_t dim, float eps) {
  rmsnorm(x, w, static_cast<void*>(out), DType::F32, tokens, dim, eps);
}

void CudaBackend::matmul_wt(const float* x, model::WeightMatrix w, float* out,
                            std::int64_t tokens, std::int64_t in, std::int64_t out_dim,
                            bool accumulate) {
  matmul_wt(x, w.f32(), DType::F32, out, DType::F32, tokens, in, out_dim, accumulate);
}

void CudaBackend::attention(const backend::KvCacheView& cache, const float* q, const float* k,
                            const float* v, float* out,
                            std::span<const backend::SequenceSlice> seqs, int n_heads,
                            int n_kv_heads, int head_size) {
  check_heads("CudaBackend::attention", n_heads, n_kv_heads, head_size);
  const std::int64_t kv_dim = static_cast<std::int64_t>(n_kv_heads) * head_size;
  check_slices("CudaBackend::attention", backend::packed_rows(seqs), seqs, cache, DType::F32,
               kv_dim, 0);
  // This batch's keys and values into each slice's cache rows pos0.. (contiguous on both sides).
  resolve(seqs, cache, impl_->resolved);
  const std::size_t row_bytes = usize(kv_dim) * sizeof(float);
  for (const SeqDesc& d : impl_->resolved) {
    copy(static_cast<std::byte*>(d.k_cache) + usize(d.pos0) * row_bytes,
         k + d.offset * kv_dim, usize(d.tokens) * row_bytes);
    copy(static_cast<std::byte*>(d.v_cache) + usize(d.pos0) * row_bytes,
         v + d.offset * kv_dim, usize(d.tokens) * row_bytes);
  }
  attention(DType::F32, q, out, seqs, cache, n_heads, n_kv_heads, head_size);
}

void CudaBackend::swiglu(float* gate, const float* up, std::int64_t n) {
  swiglu(gate, up, static_cast<void*>(gate), DType::F32, n);
}

void CudaBackend::decoder_layer_forward(const model::LlamaConfig& config,
                                        const DeviceDecoderWeights& w, float* x,
                                        std::int64_t tokens,
                                        std::span<const backend::SequenceSlice> seqs,
                                        const backend::KvCacheView& cache) {
  config.validate("CudaBackend::decoder_layer_forward");
  check_slices("CudaBackend::decoder_layer_forward", tokens, seqs, cache, w.dtype, config.kv_dim(),
               config.seq_len);
  BRIGADE_CHECK(!w.wqkv.empty() && !w.wo.empty() && !w.w13.empty() && !w.w2.empty() &&
                    !w.rms_att.empty() && !w.rms_ffn.empty(),
                Errc::InvalidArgument,
                "CudaBackend::decoder_layer_forward: the DeviceDecoderWeights are empty; expected "
                "upload_decoder_weights' result");
  BRIGADE_CHECK(tokens == 0 || x != nullptr, Errc::InvalidArgument,
                "CudaBackend::decoder_layer_forward: x is null with tokens = {}", tokens);
  if (tokens == 0) return;
  DeviceGuard g(impl_->opt.device);
  Impl& m = *impl_;
  const DType dt = w.dtype;
  const std::size_t es = dtype_block_bytes(dt);
  const std::int64_t dim = config.dim, kv_dim = config.kv_dim(), hidden = config.hidden_dim;
  const std::int64_t qkv_n = dim + 2 * kv_dim;
  const int hs = config.head_size();
  resolve(seqs, cache, m.resolved);
  const Impl::Meta meta = m.upload_meta(tokens, m.resolved);
  void* xb = m.grow(m.xb_buf, usize(tokens * dim) * es);
  auto* qkv = static_cast<float*>(m.grow(m.qkv_buf, usize(tokens * qkv_n) * sizeof(float)));
  void* q = m.grow(m.q_buf, usize(tokens * dim) * es);
  void* att = m.grow(m.att_buf, usize(tokens * dim) * es);
  auto* h13 = static_cast<float*>(m.grow(m.h13_buf, usize(tokens * 2 * hidden) * sizeof(float)));
  void* hb = m.grow(m.hb_buf, usize(tokens * hidden) * es);
  const float* freq = m.rope_freq(hs, config.rope_theta);

  // Attention block.
  BRIGADE_CUDA_CHECK(detail::launch_rmsnorm(x, w.rms_att.as<float>(), xb, code(dt), tokens, dim,
                                            config.norm_eps, m.s()));
  m.gemm(detail::plan_linear(tokens, dim, qkv_n), w.wqkv.data(), xb, dt, qkv, DType::F32, 1.0f,
         0.0f);
  BRIGADE_CUDA_CHECK(detail::launch_rope(qkv, qkv_n, qkv + dim, qkv_n, meta.pos, freq, tokens,
                                         config.n_heads, config.n_kv_heads, hs, m.s()));
  BRIGADE_CUDA_CHECK(detail::launch_qkv_scatter(qkv, qkv_n, tokens, dim, kv_dim, meta.tok_seq,
                                                meta.seqs, q, code(dt), m.s()));
  m.attention(dt, q, att, m.resolved, meta, config.n_heads, config.n_kv_heads, hs,
              AttentionPath::Auto);
  m.gemm(detail::plan_linear(tokens, dim, dim), w.wo.data(), att, dt, x, DType::F32, 1.0f, 1.0f);

  // FFN block.
  BRIGADE_CUDA_CHECK(detail::launch_rmsnorm(x, w.rms_ffn.as<float>(), xb, code(dt), tokens, dim,
                                            config.norm_eps, m.s()));
  m.gemm(detail::plan_linear(tokens, dim, 2 * hidden), w.w13.data(), xb, dt, h13, DType::F32, 1.0f,
         0.0f);
  BRIGADE_CUDA_CHECK(
      detail::launch_swiglu(h13, h13 + hidden, 2 * hidden, hb, code(dt), tokens, hidden, m.s()));
  m.gemm(detail::plan_linear(tokens, hidden, dim), w.w2.data(), hb, dt, x, DType::F32, 1.0f, 1.0f);
}

// --- training (TrainingBackend) ------------------------------------------------------------------

namespace {

/// The gemm plans' float32 operands of one training GEMM.
constexpr DType kF = DType::F32;

float* fp(DeviceBuffer& b) { return b.as<float>(); }
const float* fp(const DeviceBuffer& b) { return b.as<float>(); }

/// cu_seqlens-style offsets of `tokens` rows, each sequence at most max_len long (the CPU's
/// cpu::validate_offsets, whose messages these follow).
void check_offsets(const char* what, std::span<const std::int64_t> offsets, std::int64_t tokens,
                   std::int64_t max_len) {
  BRIGADE_CHECK(offsets.size() >= 2 && offsets.front() == 0, Errc::InvalidArgument,
                "{}: offsets has {} entries starting at {}; expected n_seq + 1 >= 2 entries "
                "starting at 0",
                what, offsets.size(), offsets.empty() ? -1 : offsets.front());
  for (std::size_t i = 1; i < offsets.size(); ++i) {
    BRIGADE_CHECK(offsets[i] > offsets[i - 1], Errc::InvalidArgument,
                  "{}: offsets[{}] = {} after {}; expected strictly increasing", what, i,
                  offsets[i], offsets[i - 1]);
    BRIGADE_CHECK(offsets[i] - offsets[i - 1] <= max_len, Errc::InvalidArgument,
                  "{}: sequence {} has {} tokens; expected at most seq_len = {}", what, i - 1,
                  offsets[i] - offsets[i - 1], max_len);
  }
  BRIGADE_CHECK(offsets.back() == tokens, Errc::InvalidArgument,
                "{}: offsets end at {}; expected tokens = {}", what, offsets.back(), tokens);
}

void check_train_weights(const char* what, const model::DecoderWeights& w) {
  BRIGADE_CHECK(w.rms_att && w.rms_ffn && w.wq && w.wk && w.wv && w.wo && w.w1 && w.w2 && w.w3,
                Errc::InvalidArgument, "{}: a DecoderWeights pointer is null; expected all 9 set",
                what);
  for (const model::WeightMatrix* m : {&w.wq, &w.wk, &w.wv, &w.wo, &w.w1, &w.w2, &w.w3})
    BRIGADE_CHECK(m->dtype == DType::F32, Errc::InvalidArgument,
                  "{}: a {} weight matrix; training on the GPU reads float32 (TrainStage uploads "
                  "its float32 master copy)",
                  what, to_string(m->dtype));
}

}  // namespace

std::size_t CudaDecoderActivations::bytes() const noexcept {
  std::size_t n = 0;
  for (const DeviceBuffer* b : {&rows, &x_in, &inv_rms_att, &xb_att, &q, &k, &v, &lse, &att,
                                &x_mid, &inv_rms_ffn, &xb_ffn, &h1, &h3, &d_mid, &dy, &hb,
                                &d_rms_att, &d_rms_ffn})
    n += b->size();
  return n;
}

void CudaDecoderActivations::clear() noexcept {
  phase = Phase::Empty;
  tokens = 0;
  for (DeviceBuffer* b : {&rows, &x_in, &inv_rms_att, &xb_att, &q, &k, &v, &lse, &att, &x_mid,
                          &inv_rms_ffn, &xb_ffn, &h1, &h3, &d_mid, &dy, &hb, &d_rms_att,
                          &d_rms_ffn})
    *b = DeviceBuffer();
}

void CudaBackend::fill_zero(void* dst, std::size_t bytes) {
  if (bytes == 0) return;
  DeviceGuard g(impl_->opt.device);
  BRIGADE_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, impl_->s()));
}

void CudaBackend::decoder_train_forward(const model::LlamaConfig& config,
                                        const model::DecoderWeights& w, const float* x_in,
                                        float* x_out, std::int64_t tokens,
                                        std::span<const std::int64_t> offsets,
                                        DecoderActivations& acts, TrainScratch* scratch) {
  const char* what = "CudaBackend::decoder_train_forward";
  config.validate(what);
  check_train_weights(what, w);
  BRIGADE_CHECK(tokens >= 1, Errc::InvalidArgument, "{}: tokens = {}; expected >= 1", what,
                tokens);
  BRIGADE_CHECK(x_in != nullptr && x_out != nullptr, Errc::InvalidArgument,
                "{}: x_in or x_out is null", what);
  check_offsets(what, offsets, tokens, config.seq_len);
  DeviceGuard g(impl_->opt.device);
  Impl& m = *impl_;
  TrainScratch local;
  TrainScratch& sc = scratch != nullptr ? *scratch : local;
  const std::int64_t dim = config.dim, kv_dim = config.kv_dim(), hidden = config.hidden_dim;
  const int hs = config.head_size();
  const std::size_t f = sizeof(float);
  acts.clear();
  acts.tokens = tokens;
  // Row metadata: position within the sequence, the sequence's first row and its end.
  std::vector<std::int32_t> meta(usize(3 * tokens));
  for (std::size_t s = 0; s + 1 < offsets.size(); ++s)
    for (std::int64_t t = offsets[s]; t < offsets[s + 1]; ++t) {
      meta[usize(t)] = static_cast<std::int32_t>(t - offsets[s]);
      meta[usize(tokens + t)] = static_cast<std::int32_t>(offsets[s]);
      meta[usize(2 * tokens + t)] = static_cast<std::int32_t>(offsets[s + 1]);
    }
  acts.rows = allocate(meta.size() * sizeof(std::int32_t));
  upload(acts.rows.data(), meta.data(), meta.size() * sizeof(std::int32_t));
  const auto* pos = acts.rows.as<std::int32_t>();
  const std::int32_t* seq_begin = pos + tokens;
  auto buf = [&](DeviceBuffer& b, std::int64_t n) { b = allocate(usize(n) * f); return fp(b); };
  float* xin = buf(acts.x_in, tokens * dim);
  copy(xin, x_in, usize(tokens * dim) * f);  // before x_out (which may alias) is written

  // Attention block.
  float* xb = buf(acts.xb_att, tokens * dim);
  BRIGADE_CUDA_CHECK(detail::launch_rmsnorm_train(xin, w.rms_att, xb,
                                                  buf(acts.inv_rms_att, tokens), tokens, dim,
                                                  config.norm_eps, m.s()));
  float* q = buf(acts.q, tokens * dim);
  float* k = buf(acts.k, tokens * kv_dim);
  float* v = buf(acts.v, tokens * kv_dim);
  m.gemm(detail::plan_linear(tokens, dim, dim), w.wq.f32(), xb, kF, q, kF, 1.0f, 0.0f);
  m.gemm(detail::plan_linear(tokens, dim, kv_dim), w.wk.f32(), xb, kF, k, kF, 1.0f, 0.0f);
  m.gemm(detail::plan_linear(tokens, dim, kv_dim), w.wv.f32(), xb, kF, v, kF, 1.0f, 0.0f);
  BRIGADE_CUDA_CHECK(detail::launch_rope_train(q, k, pos, m.rope_freq(hs, config.rope_theta),
                                               tokens, dim, kv_dim, hs, false, m.s()));
  float* att = buf(acts.att, tokens * dim);
  BRIGADE_CUDA_CHECK(detail::launch_attention_train_forward(
      q, k, v, att, buf(acts.lse, tokens * config.n_heads), seq_begin, tokens, config.n_heads,
      config.n_kv_heads, hs, m.s()));
  float* xmid = buf(acts.x_mid, tokens * dim);
  copy(xmid, xin, usize(tokens * dim) * f);
  m.gemm(detail::plan_linear(tokens, dim, dim), w.wo.f32(), att, kF, xmid, kF, 1.0f, 1.0f);

  // FFN block.
  float* xf = buf(acts.xb_ffn, tokens * dim);
  BRIGADE_CUDA_CHECK(detail::launch_rmsnorm_train(xmid, w.rms_ffn, xf,
                                                  buf(acts.inv_rms_ffn, tokens), tokens, dim,
                                                  config.norm_eps, m.s()));
  float* h1 = buf(acts.h1, tokens * hidden);
  float* h3 = buf(acts.h3, tokens * hidden);
  m.gemm(detail::plan_linear(tokens, dim, hidden), w.w1.f32(), xf, kF, h1, kF, 1.0f, 0.0f);
  m.gemm(detail::plan_linear(tokens, dim, hidden), w.w3.f32(), xf, kF, h3, kF, 1.0f, 0.0f);
  auto* hb = static_cast<float*>(m.grow(sc.a, usize(tokens * hidden) * f));
  BRIGADE_CUDA_CHECK(
      detail::launch_swiglu(h1, h3, hidden, hb, detail::kF32, tokens, hidden, m.s()));
  copy(x_out, xmid, usize(tokens * dim) * f);
  m.gemm(detail::plan_linear(tokens, hidden, dim), w.w2.f32(), hb, kF, x_out, kF, 1.0f, 1.0f);
  acts.phase = DecoderActivations::Phase::Forward;
}

void CudaBackend::decoder_backward_input(const model::LlamaConfig& config,
                                         const model::DecoderWeights& w, DecoderActivations& acts,
                                         const float* dy, float* dx, TrainScratch* scratch) {
  const char* what = "CudaBackend::decoder_backward_input";
  config.validate(what);
  check_train_weights(what, w);
  BRIGADE_CHECK(acts.phase == DecoderActivations::Phase::Forward, Errc::InvalidUsage,
                "{}: activations are in phase {}; expected {} (Forward: run "
                "decoder_train_forward first)",
                what, static_cast<int>(acts.phase),
                static_cast<int>(DecoderActivations::Phase::Forward));
  BRIGADE_CHECK(dy != nullptr && dx != nullptr, Errc::InvalidArgument, "{}: dy or dx is null",
                what);
  const std::int64_t tokens = acts.tokens;
  const std::int64_t dim = config.dim, kv_dim = config.kv_dim(), hidden = config.hidden_dim;
  const int hs = config.head_size();
  const std::size_t f = sizeof(float);
  BRIGADE_CHECK(acts.x_in.size() == usize(tokens * dim) * f &&
                    acts.h1.size() == usize(tokens * hidden) * f,
                Errc::InvalidArgument,
                "{}: activations of {} tokens do not match this config (dim = {}, hidden_dim = "
                "{})",
                what, tokens, dim, hidden);
  DeviceGuard g(impl_->opt.device);
  Impl& m = *impl_;
  TrainScratch local;
  TrainScratch& sc = scratch != nullptr ? *scratch : local;
  auto buf = [&](DeviceBuffer& b, std::int64_t n) { b = allocate(usize(n) * f); return fp(b); };
  float* dyc = buf(acts.dy, tokens * dim);
  copy(dyc, dy, usize(tokens * dim) * f);  // before dx (which may alias) is written

  // FFN block: x_out = x_mid + hb W2^T, hb = silu(h1) * h3, h1/h3 = xb_ffn W1^T / W3^T.
  auto* dhb = static_cast<float*>(m.grow(sc.a, usize(tokens * hidden) * f));
  m.gemm(detail::plan_linear_backward_input(tokens, hidden, dim), w.w2.f32(), dyc, kF, dhb, kF,
         1.0f, 0.0f);
  float* h1 = fp(acts.h1);
  float* h3 = fp(acts.h3);
  BRIGADE_CUDA_CHECK(detail::launch_swiglu_backward(h1, h3, dhb, h1, h3,
                                                    buf(acts.hb, tokens * hidden),
                                                    tokens * hidden, m.s()));  // h1, h3: dh1, dh3
  auto* dxb = static_cast<float*>(m.grow(sc.b, usize(tokens * dim) * f));
  m.gemm(detail::plan_linear_backward_input(tokens, dim, hidden), w.w1.f32(), h1, kF, dxb, kF,
         1.0f, 0.0f);
  m.gemm(detail::plan_linear_backward_input(tokens, dim, hidden), w.w3.f32(), h3, kF, dxb, kF,
         1.0f, 1.0f);
  float* dmid = buf(acts.d_mid, tokens * dim);
  copy(dmid, dyc, usize(tokens * dim) * f);
  float* drf = buf(acts.d_rms_ffn, dim);
  fill_zero(drf, usize(dim) * f);
  BRIGADE_CUDA_CHECK(detail::launch_rmsnorm_backward(fp(acts.x_mid), w.rms_ffn,
                                                     fp(acts.inv_rms_ffn), dxb, dmid, drf, tokens,
                                                     dim, true, m.s()));

  // Attention block: x_mid = x_in + att Wo^T.
  float* datt = dxb;
  m.gemm(detail::plan_linear_backward_input(tokens, dim, dim), w.wo.f32(), dmid, kF, datt, kF,
         1.0f, 0.0f);
  const auto* pos = acts.rows.as<std::int32_t>();
  DeviceBuffer dq = allocate(usize(tokens * dim) * f), dk = allocate(usize(tokens * kv_dim) * f),
               dv = allocate(usize(tokens * kv_dim) * f);
  auto* dsum = static_cast<float*>(m.grow(sc.c, usize(tokens * config.n_heads) * f));
  BRIGADE_CUDA_CHECK(detail::launch_attention_train_backward(
      fp(acts.q), fp(acts.k), fp(acts.v), fp(acts.att), fp(acts.lse), datt, dsum, fp(dq), fp(dk),
      fp(dv), pos + tokens, pos + 2 * tokens, tokens, config.n_heads, config.n_kv_heads, hs,
      m.s()));
  BRIGADE_CUDA_CHECK(detail::launch_rope_train(fp(dq), fp(dk), pos,
                                               m.rope_freq(hs, config.rope_theta), tokens, dim,
                                               kv_dim, hs, true, m.s()));
  acts.q = std::move(dq);
  acts.k = std::move(dk);
  acts.v = std::move(dv);
  acts.lse = DeviceBuffer();
  acts.x_mid = DeviceBuffer();
  acts.inv_rms_ffn = DeviceBuffer();
  m.gemm(detail::plan_linear_backward_input(tokens, dim, dim), w.wq.f32(), fp(acts.q), kF, dxb,
         kF, 1.0f, 0.0f);
  m.gemm(detail::plan_linear_backward_input(tokens, dim, kv_dim), w.wk.f32(), fp(acts.k), kF,
         dxb, kF, 1.0f, 1.0f);
  m.gemm(detail::plan_linear_backward_input(tokens, dim, kv_dim), w.wv.f32(), fp(acts.v), kF,
         dxb, kF, 1.0f, 1.0f);
  copy(dx, dmid, usize(tokens * dim) * f);
  float* dra = buf(acts.d_rms_att, dim);
  fill_zero(dra, usize(dim) * f);
  BRIGADE_CUDA_CHECK(detail::launch_rmsnorm_backward(fp(acts.x_in), w.rms_att,
                                                     fp(acts.inv_rms_att), dxb, dx, dra, tokens,
                                                     dim, true, m.s()));
  acts.x_in = DeviceBuffer();
  acts.inv_rms_att = DeviceBuffer();
  acts.phase = DecoderActivations::Phase::BackwardInput;
}

void CudaBackend::decoder_backward_weight(const model::LlamaConfig& config,
                                          DecoderActivations& acts,
                                          const backend::DecoderGradTensors& grads) {
  const char* what = "CudaBackend::decoder_backward_weight";
  config.validate(what);
  BRIGADE_CHECK(acts.phase == DecoderActivations::Phase::BackwardInput, Errc::InvalidUsage,
                "{}: activations are in phase {}; expected {} (BackwardInput: run "
                "decoder_backward_input first)",
                what, static_cast<int>(acts.phase),
                static_cast<int>(DecoderActivations::Phase::BackwardInput));
  for (std::size_t i = 0; i < grads.size(); ++i)
    BRIGADE_CHECK(grads[i] != nullptr, Errc::InvalidArgument, "{}: gradient tensor {} is null",
                  what, i);
  DeviceGuard g(impl_->opt.device);
  Impl& m = *impl_;
  const std::int64_t T = acts.tokens;
  const std::int64_t dim = config.dim, kv_dim = config.kv_dim(), hidden = config.hidden_dim;
  auto bw = [&](const DeviceBuffer& dy, const DeviceBuffer& x, float* dw, std::int64_t in,
                std::int64_t out) {
    m.gemm(detail::plan_linear_backward_weight(T, in, out), fp(x), fp(dy), kF, dw, kF, 1.0f,
           1.0f);
  };
  bw(acts.q, acts.xb_att, grads[1], dim, dim);
  bw(acts.k, acts.xb_att, grads[2], dim, kv_dim);
  bw(acts.v, acts.xb_att, grads[3], dim, kv_dim);
  bw(acts.d_mid, acts.att, grads[4], dim, dim);
  bw(acts.h1, acts.xb_ffn, grads[6], dim, hidden);
  bw(acts.h3, acts.xb_ffn, grads[8], dim, hidden);
  bw(acts.dy, acts.hb, grads[7], hidden, dim);
  BRIGADE_CUDA_CHECK(detail::launch_add(fp(acts.d_rms_att), grads[0], dim, m.s()));
  BRIGADE_CUDA_CHECK(detail::launch_add(fp(acts.d_rms_ffn), grads[5], dim, m.s()));
  acts.clear();
}

cpu::CrossEntropyLoss CudaBackend::head_forward_backward_input(
    const model::LlamaConfig& config, const float* rms_final, const float* wcls, const float* x,
    const std::int32_t* targets, std::int64_t tokens, float* dx, HeadActivations& acts,
    double grad_denominator) {
  const char* what = "CudaBackend::head_forward_backward_input";
  config.validate(what);
  BRIGADE_CHECK(tokens >= 1, Errc::InvalidArgument, "{}: tokens = {}; expected >= 1", what,
                tokens);
  BRIGADE_CHECK(rms_final && wcls && x && targets && dx, Errc::InvalidArgument,
                "{}: a null pointer among rms_final, wcls, x, targets, dx", what);
  BRIGADE_CHECK(grad_denominator >= 0.0, Errc::InvalidArgument,
                "{}: grad_denominator = {}; expected >= 0 (0 = mean over targets)", what,
                grad_denominator);
  DeviceGuard g(impl_->opt.device);
  Impl& m = *impl_;
  const std::int64_t dim = config.dim, vocab = config.vocab_size;
  const std::size_t f = sizeof(float);
  acts = HeadActivations{};
  std::vector<std::int32_t> host_targets(usize(tokens));
  download(host_targets.data(), targets, usize(tokens) * sizeof(std::int32_t));
  cpu::CrossEntropyLoss loss;
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::int32_t y = host_targets[usize(t)];
    BRIGADE_CHECK(y == -1 || (y >= 0 && y < vocab), Errc::InvalidArgument,
                  "{}: targets[{}] = {}; expected -1 (ignore) or an id in [0, {})", what, t, y,
                  vocab);
    if (y != -1) ++loss.count;
  }
  const double denom = grad_denominator > 0.0
                           ? grad_denominator
                           : static_cast<double>(std::max<std::int64_t>(loss.count, 1));
  const auto inv_denom = static_cast<float>(1.0 / denom);
  acts.tokens = tokens;
  acts.xn = allocate(usize(tokens * dim) * f);
  acts.dlogits = allocate(usize(tokens * vocab) * f);
  acts.d_rms = allocate(usize(dim) * f);
  DeviceBuffer inv_rms = allocate(usize(tokens) * f);
  DeviceBuffer row_loss = allocate(usize(tokens) * sizeof(double));
  DeviceBuffer dxn = allocate(usize(tokens * dim) * f);
  BRIGADE_CUDA_CHECK(detail::launch_rmsnorm_train(x, rms_final, fp(acts.xn), fp(inv_rms), tokens,
                                                  dim, config.norm_eps, m.s()));
  m.gemm(detail::plan_linear(tokens, dim, vocab), wcls, fp(acts.xn), kF, fp(acts.dlogits), kF,
         1.0f, 0.0f);
  BRIGADE_CUDA_CHECK(detail::launch_cross_entropy(fp(acts.dlogits), targets, fp(acts.dlogits),
                                                  row_loss.as<double>(), tokens, vocab, inv_denom,
                                                  m.s()));
  m.gemm(detail::plan_linear_backward_input(tokens, dim, vocab), wcls, fp(acts.dlogits), kF,
         fp(dxn), kF, 1.0f, 0.0f);
  fill_zero(acts.d_rms.data(), usize(dim) * f);
  BRIGADE_CUDA_CHECK(detail::launch_rmsnorm_backward(x, rms_final, fp(inv_rms), fp(dxn), dx,
                                                     fp(acts.d_rms), tokens, dim, false, m.s()));
  std::vector<double> rows(usize(tokens));
  download(rows.data(), row_loss.data(), rows.size() * sizeof(double));
  for (const double r : rows) loss.sum += r;  // row order, as the CPU's sum
  return loss;
}

void CudaBackend::head_backward_weight(const model::LlamaConfig& config, HeadActivations& acts,
                                       float* d_rms_final, float* d_wcls) {
  const char* what = "CudaBackend::head_backward_weight";
  const std::int64_t dim = config.dim, vocab = config.vocab_size;
  const std::size_t f = sizeof(float);
  BRIGADE_CHECK(acts.tokens >= 1 && acts.xn.size() == usize(acts.tokens * dim) * f &&
                    acts.dlogits.size() == usize(acts.tokens * vocab) * f &&
                    acts.d_rms.size() == usize(dim) * f,
                Errc::InvalidUsage,
                "{}: acts holds no head_forward_backward_input stash for this config (tokens = "
                "{}, xn {} bytes, dlogits {} bytes)",
                what, acts.tokens, acts.xn.size(), acts.dlogits.size());
  BRIGADE_CHECK(d_rms_final && d_wcls, Errc::InvalidArgument, "{}: d_rms_final or d_wcls is null",
                what);
  DeviceGuard g(impl_->opt.device);
  Impl& m = *impl_;
  m.gemm(detail::plan_linear_backward_weight(acts.tokens, dim, vocab), fp(acts.xn),
         fp(acts.dlogits), kF, d_wcls, kF, 1.0f, 1.0f);
  BRIGADE_CUDA_CHECK(detail::launch_add(fp(acts.d_rms), d_rms_final, dim, m.s()));
  acts = HeadActivations{};
}

void CudaBackend::embedding_backward(const float* dy, const std::int32_t* ids, float* dtable,
                                     std::int64_t tokens, std::int64_t dim, std::int64_t vocab) {
  const char* what = "CudaBackend::embedding_backward";
  BRIGADE_CHECK(tokens >= 0 && dim > 0, Errc::InvalidArgument,
                "{}: tokens = {}, dim = {}; expected tokens >= 0, dim > 0", what, tokens, dim);
  if (tokens == 0) return;
  DeviceGuard g(impl_->opt.device);
  std::vector<std::int32_t> host_ids(usize(tokens));
  download(host_ids.data(), ids, usize(tokens) * sizeof(std::int32_t));
  for (std::int64_t t = 0; t < tokens; ++t)
    BRIGADE_CHECK(host_ids[usize(t)] >= 0 && host_ids[usize(t)] < vocab, Errc::InvalidArgument,
                  "{}: ids[{}] = {}; expected in [0, vocab = {})", what, t, host_ids[usize(t)],
                  vocab);
  BRIGADE_CUDA_CHECK(detail::launch_embedding_backward(dy, ids, dtable, tokens, dim, impl_->s()));
}

}  // namespace v0
}  // namespace brigade::cuda
