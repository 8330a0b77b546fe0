// The thread driver: one rank per thread over any Transport, with failure propagation.
#pragma once

#include "brigade/core/error.hpp"
#include "brigade/transport/transport.hpp"

#include <exception>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace brigade::engine {
inline namespace v0 {

/// Rethrows the root cause among the errors of failed ranks (null entries: ranks that
/// succeeded): the first (in rank order) that is not an Aborted or a PeerTimeout brigade::Error,
/// else the first of those. Returns when every entry is null.
inline void rethrow_root_cause(std::span<const std::exception_ptr> errors) {
  std::exception_ptr secondary;
  for (const auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      if (err.code() != Errc::Aborted && err.code() != Errc::PeerTimeout)
        std::rethrow_exception(e);
      if (!secondary) secondary = e;
    } catch (...) {
      std::rethrow_exception(e);
    }
  }
  if (secondary) std::rethrow_exception(secondary);
}

/// Runs `body(transports[r])` for every r on its own thread (one rank per thread, the SPMD form
/// every engine entry point that takes a Transport expects: generate_on, DistributedTrainer,
/// run_training_program) and joins them.
///
/// When a rank's body throws, the driver calls transport::abort_others on that rank's transport:
/// for an AbortableTransport (InProcessTransport, MpiTransport, a decorator over either) every
/// other rank's pending and later waits then throw Error{Aborted}; for a transport without
/// abort the others stop at their own deadlines (PeerTimeout). After all threads joined, the
/// root cause is rethrown: the first error (in rank order) that is not an Aborted or a
/// PeerTimeout, else the first of those.
///
/// @code
///   transport::InProcessFabric fabric(P);
///   auto eps = transport::endpoints(fabric);              // one InProcessTransport per rank
///   engine::run_ranks(std::span(eps), [&](transport::InProcessTransport& t) {
///     engine::generate_on(t, weights, partition, requests);
///   });
/// @endcode
///
/// @param transports one endpoint per rank, `transports[r].rank() == r` expected (not checked:
///        any transport may be driven); each is used by its thread only
/// @param body called as body(T&) on each rank's thread
/// @throws the root-cause error of the failed ranks, as described
template <transport::Transport T, class F>
void run_ranks(std::span<T> transports, F&& body) {
  const std::size_t n = transports.size();
  std::vector<std::exception_ptr> errors(n);
  {
    std::vector<std::jthread> threads;
    threads.reserve(n);
    for (std::size_t r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        try {
          body(transports[r]);
        } catch (const std::exception& e) {
          errors[r] = std::current_exception();
          transport::abort_others(transports[r], e);
        } catch (...) {
          errors[r] = std::current_exception();
        }
      });
  }
  rethrow_root_cause(errors);
}

/// Runs `body(t, p)` for every rank of a TP x PP grid of `tp` x `pp` ranks on its own thread
/// (global rank p x tp + t, tp::Grid's order) and joins them: the thread driver of tensor
/// parallelism on threads (engine::generate with InferenceOptions::tp, TrainingEngine with
/// TrainingOptions::tp), where each pipeline has its transports and each pipeline rank's TP
/// group its collectives.
///
/// When a rank's body throws `e`, the driver calls `abort_all(e, reason)` once per failure with
/// reason "rank g (TP t of pipeline rank p) failed: <what>", which must stop every other rank:
/// abort every pipeline's transports and every group (transport::InProcessGroup::abort), so no
/// rank waits for its deadline. After the join the root cause is rethrown, as run_ranks does.
/// @param abort_all called as abort_all(const std::exception&, const std::string&); must not throw
/// @throws the root-cause error of the failed ranks
template <class F, class Abort>
void run_grid(int tp, int pp, F&& body, Abort&& abort_all) {
  const int G = tp * pp;
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(G));
  {
    std::vector<std::jthread> threads;
    threads.reserve(static_cast<std::size_t>(G));
    for (int g = 0; g < G; ++g)
      threads.emplace_back([&, g] {
        const int p = g / tp, t = g % tp;
        try {
          body(t, p);
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(g)] = std::current_exception();
          std::string reason;
          try {
            reason = "rank " + std::to_string(g) + " (TP " + std::to_string(t) +
                     " of pipeline rank " + std::to_string(p) + ") failed: " + e.what();
          } catch (...) {  // keep going without the text
          }
          abort_all(e, reason);
        } catch (...) {
          errors[static_cast<std::size_t>(g)] = std::current_exception();
        }
      });
  }
  rethrow_root_cause(errors);
}

}  // namespace v0
}  // namespace brigade::engine
