// Tensor parallelism inside a stage (Megatron-LM's split, brigade/tp/tensor_parallel.hpp) on the
// real stories260K (8 query heads, 4 KV heads, hidden 172, vocabulary 512): greedy tokens equal
// llama2.c's run.c (models/reference/stories260K_greedy.json) with TP x PP grids run as threads,
// each TP rank holds its slices and its KV heads, and grids the model cannot split are refused
// before anything runs.
#include <brigade/engine/inference.hpp>
#include <brigade/model/text.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/partition/partition.hpp>
#include <brigade/runtime/inference_stage.hpp>
#include <brigade/tp/tensor_parallel.hpp>
#include <brigade/transport/collectives.hpp>
#include <brigade/transport/in_process.hpp>

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <thread>

using namespace brigade;
namespace fs = std::filesystem;

namespace {

const fs::path kData = BRIGADE_MODEL_DIR;  // the committed models/

struct Reference {
  model::LlamaWeights weights = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  model::Tokenizer tok = model::Tokenizer::load_llama2c(kData / "tok512.bin", 512);
  std::vector<test::GreedyCase> cases = test::greedy_reference(kData).cases;
};

const Reference& ref() {
  static const Reference r;
  return r;
}

}  // namespace

TEST_CASE("tp.stories260K: greedy tokens equal run.c with TP2 x PP1, TP2 x PP2, TP4 x PP1 and "
          "TP2 x PP3 on threads, each prompt alone and both in flight") {
  const auto& R = ref();
  REQUIRE(R.cases.size() == 2);
  const model::ModelSpec spec(R.weights.config);
  for (const auto& [tp, pp] : {std::pair{2, 1}, std::pair{2, 2}, std::pair{4, 1}, std::pair{2, 3}}) {
    CAPTURE(tp);
    CAPTURE(pp);
    const auto part = partition::uniform(spec, pp);
    engine::InferenceOptions opt;
    opt.sampler.temperature = 0.0f;
    opt.tp = tp;
    for (const auto& c : R.cases) {
      CAPTURE(c.prompt);
      const std::vector<engine::GenerationRequest> req{{c.prompt_ids, c.steps}};
      const auto rep = engine::generate(R.weights, part, req, opt);
      REQUIRE(rep.sequences.size() == 1);
      CHECK(rep.sequences[0].tokens == c.tokens());
      CHECK(model::render_like_run_c(R.tok, rep.sequences[0].tokens) == c.stdout_text);
      // One Timeline row and one weight figure per rank of the grid, every rank busy.
      REQUIRE(rep.timeline.num_ranks() == tp * pp);
      REQUIRE(rep.resident_weight_bytes.size() == static_cast<std::size_t>(tp * pp));
      for (int g = 0; g < tp * pp; ++g) CHECK(rep.timeline.busy(g) > 0.0);
    }
    std::vector<engine::GenerationRequest> both;
    for (const auto& c : R.cases) both.push_back({c.prompt_ids, c.steps});
    opt.microbatches = 2;
    const auto rep = engine::generate(R.weights, part, both, opt);
    REQUIRE(rep.sequences.size() == 2);
    for (std::size_t i = 0; i < 2; ++i) CHECK(rep.sequences[i].tokens == R.cases[i].tokens());
  }
}

TEST_CASE("tp.stage: a TP2 stage holds its KV heads and its slices, and its logits are the whole "
          "stage's to 1e-5") {
  const auto& R = ref();
  const auto& c = R.weights.config;
  const model::ModelSpec spec(c);
  const partition::StageRange all{0, 0, spec.num_layers() - 1};  // everything but the sampler
  const std::vector<int> capacity{8};
  runtime::InferenceStage whole(R.weights, all, capacity, model::SamplerConfig{});
  runtime::Microbatch ref_mb;
  ref_mb.seqs = {{0, 0, 3}};
  ref_mb.token_ids = {model::Tokenizer::kBos, 403, 407};
  whole.forward(ref_mb);
  REQUIRE(ref_mb.width == c.vocab_size);

  transport::InProcessGroup group(2);
  std::vector<runtime::Microbatch> out(2);
  std::vector<std::size_t> kv(2), weights(2);
  std::vector<std::jthread> threads;
  for (int t = 0; t < 2; ++t)
    threads.emplace_back([&, t] {
      transport::InProcessCollectives member(group, t);
      tp::GroupOver<transport::InProcessCollectives> g(member, 30.0);
      runtime::InferenceStage stage(R.weights, all, capacity, model::SamplerConfig{},
                                    cpu::CpuBackend{}, 0, &g);
      auto& mb = out[static_cast<std::size_t>(t)];
      mb.seqs = ref_mb.seqs;
      mb.token_ids = {model::Tokenizer::kBos, 403, 407};
      stage.forward(mb);
      kv[static_cast<std::size_t>(t)] = stage.kv_cache_bytes();
      weights[static_cast<std::size_t>(t)] = stage.weight_bytes();
    });
  threads.clear();
  for (int t = 0; t < 2; ++t) {
    CAPTURE(t);
    const auto& mb = out[static_cast<std::size_t>(t)];
    REQUIRE(mb.act.size() == ref_mb.act.size());
    for (std::size_t i = 0; i < mb.act.size(); ++i)
      REQUIRE(std::abs(mb.act[i] - ref_mb.act[i]) <= 1e-5f * (1.0f + std::abs(ref_mb.act[i])));
    CHECK(mb.act == out[0].act);  // both ranks hold the same logits, bit for bit
    // 2 of the 4 KV heads: half the whole stage's cache.
    CHECK(2 * kv[static_cast<std::size_t>(t)] == whole.kv_cache_bytes());
    // Half of every matrix (embedding, decoder matrices, the tied head), the norms whole.
    const double norms = (2.0 * c.n_layers + 1.0) * c.dim * sizeof(float);
    CHECK(static_cast<double>(weights[static_cast<std::size_t>(t)]) ==
          doctest::Approx((static_cast<double>(whole.weight_bytes()) - norms) / 2 + norms));
  }
}

