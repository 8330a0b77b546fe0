// cuda_generate: a llama2.c checkpoint generating on one GPU with brigade::cuda, the way a user
// would call the library. With --check it replays the reference cases of
// <data>/reference/stories260K_greedy.json and exits 1 unless every token matches run.c's.
// Without a usable GPU it exits 77 (the tests' "skipped" code).
//
//   cuda_generate --data ../shared/data --check              # stories260K, f32, token-exact
//   cuda_generate --data DIR --prompt "Once upon a time" -n 64 --dtype bf16
//   cuda_generate --data DIR --prompt "Lily" -t 0.8 --seed 7  # sampled (host sampler, run.c's)
#include <brigade/backend/cuda.hpp>
#include <brigade/model/sampler.hpp>
#include <brigade/model/text.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using brigade::cuda::CudaLlama;
using brigade::DType;

namespace {

/// run.c's generation loop with a host sampler (used when temperature > 0).
std::vector<int> generate_sampled(CudaLlama& model, const std::vector<int>& prompt, int steps,
                                  brigade::model::Sampler& sampler) {
  std::vector<int> all = prompt;
  std::vector<int> ids = prompt;
  CudaLlama::Step step{0, 0, static_cast<int>(prompt.size())};
  for (int pos = static_cast<int>(prompt.size()) - 1; pos < steps; ++pos) {
    auto logits = model.forward({&step, 1}, ids);
    const int next = sampler.sample(logits);
    if (next == brigade::model::Tokenizer::kBos) break;
    all.push_back(next);
    step = CudaLlama::Step{0, pos + 1, 1};
    ids.assign(1, next);
  }
  return all;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Generate text with a llama2.c checkpoint on one GPU (brigade::cuda)"};
  std::string data = std::getenv("BRIGADE_DATA_DIR") ? std::getenv("BRIGADE_DATA_DIR") : "";
  std::string model_name = "stories260K.bin", tokenizer_name = "tok512.bin", prompt, dtype = "f32";
  int steps = 256;
  float temperature = 0.0f, top_p = 0.9f;
  unsigned long long seed = 42;
  bool check = false;
  app.add_option("-d,--data", data, "folder with the checkpoint, tokenizer and reference/")
      ->required(data.empty());
  app.add_option("-m,--model", model_name, "checkpoint file in the data folder");
  app.add_option("-k,--tokenizer", tokenizer_name, "tokenizer file in the data folder");
  app.add_option("-p,--prompt", prompt, "prompt text");
  app.add_option("-n,--steps", steps, "positions to run, prompt included (run.c's -n)");
  app.add_option("--dtype", dtype, "f32 or bf16")->check(CLI::IsMember({"f32", "bf16"}));
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
    brigade::cuda::CudaBackend gpu;
    const std::vector<int> caps = {weights.config.seq_len};
    CudaLlama model(gpu, weights, dtype == "bf16" ? DType::BF16 : DType::F32, caps);
    std::printf("device %s, model %s (dim %d, %d layers), dtype %s\n", info.name.c_str(),
                (dir / model_name).string().c_str(), weights.config.dim, weights.config.n_layers,
                dtype.c_str());

    if (check) {
      std::ifstream in(dir / "reference" / "stories260K_greedy.json");
      if (!in) {
        std::fprintf(stderr, "cuda_generate: no reference/stories260K_greedy.json in %s\n",
                     dir.string().c_str());
        return 2;
      }
      const auto ref = nlohmann::json::parse(in);
      int failures = 0;
      for (const auto& c : ref.at("cases")) {
        const auto prompt_ids = c.at("prompt_ids").get<std::vector<int>>();
        std::vector<int> expected = prompt_ids;
        for (int t : c.at("generated_ids").get<std::vector<int>>())
          if (t != brigade::model::Tokenizer::kBos) expected.push_back(t);
        const auto t0 = std::chrono::steady_clock::now();
        const auto got = model.generate_greedy(prompt_ids, c.at("steps").get<int>());
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const bool tokens_ok = got == expected;
        const bool text_ok =
            brigade::model::render_like_run_c(tok, got) == c.at("stdout").get<std::string>();
        std::size_t same = 0;
        while (same < std::min(got.size(), expected.size()) && got[same] == expected[same]) ++same;
        std::printf(
            "case %s: %zu positions, %.1f tokens/s; tokens %s (first %zu of %zu agree), "
            "text %s\n",
            c.at("name").get<std::string>().c_str(), got.size(),
            static_cast<double>(got.size() - prompt_ids.size()) / s,
            tokens_ok ? "EQUAL run.c" : "DIFFER", same, expected.size(),
            text_ok ? "EQUAL" : "DIFFERS");
        failures += !(tokens_ok && text_ok);
      }
      std::printf("%s\n", failures == 0 ? "stories260K on the GPU: token-exact with run.c"
                                        : "stories260K on the GPU: MISMATCH");
      return failures == 0 ? 0 : 1;
    }

    const auto prompt_ids = tok.encode(prompt, true, false);
    std::vector<int> out;
    if (temperature > 0.0f) {
      brigade::model::Sampler sampler(weights.config.vocab_size, {temperature, top_p, seed});
      out = generate_sampled(model, prompt_ids, steps, sampler);
    } else {
      out = model.generate_greedy(prompt_ids, steps);
    }
    std::fputs(brigade::model::render_like_run_c(tok, out).c_str(), stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuda_generate: %s\n", e.what());
    return 1;
  }
}
