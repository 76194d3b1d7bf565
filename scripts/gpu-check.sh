#!/usr/bin/env bash
# One GPU check: builds the CUDA backend for this GPU, runs the GPU tests (which must run, not
# skip), then benchmarks, and writes everything to one results file (default gpu-check.md, or
# the first argument). Target: under 8 minutes on one H200.
#
#   bash scripts/gpu-check.sh [results.md]
#
# Needs what scripts/setup.sh installs (cmake, OpenBLAS, doctest, Google Benchmark, nlohmann-json,
# zlib) plus the CUDA toolkit and a driver; it installs nothing itself, because the GPU machine
# may have no network. Builds only for the GPU it finds (its compute capability), in
# build/gpu-check.
#
# What it measures:
#   - bf16 GEMM TFLOP/s at a transformer layer's shapes, dsp's gemm against the bare cuBLAS call
#     (bench_gemm_cuda);
#   - fp32 and bf16 mixed-precision training steps of a 0.78B model on device memory, each with
#     the materialising and the flash attention: tokens/s, TFLOP/s, MFU, and peak device memory
#     against the ledger (bench_train_step_cuda);
#   - causal attention: the tiled memory-efficient kernels against the materialising op, forward
#     and forward + backward, fp32 and in a bf16 matmul scope (the tensor-core flash kernels),
#     TFLOP/s and memory held for backward (bench_attention_cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check.md}
build=build/gpu-check
start=$SECONDS

# Preflight: everything the build needs, named when missing (no network on the GPU machine).
if ! command -v nvcc > /dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
# Libraries carried from a development machine (scripts/gpu-deps.sh), when there.
cmake_deps=()
if [[ -d .gpu-deps/root/usr ]]; then
  deps=$PWD/.gpu-deps/root/usr
  arch_lib=$deps/lib/x86_64-linux-gnu
  export CPATH=$deps/include:$deps/include/x86_64-linux-gnu/openblas-pthread${CPATH:+:$CPATH}
  export LIBRARY_PATH=$arch_lib:$arch_lib/openblas-pthread${LIBRARY_PATH:+:$LIBRARY_PATH}
  export LD_LIBRARY_PATH=$arch_lib:$arch_lib/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  cmake_deps=(-DCMAKE_PREFIX_PATH="$deps" -DBLAS_LIBRARIES="$arch_lib/openblas-pthread/libopenblas.so")
  echo "=== gpu-check: using the carried libraries in $deps"
fi
# NCCL from PyTorch's wheel (nvidia-nccl-cu13) where the toolkit has none beside it.
if [[ ! -e /usr/local/cuda/include/nccl.h ]]; then
  nccl=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2> /dev/null || true)
  if [[ -n $nccl && -e $nccl/include/nccl.h && -e $nccl/lib/libnccl.so.2 ]]; then
    cmake_deps+=(-DDSP_NCCL_INCLUDE_DIR="$nccl/include" -DDSP_NCCL_LIBRARY="$nccl/lib/libnccl.so.2")
    export LD_LIBRARY_PATH=$nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    echo "=== gpu-check: using NCCL from $nccl"
  fi
fi
missing=()
for tool in nvidia-smi nvcc cmake python3 c++; do
  command -v "$tool" > /dev/null || missing+=("$tool")
done
for header in cblas.h doctest/doctest.h benchmark/benchmark.h nlohmann/json.hpp zlib.h CLI/CLI.hpp; do
  printf '#include <%s>\n' "$header" | c++ -E -x c++ - > /dev/null 2>&1 || missing+=("$header")
