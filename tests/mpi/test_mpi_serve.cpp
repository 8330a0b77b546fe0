// Serving under mpirun: serve::serve_on over an MpiTransport, one process per stage. stories260K
// greedy serving with layer moves forced every few rounds gives run.c's tokens; the layers'
// weights and KV caches migrate between processes; every rank's compute seconds reach the
// rebalancer on stage 0's process with the rounds' own messages; the per-request metrics and
// every rank's Timeline are gathered on rank 0.
#include <brigade/partition/partition.hpp>
#include <brigade/serve/rebalance.hpp>
#include <brigade/serve/serving.hpp>
#include <brigade/transport/mpi.hpp>

#include <doctest/doctest.h>

#include "serve_workload.hpp"

#include <cstdlib>
#include <filesystem>
#include <set>
#include <utility>
#include <vector>

using namespace brigade;

namespace {

const test::ServeReference& ref() {
  static const test::ServeReference r(BRIGADE_MODEL_DIR);
  return r;
}

}  // namespace

TEST_CASE("mpi.serve: greedy tokens equal run.c's while layers move between processes, moves "
          "forced every few rounds, measurements and timelines reach rank 0") {
  transport::MpiTransport tp;
  const int P = tp.world_size();
  const model::ModelSpec spec(ref().weights.config);
  // Eight requests in flight at once and staggered: every move migrates live KV caches.
  const auto w = test::reference_workload(ref(), {0, 0, 0.002, 0.004, 0.006, 0, 0.008, 0.01});
  serve::ServeOptions o;
  o.microbatches = 2;
  o.max_seqs = 4;
  o.max_batch_tokens = 8;  // prompts are chunked while layers move
  o.prefill_chunk = 3;
  o.inference.sampler.temperature = 0.0f;
  o.inference.timeout_s = 60;
  // Parts of 8 KiB: a layer (about 200 KB of weights) and its KV rows take several rounds, each
  // part above MpiTransport's inline size (a payload stream of its own).
  o.inference.migration_part_bytes = 8 << 10;
  serve::RebalanceOptions rb;
  rb.force_every = 3;
  o.rebalance = rb;
  const auto rep = serve::serve_on(tp, ref().weights, partition::uniform(spec, P), w.requests, o);
  if (tp.rank() != 0) {
    // Another rank keeps its own Timeline only; the metrics live on rank 0.
    CHECK(rep.requests.empty());
    for (const auto& iv : rep.timeline.intervals()) CHECK(iv.rank == tp.rank());
    return;
  }
  test::check_tokens(w, rep);
  REQUIRE(rep.moves.size() >= 3);
  std::set<std::pair<int, int>> seen;
  for (const auto& m : rep.moves) {
    seen.insert({m.from, m.to});
    CHECK(m.forced);
    CHECK(m.switch_round > m.first_round + 1);  // at least two rounds of parts
  }
  for (int b = 0; b + 1 < P; ++b) CHECK((seen.count({b, b + 1}) || seen.count({b + 1, b})));
  REQUIRE(rep.plans.size() == rep.moves.size() + 1);
  // The gathered Timeline: every rank's F, and the parts each side of a move recorded.
  std::vector<int> f(static_cast<std::size_t>(P), 0);
  std::int64_t sent = 0, received = 0;
  for (const auto& iv : rep.timeline.intervals()) {
    if (iv.op == Op::F) ++f[static_cast<std::size_t>(iv.rank)];
    if (iv.op == Op::Migrate) sent += iv.bytes;
    if (iv.op == Op::MigrateRecv) received += iv.bytes;
  }
  for (int r = 0; r < P; ++r) CHECK(f[static_cast<std::size_t>(r)] > 0);
  CHECK(sent == received);
  CHECK(sent > static_cast<std::int64_t>(rep.moves.size()) * 200000);  // weights at least
  // Every round's seconds of every stage came back to rank 0 with its tokens.
  REQUIRE(rep.measured_rounds.size() == static_cast<std::size_t>(P));
  for (const int n : rep.measured_rounds) CHECK(n == static_cast<int>(rep.round_features.size()));
}

TEST_CASE("mpi.serve: the predictor-driven rebalancer decides on the measurements of every "
          "process and tokens stay run.c's") {
  transport::MpiTransport tp;
  const int P = tp.world_size();
  const model::ModelSpec spec(ref().weights.config);
  const auto w = test::reference_workload(ref(), {0, 0, 0, 0, 0.002, 0.004});
  serve::ServeOptions o;
  o.microbatches = 2;
  o.inference.sampler.temperature = 0.0f;
  o.inference.timeout_s = 60;
  o.inference.migration_part_bytes = 16 << 10;
  // Eager settings: the measured imbalance of the even split (the tail holds the LM head and
  // the sampler) is acted on after a few rounds.
  serve::RebalanceOptions rb;
  rb.warmup = 2;
  rb.patience = 1;
  rb.cooldown = 2;
  rb.threshold = 0.0;
  rb.min_gain = 0.0;
  o.rebalance = rb;
  const auto rep = serve::serve_on(tp, ref().weights, partition::uniform(spec, P), w.requests, o);
  if (tp.rank() != 0) return;
  test::check_tokens(w, rep);
  for (const auto& m : rep.moves) {
    CHECK_FALSE(m.forced);
    CHECK(m.predicted_round_after_s < m.predicted_round_s);
  }
  REQUIRE(rep.measured_rounds.size() == static_cast<std::size_t>(P));
  for (const int n : rep.measured_rounds) CHECK(n == static_cast<int>(rep.round_features.size()));
}
