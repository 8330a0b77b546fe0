// Pipelined generation on the executor: stage 0's sequence book, the generation layout every
// rank shares, the InferenceWorker, and generate() over in-process threads.
#include "brigade/engine/inference.hpp"

#include "brigade/backend/cpu.hpp"
#include "brigade/engine/threads.hpp"
#include "brigade/transport/collectives.hpp"
#include "brigade/transport/in_process.hpp"
#include "mapped_file.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace brigade::engine {
inline namespace v0 {
namespace detail {

SequenceBook::SequenceBook(std::span<const GenerationRequest> requests, int seq_len, int groups) {
  const int n = static_cast<int>(requests.size());
  members_.resize(static_cast<std::size_t>(groups));
  for (int i = 0; i < n; ++i) {
    const auto& r = requests[static_cast<std::size_t>(i)];
    BRIGADE_CHECK(!r.prompt.empty(), Errc::InvalidArgument,
                  "generate: request {} has an empty prompt; it must start with BOS", i);
    members_[static_cast<std::size_t>(group_of(i, n, groups))].push_back(i);
    steps_.push_back(effective_steps(r, seq_len));
    SequenceResult res;
    res.tokens = r.prompt;
    res.prompt_tokens = static_cast<int>(r.prompt.size());
    results_.push_back(std::move(res));
  }
}

runtime::Microbatch SequenceBook::prefill(int g) {
  runtime::Microbatch mb;
  mb.id = g;
  for (int seq : members_[static_cast<std::size_t>(g)]) {
    auto& res = results_[static_cast<std::size_t>(seq)];
    const int steps = steps_[static_cast<std::size_t>(seq)];
    if (steps < res.prompt_tokens) {
      // run.c feeds only the first `steps` positions and samples nothing.
      res.tokens.resize(static_cast<std::size_t>(steps) + 1);
      continue;
    }
    mb.seqs.push_back({seq, 0, res.prompt_tokens});
    mb.token_ids.insert(mb.token_ids.end(), res.tokens.begin(), res.tokens.end());
  }
  return mb;
}

runtime::Microbatch SequenceBook::advance(int id, std::span<const backend::SequenceSlice> seqs,
                                          std::span<const std::int32_t> sampled, double now_s) {
  BRIGADE_CHECK(sampled.size() == seqs.size(), Errc::Internal,
                "generate: {} sampled tokens for micro-batch {} of {} sequences", sampled.size(),
                id, seqs.size());
  runtime::Microbatch next;
  next.id = id;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const auto& e = seqs[i];
    auto& res = results_[static_cast<std::size_t>(e.seq)];
    const int token = sampled[i];
    if (++res.generated == 1) res.ttft_s = now_s;
    res.done_s = now_s;
    const int fed = e.pos0 + e.tokens;  // positions run so far
    if (token == model::Tokenizer::kBos) {
      res.stopped_on_bos = true;
      continue;
    }
    res.tokens.push_back(token);
    if (fed >= steps_[static_cast<std::size_t>(e.seq)]) continue;
    next.seqs.push_back({e.seq, fed, 1});
    next.token_ids.push_back(token);
  }
  return next;
}

GenerationLayout make_layout(std::span<const GenerationRequest> requests,
                             const model::LlamaConfig& config, int groups) {
  const int seq_len = config.seq_len;
  GenerationLayout l;
  l.groups = groups;
  l.width = std::max(config.dim, config.vocab_size);
  l.prefill.resize(static_cast<std::size_t>(groups));
  l.max_rows.assign(static_cast<std::size_t>(groups), 0);
  const int n = static_cast<int>(requests.size());
  for (int i = 0; i < n; ++i) {
    const auto& r = requests[static_cast<std::size_t>(i)];
    BRIGADE_CHECK(!r.prompt.empty(), Errc::InvalidArgument,
                  "generate: request {} has an empty prompt; it must start with BOS", i);
    const int steps = effective_steps(r, seq_len);
    const int p = static_cast<int>(r.prompt.size());
    l.capacities.push_back(steps);
    if (steps < p) continue;  // fed up to `steps` only, nothing sampled: no forward at all
    const auto g = static_cast<std::size_t>(group_of(i, n, groups));
    l.prefill[g].push_back({i, 0, p});
    l.max_rows[g] += p;
    // Prefill, steps - p decode rounds, then the closing round.
    l.max_rounds = std::max(l.max_rounds, 2 + steps - p);
  }
  for (auto& r : l.max_rows) r = std::max<std::int64_t>(r, 1);
  return l;
}

schedule::Shape inference_shape(const partition::Partition& partition,
                                const GenerationLayout& layout) {
  schedule::Shape s;
  s.num_ranks = partition.num_ranks();
  s.num_virtual_stages = partition.num_stages();
  s.num_microbatches = layout.groups;
  s.num_chunks = layout.max_rounds;
  s.mode = schedule::Mode::Inference;
  for (const auto& st : partition.stages()) s.placement.push_back(st.rank);
  s.check();
  return s;
}

std::vector<model::WorkItem> prefill_work(const GenerationLayout& layout) {
  std::vector<model::WorkItem> out;
  for (const auto& group : layout.prefill) {
    model::WorkItem w{0, 0, 0.0};
    double context = 0.0;  // sum over the group's prompt tokens of the positions they attend to
    for (const auto& e : group) {
      w.tokens += e.tokens;
      ++w.sequences;
      context += static_cast<double>(e.tokens) * (e.tokens + 1) / 2.0;
    }
    if (w.sequences == 0) w = {1, 1, 1.0};  // a group with nothing to run (prompt >= steps)
    else w.context = context / static_cast<double>(w.tokens);
    out.push_back(w);
  }
  return out;
}

}  // namespace detail

