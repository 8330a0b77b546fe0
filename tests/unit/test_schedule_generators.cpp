// Generators: every one validates, round-trips through its text form and keeps its compute
// order through lower(), over a grid of shapes; their documented structure; the name table.
#include <brigade/schedule.hpp>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <string>

namespace sch = brigade::schedule;
using brigade::Errc;
using brigade::Error;
using sch::Action;
using sch::Op;

namespace {

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

std::string error_of(const std::string& name, const sch::Params& p) {
  try {
    (void)sch::generate(name, p);
  } catch (const Error& e) {
    CHECK(e.code() == Errc::InvalidArgument);
    return e.what();
  }
  FAIL("expected a brigade::Error");
  return {};
}

int count(const std::vector<Action>& prog, Op op) {
  return static_cast<int>(
      std::count_if(prog.begin(), prog.end(), [&](const Action& a) { return a.op == op; }));
}

}  // namespace

TEST_CASE("schedule.generators.grid: validate and round-trip for P 1-8 M 1-16 V 1-4") {
  for (const auto& g : sch::generators()) {
    for (int P : {1, 2, 3, 4, 8}) SUBCASE(fmt::format("{}.p{}", g.name, P).c_str()) {
        for (int M : {1, 2, 3, 4, 8, 16}) {
          for (int V : {1, 2, 4}) {
            if (V > 1 && !g.supports_virtual) continue;
            if (g.required_virtual > 0 && V != g.required_virtual) continue;
            if (g.name == "dualpipe-v" && M < 2 * P) continue;
            const sch::Params p{P, M, V, 2};
            CAPTURE(g.name);
            CAPTURE(P);
            CAPTURE(M);
            CAPTURE(V);
            const sch::Schedule compute = g.make(p);
            CHECK(compute.shape.num_ranks == P);
            CHECK(compute.shape.num_virtual_stages == P * V);
            CHECK(compute.shape.num_microbatches == M);
            for (const auto& prog : compute.ranks)
              for (const auto& a : prog) CHECK(sch::is_compute(a.op));
            CHECK(sch::parse_schedule(sch::to_text(compute)) == compute);
            const sch::Schedule lowered = sch::lower(compute);
            CHECK(sch::parse_schedule(sch::to_text(lowered)) == lowered);
            CHECK(sch::strip_communication(lowered) == compute);
            const auto v = sch::validate(lowered);
            CHECK(v.actions == lowered.num_actions());
            CHECK(v.compute_actions == compute.num_actions());
            CHECK(v.messages * 2 == lowered.num_actions() - compute.num_actions());
          }
        }
      }
  }
}

TEST_CASE("schedule.1f1b.p4.m8: warm-up of P-r-1 forwards then alternation") {
  const auto s = sch::one_f_one_b({4, 8});
  const auto& r0 = s.ranks[0];
  CHECK(sch::to_string(r0[0]) == "0F0");
  CHECK(sch::to_string(r0[3]) == "0F3");
  CHECK(sch::to_string(r0[4]) == "0B0");
  CHECK(sch::to_string(r0[5]) == "0F4");
  const auto& r3 = s.ranks[3];
  CHECK(sch::to_string(r3[0]) == "3F0");
  CHECK(sch::to_string(r3[1]) == "3B0");
  for (const auto& prog : s.ranks) {
    CHECK(count(prog, Op::F) == 8);
    CHECK(count(prog, Op::B) == 8);
  }
}

TEST_CASE("schedule.interleaved.p2.m4.v2: Megatron's order and round-robin placement") {
  const auto s = sch::interleaved_1f1b({2, 4, 2});
  CHECK(s.shape.placement == std::vector<int>{0, 1, 0, 1});
  // Rank 0: warm-up 2(P-1) + (V-1)P = 4 forwards: mb 0,1 on chunk 0, then mb 0,1 on chunk 1.
  std::string r0;
  for (const auto& a : s.ranks[0]) r0 += sch::to_string(a) + " ";
  CHECK(r0 == "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3 ");
  std::string r1;
  for (const auto& a : s.ranks[1]) r1 += sch::to_string(a) + " ";
  CHECK(r1 == "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3 ");
}

