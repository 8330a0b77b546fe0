// engine::generate_mpi: engine::generate_on over an MpiTransport on MPI_COMM_WORLD.
#include "brigade/engine/generate_mpi.hpp"

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
  transport::MpiTransport t;
  return generate_on(t, weights, partition, requests, options, fault);
}

}  // namespace v0
}  // namespace brigade::engine