plan::Plan inference_plan(const model::LlamaConfig& config, const partition::Partition& partition,
                          std::span<const GenerationRequest> requests, int microbatches,
                          std::span<const cost::DeviceProfile> devices) {
  const model::ModelSpec spec(config);
  BRIGADE_CHECK(partition.num_layers() == spec.num_layers(), Errc::InvalidArgument,
                "inference_plan: the partition covers {} layers, the model has {}",
                partition.num_layers(), spec.num_layers());
  BRIGADE_CHECK(!requests.empty(), Errc::InvalidArgument, "inference_plan: no requests");
  BRIGADE_CHECK(microbatches >= 0, Errc::InvalidArgument,
                "inference_plan: microbatches = {}, expected >= 0 (0 = automatic)", microbatches);
  const int groups = detail::group_count(static_cast<int>(requests.size()),
                                         partition.num_ranks(), microbatches);
  const auto layout = detail::make_layout(requests, config, groups);
  schedule::Schedule lowered{detail::inference_shape(partition, layout), {}};
  const auto& sh = lowered.shape;
  lowered.ranks.resize(static_cast<std::size_t>(sh.num_ranks));
  const std::vector<char> live(static_cast<std::size_t>(groups), 1);
  for (int r = 0; r < sh.num_ranks; ++r)
    for (int c = 0; c < sh.num_chunks; ++c)
      schedule::append_inference_round(sh, r, c, live, lowered.ranks[static_cast<std::size_t>(r)]);
  plan::Plan plan(partition, lowered, detail::prefill_work(layout));
  if (!devices.empty()) {
    for (const auto& d : devices) cost::check_holds_weights(d, cost::model_weight_bytes(spec));
    cost::check_capacity(inference_memory(config, plan, requests), devices, "inference_plan");
  }
  return plan;
}

std::vector<cost::MemoryBreakdown> inference_memory(const model::LlamaConfig& config,
                                                    const plan::Plan& plan,
                                                    std::span<const GenerationRequest> requests,
                                                    std::vector<double> layer_weight_bytes) {
  const auto layout = detail::make_layout(requests, config, plan.shape().num_microbatches);
  cost::InferenceMemoryOptions mo;
  mo.layer_weight_bytes = std::move(layer_weight_bytes);
  mo.kv_positions = layout.capacities;
  return cost::inference_memory(model::ModelSpec(config), plan, mo);
}

detail::GenerationLayout check_inference_plan(const plan::Plan& plan,
                                              const model::LlamaConfig& config,
                                              std::span<const GenerationRequest> requests,
                                              const InferenceOptions& options,
                                              std::string_view who) {
  const model::ModelSpec spec(config);
  const auto& sh = plan.shape();
  BRIGADE_CHECK(sh.mode == schedule::Mode::Inference, Errc::InvalidArgument,
                "{}: the plan is a {} plan, expected an inference plan", who,
                schedule::to_string(sh.mode));
  BRIGADE_CHECK(plan.partition().num_layers() == spec.num_layers(), Errc::InvalidArgument,
                "{}: the partition covers {} layers, the model has {}", who,
                plan.partition().num_layers(), spec.num_layers());
  BRIGADE_CHECK(!requests.empty(), Errc::InvalidArgument, "{}: no requests", who);
  BRIGADE_CHECK(options.blas_threads >= 1, Errc::InvalidArgument,
                "{}: blas_threads = {}, expected >= 1", who, options.blas_threads);
  const int n = static_cast<int>(requests.size());
  BRIGADE_CHECK(sh.num_microbatches <= n &&
                    (options.microbatches == 0 ||
                     std::min(options.microbatches, n) == sh.num_microbatches),
                Errc::InvalidArgument,
                "{}: the plan has {} micro-batches for {} requests with microbatches = {} (expected "
                "at most one per request, and microbatches 0 or the plan's)",
                who, sh.num_microbatches, n, options.microbatches);
  auto layout = detail::make_layout(requests, config, sh.num_microbatches);
  const auto work = detail::prefill_work(layout);
  const auto planned = plan.work();
  bool same = sh.num_chunks == layout.max_rounds && planned.size() == work.size();
  for (std::size_t m = 0; same && m < work.size(); ++m)
    same = planned[m].tokens == work[m].tokens && planned[m].sequences == work[m].sequences;
  BRIGADE_CHECK(same, Errc::InvalidArgument,
                "{}: the plan was made for other requests ({} rounds, prefill work of {} "
                "micro-batches; these requests need {} rounds); build it with "
                "engine::inference_plan for these requests",
                who, sh.num_chunks, planned.size(), layout.max_rounds);
  return layout;
}

using schedule::Action;
using schedule::Op;
using brigade::DType;
using transport::kAny;
using transport::MessageHeader;
using transport::MessageKind;

namespace {

/// madvise(advice) over the whole mapping of mapped weights (best effort: the access pattern
/// hint only).
void advise_mapping(const model::LlamaWeights& w, int advice) {
  const void* base = w.storage.get();
  const std::size_t bytes = ::brigade::detail::MappedFiles::instance().bytes(base);
  if (bytes > 0) (void)::madvise(const_cast<void*>(base), bytes, advice);
}

}  // namespace

InferenceWorker::InferenceWorker(const schedule::Shape& shape, int rank,
                                 std::span<runtime::InferenceStageBase* const> stages,
                                 const detail::GenerationLayout& layout,
                                 detail::MicrobatchSource* book,
                                 std::chrono::steady_clock::time_point t0, bool weight_offload,
                                 DType pipeline_dtype, bool background_prefetch,
                                 std::size_t migration_part_bytes)
    : shape_(&shape), rank_(rank), stages_(stages), layout_(&layout), book_(book), t0_(t0),
      weight_offload_(weight_offload), pipeline_dtype_(pipeline_dtype),
      part_bytes_(migration_part_bytes) {
  BRIGADE_CHECK(is_float_dtype(pipeline_dtype), Errc::InvalidArgument,
                "InferenceWorker: pipeline dtype {}; expected f32, f16 or bf16",
                to_string(pipeline_dtype));
  const auto M = static_cast<std::size_t>(shape.num_microbatches);
  BRIGADE_CHECK(shape.rank_of(0) != rank || book != nullptr, Errc::InvalidArgument,
                "InferenceWorker: rank {} holds virtual stage 0 but has no SequenceBook", rank);
  live_.assign(M, 1);
  closed_.assign(M, 0);
  known_.assign(M, 0);
  idle_.assign(M, 0);
  prev_.resize(M);
  cur_.resize(M);
  slot_.resize(M);
  tokens_.resize(M);
  // With offload every window is PREFETCHed before its first compute (add_weight_offload), and
  // nothing is held before: the offload starts by dropping every page.
  released_.assign(static_cast<std::size_t>(shape.num_virtual_stages), weight_offload ? 1 : 0);
  seconds_.resize(M);
  bool mapped = false;
  for (const auto* s : stages_) {
    if (s == nullptr) continue;
    mapped = mapped || s->mapped();
    peak_resident_ += static_cast<double>(s->weight_bytes());
  }
  offload_mapped_ = weight_offload && mapped;
  if (offload_mapped_) {
    peak_resident_ = 0;
    // What loading touched goes: this rank then holds only the windows it loads.
    for (const auto* s : stages_)
      if (s != nullptr) {
        runtime::release_model_pages(s->weights());
        break;
      }
  }
  if (offload_mapped_ && background_prefetch) {
    prefetcher_ = std::make_unique<runtime::WeightPrefetcher>();
    // The prefetcher loads exactly the next window: the kernel's read-around on page faults
    // (read_ahead_kb, often megabytes) would pull in other windows' pages as well.
    for (const auto* s : stages_)
      if (s != nullptr) {
        advise_mapping(s->weights(), MADV_RANDOM);
        break;
      }
  }
}

