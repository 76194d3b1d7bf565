// NcclComm across GPUs (needs at least two; ctest reports it skipped otherwise): ranks are
// threads, one device each, with rank-valued inputs checked against closed forms.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../../backend/cuda/device_vectors.hpp"
#include "dsp/backend/cuda/device.hpp"
#include "dsp/backend/cuda/memory.hpp"
#include "dsp/backend/cuda/stream.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/comm/nccl_comm.hpp"

using dsp::backend::Cuda;
using dsp::backend::DeviceBuffer;
using dsp::comm::NcclComm;
using dsp::comm::ThreadComm;
using dsp::test::on_device;

TEST_CASE("NcclComm on every GPU (up to 4): all_reduce, all_gather, reduce_scatter, broadcast, ring, all_to_all_v, split") {
  const int n = std::min(dsp::backend::device_count(), 4);
  REQUIRE(n >= 2);
  dsp::comm::launch(n, [n](ThreadComm& world) {
    const int r = world.rank();
    DSP_CUDA_CHECK(cudaSetDevice(r));
    dsp::backend::Stream compute;
    const Cuda b = compute.backend();
    NcclComm nccl = NcclComm::create(world, b);
    REQUIRE(nccl.rank() == r);
    REQUIRE(nccl.size() == n);
    const std::size_t len = 4099;

    // all_reduce of x_i = r + i: n i + n(n-1)/2 (small integers: exact in fp32).
    std::vector<float> x(len);
    for (std::size_t i = 0; i < len; ++i) x[i] = float(r) + float(i);
    auto d = on_device(b, x);
    nccl.all_reduce(std::span<float>(d.data(), len));
    const auto sum = to_host(b, d.data(), len);
    for (std::size_t i = 0; i < len; ++i) CHECK(sum[i] == float(n) * float(i) + float(n * (n - 1) / 2));
    // the same sum of host memory (a trainer's loss sums and norms), staged through the device
    std::vector<double> host_sum{double(r), 1.0};
    nccl.all_reduce(std::span(host_sum));
    CHECK(host_sum == std::vector<double>{double(n * (n - 1) / 2), double(n)});
    // Max and Min (async, waited for), and a bf16 sum of small integers (exact in bf16).
    auto mx = on_device(b, x), mn = on_device(b, x);
    dsp::comm::Work wmax = nccl.all_reduce_async(std::span<float>(mx.data(), len), dsp::comm::ReduceOp::Max);
    nccl.all_reduce(std::span<float>(mn.data(), len), dsp::comm::ReduceOp::Min);
    wmax.wait();
    const auto hmax = to_host(b, mx.data(), len), hmin = to_host(b, mn.data(), len);
    for (std::size_t i = 0; i < len; ++i) {
      CHECK(hmax[i] == float(n - 1) + float(i));
      CHECK(hmin[i] == float(i));
    }
    std::vector<dsp::bf16> h16(64);
    for (std::size_t i = 0; i < h16.size(); ++i) h16[i] = dsp::bf16(float(r + 1) * float(i % 4));
    auto d16 = on_device(b, h16);
    nccl.all_reduce(std::span<dsp::bf16>(d16.data(), h16.size()));
    const auto s16 = to_host(b, d16.data(), h16.size());
    for (std::size_t i = 0; i < h16.size(); ++i) CHECK(float(s16[i]) == float(n * (n + 1) / 2) * float(i % 4));

    // all_gather of a block of r's, then reduce_scatter of it: block r of the sum is n r.
    auto mine = on_device(b, std::vector<float>(len, float(r)));
    DeviceBuffer<float> all(b, len * n), block(b, len);
    nccl.all_gather(std::span<const float>(mine.data(), len), std::span<float>(all.data(), all.size()));
    const auto g = to_host(b, all.data(), all.size());
    for (int p = 0; p < n; ++p) CHECK(g[std::size_t(p) * len] == float(p));
    nccl.reduce_scatter(std::span<const float>(all.data(), all.size()), std::span<float>(block.data(), len));
    CHECK(to_host(b, block.data(), len) == std::vector<float>(len, float(n) * float(r)));

    // broadcast from the last rank; a ring of send/recv.
    auto c = on_device(b, std::vector<float>(len, float(r)));
    nccl.broadcast(std::span<float>(c.data(), len), n - 1);
    CHECK(to_host(b, c.data(), len) == std::vector<float>(len, float(n - 1)));
    // Sends are not buffered: even ranks send first, odd ranks receive first (no cycle of
    // unmatched sends).
    DeviceBuffer<float> from_left(b, len);
    const auto send_right = [&] { nccl.send(std::span<const float>(mine.data(), len), (r + 1) % n); };
    const auto recv_left = [&] { nccl.recv(std::span<float>(from_left.data(), len), (r + n - 1) % n); };
    if (r % 2 == 0) {
      send_right();
      recv_left();
    } else {
      recv_left();
      send_right();
    }
    CHECK(to_host(b, from_left.data(), len) == std::vector<float>(len, float((r + n - 1) % n)));

    // all_to_all_v: rank r sends r + q + 1 copies of 100 r + q to rank q.
    std::vector<std::int64_t> send_counts(n), recv_counts(n);
    std::vector<float> out_host;
    for (int q = 0; q < n; ++q) {
      send_counts[q] = r + q + 1;
      recv_counts[q] = q + r + 1;
      out_host.insert(out_host.end(), std::size_t(r + q + 1), float(100 * r + q));
    }
    auto in = on_device(b, out_host);
    DeviceBuffer<float> received(b, out_host.size());
    nccl.all_to_all_v(std::span<const float>(in.data(), in.size()), send_counts,
                      std::span<float>(received.data(), received.size()), recv_counts);
    const auto got = to_host(b, received.data(), received.size());
    std::size_t at = 0;
    for (int q = 0; q < n; ++q)
      for (int k = 0; k < q + r + 1; ++k) CHECK(got[at++] == float(100 * q + r));

    // split by parity: the even and the odd ranks each sum their ranks.
    NcclComm half = nccl.split(r % 2, r);
    auto one = on_device(b, std::vector<float>{float(r)});
    half.all_reduce(std::span<float>(one.data(), 1));
    float expect = 0;
    for (int p = r % 2; p < n; p += 2) expect += float(p);
    CHECK(to_host(b, one.data(), 1)[0] == expect);
    nccl.barrier();
  });
}
