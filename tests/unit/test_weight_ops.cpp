// The memory ops PREFETCH, RELEASE, MIGRATE and MIGRATE_RECV: text form, the offload pass,
// validate()'s residency and migration rules and refusals, the simulator's I/O lane (closed forms
// of a 2-window ring), the executor's dispatch, and the chunk index carried on SEND/RECV and
// compute.
#include "../test_util.hpp"

#include <brigade/cost/cost_model.hpp>
#include <brigade/engine/executor.hpp>
#include <brigade/engine/threads.hpp>
#include <brigade/engine/training.hpp>
#include <brigade/io/trace.hpp>
#include <brigade/model/config.hpp>
#include <brigade/schedule.hpp>
#include <brigade/sim/simulator.hpp>
#include <brigade/sim/svg.hpp>
#include <brigade/transport/in_process.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

using brigade::test::rel;

namespace sch = brigade::schedule;
namespace eng = brigade::engine;
namespace tp = brigade::transport;
using brigade::Errc;
using brigade::test::error_of;
using brigade::cost::UnitCostModel;
using brigade::cost::UnitCostOptions;
using sch::Action;
using sch::Op;

namespace {

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

/// The inference ring of P ranks x V windows (virtual stage v on rank v mod P), M sequence
/// groups, `rounds` rounds (prefill + rounds - 1 decode steps), lowered.
sch::Schedule ring(int P, int V, int M, int rounds) {
  return sch::lower(sch::inference({P, M, V, rounds - 1}));
}

/// Unit costs for a ring: F of one window = f, a PREFETCH of one window = load, one weight unit
/// per rank (1 / V per window), free links, SAMPLE free.
UnitCostModel ring_costs(const sch::Shape& shape, double f, double load) {
  const int V = shape.num_virtual_stages / shape.num_ranks;
  UnitCostOptions o;
  o.weight_load = load * V;
  return UnitCostModel(shape, f * V, 0.0, std::nullopt, o);
}

}  // namespace

TEST_CASE("ops.text: PREFETCH, RELEASE, MIGRATE and MIGRATE_RECV print and parse back, kNumOps "
          "counts them") {
  CHECK(brigade::kNumOps == 15);
  CHECK(sch::to_string(Action{Op::MigrateRecv, 1, 0, 2}) == "1MIGRATE_RECV0.c2");
  CHECK(sch::parse_action("1MIGRATE_RECV0.c2") == Action{Op::MigrateRecv, 1, 0, 2});
  CHECK(sch::to_string(Action{Op::Prefetch, 2, 0, 3}) == "2PREFETCH0.c3");
  CHECK(sch::to_string(Action{Op::Release, 0, 1, 0}) == "0RELEASE1");
  CHECK(sch::to_string(Action{Op::Migrate, 5, 4, 1}) == "5MIGRATE4.c1");
  CHECK(sch::parse_action("2PREFETCH0.c3") == Action{Op::Prefetch, 2, 0, 3});
  CHECK(sch::parse_action("0RELEASE1") == Action{Op::Release, 0, 1, 0});
  CHECK(sch::parse_action("5MIGRATE4.c1") == Action{Op::Migrate, 5, 4, 1});
  CHECK(contains(error_of(Errc::InvalidArgument, [] { sch::parse_action("0PREFECH0"); }),
                 "unknown op 'PREFECH', expected one of F, B, BI, BW, RECOMPUTE, SEND_F, RECV_F, "
                 "SEND_B, RECV_B, SAMPLE, OPT, PREFETCH, RELEASE, MIGRATE, MIGRATE_RECV"));
  // Classification: memory ops are neither compute nor communication.
  for (Op op : {Op::Prefetch, Op::Release, Op::Migrate, Op::MigrateRecv}) {
    CHECK(brigade::is_memory_op(op));
    CHECK_FALSE(brigade::is_compute(op));
    CHECK_FALSE(brigade::is_communication(op));
  }
  CHECK(brigade::is_compute(Op::Opt));
  CHECK_FALSE(brigade::is_memory_op(Op::F));
  // A whole offloaded schedule round-trips through the text form.
  const auto s = sch::with_weight_offload(ring(2, 2, 2, 3));
  CHECK(sch::parse_schedule(sch::to_text(s)) == s);
}

