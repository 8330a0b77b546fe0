// brigade::Tensor: a float32 tensor of rank 0..4, owning or a view, row-major by default.
#pragma once

#include "brigade/core/error.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>

namespace brigade {
inline namespace v0 {

/// A float32 tensor of rank 0..4 with explicit shape and strides (in elements).
///
/// Owning tensors (`Tensor::zeros`) share their storage on copy, like a shared_ptr; views
/// (`Tensor::view`) point into memory someone else keeps alive (an mmap'd checkpoint, a
/// receive buffer). Layout is row-major unless the strides say otherwise: element
/// (i0, i1, ...) lives at `data()[i0*stride(0) + i1*stride(1) + ...]`.
class Tensor {
 public:
  static constexpr int kMaxRank = 4;
  using Shape = std::array<std::int64_t, kMaxRank>;

  /// An empty rank-0 tensor with no storage.
  Tensor() = default;

  /// A contiguous, zero-filled, owning tensor.
  /// @param shape sizes of each dimension, outermost first (at most 4, each >= 0)
  /// @throws brigade::Error{InvalidArgument} for more than 4 dimensions or a negative size
  static Tensor zeros(std::initializer_list<std::int64_t> shape) {
    return zeros(std::span<const std::int64_t>(shape.begin(), shape.size()));
  }
  /// @copydoc zeros(std::initializer_list<std::int64_t>)
  static Tensor zeros(std::span<const std::int64_t> shape) {
    Tensor t;
    t.set_shape(shape);
    t.storage_ = std::shared_ptr<float[]>(new float[static_cast<std::size_t>(t.numel())]());
    t.data_ = t.storage_.get();
    return t;
  }

  /// A contiguous row-major view of `data`; the caller keeps `data` alive.
  /// @throws brigade::Error{InvalidArgument} for more than 4 dimensions or a negative size
  static Tensor view(float* data, std::initializer_list<std::int64_t> shape) {
    Tensor t;
    t.set_shape(std::span<const std::int64_t>(shape.begin(), shape.size()));
    t.data_ = data;
    return t;
  }

  /// A view of rows [begin, end) of dimension 0 (shares storage, keeps it alive).
  /// @throws brigade::Error{InvalidArgument} if the range is outside [0, size(0)]
  [[nodiscard]] Tensor rows(std::int64_t begin, std::int64_t end) const {
    BRIGADE_CHECK(rank_ >= 1 && 0 <= begin && begin <= end && end <= shape_[0],
                  Errc::InvalidArgument, "Tensor::rows: range [{}, {}) outside [0, {})", begin, end,
                  rank_ >= 1 ? shape_[0] : 0);
    Tensor t = *this;
    t.shape_[0] = end - begin;
    t.data_ = data_ + begin * strides_[0];
    return t;
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Size of dimension d (d in [0, rank)).
  [[nodiscard]] std::int64_t size(int d) const noexcept { return shape_[static_cast<std::size_t>(d)]; }
  /// Stride of dimension d in elements.
  [[nodiscard]] std::int64_t stride(int d) const noexcept {
    return strides_[static_cast<std::size_t>(d)];
  }
  /// Number of elements (product of the sizes; 1 for rank 0 with storage).
  [[nodiscard]] std::int64_t numel() const noexcept {
    std::int64_t n = 1;
    for (int d = 0; d < rank_; ++d) n *= shape_[static_cast<std::size_t>(d)];
    return n;
  }
  /// Bytes covered by the elements (numel * 4).
  [[nodiscard]] std::size_t nbytes() const noexcept {
    return static_cast<std::size_t>(numel()) * sizeof(float);
  }
  /// True when the strides are row-major for the shape.
  [[nodiscard]] bool is_contiguous() const noexcept {
    std::int64_t s = 1;
    for (int d = rank_ - 1; d >= 0; --d) {
      if (shape_[static_cast<std::size_t>(d)] != 1 && strides_[static_cast<std::size_t>(d)] != s)
        return false;
      s *= shape_[static_cast<std::size_t>(d)];
    }
    return true;
  }
  /// True when this tensor owns (shares) its storage rather than viewing foreign memory.
  [[nodiscard]] bool is_owning() const noexcept { return storage_ != nullptr; }

  [[nodiscard]] float* data() noexcept { return data_; }
  [[nodiscard]] const float* data() const noexcept { return data_; }
  /// The elements as a flat span (contiguous tensors only).
  [[nodiscard]] std::span<float> flat() noexcept {
    return {data_, static_cast<std::size_t>(numel())};
  }
  [[nodiscard]] std::span<const float> flat() const noexcept {
    return {data_, static_cast<std::size_t>(numel())};
  }

  /// Element access by index (no bounds check in release builds).
  template <class... I>
  float& operator()(I... idx) noexcept {
    return data_[offset(idx...)];
  }
  template <class... I>
  float operator()(I... idx) const noexcept {
    return data_[offset(idx...)];
  }

 private:
  template <class... I>
  [[nodiscard]] std::int64_t offset(I... idx) const noexcept {
    const std::int64_t ix[] = {static_cast<std::int64_t>(idx)...};
    std::int64_t o = 0;
    for (std::size_t d = 0; d < sizeof...(I); ++d) o += ix[d] * strides_[d];
    return o;
  }

  void set_shape(std::span<const std::int64_t> shape) {
    BRIGADE_CHECK(shape.size() <= kMaxRank, Errc::InvalidArgument,
                  "Tensor: rank {} exceeds the maximum {}", shape.size(), kMaxRank);
    rank_ = static_cast<int>(shape.size());
    shape_.fill(1);
    strides_.fill(0);
    std::int64_t s = 1;
    for (int d = rank_ - 1; d >= 0; --d) {
      const auto ud = static_cast<std::size_t>(d);
      BRIGADE_CHECK(shape[ud] >= 0, Errc::InvalidArgument, "Tensor: dimension {} has size {} < 0",
                    d, shape[ud]);
      shape_[ud] = shape[ud];
      strides_[ud] = s;
      s *= shape[ud];
    }
  }

  std::shared_ptr<float[]> storage_;
  float* data_ = nullptr;
  Shape shape_{1, 1, 1, 1};
  Shape strides_{0, 0, 0, 0};
  int rank_ = 0;
};

}  // namespace v0
}  // namespace brigade
