// doctest's main for dsp_mpi_tests, run by ctest under mpiexec: every rank runs every test
// case (collectives pair up across processes) between MPI_Init_thread and MPI_Finalize.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "dsp/comm/mpi_launch.hpp"

int main(int argc, char** argv) {
  dsp::comm::MpiRuntime mpi;
  doctest::Context context(argc, argv);
  context.setOption("no-colors", true);  // output of several ranks is interleaved in one stream
  if (mpi.world().rank() != 0) context.setOption("no-version", true);
  return context.run();
}
