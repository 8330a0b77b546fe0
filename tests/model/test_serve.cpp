// The serving engine (serve::serve): requests arriving over time on the pipelined executor,
// continuous batching, chunked prefill, the KV block pool; trace reading; `brigade serve`.
#include <doctest/doctest.h>

#include "serve_workload.hpp"
#include "test_util.hpp"

#include <brigade/engine/inference.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/partition/partition.hpp>
#include <brigade/serve/kv_blocks.hpp>
#include <brigade/serve/predictor.hpp>
#include <brigade/serve/rebalance.hpp>
#include <brigade/serve/serving.hpp>
#include <brigade/serve/trace.hpp>
#include <brigade/transport/in_process.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <utility>
#include <vector>

using brigade::test::rel;

using namespace brigade;
namespace fs = std::filesystem;

namespace {

const fs::path kModels = BRIGADE_MODEL_DIR;  // the committed models/
const fs::path kShared = BRIGADE_DATA_DIR;   // traces

const test::ServeReference& ref() {
  static const test::ServeReference r(kModels);
  return r;
}

using Workload = test::ServeWorkload;

Workload reference_workload(const std::vector<double>& arrivals) {
  return test::reference_workload(ref(), arrivals);
}

using test::check_tokens;


/// Micro-batch `mb`'s features of executor round `round` when it decodes `seqs` sequences at a
/// mean context of `context` positions and samples each.
serve::RoundFeatures decode_round(int mb, int round, int seqs = 4, double context = 40) {
  serve::RoundFeatures f;
  f.microbatch = mb;
  f.round = round;
  f.decode_seqs = seqs;
  f.decode_context = context;
  f.sampled = seqs;
  return f;
}

}  // namespace

TEST_CASE("serve.stories260K: greedy tokens of every request equal run.c's for any arrival "
          "pattern, chunking and 1-3 stages") {
  const model::ModelSpec spec(ref().weights.config);
  const std::vector<std::vector<double>> patterns = {
      {0, 0, 0, 0, 0, 0},                        // all at once
      {0, 0.004, 0.008, 0.012, 0.016, 0.02},     // staggered: joins mid-decode
      {0.03, 0.02, 0.01, 0.0, 0.005, 0.015},     // out of order
  };
  for (int stages = 1; stages <= 3; ++stages) {
    for (std::size_t p = 0; p < patterns.size(); ++p) {
      for (int chunk : {2, 64}) {
        CAPTURE(stages);
        CAPTURE(p);
        CAPTURE(chunk);
        const auto w = reference_workload(patterns[p]);
        serve::ServeOptions o;
        o.microbatches = stages == 1 ? 1 : stages - (p % 2 == 0 ? 0 : 1);
        o.prefill_chunk = chunk;
        o.max_seqs = 3;
        o.max_batch_tokens = 4;  // prompts are fed over several rounds beside decodes
        o.inference.sampler.temperature = 0.0f;
        const auto rep = serve::serve(ref().weights, partition::uniform(spec, stages), w.requests, o);
        check_tokens(w, rep);
        CHECK(rep.peak_kv_blocks <= rep.kv_blocks);
      }
    }
  }
}

TEST_CASE("serve.stories260K: an over-memory workload queues at the KV limit and completes every "
          "request with run.c's tokens") {
  const model::ModelSpec spec(ref().weights.config);
  const auto w = reference_workload({0, 0, 0, 0, 0, 0, 0, 0});
  serve::ServeOptions o;
  o.microbatches = 2;
  o.kv_block_size = 16;
  o.kv_blocks = 20;  // one 256-position request takes 16 blocks: at most one more short one
  o.inference.sampler.temperature = 0.0f;
  const auto rep = serve::serve(ref().weights, partition::uniform(spec, 2), w.requests, o);
  check_tokens(w, rep);
  CHECK(rep.kv_blocks == 20);
  CHECK(rep.peak_kv_blocks <= 20);
  CHECK(rep.peak_kv_blocks >= 16);
  CHECK(rep.peak_queue >= 5);  // 8 arrive at once, at most 3 fit (4 + 16 blocks, or 4 + 2 + 1...)
  int queued = 0;
  for (const auto& m : rep.requests) queued += m.queue_s() > 0 ? 1 : 0;
  CHECK(queued >= 5);
}

TEST_CASE("serve.stories260K: seeded top-p sampling does not depend on chunking, micro-batches or "
          "stages") {
  const model::ModelSpec spec(ref().weights.config);
  auto w = reference_workload({0, 0.002, 0.004, 0.006});
  std::vector<std::vector<int>> first;
  for (auto [stages, chunk, mbs] : {std::tuple{1, 64, 1}, std::tuple{2, 1, 2}, std::tuple{3, 3, 2}}) {
    CAPTURE(stages);
    serve::ServeOptions o;
    o.microbatches = mbs;
    o.prefill_chunk = chunk;
    o.inference.sampler.temperature = 1.0f;
    o.inference.sampler.top_p = 0.9f;
    o.inference.sampler.seed = 7;
    const auto rep = serve::serve(ref().weights, partition::uniform(spec, stages), w.requests, o);
    std::vector<std::vector<int>> got;
    for (const auto& m : rep.requests) got.push_back(m.tokens);
    if (first.empty()) first = got;
    else CHECK(got == first);
  }
  // And they are the tokens engine::generate samples for each request alone (seed + id).
  for (std::size_t i = 0; i < w.requests.size(); ++i) {
    engine::InferenceOptions io;
    io.sampler.temperature = 1.0f;
    io.sampler.top_p = 0.9f;
    io.sampler.seed = 7 + i;
    const std::vector<engine::GenerationRequest> one{
        {w.requests[i].prompt,
         static_cast<int>(w.requests[i].prompt.size()) + w.requests[i].max_new_tokens - 1}};
    const auto g = engine::generate(ref().weights, partition::uniform(spec, 1), one, io);
    CHECK(g.sequences[0].tokens == first[i]);
  }
}

