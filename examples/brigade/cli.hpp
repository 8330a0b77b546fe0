// The `brigade` command line: each subcommand registers itself from its own file.
#pragma once

#include <CLI/CLI.hpp>

#include <brigade/config.hpp>
#include <brigade/core/dtype.hpp>
#include <brigade/core/error.hpp>
#include <brigade/cost/profile.hpp>
#include <brigade/data/corpus.hpp>
#include <brigade/transport/mpi.hpp>  // mpi_world_size_from_env(); compiles without MPI

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

namespace brigade::cli {

/// A subcommand: `setup` adds its options to `sub` and returns the function that runs it
/// (returning the process exit code).
struct Command {
  std::string name;
  std::string description;
  std::function<std::function<int()>(CLI::App& sub)> setup;
};

/// The corpus a `--data` / `--corpus` argument names: `debian`, the multi-task corpus of
/// Debian's plain text (data::debian_sources under /), or a text file or folder
/// (data::load_corpus; a path named debian is reached as ./debian).
/// @throws brigade::Error{BadFile} as data::load_sources and data::load_corpus
inline data::Corpus load_text_corpus(const std::string& arg, const model::Tokenizer& tokenizer,
                                     int max_tokens) {
  return arg == "debian" ? data::load_sources(data::debian_sources(), tokenizer, max_tokens)
                         : data::load_corpus(arg, tokenizer, max_tokens);
}

/// All registered subcommands (filled by Registrar objects at static-initialisation time).
inline std::vector<Command>& commands() {
  static std::vector<Command> all;
  return all;
}

/// Registers a subcommand: `static Registrar r{{"generate", "...", setup}};` in its file.
struct Registrar {
  explicit Registrar(Command c) { commands().push_back(std::move(c)); }
};

/// A CLI11 check that a flag's value is a number in [lo, hi] ((lo, hi] when `lo_open`), with
/// an error a person can read: "--top-p: 0 is out of range; expected a number above 0 and at
/// most 1". NaN and infinities are refused for floating-point flags. `words` says the range
/// ("a whole number from 1 to 4096"); it is also the flag's range in --help.
template <class T>
CLI::Validator number_in(T lo, T hi, std::string words, bool lo_open = false) {
  auto check = [lo, hi, words, lo_open](std::string& text) -> std::string {
    T v{};
    const std::string shown = ::brigade::detail::excerpt(text);
    if (!CLI::detail::lexical_cast(text, v))
      return fmt::format("'{}' is not {}", shown,
                         std::is_integral_v<T> ? "a whole number" : "a number");
    if constexpr (std::is_floating_point_v<T>)
      if (!std::isfinite(v)) return fmt::format("{} is not a finite number; expected {}", shown, words);
    if (v < lo || v > hi || (lo_open && v == lo))
      return fmt::format("{} is out of range; expected {}", shown, words);
    return {};
  };
  return CLI::Validator(check, "(" + words + ")", "");
}

/// Threads this machine runs at once (std::thread::hardware_concurrency(), at least 1).
inline int hardware_threads() {
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

/// `--threads`: intra-op (BLAS) threads per stage, bounded by the machine's hardware threads.
inline CLI::Validator threads_range() {
  const int hw = hardware_threads();
  return number_in<int>(1, hw, fmt::format("a whole number from 1 to {} (this machine's hardware "
                                           "threads)", hw));
}

/// Starts `needed` threads and joins them, so that a run asking for more threads than this
/// process may start (ulimit -u, ulimit -v, cgroup pids.max) fails before it begins, with the
/// flags named, instead of failing half-way with "Resource temporarily unavailable".
/// @param flags names what asked for the threads ("--stages 2 x --threads 64")
/// @throws brigade::Error{InvalidArgument} naming `flags`, the number needed and the number
///         that could be started
inline void check_threads_startable(int needed, std::string_view flags) {
  std::vector<std::thread> started;
  started.reserve(static_cast<std::size_t>(needed));
  std::string failure;
  for (int i = 0; i < needed; ++i) {
    try {
      started.emplace_back([] {});
    } catch (const std::system_error& e) {
      failure = e.what();
      break;
    }
  }
  const int got = static_cast<int>(started.size());
  for (auto& t : started) t.join();
  BRIGADE_CHECK(got == needed, Errc::InvalidArgument,
                "{} needs {} threads, but this process could start only {} ({}; see ulimit -u "
                "and ulimit -v)",
                flags, needed, got, failure);
}

/// How this process was started: alone, or as one of `world` processes under mpirun (then MPI
/// is initialized for the life of this object and every process runs one pipeline rank).
class MpiLaunch {
 public:
  /// Starts MPI when the environment shows mpirun (OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_SIZE).
  /// @param fail_rank the fault-injection flag's value (-1 when unused)
  /// @throws brigade::Error{InvalidUsage} under mpirun without the mpi component;
  ///         Error{InvalidArgument} for --fail-rank without mpirun
  explicit MpiLaunch(int fail_rank) : world_(transport::mpi_world_size_from_env()) {
#if BRIGADE_HAS_MPI
    if (world_ > 0) session_.emplace();
#else
    BRIGADE_CHECK(world_ <= 1, Errc::InvalidUsage,
                  "started by mpirun with {} processes, but this brigade was built without the "
                  "mpi component (install libopenmpi-dev and configure with BRIGADE_ENABLE_MPI=ON)",
                  world_);
#endif
    BRIGADE_CHECK(fail_rank < 0 || active(), Errc::InvalidArgument,
                  "--fail-rank is a fault-injection flag for runs under mpirun");
  }
  /// True when running under mpirun with MPI initialized.
  [[nodiscard]] bool active() const noexcept {
#if BRIGADE_HAS_MPI
    return session_.has_value();
#else
    return false;
#endif
  }
  /// This process's rank in MPI_COMM_WORLD (0 when not under mpirun).
  [[nodiscard]] int rank() const noexcept {
#if BRIGADE_HAS_MPI
    return session_ ? session_->rank() : 0;
#else
    return 0;
#endif
  }
  /// Processes mpirun started (0 when not under mpirun).
  [[nodiscard]] int world() const noexcept { return world_; }
  /// The rank count to use: `requested` alone; under mpirun the world size, which an explicit
  /// `flag` must equal.
  /// @param what names one process's share in the message ("stage", "pipeline rank")
  /// @throws brigade::Error{InvalidArgument} if the flag was given and differs from the world
  [[nodiscard]] int ranks(int requested, const CLI::Option* flag, std::string_view what) const {
    if (!active()) return requested;
    BRIGADE_CHECK(flag == nullptr || flag->count() == 0 || requested == world_,
                  Errc::InvalidArgument,
                  "--stages {} but mpirun started {} processes; under MPI every process runs one "
                  "{} (omit --stages, or pass --stages {})",
                  requested, world_, what, world_);
    return world_;
  }

 private:
  int world_ = 0;
#if BRIGADE_HAS_MPI
  std::optional<transport::MpiSession> session_;
#endif
};

/// The device profile a command prices layers with, and where it came from.
struct ResolvedProfile {
  std::optional<cost::DeviceProfile> profile;  ///< empty: the roofline at default rates
  std::string origin;                          ///< for the summary line
};

/// Where `--profile auto` keeps this machine's profile for `cores` cores:
/// $XDG_CACHE_HOME/brigade (else $HOME/.cache/brigade)/profile-<cores>c-v4.json; empty when
/// neither variable is set. The version changes when what a profile measures changes (v2: the
/// kernels' own intra-op team replaced OpenMP and OpenBLAS threads, so multi-thread rates moved;
/// v3: the small-M kernel's k-chunks and F32 blocks moved the rates of 2-16 row products;
/// v4: the backward products moved from Eigen to OpenBLAS SGEMM, 1.2-1.5x faster).
inline std::filesystem::path profile_cache_path(int cores) {
  namespace fs = std::filesystem;
  fs::path dir;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0')
    dir = fs::path(x) / "brigade";
  else if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0')
    dir = fs::path(h) / ".cache" / "brigade";
  else
    return {};
  return dir / fmt::format("profile-{}c-v4.json", cores);
}

/// Resolves --profile (docs/profiles.md, "The calibrated split by default"):
/// - "auto": this machine's profile, read from profile_cache_path(cores) when its name names
///   this CPU model, else measured (cost::measure_profile with a 64 MiB disk file, about 4 s)
///   and cached there (a cache that cannot be written is skipped; a machine that cannot be
///   measured, e.g. without a writable temporary directory, gets the roofline and a notice);
///   under mpirun the processes could measure different figures and split differently, so
///   there "auto" is the roofline unless a file is given;
/// - "none": no profile (the roofline at default rates: a split that depends on no machine);
/// - anything else: that profile file.
/// @throws brigade::Error from cost::load_profile or cost::measure_profile
inline ResolvedProfile resolve_profile(const std::string& arg, int cores, bool under_mpi,
                                       std::string_view cpu_model) {
  if (arg == "none") return {std::nullopt, "none: roofline at default rates"};
  if (arg != "auto") {
    return {cost::load_profile(arg), arg};
  }
  if (under_mpi)
    return {std::nullopt, "auto under mpirun: roofline at default rates (give --profile FILE)"};
  const auto path = profile_cache_path(cores);
  std::error_code ec;
  if (!path.empty() && std::filesystem::exists(path, ec)) {
    try {
      auto p = cost::load_profile(path);
      if (p.kind == "cpu" && p.cores == cores && p.name.rfind(cpu_model, 0) == 0)
        return {std::move(p), fmt::format("cached {}", path.string())};
    } catch (const Error&) {
      // An unreadable or outdated cache is measured again and replaced.
    }
  }
  fmt::print(stderr, "profile: measuring this machine ({} cores, about 4 s; cached at {})\n",
             cores, path.empty() ? std::string("nowhere: no HOME") : path.string());
  cost::ProfileOptions o;
  o.cores = cores;
  o.disk_bytes = std::int64_t{64} << 20;  // the disk rate from a smaller file than `profile`'s
  cost::DeviceProfile p;
  try {
    p = cost::measure_profile(o);
  } catch (const Error& e) {  // e.g. no writable temporary directory for the disk figure
    fmt::print(stderr, "profile: could not measure this machine ({}); the roofline at default "
               "rates prices the split\n", e.what());
    return {std::nullopt, "auto, not measured: roofline at default rates"};
  }
  if (!path.empty()) {
    std::filesystem::create_directories(path.parent_path(), ec);
    try {
      cost::save_profile(path, p);
    } catch (const Error&) {
      // Not cached: the next run measures again.
    }
  }
  return {std::move(p), fmt::format("measured now{}", path.empty() ? "" : ", cached " + path.string())};
}

/// Adds the --profile option (default "auto") to `sub`.
inline CLI::Option* add_profile_option(CLI::App& sub, std::string& value) {
  return sub
      .add_option("--profile", value,
                  "device profile the balanced split prices layers with: auto (this machine's, "
                  "measured once and cached), none (roofline at default rates), or a file "
                  "(brigade profile --out FILE; docs/profiles.md); the plan's memory must fit its "
                  "memory_capacity_bytes")
      ->capture_default_str();
}

/// --pipeline-dtype: the dtype of the activations (and in training the activation gradients)
/// sent between stages (engine::InferenceOptions / TrainingOptions::pipeline_dtype); `value`
/// holds its name (f32, f16 or bf16) for brigade::parse_dtype.
inline CLI::Option* add_pipeline_dtype_option(CLI::App& sub, std::string& value) {
  return sub
      .add_option("--pipeline-dtype", value,
                  "dtype of what stages send each other: f32 (exact), or f16 / bf16 (half the "
                  "bytes on every link; each stage's input rounded once; compute stays f32)")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}))
      ->capture_default_str();
}

}  // namespace brigade::cli