InferenceWorker::~InferenceWorker() {
  if (!prefetcher_) return;
  prefetcher_.reset();  // no load in flight past this point
  for (const auto* s : stages_)
    if (s != nullptr) {
      advise_mapping(s->weights(), MADV_NORMAL);
      break;
    }
}

double InferenceWorker::peak_resident_weight_bytes() const { return peak_resident_; }

runtime::InferenceStageBase& InferenceWorker::stage(int v) const {
  auto* s = v >= 0 && v < static_cast<int>(stages_.size()) ? stages_[static_cast<std::size_t>(v)]
                                                             : nullptr;
  BRIGADE_CHECK(s != nullptr, Errc::InvalidArgument,
                "executor: rank {} has no inference stage for virtual stage {}", rank_, v);
  return *s;
}

bool InferenceWorker::fill(std::vector<Action>& out) {
  bool any = false;
  const std::vector<char> was_live = live_;
  for (std::size_t m = 0; m < live_.size(); ++m) {
    if (closed_[m]) live_[m] = 0;
    closed_[m] = 0;
    if (round_ >= 0) prev_[m].swap(cur_[m]);
    cur_[m].clear();
    known_[m] = 0;
    idle_[m] = 0;
    any = any || live_[m];
  }
  ++round_;
  const bool receiving = mig_ && mig_->receiving && round_ > mig_->first && round_ <= mig_->last + 1;
  if ((!any && !receiving) || round_ >= shape_->num_chunks) return false;
  const std::size_t begin = out.size();
  if (any) schedule::append_inference_round(*shape_, rank_, round_, live_, out);
  if (weight_offload_) schedule::add_weight_offload(out, begin);
  migration_actions(out, begin, was_live);
  return true;
}

void InferenceWorker::migration_actions(std::vector<Action>& out, std::size_t begin,
                                        const std::vector<char>& was_live) {
  const int r = round_;
  // The migration of this rank ends: the owner drops the layer once its last part is out; the
  // neighbour has received its last parts in the round before.
  if (mig_ && mig_->sending && r == mig_->last + 1) {
    stage(mig_->order.from).drop(mig_->layer);
    mig_->sending = false;
  }
  if (mig_ && mig_->receiving && r == mig_->last + 2) {
    // Every micro-batch live in the last round sent its last part, so only a run whose
    // micro-batches all closed during the move ends without adopting the layer.
    BRIGADE_CHECK(mig_->adopted || std::none_of(live_.begin(), live_.end(), [](char l) { return l != 0; }),
                  Errc::Internal,
                  "rank {}: the migration of layer {} ended without its last part", rank_,
                  mig_->layer);
    mig_->receiving = false;
  }
  if (mig_ && !mig_->sending && !mig_->receiving) mig_.reset();
  // A move ordered in the round before starts now on the ranks of its two stages.
  if (ordered_ && ordered_->first == r - 1) {
    const auto o = ordered_->second;
    const bool from = shape_->rank_of(o.from) == rank_, to = shape_->rank_of(o.to) == rank_;
    if (from || to) {
      BRIGADE_CHECK(!mig_, Errc::InvalidArgument,
                    "rank {}: a layer move {} -> {} ordered in round {} while another one is "
                    "under way",
                    rank_, o.from, o.to, r - 1);
      Migration m;
      m.order = o;
      m.first = r;
      m.last = r + o.parts - 1;
      m.sending = from;
      m.receiving = to;
      // The layer at `from`'s end facing `to`, as both sides know it now.
      if (from) {
        const auto& rg = stage(o.from).range();
        m.layer = o.to > o.from ? rg.last - 1 : rg.first;
      } else {
        const auto& rg = stage(o.to).range();
        m.layer = o.to > o.from ? rg.first - 1 : rg.last;
      }
      auto& st = stage(from ? o.from : o.to);
      m.weight_bytes = st.migration_weight_bytes(m.layer);
      m.row_bytes = st.kv_position_bytes();
      if (to) stage(o.to).begin_adopt(m.layer);
      if (from) {  // the owner keeps at least one layer
        const auto& rg = stage(o.from).range();
        BRIGADE_CHECK(rg.last - rg.first >= 2, Errc::InvalidArgument,
                      "rank {}: virtual stage {} holds only layer {}; it cannot hand it to {}",
                      rank_, o.from, rg.first, o.to);
      }
      mig_ = std::move(m);
    }
  }
  if (book_ != nullptr)  // the rank of virtual stage 0 orders the moves
    if (auto o = book_->rebalance(r)) {
      BRIGADE_CHECK(o->parts >= 1 && std::abs(o->to - o->from) == 1 && o->from >= 0 &&
                        o->to >= 0 && o->from < shape_->num_virtual_stages &&
                        o->to < shape_->num_virtual_stages,
                    Errc::InvalidArgument,
                    "rank {}: a layer move {} -> {} in {} parts: expected neighbouring virtual "
                    "stages and parts >= 1",
                    rank_, o->from, o->to, o->parts);
      ordered_ = std::pair{r, *o};
    }
  if (!mig_) return;
  const auto M = static_cast<int>(live_.size());
  if (mig_->sending && r >= mig_->first && r <= mig_->last) {
    // MIGRATE(from, m, r) right after the last action of (from, m, r).
    const int v = mig_->order.from;
    for (int m = M - 1; m >= 0; --m) {
      if (!live_[static_cast<std::size_t>(m)]) continue;
      std::size_t at = out.size();
      for (std::size_t i = out.size(); i-- > begin;)
        if (out[i].virtual_stage == v && out[i].microbatch == m && out[i].chunk == r) {
          at = i + 1;
          break;
        }
      out.insert(out.begin() + static_cast<std::ptrdiff_t>(at), Action{Op::Migrate, v, m, r});
    }
  }
  if (mig_->receiving && r > mig_->first && r <= mig_->last + 1) {
    // MIGRATE_RECV(to, m, r - 1) right before F(to, m, r), or first for a closed micro-batch.
    // The parts of one round are received in micro-batch order (the order they are sent on
    // the migration channel): a closed micro-batch's part goes right before the next one's.
    const int v = mig_->order.to;
    std::size_t next = out.size();
    for (int m = M - 1; m >= 0; --m) {
      if (!was_live[static_cast<std::size_t>(m)]) continue;
      const Action recv{Op::MigrateRecv, v, m, r - 1};
      const auto f = std::find(out.begin() + static_cast<std::ptrdiff_t>(begin), out.end(),
                               Action{Op::F, v, m, r});
      const std::size_t at = live_[static_cast<std::size_t>(m)] && f != out.end()
                                 ? static_cast<std::size_t>(f - out.begin())
                                 : next;
      out.insert(out.begin() + static_cast<std::ptrdiff_t>(at), recv);
      next = at;
    }
  }
}

