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
            if (g.name == "interleaved-1f1b" && V > 1 && M % P != 0) continue;
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

TEST_CASE("schedule.zb-h1.p3.m4: BI on the critical path and BW deferred r steps on rank r") {
  const auto s = sch::zero_bubble_h1({3, 4});
  auto line = [&](int r) {
    std::string out;
    for (const auto& a : s.ranks[static_cast<std::size_t>(r)]) out += sch::to_string(a) + " ";
    return out;
  };
  CHECK(line(0) == "0F0 0F1 0F2 0BI0 0F3 0BW0 0BI1 0BW1 0BI2 0BW2 0BI3 0BW3 ");
  CHECK(line(1) == "1F0 1F1 1BI0 1F2 1BI1 1F3 1BW0 1BI2 1BW1 1BI3 1BW2 1BW3 ");
  CHECK(line(2) == "2F0 2BI0 2F1 2BI1 2F2 2BI2 2F3 2BW0 2BI3 2BW1 2BW2 2BW3 ");
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
  CHECK(contains(error_of("interleaved-1f1b", {4, 6, 2}),
                 "microbatches = 6 is not a multiple of ranks = 4"));
  CHECK(contains(error_of("interleaved-1f1b", {4, 8, 0}), "virtual stages per rank = 0"));
  CHECK(contains(error_of("inference", {2, 2, 1, -1}), "decode_steps = -1"));
  CHECK(contains(error_of("1f1b", {100000, 100000}), "too large"));
  CHECK(contains(error_of("pipedream", {2, 2}),
                 "unknown schedule 'pipedream', expected one of: gpipe, 1f1b, interleaved-1f1b, "
                 "zb-h1, inference"));
}

TEST_CASE("schedule.registry: names map to the generators") {
  CHECK(sch::generators().size() == 5);
  CHECK((sch::find_generator("1f1b").make == &sch::one_f_one_b));
  CHECK(sch::generate("zb-h1", {2, 2}) == sch::zero_bubble_h1({2, 2}));
  for (const auto& g : sch::generators()) CHECK_FALSE(g.summary.empty());
}
