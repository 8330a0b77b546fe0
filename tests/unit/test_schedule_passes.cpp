// The passes: lower() against hand-written inputs, validate() on good and broken schedules,
// and the swap property (a perturbed schedule validates or is rejected; it never hangs).
#include <brigade/schedule.hpp>
#include <brigade/sim/simulator.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <string>

namespace sch = brigade::schedule;
using brigade::Errc;
using brigade::Error;
using sch::Action;
using sch::Op;

namespace {

template <class F>
std::string error_of(F&& f, Errc expected) {
  try {
    f();
  } catch (const Error& e) {
    CHECK(to_string(e.code()) == to_string(expected));
    return e.what();
  }
  FAIL("expected a brigade::Error");
  return {};
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

sch::Schedule text(const char* s) { return sch::parse_schedule(s); }

}  // namespace

TEST_CASE("schedule.lower.gpipe.p2.m2: sends after producers and receives before consumers") {
  const auto lowered = sch::lower(sch::gpipe({2, 2}));
  const auto expected = text(
      "shape ranks=2 microbatches=2\n"
      "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1\n"
      "rank 1: 1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1\n");
  CHECK(sch::to_text(lowered) == sch::to_text(expected));
  CHECK(sch::strip_communication(lowered) == sch::gpipe({2, 2}));
}

TEST_CASE("schedule.lower.inference.p2.m1.d1: the sampled token returns to stage 0") {
  const auto lowered = sch::lower(sch::inference({2, 1, 1, 1}));
  const auto expected = text(
      "shape ranks=2 microbatches=1 chunks=2 mode=inference\n"
      "rank 0: 0F0 0SEND_F0 0RECV_F0.c1 0F0.c1 0SEND_F0.c1\n"
      "rank 1: 1RECV_F0 1F0 1SAMPLE0 1SEND_F0 1RECV_F0.c1 1F0.c1 1SAMPLE0.c1\n");
  CHECK(sch::to_text(lowered) == sch::to_text(expected));
  // The lowered actions name their peers through the placement.
  CHECK(sch::peer_rank(lowered.shape, {Op::SendF, 1, 0, 0}) == 0);
  CHECK(sch::counterpart(lowered.shape, {Op::SendF, 1, 0, 0}) == Action{Op::RecvF, 0, 0, 1});
  CHECK(sch::counterpart(lowered.shape, {Op::RecvF, 0, 0, 1}) == Action{Op::SendF, 1, 0, 0});
  CHECK_FALSE(sch::counterpart(lowered.shape, {Op::SendF, 1, 0, 1}).has_value());  // last round
  CHECK(sch::validate(lowered).messages == 3);
}

TEST_CASE("schedule.lower.interleaved.p2.v2: edges within a rank get no communication") {
  // P = 1, V = 3: every edge stays on rank 0.
  const auto one = sch::lower(sch::interleaved_1f1b({1, 2, 3}));
  for (const auto& a : one.ranks[0]) CHECK(sch::is_compute(a.op));
  // P = 2, V = 2: stage 1 -> 2 wraps from rank 1 to rank 0.
  const auto two = sch::lower(sch::interleaved_1f1b({2, 2, 2}));
  CHECK(sch::peer_rank(two.shape, {Op::SendF, 1, 0, 0}) == 0);
  CHECK(sch::peer_rank(two.shape, {Op::SendB, 2, 0, 0}) == 1);
  CHECK(sch::validate(two).messages == 2 * 3 * 2);  // 3 boundaries x 2 mbs x (F and B)
}

TEST_CASE("schedule.lower: placement from a Partition") {
  const brigade::model::ModelSpec spec(brigade::model::named_config("260K"));
  // 4 stages placed 0,1,1,0: stage 1 -> 2 is within rank 1.
  const brigade::partition::Partition part(
      spec.num_layers(), 2, {{0, 0, 2}, {1, 2, 4}, {1, 4, 6}, {0, 6, spec.num_layers()}});
  auto s = sch::empty_schedule(sch::Shape::make(2, 1, 2));
  s.ranks[0] = {{Op::F, 0, 0, 0}, {Op::F, 3, 0, 0}};
  s.ranks[1] = {{Op::F, 1, 0, 0}, {Op::F, 2, 0, 0}};
  // Under the default round-robin placement these actions sit on the wrong ranks.
  CHECK(contains(error_of([&] { (void)sch::lower(s); }, Errc::InvalidArgument),
                 "names virtual stage 3, which is placed on rank 1"));
  const auto lowered = sch::lower(s, part);
  CHECK(lowered.shape.placement == std::vector<int>{0, 1, 1, 0});
  CHECK(lowered.ranks[1] ==
        std::vector<Action>{
            {Op::RecvF, 1, 0, 0}, {Op::F, 1, 0, 0}, {Op::F, 2, 0, 0}, {Op::SendF, 2, 0, 0}});
  CHECK(sch::validate(lowered).messages == 2);
}

TEST_CASE("schedule.lower: rejects communication ops and shapes that do not match") {
  auto s = sch::lower(sch::one_f_one_b({2, 2}));
  CHECK(contains(error_of([&] { (void)sch::lower(s); }, Errc::InvalidArgument),
                 "is a communication op; lower() takes a compute-only schedule"));
  auto t = sch::one_f_one_b({2, 2});
  t.ranks.pop_back();
  CHECK(contains(error_of([&] { (void)sch::lower(t); }, Errc::InvalidArgument),
                 "1 rank programs, expected shape.num_ranks = 2"));
}

TEST_CASE("schedule.validate.deadlock.p2.m2: a hand-written cycle is named") {
  // Rank 1 runs both forwards before any backward; rank 0 waits for B0 before sending F1.
  const auto s = text(
      "shape ranks=2 microbatches=2\n"
      "rank 0: 0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1\n"
      "rank 1: 1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1\n");
  const std::string msg = error_of([&] { sch::validate(s); }, Errc::Deadlock);
  CHECK(contains(msg, "wait-for cycle rank 0 -> rank 1 -> rank 0"));
  CHECK(contains(msg, "rank 0 blocks at step 2 on 0RECV_B0, sent by 1SEND_B0 at rank 1 step 5"));
  CHECK(contains(msg, "rank 1 blocks at step 2 on 1RECV_F1, sent by 0SEND_F1 at rank 0 step 5"));
  CHECK(contains(msg, "cycle: rank 0 waits 0RECV_B0 <- rank 1 waits 1RECV_F1 <- rank 0"));
  // The grid excerpt marks both blocked steps.
  CHECK(contains(msg, "[0RECV_B0]"));
  CHECK(contains(msg, "[1RECV_F1]"));
  CHECK(contains(msg, "<-- rank 0, rank 1"));
  // The simulator refuses it too, with the same reason.
  const brigade::cost::UnitCostModel unit(s.shape, 1, 2);
  CHECK(contains(error_of([&] { (void)brigade::sim::simulate(s, unit); }, Errc::Deadlock),
                 "wait-for cycle"));
  brigade::sim::SimOptions raw;
  raw.validate = false;
  CHECK(contains(error_of([&] { (void)brigade::sim::simulate(s, unit, raw); }, Errc::Deadlock),
                 "is blocked at step 2"));
}

TEST_CASE("schedule.validate.missing-send.p2.m2: the chain ends at the send that is missing") {
  auto s = sch::lower(sch::one_f_one_b({2, 2}));
  auto& r0 = s.ranks[0];
  r0.erase(std::find(r0.begin(), r0.end(), Action{Op::SendF, 0, 1, 0}));
  const std::string msg = error_of([&] { sch::validate(s); }, Errc::Deadlock);
  CHECK(contains(msg, "rank 1 waits on 1RECV_F1, which no rank sends (receive without send)"));
  CHECK(contains(msg, "0SEND_F1 is absent from rank 0"));
  CHECK(contains(msg,
                 "wait-for chain: rank 0 waits 0RECV_B1 <- rank 1 waits 1RECV_F1 <- missing "
                 "0SEND_F1 on rank 0"));
  CHECK(contains(msg, "[1RECV_F1]"));
}

TEST_CASE("schedule.validate.dependencies: backward before forward and other order errors") {
  struct Bad {
    const char* text;
    const char* needle;
  };
  const Bad cases[] = {
      {"shape ranks=1 microbatches=1\nrank 0: 0B0 0F0\n",
       "rank 0 step 0: 0B0 is a backward before its forward 0F0"},
      {"shape ranks=1 microbatches=1\nrank 0: 0F0 0BW0 0BI0\n", "0BW0 runs before 0BI0"},
      {"shape ranks=1 microbatches=1 stages=2\nrank 0: 1F0 0F0\n",
       "1F0 runs before its input 0F0 on the same rank"},
      {"shape ranks=2 microbatches=1\nrank 0: 0F0 0SEND_F0\nrank 1: 1F0 1RECV_F0\n",
       "1F0 runs before its input arrived: no earlier 1RECV_F0 on rank 1"},
      {"shape ranks=2 microbatches=1\nrank 0: 0SEND_F0 0F0\nrank 1: 1RECV_F0 1F0\n",
       "0SEND_F0 sends before computing what it sends (0F0)"},
      {"shape ranks=1 microbatches=2\nrank 0: 0F0 0B0 0OPT0 0F1 0B1\n",
       "steps the optimizer before the weight gradient of micro-batch 1"},
      {"shape ranks=1 microbatches=1 chunks=2 mode=inference\nrank 0: 0F0.c1 0SAMPLE0.c1 0F0 "
       "0SAMPLE0\n",
       "0F0.c1 runs before its input 0SAMPLE0 on the same rank"},
  };
  for (const auto& b : cases) {
    CAPTURE(b.text);
    const std::string msg = error_of([&] { sch::validate(text(b.text)); }, Errc::InvalidArgument);
    CHECK(contains(msg, b.needle));
  }
}

TEST_CASE("schedule.validate.static: missing micro-batches pairing duplicates placement") {
  struct Bad {
    const char* text;
    const char* needle;
  };
  const Bad cases[] = {
      {"shape ranks=2 microbatches=2\nrank 0: 0F0 0SEND_F0 0F1 0SEND_F1\nrank 1: 1RECV_F0 1F0\n",
       "micro-batch 1 is missing on virtual stage 1 (rank 1): no forward 1F1"},
      {"shape ranks=1 microbatches=2\nrank 0: 0F0 0F1 0B0\n",
       "micro-batch 1 is missing on virtual stage 0 (rank 0): no backward"},
      {"shape ranks=1 microbatches=1\nrank 0: 0F0 0BI0\n", "0BI0 without 0BW0"},
      {"shape ranks=1 microbatches=1\nrank 0: 0F0 0B0 0BI0 0BW0\n", "both a full backward"},
      {"shape ranks=1 microbatches=1\nrank 0: 0F0 0F0\n", "rank 0 step 1: 0F0 appears twice"},
      {"shape ranks=2 microbatches=1\nrank 0: 1F0\nrank 1: 0F0\n",
       "rank 0 step 0: 1F0 names virtual stage 1, which is placed on rank 1"},
      {"shape ranks=2 microbatches=1\nrank 0: 0F0\nrank 1: 1F0 1SEND_F0\n",
       "1SEND_F0 has no counterpart in a training schedule of 2 virtual stages"},
      {"shape ranks=1 stages=2 microbatches=1\nrank 0: 0F0 0SEND_F0 1RECV_F0 1F0\n",
       "pairs with 1RECV_F0 on the same rank"},
      {"shape ranks=2 microbatches=1\nrank 0: 0F0 0SEND_F0\nrank 1: 1F0\n",
       "0SEND_F0 has no matching receive: 1RECV_F0 is absent from rank 1"},
      {"shape ranks=1 microbatches=1 stages=1 mode=inference\nrank 0: 0F0\n",
       "no 0SAMPLE0 (inference samples every round on the last stage)"},
      {"shape ranks=2 microbatches=1 mode=inference\nrank 0: 0F0 0SAMPLE0\nrank 1: 1F0 1SAMPLE0\n",
       "0SAMPLE0 samples on virtual stage 0"},
      {"shape ranks=1 microbatches=1 mode=inference\nrank 0: 0F0 0SAMPLE0 0B0\n",
       "an inference schedule holds backward ops"},
  };
  for (const auto& b : cases) {
    CAPTURE(b.text);
    const std::string msg = error_of([&] { sch::validate(text(b.text)); }, Errc::InvalidArgument);
    CHECK(contains(msg, b.needle));
  }
}

TEST_CASE("schedule.validate.property: random swaps validate or are rejected and never hang" *
          doctest::timeout(120)) {
  std::mt19937 rng(20240611u);
  int accepted = 0, deadlocks = 0, invalid = 0;
  const char* names[] = {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v",
                         "inference"};
  for (int iter = 0; iter < 700; ++iter) {
    const std::string name = names[iter % 7];
    const auto& gen = sch::find_generator(name);
    const int P = 1 + static_cast<int>(rng() % 4);
    const int V = gen.required_virtual > 0 ? gen.required_virtual
                  : gen.supports_virtual   ? 1 + static_cast<int>(rng() % 3)
                                           : 1;
    int M = 1 + static_cast<int>(rng() % 6);
    if (name == "dualpipe-v") M += 2 * P;
    auto s = sch::lower(gen.make({P, M, V, 1 + static_cast<int>(rng() % 2)}));
    const int swaps = 1 + static_cast<int>(rng() % 2);
    for (int k = 0; k < swaps; ++k) {
      auto& prog = s.ranks[rng() % s.ranks.size()];
      if (prog.size() < 2) continue;
      std::swap(prog[rng() % prog.size()], prog[rng() % prog.size()]);
    }
    CAPTURE(sch::to_text(s));
    try {
      sch::validate(s);
      ++accepted;
      // A schedule that validates also simulates to completion.
      const brigade::cost::UnitCostModel unit(s.shape, 1, 2);
      const auto r = brigade::sim::simulate(s, unit);
      CHECK(std::isfinite(r.makespan));
      CHECK(r.actions == s.num_actions());
    } catch (const Error& e) {
      if (e.code() == Errc::Deadlock) {
        ++deadlocks;
        CHECK(contains(e.what(), "waits"));
      } else {
        CHECK(e.code() == Errc::InvalidArgument);
        ++invalid;
      }
    }
  }
  MESSAGE("accepted " << accepted << ", deadlocks " << deadlocks << ", invalid " << invalid);
  CHECK(accepted > 0);
  CHECK(deadlocks > 0);
  CHECK(invalid > 0);
}
