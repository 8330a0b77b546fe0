// CpuBackend: brigade's CPU kernels (brigade/backend/cpu.hpp, cpu_train.hpp: Eigen, OpenBLAS, the
// small-M decode kernels and the intra-op thread team) as a model of the Backend and
// TrainingBackend concepts (brigade/backend/backend.hpp). The engines' default backend.
#pragma once

#include "brigade/backend/backend.hpp"
#include "brigade/backend/cpu.hpp"
#include "brigade/backend/cpu_train.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <vector>

namespace brigade::cpu {
inline namespace v0 {

/// The CPU kernels as a Backend: host memory, immediate kernels, weights read where they lie
/// (owned or mapped from the file, in their dtype: F32, F16, BF16, Q8_0). Stateless: the
/// intra-op thread count is process-wide (set_blas_threads), so copies are interchangeable and
/// one per stage costs nothing. Every kernel is the cpu:: function of the same name; the bits are
/// those of that function.
class CpuBackend {
 public:
  /// Host memory: float32-aligned bytes, zero-initialised. Allocated with calloc, so a large
  /// buffer (a KV pool) gets the kernel's zero pages and each page is zeroed when first touched:
  /// allocating one costs no pass over its bytes (what a layer adopted while serving relies on:
  /// its KV pool is allocated in the round its migration starts, and only the rows written are
  /// ever touched).
  class Buffer {
   public:
    Buffer() = default;
    /// `bytes` bytes (rounded up to whole floats).
    /// @throws std::bad_alloc when the memory cannot be had
    explicit Buffer(std::size_t bytes) : bytes_(bytes) {
      if (bytes == 0) return;
      const std::size_t words = (bytes + sizeof(float) - 1) / sizeof(float);
      words_.reset(static_cast<float*>(std::calloc(words, sizeof(float))));
      if (!words_) throw std::bad_alloc();
    }
    /// The first byte (nullptr when empty).
    [[nodiscard]] void* data() noexcept { return words_.get(); }
    /// Size in bytes.
    [[nodiscard]] std::size_t size() const noexcept { return bytes_; }

   private:
    struct Free {
      void operator()(float* p) const noexcept { std::free(p); }
    };
    std::unique_ptr<float[], Free> words_;
    std::size_t bytes_ = 0;
  };

  /// The kernels run on host memory: stages work in place on their micro-batches.
  static constexpr bool host_memory = true;

  /// `bytes` bytes of host memory.
  [[nodiscard]] Buffer allocate(std::size_t bytes) const { return Buffer(bytes); }
  /// memcpy (the memories are the same).
  void upload(void* dst, const void* src, std::size_t bytes) const { copy(dst, src, bytes); }
  /// memcpy.
  void download(void* dst, const void* src, std::size_t bytes) const { copy(dst, src, bytes); }
  /// memcpy (nothing when dst == src).
  void copy(void* dst, const void* src, std::size_t bytes) const {
    if (dst != src && bytes > 0) std::memcpy(dst, src, bytes);
  }
  /// Nothing to wait for: the kernels are immediate.
  void synchronize() const noexcept {}
  /// `w` itself: the kernels read every weight dtype in place (mapped weights stay mapped).
  [[nodiscard]] model::WeightMatrix upload_weight(model::WeightMatrix w, std::int64_t /*rows*/,
                                                  std::int64_t /*cols*/) const noexcept {
    return w;
  }
  /// F32: the KV caches hold float32.
  [[nodiscard]] DType kv_cache_dtype() const noexcept { return DType::F32; }

  /// cpu::embedding.
  void embedding(model::WeightMatrix table, const std::int32_t* ids, float* out,
                 std::int64_t tokens, std::int64_t dim) const {
    cpu::embedding(table, ids, out, tokens, dim);
  }
  /// cpu::rmsnorm.
  void rmsnorm(const float* x, const float* w, float* out, std::int64_t tokens, std::int64_t dim,
               float eps) const {
    cpu::rmsnorm(x, w, out, tokens, dim, eps);
  }
  /// cpu::matmul_wt, or cpu::matmul_wt_accumulate when `accumulate`.
  void matmul_wt(const float* x, model::WeightMatrix w, float* out, std::int64_t tokens,
                 std::int64_t in, std::int64_t out_dim, bool accumulate) const {
    if (accumulate)
      cpu::matmul_wt_accumulate(x, w, out, tokens, in, out_dim);
    else
      cpu::matmul_wt(x, w, out, tokens, in, out_dim);
  }
  /// cpu::rope.
  void rope(float* q, float* k, const std::int32_t* pos, std::int64_t tokens, int n_heads,
            int n_kv_heads, int head_size, float theta) const {
    cpu::rope(q, k, pos, tokens, n_heads, n_kv_heads, head_size, theta);
  }
  /// cpu::attention over the packed slices (stores k and v in the cache first).
  void attention(const backend::KvCacheView& cache, const float* q, const float* k,
                 const float* v, float* out, std::span<const backend::SequenceSlice> seqs,
                 int n_heads, int n_kv_heads, int head_size) const {
    cpu::attention(cache, q, k, v, out, seqs, n_heads, n_kv_heads, head_size);
  }
  /// cpu::swiglu.
  void swiglu(float* gate, const float* up, std::int64_t n) const { cpu::swiglu(gate, up, n); }

  // --- training (TrainingBackend): the layer-level passes of cpu_train.hpp ----------------------

  using DecoderActivations = cpu::DecoderActivations;
  using HeadActivations = cpu::HeadActivations;
  using TrainScratch = cpu::DecoderTrainScratch;

  /// memset to zero.
  void fill_zero(void* dst, std::size_t bytes) const {
    if (bytes > 0) std::memset(dst, 0, bytes);
  }

  // The training passes take an optional tensor-parallel split (the whole layer when null):
  // what runtime::TrainStage passes when it is one rank of a TP group.

  /// cpu::decoder_train_forward (split: one TP rank's share of the layer, or null).
  void decoder_train_forward(const model::LlamaConfig& config, const model::DecoderWeights& w,
                             const float* x_in, float* x_out, std::int64_t tokens,
                             std::span<const std::int64_t> offsets, DecoderActivations& acts,
                             TrainScratch* scratch,
                             const backend::DecoderSplit* split = nullptr) const {
    cpu::decoder_train_forward(config, w, x_in, x_out, tokens, offsets, acts, scratch, split);
  }
  /// cpu::decoder_backward_input (split: the forward's).
  void decoder_backward_input(const model::LlamaConfig& config, const model::DecoderWeights& w,
                              DecoderActivations& acts, const float* dy, float* dx,
                              TrainScratch* scratch,
                              const backend::DecoderSplit* split = nullptr) const {
    cpu::decoder_backward_input(config, w, acts, dy, dx, scratch, split);
  }
  /// cpu::decoder_backward_weight into the stage's nine gradient tensors (split: the forward's).
  void decoder_backward_weight(const model::LlamaConfig& config, DecoderActivations& acts,
                               const backend::DecoderGradTensors& grads,
                               const backend::DecoderSplit* split = nullptr) const {
    cpu::decoder_backward_weight(config, acts, grads, split);
  }
  /// cpu::head_forward_backward_input (row_loss: [tokens] per-row losses, or nullptr; split: one
  /// TP rank's vocabulary shard, or null).
  CrossEntropyLoss head_forward_backward_input(const model::LlamaConfig& config,
                                               const float* rms_final, const float* wcls,
                                               const float* x, const std::int32_t* targets,
                                               std::int64_t tokens, float* dx,
                                               HeadActivations& acts, double grad_denominator,
                                               double* row_loss = nullptr,
                                               const backend::VocabSplit* split = nullptr) const {
    return cpu::head_forward_backward_input(config, rms_final, wcls, x, targets, tokens, dx,
                                            acts, grad_denominator, row_loss, split);
  }
  /// cpu::head_backward_weight (split: the forward's).
  void head_backward_weight(const model::LlamaConfig& config, HeadActivations& acts,
                            float* d_rms_final, float* d_wcls,
                            const backend::VocabSplit* split = nullptr) const {
    cpu::head_backward_weight(config, acts, d_rms_final, d_wcls, split);
  }
  /// cpu::embedding_backward.
  void embedding_backward(const float* dy, const std::int32_t* ids, float* dtable,
                          std::int64_t tokens, std::int64_t dim, std::int64_t vocab) const {
    cpu::embedding_backward(dy, ids, dtable, tokens, dim, vocab);
  }
};

static_assert(backend::Backend<CpuBackend>);
static_assert(backend::TrainingBackend<CpuBackend>);

}  // namespace v0
}  // namespace brigade::cpu
