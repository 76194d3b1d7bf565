// Single-precision GEMM through CBLAS (OpenBLAS): the machine's measured compute peak, the
// denominator the trainer's MFU is taken against.
//
// sgemm/n:N/threads:T computes C = A B with A, B, C row-major N x N fp32 matrices
// (cblas_sgemm, alpha 1, beta 0) with OpenBLAS limited to T threads
// (openblas_set_num_threads; T = 1 and T = all hardware threads).
//   time     wall time of one cblas_sgemm call (manual timing, steady_clock)
//   GFLOPs   2 N^3 / time / 1e9: one multiply and one add per (i, j, k) term, i.e. the
//            2mnk convention (m = n = k = N) that MFU and every BLAS benchmark use;
//            1 GFLOP = 1e9 floating-point operations
//   wrong    1 when C differs from the closed form. Inputs: A[i][k] = (i + k) mod 4,
//            B[k][j] = 1, so C[i][j] = sum_k ((i + k) mod 4), exact in fp32 (< 2^24);
//            checked on the last result.
// The label is openblas_get_corename(): the kernel set in use (see RESULTS.md: OpenBLAS 0.3.21
// does not know this machine's CPU and falls back to "Prescott" unless OPENBLAS_CORETYPE is set).
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

namespace {

void BM_sgemm(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  const auto nn = static_cast<std::size_t>(n) * static_cast<std::size_t>(n);
  std::vector<float> a(nn), b(nn, 1.0f), c(nn, 0.0f);
  for (int i = 0; i < n; ++i)
    for (int k = 0; k < n; ++k) a[std::size_t(i) * std::size_t(n) + std::size_t(k)] = float((i + k) % 4);

  openblas_set_num_threads(threads);
  // One untimed call first: OpenBLAS allocates its buffers and starts its threads lazily.
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
  // The kernel set OpenBLAS chose (DYNAMIC_ARCH builds pick it from the CPU at load time, or
  // from OPENBLAS_CORETYPE): a CPU newer than the OpenBLAS release falls back to a generic
  // kernel, which RESULTS.md shows is several times slower.
  state.SetLabel(openblas_get_corename());
  double seconds = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f,
                c.data(), n);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(dt);
    seconds += dt;
    benchmark::ClobberMemory();
  }

  // Closed form: row i of A holds each residue (i + k) mod 4 N/4 times when 4 | N.
  std::int64_t wrong = 0;
  for (int i = 0; i < n; ++i) {
    double expect = 0;
    for (int k = 0; k < n; ++k) expect += (i + k) % 4;
    for (int j = 0; j < n; ++j) wrong += c[std::size_t(i) * std::size_t(n) + std::size_t(j)] != float(expect);
  }
  const double flops = 2.0 * double(n) * double(n) * double(n);  // 2mnk
  state.counters["GFLOPs"] = seconds > 0 ? flops * double(state.iterations()) / seconds / 1e9 : 0.0;
  state.counters["wrong"] = double(wrong);
}

void gemm_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "threads"});
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int n : {512, 1024, 2048}) {
    b->Args({n, 1});
    if (cores > 1) b->Args({n, cores});
  }
}
BENCHMARK(BM_sgemm)->Name("sgemm")->Apply(gemm_args)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
