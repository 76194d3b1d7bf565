// NcclComm on one GPU: a communicator of one rank (NCCL refuses two ranks on one device), so
// every collective is the identity or a copy, checked exactly; plus the ordering against a
// delayed compute stream, Works that outlive a move, split, host memory through the blocking
// forms, and the errors for bad sizes.
// Reductions across ranks are tested in test_nccl_multi_gpu (two GPUs or more).
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "../../backend/cuda/device_vectors.hpp"
#include "dsp/backend/cuda/memory.hpp"
#include "dsp/backend/cuda/stream.hpp"
#include "dsp/comm/communicator.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/comm/nccl_comm.hpp"

using dsp::backend::Cuda;
using dsp::backend::DeviceBuffer;
using dsp::comm::NcclComm;
using dsp::comm::ThreadComm;
using dsp::test::on_device;
using dsp::test::on_host;

static_assert(dsp::comm::Communicator<NcclComm>);

namespace {
std::vector<float> iota_vector(std::size_t n, float start) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}
}  // namespace

TEST_CASE("NcclComm of one rank: every collective on device memory, ordered on the compute stream") {
  dsp::comm::launch(1, [](ThreadComm& world) {
    DSP_CUDA_CHECK(cudaSetDevice(0));
    dsp::backend::Stream compute;
    const Cuda b = compute.backend();
    NcclComm nccl = NcclComm::create(world, b);
    CHECK(nccl.rank() == 0);
    CHECK(nccl.size() == 1);

    const auto v = iota_vector(1000, -3.0f);
    auto d = on_device(b, v);
    nccl.all_reduce(std::span<float>(d.data(), d.size()));
    CHECK(to_host(b, d.data(), d.size()) == v);

    DeviceBuffer<float> gathered(b, v.size()), scattered(b, v.size());
    nccl.all_gather(std::span<const float>(d.data(), d.size()), std::span<float>(gathered.data(), gathered.size()));
    nccl.reduce_scatter(std::span<const float>(gathered.data(), gathered.size()),
                        std::span<float>(scattered.data(), scattered.size()));
    CHECK(to_host(b, scattered.data(), scattered.size()) == v);

    std::vector<dsp::bf16> h16(64);
    for (std::size_t i = 0; i < h16.size(); ++i) h16[i] = dsp::bf16(float(i) / 4);
    auto d16 = on_device(b, h16);
    nccl.broadcast(std::span<dsp::bf16>(d16.data(), d16.size()), 0);
    const auto back16 = to_host(b, d16.data(), d16.size());
    for (std::size_t i = 0; i < h16.size(); ++i) CHECK(back16[i].bits == h16[i].bits);

    DeviceBuffer<float> received(b, v.size());
    nccl.all_to_all_v(std::span<const float>(d.data(), d.size()), {std::int64_t(v.size())},
                      std::span<float>(received.data(), received.size()), {std::int64_t(v.size())});
    CHECK(to_host(b, received.data(), received.size()) == v);

    // The async form, waited for after a move of the communicator.
    auto d2 = on_device(b, v);
    dsp::comm::Work w = nccl.all_reduce_async(std::span<float>(d2.data(), d2.size()), dsp::comm::ReduceOp::Max);
    NcclComm moved = std::move(nccl);
    CHECK(nccl.size() == 0);
    CHECK(!nccl.valid());
    w.wait();
    CHECK(to_host(b, d2.data(), d2.size()) == v);
    moved.barrier();

    NcclComm sub = moved.split(0, 0);
    CHECK(sub.size() == 1);
    sub.all_reduce(std::span<float>(d.data(), d.size()));
    CHECK(to_host(b, d.data(), d.size()) == v);

    CHECK_THROWS_WITH_AS(moved.all_gather(std::span<const float>(d.data(), 10), std::span<float>(gathered.data(), 11)),
                         "all_gather: 11 elements are not 1 blocks of 10", dsp::CommError);
    CHECK_THROWS_AS(moved.split(-1, 0), dsp::CommError);
    CHECK_THROWS_AS(nccl.barrier(), dsp::CommError);  // moved-from: empty
  });
}

