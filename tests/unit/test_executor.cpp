// engine::execute, the one executor of training and inference, against schedule::validate():
// inference rounds equal the lowered generator, the in-order matching rule (issue 9, item 5),
// rendezvous sends, and the property that what validates completes and what it rejects fails.
#include <brigade/engine/executor.hpp>
#include <brigade/engine/training.hpp>
#include <brigade/engine/threads.hpp>
#include <brigade/schedule.hpp>
#include <brigade/transport/in_process.hpp>

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <algorithm>
#include <random>
#include <string>
#include <vector>

using brigade::test::rel;

namespace sch = brigade::schedule;
namespace eng = brigade::engine;
namespace tp = brigade::transport;
using brigade::Errc;
using brigade::Error;
using sch::Action;
using sch::Op;

namespace {

/// A Worker that moves one int per message, tagged by channel like the real workers, and
/// refuses a compute action whose inputs are not there (as a TrainStage would).
class CheckingWorker {
 public:
  CheckingWorker(const sch::Shape& shape, int rank) : shape_(&shape), rank_(rank) {
    const auto n = static_cast<std::size_t>(shape.num_virtual_stages * shape.num_microbatches *
                                            shape.num_chunks);
    f_.assign(n, 0);
    bi_.assign(n, 0);
    bw_.assign(n, 0);
    in_f_.assign(n, 0);
    in_b_.assign(n, 0);
  }
  eng::Work compute(const Action& a) {
    const auto k = key(a);
    auto need = [&](bool ok, const char* what) {
      BRIGADE_CHECK(ok, Errc::InvalidUsage, "rank {}: {} without {}", rank_, sch::to_string(a),
                    what);
    };
    const int last = shape_->num_virtual_stages - 1;
    switch (a.op) {
      case Op::F:
        if (a.virtual_stage > 0) {
          const Action up{Op::F, a.virtual_stage - 1, a.microbatch, a.chunk};
          need(in_f_[k] || (shape_->rank_of(up.virtual_stage) == rank_ && f_[key(up)]), "input");
        }
        f_[k] = 1;
        break;
      case Op::B:
      case Op::BI:
        need(f_[k], "forward");
        if (a.virtual_stage < last) {
          const Action up{Op::B, a.virtual_stage + 1, a.microbatch, a.chunk};
          need(in_b_[k] || (shape_->rank_of(up.virtual_stage) == rank_ && bi_[key(up)]),
               "output gradient");
        }
        bi_[k] = 1;
        if (a.op == Op::B) bw_[k] = 1;
        break;
      case Op::BW:
        need(bi_[k], "backward-input");
        bw_[k] = 1;
        break;
      default:
        break;
    }
    return {true, 1, {}};
  }
  void recv_messages(const Action& a, std::vector<eng::MessageSpec>& out) {
    out.push_back({sch::channel_of(*shape_, a),
                   tp::MessageHeader::make(a.microbatch, a.virtual_stage, brigade::DType::I32, {1}),
                   4});
  }
  void received(const Action& a, std::span<const eng::Received>) {
    (a.op == Op::RecvF ? in_f_ : in_b_)[key(a)] = 1;
  }
  void send(const Action& a, eng::Outbox& out) {
    const Action peer = *sch::counterpart(*shape_, a);
    BRIGADE_CHECK(a.op == Op::SendF ? f_[key(a)] : bi_[key(a)], Errc::InvalidUsage,
                  "rank {}: {} before its producer", rank_, sch::to_string(a));
    const std::int32_t v = 7;
    out.add(sch::channel_of(*shape_, a),
            tp::MessageHeader::make(a.microbatch, peer.virtual_stage, brigade::DType::I32, {1}),
            tp::as_bytes(std::span<const std::int32_t>(&v, 1)));
  }

