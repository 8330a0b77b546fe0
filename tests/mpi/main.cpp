// The doctest main of the MPI test binary: MPI is initialized around the whole run, every rank
// runs every case (each case is one collective program), and each rank's exit code is its own
// doctest result, so mpirun fails when any rank fails.
#define DOCTEST_CONFIG_IMPLEMENT
#include <brigade/transport/mpi.hpp>

#include <doctest/doctest.h>

int main(int argc, char** argv) {
  brigade::transport::MpiSession mpi(&argc, &argv);
  doctest::Context context(argc, argv);
  return context.run();
}
