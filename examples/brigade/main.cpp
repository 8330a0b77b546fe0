// `brigade`: generate, simulate, train, ... Each subcommand lives in its own file.
#include "cli.hpp"

#include <brigade/config.hpp>
#include <brigade/core/error.hpp>

#include <fmt/core.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>

namespace {

/// Ends the process with `rc` once every output is flushed, without running library destructors:
/// under an address-space limit (ulimit -v) OpenBLAS's worker threads can fail to allocate their
/// buffers and retry forever, and its exit handler would then join them and hang after the run
/// has finished. Every file brigade writes is complete (atomic rename, closed streams) before
/// run() returns, and MPI is finalized by then.
[[noreturn]] int exit_now(int rc) {
  std::fflush(nullptr);
  std::_Exit(rc);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"brigade " BRIGADE_VERSION_STRING ": pipeline parallelism for transformer models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string(BRIGADE_VERSION_STRING));
  auto& cmds = brigade::cli::commands();
  std::sort(cmds.begin(), cmds.end(), [](auto& a, auto& b) { return a.name < b.name; });
  std::vector<std::pair<CLI::App*, std::function<int()>>> runners;
  for (auto& c : cmds) {
    CLI::App* sub = app.add_subcommand(c.name, c.description);
    runners.emplace_back(sub, c.setup(*sub));
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return exit_now(app.exit(e));
  } catch (const CLI::CallForAllHelp& e) {
    return exit_now(app.exit(e));
  } catch (const CLI::CallForVersion& e) {
    return exit_now(app.exit(e));
  } catch (const CLI::ParseError& e) {
    // One line: what was wrong. `--help` lists the flags.
    fmt::print(stderr, "brigade: {} (see --help)\n", e.what());
    return exit_now(2);
  }
  int rc = 1;
  try {
    for (auto& [sub, run] : runners)
      if (sub->parsed()) {
        rc = run();
        break;
      }
  } catch (const brigade::Error& e) {
    fmt::print(stderr, "brigade: error ({}): {}\n", brigade::to_string(e.code()), e.what());
    rc = 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "brigade: error: {}\n", e.what());
    rc = 2;
  }
  return exit_now(rc);
}
