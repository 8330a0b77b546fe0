// The TP x PP planner (plan/tp_planner.hpp): ring collectives by hand, Llama-3.1 memory
// figures, the pipeline's closed forms, the named errors, the study's trade-off on 8 GPUs, and
// `brigade plan` end to end.
#include <brigade/cost/profile.hpp>
#include <brigade/model/config.hpp>
#include <brigade/plan/tp_planner.hpp>
#include <brigade/plan/tp_svg.hpp>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include "test_util.hpp"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

using brigade::test::rel;

namespace fs = std::filesystem;
using namespace brigade;

namespace {

cost::DeviceProfile h100() { return cost::load_profile(fs::path(BRIGADE_PROFILE_DIR) / "nvidia_h100_sxm.json"); }
cost::DeviceProfile h200() { return cost::load_profile(fs::path(BRIGADE_PROFILE_DIR) / "nvidia_h200_sxm.json"); }
model::LlamaConfig l70() { return model::named_config("llama-3.1-70b"); }
model::LlamaConfig l405() { return model::named_config("llama-3.1-405b"); }

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

bool contains(const std::string& s, const std::string& needle) {
  return s.find(needle) != std::string::npos;
}

}  // namespace

TEST_CASE("tp_planner.ring_collectives: the all-reduce and all-gather costs by hand") {
  const cost::LinkProfile nvlink{"nvlink", 3e-6, 450e9};
  // One token's 70B activation (8192 bf16 values) over 8 GPUs: 3 us, and 2 x 7 / 8 of 16384
  // bytes at 450 GB/s = 63.7 ns.
  CHECK(plan::ring_all_reduce_seconds(16384.0, 8, nvlink) ==
        rel(3e-6 + 14.0 / 8.0 * 16384.0 / 450e9, 1e-12));
  CHECK(plan::ring_all_reduce_seconds(16384.0, 8, nvlink) == rel(3.0637e-6));
  // Two GPUs, 1 MB: one latency and one full buffer (2.22 us).
  CHECK(plan::ring_all_reduce_seconds(1e6, 2, nvlink) == rel(3e-6 + 1e6 / 450e9));
  // 256 sequences of 70B on TP8: 4 MiB, the bandwidth term dominates (16.3 us of 19.3).
  CHECK(plan::ring_all_reduce_seconds(256 * 16384.0, 8, nvlink) == rel(1.9311e-5, 1e-4));
  CHECK(plan::ring_all_reduce_seconds(1e9, 1, nvlink) == 0.0);
  CHECK(plan::ring_all_gather_seconds(8e6, 4, nvlink) == rel(3e-6 + 0.75 * 8e6 / 450e9));
  CHECK(plan::ring_all_gather_seconds(8e6, 1, nvlink) == 0.0);
  CHECK(contains(error_of([&] { (void)plan::ring_all_reduce_seconds(1.0, 0, nvlink); }),
                 "over 0 ranks"));
}

TEST_CASE("tp_planner.llama31_shapes: the published parameter counts and BF16 weights") {
  // Llama 3.1: 70.55 B and 405.85 B parameters; BF16 weights 141.1 GB and 811.7 GB.
  CHECK(l70().num_parameters() == 70553706496LL);
  CHECK(l405().num_parameters() == 405853388800LL);
  const auto m1 = plan::tp_rank_memory(l70(), h100(), {1, 1}, 1, {128, 128});
  CHECK(m1.weight_bytes == doctest::Approx(141.107412992e9));
  // KV cache: 80 layers x 2 x 8 heads x 128 x 2 bytes = 327680 bytes per token; 256 tokens.
  CHECK(m1.kv_bytes == doctest::Approx(327680.0 * 256));
  // TP8: an eighth of every layer's Q, O and MLP, one KV head each, an eighth of the vocabulary.
  const auto m8 = plan::tp_rank_memory(l70(), h100(), {8, 1}, 1, {128, 128});
  const double layer = 2.0 * 8192 * 8192 / 8 + 2.0 * 8192 * 128 + 3.0 * 8192 * 28672 / 8;
  CHECK(m8.weight_bytes ==
        doctest::Approx((80 * (layer + 2 * 8192) + 2.0 * 128256 * 8192 / 8 + 8192) * 2));
  CHECK(m8.weight_bytes / 1e9 == doctest::Approx(17.64).epsilon(0.01));
  CHECK(m8.kv_bytes == doctest::Approx(327680.0 * 256 / 8));
  // 70B fits 8 H100 with TP8 and not one H100.
  CHECK_FALSE(plan::evaluate_tp_pp(l70(), h100(), {1, 1}, 1, {128, 128}).fits);
  CHECK(plan::evaluate_tp_pp(l70(), h100(), {8, 1}, 1, {128, 128}).fits);
  // 405B in BF16 (812 GB) does not fit 8 x 80 GB at any grid; it fits 8 H200 (141 GB each).
  CHECK_FALSE(plan::evaluate_tp_pp(l405(), h100(), {8, 1}, 1, {128, 128}).fits);
  CHECK(plan::evaluate_tp_pp(l405(), h200(), {8, 1}, 1, {128, 128}).fits);
  // PP8: each GPU holds 10 whole layers (the last also the LM head: the most loaded).
  const auto p8 = plan::tp_rank_memory(l70(), h100(), {1, 8}, 1, {128, 128});
  const double full = 2.0 * 8192 * 8192 + 2.0 * 8192 * 1024 + 3.0 * 8192 * 28672;
  CHECK(p8.weight_bytes == doctest::Approx((10 * (full + 2 * 8192) + 128256.0 * 8192 + 8192) * 2));
}

