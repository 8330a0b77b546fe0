// integrity_eval: the measurements behind docs/benchmarks.md "Integrity checks" (SENTINEL,
// docs/integrity.md), on real training traffic:
//
//   integrity_eval detect OUT_DIR [STEPS_260K] [STEPS_42M]
//       records the activations and gradients crossing the stage boundary of a 2-stage 1F1B run
//       (stories260K fine-tuned on the fortunes corpus; the synthetic 42M shape), then replays each
//       stream through a fresh StreamMonitor with faults injected by apply_fault (every kind,
//       magnitudes 1%-100% of the payload's norm, rates 1% and 10%, 4 seeds): TPR and FPR at the
//       calibrated threshold, the smallest magnitude caught at 90%, TPR at FPR <= 0.1% from the
//       ROC; writes OUT_DIR/detection.md and OUT_DIR/roc_<kind>.svg.
//   integrity_eval attack OUT_DIR [STEPS] [KIND:MAGNITUDE]
//       three runs of stories260K on fortunes: clean; rank 0's activations corrupted at a 10% rate
//       with --verify drop; the same attack unchecked. Held-out loss every 20 steps; writes
//       OUT_DIR/attack.md and OUT_DIR/attack_loss.svg.
//   integrity_eval dump OUT_DIR [STEPS] [260K|42M]
//       records the streams (with each micro-batch's token ids) to OUT_DIR/*.bin; with
//       BRIGADE_EVAL_STREAMS_260K / _42M set to such a directory, detect and diagnose replay
//       those instead of recording them again.
//   (BRIGADE_EVAL_VERBOSE set: detect names each fault it missed and each clean message it
//   flagged, diagnose each clean flag; BRIGADE_EVAL_KINDS=noise,sign: detect replays only the
//   fault kinds named; BRIGADE_EVAL_MINOR_KINDS=activation,gradient: the message kinds whose
//   monitors score minor-share, default gradient.)
//   integrity_eval clean STEPS
//       a clean run with the "stop" policy at the default threshold: how many messages were
//       checked and whether a false alarm stopped it.
#include <brigade/data/corpus.hpp>
#include <brigade/engine/training.hpp>
#include <brigade/model/config.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/transport/decorators.hpp>
#include <brigade/transport/faults.hpp>
#include <brigade/transport/in_process.hpp>
#include <brigade/transport/verify.hpp>

#include <fmt/core.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace brigade;
namespace fs = std::filesystem;
using transport::FaultKind;
using transport::MessageKind;

const fs::path kModels = BRIGADE_MODEL_DIR;

/// A training run's setting: model, corpus split, configuration.
struct Run {
  std::string name;
  model::LlamaWeights weights;
  data::Corpus train, held;
  engine::TrainingConfig cfg;
  int tokens_per_microbatch = 128;
};

/// A 2-stage 1F1B run on the fortunes corpus: `m` micro-batches of <= `tokens` tokens, AdamW at
/// lr 1e-3 (cosine to 1e-4 over `steps`, `warmup` steps of warm-up).
Run make_run(std::string name, model::LlamaWeights weights, const model::Tokenizer& tok, int m,
             int tokens, int warmup, int steps) {
  Run r;
  r.name = std::move(name);
  r.weights = std::move(weights);
  r.tokens_per_microbatch = tokens;
  const auto corpus = data::load_corpus(data::default_corpus_path(), tok, tokens + 1);
  std::tie(r.train, r.held) = data::split_held_out(corpus, 20);
  r.cfg.ranks = 2;
  r.cfg.microbatches = m;
  r.cfg.seq_len_hint = tokens;
  r.cfg.optimizer.lr = 1e-3f;
  r.cfg.optimizer.min_lr = 1e-4f;
  r.cfg.optimizer.warmup_steps = warmup;
  r.cfg.optimizer.decay_steps = steps;
  return r;
}

Run stories_run(int steps) {
  return make_run("stories260K", model::load_llama2c_checkpoint(kModels / "stories260K.bin"),
                  model::Tokenizer::load_llama2c(kModels / "tok512.bin", 512), 4, 128, 10, steps);
}

Run shape42m_run(int steps) {
  auto w = model::make_synthetic_weights(model::named_config("42M"), 1234);
  const auto tok = model::Tokenizer::synthetic(w.config.vocab_size, 1234);
  return make_run("42M shape", std::move(w), tok, 8, 64, 5, steps);
}