TEST_CASE("ops.offload-pass: one run ahead, released after the run and its sends") {
  // Rank 0 of a 2 x 2 ring, 1 group, 2 rounds: windows 0 and 2 alternate.
  const auto s = sch::with_weight_offload(ring(2, 2, 1, 2));
  std::string r0;
  for (const auto& a : s.ranks[0]) r0 += sch::to_string(a) + " ";
  CHECK(r0 ==
        "0PREFETCH0 2PREFETCH0 0F0 0SEND_F0 0RELEASE0 "
        "0PREFETCH0.c1 2RECV_F0 2F0 2SEND_F0 2RELEASE0 "
        "2PREFETCH0.c1 0RECV_F0.c1 0F0.c1 0SEND_F0.c1 0RELEASE0.c1 "
        "2RECV_F0.c1 2F0.c1 2SEND_F0.c1 2RELEASE0.c1 ");
  // The compute and communication actions are untouched.
  std::vector<Action> stripped;
  for (const auto& a : s.ranks[1])
    if (!brigade::is_memory_op(a.op)) stripped.push_back(a);
  CHECK(stripped == ring(2, 2, 1, 2).ranks[1]);
  // The pass applies once.
  std::vector<Action> again = s.ranks[0];
  CHECK(contains(error_of(Errc::InvalidArgument, [&] { sch::add_weight_offload(again); }),
                 "add_weight_offload: step 0 is already 0PREFETCH0"));
  // Round by round, as the inference worker emits it: each round's windows load and drop.
  std::vector<Action> rounds;
  const std::vector<char> live{1};
  for (int c = 0; c < 2; ++c) {
    const std::size_t begin = rounds.size();
    sch::append_inference_round(s.shape, 0, c, live, rounds);
    sch::add_weight_offload(rounds, begin);
  }
  int prefetches = 0;
  for (const auto& a : rounds) prefetches += a.op == Op::Prefetch;
  CHECK(prefetches == 4);
  auto per_round = sch::empty_schedule(s.shape);
  per_round.ranks[0] = rounds;
  for (int c = 0; c < 2; ++c) {
    const std::size_t begin = per_round.ranks[1].size();
    sch::append_inference_round(s.shape, 1, c, live, per_round.ranks[1]);
    sch::add_weight_offload(per_round.ranks[1], begin);
  }
  CHECK(sch::validate(per_round).weight_actions == 16);
}