done
if ((${#missing[@]})); then
  echo "gpu-check: missing here: ${missing[*]} (scripts/setup.sh installs the libraries from Debian;" \
    "where there is no network, carry .gpu-deps made by scripts/gpu-deps.sh)" >&2
  exit 1
fi
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
[[ $cc =~ ^[0-9]+$ ]] || { echo "gpu-check: cannot read the GPU's compute capability (got '$cc')" >&2; exit 1; }

{
  echo "# dsp GPU check ($(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2> /dev/null || echo unknown))"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv
  nvcc --version | tail -1
  echo '```'
} > "$out"

echo "=== gpu-check: configure and build for sm_$cc"
mkdir -p "$build"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DDSP_ENABLE_CUDA=ON -DDSP_ENABLE_MPI=OFF \
  -DCMAKE_CUDA_ARCHITECTURES="$cc" "${cmake_deps[@]}" > "$build/configure.log" 2>&1 ||
  { cat "$build/configure.log"; exit 1; }
cmake --build "$build" -j"$(nproc)" --target dsp_cuda_tests bench_gemm_cuda bench_attention_cuda \
  bench_train_step_cuda

echo "=== gpu-check: GPU tests"
ctest_log=$(mktemp)
set +e
gpus=$(nvidia-smi -L | grep -c '^GPU')
exclude=()
((gpus >= 2)) || exclude=(-E multi_gpu)  # the tests that need two GPUs skip themselves on one
ctest --test-dir "$build" -L gpu "${exclude[@]}" --output-on-failure --no-tests=error --timeout 300 2>&1 |
  tee "$ctest_log"
ctest_rc=${PIPESTATUS[0]}
set -e
{
  echo
  echo "## GPU tests (ctest -L gpu ${exclude[*]}; $gpus GPU(s))"
  echo
  echo '```'
  grep -E 'tests passed|tests failed|Skipped|Failed|\*\*\*' "$ctest_log" || true
  echo '```'
} >> "$out"
# Here a skipped GPU test is a failure: it means the test binary saw no device. The benchmark
# still runs (device time is scarce; its `wrong` column checks its own results).
tests_ok=1
if [[ $ctest_rc -ne 0 ]] || grep -q 'Skipped' "$ctest_log"; then
  tests_ok=0
  echo "gpu-check: GPU tests failed or skipped (see above); going on to the benchmark" >&2
  # What failed goes into the results file too: it may be all that comes back from the GPU
  # machine. A CUDA test that crashed (or any failed one, when the log shows a CUDA error) is
  # rerun once under compute-sanitizer where the toolkit has it, which names the kernel, the
  # thread and the bad address (a plain numerical failure is not: device time is scarce).
  failed=$(grep -E '^[[:space:]]*[0-9]+ - [^ ]+ \((Failed|SEGFAULT|Subprocess aborted|Exception|Timeout|Child aborted|ILLEGAL|OTHER_FAULT|NUMERICAL|INTERRUPT)' \
    "$ctest_log" | sed -E 's/^[[:space:]]*[0-9]+ - ([^ ]+) .*/\1/' | sort -u || true)
  faulted=()
  for name in $failed; do
    [[ -e tests/$name.cu ]] || continue
    if grep -qE "^[[:space:]]*[0-9]+ - $name \((SEGFAULT|Subprocess aborted|Child aborted|ILLEGAL|OTHER_FAULT)" "$ctest_log" ||
      grep -qiE 'CudaError|illegal memory|misaligned|unspecified launch failure' "$ctest_log"; then
      faulted+=("$name")
    fi
  done
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2> /dev/null || true)
  {
    echo
    echo "### What failed (doctest and CUDA error lines)"
    echo
    echo '```'
    grep -E 'ERROR|FATAL|values:|logged:|CudaError|CUDA error|error:' "$ctest_log" | head -80 || true
    echo '```'
    for name in "${faulted[@]:0:2}"; do  # at most two
      [[ -n $sanitizer ]] || break
      echo
      echo "### compute-sanitizer memcheck: $name"
      echo
      echo '```'
      timeout 90 "$sanitizer" --tool memcheck --print-limit 8 "$build/tests/dsp_cuda_tests" \
        --source-file="*/$name.cu" --no-version 2>&1 | tail -60 || true
      echo '```'
    done
  } >> "$out"
fi

echo "=== gpu-check: bf16 GEMM"
"$build/benchmarks/bench_gemm_cuda" --benchmark_min_time=0.2 --benchmark_out="$build/gemm.json" \
  --benchmark_out_format=json
python3 - "$build/gemm.json" >> "$out" << 'PY'
import json, sys
rows = {}
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    _, shape, impl = b["name"].split("/")[:3]
    rows.setdefault(shape, {})[impl] = b
print("\n## bf16 GEMM (bench_gemm_cuda, TFLOP/s = 2mnk / time / 1e12)\n")
print("| shape | dsp TFLOP/s | cuBLAS TFLOP/s | dsp / cuBLAS | wrong |")
print("| --- | ---: | ---: | ---: | ---: |")
for shape, r in rows.items():
    d, c = r.get("dsp", {}), r.get("cublas", {})
    errors = sorted({x["error_message"] for x in (d, c) if x.get("error_occurred")})
    if errors or "TFLOPs" not in d or "TFLOPs" not in c:
        print(f"| {shape} | error: {'; '.join(errors) or 'missing result'} | | | |")
        continue
    print(f"| {shape} | {d['TFLOPs']:.0f} | {c['TFLOPs']:.0f} | {d['TFLOPs'] / c['TFLOPs']:.3f} | "
          f"{int(d['wrong'] + c['wrong'])} |")
PY

echo "=== gpu-check: attention"
"$build/benchmarks/bench_attention_cuda" --benchmark_min_time=0.2 --benchmark_out="$build/attention.json" \
  --benchmark_out_format=json || true
python3 - "$build/attention.json" >> "$out" << 'PY'
import json, sys
print("\n## causal attention, fp32 and bf16 scope, batch 2, 12 heads, head_dim 128 (bench_attention_cuda; see its header)\n")
try:
    runs = json.load(open(sys.argv[1]))["benchmarks"]
except (OSError, ValueError) as e:
    runs = []
    print(f"no result: {e}")
print("| case | ms | TFLOP/s | max rel diff vs the other impl | held for backward MB |")
print("| --- | ---: | ---: | ---: | ---: |")
for b in runs:
    if b.get("error_occurred"):
        print(f"| {b['name']} | error: {b['error_message']} | | | |")
        continue
    print(f"| {b['name']} | {b['real_time']:.2f} | {b['TFLOPs']:.1f} | {b['max_rel_diff']:.1e} | {b['held_MB']:.2f} |")
PY

echo "=== gpu-check: training steps (fp32, bf16 mixed precision)"
"$build/benchmarks/bench_train_step_cuda" --benchmark_out="$build/train.json" --benchmark_out_format=json || true
python3 - "$build/train.json" >> "$out" << 'PY'
import json, sys
print("\n## training step, 0.78B model, one GPU, fp32 and bf16 mixed precision (bench_train_step_cuda; see its header)\n")
try:
    runs = json.load(open(sys.argv[1]))["benchmarks"]
except (OSError, ValueError) as e:
    runs = []
    print(f"no result: {e}")
print("| case | ms/step | tokens/s | TFLOP/s | MFU vs fp32 peak | MFU vs bf16 peak | peak GB | ledger GB |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for b in runs:
    if b.get("error_occurred"):
        print(f"| {b['name']} | error: {b['error_message']} | | | | | | |")
        continue
    print(f"| {b['name']} | {b['real_time']:.0f} | {b['tokens/s']:.0f} | {b['TFLOPs']:.1f} | {b['MFU_fp32']:.3f} | "
          f"{b['MFU_bf16']:.3f} | {b['peak_GB']:.2f} | {b['ledger_GB']:.2f} |")
PY

{
  echo
  echo "gpu-check took $((SECONDS - start)) s."
} >> "$out"
echo "=== gpu-check: done in $((SECONDS - start)) s; results in $out"
((tests_ok)) || { echo "gpu-check: FAILED: GPU tests failed or skipped" >&2; exit 1; }