 private:
  [[nodiscard]] std::size_t key(const Action& a) const {
    return static_cast<std::size_t>(
        (a.virtual_stage * shape_->num_microbatches + a.microbatch) * shape_->num_chunks + a.chunk);
  }
  const sch::Shape* shape_;
  int rank_;
  std::vector<char> f_, bi_, bw_, in_f_, in_b_;
};

/// Runs every rank's program of `s` on threads over the executor; rethrows the root cause.
void execute_all(const sch::Schedule& s, double timeout_s, eng::ExecutorWindows w = {}) {
  const int P = s.shape.num_ranks;
  tp::InProcessFabric fabric(P);
  const auto t0 = std::chrono::steady_clock::now();
  auto endpoints = tp::endpoints(fabric);
  eng::run_ranks(std::span(endpoints), [&](tp::InProcessTransport& t) {
    const int r = t.rank();
    CheckingWorker worker(s.shape, r);
    eng::FixedProgram program(s.ranks[static_cast<std::size_t>(r)]);
    brigade::Timeline tl(P);
    eng::execute(program, worker, t, eng::ExecutorRun{&s.shape, r, t0, timeout_s, w}, tl);
  });
}

std::string error_of(const auto& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

}  // namespace

TEST_CASE("executor.rounds: inference rounds emitted one by one equal the lowered generator") {
  for (int P = 1; P <= 3; ++P)
    for (int V = 1; V <= 2; ++V)
      for (int M = 1; M <= 3; ++M)
        for (int D = 0; D <= 2; ++D) {
          CAPTURE(P);
          CAPTURE(V);
          CAPTURE(M);
          CAPTURE(D);
          const auto lowered = sch::lower(sch::inference({P, M, V, D}));
          const std::vector<char> live(static_cast<std::size_t>(M), 1);
          for (int r = 0; r < P; ++r) {
            std::vector<Action> out;
            for (int c = 0; c <= D; ++c)
              sch::append_inference_round(lowered.shape, r, c, live, out);
            CHECK(out == lowered.ranks[static_cast<std::size_t>(r)]);
          }
          sch::validate(lowered);
        }
  const auto sh = sch::inference({2, 3, 1, 2}).shape;
  std::vector<Action> out;
  const std::vector<char> some{1, 0, 1};
  sch::append_inference_round(sh, 1, 1, some, out);
  CHECK(out == std::vector<Action>{{Op::RecvF, 1, 0, 1}, {Op::F, 1, 0, 1}, {Op::Sample, 1, 0, 1},
                                   {Op::SendF, 1, 0, 1}, {Op::RecvF, 1, 2, 1}, {Op::F, 1, 2, 1},
                                   {Op::Sample, 1, 2, 1}, {Op::SendF, 1, 2, 1}});
  CHECK(error_of([&] { sch::append_inference_round(sch::gpipe({2, 2}).shape, 0, 0, some, out); })
            .find("a training shape, expected inference") != std::string::npos);
}

TEST_CASE("executor.matching: sending micro-batch 1 before 0 to the same peer is rejected by "
          "validate, as the executor fails on it (issue 9, item 5)") {
  const auto s = sch::parse_schedule(
      "shape ranks=2 microbatches=2\n"
      "rank 0: 0F0 0F1 0SEND_F1 0SEND_F0\n"
      "rank 1: 1RECV_F0 1F0 1RECV_F1 1F1\n");
  const std::string why = error_of([&] { sch::validate(s); });
  CHECK(why.find("validate: rank 1 step 0: 1RECV_F0 is receive #1 from rank 0 on the activation "
                 "channel, but message #1 that rank 0 sends on it is 0SEND_F1 (step 2); receives "
                 "match sends in order per (peer, tag), so the executor would fail with "
                 "HeaderMismatch") != std::string::npos);
  try {
    execute_all(s, 10.0);
    FAIL("the executor completed a schedule that should fail");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::HeaderMismatch);
    CHECK(std::string(e.what()).find("has microbatch = 1, expected 0") != std::string::npos);
  }
  // In order, both agree that it completes.
  const auto ok = sch::parse_schedule(
      "shape ranks=2 microbatches=2\n"
      "rank 0: 0F0 0F1 0SEND_F0 0SEND_F1\n"
      "rank 1: 1RECV_F0 1F0 1RECV_F1 1F1\n");
  CHECK(sch::validate(ok).semantics == "eager sends, receives matched in order per (peer, tag)");
  execute_all(ok, 10.0);
}

