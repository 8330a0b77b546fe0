// The batching joint: padding, Megatron/T5 packing, packing by offsets, and DynaPipe's DP
// (checked against brute force over every consecutive split).
#include <brigade/batching/ahead.hpp>
#include <brigade/batching/batcher.hpp>
#include <brigade/batching/dynamic.hpp>
#include <brigade/model/config.hpp>
#include <brigade/partition/partition.hpp>

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <cmath>
#include <random>
#include <string>
#include <thread>

using brigade::test::rel;

using namespace brigade;
using batching::MicroBatch;
using batching::SampleLength;
using Positions = std::vector<std::int64_t>;

namespace {

std::vector<SampleLength> lengths(std::initializer_list<std::int64_t> ls) {
  std::vector<SampleLength> out;
  for (const auto l : ls)
    out.push_back({l, static_cast<int>(out.size()) % 2, static_cast<std::int64_t>(out.size())});
  return out;
}

void check_work(const MicroBatch& mb, std::int64_t tokens, std::int64_t sequences, double context,
                std::int64_t useful, std::int64_t longest) {
  CHECK(mb.work.tokens == tokens);
  CHECK(mb.work.sequences == sequences);
  CHECK(mb.work.context == doctest::Approx(context).epsilon(1e-12));
  CHECK(mb.useful_tokens == useful);
  CHECK(mb.longest == longest);
  CHECK(mb.padding_tokens() == tokens - useful);
}

// A closed-form cost: a fixed overhead per micro-batch, linear work per token, attention
// per causal pair; memory = tokens. With `recompute`, full recompute adds 0.05 s a token (the
// forward again) and keeps a tenth of the bytes.
batching::MicroBatchCost toy_cost(bool recompute = false) {
  batching::MicroBatchCost c;
  c.seconds = [](const model::WorkItem& w) {
    const double t = static_cast<double>(w.tokens);
    return 0.5 + 0.1 * t + 0.01 * t * w.context;
  };
  c.activation_bytes = [](const model::WorkItem& w) { return static_cast<double>(w.tokens); };
  if (recompute) {
    c.recompute_seconds = [s = c.seconds](const model::WorkItem& w) {
      return s(w) + 0.05 * static_cast<double>(w.tokens);
    };
    c.checkpoint_bytes = [](const model::WorkItem& w) { return static_cast<double>(w.tokens) / 10.0; };
  }
  return c;
}

// Brute force: every split of the length-sorted samples into consecutive ranges, and every
// assignment of a mode (none, or full recompute where the cost offers it) to the ranges; a
// range fits without recompute when its activation bytes are at most `limit`, with full
// recompute when its checkpoint bytes are and its activation bytes are at most `peak`.
double brute_force(std::span<const SampleLength> samples, const batching::MicroBatchCost& cost,
                   int stages, double limit,
                   double peak = std::numeric_limits<double>::infinity()) {
  std::vector<std::int64_t> sorted;
  for (const auto& s : samples) sorted.push_back(s.tokens);
  std::stable_sort(sorted.begin(), sorted.end());
  const auto n = sorted.size();
  const bool rc = cost.offers_recompute();
  double best = std::numeric_limits<double>::infinity();
  for (std::uint64_t mask = 0; mask < (std::uint64_t{1} << (n - 1)); ++mask) {
    std::vector<model::WorkItem> ranges;
    std::int64_t tokens = 0;
    double pairs = 0.0, count = 0;
    for (std::size_t k = 0; k < n; ++k) {
      tokens += sorted[k];
      pairs += static_cast<double>(sorted[k]) * static_cast<double>(sorted[k] + 1) / 2.0;
      ++count;
      if (k + 1 == n || ((mask >> k) & 1U)) {
        ranges.push_back({tokens, static_cast<std::int64_t>(count),
                          pairs / static_cast<double>(tokens)});
        tokens = 0;
        pairs = 0.0;
        count = 0;
      }
    }
    const std::uint64_t modes = rc ? std::uint64_t{1} << ranges.size() : 1;
    for (std::uint64_t mode = 0; mode < modes; ++mode) {
      std::vector<double> times;
      bool fits = true;
      for (std::size_t r = 0; r < ranges.size() && fits; ++r) {
        const auto& w = ranges[r];
        if ((mode >> r) & 1U) {
          fits = cost.checkpoint_bytes(w) <= limit && cost.activation_bytes(w) <= peak;
          times.push_back(cost.recompute_seconds(w));
        } else {
          fits = cost.activation_bytes(w) <= limit;
          times.push_back(cost.seconds(w));
        }
      }
      if (fits) best = std::min(best, batching::predicted_iteration_seconds(times, stages));
    }
  }
  return best;
}

// Every sample exactly once, and each micro-batch in a mode that fits.
void check_cover(std::span<const SampleLength> samples, const batching::DynamicPlan& plan,
                 double limit, double peak = std::numeric_limits<double>::infinity()) {
  std::vector<int> seen(samples.size(), 0);
  REQUIRE(plan.costs.size() == plan.microbatches.size());
  for (std::size_t m = 0; m < plan.microbatches.size(); ++m) {
    for (const auto p : plan.microbatches[m].samples) ++seen[static_cast<std::size_t>(p)];
    CHECK(plan.costs.held_bytes[m] <= limit);
    if (plan.costs.recompute[m] != 0) {
      CHECK(plan.costs.peak_bytes[m] > limit);  // recompute only where it must
      CHECK(plan.costs.peak_bytes[m] <= peak);
    } else {
      CHECK(plan.costs.peak_bytes[m] == plan.costs.held_bytes[m]);
    }
  }
  for (const int s : seen) CHECK(s == 1);
}

}  // namespace