int InferenceWorker::migration_peer(const Action& a) const {
  BRIGADE_CHECK(mig_.has_value(), Errc::InvalidArgument,
                "executor: rank {}: {} without a layer move under way", rank_,
                schedule::to_string(a));
  return shape_->rank_of(a.op == Op::Migrate ? mig_->order.to : mig_->order.from);
}

InferenceWorker::Part InferenceWorker::plan_part(int c,
                                                 std::span<const backend::SequenceSlice> seqs,
                                                 const runtime::InferenceStageBase& st) {
  auto& g = *mig_;
  Part p;
  p.last = c == g.last;
  const std::size_t left = g.weight_bytes - g.weight_sent;
  const std::size_t w = p.last ? left : std::min(left, part_bytes_);
  p.w0 = g.weight_sent;
  p.w1 = g.weight_sent + w;
  g.weight_sent += w;
  std::int64_t rows_left =
      p.last ? std::numeric_limits<std::int64_t>::max()
             : static_cast<std::int64_t>((part_bytes_ - w) / std::max<std::size_t>(g.row_bytes, 1));
  std::int64_t rows = 0;
  for (const auto& q : seqs) {
    const auto id = static_cast<std::size_t>(q.seq);
    if (id >= g.sent.size()) g.sent.resize(id + 1, 0);
    if (q.pos0 == 0) g.sent[id] = 0;  // a new sequence (a pool row may have been reused)
    const std::int64_t unsent = q.pos0 + q.tokens - g.sent[id];
    const std::int64_t take = std::min(unsent, rows_left);
    if (take <= 0) continue;
    p.segments.emplace_back(st.kv_first_row(q.seq) + g.sent[id], take);
    g.sent[id] += static_cast<std::int32_t>(take);
    rows_left -= take;
    rows += take;
  }
  p.bytes = w + static_cast<std::size_t>(rows) * g.row_bytes;
  return p;
}

void InferenceWorker::check_sequences(int m, std::span<const backend::SequenceSlice> seen, int peer) {
  const auto um = static_cast<std::size_t>(m);
  auto fail = [&](const backend::SequenceSlice* expected, const backend::SequenceSlice* got) {
    const std::string exp =
        expected ? fmt::format("sequence {} at position {}", expected->seq, expected->pos0)
                 : std::string("no further sequence");
    const std::string saw =
        got ? fmt::format("sequence {} at position {}", got->seq, got->pos0)
            : std::string("no further sequence");
    ::brigade::detail::fail(Errc::HeaderMismatch,
                            "rank {}: micro-batch {} round {} ({}): expected {}, the message from "
                            "rank {} holds {}",
                            rank_, m, round_, round_ == 0 ? "prefill" : "decode", exp, peer, saw);
  };
  if (known_[um]) {
    // An earlier virtual stage of this rank saw this round already: the same sequences.
    const auto& want = cur_[um];
    for (std::size_t i = 0; i < std::max(want.size(), seen.size()); ++i) {
      const auto* w = i < want.size() ? &want[i] : nullptr;
      const auto* g = i < seen.size() ? &seen[i] : nullptr;
      if (!w || !g || w->seq != g->seq || w->pos0 != g->pos0 || w->tokens != g->tokens) fail(w, g);
    }
    return;
  }
  if (layout_->dynamic) {
    // Serving: a sequence at position 0 is new (its first prompt chunk); any other continues
    // where its last round left it. Sequences leave (finished) or skip rounds freely.
    for (const auto& g : seen) {
      const auto id = static_cast<std::size_t>(g.seq);
      const std::int32_t expect = g.seq >= 0 && id < next_pos_.size() ? next_pos_[id] : -1;
      if (g.seq < 0 || g.tokens < 1 || (g.pos0 != 0 && g.pos0 != expect)) {
        const backend::SequenceSlice want{g.seq, expect < 0 ? 0 : expect, g.tokens};
        fail(&want, &g);
      }
      if (id >= next_pos_.size()) next_pos_.resize(id + 1, -1);
      next_pos_[id] = g.pos0 + g.tokens;
    }
  } else if (round_ == 0) {
    const auto& want = layout_->prefill[um];
    for (std::size_t i = 0; i < std::max(want.size(), seen.size()); ++i) {
      const auto* w = i < want.size() ? &want[i] : nullptr;
      const auto* g = i < seen.size() ? &seen[i] : nullptr;
      if (!w || !g || w->seq != g->seq || w->pos0 != g->pos0 || w->tokens != g->tokens) fail(w, g);
    }
  } else {
    // A decode round: the previous round's sequences, in order, some of them finished, each one
    // position further with one new token.
    const auto& before = prev_[um];
    std::size_t j = 0;
    for (const auto& g : seen) {
      while (j < before.size() && before[j].seq != g.seq) ++j;
      if (j == before.size()) {
        // Name the first sequence that could still come.
        const backend::SequenceSlice* next = nullptr;
        backend::SequenceSlice e;
        for (const auto& b : before) {
          bool used = false;
          for (const auto& s : seen) {
            if (&s == &g) break;
            used = used || s.seq == b.seq;
          }
          if (!used) {
            e = {b.seq, b.pos0 + b.tokens, 1};
            next = &e;
            break;
          }
        }
        fail(next, &g);
      }
      const backend::SequenceSlice want{before[j].seq, before[j].pos0 + before[j].tokens, 1};
      if (g.pos0 != want.pos0 || g.tokens != 1) fail(&want, &g);
      ++j;
    }
  }
  cur_[um].assign(seen.begin(), seen.end());
  known_[um] = 1;
}

