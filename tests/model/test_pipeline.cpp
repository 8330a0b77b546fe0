// The main job on real data: stories260K split into 1..5 stages generates exactly the tokens and
// the text of llama2.c's run.c (models/reference/stories260K_greedy.json).
#include <brigade/engine/inference.hpp>
#include <brigade/model/text.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/partition/ring.hpp>
#include <brigade/runtime/inference_stage.hpp>

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <tuple>

using namespace brigade;
namespace fs = std::filesystem;

namespace {

// `n` ring windows over the model's decoder layers, sizes differing by at most one (the earlier
// windows larger), as partition::uniform splits them.
std::vector<int> even_windows(const model::ModelSpec& spec, int n) {
  const int L = spec.config().n_layers;
  std::vector<int> sizes(static_cast<std::size_t>(n), L / n);
  for (int i = 0; i < L % n; ++i) ++sizes[static_cast<std::size_t>(i)];
  return sizes;
}

const fs::path kData = BRIGADE_MODEL_DIR;  // the committed models/

using Case = test::GreedyCase;

struct Reference {
  model::LlamaWeights weights = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  model::Tokenizer tok = model::Tokenizer::load_llama2c(kData / "tok512.bin", 512);
  test::GreedyReference ref = test::greedy_reference(kData);
  const std::vector<Case>& cases = ref.cases;
  const std::vector<float>& logits16 = ref.logits_bos_pos0_first16;
};

const Reference& ref() {
  static const Reference r;
  return r;
}

partition::Partition make_partition(const std::string& kind, int stages, int sequences) {
  const model::ModelSpec spec(ref().weights.config);
  if (kind == "uniform") return partition::uniform(spec, stages);
  return partition::balanced(spec, stages, model::WorkItem{sequences, sequences, 64.0});
}

void check_case_output(const Case& c, const engine::SequenceResult& r) {
  CHECK(r.tokens == c.tokens());
  CHECK(r.generated == static_cast<int>(c.generated_ids.size()));
  CHECK(model::render_like_run_c(ref().tok, r.tokens) == c.stdout_text);
}

}  // namespace

TEST_CASE("pipeline.stories260K: greedy tokens and text equal run.c for 1-5 stages, both "
          "partitions, each prompt alone and both in flight") {
  const auto& R = ref();
  REQUIRE(R.cases.size() == 2);
  for (const std::string kind : {"uniform", "balanced"}) {
    for (int stages = 1; stages <= 5; ++stages) {
      CAPTURE(kind);
      CAPTURE(stages);
      for (const auto& c : R.cases) {
        CAPTURE(c.name);
        REQUIRE(R.tok.encode(c.prompt, true, false) == c.prompt_ids);
        const std::vector<engine::GenerationRequest> req{{c.prompt_ids, c.steps}};
        engine::InferenceOptions opt;
        opt.sampler.temperature = 0.0f;
        const auto rep = engine::generate(R.weights, make_partition(kind, stages, 1), req, opt);
        REQUIRE(rep.sequences.size() == 1);
        check_case_output(c, rep.sequences[0]);
      }
      // Both prompts at once: as two micro-batches in flight, and batched in one micro-batch.
      for (int mbs : {1, 2}) {
        CAPTURE(mbs);
        std::vector<engine::GenerationRequest> req;
        for (const auto& c : R.cases) req.push_back({c.prompt_ids, c.steps});
        engine::InferenceOptions opt;
        opt.sampler.temperature = 0.0f;
        opt.microbatches = mbs;
        const auto rep = engine::generate(R.weights, make_partition(kind, stages, 2), req, opt);
        REQUIRE(rep.sequences.size() == 2);
        for (std::size_t i = 0; i < 2; ++i) check_case_output(R.cases[i], rep.sequences[i]);
        // Every stage did work, and the timeline has one row per stage.
        CHECK(rep.timeline.num_ranks() == stages);
        for (int s = 0; s < stages; ++s) CHECK(rep.timeline.busy(s) > 0.0);
      }
    }
  }
}