TEST_CASE("ops.validate: residency rules, placement and training are refused with reasons") {
  // A schedule without PREFETCH keeps every window resident: nothing changes.
  CHECK(sch::validate(ring(2, 2, 2, 3)).weight_actions == 0);
  const auto good = sch::with_weight_offload(ring(2, 2, 2, 3));
  const auto proof = sch::validate(good);
  CHECK(proof.weight_actions == 24);  // 2 ranks x 3 rounds x 2 windows x (PREFETCH + RELEASE)
  CHECK(proof.compute_actions == sch::validate(ring(2, 2, 2, 3)).compute_actions);
  sch::validate(good, {sch::SendSemantics::Rendezvous, {}});

  // Compute after RELEASE without PREFETCH.
  CHECK(contains(
      error_of(Errc::InvalidArgument,
               [] {
                 sch::validate(sch::parse_schedule(
                     "shape ranks=1 microbatches=1 chunks=2 mode=inference\n"
                     "rank 0: 0F0 0SAMPLE0 0RELEASE0 0F0.c1 0SAMPLE0.c1\n"));
               }),
      "validate: rank 0 step 3: 0F0.c1 runs on virtual stage 0 after 0RELEASE0 at step 2 "
      "without a 0PREFETCH0.c1 in between: its weights are not resident"));
  // With the PREFETCH it validates; weights start absent when the first action is a PREFETCH.
  sch::validate(sch::parse_schedule("shape ranks=1 microbatches=1 chunks=2 mode=inference\n"
                                    "rank 0: 0PREFETCH0 0F0 0SAMPLE0 0RELEASE0 0PREFETCH0.c1 "
                                    "0F0.c1 0SAMPLE0.c1 0RELEASE0.c1\n"));
  // PREFETCH of resident weights (from the start, or prefetched already).
  CHECK(contains(error_of(Errc::InvalidArgument,
                          [] {
                            sch::validate(sch::parse_schedule(
                                "shape ranks=1 microbatches=1 chunks=1 mode=inference\n"
                                "rank 0: 0F0 0PREFETCH0 0SAMPLE0\n"));
                          }),
                 "validate: rank 0 step 1: 0PREFETCH0 prefetches virtual stage 0, whose weights "
                 "are already resident (from the start); RELEASE them before a new PREFETCH"));
  CHECK(contains(error_of(Errc::InvalidArgument,
                          [] {
                            sch::validate(sch::parse_schedule(
                                "shape ranks=1 microbatches=1 chunks=1 mode=inference\n"
                                "rank 0: 0PREFETCH0 0PREFETCH0 0F0 0SAMPLE0\n"));
                          }),
                 "already resident (since step 0 (0PREFETCH0))"));
  // RELEASE twice.
  CHECK(contains(error_of(Errc::InvalidArgument,
                          [] {
                            sch::validate(sch::parse_schedule(
                                "shape ranks=1 microbatches=1 chunks=1 mode=inference\n"
                                "rank 0: 0F0 0SAMPLE0 0RELEASE0 0RELEASE0\n"));
                          }),
                 "validate: rank 0 step 3: 0RELEASE0 releases virtual stage 0, whose weights are "
                 "not resident: released at step 2 (0RELEASE0) without a PREFETCH since"));
  // A virtual stage placed on another rank.
  CHECK(contains(error_of(Errc::InvalidArgument,
                          [] {
                            sch::validate(sch::parse_schedule(
                                "shape ranks=2 microbatches=1 chunks=1 mode=inference\n"
                                "rank 0: 1PREFETCH0 0F0 0SEND_F0\n"
                                "rank 1: 1RECV_F0 1F0 1SAMPLE0\n"));
                          }),
                 "validate: rank 0 step 0: 1PREFETCH0 names virtual stage 1, which is placed on "
                 "rank 1"));
  // Training: the stages own and update their weights.
  auto train = sch::lower(sch::gpipe({2, 2}));
  train.ranks[0].insert(train.ranks[0].begin(), Action{Op::Prefetch, 0, 0, 0});
  CHECK(contains(error_of(Errc::InvalidArgument, [&] { sch::validate(train); }),
                 "validate: rank 0 step 0: 0PREFETCH0 in a training schedule: training stages "
                 "own their weights and the optimizer updates them in place"));
}

namespace {

/// A 2-stage inference ring of 2 micro-batches and 4 rounds in which virtual stage `from` hands
/// a layer to `to` with parts in rounds 1 and 2, placed as engine::InferenceWorker emits them:
/// MIGRATE(from, m, c) right after the last action of (from, m, c), MIGRATE_RECV(to, m, c)
/// right before F(to, m, c + 1).
sch::Schedule migrating(int from, int to) {
  auto s = ring(2, 1, 2, 4);
  for (int c : {1, 2})
    for (int m = 1; m >= 0; --m) {
      auto& snd = s.ranks[static_cast<std::size_t>(from)];
      std::size_t at = 0;
      for (std::size_t i = 0; i < snd.size(); ++i)
        if (snd[i].virtual_stage == from && snd[i].microbatch == m && snd[i].chunk == c) at = i + 1;
      snd.insert(snd.begin() + static_cast<std::ptrdiff_t>(at), Action{Op::Migrate, from, m, c});
      auto& rcv = s.ranks[static_cast<std::size_t>(to)];
      const auto f = std::find(rcv.begin(), rcv.end(), Action{Op::F, to, m, c + 1});
      rcv.insert(f, Action{Op::MigrateRecv, to, m, c});
    }
  return s;
}

}  // namespace

