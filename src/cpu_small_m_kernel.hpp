// The blocked small-M kernel as a template over a packet type (internal to src/; included only
// by the per-ISA translation units, each compiled for its instruction set). Everything here has
// internal linkage, so the copies built for different instruction sets never meet at link time.
//
// Blocks of NR rows of W times blocks of MR rows of x, MR x NR accumulators of 16 lanes, k
// advancing 16 at a time (W's packets loaded as WLoad says). One row of x (a GEMV, sm_gemv) walks each
// block's whole rows at once; more rows walk them in chunks of kSmallMChunk floats (sm_rows), so
// the chunk stays in L1 for every block of x rows. W is read once per call; x once per block of
// NR W rows.
#pragma once

#include "cpu_small_m.hpp"

#include <immintrin.h>

#include <cstdint>

namespace brigade::cpu::detail {
namespace {

/// reduce_lanes (cpu_small_m.hpp) in 256- and 128-bit registers: the same additions of the same
/// operands in the same tree (lanes l + (l + 8); the halves; (0 + 2), (1 + 3); the last two), so
/// the same bits, in 6 instructions instead of 15 scalar adds. Both instruction-set builds that
/// include this header have AVX.
inline float reduce_lanes_vec(const float* lanes) {
  const __m256 s8 = _mm256_add_ps(_mm256_loadu_ps(lanes), _mm256_loadu_ps(lanes + 8));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// Isa provides: Packet, kWidth (floats per packet), kPrefetchRows (sm_rows; 0: never),
// kXInRegister (sm_chunk: each x packet loaded once into a register for its NR FMAs), zero(),
// load(p) (kWidth floats), load_w<WT>(row, k) (the float32 values of W row elements k .. k +
// kWidth - 1 of dtype F32, F16 or BF16, exact), q8_scale(row, k) (the scale of the Q8_0 block holding element k,
// broadcast), q8_load(row, k, d) (elements k .. k + kWidth - 1 of a Q8_0 row as int8 times d:
// exact; k is a multiple of kWidth, so a packet never straddles a block), half(h) (a binary16
// as float32), fma(a, b, c) = a*b + c rounded once, store(p, v).
// The NR rows of W of a block lie `rs` rows apart (and so do their outputs): sm_run takes them
// from NR far-apart segments of W, so the weights arrive as NR long sequential streams, which
// keeps more memory requests in flight than one stream of short rows (about 2x the bandwidth of
// adjacent rows on Zen 3, where one core's bandwidth is bound by its outstanding misses).
// The lanes are independent sums. For several x rows (sm_rows) the kernel walks k once per
// packet of lanes (lanes 0-7, then 8-15 with 8-float packets): MR x NR accumulators of one
// register each, and MR + NR loads per MR x NR FMAs; the first pass brings the chunk's W rows
// into L1, the others find them there. One x row (sm_gemv) takes all 16 lanes at once.

/// How a float32 W row's packets are loaded. Plain (Shifted false, and every typed W): one
/// unaligned load each. Shifted (W's rows start shift.s floats past a packet boundary, the same
/// for every row): the aligned packets that hold the elements, recombined in registers
/// (Isa::combine), so that no load splits a cache line. A misaligned 64-byte load touches two
/// lines, and on Zen 5 a stream of them reads W from memory at about 60% of the aligned rate
/// (bench_kernels BM_MatmulSmallM, woff 0 against 28; llama2.c checkpoints put every tensor 28
/// bytes past a line, GGUF's 32-byte alignment half of them). The loaded values are the same,
/// so the bits are too.
template <class Isa, bool Shifted>
struct WLoad {
  typename Isa::Shift shift{};
  /// Row length (floats): a walk's steps that reach it load unaligned, as the aligned packet
  /// after a row's last element would lie past the row.
  std::int64_t in = 0;
};

/// Walks k over [k_begin, k_end) in steps of 16 lanes, calling step(k, load_w) where
/// load_w(j, kk) is the packet of W row j (`rb` bytes after row j - 1) at element kk, for kk =
/// k + q * kWidth, q < Packets (the packets of a step). k_begin is a multiple of 16 (of 32 for
/// Q8_0) plus a packet offset, and k_end - k_begin a multiple of 16 (of 32 for Q8_0): a Q8_0
/// block's two steps read its scale once. `ld` says how float32 packets are read (WLoad).
template <class Isa, DType WT, int NR, int Packets, bool Shifted, class Step>
inline __attribute__((always_inline)) void sm_walk(const std::byte* w, std::int64_t rb,
                                                   std::int64_t k_begin, std::int64_t k_end,
                                                   const WLoad<Isa, Shifted>& ld, Step&& step) {
  if constexpr (WT == DType::F32 && Shifted) {
    // Rows start ld.shift.s floats past a packet boundary: each step reads the aligned packets
    // that hold its elements and recombines neighbours (Isa::combine). When a step's packets
    // cover all 16 lanes, the last aligned packet of a step is the first of the next one and is
    // carried in a register, so each line is loaded once. A walk that reaches the row's end
    // takes its last step with unaligned loads (the next aligned packet lies past the row).
    using P = typename Isa::Packet;
    constexpr int kW = Isa::kWidth;
    constexpr bool kCarry = Packets * kW == kSmallMLanes;
    const std::int64_t last = k_end == ld.in ? k_end - kSmallMLanes : k_end;
    auto aligned = [&](int j, std::int64_t kk) __attribute__((always_inline)) {
      return Isa::load_aligned(reinterpret_cast<const float*>(w + j * rb) + kk - ld.shift.s);
    };
    std::int64_t k = k_begin;
    P carried[NR];
    if (kCarry && k < last)
      for (int j = 0; j < NR; ++j) carried[j] = aligned(j, k);
    for (; k < last; k += kSmallMLanes) {
      P packets[NR][Packets];
      for (int j = 0; j < NR; ++j) {
        P lo = kCarry ? carried[j] : aligned(j, k);
        for (int q = 0; q < Packets; ++q) {
          const P hi = aligned(j, k + (q + 1) * kW);
          packets[j][q] = Isa::combine(lo, hi, ld.shift);
          lo = hi;
        }
        if (kCarry) carried[j] = lo;
      }
      step(k, [&](int j, std::int64_t kk) { return packets[j][(kk - k) / kW]; });
    }
    for (; k < k_end; k += kSmallMLanes)
      step(k, [&](int j, std::int64_t kk) {
        return Isa::load(reinterpret_cast<const float*>(w + j * rb) + kk);
      });
  } else if constexpr (WT == DType::Q8_0) {
    for (std::int64_t k = k_begin; k < k_end; k += 2 * kSmallMLanes) {
      typename Isa::Packet d[NR];
      for (int j = 0; j < NR; ++j) d[j] = Isa::q8_scale(w + j * rb, k);
      auto q8 = [&](int j, std::int64_t kk) { return Isa::q8_load(w + j * rb, kk, d[j]); };
      step(k, q8);
      step(k + kSmallMLanes, q8);
    }
  } else {
    for (std::int64_t k = k_begin; k < k_end; k += kSmallMLanes)
      step(k, [&](int j, std::int64_t kk) { return Isa::template load_w<WT>(w + j * rb, kk); });
  }
}

/// Software prefetches that a block of x rows issues as it walks k (sm_chunk): one line per step
/// for each of `streams` W rows, `stride` bytes apart from `at`, at the step's element offset.
/// sm_rows points them at the next call's W rows (the next row of each segment), so the weights'
/// misses are spread over the whole computation instead of stalling the first block.
struct Prefetch {
  const std::byte* at = nullptr;
  std::int64_t stride = 0;
  int streams = 0;
};

/// Byte offset of element k (a multiple of 16) in a W row of dtype WT.
template <DType WT>
constexpr std::int64_t element_offset(std::int64_t k) noexcept {
  if constexpr (WT == DType::Q8_0)
    return (k >> 5) * 34 + 2 + (k & 31);
  else if constexpr (WT == DType::F32)
    return k * 4;
  else
    return k * 2;
}

/// Floats of x's rows per k-chunk of sm_rows: the chunk of an x block and of the NR W rows stays
/// in L1 between the packet passes and across the x blocks, so x comes from L2 once per block of
/// W rows and W from memory once. 256 keeps the chunks of 64 x rows (64 KiB) in L2 and the
/// accumulators' spills (one load and one store per accumulator per chunk) under 7% of the loads.
inline constexpr std::int64_t kSmallMChunk = 256;
/// Most x rows whose accumulators sm_rows keeps at once (more rows are taken in groups of it).
inline constexpr std::int64_t kSmallMGroupRows = 64;

/// One k-chunk [k0, k1) (multiples of 16; of 32 for Q8_0) of MR rows of x against NR rows of W
/// (`rb` bytes apart), continuing the MR x NR accumulators of 16 lanes in `acc` ([MR][NR][16];
/// from zero when `first`). Each lane sums its k in increasing order across the chunks, so the
/// chunking leaves every output's summation order (cpu_small_m.hpp) unchanged. Each step also
/// issues `pf`'s prefetches (none when pf.streams is 0).
template <class Isa, DType WT, int MR, int NR, bool Sh>
inline __attribute__((always_inline)) void sm_chunk(const float* x, const std::byte* w,
                                                    float* acc_lanes, std::int64_t in,
                                                    std::int64_t rb, std::int64_t k0,
                                                    std::int64_t k1, bool first,
                                                    const WLoad<Isa, Sh>& ld,
                                                    const Prefetch& pf) {
  using P = typename Isa::Packet;
  constexpr int kW = Isa::kWidth;
  constexpr int kPk = kSmallMLanes / kW;
  static_assert(kPk * kW == kSmallMLanes, "packet width must divide 16");
  for (int p = 0; p < kPk; ++p) {
    P acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j)
        acc[i][j] =
            first ? Isa::zero() : Isa::load(acc_lanes + (i * NR + j) * kSmallMLanes + p * kW);
    const int streams = p == 0 ? pf.streams : 0;  // the first pass brings the lines
    auto step = [&](std::int64_t k, auto&& load_w) __attribute__((always_inline)) {
      for (int q = 0; q < streams; ++q)
        _mm_prefetch(reinterpret_cast<const char*>(pf.at + q * pf.stride + element_offset<WT>(k)),
                     _MM_HINT_T0);
      P wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = load_w(j, k);
      for (int i = 0; i < MR; ++i) {
        P xv = Isa::load(x + i * in + k);
        // Isa::kXInRegister: the compiler would fold the load into each of the NR FMAs (NR
        // loads of one packet); the empty asm makes it one load, which on Zen 5's two 512-bit
        // load ports was the bound at 8 x 2 and 8 x 3 (AVX-512: 18 loads per 16 FMAs).
        if constexpr (Isa::kXInRegister && NR > 1) asm("" : "+v"(xv));
        for (int j = 0; j < NR; ++j) acc[i][j] = Isa::fma(xv, wv[j], acc[i][j]);
      }
    };
    sm_walk<Isa, WT, NR, 1>(w, rb, k0 + p * kW, k1, ld, step);
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j)
        Isa::store(acc_lanes + (i * NR + j) * kSmallMLanes + p * kW, acc[i][j]);
  }
}

/// sm_chunk for the last `rows` < MR rows of x (MR - 1 down to 1).
template <class Isa, DType WT, int MR, int NR, bool Sh>
inline void sm_chunk_tail(const float* x, const std::byte* w, float* acc_lanes, std::int64_t rows,
                          std::int64_t in, std::int64_t rb, std::int64_t k0, std::int64_t k1,
                          bool first, const WLoad<Isa, Sh>& ld, const Prefetch& pf) {
  if constexpr (MR > 1) {
    if (rows == MR - 1)
      sm_chunk<Isa, WT, MR - 1, NR>(x, w, acc_lanes, in, rb, k0, k1, first, ld, pf);
    else
      sm_chunk_tail<Isa, WT, MR - 1, NR>(x, w, acc_lanes, rows, in, rb, k0, k1, first, ld, pf);
  }
}

/// All `tokens` rows of x against W rows n, n + rs, ..., n + (NR - 1) rs: for each group of up
/// to kSmallMGroupRows x rows, the k-chunks in order, each over the group's blocks of MR rows;
/// then each output's lanes reduced and its K % 16 tail added.
template <class Isa, DType WT, int MR, int NR, bool Accumulate, bool Sh>
inline void sm_rows(const float* x, const std::byte* w, float* out, std::int64_t tokens,
                    std::int64_t in, std::int64_t out_dim, std::int64_t n, std::int64_t rs,
                    const WLoad<Isa, Sh>& ld, bool prefetch_on) {
  const std::int64_t rb = rs * row_bytes<WT>(in);
  const std::byte* wn = w + n * row_bytes<WT>(in);
  const std::int64_t k_vec = in - in % kSmallMLanes;
  alignas(64) float lanes[kSmallMGroupRows * NR * kSmallMLanes];
  // Isa::kPrefetchRows: from that many x rows on (and while `prefetch_on`), the next W row of
  // each segment (the next call's) is prefetched one line per step of the walk, spread over
  // the first NR blocks of x rows (Prefetch), so its misses are in flight while this call
  // computes and the memory stream stays busy through the blocks that read W from L1 (a
  // prefetch past W's end does not fault). Issuing a row's lines all at once, at the call's
  // start (the earlier scheme), stalled on the full miss queue: 19% of the kernel's samples sat
  // on those prefetches. Over the 42M decode sweep on Zen 5 (bench_kernels BM_DecodeSweep,
  // docs/benchmarks.md) the spread prefetches raised 4-16 rows by 1.1-1.4x on AVX-512 and AVX2.
  const bool prefetch = prefetch_on && Isa::kPrefetchRows > 0 && tokens >= Isa::kPrefetchRows;
  for (std::int64_t g = 0; g < tokens; g += kSmallMGroupRows) {
    const std::int64_t rows = tokens - g < kSmallMGroupRows ? tokens - g : kSmallMGroupRows;
    const float* xg = x + g * in;
    const std::int64_t blocks = (rows + MR - 1) / MR;
    // The first group's blocks share the next W rows' prefetches: block b takes the streams
    // j = b, b + blocks, ... (NR streams over min(blocks, NR) blocks).
    auto prefetch_of = [&](std::int64_t b) {
      Prefetch pf;
      if (prefetch && g == 0 && b < NR) {
        pf.at = wn + b * rb + row_bytes<WT>(in);
        pf.stride = blocks * rb;
        pf.streams = static_cast<int>((NR - b + blocks - 1) / blocks);
      }
      return pf;
    };
    if (k_vec == 0)
      for (float& l : lanes) l = 0.0f;
    for (std::int64_t k0 = 0; k0 < k_vec; k0 += kSmallMChunk) {
      const std::int64_t k1 = k0 + kSmallMChunk < k_vec ? k0 + kSmallMChunk : k_vec;
      std::int64_t t = 0;
      for (; t + MR <= rows; t += MR)
        sm_chunk<Isa, WT, MR, NR>(xg + t * in, wn, lanes + t * NR * kSmallMLanes, in, rb, k0, k1,
                                  k0 == 0, ld, prefetch_of(t / MR));
      if (t < rows)
        sm_chunk_tail<Isa, WT, MR, NR>(xg + t * in, wn, lanes + t * NR * kSmallMLanes, rows - t, in,
                                       rb, k0, k1, k0 == 0, ld, prefetch_of(t / MR));
    }
    for (std::int64_t t = 0; t < rows; ++t)
      for (int j = 0; j < NR; ++j) {
        const float s = add_tail<WT>(reduce_lanes_vec(lanes + (t * NR + j) * kSmallMLanes),
                                     xg + t * in, wn + j * rb, k_vec, in, Isa::half);
        float& o = out[(g + t) * out_dim + n + j * rs];
        o = Accumulate ? o + s : s;
      }
  }
}

/// One row of x (a GEMV) against the NR rows of W at w, `rs` rows apart: all 16 lanes in one
/// pass (NR x 16 / kWidth accumulators), so each Q8_0 block's scale is read once and x once.
template <class Isa, DType WT, int NR, bool Accumulate, bool Sh>
inline __attribute__((always_inline)) void sm_gemv(const float* x, const std::byte* w, float* out,
                                                   std::int64_t in, std::int64_t rs,
                                                   const WLoad<Isa, Sh>& ld) {
  const std::int64_t rb = rs * row_bytes<WT>(in);
  using P = typename Isa::Packet;
  constexpr int kW = Isa::kWidth;
  constexpr int kPk = kSmallMLanes / kW;
  const std::int64_t k_vec = in - in % kSmallMLanes;
  P acc[NR][kPk];
  for (int j = 0; j < NR; ++j)
    for (int p = 0; p < kPk; ++p) acc[j][p] = Isa::zero();
  auto step = [&](std::int64_t k, auto&& load_w) __attribute__((always_inline)) {
    for (int p = 0; p < kPk; ++p) {
      const P xv = Isa::load(x + k + p * kW);
      for (int j = 0; j < NR; ++j) acc[j][p] = Isa::fma(xv, load_w(j, k + p * kW), acc[j][p]);
    }
  };
  sm_walk<Isa, WT, NR, kPk>(w, rb, 0, k_vec, ld, step);
  alignas(64) float lanes[kSmallMLanes];
  for (int j = 0; j < NR; ++j) {
    for (int p = 0; p < kPk; ++p) Isa::store(lanes + p * kW, acc[j][p]);
    const float s = add_tail<WT>(reduce_lanes_vec(lanes), x, w + j * rb, k_vec, in, Isa::half);
    float& o = out[j * rs];
    o = Accumulate ? o + s : s;
  }
}

/// W rows [n_begin, n_end): split into NR equal segments (GemvNR for one row of x) walked side
/// by side, block i taking row i of each segment; the rows past the last whole segment one by one.
template <class Isa, DType WT, int MR, int NR, int GemvNR, bool Accumulate, bool Sh>
inline void sm_run(const float* x, const std::byte* w, float* out, std::int64_t tokens,
                   std::int64_t in, std::int64_t out_dim, std::int64_t n_begin,
                   std::int64_t n_end, const WLoad<Isa, Sh>& ld, bool prefetch) {
  const std::int64_t rows = n_end - n_begin;
  std::int64_t done = 0;
  if (tokens == 1) {
    const std::int64_t seg = rows / GemvNR;
    for (std::int64_t i = 0; i < seg; ++i)
      sm_gemv<Isa, WT, GemvNR, Accumulate>(x, w + (n_begin + i) * row_bytes<WT>(in),
                                           out + n_begin + i, in, seg, ld);
    done = seg * GemvNR;
  } else {
    const std::int64_t seg = rows / NR;
    for (std::int64_t i = 0; i < seg; ++i)
      sm_rows<Isa, WT, MR, NR, Accumulate>(x, w, out, tokens, in, out_dim, n_begin + i, seg, ld,
                                           prefetch);
    done = seg * NR;
  }
  for (std::int64_t n = n_begin + done; n < n_end; ++n)
    sm_rows<Isa, WT, MR, 1, Accumulate>(x, w, out, tokens, in, out_dim, n, 1, ld, prefetch);
}

template <class Isa, DType WT, int MR, int NR, int GemvNR>
inline void sm_typed(const float* x, const void* w, float* out, std::int64_t tokens,
                     std::int64_t in, std::int64_t out_dim, std::int64_t n_begin,
                     std::int64_t n_end, bool accumulate, bool prefetch) {
  const auto* wb = static_cast<const std::byte*>(w);
  auto run = [&](const auto& ld) {
    if (accumulate)
      sm_run<Isa, WT, MR, NR, GemvNR, true>(x, wb, out, tokens, in, out_dim, n_begin, n_end, ld,
                                            prefetch);
    else
      sm_run<Isa, WT, MR, NR, GemvNR, false>(x, wb, out, tokens, in, out_dim, n_begin, n_end, ld,
                                             prefetch);
  };
  if constexpr (WT == DType::F32) {
    // Shifted loads when W starts inside a packet at a whole float and every row starts at the
    // same offset (in a multiple of the packet width).
    constexpr std::uintptr_t kBytes = sizeof(float) * Isa::kWidth;
    const std::uintptr_t off = reinterpret_cast<std::uintptr_t>(w) % kBytes;
    if (off != 0 && off % sizeof(float) == 0 && in % Isa::kWidth == 0)
      return run(WLoad<Isa, true>{Isa::make_shift(static_cast<int>(off / sizeof(float))), in});
  }
  run(WLoad<Isa, false>{});
}

/// The kernel for W's dtype `wt` (F32, F16, BF16 or Q8_0; anything else does nothing: the
/// caller checks): MR x NR blocks for F32, TMR x TNR for the typed W (each weight packet is
/// converted once per block of x rows, so a typed W favours fewer W rows per block).
template <class Isa, int MR, int NR, int TMR, int TNR, int GemvNR>
inline void sm_dispatch(const float* x, const void* w, DType wt, float* out, std::int64_t tokens,
                        std::int64_t in, std::int64_t out_dim, std::int64_t n_begin,
                        std::int64_t n_end, bool accumulate, bool prefetch) {
  switch (wt) {
    case DType::F32:
      return sm_typed<Isa, DType::F32, MR, NR, GemvNR>(x, w, out, tokens, in, out_dim, n_begin,
                                                       n_end, accumulate, prefetch);
    case DType::F16:
      return sm_typed<Isa, DType::F16, TMR, TNR, GemvNR>(x, w, out, tokens, in, out_dim, n_begin,
                                                         n_end, accumulate, prefetch);
    case DType::BF16:
      return sm_typed<Isa, DType::BF16, TMR, TNR, GemvNR>(x, w, out, tokens, in, out_dim, n_begin,
                                                          n_end, accumulate, prefetch);
    case DType::Q8_0:
      return sm_typed<Isa, DType::Q8_0, TMR, TNR, GemvNR>(x, w, out, tokens, in, out_dim, n_begin,
                                                          n_end, accumulate, prefetch);
    default:
      return;
  }
}

/// Rows [0, rows) of W (dtype WT: F16, BF16 or Q8_0) as float32 into out [rows x in] (exact):
/// the same packet conversions as the kernel, stored instead of summed.
template <class Isa, DType WT>
inline void sm_dequantize_typed(const std::byte* w, std::int64_t in, std::int64_t rows,
                                float* out) {
  constexpr int kW = Isa::kWidth;
  const std::int64_t rb = row_bytes<WT>(in);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::byte* row = w + r * rb;
    float* o = out + r * in;
    if constexpr (WT == DType::Q8_0) {
      for (std::int64_t k = 0; k < in; k += 32) {
        const auto d = Isa::q8_scale(row, k);
        for (std::int64_t kk = k; kk < k + 32; kk += kW)
          Isa::store(o + kk, Isa::q8_load(row, kk, d));
      }
    } else {
      const std::int64_t k_vec = in - in % kW;
      for (std::int64_t k = 0; k < k_vec; k += kW)
        Isa::store(o + k, Isa::template load_w<WT>(row, k));
      for (std::int64_t k = k_vec; k < in; ++k) o[k] = weight_at<WT>(row, k, Isa::half);
    }
  }
}

/// sm_dequantize_typed for W's dtype `wt` (F16, BF16 or Q8_0; anything else does nothing).
template <class Isa>
inline void sm_dequantize(const void* w, DType wt, std::int64_t in, std::int64_t rows, float* out) {
  const auto* wb = static_cast<const std::byte*>(w);
  switch (wt) {
    case DType::F16:
      return sm_dequantize_typed<Isa, DType::F16>(wb, in, rows, out);
    case DType::BF16:
      return sm_dequantize_typed<Isa, DType::BF16>(wb, in, rows, out);
    case DType::Q8_0:
      return sm_dequantize_typed<Isa, DType::Q8_0>(wb, in, rows, out);
    default:
      return;
  }
}

}  // namespace
}  // namespace brigade::cpu::detail