TEST_CASE("serve.errors: a request longer than the context, larger than the KV pool, without BOS, "
          "or bad options is a named error") {
  const model::ModelSpec spec(ref().weights.config);
  const auto part = partition::uniform(spec, 2);
  std::vector<serve::ServeRequest> rs(1);
  rs[0].prompt = {model::Tokenizer::kBos, 5, 6};
  rs[0].max_new_tokens = 511;  // 3 + 511 - 1 = 513 > 512
  auto msg = test::error_of(Errc::InvalidArgument, [&] { serve::serve(ref().weights, part, rs); });
  CHECK(msg.find("request 0 is longer than the model's context") != std::string::npos);
  CHECK(msg.find("513 positions, seq_len is 512") != std::string::npos);
  rs[0].max_new_tokens = 100;
  serve::ServeOptions o;
  o.kv_blocks = 3;
  msg = test::error_of(Errc::InvalidArgument, [&] { serve::serve(ref().weights, part, rs, o); });
  CHECK(msg.find("needs 7 KV blocks of 16 positions, the pool holds 3") != std::string::npos);
  rs[0].prompt = {5, 6};
  msg = test::error_of(Errc::InvalidArgument, [&] { serve::serve(ref().weights, part, rs); });
  CHECK(msg.find("a prompt not starting with BOS") != std::string::npos);
  rs[0].prompt = {model::Tokenizer::kBos};
  o = {};
  o.max_batch_tokens = 2;
  o.max_seqs = 4;
  msg = test::error_of(Errc::InvalidArgument, [&] { serve::serve(ref().weights, part, rs, o); });
  CHECK(msg.find("max_batch_tokens 2 (>= max_seqs)") != std::string::npos);
  rs[0].arrival_s = -1;
  msg = test::error_of(Errc::InvalidArgument, [&] { serve::serve(ref().weights, part, rs); });
  CHECK(msg.find("arrives at -1 s") != std::string::npos);
  // The SPMD form on a world that is not the partition's: refused before any message.
  rs[0].arrival_s = 0;
  transport::InProcessFabric fabric(3);
  auto eps = transport::endpoints(fabric);
  msg = test::error_of(Errc::InvalidArgument,
                       [&] { serve::serve_on(eps[0], ref().weights, part, rs); });
  CHECK(msg.find("the partition has 2 ranks, the transport's world has 3") != std::string::npos);
}

TEST_CASE("serve.kv_blocks: first-fit runs of blocks, freed on completion, refused when no run "
          "is free") {
  serve::KvBlockManager kv(16, 10);
  CHECK(kv.rows() == 160);
  const auto a = kv.allocate(40);  // 3 blocks
  REQUIRE(a);
  CHECK(*a == runtime::KvPlacement{0, 40});
  const auto b = kv.allocate(16);  // 1 block
  REQUIRE(b);
  CHECK(b->first_row == 48);
  const auto c = kv.allocate(90);  // 6 blocks: 4..9
  REQUIRE(c);
  CHECK(c->first_row == 64);
  CHECK(kv.used_blocks() == 10);
  CHECK_FALSE(kv.allocate(1));
  kv.free(*a);
  CHECK_FALSE(kv.allocate(49));  // 4 blocks: only a run of 3 is free
  const auto d = kv.allocate(48);
  REQUIRE(d);
  CHECK(d->first_row == 0);
  CHECK(kv.peak_blocks() == 10);
  kv.free(*d);
  test::error_of(Errc::InvalidUsage, [&] { kv.free(*d); });
  test::error_of(Errc::InvalidArgument, [] { serve::KvBlockManager(0, 4); });
}

TEST_CASE("serve.trace: Azure CSV and Mooncake JSONL parse into arrivals and lengths, malformed "
          "lines are named errors") {
  const auto az = serve::parse_trace(
      "TIMESTAMP,ContextTokens,GeneratedTokens\n"
      "2023-11-16 18:17:03.9799600,4808,10\n"
      "2023-11-16 18:17:04.0319600,3180,8\r\n"
      "2023-11-17 00:00:00,5,1",
      "az.csv");
  REQUIRE(az.size() == 3);
  CHECK(az[0].arrival_s == 0.0);
  CHECK(az[1].arrival_s == rel(0.052, 1e-9));
  CHECK(az[2].arrival_s == doctest::Approx(5 * 3600 + 42 * 60 + 56.02004).epsilon(1e-9));
  CHECK(az[1].prompt_tokens == 3180);
  CHECK(az[1].output_tokens == 8);
  CHECK(az[2].line == 4);
  const auto mc = serve::parse_trace(
      "{\"timestamp\": 0, \"input_length\": 6758, \"output_length\": 500, \"hash_ids\": [0]}\n"
      "{\"timestamp\": 1500, \"input_length\": 12, \"output_length\": 3}\n",
      "mc.jsonl");
  REQUIRE(mc.size() == 2);
  CHECK(mc[1].arrival_s == 1.5);
  CHECK(mc[0].output_tokens == 500);

  auto bad = [](std::string_view text, std::string_view what) {
    const auto msg = test::error_of(Errc::BadFile, [&] { serve::parse_trace(text, "t"); });
    CHECK_MESSAGE(msg.find(what) != std::string::npos, msg);
  };
  const std::string h = "TIMESTAMP,ContextTokens,GeneratedTokens\n";
  bad(h + "2023-11-16 18:17:03.9,12\n", "trace t line 2: expected 3 comma-separated fields");
  bad(h + "2023-11-16 18:17:03.9,12,x\n", "line 2: GeneratedTokens is not a whole number");
  bad(h + "2023-11-16 18:17:03.9,-3,4\n", "ContextTokens is not a whole number");
  bad(h + "16/11/2023 18:17,3,4\n", "TIMESTAMP is not YYYY-MM-DD");
  bad(h + "2023-11-16 18:17:03.9,3,4\n2023-11-16 18:17:02,3,4\n",
      "line 3: the timestamp is earlier than the line before");
  bad(h + "2023-11-16 18:17:03.9,0,4\n", "at least 1 token");
  bad("{\"timestamp\": 0, \"input_length\": 5}\n", "line 1: no number field \"output_length\"");
  bad("{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1}\n{oops\n",
      "line 2: not a JSON object");
  bad("id,prompt\n1,2\n", "expected the Azure header");
  bad(h, "no requests");
  test::error_of(Errc::BadFile, [] { serve::read_trace("/nonexistent/trace.csv"); });
}

TEST_CASE("serve.trace: requests from a trace are scaled, seeded, and a request longer than the "
          "context is a named error") {
  const auto cfg = ref().weights.config;  // seq_len 512, vocab 512
  std::vector<serve::TraceRequest> t = {{0.0, 100, 20, 2}, {3.0, 40, 8, 3}};
  serve::TraceReplay rp;
  rp.rate_scale = 2.0;
  rp.prompt_scale = 0.5;
  rp.output_scale = 0.5;
  const auto rs = serve::trace_requests(t, cfg, rp);
  REQUIRE(rs.size() == 2);
  CHECK(rs[1].arrival_s == 1.5);
  CHECK(rs[0].prompt.size() == 50);
  CHECK(rs[0].prompt[0] == model::Tokenizer::kBos);
  CHECK(rs[0].max_new_tokens == 10);
  for (int id : rs[0].prompt) CHECK((id == 1 || (id >= 3 && id < 512)));
  CHECK(serve::trace_requests(t, cfg, rp)[0].prompt == rs[0].prompt);
  t[1].prompt_tokens = 1200;
  const auto msg =
      test::error_of(Errc::InvalidArgument, [&] { serve::trace_requests(t, cfg, rp); });
  CHECK(msg.find("trace line 3: 600 prompt + 4 output tokens need 603 positions, the model's "
                 "seq_len is 512") != std::string::npos);
  rp.rate_scale = 0;
  test::error_of(Errc::InvalidArgument, [&] { serve::trace_requests(t, cfg, rp); });
}

