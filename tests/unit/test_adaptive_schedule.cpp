// DynaPipe's memory-aware adaptive schedule (schedule::adaptive) and its micro-batch ordering
// (batching::order_adaptive): the cycle order's closed forms, the memory cap, FIFO channels,
// the named errors, and the ordering search against brute force.
#include <brigade/batching/order.hpp>
#include <brigade/schedule.hpp>
#include <brigade/schedule/recompute.hpp>
#include <brigade/schedule/validate.hpp>
#include <brigade/sim/simulator.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <random>
#include <string>

namespace sch = brigade::schedule;
using brigade::Errc;
using brigade::Error;
using sch::Action;
using sch::Op;

namespace {

std::string error_of(const sch::Params& p) {
  try {
    (void)sch::adaptive(p);
  } catch (const Error& e) {
    CHECK(e.code() == Errc::InvalidArgument);
    return e.what();
  }
  FAIL("expected a brigade::Error");
  return {};
}

std::vector<Action> program(std::initializer_list<std::pair<Op, int>> ops, int rank) {
  std::vector<Action> out;
  for (const auto& [op, m] : ops) out.push_back({op, rank, m, 0});
  return out;
}

using brigade::batching::MicroBatchTable;

MicroBatchTable table(const std::vector<double>& seconds, const std::vector<double>& bytes) {
  return MicroBatchTable::without_recompute(seconds, bytes);
}

double makespan(const sch::Schedule& compute, const MicroBatchTable& t,
                std::vector<double>* peaks = nullptr) {
  const brigade::batching::MicroBatchTableCost cost(t, 1.0 / 3.0);
  const auto r = brigade::sim::simulate(sch::lower(compute), cost);
  if (peaks) *peaks = r.peak_memory_bytes;
  return r.makespan;
}

double makespan(const sch::Schedule& compute, const std::vector<double>& seconds,
                const std::vector<double>& bytes, std::vector<double>* peaks = nullptr) {
  return makespan(compute, table(seconds, bytes), peaks);
}

}  // namespace

TEST_CASE("schedule.adaptive: equal micro-batches without a limit run the cycle order") {
  // P = 2, M = 3: rank 0 runs F(m) in cycle m and B(m) in cycle m + 3; rank 1 F(m) in cycle
  // m + 1 and B(m) in cycle m + 2 (B first within a cycle).
  const auto s = sch::adaptive({2, 3});
  CHECK(s.ranks[0] == program({{Op::F, 0}, {Op::F, 1}, {Op::F, 2}, {Op::B, 0}, {Op::B, 1},
                               {Op::B, 2}}, 0));
  CHECK(s.ranks[1] == program({{Op::F, 0}, {Op::B, 0}, {Op::F, 1}, {Op::B, 1}, {Op::F, 2},
                               {Op::B, 2}}, 1));
  // P = 4, M = 12: rank r holds min(2(P - r) - 1, M) micro-batches at its peak (7, 5, 3, 1).
  const auto big = sch::adaptive({4, 12});
  for (int r = 0; r < 4; ++r) {
    const auto& prog = big.ranks[static_cast<std::size_t>(r)];
    const auto first_b = std::find_if(prog.begin(), prog.end(),
                                      [](const Action& a) { return a.op == Op::B; });
    CHECK(first_b - prog.begin() == 2 * (4 - r) - 1);
  }
}

TEST_CASE("schedule.adaptive: a limit of P micro-batches gives 1F1B's order on rank 0") {
  sch::Params p{4, 8};
  p.microbatch_bytes.assign(8, 1.0);
  p.memory_limit_bytes = 4.0;
  const auto s = sch::adaptive(p);
  CHECK(s.ranks[0] == sch::one_f_one_b({4, 8}).ranks[0]);
  // A limit of one micro-batch: every rank runs F, B, F, B, ... (no two held at once).
  p.memory_limit_bytes = 1.0;
  const auto one = sch::adaptive(p);
  for (const auto& prog : one.ranks)
    for (std::size_t i = 0; i < prog.size(); ++i)
      CHECK(prog[i] == Action{i % 2 == 0 ? Op::F : Op::B, prog[0].virtual_stage,
                              static_cast<int>(i / 2), 0});
}