TEST_CASE("pipeline.stories260K: first logits of BOS at position 0 match run.c to 1e-5") {
  const auto& R = ref();
  const model::ModelSpec spec(R.weights.config);
  // Everything but the sampler: the micro-batch leaves holding the logits.
  runtime::InferenceStage stage(R.weights, {0, 0, spec.num_layers() - 1}, std::vector<int>{1},
                                model::SamplerConfig{});
  runtime::Microbatch mb;
  mb.seqs = {{0, 0, 1}};
  mb.token_ids = {model::Tokenizer::kBos};
  stage.forward(mb);
  REQUIRE(mb.width == 512);
  for (std::size_t i = 0; i < R.logits16.size(); ++i) {
    CAPTURE(i);
    CHECK(std::abs(mb.act[i] - R.logits16[i]) <= 1e-5 * std::abs(R.logits16[i]));
  }
}

TEST_CASE("pipeline.stories260K: --steps shorter than the prompt samples nothing, as run.c") {
  const auto& R = ref();
  const auto ids = R.tok.encode("Once upon a time", true, false);  // 5 ids
  const std::vector<engine::GenerationRequest> req{{ids, 3}, {ids, 5}};
  engine::InferenceOptions opt;
  opt.sampler.temperature = 0.0f;
  const auto rep = engine::generate(R.weights, make_partition("uniform", 2, 2), req, opt);
  // steps 3: positions 0..2 fed, prints prompt tokens 1..3.
  CHECK(rep.sequences[0].tokens == std::vector<int>(ids.begin(), ids.begin() + 4));
  CHECK(rep.sequences[0].generated == 0);
  // steps 5 = prompt length: one token sampled after the last prompt position.
  CHECK(rep.sequences[1].generated == 1);
  CHECK(rep.sequences[1].tokens.size() == 6);
  CHECK(rep.sequences[1].tokens[5] == R.cases[1].generated_ids[0]);
}

TEST_CASE("pipeline.stories260K: sampling with a seed is reproducible and partition-independent") {
  const auto& R = ref();
  const std::vector<engine::GenerationRequest> req{{R.cases[1].prompt_ids, 80},
                                                   {R.cases[0].prompt_ids, 80}};
  engine::InferenceOptions opt;
  opt.sampler = {0.9f, 0.9f, 1234};
  const auto a = engine::generate(R.weights, make_partition("uniform", 1, 2), req, opt);
  const auto b = engine::generate(R.weights, make_partition("balanced", 4, 2), req, opt);
  for (std::size_t i = 0; i < 2; ++i) CHECK(a.sequences[i].tokens == b.sequences[i].tokens);
  opt.sampler.seed = 99;
  const auto c = engine::generate(R.weights, make_partition("uniform", 1, 2), req, opt);
  CHECK(a.sequences[0].tokens != c.sequences[0].tokens);
}

TEST_CASE("pipeline.errors: bad requests and partitions fail with an Error, not a hang") {
  const auto& R = ref();
  const auto part = make_partition("uniform", 3, 1);
  engine::InferenceOptions opt;
  opt.timeout_s = 10;
  std::vector<engine::GenerationRequest> empty{{{}, 10}};
  CHECK_THROWS_WITH_AS(engine::generate(R.weights, part, empty, opt),
                       doctest::Contains("empty prompt"), Error);
  std::vector<engine::GenerationRequest> bad_token{{{1, 600}, 10}};
  CHECK_THROWS_WITH_AS(engine::generate(R.weights, part, bad_token, opt),
                       doctest::Contains("token id 600 outside the vocabulary [0, 512)"), Error);
  std::vector<engine::GenerationRequest> ok{{{1}, 10}};
  const partition::Partition wrong(5, 2, {{0, 0, 2}, {1, 2, 5}});
  CHECK_THROWS_WITH_AS(engine::generate(R.weights, wrong, ok, opt),
                       doctest::Contains("covers 5 layers, the model has 9"), Error);
  const model::ModelSpec spec9(R.weights.config);
  CHECK_THROWS_WITH_AS(partition::ring_partition(spec9, 4, even_windows(spec9, 3)),
                       doctest::Contains("ring_partition: 4 ranks for 3 windows, expected 1..3"),
                       Error);
}

