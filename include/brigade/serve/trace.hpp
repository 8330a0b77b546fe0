// Serving traces: the Azure LLM inference traces (CSV) and Mooncake's (JSON Lines), read into
// arrivals and lengths, and turned into ServeRequests for a model.
#pragma once

#include "brigade/serve/serving.hpp"

#include <cstdint>
#include <filesystem>
#include <string_view>
#include <vector>

namespace brigade::serve {
inline namespace v0 {

/// One request of a trace: when it arrived and its lengths.
struct TraceRequest {
  double arrival_s = 0.0;  ///< seconds after the trace's first request
  int prompt_tokens = 0;   ///< prompt (context) tokens
  int output_tokens = 0;   ///< generated tokens
  int line = 0;            ///< 1-based line of the file it came from
};

/// Largest trace file read (bytes): 256 MiB.
inline constexpr std::uint64_t kMaxTraceFileBytes = std::uint64_t{256} << 20;

/// Parses a trace from its text, by its first line: the Azure LLM inference trace 2023
/// (Splitwise; header `TIMESTAMP,ContextTokens,GeneratedTokens`, timestamps
/// `YYYY-MM-DD HH:MM:SS[.fraction]`) or Mooncake's FAST'25 traces (one JSON object per line:
/// `timestamp` in ms, `input_length`, `output_length`; other fields ignored). Arrivals are made
/// relative to the first request. `name` names the source in messages.
/// @throws brigade::Error{BadFile} naming `name`, the line and an excerpt for a line that is not
///         of the format (wrong column count, a field that is not a whole number or timestamp,
///         a missing JSON field), a length < 1 (prompt) or < 1 (output), a timestamp earlier
///         than the line before it, a file of neither format, or no requests
std::vector<TraceRequest> parse_trace(std::string_view text, std::string_view name);

/// parse_trace of the file at `path` (a regular file of at most kMaxTraceFileBytes).
/// @throws brigade::Error{BadFile} as io::check_input_file and parse_trace
std::vector<TraceRequest> read_trace(const std::filesystem::path& path);

/// How a trace becomes requests for a model on this machine.
struct TraceReplay {
  /// Arrival times are divided by this (> 0): 2 replays the trace at twice its request rate.
  double rate_scale = 1.0;
  /// Prompt lengths are multiplied by this (> 0) and rounded, at least 1: the traces come from
  /// models with far longer contexts than the small models here.
  double prompt_scale = 1.0;
  /// Output lengths are multiplied by this (> 0) and rounded, at least 1.
  double output_scale = 1.0;
  /// The first N requests of the trace (0: all).
  int max_requests = 0;
  /// Seed of the prompt token ids (BOS, then ids drawn uniformly from [3, vocab)).
  std::uint64_t seed = 1;
};

/// The requests of `trace` for a model of `config`: arrival_s / rate_scale; a prompt of
/// round(prompt_tokens x prompt_scale) tokens (BOS first, then seeded ids) and
/// round(output_tokens x output_scale) new tokens, each at least 1.
/// @throws brigade::Error{InvalidArgument} for a scale not > 0 (or not finite), max_requests <
///         0; a request longer than the model's context ("trace line L: P prompt + O output
///         tokens need N positions, the model's seq_len is S; scale the lengths with
///         --prompt-scale / --output-scale")
std::vector<ServeRequest> trace_requests(std::span<const TraceRequest> trace,
                                         const model::LlamaConfig& config,
                                         const TraceReplay& replay);

}  // namespace v0
}  // namespace brigade::serve