Work InferenceWorker::compute(const Action& a) {
  const auto m = static_cast<std::size_t>(a.microbatch);
  auto& mb = slot_[m];
  // A round that feeds a prompt (a sequence at position 0, or a chunk of several tokens) is a
  // prefill; one token per sequence is a decode.
  auto label = [&] {
    const bool feeds_prompt = std::any_of(mb.seqs.begin(), mb.seqs.end(), [](const auto& s) {
      return s.pos0 == 0 || s.tokens > 1;
    });
    return std::string_view((a.chunk == 0 || feeds_prompt) ? "prefill" : "decode");
  };
  const auto v = static_cast<std::size_t>(a.virtual_stage);
  if (a.op == Op::Prefetch || a.op == Op::Release) {
    auto& st = stage(a.virtual_stage);
    const bool prefetch = a.op == Op::Prefetch;
    released_[v] = prefetch ? 0 : 1;
    if (!offload_mapped_) return {true, 0, std::string_view("owned: resident")};
    if (!prefetch) {
      if (prefetcher_) prefetcher_->settle(&st);
      // The pages another window of this rank still holds stay, and those of the window it
      // runs next (cyclically: after the head's output layers, window 0 of the next position),
      // which its PREFETCH would read back at once: a tied LM head on the head reads window 0's
      // embedding table. The planner counts them once the same way
      // (partition::resident_weight_bytes). Only the sorted, merged union is kept.
      std::size_t next = v;
      for (std::size_t i = 1; i <= stages_.size(); ++i) {
        const std::size_t u = (v + i) % stages_.size();
        if (stages_[u] != nullptr) {
          next = u;
          break;
        }
      }
      keep_.clear();
      for (std::size_t u = 0; u < stages_.size(); ++u)
        if (u != v && stages_[u] != nullptr && (!released_[u] || u == next))
          keep_.insert(keep_.end(), stages_[u]->weight_pages().begin(), stages_[u]->weight_pages().end());
      std::sort(keep_.begin(), keep_.end());
      std::size_t n = 0;
      for (const auto& r : keep_) {
        if (n > 0 && r.first <= keep_[n - 1].first + keep_[n - 1].second)
          keep_[n - 1].second = std::max(keep_[n - 1].first + keep_[n - 1].second, r.first + r.second) - keep_[n - 1].first;
        else
          keep_[n++] = r;
      }
      keep_.resize(n);
      st.release_weights(keep_);
      return {true, 0, std::string_view("madvise+fadvise")};
    }
    if (!prefetcher_) return {true, 0, std::string_view("demand paging")};
    prefetcher_->submit(&st);
    return {true, 0, std::string_view("background")};
  }
  BRIGADE_CHECK(v < released_.size() && !released_[v], Errc::InvalidArgument,
                "executor: rank {}: {} runs on virtual stage {} after its RELEASE without a "
                "PREFETCH in between: its weights are not resident",
                rank_, schedule::to_string(a), a.virtual_stage);
  if (a.op == Op::F) {
    double book_wait_s = 0.0;  // the book's next(), arrivals waited for: not the forward
    if (a.virtual_stage == 0) {
      scratch_.clear();
      if (a.chunk > 0) {
        const auto& t = tokens_[m];
        for (std::size_t i = 2; i < t.size(); i += 3) scratch_.push_back(t[i]);
      }
      // The seconds of the micro-batch's last round on every virtual stage came back with its
      // tokens: the book's measurements (an idle round measured nothing).
      auto& secs = seconds_[m];
      if (layout_->report_seconds && a.chunk > 0 &&
          secs.size() == static_cast<std::size_t>(shape_->num_virtual_stages))
        book_->measured(a.microbatch, a.chunk - 1, secs);
      secs.clear();
      const double now =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
      mb = runtime::Microbatch{};
      const auto t_book = std::chrono::steady_clock::now();
      const bool open =
          book_->next(detail::RoundInput{a.microbatch, a.chunk,
                                         a.chunk > 0 ? std::span<const backend::SequenceSlice>(
                                                           prev_[m])
                                                     : std::span<const backend::SequenceSlice>(),
                                         scratch_, now},
                      mb);
      mb.id = a.microbatch;
      cur_[m] = mb.seqs;
      known_[m] = 1;
      if (!open) closed_[m] = 1;
      else if (mb.seqs.empty()) idle_[m] = 1;
      book_wait_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_book).count();
    }
    if (closed_[m] || idle_[m]) return {false, 0, {}};
    const auto t_f = std::chrono::steady_clock::now();
    stage(a.virtual_stage).forward(mb);
    if (layout_->report_seconds)
      seconds_[m].push_back(
          std::chrono::duration<float>(std::chrono::steady_clock::now() - t_f).count());
    if (offload_mapped_) {  // the window just run and whatever of the next one is loaded
      pages_.clear();
      for (const auto* s : stages_)
        if (s != nullptr) pages_.insert(pages_.end(), s->weight_pages().begin(), s->weight_pages().end());
      peak_resident_ = std::max(peak_resident_, static_cast<double>(runtime::resident_bytes(pages_)));
    }
    return {true, mb.num_tokens(), label(), book_wait_s};
  }
  if (a.op == Op::Sample) {
    if (closed_[m] || idle_[m]) {
      tokens_[m].clear();
      return {false, 0, {}};
    }
    const auto t_s = std::chrono::steady_clock::now();
    stage(a.virtual_stage).sample(mb);
    if (layout_->report_seconds && !seconds_[m].empty())
      seconds_[m].back() +=
          std::chrono::duration<float>(std::chrono::steady_clock::now() - t_s).count();
    if (shape_->rank_of(0) == rank_) {
      // The next round's virtual stage 0 is here: the tokens need no message.
      auto& t = tokens_[m];
      t.clear();
      for (std::size_t i = 0; i < mb.seqs.size(); ++i)
        t.insert(t.end(), {mb.seqs[i].seq, mb.seqs[i].pos0 + mb.seqs[i].tokens, mb.sampled[i]});
    }
    return {true, static_cast<std::int64_t>(mb.seqs.size()), label()};
  }
  BRIGADE_CHECK(false, Errc::InvalidArgument, "executor: rank {}: inference cannot run {}", rank_,
                schedule::to_string(a));
  return {};
}