TEST_CASE("schedule.adaptive: unequal micro-batches stay under the memory limit, channels are "
          "FIFO, the lowered schedule validates") {
  std::mt19937 rng(15);
  for (int trial = 0; trial < 40; ++trial) {
    const int P = 1 + static_cast<int>(rng() % 6), M = 1 + static_cast<int>(rng() % 20);
    sch::Params p{P, M};
    std::vector<double> seconds;
    for (int m = 0; m < M; ++m) {
      const double tokens = 16.0 + static_cast<double>(rng() % 2000);
      p.microbatch_bytes.push_back(tokens * 1000.0);
      seconds.push_back(tokens * 1e-4);
    }
    const double biggest = *std::max_element(p.microbatch_bytes.begin(), p.microbatch_bytes.end());
    p.memory_limit_bytes = biggest * (1.0 + static_cast<double>(rng() % 40) / 10.0);
    CAPTURE(trial);
    CAPTURE(P);
    CAPTURE(M);
    const auto s = sch::adaptive(p);
    for (int r = 0; r < P; ++r) {
      // Every rank runs the forwards and the backwards in injection order (FIFO queues), so
      // each receive matches the next message of its channel.
      std::vector<int> f, b;
      for (const auto& a : s.ranks[static_cast<std::size_t>(r)])
        (a.op == Op::F ? f : b).push_back(a.microbatch);
      std::vector<int> ids(static_cast<std::size_t>(M));
      std::iota(ids.begin(), ids.end(), 0);
      CHECK(f == ids);
      CHECK(b == ids);
    }
    sch::validate(sch::lower(s));
    std::vector<double> peaks;
    (void)makespan(s, seconds, p.microbatch_bytes, &peaks);
    for (const double peak : peaks) CHECK(peak <= p.memory_limit_bytes);
  }
}

TEST_CASE("schedule.adaptive: on alternating small and large micro-batches it beats 1F1B "
          "within the same memory") {
  // P = 4, micro-batches of 1 and 4 s (F a third) and 1 and 4 units of activations, alternating.
  // 1F1B peaks at 10 units on rank 0 and takes 121/3 s; the adaptive order under a limit of
  // 12 units (what 1F1B needs, plus room for one more small micro-batch) runs more forwards
  // ahead where they fit and fills 1F1B's bubbles behind the large ones: 115/3 s.
  const std::vector<double> sizes{1, 4, 1, 4, 1, 4, 1, 4};
  sch::Params p{4, 8};
  p.microbatch_bytes = sizes;
  p.memory_limit_bytes = 12.0;
  std::vector<double> peaks, peaks_1f1b;
  const double adaptive = makespan(sch::adaptive(p), sizes, sizes, &peaks);
  const double ofob = makespan(sch::one_f_one_b({4, 8}), sizes, sizes, &peaks_1f1b);
  for (const double peak : peaks) CHECK(peak <= 12.0);
  CHECK(peaks_1f1b[0] == 10.0);
  CHECK(ofob == doctest::Approx(121.0 / 3.0).epsilon(1e-12));
  CHECK(adaptive == doctest::Approx(115.0 / 3.0).epsilon(1e-12));
  // Without a limit: 94/3 s, 22% under 1F1B (peak 19 units on rank 0).
  p.memory_limit_bytes = std::numeric_limits<double>::infinity();
  CHECK(makespan(sch::adaptive(p), sizes, sizes, &peaks) ==
        doctest::Approx(94.0 / 3.0).epsilon(1e-12));
  CHECK(peaks[0] == 19.0);
}

TEST_CASE("schedule.adaptive: bad parameters are named errors") {
  sch::Params p{2, 3};
  p.microbatch_bytes = {1.0, 5.0, 1.0};
  p.memory_limit_bytes = 4.0;
  CHECK(error_of(p).find("micro-batch 1 keeps 5 bytes of activations on a rank, more than the "
                         "memory limit of 4 bytes") != std::string::npos);
  p.microbatch_bytes = {1.0, 1.0};
  CHECK(error_of(p).find("2 micro-batch byte counts for 3 micro-batches") != std::string::npos);
  p.microbatch_bytes = {1.0, -1.0, 1.0};
  CHECK(error_of(p).find("micro-batch 1 keeps -1 bytes") != std::string::npos);
  p.microbatch_bytes = {};
  p.memory_limit_bytes = 0.0;
  CHECK(error_of(p).find("memory limit 0 bytes, expected > 0") != std::string::npos);
  CHECK(error_of({2, 3, 2}).find("adaptive: virtual stages per rank = 2") != std::string::npos);
}

