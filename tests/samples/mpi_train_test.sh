#!/usr/bin/env bash
# dsp-train under mpiexec (one rank per process, MpiComm) against the thread run (ThreadComm):
#  - TP=2 x DP=2 on 4 processes gives the thread run's 20 losses within 1e-5 relative;
#  - TP=2 x PP=2 on 4 processes (pipeline sends and receives between processes) likewise;
#  - an MoE model at TP=2 x EP=2 (tokens exchanged by all_to_all_v between processes) likewise;
#  - ZeRO stage 2 at TP=2 x DP=2 (gradients reduce-scattered, parameters all-gathered between
#    processes) likewise, and --bf16 at ZeRO stage 3 (bf16 gradients and parameters between
#    processes);
#  - --world-size that differs from the MPI size: a message naming both, non-zero exit;
#  - dsp-generate on 2 processes serves what it serves on 2 threads (a dense model at TP2, an
#    MoE model at EP2);
#  - --profile-file on 2 processes: rank 0 writes one trace with spans of both ranks;
#  - a rank killed with SIGKILL, and a rank that throws (only rank 0 opens the metrics file),
#    also in a TP=2 x PP=2 job whose second stage then waits on a pipeline receive:
#    mpiexec ends every rank and exits non-zero within 30 s, naming the failure.
# Prints the wall time of the thread and the MPI run.
# Usage: mpi_train_test.sh BIN_DIR DATA_FILE MPIEXEC [MPIEXEC_FLAGS...]
set -uo pipefail
bin=$1
data=$2
mpiexec=$3
shift 3
mpi=("$mpiexec" "$@")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0
failed=0
ok() { passed=$((passed + 1)); }
fail() { failed=$((failed + 1)); echo "FAILED: $*"; }
now() { date +%s.%N; }

model=(--data-path "$data" --num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128
       --seq-length 32 --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --peak-flops 1e10
       --tensor-model-parallel-size 2)

# step and loss of every line of a metrics file, as "step loss"
losses() { sed -E 's/.*"loss":([^,}]*).*"step":([0-9]+).*/\2 \1/' "$1"; }

# max_rel_diff A.jsonl B.jsonl: the largest relative difference of their losses, step by step
max_rel_diff() {
  paste -d' ' <(losses "$1") <(losses "$2") | awk '
    $1 != $3 { print "step mismatch"; exit }
    { d = $2 - $4; if (d < 0) d = -d; m = $2 < 0 ? -$2 : $2; r = d / m; if (r > worst) worst = r }
    END { if (worst == "") worst = 0; print worst }'
}

# mpi_equals_threads NAME LAYOUT ARGS...: 20 steps of dsp-train on 4 threads and under
# mpiexec -n 4 with ARGS give the same losses (<= 1e-5 relative) and the MPI run reports LAYOUT.
mpi_equals_threads() {
  local name=$1 layout=$2
  shift 2
  local t0 t1 t2 worst
  t0=$(now)
  "$bin/dsp-train" --world-size 4 "${model[@]}" "$@" --train-iters 20 --metrics-file "$work/$name-threads.jsonl" \
    >/dev/null || fail "$name: thread run"
  t1=$(now)
  timeout 120 "${mpi[@]}" -n 4 "$bin/dsp-train" "${model[@]}" "$@" --train-iters 20 \
    --metrics-file "$work/$name-mpi.jsonl" >"$work/$name-mpi.out" 2>&1 || fail "$name: MPI run: $(cat "$work/$name-mpi.out")"
  t2=$(now)
  grep -q "$layout" "$work/$name-mpi.out" && ok || fail "$name: MPI run did not report $layout: $(cat "$work/$name-mpi.out")"
  if [ "$(losses "$work/$name-threads.jsonl" | wc -l)" -eq 20 ] && [ "$(losses "$work/$name-mpi.jsonl" | wc -l)" -eq 20 ]; then
    worst=$(max_rel_diff "$work/$name-threads.jsonl" "$work/$name-mpi.jsonl")
    awk -v w="$worst" 'BEGIN { exit !(w != "step mismatch" && w <= 1e-5) }' && ok \
      || fail "$name: MPI losses differ from the thread run's (max relative difference $worst)"
    echo "$name: max relative loss difference, MPI vs threads over 20 steps: $worst"
  else
    fail "$name: expected 20 losses from each run"
  fi
  awk -v a="$t0" -v b="$t1" -v c="$t2" -v n="$name" 'BEGIN { printf "%s: wall time: threads %.2f s, mpiexec -n 4 %.2f s\n", n, b - a, c - b }'
}

