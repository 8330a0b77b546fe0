// libFuzzer target: schedule::parse_schedule on arbitrary text. A schedule that parses must
// print and parse back to itself (to_text / parse_schedule round trip), and every error
// message must stay short (hostile tokens are quoted as excerpts).
#include <brigade/core/error.hpp>
#include <brigade/schedule/action.hpp>

#include <cstdint>
#include <cstdlib>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  brigade::schedule::Schedule s;
  try {
    s = brigade::schedule::parse_schedule(text);
  } catch (const brigade::Error& e) {
    if (std::string_view(e.what()).size() > 1024) std::abort();  // an echoed input
    return 0;
  }
  if (brigade::schedule::parse_schedule(brigade::schedule::to_text(s)) != s) std::abort();
  return 0;
}