TEST_CASE("pipeline.stories260K: ring windows (several layer ranges per rank, the token walks the "
          "ring of ranks twice per position) equal run.c, 2 ranks x 2 windows and 1 x 2") {
  const auto& R = ref();
  const model::ModelSpec spec(R.weights.config);
  for (const auto& [ranks, windows] : {std::pair{2, 2}, std::pair{1, 2}, std::pair{2, 1}}) {
    CAPTURE(ranks);
    CAPTURE(windows);
    const auto part = partition::ring_partition(spec, ranks, even_windows(spec, ranks * windows));
    REQUIRE(part.num_ranks() == ranks);
    if (windows > 1) CHECK(part.stage(ranks).rank == 0);  // window `ranks` wraps to rank 0
    for (int mbs : {1, 2}) {
      CAPTURE(mbs);
      std::vector<engine::GenerationRequest> req;
      for (const auto& c : R.cases) req.push_back({c.prompt_ids, c.steps});
      engine::InferenceOptions opt;
      opt.sampler.temperature = 0.0f;
      opt.microbatches = mbs;
      const auto rep = engine::generate(R.weights, part, req, opt);
      REQUIRE(rep.sequences.size() == 2);
      for (std::size_t i = 0; i < 2; ++i) check_case_output(R.cases[i], rep.sequences[i]);
      CHECK(rep.timeline.num_ranks() == ranks);
      // Rank 0 computes both of its windows: virtual stages 0 and `ranks` (the next round's
      // window, or with one round and two ranks the output layers' stage on the head).
      bool first = false, wrapped = false;
      for (const auto& iv : rep.timeline.intervals()) {
        if (iv.rank != 0 || iv.op != Op::F) continue;
        first = first || iv.virtual_stage == 0;
        wrapped = wrapped || iv.virtual_stage == ranks;
      }
      CHECK(first);
      CHECK(wrapped == (part.num_stages() > ranks));
      CHECK(part.stage(part.num_stages() - 1).rank == 0);
    }
  }
}

TEST_CASE("pipeline.ring: the 42M synthetic model with 2 ranks x 4 windows and 4 ranks x 2 "
          "windows gives the greedy tokens of one stage") {
  const auto w = model::make_synthetic_weights(model::named_config("42M"), 42);
  const model::ModelSpec spec(w.config);
  std::vector<engine::GenerationRequest> req;
  for (int i = 0; i < 3; ++i) req.push_back({{1, 500 + 7 * i, 900 + 11 * i}, 10});
  engine::InferenceOptions opt;
  opt.sampler.temperature = 0.0f;
  opt.microbatches = 2;
  const auto one = engine::generate(w, partition::uniform(spec, 1), req, opt);
  for (const auto& [ranks, windows] : {std::pair{2, 4}, std::pair{4, 2}}) {
    CAPTURE(ranks);
    CAPTURE(windows);
    const auto rep = engine::generate(
        w, partition::ring_partition(spec, ranks, even_windows(spec, ranks * windows)), req, opt);
    for (std::size_t i = 0; i < req.size(); ++i) {
      CHECK(rep.sequences[i].tokens == one.sequences[i].tokens);
      CHECK(rep.sequences[i].generated == 8);
    }
  }
}