TEST_CASE("batching.order_adaptive: the best of every permutation (adaptive, or 1F1B where it "
          "fits) for few micro-batches, the best cluster order for many") {
  using brigade::batching::order_adaptive;
  // Four micro-batches, k = 4: every one of the 24 orders is tried; the choice equals brute force.
  const std::vector<double> seconds{4, 1, 3, 1}, bytes{4, 1, 3, 1};
  const auto best = order_adaptive(table(seconds, bytes), 3, 6.0);
  CHECK(best.orders_tried == 24);
  std::vector<int> perm{0, 1, 2, 3};
  double brute = std::numeric_limits<double>::infinity();
  do {
    sch::Params p{3, 4};
    std::vector<double> s, b;
    for (const int m : perm) {
      s.push_back(seconds[static_cast<std::size_t>(m)]);
      b.push_back(bytes[static_cast<std::size_t>(m)]);
    }
    p.microbatch_bytes = b;
    p.memory_limit_bytes = 6.0;
    brute = std::min(brute, makespan(sch::adaptive(p), s, b));
    std::vector<double> peaks;
    const double ofob = makespan(sch::one_f_one_b(p), s, b, &peaks);
    if (*std::max_element(peaks.begin(), peaks.end()) <= 6.0) brute = std::min(brute, ofob);
  } while (std::next_permutation(perm.begin(), perm.end()));
  CHECK(best.makespan_seconds == doctest::Approx(brute).epsilon(1e-12));
  CHECK(best.makespan_seconds <= best.input_order_makespan_seconds);
  // The chosen schedule runs the chosen order: its micro-batch j is the caller's order[j].
  std::vector<double> s, b;
  for (const int m : best.order) {
    s.push_back(seconds[static_cast<std::size_t>(m)]);
    b.push_back(bytes[static_cast<std::size_t>(m)]);
  }
  CHECK(makespan(best.schedule, s, b) == doctest::Approx(best.makespan_seconds).epsilon(1e-12));

  // 30 micro-batches in three clear sizes (k = 3): 3! cluster orders + the input order.
  std::vector<double> many_s, many_b;
  for (int m = 0; m < 30; ++m) {
    const double size = m % 3 == 0 ? 1.0 : m % 3 == 1 ? 2.0 : 8.0;
    many_s.push_back(size);
    many_b.push_back(size);
  }
  const auto clustered = order_adaptive(table(many_s, many_b), 4, 16.0);
  CHECK(clustered.orders_tried == 7);
  CHECK(clustered.makespan_seconds < clustered.input_order_makespan_seconds);
  CHECK(clustered.generator == "adaptive");
  // Equal micro-batches with room for 1F1B: 1F1B's order wins (the cycle order runs more
  // forwards ahead on the middle ranks), (M + P - 1)(F + B) = 11 s for P = 4, M = 8, 1 s each.
  const std::vector<double> equal(8, 1.0);
  const auto same = order_adaptive(table(equal, equal), 4, 4.0);
  CHECK(same.generator == "1f1b");
  CHECK(same.makespan_seconds == doctest::Approx(11.0).epsilon(1e-12));
  // The chosen order runs the clusters one after another.
  int changes = 0;
  for (std::size_t j = 1; j < clustered.order.size(); ++j)
    changes += many_s[static_cast<std::size_t>(clustered.order[j])] !=
               many_s[static_cast<std::size_t>(clustered.order[j - 1])];
  CHECK(changes == 2);
  CHECK_THROWS_AS(order_adaptive(MicroBatchTable{}, 2, 1.0), Error);
  CHECK_THROWS_AS(order_adaptive(table(seconds, bytes), 2, 1.0, 6), Error);
}