TEST_CASE("tp_planner.pipeline_closed_forms: bubbles, latency and throughput") {
  const plan::ServingWorkload w{128, 128};
  // One micro-batch through 8 stages: one stage works at a time, bubble 1 - 1/8.
  const auto one = plan::evaluate_tp_pp(l70(), h100(), {1, 8}, 1, w);
  CHECK(one.microbatches == 1);
  CHECK(one.decode_bubble == rel(0.875));
  // Four micro-batches in 8 stages: bubble at least 1 - 4/8 (the LM head's stage is slower).
  const auto four = plan::evaluate_tp_pp(l70(), h100(), {1, 8}, 4, w);
  CHECK(four.microbatches == 4);
  CHECK(four.decode_bubble == rel(0.5, 0.01));
  // Eight micro-batches fill the pipeline: only the last stage's extra LM head idles the others.
  const auto full = plan::evaluate_tp_pp(l70(), h100(), {1, 8}, 64, w);
  CHECK(full.microbatches == 8);
  CHECK(full.decode_bubble < 0.1);
  CHECK(full.tp_comm_fraction == 0.0);
  for (const auto& p : {one, four, full}) {
    CHECK(p.latency_s == rel(p.ttft_s + 127 * p.tpot_s));
    CHECK(p.tokens_per_s == doctest::Approx(p.batch * 128 / p.latency_s));
  }
  // TP8 x PP1, batch 1, by hand: 80 layers of (weight stream of the GPU's share at 3.35 TB/s +
  // decode attention on one KV head + element-wise + two all-reduces of 16 KB) + embedding +
  // LM head shard + the logits' all-gather.
  const auto p = h100();
  const cost::LinkProfile nv = p.link("nvlink");
  const double W = 2.0 * 8192 * 8192 / 8 + 2.0 * 8192 * 128 + 3.0 * 8192 * 28672 / 8;
  const double bw = 3.35e12;
  const double layer = W * 2 / bw + p.attention_seconds(1, 1, 128, 192.0) +
                       (6.0 * 8192 + 3.0 * 28672 / 8) * 2 / bw +
                       2 * (3e-6 + 14.0 / 8 * 16384 / 450e9);
  const double head = 128256.0 * 8192 / 8 * 2 / bw;
  const double tpot = 80 * layer + 8192.0 * 2 / bw + head + plan::ring_all_gather_seconds(128256.0 * 2, 8, nv);
  const auto tp8 = plan::evaluate_tp_pp(l70(), p, {8, 1}, 1, w);
  CHECK(tp8.tpot_s == rel(tpot, 1e-9));
  CHECK(tp8.tpot_s * 1e3 == doctest::Approx(5.70).epsilon(0.01));  // ms per token
  CHECK(tp8.decode_bubble == 0.0);
  CHECK(tp8.tp_comm_fraction == rel(80 * 2 * (3e-6 + 14.0 / 8 * 16384 / 450e9) / tpot +
        plan::ring_all_gather_seconds(128256.0 * 2, 8, nv) / tpot, 1e-6));
}

