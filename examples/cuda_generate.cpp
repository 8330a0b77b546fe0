// cuda_generate: a llama2.c checkpoint generating on the GPU through brigade's common executor:
// engine::generate with every pipeline stage on its own cuda::CudaBackend
// (runtime::InferenceStage<CudaBackend>, float32), the way a user brings a Backend. With --check
// it replays the reference cases of <data>/reference/stories260K_greedy.json (all of them in
// flight at once) and exits 1 unless every token matches run.c's. Without a usable GPU it exits
// 77 (the tests' "skipped" code).
//
//   cuda_generate --data ../shared/data --check               # stories260K, token-exact
//   cuda_generate --data DIR --prompt "Once upon a time" -n 64 --stages 2
//   cuda_generate --data DIR --prompt "Lily" -t 0.8 --seed 7   # sampled (run.c's sampler)
#include <brigade/backend/cuda.hpp>
#include <brigade/engine/inference.hpp>
#include <brigade/model/text.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>
#include <brigade/partition/partition.hpp>
#include <brigade/transport/in_process.hpp>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

/// Generates `requests` with `stages` pipeline stages (one rank thread each), every stage on its
/// own CudaBackend on device 0.
brigade::engine::InferenceReport generate_on_gpu(
    const brigade::model::LlamaWeights& weights,
    const std::vector<brigade::engine::GenerationRequest>& requests, int stages,
    const brigade::engine::InferenceOptions& options) {
  const brigade::model::ModelSpec spec(weights.config);
  const auto part = brigade::partition::uniform(spec, stages);
  const auto plan = brigade::engine::inference_plan(weights.config, part, requests);
  brigade::transport::InProcessFabric fabric(stages);
  auto ranks = brigade::transport::endpoints(fabric);
  return brigade::engine::generate(std::span(ranks), weights, plan, requests, options,
                                   [](int) { return brigade::cuda::CudaBackend(); });
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Generate text with a llama2.c checkpoint on the GPU (brigade's engine over "
               "cuda::CudaBackend)"};
  std::string data = std::getenv("BRIGADE_DATA_DIR") ? std::getenv("BRIGADE_DATA_DIR") : "";
  std::string model_name = "stories260K.bin", tokenizer_name = "tok512.bin", prompt;
  int steps = 256, stages = 1;
  float temperature = 0.0f, top_p = 0.9f;
  unsigned long long seed = 42;
  bool check = false;
  app.add_option("-d,--data", data, "folder with the checkpoint, tokenizer and reference/")
      ->required(data.empty());
  app.add_option("-m,--model", model_name, "checkpoint file in the data folder");
  app.add_option("-k,--tokenizer", tokenizer_name, "tokenizer file in the data folder");
  app.add_option("-p,--prompt", prompt, "prompt text");
  app.add_option("-n,--steps", steps, "positions to run, prompt included (run.c's -n)");
  app.add_option("--stages", stages, "pipeline stages, each on its own CudaBackend")
      ->check(CLI::PositiveNumber);
  app.add_option("-t,--temperature", temperature, "0 = greedy");
  app.add_option("--top-p", top_p, "nucleus threshold when sampling");
  app.add_option("--seed", seed, "sampler seed");
  app.add_flag("--check", check, "replay reference/stories260K_greedy.json and compare tokens");
  CLI11_PARSE(app, argc, argv);

  try {
    const auto info = brigade::cuda::probe_devices();
    if (!info.available) {
      std::fprintf(stderr, "cuda_generate: no CUDA device: %s\n", info.reason.c_str());
      return 77;  // "skipped", as the cuda tests
    }
    const fs::path dir = data;
    const auto weights = brigade::model::load_llama2c_checkpoint(dir / model_name);
    const auto tok =
        brigade::model::Tokenizer::load_llama2c(dir / tokenizer_name, weights.config.vocab_size);
    std::printf("device %s, model %s (dim %d, %d layers), %d stage(s), float32\n",
                info.name.c_str(), (dir / model_name).string().c_str(), weights.config.dim,
                weights.config.n_layers, stages);
    brigade::engine::InferenceOptions options;
    options.sampler = {temperature, top_p, seed};

    if (check) {
      std::ifstream in(dir / "reference" / "stories260K_greedy.json");
      if (!in) {
        std::fprintf(stderr, "cuda_generate: no reference/stories260K_greedy.json in %s\n",
                     dir.string().c_str());
        return 2;
      }
      const auto ref = nlohmann::json::parse(in);
      std::vector<brigade::engine::GenerationRequest> requests;
      std::vector<std::vector<int>> expected;
      for (const auto& c : ref.at("cases")) {
        const auto prompt_ids = c.at("prompt_ids").get<std::vector<int>>();
        requests.push_back({prompt_ids, c.at("steps").get<int>()});
        expected.push_back(prompt_ids);
        for (int t : c.at("generated_ids").get<std::vector<int>>())
          if (t != brigade::model::Tokenizer::kBos) expected.back().push_back(t);
      }
      options.sampler.temperature = 0.0f;
      const auto report = generate_on_gpu(weights, requests, stages, options);
      int failures = 0;
      std::size_t i = 0;
      for (const auto& c : ref.at("cases")) {
        const auto& got = report.sequences[i].tokens;
        const bool tokens_ok = got == expected[i];
        const bool text_ok =
            brigade::model::render_like_run_c(tok, got) == c.at("stdout").get<std::string>();
        std::printf("case %s: %zu positions; tokens %s, text %s\n",
                    c.at("name").get<std::string>().c_str(), got.size(),
                    tokens_ok ? "EQUAL run.c" : "DIFFER", text_ok ? "EQUAL" : "DIFFERS");
        failures += !(tokens_ok && text_ok);
        ++i;
      }
      std::printf("%.1f tokens/s over %zu sequences\n", report.tokens_per_s(), requests.size());
      std::printf("%s\n", failures == 0 ? "stories260K on the GPU: token-exact with run.c"
                                        : "stories260K on the GPU: MISMATCH");
      return failures == 0 ? 0 : 1;
    }

    const std::vector<brigade::engine::GenerationRequest> requests{
        {tok.encode(prompt, true, false), steps}};
    const auto report = generate_on_gpu(weights, requests, stages, options);
    std::fputs(brigade::model::render_like_run_c(tok, report.sequences[0].tokens).c_str(),
               stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuda_generate: %s\n", e.what());
    return 1;
  }
}