TEST_CASE("tp.shard: heads, KV heads (replicated past n_kv_heads), MLP rows and vocabulary of "
          "each rank") {
  model::LlamaConfig c = ref().weights.config;  // 8 heads, 4 KV heads, hidden 172, vocab 512
  const auto s = tp::shard_of(c, 1, 2);
  CHECK(s.head0 == 4);
  CHECK(s.n_heads == 4);
  CHECK(s.kv_head0 == 2);
  CHECK(s.n_kv_heads == 2);
  CHECK(s.hidden0 == 86);
  CHECK(s.hidden == 86);
  CHECK(s.vocab0 == 256);
  CHECK(s.vocab == 256);
  // TP 8 over 4 KV heads: each rank reads one KV head, shared by two ranks.
  c.hidden_dim = 176;
  const auto r5 = tp::shard_of(c, 5, 8);
  CHECK(r5.head0 == 5);
  CHECK(r5.n_heads == 1);
  CHECK(r5.kv_head0 == 2);
  CHECK(r5.n_kv_heads == 1);
  const tp::Grid grid{2, 3, 2};
  CHECK(grid.ranks() == 12);
  CHECK(grid.rank_of(1, 2, 1) == 11);
  CHECK(grid.tp_rank(11) == 1);
  CHECK(grid.pp_rank(11) == 2);
  CHECK(grid.dp_rank(11) == 1);
}

TEST_CASE("tp.errors: TP degrees the model cannot split are refused before anything runs") {
  const auto& R = ref();
  const model::ModelSpec spec(R.weights.config);
  const std::vector<engine::GenerationRequest> req{{R.cases[1].prompt_ids, 16}};
  engine::InferenceOptions opt;
  opt.timeout_s = 10;
  opt.tp = 3;
  CHECK_THROWS_WITH_AS(engine::generate(R.weights, partition::uniform(spec, 1), req, opt),
                       doctest::Contains("TP 3: the model's 8 attention heads are not divisible "
                                         "by the TP degree"),
                       Error);
  opt.tp = 8;  // 8 heads, 4 KV heads (replicated): fine; hidden_dim 172 is not
  CHECK_THROWS_WITH_AS(engine::generate(R.weights, partition::uniform(spec, 1), req, opt),
                       doctest::Contains("TP 8: the model's hidden_dim 172 is not divisible"),
                       Error);
  opt.tp = 0;
  CHECK_THROWS_WITH_AS(engine::generate(R.weights, partition::uniform(spec, 1), req, opt),
                       doctest::Contains("options.tp = 0, expected >= 1"), Error);
  // KV heads neither divisible by the TP degree nor a divisor of it: 12 heads, 6 KV heads, TP 4.
  model::LlamaConfig c;
  c.dim = 96;
  c.hidden_dim = 64;
  c.n_layers = 2;
  c.n_heads = 12;
  c.n_kv_heads = 6;
  c.vocab_size = 64;
  c.seq_len = 32;
  CHECK_THROWS_WITH_AS(tp::check_tensor_parallel(c, 4),
                       doctest::Contains("TP 4: the model's 6 KV heads are neither divisible by "
                                         "the TP degree nor a divisor of it"),
                       Error);
  CHECK_THROWS_WITH_AS(tp::check_grid_ranks(tp::Grid{2, 2, 1}, 3),
                       doctest::Contains("grid TP 2 x PP 2 = 4 ranks does not match the 3 processes"),
                       Error);
  // The transports of a caller run TP 1 only.
  opt.tp = 2;
  transport::InProcessFabric fabric(1);
  auto eps = transport::endpoints(fabric);
  CHECK_THROWS_WITH_AS(
      engine::generate(std::span(eps), R.weights,
                       engine::inference_plan(R.weights.config, partition::uniform(spec, 1), req),
                       req, opt),
      doctest::Contains("tensor parallelism runs through"), Error);
  // A rank told TP 2 without a group of 2 (what a driver that does not build TP groups, such as
  // serve, would do) is refused instead of running TP 1.
  const auto plan = engine::inference_plan(R.weights.config, partition::uniform(spec, 1), req);
  engine::InferenceOptions one;
  const auto layout = engine::check_inference_plan(plan, R.weights.config, req, one, "test");
  Timeline tl(1);
  CHECK_THROWS_WITH_AS(engine::run_inference_rank(eps[0], R.weights, plan, layout, nullptr, opt,
                                                  std::chrono::steady_clock::now(), tl),
                       doctest::Contains("options.tp = 2 but the rank's TP group has 1 members"),
                       Error);
}
