// The `brigade` command line: each subcommand registers itself from its own file.
#pragma once

#include <CLI/CLI.hpp>

#include <brigade/config.hpp>
#include <brigade/core/error.hpp>
#include <brigade/transport/mpi.hpp>  // mpi_world_size_from_env(); compiles without MPI

#include <optional>
#include <string_view>

#include <functional>
#include <string>
#include <vector>

namespace brigade::cli {

/// A subcommand: `setup` adds its options to `sub` and returns the function that runs it
/// (returning the process exit code).
struct Command {
  std::string name;
  std::string description;
  std::function<std::function<int()>(CLI::App& sub)> setup;
};

/// All registered subcommands (filled by Registrar objects at static-initialisation time).
inline std::vector<Command>& commands() {
  static std::vector<Command> all;
  return all;
}

/// Registers a subcommand: `static Registrar r{{"generate", "...", setup}};` in its file.
struct Registrar {
  explicit Registrar(Command c) { commands().push_back(std::move(c)); }
};

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

}  // namespace brigade::cli
