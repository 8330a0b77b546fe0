// InferenceStage: one stage's layers over packed micro-batches, with its KV caches.
#include "brigade/runtime/inference_stage.hpp"

#include "brigade/core/finite.hpp"
#include "mapped_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace brigade::runtime {
inline namespace v0 {

using model::LayerKind;

InferenceStageBase::InferenceStageBase(const model::LlamaWeights& weights,
                                       partition::StageRange range,
                                       std::span<const int> capacities,
                                       const model::SamplerConfig& sampler,
                                       std::int64_t pool_rows)
    : weights_(&weights),
      spec_(weights.config),
      range_(range),
      num_layers_(spec_.num_layers()),
      kv_dim_(weights.config.kv_dim()),
      capacities_(capacities.begin(), capacities.end()) {
  BRIGADE_CHECK(range.first >= 0 && range.first < range.last && range.last <= num_layers_,
                Errc::InvalidArgument, "InferenceStage: layers [{}, {}) outside the model's [0, {})",
                range.first, range.last, num_layers_);
  const auto& c = weights.config;
  for (std::size_t i = 0; i < capacities_.size(); ++i) {
    BRIGADE_CHECK(capacities_[i] >= 1 && capacities_[i] <= c.seq_len, Errc::InvalidArgument,
                  "InferenceStage: sequence {} needs {} positions, the model's seq_len is {}", i,
                  capacities_[i], c.seq_len);
    cache_offsets_.push_back(cache_rows_total_);
    cache_rows_total_ += capacities_[i];
  }
  BRIGADE_CHECK(pool_rows >= 0, Errc::InvalidArgument, "InferenceStage: pool_rows = {}, expected >= 0",
                pool_rows);
  cache_rows_total_ = std::max(cache_rows_total_, pool_rows);
  sampler_config_ = sampler;
  for (int l = range.first; l < range.last; ++l) {
    if (spec_.layer(l).kind != LayerKind::Decoder) continue;
    if (first_decoder_ < 0) first_decoder_ = spec_.layer(l).decoder_index;
    ++num_decoders_;
  }
  // The byte ranges of this stage's tensors, rounded out to whole pages and merged.
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> ranges;  // [begin, end)
  // A matrix counts its bytes in its dtype (rows x in elements).
  auto tensor = [&](model::WeightMatrix m, std::int64_t rows, std::int64_t in) {
    if (m.data == nullptr || rows * in <= 0) return;
    const auto b = reinterpret_cast<std::uintptr_t>(m.data);
    const auto bytes =
        static_cast<std::uintptr_t>(rows) * model::weight_row_bytes(m.dtype, in);
    weight_bytes_ += bytes;
    ranges.emplace_back(b / page * page, (b + bytes + page - 1) / page * page);
  };
  const std::int64_t dim = c.dim, kv = c.kv_dim(), hid = c.hidden_dim, vocab = c.vocab_size;
  for (int l = range.first; l < range.last; ++l) {
    const auto& ls = spec_.layer(l);
    switch (ls.kind) {
      case LayerKind::Embedding:
        tensor(weights.token_embedding, vocab, dim);
        break;
      case LayerKind::Decoder: {
        const auto& d = weights.layers[static_cast<std::size_t>(ls.decoder_index)];
        tensor(d.rms_att, 1, dim);
        tensor(d.wq, dim, dim);
        tensor(d.wk, kv, dim);
        tensor(d.wv, kv, dim);
        tensor(d.wo, dim, dim);
        tensor(d.rms_ffn, 1, dim);
        tensor(d.w1, hid, dim);
        tensor(d.w2, dim, hid);
        tensor(d.w3, hid, dim);
        break;
      }
      case LayerKind::FinalNorm:
        tensor(weights.rms_final, 1, dim);
        break;
      case LayerKind::LMHead:
        tensor(weights.wcls, vocab, dim);
        break;
      case LayerKind::Sampler:
        break;
    }
  }
  std::sort(ranges.begin(), ranges.end());
  for (const auto& [b, e] : ranges) {
    if (!weight_pages_.empty() && b <= weight_pages_.back().first + weight_pages_.back().second) {
      auto& last = weight_pages_.back();
      last.second = std::max(last.first + last.second, e) - last.first;
    } else {
      weight_pages_.emplace_back(b, e - b);
    }
  }
  if (owns_sampler()) {
    for (std::size_t i = 0; i < capacities_.size(); ++i) {
      model::SamplerConfig sc = sampler;
      sc.seed = sampler.seed + i;
      samplers_.emplace_back(c.vocab_size, sc);
    }
  }
}

bool InferenceStageBase::advise_weights(
    std::span<const std::pair<std::uintptr_t, std::size_t>> ranges, int advice, const char* name) {
  if (!weights_->mapped) return false;
  // In pieces of 2 MiB: one MADV_WILLNEED call starts the reads of at most a few megabytes
  // (8 MB on Linux 6.18, force_page_cache_ra's limit), and the rest of a larger range would
  // come in by page faults, one page at a time under the run's MADV_RANDOM (10-14 MB/s against
  // 250-580 MB/s in pieces on this machine: docs/ring.md).
  constexpr std::size_t kPiece = std::size_t{2} << 20;
  for (const auto& [begin, bytes] : ranges)
    for (std::size_t off = 0; off < bytes; off += kPiece) {
      const std::size_t n = std::min(kPiece, bytes - off);
      if (::madvise(reinterpret_cast<void*>(begin + off), n, advice) != 0) {
        const int err = errno;
        ::brigade::detail::fail(Errc::Internal,
                                "InferenceStage [{}, {}): madvise({}) over {} bytes failed: {}",
                                range_.first, range_.last, name, n, std::strerror(err));
      }
    }
  return true;
}

void InferenceStageBase::check_weights_finite() {
  if (!weights_->check_finite) return;
  std::call_once(*scanned_, [this] { weights_->check_finite(range_.first, range_.last); });
}

bool InferenceStageBase::prefetch_weights() {
  if (!weights_->mapped) return false;
  // A range of up to 8 MiB: MADV_WILLNEED, which reads exactly it. A larger one (a decoder
  // layer of a GGUF file, its tensors side by side): MADV_SEQUENTIAL, then the reads below
  // fault it in front to back with the kernel's read-ahead, which runs at most one read-ahead
  // window past its end. On this machine (Linux 6.18, virtio disk) windows of 88 MB load at
  // 1.1-2.7 GB/s against 0.4-0.9 GB/s by MADV_WILLNEED in pieces (docs/ring.md); the range
  // stays MADV_SEQUENTIAL (its later faults, if any, read ahead the same way).
  constexpr std::size_t kExact = std::size_t{8} << 20;
  std::vector<std::pair<std::uintptr_t, std::size_t>> small;
  for (const auto& r : weight_pages_) {
    if (r.second <= kExact) {
      small.push_back(r);
    } else if (::madvise(reinterpret_cast<void*>(r.first), r.second, MADV_SEQUENTIAL) != 0) {
      const int err = errno;
      ::brigade::detail::fail(Errc::Internal,
                              "InferenceStage [{}, {}): madvise(MADV_SEQUENTIAL) over {} bytes "
                              "failed: {}",
                              range_.first, range_.last, r.second, std::strerror(err));
    }
  }
  advise_weights(small, MADV_WILLNEED, "MADV_WILLNEED");
  check_weights_finite();
  // One read per page: each page is resident in this process when this returns.
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  unsigned sum = 0;
  for (const auto& [begin, bytes] : weight_pages_)
    for (std::size_t off = 0; off < bytes; off += page)
      sum += *reinterpret_cast<const volatile unsigned char*>(begin + off);
  touched_ = sum;
  return true;
}

namespace {

/// `from` without `keep` (both sorted, merged, page-aligned (address, bytes) ranges).
std::vector<std::pair<std::uintptr_t, std::size_t>> without(
    std::span<const std::pair<std::uintptr_t, std::size_t>> from,
    std::span<const std::pair<std::uintptr_t, std::size_t>> keep) {
  std::vector<std::pair<std::uintptr_t, std::size_t>> out;
  std::size_t k = 0;
  for (const auto& [begin, bytes] : from) {
    std::uintptr_t at = begin;
    const std::uintptr_t end = begin + bytes;
    while (k < keep.size() && keep[k].first + keep[k].second <= at) ++k;
    for (std::size_t j = k; j < keep.size() && keep[j].first < end && at < end; ++j) {
      if (keep[j].first > at) out.emplace_back(at, keep[j].first - at);
      at = std::max(at, keep[j].first + keep[j].second);
    }
    if (at < end) out.emplace_back(at, end - at);
  }
  return out;
}

}  // namespace

bool InferenceStageBase::release_weights(
    std::span<const std::pair<std::uintptr_t, std::size_t>> keep) {
  const auto drop = without(weight_pages_, keep);
  if (!advise_weights(drop, MADV_DONTNEED, "MADV_DONTNEED")) return false;
  const int fd = ::brigade::detail::MappedFiles::instance().fd(weights_->storage.get());
  if (fd < 0) return true;  // not one of OpenFile::map's mappings: the process's pages are dropped
  const auto base = reinterpret_cast<std::uintptr_t>(weights_->storage.get());
  for (const auto& [begin, bytes] : drop) {
    const int rc = ::posix_fadvise(fd, static_cast<off_t>(begin - base),
                                   static_cast<off_t>(bytes), POSIX_FADV_DONTNEED);
    if (rc != 0)
      ::brigade::detail::fail(Errc::Internal,
                              "InferenceStage [{}, {}): posix_fadvise(POSIX_FADV_DONTNEED) over {} "
                              "bytes failed: {}",
                              range_.first, range_.last, bytes, std::strerror(rc));
  }
  return true;
}

bool release_model_pages(const model::LlamaWeights& weights) {
  if (!weights.mapped) return false;
  const void* base = weights.storage.get();
  const auto& files = ::brigade::detail::MappedFiles::instance();
  const std::size_t bytes = files.bytes(base);
  const int fd = files.fd(base);
  if (bytes == 0 || fd < 0) return false;
  if (::madvise(const_cast<void*>(base), bytes, MADV_DONTNEED) != 0) {
    const int err = errno;
    ::brigade::detail::fail(Errc::Internal, "release_model_pages: madvise(MADV_DONTNEED) over {} bytes failed: {}",
                            bytes, std::strerror(err));
  }
  const int rc = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  if (rc != 0)
    ::brigade::detail::fail(Errc::Internal, "release_model_pages: posix_fadvise(POSIX_FADV_DONTNEED) failed: {}",
                            std::strerror(rc));
  return true;
}

std::size_t InferenceStageBase::resident_weight_bytes() const {
  if (!weights_->mapped) return weight_bytes_;
  return resident_bytes(weight_pages_);
}

std::size_t resident_bytes(std::span<const std::pair<std::uintptr_t, std::size_t>> ranges) {
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  // Merged, so a page two ranges share is counted once.
  std::vector<std::pair<std::uintptr_t, std::size_t>> merged(ranges.begin(), ranges.end());
  std::sort(merged.begin(), merged.end());
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> spans;  // [first page, end)
  for (const auto& [b, n] : merged) {
    const std::uintptr_t lo = b / page * page, hi = (b + n + page - 1) / page * page;
    if (!spans.empty() && lo <= spans.back().second)
      spans.back().second = std::max(spans.back().second, hi);
    else
      spans.emplace_back(lo, hi);
  }
  std::size_t resident = 0;
  std::vector<unsigned char> in;
  for (const auto& [lo, hi] : spans) {
    in.assign((hi - lo) / page, 0);
    if (::mincore(reinterpret_cast<void*>(lo), hi - lo, in.data()) != 0) {
      const int err = errno;
      ::brigade::detail::fail(Errc::Internal, "resident_bytes: mincore over {} bytes at {:#x} failed: {}",
                              hi - lo, lo, std::strerror(err));
    }
    for (const unsigned char c : in) resident += (c & 1u) ? page : 0;
  }
  return resident;
}

int InferenceStageBase::decoder_of(int layer, const char* what) const {
  BRIGADE_CHECK(layer >= 0 && layer < num_layers_ &&
                    spec_.layer(layer).kind == LayerKind::Decoder,
                Errc::InvalidArgument,
                "InferenceStage [{}, {}): {}: layer {} is not a decoder layer (only decoders move "
                "between stages)",
                range_.first, range_.last, what, layer);
  return spec_.layer(layer).decoder_index;
}

namespace {

/// Decoder `d`'s nine tensors as (host pointer, bytes), in model::DecoderWeights order.
std::array<std::pair<const void*, std::size_t>, 9> decoder_tensors(const model::LlamaWeights& w,
                                                                   int d) {
  const auto& c = w.config;
  const auto& h = w.layers[static_cast<std::size_t>(d)];
  const std::int64_t dim = c.dim, kv = c.kv_dim(), hid = c.hidden_dim;
  auto m = [](model::WeightMatrix x, std::int64_t rows, std::int64_t cols) {
    return std::pair<const void*, std::size_t>(
        x.data, static_cast<std::size_t>(rows) * model::weight_row_bytes(x.dtype, cols));
  };
  return {{m(h.rms_att, 1, dim), m(h.wq, dim, dim), m(h.wk, kv, dim), m(h.wv, kv, dim),
           m(h.wo, dim, dim), m(h.rms_ffn, 1, dim), m(h.w1, hid, dim), m(h.w2, dim, hid),
           m(h.w3, hid, dim)}};
}

}  // namespace

std::array<std::size_t, 10> decoder_image_layout(const model::LlamaWeights& weights, int d) {
  const auto t = decoder_tensors(weights, d);
  std::array<std::size_t, 10> off{};
  std::size_t at = 0;
  for (std::size_t k = 0; k < t.size(); ++k) {
    off[k] = at;
    at = (at + t[k].second + 63) / 64 * 64;
  }
  off[9] = at;
  return off;
}

std::size_t InferenceStageBase::migration_weight_bytes(int layer) const {
  return decoder_image_layout(*weights_, decoder_of(layer, "migration_weight_bytes"))[9];
}

void InferenceStageBase::read_migration_weights(int layer, std::size_t offset,
                                                std::span<std::byte> out) const {
  const int d = decoder_of(layer, "read_migration_weights");
  const auto off = decoder_image_layout(*weights_, d);
  BRIGADE_CHECK(offset <= off[9] && out.size() <= off[9] - offset, Errc::InvalidArgument,
                "InferenceStage: weight bytes [{}, {}) of layer {} outside its image of {} bytes",
                offset, offset + out.size(), layer, off[9]);
  const auto t = decoder_tensors(*weights_, d);
  std::memset(out.data(), 0, out.size());  // the padding between tensors
  const std::size_t end = offset + out.size();
  for (std::size_t k = 0; k < t.size(); ++k) {
    const std::size_t lo = std::max(offset, off[k]), hi = std::min(end, off[k] + t[k].second);
    if (lo < hi)
      std::memcpy(out.data() + (lo - offset),
                  static_cast<const std::byte*>(t[k].first) + (lo - off[k]), hi - lo);
  }
}

void InferenceStageBase::set_range(partition::StageRange r) {
  range_ = r;
  first_decoder_ = -1;
  num_decoders_ = 0;
  for (int l = r.first; l < r.last; ++l) {
    if (spec_.layer(l).kind != LayerKind::Decoder) continue;
    if (first_decoder_ < 0) first_decoder_ = spec_.layer(l).decoder_index;
    ++num_decoders_;
  }
}

backend::KvCacheView InferenceStageBase::kv_view(void* base, DType dtype) const {
  const std::int64_t kv = kv_dim_;
  backend::KvCacheView v;
  v.keys = base;
  v.values = static_cast<std::byte*>(base) + dtype_bytes(dtype, cache_rows_total_ * kv);
  v.dtype = dtype;
  v.kv_dim = kv;
  v.first_row = cache_offsets_;
  v.capacity = capacities_;
  return v;
}

void InferenceStageBase::place_sequences(const Microbatch& mb) {
  if (mb.placement.empty()) return;
  const auto& c = weights_->config;
  BRIGADE_CHECK(mb.placement.size() == mb.seqs.size(), Errc::InvalidArgument,
                "InferenceStage: micro-batch {} has {} KV placements for {} sequences", mb.id,
                mb.placement.size(), mb.seqs.size());
  for (std::size_t i = 0; i < mb.seqs.size(); ++i) {
    const auto& s = mb.seqs[i];
    const auto& p = mb.placement[i];
    BRIGADE_CHECK(s.seq >= 0 && p.first_row >= 0 && p.capacity >= 1 && p.capacity <= c.seq_len &&
                      p.first_row + static_cast<std::int64_t>(p.capacity) <= cache_rows_total_,
                  Errc::InvalidArgument,
                  "InferenceStage: sequence {} placed at KV rows [{}, {}), outside the pool of {} "
                  "rows (or over seq_len {})",
                  s.seq, p.first_row, static_cast<std::int64_t>(p.first_row) + p.capacity,
                  cache_rows_total_, c.seq_len);
    const auto id = static_cast<std::size_t>(s.seq);
    if (id >= capacities_.size()) {
      capacities_.resize(id + 1, 0);
      cache_offsets_.resize(id + 1, 0);
    }
    capacities_[id] = p.capacity;
    cache_offsets_[id] = p.first_row;
    if (owns_sampler() && (s.pos0 == 0 || id >= samplers_.size())) {
      while (samplers_.size() <= id) {
        model::SamplerConfig sc = sampler_config_;
        sc.seed = sampler_config_.seed + samplers_.size();
        samplers_.emplace_back(c.vocab_size, sc);
      }
      model::SamplerConfig sc = sampler_config_;
      sc.seed = sampler_config_.seed + id;
      samplers_[id] = model::Sampler(c.vocab_size, sc);
    }
  }
}

void InferenceStageBase::check_entry(const Microbatch& mb) const {
  const auto& c = weights_->config;
  BRIGADE_CHECK(mb.next_layer == range_.first, Errc::InvalidArgument,
                "InferenceStage [{}, {}): micro-batch {} enters at layer {}", range_.first,
                range_.last, mb.id, mb.next_layer);
  for (const auto& s : mb.seqs) {
    BRIGADE_CHECK(s.seq >= 0 && s.seq < static_cast<int>(capacities_.size()),
                  Errc::InvalidArgument, "InferenceStage: sequence id {} outside [0, {})", s.seq,
                  capacities_.size());
    BRIGADE_CHECK(s.tokens >= 1 && s.pos0 >= 0 &&
                      s.pos0 + s.tokens <= capacities_[static_cast<std::size_t>(s.seq)],
                  Errc::InvalidArgument,
                  "InferenceStage: sequence {} positions [{}, {}) exceed its KV capacity {}", s.seq,
                  s.pos0, s.pos0 + s.tokens, capacities_[static_cast<std::size_t>(s.seq)]);
  }
  if (!owns_embedding()) return;
  const std::int64_t tokens = mb.num_tokens();
  BRIGADE_CHECK(static_cast<std::int64_t>(mb.token_ids.size()) == tokens, Errc::InvalidArgument,
                "InferenceStage: micro-batch {} has {} token ids for {} tokens", mb.id,
                mb.token_ids.size(), tokens);
  for (auto id : mb.token_ids)
    BRIGADE_CHECK(id >= 0 && id < c.vocab_size, Errc::InvalidArgument,
                  "InferenceStage: token id {} outside the vocabulary [0, {})", id, c.vocab_size);
}

// Stops the run when layer `l`'s output in `mb` holds a NaN or an infinity, naming the stage
// (its layer range), the micro-batch, the layer, the sequence and position of the bad row and
// the column. One read of the output per layer (its cost: docs/benchmarks.md).
// @throws brigade::Error{NonFinite}
void InferenceStageBase::check_layer_output(const Microbatch& mb, int l) const {
  const auto range = range_;
  const model::LayerSpec& layer = spec_.layer(l);
  check_finite(
      mb.act.data(), mb.rows, mb.width,
      [&] {
        const std::string kind =
            layer.kind == LayerKind::Decoder
                ? fmt::format("decoder {}", layer.decoder_index)
                : std::string(model::to_string(layer.kind));
        return fmt::format("non-finite {}: stage of layers [{}, {}), micro-batch {}, output of "
                           "layer {} ({})",
                           layer.kind == LayerKind::LMHead ? "logits" : "activation", range.first,
                           range.last, mb.id, l, kind);
      },
      [&](std::int64_t row) {
        // Packed rows until the final norm; one row per sequence (its last position) after it.
        const bool per_sequence = mb.rows == static_cast<std::int64_t>(mb.seqs.size()) &&
                                  (layer.kind == LayerKind::FinalNorm || layer.kind == LayerKind::LMHead);
        std::int64_t first = 0;
        for (const auto& s : mb.seqs) {
          const std::int64_t n = per_sequence ? 1 : s.tokens;
          if (row < first + n)
            return fmt::format("row {} (sequence {}, position {})", row, s.seq,
                               per_sequence ? s.pos0 + s.tokens - 1 : s.pos0 + (row - first));
          first += n;
        }
        return fmt::format("row {}", row);
      });
}

void InferenceStageBase::sample(Microbatch& mb) {
  const auto& c = weights_->config;
  BRIGADE_CHECK(owns_sampler() && mb.next_layer == num_layers_ - 1, Errc::InvalidArgument,
                "InferenceStage [{}, {}): sample() on micro-batch {} at layer {}, expected the "
                "sampler layer {} of a stage that owns it",
                range_.first, range_.last, mb.id, mb.next_layer, num_layers_ - 1);
  const auto n_seq = static_cast<std::int64_t>(mb.seqs.size());
  BRIGADE_CHECK(mb.rows == n_seq && mb.width == c.vocab_size, Errc::InvalidArgument,
                "InferenceStage: sample() got [{} x {}] logits, expected [{} x {}]", mb.rows,
                mb.width, n_seq, c.vocab_size);
  // The logits were checked as the LM head's output, on whichever stage holds it.
  mb.sampled.resize(static_cast<std::size_t>(n_seq));
  BRIGADE_CHECK(mb.emit.empty() || mb.emit.size() == mb.seqs.size(), Errc::InvalidArgument,
                "InferenceStage: micro-batch {} has {} emit flags for {} sequences", mb.id,
                mb.emit.size(), mb.seqs.size());
  for (std::int64_t i = 0; i < n_seq; ++i) {
    if (!mb.emit.empty() && mb.emit[static_cast<std::size_t>(i)] == 0) {
      mb.sampled[static_cast<std::size_t>(i)] = -1;
      continue;
    }
    std::span<float> logits(mb.act.data() + i * c.vocab_size,
                            static_cast<std::size_t>(c.vocab_size));
    mb.sampled[static_cast<std::size_t>(i)] =
        samplers_[static_cast<std::size_t>(mb.seqs[static_cast<std::size_t>(i)].seq)].sample(
            logits);
  }
  mb.next_layer = range_.last;
}

template class InferenceStage<cpu::CpuBackend>;

}  // namespace v0
}  // namespace brigade::runtime
