#pragma once
// The MPI entry point: MpiRuntime (MPI's lifetime in this process) and mpi_launch, the MPI
// counterpart of comm::launch. Start the program with `mpiexec -n N prog ...`.
//
// Threading level: MPI_THREAD_FUNNELED. MpiComm starts no thread of its own (its asynchronous
// operations are MPI nonblocking operations progressed by MPI calls), and a rank's code calls
// MPI from its main thread only; compute threads (OpenBLAS) never call MPI.
#include <cstdio>
#include <exception>
#include <functional>
#include <optional>

#include "dsp/comm/mpi_comm.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/threads.hpp"
#include "dsp/core/trace.hpp"

namespace dsp::comm {

/// Owns MPI's initialisation in this process (at most one at a time; MPI cannot be
/// re-initialised after MPI_Finalize). The constructor calls MPI_Init_thread with
/// MPI_THREAD_FUNNELED and sets dsp::ranks_per_process() to the number of ranks on this node
/// (MPI_Comm_split_type SHARED), so the host backend gives each rank cores / local ranks BLAS
/// threads. Throws CommError when MPI is already initialised or cannot be. The destructor
/// waits for operations nobody waits for any more (dropped Works, buffered sends) and calls
/// MPI_Finalize; reached by an exception that leaves the runtime's scope, it calls
/// MPI_Abort(MPI_COMM_WORLD, 1) instead, since the other ranks may wait for this one.
class MpiRuntime {
 public:
  MpiRuntime() {
    int initialized = 0;
    DSP_MPI_CHECK(MPI_Initialized(&initialized));
    DSP_CHECK_AS(CommError, !initialized, "MpiRuntime: MPI is already initialised (one MpiRuntime per process)");
    int provided = 0;
    DSP_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided));
    if (provided < MPI_THREAD_FUNNELED) {
      MPI_Finalize();
      throw CommError(::dsp::detail::concat("MpiRuntime: MPI provides thread level ", provided,
                                            ", dsp needs MPI_THREAD_FUNNELED"));
    }
    world_ = MpiComm::world();
    MPI_Comm node = MPI_COMM_NULL;
    DSP_MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
    DSP_MPI_CHECK(MPI_Comm_size(node, &local_size_));
    DSP_MPI_CHECK(MPI_Comm_free(&node));
    ranks_.emplace(local_size_);
  }
  ~MpiRuntime() {
    if (std::uncaught_exceptions() > uncaught_) {
      std::fprintf(stderr, "rank %d failed: an exception left the MPI runtime's scope\n", world_.rank());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    try {
      detail::Inflight::get().drain();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: %s\n", world_.rank(), e.what());
    }
    world_ = MpiComm();
    ranks_.reset();
    MPI_Finalize();
  }
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  /// MPI_COMM_WORLD as an MpiComm.
  MpiComm& world() { return world_; }
  /// Ranks of this job on this node.
  int local_size() const { return local_size_; }
  /// Waits for this rank's operations nobody waits for any more (dropped Works, buffered
  /// sends); throws CommError for the first that failed.
  void wait_pending() { detail::Inflight::get().drain(); }

 private:
  int uncaught_ = std::uncaught_exceptions();
  MpiComm world_;
  int local_size_ = 1;
  std::optional<RanksPerProcess> ranks_;
};

/// Runs fn(world) as this process's rank of MPI_COMM_WORLD, between MpiRuntime's MPI_Init and
/// MPI_Finalize (see MpiRuntime for the threading level and BLAS threads). The calling thread
/// becomes trace rank world.rank() (trace::set_thread_rank). Returns when fn returned and this
/// rank's pending operations completed. When fn (or that wait) throws, it
/// prints "rank R failed: <message>" to stderr and calls MPI_Abort(MPI_COMM_WORLD, 1): every
/// rank of the job ends (mpiexec exits non-zero) instead of waiting in a collective for this
/// one, and this call does not return. Throws CommError when MPI cannot be initialised.
inline void mpi_launch(const std::function<void(MpiComm&)>& fn) {
  MpiRuntime runtime;
  const int rank = runtime.world().rank();
  trace::set_thread_rank(rank);
  auto abort_job = [rank](const char* message) {
    std::fprintf(stderr, "rank %d failed: %s\n", rank, message);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  };
  try {
    fn(runtime.world());
    runtime.wait_pending();
  } catch (const std::exception& e) {
    abort_job(e.what());
  } catch (...) {
    abort_job("non-standard exception");
  }
}

}  // namespace dsp::comm
