// serve_splits: what a fixed split can give, and how well the online latency predictor prices a
// split it has not run (docs/serving.md, "What any split can give"). Replays one serving trace
// (issue 16's scaled Azure traces) through serve::serve on 2 stages once per split of the
// layers, the splits interleaved REPS times, then fits a fresh serve::StageLatencyPredictor on
// the even split's measured rounds and predicts every other split's rounds with it: the
// extrapolation a rebalancer's move relies on.
//
//   serve_splits TRACE RATE_SCALE PROMPT_SCALE OUTPUT_SCALE MAX_REQUESTS PROFILE REPS CUT...
//
// TRACE an Azure CSV or Mooncake JSONL file; PROFILE a device profile file (brigade profile
// --out, or the cached ~/.cache/brigade/profile-<cores>c-v4.json), or "none" for the roofline;
// each CUT is stage 0's ModelSpec layer count (the embedding and its decoders: on the 42M shape
// 5 is the even split, 6 and 7 give stage 0 one and two more decoders). The model is the
// synthetic 42M shape, top-p 0.9 at temperature 1 (bench/serve_compare.sh's settings). Prints a
// Markdown table on stdout.
#include <brigade/cost/estimator.hpp>
#include <brigade/cost/profile.hpp>
#include <brigade/cost/profiled.hpp>
#include <brigade/model/config.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/partition/partition.hpp>
#include <brigade/serve/predictor.hpp>
#include <brigade/serve/serving.hpp>
#include <brigade/serve/trace.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <vector>

using namespace brigade;

namespace {

struct Run {
  double e2e = 0, ttft = 0, tpot = 0;
  double busy[2] = {0, 0};  // measured seconds of every stage round (F, and SAMPLE on the tail)
};

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / static_cast<double>(v.size());
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 9) {
    std::fprintf(stderr,
                 "usage: serve_splits TRACE RATE_SCALE PROMPT_SCALE OUTPUT_SCALE MAX_REQUESTS "
                 "PROFILE REPS CUT...\n");
    return 2;
  }
  const auto trace = serve::read_trace(argv[1]);
  const auto weights = model::make_synthetic_weights(model::named_config("42M"), 0);
  const model::ModelSpec spec(weights.config);
  serve::TraceReplay replay;
  replay.rate_scale = std::stod(argv[2]);
  replay.prompt_scale = std::stod(argv[3]);
  replay.output_scale = std::stod(argv[4]);
  replay.max_requests = std::stoi(argv[5]);
  const auto requests = serve::trace_requests(trace, weights.config, replay);
  const std::string profile = argv[6];
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const model::LayerSeconds layer_seconds =
      profile == "none" ? model::roofline_layer_seconds()
                        : model::LayerSeconds(cost::ProfiledLayerTimes(
                              cost::load_profile(profile), 1, std::min(2, cores)));
  const int reps = std::stoi(argv[7]);
  std::vector<int> cuts;
  for (int i = 8; i < argc; ++i) cuts.push_back(std::stoi(argv[i]));
  const int L = spec.num_layers();
  const int even = partition::uniform(spec, 2).stage(0).last;
  BRIGADE_CHECK(reps >= 1 && std::find(cuts.begin(), cuts.end(), even) != cuts.end(),
                Errc::InvalidArgument,
                "serve_splits: REPS = {} (>= 1) and the cuts must include the even split's {}",
                reps, even);
  for (int c : cuts)
    BRIGADE_CHECK(c >= 2 && c <= L - 3, Errc::InvalidArgument,
                  "serve_splits: cut {} outside [2, {}] (stage 0 needs a decoder; the tail "
                  "keeps the final norm, the LM head and the sampler, as serve::move_layer "
                  "allows)",
                  c, L - 3);
  auto split = [&](int c) { return partition::Partition(L, 2, {{0, 0, c}, {1, c, L}}); };

  serve::ServeOptions o;
  o.inference.sampler = {1.0f, 0.9f, 1};
  std::vector<std::vector<Run>> runs(cuts.size());
  std::vector<serve::ServeReport> last(cuts.size());
  for (int r = 0; r < reps; ++r)
    for (std::size_t i = 0; i < cuts.size(); ++i) {
      auto rep = serve::serve(weights, split(cuts[i]), requests, o);
      Run run{rep.e2e().mean, rep.ttft().mean, rep.tpot().mean, {0, 0}};
      for (const auto& sr : serve::stage_rounds(rep)) run.busy[sr.stage] += sr.seconds;
      std::fprintf(stderr, "serve_splits: rep %d, stage 0 layers %d: e2e mean %.3f s\n", r + 1,
                   cuts[i], run.e2e);
      runs[i].push_back(run);
      last[i] = std::move(rep);
    }

  // The predictor fitted on the even split's last run, predicting every split's last run.
  const auto ie = static_cast<std::size_t>(std::find(cuts.begin(), cuts.end(), even) - cuts.begin());
  serve::StageLatencyPredictor pred(cost::LatencyEstimator(spec, layer_seconds), split(even));
  for (const auto& sr : serve::stage_rounds(last[ie]))
    pred.observe(split(even), sr.stage, last[ie].round_features[sr.round], sr.seconds);

  std::vector<double> even_e2e;
  for (const auto& run : runs[ie]) even_e2e.push_back(run.e2e);
  fmt::print("| stage 0 / 1 layers | e2e mean (s), per rep | vs even | TTFT mean (s) | TPOT mean "
             "(s) | busy s, stage 0 / 1 (last rep) | slowest / even's | predicted from the even "
             "fit: stage 0 / 1 | predicted slowest / even's |\n");
  fmt::print("| --- | --- | ---: | ---: | ---: | --- | ---: | --- | ---: |\n");
  double even_busy = 0, even_pred = 0;
  std::vector<double> p0(cuts.size()), p1(cuts.size());
  for (std::size_t i = 0; i < cuts.size(); ++i) {
    for (const auto& sr : serve::stage_rounds(last[i])) {
      const double y = pred.predict(split(cuts[i]), sr.stage, last[i].round_features[sr.round]);
      (sr.stage == 0 ? p0[i] : p1[i]) += y;
    }
  }
  even_busy = std::max(runs[ie].back().busy[0], runs[ie].back().busy[1]);
  even_pred = std::max(p0[ie], p1[ie]);
  for (std::size_t i = 0; i < cuts.size(); ++i) {
    std::vector<double> e2e, ttft, tpot;
    std::string per;
    for (const auto& run : runs[i]) {
      e2e.push_back(run.e2e);
      ttft.push_back(run.ttft);
      tpot.push_back(run.tpot);
      per += fmt::format("{}{:.3f}", per.empty() ? "" : ", ", run.e2e);
    }
    const auto& b = runs[i].back().busy;
    fmt::print("| {} / {} | {:.3f} ({}) | {:+.1f}% | {:.3f} | {:.4f} | {:.2f} / {:.2f} | {:.3f} | "
               "{:.2f} / {:.2f} | {:.3f} |\n",
               cuts[i], L - cuts[i], mean(e2e), per, 100 * (mean(e2e) / mean(even_e2e) - 1),
               mean(ttft), mean(tpot), b[0], b[1], std::max(b[0], b[1]) / even_busy, p0[i], p1[i],
               std::max(p0[i], p1[i]) / even_pred);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "serve_splits: %s\n", e.what());
  return 1;
}
