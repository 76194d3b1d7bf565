// bf16 GEMM on the GPU at the shapes of a transformer layer: dsp's gemm(Cuda, ...) against the
// bare cublasGemmEx call it wraps, so the cost of dsp's layer (checks, handle lookup, stream
// binding) shows as the ratio of the two. Needs a CUDA device; without one every case reports
// "no CUDA device" as its error.
//
// gemm_bf16/<shape>/<impl> computes C[m, n] = op(A)[m, k] op(B)[k, n], A, B and C bf16,
// fp32 accumulation (CUBLAS_COMPUTE_32F), alpha 1, beta 0; impl `dsp` calls
// dsp::backend::gemm(Cuda, ...), impl `cublas` calls cublasGemmEx with the same arguments on
// its own handle.
//   time     GPU time of one call: CUDA events around `batch` back-to-back calls, divided by
//            batch (manual time)
//   TFLOPs   2 m n k / time / 1e12 (the 2mnk convention MFU uses; 1 TFLOP = 1e12 operations)
//   wrong    elements of the last C that differ from the closed form. Inputs: A stored with
//            element [r][c] = (r + c) mod 4 (symmetric in r and c, so op(A)[i][p] = (i + p) mod 4
//            either way round) and B = 1, so C[i][j] = sum_p (i + p) mod 4 = 1.5 k when 4 | k:
//            exact in the fp32 accumulator and in bf16 for every k here.
// Shapes: one layer of a 0.9B-parameter model (hidden 2048, SwiGLU ffn 5632, micro batch 4 x
// sequence 2048 = 8192 tokens): the forward GEMMs (x W), the input gradients (dy W^T) and the
// weight gradients (x^T dy), plus 8192^3 for the large-GEMM peak.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dsp/backend/cuda/device.hpp"
#include "dsp/backend/cuda/gemm.hpp"
#include "dsp/backend/cuda/memory.hpp"
#include "dsp/backend/cuda/stream.hpp"

namespace {

using dsp::bf16;
using dsp::backend::Cuda;
using dsp::backend::DeviceBuffer;

struct Shape {
  std::string name;
  bool trans_a, trans_b;
  std::int64_t m, n, k;
};

std::vector<Shape> shapes() {
  const std::int64_t tokens = 8192, hidden = 2048, ffn = 5632;
  return {
      {"qkv_fwd", false, false, tokens, 3 * hidden, hidden},
      {"attn_out_fwd", false, false, tokens, hidden, hidden},
      {"gate_up_fwd", false, false, tokens, 2 * ffn, hidden},
      {"down_fwd", false, false, tokens, hidden, ffn},
      {"gate_up_dgrad", false, true, tokens, hidden, 2 * ffn},
      {"gate_up_wgrad", true, false, hidden, 2 * ffn, tokens},
      {"square_8192", false, false, 8192, 8192, 8192},
  };
}

// Row-major C = op(A) op(B) as the column-major C^T = op(B)^T op(A)^T: the call dsp makes.
void bare_cublas(cublasHandle_t h, const Shape& s, const bf16* a, std::int64_t lda, const bf16* b, std::int64_t ldb,
                 bf16* c) {
  const float alpha = 1.0f, beta = 0.0f;
  DSP_CUBLAS_CHECK(cublasGemmEx(h, s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                int(s.n), int(s.m), int(s.k), &alpha, b, CUDA_R_16BF, int(ldb), a, CUDA_R_16BF,
                                int(lda), &beta, c, CUDA_R_16BF, int(s.n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void BM_gemm_bf16(benchmark::State& state, const Shape& s, bool use_dsp) {
  std::string why;
  if (dsp::backend::device_count(&why) == 0) {
    state.SkipWithError(("no CUDA device: " + why).c_str());
    return;
  }
  dsp::backend::Stream stream;
  const Cuda b = stream.backend();
  const std::int64_t a_rows = s.trans_a ? s.k : s.m, a_cols = s.trans_a ? s.m : s.k;
  const std::int64_t b_rows = s.trans_b ? s.n : s.k, b_cols = s.trans_b ? s.k : s.n;
  std::vector<bf16> ha(std::size_t(a_rows * a_cols));
  for (std::int64_t r = 0; r < a_rows; ++r)
    for (std::int64_t c = 0; c < a_cols; ++c) ha[std::size_t(r * a_cols + c)] = bf16(float((r + c) % 4));
  auto da = dsp::backend::to_device<bf16>(b, ha);
  auto db = dsp::backend::to_device<bf16>(b, std::vector<bf16>(std::size_t(b_rows * b_cols), bf16(1.0f)));
  DeviceBuffer<bf16> dc(b, std::size_t(s.m * s.n));
  cublasHandle_t handle = nullptr;
  DSP_CUBLAS_CHECK(cublasCreate(&handle));
  DSP_CUBLAS_CHECK(cublasSetStream(handle, b.stream));
  auto call = [&] {
    if (use_dsp)
      gemm(b, s.trans_a, s.trans_b, s.m, s.n, s.k, 1.0f, da.data(), a_cols, db.data(), b_cols, 0.0f, dc.data(), s.n);
    else
      bare_cublas(handle, s, da.data(), a_cols, db.data(), b_cols, dc.data());
  };
  // Warm-up: cuBLAS picks and loads its kernel on the first call; then about 20 ms per batch.
  call();
  dsp::backend::Event start, stop;
  start.record(b);
  call();
  stop.record(b);
  stop.synchronize();
  const int batch = std::max(1, int(20.0f / std::max(stop.elapsed_ms(start), 1e-3f)));
  double seconds = 0;
  for (auto _ : state) {
    start.record(b);
    for (int i = 0; i < batch; ++i) call();
    stop.record(b);
    stop.synchronize();
    const double dt = stop.elapsed_ms(start) / 1e3 / batch;
    state.SetIterationTime(dt);
    seconds += dt;
  }
  const auto c = dsp::backend::to_host(b, dc.data(), dc.size());
  std::int64_t wrong = 0;
  for (std::int64_t i = 0; i < s.m; ++i) {
    double expect = 0;
    for (std::int64_t p = 0; p < s.k; ++p) expect += double((i + p) % 4);
    for (std::int64_t j = 0; j < s.n; ++j) wrong += float(c[std::size_t(i * s.n + j)]) != float(expect);
  }
  DSP_CUBLAS_CHECK(cublasDestroy(handle));
  const double flops = 2.0 * double(s.m) * double(s.n) * double(s.k);
  state.counters["TFLOPs"] = seconds > 0 ? flops * double(state.iterations()) / seconds / 1e12 : 0.0;
  state.counters["wrong"] = double(wrong);
  state.counters["batch"] = batch;
}

}  // namespace

int main(int argc, char** argv) {
  for (const Shape& s : shapes())
    for (bool use_dsp : {true, false})
      benchmark::RegisterBenchmark(("gemm_bf16/" + s.name + (use_dsp ? "/dsp" : "/cublas")).c_str(),
                                   [s, use_dsp](benchmark::State& st) { BM_gemm_bf16(st, s, use_dsp); })
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