void InferenceWorker::recv_messages(const Action& a, std::vector<MessageSpec>& out) {
  const auto m = static_cast<std::size_t>(a.microbatch);
  if (a.op == Op::MigrateRecv) {
    // The part of (m, c) over that round's sequences, which this rank saw in round c.
    BRIGADE_CHECK(mig_ && mig_->receiving, Errc::InvalidArgument,
                  "executor: rank {}: {} without a layer move under way", rank_,
                  schedule::to_string(a));
    const Part p = plan_part(a.chunk, prev_[m], stage(a.virtual_stage));
    out.push_back({detail::kTagMigrate,
                   MessageHeader::make(a.microbatch, a.virtual_stage, DType::U8,
                                       {static_cast<std::int64_t>(p.bytes)}, a.chunk),
                   p.bytes});
    mig_->posted[{a.microbatch, a.chunk}] = p;
    return;
  }
  const auto seqs = layout_->dynamic ? static_cast<std::int64_t>(layout_->max_seqs)
                                     : static_cast<std::int64_t>(layout_->prefill[m].size());
  if (a.virtual_stage == 0) {
    out.push_back({detail::kTagToken,
                   MessageHeader::make(a.microbatch, 0, DType::I32, {kAny, 3}, a.chunk,
                                       MessageKind::Token),
                   static_cast<std::size_t>(3 * std::max<std::int64_t>(seqs, 1)) * 4});
  } else {
    out.push_back({detail::kTagDescriptor,
                   MessageHeader::make(a.microbatch, a.virtual_stage, DType::I32,
                                       {kAny, detail::kDescriptorColumns}, a.chunk),
                   static_cast<std::size_t>(detail::kDescriptorColumns * (seqs + 1)) * 4});
    out.push_back({detail::kTagActivation,
                   MessageHeader::make(a.microbatch, a.virtual_stage, pipeline_dtype_,
                                       {kAny, kAny}, a.chunk, MessageKind::Activation),
                   dtype_bytes(pipeline_dtype_, layout_->max_rows[m] * layout_->width)});
  }
  if (layout_->report_seconds)
    out.push_back({detail::kTagSeconds,
                   MessageHeader::make(a.microbatch, a.virtual_stage, DType::F32, {kAny}, a.chunk),
                   static_cast<std::size_t>(shape_->num_virtual_stages) * sizeof(float)});
}

void InferenceWorker::received(const Action& a, std::span<const Received> msgs) {
  const auto m = static_cast<std::size_t>(a.microbatch);
  if (a.op == Op::MigrateRecv) {
    auto& g = *mig_;
    const auto it = g.posted.find({a.microbatch, a.chunk});
    BRIGADE_CHECK(it != g.posted.end() && msgs.size() == 1 &&
                      msgs[0].payload.size() == it->second.bytes,
                  Errc::HeaderMismatch,
                  "rank {}: {}: the part of layer {} holds {} bytes, expected {}", rank_,
                  schedule::to_string(a), g.layer, msgs.empty() ? 0 : msgs[0].payload.size(),
                  it == g.posted.end() ? 0 : it->second.bytes);
    const Part p = std::move(it->second);
    g.posted.erase(it);
    auto& st = stage(a.virtual_stage);
    const std::byte* in = msgs[0].payload.data();
    if (p.w1 > p.w0) {
      const auto image = st.adopt_weight_image();
      std::memcpy(image.data() + p.w0, in, p.w1 - p.w0);
      in += p.w1 - p.w0;
    }
    // The rows go to the layer being adopted, or to the adopted layer (after the first part of
    // the last round).
    for (const auto& [row, rows] : p.segments) {
      st.write_kv_rows(g.layer, row, rows, in);
      in += static_cast<std::size_t>(rows) * g.row_bytes;
    }
    if (p.last && !g.adopted) {  // the weights are complete: the layer is this stage's now
      st.adopt();
      g.adopted = true;
    }
    return;
  }
  const int peer = schedule::peer_rank(*shape_, a);
  auto ints = [](const Received& r) {
    return std::span<const std::int32_t>(reinterpret_cast<const std::int32_t*>(r.payload.data()),
                                         r.payload.size() / 4);
  };
  if (a.virtual_stage == 0) {
    // Tokens of the previous round: (seq, position, token) for each of its sequences.
    const auto t = ints(msgs[0]);
    const auto& before = prev_[m];
    const std::size_t n = t.size() / 3;
    for (std::size_t i = 0; i < std::max(n, before.size()); ++i) {
      const backend::SequenceSlice* w = nullptr;
      backend::SequenceSlice want, got;
      if (i < before.size()) {
        want = {before[i].seq, before[i].pos0 + before[i].tokens, 1};
        w = &want;
      }
      if (i < n) got = {t[3 * i], t[3 * i + 1], 1};
      if (!w || i >= n || got.seq != want.seq || got.pos0 != want.pos0)
        ::brigade::detail::fail(
            Errc::HeaderMismatch,
            "rank {}: micro-batch {} round {}: expected the token of {}, the message from rank {} "
            "holds {}",
            rank_, a.microbatch, round_,
            w ? fmt::format("sequence {} at position {}", want.seq, want.pos0)
              : std::string("no further sequence"),
            peer,
            i < n ? fmt::format("sequence {} at position {}", got.seq, got.pos0)
                  : std::string("no further sequence"));
    }
    tokens_[m].assign(t.begin(), t.end());
    if (layout_->report_seconds) take_seconds(a, msgs[1], shape_->num_virtual_stages, n > 0);
    return;
  }
  const auto d = ints(msgs[0]);
  constexpr std::size_t C = detail::kDescriptorColumns;
  const std::size_t n_seq = d.size() / C - 1;
  auto& mb = slot_[m];
  mb = runtime::Microbatch{};
  mb.id = a.microbatch;
  bool placed = false, partial = false;
  for (std::size_t i = 0; i < n_seq; ++i) {
    const auto* row = d.data() + C * (i + 1);
    mb.seqs.push_back({row[0], row[1], row[2]});
    placed = placed || row[4] != 0;
    partial = partial || row[5] == 0;
  }
  for (std::size_t i = 0; i < n_seq && (placed || partial); ++i) {
    const auto* row = d.data() + C * (i + 1);
    if (placed) mb.placement.push_back({row[3], row[4]});
    if (partial) mb.emit.push_back(static_cast<std::uint8_t>(row[5] != 0));
  }
  check_sequences(a.microbatch, mb.seqs, peer);
  if (layout_->report_seconds) take_seconds(a, msgs[2], a.virtual_stage, n_seq > 0);
  if (d[4] != 0) {  // a layer move ordered in this round (header columns 4 and 5)
    const int code = d[4] - 1;
    const detail::MoveOrder o{code / 2, code / 2 + (code % 2 ? 1 : -1), d[5]};
    BRIGADE_CHECK(!ordered_ || ordered_->first != round_ || ordered_->second == o,
                  Errc::HeaderMismatch,
                  "rank {}: micro-batch {} round {}: the descriptor from rank {} orders the move "
                  "{} -> {} in {} parts, another micro-batch of the round ordered {} -> {}",
                  rank_, a.microbatch, round_, peer, o.from, o.to, o.parts,
                  ordered_->second.from, ordered_->second.to);
    ordered_ = std::pair{round_, o};
  }
  if (n_seq == 0) {
    (d[3] == detail::kIdle ? idle_ : closed_)[m] = 1;
    return;
  }
  mb.rows = d[0];
  mb.width = d[1];
  mb.next_layer = d[2];
  const auto& act = msgs[1];
  BRIGADE_CHECK(act.header.ndim == 2 && act.header.shape[0] == mb.rows &&
                    act.header.shape[1] == mb.width,
                Errc::HeaderMismatch,
                "rank {}: micro-batch {} round {}: the descriptor says [{} x {}] activations, the "
                "message from rank {} holds {}",
                rank_, a.microbatch, round_, mb.rows, mb.width, peer, act.header.to_string());
  mb.act.resize(static_cast<std::size_t>(mb.rows * mb.width));
  convert_to_f32(act.payload.data(), act.header.dtype, mb.act.data(), mb.rows * mb.width);
}

