#!/usr/bin/env bash
# One GPU check: builds the CUDA backend for this GPU, runs the GPU tests (which must run, not
# skip), then benchmarks, and writes everything to one results file (default gpu-check.md, or
# the first argument) and its logs to a folder beside it (gpu-check-logs/: build.log, ctest.log,
# bench.log, sanitizer.log), made anew each run. Target: under 8 minutes on one H200.
#
#   bash scripts/gpu-check.sh [results.md]
#   DSP_GPU_CHECK_BUDGET_S=510 bash scripts/gpu-check.sh $OUT/gpu-check.md   # a lent GPU, 540 s call
#
# The results file may be all that comes back from a lent GPU, so it is written from the first
# second on: its header, a line as each phase starts (the last one says where a killed run was),
# each section as soon as its phase ends, and why the run stopped (a failed preflight, configure
# or build puts the reason and the log's tail there). Every phase after the build runs under a
# time limit cut from the budget, DSP_GPU_CHECK_BUDGET_S seconds (default 510, for a 540 s call),
# so the script ends on its own and writes its last lines before an outer limit kills it. A phase
# that fails or times out is reported and the next one runs. Order: GPU tests, bf16 GEMM,
# attention, the training steps (bf16 with the flash kernels first: the MFU figure), then, where
# tests failed with a CUDA fault, up to two of them again under compute-sanitizer.
#
# Needs what scripts/setup.sh installs (cmake, OpenBLAS, doctest, Google Benchmark, nlohmann-json,
# zlib, CLI11) plus the CUDA toolkit and a driver; it installs nothing itself, because the GPU
# machine may have no network: there, carry .gpu-deps made here by scripts/gpu-deps.sh. Builds only
# for the GPU it finds (its compute capability), in build/gpu-check, with Ninja when present.
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
logs=${out%.md}-logs
build=build/gpu-check
budget=${DSP_GPU_CHECK_BUDGET_S:-510}
start=$SECONDS
phase=start
rm -rf "$logs"  # the logs are appended to: none from an earlier run
mkdir -p "$(dirname "$out")" "$logs"

say() { printf '%s\n' "$@" >> "$out"; }              # lines into the results file
left() { echo $((budget - (SECONDS - start))); }    # seconds of the budget left
# share MAX PERCENT: a phase's time limit, min(MAX, PERCENT % of what is left), so that every
# later phase still gets some when an earlier one runs out its time
share() { local l=$(($(left) * $2 / 100)); ((l < $1)) || l=$1; echo $((l > 0 ? l : 0)); }
phase() {                                          # phase NAME: announced on the console and in the file
  phase=$1
  echo "=== gpu-check: $1 (at $((SECONDS - start)) s)"
  say "" "_[$((SECONDS - start)) s] $1_"
}
stop() {  # stop WHY: the run ends here, failed
  say "" "**gpu-check stopped during '$phase' after $((SECONDS - start)) s: $1**"
  echo "gpu-check: $1" >&2
  phase=done
  exit 1
}
on_exit() {
  local rc=$?
  [[ $phase == done ]] && return
  say "" "**gpu-check ended during '$phase' after $((SECONDS - start)) s (exit status $rc).**"
}
child=
trap on_exit EXIT
# Stopped from outside: end the running command too (timeout passes the signal on to its process
# group), then on_exit says where the run was.
trap '[[ -z $child ]] || kill -TERM "$child" 2> /dev/null; exit 143' TERM HUP INT
# timeout_run SECONDS LOG COMMAND...: COMMAND's output to the console and appended to LOG, killed
# (its whole process group) at the limit; returns COMMAND's status, 124 on timeout (at once when
# SECONDS is below 1: timeout 0 would mean no limit). It runs in the background and is waited
# for, so that a TERM reaches the trap above at once instead of after COMMAND; the tee is waited
# for too, so that LOG is complete when this returns (its last lines are ctest's summary).
timeout_run() {
  local seconds=$1 log=$2 rc=0 fd tee_pid
  shift 2
  ((seconds >= 1)) || { echo "gpu-check: no time left for $1" | tee -a "$log"; return 124; }
  exec {fd}> >(tee -a "$log")
  tee_pid=$!
  timeout --kill-after=10 "$seconds" "$@" >&"$fd" 2>&1 {fd}>&- &
  child=$!
  exec {fd}>&-
  wait "$child" || rc=$?
  child=
  wait "$tee_pid" 2> /dev/null || true
  return "$rc"
}

# The CUDA toolkit's usual place, for machines whose PATH lacks it (before the header: it prints
# nvcc's version).
if ! command -v nvcc > /dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
{
  echo "# dsp GPU check ($(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2> /dev/null || echo unknown))"
  echo
  echo "Budget $budget s. Logs: $logs/."
  echo
  echo '```'
  timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv 2>&1 ||
    echo "nvidia-smi failed"
  nvcc --version 2> /dev/null | tail -1 || echo "nvcc not on PATH"
  echo "$(nproc) CPU cores"
  echo '```'
} > "$out" 2>&1