TEST_CASE("ops.validate: MIGRATE pairs with MIGRATE_RECV, a half without its pair, a part sent "
          "before its round's forward, or a layer used before its copy completes is refused") {
  // Both directions validate under eager and rendezvous sends, with the migration channel.
  for (auto [from, to] : {std::pair{0, 1}, std::pair{1, 0}}) {
    CAPTURE(from);
    const auto s = migrating(from, to);
    const auto proof = sch::validate(s);
    CHECK(proof.migrations == 4);
    CHECK(proof.messages == sch::validate(ring(2, 1, 2, 4)).messages);
    CHECK(sch::validate(s, {sch::SendSemantics::Rendezvous, {}}).migrations == 4);
    CHECK(sch::parse_schedule(sch::to_text(s)) == s);
  }
  // A MIGRATE without its MIGRATE_RECV, and the other way round, named with their steps.
  auto lone = migrating(0, 1);
  auto& r1 = lone.ranks[1];
  r1.erase(std::find(r1.begin(), r1.end(), Action{Op::MigrateRecv, 1, 1, 2}));
  CHECK(contains(error_of(Errc::InvalidArgument, [&] { sch::validate(lone); }),
                 "validate: rank 0 step 19: 0MIGRATE1.c2 has no pair: neither "));
  auto orphan = migrating(0, 1);
  auto& r0 = orphan.ranks[0];
  r0.erase(std::find(r0.begin(), r0.end(), Action{Op::Migrate, 0, 0, 1}));
  CHECK(contains(error_of(Errc::InvalidArgument, [&] { sch::validate(orphan); }),
                 "validate: rank 1 step 17: 1MIGRATE_RECV0.c1 has no pair"));
  // The new owner runs round 2 of micro-batch 0 before round 1's part arrived: the layer would
  // be used before its copy completes.
  auto early = migrating(0, 1);
  auto& e1 = early.ranks[1];
  const auto recv = std::find(e1.begin(), e1.end(), Action{Op::MigrateRecv, 1, 0, 1});
  const Action part = *recv;
  e1.erase(recv);
  e1.insert(std::find(e1.begin(), e1.end(), Action{Op::F, 1, 0, 2}) + 1, part);
  const std::string used = error_of(Errc::InvalidArgument, [&] { sch::validate(early); });
  CHECK(contains(used, "validate: rank 1 step 17: 1F0.c2 uses the layer its virtual stage adopts "
                       "before the copy completes: 1MIGRATE_RECV0.c1 (step 18)"));
  // A part sent before the forward that writes its round's KV rows.
  auto ahead = migrating(1, 0);
  auto& a1 = ahead.ranks[1];
  const auto snd = std::find(a1.begin(), a1.end(), Action{Op::Migrate, 1, 1, 2});
  const Action send = *snd;
  a1.erase(snd);
  a1.insert(std::find(a1.begin(), a1.end(), Action{Op::F, 1, 1, 2}), send);
  CHECK(contains(error_of(Errc::InvalidArgument, [&] { sch::validate(ahead); }),
                 "1MIGRATE1.c2 sends its part of round 2 before 1F1.c2 wrote that round's KV "
                 "rows"));
  // Two neighbours receiving the same part, and migrations in training.
  auto both = sch::lower(sch::inference({3, 1, 1, 1}));
  both.ranks[1].push_back(Action{Op::Migrate, 1, 0, 1});
  both.ranks[0].push_back(Action{Op::MigrateRecv, 0, 0, 1});
  both.ranks[2].push_back(Action{Op::MigrateRecv, 2, 0, 1});
  CHECK(contains(error_of(Errc::InvalidArgument, [&] { sch::validate(both); }),
                 "1MIGRATE0.c1 pairs with both 0MIGRATE_RECV0.c1 and 2MIGRATE_RECV0.c1"));
  auto train = sch::lower(sch::gpipe({2, 1}));
  train.ranks[0].push_back(Action{Op::Migrate, 0, 0, 0});
  CHECK(contains(error_of(Errc::InvalidArgument, [&] { sch::validate(train); }),
                 "validate: rank 0 step 4: 0MIGRATE0 in a training schedule"));
  // The simulator has no cost for a migration's parts: refused by name, validated or not.
  brigade::sim::SimOptions no_check;
  no_check.validate = false;
  const auto s = migrating(0, 1);
  CHECK(contains(error_of(Errc::InvalidArgument,
                          [&] {
                            brigade::sim::simulate(s, UnitCostModel(s.shape, 1.0, 0.0), no_check);
                          }),
                 "the simulator has no cost for a layer migration"));
}

