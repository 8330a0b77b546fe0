// CudaBackend: the Llama decoder's forward kernels on an NVIDIA GPU (cuBLAS GEMMs plus brigade's
// kernels in cuda/kernels.cu), with device memory, streams and events.
//
// This header declares only: it includes neither cuda_runtime.h nor cuBLAS, so it compiles with
// plain g++ on a machine without CUDA. CUDA objects appear as opaque handles (CUstream_st*,
// CUevent_st*: the types behind cudaStream_t and cudaEvent_t). Linking needs brigade::cuda
// (BRIGADE_HAS_CUDA in <brigade/config.hpp> says whether this build has it).
//
// Layouts follow the CPU backend (brigade/backend/cpu.hpp): activations are row-major
// [tokens x width]; tokens of several sequences are packed one after another (varlen, as
// cu_seqlens); weight matrices are llama2.c's row-major [out x in]. Every pointer a kernel takes
// is device memory on the backend's device. Kernels are asynchronous: they are enqueued on
// the backend's stream and return at once; CudaBackend::synchronize() (or a download) waits.
//
// Precision: DType::F32 computes in float32 throughout (cuBLAS with CUBLAS_COMPUTE_32F and no
// TF32), matching the CPU backend to ~1e-5 relative; DType::BF16 feeds bfloat16 operands to the
// tensor cores with float32 accumulation and float32 outputs, while norms, RoPE, softmax and the
// residual stream stay float32 (~1e-2 relative to the CPU backend).
//
// Under the engines CudaBackend models backend::Backend (inference: runtime::InferenceStage<
// CudaBackend>) and backend::TrainingBackend (training: runtime::TrainStage<CudaBackend>, float32,
// the backward kernels of cuda/train_math.hpp plus cuBLAS GEMMs; docs/cuda.md).
#pragma once

#include "brigade/backend/backend.hpp"
#include "brigade/backend/cpu_train.hpp"
#include "brigade/core/dtype.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/weight_matrix.hpp"
#include "brigade/model/weights.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

struct CUstream_st;  // cudaStream_t is CUstream_st*
struct CUevent_st;   // cudaEvent_t is CUevent_st*