# --- MPI run == thread run (TP2 x DP2, TP2 x PP2, TP2 x EP2, ZeRO 2, bf16 ZeRO 3) --------------
mpi_equals_threads tp2dp2 "TP2/PP1/DP2"
mpi_equals_threads tp2pp2 "TP2/PP2/DP1" --pipeline-model-parallel-size 2
mpi_equals_threads tp2ep2 "TP2/PP1/DP2/EP2" --expert-model-parallel-size 2 --num-experts 8 --moe-router-topk 2 \
  --moe-ffn-hidden-size 32 --num-shared-experts 1 --first-k-dense-replace 1 --moe-aux-loss-coeff 0.001
mpi_equals_threads tp2dp2_zero2 "TP2/PP1/DP2, .*ZeRO stage 2," --zero-stage 2
mpi_equals_threads tp2dp2_bf16_zero3 "TP2/PP1/DP2, .*bf16 precision, ZeRO stage 3," --bf16 --zero-stage 3

# --- --world-size must equal the MPI size ---------------------------------------------------
timeout 60 "${mpi[@]}" -n 2 "$bin/dsp-train" "${model[@]}" --world-size 4 --train-iters 2 >"$work/out" 2>&1
rc=$?
if [ "$rc" -ne 0 ] && grep -qF -- "--world-size 4 does not match the MPI world size 2" "$work/out"; then ok
else fail "world size mismatch: rc $rc: $(cat "$work/out")"; fi

# --- one trace file with every rank's spans ------------------------------------------------
timeout 120 "${mpi[@]}" -n 2 "$bin/dsp-train" "${model[@]}" --train-iters 4 --profile-file "$work/trace.json" \
  >"$work/out" 2>&1 || fail "profiled MPI run: $(cat "$work/out")"
# complete events ("ph":"X"; nlohmann::json writes keys sorted, so pid follows ph) per rank
spans() { grep -o '"ph":"X","pid":[0-9]*' "$work/trace.json" | sort | uniq -c; }
if [ -s "$work/trace.json" ] && [ "$(spans | wc -l)" -eq 2 ] && spans | grep -q '"pid":0$' && spans | grep -q '"pid":1$' \
   && grep -q '"name":"backward"' "$work/trace.json"; then ok
else fail "trace of the MPI run lacks a rank's spans: $(spans)"; fi

# --- serving under mpiexec == serving on threads ---------------------------------------------
# The engine's driver (rank 0) broadcasts the requests; every rank runs the same batches. A dense
# TP2 checkpoint at TP2, and an MoE one (TP2 x EP2 training) at TP1 x EP2, served on 2 processes.
printf 'ROMEO:\nJULIET:\\nO Romeo\nA\n' >"$work/prompts"
serve_mpi_equals_threads() {  # NAME CKPT GENERATE_ARGS...
  local name=$1 ckpt=$2
  shift 2
  "$bin/dsp-generate" --load "$ckpt" --prompts-file "$work/prompts" --max-new-tokens 12 --temperature 0.8 --seed 3 "$@" \
    >"$work/$name-threads.txt" 2>/dev/null || fail "$name: serving on threads"
  timeout 120 "${mpi[@]}" -n 2 "$bin/dsp-generate" --load "$ckpt" --prompts-file "$work/prompts" --max-new-tokens 12 \
    --temperature 0.8 --seed 3 "$@" >"$work/$name-mpi.txt" 2>"$work/$name-mpi.err" || fail "$name: serving under mpiexec: $(cat "$work/$name-mpi.err")"
  [ -s "$work/$name-threads.txt" ] && diff <(grep -av '^--- ' "$work/$name-threads.txt") <(grep -av '^--- ' "$work/$name-mpi.txt") >/dev/null \
    && ok || fail "$name: mpiexec serving differs from the thread run"
}
"$bin/dsp-train" --world-size 2 "${model[@]}" --train-iters 4 --save "$work/serve_ckpt" >/dev/null || fail "serving checkpoint"
serve_mpi_equals_threads dense_tp2 "$work/serve_ckpt" --tensor-model-parallel-size 2
"$bin/dsp-train" --world-size 4 "${model[@]}" --expert-model-parallel-size 2 --num-experts 8 --moe-router-topk 2 \
  --moe-ffn-hidden-size 32 --num-shared-experts 1 --first-k-dense-replace 1 --train-iters 4 --save "$work/serve_moe" \
  >/dev/null || fail "MoE serving checkpoint"