TEST_CASE("ops.lower: memory ops in a compute-only schedule keep their place") {
  auto compute = sch::inference({1, 1, 1, 1});
  compute.ranks[0].insert(compute.ranks[0].begin(), Action{Op::Prefetch, 0, 0, 0});
  compute.ranks[0].insert(compute.ranks[0].begin() + 3, Action{Op::Release, 0, 0, 0});
  compute.ranks[0].insert(compute.ranks[0].begin() + 4, Action{Op::Prefetch, 0, 0, 1});
  const auto low = sch::lower(compute);
  CHECK(low == compute);  // one rank: no communication at all
  CHECK(sch::strip_communication(low) == compute);
  sch::validate(low);
}

// prima.cpp's pipelined ring with offload, closed forms: P = 2 ranks, 2 windows each (virtual
// stage v on rank v mod 2), 1 sequence group, C rounds, F = f per window, free links, a
// window's load L on its rank's I/O lane. Without offload the token walks 4 windows per round
// one after another: 4Cf. With the pass (load one run ahead, release after): for L <= f every
// load after the first two hides behind the other rank's and the other window's compute, so
// the makespan is 4Cf + L (only rank 0's first load is exposed). For L >= 2f the two I/O lanes
// pace the ring: each rank loads 2 windows per round back to back, rank 0's window 0 of round c
// starts at (2c + 1)L, window 2 at (2c + 2)L, and the makespan is 2CL + 2f.
TEST_CASE("ops.sim.ring-offload.closed-form: prefetch hides behind compute, or paces the ring") {
  for (int C : {1, 2, 3, 5}) {
    CAPTURE(C);
    const double f = 1.0;
    const auto base = ring(2, 2, 1, C);
    const auto off = sch::with_weight_offload(base);
    const auto none = brigade::sim::simulate(base, ring_costs(base.shape, f, 0.5));
    CHECK(none.makespan == doctest::Approx(4.0 * C * f));
    CHECK(none.peak_weight_bytes == std::vector<double>{1.0, 1.0});  // both windows resident
    CHECK(none.io_wait_seconds == std::vector<double>{0.0, 0.0});
    for (double L : {0.25, 0.5, 1.0}) {
      CAPTURE(L);
      const auto r = brigade::sim::simulate(off, ring_costs(off.shape, f, L));
      CHECK(r.makespan == doctest::Approx(4.0 * C * f + L));
      CHECK(r.io_wait_seconds[0] == rel(L));  // the first load of window 0
      CHECK(r.io_wait_seconds[1] == doctest::Approx(0.0));
      CHECK(r.busy_seconds == none.busy_seconds);  // loads are not compute
    }
    for (double L : {2.0, 3.0, 4.5}) {
      CAPTURE(L);
      const auto r = brigade::sim::simulate(off, ring_costs(off.shape, f, L));
      CHECK(r.makespan == doctest::Approx(2.0 * C * L + 2.0 * f));
      CHECK(r.makespan > none.makespan);
    }
  }
  // The PREFETCH intervals are on the Timeline and overlap compute on the same rank.
  const auto off = sch::with_weight_offload(ring(2, 2, 1, 3));
  const auto r = brigade::sim::simulate(off, ring_costs(off.shape, 1.0, 0.5));
  int prefetches = 0, overlapping = 0;
  for (const auto& p : r.timeline.intervals()) {
    if (p.op != Op::Prefetch) continue;
    ++prefetches;
    CHECK(p.duration() == rel(0.5));
    for (const auto& c : r.timeline.intervals())
      if (c.rank == p.rank && brigade::is_compute(c.op) && c.start < p.end && p.start < c.end)
        ++overlapping;
  }
  CHECK(prefetches == 12);  // 2 ranks x 3 rounds x 2 windows
  CHECK(overlapping > 0);
}