// Megatron-LM (get_schedule_table, microbatch_group_size_per_vp_stage) and PyTorch
// (ScheduleInterleaved1F1B: rounds of M / floor(M / P)) run M not divisible by P in groups of at
// least P micro-batches; each group runs chunk 0 for all its micro-batches, then chunk 1.
TEST_CASE("schedule.interleaved.any-m: groups of at least P micro-batches for M not a multiple "
          "of P") {
  auto line = [](const sch::Schedule& s, int r) {
    std::string out;
    for (const auto& a : s.ranks[static_cast<std::size_t>(r)]) out += sch::to_string(a) + " ";
    return out;
  };
  // P = 4, M = 6: one group of 6; rank 3 warms up (V-1) x 6 forwards.
  const auto six = sch::interleaved_1f1b({4, 6, 2});
  CHECK(line(six, 3) == "3F0 3F1 3F2 3F3 3F4 3F5 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 7F4 7B4 7F5 "
                        "7B5 3B0 3B1 3B2 3B3 3B4 3B5 ");
  // P = 4, M = 3 (< P): one group of 3.
  const auto three = sch::interleaved_1f1b({4, 3, 2});
  CHECK(line(three, 3) == "3F0 3F1 3F2 7F0 7B0 7F1 7B1 7F2 7B2 3B0 3B1 3B2 ");
  // P = 2, M = 5: groups {0, 1, 2} and {3, 4}; rank 1's forwards follow the table.
  const auto five = sch::interleaved_1f1b({2, 5, 2});
  std::string fwd;
  for (const auto& a : five.ranks[1])
    if (a.op == Op::F) fwd += sch::to_string(a) + " ";
  CHECK(fwd == "1F0 1F1 1F2 3F0 3F1 3F2 1F3 1F4 3F3 3F4 ");
  // P = 4, M = 13: groups 5, 4, 4 (no group smaller than P); rank 0's first chunk-1 forward
  // comes after the first group's 5 chunk-0 forwards.
  const auto thirteen = sch::interleaved_1f1b({4, 13, 2});
  const auto& r0 = thirteen.ranks[0];
  const auto first_chunk1 = std::find_if(r0.begin(), r0.end(), [](const Action& a) {
    return a.op == Op::F && a.virtual_stage == 4;
  });
  CHECK(first_chunk1 - r0.begin() == 5);
  CHECK(r0[10] == Action{Op::F, 0, 5, 0});  // the second group starts at micro-batch 5
  // When P divides M the groups are the P-sized ones of the original order.
  CHECK(sch::interleaved_1f1b({2, 4, 2}).ranks[0].front() == Action{Op::F, 0, 0, 0});
}

TEST_CASE("schedule.v-shape: Shape::make_v places v and 2P-1-v on rank v") {
  const auto sh = sch::Shape::make_v(4, 8);
  CHECK(sh.num_virtual_stages == 8);
  CHECK(sh.placement == std::vector<int>{0, 1, 2, 3, 3, 2, 1, 0});
  for (int r = 0; r < 4; ++r) CHECK(sh.stages_on(r) == 2);
  CHECK(sch::Shape::make_v(1, 1).placement == std::vector<int>{0, 0});
  CHECK(sch::zero_bubble_v({4, 8, 2}).shape == sh);
  CHECK(sch::dualpipe_v({4, 8, 2}).shape == sh);
  CHECK_THROWS_AS((void)sch::Shape::make_v(0, 1), Error);
  // The text form carries the placement, so a V schedule parses back with it.
  const auto lowered = sch::lower(sch::zero_bubble_v({3, 5, 2}));
  CHECK(sch::parse_schedule(sch::to_text(lowered)).shape.placement ==
        std::vector<int>{0, 1, 2, 2, 1, 0});
}

TEST_CASE("schedule.zb-v.p2.m4: PyTorch's ScheduleZBVZeroBubble order") {
  const auto s = sch::zero_bubble_v({2, 4, 2});
  auto line = [&](int r) {
    std::string out;
    for (const auto& a : s.ranks[static_cast<std::size_t>(r)]) out += sch::to_string(a) + " ";
    return out;
  };
  // Rank 0 holds stages 0 and 3: 2P-1 = 3 forwards of chunk 0, then F1 BI1 BW1 twice, then the
  // steady F0 BI0 BW0 F1 BI1 BW1, then BI0 BW0.
  CHECK(line(0) == "0F0 0F1 0F2 3F0 3BI0 3BW0 3F1 3BI1 3BW1 0F3 0BI0 0BW0 3F2 3BI2 3BW2 0BI1 "
                   "0BW1 3F3 3BI3 3BW3 0BI2 0BW2 0BI3 0BW3 ");
  // Rank 1 holds stages 1 and 2: r = 1 pairs F1 F0, ..., then r = 1 deferred BI0 BI1 pair.
  CHECK(line(1) == "1F0 2F0 1F1 2F1 2BI0 2BW0 1F2 1BI0 1BW0 2F2 2BI1 2BW1 1F3 1BI1 1BW1 2F3 "
                   "2BI2 2BW2 1BI2 2BI3 1BI3 1BW2 2BW3 1BW3 ");
  // M < 2P - 1: the order of M' = 2P - 1 micro-batches with the extra ones dropped.
  const auto small = sch::zero_bubble_v({2, 2, 2});
  CHECK(small.ranks[0].size() == 12);
  (void)sch::validate(sch::lower(small));
}

