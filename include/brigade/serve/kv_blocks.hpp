// The KV-cache block manager of the serving engine: a pool of fixed-size blocks of positions,
// allocated per sequence at admission and freed when it completes.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/runtime/inference_stage.hpp"

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace brigade::serve {
inline namespace v0 {

/// A pool of `num_blocks` blocks of `block_size` KV positions each (the same pool on every
/// stage: each stage's KV cache holds num_blocks x block_size rows per owned decoder layer).
/// A sequence of P positions gets ceil(P / block_size) blocks, contiguous in the pool (the
/// attention kernels read a sequence's rows as one run, backend::KvCacheView), found first fit;
/// free() returns them. The serving engine admits a request only when its blocks are free, so
/// the KV memory never exceeds the pool (vLLM's block manager, with runs of blocks instead of a
/// block table because brigade's kernels address a sequence's cache by its first row).
class KvBlockManager {
 public:
  /// @throws brigade::Error{InvalidArgument} if block_size < 1, num_blocks < 1, or the pool's
  ///         rows exceed 2^31 - 1 (descriptors carry rows as int32)
  KvBlockManager(int block_size, int num_blocks) : block_size_(block_size), used_() {
    BRIGADE_CHECK(block_size >= 1 && num_blocks >= 1 &&
                      static_cast<std::int64_t>(block_size) * num_blocks <=
                          std::numeric_limits<std::int32_t>::max(),
                  Errc::InvalidArgument,
                  "KvBlockManager: {} blocks of {} positions; expected both >= 1 and at most "
                  "2^31 - 1 rows in all",
                  num_blocks, block_size);
    used_.assign(static_cast<std::size_t>(num_blocks), 0);
  }

  /// Blocks a sequence of `positions` positions needs: ceil(positions / block_size).
  [[nodiscard]] int blocks_for(int positions) const noexcept {
    return (positions + block_size_ - 1) / block_size_;
  }

  /// Reserves the blocks of a sequence of `positions` positions (>= 1): the first run of
  /// blocks_for(positions) free blocks. std::nullopt when no such run is free (the caller
  /// queues the request). The placement's capacity is the positions asked for.
  std::optional<runtime::KvPlacement> allocate(int positions) {
    const int need = blocks_for(positions);
    int run = 0;
    for (int b = 0; b < num_blocks(); ++b) {
      run = used_[static_cast<std::size_t>(b)] ? 0 : run + 1;
      if (run == need) {
        const int first = b - need + 1;
        for (int i = first; i <= b; ++i) used_[static_cast<std::size_t>(i)] = 1;
        used_blocks_ += need;
        peak_blocks_ = std::max(peak_blocks_, used_blocks_);
        return runtime::KvPlacement{first * block_size_, positions};
      }
    }
    return std::nullopt;
  }

  /// Frees the blocks of a placement allocate() returned.
  /// @throws brigade::Error{InvalidUsage} if one of its blocks is not allocated
  void free(const runtime::KvPlacement& p) {
    const int first = p.first_row / block_size_, need = blocks_for(p.capacity);
    for (int b = first; b < first + need; ++b) {
      BRIGADE_CHECK(b >= 0 && b < num_blocks() && used_[static_cast<std::size_t>(b)],
                    Errc::InvalidUsage, "KvBlockManager: block {} freed but not allocated", b);
      used_[static_cast<std::size_t>(b)] = 0;
    }
    used_blocks_ -= need;
  }

  [[nodiscard]] int block_size() const noexcept { return block_size_; }
  [[nodiscard]] int num_blocks() const noexcept { return static_cast<int>(used_.size()); }
  /// Rows of every stage's pool: num_blocks x block_size.
  [[nodiscard]] std::int64_t rows() const noexcept {
    return static_cast<std::int64_t>(num_blocks()) * block_size_;
  }
  [[nodiscard]] int used_blocks() const noexcept { return used_blocks_; }
  /// The most blocks allocated at once so far.
  [[nodiscard]] int peak_blocks() const noexcept { return peak_blocks_; }

 private:
  int block_size_;
  std::vector<char> used_;
  int used_blocks_ = 0, peak_blocks_ = 0;
};

}  // namespace v0
}  // namespace brigade::serve
