// Writes a synthetic Llama of a named size (model::make_synthetic_weights, with its synthetic
// tokenizer) as a GGUF v3 file, for bench/ring_offload.sh's real run of the mmap weight offload:
// a model file far larger than the processes' RAM budgets.
//   ring_offload_model SIZE OUT.gguf [SEED]
#include <brigade/model/config.hpp>
#include <brigade/model/gguf.hpp>
#include <brigade/model/tokenizer.hpp>
#include <brigade/model/weights.hpp>

#include <fmt/format.h>

#include <cstdio>
#include <exception>
#include <string>

int main(int argc, char** argv) {
  using namespace brigade;
  if (argc < 3 || argc > 4) {
    fmt::print(stderr, "usage: {} SIZE OUT.gguf [SEED]  (SIZE: 260K, 15M, 42M, 110M, 1.1B)\n", argv[0]);
    return 2;
  }
  try {
    const std::uint64_t seed = argc == 4 ? std::stoull(argv[3]) : 1234;
    const auto w = model::make_synthetic_weights(model::named_config(argv[1]), seed);
    const auto tok = model::Tokenizer::synthetic(w.config.vocab_size, seed);
    model::save_gguf_llama(argv[2], w, tok);
    fmt::print(stderr, "wrote {} (synthetic {}, seed {}, {:.2f} GB of f32 weights)\n", argv[2],
               argv[1], seed, static_cast<double>(model::weight_bytes(w)) / 1e9);
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