TEST_CASE("batching: padding pads each micro-batch to its longest sample") {
  const auto s = lengths({3, 7, 2, 5, 4});
  const auto mbs = batching::PaddingBatcher{2}.plan(s);
  REQUIRE(mbs.size() == 3);
  CHECK(mbs[0].samples == Positions{0, 1});
  CHECK(mbs[0].row_offsets == Positions{0, 1, 2});
  check_work(mbs[0], 14, 2, 4.0, 10, 7);
  CHECK(mbs[1].samples == Positions{2, 3});
  check_work(mbs[1], 10, 2, 3.0, 7, 5);
  CHECK(mbs[2].samples == Positions{4});
  CHECK(mbs[2].row_offsets == Positions{0, 1});
  check_work(mbs[2], 4, 1, 2.5, 4, 4);
  CHECK_THROWS_WITH_AS(batching::PaddingBatcher{0}.plan(s),
                       doctest::Contains("0 samples per micro-batch"), Error);
}

TEST_CASE("batching: Megatron/T5 packing fills fixed rows and prices attention over the row") {
  const auto s = lengths({3, 7, 2, 5, 4});
  const auto mbs = batching::PackingBatcher{8, 2}.plan(s);
  REQUIRE(mbs.size() == 2);
  // Rows of 8: [3] [7] | [2 5] [4]: 7 does not fit after 3, 4 not after 2 + 5.
  CHECK(mbs[0].samples == Positions{0, 1});
  CHECK(mbs[0].row_offsets == Positions{0, 1, 2});
  check_work(mbs[0], 16, 2, 4.5, 10, 7);
  CHECK(mbs[1].samples == Positions{2, 3, 4});
  CHECK(mbs[1].row_offsets == Positions{0, 2, 3});
  check_work(mbs[1], 16, 2, 4.5, 11, 5);
  const batching::PackingBatcher short_rows{6, 2};
  CHECK_THROWS_WITH_AS(short_rows.plan(s),
                       doctest::Contains("sample 1 has 7 tokens, longer than a row of 6 tokens"),
                       Error);
}

TEST_CASE("batching: packing by offsets fills a token budget without padding") {
  const auto s = lengths({3, 7, 2, 5, 4});
  const auto mbs = batching::OffsetsBatcher{10}.plan(s);
  REQUIRE(mbs.size() == 3);
  CHECK(mbs[0].samples == Positions{0, 1});
  CHECK(mbs[0].row_offsets == Positions{0, 2});
  check_work(mbs[0], 10, 2, (6.0 + 28.0) / 10.0, 10, 7);
  CHECK(mbs[1].samples == Positions{2, 3});
  check_work(mbs[1], 7, 2, (3.0 + 15.0) / 7.0, 7, 5);
  CHECK(mbs[2].samples == Positions{4});
  check_work(mbs[2], 4, 1, 2.5, 4, 4);
  CHECK(batching::work_of(mbs).size() == 3);
  CHECK_THROWS_WITH_AS(
      batching::OffsetsBatcher{6}.plan(s),
      doctest::Contains("sample 1 has 7 tokens, more than the token budget of 6"), Error);
}

