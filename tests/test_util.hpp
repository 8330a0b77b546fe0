// Helpers shared by brigade's test files.
#pragma once

#include <fmt/format.h>

#include <atomic>
#include <filesystem>
#include <string_view>
#include <system_error>
#include <unistd.h>

namespace brigade::test {

/// A fresh directory under the system temp dir (unique per process and instance), removed with
/// its contents at scope exit.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(std::string_view prefix = "brigade-test") {
    static std::atomic<int> counter{0};
    path = std::filesystem::temp_directory_path() /
           fmt::format("{}-{}-{}", prefix, ::getpid(), counter.fetch_add(1));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  [[nodiscard]] std::filesystem::path operator/(std::string_view name) const { return path / name; }
};

}  // namespace brigade::test
