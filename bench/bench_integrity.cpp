// The cost of SENTINEL's integrity checks (docs/integrity.md) on training and decode throughput,
// measured side by side in one run (docs/benchmarks.md, "Integrity checks"):
//
//   BM_IntegrityOverheadTrain/model:K  2-stage 1F1B training, 4 micro-batches per step, over
//       InProcessTransport endpoints (plain) and over VerifyingTransport<FaultInjectingTransport<
//       InProcessTransport>> with the default monitors checking every activation and gradient
//       (log policy, no fault injected); each iteration runs one step of each, in alternating
//       order, after 4 warm-up steps of each (the monitors' warm-up). K = 0: stories260K,
//       micro-batches of one 128-token sequence, 200 iterations; K = 1: the synthetic 42M shape,
//       256 tokens, 6 iterations.
//       Counters: tokens_per_s_plain, tokens_per_s_checked, overhead (checked / plain time - 1).
//   BM_IntegrityOverheadDecode/seqs:S  greedy generation on the 42M shape, 2 stages, S sequences
//       of 48 tokens, plain and checked (activations and returning tokens), alternating.
#include <brigade/engine/inference.hpp>
#include <brigade/engine/training.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/partition/partition.hpp>
#include <brigade/transport/faults.hpp>
#include <brigade/transport/in_process.hpp>
#include <brigade/transport/verify.hpp>

#include <benchmark/benchmark.h>

#include "machine_context.hpp"
#include "workloads.hpp"

#include <deque>
#include <utility>
#include <vector>

using namespace brigade;

namespace {

using transport::MessageKind;
using Injector = transport::FaultInjectingTransport<transport::InProcessTransport>;
using Verifier = transport::VerifyingTransport<Injector>;

const model::LlamaWeights& weights(int which) {
  static const auto small = model::load_llama2c_checkpoint(
      std::filesystem::path(BRIGADE_MODEL_DIR) / "stories260K.bin");
  static const auto big = model::make_synthetic_weights(model::named_config("42M"), 1234);
  return which == 0 ? small : big;
}


/// Each rank's checked stack over `endpoints`: no fault, the default monitors on `kinds`.
struct Checked {
  std::deque<Injector> injectors;
  std::vector<Verifier> verifiers;
  Checked(std::span<transport::InProcessTransport> endpoints, std::vector<MessageKind> kinds,
          std::int64_t token_limit) {
    transport::FaultSpec none;
    none.max_faults = 0;
    transport::SentinelConfig cfg;
    cfg.token_limit = token_limit;
    verifiers.reserve(endpoints.size());
    for (auto& e : endpoints) {
      injectors.emplace_back(e, none);
      verifiers.emplace_back(injectors.back(), cfg, transport::VerifyPolicy::Log, kinds);
    }
  }
  [[nodiscard]] std::int64_t checked() const {
    std::int64_t n = 0;
    for (const auto& v : verifiers) n += v.checked();
    return n;
  }
};

void BM_IntegrityOverheadTrain(benchmark::State& state) {
  const int which = static_cast<int>(state.range(0));
  const auto& w = weights(which);
  engine::TrainingConfig cfg;
  cfg.ranks = 2;
  cfg.microbatches = 4;
  const int len = which == 0 ? 128 : 256;
  cfg.seq_len_hint = len;
  const auto data = bench::random_sequences(cfg.microbatches, len, w.config.vocab_size, 7);
  engine::TrainingEngine plain(w, cfg), checked(w, cfg);
  transport::InProcessFabric f1(2), f2(2);
  auto e1 = transport::endpoints(f1);
  auto e2 = transport::endpoints(f2);
  Checked stack{std::span(e2), {MessageKind::Activation, MessageKind::Gradient}, 0};
  for (auto& v : stack.verifiers) v.expect(transport::row_keys(std::span(std::as_const(data))));
  for (int i = 0; i < 4; ++i) {  // the monitors' warm-up (and the engines')
    plain.train_step(std::span(e1), data);
    checked.train_step(std::span(stack.verifiers), data);
  }
  double tp = 0, tc = 0, tokens = 0;
  bool order = false;
  for (auto _ : state) {
    order = !order;
    for (int k = 0; k < 2; ++k) {
      if ((k == 0) == order) {
        const auto r = plain.train_step(std::span(e1), data);
        tp += r.seconds;
        tokens += static_cast<double>(r.tokens);
      } else {
        tc += checked.train_step(std::span(stack.verifiers), data).seconds;
      }
    }
  }
  state.counters["tokens_per_s_plain"] = tokens / tp;
  state.counters["tokens_per_s_checked"] = tokens / tc;
  state.counters["overhead"] = tc / tp - 1.0;
  state.counters["checked_messages"] = static_cast<double>(stack.checked());
}
// stories260K's steps take milliseconds: more of them, so that the ratio is not noise.
BENCHMARK(BM_IntegrityOverheadTrain)
    ->ArgName("model")->Arg(0)->Unit(benchmark::kSecond)->UseRealTime()->Iterations(200);
BENCHMARK(BM_IntegrityOverheadTrain)
    ->ArgName("model")->Arg(1)->Unit(benchmark::kSecond)->UseRealTime()->Iterations(6);

void BM_IntegrityOverheadDecode(benchmark::State& state) {
  const int seqs = static_cast<int>(state.range(0));
  const auto& w = weights(1);
  std::vector<engine::GenerationRequest> reqs;
  for (int i = 0; i < seqs; ++i) reqs.push_back({{1, 300 + i}, 48});
  engine::InferenceOptions opt;
  opt.sampler.temperature = 0.0f;
  const auto part = partition::uniform(model::ModelSpec(w.config), 2);
  const auto plan = engine::inference_plan(w.config, part, reqs, 0);
  double tp = 0, tc = 0, tokens = 0;
  std::int64_t checked_messages = 0;
  bool order = false;
  for (auto _ : state) {
    order = !order;
    for (int k = 0; k < 2; ++k) {
      transport::InProcessFabric fabric(2);
      auto eps = transport::endpoints(fabric);
      if ((k == 0) == order) {
        const auto r = engine::generate(std::span(eps), w, plan, reqs, opt);
        tp += r.wall_s;
        tokens += static_cast<double>(r.generated_tokens);
      } else {
        Checked stack{std::span(eps), {MessageKind::Activation, MessageKind::Token},
                      w.config.vocab_size};
        tc += engine::generate(std::span(stack.verifiers), w, plan, reqs, opt).wall_s;
        checked_messages += stack.checked();
      }
    }
  }
  state.counters["tokens_per_s_plain"] = tokens / tp;
  state.counters["tokens_per_s_checked"] = tokens / tc;
  state.counters["overhead"] = tc / tp - 1.0;
  state.counters["checked_messages"] =
      static_cast<double>(checked_messages) / static_cast<double>(state.iterations());
}
BENCHMARK(BM_IntegrityOverheadDecode)
    ->ArgName("seqs")->Arg(1)->Arg(8)->Unit(benchmark::kSecond)->UseRealTime()->Iterations(6);

}  // namespace

int main(int argc, char** argv) { return brigade::bench::run_benchmarks(argc, argv); }
