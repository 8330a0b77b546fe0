// The serving engine: the ServingBook (admission, continuous batching, chunked prefill, the KV
// block pool) as the first stage's MicrobatchSource of the one inference executor.
#include "brigade/serve/serving.hpp"

#include "brigade/engine/threads.hpp"
#include "brigade/model/tokenizer.hpp"
#include "brigade/serve/kv_blocks.hpp"
#include "brigade/serve/rebalance.hpp"
#include "brigade/transport/in_process.hpp"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <numeric>
#include <thread>

namespace brigade::serve {
inline namespace v0 {

LatencySummary summarize(std::vector<double> values) {
  LatencySummary s;
  if (values.empty()) return s;
  std::sort(values.begin(), values.end());
  s.mean = std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
  auto pct = [&](double q) {
    const double pos = q * static_cast<double>(values.size() - 1);
    const auto lo = static_cast<std::size_t>(std::floor(pos));
    const std::size_t hi = std::min(lo + 1, values.size() - 1);
    return values[lo] + (values[hi] - values[lo]) * (pos - static_cast<double>(lo));
  };
  s.p50 = pct(0.50);
  s.p99 = pct(0.99);
  return s;
}

namespace {

template <class F>
LatencySummary summary_of(const std::vector<RequestMetrics>& rs, F f, bool decode_only = false) {
  std::vector<double> v;
  for (const auto& r : rs)
    if (!decode_only || r.generated > 1) v.push_back(f(r));
  return summarize(std::move(v));
}

/// Stage 0's book of a serving run (see serve()).
class ServingBook final : public engine::detail::MicrobatchSource {
 public:
  ServingBook(std::span<const ServeRequest> requests, const ServeOptions& o, int microbatches,
              KvBlockManager& kv, std::chrono::steady_clock::time_point t0)
      : requests_(requests), o_(o), kv_(&kv), t0_(t0),
        members_(static_cast<std::size_t>(microbatches)) {
    order_.resize(requests.size());
    std::iota(order_.begin(), order_.end(), 0);
    std::stable_sort(order_.begin(), order_.end(), [&](int a, int b) {
      return requests[static_cast<std::size_t>(a)].arrival_s <
             requests[static_cast<std::size_t>(b)].arrival_s;
    });
    state_.resize(requests.size());
    metrics_.resize(requests.size());
    for (std::size_t i = 0; i < requests.size(); ++i) {
      metrics_[i].arrival_s = requests[i].arrival_s;
      metrics_[i].prompt_tokens = static_cast<int>(requests[i].prompt.size());
      metrics_[i].tokens = requests[i].prompt;
    }
  }

  bool next(const engine::detail::RoundInput& in, runtime::Microbatch& out) override {
    rounds_ = std::max(rounds_, in.round + 1);
    record(in);
    auto& members = members_[static_cast<std::size_t>(in.microbatch)];
    double idle = 0.0;  // seconds slept for an arrival
    for (;;) {
      const double now = elapsed();
      arrive(now);
      build(members, now, out);
      if (!out.seqs.empty()) {
        index_[{in.microbatch, in.round}] = features_.size();
        features_.push_back(features_of(in, out));
        features_.back().idle_s = idle;
        return true;
      }
      if (members.empty() && queue_.empty() && next_arrival_ == order_.size()) return false;
      if (active_ > 0 || !queue_.empty()) return true;  // idle round; others run
      // Nothing runs anywhere: wait for the next arrival.
      const double at = requests_[static_cast<std::size_t>(order_[next_arrival_])].arrival_s;
      const double slept_from = elapsed();
      std::this_thread::sleep_until(t0_ + std::chrono::duration_cast<std::chrono::nanoseconds>(
                                              std::chrono::duration<double>(at)));
      idle += elapsed() - slept_from;
    }
  }

  /// Dynamic rebalancing: the rebalancer, fed by measured().
  void set_rebalancer(Rebalancer* rb, int stages) {
    rb_ = rb;
    measured_rounds_.assign(static_cast<std::size_t>(stages), 0);
  }

  // Every stage's seconds of (m, round), back with its tokens: joined with the round's
  // features, they are the predictor's observations.
  void measured(int microbatch, int round, std::span<const float> seconds) override {
    if (rb_ == nullptr) return;
    const auto f = index_.find({microbatch, round});
    if (f == index_.end()) return;
    for (std::size_t v = 0; v < seconds.size() && v < measured_rounds_.size(); ++v) {
      rb_->observe(static_cast<int>(v), features_[f->second], seconds[v]);
      ++measured_rounds_[v];
    }
  }

  std::optional<engine::detail::MoveOrder> rebalance(int round) override {
    if (rb_ == nullptr) return std::nullopt;
    std::int64_t live = 0;
    for (const auto& members : members_)
      for (const int seq : members) live += state_[static_cast<std::size_t>(seq)].fed;
    return rb_->decide(round, elapsed(), features_, live);
  }

  std::vector<RequestMetrics> take_metrics() { return std::move(metrics_); }
  std::vector<RoundFeatures> take_features() { return std::move(features_); }
  std::vector<int> take_measured_rounds() { return std::move(measured_rounds_); }
  [[nodiscard]] int rounds() const noexcept { return rounds_; }
  [[nodiscard]] int peak_queue() const noexcept { return peak_queue_; }

 private:
  struct SeqState {
    int fed = 0;  // positions fed so far
    runtime::KvPlacement kv;
  };

  static RoundFeatures features_of(const engine::detail::RoundInput& in,
                                   const runtime::Microbatch& mb) {
    RoundFeatures f;
    f.microbatch = in.microbatch;
    f.round = in.round;
    for (std::size_t i = 0; i < mb.seqs.size(); ++i) {
      const auto& s = mb.seqs[i];
      const bool prompt = s.tokens > 1 || !mb.emit[i] || s.pos0 == 0;
      // Token k of the slice (position pos0 + k) attends to pos0 + k + 1 positions.
      const double ctx = s.tokens * (s.pos0 + (s.tokens + 1) / 2.0);
      if (prompt) {
        f.prefill_tokens += s.tokens;
        ++f.prefill_seqs;
        f.prefill_context += ctx;
      } else {
        ++f.decode_seqs;
        f.decode_context += ctx;
      }
      f.sampled += mb.emit[i];
    }
    if (f.prefill_tokens > 0) f.prefill_context /= f.prefill_tokens;
    if (f.decode_seqs > 0) f.decode_context /= f.decode_seqs;
    return f;
  }

  double elapsed() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }

  // The tokens the last round sampled: record them, retire finished sequences.
  void record(const engine::detail::RoundInput& in) {
    auto& members = members_[static_cast<std::size_t>(in.microbatch)];
    for (std::size_t i = 0; i < in.previous.size(); ++i) {
      const auto& e = in.previous[i];
      const auto id = static_cast<std::size_t>(e.seq);
      auto& st = state_[id];
      auto& m = metrics_[id];
      st.fed = e.pos0 + e.tokens;
      const int token = in.sampled[i];
      if (token < 0) continue;  // a prompt chunk that was not the last
      if (++m.generated == 1) m.first_token_s = in.now_s;
      m.done_s = in.now_s;
      bool done = m.generated >= requests_[id].max_new_tokens;
      if (token == model::Tokenizer::kBos && !o_.ignore_eos) {
        m.stopped_on_bos = true;
        done = true;
      } else {
        m.tokens.push_back(token);
      }
      if (done) {
        kv_->free(st.kv);
        members.erase(std::find(members.begin(), members.end(), e.seq));
        --active_;
      }
    }
  }

  void arrive(double now) {
    while (next_arrival_ < order_.size() &&
           requests_[static_cast<std::size_t>(order_[next_arrival_])].arrival_s <= now)
      queue_.push_back(order_[next_arrival_++]);
    peak_queue_ = std::max(peak_queue_, static_cast<int>(queue_.size()));
  }

  void add(runtime::Microbatch& out, int seq, int tokens, bool emit) {
    const auto id = static_cast<std::size_t>(seq);
    const auto& st = state_[id];
    out.seqs.push_back({seq, st.fed, tokens});
    out.placement.push_back(st.kv);
    out.emit.push_back(static_cast<std::uint8_t>(emit));
    const auto& prompt = requests_[id].prompt;
    if (st.fed < static_cast<int>(prompt.size()))
      out.token_ids.insert(out.token_ids.end(), prompt.begin() + st.fed,
                           prompt.begin() + st.fed + tokens);
    else
      out.token_ids.push_back(metrics_[id].tokens.back());
  }

  // Micro-batch `members`' next round: one token per sequence (a decode token, or the first of
  // a prompt chunk: every live sequence runs every round, max_batch_tokens >= max_seqs), then the
  // prompt chunks grow up to prefill_chunk tokens within max_batch_tokens, then new sequences
  // from the queue while blocks, sequences and tokens allow.
  void build(std::vector<int>& members, double now, runtime::Microbatch& out) {
    out = runtime::Microbatch{};
    int budget = o_.max_batch_tokens - static_cast<int>(members.size());
    std::vector<int> take(members.size(), 1);
    for (std::size_t i = 0; i < members.size(); ++i) {
      const auto id = static_cast<std::size_t>(members[i]);
      const int left = static_cast<int>(requests_[id].prompt.size()) - state_[id].fed;
      if (left <= 1) continue;
      const int more = std::min({left, o_.prefill_chunk, budget + 1}) - 1;
      take[i] += more;
      budget -= more;
    }
    for (std::size_t i = 0; i < members.size(); ++i) {
      const auto id = static_cast<std::size_t>(members[i]);
      const int p = static_cast<int>(requests_[id].prompt.size());
      add(out, members[i], take[i], state_[id].fed + take[i] >= p);
    }
    while (!queue_.empty() && budget > 0 && static_cast<int>(members.size()) < o_.max_seqs) {
      const int seq = queue_.front();
      const auto id = static_cast<std::size_t>(seq);
      const auto& r = requests_[id];
      const int p = static_cast<int>(r.prompt.size());
      const auto slot = kv_->allocate(p + r.max_new_tokens - 1);
      if (!slot) break;  // FIFO: the head waits for blocks
      queue_.pop_front();
      state_[id] = {0, *slot};
      metrics_[id].admitted_s = now;
      members.push_back(seq);
      ++active_;
      const int t = std::min({p, o_.prefill_chunk, budget});  // budget >= 1 here
      budget -= t;
      add(out, seq, t, t >= p);
    }
  }

  std::span<const ServeRequest> requests_;
  const ServeOptions& o_;
  KvBlockManager* kv_;
  std::chrono::steady_clock::time_point t0_;
  std::vector<std::vector<int>> members_;  // per micro-batch: live sequence ids, admission order
  std::vector<int> order_;                 // request ids by arrival
  std::size_t next_arrival_ = 0;
  std::deque<int> queue_;                  // arrived, waiting for KV blocks
  std::vector<SeqState> state_;
  std::vector<RequestMetrics> metrics_;
  std::vector<RoundFeatures> features_;
  std::map<std::pair<int, int>, std::size_t> index_;  // (micro-batch, round) -> features_
  Rebalancer* rb_ = nullptr;
  std::vector<int> measured_rounds_;  // per stage: rounds observed
  int active_ = 0, rounds_ = 0, peak_queue_ = 0;
};

}  // namespace

const partition::Partition& ServeReport::plan_at(int round) const {
  BRIGADE_CHECK(!plans.empty(), Errc::InvalidArgument, "ServeReport: no plans recorded");
  const partition::Partition* p = &plans.front().second;
  for (const auto& [from, plan] : plans)
    if (from <= round) p = &plan;
  return *p;
}

LatencySummary ServeReport::e2e() const {
  return summary_of(requests, [](const RequestMetrics& r) { return r.e2e_s(); });
}
LatencySummary ServeReport::ttft() const {
  return summary_of(requests, [](const RequestMetrics& r) { return r.ttft_s(); });
}
LatencySummary ServeReport::tpot() const {
  return summary_of(requests, [](const RequestMetrics& r) { return r.tpot_s(); }, true);
}

namespace detail {

struct ServingRun::State {
  const model::LlamaWeights* weights = nullptr;
  const partition::Partition* partition = nullptr;
  std::span<const ServeRequest> requests;
  const ServeOptions* options = nullptr;
  int microbatches = 1;
  std::optional<KvBlockManager> kv;
  engine::detail::GenerationLayout layout;
  schedule::Shape shape;
  engine::InferenceOptions inference;
  std::optional<Rebalancer> rebalancer;
  std::optional<ServingBook> book;
};

ServingRun::ServingRun(const model::LlamaWeights& weights, const partition::Partition& partition,
                       std::span<const ServeRequest> requests, const ServeOptions& options)
    : s_(std::make_unique<State>()) {
  const auto& c = weights.config;
  const model::ModelSpec spec(c);
  BRIGADE_CHECK(partition.num_layers() == spec.num_layers(), Errc::InvalidArgument,
                "serve: the partition covers {} layers, the model has {}", partition.num_layers(),
                spec.num_layers());
  BRIGADE_CHECK(!requests.empty(), Errc::InvalidArgument, "serve: no requests");
  const ServeOptions& o = options;
  BRIGADE_CHECK(o.microbatches >= 0 && o.max_seqs >= 1 && o.max_batch_tokens >= o.max_seqs &&
                    o.prefill_chunk >= 1 && o.kv_block_size >= 1 && o.kv_blocks >= 0,
                Errc::InvalidArgument,
                "serve: microbatches {} (>= 0), max_seqs {} (>= 1), max_batch_tokens {} (>= "
                "max_seqs), prefill_chunk {} (>= 1), kv_block_size {} (>= 1), kv_blocks {} (>= 0)",
                o.microbatches, o.max_seqs, o.max_batch_tokens, o.prefill_chunk, o.kv_block_size,
                o.kv_blocks);
  BRIGADE_CHECK(o.inference.blas_threads >= 1, Errc::InvalidArgument,
                "serve: blas_threads = {}, expected >= 1", o.inference.blas_threads);
  int longest = 1;
  double last = 0.0, gap = 0.0;
  std::vector<double> arrivals;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const auto& r = requests[i];
    BRIGADE_CHECK(!r.prompt.empty() && r.prompt.front() == model::Tokenizer::kBos,
                  Errc::InvalidArgument, "serve: request {} has {}; it must start with BOS", i,
                  r.prompt.empty() ? "an empty prompt" : "a prompt not starting with BOS");
    BRIGADE_CHECK(r.max_new_tokens >= 1, Errc::InvalidArgument,
                  "serve: request {} asks for {} new tokens, expected >= 1", i, r.max_new_tokens);
    BRIGADE_CHECK(std::isfinite(r.arrival_s) && r.arrival_s >= 0, Errc::InvalidArgument,
                  "serve: request {} arrives at {} s, expected a finite time >= 0", i,
                  r.arrival_s);
    const std::int64_t positions =
        static_cast<std::int64_t>(r.prompt.size()) + r.max_new_tokens - 1;
    BRIGADE_CHECK(positions <= c.seq_len, Errc::InvalidArgument,
                  "serve: request {} is longer than the model's context: {} prompt + {} new "
                  "tokens need {} positions, seq_len is {}",
                  i, r.prompt.size(), r.max_new_tokens, positions, c.seq_len);
    longest = std::max(longest, static_cast<int>(positions));
    arrivals.push_back(r.arrival_s);
  }
  std::sort(arrivals.begin(), arrivals.end());
  for (double a : arrivals) {
    gap = std::max(gap, a - last);
    last = a;
  }
  const int P = partition.num_ranks();
  const int M = o.microbatches > 0 ? o.microbatches : P;
  const int per_seq = (longest + o.kv_block_size - 1) / o.kv_block_size;
  auto& kv = s_->kv.emplace(o.kv_block_size,
                            o.kv_blocks > 0 ? o.kv_blocks : M * o.max_seqs * per_seq);
  BRIGADE_CHECK(per_seq <= kv.num_blocks(), Errc::InvalidArgument,
                "serve: the longest request needs {} KV blocks of {} positions, the pool holds "
                "{} (kv_blocks)",
                per_seq, o.kv_block_size, kv.num_blocks());
  if (o.rebalance)
    BRIGADE_CHECK(partition.num_stages() == P, Errc::InvalidArgument,
                  "serve: dynamic rebalancing moves layers between ranks: the partition has {} "
                  "stages on {} ranks, expected one stage per rank",
                  partition.num_stages(), P);