// issue 15: DynaPipe's recompute choice per micro-batch reaches the schedule as RECOMPUTE actions.
TEST_CASE("schedule.with_recompute: a RECOMPUTE right before the first backward of each "
          "flagged micro-batch, on every rank") {
  const std::vector<char> flags{0, 1, 0};
  const auto s = sch::with_recompute(sch::one_f_one_b({2, 3}), flags);
  // 1F1B, P = 2, M = 3: rank 0 F0 F1 B0 F2 B1 B2, rank 1 F0 B0 F1 B1 F2 B2.
  CHECK(s.ranks[0] == program({{Op::F, 0}, {Op::F, 1}, {Op::B, 0}, {Op::F, 2}, {Op::Recompute, 1},
                               {Op::B, 1}, {Op::B, 2}}, 0));
  CHECK(s.ranks[1] == program({{Op::F, 0}, {Op::B, 0}, {Op::F, 1}, {Op::Recompute, 1}, {Op::B, 1},
                               {Op::F, 2}, {Op::B, 2}}, 1));
  // Lowered, the RECOMPUTE comes before the RECV_B it does not need: rank 0 recomputes while
  // micro-batch 1's gradient is on its way.
  const auto low = sch::lower(s);
  sch::validate(low);
  const auto& r0 = low.ranks[0];
  const auto rc = std::find(r0.begin(), r0.end(), Action{Op::Recompute, 0, 1, 0});
  REQUIRE(rc != r0.end());
  CHECK(*(rc + 1) == Action{Op::RecvB, 0, 1, 0});
  // Split backward (zero-bubble): the RECOMPUTE precedes the BI, the BW needs nothing rebuilt.
  const auto zb = sch::with_recompute(sch::zero_bubble_h1({2, 2}), std::vector<char>{1, 0});
  for (const auto& prog : zb.ranks) {
    const auto bi = std::find_if(prog.begin(), prog.end(), [](const Action& a) {
      return a.op == Op::BI && a.microbatch == 0;
    });
    REQUIRE(bi != prog.begin());
    CHECK((bi - 1)->op == Op::Recompute);
    CHECK(std::count_if(prog.begin(), prog.end(),
                        [](const Action& a) { return a.op == Op::Recompute; }) == 1);
  }
  sch::validate(sch::lower(zb));
  // No flags: the schedule as it was.
  CHECK(sch::with_recompute(sch::one_f_one_b({2, 3}), {}) == sch::one_f_one_b({2, 3}));
  CHECK_THROWS_WITH_AS(sch::with_recompute(sch::one_f_one_b({2, 3}), std::vector<char>{1, 0}),
                       doctest::Contains("2 recompute flags for 3 micro-batches"), Error);
  CHECK_THROWS_WITH_AS(sch::with_recompute(s, flags),
                       doctest::Contains("0RECOMPUTE1 already recomputes micro-batch 1"), Error);
  CHECK_THROWS_WITH_AS(sch::with_recompute(sch::inference({2, 1}), std::vector<char>{1}),
                       doctest::Contains("recomputation is for training schedules"), Error);
}

TEST_CASE("schedule.adaptive: recomputed micro-batches are admitted with room for their peak") {
  // P = 2, M = 2, both recompute: 1 byte held from F to RECOMPUTE, 5 at the peak. Under a limit
  // of 5.5 the second forward would fit beside the first's checkpoint (2 bytes) but not beside
  // its peak (1 + 5), so rank 0 runs F0 B0 F1 B1 and never holds more than 5.
  MicroBatchTable t;
  t.seconds = {3, 3};
  t.held_bytes = {1, 1};
  t.peak_bytes = {5, 5};
  t.recompute = {1, 1};
  sch::Params p{2, 2};
  p.microbatch_bytes = t.held_bytes;
  p.microbatch_peak_bytes = t.peak_bytes;
  p.memory_limit_bytes = 5.5;
  const auto s = sch::with_recompute(sch::adaptive(p), t.recompute);
  CHECK(s.ranks[0] == program({{Op::F, 0}, {Op::Recompute, 0}, {Op::B, 0}, {Op::F, 1},
                               {Op::Recompute, 1}, {Op::B, 1}}, 0));
  std::vector<double> peaks;
  (void)makespan(s, t, &peaks);
  CHECK(peaks[0] == 5.0);
  // Counting the checkpoints alone (no peaks given) admits F1 early: 6 bytes at RECOMPUTE(0).
  p.microbatch_peak_bytes = {};
  (void)makespan(sch::with_recompute(sch::adaptive(p), t.recompute), t, &peaks);
  CHECK(peaks[0] == 6.0);
  // Named errors: a peak over the limit, a peak below what the micro-batch keeps, a wrong size.
  p.microbatch_peak_bytes = {5.0, 6.0};
  CHECK(error_of(p).find("micro-batch 1 peaks at 6 bytes of activations on a rank, more than "
                         "the memory limit of 5.5 bytes") != std::string::npos);
  p.microbatch_peak_bytes = {0.5, 5.0};
  CHECK(error_of(p).find("micro-batch 0 peaks at 0.5 bytes, expected finite and at least the 1 "
                         "bytes it keeps") != std::string::npos);
  p.microbatch_peak_bytes = {5.0};
  CHECK(error_of(p).find("1 micro-batch peak byte counts for 2 micro-batches") != std::string::npos);
}

