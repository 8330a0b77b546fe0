// The `brigade` command line: each subcommand registers itself from its own file.
#pragma once

#include <CLI/CLI.hpp>

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

}  // namespace brigade::cli
