#pragma once
// The host (CPU) backend tag.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "dsp/core/memory_space.hpp"

namespace dsp::backend {

/// Tag of the CPU backend. Every host op takes `Host` as its first argument (tag dispatch):
/// layers call `gemm(B{}, ...)` and argument-dependent lookup picks the backend's overload.
/// Host ops work on fp32, row-major, contiguous host memory through raw pointers; scratch
/// memory they need is allocated per call (never per element).
struct Host {};

/// Where tensors of a model on this backend live: host ops read any host-addressable memory,
/// so the host backend keeps the calling thread's current space (host memory unless a
/// MemorySpaceScope says otherwise; tests use a space that forbids host element access).
inline MemorySpace* memory_space(Host) { return current_memory_space(); }

/// n zeroed floats of per-call scratch for an op written for every backend (attention's score
/// matrix, say), freed with the returned vector. Not counted in the memory ledger, like the host
/// ops' other per-call scratch.
inline std::vector<float> scratch(Host, std::int64_t n) { return std::vector<float>(static_cast<std::size_t>(n)); }

}  // namespace dsp::backend
