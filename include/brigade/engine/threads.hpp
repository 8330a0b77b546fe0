// Running one function per rank on threads over an InProcessFabric, with failure propagation.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/transport/in_process.hpp"

#include <exception>
#include <thread>
#include <vector>

namespace brigade::engine::detail {

/// Runs `body(r)` for r in [0, n) on n threads and joins them. When one throws, the fabric is
/// aborted (every rank waiting on it wakes with Errc::Aborted) and, after all have joined, the
/// root cause is rethrown: the first error that is not an Aborted, else the first Aborted.
/// @param what names a rank in the abort reason ("stage", "rank")
template <class F>
void run_on_threads(int n, transport::InProcessFabric& fabric, const char* what, F&& body) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  {
    std::vector<std::jthread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        try {
          body(r);
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = std::current_exception();
          fabric.abort(fmt::format("{} {} failed: {}", what, r, e.what()));
        }
      });
  }
  std::exception_ptr aborted;
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      if (err.code() != Errc::Aborted) std::rethrow_exception(e);
      if (!aborted) aborted = e;
    } catch (...) {
      std::rethrow_exception(e);
    }
  }
  if (aborted) std::rethrow_exception(aborted);
}

}  // namespace brigade::engine::detail
