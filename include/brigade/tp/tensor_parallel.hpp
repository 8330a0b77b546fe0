// Tensor parallelism inside a pipeline stage, as Megatron-LM does it (Shoeybi et al. 2019,
// "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism", §3):
// which slice of a Llama model each rank of a tensor-parallel (TP) group holds, the group's
// collectives behind one small interface, and the rank grid TP x PP (x DP).
//
// The split (every rank of a stage's TP group of t ranks holds):
// - attention: n_heads / t query heads (the rows of Wq for them: column-parallel), their KV heads
//   (n_kv_heads / t, or the one KV head they read when t > n_kv_heads: replicated, as Megatron
//   and vLLM do), the rows of Wk and Wv for those, and the columns of Wo for its query heads
//   (row-parallel): its attention output times its Wo slice is a partial sum of the layer's
//   output, all-reduced over the group;
// - MLP: hidden_dim / t rows of W1 and W3 (column-parallel), the same columns of W2
//   (row-parallel), one all-reduce after W2;
// - embedding and LM head: vocabulary-parallel (Megatron's VocabParallelEmbedding and its
//   column-parallel output layer): vocab / t rows of each. The embedding looks up the ids of its
//   shard (zero rows for the others) and all-reduces (each row has exactly one non-zero
//   contribution, so the sum is exact); the LM head computes its shard of the logits and
//   all-gathers them, so every rank samples the same token from the same logits. Chosen over a
//   replicated table because it divides the largest tensors of a model (128K x 8K x 2 for
//   Llama-3.1 70B) by t, which is what makes a stage fit, at the cost of one all-reduce of the
//   prompt's rows and one all-gather of the logits per step;
// - RMSNorm gains: replicated; the residual stream: replicated (every rank holds all of it after
//   each all-reduce), so the pipeline hands the same activations to every rank of the next stage.
// - KV cache: each rank holds its KV heads only.
#pragma once