TEST_CASE("NcclComm blocking operations (all_to_all_v and char broadcasts too) take host memory through a device copy; the async forms refuse it") {
  dsp::comm::launch(1, [](ThreadComm& world) {
    DSP_CUDA_CHECK(cudaSetDevice(0));
    dsp::backend::Stream compute;
    const Cuda b = compute.backend();
    NcclComm nccl = NcclComm::create(world, b);
    // outputs start at zero, so a result not copied back is seen
    const std::vector<double> in{1.5, -2.0, 3.25};
    std::vector<double> gathered(3, 0.0), scattered(3, 0.0);
    nccl.all_gather(std::span<const double>(in), std::span<double>(gathered));
    CHECK(gathered == in);
    nccl.reduce_scatter(std::span<const double>(gathered), std::span<double>(scattered));
    CHECK(scattered == in);
    // host in, device out and the reverse
    DeviceBuffer<double> d(b, 3);
    nccl.all_gather(std::span<const double>(in), std::span<double>(d.data(), 3));
    CHECK(to_host(b, d.data(), 3) == in);
    std::vector<double> back(3, 0.0);
    nccl.all_gather(std::span<const double>(d.data(), 3), std::span<double>(back));
    CHECK(back == in);
    std::vector<std::int64_t> counts{7, -1};
    nccl.all_reduce(std::span(counts), dsp::comm::ReduceOp::Max);
    nccl.broadcast(std::span(counts), 0);
    CHECK(counts == std::vector<std::int64_t>{7, -1});
    std::string text = "ckpt.tmp";  // chars, as save_checkpoint broadcasts its staging path
    nccl.broadcast(std::span(text.data(), text.size()), 0);
    CHECK(text == "ckpt.tmp");
    const std::vector<float> sent{1.0f, 2.0f};
    std::vector<float> received(2, 0.0f);
    nccl.all_to_all_v(std::span<const float>(sent), {2}, std::span<float>(received), {2});
    CHECK(received == sent);
    CHECK_THROWS_WITH_AS(nccl.all_reduce_async(std::span(counts)), doctest::Contains("host memory"), dsp::CommError);
    CHECK_THROWS_AS(nccl.all_gather_async(std::span<const double>(in), std::span<double>(d.data(), 3)), dsp::CommError);
  });
}

namespace {
void CUDART_CB sleep_50ms(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(50)); }
}  // namespace

TEST_CASE("NcclComm operations wait for the compute stream's earlier work, and later work waits for them") {
  dsp::comm::launch(1, [](ThreadComm& world) {
    DSP_CUDA_CHECK(cudaSetDevice(0));
    dsp::backend::Stream compute;
    const Cuda b = compute.backend();
    NcclComm nccl = NcclComm::create(world, b);
    const std::size_t n = 1 << 20;
    DeviceBuffer<float> in(b, n), out(b, n);
    DSP_CUDA_CHECK(cudaMemsetAsync(in.data(), 0, n * sizeof(float), b.stream));
    DSP_CUDA_CHECK(cudaMemsetAsync(out.data(), 0, n * sizeof(float), b.stream));
    // The compute stream is held up for 50 ms, then writes the pattern: an all_gather that did
    // not wait for it would copy the zeros.
    DSP_CUDA_CHECK(cudaLaunchHostFunc(b.stream, sleep_50ms, nullptr));
    DSP_CUDA_CHECK(cudaMemsetAsync(in.data(), 0x3f, n * sizeof(float), b.stream));
    nccl.all_gather(std::span<const float>(in.data(), n), std::span<float>(out.data(), n));
    // Later compute work (this copy) must see the gathered pattern.
    const auto got = to_host(b, out.data(), n);
    std::uint32_t bits = 0;
    std::memcpy(&bits, &got[n - 1], sizeof bits);
    CHECK(bits == 0x3f3f3f3fu);
    std::memcpy(&bits, &got[0], sizeof bits);
    CHECK(bits == 0x3f3f3f3fu);
  });
}