TEST_CASE("batching: dynamic splits the length-sorted samples by the pipeline's objective") {
  const auto s = lengths({3, 7, 2, 5, 4});  // sorted: 2 3 4 5 7 = positions 2 0 4 3 1
  SUBCASE("one stage: the sum alone, fewest micro-batches under the memory limit") {
    const auto plan = batching::DynamicBatcher(toy_cost(), 1, 12.0).solve(s);
    REQUIRE(plan.microbatches.size() == 2);
    CHECK(plan.microbatches[0].samples == Positions{2, 0, 4});
    CHECK(plan.microbatches[1].samples == Positions{3, 1});
    check_work(plan.microbatches[1], 12, 2, (15.0 + 28.0) / 12.0, 12, 7);
    CHECK(plan.costs.seconds[0] == doctest::Approx(1.59));
    CHECK(plan.costs.seconds[1] == doctest::Approx(2.13));
    CHECK(plan.iteration_seconds == doctest::Approx(3.72));
  }
  SUBCASE("three stages: the slowest micro-batch weighs twice more, so it is split") {
    const auto plan = batching::DynamicBatcher(toy_cost(), 3, 12.0).solve(s);
    REQUIRE(plan.microbatches.size() == 3);
    CHECK(plan.microbatches[0].samples == Positions{2, 0, 4});
    CHECK(plan.microbatches[1].samples == Positions{3});
    CHECK(plan.microbatches[2].samples == Positions{1});
    CHECK(plan.iteration_seconds == doctest::Approx(2 * 1.59 + 1.59 + 1.15 + 1.48));
    CHECK(plan.costs.peak_bytes == std::vector<double>{9.0, 5.0, 7.0});
    CHECK(plan.costs.recompute == std::vector<char>{0, 0, 0});
  }
}

TEST_CASE("batching: dynamic recomputes the micro-batches that do not fit, where it pays") {
  // Sorted 2 3 4 7 12 = positions 2 0 4 1 3; a micro-batch keeps its tokens in bytes (a tenth
  // with full recompute, which costs 0.05 s a token), at most 10 bytes held and 20 at the peak.
  // One stage: the objective is the sum, 0.5 per micro-batch + 0.1 per token + 0.01 per causal
  // pair (fixed: 2.8 + 1.25) + 0.05 per recomputed token. Sample 3 (12 tokens) must recompute;
  // joining 7 to it (19 tokens recomputed, 2 micro-batches: 1.95) beats every other split
  // (2 3 4 7 | 12: 2.4; 2 3 4 | 7 | 12 unjoined: 2.1; 28 tokens at once peaks over 20).
  const auto s = lengths({3, 7, 2, 12, 4});
  batching::DynamicOptions opt;
  opt.peak_limit_bytes = 20.0;
  const auto plan = batching::DynamicBatcher(toy_cost(true), 1, 10.0, opt).solve(s);
  REQUIRE(plan.microbatches.size() == 2);
  CHECK(plan.microbatches[0].samples == Positions{2, 0, 4});
  CHECK(plan.microbatches[1].samples == Positions{1, 3});
  CHECK(plan.costs.recompute == std::vector<char>{0, 1});
  CHECK(plan.costs.seconds[0] == doctest::Approx(1.59));
  CHECK(plan.costs.seconds[1] == doctest::Approx(0.5 + 1.9 + 1.06 + 0.95));
  CHECK(plan.costs.held_bytes == std::vector<double>{9.0, 1.9});
  CHECK(plan.costs.peak_bytes == std::vector<double>{9.0, 19.0});
  CHECK(plan.iteration_seconds == doctest::Approx(6.0));
  CHECK(plan.iteration_seconds == doctest::Approx(brute_force(s, toy_cost(true), 1, 10.0, 20.0)));
  // Without recompute (not offered, or turned off) the 12-token sample fits no micro-batch.
  opt.recompute = false;
  CHECK_THROWS_WITH_AS(batching::DynamicBatcher(toy_cost(true), 1, 10.0, opt).plan(s),
                       doctest::Contains("sample 3 (12 tokens) needs 12 bytes"), Error);
  // choose_recompute, the rule the DP applies to each range (and the CLI to static batchers'
  // micro-batches): none when it fits, full when only its checkpoint does, else nothing fits.
  opt.recompute = true;
  const auto rc = toy_cost(true);
  const auto none = batching::choose_recompute(rc, {8, 1, 4.5}, 10.0, opt);
  CHECK((none.fits && none.mode == batching::Recompute::None && none.held_bytes() == 8.0));
  const auto full = batching::choose_recompute(rc, {15, 1, 8.0}, 10.0, opt);
  CHECK((full.fits && full.mode == batching::Recompute::Full));
  CHECK(full.held_bytes() == 1.5);
  CHECK(full.seconds == doctest::Approx(rc.seconds({15, 1, 8.0}) + 0.75));
  CHECK_FALSE(batching::choose_recompute(rc, {25, 1, 13.0}, 10.0, opt).fits);   // over the peak
  CHECK_FALSE(batching::choose_recompute(rc, {15, 1, 8.0}, 1.0, opt).fits);     // checkpoint over
  CHECK_FALSE(batching::choose_recompute(toy_cost(), {15, 1, 8.0}, 10.0, opt).fits);  // not offered
}