TEST_CASE("tp_planner.named_errors: a grid that does not divide, heads, memory") {
  const auto c = l70();
  CHECK(contains(error_of([&] { plan::check_grid(c, {3, 3}, 8); }),
                 "grid TP 3 x PP 3 = 9 ranks does not match the 8 GPUs"));
  CHECK(contains(error_of([&] { plan::check_grid(c, {3, 1}, 3); }),
                 "TP 3: the model's 64 attention heads are not divisible by the TP degree"));
  model::LlamaConfig odd = model::named_config("42M");  // 8 heads of 64
  odd.n_heads = 24;
  odd.n_kv_heads = 6;
  odd.dim = 24 * 64;
  CHECK(contains(error_of([&] { plan::check_grid(odd, {4, 1}, 4); }),
                 "TP 4: the model's 6 KV heads are neither divisible"));
  CHECK(contains(error_of([&] { plan::check_grid(model::named_config("260K"), {1, 8}, 8); }),
                 "PP 8: more stages than the model's 5 decoder layers"));
  const auto over = plan::evaluate_tp_pp(c, h100(), {1, 1}, 1, {128, 128});
  CHECK(contains(error_of([&] { plan::check_plan_fits(over, h100()); }),
                 "TP1 x PP1, batch 1: one GPU needs 141.2 GB (weights 141.1"));
  CHECK(contains(error_of([&] { plan::check_plan_fits(over, h100()); }),
                 "but NVIDIA H100 SXM holds 85.5 GB"));
  // No grid splits a 7-head model over 8 GPUs except PP8, and it has 5 layers: nothing left.
  model::LlamaConfig seven = model::named_config("260K");
  seven.n_heads = 7;
  seven.n_kv_heads = 7;
  seven.dim = 7 * 8;
  CHECK(contains(error_of([&] { (void)plan::tp_pp_plans(seven, h100(), {16, 16}, {8, 4, "nvlink"}); }),
                 "no TP x PP grid splits the model over 8 GPUs"));
  CHECK(contains(error_of([&] { (void)plan::evaluate_tp_pp(c, h100(), {8, 1}, 1, {16, 16}, "pcie5"); }),
                 "pcie5"));
}

TEST_CASE("tp_planner.study_tradeoff: TP lowest latency, PP highest throughput on 8 GPUs") {
  struct Case {
    model::LlamaConfig config;
    cost::DeviceProfile gpu;
  };
  for (const auto& [config, gpu] : {Case{l70(), h100()}, Case{l70(), h200()}, Case{l405(), h200()}}) {
    CAPTURE(config.dim);
    CAPTURE(gpu.name);
    const auto plans = plan::tp_pp_plans(config, gpu, {128, 128}, {8, 1024, "nvlink"});
    const auto front = plan::pareto_front(plans);
    REQUIRE(front.size() >= 3);
    // The lowest latency is TP8 x PP1; the highest throughput the deepest pipeline that fits.
    CHECK(front.front().grid.tp == 8);
    CHECK(front.back().grid.pp >= 4);
    // Hybrids (neither degree 1... nor 8) on the front, between the two ends.
    bool hybrid = false;
    for (const auto& p : front) hybrid |= p.grid.tp > 1 && p.grid.pp > 1;
    CHECK(hybrid);
    // The front is monotone: latency and throughput both increase along it.
    for (std::size_t i = 1; i < front.size(); ++i) {
      CHECK(front[i].latency_s >= front[i - 1].latency_s);
      CHECK(front[i].tokens_per_s > front[i - 1].tokens_per_s);
    }
    // At batch 1 the latency orders the grids: TP8 < TP4 x PP2 < TP2 x PP4 < TP1 x PP8.
    double last = 0.0;
    for (const auto& p : plans)
      if (p.batch == 1 && p.fits) {
        CHECK(p.latency_s > last);
        last = p.latency_s;
      }
  }
}

TEST_CASE("tp_planner.slo_pick: the highest throughput that meets TTFT and TPOT") {
  const auto plans = plan::tp_pp_plans(l70(), h100(), {128, 128}, {8, 1024, "nvlink"});
  const auto pick = plan::pick_for_slo(plans, 1.0, 0.030);
  REQUIRE(pick.has_value());
  CHECK(pick->ttft_s <= 1.0);
  CHECK(pick->tpot_s <= 0.030);
  for (const auto& p : plans)
    if (p.fits && p.ttft_s <= 1.0 && p.tpot_s <= 0.030) CHECK(p.tokens_per_s <= pick->tokens_per_s);
  // A tighter TPOT than any plan reaches: no pick.
  CHECK_FALSE(plan::pick_for_slo(plans, 10.0, 1e-4).has_value());
  // No SLA at all: the highest-throughput plan, the end of the front.
  const auto any = plan::pick_for_slo(plans, 1e9, 1e9);
  REQUIRE(any.has_value());
  CHECK(any->tokens_per_s == plan::pareto_front(plans).back().tokens_per_s);
  const std::string svg = plan::render_front_svg(plans, plan::pareto_front(plans), pick, "70B");
  CHECK(contains(svg, "<polyline"));
  CHECK(contains(svg, "TP8 x PP1"));
  CHECK(contains(svg, "SLA pick"));
}

