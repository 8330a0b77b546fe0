// engine::generate_on, the SPMD driver behind `brigade generate` under mpirun, run here on
// threads over InProcessTransport (one call per rank): stories260K token-exact, the Timeline
// gathered to the rank of stage 0, and its argument checks. The MPI run is tests/mpi/.
#include <brigade/engine/distributed.hpp>
#include <brigade/engine/threads.hpp>
#include <brigade/cost/cost_model.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/schedule/generators.hpp>
#include <brigade/sim/simulator.hpp>
#include <brigade/transport/in_process.hpp>

#include "flip_scenario.hpp"
#include "test_util.hpp"

#include <doctest/doctest.h>

#include <cstring>
#include <exception>
#include <functional>
#include <filesystem>
#include <fstream>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

using namespace brigade;
namespace fs = std::filesystem;

namespace {

const fs::path kData = BRIGADE_MODEL_DIR;  // the committed models/

struct Fixture {
  model::LlamaWeights weights = model::load_llama2c_checkpoint(kData / "stories260K.bin");
  std::vector<test::GreedyCase> cases = test::greedy_reference(kData).cases;
  /// Reference token ids at every position of case `i` (prompt, then generated).
  std::vector<int> ids(int i) const { return cases.at(static_cast<std::size_t>(i)).tokens(); }
  std::int64_t generated(int i) const {
    return static_cast<std::int64_t>(cases.at(static_cast<std::size_t>(i)).generated_ids.size());
  }
  std::vector<int> prompt(int i) const { return cases.at(static_cast<std::size_t>(i)).prompt_ids; }
};

const Fixture& fixture() {
  static const Fixture f;
  return f;
}

/// Calls generate_on on every rank of a world of part.num_ranks() threads, each over
/// `wrap(InProcessTransport&, rank)` (the plain transport by default).
template <class Wrap>
std::vector<engine::InferenceReport> run_all(const partition::Partition& part,
                                             std::span<const engine::GenerationRequest> req,
                                             const engine::InferenceOptions& opt, Wrap wrap) {
  transport::InProcessFabric fabric(part.num_ranks());
  auto endpoints = transport::endpoints(fabric);
  std::vector<engine::InferenceReport> reports(endpoints.size());
  engine::run_ranks(std::span(endpoints), [&](transport::InProcessTransport& t) {
    decltype(auto) w = wrap(t, t.rank());
    reports[static_cast<std::size_t>(t.rank())] =
        engine::generate_on(w, fixture().weights, part, req, opt);
  });
  return reports;
}

std::vector<engine::InferenceReport> run_all(const partition::Partition& part,
                                             std::span<const engine::GenerationRequest> req,
                                             const engine::InferenceOptions& opt) {
  return run_all(part, req, opt,
                 [](transport::InProcessTransport& t, int) -> transport::InProcessTransport& {
                   return t;
                 });
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

TEST_CASE("transport decorators: bits flipped in one activation by a fault-injecting decorator "
          "are rejected by the SENTINEL verifier of the receiving rank, naming the ranks, the "
          "kind and the micro-batch, the clean run flags nothing, the other ranks stop with "
          "Aborted (threads, 2 and 3 ranks)") {
  const auto& F = fixture();
  const std::vector<engine::GenerationRequest> req{{F.prompt(1), 64}, {F.prompt(0), 64}};
  engine::InferenceOptions opt;
  opt.sampler.temperature = 0.0f;
  opt.microbatches = 2;
  opt.timeout_s = 60;  // a rank left waiting would end in PeerTimeout, not Aborted
  for (int world : {2, 3}) {
    CAPTURE(world);
    transport::InProcessFabric fabric(world);
    auto endpoints = transport::endpoints(fabric);
    std::vector<test::FlipOutcome> out(endpoints.size());
    engine::run_ranks(std::span(endpoints), [&](transport::InProcessTransport& t) {
      out[static_cast<std::size_t>(t.rank())] = test::flip_one_activation(t, F.weights, req, opt);
    });
    // The clean run with the check in place is run.c's text.
    REQUIRE(out[0].clean.size() == 2);
    CHECK(out[0].clean[0].tokens == F.ids(1));
    for (int r = 0; r < world; ++r) test::check_flip_outcome(out[static_cast<std::size_t>(r)], r);
  }
}

TEST_CASE("engine.generate over the caller's transports: a TracingTransport per rank counts "
          "every activation row and token message of a token-exact run") {
  const auto& F = fixture();
  const model::ModelSpec spec(F.weights.config);
  const std::vector<engine::GenerationRequest> req{{F.prompt(1), 64}};
  engine::InferenceOptions opt;
  opt.sampler.temperature = 0.0f;
  const auto plan = engine::inference_plan(F.weights.config, partition::uniform(spec, 2), req, 0);
  transport::InProcessFabric fabric(2);
  auto endpoints = transport::endpoints(fabric);
  std::vector<transport::TracingTransport<transport::InProcessTransport>> traced;
  for (auto& e : endpoints) traced.emplace_back(e);
  const auto report = engine::generate(std::span(traced), F.weights, plan, req, opt);
  REQUIRE(report.sequences.size() == 1);
  CHECK(report.sequences[0].tokens == F.ids(1));
  using transport::MessageKind;
  // Every position but the last sampled one crosses the stage boundary as one activation row.
  const auto rows = static_cast<std::int64_t>(F.prompt(1).size()) + F.generated(1) - 1;
  const auto sent = traced[0].sent(MessageKind::Activation, 1);
  CHECK(sent.bytes == rows * F.weights.config.dim * 4);
  CHECK(traced[1].received(MessageKind::Activation, 0).bytes == sent.bytes);
  CHECK(traced[1].received(MessageKind::Activation, 0).messages == sent.messages);
  CHECK(traced[1].sent(MessageKind::Token, 0).messages == F.generated(1));
  CHECK(traced[0].sent(MessageKind::Gradient).messages == 0);
  // A transport list that does not match the plan is refused.
  CHECK_THROWS_WITH_AS(engine::generate(std::span(traced).first(1), F.weights, plan, req, opt),
                       doctest::Contains("1 transports for a plan of 2 ranks"), Error);
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
  double peak = 0.0;
  const double end = engine::detail::decode_rank_result(
      engine::detail::encode_rank_result(tl, 1.5, 123456.0), 2, back, &peak);
  CHECK(end == 1.5);
  CHECK(peak == 123456.0);
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

namespace {

/// A transport that forwards to an InProcessTransport and rewrites the I32 payload of the first
/// message of `tag` whose (seq, pos, ...) rows `pick` selects: `pick(row)` returns true for the
/// row to corrupt, and the row's sequence id becomes `new_seq`. Used to show that stages check
/// the pipeline's metadata instead of trusting it.
class CorruptOne : public transport::ForwardingTransport<transport::InProcessTransport> {
 public:
  CorruptOne(transport::InProcessTransport& inner, int tag, int first_row,
             std::function<bool(const std::int32_t*)> pick, std::int32_t new_seq)
      : ForwardingTransport(inner), tag_(tag), first_row_(first_row), pick_(std::move(pick)),
        new_seq_(new_seq) {}
  transport::Request isend(int peer, int tag, const transport::MessageHeader& h,
                           transport::ConstBytes payload) {
    if (done_ || tag != tag_) return inner_->isend(peer, tag, h, payload);
    std::vector<std::int32_t> v(payload.size() / 4);
    std::memcpy(v.data(), payload.data(), payload.size());
    for (std::size_t row = static_cast<std::size_t>(first_row_); 3 * row + 2 < v.size(); ++row) {
      if (!pick_(&v[3 * row])) continue;
      v[3 * row] = new_seq_;
      done_ = true;
      break;
    }
    return inner_->isend(peer, tag, h, transport::as_bytes(std::span<const std::int32_t>(v)));
  }

 private:
  int tag_, first_row_;
  std::function<bool(const std::int32_t*)> pick_;
  std::int32_t new_seq_;
  bool done_ = false;
};

}  // namespace

TEST_CASE("engine.generate_on: a decode descriptor naming the wrong sequence stops the run "
          "naming the rank, the micro-batch, the expected and the seen sequence and position") {
  // Three sequences in one micro-batch over 2 stages; stage 0's first decode descriptor says
  // sequence 0 where it holds sequence 2. Without the check stage 1 would write sequence 2's
  // keys and values into sequence 0's KV cache and the run would end with wrong text.
  const auto& F = fixture();
  const model::ModelSpec spec(F.weights.config);
  const std::vector<engine::GenerationRequest> req{
      {F.prompt(0), 40}, {F.prompt(1), 40}, {F.prompt(1), 40}};
  const int pos = static_cast<int>(F.prompt(1).size());  // sequence 2's first decode position
  engine::InferenceOptions opt;
  opt.sampler.temperature = 0.0f;
  opt.microbatches = 1;
  opt.timeout_s = 30;
  const auto part = partition::uniform(spec, 2);
  auto corrupt = [&](transport::InProcessTransport& t, int r) {
    return CorruptOne(t, r == 0 ? engine::detail::kTagDescriptor : -1, 1,
                      [](const std::int32_t* row) { return row[0] == 2 && row[1] > 0; }, 0);
  };
  CHECK_THROWS_WITH_AS(
      run_all(part, req, opt, corrupt),
      doctest::Contains(fmt::format("rank 1: micro-batch 0 round 1 (decode): expected sequence 2 "
                                    "at position {}, the message from rank 0 holds sequence 0 at "
                                    "position {}",
                                    pos, pos)
                            .c_str()),
      Error);
  // The sampled tokens returning to stage 0 are checked the same way.
  auto corrupt_tokens = [&](transport::InProcessTransport& t, int r) {
    return CorruptOne(t, r == 1 ? engine::detail::kTagToken : -1, 0,
                      [](const std::int32_t* row) { return row[0] == 2; }, 1);
  };
  CHECK_THROWS_WITH_AS(
      run_all(part, req, opt, corrupt_tokens),
      doctest::Contains(fmt::format("rank 0: micro-batch 0 round 1: expected the token of sequence "
                                    "2 at position {}, the message from rank 1 holds sequence 1 "
                                    "at position {}",
                                    pos, pos)
                            .c_str()),
      Error);
  // Unchanged, the same run succeeds and sequences 1 and 2 agree.
  const auto ok = run_all(part, req, opt);
  CHECK(ok[0].sequences[1].tokens == ok[0].sequences[2].tokens);
}

TEST_CASE("engine.generate: the inference Timeline holds F, SAMPLE, SEND and RECV of every "
          "round") {
  const auto& F = fixture();
  const model::ModelSpec spec(F.weights.config);
  const std::vector<engine::GenerationRequest> req{{F.prompt(0), 256}, {F.prompt(1), 64}};
  engine::InferenceOptions opt;
  opt.sampler.temperature = 0.0f;
  opt.microbatches = 2;
  const auto rep = engine::generate(F.weights, partition::uniform(spec, 2), req, opt);
  REQUIRE(rep.sequences.size() == 2);
  const auto& tl = rep.timeline;
  auto count = [&](int rank, Op op, int mb, int round) {
    int n = 0;
    for (const auto& iv : tl.intervals())
      n += iv.rank == rank && iv.op == op && iv.microbatch == mb && iv.chunk == round;
    return n;
  };
  for (int m = 0; m < 2; ++m) {
    CAPTURE(m);
    // Sequence m is micro-batch m; it samples `generated` tokens, one per working round.
    const int rounds = rep.sequences[static_cast<std::size_t>(m)].generated;
    CHECK(rounds == F.generated(m));
    CHECK(rep.sequences[static_cast<std::size_t>(m)].tokens == F.ids(m));
    for (int c = 0; c < rounds; ++c) {
      CAPTURE(c);
      CHECK(count(0, Op::F, m, c) == 1);
      CHECK(count(0, Op::SendF, m, c) == 2);  // descriptor and activations
      CHECK(count(1, Op::RecvF, m, c) == 1);
      CHECK(count(1, Op::F, m, c) == 1);
      CHECK(count(1, Op::Sample, m, c) == 1);
      CHECK(count(1, Op::SendF, m, c) == 1);  // the tokens, back to stage 0
      if (c > 0) CHECK(count(0, Op::RecvF, m, c) == 1);
    }
    // The closing round: stage 0 receives the last tokens and computes nothing more.
    CHECK(count(0, Op::F, m, rounds) == 0);
    CHECK(count(1, Op::Sample, m, rounds) == 0);
    for (const auto& iv : tl.intervals())
      if (iv.op == Op::F && iv.microbatch == m)
        CHECK(iv.label == (iv.chunk == 0 ? "prefill" : "decode"));
  }
}

namespace {

/// A pipeline gate between two ranks: rank 1's first wait() blocks until rank 0 has sent
/// the activations of micro-batch 1 in round 0 (or until 30 s pass, which fails the test).
struct RunAheadGate {
  std::mutex mu;
  std::condition_variable cv;
  bool opened = false;     ///< rank 0 sent micro-batch 1's round-0 activations
  bool rank1_held = false; ///< rank 1 had entered a wait and was held there
  bool released = false;   ///< rank 0's send opened the gate while rank 1 was held (no timeout)
};

/// Rank 0's side opens the gate on that send; rank 1's side holds its first wait() at it.
template <transport::Transport Inner>
class GatedTransport : public transport::ForwardingTransport<Inner> {
 public:
  GatedTransport(Inner& inner, RunAheadGate& gate)
      : transport::ForwardingTransport<Inner>(inner), gate_(&gate) {}
  transport::Request isend(int peer, int tag, const transport::MessageHeader& h,
                           transport::ConstBytes payload) {
    auto r = this->inner_->isend(peer, tag, h, payload);
    if (this->rank() == 0 && h.kind == transport::MessageKind::Activation && h.microbatch == 1 &&
        h.chunk == 0) {
      const std::lock_guard lock(gate_->mu);
      gate_->opened = true;
      gate_->cv.notify_all();
    }
    return r;
  }
  void wait(transport::Request& r, transport::Deadline deadline) {
    if (this->rank() == 1 && !held_) {
      held_ = true;
      std::unique_lock lock(gate_->mu);
      gate_->rank1_held = true;
      gate_->released =
          gate_->cv.wait_for(lock, std::chrono::seconds(30), [&] { return gate_->opened; });
    }
    this->inner_->wait(r, deadline);
  }

 private:
  RunAheadGate* gate_;
  bool held_ = false;
};

}  // namespace

TEST_CASE("engine.generate: stage 0 computes micro-batch 1 while stage 1 has not yet received "
          "micro-batch 0 (two micro-batches in flight, tokens unchanged)") {
  // Pipelining, without relying on the machine's scheduler: rank 1 is held before it receives
  // anything, and rank 0 must still run micro-batch 0 and then micro-batch 1 and send both.
  // An executor that made stage 0 wait for stage 1 within a round never opens the gate.
  const auto& F = fixture();
  const model::ModelSpec spec(F.weights.config);
  const std::vector<engine::GenerationRequest> req{{F.prompt(0), 256}, {F.prompt(1), 64}};
  engine::InferenceOptions opt;
  opt.sampler.temperature = 0.0f;
  opt.microbatches = 2;
  const auto part = partition::uniform(spec, 2);
  const auto plan = engine::inference_plan(F.weights.config, part, req, 2);
  transport::InProcessFabric fabric(2);
  auto endpoints = transport::endpoints(fabric);
  RunAheadGate gate;
  std::vector<GatedTransport<transport::InProcessTransport>> gated;
  for (auto& e : endpoints) gated.emplace_back(e, gate);
  const auto rep = engine::generate(std::span(gated), F.weights, plan, req, opt);
  CHECK(gate.rank1_held);
  CHECK(gate.released);
  for (int m = 0; m < 2; ++m) CHECK(rep.sequences[static_cast<std::size_t>(m)].tokens == F.ids(m));
  // In the Timeline, stage 0's forward of micro-batch 1 in round 0 ended before stage 1's
  // forward of micro-batch 0 began.
  const Interval* f0m1 = nullptr;
  const Interval* f1m0 = nullptr;
  for (const auto& iv : rep.timeline.intervals()) {
    if (iv.op != Op::F || iv.chunk != 0) continue;
    if (iv.rank == 0 && iv.microbatch == 1) f0m1 = &iv;
    if (iv.rank == 1 && iv.microbatch == 0) f1m0 = &iv;
  }
  REQUIRE(f0m1 != nullptr);
  REQUIRE(f1m0 != nullptr);
  CHECK(f0m1->end <= f1m0->start);
}

TEST_CASE("engine.generate: an inference Plan runs token for token like its partition, the "
          "simulator prices it, and a plan for other requests is refused") {
  const auto& F = fixture();
  const model::ModelSpec spec(F.weights.config);
  const std::vector<engine::GenerationRequest> req{{F.prompt(0), 256}, {F.prompt(1), 64}};
  engine::InferenceOptions opt;
  opt.sampler.temperature = 0.0f;
  const auto part = partition::uniform(spec, 2);
  const plan::Plan p = engine::inference_plan(F.weights.config, part, req, 2);
  CHECK(p.shape().mode == schedule::Mode::Inference);
  CHECK(p.shape().num_microbatches == 2);
  REQUIRE(p.work().size() == 2);
  CHECK(p.work()[0].tokens == static_cast<std::int64_t>(F.prompt(0).size()));
  CHECK(p.work()[1].sequences == 1);
  const auto rep = engine::generate(F.weights, p, req, opt);
  for (int m = 0; m < 2; ++m) CHECK(rep.sequences[static_cast<std::size_t>(m)].tokens == F.ids(m));
  // The simulator takes the same value: every group runs the plan's bound on rounds.
  cost::RooflineOptions ro;
  ro.rates = {1e10, 1e10};
  const auto sim = sim::simulate(p, cost::RooflineCostModel(spec, p, ro));
  CHECK(sim.actions == p.schedule().num_actions());
  CHECK(sim.makespan > 0.0);
  // Plans and options that do not fit the requests.
  const std::vector<engine::GenerationRequest> longer{{F.prompt(0), 200}, {F.prompt(1), 64}};
  CHECK_THROWS_WITH_AS(engine::generate(F.weights, p, longer, opt),
                       doctest::Contains("the plan was made for other requests"), Error);
  opt.microbatches = 1;
  CHECK_THROWS_WITH_AS(engine::generate(F.weights, p, req, opt),
                       doctest::Contains("the plan has 2 micro-batches for 2 requests with "
                                         "microbatches = 1"),
                       Error);
  opt.microbatches = 0;
  const auto train = plan::Plan(part, schedule::one_f_one_b({2, 2}));
  CHECK_THROWS_WITH_AS(engine::generate(F.weights, train, req, opt),
                       doctest::Contains("the plan is a training plan"), Error);
  const model::ModelSpec other(model::named_config("15M"));
  CHECK_THROWS_WITH_AS(engine::generate(F.weights, partition::uniform(other, 2), req, opt),
                       doctest::Contains("the partition covers 10 layers, the model has 9"),
                       Error);
  CHECK_THROWS_WITH_AS(engine::generate(F.weights, part, {}, opt),
                       doctest::Contains("no requests"), Error);
  opt.microbatches = -1;
  CHECK_THROWS_WITH_AS(engine::generate(F.weights, part, req, opt),
                       doctest::Contains("microbatches = -1, expected >= 0"), Error);
}