  auto& layout = s_->layout;
  layout.groups = M;
  layout.dynamic = true;
  layout.max_seqs = o.max_seqs;
  layout.kv_pool_rows = kv.rows();
  layout.width = std::max(c.dim, c.vocab_size);
  layout.prefill.resize(static_cast<std::size_t>(M));
  layout.max_rows.assign(static_cast<std::size_t>(M), o.max_batch_tokens);
  layout.report_seconds = o.rebalance.has_value();
  // Rounds are not known up front: the largest bound a Shape admits.
  const std::int64_t cells = static_cast<std::int64_t>(partition.num_stages()) * M;
  layout.max_rounds = static_cast<int>(std::min<std::int64_t>(
      (std::int64_t{1} << 31) / cells, std::numeric_limits<int>::max() / 2));
  s_->shape = engine::detail::inference_shape(partition, layout);

  s_->inference = o.inference;
  s_->inference.timeout_s += gap;  // the first stage may wait this long for an arrival
  s_->inference.weight_offload = false;
  s_->weights = &weights;
  s_->partition = &partition;
  s_->requests = requests;
  s_->options = &options;
  s_->microbatches = M;
}

ServingRun::~ServingRun() = default;

const schedule::Shape& ServingRun::shape() const noexcept { return s_->shape; }
const engine::detail::GenerationLayout& ServingRun::layout() const noexcept { return s_->layout; }
const engine::InferenceOptions& ServingRun::inference() const noexcept { return s_->inference; }
int ServingRun::root() const noexcept { return s_->shape.rank_of(0); }

engine::detail::MicrobatchSource* ServingRun::book(std::chrono::steady_clock::time_point t0) {
  auto& s = *s_;
  if (!s.book) {
    if (s.options->rebalance)
      s.rebalancer.emplace(*s.weights, *s.partition, s.microbatches,
                           s.inference.migration_part_bytes, *s.options->rebalance);
    s.book.emplace(s.requests, *s.options, s.microbatches, *s.kv, t0);
    if (s.rebalancer) s.book->set_rebalancer(&*s.rebalancer, s.partition->num_stages());
  }
  return &*s.book;
}

ServeReport ServingRun::report(Timeline timeline, double wall_s) {
  auto& s = *s_;
  BRIGADE_CHECK(s.book.has_value(), Errc::InvalidUsage,
                "ServingRun::report: this rank holds no ServingBook (not virtual stage 0's rank, "
                "or the run never started)");
  auto& book = *s.book;
  ServeReport report;
  report.timeline = std::move(timeline);
  report.wall_s = wall_s;
  report.requests = book.take_metrics();
  for (const auto& r : report.requests) report.generated_tokens += r.generated;
  report.rounds = book.rounds();
  report.round_features = book.take_features();
  if (s.rebalancer) {
    // A move ordered after the last round never switched: only the plans that ran count.
    for (const auto& [from, plan] : s.rebalancer->plans())
      if (from < book.rounds()) report.plans.emplace_back(from, plan);
    for (const auto& m : s.rebalancer->moves())
      if (m.switch_round < book.rounds()) report.moves.push_back(m);
    report.measured_rounds = book.take_measured_rounds();
  } else {
    report.plans.emplace_back(0, *s.partition);
  }
  report.kv_blocks = s.kv->num_blocks();
  report.kv_block_size = s.kv->block_size();
  report.peak_kv_blocks = s.kv->peak_blocks();
  report.peak_queue = book.peak_queue();
  return report;
}

}  // namespace detail

ServeReport serve(const model::LlamaWeights& weights, const partition::Partition& partition,
                  std::span<const ServeRequest> requests, const ServeOptions& options) {
  const int root = partition.stage(0).rank;
  transport::InProcessFabric fabric(partition.num_ranks());
  auto endpoints = transport::endpoints(fabric);
  ServeReport report;
  engine::run_ranks(std::span(endpoints), [&](transport::InProcessTransport& tp) {
    auto mine = serve_on(tp, weights, partition, requests, options);
    if (tp.rank() == root) report = std::move(mine);
  });
  return report;
}

}  // namespace v0
}  // namespace brigade::serve