TEST_CASE("serve.trace: the shared Azure and Mooncake traces parse whole") {
  for (const auto& [file, rows] :
       {std::pair{"AzureLLMInferenceTrace_code.csv", 8819},
        std::pair{"AzureLLMInferenceTrace_conv.csv", 19366},
        std::pair{"mooncake_conversation_trace.jsonl", 12031},
        std::pair{"mooncake_synthetic_trace.jsonl", 3993}}) {
    const auto path = kShared / "traces" / file;
    if (!test::have_data(path)) return;
    const auto t = serve::read_trace(path);
    CHECK(static_cast<int>(t.size()) == rows);
  }
}

TEST_CASE("cli.serve: replays a trace with even and static splits on the same arrivals, metrics "
          "JSON and Timelines, a malformed line and a too-long request are named errors" *
          doctest::skip(std::string_view(BRIGADE_CLI).empty())) {
  test::TempDir dir("brigade-serve");
  const auto csv = dir / "trace.csv";
  {
    std::ofstream out(csv);
    out << "TIMESTAMP,ContextTokens,GeneratedTokens\n"
           "2023-11-16 18:17:03.9799600,480,100\n"
           "2023-11-16 18:17:04.0319600,318,80\n"
           "2023-11-16 18:17:04.5,120,200\n"
           "2023-11-16 18:17:05,1000,60";
  }
  const std::string model = "--model " + (kModels / "stories260K.bin").string() +
                            " --tokenizer " + (kModels / "tok512.bin").string();
  const auto metrics = dir / "m.json";
  const auto timeline = dir / "tl.json";
  auto r = test::run_cli("serve --trace " + csv.string() + " " + model +
                         " --stages 2 --rebalance even,static --prompt-scale 0.1 "
                         "--output-scale 0.1 --rate-scale 4 --profile none --metrics " +
                         metrics.string() + " --timeline " + timeline.string());
  INFO(r.err);
  REQUIRE(r.rc == 0);
  std::ifstream mf(metrics);
  const auto m = nlohmann::json::parse(mf);
  CHECK(m["requests"] == 4);
  REQUIRE(m["runs"].size() == 2);
  CHECK(m["runs"][0]["rebalance"] == "even");
  CHECK(m["runs"][1]["rebalance"] == "static");
  for (const auto& run : m["runs"]) {
    CHECK(run["generated_tokens"] == 10 + 8 + 20 + 6);  // the trace's outputs x 0.1
    for (const char* k : {"e2e_s", "ttft_s", "tpot_s"}) {
      CHECK(run[k]["p50"].get<double>() > 0);
      CHECK(run[k]["p99"].get<double>() >= run[k]["p50"].get<double>());
      CHECK(run[k]["mean"].get<double>() > 0);
    }
    CHECK(run["e2e_s"]["mean"].get<double>() > run["ttft_s"]["mean"].get<double>());
    CHECK(run["throughput_tokens_per_s"].get<double>() > 0);
    CHECK(run["moves"].empty());
    REQUIRE(run["predictor"].size() == 2);
    CHECK(run["predictor"][1]["rounds"].get<int>() > 0);
    CHECK(run["predictor"][1]["heldout_mape"].get<double>() > 0);
  }
  CHECK(m["runs"][1].contains("e2e_mean_improvement_vs_even"));
  CHECK(fs::exists(dir / "tl.even.json"));
  CHECK(fs::exists(dir / "tl.static.json"));

  {
    std::ofstream out(dir / "bad.csv");
    out << "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,10,2\n"
           "2023-11-16 18:17:04.0,ten,2\n";
  }
  r = test::run_cli("serve --trace " + (dir / "bad.csv").string() + " " + model);
  CHECK(r.rc == 2);
  CHECK(r.err.find("error (BadFile): trace " + (dir / "bad.csv").string() +
                   " line 3: ContextTokens is not a whole number") != std::string::npos);
  r = test::run_cli("serve --trace " + csv.string() + " " + model + " --prompt-scale 0.5 --output-scale 0.5");
  CHECK(r.rc == 2);
  CHECK(r.err.find("trace line 2: 240 prompt + 50 output tokens need 289 positions") ==
        std::string::npos);  // line 2 fits: 289 <= 512
  CHECK(r.err.find("trace line 5: 500 prompt + 30 output tokens need 529 positions, the model's "
                   "seq_len is 512") != std::string::npos);
  r = test::run_cli("serve --trace " + csv.string() + " " + model + " --rebalance bogus");
  CHECK(r.rc == 2);
  CHECK(r.err.find("--rebalance bogus: expected even, static or dynamic") != std::string::npos);
}

TEST_CASE("serve.predictor: the online fit recovers a stage's cost law from its rounds, before any "
          "round it predicts the calibrated prior") {
  const model::ModelSpec spec(ref().weights.config);
  const auto part = partition::uniform(spec, 2);
  serve::StageLatencyPredictor p(cost::LatencyEstimator(spec, model::roofline_layer_seconds()), part);
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> seqs(0, 8), chunk(0, 64), pos(1, 400);
  auto round = [&] {
    serve::RoundFeatures f;
    f.decode_seqs = seqs(rng);
    f.decode_context = pos(rng);
    f.prefill_tokens = chunk(rng);
    f.prefill_seqs = f.prefill_tokens > 0 ? 1 : 0;
    f.prefill_context = pos(rng);
    f.sampled = f.decode_seqs + f.prefill_seqs;
    if (f.sampled == 0) f.decode_seqs = f.sampled = 1;
    return f;
  };
  // This "machine": decodes 2x slower and prompts 0.5x the prior, 0.3 ms per sampled sequence on
  // the tail, a 0.2 ms fixed cost per round.
  auto truth = [&](int v, const serve::RoundFeatures& f) {
    const auto x = p.features(v, f);
    return 2.0 * x[0] + 0.5 * x[1] + 0.3 * x[2] + 0.2 * x[3];
  };
  const auto f0 = round();
  for (int v = 0; v < 2; ++v) CHECK(p.predict(v, f0) == rel(p.prior(v, f0)));
  for (int i = 0; i < 40; ++i) {
    const auto f = round();
    for (int v = 0; v < 2; ++v) p.observe(v, f, truth(v, f));
  }
  // Within 5% of the truth on rounds it has not seen (relative: test::rel, since doctest's
  // Approx otherwise adds its scale 1 to seconds of this size and cannot fail). The fit is not
  // exact: the ridge settles the direction in which the near-constant decode prior and the
  // fixed cost cannot be told apart, and the context the prior prices moves along it.
  for (int i = 0; i < 20; ++i) {
    const auto f = round();
    for (int v = 0; v < 2; ++v)
      CHECK(p.predict(v, f) == rel(truth(v, f), 0.05));
  }
  // (The decode prior is nearly constant in the roofline, a weight-bound pass, so its weight and
  // the fixed cost's are not told apart; their sum is, and so is the sampler's.)
  CHECK(p.weights(1)[2] == rel(0.3, 0.05));
  CHECK(p.observations(0) == 40);
  test::error_of(Errc::InvalidArgument, [&] { p.observe(0, f0, 0.0); });
  test::error_of(Errc::InvalidArgument, [&] { (void)p.features(2, f0); });
}

