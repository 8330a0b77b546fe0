// `brigade plan-batches` end to end: the micro-batches and the predicted iteration time it
// prints, and its one-line refusals of bad lengths files.
#include <brigade/batching/dynamic.hpp>
#include <brigade/batching/order.hpp>
#include <brigade/model/config.hpp>
#include <brigade/partition/partition.hpp>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include "test_util.hpp"

#include <unistd.h>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

using namespace brigade;
namespace fs = std::filesystem;

namespace {

bool have_cli() { return std::string(BRIGADE_CLI).size() > 0 && fs::exists(BRIGADE_CLI); }

// The test files live in one directory per process, removed when the test binary exits.
fs::path write_file(const std::string& name, const std::string& bytes) {
  static const test::TempDir dir("brigade_plan_batches");
  std::ofstream(dir / name, std::ios::binary) << bytes;
  return dir / name;
}

bool has(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

}  // namespace

TEST_CASE("plan-batches.cli: the four batchers on a lengths file") {
  if (!have_cli()) return;
  const auto f = write_file("five.txt", "3\n7\n\n2\n5\r\n4\n");
  const auto base = "plan-batches " + f.string() + " --model 15M --stages 2 --token-budget 10";
  const auto pad = test::run_cli(base + " --batching padding --samples-per-microbatch 2");
  CAPTURE(pad.err);
  CHECK(pad.rc == 0);
  CHECK(has(pad.out, "plan-batches: 5 samples, 21 tokens"));
  CHECK(has(pad.out, "micro-batches 3; tokens 28 (7 padding, 25.0%)"));
  const auto off = test::run_cli(base + " --batching offsets");
  CHECK(off.rc == 0);
  CHECK(has(off.out, "micro-batches 3; tokens 21 (0 padding, 0.0%)"));
  // Rows of 5 tokens: the 7-token sample fits no row, and is refused by name.
  const auto pack = test::run_cli(base + " --batching packing --row-tokens 5");
  CHECK(pack.rc != 0);
  CHECK(has(pack.err, "sample 1 has 7 tokens, longer than a row of 5 tokens"));
  // Dynamic: the printed prediction is the library's DP over the same cost and limit.
  const auto dyn = test::run_cli(base);
  CAPTURE(dyn.err);
  REQUIRE(dyn.rc == 0);
  const model::ModelSpec spec(model::named_config("15M"));
  const auto cost =
      batching::stage_cost(spec, partition::uniform(spec, 2), model::roofline_layer_seconds());
  const double limit = cost.activation_bytes(batching::varlen_work(10, 1, batching::causal_pairs(10)));
  const std::vector<batching::SampleLength> s{{3, 0, 0}, {7, 0, 1}, {2, 0, 2}, {5, 0, 3}, {4, 0, 4}};
  batching::DynamicOptions opt;
  opt.peak_limit_bytes = 2 * limit;  // --rank-memory's default: stages x the micro-batch limit
  const auto plan = batching::DynamicBatcher(cost, 2, limit, opt).solve(s);
  const auto recomputed = std::count(plan.costs.recompute.begin(), plan.costs.recompute.end(), 1);
  CHECK(has(dyn.out, fmt::format("micro-batches {}; tokens 21 (0 padding, 0.0%); {} recompute",
                                 plan.microbatches.size(), recomputed)));
  CHECK(has(dyn.out, "activation B         held B recompute"));
  CHECK(has(dyn.out, fmt::format("predicted iteration {:.6g} s", plan.iteration_seconds)));
  double peak = 0.0;
  for (const double b : plan.costs.peak_bytes) peak = std::max(peak, b);
  CHECK(has(dyn.out, fmt::format("peak activation {:.6g} bytes", peak)));
  // The schedule lines: order_adaptive and 1F1B simulated over the same micro-batches, under a
  // rank limit of stages x the micro-batch limit (the default).
  const auto ordered = batching::order_adaptive(plan.costs, 2, 2 * limit);
  CHECK(has(dyn.out, fmt::format("simulated iteration {:.6g} s ({} orders tried",
                                 ordered.makespan_seconds, ordered.orders_tried)));
  CHECK(has(dyn.out, "1f1b on the same micro-batches: simulated iteration"));
  CHECK(has(dyn.out, "peak activation bytes per rank under that schedule: "));
  // A limit below the 7-token sample's activations: it (and whatever joins it) recomputes,
  // the row says so; with --recompute none the same limit is refused, naming the sample.
  const double tight = cost.activation_bytes(batching::varlen_work(5, 1, batching::causal_pairs(5)));
  const auto rc = test::run_cli(base + fmt::format(" --memory-limit {}", tight));
  CAPTURE(rc.err);
  REQUIRE(rc.rc == 0);
  batching::DynamicOptions rc_opt;
  rc_opt.peak_limit_bytes = 2 * tight;
  const auto rc_plan = batching::DynamicBatcher(cost, 2, tight, rc_opt).solve(s);
  REQUIRE(rc_plan.costs.any_recompute());
  for (std::size_t m = 0; m < rc_plan.microbatches.size(); ++m) {
    CAPTURE(m);
    const auto& mb = rc_plan.microbatches[m];
    CHECK(has(rc.out, fmt::format("{:>4} {:>8} {:>8}", m, mb.samples.size(), mb.work.tokens)));
    CHECK(has(rc.out, fmt::format("{:>14.6g} {:>9}\n", rc_plan.costs.held_bytes[m],
                                  rc_plan.costs.recompute[m] != 0 ? "full" : "none")));
  }
  CHECK(has(rc.out, fmt::format("predicted iteration {:.6g} s", rc_plan.iteration_seconds)));
  const auto refused = test::run_cli(base + fmt::format(" --memory-limit {} --recompute none", tight));
  CHECK(refused.rc != 0);
  CHECK(has(refused.err, "sample 1 (7 tokens) needs"));
  const auto svg = write_file("dyn.svg", "");
  fs::remove(svg);
  const auto with_svg = test::run_cli(base + " --svg " + svg.string());
  CHECK(with_svg.rc == 0);
  REQUIRE(fs::exists(svg));
  std::ifstream in(svg);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(has(text, "<svg"));
  CHECK(has(text, "plan-batches dynamic"));
}

TEST_CASE("plan-batches.cli: a corpus is tokenized, each sample counting its tokens - 1 rows") {
  if (!have_cli()) return;
  // tok512: "Once upon a time there was a cat." is 11 tokens with BOS (10 rows), "The dog
  // ran." 7 (6 rows).
  const auto f = write_file("corpus.txt", "Once upon a time there was a cat.\n\nThe dog ran.\n");
  const auto tok = std::string(BRIGADE_MODEL_DIR) + "/tok512.bin";
  const auto r = test::run_cli("plan-batches --corpus " + f.string() + " --tokenizer " + tok +
                               " --model 15M --stages 2 --batching offsets");
  CAPTURE(r.err);
  CHECK(r.rc == 0);
  CHECK(has(r.out, "plan-batches: 2 samples, 16 tokens"));
  CHECK(has(r.out, "(1 tasks; 0 samples cut"));
  CHECK(has(r.out, "   0        2       16       16        0       10"));
  const auto bin = write_file("corpus.bin", std::string("ab\0cd", 5));
  const auto b = test::run_cli("plan-batches --corpus " + bin.string() + " --tokenizer " + tok);
  CHECK(b.rc != 0);
  CHECK(has(b.err, "is a binary file, not text"));
}

TEST_CASE("plan-batches.cli: bad inputs are one-line named errors") {
  if (!have_cli()) return;
  const auto missing = test::run_cli("plan-batches /nonexistent/lengths.txt");
  CHECK(missing.rc != 0);
  CHECK(has(missing.err, "/nonexistent/lengths.txt: lengths file not found"));
  const auto bin = write_file("bin.txt", std::string("12\n\0\x01\x02", 6));
  const auto b = test::run_cli("plan-batches " + bin.string());
  CHECK(b.rc != 0);
  CHECK(has(b.err, "is a binary file, not a lengths file (a NUL byte at offset 3"));
  const auto bad = write_file("bad.txt", "3\n\n7\nx12\n");
  const auto n = test::run_cli("plan-batches " + bad.string());
  CHECK(n.rc != 0);
  CHECK(has(n.err, bad.string() + ":4: 'x12' is not a token count"));
  const auto zero = write_file("zero.txt", "3\n0\n");
  CHECK(has(test::run_cli("plan-batches " + zero.string()).err, ":2: '0' is not a token count"));
  const auto empty = write_file("empty.txt", "\n\n");
  CHECK(has(test::run_cli("plan-batches " + empty.string()).err, "no lengths"));
  CHECK(has(test::run_cli("plan-batches").err, "give a lengths file or --corpus"));
  const auto longf = write_file("long.txt", "3\n70000\n");
  const auto l = test::run_cli("plan-batches " + longf.string() + " --model 15M");
  CHECK(l.rc != 0);
  CHECK(has(l.err, "sample 1 (70000 tokens) needs"));
  CHECK(has(l.err, "more than the micro-batch memory limit of"));
}
