// tp::MpiGrid: one process's communicators in a DP x PP x TP grid of MPI processes (brigade::mpi).
// Declaration only: this header compiles without MPI; linking needs brigade::mpi.
#pragma once

#include "brigade/tp/tensor_parallel.hpp"
#include "brigade/transport/mpi.hpp"

#include <memory>
#include <string_view>

namespace brigade::tp {
inline namespace v0 {

/// This process's place in a DP x PP x TP grid over MPI_COMM_WORLD (Grid's order, TP fastest:
/// world rank (d pp + p) tp + t is TP rank t of pipeline rank p of replica d), with the three
/// communicators it runs on, each from MPI_Comm_split of the world (collective over the world:
/// every process constructs its MpiGrid at the same point, before its other collectives):
/// - pipeline(): the pp processes of its replica and TP index, rank = pipeline rank p (the
///   Transport a pipeline engine runs: generate_on, DistributedTrainer);
/// - tp_group(): the tp processes of its replica and pipeline rank (its stages' collectives),
///   member = t; null when tp = 1;
/// - dp_group(): the dp processes of its pipeline rank and TP index, one per replica (the
///   gradient all-reduce), member = d; null when dp = 1.
/// The groups are transport::MpiCollectives (MPI_Iallreduce, MPI_Iallgather) behind tp::Group,
/// each collective waiting at most `timeout_s` seconds.
class MpiGrid {
 public:
  /// @param grid      the degrees; grid.ranks() must be the world size
  /// @param timeout_s seconds a group's collective waits for its members (PeerTimeout)
  /// @param what      names the world in the error ("processes mpirun started")
  /// @throws brigade::Error{InvalidUsage} if MPI is not initialized (no MpiSession);
  ///         Error{InvalidArgument} as check_grid_ranks ("grid TP 2 x PP 2 x DP 2 = 8 ranks does
  ///         not match the 4 processes mpirun started"); Error{Mpi}
  MpiGrid(Grid grid, double timeout_s, std::string_view what = "processes mpirun started");
  ~MpiGrid();
  MpiGrid(const MpiGrid&) = delete;
  MpiGrid& operator=(const MpiGrid&) = delete;

  /// The degrees.
  [[nodiscard]] const Grid& grid() const noexcept;
  /// This process's rank in MPI_COMM_WORLD.
  [[nodiscard]] int world_rank() const noexcept;
  /// Its TP rank t, pipeline rank p and replica d.
  [[nodiscard]] int tp_rank() const noexcept { return grid().tp_rank(world_rank()); }
  [[nodiscard]] int pp_rank() const noexcept { return grid().pp_rank(world_rank()); }
  [[nodiscard]] int dp_rank() const noexcept { return grid().dp_rank(world_rank()); }
  /// Its pipeline's transport (rank = pp_rank(), world_size() = grid().pp).
  [[nodiscard]] transport::MpiTransport& pipeline() noexcept;
  /// Its TP group, or null when grid().tp == 1.
  [[nodiscard]] Group* tp_group() noexcept;
  /// Its DP group, or null when grid().dp == 1.
  [[nodiscard]] Group* dp_group() noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace v0
}  // namespace brigade::tp