TEST_CASE("serve.predictor: a fit that weighs a feature negatively predicts 0 s, not a negative "
          "time, on a round past the ones it learned from") {
  const model::ModelSpec spec(ref().weights.config);
  const auto part = partition::uniform(spec, 2);
  serve::StageLatencyPredictor p(cost::LatencyEstimator(spec, model::roofline_layer_seconds()), part);
  auto chunk = [](int tokens) {
    serve::RoundFeatures f;
    f.prefill_tokens = tokens;
    f.prefill_seqs = 1;
    f.prefill_context = tokens / 2.0;
    f.sampled = 1;
    return f;
  };
  // This "machine" gets faster with longer prompt chunks over the chunks observed (16-64
  // tokens, where the prior grows 4x): 2 ms fixed, less c per second of the prior, c set so every
  // observed round takes >= 1 ms.
  const double most = p.features(0, chunk(64))[1];
  const double c = 1e-3 / most;
  for (int i = 0; i < 42; ++i) {
    const auto f = chunk(16 + 8 * (i % 7));
    const auto x = p.features(0, f);
    p.observe(0, f, 2.0 * x[3] - c * x[1]);
  }
  CHECK(p.weights(0)[1] < 0.0);
  // A 512-token chunk: w . x is far below zero (its prior is ~17x the largest observed).
  const auto big = chunk(512);
  const auto x = p.features(0, big);
  double wx = 0.0;
  for (int i = 0; i < serve::StageLatencyPredictor::kFeatures; ++i)
    wx += p.weights(0)[static_cast<std::size_t>(i)] * x[static_cast<std::size_t>(i)];
  CHECK(wx < -1e-3);
  CHECK(p.predict(0, big) == 0.0);
  // Inside the observed rounds the fit is what it learned.
  const auto f40 = chunk(40);
  CHECK(p.predict(0, f40) == rel(2.0 * p.features(0, f40)[3] - c * p.features(0, f40)[1], 0.02));
}

TEST_CASE("serve.predictor: every round of a run is measured on every stage and predicted online "
          "with a finite error") {
  const model::ModelSpec spec(ref().weights.config);
  const auto part = partition::uniform(spec, 2);
  const auto w = reference_workload({0, 0.01, 0.02, 0.03});
  serve::ServeOptions o;
  o.inference.sampler.temperature = 0.0f;
  const auto rep = serve::serve(ref().weights, part, w.requests, o);
  REQUIRE(!rep.round_features.empty());
  int tokens = 0;
  for (const auto& f : rep.round_features) tokens += f.sampled;
  CHECK(tokens == rep.generated_tokens);  // every sampled token belongs to one recorded round
  const auto rounds = serve::stage_rounds(rep);
  CHECK(rounds.size() == 2 * rep.round_features.size());
  const serve::StageLatencyPredictor fresh(
      cost::LatencyEstimator(spec, model::roofline_layer_seconds()), part);
  const auto err = serve::evaluate_predictor(rep, fresh);
  REQUIRE(err.size() == 2);
  for (const auto& e : err) {
    CHECK(e.rounds == static_cast<std::int64_t>(rep.round_features.size()));
    CHECK(std::isfinite(e.online_mape));
    CHECK(e.heldout_mape > 0);
    CHECK(e.prior_heldout_mape > 0);
  }
  test::error_of(Errc::InvalidArgument, [&] { serve::evaluate_predictor(rep, fresh, 1.0); });
}

TEST_CASE("serve.timeline: the first stage's wait for the next arrival is idle time, not inside "
          "its F") {
  // The second request arrives 0.4 s after the first: the book sleeps in between, inside the
  // action that builds stage 0's next micro-batch. The Timeline shows that sleep as a gap
  // (and stage_rounds / evaluate_predictor measure forwards only), not as a 0.4 s F.
  const model::ModelSpec spec(ref().weights.config);
  const auto w = reference_workload({0, 0.4});
  serve::ServeOptions o;
  o.inference.sampler.temperature = 0.0f;
  const auto rep = serve::serve(ref().weights, partition::uniform(spec, 2), w.requests, o);
  check_tokens(w, rep);
  std::vector<std::pair<double, double>> f0;  // stage 0's F intervals
  for (const auto& iv : rep.timeline.intervals())
    if (iv.op == Op::F && iv.virtual_stage == 0) f0.emplace_back(iv.start, iv.end);
  REQUIRE(f0.size() >= 2);
  std::sort(f0.begin(), f0.end());
  double longest = 0, widest_gap = 0;
  for (std::size_t i = 0; i < f0.size(); ++i) {
    longest = std::max(longest, f0[i].second - f0[i].first);
    if (i > 0) widest_gap = std::max(widest_gap, f0[i].first - f0[i - 1].second);
  }
  CHECK(longest < 0.2);      // a stories260K forward takes milliseconds
  CHECK(widest_gap > 0.25);  // the wait for the second arrival
  for (const auto& r : serve::stage_rounds(rep)) CHECK(r.seconds < 0.2);
}

// ---- DynaPipe's live rebalancing: layer moves with asynchronous KV-cache migration ----------

