// Writes a synthetic Llama of a named size (model::make_synthetic_weights, with its synthetic
// tokenizer) as a GGUF v3 file with its matrices in DTYPE (f16 by default; llama.cpp's layouts,
// norm gains f32), for bench/ring_offload.sh's real run of the mmap weight offload: a model
// file far larger than the processes' RAM budgets.
//   ring_offload_model SIZE OUT.gguf [DTYPE [SEED]]   (DTYPE: f32, f16, bf16, q8_0)
#include <brigade/core/dtype.hpp>
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
  if (argc < 3 || argc > 5) {
    fmt::print(stderr, "usage: {} SIZE OUT.gguf [DTYPE [SEED]]  (SIZE: 260K, 15M, 42M, 110M, 1.1B; "
               "DTYPE: f32, f16, bf16, q8_0; default f16)\n", argv[0]);
    return 2;
  }
  try {
    const std::string name = argc >= 4 ? argv[3] : "f16";
    const auto dtype = parse_dtype(name);
    BRIGADE_CHECK(dtype && model::is_weight_dtype(*dtype), Errc::InvalidArgument,
                  "DTYPE {}: expected f32, f16, bf16 or q8_0", name);
    const std::uint64_t seed = argc == 5 ? std::stoull(argv[4]) : 1234;
    const auto w = model::convert_weights(
        model::make_synthetic_weights(model::named_config(argv[1]), seed), *dtype);
    const auto tok = model::Tokenizer::synthetic(w.config.vocab_size, seed);
    model::save_gguf_llama(argv[2], w, tok);
    fmt::print(stderr, "wrote {} (synthetic {}, seed {}, {:.2f} GB of {} weights)\n", argv[2],
               argv[1], seed, static_cast<double>(model::weight_bytes(w)) / 1e9, name);
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
