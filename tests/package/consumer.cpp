// A user of the installed package, as an outside engine would link it: its own Transport
// decorator (bytes per message kind), its own partition policy and its own schedule generator,
// registered by name next to the built-in ones, and its own Backend (CpuBackend's kernels with
// every GEMM counted); stories260K generated through all four must give the reference tokens
// with exactly the GEMMs the model needs, and a training step under the user's generator the
// built-in GPipe's loss.
//   consumer MODEL_DIR STEPS PROMPT_TOKENS EXPECTED_IDS
// EXPECTED_IDS: "1,403,..." the token at every position of run.c's greedy story (the prompt's
// PROMPT_TOKENS first), from models/reference/stories260K_greedy.json.
#include <brigade/backend/backend.hpp>
#include <brigade/backend/cpu_backend.hpp>
#include <brigade/brigade.hpp>
#include <brigade/engine/inference.hpp>
#include <brigade/engine/training.hpp>
#include <brigade/partition/policies.hpp>
#include <brigade/schedule/registry.hpp>
#include <brigade/transport/decorators.hpp>
#include <brigade/transport/in_process.hpp>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace brigade;

/// The user's decorator: counts payload bytes per message kind, forwards everything else.
template <transport::Transport Inner>
class KindBytes : public transport::ForwardingTransport<Inner> {
 public:
  explicit KindBytes(Inner& inner) : transport::ForwardingTransport<Inner>(inner) {}
  transport::Request isend(int peer, int tag, const transport::MessageHeader& h,
                           transport::ConstBytes payload) {
    bytes[static_cast<std::size_t>(h.kind)] += static_cast<long long>(payload.size());
    return this->inner_->isend(peer, tag, h, payload);
  }
  std::array<long long, transport::kNumMessageKinds> bytes{};
};

/// The user's Backend: CpuBackend's kernels, each matmul_wt (one GEMM: a projection or the
/// classifier) counted in a counter the stages share (they run on several rank threads).
class CountingBackend : public cpu::CpuBackend {
 public:
  explicit CountingBackend(std::atomic<long long>* gemms) : gemms_(gemms) {}
  void matmul_wt(const float* x, model::WeightMatrix w, float* out, std::int64_t tokens,
                 std::int64_t in, std::int64_t out_dim, bool accumulate) const {
    gemms_->fetch_add(1, std::memory_order_relaxed);
    cpu::CpuBackend::matmul_wt(x, w, out, tokens, in, out_dim, accumulate);
  }

 private:
  std::atomic<long long>* gemms_;
};
static_assert(backend::Backend<CountingBackend>);

/// The user's partition policy: every stage but the last takes two layers; the last the rest.
partition::Partition two_each(const model::ModelSpec& spec, const partition::PolicyRequest& req) {
  std::vector<partition::StageRange> st;
  const int n = req.num_stages();
  for (int v = 0; v < n; ++v) {
    const int first = 2 * v, last = v + 1 == n ? spec.num_layers() : 2 * v + 2;
    st.push_back({req.placement[static_cast<std::size_t>(v)], first, last});
  }
  return partition::Partition(spec.num_layers(), req.num_ranks, std::move(st));
}

/// The user's schedule generator: GPipe with the backwards in reverse micro-batch order (each
/// rank drains its last forward first), a compute-only Schedule the library lowers.
schedule::Schedule gpipe_reversed(const schedule::Params& p) {
  using schedule::Op;
  auto s = schedule::empty_schedule(schedule::Shape::make(p.ranks, p.microbatches));
  for (int r = 0; r < p.ranks; ++r) {
    auto& prog = s.ranks[static_cast<std::size_t>(r)];
    for (int m = 0; m < p.microbatches; ++m) prog.push_back({Op::F, r, m, 0});
    for (int m = p.microbatches - 1; m >= 0; --m) prog.push_back({Op::B, r, m, 0});
  }
  return s;
}

std::vector<int> parse_ids(const std::string& text) {
  std::vector<int> ids;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) ids.push_back(std::stoi(item));
  return ids;
}

