// engine::generate_mpi: engine::generate_on over an MpiTransport on MPI_COMM_WORLD, or with
// options.tp > 1 over the TP x PP grid of the world (a pipeline communicator per TP index, an
// MpiCollectives group per stage).
#include "brigade/engine/generate_mpi.hpp"

#include "brigade/tp/tensor_parallel.hpp"
#include "brigade/transport/mpi.hpp"

#include <mpi.h>

#include <vector>

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
  int world = 0, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  // Named errors before any communicator is made (every process checks the same inputs).
  tp::check_tensor_parallel(weights.config, options.tp);
  const tp::Grid grid{options.tp, partition.num_ranks(), 1};
  tp::check_grid_ranks(grid, world, "processes mpirun started");
  // The pipeline of TP index t: world ranks p x tp + t, ordered by stage rank p.
  MPI_Comm pipe_comm = MPI_COMM_NULL;
  const int rc = MPI_Comm_split(MPI_COMM_WORLD, grid.tp_rank(me), grid.pp_rank(me), &pipe_comm);
  BRIGADE_CHECK(rc == MPI_SUCCESS, Errc::Mpi, "generate_mpi: MPI_Comm_split failed ({})", rc);
  transport::MpiTransport pipe(&pipe_comm);  // duplicates it
  MPI_Comm_free(&pipe_comm);
  // The TP group of this stage rank: world ranks p x tp .. p x tp + tp - 1.
  std::vector<int> members;
  for (int t = 0; t < grid.tp; ++t) members.push_back(grid.rank_of(0, grid.pp_rank(me), t));
  transport::MpiCollectives collectives(members);
  tp::GroupOver<transport::MpiCollectives> group(collectives, options.timeout_s);
  return generate_on(pipe, weights, partition, requests, options, fault, &group);
}

}  // namespace v0
}  // namespace brigade::engine