TEST_CASE("batching: the dynamic DP equals brute force over all consecutive splits and modes") {
  std::mt19937_64 rng(15);
  const model::ModelSpec spec(model::named_config("42M"));
  for (int trial = 0; trial < 90; ++trial) {
    const int n = std::uniform_int_distribution<int>(1, 11)(rng);
    std::lognormal_distribution<double> len(4.0, 1.2);
    std::vector<SampleLength> s;
    std::int64_t total = 0, longest = 0;
    for (int i = 0; i < n; ++i) {
      const auto l = std::clamp<std::int64_t>(std::llround(len(rng)), 1, 2048);
      s.push_back({l, i % 3, i});
      total += l;
      longest = std::max(longest, l);
    }
    const int stages = std::uniform_int_distribution<int>(1, 8)(rng);
    // The calibrated cost's roofline form on the 42M shape (with full recompute), the toy cost
    // with recompute and without, in turn.
    const int kind = trial % 3;
    const auto cost = kind == 0 ? batching::stage_cost(spec, partition::uniform(spec, std::min(stages, 8)),
                                                       model::roofline_layer_seconds())
                                : toy_cost(kind == 1);
    const double lo = cost.activation_bytes({longest, 1, static_cast<double>(longest + 1) / 2.0});
    const double hi = cost.activation_bytes({total, n, 1.0});
    // The limit: anywhere from the longest sample's bytes (so each fits alone) to all of them;
    // with recompute offered, down to a third of the longest's (it must recompute), and a peak
    // limit from the longest's bytes to twice all of them, or none.
    const double from = cost.offers_recompute() ? lo / 3.0 : lo;
    const double limit = from + (hi - from) * std::uniform_real_distribution<double>(0.0, 1.0)(rng);
    batching::DynamicOptions opt;
    if (trial % 4 != 3)
      opt.peak_limit_bytes = lo + (2 * hi - lo) * std::uniform_real_distribution<double>(0.0, 1.0)(rng);
    CAPTURE(trial);
    CAPTURE(n);
    CAPTURE(stages);
    CAPTURE(limit);
    CAPTURE(opt.peak_limit_bytes);
    const auto plan = batching::DynamicBatcher(cost, stages, limit, opt).solve(s);
    CHECK(plan.iteration_seconds ==
          rel(brute_force(s, cost, stages, limit, opt.peak_limit_bytes), 1e-12));
    check_cover(s, plan, limit, opt.peak_limit_bytes);
    // Quantised bounds (two tried): never better than the optimum, still a valid split.
    batching::DynamicOptions coarse_opt = opt;
    coarse_opt.max_bounds = 2;
    const auto coarse = batching::DynamicBatcher(cost, stages, limit, coarse_opt).solve(s);
    CHECK(coarse.bounds_tried <= 2);
    CHECK(coarse.iteration_seconds >= plan.iteration_seconds * (1 - 1e-12));
    check_cover(s, coarse, limit, opt.peak_limit_bytes);
  }
}

