// Partition: invariants, uniform split, balanced split against brute force.
#include <brigade/partition/partition.hpp>

#include <doctest/doctest.h>

#include <random>

using namespace brigade;
using namespace brigade::partition;

TEST_CASE("partition.invariants: each broken invariant names the stage and the layers") {
  CHECK_NOTHROW(Partition(5, 2, {{0, 0, 2}, {1, 2, 5}}));
  CHECK_THROWS_WITH_AS(Partition(5, 2, {{0, 0, 2}, {1, 3, 5}}),
                       doctest::Contains("stage 1 starts at layer 3, expected layer 2"), Error);
  CHECK_THROWS_WITH_AS(Partition(5, 2, {{0, 0, 2}, {1, 2, 4}}),
                       doctest::Contains("stages end at layer 4, expected 5"), Error);
  CHECK_THROWS_WITH_AS(Partition(5, 2, {{0, 0, 2}, {1, 2, 2}, {1, 2, 5}}),
                       doctest::Contains("stage 1 is empty"), Error);
  CHECK_THROWS_WITH_AS(Partition(5, 2, {{0, 0, 2}, {2, 2, 5}}),
                       doctest::Contains("stage 1 is on rank 2, outside [0, 2)"), Error);
  CHECK_THROWS_WITH_AS(Partition(5, 3, {{0, 0, 2}, {1, 2, 5}}),
                       doctest::Contains("rank 2 holds no stage"), Error);
  CHECK_THROWS_WITH_AS(Partition(5, 1, {}), doctest::Contains("no stages"), Error);
  CHECK_THROWS_AS((void)Partition(5, 2, {{0, 0, 2}, {1, 2, 5}}).stage(2), Error);
  CHECK(Partition(5, 2, {{0, 0, 2}, {1, 2, 5}}).stage_of_layer(3) == 1);
  CHECK(Partition(5, 2, {{0, 0, 2}, {1, 2, 5}}).to_string() == "[0,2)@0 [2,5)@1");
}

TEST_CASE("partition.uniform: decoder layers split evenly, head layers on the last stage") {
  model::LlamaConfig c = model::named_config("260K");  // 5 decoder layers, 9 ModelSpec layers
  const model::ModelSpec spec(c);
  CHECK(uniform(spec, 1).to_string() == "[0,9)@0");
  CHECK(uniform(spec, 2).to_string() == "[0,4)@0 [4,9)@1");  // 3 + 2 decoders
  CHECK(uniform(spec, 3).to_string() == "[0,3)@0 [3,5)@1 [5,9)@2");  // 2 + 2 + 1
  CHECK(uniform(spec, 5).to_string() == "[0,2)@0 [2,3)@1 [3,4)@2 [4,5)@3 [5,9)@4");
  CHECK_THROWS_WITH_AS(uniform(spec, 6), doctest::Contains("6 stages for 5 decoder layers"), Error);
  CHECK_THROWS_AS(uniform(spec, 0), Error);
}

TEST_CASE("partition.balanced: the bottleneck equals brute force over all splits") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.1, 10.0);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 2 + trial % 9;
    const int stages = 1 + trial % n;
    std::vector<double> cost(static_cast<std::size_t>(n));
    for (auto& c : cost) c = u(rng);
    const auto p = balanced(n, stages, cost);
    const auto sc = stage_costs(p, cost);
    const double got = *std::max_element(sc.begin(), sc.end());
    // Brute force: every choice of stages-1 cut points among n-1 gaps.
    double best = 1e300;
    for (unsigned mask = 0; mask < (1u << (n - 1)); ++mask) {
      if (__builtin_popcount(mask) != stages - 1) continue;
      double cur = 0, worst = 0;
      for (int i = 0; i < n; ++i) {
        cur += cost[static_cast<std::size_t>(i)];
        if (i == n - 1 || (mask >> i & 1u)) {
          worst = std::max(worst, cur);
          cur = 0;
        }
      }
      best = std::min(best, worst);
    }
    CHECK(got == doctest::Approx(best).epsilon(1e-12));
    CHECK(p.num_stages() == stages);
  }
}

TEST_CASE("partition.balanced: a heavy tail (LM head + sampler) gets fewer decoder layers") {
  // 42M: vocab 32000 x dim 512 classifier = 16.4M MACs per token, a decoder layer ~3.1M.
  const model::ModelSpec spec(model::named_config("42M"));
  const model::WorkItem work{8, 8, 64.0};
  const auto p = balanced(spec, 2, work);
  const auto u = uniform(spec, 2);
  const auto costs = layer_seconds(spec, work);
  const auto bc = stage_costs(p, costs), uc = stage_costs(u, costs);
  CHECK(p.stage(1).first > u.stage(1).first);  // the tail stage holds fewer decoder layers
  CHECK(std::max(bc[0], bc[1]) < std::max(uc[0], uc[1]));
}

TEST_CASE("partition.balanced: bad costs are rejected") {
  std::vector<double> c{1, 2, -1};
  CHECK_THROWS_WITH_AS(balanced(3, 2, c), doctest::Contains("layer 2 has cost -1"), Error);
  std::vector<double> ok{1, 2, 3};
  CHECK_THROWS_WITH_AS(balanced(3, 4, ok), doctest::Contains("4 stages for 3 layers"), Error);
  CHECK_THROWS_WITH_AS(balanced(4, 2, ok), doctest::Contains("3 layer costs for 4 layers"), Error);
}