/// One recorded stream: the f32 payloads one rank received from another, of one kind, in order.
struct Stream {
  std::string name;  // "activation 0 -> 1"
  std::vector<std::vector<float>> messages;
  std::vector<std::int64_t> rows, microbatch, chunk;
  /// Per message, per row: the input token id, the target id and the position in its sequence
  /// (from the micro-batch's PackedBatch, which every rank reads from the data order).
  std::vector<std::vector<std::int32_t>> inputs, targets, positions;
  /// The row keys the receiver's monitor uses (VerifyingTransport::expect): input ids for
  /// activations, target ids for gradients.
  [[nodiscard]] std::span<const std::int32_t> keys(std::size_t i) const {
    return gradient() ? targets[i] : inputs[i];
  }
  /// Whether VerifyingTransport's monitors of this stream score minor-share.
  [[nodiscard]] bool minor_share(const transport::SentinelConfig& cfg) const {
    const auto kind = gradient() ? MessageKind::Gradient : MessageKind::Activation;
    return std::find(cfg.minor_share_kinds.begin(), cfg.minor_share_kinds.end(), kind) !=
           cfg.minor_share_kinds.end();
  }
  /// Per message: its step's real targets (RowKeys::gradient_scale).
  std::vector<double> step_targets;
  /// The scale the receiver's monitor compares the message under (SentinelMonitor::assess):
  /// the step's real targets for a gradient, 1 for an activation.
  [[nodiscard]] double scale(std::size_t i) const { return gradient() ? step_targets[i] : 1.0; }
  [[nodiscard]] bool gradient() const { return name.rfind("gradient", 0) == 0; }
};


/// The row keys of a packed micro-batch: input ids, target ids, positions in the sequence.
void row_keys(const data::PackedBatch& b, Stream& s) {
  s.inputs.push_back(b.inputs);
  s.targets.push_back(b.targets);
  std::vector<std::int32_t> pos(b.inputs.size());
  for (int q = 0; q < b.num_sequences(); ++q)
    for (auto r = b.offsets[static_cast<std::size_t>(q)]; r < b.offsets[static_cast<std::size_t>(q) + 1]; ++r)
      pos[static_cast<std::size_t>(r)] = static_cast<std::int32_t>(r - b.offsets[static_cast<std::size_t>(q)]);
  s.positions.push_back(std::move(pos));
}

/// Trains `steps` steps of `run` and records every activation and gradient received.
std::vector<Stream> record(Run& run, int steps) {
  using Recorder = transport::InspectingTransport<transport::InProcessTransport>;
  const int P = run.cfg.ranks;
  transport::InProcessFabric fabric(P);
  auto endpoints = transport::endpoints(fabric);
  // Per receiving rank (each rank's check runs on its own thread): (from, kind) -> stream.
  std::vector<std::map<std::pair<int, int>, Stream>> got(static_cast<std::size_t>(P));
  std::vector<Recorder> recorders;
  recorders.reserve(endpoints.size());
  std::vector<data::PackedBatch> batches;  // this step's micro-batches (read by the recorders)
  double targets = 1;                      // their real targets (RowKeys::gradient_scale)
  for (auto& e : endpoints) {
    auto* mine = &got[static_cast<std::size_t>(e.rank())];
    const int me = e.rank();
    recorders.emplace_back(
        e, std::vector<MessageKind>{MessageKind::Activation, MessageKind::Gradient},
        [mine, me, &batches, &targets](const transport::MessageHeader& h, int from, transport::ConstBytes p) {
          auto& s = (*mine)[{from, static_cast<int>(h.kind)}];
          if (s.name.empty())
            s.name = fmt::format("{} {} -> {}", transport::to_string(h.kind), from, me);
          s.messages.emplace_back(p.size() / sizeof(float));
          std::memcpy(s.messages.back().data(), p.data(), p.size());
          s.rows.push_back(h.shape[0]);
          s.microbatch.push_back(h.microbatch);
          s.chunk.push_back(h.chunk);
          s.step_targets.push_back(targets);
          row_keys(batches[static_cast<std::size_t>(h.microbatch)], s);
          return transport::CheckResult{};
        });
  }
  engine::TrainingEngine eng(run.weights, run.cfg);
  data::Packer packer(run.train.samples, run.tokens_per_microbatch, 42);
  const auto t0 = std::chrono::steady_clock::now();
  double loss = 0;
  for (int s = 0; s < steps; ++s) {
    batches.clear();
    for (int m = 0; m < run.cfg.microbatches; ++m) batches.push_back(packer.next());
    targets = transport::row_keys(std::span<const data::PackedBatch>(batches))[0].gradient_scale;
    loss = eng.train_step(std::span(recorders), batches).loss;
  }
  fmt::print(stderr, "{}: recorded {} steps in {:.1f} s (last loss {:.3f})\n", run.name, steps,
             std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), loss);
  std::vector<Stream> out;
  for (auto& per_rank : got)
    for (auto& [key, s] : per_rank) out.push_back(std::move(s));
  return out;
}

/// The streams `dump` wrote to `dir` (name from the file name: "activation_0_-_1.bin" ->
/// "activation 0 -> 1").
std::vector<Stream> load_streams(const fs::path& dir) {
  std::vector<Stream> out;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".bin") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const auto& p : files) {
    std::ifstream f(p, std::ios::binary);
    Stream s;
    s.name = p.stem().string();
    std::replace(s.name.begin(), s.name.end(), '_', ' ');
    if (const auto at = s.name.find(" - "); at != std::string::npos) s.name.replace(at, 3, " -> ");
    std::int64_t cols = 0, rows = 0, mb = 0;
    double targets = 0;
    f.read(reinterpret_cast<char*>(&cols), 8);
    while (f.read(reinterpret_cast<char*>(&rows), 8) && f.read(reinterpret_cast<char*>(&mb), 8) &&
           f.read(reinterpret_cast<char*>(&targets), 8)) {
      s.rows.push_back(rows);
      s.microbatch.push_back(mb);
      s.step_targets.push_back(targets);
      s.chunk.push_back(0);
      for (auto* v : {&s.inputs, &s.targets, &s.positions}) {
        v->emplace_back(static_cast<std::size_t>(rows));
        f.read(reinterpret_cast<char*>(v->back().data()), rows * 4);
      }
      s.messages.emplace_back(static_cast<std::size_t>(rows * cols));
      f.read(reinterpret_cast<char*>(s.messages.back().data()), rows * cols * 4);
    }
    BRIGADE_CHECK(!s.messages.empty(), Errc::BadFile, "{}: no messages", p.string());
    fmt::print(stderr, "loaded {} ({} messages)\n", s.name, s.messages.size());
    out.push_back(std::move(s));
  }
  return out;
}

