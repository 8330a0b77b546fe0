// The serving workload over run.c's greedy reference that the serving tests share (threads in
// tests/model/test_serve.cpp, MPI processes in tests/mpi/test_mpi_serve.cpp).
#pragma once

#include "test_util.hpp"

#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/serve/serving.hpp>

#include <doctest/doctest.h>

#include <filesystem>
#include <vector>

namespace brigade::test {

/// stories260K and run.c's token ids at every position of its two greedy cases.
struct ServeReference {
  model::LlamaWeights weights;
  std::vector<int> once_prompt, once_all, empty_all;
  /// @param models the committed models/ (stories260K.bin, reference/)
  explicit ServeReference(const std::filesystem::path& models)
      : weights(model::load_llama2c_checkpoint(models / "stories260K.bin")) {
    for (const auto& c : greedy_reference(models).cases) {
      if (c.name == "once_upon_64") {
        once_prompt = c.prompt_ids;
        once_all = c.tokens();
      } else {
        empty_all = c.tokens();
      }
    }
  }
};

/// Requests over run.c's two cases with fewer steps too (greedy: a shorter run is a prefix),
/// and the tokens run.c gives each: prompt, then steps - prompt + 1 generated ids.
struct ServeWorkload {
  std::vector<serve::ServeRequest> requests;
  std::vector<std::vector<int>> expected;
};

/// One request per arrival time (seconds), alternating "Once upon a time" (64, 30, 12 steps) and
/// the empty prompt (256, 90, 40 steps).
inline ServeWorkload reference_workload(const ServeReference& ref,
                                        const std::vector<double>& arrivals) {
  const int once_steps[] = {64, 30, 12};
  const int empty_steps[] = {256, 90, 40};
  ServeWorkload w;
  for (std::size_t i = 0; i < arrivals.size(); ++i) {
    const bool once = i % 2 == 0;
    const int steps = once ? once_steps[(i / 2) % 3] : empty_steps[(i / 2) % 3];
    serve::ServeRequest r;
    r.arrival_s = arrivals[i];
    r.prompt = once ? ref.once_prompt : std::vector<int>{model::Tokenizer::kBos};
    r.max_new_tokens = steps - static_cast<int>(r.prompt.size()) + 1;
    const auto& all = once ? ref.once_all : ref.empty_all;
    w.expected.emplace_back(all.begin(), all.begin() + steps + 1);
    w.requests.push_back(std::move(r));
  }
  return w;
}

/// Every request of `rep` has run.c's tokens and consistent times.
inline void check_tokens(const ServeWorkload& w, const serve::ServeReport& rep) {
  REQUIRE(rep.requests.size() == w.requests.size());
  for (std::size_t i = 0; i < w.requests.size(); ++i) {
    INFO("request " << i);
    const auto& m = rep.requests[i];
    CHECK(m.tokens == w.expected[i]);
    CHECK(m.generated == w.requests[i].max_new_tokens);
    CHECK(m.first_token_s >= m.arrival_s);
    CHECK(m.admitted_s >= m.arrival_s);
    CHECK(m.done_s >= m.first_token_s);
    CHECK(m.ttft_s() >= 0);
    CHECK(m.e2e_s() >= m.ttft_s());
  }
}

}  // namespace brigade::test
