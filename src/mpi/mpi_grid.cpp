// tp::MpiGrid: the pipeline, TP and DP communicators of one process of a DP x PP x TP grid.
#include "brigade/tp/mpi_grid.hpp"

#include <mpi.h>

#include <optional>

namespace brigade::tp {
inline namespace v0 {

namespace {

/// MPI_Comm_split of the world by `color`, ranked by `key`; the caller frees it.
MPI_Comm split_world(int color, int key, const char* what) {
  MPI_Comm comm = MPI_COMM_NULL;
  const int rc = MPI_Comm_split(MPI_COMM_WORLD, color, key, &comm);
  BRIGADE_CHECK(rc == MPI_SUCCESS, Errc::Mpi, "MpiGrid: MPI_Comm_split of the {} failed ({})",
                what, rc);
  return comm;
}

}  // namespace

struct MpiGrid::Impl {
  Grid grid;
  int world_rank = 0;
  std::optional<transport::MpiTransport> pipeline;
  std::optional<transport::MpiCollectives> tp, dp;
  std::optional<GroupOver<transport::MpiCollectives>> tp_group, dp_group;
};

MpiGrid::MpiGrid(Grid grid, double timeout_s, std::string_view what)
    : impl_(std::make_unique<Impl>()) {
  BRIGADE_CHECK(transport::MpiSession::active(), Errc::InvalidUsage,
                "MpiGrid: MPI is not initialized; create a brigade::transport::MpiSession first");
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  MPI_Comm_rank(MPI_COMM_WORLD, &impl_->world_rank);
  check_grid_ranks(grid, world, what);  // the same inputs on every process: all refuse alike
  impl_->grid = grid;
  const int me = impl_->world_rank;
  const int t = grid.tp_rank(me), p = grid.pp_rank(me), d = grid.dp_rank(me);
  // The same three splits, in the same order, on every process of the world.
  MPI_Comm pipe = split_world(d * grid.tp + t, p, "pipelines");
  MPI_Comm tpc = split_world(d * grid.pp + p, t, "TP groups");
  MPI_Comm dpc = split_world(p * grid.tp + t, d, "DP groups");
  try {
    impl_->pipeline.emplace(&pipe);  // each duplicates its communicator
    if (grid.tp > 1) {
      impl_->tp.emplace(&tpc);
      impl_->tp_group.emplace(*impl_->tp, timeout_s);
    }
    if (grid.dp > 1) {
      impl_->dp.emplace(&dpc);
      impl_->dp_group.emplace(*impl_->dp, timeout_s);
    }
  } catch (...) {
    MPI_Comm_free(&pipe);
    MPI_Comm_free(&tpc);
    MPI_Comm_free(&dpc);
    throw;
  }
  MPI_Comm_free(&pipe);
  MPI_Comm_free(&tpc);
  MPI_Comm_free(&dpc);
}

MpiGrid::~MpiGrid() = default;

const Grid& MpiGrid::grid() const noexcept { return impl_->grid; }
int MpiGrid::world_rank() const noexcept { return impl_->world_rank; }
transport::MpiTransport& MpiGrid::pipeline() noexcept { return *impl_->pipeline; }
Group* MpiGrid::tp_group() noexcept { return impl_->tp_group ? &*impl_->tp_group : nullptr; }
Group* MpiGrid::dp_group() noexcept { return impl_->dp_group ? &*impl_->dp_group : nullptr; }

}  // namespace v0
}  // namespace brigade::tp