TEST_CASE("batching: bad inputs are named errors") {
  const std::vector<SampleLength> none;
  CHECK_THROWS_WITH_AS(batching::PaddingBatcher{2}.plan(none), doctest::Contains("no samples"),
                       Error);
  const batching::PackingBatcher packing{8, 1};
  CHECK_THROWS_WITH_AS(packing.plan(none), doctest::Contains("no samples"), Error);
  CHECK_THROWS_WITH_AS(batching::OffsetsBatcher{8}.plan(none), doctest::Contains("no samples"),
                       Error);
  CHECK_THROWS_WITH_AS(batching::DynamicBatcher(toy_cost(), 2, 10.0).plan(none),
                       doctest::Contains("no samples"), Error);
  // Sample 3 (12 tokens = 12 bytes in the toy cost) fits no micro-batch of 10 bytes.
  const auto s = lengths({3, 7, 2, 12, 4});
  CHECK_THROWS_WITH_AS(batching::DynamicBatcher(toy_cost(), 2, 10.0).plan(s),
                       doctest::Contains("sample 3 (12 tokens) needs 12 bytes of activations on "
                                         "a stage as a micro-batch of its own, more than the "
                                         "micro-batch memory limit of 10 bytes"),
                       Error);
  // With full recompute: sample 3 of 25 tokens keeps 2.5 bytes from its forward to its
  // recompute, within the limit, but peaks at 25, over the peak limit of 20.
  batching::DynamicOptions peak20;
  peak20.peak_limit_bytes = 20.0;
  CHECK_THROWS_WITH_AS(
      batching::DynamicBatcher(toy_cost(true), 2, 10.0, peak20).plan(lengths({3, 7, 2, 25, 4})),
      doctest::Contains("sample 3 (25 tokens) needs 25 bytes of activations on a stage as a "
                        "micro-batch of its own, more than the micro-batch memory limit of 10 "
                        "bytes, and does not fit with full recompute either: it keeps 2.5 bytes "
                        "from its forward to its recompute (limit 10 bytes) and peaks at 25 "
                        "bytes (peak limit 20 bytes)"),
      Error);
  CHECK_THROWS_WITH_AS(batching::OffsetsBatcher{8}.plan(lengths({3, 0})),
                       doctest::Contains("sample 1 has 0 tokens"), Error);
  CHECK_THROWS_AS(batching::DynamicBatcher(toy_cost(), 0, 10.0), Error);
  CHECK_THROWS_AS(batching::DynamicBatcher(toy_cost(), 2, 0.0), Error);
  CHECK_THROWS_AS(batching::DynamicBatcher({}, 2, 10.0), Error);
  batching::DynamicOptions no_peak;
  no_peak.peak_limit_bytes = 0.0;
  CHECK_THROWS_WITH_AS(batching::DynamicBatcher(toy_cost(), 2, 10.0, no_peak),
                       doctest::Contains("peak limit 0 bytes"), Error);
}