TEST_CASE("executor.rendezvous: the generators' schedules complete with the executor's default "
          "windows when large sends block until received, tight windows can deadlock") {
  sch::ExecutionModel rv;
  rv.sends = sch::SendSemantics::Rendezvous;
  for (const char* name : {"gpipe", "1f1b", "zb-h1"})
    for (int P = 2; P <= 4; ++P)
      for (int M : {1, 2, 4, 8, 16}) {
        CAPTURE(name);
        CAPTURE(P);
        CAPTURE(M);
        const auto r = sch::validate(sch::lower(sch::generate(name, {P, M})), rv);
        CHECK(r.semantics.find("rendezvous sends") != std::string::npos);
      }
  for (const char* name : {"interleaved-1f1b", "zb-v", "dualpipe-v"})
    for (int P = 2; P <= 4; ++P)
      for (int M : {2 * P, 4 * P}) {
        CAPTURE(name);
        CAPTURE(P);
        CAPTURE(M);
        sch::validate(sch::lower(sch::generate(name, {P, M, 2})), rv);
      }
  // Inference sends two messages (descriptor, activations) per SEND_F: half the send window.
  sch::ExecutionModel rv_inference = rv;
  rv_inference.windows.send_window = eng::ExecutorWindows{}.send_window / 2;
  for (int P = 2; P <= 3; ++P)
    for (int V = 1; V <= 2; ++V)
      for (int M : {1, P, 4 * P}) {
        CAPTURE(P);
        CAPTURE(V);
        CAPTURE(M);
        sch::validate(sch::lower(sch::inference({P, M, V, 3})), rv_inference);
      }
  // Virtual stages 0 and 2 on rank 0, 1 on rank 1: rank 0 sends micro-batch 1's activation (X)
  // and then micro-batch 0's gradient (Y) to rank 1, which receives Y first. With one send in
  // flight and one receive posted ahead, rank 0 waits for X to be received before it sends Y,
  // and rank 1 waits for Y before it posts X's receive: eager sends complete, rendezvous ones
  // deadlock; a receive window of 2 lets rank 1 post X's receive early.
  const auto s = sch::parse_schedule(
      "shape ranks=2 stages=3 microbatches=2 placement=0,1,0\n"
      "rank 0: 0F0 0SEND_F0 2RECV_F0 2F0 0F1 0SEND_F1 2B0 2SEND_B0 2RECV_F1 2F1 2B1 2SEND_B1 "
      "0RECV_B0 0B0 0RECV_B1 0B1\n"
      "rank 1: 1RECV_F0 1F0 1SEND_F0 1RECV_B0 1B0 1SEND_B0 1RECV_F1 1F1 1SEND_F1 1RECV_B1 1B1 "
      "1SEND_B1\n");
  sch::validate(s);
  execute_all(s, 30.0);
  sch::ExecutionModel tight = rv;
  tight.windows = {1, 1};
  const std::string why = error_of([&] { sch::validate(s, tight); });
  CHECK(why.find("validate (rendezvous sends (a send completes when its receive is posted), "
                 "receives matched in order per (peer, tag), receive window 1, send window 1): "
                 "deadlock:") != std::string::npos);
  CHECK(why.find("rank 0 blocks at step 7 (2SEND_B0) waiting for its send 0SEND_F1 (step 5) to "
                 "complete: rank 1 has not posted that receive (its receive #3, 1 received so "
                 "far, window 1)") != std::string::npos);
  CHECK(why.find("rank 1 blocks at step 3 on 1RECV_B0 (not yet sent)") != std::string::npos);
  tight.windows = {2, 1};
  sch::validate(s, tight);
}

TEST_CASE("executor.property: random legal reorderings that validate complete in the executor, "
          "those it rejects fail or hang there") {
  std::mt19937 rng(20261130);
  int accepted = 0, rejected = 0;
  for (int trial = 0; trial < 72; ++trial) {
    const char* names[] = {"gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "dualpipe-v"};
    const char* name = names[trial % 6];
    const int P = 2 + static_cast<int>(rng() % 2);
    const int V = trial % 6 >= 3 ? 2 : 1;
    const int M = V > 1 ? 2 * P * (1 + static_cast<int>(rng() % 2)) : 1 + static_cast<int>(rng() % 4);
    auto s = sch::lower(sch::generate(name, {P, M, V}));
    // A few random adjacent swaps within one rank's program.
    const int swaps = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < swaps; ++k) {
      auto& prog = s.ranks[rng() % s.ranks.size()];
      if (prog.size() < 2) continue;
      const std::size_t i = rng() % (prog.size() - 1);
      std::swap(prog[i], prog[i + 1]);
    }
    CAPTURE(sch::to_text(s));
    bool valid = true;
    try {
      sch::validate(s);
    } catch (const Error&) {
      valid = false;
    }
    std::string failure;
    try {
      execute_all(s, valid ? 30.0 : 0.5);
    } catch (const Error& e) {
      failure = e.what();
    }
    if (valid) {
      ++accepted;
      CHECK(failure.empty());
    } else {
      ++rejected;
      CHECK(!failure.empty());
    }
  }
  MESSAGE("accepted ", accepted, ", rejected ", rejected);
  CHECK(accepted > 0);
  CHECK(rejected > 0);
}

TEST_CASE("executor.training: chunked and inference schedules are refused by the training worker") {
  auto sh = sch::gpipe({2, 2}).shape;
  sh.num_chunks = 2;
  CHECK(error_of([&] { eng::TrainingWorker(std::span<const Action>{}, sh, 0, {}, {}, 1.0, 8); })
            .find("executor: a schedule in training mode with 2 chunk(s) per micro-batch; the "
                  "training worker runs training schedules of 1 chunk only") != std::string::npos);
  const auto inf = sch::inference({2, 2, 1, 1}).shape;
  CHECK(error_of([&] { eng::TrainingWorker(std::span<const Action>{}, inf, 0, {}, {}, 1.0, 8); })
            .find("a schedule in inference mode with 2 chunk(s)") != std::string::npos);
}