namespace brigade::cuda {
inline namespace v0 {

/// What the CUDA runtime reports about this machine's GPUs.
struct DeviceInfo {
  bool available = false;  ///< true when at least one device can be used
  int count = 0;           ///< number of devices (0 when unavailable)
  std::string reason;      ///< why not, e.g. "cudaErrorInsufficientDriver: CUDA driver version is
                           ///< insufficient for CUDA runtime version"; empty when available
  std::string name;        ///< device 0's name ("NVIDIA H200"), when available
  int compute_major = 0;   ///< device 0's compute capability, when available
  int compute_minor = 0;
};

/// Probes the GPUs with cudaGetDeviceCount (keyed on its return code: without a driver it returns
/// cudaErrorInsufficientDriver and leaves the count unwritten). Never throws; tests call it to
/// decide whether to skip.
DeviceInfo probe_devices() noexcept;

/// Owning device memory (cudaMalloc / cudaFree), move-only. Allocates on the device current for
/// the calling thread, or on `device` when given.
class DeviceBuffer {
 public:
  /// An empty buffer (no memory).
  DeviceBuffer() noexcept = default;
  /// `bytes` bytes of uninitialised device memory on `device` (-1: the current device).
  /// @throws brigade::Error{Cuda} when cudaMalloc fails (the message gives the size and the
  ///         CUDA error name)
  explicit DeviceBuffer(std::size_t bytes, int device = -1);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  /// The device address (nullptr when empty).
  [[nodiscard]] void* data() noexcept { return data_; }
  [[nodiscard]] const void* data() const noexcept { return data_; }
  /// The device address as T*.
  template <class T>
  [[nodiscard]] T* as() noexcept {
    return static_cast<T*>(data_);
  }
  template <class T>
  [[nodiscard]] const T* as() const noexcept {
    return static_cast<const T*>(data_);
  }
  /// Size in bytes.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// True when no memory is held.
  [[nodiscard]] bool empty() const noexcept { return data_ == nullptr; }

  /// Copies `bytes` bytes from host memory `src` to offset `offset` of this buffer and waits
  /// until the data is on the device. Not ordered with any stream: work enqueued earlier that
  /// reads or writes the buffer must have finished (synchronize its stream first).
  /// @throws brigade::Error{InvalidArgument} if [offset, offset + bytes) exceeds size();
  ///         Error{Cuda} if the copy fails
  void copy_from_host(const void* src, std::size_t bytes, std::size_t offset = 0);
  /// Copies `bytes` bytes from offset `offset` of this buffer to host memory `dst` and waits.
  /// Not ordered with any stream: synchronize the stream that wrote the buffer first.
  /// @throws as copy_from_host
  void copy_to_host(void* dst, std::size_t bytes, std::size_t offset = 0) const;

 private:
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

/// A non-blocking CUDA stream (cudaStreamCreateWithFlags(cudaStreamNonBlocking)), move-only.
class Stream {
 public:
  /// A new stream on the current device.
  /// @throws brigade::Error{Cuda} on failure
  Stream();
  ~Stream();
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  /// The cudaStream_t.
  [[nodiscard]] CUstream_st* native() const noexcept { return stream_; }
  /// Blocks until all work enqueued on the stream has finished.
  /// @throws brigade::Error{Cuda} with the first asynchronous error a kernel reported
  void synchronize() const;

 private:
  CUstream_st* stream_ = nullptr;
};

/// A CUDA event for ordering streams and timing (timing enabled), move-only.
class Event {
 public:
  /// @throws brigade::Error{Cuda} on failure
  Event();
  ~Event();
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  /// Records the event at the current end of `stream` (cudaEventRecord).
  void record(CUstream_st* stream);
  /// Makes `stream` wait for this event's last record without blocking the host
  /// (cudaStreamWaitEvent).
  void wait_on(CUstream_st* stream) const;
  /// Blocks the host until the last record has completed.
  void synchronize() const;
  /// True when the last record has completed (never blocks).
  [[nodiscard]] bool query() const;
  /// Milliseconds between `start`'s last record and this event's last record (both completed).
  [[nodiscard]] float elapsed_ms_since(const Event& start) const;
  /// The cudaEvent_t.
  [[nodiscard]] CUevent_st* native() const noexcept { return event_; }

 private:
  CUevent_st* event_ = nullptr;
};

/// One decoder layer's weights on the device, packed for fewer, larger GEMMs.
struct DeviceDecoderWeights {
  DType dtype = DType::F32;  ///< dtype of the matrices (the norms' gains are always float32)
  DeviceBuffer rms_att;      ///< [dim] float32
  DeviceBuffer rms_ffn;      ///< [dim] float32
  DeviceBuffer wqkv;         ///< [(dim + 2 kv_dim) x dim]: wq's rows, then wk's, then wv's
  DeviceBuffer wo;           ///< [dim x dim]
  DeviceBuffer w13;          ///< [2 hidden_dim x dim]: w1's rows (gate), then w3's (up)
  DeviceBuffer w2;           ///< [dim x hidden_dim]
};

/// What one micro-batch's training forward stashes in device memory for its backward, and what
/// the backward-input stashes for the backward-weight (the device form of
/// cpu::DecoderActivations: the same tensors, each a DeviceBuffer of float32, [tokens x width]
/// row-major). Memory per token is cpu::DecoderActivations's plus 12 bytes of row metadata.
struct CudaDecoderActivations {
  /// Which pass the stash is ready for (as cpu::DecoderActivations::Phase).
  enum class Phase : std::uint8_t { Empty, Forward, BackwardInput };
  Phase phase = Phase::Empty;
  std::int64_t tokens = 0;
  DeviceBuffer rows;  ///< int32 [3 x tokens]: position, first row and end row of each row's sequence
  // Forward stash (q, k, v, h1, h3 hold their gradients after the backward-input).
  DeviceBuffer x_in, inv_rms_att, xb_att, q, k, v, lse, att, x_mid, inv_rms_ffn, xb_ffn, h1, h3;
  // Backward-input stash.
  DeviceBuffer d_mid, dy, hb, d_rms_att, d_rms_ffn;
  /// Device bytes held.
  [[nodiscard]] std::size_t bytes() const noexcept;
  /// Frees every buffer (cudaFree: waits for the device); phase Empty.
  void clear() noexcept;
};

/// The head's stash between head_forward_backward_input and head_backward_weight, in device
/// memory: xn [tokens x dim], dlogits [tokens x vocab], d_rms [dim], float32.
struct CudaHeadActivations {
  std::int64_t tokens = 0;
  DeviceBuffer xn, dlogits, d_rms;
  /// Device bytes held.
  [[nodiscard]] std::size_t bytes() const noexcept { return xn.size() + dlogits.size() + d_rms.size(); }
};

/// Grow-only device work buffers of the training passes (one per stage; nothing is kept between
/// calls).
struct CudaTrainScratch {
  DeviceBuffer a, b, c;
};

/// How attention() computes scores.
enum class AttentionPath : std::uint8_t {
  Auto,    ///< Gemm for sequences with at least Options::gemm_attention_min_tokens new tokens,
           ///< Direct otherwise (decode)
  Direct,  ///< one kernel: a thread block per (query row, head), online softmax over key tiles
  Gemm,    ///< per sequence and block of query rows: S = Q K^T and O = P V as strided-batched
           ///< cuBLAS GEMMs (tensor cores in bf16), with a causal softmax kernel between them
};

/// The decoder's forward kernels on one GPU. Every DType parameter takes DType::F32 or DType::BF16
/// (another dtype throws brigade::Error{InvalidArgument}). Owns a stream, a cuBLAS handle and grow-only
/// scratch memory; not thread-safe (one backend per thread). Models the DESIGN.md Backend role
/// for the forward pass: memory, streams and events, GEMM, RMSNorm, RoPE, causal varlen attention
/// with a KV cache, SwiGLU, embedding, classifier and sampling.
///
/// @code
///   brigade::cuda::CudaBackend gpu;                          // device 0
///   auto w = gpu.upload_decoder_weights(cfg, host_layer, brigade::DType::BF16);
///   brigade::cuda::DeviceBuffer x(tokens * cfg.dim * 4);     // residual stream, float32
///   gpu.decoder_layer_forward(cfg, w, x.as<float>(), tokens, slices);
///   gpu.synchronize();
/// @endcode
class CudaBackend {
 public:
  /// Construction settings.
  struct Options {
    /// CUDA device ordinal.
    int device = 0;
    /// Attention algorithm.
    AttentionPath attention = AttentionPath::Auto;
    /// Auto's threshold: sequences with at least this many new tokens take the Gemm path.
    std::int64_t gemm_attention_min_tokens = 16;
    /// Bound on the Gemm path's score matrices (bytes); sets its query-row block size.
    std::size_t attention_scratch_bytes = std::size_t{256} << 20;
  };

  /// Selects the device and creates the stream and the cuBLAS handle.
  /// @throws brigade::Error{Cuda} if the device cannot be used (no driver, bad ordinal) or
  ///         cuBLAS cannot be initialised
  explicit CudaBackend(Options options);
  /// CudaBackend(Options{}): device 0.
  CudaBackend();
  ~CudaBackend();
  CudaBackend(CudaBackend&&) noexcept;
  CudaBackend& operator=(CudaBackend&&) noexcept;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  /// The CUDA device ordinal.
  [[nodiscard]] int device() const noexcept;
  /// The options the backend was made with.
  [[nodiscard]] const Options& options() const noexcept;
  /// The stream every kernel of this backend is enqueued on.
  [[nodiscard]] CUstream_st* stream() const noexcept;
  /// Blocks until every kernel enqueued so far has finished.
  /// @throws brigade::Error{Cuda} naming the first asynchronous failure
  void synchronize();

  // --- memory ---------------------------------------------------------------------------------

  /// `bytes` bytes of device memory on this backend's device.
  /// @throws brigade::Error{Cuda} when out of memory
  [[nodiscard]] DeviceBuffer allocate(std::size_t bytes);
  /// Enqueues a host-to-device copy on the backend's stream. `src` may be reused as soon as the
  /// call returns (pageable memory is staged by the driver).
  void upload(void* dst, const void* src, std::size_t bytes);
  /// Copies device memory to the host after the work enqueued so far (waits).
  void download(void* dst, const void* src, std::size_t bytes);
  /// Enqueues a device-to-device copy.
  void copy(void* dst, const void* src, std::size_t bytes);
  /// Enqueues dst[i] = convert(src[i]) for i < n (float32 <-> bfloat16, or a plain copy).
  void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::int64_t n);
  /// Enqueues dst[i] = uniform in [-scale, scale), from a counter-based hash of (seed, i): the same
  /// seed gives the same values on every GPU. For benchmarks and tests.
  void fill_random(void* dst, DType dtype, std::int64_t n, std::uint64_t seed, float scale);

  // --- kernels (all asynchronous on stream()) --------------------------------------------------

  /// RMSNorm, as cpu::rmsnorm: out[t, i] = w[i] * x[t, i] / sqrt(mean(x[t, :]^2) + eps).
  /// @param x   [tokens x dim] float32
  /// @param w   [dim] float32
  /// @param out [tokens x dim] in `out_dtype`; may alias x when out_dtype is F32
  /// @throws brigade::Error{InvalidArgument} if tokens < 0 or dim < 1
  void rmsnorm(const float* x, const float* w, void* out, DType out_dtype, std::int64_t tokens,
               std::int64_t dim, float eps);

  /// out = x W^T (+ out when `accumulate`), as cpu::matmul_wt: one cublasGemmEx with float32
  /// accumulation (CUBLAS_COMPUTE_32F; no TF32).
  /// @param x     [tokens x in] in `in_dtype`, row-major
  /// @param w     [out_dim x in] in `in_dtype`, row-major
  /// @param out   [tokens x out_dim] in `out_dtype` (F32; BF16 only with BF16 operands)
  /// @throws brigade::Error{InvalidArgument} for negative sizes, sizes above 2^31 - 1, or
  ///         in_dtype F32 with out_dtype BF16; Error{Cuda} when cuBLAS refuses
  void matmul_wt(const void* x, const void* w, DType in_dtype, void* out, DType out_dtype,
                 std::int64_t tokens, std::int64_t in, std::int64_t out_dim,
                 bool accumulate = false);

  /// RoPE on adjacent pairs, in place, as cpu::rope (run.c's formula:
  /// freq = 1 / theta^((2i mod head_size) / head_size), angle = pos * freq).
  /// @param q   [tokens x n_heads*head_size] float32
  /// @param k   [tokens x n_kv_heads*head_size] float32
  /// @param pos [tokens] int32 absolute positions (device memory)
  /// @throws brigade::Error{InvalidArgument} as cpu::rope
  void rope(float* q, float* k, const std::int32_t* pos, std::int64_t tokens, int n_heads,
            int n_kv_heads, int head_size, float theta);

  /// Causal grouped-query attention of packed sequences against their KV caches, as
  /// cpu::attention for each sequence: query row t of slice s sits at position s.pos0 + t and
  /// attends to its sequence's cache rows 0..s.pos0 + t (which must already hold that sequence's
  /// keys and values); scores q.k / sqrt(head_size), softmax with the maximum subtracted.
  /// @param dtype dtype of q, the caches (cache.dtype) and out
  /// @param q     [tokens x n_heads*head_size], tokens = backend::packed_rows(seqs)
  /// @param out   [tokens x n_heads*head_size]; must not alias q
  /// @param seqs  the slices in row order (host memory)
  /// @param cache the layer's KV cache (device memory; first_row and capacity on the host)
  /// @param path  the algorithm (Auto: as Options)
  /// @throws brigade::Error{InvalidArgument} for bad head counts (as cpu::attention), a slice
  ///         with tokens < 1, a negative position, a sequence the cache does not hold or whose
  ///         capacity it exceeds, or a cache of another dtype or kv_dim
  void attention(DType dtype, const void* q, void* out, std::span<const backend::SequenceSlice> seqs,
                 const backend::KvCacheView& cache, int n_heads, int n_kv_heads, int head_size,
                 AttentionPath path = AttentionPath::Auto);

  /// SwiGLU, as cpu::swiglu: out[i] = silu(gate[i]) * up[i], silu(x) = x / (1 + exp(-x)).
  /// @param gate [n] float32
  /// @param up   [n] float32
  /// @param out  [n] in `out_dtype`; may alias gate when F32
  void swiglu(const float* gate, const float* up, void* out, DType out_dtype, std::int64_t n);

  /// Embedding lookup, as cpu::embedding: out[t, :] = table[ids[t], :].
  /// @param table [vocab x dim] float32
  /// @param ids   [tokens] int32, each in [0, vocab) (not checked on the device)
  /// @param out   [tokens x dim] float32
  void embedding(const float* table, const std::int32_t* ids, float* out, std::int64_t tokens,
                 std::int64_t dim);

  /// The classifier: logits = rmsnorm(x, rms_final) Wcls^T, for the rows of x (each sequence's
  /// last row, as the tail stage keeps them).
  /// @param x      [rows x dim] float32
  /// @param rms    [dim] float32
  /// @param wcls   [vocab x dim] in `w_dtype`
  /// @param logits [rows x vocab] float32
  void classifier(const float* x, const float* rms, const void* wcls, DType w_dtype, float* logits,
                  std::int64_t rows, std::int64_t dim, std::int64_t vocab, float eps);

  /// Greedy sampling on the GPU: out[r] = argmax(logits[r, :]), the first index on ties (run.c's
  /// argmax).
  /// @param logits [rows x vocab] float32
  /// @param out    [rows] int32 (device memory)
  void argmax(const float* logits, std::int32_t* out, std::int64_t rows, std::int64_t vocab);

  /// Temperature sampling on the GPU with run.c's semantics (model::Sampler): probabilities =
  /// softmax(logits / temperature); then the first index whose running CDF exceeds the coin
  /// (multinomial). Top-p (nucleus) is not done on the GPU: a top_p inside (0, 1) is refused.
  /// The coins come from the host (model::Sampler::random_f32, one per row) so a seed gives the
  /// same stream as the CPU sampler; the CDF is summed in a different order than run.c's, so a
  /// coin within ~1e-6 of a CDF step may pick the neighbouring token.
  /// @param logits [rows x vocab] float32; overwritten with the probabilities
  /// @param coins  [rows] host values in [0, 1)
  /// @param out    [rows] int32 (device memory)
  /// @throws brigade::Error{InvalidArgument} if temperature <= 0 or NaN, top_p is inside (0, 1),
  ///         or coins.size() != rows
  void sample(float* logits, std::int64_t rows, std::int64_t vocab, float temperature, float top_p,
              std::span<const float> coins, std::int32_t* out);

  // --- the Backend concept (brigade/backend/backend.hpp): float32 under the engines ------------
  //
  // With these members CudaBackend models backend::Backend, so runtime::InferenceStage<
  // CudaBackend> runs a stage's layers on the GPU under the executor and every engine
  // (engine::generate with a factory returning CudaBackends). That mode computes in float32
  // throughout (weights dequantized to float32 on upload, float32 KV caches, cuBLAS without
  // TF32): the token-exact mode. bfloat16 stays with the direct members above
  // (upload_decoder_weights and decoder_layer_forward in BF16).

  /// The backend's memory: device memory on its device.
  using Buffer = DeviceBuffer;
  /// Kernels read device memory: stages upload a micro-batch before their layers and download
  /// it after.
  static constexpr bool host_memory = false;

  /// The host matrix w ([rows x cols] in w.dtype: F32, F16, BF16 or Q8_0; dequantized exactly to
  /// float32 on the host first when typed) as a float32 copy on the device, owned by this backend
  /// until it is destroyed.
  /// @throws brigade::Error{InvalidArgument} for negative sizes or an unreadable dtype (as
  ///         model::dequantize_rows); Error{Cuda} when out of memory
  [[nodiscard]] model::WeightMatrix upload_weight(model::WeightMatrix w, std::int64_t rows,
                                                  std::int64_t cols);
  /// F32: the KV caches of the concept's mode hold float32.
  [[nodiscard]] DType kv_cache_dtype() const noexcept { return DType::F32; }
  /// embedding() over a float32 table from upload_weight.
  /// @throws brigade::Error{InvalidArgument} if the table is not F32
  void embedding(model::WeightMatrix table, const std::int32_t* ids, float* out,
                 std::int64_t tokens, std::int64_t dim);
  /// rmsnorm() with a float32 output.
  void rmsnorm(const float* x, const float* w, float* out, std::int64_t tokens, std::int64_t dim,
               float eps);
  /// matmul_wt() over float32 x, w (from upload_weight) and out.
  /// @throws brigade::Error{InvalidArgument} if w is not F32, or as matmul_wt()
  void matmul_wt(const float* x, model::WeightMatrix w, float* out, std::int64_t tokens,
                 std::int64_t in, std::int64_t out_dim, bool accumulate);
  /// The concept's attention: copies the batch's k and v rows ([tokens x kv_dim] float32, after
  /// RoPE) into rows pos0.. of each slice's sequence in `cache` (F32), then attention() in F32.
  /// @throws brigade::Error{InvalidArgument} as attention()
  void attention(const backend::KvCacheView& cache, const float* q, const float* k,
                 const float* v, float* out, std::span<const backend::SequenceSlice> seqs,
                 int n_heads, int n_kv_heads, int head_size);
  /// swiglu() in place on gate (float32).
  void swiglu(float* gate, const float* up, std::int64_t n);

  // --- training: the TrainingBackend concept (brigade/backend/backend.hpp) --------------------
  //
  // The math of cpu_train.hpp on the GPU in float32: the GEMMs (every projection, its
  // backward-input dX = dY W and backward-weight dW += dY^T X) through cuBLAS without TF32, the
  // rest one thread per row, column or element of cuda/train_math.hpp (the functions the unit
  // tests run on the host against the CPU backend). Causal attention is a direct kernel (one
  // thread per (row, head) for the forward and dQ, per (key row, KV head) for dK and dV), not
  // FlashAttention-2's tiles: correct for any packed batch, quadratic per thread. Every pointer is
  // device memory; offsets, like the CPU's, are host memory. Errors as the CPU functions.

  using DecoderActivations = CudaDecoderActivations;
  using HeadActivations = CudaHeadActivations;
  using TrainScratch = CudaTrainScratch;

  /// cudaMemsetAsync(dst, 0, bytes) on the stream.
  void fill_zero(void* dst, std::size_t bytes);
  /// cpu::decoder_train_forward on the device: x_in, x_out [tokens x dim] (may alias); w's
  /// tensors float32 in device memory (as TrainStage uploads them); offsets host memory.
  /// @throws brigade::Error{InvalidArgument} as the CPU version (config, null pointers, tokens,
  ///         offsets); Error{Cuda} when out of memory
  void decoder_train_forward(const model::LlamaConfig& config, const model::DecoderWeights& w,
                             const float* x_in, float* x_out, std::int64_t tokens,
                             std::span<const std::int64_t> offsets, DecoderActivations& acts,
                             TrainScratch* scratch);
  /// cpu::decoder_backward_input on the device; dx may alias dy.
  /// @throws brigade::Error{InvalidUsage} if acts is not in phase Forward
  void decoder_backward_input(const model::LlamaConfig& config, const model::DecoderWeights& w,
                              DecoderActivations& acts, const float* dy, float* dx,
                              TrainScratch* scratch);
  /// cpu::decoder_backward_weight on the device: adds the seven GEMMs' dW and the two gains'
  /// gradients into `grads` (device memory), then frees acts.
  /// @throws brigade::Error{InvalidUsage} if acts is not in phase BackwardInput
  void decoder_backward_weight(const model::LlamaConfig& config, DecoderActivations& acts,
                               const backend::DecoderGradTensors& grads);
  /// cpu::head_forward_backward_input on the device: targets [tokens] int32 device memory
  /// (downloaded once and checked on the host: -1 or in [0, vocab)); the per-row losses are
  /// summed on the host in row order (double). dx may alias x.
  /// @throws brigade::Error{InvalidArgument} as the CPU version (acts left empty)
  cpu::CrossEntropyLoss head_forward_backward_input(const model::LlamaConfig& config,
                                                    const float* rms_final, const float* wcls,
                                                    const float* x, const std::int32_t* targets,
                                                    std::int64_t tokens, float* dx,
                                                    HeadActivations& acts,
                                                    double grad_denominator);
  /// cpu::head_backward_weight on the device: d_wcls [vocab x dim] += dlogits^T xn,
  /// d_rms_final [dim] += the stashed gain gradient; frees acts.
  /// @throws brigade::Error{InvalidUsage} if acts holds no stash
  void head_backward_weight(const model::LlamaConfig& config, HeadActivations& acts,
                            float* d_rms_final, float* d_wcls);
  /// cpu::embedding_backward on the device (one thread per column, repeated ids add in row
  /// order); ids device memory, downloaded once and checked on the host.
  /// @throws brigade::Error{InvalidArgument} as the CPU version (nothing written then)
  void embedding_backward(const float* dy, const std::int32_t* ids, float* dtable,
                          std::int64_t tokens, std::int64_t dim, std::int64_t vocab);

  // --- the decoder layer -----------------------------------------------------------------------

  /// Uploads one decoder layer's weights (llama2.c layout, float32 on the host), converting the
  /// matrices to `dtype` and packing wq|wk|wv and w1|w3.
  /// @throws brigade::Error{InvalidArgument} if the config is invalid or a pointer is null;
  ///         Error{Cuda} when out of memory
  [[nodiscard]] DeviceDecoderWeights upload_decoder_weights(const model::LlamaConfig& config,
                                                            const model::DecoderWeights& w,
                                                            DType dtype);

  /// One Llama decoder layer over a packed micro-batch, in place on the residual stream: the
  /// device version of backend::decoder_layer_forward (same math and order: RMSNorm, QKV GEMM,
  /// RoPE, K/V rows stored in each sequence's cache, causal GQA attention, x += att Wo^T,
  /// RMSNorm, W1|W3 GEMM, SwiGLU, x += h W2^T), with wq|wk|wv and w1|w3 packed into one GEMM
  /// each. In BF16 the GEMM operands, the caches and the attention output are bfloat16; x stays
  /// float32.
  /// @param x      [tokens x dim] float32 residual stream, updated in place
  /// @param seqs   the slices in row order covering `tokens` rows (host memory)
  /// @param cache  the layer's KV cache in w.dtype (rows pos0 + tokens of each slice's sequence
  ///               must fit its capacity)
  /// @throws brigade::Error{InvalidArgument} if the config is invalid, the slices do not cover
  ///         `tokens` rows, a slice has tokens < 1, positions beyond seq_len or its capacity, a
  ///         sequence the cache does not hold, or the cache's dtype is not w.dtype (as the CPU
  ///         version)
  void decoder_layer_forward(const model::LlamaConfig& config, const DeviceDecoderWeights& w,
                             float* x, std::int64_t tokens,
                             std::span<const backend::SequenceSlice> seqs,
                             const backend::KvCacheView& cache);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

static_assert(backend::Backend<CudaBackend>);
static_assert(backend::TrainingBackend<CudaBackend>);

}  // namespace v0
}  // namespace brigade::cuda
