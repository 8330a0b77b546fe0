// libFuzzer target: load_llama2c_checkpoint on arbitrary bytes. Half the inputs are used raw;
// the other half keep their 28-byte header and have the body cut or zero-padded to the exact
// size that header implies (when under 1 MiB), so the fuzzer reaches the tensor binding and
// the non-finite weight scan instead of stopping at the size check.
#include "fuzz_util.hpp"

#include <brigade/core/error.hpp>
#include <brigade/model/weights.hpp>

#include <cstring>
#include <vector>

namespace {

/// The file size a llama2.c header implies (0 when invalid or over 1 MiB); mirrors docs/formats.md.
std::uint64_t implied_bytes(const std::int32_t* h) {
  for (int i = 0; i < 7; ++i)
    if (i != 5 && (h[i] <= 0 || h[i] > 4096)) return 0;
  if (h[5] == 0 || h[5] < -4096 || h[5] > 4096) return 0;
  const std::uint64_t d = static_cast<std::uint64_t>(h[0]), hid = static_cast<std::uint64_t>(h[1]),
                      n = static_cast<std::uint64_t>(h[2]), nh = static_cast<std::uint64_t>(h[3]),
                      nkv = static_cast<std::uint64_t>(h[4]),
                      v = static_cast<std::uint64_t>(h[5] < 0 ? -h[5] : h[5]),
                      s = static_cast<std::uint64_t>(h[6]);
  if (d % nh != 0 || nh % nkv != 0 || (d / nh) % 2 != 0) return 0;
  const std::uint64_t kvd = d / nh * nkv, hs = d / nh;
  std::uint64_t floats = v * d + n * (2 * d + 2 * d * d + 2 * kvd * d + 3 * hid * d) + d + s * hs;
  if (h[5] < 0) floats += v * d;
  const std::uint64_t bytes = 28 + 4 * floats;
  return bytes <= (1u << 20) ? bytes : 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const bool fit = (data[0] & 1) != 0;
  std::vector<std::uint8_t> bytes(data + 1, data + size);
  if (fit && bytes.size() >= 28) {
    std::int32_t h[7];
    std::memcpy(h, bytes.data(), sizeof h);
    if (const std::uint64_t want = implied_bytes(h)) bytes.resize(want, 0);
  }
  brigade::fuzz::MemFile f(bytes.data(), bytes.size());
  try {
    const auto w = brigade::model::load_llama2c_checkpoint(f.path());
    // Touch what the loader bound: the first and last float of every tensor pointer.
    volatile float sink =
        w.token_embedding.f32()[0] + w.rms_final[w.config.dim - 1] +
        w.wcls.f32()[static_cast<std::size_t>(w.config.vocab_size) * w.config.dim - 1];
    for (const auto& l : w.layers) sink = sink + l.w2.f32()[0] + l.w3.f32()[0];
    (void)sink;
  } catch (const brigade::Error&) {
  }
  (void)brigade::model::is_llama2c_checkpoint(f.path());
  return 0;
}