namespace {

/// A user's generator: GPipe with the backwards in reverse micro-batch order.
sch::Schedule reverse_gpipe(const sch::Params& p) {
  auto s = sch::gpipe(p);
  for (auto& prog : s.ranks) std::reverse(prog.begin() + p.microbatches, prog.end());
  return s;
}

}  // namespace

TEST_CASE("schedule.registry: a generator registered at run time is found by name, validates "
          "and runs in the executor, names are unique") {
  sch::register_generator({"reverse-gpipe", "GPipe, backwards last micro-batch first",
                           &reverse_gpipe, false});
  CHECK(sch::find_generator("reverse-gpipe").summary == "GPipe, backwards last micro-batch first");
  CHECK(sch::generators().back().name == "reverse-gpipe");
  const auto s = sch::lower(sch::generate("reverse-gpipe", {3, 4}));
  CHECK(s.ranks[0][8] == Action{Op::RecvB, 0, 3, 0});
  sch::validate(s);
  execute_all(s, 30.0);
  CHECK(error_of([] {
          sch::register_generator({"reverse-gpipe", "again", &reverse_gpipe, false});
        }).find("a schedule called 'reverse-gpipe' exists already") != std::string::npos);
  CHECK(error_of([] { sch::register_generator({"", "no name", &reverse_gpipe, false}); })
            .find("needs a name and a function") != std::string::npos);
  CHECK(error_of([] { sch::generate("nope", {2, 2}); }).find("reverse-gpipe") !=
        std::string::npos);
}

TEST_CASE("executor.measured_costs: each action as measured (else prefill and decode means), "
          "link latency from waiting receivers only, send overhead") {
  // Two ranks, one micro-batch, three rounds of inference.
  const auto shape = sch::Shape::make(2, 1, 1, 3, sch::Mode::Inference);
  brigade::Timeline tl(2);
  auto add = [&](int rank, Op op, int v, int round, double start, double end) {
    brigade::Interval iv;
    iv.rank = rank;
    iv.op = op;
    iv.virtual_stage = v;
    iv.chunk = round;
    iv.start = start;
    iv.end = end;
    tl.add(iv);
  };
  add(0, Op::F, 0, 0, 0.0, 1.0);      // prefill
  add(0, Op::F, 0, 1, 2.0, 2.5);      // decode
  add(0, Op::F, 0, 2, 3.0, 3.7);      // decode
  add(0, Op::SendF, 0, 1, 2.5, 2.6);  // two messages of one SEND: the first post counts
  add(0, Op::SendF, 0, 1, 2.55, 2.6);
  add(1, Op::RecvF, 1, 1, 2.0, 2.7);  // waiting since 2.0: latency 2.7 - 2.5 = 0.2
  add(0, Op::SendF, 0, 2, 3.7, 3.8);
  add(1, Op::RecvF, 1, 2, 3.9, 4.5);  // arrived before the receiver got there: not a sample
  add(1, Op::F, 1, 1, 2.7, 3.0);
  const eng::MeasuredCostModel m(shape, tl);
  CHECK(m.compute_seconds({Op::F, 0, 0, 0}) == doctest::Approx(1.0));
  CHECK(m.compute_seconds({Op::F, 0, 0, 1}) == rel(0.5));  // each as measured
  CHECK(m.compute_seconds({Op::F, 0, 0, 2}) == rel(0.7));
  // Actions the timeline does not hold: the mean of their (op, stage, phase), or of the other
  // phase when that one never ran (stage 1 ran no prefill).
  const eng::MeasuredCostModel wider(sch::Shape::make(2, 2, 1, 3, sch::Mode::Inference), tl);
  CHECK(wider.compute_seconds({Op::F, 0, 1, 2}) == rel(0.6));  // (0.5 + 0.7) / 2
  CHECK(wider.compute_seconds({Op::F, 0, 1, 0}) == doctest::Approx(1.0));
  CHECK(m.compute_seconds({Op::F, 1, 0, 0}) == rel(0.3));
  CHECK(m.compute_seconds({Op::SendF, 0, 0, 1}) == 0.0);
  CHECK(m.link(0, 1).latency_s == rel(0.2));
  CHECK(m.link(1, 0).latency_s == 0.0);
  CHECK(m.message_latency_seconds({Op::SendF, 0, 0, 1}) == rel(0.2));  // its own
  CHECK(m.message_latency_seconds({Op::SendF, 0, 0, 2}) == rel(0.2));  // the link's
  CHECK(m.link(0, 1).is_free() == false);
  // Rank 0 ran from 0 to 3.7 s with 2.2 s of F: 1.5 s outside intervals over its 2 SENDs.
  CHECK(m.send_overhead_seconds({Op::SendF, 0, 0, 1}) == rel(0.75));
  CHECK(m.send_overhead_seconds({Op::SendF, 1, 0, 1}) == 0.0);  // rank 1 sent nothing
}