TEST_CASE("schedule.dualpipe-v.p2.m4: deepseek-ai/DualPipe's dualpipev.py order") {
  const auto s = sch::dualpipe_v({2, 4, 2});
  auto line = [&](int r) {
    std::string out;
    for (const auto& a : s.ranks[static_cast<std::size_t>(r)]) out += sch::to_string(a) + " ";
    return out;
  };
  // Rank 0: (1) F0 F0 (2) F0 F1 (3) BI1 BW F1 (4) [F0 B1] [F1 B0] (5) B1 [F1 B0] (6) B1 BI0
  // (7) BW BI0 (8) BW.
  CHECK(line(0) == "0F0 0F1 0F2 3F0 3BI0 3BW0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0BI2 0BW2 "
                   "0BI3 0BW3 ");
  // Rank 1 (the V's tip): (2) F0 F1 twice (4) two rounds of [F0 B1] [F1 B0] (6) B1 B0, then
  // BI1 BI0 (8) their BWs, oldest first.
  CHECK(line(1) == "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2BI3 1BI3 2BW3 "
                   "1BW3 ");
}

TEST_CASE("schedule.dualpipe-v.overlap: the F & B pairs are adjacent and lower() puts only "
          "their own communication between them") {
  for (int P : {2, 4, 8}) {
    const int M = 3 * P;
    const auto compute = sch::dualpipe_v({P, M, 2});
    const auto lowered = sch::lower(compute);
    for (int r = 0; r < P; ++r) {
      CAPTURE(P);
      CAPTURE(r);
      const auto& prog = compute.ranks[static_cast<std::size_t>(r)];
      int pairs = 0;
      for (std::size_t i = 0; i + 1 < prog.size(); ++i)
        if (prog[i].op == Op::F && prog[i + 1].op == Op::B &&
            prog[i].virtual_stage != prog[i + 1].virtual_stage)
          ++pairs;
      // Step 4: two pairs per iteration; step 5: one.
      CHECK(pairs == 2 * (M - 2 * P + r + 1) + (P - r - 1));
      const auto& low = lowered.ranks[static_cast<std::size_t>(r)];
      for (std::size_t i = 0; i < low.size(); ++i) {
        if (low[i].op != Op::F) continue;
        std::size_t j = i + 1;
        while (j < low.size() && brigade::is_communication(low[j].op)) ++j;
        if (j == low.size() || low[j].op != Op::B || low[j].virtual_stage == low[i].virtual_stage)
          continue;
        for (std::size_t k = i + 1; k < j; ++k) {
          const bool own_send = low[k] == Action{Op::SendF, low[i].virtual_stage,
                                                 low[i].microbatch, 0};
          const bool own_recv = low[k] == Action{Op::RecvB, low[j].virtual_stage,
                                                 low[j].microbatch, 0};
          CHECK((own_send || own_recv));
        }
      }
    }
  }
}

TEST_CASE("schedule.zb-h1.p3.m4: BI on the critical path and BW deferred r steps on rank r") {
  const auto s = sch::zero_bubble_h1({3, 4});
  auto line = [&](int r) {
    std::string out;
    for (const auto& a : s.ranks[static_cast<std::size_t>(r)]) out += sch::to_string(a) + " ";
    return out;
  };
  // Steady state BI, BW, then F (PyTorch's zero-bubble order): the BW frees an activation
  // before the F stashes the next one.
  CHECK(line(0) == "0F0 0F1 0F2 0BI0 0BW0 0F3 0BI1 0BW1 0BI2 0BW2 0BI3 0BW3 ");
  CHECK(line(1) == "1F0 1F1 1BI0 1F2 1BI1 1BW0 1F3 1BI2 1BW1 1BI3 1BW2 1BW3 ");
  CHECK(line(2) == "2F0 2BI0 2F1 2BI1 2F2 2BI2 2BW0 2F3 2BI3 2BW1 2BW2 2BW3 ");
}