/// What one replay of a stream with faults gave: scores of clean and corrupted messages from the
/// end of the stream's warm-up (its first `warmup` messages), and the verdicts at the calibrated
/// thresholds.
/// The monitors' settings: the defaults (what --verify runs with), but for the message kinds
/// that score minor-share when BRIGADE_EVAL_MINOR_KINDS names them ("activation,gradient";
/// "none" for no kind), to measure what the default leaves out.
transport::SentinelConfig eval_config() {
  transport::SentinelConfig cfg;
  if (const char* kinds = std::getenv("BRIGADE_EVAL_MINOR_KINDS"); kinds != nullptr) {
    const std::string k = kinds;
    cfg.minor_share_kinds.clear();
    for (MessageKind kind : {MessageKind::Activation, MessageKind::Gradient})
      if (k.find(transport::to_string(kind)) != std::string::npos)
        cfg.minor_share_kinds.push_back(kind);
  }
  return cfg;
}

struct Replay {
  std::vector<double> clean, faulty;
  std::int64_t clean_flagged = 0, faulty_flagged = 0;
};

Replay replay(const Stream& s, transport::FaultSpec spec, std::uint64_t seed,
              const transport::SentinelConfig& cfg) {
  // As VerifyingTransport keys its streams: one StreamMonitor (a monitor per row bucket
  // floor(log2(rows)), with its stand-in during a bucket's warm-up; the width and the row keys
  // are fixed here) and one replay check per payload size, the replay check before the monitor.
  transport::StreamMonitor monitor(cfg, s.minor_share(cfg));
  std::map<std::size_t, transport::ReplayGuard> guards;
  std::mt19937_64 rng(seed);
  std::bernoulli_distribution coin(spec.rate);
  spec.seed = seed;
  Replay r;
  std::int64_t drift = 0;
  std::vector<float> x;
  std::string last_reason;
  for (std::size_t i = 0; i < s.messages.size(); ++i) {
    x = s.messages[i];
    bool faulty = false;
    if (coin(rng)) {
      // Replay sends a message from 32 messages back (an old one of the same stream).
      std::span<const float> previous;
      if (i >= 32 && s.messages[i - 32].size() == x.size()) previous = s.messages[i - 32];
      faulty = transport::apply_fault(spec, std::span(x), rng, previous, drift);
      if (faulty && spec.kind == FaultKind::Drift) ++drift;
    }
    const bool replayed =
        cfg.replay_memory > 0 &&
        guards.try_emplace(x.size(), cfg.replay_memory, cfg.warmup)
            .first->second.observe(std::as_bytes(std::span<const float>(x)),
                                   static_cast<std::int64_t>(i), s.microbatch[i], s.chunk[i]);
    double score = std::numeric_limits<double>::infinity();  // replayed: flagged at once
    bool flagged = replayed;
    if (!replayed) {
      const auto a = monitor.observe(x, s.rows[i], s.keys(i), s.scale(i));
      flagged = a.flagged;
      last_reason = a.reason;
      // The ROC's score: the deciding statistic's score over its threshold (scaling every
      // statistic's calibrated threshold by one factor sweeps the ROC; 1 is the calibrated
      // point). A message no monitor judges yet (its bucket warming up, no warm bucket to
      // stand in) is not checked: a fault there is missed (score 0), a clean one is left out of
      // the FPR.
      if (!std::isfinite(a.threshold) && std::isfinite(a.score)) {
        if (!faulty || i < static_cast<std::size_t>(cfg.warmup)) continue;
        score = 0;
      } else {
        score = a.score / a.threshold;
      }
    }
    if (i < static_cast<std::size_t>(cfg.warmup)) continue;  // the stream's own warm-up
    if (faulty && !flagged && std::getenv("BRIGADE_EVAL_VERBOSE") != nullptr)
      fmt::print(stderr,
                 "  {} {}:{:g}:{:g} seed {}: fault at message {} ({} rows) missed, score {:.3g}\n",
                 s.name, transport::to_string(spec.kind), spec.magnitude, spec.rate, seed, i,
                 s.rows[i], score);
    if (!faulty && flagged && !replayed && std::getenv("BRIGADE_EVAL_VERBOSE") != nullptr)
      fmt::print(stderr, "  {} {}:{:g}:{:g} seed {}: clean message {} ({} rows) flagged: {}\n",
                 s.name, transport::to_string(spec.kind), spec.magnitude, spec.rate, seed, i,
                 s.rows[i], last_reason);
    (faulty ? r.faulty : r.clean).push_back(score);
    (faulty ? r.faulty_flagged : r.clean_flagged) += flagged ? 1 : 0;
  }
  return r;
}

