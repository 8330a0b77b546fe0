// DynaPipe's live layer rebalancer (serve::Rebalancer) and what its migrations did to the rounds.
#include "brigade/serve/rebalance.hpp"

#include "brigade/runtime/inference_stage.hpp"
#include "brigade/schedule/generators.hpp"
#include "brigade/schedule/lower.hpp"
#include "brigade/sim/simulator.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <numeric>

namespace brigade::serve {
inline namespace v0 {

std::optional<partition::Partition> move_layer(const partition::Partition& p, int from, int to) {
  const int S = p.num_stages();
  BRIGADE_CHECK(from >= 0 && from < S && to >= 0 && to < S && std::abs(from - to) == 1,
                Errc::InvalidArgument,
                "move_layer: stages {} -> {} of {}: expected two neighbouring stages", from, to,
                S);
  auto stages = p.stages();
  auto& a = stages[static_cast<std::size_t>(from)];
  auto& b = stages[static_cast<std::size_t>(to)];
  if (a.last - a.first < 2) return std::nullopt;
  const int layer = to > from ? a.last - 1 : a.first;
  // Only decoders move: in ModelSpec order the embedding is layer 0, the final norm, the LM
  // head and the sampler the last three.
  if (layer == 0 || layer >= p.num_layers() - 3) return std::nullopt;
  if (to > from) {
    --a.last;
    --b.first;
  } else {
    ++a.first;
    ++b.last;
  }
  return partition::Partition(p.num_layers(), p.num_ranks(), std::move(stages));
}

Rebalancer::Rebalancer(const model::LlamaWeights& weights, partition::Partition start,
                       int microbatches, std::size_t part_bytes, RebalanceOptions options)
    : weights_(&weights), o_(std::move(options)), microbatches_(microbatches),
      part_bytes_(part_bytes),
      pred_(cost::LatencyEstimator(model::ModelSpec(weights.config),
                                   o_.layer_seconds ? o_.layer_seconds
                                                    : model::roofline_layer_seconds()),
            start) {
  BRIGADE_CHECK(o_.threshold >= 0 && std::isfinite(o_.threshold) && o_.patience >= 1 &&
                    o_.cooldown >= 0 && o_.warmup >= 0 && o_.window >= 0 && o_.min_gain >= 0 &&
                    o_.min_gain < 1 && o_.force_every >= 0,
                Errc::InvalidArgument,
                "Rebalancer: threshold {} (>= 0), patience {} (>= 1), cooldown {} (>= 0), warmup "
                "{} (>= 0), window {} (>= 0), min_gain {} (in [0, 1)), force_every {} (>= 0)",
                o_.threshold, o_.patience, o_.cooldown, o_.warmup, o_.window, o_.min_gain,
                o_.force_every);
  BRIGADE_CHECK(microbatches >= 1 && part_bytes >= 1, Errc::InvalidArgument,
                "Rebalancer: {} micro-batches and parts of {} bytes, expected both >= 1",
                microbatches, part_bytes);
  plans_.emplace_back(0, std::move(start));
}

const partition::Partition& Rebalancer::plan_at(int round) const {
  const partition::Partition* p = &plans_.front().second;
  for (const auto& [from, plan] : plans_)
    if (from <= round) p = &plan;
  return *p;
}

namespace {
constexpr int kMinChecked = 16;  // stage rounds a move is checked over before its error counts
}  // namespace

void Rebalancer::observe(int v, const RoundFeatures& f, double seconds) {
  if (!(seconds > 0.0 && std::isfinite(seconds))) return;
  if (ordered_fit_ && !moves_.empty()) {
    auto& m = moves_.back();
    const int limit = 2 * (o_.window > 0 ? o_.window : 64 * microbatches_);
    if (f.round >= m.switch_round && (v == m.from || v == m.to) && m.checked_rounds < limit) {
      m.checked_predicted_s += ordered_fit_->predict(plans_.back().second, v, f);
      m.checked_measured_s += seconds;
      ++m.checked_rounds;
    }
  }
  pred_.observe(plan_at(f.round), v, f, seconds);
}

double Rebalancer::moved_prediction_error() const noexcept {
  double sum = 0.0;
  int n = 0;
  for (const auto& m : moves_)
    if (m.checked_rounds >= kMinChecked && m.checked_measured_s > 0.0) {
      sum += std::abs(m.checked_predicted_s / m.checked_measured_s - 1.0);
      ++n;
    }
  return n > 0 ? sum / n : 0.0;
}

std::vector<double> Rebalancer::stage_seconds(const partition::Partition& p,
                                              std::span<const RoundFeatures> recent) const {
  std::vector<double> t(static_cast<std::size_t>(p.num_stages()), 0.0);
  for (const auto& f : recent)
    for (int v = 0; v < p.num_stages(); ++v)
      t[static_cast<std::size_t>(v)] += pred_.predict(p, v, f);
  for (auto& x : t) x /= static_cast<double>(std::max<std::size_t>(recent.size(), 1));
  return t;
}

namespace {

/// The predictor's seconds for the actions of a window of serving rounds: F(v, m, c) takes
/// stage v's predicted seconds on micro-batch m's features of round first + c (its SAMPLE
/// included, as the predictor fits them), 0 when m built nothing in that round (an idle
/// micro-batch still passes through the pipeline); SAMPLE and messages cost nothing (the
/// stages share a machine: in-process links).
class WindowCost {
 public:
  WindowCost(const StageLatencyPredictor& pred, const partition::Partition& p,
             std::span<const RoundFeatures> window, int first_round, int rounds, int microbatches)
      : S_(p.num_stages()), M_(microbatches), C_(rounds),
        seconds_(static_cast<std::size_t>(S_) * M_ * C_, 0.0) {
    for (const auto& f : window) {
      const int c = f.round - first_round;
      if (c < 0 || c >= C_ || f.microbatch < 0 || f.microbatch >= M_) continue;
      for (int v = 0; v < S_; ++v) seconds_[index(v, f.microbatch, c)] += pred.predict(p, v, f);
    }
  }
  [[nodiscard]] double compute_seconds(const schedule::Action& a) const noexcept {
    return a.op == Op::F ? seconds_[index(a.virtual_stage, a.microbatch, a.chunk)] : 0.0;
  }
  [[nodiscard]] double activation_bytes(const schedule::Action&) const noexcept { return 0.0; }
  [[nodiscard]] double message_bytes(const schedule::Action&) const noexcept { return 0.0; }
  [[nodiscard]] cost::Link link(int, int) const noexcept { return {}; }

 private:
  [[nodiscard]] std::size_t index(int v, int m, int c) const noexcept {
    return (static_cast<std::size_t>(v) * static_cast<std::size_t>(M_) +
            static_cast<std::size_t>(m)) * static_cast<std::size_t>(C_) +
           static_cast<std::size_t>(c);
  }
  int S_, M_, C_;
  std::vector<double> seconds_;
};

}  // namespace

double Rebalancer::round_seconds(const partition::Partition& p,
                                 std::span<const RoundFeatures> window) {
  if (window.empty()) return 0.0;
  int lo = window.front().round, hi = lo;
  for (const auto& f : window) {
    lo = std::min(lo, f.round);
    hi = std::max(hi, f.round);
  }
  const int rounds = hi - lo + 1;
  if (rounds != lowered_rounds_) {
    schedule::Params sp;
    sp.ranks = p.num_stages();
    sp.microbatches = microbatches_;
    sp.decode_steps = rounds - 1;
    lowered_ = schedule::lower(schedule::inference(sp));
    lowered_rounds_ = rounds;
  }
  const WindowCost cost(pred_, p, window, lo, rounds, microbatches_);
  sim::SimOptions so;
  so.validate = false;
  so.record_timeline = false;
  return sim::simulate(lowered_, cost, so).makespan / rounds;
}

std::optional<engine::detail::MoveOrder> Rebalancer::decide(int round, double now_s,
                                                            std::span<const RoundFeatures> recent,
                                                            std::int64_t live_positions) {
  const auto& current = plans_.back().second;
  const int S = current.num_stages();
  if (S < 2) return std::nullopt;
  const int last_switch = plans_.back().first;
  if (round < last_switch) return std::nullopt;  // a move is under way
  LayerMove mv;
  std::optional<partition::Partition> next;
  if (o_.force_every > 0) {
    if (round < last_switch + o_.force_every) return std::nullopt;
    // Cycle over the boundaries, alternating the direction; the first valid move.
    const int b = forced_ % (S - 1);
    const bool down_first = (forced_ / (S - 1)) % 2 == 0;
    for (const bool down : {down_first, !down_first}) {
      const int from = down ? b : b + 1, to = down ? b + 1 : b;
      if ((next = move_layer(current, from, to))) {
        mv.from = from;
        mv.to = to;
        break;
      }
    }
    ++forced_;
    if (!next) return std::nullopt;
    mv.forced = true;
  } else {
    // Back-off: each move in a row that undid the one before doubles the cooldown.
    const int wait = moves_.empty() ? 0 : o_.cooldown << std::min(reversals_, 6);
    if (round < last_switch + wait) return std::nullopt;
    for (int v = 0; v < S; ++v)
      if (pred_.observations(v) < o_.warmup) return std::nullopt;
    const auto w = static_cast<std::size_t>(o_.window > 0 ? o_.window : 64 * microbatches_);
    if (recent.empty()) return std::nullopt;
    const auto window = recent.subspan(recent.size() - std::min(w, recent.size()));
    const auto t = stage_seconds(current, window);
    const double mean = std::accumulate(t.begin(), t.end(), 0.0) / S;
    const auto slow = static_cast<int>(std::max_element(t.begin(), t.end()) - t.begin());
    const double worst = t[static_cast<std::size_t>(slow)];
    streak_ = worst > mean * (1.0 + o_.threshold) ? streak_ + 1 : 0;
    if (streak_ < o_.patience) return std::nullopt;
    // The imbalance says where to look; the pipeline's simulated rounds say whether a move
    // pays (the busiest stage's load alone does not: with one micro-batch live a round is the
    // sum of the stages, and a decoder may cost more on one stage than on the other).
    streak_ = 0;  // evaluated: the next evaluation waits for another `patience` rounds
    const double now_round = round_seconds(current, window);
    double best = now_round;
    for (const int to : {slow - 1, slow + 1}) {
      if (to < 0 || to >= S) continue;
      auto cand = move_layer(current, slow, to);
      if (!cand) continue;
      const double r2 = round_seconds(*cand, window);
      if (r2 < best) {
        best = r2;
        next = std::move(cand);
        mv.from = slow;
        mv.to = to;
      }
    }
    // A move that undoes the last one (the same layer back where it came from) needs twice the
    // predicted gain: a layer does not shuttle between two stages on the predictions' noise.
    bool reversal = false;
    if (next && !moves_.empty()) {
      const auto& last = moves_.back();
      const auto& src = current.stage(mv.from);
      const int layer = mv.to > mv.from ? src.last - 1 : src.first;
      reversal = !last.forced && last.from == mv.to && last.to == mv.from && last.layer == layer;
    }
    // The gain must also clear how far the predictor was off on the splits it moved to.
    const double need = (reversal ? 2.0 : 1.0) * o_.min_gain +
                        (o_.gate_on_moved_error ? moved_prediction_error() : 0.0);
    RebalanceEvaluation ev;
    ev.round = round;
    ev.from = next ? mv.from : slow;
    ev.to = next ? mv.to : slow;
    ev.round_s = now_round;
    ev.best_after_s = best;
    ev.required_gain = need;
    ev.moved = next && best <= now_round * (1.0 - need);
    evaluations_.push_back(ev);
    if (!ev.moved) return std::nullopt;
    reversals_ = reversal ? reversals_ + 1 : 0;
    mv.predicted_slowest_s = worst;
    mv.predicted_round_s = now_round;
    mv.predicted_round_after_s = best;
    mv.required_gain = need;
  }
  // Parts: the layer's weights and the live sequences' KV rows (float32 keys and values), at
  // most part_bytes per micro-batch and round, then one round for the rows written meanwhile.
  const auto& c = weights_->config;
  const auto& from = current.stage(mv.from);
  mv.layer = mv.to > mv.from ? from.last - 1 : from.first;
  const int d = model::ModelSpec(c).layer(mv.layer).decoder_index;
  const auto image = runtime::decoder_image_layout(*weights_, d)[9];
  mv.bytes = static_cast<std::int64_t>(image) +
             live_positions * 2 * c.kv_dim() * static_cast<std::int64_t>(sizeof(float));
  const auto per_round = static_cast<std::int64_t>(part_bytes_) * microbatches_;
  const auto parts = static_cast<int>(1 + (mv.bytes + per_round - 1) / per_round);
  mv.ordered_round = round;
  mv.first_round = round + 1;
  mv.switch_round = round + 1 + parts;
  mv.ordered_s = now_s;
  for (const auto& st : next->stages()) mv.layers_after.push_back(st.last - st.first);
  plans_.emplace_back(mv.switch_round, std::move(*next));
  moves_.push_back(mv);
  ordered_fit_ = pred_;  // the fit this move was priced with, to check it against its rounds
  return engine::detail::MoveOrder{mv.from, mv.to, parts};
}

MigrationImpact migration_impact(const ServeReport& report, int neighbours) {
  BRIGADE_CHECK(neighbours >= 1, Errc::InvalidArgument,
                "migration_impact: neighbours = {}, expected >= 1", neighbours);
  MigrationImpact out;
  out.migrations = static_cast<int>(report.moves.size());
  // Round starts on virtual stage 0 (its first F of each round), and where each of its
  // micro-batch rounds began.
  std::map<int, double> start;
  std::map<std::pair<int, int>, double> f_start;  // (micro-batch, round) -> its F's start
  std::vector<const Interval*> migration;  // every MIGRATE / MIGRATE_RECV, any rank
  for (const auto& iv : report.timeline.intervals()) {
    if (iv.op == Op::F && iv.virtual_stage == 0) {
      auto [it, fresh] = start.emplace(iv.chunk, iv.start);
      if (!fresh) it->second = std::min(it->second, iv.start);
      f_start[{iv.microbatch, iv.chunk}] = iv.start;
    }
    if (is_migration(iv.op)) {
      migration.push_back(&iv);
      out.migration_seconds += iv.duration();
      out.migration_bytes += iv.bytes;
    }
  }
  std::map<int, double> length;  // round -> seconds to the next round's start
  for (auto it = start.begin(); it != start.end(); ++it) {
    const auto next = std::next(it);
    if (next != start.end() && next->first == it->first + 1)
      length[it->first] = next->second - it->second;
  }
  // The book's sleeps for an arrival lie just before the F they preceded, in the window of
  // the last round that started before it: idle time, not the round's.
  std::vector<std::pair<double, int>> by_start;  // (start, round), increasing
  for (const auto& [r, t] : start) by_start.emplace_back(t, r);
  std::sort(by_start.begin(), by_start.end());
  for (const auto& f : report.round_features) {
    if (!(f.idle_s > 0)) continue;
    const auto at = f_start.find({f.microbatch, f.round});
    if (at == f_start.end()) continue;
    const auto w = std::lower_bound(by_start.begin(), by_start.end(),
                                    std::pair{at->second, std::numeric_limits<int>::min()});
    if (w == by_start.begin()) continue;
    const auto len = length.find(std::prev(w)->second);
    if (len != length.end()) len->second = std::max(0.0, len->second - f.idle_s);
  }
  auto in_migration = [&](int r) {
    return std::any_of(report.moves.begin(), report.moves.end(), [&](const LayerMove& m) {
      return r >= m.ordered_round && r <= m.switch_round;
    });
  };
  const int last = length.empty() ? 0 : length.rbegin()->first;
  // Rounds [lo, hi] against the median of the `neighbours` rounds before and after them that
  // lie outside every migration: the largest and the mean ratio, or nothing without
  // neighbours.
  struct Ratios {
    double max = 0.0, mean = 0.0;
  };
  auto ratios = [&](int lo, int hi, double* median_out) -> std::optional<Ratios> {
    std::vector<double> around;
    for (int r = lo - 1, k = 0; r >= 0 && k < neighbours; --r)
      if (!in_migration(r) && length.count(r)) {
        around.push_back(length[r]);
        ++k;
      }
    for (int r = hi + 1, k = 0; r <= last && k < neighbours; ++r)
      if (!in_migration(r) && length.count(r)) {
        around.push_back(length[r]);
        ++k;
      }
    if (around.empty()) return std::nullopt;
    std::sort(around.begin(), around.end());
    const double median = around.size() % 2 ? around[around.size() / 2]
                                            : 0.5 * (around[around.size() / 2 - 1] +
                                                     around[around.size() / 2]);
    if (!(median > 0)) return std::nullopt;
    Ratios q;
    int n = 0;
    for (int r = lo; r <= hi; ++r) {
      const auto it = length.find(r);
      if (it == length.end()) continue;
      q.max = std::max(q.max, it->second / median);
      q.mean += it->second / median;
      ++n;
    }
    if (n == 0) return std::nullopt;
    q.mean /= n;
    if (median_out != nullptr) *median_out = median;
    return q;
  };
  std::vector<double> means, maxes;
  std::vector<int> spans;
  for (const auto& m : report.moves) {
    double median = 0.0;
    const auto q = ratios(m.ordered_round, m.switch_round, &median);
    if (!q) continue;
    out.max_round_ratio = std::max(out.max_round_ratio, q->max);
    means.push_back(q->mean);
    maxes.push_back(q->max);
    spans.push_back(m.switch_round - m.ordered_round + 1);
    for (int r = m.ordered_round; r <= m.switch_round; ++r) {
      const auto it = length.find(r);
      if (it == length.end() || !(it->second > 0)) continue;
      // Each rank's migration seconds inside the round's window [start, start + length): the
      // rounds of a rank's ops are not the window they ran in (a part's MIGRATE_RECV runs
      // before the receiver's next F, which may lie in a later window), and the share is of
      // that window's time (idle left out), at most 1 (a rank runs its ops one at a time).
      const double lo = start[r], hi = lo + it->second;
      std::map<int, double> secs;  // rank -> seconds in the window
      for (const Interval* iv : migration)
        secs[iv->rank] += std::max(0.0, std::min(iv->end, hi) - std::max(iv->start, lo));
      for (const auto& [rank, in_window] : secs) {
        const double share = std::min(1.0, in_window / it->second);
        out.max_migration_share = std::max(out.max_migration_share, share);
        out.max_added_ratio = std::max(out.max_added_ratio,
                                       share < 1.0 ? 1.0 / (1.0 - share)
                                                   : std::numeric_limits<double>::infinity());
      }
    }
  }
  auto median_of = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0
                     : v.size() % 2 ? v[v.size() / 2]
                                    : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  if (means.empty()) return out;
  out.median_max_round_ratio = median_of(maxes);
  out.mean_round_ratio = std::accumulate(means.begin(), means.end(), 0.0) /
                         static_cast<double>(means.size());
  // The same measures over windows of as many rounds that hold no migration: what the batch
  // mix and the machine make of a window of rounds without one.
  std::sort(spans.begin(), spans.end());
  const int span = spans[spans.size() / 2];
  std::vector<double> base_max, base_mean;
  for (int lo = 0; lo + span - 1 <= last; lo += span) {
    bool clear = true;
    for (int r = lo; r < lo + span && clear; ++r) clear = !in_migration(r);
    if (!clear) continue;
    if (const auto q = ratios(lo, lo + span - 1, nullptr)) {
      base_max.push_back(q->max);
      base_mean.push_back(q->mean);
    }
  }
  out.baseline_windows = static_cast<int>(base_max.size());
  out.baseline_max_round_ratio = median_of(base_max);
  out.baseline_mean_round_ratio = median_of(base_mean);
  return out;
}

}  // namespace v0
}  // namespace brigade::serve