TEST_CASE("ops.sim.peak-weights: a rank of 4 windows holds 2 with offload, all 4 without") {
  const auto base = ring(2, 4, 2, 3);
  const auto off = sch::with_weight_offload(base);
  const auto none = brigade::sim::simulate(base, ring_costs(base.shape, 1.0, 0.1));
  const auto r = brigade::sim::simulate(off, ring_costs(off.shape, 1.0, 0.1));
  CHECK(none.peak_weight_bytes == std::vector<double>{1.0, 1.0});
  CHECK(r.peak_weight_bytes[0] == rel(0.5));
  CHECK(r.peak_weight_bytes[1] == rel(0.5));
  const auto m = brigade::sim::metrics_json(r);
  CHECK(m["peak_weight_bytes"].size() == 2);
  CHECK(m["io_wait_s"].size() == 2);
  // The Chrome trace puts the loads on an I/O row per rank; the SVG draws them teal.
  const auto j = brigade::io::to_chrome_trace(r.timeline);
  int io_rows = 0, io_events = 0;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "M" && contains(e["args"]["name"].get<std::string>(), " I/O")) ++io_rows;
    if (e["ph"] == "X" && (e["cat"] == "PREFETCH" || e["cat"] == "RELEASE")) {
      ++io_events;
      CHECK(e["tid"].get<int>() >= 2);
    }
  }
  CHECK(io_rows == 2);
  CHECK(io_events == 2 * 2 * 3 * 4);
  brigade::sim::SvgOptions so;
  so.seconds = false;
  const std::string svg = brigade::sim::render_svg(r.timeline, so);
  CHECK(contains(svg, "fill=\"#76b7b2\"><title>PREFETCH vs0"));
  CHECK(contains(svg, ">PREFETCH</text>"));
  CHECK(contains(svg, ">RELEASE</text>"));
}

TEST_CASE("ops.roofline: weight bytes of a window and its load time over the disk bandwidth") {
  const brigade::model::ModelSpec spec(brigade::model::named_config("42M"));
  const auto shape = ring(2, 2, 1, 2).shape;
  const auto part = brigade::cost::RooflineCostModel::placed_uniform(spec, shape);
  brigade::cost::RooflineOptions ro;
  ro.weight_load_bytes_per_s = 1e9;
  const brigade::cost::RooflineCostModel cm(spec, part, shape, ro);
  double total = 0.0, expected = 0.0;
  for (int v = 0; v < 4; ++v) {
    const Action a{Op::Prefetch, v, 0, 0};
    total += cm.weight_bytes(a);
    CHECK(cm.weight_load_seconds(a) == rel(cm.weight_bytes(a) / 1e9));
  }
  for (int l = 0; l < spec.num_layers(); ++l)
    expected += brigade::model::layer_cost(spec, l, brigade::model::WorkItem{}).weight_bytes;
  CHECK(total == doctest::Approx(expected));
  CHECK(total > 1e8);  // 42M parameters in float32
  const auto off = sch::with_weight_offload(sch::lower(sch::inference({2, 1, 2, 1})));
  const auto r = brigade::sim::simulate(off, cm);
  CHECK(r.io_wait_seconds[0] > 0.0);
  ro.weight_load_bytes_per_s = 0.0;
  CHECK(contains(error_of(Errc::InvalidArgument,
                          [&] { brigade::cost::RooflineCostModel(spec, part, shape, ro); }),
                 "weight load bandwidth 0 bytes/s, expected > 0"));
}

namespace {

/// A worker that counts what the executor hands it; messages are one int.
struct CountingWorker {
  const sch::Shape* shape;
  std::vector<Action> seen;
  eng::Work compute(const Action& a) {
    seen.push_back(a);
    return {true, 0, brigade::is_memory_op(a.op) ? "weights" : ""};
  }
  void recv_messages(const Action& a, std::vector<eng::MessageSpec>& out) {
    out.push_back({sch::channel_of(*shape, a),
                   tp::MessageHeader::make(a.microbatch, a.virtual_stage, brigade::DType::I32, {1},
                                           a.chunk),
                   4});
  }
  void received(const Action& a, std::span<const eng::Received> msgs) {
    // The payload is the sender's chunk: the message of this chunk, not another one's.
    std::int32_t v = -1;
    std::memcpy(&v, msgs[0].payload.data(), sizeof v);
    const Action peer = *sch::counterpart(*shape, a);
    BRIGADE_CHECK(v == peer.chunk, Errc::HeaderMismatch, "{} received the message of chunk {}",
                  sch::to_string(a), v);
    seen.push_back(a);
  }
  void send(const Action& a, eng::Outbox& out) {
    const Action peer = *sch::counterpart(*shape, a);
    const std::int32_t v = a.chunk;
    out.add(sch::channel_of(*shape, a),
            tp::MessageHeader::make(a.microbatch, peer.virtual_stage, brigade::DType::I32, {1},
                                    peer.chunk),
            tp::as_bytes(std::span<const std::int32_t>(&v, 1)));
  }
};

std::vector<brigade::Timeline> execute_all(const sch::Schedule& s,
                                           std::vector<std::vector<Action>>* seen = nullptr) {
  const int P = s.shape.num_ranks;
  tp::InProcessFabric fabric(P);
  std::vector<brigade::Timeline> tls(static_cast<std::size_t>(P), brigade::Timeline(P));
  if (seen) seen->assign(static_cast<std::size_t>(P), {});
  const auto t0 = std::chrono::steady_clock::now();
  auto endpoints = tp::endpoints(fabric);
  eng::run_ranks(std::span(endpoints), [&](tp::InProcessTransport& t) {
    const int r = t.rank();
    CountingWorker w{&s.shape, {}};
    eng::FixedProgram program(s.ranks[static_cast<std::size_t>(r)]);
    eng::execute(program, w, t, eng::ExecutorRun{&s.shape, r, t0, 10.0, {}},
                 tls[static_cast<std::size_t>(r)]);
    if (seen) (*seen)[static_cast<std::size_t>(r)] = std::move(w.seen);
  });
  return tls;
}

}  // namespace