Replay& operator+=(Replay& a, const Replay& b) {
  a.clean.insert(a.clean.end(), b.clean.begin(), b.clean.end());
  a.faulty.insert(a.faulty.end(), b.faulty.begin(), b.faulty.end());
  a.clean_flagged += b.clean_flagged;
  a.faulty_flagged += b.faulty_flagged;
  return a;
}

double tpr(const Replay& r) {
  return r.faulty.empty() ? 0.0 : static_cast<double>(r.faulty_flagged) / static_cast<double>(r.faulty.size());
}
double fpr(const Replay& r) {
  return r.clean.empty() ? 0.0 : static_cast<double>(r.clean_flagged) / static_cast<double>(r.clean.size());
}

/// ROC points (FPR, TPR) over every threshold between the scores, FPR ascending.
std::vector<std::pair<double, double>> roc(const Replay& r) {
  std::vector<double> c = r.clean, f = r.faulty;
  std::sort(c.begin(), c.end());
  std::sort(f.begin(), f.end());
  std::vector<double> ts(c.begin(), c.end());
  ts.insert(ts.end(), f.begin(), f.end());
  std::sort(ts.begin(), ts.end(), std::greater<>());
  ts.erase(std::unique(ts.begin(), ts.end()), ts.end());
  std::vector<std::pair<double, double>> pts{{0.0, 0.0}};
  auto above = [](const std::vector<double>& v, double t) {
    return static_cast<double>(v.end() - std::upper_bound(v.begin(), v.end(), t));
  };
  for (double t : ts) {  // flagged: score > t; then the point at t itself (>=)
    const double t_lo = std::nextafter(t, -INFINITY);
    pts.emplace_back(c.empty() ? 0.0 : above(c, t_lo) / static_cast<double>(c.size()),
                     f.empty() ? 0.0 : above(f, t_lo) / static_cast<double>(f.size()));
  }
  return pts;
}

/// TPR at the highest threshold whose FPR is at most `max_fpr`.
double tpr_at_fpr(const Replay& r, double max_fpr) {
  double best = 0.0;
  for (const auto& [x, y] : roc(r))
    if (x <= max_fpr) best = std::max(best, y);
  return best;
}

// ---- SVG line plots ---------------------------------------------------------------------------

struct Series {
  std::string name, color;
  std::vector<std::pair<double, double>> points;
};

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '&') o += "&amp;";
    else if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else o += c;
  }
  return o;
}

/// A line plot: x linear or log10 over [x0, x1], y linear over [y0, y1], a legend.
std::string line_plot(const std::string& title, const std::string& xlabel,
                      const std::string& ylabel, const std::vector<Series>& series, bool log_x,
                      double x0, double x1, double y0, double y1) {
  const double W = 560, H = 380, L = 70, R = 20, T = 40, B = 55;
  auto fx = [&](double x) {
    const double u = log_x ? (std::log10(std::max(x, x0)) - std::log10(x0)) /
                                 (std::log10(x1) - std::log10(x0))
                           : (x - x0) / (x1 - x0);
    return L + std::clamp(u, 0.0, 1.0) * (W - L - R);
  };
  auto fy = [&](double y) { return H - B - std::clamp((y - y0) / (y1 - y0), 0.0, 1.0) * (H - T - B); };
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">{}</text>\n",
      W, H, W / 2, esc(title));
  s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#888\"/>\n",
                   L, T, W - L - R, H - T - B);
  // Ticks.
  std::vector<double> xt;
  if (log_x)
    for (double v = x0; v <= x1 * 1.0001; v *= 10) xt.push_back(v);
  else
    for (int i = 0; i <= 5; ++i) xt.push_back(x0 + (x1 - x0) * i / 5);
  for (double v : xt)
    s += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\" stroke=\"#ddd\"/>"
                     "<text x=\"{0:.1f}\" y=\"{3}\" text-anchor=\"middle\">{4:g}</text>\n",
                     fx(v), T, H - B, H - B + 16, v);
  for (int i = 0; i <= 5; ++i) {
    const double v = y0 + (y1 - y0) * i / 5;
    s += fmt::format("<line x1=\"{0}\" y1=\"{1:.1f}\" x2=\"{2}\" y2=\"{1:.1f}\" stroke=\"#ddd\"/>"
                     "<text x=\"{3}\" y=\"{4:.1f}\" text-anchor=\"end\">{5:.3g}</text>\n",
                     L, fy(v), W - R, L - 6, fy(v) + 4, v);
  }
  s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", (L + W - R) / 2,
                   H - 12, esc(xlabel));
  s += fmt::format("<text x=\"16\" y=\"{}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {})\">{}</text>\n",
                   (T + H - B) / 2, (T + H - B) / 2, esc(ylabel));
  double ly = T + 14;
  for (const auto& se : series) {
    std::string path;
    double px = -1e9, py = -1e9;  // the last point drawn: closer ones add nothing visible
    for (std::size_t i = 0; i < se.points.size(); ++i) {
      const double x = fx(se.points[i].first), y = fy(se.points[i].second);
      if (i + 1 < se.points.size() && std::fabs(x - px) < 0.5 && std::fabs(y - py) < 0.5) continue;
      path += fmt::format("{}{:.1f},{:.1f} ", path.empty() ? "M" : "L", x, y);
      px = x;
      py = y;
    }
    s += fmt::format("<path d=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"/>\n", path,
                     se.color);
    s += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"{}\" "
                     "stroke-width=\"3\"/><text x=\"{}\" y=\"{:.1f}\">{}</text>\n",
                     W - R - 190, ly, W - R - 170, ly, se.color, W - R - 164, ly + 4, esc(se.name));
    ly += 16;
  }
  return s + "</svg>\n";
}