TEST_CASE("schedule.adaptive: with recomputed micro-batches the simulated peak stays under the "
          "limit, channels stay FIFO, the lowered schedule validates") {
  std::mt19937 rng(16);
  for (int trial = 0; trial < 40; ++trial) {
    const int P = 1 + static_cast<int>(rng() % 6), M = 1 + static_cast<int>(rng() % 20);
    MicroBatchTable t;
    for (int m = 0; m < M; ++m) {
      const double tokens = 16.0 + static_cast<double>(rng() % 2000);
      const bool rc = rng() % 3 == 0;
      t.seconds.push_back(tokens * 1e-4 * (rc ? 4.0 / 3.0 : 1.0));
      t.peak_bytes.push_back(tokens * 1000.0);
      t.held_bytes.push_back(rc ? tokens * 1000.0 / 13.0 : tokens * 1000.0);
      t.recompute.push_back(rc ? 1 : 0);
    }
    sch::Params p{P, M};
    p.microbatch_bytes = t.held_bytes;
    p.microbatch_peak_bytes = t.peak_bytes;
    const double biggest = *std::max_element(t.peak_bytes.begin(), t.peak_bytes.end());
    p.memory_limit_bytes = biggest * (1.0 + static_cast<double>(rng() % 40) / 10.0);
    CAPTURE(trial);
    CAPTURE(P);
    CAPTURE(M);
    const auto s = sch::with_recompute(sch::adaptive(p), t.recompute);
    for (int r = 0; r < P; ++r) {
      std::vector<int> f, b, rc;
      for (const auto& a : s.ranks[static_cast<std::size_t>(r)])
        (a.op == Op::F ? f : a.op == Op::B ? b : rc).push_back(a.microbatch);
      std::vector<int> ids(static_cast<std::size_t>(M)), flagged;
      std::iota(ids.begin(), ids.end(), 0);
      for (int m = 0; m < M; ++m)
        if (t.recompute[static_cast<std::size_t>(m)] != 0) flagged.push_back(m);
      CHECK(f == ids);
      CHECK(b == ids);
      CHECK(rc == flagged);
    }
    sch::validate(sch::lower(s));
    std::vector<double> peaks;
    (void)makespan(s, t, &peaks);
    for (const double peak : peaks) CHECK(peak <= p.memory_limit_bytes);
    // order_adaptive over the same table: its schedule recomputes the same micro-batches (in
    // its order) and stays under the limit too.
    const auto best = brigade::batching::order_adaptive(t, P, p.memory_limit_bytes);
    const auto ordered = t.permuted(best.order);
    CHECK(makespan(best.schedule, ordered, &peaks) ==
          doctest::Approx(best.makespan_seconds).epsilon(1e-12));
    for (const double peak : peaks) CHECK(peak <= p.memory_limit_bytes * (1 + 1e-9));
    for (const auto& prog : best.schedule.ranks)
      for (const auto& a : prog)
        if (a.op == Op::Recompute) CHECK(ordered.recompute[static_cast<std::size_t>(a.microbatch)] == 1);
  }
}