TEST_CASE("serve.rebalance: greedy tokens equal run.c's while layers move mid-request, 2-4 "
          "stages, moves forced every few rounds, parts spread over rounds") {
  const model::ModelSpec spec(ref().weights.config);
  // Eight requests in flight at once and staggered: every move migrates live KV caches.
  const auto w = reference_workload({0, 0, 0.002, 0.004, 0.006, 0, 0.008, 0.01});
  for (int stages = 2; stages <= 4; ++stages) {
    CAPTURE(stages);
    serve::ServeOptions o;
    o.microbatches = 2;
    o.max_seqs = 4;
    o.max_batch_tokens = 8;  // prompts are chunked while layers move
    o.prefill_chunk = 3;
    o.inference.sampler.temperature = 0.0f;
    // Parts of 8 KiB: a stories260K layer (about 200 KB of weights) and its KV rows take
    // several rounds to migrate, so moves overlap decodes, prefills and new arrivals.
    o.inference.migration_part_bytes = 8 << 10;
    serve::RebalanceOptions rb;
    rb.force_every = 3;
    o.rebalance = rb;
    const auto rep = serve::serve(ref().weights, partition::uniform(spec, stages), w.requests, o);
    check_tokens(w, rep);
    // Moves happened, across every boundary and in both directions, each after its parts.
    REQUIRE(rep.moves.size() >= 4);
    std::set<std::pair<int, int>> seen;
    for (const auto& m : rep.moves) {
      seen.insert({m.from, m.to});
      CHECK(m.forced);
      CHECK(m.first_round == m.ordered_round + 1);
      CHECK(m.switch_round > m.first_round + 1);  // at least two rounds of parts
      CHECK(std::abs(m.from - m.to) == 1);
    }
    for (int b = 0; b + 1 < stages; ++b) CHECK((seen.count({b, b + 1}) || seen.count({b + 1, b})));
    CHECK(seen.size() >= 2);
    // The plans follow the moves, and the Timeline holds the parts: every MIGRATE on the rank
    // of its `from`, every MIGRATE_RECV on the rank of its `to`, with their bytes.
    REQUIRE(rep.plans.size() == rep.moves.size() + 1);
    std::int64_t sent = 0, received = 0;
    int sends = 0, recvs = 0;
    for (const auto& iv : rep.timeline.intervals()) {
      if (iv.op == Op::Migrate) {
        sent += iv.bytes;
        ++sends;
      }
      if (iv.op == Op::MigrateRecv) {
        received += iv.bytes;
        ++recvs;
      }
    }
    CHECK(sends == recvs);
    CHECK(sent == received);
    CHECK(sent > static_cast<std::int64_t>(rep.moves.size()) * 200000);  // weights at least
    const auto impact = serve::migration_impact(rep);
    CHECK(impact.migrations == static_cast<int>(rep.moves.size()));
    CHECK(impact.migration_bytes == sent + received);
    // Every round's seconds of every stage came back to stage 0's rank with its tokens.
    REQUIRE(rep.measured_rounds.size() == static_cast<std::size_t>(stages));
    for (const int n : rep.measured_rounds)
      CHECK(n == static_cast<int>(rep.round_features.size()));
  }
}

TEST_CASE("serve.rebalance: seeded top-p sampling is unchanged by layer moves") {
  const model::ModelSpec spec(ref().weights.config);
  const auto w = reference_workload({0, 0.002, 0.004, 0.006, 0.008});
  std::vector<std::vector<int>> tokens[2];
  for (int dynamic = 0; dynamic < 2; ++dynamic) {
    serve::ServeOptions o;
    o.microbatches = 3;
    o.inference.sampler = {1.0f, 0.9f, 11};
    o.inference.migration_part_bytes = 16 << 10;
    if (dynamic) {
      serve::RebalanceOptions rb;
      rb.force_every = 2;
      o.rebalance = rb;
    }
    const auto rep = serve::serve(ref().weights, partition::uniform(spec, 3), w.requests, o);
    CHECK((dynamic == 0 || rep.moves.size() >= 3));
    for (const auto& m : rep.requests) tokens[dynamic].push_back(m.tokens);
  }
  CHECK(tokens[0] == tokens[1]);
}

TEST_CASE("serve.rebalance: the rebalancer moves a boundary decoder off the predicted slowest "
          "stage only after the imbalance persists, then waits out its cooldown") {
  const auto& weights = ref().weights;
  const model::ModelSpec spec(weights.config);
  const auto even = partition::uniform(spec, 2);  // [emb + 3 decoders | 2 decoders + tail]
  serve::RebalanceOptions o;
  o.patience = 3;
  o.cooldown = 5;
  o.warmup = 8;
  o.threshold = 0.1;
  o.min_gain = 0.02;  // a tail-held decoder of stories260K is a few percent of its stage
  serve::Rebalancer rb(weights, even, 2, 1 << 20, o);
  // Stage 1 takes 3x its prior, stage 0 its prior: stage 1 is slowest by far. Both
  // micro-batches decode every round, so the pipeline is full and a round lasts the busier
  // stage's two micro-batches.
  std::vector<serve::RoundFeatures> rounds;
  auto feed = [&](int round, double slow) {
    for (int mb = 0; mb < 2; ++mb) {
      const auto f = decode_round(mb, round);
      rounds.push_back(f);
      const auto& plan = rb.plan_at(round);
      const auto& pred = rb.predictor();
      rb.observe(0, f, pred.prior(plan, 0, f) + 1e-4);
      rb.observe(1, f, slow * (pred.prior(plan, 1, f) + 1e-4));
    }
  };
  int round = 0;
  for (; round < 3; ++round) {
    feed(round, 3.0);
    CHECK_FALSE(rb.decide(round, 0.0, rounds, 100));  // warming up: 8 observations per stage
  }
  // The imbalance must persist `patience` decisions: two pass, the third moves.
  feed(round, 3.0);
  CHECK_FALSE(rb.decide(round++, 0.0, rounds, 100));
  feed(round, 3.0);
  CHECK_FALSE(rb.decide(round++, 0.0, rounds, 100));
  feed(round, 3.0);
  const auto order = rb.decide(round, 1.5, rounds, 100);
  REQUIRE(order);
  CHECK(order->from == 1);
  CHECK(order->to == 0);
  CHECK(order->parts >= 2);
  REQUIRE(rb.moves().size() == 1);
  const auto& m = rb.moves()[0];
  CHECK(m.layer == even.stage(1).first);
  CHECK(m.switch_round == round + 1 + order->parts);
  CHECK(m.predicted_round_after_s < m.predicted_round_s);
  CHECK(rb.plan_at(m.switch_round).stage(0).last == even.stage(0).last + 1);
  CHECK(rb.plan_at(m.switch_round - 1) == even);
  // Nothing while the move is under way, nor during the cooldown after its switch.
  for (++round; round < m.switch_round + o.cooldown; ++round) {
    feed(round, 3.0);
    CHECK_FALSE(rb.decide(round, 0.0, rounds, 100));
  }
  // A balanced load never moves.
  serve::Rebalancer calm(weights, even, 2, 1 << 20, o);
  std::vector<serve::RoundFeatures> flat;
  for (int r = 0; r < 30; ++r) {
    serve::RoundFeatures f;
    f.round = r;
    f.decode_seqs = 4;
    f.decode_context = 40;
    flat.push_back(f);
    // Both stages take the same measured seconds.
    calm.observe(0, f, 1e-3);
    calm.observe(1, f, 1e-3);
    CHECK_FALSE(calm.decide(r, 0.0, flat, 100));
  }
  // move_layer: only decoders move, and a stage keeps a layer.
  CHECK_FALSE(serve::move_layer(even, 1, 0)->stage(1).first == even.stage(1).first);
  // The embedding stays on stage 0: a stage 0 of one layer cannot give it away.
  const partition::Partition tiny(spec.num_layers(), 2,
                                  {{0, 0, 1}, {1, 1, spec.num_layers()}});
  CHECK_FALSE(serve::move_layer(tiny, 0, 1));
  CHECK(serve::move_layer(even, 0, 1)->stage(1).first == even.stage(1).first - 1);
  CHECK(test::error_of(Errc::InvalidArgument, [&] { (void)serve::move_layer(even, 0, 0); })
            .find("expected two neighbouring stages") != std::string::npos);
  CHECK(test::error_of(Errc::InvalidArgument, [&] {
          serve::RebalanceOptions bad;
          bad.patience = 0;
          serve::Rebalancer(weights, even, 2, 1, bad);
        }).find("patience 0 (>= 1)") != std::string::npos);
}