TEST_CASE("schedule.inference.p2.m2.v1.d2: rounds in chunk order with SAMPLE on the last stage") {
  const auto s = sch::inference({2, 2, 1, 2});
  CHECK(s.shape.mode == sch::Mode::Inference);
  CHECK(s.shape.num_chunks == 3);
  std::string r1;
  for (const auto& a : s.ranks[1]) r1 += sch::to_string(a) + " ";
  CHECK(r1 ==
        "1F0 1SAMPLE0 1F1 1SAMPLE1 1F0.c1 1SAMPLE0.c1 1F1.c1 1SAMPLE1.c1 1F0.c2 1SAMPLE0.c2 "
        "1F1.c2 1SAMPLE1.c2 ");
  CHECK(count(s.ranks[0], Op::Sample) == 0);
  // V = 2: the ring is walked twice per token; only virtual stage 3 samples.
  const auto ring = sch::inference({2, 2, 2, 0});
  CHECK(count(ring.ranks[1], Op::Sample) == 2);
  CHECK(count(ring.ranks[0], Op::F) == 4);
}

TEST_CASE("schedule.generators.errors: bad parameters give one clear reason") {
  CHECK(contains(error_of("gpipe", {0, 4}), "gpipe: ranks = 0, expected >= 1"));
  CHECK(contains(error_of("1f1b", {4, 0}), "1f1b: microbatches = 0, expected >= 1"));
  CHECK(contains(error_of("1f1b", {4, 8, 2}), "1f1b places one stage per rank"));
  CHECK(contains(error_of("zb-h1", {4, 8, 3}), "use interleaved-1f1b or inference for V > 1"));
  CHECK(contains(error_of("zb-v", {4, 8, 1}),
                 "zb-v: virtual stages per rank = 1, but zb-v places exactly 2 per rank"));
  CHECK(contains(error_of("dualpipe-v", {4, 8, 3}), "dualpipe-v: virtual stages per rank = 3"));
  CHECK(contains(error_of("dualpipe-v", {4, 7, 2}),
                 "dualpipe-v: microbatches = 7, expected at least 2 x ranks = 8"));
  CHECK(contains(error_of("zb-v", {0, 8, 2}), "zb-v: ranks = 0, expected >= 1"));
  CHECK(contains(error_of("interleaved-1f1b", {4, 8, 0}), "virtual stages per rank = 0"));
  CHECK(contains(error_of("inference", {2, 2, 1, -1}), "decode_steps = -1"));
  CHECK(contains(error_of("1f1b", {100000, 100000}), "too large"));
  CHECK(contains(error_of("pipedream", {2, 2}),
                 "unknown schedule 'pipedream', expected one of: gpipe, 1f1b, interleaved-1f1b, "
                 "zb-h1, zb-v, dualpipe-v, adaptive, inference"));
}

TEST_CASE("schedule.registry: names map to the generators") {
  // The built-in generators come first, in order (a test may have registered more after them).
  const std::vector<std::string_view> builtin{
      "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v", "adaptive", "inference"};
  REQUIRE(sch::generators().size() >= builtin.size());
  for (std::size_t i = 0; i < builtin.size(); ++i) CHECK(sch::generators()[i].name == builtin[i]);
  CHECK((sch::find_generator("1f1b").make == &sch::one_f_one_b));
  CHECK(sch::generate("zb-h1", {2, 2}) == sch::zero_bubble_h1({2, 2}));
  CHECK(sch::generate("zb-v", {2, 4, 2}) == sch::zero_bubble_v({2, 4, 2}));
  CHECK(sch::generate("dualpipe-v", {2, 4, 2}) == sch::dualpipe_v({2, 4, 2}));
  CHECK(sch::default_virtual_stages("zb-v") == 2);
  CHECK(sch::default_virtual_stages("dualpipe-v") == 2);
  CHECK(sch::default_virtual_stages("interleaved-1f1b") == 1);
  CHECK(sch::default_virtual_stages("1f1b") == 1);
  CHECK_THROWS_AS((void)sch::default_virtual_stages("zbv"), Error);
  for (const auto& g : sch::generators()) CHECK_FALSE(g.summary.empty());
}