TEST_CASE("pipeline.offload: a ring that RELEASEs and PREFETCHes every window each round "
          "(background loads and madvise/fadvise on the mapped stories260K) equals run.c, with "
          "PREFETCH on the Timeline") {
  const auto& R = ref();
  REQUIRE(R.weights.mapped);
  const model::ModelSpec spec(R.weights.config);
  const auto part = partition::ring_partition(spec, 2, even_windows(spec, 4));  // 2 ranks x 2 windows
  std::vector<engine::GenerationRequest> req;
  for (const auto& c : R.cases) req.push_back({c.prompt_ids, c.steps});
  for (int mbs : {1, 2}) {
    CAPTURE(mbs);
    engine::InferenceOptions opt;
    opt.sampler.temperature = 0.0f;
    opt.microbatches = mbs;
    opt.weight_offload = true;
    const auto rep = engine::generate(R.weights, part, req, opt);
    for (std::size_t i = 0; i < 2; ++i) check_case_output(R.cases[i], rep.sequences[i]);
    // Every F of window v in round c on rank r comes after a PREFETCH of (v, c) and before a
    // RELEASE of (v, c) on that rank; each (rank, v, c) is loaded and dropped exactly once.
    std::map<std::tuple<int, int, int>, std::pair<const Interval*, const Interval*>> io;
    for (const auto& iv : rep.timeline.intervals()) {
      if (iv.op != Op::Prefetch && iv.op != Op::Release) continue;
      CHECK(iv.label == (iv.op == Op::Prefetch ? "background" : "madvise+fadvise"));
      auto& slot = io[{iv.rank, iv.virtual_stage, iv.chunk}];
      auto& which = iv.op == Op::Prefetch ? slot.first : slot.second;
      CHECK(which == nullptr);
      which = &iv;
    }
    std::set<std::tuple<int, int, int>> forwards;
    for (const auto& iv : rep.timeline.intervals()) {
      if (iv.op != Op::F) continue;
      forwards.insert({iv.rank, iv.virtual_stage, iv.chunk});
      const auto it = io.find({iv.rank, iv.virtual_stage, iv.chunk});
      REQUIRE(it != io.end());
      REQUIRE(it->second.first != nullptr);
      REQUIRE(it->second.second != nullptr);
      CHECK(it->second.first->end <= iv.start);
      CHECK(it->second.second->start >= iv.end);
    }
    CHECK(forwards.size() > 8);
    CHECK(io.size() >= forwards.size());  // closing rounds load and drop without a forward
  }
}

TEST_CASE("pipeline.offload: owned (synthetic) weights stay resident, the ops are recorded "
          "no-ops and the tokens do not change") {
  const auto w = model::make_synthetic_weights(model::named_config("260K"), 7);
  CHECK_FALSE(w.mapped);
  const model::ModelSpec spec(w.config);
  const auto part = partition::ring_partition(spec, 2, even_windows(spec, 4));
  std::vector<engine::GenerationRequest> req{{{1, 50, 60}, 12}, {{1, 70}, 9}};
  engine::InferenceOptions opt;
  opt.sampler.temperature = 0.0f;
  const auto plain = engine::generate(w, part, req, opt);
  opt.weight_offload = true;
  const auto off = engine::generate(w, part, req, opt);
  for (std::size_t i = 0; i < req.size(); ++i)
    CHECK(off.sequences[i].tokens == plain.sequences[i].tokens);
  int prefetches = 0;
  for (const auto& iv : off.timeline.intervals())
    if (iv.op == Op::Prefetch) {
      ++prefetches;
      CHECK(iv.label == "owned: resident");
    }
  CHECK(prefetches > 0);
}

namespace {

/// Resident kB of the mapping of this process that contains `p` (/proc/self/smaps "Rss:").
long mapping_rss_kb(const void* p) {
  std::ifstream in("/proc/self/smaps");
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  bool inside = false;
  for (std::string line; std::getline(in, line);) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      inside = addr >= lo && addr < hi;
      continue;
    }
    long kb = 0;
    if (inside && std::sscanf(line.c_str(), "Rss: %ld kB", &kb) == 1) return kb;
  }
  return -1;
}

}  // namespace

