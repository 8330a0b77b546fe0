// Pipelined generation over in-process threads; stage 0's sequence book.
#include "brigade/engine/inference.hpp"

#include "brigade/backend/cpu.hpp"
#include "brigade/engine/threads.hpp"
#include "brigade/transport/in_process.hpp"

#include <exception>
#include <memory>
#include <thread>

namespace brigade::engine {
inline namespace v0 {
namespace detail {

SequenceBook::SequenceBook(std::span<const GenerationRequest> requests, int seq_len, int groups) {
  const int n = static_cast<int>(requests.size());
  members_.resize(static_cast<std::size_t>(groups));
  for (int i = 0; i < n; ++i) {
    const auto& r = requests[static_cast<std::size_t>(i)];
    BRIGADE_CHECK(!r.prompt.empty(), Errc::InvalidArgument,
                  "generate: request {} has an empty prompt; it must start with BOS", i);
    members_[static_cast<std::size_t>(group_of(i, n, groups))].push_back(i);
    steps_.push_back(effective_steps(r, seq_len));
    SequenceResult res;
    res.tokens = r.prompt;
    res.prompt_tokens = static_cast<int>(r.prompt.size());
    results_.push_back(std::move(res));
  }
  done_.assign(static_cast<std::size_t>(n), false);
}

runtime::Microbatch SequenceBook::prefill(int g) {
  runtime::Microbatch mb;
  mb.id = g;
  for (int seq : members_[static_cast<std::size_t>(g)]) {
    auto& res = results_[static_cast<std::size_t>(seq)];
    const int steps = steps_[static_cast<std::size_t>(seq)];
    if (steps < res.prompt_tokens) {
      // run.c feeds only the first `steps` positions and samples nothing.
      res.tokens.resize(static_cast<std::size_t>(steps) + 1);
      done_[static_cast<std::size_t>(seq)] = true;
      continue;
    }
    mb.seqs.push_back({seq, 0, res.prompt_tokens});
    mb.token_ids.insert(mb.token_ids.end(), res.tokens.begin(), res.tokens.end());
  }
  return mb;
}

runtime::Microbatch SequenceBook::advance(const runtime::Microbatch& mb,
                                          std::span<const std::int32_t> sampled, double now_s) {
  BRIGADE_CHECK(sampled.size() == mb.seqs.size(), Errc::Internal,
                "generate: {} sampled tokens for micro-batch {} of {} sequences", sampled.size(),
                mb.id, mb.seqs.size());
  runtime::Microbatch next;
  next.id = mb.id;
  for (std::size_t i = 0; i < mb.seqs.size(); ++i) {
    const auto& e = mb.seqs[i];
    auto& res = results_[static_cast<std::size_t>(e.seq)];
    const int token = sampled[i];
    if (++res.generated == 1) res.ttft_s = now_s;
    res.done_s = now_s;
    const int fed = e.pos0 + e.tokens;  // positions run so far
    if (token == model::Tokenizer::kBos) {
      res.stopped_on_bos = true;
      done_[static_cast<std::size_t>(e.seq)] = true;
      continue;
    }
    res.tokens.push_back(token);
    if (fed >= steps_[static_cast<std::size_t>(e.seq)]) {
      done_[static_cast<std::size_t>(e.seq)] = true;
      continue;
    }
    next.seqs.push_back({e.seq, fed, 1});
    next.token_ids.push_back(token);
  }
  return next;
}

}  // namespace detail

InferenceReport generate(const model::LlamaWeights& weights, const partition::Partition& partition,
                         std::span<const GenerationRequest> requests,
                         const InferenceOptions& options) {
  const model::ModelSpec spec(weights.config);
  BRIGADE_CHECK(partition.num_layers() == spec.num_layers(), Errc::InvalidArgument,
                "generate: the partition covers {} layers, the model has {}",
                partition.num_layers(), spec.num_layers());
  BRIGADE_CHECK(partition.num_ranks() == partition.num_stages(), Errc::InvalidArgument,
                "generate: {} stages on {} ranks; pipelined generation runs one stage per rank",
                partition.num_stages(), partition.num_ranks());
  BRIGADE_CHECK(!requests.empty(), Errc::InvalidArgument, "generate: no requests");
  BRIGADE_CHECK(options.microbatches >= 0, Errc::InvalidArgument,
                "generate: microbatches = {}, expected >= 0 (0 = automatic)", options.microbatches);
  BRIGADE_CHECK(options.blas_threads >= 1, Errc::InvalidArgument,
                "generate: blas_threads = {}, expected >= 1", options.blas_threads);
  const int S = partition.num_stages();
  const int n = static_cast<int>(requests.size());
  int groups = options.microbatches > 0 ? options.microbatches : std::min(n, S);
  groups = std::min(groups, n);

  cpu::set_blas_threads(options.blas_threads);
  detail::SequenceBook book(requests, weights.config.seq_len, groups);
  const auto capacities = book.capacities();

  transport::InProcessFabric fabric(S);
  std::vector<Timeline> timelines(static_cast<std::size_t>(S), Timeline(S));
  const auto t0 = std::chrono::steady_clock::now();
  detail::run_on_threads(S, fabric, "stage", [&](int s) {
    runtime::InferenceStage stage(weights, partition.stage(s), capacities, options.sampler);
    transport::InProcessTransport tp(fabric, partition.stage(s).rank);
    run_inference_stage(stage, s, partition, groups, tp, s == 0 ? &book : nullptr, t0,
                        options.timeout_s, timelines[static_cast<std::size_t>(s)]);
  });

  InferenceReport report;
  report.timeline = Timeline(S);
  for (const auto& tl : timelines) report.timeline.merge(tl);
  report.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  report.sequences = book.results();
  for (const auto& r : report.sequences) {
    report.generated_tokens += r.generated;
    report.prompt_tokens += r.prompt_tokens;
  }
  return report;
}

}  // namespace v0
}  // namespace brigade::engine
