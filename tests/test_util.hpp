// Helpers shared by brigade's test files.
#pragma once

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <brigade/core/error.hpp>
#include <brigade/data/corpus.hpp>
#include <brigade/model/tokenizer.hpp>

#include <algorithm>
#include <array>
#include <cfloat>
#include <atomic>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>
#include <string_view>
#include <system_error>
#include <sys/wait.h>
#include <unistd.h>

namespace brigade::test {

/// True when `file` (data that is not committed: under BRIGADE_DATA_DIR, ../shared/data by
/// default) exists; otherwise prints the "[skipped]" line ctest reports as Skipped
/// (SKIP_REGULAR_EXPRESSION) and returns false, and the test returns at once.
inline bool have_data(const std::filesystem::path& file) {
  if (std::filesystem::exists(file)) return true;
  std::printf("[skipped] %s not found: set the CMake cache variable BRIGADE_DATA_DIR to the "
              "folder that holds it\n", file.lexically_normal().string().c_str());
  return false;
}

/// The message of the brigade::Error that `f` throws; fails the test when `f` throws nothing or
/// throws with another code than `code`.
inline std::string error_of(Errc code, const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    INFO("message: " << std::string(e.what()));
    CHECK(to_string(e.code()) == to_string(code));
    return e.what();
  }
  FAIL("expected brigade::Error, nothing was thrown");
  return {};
}

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

/// `n` floats drawn uniformly from [lo, hi) by `rng` (the random inputs of the kernel tests).
inline std::vector<float> random_vec(std::mt19937& rng, std::int64_t n, float lo = -1.0f,
                                     float hi = 1.0f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

/// ||a - b|| / ||b|| (Euclidean norms in double; a tiny floor for ||b|| = 0): how gradient
/// tensors of two runs are compared. a and b have the same size.
inline double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

/// `value` within a relative `eps` (default doctest's 100 x FLT_EPSILON, about 1.2e-5): what
/// `doctest::Approx(value).epsilon(eps)` reads as but is not. doctest passes
/// |a - value| < eps * (scale + max(|a|, |value|)) with scale 1, so below magnitude 1 the bound
/// is about eps absolute: Approx(1e-4).epsilon(0.01) passes anything in [-0.01, 0.01], and even
/// the default epsilon lets 1e-6 s pass for almost anything. rel() sets scale 0: purely
/// relative. The scale is the smallest normal double rather than 0, so that 0 still equals
/// exactly 0 (with scale 0 doctest's strict < refuses even that). For a quantity that may be
/// near 0, where relative means nothing, check an explicit absolute bound instead
/// (std::abs(a - b) < tol).
inline doctest::Approx rel(double value, double eps = 100.0 * FLT_EPSILON) {
  return doctest::Approx{value}.epsilon(eps).scale(std::numeric_limits<double>::min());
}

/// Ten short TinyStories-like sentences as training samples (BOS first), tasks 0, 1, 2, 0, ...
inline std::vector<data::Sample> story_samples(const model::Tokenizer& tok) {
  const char* texts[] = {"Once upon a time, there was a little girl named Lily.",
                         "She loved to play outside in the park.",
                         "One day, she saw a big, red ball.",
                         "Tom and his dog ran to the tree.",
                         "The sun was hot and the sky was blue.",
                         "Mom said, \"Let's go home and eat.\"",
                         "The cat jumped on the bed and slept.",
                         "Ben wanted to fly a kite with his friend.",
                         "They laughed and played all day long.",
                         "The bird sang a happy song."};
  std::vector<data::Sample> out;
  int task = 0;
  for (const char* t : texts) out.push_back({task++ % 3, tok.encode(t, true, false)});
  return out;
}

/// story_samples(tok) in file order packed by data::Packer (seed 0) into `n` micro-batches of at
/// most `rows` rows (task spans included): the training tests' step of micro-batches.
inline std::vector<data::PackedBatch> story_batches(const model::Tokenizer& tok, int n,
                                                    std::int64_t rows = 24) {
  const auto samples = story_samples(tok);  // the packer reads them: keep them alive
  data::Packer packer(samples, rows, 0);
  std::vector<data::PackedBatch> out;
  for (int i = 0; i < n; ++i) out.push_back(packer.next());
  return out;
}

/// One case of llama2.c run.c's greedy output for stories260K (reference/stories260K_greedy.json
/// under the data dir; its README says how it was made).
struct GreedyCase {
  std::string name;                ///< "empty_256" or "once_upon_64"
  std::string prompt;              ///< the prompt text ("" or "Once upon a time")
  int steps = 0;                   ///< run.c's -n: positions run, the prompt's included
  std::string stdout_text;         ///< what run.c printed (its text, byte for byte)
  std::vector<int> prompt_ids;     ///< BOS first
  std::vector<int> generated_ids;  ///< the ids run.c sampled after the prompt
  /// The token ids at every position: the prompt, then the generated ids (a terminating BOS is
  /// not a token of the text and is left out).
  [[nodiscard]] std::vector<int> tokens() const {
    std::vector<int> ids = prompt_ids;
    for (int t : generated_ids)
      if (t != model::Tokenizer::kBos) ids.push_back(t);
    return ids;
  }
};

/// The reference file's cases in file order (0: the empty prompt, 256 steps; 1: "Once upon a
/// time", 64 steps) and the first 16 logits at position 0 after BOS. Fails the test (REQUIRE)
/// when the file is missing.
struct GreedyReference {
  std::vector<GreedyCase> cases;
  std::vector<float> logits_bos_pos0_first16;
};

inline GreedyReference greedy_reference(const std::filesystem::path& data_dir) {
  std::ifstream in(data_dir / "reference" / "stories260K_greedy.json");
  REQUIRE_MESSAGE(in.good(), "no reference/stories260K_greedy.json in ", data_dir.string());
  const auto j = nlohmann::json::parse(in);
  GreedyReference ref;
  for (const auto& c : j.at("cases")) {
    GreedyCase k;
    k.name = c.at("name");
    k.prompt = c.at("prompt");
    k.steps = c.at("steps");
    k.stdout_text = c.at("stdout");
    k.prompt_ids = c.at("prompt_ids").get<std::vector<int>>();
    k.generated_ids = c.at("generated_ids").get<std::vector<int>>();
    ref.cases.push_back(std::move(k));
  }
  ref.logits_bos_pos0_first16 = j.at("logits_bos_pos0_first16").get<std::vector<float>>();
  return ref;
}

/// What a command printed and its exit code (-1 when it did not exit normally).
struct Run {
  int rc = -1;
  std::string out, err;
};

/// Runs `command` through /bin/sh, capturing stdout and stderr.
inline Run run_shell(const std::string& command) {
  // One stderr file per call: ctest runs test cases in parallel processes.
  static std::atomic<int> calls{0};
  const std::filesystem::path err_file =
      std::filesystem::temp_directory_path() /
      fmt::format("brigade_cli_stderr_{}_{}.txt", ::getpid(), calls.fetch_add(1));
  const std::string cmd = "{ " + command + " ; } 2>" + err_file.string();
  Run r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf{};
  std::size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  {
    std::ifstream e(err_file);
    r.err.assign(std::istreambuf_iterator<char>(e), {});
  }
  std::error_code ec;
  std::filesystem::remove(err_file, ec);
  return r;
}

#ifdef BRIGADE_CLI
/// Runs the `brigade` CLI with `args` (shell words), capturing stdout and stderr.
inline Run run_cli(const std::string& args) { return run_shell(std::string(BRIGADE_CLI) + " " + args); }
#endif

}  // namespace brigade::test