int fail(const char* what) {
  std::fprintf(stderr, "consumer: %s\n", what);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) return fail("usage: consumer MODEL_DIR STEPS PROMPT_TOKENS EXPECTED_IDS");
  const std::string dir = argv[1];
  const int steps = std::atoi(argv[2]), prompt_tokens = std::atoi(argv[3]);
  const auto expected = parse_ids(argv[4]);
  if (steps < 1 || prompt_tokens < 1 || expected.size() < 41) return fail("bad arguments");
  try {
    partition::register_policy({"two-each", "two layers per stage, the rest on the last", &two_each});
    schedule::register_generator(
        {"gpipe-reversed", "GPipe with the backwards in reverse order", &gpipe_reversed, false});

    // Generation: 3 ranks over the user's decorator, split by the user's policy.
    const auto weights = model::load_llama2c_checkpoint(dir + "/stories260K.bin");
    const model::ModelSpec spec(weights.config);
    partition::PolicyRequest req;
    req.placement = {0, 1, 2};
    req.num_ranks = 3;
    const auto part = partition::make_partition(spec, "two-each", req);
    const std::vector<int> prompt(expected.begin(), expected.begin() + prompt_tokens);
    const std::vector<engine::GenerationRequest> requests{{prompt, steps}};
    engine::InferenceOptions opt;
    opt.sampler.temperature = 0.0f;
    transport::InProcessFabric fabric(3);
    auto endpoints = transport::endpoints(fabric);
    std::vector<KindBytes<transport::InProcessTransport>> counted;
    for (auto& e : endpoints) counted.emplace_back(e);
    const auto plan = engine::inference_plan(weights.config, part, requests, 1);
    std::atomic<long long> gemms{0};
    const auto report = engine::generate(std::span(counted), weights, plan, requests, opt,
                                         [&](int) { return CountingBackend(&gemms); });
    const auto& seq = report.sequences.at(0);
    if (seq.tokens != expected) return fail("tokens differ from the reference");
    // One forward per sampled token (the prompt's prefill, then one per decode step), each
    // through every layer: 7 GEMMs per decoder layer (wq, wk, wv, wo, w1, w3, w2) and the
    // classifier's.
    const long long forwards =
        static_cast<long long>(expected.size()) - prompt_tokens + (seq.stopped_on_bos ? 1 : 0);
    const long long per_forward = 7LL * weights.config.n_layers + 1;
    if (seq.generated != forwards || gemms.load() != forwards * per_forward) {
      std::fprintf(stderr, "consumer: %lld GEMMs for %d sampled tokens; expected %lld x %lld\n",
                   gemms.load(), seq.generated, forwards, per_forward);
      return 1;
    }
    const auto act = static_cast<std::size_t>(transport::MessageKind::Activation);
    if (counted[0].bytes[act] == 0 || counted[1].bytes[act] == 0 || counted[2].bytes[act] != 0)
      return fail("activation bytes not counted on ranks 0 and 1 only");

    // Training: one step of the user's generator equals the built-in GPipe (same loss bits).
    std::vector<data::PackedBatch> batches(4);
    for (int m = 0; m < 4; ++m) {
      auto& b = batches[static_cast<std::size_t>(m)];
      b.offsets.push_back(0);
      for (int t = 0; t < 16; ++t) {
        b.inputs.push_back(expected[static_cast<std::size_t>((m * 7 + t) % 40)]);
        b.targets.push_back(expected[static_cast<std::size_t>((m * 7 + t + 1) % 40)]);
      }
      b.offsets.push_back(b.rows());
      b.tasks.push_back(0);
      b.task_offsets = {0, b.rows()};
    }
    double loss[2] = {0, 0};
    const char* names[2] = {"gpipe", "gpipe-reversed"};
    for (int i = 0; i < 2; ++i) {
      engine::TrainingConfig cfg;
      cfg.schedule = names[i];
      cfg.partition = "two-each";
      cfg.ranks = 2;
      cfg.microbatches = 4;
      engine::TrainingEngine eng(weights, cfg);
      loss[i] = eng.compute_gradients(batches).loss;
    }
    if (!(loss[0] > 0) || loss[0] != loss[1]) return fail("training losses differ");
    std::printf("brigade ok %s: %zu tokens, %lld GEMMs on the user's backend, activation bytes "
                "%lld and %lld, loss %.6f\n",
                BRIGADE_VERSION_STRING, report.sequences[0].tokens.size(), gemms.load(),
                counted[0].bytes[act], counted[1].bytes[act], loss[0]);
  } catch (const Error& e) {
    std::fprintf(stderr, "consumer: brigade::Error: %s\n", e.what());
    return 1;
  }
  return 0;
}