void write(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::trunc);
  out << text;
  if (!out.good()) throw std::runtime_error("cannot write " + p.string());
  fmt::print(stderr, "wrote {}\n", p.string());
}

constexpr FaultKind kKinds[] = {FaultKind::Noise, FaultKind::Scale,  FaultKind::Sign,
                                FaultKind::Zero,  FaultKind::BitFlip, FaultKind::Replay,
                                FaultKind::Drift};
constexpr double kMagnitudes[] = {0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0};
constexpr double kRates[] = {0.01, 0.1};
constexpr int kSeeds = 4;

int detect(const fs::path& out, int steps_small, int steps_42m) {
  fs::create_directories(out);
  const transport::SentinelConfig cfg = eval_config();  // the defaults: what --verify runs with
  std::string md = fmt::format(
      "Detection at the default settings (decay {}, warm-up {}, target FPR {:g}, calibrated "
      "threshold); each cell pools {} seeds of the stream. TPR: corrupted messages flagged; FPR: "
      "clean messages flagged (in the same replays), from the end of the monitor's warm-up.\n\n",
      cfg.decay, cfg.warmup, cfg.target_fpr, kSeeds);
  // ROC data: kind -> magnitude -> pooled replay (stories260K, rate 10%).
  std::map<int, std::map<double, Replay>> roc_data;
  for (int which = 0; which < 2; ++which) {
    const int steps = which == 0 ? steps_small : steps_42m;
    if (steps <= 0) continue;
    Run run = which == 0 ? stories_run(steps) : shape42m_run(steps);
    // BRIGADE_EVAL_STREAMS_260K / _42M: the streams of an earlier `dump` of the same run,
    // instead of recording them again.
    const char* dumped = std::getenv(which == 0 ? "BRIGADE_EVAL_STREAMS_260K" : "BRIGADE_EVAL_STREAMS_42M");
    const auto streams = dumped != nullptr ? load_streams(dumped) : record(run, steps);
    std::size_t total = 0;
    for (const auto& s : streams) total += s.messages.size();
    md += fmt::format("### {} ({} steps of {} micro-batches of <= {} tokens, {} messages in {} "
                      "streams)\n\n",
                      run.name, steps, run.cfg.microbatches, run.tokens_per_microbatch, total,
                      streams.size());
    for (const char* which_kind : {"activation", "gradient"}) {
    std::vector<const Stream*> chosen;
    for (const auto& s : streams)
      if (s.name.rfind(which_kind, 0) == 0) chosen.push_back(&s);
    md += fmt::format("{} messages ({}):\n\n", which_kind, chosen.empty() ? "none" : chosen[0]->name);
    md += "| fault | rate | TPR at 1% | TPR at 10% | TPR at 100% | FPR | smallest magnitude "
          "caught at 90% | TPR at FPR <= 0.1%, 100% |\n| --- | ---: | ---: | ---: | ---: | ---: "
          "| ---: | ---: |\n";
    for (FaultKind k : kKinds) {
      if (const char* only = std::getenv("BRIGADE_EVAL_KINDS");
          only != nullptr && std::string(only).find(transport::to_string(k)) == std::string::npos)
        continue;
      for (double rate : kRates) {
        std::map<double, Replay> by_mag;
        for (double m : kMagnitudes) {
          if (k == FaultKind::Replay && m != 1.0) continue;  // replay has no magnitude
          transport::FaultSpec spec;
          spec.kind = k;
          spec.magnitude = m;
          spec.rate = rate;
          Replay pooled;
          for (const Stream* s : chosen)
            for (int seed = 0; seed < kSeeds; ++seed)
              pooled += replay(*s, spec, static_cast<std::uint64_t>(1000 * seed + 17), cfg);
          by_mag[m] = std::move(pooled);
        }
        auto cell = [&](double m) {
          const auto it = by_mag.find(m);
          return it == by_mag.end() ? std::string("-") : fmt::format("{:.3f}", tpr(it->second));
        };
        Replay all;  // the clean messages of every magnitude's replays
        for (const auto& [m, r] : by_mag) {
          all.clean.insert(all.clean.end(), r.clean.begin(), r.clean.end());
          all.clean_flagged += r.clean_flagged;
        }
        std::string smallest = "none";
        for (const auto& [m, r] : by_mag)
          if (tpr(r) >= 0.9) {
            smallest = fmt::format("{:g}%", 100 * m);
            break;
          }
        md += fmt::format("| {} | {:g}% | {} | {} | {} | {:.4f} | {} | {:.3f} |\n",
                          transport::to_string(k), 100 * rate, cell(0.01), cell(0.1), cell(1.0),
                          fpr(all), smallest, tpr_at_fpr(by_mag.at(1.0), 1e-3));
        if (which == 0 && rate == 0.1 && std::string(which_kind) == "activation")
          roc_data[static_cast<int>(k)] = by_mag;
      }
    }
    md += "\n";
    }
  }
  write(out / "detection.md", md);
  // ROC per fault kind (stories260K, rate 10%), FPR on a log axis.
  const char* colors[] = {"#4e79a7", "#f28e2b", "#59a14f"};
  for (const auto& [k, by_mag] : roc_data) {
    std::vector<Series> series;
    int c = 0;
    for (double m : {0.01, 0.1, 1.0}) {
      const auto it = by_mag.find(m);
      if (it == by_mag.end()) continue;
      Series se{fmt::format("magnitude {:g}% (TPR {:.2f} at FPR {:.4f})", 100 * m, tpr(it->second),
                            fpr(it->second)),
                colors[c++ % 3], {}};
      for (auto [x, y] : roc(it->second)) se.points.emplace_back(std::max(x, 1e-4), y);
      series.push_back(std::move(se));
    }
    const auto kind = transport::to_string(static_cast<FaultKind>(k));
    write(out / fmt::format("roc_{}.svg", kind),
          line_plot(fmt::format("{} faults in activations at a 10% rate (stories260K)", kind),
                    "false-positive rate (clean messages flagged)", "true-positive rate", series,
                    true, 1e-4, 1.0, 0.0, 1.0));
  }
  return 0;
}