TEST_CASE("ops.executor: PREFETCH/RELEASE reach the worker and the Timeline, MIGRATE needs a "
          "migrating worker") {
  const auto s = sch::with_weight_offload(ring(2, 2, 2, 2));
  std::vector<std::vector<Action>> seen;
  const auto tls = execute_all(s, &seen);
  for (int r = 0; r < 2; ++r) {
    std::vector<Action> want;
    for (const auto& a : s.ranks[static_cast<std::size_t>(r)])
      if (!(a.op == Op::SendF || a.op == Op::SendB)) want.push_back(a);
    CHECK(seen[static_cast<std::size_t>(r)] == want);
    int prefetch = 0, release = 0;
    for (const auto& iv : tls[static_cast<std::size_t>(r)].intervals()) {
      prefetch += iv.op == Op::Prefetch;
      release += iv.op == Op::Release;
      if (brigade::is_memory_op(iv.op)) CHECK(iv.label == "weights");
    }
    CHECK(prefetch == 4);
    CHECK(release == 4);
  }
  auto migrate = ring(1, 1, 1, 1);
  migrate.ranks[0].push_back(Action{Op::Migrate, 0, 0, 0});
  CHECK(contains(error_of(Errc::InvalidArgument, [&] { execute_all(migrate); }),
                 "execute: rank 0: 0MIGRATE0: this worker does not migrate layers"));
}

// The chunk index travels with every action: lower() puts it on SEND/RECV, validate() keys its
// matching on it, the simulator and the executor record it, and the text form prints it.
TEST_CASE("ops.chunks: a 2-chunk training schedule carries the chunk on SEND/RECV and compute") {
  const auto compute = sch::parse_schedule(
      "shape ranks=2 microbatches=1 chunks=2\n"
      "rank 0: 0F0 0F0.c1 0B0.c1 0B0\n"
      "rank 1: 1F0 1F0.c1 1B0.c1 1B0\n");
  const auto low = sch::lower(compute);
  std::string r0, r1;
  for (const auto& a : low.ranks[0]) r0 += sch::to_string(a) + " ";
  for (const auto& a : low.ranks[1]) r1 += sch::to_string(a) + " ";
  CHECK(r0 == "0F0 0SEND_F0 0F0.c1 0SEND_F0.c1 0RECV_B0.c1 0B0.c1 0RECV_B0 0B0 ");
  CHECK(r1 == "1RECV_F0 1F0 1RECV_F0.c1 1F0.c1 1B0.c1 1SEND_B0.c1 1B0 1SEND_B0 ");
  CHECK(sch::parse_schedule(sch::to_text(low)) == low);
  CHECK(sch::validate(low).messages == 4);
  // Receiving chunk 1 before chunk 0 of a channel is named by validate.
  auto swapped = low;
  std::swap(swapped.ranks[1][0], swapped.ranks[1][2]);
  std::swap(swapped.ranks[1][1], swapped.ranks[1][3]);
  CHECK(contains(error_of(Errc::InvalidArgument, [&] { sch::validate(swapped); }),
                 "1RECV_F0.c1 is receive #1 from rank 0 on the activation channel, but message "
                 "#1 that rank 0 sends on it is 0SEND_F0 (step 1)"));
  // The simulator records the chunk of compute and of communication.
  UnitCostOptions uo;
  uo.link = {0.5, std::numeric_limits<double>::infinity()};
  const auto r = brigade::sim::simulate(low, UnitCostModel(low.shape, 1.0, 2.0, std::nullopt, uo));
  int chunk1_compute = 0, chunk1_comm = 0;
  for (const auto& iv : r.timeline.intervals()) {
    if (iv.chunk != 1) continue;
    (brigade::is_compute(iv.op) ? chunk1_compute : chunk1_comm) += 1;
  }
  CHECK(chunk1_compute == 4);
  CHECK(chunk1_comm >= 2);
  // The executor hands each chunk's message to the receive of that chunk (the payload is the
  // sender's chunk) and records the chunk on every interval.
  std::vector<std::vector<Action>> seen;
  const auto tls = execute_all(low, &seen);
  int recorded = 0;
  for (const auto& tl : tls)
    for (const auto& iv : tl.intervals()) recorded += iv.chunk == 1;
  CHECK(recorded >= 8);  // 4 compute, 2 RECV and 2 SEND of chunk 1
  CHECK(seen[1][0] == Action{Op::RecvF, 1, 0, 0});
  // Without validate, the swapped program reaches the executor: the message header carries the
  // receiver's chunk, so chunk 0's message at chunk 1's receive stops the run.
  CHECK(contains(error_of(Errc::HeaderMismatch, [&] { execute_all(swapped); }),
                 "has chunk = 0, expected 1"));
}

