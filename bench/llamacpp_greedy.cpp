// Greedy decoding with llama.cpp's library, printing token ids: the llama.cpp side of
// bench/vs_llamacpp_tokens.sh (not part of brigade's build; the script compiles it against a
// llama.cpp checkout). Usage: llamacpp_greedy MODEL.gguf NEW_TOKENS PROMPT
// Prints two lines: "prompt: ids..." (llama.cpp's tokenization, BOS first) and "generated: ids...".
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "llama.h"

namespace {
void print_ids(const char* label, const std::vector<llama_token>& ids) {
  std::printf("%s:", label);
  for (const llama_token t : ids) std::printf(" %d", t);
  std::printf("\n");
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s MODEL.gguf NEW_TOKENS PROMPT\n", argv[0]);
    return 2;
  }
  const std::string prompt = argv[3];
  const int new_tokens = std::atoi(argv[2]);
  ggml_backend_load_all();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (model == nullptr) {
    std::fprintf(stderr, "cannot load %s\n", argv[1]);
    return 1;
  }
  const llama_vocab* vocab = llama_model_get_vocab(model);
  const int n = -llama_tokenize(vocab, prompt.c_str(), static_cast<int>(prompt.size()), nullptr, 0,
                                /*add_special=*/true, /*parse_special=*/false);
  std::vector<llama_token> ids(static_cast<std::size_t>(n));
  if (llama_tokenize(vocab, prompt.c_str(), static_cast<int>(prompt.size()), ids.data(), n,
                     /*add_special=*/true, /*parse_special=*/false) < 0) {
    std::fprintf(stderr, "tokenization failed\n");
    return 1;
  }
  print_ids("prompt", ids);
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(n + new_tokens);
  cp.n_batch = static_cast<uint32_t>(n);
  cp.n_threads = 1;
  cp.n_threads_batch = 1;
  llama_context* ctx = llama_init_from_model(model, cp);
  llama_sampler* greedy = llama_sampler_init_greedy();
  std::vector<llama_token> out;
  llama_batch batch = llama_batch_get_one(ids.data(), n);
  llama_token next = 0;
  while (static_cast<int>(out.size()) < new_tokens) {
    if (llama_decode(ctx, batch) != 0) {
      std::fprintf(stderr, "llama_decode failed\n");
      return 1;
    }
    next = llama_sampler_sample(greedy, ctx, -1);  // argmax of the last position's logits
    out.push_back(next);
    batch = llama_batch_get_one(&next, 1);
  }
  print_ids("generated", out);
  llama_sampler_free(greedy);
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}