phase "preflight"
# Libraries carried from a development machine (scripts/gpu-deps.sh), when there.
cmake_deps=()
if [[ -d .gpu-deps/root/usr ]]; then
  deps=$PWD/.gpu-deps/root/usr
  arch_lib=$deps/lib/x86_64-linux-gnu
  export CPATH=$deps/include:$deps/include/x86_64-linux-gnu/openblas-pthread${CPATH:+:$CPATH}
  export LIBRARY_PATH=$arch_lib:$arch_lib/openblas-pthread${LIBRARY_PATH:+:$LIBRARY_PATH}
  export LD_LIBRARY_PATH=$arch_lib:$arch_lib/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  cmake_deps=(-DCMAKE_PREFIX_PATH="$deps" -DBLAS_LIBRARIES="$arch_lib/openblas-pthread/libopenblas.so")
  say "Using the carried libraries in .gpu-deps."
fi
# NCCL from PyTorch's wheel (nvidia-nccl-cu13) where the toolkit has none beside it.
if [[ ! -e /usr/local/cuda/include/nccl.h ]]; then
  nccl=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2> /dev/null || true)
  if [[ -n $nccl && -e $nccl/include/nccl.h && -e $nccl/lib/libnccl.so.2 ]]; then
    cmake_deps+=(-DDSP_NCCL_INCLUDE_DIR="$nccl/include" -DDSP_NCCL_LIBRARY="$nccl/lib/libnccl.so.2")
    export LD_LIBRARY_PATH=$nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    say "Using NCCL from $nccl."
  fi
fi
missing=()
for tool in nvidia-smi nvcc cmake python3 c++ timeout; do
  command -v "$tool" > /dev/null || missing+=("$tool")
done
for header in cblas.h doctest/doctest.h benchmark/benchmark.h nlohmann/json.hpp zlib.h CLI/CLI.hpp; do
  printf '#include <%s>\n' "$header" | c++ -E -x c++ - > /dev/null 2>&1 || missing+=("$header")