void InferenceWorker::send(const Action& a, Outbox& out) {
  const auto m = static_cast<std::size_t>(a.microbatch);
  const auto& mb = slot_[m];
  if (a.op == Op::Migrate) {
    BRIGADE_CHECK(mig_ && mig_->sending, Errc::InvalidArgument,
                  "executor: rank {}: {} without a layer move under way", rank_,
                  schedule::to_string(a));
    auto& st = stage(a.virtual_stage);
    const Part p = plan_part(a.chunk, cur_[m], st);
    // Gathered straight into the send slot: the part's only copy on this side.
    const auto wire = out.stage(p.bytes);
    std::byte* o = wire.data();
    if (p.w1 > p.w0) {
      st.read_migration_weights(mig_->layer, p.w0, {o, p.w1 - p.w0});
      o += p.w1 - p.w0;
    }
    for (const auto& [row, rows] : p.segments) {
      st.read_kv_rows(mig_->layer, row, rows, o);
      o += static_cast<std::size_t>(rows) * mig_->row_bytes;
    }
    out.add(detail::kTagMigrate,
            MessageHeader::make(a.microbatch, mig_->order.to, DType::U8,
                                {static_cast<std::int64_t>(p.bytes)}, a.chunk),
            transport::ConstBytes(wire.data(), wire.size()));
    return;
  }
  const int last = shape_->num_virtual_stages - 1;
  if (a.virtual_stage == last) {
    // The sampled tokens return to virtual stage 0; a closed micro-batch has none, an idle one
    // sends an empty message.
    if (closed_[m]) return;
    if (idle_[m]) {
      out.add(detail::kTagToken,
              MessageHeader::make(a.microbatch, 0, DType::I32, {0, 3}, a.chunk + 1,
                                  MessageKind::Token),
              {});
      send_seconds(a, 0, a.chunk + 1, true, out);
      return;
    }
    scratch_.clear();
    for (std::size_t i = 0; i < mb.seqs.size(); ++i)
      scratch_.insert(scratch_.end(), {mb.seqs[i].seq, mb.seqs[i].pos0 + mb.seqs[i].tokens,
                                       mb.sampled[i]});
    out.add(detail::kTagToken,
            MessageHeader::make(a.microbatch, 0, DType::I32,
                                {static_cast<std::int64_t>(mb.seqs.size()), 3}, a.chunk + 1,
                                MessageKind::Token),
            transport::as_bytes(std::span<const std::int32_t>(scratch_)));
    send_seconds(a, 0, a.chunk + 1, false, out);
    return;
  }
  const int to = a.virtual_stage + 1;
  scratch_.clear();
  const bool closed = closed_[m] != 0 || idle_[m] != 0;
  // A move ordered in this round rides every descriptor of the round.
  std::int32_t move = 0, parts = 0;
  if (ordered_ && ordered_->first == a.chunk) {
    const auto& o = ordered_->second;
    move = 1 + 2 * o.from + (o.to > o.from ? 1 : 0);
    parts = o.parts;
  }
  if (closed) {
    scratch_.insert(scratch_.end(),
                    {0, 0, mb.next_layer, idle_[m] ? detail::kIdle : 0, move, parts});
  } else {
    scratch_.insert(scratch_.end(), {static_cast<std::int32_t>(mb.rows),
                                     static_cast<std::int32_t>(mb.width), mb.next_layer, 0, move,
                                     parts});
    for (std::size_t i = 0; i < mb.seqs.size(); ++i) {
      const auto& s = mb.seqs[i];
      const runtime::KvPlacement p = mb.placement.empty() ? runtime::KvPlacement{} : mb.placement[i];
      const std::int32_t emit = mb.emit.empty() ? 1 : mb.emit[i];
      scratch_.insert(scratch_.end(), {s.seq, s.pos0, s.tokens, p.first_row, p.capacity, emit});
    }
  }
  out.add(detail::kTagDescriptor,
          MessageHeader::make(a.microbatch, to, DType::I32,
                              {static_cast<std::int64_t>(scratch_.size() / detail::kDescriptorColumns),
                               detail::kDescriptorColumns},
                              a.chunk),
          transport::as_bytes(std::span<const std::int32_t>(scratch_)));
  const std::int64_t rows = closed ? 0 : mb.rows, width = closed ? 0 : mb.width;
  transport::ConstBytes payload;
  if (!closed && pipeline_dtype_ == DType::F32) {
    payload = transport::as_bytes(std::span<const float>(mb.act));
  } else if (!closed) {
    const auto wire = out.stage(dtype_bytes(pipeline_dtype_, rows * width));
    convert_from_f32(mb.act.data(), wire.data(), pipeline_dtype_, rows * width);
    payload = transport::ConstBytes(wire.data(), wire.size());
  }
  out.add(detail::kTagActivation,
          MessageHeader::make(a.microbatch, to, pipeline_dtype_, {rows, width}, a.chunk,
                              MessageKind::Activation),
          payload);
  send_seconds(a, to, a.chunk, closed, out);
}

