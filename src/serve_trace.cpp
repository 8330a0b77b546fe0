// Serving traces: Azure LLM inference (CSV) and Mooncake (JSON Lines) readers, and requests
// for a model from a trace.
#include "brigade/serve/trace.hpp"

#include "brigade/io/input.hpp"
#include "brigade/model/tokenizer.hpp"

#include <nlohmann/json.hpp>

#include <charconv>
#include <cmath>
#include <random>
#include <string>

namespace brigade::serve {
inline namespace v0 {
namespace {

[[noreturn]] void bad_line(std::string_view name, int line, std::string_view text,
                           std::string_view why) {
  ::brigade::detail::fail(Errc::BadFile, "trace {} line {}: {} (the line reads \"{}\")", name,
                          line, why, ::brigade::detail::excerpt(text, 80));
}

// A whole number in [0, 2^31) or nothing.
bool whole(std::string_view s, int& out) {
  long long v = 0;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || v < 0 || v > 0x7fffffff) return false;
  out = static_cast<int>(v);
  return true;
}

// Days from 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's days_from_civil).
std::int64_t days_from_civil(std::int64_t y, unsigned m, unsigned d) {
  y -= m <= 2;
  const std::int64_t era = (y >= 0 ? y : y - 399) / 400;
  const auto yoe = static_cast<unsigned>(y - era * 400);
  const unsigned doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
  const unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + static_cast<std::int64_t>(doe) - 719468;
}

// "YYYY-MM-DD HH:MM:SS[.fraction]" as whole seconds since 1970 and the fraction, or false.
bool timestamp(std::string_view s, std::int64_t& secs, double& frac) {
  int y = 0, mo = 0, d = 0, h = 0, mi = 0, se = 0;
  if (s.size() < 19 || s[4] != '-' || s[7] != '-' || s[10] != ' ' || s[13] != ':' ||
      s[16] != ':')
    return false;
  if (!whole(s.substr(0, 4), y) || !whole(s.substr(5, 2), mo) || !whole(s.substr(8, 2), d) ||
      !whole(s.substr(11, 2), h) || !whole(s.substr(14, 2), mi) || !whole(s.substr(17, 2), se))
    return false;
  if (mo < 1 || mo > 12 || d < 1 || d > 31 || h > 23 || mi > 59 || se > 60) return false;
  frac = 0.0;
  if (s.size() > 19) {
    if (s[19] != '.' || s.size() == 20) return false;
    double scale = 0.1;
    for (char ch : s.substr(20)) {
      if (ch < '0' || ch > '9') return false;
      frac += (ch - '0') * scale;
      scale /= 10;
    }
  }
  secs = days_from_civil(y, static_cast<unsigned>(mo), static_cast<unsigned>(d)) * 86400 +
         h * 3600 + mi * 60 + se;
  return true;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.back() == '\r' || s.back() == ' ')) s.remove_suffix(1);
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  return s;
}

}  // namespace