TEST_CASE("ops.errors: the pass, the cost models and the training worker name what is wrong") {
  std::vector<Action> prog{{Op::F, 0, 0, 0}};
  CHECK(contains(error_of(Errc::InvalidArgument, [&] { sch::add_weight_offload(prog, 2); }),
                 "add_weight_offload: fragment start 2 past the program's 1 actions"));
  UnitCostOptions o;
  o.weight_load = -1.0;
  const auto shape = ring(2, 2, 1, 1).shape;
  CHECK(contains(error_of(Errc::InvalidArgument, [&] { UnitCostModel(shape, 1.0, 0.0, {}, o); }),
                 "weight load=-1, expected finite and >= 0"));
  const auto train = sch::gpipe({2, 2}).shape;
  eng::TrainingWorker worker(std::span<const Action>{}, train, 0, {}, {}, 1.0, 8);
  CHECK(contains(error_of(Errc::InvalidArgument,
                          [&] { worker.compute(Action{Op::Release, 0, 0, 0}); }),
                 "executor: rank 0: 0RELEASE0: the training worker's stages own their weights"));
}

#ifdef BRIGADE_CLI
TEST_CASE("ops.cli: brigade simulate --offload prints the closed form, peak weights and I/O wait") {
  if (!std::filesystem::exists(BRIGADE_CLI)) return;
  // The 2 x 2 ring, 3 rounds, F = 1 per window, a window loads in 0.5: 4 C f + L = 12.5.
  const auto r = brigade::test::run_cli(
      "simulate --schedule inference --ranks 2 --microbatches 1 --virtual 2 --decode-steps 2 "
      "--unit-costs 2,0 --offload --weight-load 1");
  CAPTURE(r.out);
  CAPTURE(r.err);
  CHECK(r.rc == 0);
  CHECK(contains(r.out, "makespan     12.5 s"));
  CHECK(contains(r.out, "weights      peak 1 1 units resident per rank"));
  CHECK(contains(r.out, "24 PREFETCH/RELEASE"));
  CHECK(contains(r.out, "I/O wait     0.5 0\n"));
  // Training schedules are refused with validate's reason; --load-bandwidth needs --model.
  const auto t = brigade::test::run_cli("simulate --schedule 1f1b --ranks 2 --microbatches 2 --offload");
  CHECK(t.rc == 2);
  CHECK(contains(t.err, "0PREFETCH0 in a training schedule"));
  const auto b = brigade::test::run_cli(
      "simulate --schedule inference --ranks 2 --microbatches 1 --offload --load-bandwidth 1e9");
  CHECK(b.rc != 0);
  CHECK(contains(b.err, "--load-bandwidth requires --model"));
}
#endif
