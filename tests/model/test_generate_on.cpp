// engine::generate_on, the SPMD driver behind `brigade generate` under mpirun, run here on
// threads over InProcessTransport (one call per rank): stories260K token-exact, the Timeline
// gathered to the rank of stage 0, and its argument checks. The MPI run is tests/mpi/.
#include <brigade/engine/distributed.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/transport/in_process.hpp>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <exception>
#include <filesystem>
#include <fstream>
#include <thread>

using namespace brigade;
namespace fs = std::filesystem;

namespace {

const fs::path kData = BRIGADE_MODEL_DIR;  // the committed models/

struct Fixture {
  model::LlamaWeights weights = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  nlohmann::json ref;
  Fixture() {
    std::ifstream in(kData / "reference" / "stories260K_greedy.json");
    REQUIRE(in.good());
    ref = nlohmann::json::parse(in);
  }
  /// Reference token ids at every position of case `i` (prompt, then generated).
  std::vector<int> ids(int i) const {
    const auto& c = ref["cases"][static_cast<std::size_t>(i)];
    auto v = c["prompt_ids"].get<std::vector<int>>();
    for (int t : c["generated_ids"].get<std::vector<int>>())
      if (t != 1) v.push_back(t);  // a terminating BOS is not part of the tokens
    return v;
  }
  std::int64_t generated(int i) const {
    return static_cast<std::int64_t>(ref["cases"][static_cast<std::size_t>(i)]["generated_ids"].size());
  }
  std::vector<int> prompt(int i) const {
    return ref["cases"][static_cast<std::size_t>(i)]["prompt_ids"].get<std::vector<int>>();
  }
};

const Fixture& fixture() {
  static const Fixture f;
  return f;
}

/// Calls generate_on on every rank of a world of part.num_ranks() threads.
std::vector<engine::InferenceReport> run_all(const partition::Partition& part,
                                             std::span<const engine::GenerationRequest> req,
                                             const engine::InferenceOptions& opt) {
  const int n = part.num_ranks();
  transport::InProcessFabric fabric(n);
  std::vector<engine::InferenceReport> reports(static_cast<std::size_t>(n));
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  {
    std::vector<std::jthread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        try {
          transport::InProcessTransport t(fabric, r);
          reports[static_cast<std::size_t>(r)] =
              engine::generate_on(t, fixture().weights, part, req, opt);
        } catch (...) {
          errors[static_cast<std::size_t>(r)] = std::current_exception();
          fabric.abort("rank " + std::to_string(r) + " failed");
        }
      });
    }
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return reports;
}

}  // namespace

TEST_CASE("engine.generate_on: one call per rank on threads equals run.c, and the Timeline is "
          "gathered to stage 0's rank") {
  const auto& F = fixture();
  const model::ModelSpec spec(F.weights.config);
  const std::vector<engine::GenerationRequest> req{{F.prompt(1), 64}, {F.prompt(0), 256}};
  engine::InferenceOptions opt;
  opt.sampler.temperature = 0.0f;
  opt.timeout_s = 60;
  for (int stages : {1, 2, 3, 5}) {
    CAPTURE(stages);
    const auto part = partition::uniform(spec, stages);
    const auto reports = run_all(part, req, opt);
    const auto& root = reports[0];
    REQUIRE(root.sequences.size() == 2);
    CHECK(root.sequences[0].tokens == F.ids(1));
    CHECK(root.sequences[1].tokens == F.ids(0));
    CHECK(root.generated_tokens == F.generated(0) + F.generated(1));
    CHECK(root.timeline.num_ranks() == stages);
    for (int s = 0; s < stages; ++s) CHECK(root.timeline.busy(s) > 0.0);
    CHECK(root.wall_s >= root.timeline.makespan() * 0.99);
    for (int r = 1; r < stages; ++r) {
      const auto& other = reports[static_cast<std::size_t>(r)];
      CHECK(other.sequences.empty());
      CHECK(other.generated_tokens == 0);
      CHECK(other.timeline.busy(r) > 0.0);
      for (const auto& iv : other.timeline.intervals()) CHECK(iv.rank == r);
    }
  }
}

TEST_CASE("engine.generate_on: a world that does not match the partition is refused") {
  const auto& F = fixture();
  const model::ModelSpec spec(F.weights.config);
  const std::vector<engine::GenerationRequest> req{{F.prompt(1), 8}};
  transport::InProcessFabric fabric(2);
  transport::InProcessTransport t(fabric, 0);
  CHECK_THROWS_WITH_AS(engine::generate_on(t, F.weights, partition::uniform(spec, 3), req),
                       doctest::Contains("the partition has 3 ranks, the transport's world has 2"),
                       Error);
  CHECK_THROWS_WITH_AS(
      engine::generate_on(t, F.weights, partition::uniform(spec, 2), req, {}, {5, 1}),
      doctest::Contains("fault injection on rank 5, outside [0, 2)"), Error);
  CHECK_THROWS_WITH_AS(
      engine::generate_on(t, F.weights, partition::uniform(spec, 2), req, {}, {1, 0}),
      doctest::Contains("fault injection after 0 steps"), Error);
}

TEST_CASE("engine.generate_on: timelines survive the gather encoding exactly") {
  Timeline tl(3);
  Interval iv;
  iv.rank = 2;
  iv.op = Op::Sample;
  iv.virtual_stage = 2;
  iv.microbatch = 7;
  iv.chunk = 1;
  iv.start = 0.125;
  iv.end = 0.3333333333333333;
  iv.tokens = 42;
  iv.label = "decode \"quoted\"";
  tl.add(iv);
  Timeline back(3);
  const double end = engine::detail::decode_rank_result(engine::detail::encode_rank_result(tl, 1.5),
                                                        2, back);
  CHECK(end == 1.5);
  REQUIRE(back.intervals().size() == 1);
  const auto& b = back.intervals()[0];
  CHECK(b.rank == 2);
  CHECK(b.op == Op::Sample);
  CHECK(b.microbatch == 7);
  CHECK(b.chunk == 1);
  CHECK(b.start == iv.start);
  CHECK(b.end == iv.end);
  CHECK(b.tokens == 42);
  CHECK(b.label == iv.label);
  CHECK_THROWS_WITH_AS(engine::detail::decode_rank_result("{\"end_s\": 1}", 4, back),
                       doctest::Contains("rank 4 sent an unreadable timeline"), Error);
}