TEST_CASE("serve.rebalance: each move is checked against the rounds after its switch, and the "
          "next move must gain beyond the error found there") {
  const auto& weights = ref().weights;
  const model::ModelSpec spec(weights.config);
  const auto even = partition::uniform(spec, 2);  // [emb + 3 decoders | 2 decoders + tail]
  const int hot = even.stage(1).first;  // the decoder the first move hands to stage 0
  serve::RebalanceOptions o;
  o.patience = 1;
  o.cooldown = 4;
  o.warmup = 64;  // a fit over enough contexts and batch sizes to hold its weights
  o.threshold = 0.1;
  o.min_gain = 0.02;
  serve::Rebalancer rb(weights, even, 2, 1 << 20, o);
  const auto& pred = rb.predictor();
  auto round_of = [](int round, int mb) {
    return decode_round(mb, round, 1 + round % 7, 10.0 + (round * 13) % 97);
  };
  // Stage 0 takes its prior, except that once it holds `hot` it takes 1.5x (a cost the prior
  // does not see: the fit of the first move prices stage 0 a third low after it); stage 1 its
  // prior plus c ms per sampled sequence, c making it the slowest stage (a fit the predictor's
  // features hold exactly before the move).
  const auto first_round = round_of(0, 0);
  const double c = (2.6 * pred.prior(even, 0, first_round) - pred.prior(even, 1, first_round)) /
                   (1e-3 * first_round.sampled);
  REQUIRE(c > 0);
  std::vector<serve::RoundFeatures> rounds;
  double p0 = 0, p1 = 0;  // after the first switch while it is checked: the two stages' truth
  for (int round = 0; round < 400; ++round) {
    for (int mb = 0; mb < 2; ++mb) {
      const auto f = round_of(round, mb);
      rounds.push_back(f);
      const auto& plan = rb.plan_at(round);
      const bool holds = plan.stage(0).last > hot;
      const double s0 = pred.prior(plan, 0, f);
      const double s1 = pred.prior(plan, 1, f) + c * 1e-3 * f.sampled;
      if (rb.moves().size() == 1 && round >= rb.moves()[0].switch_round &&
          rb.moves()[0].checked_rounds < 256) {
        p0 += s0;
        p1 += s1;
      }
      rb.observe(0, f, (holds ? 1.5 : 1.0) * s0);
      rb.observe(1, f, s1);
    }
    (void)rb.decide(round, 0.0, rounds, 100);
  }
  REQUIRE(rb.moves().size() >= 1);
  const auto& first = rb.moves()[0];
  CHECK(first.from == 1);
  CHECK(first.to == 0);
  CHECK(first.layer == hot);
  CHECK(first.required_gain == rel(o.min_gain));  // nothing checked before
  // The check, in closed form: the first move's fit (both stages exact before it) prices the
  // rounds after its switch at p0 + p1, which measured 1.5 p0 + p1; over the stage rounds from
  // the switch to the second move's order, at most 2 x the window (128 rounds).
  const int expected = rb.moves().size() > 1
                           ? 2 * 2 * (rb.moves()[1].ordered_round - first.switch_round + 1)
                           : 256;
  CHECK(first.checked_rounds == std::min(expected, 256));
  REQUIRE(first.checked_rounds >= 16);
  const double ratio = (p0 + p1) / (1.5 * p0 + p1);
  CHECK(ratio < 0.95);  // an error worth checking
  CHECK(first.checked_measured_s == rel(1.5 * p0 + p1, 1e-9));
  CHECK(first.checked_predicted_s / first.checked_measured_s ==
        rel(ratio, 0.01));
  // Once the check is in, the next candidate (stage 1's last decoder to stage 0) is predicted
  // to gain more than min_gain but not min_gain plus that error: it is evaluated, not made.
  REQUIRE(rb.moves().size() == 1);
  const int checked_by = first.switch_round + 256 / 4;  // 2 stages x 2 micro-batches a round
  int refused = 0;
  for (const auto& e : rb.evaluations()) {
    if (e.round < checked_by) continue;
    INFO("the evaluation of round " << e.round);
    CHECK(e.required_gain == rel(o.min_gain + (1.0 - ratio), 0.01));
    CHECK(e.gain() > o.min_gain);
    CHECK(e.gain() < e.required_gain);
    CHECK_FALSE(e.moved);
    ++refused;
  }
  CHECK(refused > 100);
}

TEST_CASE("serve.rebalance: a decision weighs the last 64 rounds of every micro-batch, so a few "
          "rounds of another mix do not move a layer the longer span calls balanced") {
  const auto& weights = ref().weights;
  const model::ModelSpec spec(weights.config);
  const auto even = partition::uniform(spec, 2);
  constexpr int kMicrobatches = 2;
  // 124 prompt-chunk rounds on which both stages take the same seconds, then 4 decode rounds on
  // which the tail stage takes 3x the first: the load of the last 128 rounds is balanced (the
  // tail is 1.6% over the mean), the load of the last 4 is not (1.5x the mean). Micro-batch
  // rounds of the two micro-batches alternate (64 executor rounds).
  std::vector<serve::RoundFeatures> rounds;
  for (int r = 0; r < 128; ++r) {
    serve::RoundFeatures f;
    f.microbatch = r % kMicrobatches;
    f.round = r / kMicrobatches;
    if (r < 124) {
      f.prefill_tokens = 64;
      f.prefill_seqs = 1;
      f.prefill_context = 32.5;
    } else {
      f.decode_seqs = 4;
      f.decode_context = 40;
    }
    rounds.push_back(f);
  }
  auto run = [&](int window) {
    serve::RebalanceOptions o;
    o.patience = 1;
    o.warmup = 4;
    o.threshold = 0.1;
    o.min_gain = 0.02;
    o.window = window;
    serve::Rebalancer rb(weights, even, kMicrobatches, 1 << 20, o);
    const auto& pred = rb.predictor();
    for (const auto& f : rounds) {  // the fit has seen every round before the decisions
      // Stage 0 at its prior; stage 1 at stage 0's seconds on prompt chunks and at 3x them on
      // decodes (a fit the predictor's features hold exactly: w = [3 D0/D1, P0/P1, 0, 0]).
      const double s0 = pred.prior(even, 0, f);
      rb.observe(0, f, s0);
      rb.observe(1, f, f.decode_seqs > 0 ? 3.0 * s0 : s0);
    }
    std::vector<int> moved;
    for (int r = 124; r < 128; ++r)
      if (rb.decide(r, 0.0, std::span(rounds).first(static_cast<std::size_t>(r + 1)), 100))
        moved.push_back(r);
    return moved;
  };
  CHECK(run(0).empty());                      // the default window: 128 rounds
  CHECK(run(64 * kMicrobatches).empty());     // the same, spelled out
  // The last 4 rounds: once decode rounds are most of them, a layer moves (once: the move is
  // then under way).
  CHECK(run(4).size() == 1);
}