void InferenceWorker::send_seconds(const Action& a, int to, int chunk, bool empty, Outbox& out) {
  if (!layout_->report_seconds) return;
  const auto& secs = seconds_[static_cast<std::size_t>(a.microbatch)];
  const std::size_t n = empty ? 0 : secs.size();
  out.add(detail::kTagSeconds,
          MessageHeader::make(a.microbatch, to, DType::F32, {static_cast<std::int64_t>(n)}, chunk),
          transport::as_bytes(std::span<const float>(secs.data(), n)));
}

void InferenceWorker::take_seconds(const Action& a, const Received& msg, int expected,
                                   bool ran) {
  const std::size_t n = msg.payload.size() / sizeof(float);
  BRIGADE_CHECK(n == (ran ? static_cast<std::size_t>(expected) : 0), Errc::HeaderMismatch,
                "rank {}: micro-batch {} round {}: the compute seconds from rank {} cover {} "
                "virtual stages, expected {}",
                rank_, a.microbatch, round_, schedule::peer_rank(*shape_, a), n,
                ran ? expected : 0);
  auto& secs = seconds_[static_cast<std::size_t>(a.microbatch)];
  secs.resize(n);
  if (n > 0) std::memcpy(secs.data(), msg.payload.data(), n * sizeof(float));
}

namespace {

/// engine::generate with options.tp > 1: tp pipelines of threads, one InProcessGroup per
/// pipeline rank (inference.hpp).
InferenceReport generate_tensor_parallel(const model::LlamaWeights& weights,
                                         const plan::Plan& plan,
                                         std::span<const GenerationRequest> requests,
                                         const InferenceOptions& options) {
  const auto layout = check_inference_plan(plan, weights.config, requests, options, "generate");
  tp::check_tensor_parallel(weights.config, options.tp);
  const tp::Grid grid{options.tp, plan.shape().num_ranks, 1};
  const int T = grid.tp, P = grid.pp, G = grid.ranks();
  const int root = plan.shape().rank_of(0);
  cpu::set_blas_threads(options.blas_threads);
  std::vector<std::unique_ptr<transport::InProcessFabric>> fabrics;
  std::vector<std::vector<transport::InProcessTransport>> pipes;  // [TP rank][pipeline rank]
  std::vector<std::unique_ptr<detail::SequenceBook>> books;       // per pipeline
  for (int t = 0; t < T; ++t) {
    fabrics.push_back(std::make_unique<transport::InProcessFabric>(P));
    pipes.push_back(transport::endpoints(*fabrics.back()));
    books.push_back(std::make_unique<detail::SequenceBook>(requests, weights.config.seq_len,
                                                           plan.shape().num_microbatches));
  }
  std::vector<std::unique_ptr<transport::InProcessGroup>> groups;  // per pipeline rank
  for (int p = 0; p < P; ++p) groups.push_back(std::make_unique<transport::InProcessGroup>(T));
  std::vector<Timeline> timelines(static_cast<std::size_t>(G), Timeline(P));
  std::vector<double> resident(static_cast<std::size_t>(G), 0.0);
  const auto t0 = std::chrono::steady_clock::now();
  run_grid(
      T, P,
      [&](int t, int p) {
        const auto at = static_cast<std::size_t>(grid.rank_of(0, p, t));
        transport::InProcessCollectives member(*groups[static_cast<std::size_t>(p)], t);
        tp::GroupOver<transport::InProcessCollectives> group(member, options.timeout_s);
        resident[at] = run_inference_rank(
            pipes[static_cast<std::size_t>(t)][static_cast<std::size_t>(p)], weights, plan,
            layout, p == root ? books[static_cast<std::size_t>(t)].get() : nullptr, options, t0,
            timelines[at], CpuBackends{}, &group);
      },
      // Stop every pipeline and every group: their ranks wait on this one's messages or
      // collectives.
      [&](const std::exception& e, const std::string& reason) {
        for (auto& pipe : pipes) transport::abort_others(pipe.front(), e);
        for (auto& grp : groups) grp->abort(reason);
      });

  InferenceReport report;
  report.timeline = Timeline(G);
  report.origin = t0;
  for (int g = 0; g < G; ++g)
    for (Interval iv : timelines[static_cast<std::size_t>(g)].intervals()) {
      iv.rank = g;  // the pipeline's rank p becomes the grid's global rank
      report.timeline.add(std::move(iv));
    }
  report.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  report.resident_weight_bytes = std::move(resident);
  report.sequences = books.front()->results();
  for (int t = 1; t < T; ++t) {
    const auto other = books[static_cast<std::size_t>(t)]->results();
    for (std::size_t i = 0; i < other.size(); ++i)
      BRIGADE_CHECK(other[i].tokens == report.sequences[i].tokens, Errc::Internal,
                    "generate: TP rank {}'s pipeline sampled other tokens than TP rank 0's for "
                    "sequence {}", t, i);
  }
  for (const auto& r : report.sequences) {
    report.generated_tokens += r.generated;
    report.prompt_tokens += r.prompt_tokens;
  }
  return report;
}

}  // namespace

InferenceReport generate(const model::LlamaWeights& weights, const plan::Plan& plan,
                         std::span<const GenerationRequest> requests,
                         const InferenceOptions& options) {
  BRIGADE_CHECK(options.tp >= 1, Errc::InvalidArgument, "generate: options.tp = {}, expected >= 1",
                options.tp);
  if (options.tp > 1) return generate_tensor_parallel(weights, plan, requests, options);
  transport::InProcessFabric fabric(plan.shape().num_ranks);
  auto endpoints = transport::endpoints(fabric);
  return generate(std::span(endpoints), weights, plan, requests, options);
}

InferenceReport generate(const model::LlamaWeights& weights, const partition::Partition& partition,
                         std::span<const GenerationRequest> requests,
                         const InferenceOptions& options) {
  return generate(weights,
                  inference_plan(weights.config, partition, requests, options.microbatches),
                  requests, options);
}

}  // namespace v0
}  // namespace brigade::engine