done
if ((${#missing[@]})); then
  stop "missing here: ${missing[*]} (scripts/setup.sh installs the libraries from Debian; where there is no network, carry .gpu-deps made by scripts/gpu-deps.sh)"
fi
cc=$(timeout 30 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>&1 | head -1 | tr -d '. ') || true
[[ $cc =~ ^[0-9]+$ ]] || stop "cannot read the GPU's compute capability (nvidia-smi said '$cc')"

generator=(-G "Unix Makefiles")
command -v ninja > /dev/null && generator=(-G Ninja)
phase "configure and build for sm_$cc (${generator[1]}, $(nproc) jobs)"
# A build folder left by another generator (a warm machine) cannot be reconfigured: start anew.
if [[ -f $build/CMakeCache.txt ]] && ! grep -qx "CMAKE_GENERATOR:INTERNAL=${generator[1]}" "$build/CMakeCache.txt"; then
  rm -rf "$build"
fi
mkdir -p "$build"
if ! timeout 180 cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DDSP_ENABLE_CUDA=ON \
  -DDSP_ENABLE_MPI=OFF -DCMAKE_CUDA_ARCHITECTURES="$cc" "${cmake_deps[@]}" > "$logs/build.log" 2>&1; then
  say '```' "$(tail -40 "$logs/build.log")" '```'
  stop "configure failed (the log's tail is above; all of it in $logs/build.log)"
fi
# The test binary and the three benchmarks in one build, so the longest translation units overlap.
if ! timeout_run $(($(left) - 120)) "$logs/build.log" cmake --build "$build" -j"$(nproc)" \
  --target dsp_cuda_tests bench_gemm_cuda bench_attention_cuda bench_train_step_cuda; then
  say '```' "$(grep -E 'error|Error|FAILED' "$logs/build.log" | head -30)" '---' "$(tail -20 "$logs/build.log")" '```'
  stop "the build failed or ran out of time (errors and the log's tail above; all of it in $logs/build.log)"
fi
say "" "Built by $((SECONDS - start)) s."

phase "GPU tests"
gpus=$(timeout 30 nvidia-smi -L | grep -c '^GPU' || true)
exclude=()
((gpus >= 2)) || exclude=(-E multi_gpu)  # the tests that need two GPUs skip themselves on one
test_limit=$(share 200 50)
ctest_rc=0
timeout_run "$test_limit" "$logs/ctest.log" ctest --test-dir "$build" -L gpu "${exclude[@]}" \
  --output-on-failure --no-tests=error || ctest_rc=$?
{
  echo
  echo "## GPU tests (ctest -L gpu ${exclude[*]}; $gpus GPU(s))"
  echo
  echo '```'
  grep -E 'tests passed|tests failed|Skipped|Failed|\*\*\*' "$logs/ctest.log" || true
  if ((ctest_rc == 124)); then
    echo "ctest timed out after $test_limit s, during: $(grep -oE 'Start +[0-9]+: [^ ]+' "$logs/ctest.log" | tail -1)"
  fi
  echo '```'
} >> "$out"
# Here a skipped GPU test is a failure: it means the test binary saw no device. The benchmarks
# still run (device time is scarce; their `wrong` columns check their own results).
tests_ok=1
faulted=()
if ((ctest_rc != 0)) || grep -q 'Skipped' "$logs/ctest.log"; then
  tests_ok=0
  echo "gpu-check: GPU tests failed or skipped (see above); going on to the benchmarks" >&2
  # What failed, with its doctest and CUDA error lines. A CUDA test that crashed (or any failed
  # one, when the log shows a CUDA error) is rerun at the end under compute-sanitizer, which names
  # the kernel, the thread and the bad address (a plain numerical failure is not).
  failed=$(grep -E '^[[:space:]]*[0-9]+ - [^ ]+ \((Failed|SEGFAULT|Subprocess aborted|Exception|Timeout|Child aborted|ILLEGAL|OTHER_FAULT|NUMERICAL|INTERRUPT)' \
    "$logs/ctest.log" | sed -E 's/^[[:space:]]*[0-9]+ - ([^ ]+) .*/\1/' | sort -u || true)
  for name in $failed; do
    source=  # its file, as --source-file takes it
    for f in tests/"$name".cu tests/"$name".cpp; do [[ -e $f ]] && source=$f; done
    [[ -n $source ]] || continue
    if grep -qE "^[[:space:]]*[0-9]+ - $name \((SEGFAULT|Subprocess aborted|Child aborted|ILLEGAL|OTHER_FAULT)" "$logs/ctest.log" ||
      grep -qiE 'CudaError|illegal memory|misaligned|unspecified launch failure' "$logs/ctest.log"; then
      faulted+=("${source#tests/}")
    fi
  done
  errors=$(grep -E 'ERROR|FATAL|values:|logged:|CudaError|CUDA error|error:' "$logs/ctest.log" | head -80 || true)
  [[ -z $errors ]] || say "" "### What failed (doctest and CUDA error lines)" "" '```' "$errors" '```'
fi

# bench NAME MAX PERCENT BINARY ARGS...: one benchmark run under $(share MAX PERCENT) seconds,
# console to bench.log, JSON to $build/NAME.json, its table (scripts/gpu_check_tables.py) to the
# results file; a failure or timeout is reported there and the script goes on.
bench() {
  local name=$1 seconds
  seconds=$(share "$2" "$3")
  shift 3
  rm -f "$build/$name.json"
  if ((seconds < 15)); then
    say "" "$name: not run, $(left) s of the budget left."
    return 0
  fi
  echo "=== $name (limit $seconds s)" >> "$logs/bench.log"
  local rc=0
  timeout_run "$seconds" "$logs/bench.log" "$@" --benchmark_out="$build/$name.json" \
    --benchmark_out_format=json || rc=$?
  ((rc == 0)) || say "" "$name exited with status $rc$( ((rc == 124)) && echo ", timed out after $seconds s")."
}

phase "bf16 GEMM"
bench gemm 60 20 "$build/benchmarks/bench_gemm_cuda" --benchmark_min_time=0.2
python3 scripts/gpu_check_tables.py gemm "$build/gemm.json" >> "$out" || true

phase "attention"
bench attention 70 25 "$build/benchmarks/bench_attention_cuda" --benchmark_min_time=0.2
python3 scripts/gpu_check_tables.py attention "$build/attention.json" >> "$out" || true

# One process a case, the figure the issue's MFU goal is about first, so that a slow or hung
# case costs only itself.
phase "training steps (bf16_flash, bf16, fp32_flash, fp32)"
train_json=()
for case in bf16_flash:50 bf16:50 fp32_flash:60 fp32:90; do  # case:percent of what is left
  bench "train_${case%:*}" 100 "${case#*:}" "$build/benchmarks/bench_train_step_cuda" --benchmark_filter="/${case%:*}/"
  train_json+=("$build/train_${case%:*}.json")
done
python3 scripts/gpu_check_tables.py train "${train_json[@]}" >> "$out" || true

sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2> /dev/null || true)
if ((${#faulted[@]})) && [[ -n $sanitizer ]]; then
  phase "compute-sanitizer memcheck of the CUDA tests that faulted"
  for source in "${faulted[@]:0:2}"; do  # at most two; all of their output in sanitizer.log
    seconds=$(share 90 95)
    ((seconds >= 15)) || { say "" "$source: no sanitizer run, $(left) s of the budget left."; break; }
    echo "=== $source" >> "$logs/sanitizer.log"
    rm -f "$build/sanitizer.log"
    timeout_run "$seconds" "$build/sanitizer.log" "$sanitizer" --tool memcheck --print-limit 8 \
      "$build/tests/dsp_cuda_tests" --source-file="*/$source" --no-version || true
    cat "$build/sanitizer.log" >> "$logs/sanitizer.log"
    say "" "### compute-sanitizer memcheck: $source" "" '```' "$(tail -60 "$build/sanitizer.log")" '```'
  done
fi

phase=done
say "" "gpu-check took $((SECONDS - start)) s."
echo "=== gpu-check: done in $((SECONDS - start)) s; results in $out"
((tests_ok)) || { echo "gpu-check: FAILED: GPU tests failed or skipped" >&2; exit 1; }
