// libFuzzer target: SafetensorsFile::open on arbitrary bytes; every tensor that opened is read
// at its first and last byte (the reader placed it inside the mapping).
#include "fuzz_util.hpp"

#include <brigade/core/error.hpp>
#include <brigade/model/safetensors.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  brigade::fuzz::MemFile f(data, size);
  try {
    const auto file = brigade::model::SafetensorsFile::open(f.path());
    unsigned sum = 0;
    for (const auto& t : file.tensors())
      if (t.end > t.begin)
        sum += std::to_integer<unsigned>(t.data[0]) +
               std::to_integer<unsigned>(t.data[t.end - t.begin - 1]);
    (void)sum;
  } catch (const brigade::Error&) {
  }
  return 0;
}
