#pragma once
// Where the samples' ranks run: threads of this process (comm::launch, ThreadComm), or, when
// the program was started by mpiexec in a build with MPI, one rank per process (MpiComm).
#include <cstdlib>

#include "dsp/comm/launch.hpp"
#include "dsp/core/error.hpp"
#ifdef DSP_SAMPLES_HAVE_MPI
#include "dsp/comm/mpi_launch.hpp"
#endif

namespace samples {

/// True when this process is a rank of an mpiexec job (OpenMPI's OMPI_COMM_WORLD_SIZE or
/// PMIx's PMIX_RANK is set).
inline bool started_by_mpiexec() { return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMIX_RANK"); }

/// Runs body(world) on every rank, `body` being generic over the communicator
/// (`[&]<class Comm>(Comm& world) {...}`). Under mpiexec in a build with MPI (DSP_SAMPLES_HAVE_MPI):
/// once in this process on comm::MpiComm through comm::mpi_launch, where a rank that throws
/// prints "rank R failed: <message>" and ends the whole job. Otherwise on `world_size` threads
/// with comm::ThreadComm (comm::launch rethrows the first rank's error).
/// world_size: the ranks asked for, 0 when not given (then 1 thread, or the MPI size). Under
/// MPI a given world_size must equal the MPI size (ConfigError naming both).
/// Under mpiexec without MPI support it throws ConfigError: every process would otherwise run
/// the whole job alone.
template <class Body>
void run_ranks(int world_size, Body&& body) {
#ifdef DSP_SAMPLES_HAVE_MPI
  if (started_by_mpiexec()) {
    dsp::comm::mpi_launch([&](dsp::comm::MpiComm& world) {
      if (world_size != 0 && world_size != world.size()) {
        if (world.rank() != 0) world.barrier();  // rank 0 reports it alone; its MPI_Abort ends this wait
        throw dsp::ConfigError(dsp::detail::concat("--world-size ", world_size, " does not match the MPI world size ",
                                                   world.size(), " (mpiexec -n); leave --world-size out under mpiexec"));
      }
      body(world);
    });
    return;
  }
#else
  DSP_CHECK_AS(dsp::ConfigError, !started_by_mpiexec(),
               "started by mpiexec, but this build has no MPI support (configure with DSP_ENABLE_MPI=ON)");
#endif
  dsp::comm::launch(world_size == 0 ? 1 : world_size, [&](dsp::comm::ThreadComm& world) { body(world); });
}

}  // namespace samples