namespace {

struct Run {
  int status = -1;
  std::string output;
};

Run brigade_cli(const std::string& args) {
  const auto r = test::run_cli(args);
  return {r.rc, r.out + r.err};
}

bool have_cli() { return std::string(BRIGADE_CLI).size() > 0 && fs::exists(BRIGADE_CLI); }

}  // namespace

TEST_CASE("tp_planner.cli: brigade plan prints the front and the pick, writes SVG and JSON") {
  if (!have_cli()) return;
  const brigade::test::TempDir dir("brigade_test_tp_planner");
  const fs::path svg = dir / "front.svg", json = dir / "plans.json";
  const Run r = brigade_cli("plan --model llama-3.1-70b --gpus 8 --gpu h100 --slo-ttft 1 "
                            "--slo-tpot 0.03 --input-len 128 --output-len 128 --max-batch 1024 "
                            "--svg " + svg.string() + " --json " + json.string());
  CAPTURE(r.output);
  CHECK(r.status == 0);
  CHECK(contains(r.output, "70.6 B parameters, 141.1 GB of bf16 weights"));
  CHECK(contains(r.output, "Pareto front"));
  CHECK(contains(r.output, "pick: TP"));
  REQUIRE(fs::exists(svg));
  REQUIRE(fs::exists(json));
  std::ifstream in(json);
  const auto j = nlohmann::json::parse(in);
  const auto plans = plan::tp_pp_plans(l70(), h100(), {128, 128}, {8, 1024, "nvlink"});
  CHECK(j["plans"].size() == plans.size());
  const auto pick = plan::pick_for_slo(plans, 1.0, 0.03);
  REQUIRE(pick.has_value());
  CHECK(j["pick"]["tp"] == pick->grid.tp);
  CHECK(j["pick"]["batch"] == pick->batch);
  CHECK(j["pick"]["tokens_per_s"].get<double>() == doctest::Approx(pick->tokens_per_s));
  // A JSON config file plans like the named shape.
  const fs::path cfg = dir / "l70.json";
  std::ofstream(cfg) << R"({"dim": 8192, "hidden_dim": 28672, "n_layers": 80, "n_heads": 64,
    "n_kv_heads": 8, "vocab_size": 128256, "seq_len": 131072, "shared_classifier": false})";
  const Run f = brigade_cli("plan --model " + cfg.string() + " --gpu h100 --tp 8 --batch 1");
  CHECK(f.status == 0);
  CHECK(contains(f.output, "141.1 GB of bf16 weights"));
  CHECK(contains(f.output, "1 plans, 0 over memory"));
  // No plan meets the SLA: exit 1 and say so.
  const Run none = brigade_cli("plan --model llama-3.1-70b --gpu h100 --slo-tpot 0.0001");
  CHECK(none.status == 1);
  CHECK(contains(none.output, "no plan meets the SLA"));
}

TEST_CASE("tp_planner.cli_errors: named refusals before anything is planned") {
  if (!have_cli()) return;
  auto refused = [](const std::string& args, const std::string& message) {
    const Run r = brigade_cli("plan " + args);
    CAPTURE(args);
    CAPTURE(r.output);
    CHECK(r.status == 2);
    CHECK(contains(r.output, message));
  };
  refused("--model llama-3.1-70b --tp 3", "--tp 3 does not divide the 8 GPUs");
  refused("--model llama-3.1-70b --tp 4 --pp 4", "grid TP 4 x PP 4 = 16 ranks does not match the 8 GPUs");
  refused("--model llama-3.1-70b --gpus 6 --tp 6",
          "TP 6: the model's 64 attention heads are not divisible by the TP degree");
  refused("--model llama-3.1-70b --tp 1 --pp 1 --gpus 1",
          "TP1 x PP1, batch 1: one GPU needs 141.2 GB");
  refused("--model llama-3.1-405b --gpu h100",
          "no plan of llama-3.1-405b fits 8 x NVIDIA H100 SXM: the smallest");
  refused("--model llama-3.1-70b --batch 4", "--batch needs a grid");
  refused("--model", "--model");
  refused("--gpu h100", "--model is required");
  refused("--model llama-3.1-7b", "llama-3.1-7b");
  refused("--model llama-3.1-70b --gpu a100", "a100");
}