TEST_CASE("batching: stage_cost prices the slowest stage from the layer times") {
  const model::ModelSpec spec(model::named_config("15M"));
  const auto part = partition::uniform(spec, 2);
  const auto ls = model::roofline_layer_seconds();
  const auto cost = batching::stage_cost(spec, part, ls);
  const model::WorkItem w{300, 3, 50.5};
  double expected = 0.0;
  for (const auto& st : part.stages()) {
    double sum = 0.0;
    for (int l = st.first; l < st.last; ++l)
      for (auto ph : {model::Phase::Forward, model::Phase::BackwardInput,
                      model::Phase::BackwardWeight})
        sum += ls(spec, l, w, ph);
    expected = std::max(expected, sum);
  }
  CHECK(cost.seconds(w) == rel(expected, 1e-12));
  const auto first = cost::training_stash(spec, part.stage(0), 300, 3);
  const auto last = cost::training_stash(spec, part.stage(1), 300, 3);
  CHECK(cost.activation_bytes(w) ==
        std::max({first.forward, first.backward_input, last.forward, last.backward_input}));
  CHECK(cost.seconds({600, 3, 50.5}) > cost.seconds(w));
  // Full recompute: each stage's forward twice; it keeps the stage's input (300 x dim floats on
  // the second stage, nothing on the first).
  double with_rc = 0.0;
  for (const auto& st : part.stages()) {
    double sum = 0.0;
    for (int l = st.first; l < st.last; ++l)
      sum += 2 * ls(spec, l, w, model::Phase::Forward) + ls(spec, l, w, model::Phase::BackwardInput) +
             ls(spec, l, w, model::Phase::BackwardWeight);
    with_rc = std::max(with_rc, sum);
  }
  REQUIRE(cost.offers_recompute());
  CHECK(cost.recompute_seconds(w) == rel(with_rc, 1e-12));
  CHECK(cost.checkpoint_bytes(w) == 300.0 * spec.config().dim * 4.0);
  CHECK(cost::recompute_checkpoint_bytes(spec, part.stage(0), 300) == 0.0);
}

// issue 15 item 3: the next global batch is planned on a background thread while the current
// step runs; the plans are those of planning in the loop.
TEST_CASE("batching.plan-ahead: plans made one ahead on another thread equal sequential "
          "planning, errors surface at their plan, no plan past the limit") {
  // A stateful planner: a seeded stream of global batches (log-normal lengths), each split by
  // the DP, as brigade train plans a step.
  struct Stream {
    std::mt19937 rng{15};
    std::thread::id thread;
    batching::DynamicPlan operator()() {
      thread = std::this_thread::get_id();
      std::lognormal_distribution<double> len(std::log(40.0), 1.0);
      std::vector<SampleLength> batch;
      for (std::int64_t total = 0; total < 2000;) {
        const auto l = std::clamp<std::int64_t>(std::llround(len(rng)), 2, 400);
        batch.push_back({l, static_cast<int>(batch.size() % 3), static_cast<std::int64_t>(batch.size())});
        total += l;
      }
      return batching::DynamicBatcher(toy_cost(), 4, 800.0).solve(batch);
    }
  };
  Stream sequential;
  std::vector<batching::DynamicPlan> want;
  for (int i = 0; i < 6; ++i) want.push_back(sequential());

  Stream background;
  batching::PlanAhead<batching::DynamicPlan> ahead([&] { return background(); }, 6);
  for (int i = 0; i < 6; ++i) {
    CAPTURE(i);
    const auto got = ahead.next();
    CHECK(background.thread != std::this_thread::get_id());  // planned off the caller's thread
    REQUIRE(got.microbatches.size() == want[static_cast<std::size_t>(i)].microbatches.size());
    CHECK(got.microbatches.size() >= 2);
    for (std::size_t m = 0; m < got.microbatches.size(); ++m)
      CHECK(got.microbatches[m].samples == want[static_cast<std::size_t>(i)].microbatches[m].samples);
    CHECK(got.costs.seconds == want[static_cast<std::size_t>(i)].costs.seconds);
    CHECK(got.iteration_seconds == want[static_cast<std::size_t>(i)].iteration_seconds);
  }
  CHECK_THROWS_WITH_AS((void)ahead.next(), doctest::Contains("all 6 plans were taken"), Error);

  // An error of the third plan is thrown by the third next(), not before.
  int calls = 0;
  batching::PlanAhead<int> failing(
      [&] {
        if (++calls == 3) detail::fail(Errc::InvalidArgument, "sample 7 does not fit");
        return calls;
      },
      5);
  CHECK(failing.next() == 1);
  CHECK(failing.next() == 2);
  CHECK_THROWS_WITH_AS((void)failing.next(), doctest::Contains("sample 7 does not fit"), Error);
  CHECK_THROWS_AS(batching::PlanAhead<int>([] { return 0; }, -1), Error);
  batching::PlanAhead<int> none([] { return 0; }, 0);
  CHECK_THROWS_AS((void)none.next(), Error);
}
