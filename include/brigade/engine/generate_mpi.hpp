// engine::generate_mpi: pipelined generation with one MPI process per stage (brigade::mpi).
// Declaration only: this header compiles without MPI; linking needs brigade::mpi.
#pragma once

#include "brigade/engine/distributed.hpp"

namespace brigade::engine {
inline namespace v0 {

/// Runs this process's stages of a pipelined generation over an MpiTransport on a duplicate of
/// MPI_COMM_WORLD: engine::generate_on with one process per rank (stage s on the process of rank
/// `partition.stage(s).rank`; several stages per process are ring windows). Every process of the job calls it with the same arguments; the
/// process of stage 0 gets the full report (sequences and the Timeline of every stage, gathered),
/// the others their own stage's Timeline only. Greedy output is token for token that of
/// engine::generate.
///
/// With options.tp = t > 1 the world is the grid TP t x PP (partition ranks), TP fastest
/// (tp::Grid: world rank p t + i is TP rank i of pipeline rank p): the processes of TP index i
/// form one pipeline (an MpiTransport on MPI_Comm_split of the world), the t processes of
/// pipeline rank p one TP group (transport::MpiCollectives: MPI_Iallreduce, MPI_Iallgather),
/// and each runs generate_on with its group. World rank 0 (TP 0 of the rank of stage 0 when
/// that is pipeline rank 0) gets the full report of pipeline 0; fault.rank is a pipeline rank.
///
/// A process that stops answering (killed, hung, cut off) makes the others throw
/// Error{PeerTimeout} naming it within about 1.25 x `options.timeout_s`; a process that fails
/// with an error makes the others throw Error{Aborted} quoting it.
///
/// @code
///   brigade::transport::MpiSession mpi(&argc, &argv);
///   auto report = brigade::engine::generate_mpi(weights, partition, requests, options);
///   if (mpi.rank() == 0) print(report);
/// @endcode
/// @throws brigade::Error{InvalidUsage} if no MpiSession is active (MPI not initialized);
///         brigade::Error{InvalidArgument} if the partition's rank count (times options.tp)
///         differs from the MPI world size ("grid TP 2 x PP 2 = 4 ranks does not match the 3
///         processes mpirun started"), a TP degree the model does not divide; the errors of
///         engine::generate_on
InferenceReport generate_mpi(const model::LlamaWeights& weights,
                             const partition::Partition& partition,
                             std::span<const GenerationRequest> requests,
                             const InferenceOptions& options = {}, FaultInjection fault = {});

}  // namespace v0
}  // namespace brigade::engine
