// engine::generate_mpi: engine::generate_on over an MpiTransport on MPI_COMM_WORLD, or with
// options.tp > 1 over the TP x PP grid of the world (tp::MpiGrid: a pipeline communicator per TP
// index, an MpiCollectives group per stage).
#include "brigade/engine/generate_mpi.hpp"

#include "brigade/tp/mpi_grid.hpp"
#include "brigade/transport/mpi.hpp"

namespace brigade::engine {
inline namespace v0 {

InferenceReport generate_mpi(const model::LlamaWeights& weights,
                             const partition::Partition& partition,
                             std::span<const GenerationRequest> requests,
                             const InferenceOptions& options, FaultInjection fault) {
  BRIGADE_CHECK(transport::MpiSession::active(), Errc::InvalidUsage,
                "generate_mpi: MPI is not initialized; create a brigade::transport::MpiSession "
                "first");
  if (options.tp == 1) {
    transport::MpiTransport t;
    return generate_on(t, weights, partition, requests, options, fault);
  }
  // Named errors before any communicator is made (every process checks the same inputs).
  tp::check_tensor_parallel(weights.config, options.tp);
  tp::MpiGrid grid(tp::Grid{options.tp, partition.num_ranks(), 1}, options.timeout_s);
  return generate_on(grid.pipeline(), weights, partition, requests, options, fault,
                     grid.tp_group());
}

}  // namespace v0
}  // namespace brigade::engine
