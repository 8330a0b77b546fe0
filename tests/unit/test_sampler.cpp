// The run.c-compatible sampler: greedy, the xorshift* stream, multinomial and top-p frequencies.
#include "brigade/model/sampler.hpp"

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

using brigade::test::rel;

namespace {

using brigade::Errc;
using brigade::Error;
using brigade::model::Sampler;
using brigade::model::SamplerConfig;

SamplerConfig cfg(float temperature, float top_p, std::uint64_t seed) {
  SamplerConfig c;
  c.temperature = temperature;
  c.top_p = top_p;
  c.seed = seed;
  return c;
}

/// Logits whose softmax (at temperature 1) is `probs`.
std::vector<float> logits_of(const std::vector<double>& probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(static_cast<float>(std::log(p)));
  return l;
}

/// Draws `n` tokens and counts them.
std::vector<int> histogram(Sampler& s, const std::vector<float>& logits, int n) {
  std::vector<int> counts(logits.size(), 0);
  for (int i = 0; i < n; ++i) {
    std::vector<float> l = logits;
    const int tok = s.sample(l);
    REQUIRE(tok >= 0);
    REQUIRE(tok < static_cast<int>(logits.size()));
    ++counts[static_cast<std::size_t>(tok)];
  }
  return counts;
}

/// Checks each count against its binomial expectation within 5 standard deviations.
void check_frequencies(const std::vector<int>& counts, const std::vector<double>& expected,
                       int n) {
  for (std::size_t i = 0; i < counts.size(); ++i) {
    CAPTURE(i);
    const double mean = n * expected[i];
    const double sd = std::sqrt(n * expected[i] * (1.0 - expected[i]));
    CAPTURE(counts[i]);
    CAPTURE(mean);
    if (expected[i] == 0.0) {
      CHECK(counts[i] == 0);
    } else {
      CHECK(std::abs(counts[i] - mean) <= 5.0 * sd + 1.0);
    }
  }
}

}  // namespace

TEST_CASE("sampler.greedy: argmax, ties go to the first index, logits untouched") {
  Sampler s(6, cfg(0.0f, 0.9f, 1));
  std::vector<float> l{0.1f, 2.5f, -1.0f, 2.5f, 0.0f, 2.4f};
  const std::vector<float> before = l;
  CHECK(s.sample(l) == 1);
  CHECK(l == before);
  std::vector<float> m{-3.0f, -2.0f, -1.0f, -0.5f, -7.0f, -0.5f};
  CHECK(s.sample(m) == 3);
  std::vector<float> flat(6, 1.0f);
  CHECK(s.sample(flat) == 0);
  Sampler one(1, cfg(0.0f, 0.9f, 1));
  std::vector<float> single{-100.0f};
  CHECK(one.sample(single) == 0);
}

TEST_CASE("sampler.xorshift: the seed-42 stream is run.c's random_f32") {
  // First four draws for seed 42, worked out with arbitrary-precision integers masked to 64 bits
  // (u32 >> 8 of each): 0x2a -> 0x54000020 -> 0xa80a8001041022 -> ...
  const std::uint32_t hand[4] = {5688906u, 13124075u, 13256299u, 15838407u};
  Sampler s(4, cfg(1.0f, 0.9f, 42));
  for (std::uint32_t h : hand) CHECK(s.random_f32() == static_cast<float>(h) / 16777216.0f);

  // And 10,000 more against the recurrence written out step by step with uint64 arithmetic.
  std::uint64_t state = 42;
  Sampler t(4, cfg(1.0f, 0.9f, 42));
  for (int i = 0; i < 10000; ++i) {
    const std::uint64_t a = state ^ (state >> 12);
    const std::uint64_t b = a ^ (a << 25);
    state = b ^ (b >> 27);
    const std::uint64_t product = state * 0x2545F4914F6CDD1DULL;  // wraps mod 2^64
    const std::uint32_t u32 = static_cast<std::uint32_t>(product >> 32);
    const float expect = static_cast<float>(u32 >> 8) * (1.0f / 16777216.0f);
    const float got = t.random_f32();
    REQUIRE(got == expect);
    REQUIRE(got >= 0.0f);
    REQUIRE(got < 1.0f);
  }
}

TEST_CASE("sampler.seed: same seed same tokens, different seeds differ") {
  const std::vector<float> logits = logits_of({0.1, 0.2, 0.3, 0.15, 0.25});
  auto draw = [&](std::uint64_t seed, float top_p) {
    Sampler s(5, cfg(1.0f, top_p, seed));
    std::vector<int> toks;
    for (int i = 0; i < 64; ++i) {
      std::vector<float> l = logits;
      toks.push_back(s.sample(l));
    }
    return toks;
  };
  for (float top_p : {1.0f, 0.9f}) {
    CAPTURE(top_p);
    CHECK(draw(7, top_p) == draw(7, top_p));
    CHECK(draw(7, top_p) != draw(8, top_p));
  }
  Sampler a(5, cfg(1.0f, 0.9f, 1234)), b(5, cfg(1.0f, 0.9f, 1235));
  int same = 0;
  for (int i = 0; i < 100; ++i) same += a.random_f32() == b.random_f32();
  CHECK(same < 5);
}