#include "brigade/backend/decoder.hpp"
#include "brigade/core/error.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/weight_matrix.hpp"
#include "brigade/model/weights.hpp"
#include "brigade/plan/tp_planner.hpp"
#include "brigade/transport/collectives.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace brigade::tp {
inline namespace v0 {

/// Checks that a TP degree can split `config` (before anything runs): `tp` >= 1; n_heads a
/// multiple of tp; n_kv_heads a multiple of tp or tp a multiple of n_kv_heads
/// (plan::check_grid's rules, the planner's); hidden_dim and vocab_size multiples of tp (each rank
/// holds equal slices of the MLP and of the vocabulary).
/// @throws brigade::Error{InvalidArgument} naming the degree and what it does not divide, e.g.
///         "TP 3: the model's 8 attention heads are not divisible by the TP degree"
inline void check_tensor_parallel(const model::LlamaConfig& config, int tp) {
  BRIGADE_CHECK(tp >= 1, Errc::InvalidArgument, "TP {}: the TP degree must be >= 1", tp);
  plan::check_grid(config, plan::TpPpGrid{tp, 1}, tp);
  BRIGADE_CHECK(config.hidden_dim % tp == 0, Errc::InvalidArgument,
                "TP {}: the model's hidden_dim {} is not divisible by the TP degree", tp,
                config.hidden_dim);
  BRIGADE_CHECK(config.vocab_size % tp == 0, Errc::InvalidArgument,
                "TP {}: the model's vocab_size {} is not divisible by the TP degree", tp,
                config.vocab_size);
}

/// Checks that a TP degree can split `config` for training: check_tensor_parallel's rules, and
/// n_kv_heads a multiple of tp (every rank holds its own KV heads). Inference replicates a KV
/// head on tp / n_kv_heads ranks when tp > n_kv_heads; training refuses it, as Megatron-LM does
/// (its attention asserts num_query_groups % tensor_model_parallel_size == 0): the gradient of a
/// replicated Wk or Wv slice would be the sum over the ranks that share it.
/// @throws brigade::Error{InvalidArgument} as check_tensor_parallel, or "TP 4: training needs the
///         model's 2 KV heads divisible by the TP degree (a KV head replicated over TP ranks is
///         for inference only)"
inline void check_tensor_parallel_training(const model::LlamaConfig& config, int tp) {
  check_tensor_parallel(config, tp);
  BRIGADE_CHECK(config.n_kv_heads % tp == 0, Errc::InvalidArgument,
                "TP {}: training needs the model's {} KV heads divisible by the TP degree (a KV "
                "head replicated over TP ranks is for inference only)",
                tp, config.n_kv_heads);
}

/// A rank grid of DP x PP x TP ranks, TP the fastest-varying (Megatron-LM's order: the ranks of
/// a TP group are neighbours, on the fastest links): rank = (d x pp + p) x tp + t.
struct Grid {
  int tp = 1;  ///< tensor-parallel degree t (ranks per stage), >= 1
  int pp = 1;  ///< pipeline stages p, >= 1
  int dp = 1;  ///< data-parallel replicas d of the whole pipeline, >= 1
  /// tp x pp x dp.
  [[nodiscard]] int ranks() const noexcept { return tp * pp * dp; }
  /// The global rank of (replica d, stage p, TP rank t).
  [[nodiscard]] int rank_of(int d, int p, int t) const noexcept { return (d * pp + p) * tp + t; }
  /// TP rank of global rank r.
  [[nodiscard]] int tp_rank(int r) const noexcept { return r % tp; }
  /// Pipeline stage of global rank r.
  [[nodiscard]] int pp_rank(int r) const noexcept { return (r / tp) % pp; }
  /// Data-parallel replica of global rank r.
  [[nodiscard]] int dp_rank(int r) const noexcept { return r / (tp * pp); }
  /// "TP 2 x PP 2" (and " x DP d" when d > 1).
  [[nodiscard]] std::string describe() const {
    return "TP " + std::to_string(tp) + " x PP " + std::to_string(pp) +
           (dp > 1 ? " x DP " + std::to_string(dp) : std::string());
  }
};

/// Checks that `grid` covers exactly `world` ranks (processes under mpirun).
/// @throws brigade::Error{InvalidArgument} "grid TP 2 x PP 2 = 4 ranks does not match the 3
///         processes" for a grid whose product differs, or a degree < 1
inline void check_grid_ranks(const Grid& grid, int world, std::string_view what = "processes") {
  BRIGADE_CHECK(grid.tp >= 1 && grid.pp >= 1 && grid.dp >= 1, Errc::InvalidArgument,
                "grid {}: every degree must be >= 1", grid.describe());
  BRIGADE_CHECK(grid.ranks() == world, Errc::InvalidArgument,
                "grid {} = {} ranks does not match the {} {}", grid.describe(), grid.ranks(),
                world, what);
}

/// The slice of a model one rank of a TP group of `size` holds (the split at the top of this
/// file). Counts are this rank's; the *0 fields are the first global index of its slice.
struct Shard {
  int rank = 0;             ///< this rank's index in its TP group, [0, size)
  int size = 1;             ///< the TP degree t
  int head0 = 0;            ///< first query head
  int n_heads = 0;          ///< query heads: n_heads / t
  int kv_head0 = 0;         ///< first KV head
  int n_kv_heads = 0;       ///< KV heads: max(1, n_kv_heads / t)
  std::int64_t hidden0 = 0; ///< first MLP row (of W1, W3; column of W2)
  std::int64_t hidden = 0;  ///< MLP rows: hidden_dim / t
  std::int64_t vocab0 = 0;  ///< first vocabulary row (of the embedding and the LM head)
  std::int64_t vocab = 0;   ///< vocabulary rows: vocab_size / t
};

/// Rank `rank`'s shard of `config` in a TP group of `size` (check_tensor_parallel's rules).
/// Query heads [rank q, (rank + 1) q) with q = n_heads / size; they read KV heads
/// [h / g for h in them], g = n_heads / n_kv_heads (contiguous, since q is a multiple of g or
/// g of q).
/// @throws brigade::Error{InvalidArgument} as check_tensor_parallel, or rank outside [0, size)
inline Shard shard_of(const model::LlamaConfig& config, int rank, int size) {
  check_tensor_parallel(config, size);
  BRIGADE_CHECK(rank >= 0 && rank < size, Errc::InvalidArgument,
                "TP rank {} outside [0, {})", rank, size);
  Shard s;
  s.rank = rank;
  s.size = size;
  s.n_heads = config.n_heads / size;
  s.head0 = rank * s.n_heads;
  const int group = config.n_heads / config.n_kv_heads;  // query heads per KV head
  s.n_kv_heads = std::max(1, config.n_kv_heads / size);
  s.kv_head0 = s.head0 / group;
  s.hidden = config.hidden_dim / size;
  s.hidden0 = rank * s.hidden;
  s.vocab = config.vocab_size / size;
  s.vocab0 = rank * s.vocab;
  return s;
}

/// The collectives of one TP group as a stage uses them (type erasure at the edge: a stage holds
/// any transport::Collectives model through this, one virtual call per collective). The spans
/// are float32 in host memory.
class Group {
 public:
  virtual ~Group() = default;
  /// This member's index in the group, [0, size()).
  [[nodiscard]] virtual int rank() const noexcept = 0;
  /// Members: the TP degree.
  [[nodiscard]] virtual int size() const noexcept = 0;
  /// In place, every member's `data` becomes the elementwise sum over the members.
  /// @throws brigade::Error{PeerTimeout} when a member does not join in time; the model's errors
  virtual void all_reduce(std::span<float> data) = 0;
  /// As the float overload, on doubles (a training step's token counts, losses and norms).
  virtual void all_reduce(std::span<double> data) = 0;
  /// In place, every member's `data` becomes the elementwise maximum over the members (the
  /// vocabulary-parallel cross-entropy's row maxima).
  /// @throws as all_reduce
  virtual void all_reduce_max(std::span<float> data) = 0;
  /// `all` (size() x mine.size()) receives member r's `mine` at [r mine.size(), (r + 1)
  /// mine.size()).
  /// @throws brigade::Error{InvalidArgument} for sizes that disagree; as all_reduce
  virtual void all_gather(std::span<const float> mine, std::span<float> all) = 0;
  /// As the float overload, on doubles (partial sums every member adds up in member order, so
  /// that all of them get the same bits whatever the collective library's reduction order).
  virtual void all_gather(std::span<const double> mine, std::span<double> all) = 0;
};

/// A Group over a transport::Collectives model `C` (InProcessCollectives, MpiCollectives), each
/// collective with a deadline of `timeout_s` seconds from its call.
template <transport::Collectives C>
class GroupOver final : public Group {
 public:
  /// @param collectives the member's endpoint (must outlive this object)
  /// @param timeout_s   seconds a collective waits for the other members before PeerTimeout
  GroupOver(C& collectives, double timeout_s) : c_(&collectives), timeout_s_(timeout_s) {}
  [[nodiscard]] int rank() const noexcept override { return c_->rank(); }
  [[nodiscard]] int size() const noexcept override { return c_->size(); }
  void all_reduce(std::span<float> data) override {
    c_->all_reduce(data, transport::ReduceOp::Sum, transport::Deadline::after(timeout_s_));
  }
  void all_reduce(std::span<double> data) override {
    c_->all_reduce(data, transport::ReduceOp::Sum, transport::Deadline::after(timeout_s_));
  }
  void all_reduce_max(std::span<float> data) override {
    c_->all_reduce(data, transport::ReduceOp::Max, transport::Deadline::after(timeout_s_));
  }
  void all_gather(std::span<const float> mine, std::span<float> all) override {
    c_->all_gather(mine, all, transport::Deadline::after(timeout_s_));
  }
  void all_gather(std::span<const double> mine, std::span<double> all) override {
    c_->all_gather(mine, all, transport::Deadline::after(timeout_s_));
  }

 private:
  C* c_;
  double timeout_s_;
};

/// The decoder layer's split of shard `s` over `group` (backend::decoder_layer_forward and the
/// training kernels take it): its query heads, KV heads and MLP rows, the residual added on rank
/// 0, and the group's all-reduce (host float32 buffers). The group must outlive the split.
inline backend::DecoderSplit decoder_split(const Shard& s, Group& group) {
  backend::DecoderSplit d;
  d.n_heads = s.n_heads;
  d.n_kv_heads = s.n_kv_heads;
  d.hidden = s.hidden;
  d.adds_residual = s.rank == 0;
  d.all_reduce = [g = &group](float* data, std::int64_t n) {
    g->all_reduce(std::span<float>(data, static_cast<std::size_t>(n)));
  };
  return d;
}

/// The LM head's vocabulary split of shard `s` over `group` for training (its rows, the group's
/// sum and max all-reduces). The group must outlive the split.
inline backend::VocabSplit vocab_split(const Shard& s, Group& group) {
  backend::VocabSplit v;
  v.vocab0 = s.vocab0;
  v.vocab = s.vocab;
  v.all_reduce = [g = &group](float* data, std::int64_t n) {
    g->all_reduce(std::span<float>(data, static_cast<std::size_t>(n)));
  };
  v.all_reduce_max = [g = &group](float* data, std::int64_t n) {
    g->all_reduce_max(std::span<float>(data, static_cast<std::size_t>(n)));
  };
  return v;
}

/// The tokens of `ids` whose rows a vocabulary-parallel shard holds (Megatron's
/// VocabParallelEmbedding): `local` receives each such id minus s.vocab0 (in [0, s.vocab)),
/// `rows` its index in `ids`, in order. The embedding's forward looks up `local` and writes
/// rows `rows` (zeros elsewhere) before the group's all-reduce; its backward scatters the same
/// rows' gradients into the shard.
inline void ids_in_shard(std::span<const std::int32_t> ids, const Shard& s,
                         std::vector<std::int32_t>& local, std::vector<std::int64_t>& rows) {
  local.clear();
  rows.clear();
  for (std::size_t t = 0; t < ids.size(); ++t) {
    const std::int64_t id = ids[t] - s.vocab0;
    if (id < 0 || id >= s.vocab) continue;
    local.push_back(static_cast<std::int32_t>(id));
    rows.push_back(static_cast<std::int64_t>(t));
  }
}

/// A decoder layer's weights sliced for one TP rank: the row slices (Wq, Wk, Wv, W1, W3) are
/// views into the model's tensors (no copy: mapped weights stay mapped); the column slices (Wo's
/// columns of this rank's query heads, W2's of its MLP rows) are copied into `storage`, in the
/// matrix's dtype, row by row.
/// @param storage receives the copies (bytes; the returned views point into its buffer: keep it
///        alive and do not resize it afterwards; moving the vector keeps the buffer)
/// @throws brigade::Error{InvalidArgument} for a Q8_0 matrix whose column slice does not start
///         and end on a 32-element block (model::weight_row_bytes names it)
inline model::DecoderWeights shard_decoder(const model::DecoderWeights& w,
                                           const model::LlamaConfig& config, const Shard& s,
                                           std::vector<std::byte>& storage) {
  const std::int64_t dim = config.dim, hs = config.head_size(), hid = config.hidden_dim;
  const auto rows = [&](model::WeightMatrix m, std::int64_t row0) {
    return model::WeightMatrix(model::weight_row(m, dim, row0), m.dtype);
  };
  // Columns [c0, c0 + n) of every one of the `out` rows of m ([out x in]), appended to storage.
  std::vector<std::size_t> offsets;
  const auto columns = [&](model::WeightMatrix m, std::int64_t out, std::int64_t in,
                           std::int64_t c0, std::int64_t n) {
    const std::size_t skip = model::weight_row_bytes(m.dtype, c0);
    const std::size_t take = model::weight_row_bytes(m.dtype, n);
    const std::size_t at = storage.size();
    storage.resize(at + static_cast<std::size_t>(out) * take);
    for (std::int64_t r = 0; r < out; ++r)
      std::memcpy(storage.data() + at + static_cast<std::size_t>(r) * take,
                  model::weight_row(m, in, r) + skip, take);
    offsets.push_back(at);
  };
  model::DecoderWeights d = w;
  d.wq = rows(w.wq, s.head0 * hs);
  d.wk = rows(w.wk, s.kv_head0 * hs);
  d.wv = rows(w.wv, s.kv_head0 * hs);
  d.w1 = rows(w.w1, s.hidden0);
  d.w3 = rows(w.w3, s.hidden0);
  // Both slices are appended before a view is taken (no reallocation moves them afterwards).
  columns(w.wo, dim, dim, s.head0 * hs, s.n_heads * hs);
  columns(w.w2, dim, hid, s.hidden0, s.hidden);
  d.wo = model::WeightMatrix(storage.data() + offsets[0], w.wo.dtype);
  d.w2 = model::WeightMatrix(storage.data() + offsets[1], w.w2.dtype);
  return d;
}

/// Bytes one TP rank holds of a ModelSpec layer whose whole weights take `full` bytes: a decoder
/// layer (full - norms) / t + norms (its two float32 gains of dim replicated), the embedding and
/// LM head full / t, the final norm full. The per-layer figures cost::inference_memory reads
/// (model::layer_weight_bytes of the loaded model) turned into one TP rank's.
/// @param kind the layer's kind
inline double shard_layer_bytes(const model::LlamaConfig& config, model::LayerKind kind,
                                double full, int tp) {
  switch (kind) {
    case model::LayerKind::Decoder: {
      const double norms = 2.0 * config.dim * sizeof(float);
      return (full - norms) / tp + norms;
    }
    case model::LayerKind::Embedding:
    case model::LayerKind::LMHead:
      return full / tp;
    default:
      return full;
  }
}

}  // namespace v0
}  // namespace brigade::tp
