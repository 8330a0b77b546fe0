// Ring windows as prima.cpp lays them out (Li et al. 2025, "PRIMA.CPP", §3.2 pipelined-ring
// parallelism): M devices, k rounds, device m runs a window of w_m decoder layers in every round,
// so L = k x sum(w_m) and a token walks the ring of devices k times per position.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/model/config.hpp"
#include "brigade/partition/partition.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <string_view>
#include <span>
#include <string>
#include <vector>

namespace brigade::partition {
inline namespace v0 {

namespace detail {
inline std::string join_sizes(std::span<const int> w) {
  std::string s;
  for (const int x : w) s += fmt::format("{}{}", s.empty() ? "" : ",", x);
  return s;
}
}  // namespace detail

/// The decoder-layer count of every window in ring order (window j on rank j mod `ranks`) for
/// `ranks` devices and `rounds` (prima.cpp's k) rounds.
///
/// @param decoder_layers L, the model's decoder layers
/// @param ranks          M, the devices (ranks) of the ring
/// @param rounds         k, the times a token walks the ring per position
/// @param sizes          the window list: empty for an even split (each round's L / k layers
///                       over the M devices, earlier devices one more when it does not divide);
///                       M entries (prima.cpp's w_m, the same window every round: k x sum = L);
///                       or M x k entries (every window in ring order: sum = L)
/// @return M x k window sizes in decoder layers, each >= 1
/// @throws brigade::Error{InvalidArgument} naming the values when ranks or rounds < 1; when an
///         even split is asked and k does not divide L ("k = 2 does not divide the 5 decoder
///         layers"), or L / k < M; when the list has neither M nor M x k entries, an entry is
///         < 1, or the windows do not cover the L layers exactly
inline std::vector<int> ring_window_sizes(int decoder_layers, int ranks, int rounds,
                                          std::span<const int> sizes = {}) {
  const int L = decoder_layers;
  BRIGADE_CHECK(ranks >= 1 && rounds >= 1, Errc::InvalidArgument,
                "ring windows: {} ranks and k = {} rounds, expected both >= 1", ranks, rounds);
  std::vector<int> out;
  if (sizes.empty()) {
    if (L % rounds != 0) {
      std::string ks;
      for (int k = 1; k <= L; ++k)
        if (L % k == 0 && L / k >= ranks) ks += fmt::format("{}{}", ks.empty() ? "" : ", ", k);
      ::brigade::detail::fail(
          Errc::InvalidArgument,
          "ring windows: k = {} rounds does not divide the model's {} decoder layers (every "
          "round runs the same windows, L = k x sum of windows); use k in {{{}}} or give the "
          "{} window sizes (--windows)",
          rounds, L, ks, ranks * rounds);
    }
    const int per_round = L / rounds;
    BRIGADE_CHECK(per_round >= ranks, Errc::InvalidArgument,
                  "ring windows: {} ranks x k = {} rounds need at least {} decoder layers, the "
                  "model has {}",
                  ranks, rounds, ranks * rounds, L);
    for (int k = 0; k < rounds; ++k)
      for (int m = 0; m < ranks; ++m) out.push_back(per_round / ranks + (m < per_round % ranks));
    return out;
  }
  const auto n = static_cast<int>(sizes.size());
  BRIGADE_CHECK(n == ranks || n == ranks * rounds, Errc::InvalidArgument,
                "ring windows: the window list {} has {} entries, expected {} (one per rank, the "
                "same every round) or {} ({} ranks x k = {} rounds)",
                detail::join_sizes(sizes), n, ranks, ranks * rounds, ranks, rounds);
  for (int i = 0; i < n; ++i)
    BRIGADE_CHECK(sizes[static_cast<std::size_t>(i)] >= 1, Errc::InvalidArgument,
                  "ring windows: window {} of the list {} has {} layers, expected >= 1", i,
                  detail::join_sizes(sizes), sizes[static_cast<std::size_t>(i)]);
  for (int k = 0; k < (n == ranks ? rounds : 1); ++k) out.insert(out.end(), sizes.begin(), sizes.end());
  const long covered = std::accumulate(out.begin(), out.end(), 0L);
  BRIGADE_CHECK(covered == L, Errc::InvalidArgument,
                "ring windows: the window list {} covers {} decoder layers ({} round(s)), the "
                "model has {}",
                detail::join_sizes(sizes), covered, n == ranks ? rounds : 1, L);
  return out;
}

/// The Partition of a ring: window j of `window_sizes` (decoder layers, ring order) on rank
/// j mod `ranks`, the embedding in window 0, and the output layers (final norm, LM head and
/// sampler) on rank 0, the head device, after the last window, as prima.cpp places them (Li et
/// al. 2025, §3.2: the head device holds the embedding and the output layers): with one rank
/// they join its last window; with more, they are a last virtual stage of rank 0, so a
/// position's last hop carries the activations of the last window back to the head, which
/// samples, and the sampled token stays there for the next position's embedding. The
/// Partition covers every ModelSpec layer: M x k stages for one rank, M x k + 1 for more.
/// @param window_sizes as ring_window_sizes returns (M x k entries, each >= 1, sum = L)
/// @throws brigade::Error{InvalidArgument} if the sizes do not sum to the decoder count, an
///         entry is < 1, or there are fewer windows than ranks
inline Partition ring_partition(const model::ModelSpec& spec, int ranks,
                                std::span<const int> window_sizes) {
  const int L = spec.config().n_layers;
  const long sum = std::accumulate(window_sizes.begin(), window_sizes.end(), 0L);
  BRIGADE_CHECK(sum == L, Errc::InvalidArgument,
                "ring_partition: windows {} cover {} decoder layers, the model has {}",
                detail::join_sizes(window_sizes), sum, L);
  BRIGADE_CHECK(ranks >= 1 && static_cast<int>(window_sizes.size()) >= ranks, Errc::InvalidArgument,
                "ring_partition: {} ranks for {} windows, expected 1..{}", ranks,
                window_sizes.size(), window_sizes.size());
  std::vector<StageRange> st;
  int d = 0;
  for (std::size_t j = 0; j < window_sizes.size(); ++j) {
    BRIGADE_CHECK(window_sizes[j] >= 1, Errc::InvalidArgument,
                  "ring_partition: window {} has {} decoder layers, expected >= 1", j,
                  window_sizes[j]);
    const int first = j == 0 ? 0 : model::ModelSpec::decoder_layer(d);
    d += window_sizes[j];
    st.push_back({static_cast<int>(j) % ranks, first, model::ModelSpec::decoder_layer(d)});
  }
  // The output layers: on the head, after the last window.
  if (st.back().rank == 0)
    st.back().last = spec.num_layers();
  else
    st.push_back({0, st.back().last, spec.num_layers()});
  return Partition(spec.num_layers(), ranks, std::move(st));
}

/// The weight bytes each rank holds resident while a ring runs: without offload every window it
/// owns; with weight offload (schedule::add_weight_offload: PREFETCH one run ahead, RELEASE
/// after) the largest sum of two windows it runs one after the other (cyclically: the last
/// window of a position is followed by the first of the next), or its one window. On a ring of
/// ring_partition the head (rank 0) holds the embedding (window 0) and the output layers (its
/// last stage): with offload its largest pair may be the output layers and window 0, which run
/// one after the other (the sampled token feeds the next position's embedding).
/// @param layer_bytes the weight bytes of each ModelSpec layer (model::layer_weight_bytes)
/// @param tied_embedding_bytes with a shared classifier, the embedding table's bytes: a window
///        holding the LM head reads those pages too (layer_bytes counts them once, at the
///        embedding), counted once where two windows held together both read them; 0 otherwise
/// @return one value per rank, in bytes
/// @throws brigade::Error{InvalidArgument} if layer_bytes does not have one entry per layer
inline std::vector<double> resident_weight_bytes(const Partition& part,
                                                 std::span<const double> layer_bytes,
                                                 bool offload, double tied_embedding_bytes = 0) {
  BRIGADE_CHECK(static_cast<int>(layer_bytes.size()) == part.num_layers(), Errc::InvalidArgument,
                "resident_weight_bytes: {} layer sizes for {} layers", layer_bytes.size(),
                part.num_layers());
  struct Window {
    double bytes = 0;
    bool embedding = false;  // reads the embedding table's pages (holds it, or a tied LM head)
  };
  std::vector<std::vector<Window>> windows(static_cast<std::size_t>(part.num_ranks()));
  for (const auto& s : part.stages()) {
    Window w;
    for (int l = s.first; l < s.last; ++l) w.bytes += layer_bytes[static_cast<std::size_t>(l)];
    w.embedding = s.first == 0;
    // The LM head (the layer before the sampler) reading the tied embedding, in another window.
    if (s.last == part.num_layers() && s.first > 0 && tied_embedding_bytes > 0) {
      w.bytes += tied_embedding_bytes;
      w.embedding = true;
    }
    windows[static_cast<std::size_t>(s.rank)].push_back(w);
  }
  std::vector<double> out;
  for (const auto& w : windows) {
    double r = 0;
    if (!offload || w.size() == 1) {
      int readers = 0;
      for (const auto& x : w) {
        r += x.bytes;
        readers += x.embedding;
      }
      if (readers > 1) r -= (readers - 1) * tied_embedding_bytes;
    } else {
      for (std::size_t i = 0; i < w.size(); ++i) {
        const Window& a = w[i];
        const Window& b = w[(i + 1) % w.size()];
        r = std::max(r, a.bytes + b.bytes - (a.embedding && b.embedding ? tied_embedding_bytes : 0.0));
      }
    }
    out.push_back(r);
  }
  return out;
}

/// Refuses a ring whose resident weights (resident_weight_bytes, with `tied_embedding_bytes`)
/// exceed a rank's RAM budget.
/// @param budgets one budget in bytes for every rank, or one per rank
/// @param who     the caller, for the message
/// @throws brigade::Error{InvalidArgument} "<who>: rank R holds B bytes of weights resident
///         (windows ..., offload on|off), over its RAM budget of C bytes" for the first such rank
inline void check_ring_budget(const Partition& part, std::span<const double> layer_bytes,
                              bool offload, std::span<const double> budgets, std::string_view who,
                              double tied_embedding_bytes = 0) {
  BRIGADE_CHECK(budgets.size() == 1 || static_cast<int>(budgets.size()) == part.num_ranks(),
                Errc::InvalidArgument, "{}: {} RAM budgets for {} ranks, expected 1 or {}", who,
                budgets.size(), part.num_ranks(), part.num_ranks());
  const auto held = resident_weight_bytes(part, layer_bytes, offload, tied_embedding_bytes);
  for (int r = 0; r < part.num_ranks(); ++r) {
    const double cap = budgets.size() == 1 ? budgets[0] : budgets[static_cast<std::size_t>(r)];
    if (held[static_cast<std::size_t>(r)] <= cap) continue;
    std::string ws;
    for (int j = 0; j < part.num_stages(); ++j)
      if (part.stage(j).rank == r)
        ws += fmt::format("{}[{},{})", ws.empty() ? "" : " ", part.stage(j).first, part.stage(j).last);
    ::brigade::detail::fail(
        Errc::InvalidArgument,
        "{}: rank {} holds {:.0f} bytes of weights resident (windows {} of the ModelSpec layers, "
        "weight offload {}), over its RAM budget of {:.0f} bytes{}",
        who, r, held[static_cast<std::size_t>(r)], ws, offload ? "on: two windows at a time" : "off",
        cap, offload ? "; use more rounds (k) or ranks" : "; use weight offload (--offload), more rounds or ranks");
  }
}

}  // namespace v0
}  // namespace brigade::partition
