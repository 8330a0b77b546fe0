// The batching joint: padding, Megatron/T5 packing, packing by offsets, and DynaPipe's DP
// (checked against brute force over every consecutive split).
#include <brigade/batching/ahead.hpp>
#include <brigade/batching/batcher.hpp>
#include <brigade/batching/dynamic.hpp>
#include <brigade/model/config.hpp>
#include <brigade/partition/partition.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <string>
#include <thread>

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
// per causal pair; memory = tokens.
batching::MicroBatchCost toy_cost() {
  return {[](const model::WorkItem& w) {
            const double t = static_cast<double>(w.tokens);
            return 0.5 + 0.1 * t + 0.01 * t * w.context;
          },
          [](const model::WorkItem& w) { return static_cast<double>(w.tokens); }};
}

// Brute force: every split of the length-sorted samples into consecutive ranges.
double brute_force(std::span<const SampleLength> samples, const batching::MicroBatchCost& cost,
                   int stages, double limit) {
  std::vector<std::int64_t> sorted;
  for (const auto& s : samples) sorted.push_back(s.tokens);
  std::stable_sort(sorted.begin(), sorted.end());
  const auto n = sorted.size();
  double best = std::numeric_limits<double>::infinity();
  for (std::uint64_t mask = 0; mask < (std::uint64_t{1} << (n - 1)); ++mask) {
    std::vector<double> times;
    bool fits = true;
    std::int64_t tokens = 0;
    double pairs = 0.0, count = 0;
    for (std::size_t k = 0; k < n && fits; ++k) {
      tokens += sorted[k];
      pairs += static_cast<double>(sorted[k]) * static_cast<double>(sorted[k] + 1) / 2.0;
      ++count;
      if (k + 1 == n || ((mask >> k) & 1U)) {
        const model::WorkItem w{tokens, static_cast<std::int64_t>(count),
                                pairs / static_cast<double>(tokens)};
        fits = cost.activation_bytes(w) <= limit;
        times.push_back(cost.seconds(w));
        tokens = 0;
        pairs = 0.0;
        count = 0;
      }
    }
    if (fits) best = std::min(best, batching::predicted_iteration_seconds(times, stages));
  }
  return best;
}

// Every sample exactly once, and each micro-batch under the limit.
void check_cover(std::span<const SampleLength> samples, const batching::DynamicPlan& plan,
                 double limit) {
  std::vector<int> seen(samples.size(), 0);
  for (std::size_t m = 0; m < plan.microbatches.size(); ++m) {
    for (const auto p : plan.microbatches[m].samples) ++seen[static_cast<std::size_t>(p)];
    CHECK(plan.activation_bytes[m] <= limit);
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
    CHECK(plan.seconds[0] == doctest::Approx(1.59));
    CHECK(plan.seconds[1] == doctest::Approx(2.13));
    CHECK(plan.iteration_seconds == doctest::Approx(3.72));
  }
  SUBCASE("three stages: the slowest micro-batch weighs twice more, so it is split") {
    const auto plan = batching::DynamicBatcher(toy_cost(), 3, 12.0).solve(s);
    REQUIRE(plan.microbatches.size() == 3);
    CHECK(plan.microbatches[0].samples == Positions{2, 0, 4});
    CHECK(plan.microbatches[1].samples == Positions{3});
    CHECK(plan.microbatches[2].samples == Positions{1});
    CHECK(plan.iteration_seconds == doctest::Approx(2 * 1.59 + 1.59 + 1.15 + 1.48));
    CHECK(plan.activation_bytes == std::vector<double>{9.0, 5.0, 7.0});
  }
}

TEST_CASE("batching: the dynamic DP equals brute force over all consecutive splits") {
  std::mt19937_64 rng(15);
  const model::ModelSpec spec(model::named_config("42M"));
  for (int trial = 0; trial < 60; ++trial) {
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
    // The calibrated cost's roofline form on the 42M shape, and the toy cost, alternately.
    const bool real = trial % 2 == 0;
    const auto cost = real ? batching::stage_cost(spec, partition::uniform(spec, std::min(stages, 8)),
                                                  model::roofline_layer_seconds())
                           : toy_cost();
    const double lo = cost.activation_bytes({longest, 1, static_cast<double>(longest + 1) / 2.0});
    const double hi = cost.activation_bytes({total, n, 1.0});
    const double limit = lo + (hi - lo) * std::uniform_real_distribution<double>(0.0, 1.0)(rng);
    CAPTURE(trial);
    CAPTURE(n);
    CAPTURE(stages);
    const auto plan = batching::DynamicBatcher(cost, stages, limit).solve(s);
    CHECK(plan.iteration_seconds == doctest::Approx(brute_force(s, cost, stages, limit)).epsilon(1e-12));
    check_cover(s, plan, limit);
    // Quantised bounds (two tried): never better than the optimum, still a valid split.
    const auto coarse = batching::DynamicBatcher(cost, stages, limit, 2).solve(s);
    CHECK(coarse.bounds_tried <= 2);
    CHECK(coarse.iteration_seconds >= plan.iteration_seconds * (1 - 1e-12));
    check_cover(s, coarse, limit);
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
  CHECK_THROWS_WITH_AS(batching::OffsetsBatcher{8}.plan(lengths({3, 0})),
                       doctest::Contains("sample 1 has 0 tokens"), Error);
  CHECK_THROWS_AS(batching::DynamicBatcher(toy_cost(), 0, 10.0), Error);
  CHECK_THROWS_AS(batching::DynamicBatcher(toy_cost(), 2, 0.0), Error);
  CHECK_THROWS_AS(batching::DynamicBatcher({}, 2, 10.0), Error);
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
  CHECK(cost.seconds(w) == doctest::Approx(expected).epsilon(1e-12));
  const auto first = cost::training_stash(spec, part.stage(0), 300, 3);
  const auto last = cost::training_stash(spec, part.stage(1), 300, 3);
  CHECK(cost.activation_bytes(w) ==
        std::max({first.forward, first.backward_input, last.forward, last.backward_input}));
  CHECK(cost.seconds({600, 3, 50.5}) > cost.seconds(w));
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
    CHECK(got.seconds == want[static_cast<std::size_t>(i)].seconds);
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