TEST_CASE("serve.rebalance: a layer that makes whichever stage holds it slow is not shuttled "
          "back and forth: the error its first move was checked with gates the way back, and "
          "without that gate a reversal needs twice the gain and each one doubles the cooldown") {
  const auto& weights = ref().weights;
  const model::ModelSpec spec(weights.config);
  const auto even = partition::uniform(spec, 2);  // [emb + 3 decoders | 2 decoders + tail]
  const int hot = even.stage(1).first;  // the layer that misbehaves, wherever it runs
  serve::RebalanceOptions o;
  o.patience = 1;
  o.cooldown = 4;
  o.warmup = 2;
  o.threshold = 0.1;
  o.min_gain = 0.05;
  auto shuttle = [&](const serve::RebalanceOptions& opts) {
    serve::Rebalancer rb(weights, even, 2, 1 << 20, opts);
    std::vector<serve::RoundFeatures> rounds;
    for (int round = 0; round < 1500; ++round) {
      for (int mb = 0; mb < 2; ++mb) {  // both micro-batches decode: the pipeline is full
        const auto f = decode_round(mb, round);
        rounds.push_back(f);
        const auto& plan = rb.plan_at(round);
        for (int v = 0; v < 2; ++v) {
          const auto& st = plan.stage(v);
          // The prior cannot see it: the stage holding `hot` takes 4x its prior.
          const bool holds = st.first <= hot && hot < st.last;
          rb.observe(v, f, (holds ? 4.0 : 1.0) * rb.predictor().prior(plan, v, f) + 1e-5);
        }
      }
      (void)rb.decide(round, 0.0, rounds, 100);
    }
    return rb;
  };
  // The error of the first move's prediction gates the next: the predictor priced stage 0
  // with `hot` at its prior and it took 4x, so every move back must gain that error on top of
  // twice min_gain, and none does.
  {
    const auto rb = shuttle(o);
    REQUIRE(rb.moves().size() == 1);
    const auto& m = rb.moves().front();
    CHECK(m.layer == hot);
    REQUIRE(m.checked_rounds >= 16);
    CHECK(rb.moved_prediction_error() > 0.1);
    int refused = 0;
    for (const auto& e : rb.evaluations())
      if (e.round > m.switch_round + 64) {
        CHECK(e.required_gain >= 2 * o.min_gain + rb.moved_prediction_error() - 1e-12);
        CHECK_FALSE(e.moved);
        refused += e.gain() > 2 * o.min_gain;  // a reversal min_gain alone would have made
      }
    CHECK(refused > 0);
  }
  // Without that gate (min_gain alone), the hysteresis of reversals holds the layer back.
  serve::RebalanceOptions alone = o;
  alone.gate_on_moved_error = false;
  const auto rb = shuttle(alone);
  const auto& moves = rb.moves();
  REQUIRE(moves.size() >= 3);  // the layer went back at least twice
  CHECK(moves.front().layer == hot);
  int reversals = 0;
  for (std::size_t k = 1; k < moves.size(); ++k) {
    const auto& a = moves[k - 1];
    const auto& b = moves[k];
    const bool reversal = b.layer == a.layer && b.from == a.to && b.to == a.from;
    reversals = reversal ? reversals + 1 : 0;
    INFO("move " << k << ": ordered in round " << b.ordered_round << ", the one before switched "
                 << "in round " << a.switch_round);
    if (reversal) {
      CHECK(b.predicted_round_after_s <= (1.0 - 2 * o.min_gain) * b.predicted_round_s);
      // The cooldown after the move before this one was doubled once per earlier reversal.
      CHECK(b.ordered_round >= a.switch_round + (o.cooldown << (reversals - 1)));
    }
  }
  // Backed off: the gaps grow, so the last moves are far apart.
  const auto& last = moves.back();
  const auto& before = moves[moves.size() - 2];
  CHECK(last.ordered_round - before.switch_round >= 2 * o.cooldown);
}