/// Held-out loss of `eng` on the first 8 held-out micro-batches.
double held_out(engine::TrainingEngine& eng, const Run& run) {
  data::Packer p(run.held.samples, run.tokens_per_microbatch, 0);
  std::vector<data::PackedBatch> b;
  for (int i = 0; i < 8; ++i) b.push_back(p.next());
  return eng.evaluate(b);
}

struct Curve {
  std::vector<std::pair<double, double>> held;  // (step, held-out loss)
  std::int64_t injected = 0, flagged = 0, checked = 0, dropped = 0, skipped = 0;
  std::string error;  // how the run ended early, if it did
};

/// One run: `inject` empty = clean; `verify` empty = unchecked.
Curve attack_run(const std::string& inject, const std::string& verify, int steps) {
  Run run = stories_run(steps);
  using Injector = transport::FaultInjectingTransport<transport::InProcessTransport>;
  using Verifier = transport::VerifyingTransport<Injector>;
  transport::InProcessFabric fabric(run.cfg.ranks);
  auto endpoints = transport::endpoints(fabric);
  transport::FaultSpec spec;
  if (!inject.empty()) {
    spec = transport::parse_fault_spec(inject);
    spec.ranks = {0};
    spec.kinds = {MessageKind::Activation};
  } else {
    spec.max_faults = 0;
  }
  std::deque<Injector> inj;
  std::vector<Verifier> ver;
  ver.reserve(endpoints.size());
  for (auto& e : endpoints) {
    inj.emplace_back(e, spec);
    ver.emplace_back(inj.back(), transport::SentinelConfig{},
                     verify.empty() ? transport::VerifyPolicy::Log
                                    : transport::parse_verify_policy(verify),
                     verify.empty() ? std::vector<MessageKind>{}
                                    : std::vector<MessageKind>{MessageKind::Activation,
                                                               MessageKind::Gradient});
  }
  engine::TrainingEngine eng(run.weights, run.cfg);
  data::Packer packer(run.train.samples, run.tokens_per_microbatch, 42);
  Curve c;
  c.held.emplace_back(0, held_out(eng, run));
  for (int s = 0; s < steps; ++s) {
    std::vector<data::PackedBatch> batches;
    for (int m = 0; m < run.cfg.microbatches; ++m) batches.push_back(packer.next());
    for (auto& v : ver) v.expect(transport::row_keys(std::span<const data::PackedBatch>(batches)));
    try {
      const auto r = eng.train_step(std::span(ver), batches);
      c.dropped += static_cast<std::int64_t>(r.dropped_microbatches.size());
      c.skipped += r.update_skipped ? 1 : 0;
    } catch (const std::exception& e) {
      c.error = fmt::format("stopped at step {}: {}", s + 1, e.what());
      break;
    }
    if ((s + 1) % 20 == 0 || s + 1 == steps) c.held.emplace_back(s + 1, held_out(eng, run));
  }
  for (const auto& i : inj) c.injected += static_cast<std::int64_t>(i.injected().size());
  for (const auto& v : ver) {
    c.checked += v.checked();
    c.flagged += v.flagged();
  }
  return c;
}

