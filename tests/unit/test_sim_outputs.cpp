// The simulator's link model and outputs: Timeline, Chrome trace, SVG, metrics JSON.
#include <brigade/cost/cost_model.hpp>
#include <brigade/io/trace.hpp>
#include <brigade/schedule.hpp>
#include <brigade/sim/simulator.hpp>
#include <brigade/sim/svg.hpp>

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <string>

using brigade::test::rel;

namespace sch = brigade::schedule;
using brigade::Op;
using brigade::cost::Link;
using brigade::cost::UnitCostModel;
using brigade::cost::UnitCostOptions;
using brigade::sim::simulate;

namespace {

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

std::size_t occurrences(const std::string& haystack, const std::string& needle) {
  std::size_t n = 0;
  for (auto p = haystack.find(needle); p != std::string::npos; p = haystack.find(needle, p + 1))
    ++n;
  return n;
}

}  // namespace

TEST_CASE("sim.link.gpipe.p2.m1: latency and bandwidth delay the receiver only") {
  const auto s = sch::lower(sch::gpipe({2, 1}));
  UnitCostOptions o;
  o.message_bytes = 100.0;
  o.link = Link{0.25, 200.0};  // 0.5 s on the wire + 0.25 s latency
  const UnitCostModel unit(s.shape, 1.0, 2.0, std::nullopt, o);
  const auto r = simulate(s, unit);
  // F0 on rank 0 [0,1]; arrives 1.75; F0 on rank 1 [1.75,2.75]; B0 [2.75,4.75];
  // gradient arrives 5.5; B0 on rank 0 [5.5,7.5].
  CHECK(r.makespan == doctest::Approx(7.5));
  CHECK(r.messages == 2);
  bool saw_send = false, saw_recv_wait = false;
  for (const auto& iv : r.timeline.intervals()) {
    if (iv.op == Op::SendF) {
      saw_send = true;
      CHECK(iv.start == doctest::Approx(1.0));
      CHECK(iv.end == doctest::Approx(1.75));
    }
    if (iv.op == Op::RecvF) {
      saw_recv_wait = true;
      CHECK(iv.rank == 1);
      CHECK(iv.start == doctest::Approx(0.0));
      CHECK(iv.end == doctest::Approx(1.75));
    }
  }
  CHECK(saw_send);
  CHECK(saw_recv_wait);
  // Busy time excludes communication.
  CHECK(r.busy_seconds[0] == doctest::Approx(3.0));
  CHECK(r.bubble_ratio == rel(1.0 - 6.0 / (2 * 7.5)));
}

TEST_CASE("sim.link.gpipe.p2.m3: sends overlap compute but queue on a busy link") {
  const auto s = sch::lower(sch::gpipe({2, 3}));
  UnitCostOptions o;
  o.message_bytes = 3.0;
  o.link = Link{0.0, 1.0};  // 3 s per message, longer than a 1 s forward
  const UnitCostModel unit(s.shape, 1.0, 1.0, std::nullopt, o);
  const auto r = simulate(s, unit);
  // Rank 0 computes F0, F1, F2 back to back at 0, 1, 2 (sends do not block it) ...
  std::vector<double> f_start, send_end;
  for (const auto& iv : r.timeline.intervals()) {
    if (iv.rank == 0 && iv.op == Op::F) f_start.push_back(iv.start);
    if (iv.rank == 0 && iv.op == Op::SendF) send_end.push_back(iv.end);
  }
  REQUIRE(f_start.size() == 3);
  CHECK(f_start[1] == doctest::Approx(1.0));
  CHECK(f_start[2] == doctest::Approx(2.0));
  // ... but the three messages leave one after the other: they arrive at 4, 7 and 10.
  REQUIRE(send_end.size() == 3);
  CHECK(send_end[0] == doctest::Approx(4.0));
  CHECK(send_end[1] == doctest::Approx(7.0));
  CHECK(send_end[2] == doctest::Approx(10.0));
}

TEST_CASE("sim.timeline.1f1b.p3.m4: compute intervals never overlap on a rank") {
  const auto s = sch::lower(sch::one_f_one_b({3, 4}));
  const UnitCostModel unit(s.shape, 1.0, 2.0);
  const auto r = simulate(s, unit);
  for (int k = 0; k < 3; ++k) {
    double last_end = 0.0;
    for (const auto& iv : r.timeline.intervals()) {
      if (iv.rank != k || brigade::is_communication(iv.op)) continue;
      CHECK(iv.start >= last_end - 1e-12);
      last_end = iv.end;
    }
  }
  CHECK(r.timeline.makespan() == doctest::Approx(r.makespan));
  CHECK(r.timeline.bubble_ratio() == rel(r.bubble_ratio));
  for (int k = 0; k < 3; ++k)
    CHECK(r.timeline.utilization(k) == rel(r.utilization[static_cast<std::size_t>(k)]));
  brigade::sim::SimOptions no_tl;
  no_tl.record_timeline = false;
  const auto bare = simulate(s, unit, no_tl);
  CHECK(bare.timeline.intervals().empty());
  CHECK(bare.makespan == doctest::Approx(r.makespan));
}