TEST_CASE("serve.rebalance: a move is judged by the simulated pipeline round, so with one "
          "micro-batch live a move that evens the stages but costs more in all is not made") {
  const auto& weights = ref().weights;
  const model::ModelSpec spec(weights.config);
  const auto even = partition::uniform(spec, 2);  // [emb + 3 decoders | 2 decoders + tail]
  serve::RebalanceOptions o;
  o.patience = 1;
  o.warmup = 4;
  o.threshold = 0.1;
  o.min_gain = 0.02;
  // Stage 0's layers take 2x their prior; stage 1 takes its prior plus a sampling cost c ms per
  // sampled sequence that makes it the slowest stage (both fits exact in the predictor's
  // features). Moving a decoder from stage 1 to stage 0 lowers stage 1 by its prior d and raises
  // stage 0 by 2d: the slowest stage drops, the two stages' sum rises by d.
  auto round_of = [](int r, int mb) { return decode_round(mb, r, 3 + r % 3, 20.0 + r % 7); };
  auto run = [&](int live_microbatches) {
    serve::Rebalancer rb(weights, even, 2, 1 << 20, o);
    const auto& pred = rb.predictor();
    const auto ref_round = round_of(0, 0);
    const double c = (2.6 * pred.prior(even, 0, ref_round) - pred.prior(even, 1, ref_round)) /
                     (1e-3 * ref_round.sampled);
    REQUIRE(c > 0);
    std::vector<serve::RoundFeatures> rounds;
    for (int r = 0; r < 24; ++r)
      for (int mb = 0; mb < live_microbatches; ++mb) {
        const auto f = round_of(r, mb);
        rounds.push_back(f);
        rb.observe(0, f, 2.0 * pred.prior(even, 0, f));
        rb.observe(1, f, pred.prior(even, 1, f) + c * 1e-3 * f.sampled);
      }
    const auto order = rb.decide(23, 0.0, rounds, 100);
    // The move's own prediction, in closed form: stage 0 at 2x, stage 1 at 1x plus sampling.
    const auto moved = serve::move_layer(even, 1, 0);
    REQUIRE(moved);
    double t0 = 0, t1 = 0, t0m = 0, t1m = 0;
    for (const auto& f : rounds) {
      t0 += 2.0 * pred.prior(even, 0, f);
      t1 += pred.prior(even, 1, f) + c * 1e-3 * f.sampled;
      t0m += 2.0 * pred.prior(*moved, 0, f);
      t1m += pred.prior(*moved, 1, f) + c * 1e-3 * f.sampled;
    }
    CHECK(t1 > 1.1 * (t0 + t1) / 2);         // stage 1 is over the threshold
    CHECK(std::max(t0m, t1m) < 0.98 * t1);   // the slowest stage would gain over min_gain
    CHECK(t0m + t1m > t0 + t1);              // the sum of the stages would not
    if (order) {
      CHECK(order->from == 1);
      CHECK(order->to == 0);
      const auto& m = rb.moves().back();
      // Full pipeline: a round is the busier stage's two micro-batches (t1 and t0m, t1m sum
      // both), plus the first round's fill spread over the 24.
      const double before = t1 / 24, after = std::max(t0m, t1m) / 24;
      CHECK(m.predicted_round_s >= before);
      CHECK(m.predicted_round_s < 1.06 * before);
      CHECK(m.predicted_round_after_s >= after);
      CHECK(m.predicted_round_after_s < 1.06 * after);
    }
    return order.has_value();
  };
  CHECK_FALSE(run(1));  // one micro-batch live: a round is the sum of the stages
  CHECK(run(2));        // both live: the busier stage
}

TEST_CASE("serve.migration_impact: a round's time leaves out the book's sleep for an arrival, and "
          "windows without a migration give the baseline") {
  serve::ServeReport rep;
  rep.timeline = Timeline(1);
  // 20 rounds of 1 s on virtual stage 0, except rounds 10 and 11 (a migration, 1.2 s each),
  // and a 5 s sleep for an arrival before round 11's F, which falls in round 10's window.
  double at = 0;
  for (int r = 0; r < 20; ++r) {
    if (r == 11) at += 5.0;
    Interval iv;
    iv.op = Op::F;
    iv.chunk = r;
    iv.start = at;
    iv.end = at + 0.1;
    rep.timeline.add(iv);
    serve::RoundFeatures f;
    f.round = r;
    f.idle_s = r == 11 ? 5.0 : 0.0;
    rep.round_features.push_back(f);
    at += r == 10 || r == 11 ? 1.2 : 1.0;
  }
  serve::LayerMove m;
  m.ordered_round = 10;
  m.first_round = 11;
  m.switch_round = 11;
  rep.moves.push_back(m);
  const auto impact = serve::migration_impact(rep);
  CHECK(impact.max_round_ratio == doctest::Approx(1.2));
  CHECK(impact.median_max_round_ratio == doctest::Approx(1.2));
  CHECK(impact.mean_round_ratio == doctest::Approx(1.2));
  // Windows of 2 rounds from round 0, all but [10, 11]; the last round has no length.
  CHECK(impact.baseline_windows == 8);
  CHECK(impact.baseline_max_round_ratio == doctest::Approx(1.0));
  CHECK(impact.baseline_mean_round_ratio == doctest::Approx(1.0));
  // Without the sleep recorded, round 10 lasts 6.2 s to round 11's start.
  rep.round_features[11].idle_s = 0;
  const auto raw = serve::migration_impact(rep);
  CHECK(raw.max_round_ratio == doctest::Approx(6.2));
  CHECK(raw.mean_round_ratio == doctest::Approx(3.7));
}

TEST_CASE("serve.migration_impact: a rank's migration seconds count in the round windows they "
          "overlap, so a share is at most the window and the added latency is t / (t - m)") {
  serve::ServeReport rep;
  rep.timeline = Timeline(2);
  auto interval = [](int rank, Op op, int virtual_stage, int round, double start, double end) {
    Interval iv;
    iv.rank = rank;
    iv.op = op;
    iv.virtual_stage = virtual_stage;
    iv.chunk = round;
    iv.start = start;
    iv.end = end;
    return iv;
  };
  // Rounds start on virtual stage 0 at 0, 1, 2, 3, 4, 5, then 6.5, 7.5, 8.5, 9.5: every round
  // takes 1 s except round 5 (1.5 s).
  for (int r = 0; r < 10; ++r) {
    const double at = r <= 5 ? r : r + 0.5;
    rep.timeline.add(interval(0, Op::F, 0, r, at, at + 0.1));
  }
  serve::LayerMove m;
  m.ordered_round = 4;
  m.first_round = 5;
  m.switch_round = 5;
  rep.moves.push_back(m);
  // Rank 1 sends round 4's part over [4.5, 5.25): 0.5 s in round 4's window, 0.25 s in round
  // 5's. Rank 0 receives it over [5.5, 6.25): 0.75 s of round 5's 1.5 s.
  auto send = interval(1, Op::Migrate, 1, 4, 4.5, 5.25);
  send.bytes = 1000;
  auto recv = interval(0, Op::MigrateRecv, 0, 4, 5.5, 6.25);
  recv.bytes = 1000;
  rep.timeline.add(send);
  rep.timeline.add(recv);
  const auto impact = serve::migration_impact(rep);
  CHECK(impact.migrations == 1);
  CHECK(impact.migration_bytes == 2000);
  CHECK(impact.migration_seconds == doctest::Approx(1.5));
  CHECK(impact.max_round_ratio == doctest::Approx(1.5));  // round 5 against the median 1 s
  // Round 4: rank 1 half of it; round 5: rank 0 half of it (rank 1 a sixth).
  CHECK(impact.max_migration_share == rel(0.5));
  CHECK(impact.max_added_ratio == doctest::Approx(2.0));
  // A rank that migrates through a whole window: the share is 1, the added ratio unbounded.
  rep.timeline.add(interval(1, Op::MigrateRecv, 1, 5, 5.25, 6.5));
  const auto whole = serve::migration_impact(rep);
  CHECK(whole.max_migration_share == doctest::Approx(1.0));
  CHECK(std::isinf(whole.max_added_ratio));
  CHECK_THROWS_WITH_AS(serve::migration_impact(rep, 0),
                       "migration_impact: neighbours = 0, expected >= 1", Error);
}
