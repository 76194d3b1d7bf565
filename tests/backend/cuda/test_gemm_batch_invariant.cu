// The CUDA batch-invariant GEMM (backend/cuda/gemm_batch_invariant.cuh) against the Host kernel
// (backend/host/gemm_batch_invariant.hpp): both compute every element as one fma chain over k
// in increasing order, so they must agree bitwise (no tolerance), for shapes that cut the 64 x
// 64 tiles and the 16-k stages, with strides; a row of C is the same bitwise whatever the rows
// beside it on the device; and linear_forward takes it inside a BatchInvariantScope.
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../gradcheck.hpp"
#include "device_vectors.hpp"
#include "dsp/backend/batch_invariance.hpp"
#include "dsp/backend/cuda/gemm.hpp"
#include "dsp/backend/cuda/gemm_batch_invariant.cuh"
#include "dsp/backend/cuda/gemm_rounded.cuh"
#include "dsp/backend/cuda/memory.hpp"
#include "dsp/backend/cuda/stream.hpp"
#include "dsp/backend/host/gemm_batch_invariant.hpp"
#include "dsp/backend/linear.hpp"

namespace cuda_gemm_batch_invariant_test {

using namespace dsp;
using backend::Cuda;
using backend::Host;
using backend::Stream;
using test::on_device;
using test::on_host;

TEST_CASE("CUDA batch-invariant gemm equals the Host kernel bitwise, strided and at tile edges") {
  Stream stream;
  const Cuda b = stream.backend();
  for (const auto& [m, n, k] : {std::array<std::int64_t, 3>{1, 1100, 64}, {7, 67, 300}, {16, 128, 129},
                                {65, 33, 16}, {130, 200, 1}, {3, 5, 1031}}) {
    CAPTURE(m);
    CAPTURE(n);
    CAPTURE(k);
    const std::int64_t lda = k + 3, ldb = k + 1, ldc = n + 2;
    const auto a = test::random_vector(static_cast<std::size_t>(m * lda), 1);
    const auto w = test::random_vector(static_cast<std::size_t>(n * ldb), 2);
    std::vector<float> want(static_cast<std::size_t>(m * ldc), -7.0f);
    backend::gemm_nt_batch_invariant(Host{}, m, n, k, a.data(), lda, w.data(), ldb, want.data(), ldc);
    const auto da = on_device(b, a), dw = on_device(b, w);
    auto dc = on_device(b, std::vector<float>(want.size(), -7.0f));
    backend::gemm_nt_batch_invariant(b, m, n, k, da.data(), lda, dw.data(), ldb, dc.data(), ldc);
    const std::vector<float> got = on_host(dc);
    CHECK(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0);  // the stride gaps too
  }
}

TEST_CASE("CUDA batch-invariant gemm: a row is the same bitwise for every m and position; linear_forward in a scope") {
  Stream stream;
  const Cuda b = stream.backend();
  const std::int64_t n = 300, k = 257;
  const auto a = test::random_vector(static_cast<std::size_t>(100 * k), 3);
  const auto w = test::random_vector(static_cast<std::size_t>(n * k), 4);
  const auto da = on_device(b, a), dw = on_device(b, w);
  auto alone = on_device(b, std::vector<float>(static_cast<std::size_t>(n)));
  backend::gemm_nt_batch_invariant(b, 1, n, k, da.data() + 37 * k, k, dw.data(), k, alone.data(), n);
  const std::vector<float> want = on_host(alone);
  for (std::int64_t m : {38, 64, 65, 100}) {  // row 37 of A first in the tile, mid-tile, ...
    CAPTURE(m);
    auto dc = on_device(b, std::vector<float>(static_cast<std::size_t>(m * n)));
    backend::gemm_nt_batch_invariant(b, m, n, k, da.data(), k, dw.data(), k, dc.data(), n);
    const std::vector<float> c = on_host(dc);
    CHECK(std::memcmp(c.data() + 37 * n, want.data(), want.size() * sizeof(float)) == 0);
  }
  auto scoped = on_device(b, std::vector<float>(static_cast<std::size_t>(n)));
  {
    const backend::BatchInvariantScope scope;
    backend::linear_forward(b, da.data() + 37 * k, dw.data(), scoped.data(), 1, k, n);
  }
  CHECK(on_host(scoped) == want);
}

}  // namespace cuda_gemm_batch_invariant_test