TEST_CASE("sim.inference.p2.m2.d2: decode rounds keep the pipeline full") {
  const auto s = sch::lower(sch::inference({2, 2, 1, 2}));
  const UnitCostModel unit(s.shape, 1.0, 0.0);
  const auto r = simulate(s, unit);
  // Each rank's share is 1 per group and round: 6 forwards per rank, and the token loop
  // leaves rank 0 idle only at the very start: makespan 1 + 6.
  CHECK(r.makespan == doctest::Approx(7.0));
  CHECK(r.peak_stash[0] == 0);  // no stash in inference
  bool prefill = false, decode = false;
  for (const auto& iv : r.timeline.intervals()) {
    prefill |= iv.label == "prefill";
    decode |= iv.label == "decode";
  }
  CHECK(prefill);
  CHECK(decode);
}

TEST_CASE("sim.trace.1f1b.p2.m2: the Chrome trace holds one event per interval") {
  const auto s = sch::lower(sch::one_f_one_b({2, 2}));
  const auto r = simulate(s, UnitCostModel(s.shape, 1.0, 2.0));
  const auto j = brigade::io::to_chrome_trace(r.timeline);
  CHECK(j["traceEvents"].size() == r.timeline.intervals().size() + 2);  // + 2 row names
  // A mark is an instant event on its rank's row, at its time from the first interval.
  auto marked = r.timeline;
  marked.add_mark({1, marked.begin() + 0.5, "flagged", "activation from rank 0"});
  const auto jm = brigade::io::to_chrome_trace(marked);
  REQUIRE(jm["traceEvents"].size() == j["traceEvents"].size() + 1);
  const auto& ev = jm["traceEvents"].back();
  CHECK(ev["ph"] == "i");
  CHECK(ev["tid"] == 1);
  CHECK(ev["ts"].get<double>() == doctest::Approx(0.5e6));
  CHECK(ev["args"]["detail"] == "activation from rank 0");
  CHECK_THROWS_AS(marked.add_mark({2, 0.0, "x", ""}), brigade::Error);
  const auto m = brigade::sim::metrics_json(r);
  CHECK(m["makespan_s"].get<double>() == doctest::Approx(r.makespan));
  CHECK(m["bubble_ratio"].get<double>() == rel(1.0 / 3.0));
  CHECK(m["peak_stash"].size() == 2);
  CHECK(m["ranks"].get<int>() == 2);
}

TEST_CASE("sim.svg.1f1b.p2.m3: ranks as rows and micro-batch numbers in colored boxes") {
  const auto s = sch::lower(sch::one_f_one_b({2, 3}));
  const auto r = simulate(s, UnitCostModel(s.shape, 1.0, 2.0));
  brigade::sim::SvgOptions opt;
  opt.title = "1f1b <P=2 & M=3>";
  opt.seconds = false;
  const std::string svg = brigade::sim::render_svg(r.timeline, opt);
  CHECK(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0) == 0);
  CHECK(contains(svg, "</svg>\n"));
  CHECK(contains(svg, "1f1b &lt;P=2 &amp; M=3&gt;"));
  CHECK(contains(svg, ">rank 0</text>"));
  CHECK(contains(svg, ">rank 1</text>"));
  CHECK(occurrences(svg, "fill=\"#4e79a7\" stroke") == 6);  // F boxes
  CHECK(occurrences(svg, "fill=\"#59a14f\" stroke") == 6);  // B boxes
  CHECK(contains(svg, "text-anchor=\"middle\">2</text>"));
  CHECK(contains(svg, ">F</text>"));
  CHECK(contains(svg, ">B</text>"));
  // ZB-H1's BW is drawn in its own color; interleaved chunks are lighter.
  const auto z = sch::lower(sch::zero_bubble_h1({2, 2}));
  const auto zr = simulate(z, UnitCostModel(z.shape, 1, 1, 1));
  CHECK(contains(brigade::sim::render_svg(zr.timeline), "fill=\"#f28e2b\""));
  const auto i = sch::lower(sch::interleaved_1f1b({2, 2, 2}));
  const auto ir = simulate(i, UnitCostModel(i.shape, 1, 2));
  const std::string isvg = brigade::sim::render_svg(ir.timeline);
  CHECK(contains(isvg, "fill=\"#4e79a7\""));
  CHECK(contains(isvg, "fill=\"#7f9ebf\""));  // F of chunk 1 of 2, lightened by 0.275
  opt.width = 10;
  CHECK_THROWS_AS((void)brigade::sim::render_svg(r.timeline, opt), brigade::Error);
}