TEST_CASE("sampler.temperature: logits become softmax(logits / T)") {
  Sampler s(4, cfg(2.0f, 0.0f, 3));
  std::vector<float> l{1.0f, 2.0f, 3.0f, -1.0f};
  std::vector<double> ref;
  double sum = 0.0;
  for (float x : l) sum += std::exp(x / 2.0);
  for (float x : l) ref.push_back(std::exp(x / 2.0) / sum);
  s.sample(l);
  for (std::size_t i = 0; i < l.size(); ++i) CHECK(l[i] == rel(ref[i], 1e-6));
}

TEST_CASE("sampler.multinomial: top_p outside (0, 1) samples the full distribution") {
  const std::vector<double> probs{0.05, 0.4, 0.02, 0.3, 0.13, 0.1};
  const int n = 20000;
  for (float top_p : {0.0f, 1.0f}) {
    CAPTURE(top_p);
    Sampler s(6, cfg(1.0f, top_p, 2024));
    const auto counts = histogram(s, logits_of(probs), n);
    CHECK(std::accumulate(counts.begin(), counts.end(), 0) == n);
    CHECK(counts[2] > 0);  // even the rarest token is drawn
    check_frequencies(counts, probs, n);
  }
}

TEST_CASE("sampler.top_p: only the nucleus is drawn, with renormalised frequencies") {
  // Vocab 16: tokens 3, 7, 11, 0 hold 0.40, 0.25, 0.15, 0.08; twelve others hold 0.01 each.
  // top_p = 0.75: cutoff (1 - 0.75) / 15 = 0.0167 keeps {3, 7, 11, 0}; sorted cumulative sums are
  // 0.40, 0.65, 0.80 > 0.75, so the nucleus is {3, 7, 11} with probabilities 0.40, 0.25, 0.15
  // renormalised by 0.80: 0.5, 0.3125, 0.1875.
  std::vector<double> probs(16, 0.01);
  probs[3] = 0.40;
  probs[7] = 0.25;
  probs[11] = 0.15;
  probs[0] = 0.08;
  std::vector<double> nucleus(16, 0.0);
  nucleus[3] = 0.5;
  nucleus[7] = 0.3125;
  nucleus[11] = 0.1875;
  const int n = 10000;
  Sampler s(16, cfg(1.0f, 0.75f, 99));
  const auto counts = histogram(s, logits_of(probs), n);
  CHECK(counts[3] + counts[7] + counts[11] == n);  // nothing outside the nucleus, ever
  check_frequencies(counts, nucleus, n);

  SUBCASE("a flat distribution where no token reaches the cutoff still samples") {
    // vocab 2, top_p 0.1: cutoff 0.9 > 0.5; run.c would index out of bounds here.
    Sampler f(2, cfg(1.0f, 0.1f, 5));
    const auto c2 = histogram(f, {0.0f, 0.0f}, 2000);
    CHECK(c2[0] + c2[1] == 2000);
    CHECK(c2[0] > 0);
  }
  SUBCASE("vocab 1 always gives token 0") {
    Sampler f(1, cfg(1.0f, 0.5f, 5));
    std::vector<float> l{3.0f};
    CHECK(f.sample(l) == 0);
  }
}

TEST_CASE("sampler.errors: bad configuration and logits of the wrong size are refused") {
  auto code = [](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      CHECK(std::string(e.what()).find("Sampler") == 0);
      return e.code();
    }
    FAIL("expected brigade::Error");
    return Errc::Internal;
  };
  CHECK(code([] { Sampler(0, cfg(0.0f, 0.9f, 1)); }) == Errc::InvalidArgument);
  CHECK(code([] { Sampler(10, cfg(-0.5f, 0.9f, 1)); }) == Errc::InvalidArgument);
  CHECK(code([] { Sampler(10, cfg(std::nanf(""), 0.9f, 1)); }) == Errc::InvalidArgument);
  CHECK(code([] { Sampler(10, cfg(1.0f, std::nanf(""), 1)); }) == Errc::InvalidArgument);
  CHECK(code([] { Sampler(10, cfg(1.0f, 0.9f, 0)); }) == Errc::InvalidArgument);
  Sampler s(10, cfg(0.0f, 0.9f, 1));
  std::vector<float> l(9, 0.0f);
  CHECK(code([&] { s.sample(l); }) == Errc::InvalidArgument);
  std::vector<float> empty;
  CHECK(code([&] { s.sample(empty); }) == Errc::InvalidArgument);
}