serve_mpi_equals_threads moe_ep2 "$work/serve_moe" --tensor-model-parallel-size 1 --expert-parallel-size 2

# --- failures end the job -------------------------------------------------------------------
# wait_bounded PID SECONDS: waits for PID to exit; returns its exit code, or 124 after SECONDS
# (and kills it).
wait_bounded() {
  local pid=$1 limit=$2 t=0
  while kill -0 "$pid" 2>/dev/null && [ "$t" -lt $((limit * 10)) ]; do sleep 0.1; t=$((t + 1)); done
  if kill -0 "$pid" 2>/dev/null; then
    pkill -KILL -P "$pid"; kill -KILL "$pid"; wait "$pid"; return 124
  fi
  wait "$pid"
}

# A rank killed with SIGKILL while training.
"${mpi[@]}" -n 2 "$bin/dsp-train" "${model[@]}" --train-iters 100000 --log-interval 1 \
  --metrics-file "$work/long.jsonl" >"$work/kill.out" 2>&1 &
job=$!
for _ in $(seq 600); do [ -s "$work/long.jsonl" ] && break; sleep 0.1; done
victim=$(pgrep -P "$job" -f dsp-train | tail -1)
if [ -s "$work/long.jsonl" ] && [ -n "$victim" ]; then
  kill -KILL "$victim"
  wait_bounded "$job" 30
  rc=$?
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && grep -qiE "signal 9|killed" "$work/kill.out"; then ok
  else fail "killed rank: rc $rc (124: still running after 30 s): $(tail -20 "$work/kill.out")"; fi
  grep -iE "signal 9|killed" "$work/kill.out" | head -2
else
  wait_bounded "$job" 1
  fail "the MPI job did not start training: $(tail -20 "$work/kill.out")"
fi

# A rank that throws: only rank 0 opens the metrics file, after the mesh and model exist, so
# the other ranks are already waiting in the first step's collectives. Its folder cannot be
# created (a regular file stands where the folder would be).
touch "$work/not_a_folder"
"${mpi[@]}" -n 2 "$bin/dsp-train" "${model[@]}" --train-iters 20 --metrics-file "$work/not_a_folder/m.jsonl" \
  >"$work/throw.out" 2>&1 &
job=$!
wait_bounded "$job" 30
rc=$?
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && grep -qF "rank 0 failed: cannot create the folder of metrics file" "$work/throw.out"; then ok
else fail "throwing rank: rc $rc (124: still running after 30 s): $(tail -20 "$work/throw.out")"; fi

# The same in a TP2 x PP2 job: rank 0 (first stage) throws while its TP peer waits in a
# tensor-parallel collective and the second stage's ranks wait on a pipeline receive.
"${mpi[@]}" -n 4 "$bin/dsp-train" "${model[@]}" --pipeline-model-parallel-size 2 --train-iters 20 \
  --metrics-file "$work/not_a_folder/m.jsonl" >"$work/pp_throw.out" 2>&1 &
job=$!
wait_bounded "$job" 30
rc=$?
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && grep -qF "rank 0 failed: cannot create the folder of metrics file" "$work/pp_throw.out"; then ok
else fail "throwing pipeline rank: rc $rc (124: still running after 30 s): $(tail -20 "$work/pp_throw.out")"; fi

echo "mpi_train_test: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