std::vector<TraceRequest> parse_trace(std::string_view text, std::string_view name) {
  std::vector<TraceRequest> out;
  std::size_t pos = 0;
  int line = 0;
  enum class Format { Unknown, Azure, Mooncake } format = Format::Unknown;
  // Arrivals relative to the first request: whole seconds and fractions apart, so that 2023's
  // epoch seconds do not cost the fraction its digits.
  std::int64_t first_secs = 0;
  double first_frac = 0.0, prev = -1e300;
  while (pos < text.size()) {
    const std::size_t nl = text.find('\n', pos);
    const std::string_view raw =
        text.substr(pos, nl == std::string_view::npos ? std::string_view::npos : nl - pos);
    pos = nl == std::string_view::npos ? text.size() : nl + 1;
    ++line;
    const std::string_view l = trim(raw);
    if (format == Format::Unknown) {
      if (l == "TIMESTAMP,ContextTokens,GeneratedTokens") {
        format = Format::Azure;
        continue;
      }
      if (!l.empty() && l.front() == '{') {
        format = Format::Mooncake;
      } else {
        ::brigade::detail::fail(
            Errc::BadFile,
            "trace {}: line 1 reads \"{}\"; expected the Azure header "
            "TIMESTAMP,ContextTokens,GeneratedTokens or a Mooncake JSON object per line",
            name, ::brigade::detail::excerpt(l, 80));
      }
    }
    if (l.empty()) continue;
    TraceRequest r;
    r.line = line;
    std::int64_t secs = 0;
    double frac = 0.0;
    if (format == Format::Azure) {
      const std::size_t c1 = l.find(','), c2 = c1 == std::string_view::npos ? c1 : l.find(',', c1 + 1);
      if (c2 == std::string_view::npos || l.find(',', c2 + 1) != std::string_view::npos)
        bad_line(name, line, l, "expected 3 comma-separated fields");
      if (!timestamp(l.substr(0, c1), secs, frac))
        bad_line(name, line, l, "TIMESTAMP is not YYYY-MM-DD HH:MM:SS[.fraction]");
      if (!whole(l.substr(c1 + 1, c2 - c1 - 1), r.prompt_tokens))
        bad_line(name, line, l, "ContextTokens is not a whole number");
      if (!whole(l.substr(c2 + 1), r.output_tokens))
        bad_line(name, line, l, "GeneratedTokens is not a whole number");
    } else {
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(l);
      } catch (const nlohmann::json::exception&) {
        bad_line(name, line, l, "not a JSON object");
      }
      auto field = [&](const char* key, double& v) {
        if (!j.is_object() || !j.contains(key) || !j[key].is_number())
          bad_line(name, line, l, fmt::format("no number field \"{}\"", key));
        v = j[key].get<double>();
      };
      double ts = 0, in = 0, outl = 0;
      field("timestamp", ts);
      field("input_length", in);
      field("output_length", outl);
      auto as_int = [&](double v, int& o, const char* key) {
        if (!(v >= 0 && v < 2147483648.0) || v != std::floor(v))
          bad_line(name, line, l, fmt::format("\"{}\" is not a whole number", key));
        o = static_cast<int>(v);
      };
      as_int(in, r.prompt_tokens, "input_length");
      as_int(outl, r.output_tokens, "output_length");
      if (!(std::abs(ts) < 1e15))
        bad_line(name, line, l, "\"timestamp\" is not a number of ms below 1e15");
      secs = static_cast<std::int64_t>(std::floor(ts / 1000.0));
      frac = ts / 1000.0 - static_cast<double>(secs);
    }
    if (r.prompt_tokens < 1 || r.output_tokens < 1)
      bad_line(name, line, l, "prompt and output lengths must be at least 1 token");
    if (out.empty()) {
      first_secs = secs;
      first_frac = frac;
    }
    const double t = static_cast<double>(secs - first_secs) + (frac - first_frac);
    if (t < prev) bad_line(name, line, l, "the timestamp is earlier than the line before");
    prev = t;
    r.arrival_s = t;
    out.push_back(r);
  }
  BRIGADE_CHECK(!out.empty(), Errc::BadFile, "trace {}: no requests", name);
  return out;
}

std::vector<TraceRequest> read_trace(const std::filesystem::path& path) {
  const std::string text = io::read_input_file(path, "trace file", kMaxTraceFileBytes);
  return parse_trace(text, path.string());
}

std::vector<ServeRequest> trace_requests(std::span<const TraceRequest> trace,
                                         const model::LlamaConfig& config,
                                         const TraceReplay& replay) {
  auto positive = [](double x) { return std::isfinite(x) && x > 0; };
  BRIGADE_CHECK(positive(replay.rate_scale) && positive(replay.prompt_scale) &&
                    positive(replay.output_scale) && replay.max_requests >= 0,
                Errc::InvalidArgument,
                "trace replay: rate_scale {}, prompt_scale {} and output_scale {} must be finite "
                "and > 0, max_requests {} >= 0",
                replay.rate_scale, replay.prompt_scale, replay.output_scale, replay.max_requests);
  const std::size_t n = replay.max_requests > 0
                            ? std::min(trace.size(), static_cast<std::size_t>(replay.max_requests))
                            : trace.size();
  std::mt19937_64 rng(replay.seed);
  std::uniform_int_distribution<int> id(3, std::max(3, config.vocab_size - 1));
  std::vector<ServeRequest> out;
  for (std::size_t i = 0; i < n; ++i) {
    const auto& t = trace[i];
    const int p = std::max(1, static_cast<int>(std::lround(t.prompt_tokens * replay.prompt_scale)));
    const int o = std::max(1, static_cast<int>(std::lround(t.output_tokens * replay.output_scale)));
    const std::int64_t positions = static_cast<std::int64_t>(p) + o - 1;
    BRIGADE_CHECK(positions <= config.seq_len, Errc::InvalidArgument,
                  "trace line {}: {} prompt + {} output tokens need {} positions, the model's "
                  "seq_len is {}; scale the lengths with --prompt-scale / --output-scale",
                  t.line, p, o, positions, config.seq_len);
    ServeRequest r;
    r.arrival_s = t.arrival_s / replay.rate_scale;
    r.max_new_tokens = o;
    r.prompt.reserve(static_cast<std::size_t>(p));
    r.prompt.push_back(model::Tokenizer::kBos);
    for (int k = 1; k < p; ++k) r.prompt.push_back(id(rng));
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace v0
}  // namespace brigade::serve
