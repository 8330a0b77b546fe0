// Chrome trace (chrome://tracing, Perfetto) export of a Timeline.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/core/timeline.hpp"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace brigade::io {
inline namespace v0 {

/// Chrome trace JSON ("traceEvents" of complete "X" events, microseconds) for a Timeline:
/// one row (tid) per rank, named "stage R"; each event is named "OP mb" with the op's text
/// form and carries microbatch, virtual stage, chunk, tokens and bytes in "args". Weight and cache
/// movement (PREFETCH, RELEASE, MIGRATE) overlaps compute, so it goes on a row of its own per
/// rank that has any: tid P + R, named "stage R I/O". Marks are instant ("i") events on their
/// rank's row, with the detail in "args".
inline nlohmann::json to_chrome_trace(const Timeline& tl, const std::string& row_name = "stage") {
  nlohmann::json events = nlohmann::json::array();
  const double t0 = tl.begin();
  const int P = tl.num_ranks();
  std::vector<char> io_row(static_cast<std::size_t>(P), 0);
  for (const auto& iv : tl.intervals())
    if (is_memory_op(iv.op)) io_row[static_cast<std::size_t>(iv.rank)] = 1;
  for (int r = 0; r < P; ++r) {
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", r},
                      {"args", {{"name", row_name + " " + std::to_string(r)}}}});
    if (io_row[static_cast<std::size_t>(r)])
      events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", P + r},
                        {"args", {{"name", row_name + " " + std::to_string(r) + " I/O"}}}});
  }
  for (const auto& iv : tl.intervals()) {
    std::string name = std::string(to_string(iv.op)) + " " + std::to_string(iv.microbatch);
    if (!iv.label.empty()) name += " " + iv.label;
    events.push_back({{"name", name},
                      {"cat", std::string(to_string(iv.op))},
                      {"ph", "X"},
                      {"pid", 0},
                      {"tid", is_memory_op(iv.op) ? P + iv.rank : iv.rank},
                      {"ts", (iv.start - t0) * 1e6},
                      {"dur", iv.duration() * 1e6},
                      {"args",
                       {{"microbatch", iv.microbatch},
                        {"virtual_stage", iv.virtual_stage},
                        {"chunk", iv.chunk},
                        {"tokens", iv.tokens},
                        {"bytes", iv.bytes}}}});
  }
  for (const auto& m : tl.marks())
    events.push_back({{"name", m.name},
                      {"ph", "i"},
                      {"s", "t"},
                      {"pid", 0},
                      {"tid", m.rank},
                      {"ts", (m.at - t0) * 1e6},
                      {"args", {{"detail", m.detail}}}});
  return {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
}

/// Writes `text` to `path` atomically: a temporary file beside it (`path` + ".tmp"), then rename,
/// so a failure never leaves a half-written file. Errors name `path`, not the temporary file.
/// @throws brigade::Error{BadFile} if the file cannot be written (a missing folder is named)
inline void write_file_atomic(const std::filesystem::path& path, const std::string& text) {
  const std::filesystem::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out.good()) {
      const auto folder = path.parent_path();
      BRIGADE_CHECK(folder.empty() || std::filesystem::is_directory(folder), Errc::BadFile,
                    "{}: cannot write: folder {} does not exist", path.string(), folder.string());
      detail::fail(Errc::BadFile, "{}: cannot open for writing", path.string());
    }
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.flush();
    if (!out.good()) {
      std::error_code ec;
      std::filesystem::remove(tmp, ec);
      detail::fail(Errc::BadFile, "{}: write failed", path.string());
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    detail::fail(Errc::BadFile, "{}: cannot rename into place", path.string());
  }
}

/// Writes the Chrome trace of `tl` to `path` (atomically).
/// @throws brigade::Error{BadFile} if the file cannot be written
inline void write_chrome_trace(const std::filesystem::path& path, const Timeline& tl,
                               const std::string& row_name = "stage") {
  write_file_atomic(path, to_chrome_trace(tl, row_name).dump());
}

}  // namespace v0
}  // namespace brigade::io