int attack(const fs::path& out, int steps, const std::string& kind_magnitude) {
  fs::create_directories(out);
  const std::string inject = kind_magnitude + ":0.1";
  const Curve clean = attack_run("", "", steps);
  const Curve dropped = attack_run(inject, "drop", steps);
  const Curve unchecked = attack_run(inject, "", steps);
  auto last = [](const Curve& c) { return c.held.back().second; };
  std::string md = fmt::format(
      "stories260K on fortunes, 2 stages (1F1B, 4 micro-batches of <= 128 tokens), {} steps; "
      "attack: `{}` on rank 0's activations (10% of them).\n\n"
      "| run | held-out loss at the end | vs clean | corrupted | checked | flagged | micro-batches "
      "dropped | updates skipped | note |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
      "| --- |\n",
      steps, kind_magnitude);
  for (const auto& [name, c] : std::vector<std::pair<std::string, const Curve*>>{
           {"clean", &clean}, {"attacked, --verify drop", &dropped}, {"attacked, unchecked", &unchecked}})
    md += fmt::format("| {} | {:.4f} | {:+.2f}% | {} | {} | {} | {} | {} | {} |\n", name, last(*c),
                      100 * (last(*c) / last(clean) - 1), c->injected, c->checked, c->flagged,
                      c->dropped, c->skipped, c->error.empty() ? "" : esc(c->error));
  write(out / "attack.md", md);
  double lo = 1e30, hi = 0;
  for (const Curve* c : {&clean, &dropped, &unchecked})
    for (auto [x, y] : c->held) {
      lo = std::min(lo, y);
      hi = std::max(hi, y);
    }
  hi = std::min(hi, lo * 3);
  write(out / "attack_loss.svg",
        line_plot(fmt::format("Held-out loss under attack ({} at a 10% rate, rank 0 -> 1)",
                              kind_magnitude),
                  "step", "held-out loss (nats)",
                  {{"clean", "#59a14f", clean.held},
                   {"attacked, --verify drop", "#4e79a7", dropped.held},
                   {"attacked, unchecked", "#e15759", unchecked.held}},
                  false, 0, steps, lo * 0.95, hi * 1.02));
  return 0;
}

/// The clean streams of `steps` steps: per stream, the flags per statistic and score quantiles,
/// and how each fault kind at magnitude 1 scores (the statistic that flags it), to see what a
/// monitor keys on.
int diagnose(int steps, bool big) {
  Run run = big ? shape42m_run(steps) : stories_run(steps);
  const char* dumped = std::getenv(big ? "BRIGADE_EVAL_STREAMS_42M" : "BRIGADE_EVAL_STREAMS_260K");
  const auto streams = dumped != nullptr ? load_streams(dumped) : record(run, steps);
  const transport::SentinelConfig cfg = eval_config();
  for (const auto& s : streams) {
    transport::SentinelMonitor mon(cfg, s.minor_share(cfg));
    std::map<std::string, int> flags;
    std::vector<double> scores;
    std::array<std::vector<double>, transport::SentinelMonitor::kGroups> top;
    for (std::size_t i = 0; i < s.messages.size(); ++i) {
      const auto a = mon.observe(s.messages[i], s.rows[i], s.keys(i), s.scale(i));
      if (!std::isfinite(a.threshold)) continue;
      for (int g = 0; g < transport::SentinelMonitor::kGroups; ++g) {
        top[static_cast<std::size_t>(g)].push_back(mon.scores()[static_cast<std::size_t>(g)]);
      }
      scores.push_back(a.score / a.threshold);
      if (a.flagged) {
        ++flags[a.statistic];
        if (std::getenv("BRIGADE_EVAL_VERBOSE")) fmt::print("  clean flag at {}: {} {}\n", i, a.statistic, a.reason);
      }
    }
    std::sort(scores.begin(), scores.end());
    auto q = [&](double p) { return scores[static_cast<std::size_t>(p * (scores.size() - 1))]; };
    std::string thresholds;
    for (int g = 0; g < transport::SentinelMonitor::kGroups; ++g)
      thresholds += fmt::format(" {} {:.2f}", transport::SentinelMonitor::kNames[g], mon.threshold(g));
    fmt::print("{}: {} scored, thresholds now{}; scores p50 {:.2f} p90 {:.2f} p99 {:.2f} max "
               "{:.2f}; clean flags:",
               s.name, scores.size(), thresholds, q(0.5), q(0.9), q(0.99), scores.back());
    for (const auto& [k, n] : flags) fmt::print(" {} {}", k, n);
    fmt::print("\n  clean scores per statistic (p99 / p99.9 / max):");
    for (int g = 0; g < transport::SentinelMonitor::kGroups; ++g) {
      auto& v = top[static_cast<std::size_t>(g)];
      std::sort(v.begin(), v.end());
      fmt::print(" {} {:.2f}/{:.2f}/{:.2f}", transport::SentinelMonitor::kNames[g],
                 v[v.size() * 99 / 100], v[v.size() * 999 / 1000], v.back());
    }
    fmt::print("\n");
    for (FaultKind k : kKinds) {
      transport::FaultSpec spec;
      spec.kind = k;
      spec.magnitude = 1.0;
      spec.rate = 0.1;
      transport::SentinelMonitor m2(cfg, s.minor_share(cfg));
      std::mt19937_64 rng(5);
      std::bernoulli_distribution coin(0.1);
      std::map<std::string, int> by;
      std::vector<double> fs;
      std::int64_t drift = 0;
      for (std::size_t i = 0; i < s.messages.size(); ++i) {
        auto x = s.messages[i];
        bool f = false;
        if (i > 64 && coin(rng)) {
          std::span<const float> prev;
          if (s.messages[i - 32].size() == x.size()) prev = s.messages[i - 32];
          f = transport::apply_fault(spec, std::span(x), rng, prev, drift);
          if (f && k == FaultKind::Drift) ++drift;
        }
        const auto a = m2.observe(x, s.rows[i], s.keys(i), s.scale(i));
        if (f) {
          fs.push_back(a.score);
          ++by[a.statistic];
        }
      }
      std::sort(fs.begin(), fs.end());
      fmt::print("  {} at 100%: {} faults, score p10 {:.2f} p50 {:.2f}; top statistic:",
                 transport::to_string(k), fs.size(), fs.empty() ? 0.0 : fs[fs.size() / 10],
                 fs.empty() ? 0.0 : fs[fs.size() / 2]);
      for (const auto& [name, n] : by) fmt::print(" {} {}", name, n);
      fmt::print("\n");
    }
  }
  return 0;
}

