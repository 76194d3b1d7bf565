#pragma once
// Helpers for the CUDA op tests: host vectors to device buffers and back, on one stream.
#include <cstdint>
#include <vector>

#include "dsp/backend/cuda/memory.hpp"

namespace dsp::test {

/// A device copy of `v` on b.stream.
template <class T>
backend::DeviceBuffer<T> on_device(backend::Cuda b, const std::vector<T>& v) {
  return backend::to_device<T>(b, v);
}

/// The device buffer's contents after everything enqueued on its stream (waits).
template <class T>
std::vector<T> on_host(const backend::DeviceBuffer<T>& d) {
  return backend::to_host(d.backend(), d.data(), d.size());
}

}  // namespace dsp::test
