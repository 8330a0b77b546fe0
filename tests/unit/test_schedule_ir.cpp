// The schedule IR: action and schedule text forms, their parsers, the step x rank grid.
#include <brigade/schedule/action.hpp>

#include <doctest/doctest.h>

#include <string>

namespace sch = brigade::schedule;
using brigade::Errc;
using brigade::Error;
using sch::Action;
using sch::Op;

namespace {

/// The message of the brigade::Error `f` throws (fails the test when it throws nothing).
template <class F>
std::string error_of(F&& f, Errc expected = Errc::InvalidArgument) {
  try {
    f();
  } catch (const Error& e) {
    CHECK(e.code() == expected);
    return e.what();
  }
  FAIL("expected a brigade::Error");
  return {};
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

}  // namespace

TEST_CASE("schedule.action.text: examples from the grammar") {
  CHECK(sch::to_string(Action{Op::F, 3, 7, 0}) == "3F7");
  CHECK(sch::to_string(Action{Op::SendB, 2, 4, 0}) == "2SEND_B4");
  CHECK(sch::to_string(Action{Op::BW, 5, 1, 2}) == "5BW1.c2");
  CHECK(sch::to_string(Action{Op::Recompute, 0, 0, 0}) == "0RECOMPUTE0");
  CHECK(sch::parse_action("5BW1.c2") == Action{Op::BW, 5, 1, 2});
  CHECK(sch::parse_action("0F0.c0") == Action{Op::F, 0, 0, 0});       // accepted, printed as 0F0
  CHECK(sch::parse_action("12BI345") == Action{Op::BI, 12, 345, 0});  // BI, not B then I
}

TEST_CASE("schedule.action.text: every op and chunk round-trips") {
  for (int k = 0; k < brigade::kNumOps; ++k) {
    for (int chunk : {0, 1, 17}) {
      const Action a{static_cast<Op>(k), 11, 2047, chunk};
      CAPTURE(sch::to_string(a));
      CHECK(sch::parse_action(sch::to_string(a)) == a);
    }
  }
}

TEST_CASE("schedule.action.parse-errors: name the token the column and the expectation") {
  struct Bad {
    const char* text;
    const char* needle;
  };
  const Bad cases[] = {
      {"", "expected a virtual-stage number"},
      {"F3", "column 1: expected a virtual-stage number"},
      {"3FX1", "column 2: unknown op 'FX', expected one of F, B, BI"},
      {"3f1", "column 2: expected an op"},
      {"3F", "column 3: expected a micro-batch number"},
      {"3F1x", "column 4: unexpected 'x'"},
      {"3F1.c", "column 6: expected a chunk number"},
      {"3F1.c2z", "column 7: unexpected 'z' after the chunk"},
      {"99999999999F1", "expected a virtual-stage number"},
      {"-1F1", "column 1"},
  };
  for (const auto& b : cases) {
    CAPTURE(b.text);
    const std::string msg = error_of([&] { (void)sch::parse_action(b.text); });
    CHECK(contains(msg, std::string("action '") + b.text + "'"));
    CHECK(contains(msg, b.needle));
  }
}

TEST_CASE("schedule.text: a hand-written schedule round-trips exactly") {
  sch::Schedule s{sch::Shape::make(2, 2), {}};
  s.ranks = {{{Op::F, 0, 0, 0}, {Op::SendF, 0, 0, 0}, {Op::F, 0, 1, 0}},
             {{Op::RecvF, 1, 0, 0}, {Op::F, 1, 0, 0}, {}}};
  s.ranks[1].pop_back();
  const std::string text = sch::to_text(s);
  CHECK(contains(text,
                 "shape ranks=2 stages=2 microbatches=2 chunks=1 mode=training placement=0,1\n"));
  CHECK(contains(text, "rank 0: 0F0 0SEND_F0 0F1\n"));
  CHECK(contains(text, "rank 1: 1RECV_F0 1F0\n"));
  CHECK(sch::parse_schedule(text) == s);
  CHECK(sch::to_text(sch::parse_schedule(text)) == text);
}

TEST_CASE("schedule.text: inference shape with chunks and a custom placement round-trips") {
  sch::Schedule s{sch::Shape::make(2, 3, 2, 4, sch::Mode::Inference), {}};
  s.shape.placement = {1, 0, 0, 1};
  s.ranks = {{{Op::F, 1, 2, 3}}, {{Op::Sample, 3, 0, 1}, {}}};
  s.ranks[1].pop_back();
  const sch::Schedule back = sch::parse_schedule(sch::to_text(s));
  CHECK(back == s);
  CHECK(back.shape.mode == sch::Mode::Inference);
}

TEST_CASE("schedule.text: optional shape keys take their defaults, comments and blank lines") {
  const auto s = sch::parse_schedule(
      "# a comment\n\n  shape ranks=3 microbatches=1\nrank 0: 0F0\n# middle\nrank 1:\nrank 2:   "
      "2F0 \n");
  CHECK(s.shape.num_virtual_stages == 3);
  CHECK(s.shape.num_chunks == 1);
  CHECK(s.shape.mode == sch::Mode::Training);
  CHECK(s.shape.placement == std::vector<int>{0, 1, 2});
  CHECK(s.ranks[0] == std::vector<Action>{{Op::F, 0, 0, 0}});
  CHECK(s.ranks[1].empty());
  CHECK(s.ranks[2] == std::vector<Action>{{Op::F, 2, 0, 0}});
}

TEST_CASE("schedule.text.parse-errors: name the line the column and the token") {
  struct Bad {
    const char* text;
    const char* needle;
  };
  const Bad cases[] = {
      {"rank 0: 0F0\n", "line 1, column 1: a rank line before the 'shape' line"},
      {"shape ranks=2 microbatches=1\nrank 0: 0F0 0FX1\n",
       "line 2, column 14: action '0FX1': unknown op 'FX'"},
      {"shape ranks=2 microbatches=1\nrank 0: 0F0\nrank 1: 1F0 1F3\n",
       "line 3, column 13: action '1F3': micro-batch 3 outside [0, 1)"},
      {"shape ranks=2 microbatches=1\nrank 0: 5F0\n", "virtual stage 5 outside [0, 2)"},
      {"shape ranks=2 microbatches=1\nrank 0: 0F0.c1\n", "chunk 1 outside [0, 1)"},
      {"shape ranks=2 microbatches=1\nrank 1: 1F0\n",
       "line 2, column 6: rank 1 where rank 0 was expected"},
      {"shape ranks=2 microbatches=1\nrank 0: 0F0\n", "2 rank lines" /* unused */},
      {"shape ranks=two microbatches=1\n",
       "line 1, column 13: ranks='two' is not a non-negative integer"},
      {"shape ranks=2 colour=blue microbatches=1\n", "unknown shape key 'colour'"},
      {"shape ranks=2 microbatches=1 mode=serving\n",
       "mode='serving', expected training or inference"},
      {"shape ranks=2 microbatches=1 placement=0,0\n", "rank 1 holds no virtual stage"},
      {"shape ranks=2 microbatches=1 placement=0,7\n", "placement of virtual stage 1 is rank 7"},
      {"shape ranks=2\n", "needs microbatches=M"},
      {"shape ranks=2 microbatches=1\nshape ranks=2 microbatches=1\n",
       "line 2, column 1: a second 'shape' line"},
      {"shape ranks=2 microbatches=1\nrnak 0: 0F0\n",
       "line 2, column 1: expected 'shape' or 'rank <r>:', got 'rnak'"},
      {"shape ranks=2 microbatches=1\nrank 0 0F0\n", "expected 'rank <r>:'"},
      {"", "no 'shape' line"},
  };
  for (const auto& b : cases) {
    CAPTURE(b.text);
    const std::string msg = error_of([&] { (void)sch::parse_schedule(b.text); });
    if (std::string(b.needle) == "2 rank lines")
      CHECK(contains(msg, "1 rank lines, expected ranks=2 (rank 1 is missing)"));
    else
      CHECK(contains(msg, b.needle));
  }
}

TEST_CASE("schedule.grid: step x rank table with marks and context") {
  auto s = sch::empty_schedule(sch::Shape::make(2, 8));
  for (int m = 0; m < 8; ++m) s.ranks[0].push_back({Op::F, 0, m, 0});
  for (int m = 0; m < 3; ++m) s.ranks[1].push_back({Op::F, 1, m, 0});
  const std::string full = sch::render_grid(s);
  CHECK(contains(full, "step  rank 0  rank 1\n"));
  CHECK(contains(full, "   0  0F0     1F0\n"));
  CHECK(contains(full, "   7  0F7     .\n"));

  sch::GridOptions opt;
  opt.marks = {{1, 2}};
  opt.context = 1;
  const std::string ex = sch::render_grid(s, opt);
  CHECK(contains(ex, "   2  0F2     [1F2]   <-- rank 1\n"));
  CHECK(contains(ex, "   1  0F1"));
  CHECK(contains(ex, "   3  0F3"));
  CHECK_FALSE(contains(ex, "   5  0F5"));
  CHECK(contains(ex, " ...\n"));

  opt.ranks = {1};
  const std::string one = sch::render_grid(s, opt);
  CHECK_FALSE(contains(one, "rank 0"));
  CHECK(contains(one, "[1F2]"));
}

TEST_CASE("schedule.shape: invariants are checked with the field named") {
  CHECK_THROWS_AS(sch::Shape::make(0, 1), Error);
  sch::Shape s = sch::Shape::make(4, 8, 2);
  CHECK(s.num_virtual_stages == 8);
  CHECK(s.rank_of(5) == 1);
  CHECK(s.stages_on(3) == 2);
  s.num_microbatches = 0;
  CHECK(contains(error_of([&] { s.check(); }), "microbatches = 0"));
}
