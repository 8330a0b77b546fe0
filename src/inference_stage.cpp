// InferenceStage: one stage's layers over packed micro-batches, with its KV caches.
#include "brigade/runtime/inference_stage.hpp"

#include "brigade/core/finite.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace brigade::runtime {
inline namespace v0 {

using model::LayerKind;

namespace {

/// Stops the run when layer `l`'s output in `mb` holds a NaN or an infinity, naming the stage
/// (its layer range), the micro-batch, the layer, the sequence and position of the bad row and
/// the column. One read of the output per layer (its cost: docs/benchmarks.md).
/// @throws brigade::Error{NonFinite}
void check_layer_output(const Microbatch& mb, partition::StageRange range, int l,
                        const model::LayerSpec& layer) {
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

}  // namespace

InferenceStage::InferenceStage(const model::LlamaWeights& weights, partition::StageRange range,
                               std::span<const int> capacities,
                               const model::SamplerConfig& sampler)
    : weights_(&weights),
      spec_(weights.config),
      range_(range),
      num_layers_(spec_.num_layers()),
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
  first_decoder_ = -1;
  for (int l = range.first; l < range.last; ++l) {
    if (spec_.layer(l).kind != LayerKind::Decoder) continue;
    if (first_decoder_ < 0) first_decoder_ = spec_.layer(l).decoder_index;
    kv_.emplace_back(static_cast<std::size_t>(2 * cache_rows_total_ * c.kv_dim()), 0.0f);
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

std::size_t InferenceStage::kv_cache_bytes() const noexcept {
  std::size_t b = 0;
  for (const auto& k : kv_) b += k.size() * sizeof(float);
  return b;
}

bool InferenceStage::advise_weights(int advice, const char* name) {
  if (!weights_->mapped) return false;
  for (const auto& [begin, bytes] : weight_pages_) {
    if (::madvise(reinterpret_cast<void*>(begin), bytes, advice) != 0) {
      const int err = errno;
      ::brigade::detail::fail(Errc::Internal,
                              "InferenceStage [{}, {}): madvise({}) over {} bytes failed: {}",
                              range_.first, range_.last, name, bytes, std::strerror(err));
    }
  }
  return true;
}

bool InferenceStage::prefetch_weights() { return advise_weights(MADV_WILLNEED, "MADV_WILLNEED"); }

bool InferenceStage::release_weights() { return advise_weights(MADV_DONTNEED, "MADV_DONTNEED"); }

float* InferenceStage::k_cache(int decoder, int seq) {
  auto& buf = kv_[static_cast<std::size_t>(decoder - first_decoder_)];
  return buf.data() + cache_offsets_[static_cast<std::size_t>(seq)] * weights_->config.kv_dim();
}

float* InferenceStage::v_cache(int decoder, int seq) {
  auto& buf = kv_[static_cast<std::size_t>(decoder - first_decoder_)];
  return buf.data() + (cache_rows_total_ + cache_offsets_[static_cast<std::size_t>(seq)]) *
                          weights_->config.kv_dim();
}

void InferenceStage::forward(Microbatch& mb) {
  const auto& c = weights_->config;
  BRIGADE_CHECK(mb.next_layer == range_.first, Errc::InvalidArgument,
                "InferenceStage [{}, {}): micro-batch {} enters at layer {}", range_.first,
                range_.last, mb.id, mb.next_layer);
  const auto n_seq = static_cast<std::int64_t>(mb.seqs.size());
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
  const std::int64_t tokens = mb.num_tokens();
  std::vector<std::int32_t> pos;
  std::vector<cpu::SequenceSlice> slices;

  for (int l = range_.first; l < range_.last; ++l) {
    const auto& layer = spec_.layer(l);
    switch (layer.kind) {
      case LayerKind::Embedding: {
        BRIGADE_CHECK(static_cast<std::int64_t>(mb.token_ids.size()) == tokens,
                      Errc::InvalidArgument,
                      "InferenceStage: micro-batch {} has {} token ids for {} tokens", mb.id,
                      mb.token_ids.size(), tokens);
        for (auto id : mb.token_ids)
          BRIGADE_CHECK(id >= 0 && id < c.vocab_size, Errc::InvalidArgument,
                        "InferenceStage: token id {} outside the vocabulary [0, {})", id,
                        c.vocab_size);
        mb.rows = tokens;
        mb.width = c.dim;
        mb.act.resize(static_cast<std::size_t>(tokens * c.dim));
        cpu::embedding(weights_->token_embedding, mb.token_ids.data(), mb.act.data(), tokens,
                       c.dim);
        break;
      }
      case LayerKind::Decoder: {
        if (slices.empty()) {
          std::int64_t off = 0;
          for (const auto& s : mb.seqs) {
            for (int t = 0; t < s.tokens; ++t) pos.push_back(s.pos0 + t);
            slices.push_back({off, s.tokens, s.pos0, nullptr, nullptr});
            off += s.tokens;
          }
        }
        const int d = layer.decoder_index;
        for (std::size_t i = 0; i < slices.size(); ++i) {
          slices[i].k_cache = k_cache(d, mb.seqs[i].seq);
          slices[i].v_cache = v_cache(d, mb.seqs[i].seq);
        }
        BRIGADE_CHECK(mb.rows == tokens && mb.width == c.dim, Errc::InvalidArgument,
                      "InferenceStage: decoder {} got activations [{} x {}], expected [{} x {}]", d,
                      mb.rows, mb.width, tokens, c.dim);
        cpu::decoder_layer_forward(c, weights_->layers[static_cast<std::size_t>(d)],
                                   mb.act.data(), tokens, pos.data(), slices, scratch_);
        break;
      }
      case LayerKind::FinalNorm: {
        // Only each sequence's last row feeds the LM head.
        tmp_.resize(static_cast<std::size_t>(n_seq * c.dim));
        std::int64_t row = 0;
        for (std::int64_t i = 0; i < n_seq; ++i) {
          row += mb.seqs[static_cast<std::size_t>(i)].tokens;
          std::copy_n(mb.act.data() + (row - 1) * c.dim, c.dim, tmp_.data() + i * c.dim);
        }
        mb.act.resize(tmp_.size());
        cpu::rmsnorm(tmp_.data(), weights_->rms_final, mb.act.data(), n_seq, c.dim, c.norm_eps);
        mb.rows = n_seq;
        break;
      }
      case LayerKind::LMHead: {
        tmp_.resize(static_cast<std::size_t>(n_seq * c.vocab_size));
        cpu::matmul_wt(mb.act.data(), weights_->wcls, tmp_.data(), n_seq, c.dim, c.vocab_size);
        mb.act.swap(tmp_);
        mb.width = c.vocab_size;
        break;
      }
      case LayerKind::Sampler:
        mb.next_layer = l;  // sample() runs it
        return;
    }
    if (layer.kind != LayerKind::Sampler) check_layer_output(mb, range_, l, layer);
  }
  mb.next_layer = range_.last;
}

void InferenceStage::sample(Microbatch& mb) {
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
  for (std::int64_t i = 0; i < n_seq; ++i) {
    std::span<float> logits(mb.act.data() + i * c.vocab_size,
                            static_cast<std::size_t>(c.vocab_size));
    mb.sampled[static_cast<std::size_t>(i)] =
        samplers_[static_cast<std::size_t>(mb.seqs[static_cast<std::size_t>(i)].seq)].sample(
            logits);
  }
  mb.next_layer = range_.last;
}

}  // namespace v0
}  // namespace brigade::runtime
