// DeviceBuffer: stream-ordered allocation counted per category in the device counters (and
// never in the host ones), round trips, a failed allocation, and event timing. The pinned host
// space of the CUDA memory space (what ZeRO-Offload's state lives in).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "dsp/backend/cuda/memory.hpp"
#include "dsp/backend/cuda/memory_space.hpp"
#include "dsp/core/space_buffer.hpp"
#include "dsp/backend/cuda/stream.hpp"

using dsp::backend::Cuda;
using dsp::backend::DeviceBuffer;
using dsp::backend::Event;
using dsp::backend::Stream;
using dsp::memory::Category;

TEST_CASE("device bytes are counted per category with live and peak, moves keep them, frees subtract") {
  Stream stream;
  const Cuda b = stream.backend();
  const auto host_before = dsp::memory::snapshot();
  const auto before = dsp::memory::device_snapshot();
  dsp::memory::reset_device_peak();
  {
    DeviceBuffer<float> p(b, 1000, Category::Parameters);
    DeviceBuffer<float> g;
    {
      const dsp::memory::CategoryScope scope(Category::Gradients);
      g = DeviceBuffer<float>(b, 500);  // the current category
    }
    CHECK(g.category() == Category::Gradients);
    auto now = dsp::memory::device_snapshot();
    CHECK(now[Category::Parameters].live - before[Category::Parameters].live == 4000);
    CHECK(now[Category::Gradients].live - before[Category::Gradients].live == 2000);
    CHECK(dsp::memory::device_live_bytes() - before.total.live == 6000);
    DeviceBuffer<float> moved(std::move(p));  // no new allocation
    CHECK(p.data() == nullptr);
    CHECK(dsp::memory::device_live_bytes() - before.total.live == 6000);
  }
  const auto after = dsp::memory::device_snapshot();
  CHECK(after.total.live == before.total.live);
  CHECK(dsp::memory::device_peak_bytes() - before.total.live == 6000);
  CHECK(after[Category::Parameters].peak - before[Category::Parameters].live == 4000);
  // The host counters did not move.
  CHECK(dsp::memory::snapshot().total.live == host_before.total.live);
}

TEST_CASE("to_device and to_host round trip; an impossible allocation throws CudaError and is not sticky") {
  const Cuda b{};
  std::vector<std::int32_t> v(12345);
  std::iota(v.begin(), v.end(), -100);
  auto d = to_device<std::int32_t>(b, v);
  CHECK(to_host(b, d.data(), d.size()) == v);
  CHECK_THROWS_AS(DeviceBuffer<char>(b, std::size_t{1} << 52), dsp::CudaError);  // 4 PiB
  auto again = to_device<std::int32_t>(b, v);  // the device still works
  CHECK(to_host(b, again.data(), again.size()) == v);
}

TEST_CASE("an event orders a second stream after the first and times the work between two events") {
  Stream first, second;
  std::vector<float> v(1 << 20, 3.0f);
  Event start, stop;
  start.record(first.backend());
  auto d = to_device<float>(first.backend(), v);
  stop.record(first.backend());
  stop.wait(second.backend());  // the copy back on `second` sees the finished upload
  std::vector<float> back(v.size());
  DSP_CUDA_CHECK(
      cudaMemcpyAsync(back.data(), d.data(), d.bytes(), cudaMemcpyDeviceToHost, second.backend().stream));
  dsp::backend::synchronize(second.backend());
  CHECK(back == v);
  stop.synchronize();
  CHECK(stop.elapsed_ms(start) >= 0.0f);
}

TEST_CASE("pinned host memory: one space behind every device space, counted in the host counters, async copies") {
  const Cuda b{};
  dsp::MemorySpace* device = dsp::backend::memory_space(b);
  dsp::MemorySpace* pinned = device->pinned_host();
  REQUIRE(pinned != nullptr);
  Stream other;
  CHECK(dsp::backend::memory_space(other.backend())->pinned_host() == pinned);
  const auto before = dsp::memory::snapshot();
  const auto device_before = dsp::memory::device_snapshot();
  {
    dsp::SpaceBuffer<float> host(1000, Category::OptimizerState, pinned), back(1000, Category::Gradients, pinned);
    CHECK(dsp::memory::snapshot()[Category::OptimizerState].live - before[Category::OptimizerState].live == 4000);
    CHECK(dsp::memory::snapshot()[Category::Gradients].live - before[Category::Gradients].live == 4000);
    CHECK(dsp::memory::device_snapshot().total.live == device_before.total.live);  // not device memory
    CHECK(std::all_of(back.data(), back.data() + 1000, [](float x) { return x == 0.0f; }));  // zeroed
    std::iota(host.data(), host.data() + 1000, 1.0f);  // host-addressable
    dsp::SpaceBuffer<float> on_device(1000, Category::Workspace, device);
    device->copy_async(on_device.data(), host.data(), 4000);
    device->copy_async(back.data(), on_device.data(), 4000);
    device->synchronize();
    CHECK(std::equal(host.data(), host.data() + 1000, back.data()));
  }
  CHECK(dsp::memory::snapshot().total.live == before.total.live);
}