/// Writes every recorded stream of `steps` steps to OUT_DIR/<kind>_<from>_<to>.bin for offline
/// analysis: int64 cols, then per message int64 rows, int64 micro-batch, f64 the step's real
/// targets (RowKeys::gradient_scale), int32 inputs[rows], int32 targets[rows], int32
/// positions[rows], f32 payload[rows * cols].
int dump(const fs::path& out, int steps, bool big) {
  fs::create_directories(out);
  Run run = big ? shape42m_run(steps) : stories_run(steps);
  const auto streams = record(run, steps);
  for (const auto& s : streams) {
    std::string name = s.name;
    std::replace(name.begin(), name.end(), ' ', '_');
    name.erase(std::remove(name.begin(), name.end(), '>'), name.end());
    std::ofstream f(out / (name + ".bin"), std::ios::binary | std::ios::trunc);
    const std::int64_t cols = static_cast<std::int64_t>(s.messages[0].size()) / s.rows[0];
    f.write(reinterpret_cast<const char*>(&cols), 8);
    for (std::size_t i = 0; i < s.messages.size(); ++i) {
      f.write(reinterpret_cast<const char*>(&s.rows[i]), 8);
      f.write(reinterpret_cast<const char*>(&s.microbatch[i]), 8);
      f.write(reinterpret_cast<const char*>(&s.step_targets[i]), 8);
      for (const auto* v : {&s.inputs[i], &s.targets[i], &s.positions[i]})
        f.write(reinterpret_cast<const char*>(v->data()), static_cast<std::streamsize>(v->size() * 4));
      f.write(reinterpret_cast<const char*>(s.messages[i].data()),
              static_cast<std::streamsize>(s.messages[i].size() * 4));
    }
    fmt::print(stderr, "wrote {} ({} messages)\n", (out / (name + ".bin")).string(), s.messages.size());
  }
  return 0;
}

int clean_run(int steps) {
  const Curve c = attack_run("", "stop", steps);
  fmt::print("clean run of {} steps with --verify stop at the default threshold: {} messages "
             "checked, {} flagged{}\n",
             steps, c.checked, c.flagged, c.error.empty() ? ", never stopped" : "; " + c.error);
  return c.error.empty() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string cmd = argc > 1 ? argv[1] : "";
    auto arg = [&](int i, const char* def) { return argc > i ? std::string(argv[i]) : std::string(def); };
    if (cmd == "detect" && argc > 2)
      return detect(argv[2], std::stoi(arg(3, "300")), std::stoi(arg(4, "200")));
    if (cmd == "attack" && argc > 2)
      return attack(argv[2], std::stoi(arg(3, "400")), arg(4, "noise:1"));
    if (cmd == "dump" && argc > 2)
      return dump(argv[2], std::stoi(arg(3, "1000")), arg(4, "260K") == "42M");
    if (cmd == "clean") return clean_run(std::stoi(arg(2, "1000")));
    if (cmd == "diagnose") return diagnose(std::stoi(arg(2, "300")), arg(3, "260K") == "42M");
    fmt::print(stderr,
               "usage: integrity_eval detect OUT_DIR [STEPS_260K=300] [STEPS_42M=200]\n"
               "       integrity_eval attack OUT_DIR [STEPS=400] [KIND:MAGNITUDE=noise:1]\n"
               "       integrity_eval clean [STEPS=1000]\n"
               "       integrity_eval diagnose [STEPS=300] [260K|42M]\n"
               "       integrity_eval dump OUT_DIR [STEPS=1000] [260K|42M]\n"
               "BRIGADE_EVAL_STREAMS_260K / BRIGADE_EVAL_STREAMS_42M = a dump's OUT_DIR: detect and\n"
               "diagnose replay those streams instead of recording them again\n");
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "integrity_eval: {}\n", e.what());
    return 1;
  }
}
