// Synthetic training workloads shared by the benchmark binaries.
#pragma once

#include <brigade/data/corpus.hpp>

#include <cstdint>
#include <random>
#include <vector>

namespace brigade::bench {

/// `m` micro-batches, each one sequence of `len` + 1 tokens: BOS (1), then `len` ids drawn
/// uniformly from [3, vocab) by an mt19937_64 seeded with `seed` (so `len` target rows each).
/// The same arguments give the same batches in every binary.
inline std::vector<data::PackedBatch> random_sequences(int m, int len, int vocab,
                                                       std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> tok(3, vocab - 1);
  std::vector<data::PackedBatch> out;
  for (int i = 0; i < m; ++i) {
    data::PackedBatch b;
    int prev = 1;
    for (int t = 0; t < len; ++t) {
      const int next = tok(rng);
      b.inputs.push_back(prev);
      b.targets.push_back(next);
      prev = next;
    }
    b.offsets = {0, b.rows()};
    b.tasks = {0};
    b.task_offsets = {0, b.rows()};
    out.push_back(std::move(b));
  }
  return out;
}

}  // namespace brigade::bench