TEST_CASE("pipeline.offload: RELEASE drops a stage's pages from the process, the next forward "
          "reads them back and gives the same logits") {
  // A private mapping of its own, so no other test's touches interfere.
  const auto w = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  const model::ModelSpec spec(w.config);
  const partition::StageRange all{0, 0, spec.num_layers()};
  const std::vector<int> caps{8};
  runtime::InferenceStage stage(w, all, caps, model::SamplerConfig{0.0f, 0.9f, 1});
  CHECK(stage.weight_bytes() > 900'000);  // every tensor of the 1 MB checkpoint but RoPE
  auto run = [&] {
    runtime::Microbatch mb;
    mb.seqs = {{0, 0, 3}};
    mb.token_ids = {1, 400, 401};
    stage.forward(mb);
    return mb.act;
  };
  const auto logits = run();
  const long before = mapping_rss_kb(w.token_embedding.f32());
  REQUIRE(before > 0);
  CHECK(stage.release_weights());
  const long after = mapping_rss_kb(w.token_embedding.f32());
  CAPTURE(before);
  CAPTURE(after);
  CHECK(after < before / 4);
  CHECK(stage.prefetch_weights());
  // Position 0 again needs an empty KV cache: a fresh stage over the same mapping.
  runtime::InferenceStage again(w, all, caps, model::SamplerConfig{0.0f, 0.9f, 1});
  runtime::Microbatch mb;
  mb.seqs = {{0, 0, 3}};
  mb.token_ids = {1, 400, 401};
  again.forward(mb);
  CHECK(mb.act == logits);
  const long reread = mapping_rss_kb(w.token_embedding.f32());
  CHECK(reread >= before / 2);
  MESSAGE("resident kB of the checkpoint's mapping: " << before << " after a forward, " << after
          << " after RELEASE, " << reread << " after the next forward");
}

TEST_CASE("pipeline.stories260K: f16 and bf16 pipeline dtypes halve the activation bytes on the "
          "links, and greedy tokens stay those of f32") {
  const auto& R = ref();
  const auto& c = R.cases[0];
  const std::vector<engine::GenerationRequest> req{{c.prompt_ids, c.steps}};
  const int dim = R.weights.config.dim;
  for (int stages : {2, 3}) {
    CAPTURE(stages);
    const auto part = make_partition("uniform", stages, 1);
    std::map<DType, engine::InferenceReport> runs;
    for (const DType t : {DType::F32, DType::F16, DType::BF16}) {
      engine::InferenceOptions opt;
      opt.sampler.temperature = 0.0f;
      opt.pipeline_dtype = t;
      runs[t] = engine::generate(R.weights, part, req, opt);
    }
    const auto& f32 = runs.at(DType::F32);
    check_case_output(c, f32.sequences[0]);
    // Every round sends each stage's activations forward: the prompt's rows once, then one row
    // per decode step; the last stage's token records and the descriptors are int32.
    const std::int64_t rows = static_cast<std::int64_t>(c.prompt_ids.size()) +
                              f32.sequences[0].generated - 1;
    for (const DType t : {DType::F16, DType::BF16}) {
      CAPTURE(to_string(t));
      const auto& half = runs.at(t);
      for (int r = 0; r + 1 < stages; ++r)
        CHECK(f32.timeline.bytes(r, true) - half.timeline.bytes(r, true) == rows * dim * 2);
      CHECK(f32.timeline.bytes(stages - 1, true) == half.timeline.bytes(stages - 1, true));
      for (int r = 0; r < stages; ++r)
        CHECK(half.timeline.bytes(r, false) == half.timeline.bytes((r + stages - 1) % stages, true));
      // Rounding each stage's input to 11 (f16) or 8 (bf16) significant bits moves the logits
      // by ~1e-3 relative: the greedy choice is the same at every position of this story.
      CHECK(half.sequences[0].tokens == f32.sequences[0].tokens);
    }
  }
  engine::InferenceOptions bad;
  bad.pipeline_dtype = DType::Q8_0;
  const auto msg = test::error_of(Errc::InvalidArgument, [&] {
    (void)engine::generate(R.weights, make_partition("uniform", 2, 1), req, bad);
  });
  CHECK(msg.find("pipeline dtype q8_0") != std::string::npos);
}
