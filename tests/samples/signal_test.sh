#!/usr/bin/env bash
# dsp-train's --exit-signal-handler (on by default) and its checkpoint folder, on 4 ranks at
# TP2 x DP2 (threads; or, with MPIEXEC given, 4 processes on MpiComm):
#  - SIGTERM at a random step (under MPI to one rank only): the run finishes the step, saves,
#    says where and exits 0; the resumed run says "resuming from iteration N" and its losses
#    equal the uninterrupted run's bitwise; the metrics file holds each step exactly once;
#  - kill -9 after a --save-interval save: the resumed run drops the metrics of the steps after
#    that save, so again each step once and the uninterrupted losses;
#  - (threads) a second signal ends the run at once, by that signal.
# Usage: signal_test.sh BIN_DIR DATA_FILE [MPIEXEC MPIEXEC_FLAGS...]
set -uo pipefail
bin=$1
data=$2
shift 2
mpi=("$@")
work=$(mktemp -d)
trap 'kill -9 $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
passed=0
failed=0
ok() { passed=$((passed + 1)); }
fail() { failed=$((failed + 1)); echo "FAILED: $*"; }

iters=40
model=(--data-path "$data" --num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2
       --ffn-hidden-size 64 --seq-length 64 --micro-batch-size 2 --global-batch-size 8 --lr 3e-3
       --tensor-model-parallel-size 2 --train-iters $iters --log-interval 1 --peak-flops 1e10)
if [ ${#mpi[@]} -gt 0 ]; then launch=("${mpi[@]}" -n 4 "$bin/dsp-train" "${model[@]}")
else launch=("$bin/dsp-train" --world-size 4 "${model[@]}"); fi
train() { "${launch[@]}" "$@"; }
# "step loss" of every line of a metrics file
losses() { sed -E 's/.*"loss":([^,}]*).*"step":([0-9]+).*/\2 \1/' "$1"; }
# wait_lines FILE N PID: until FILE has N lines (at most 120 s) while PID runs
wait_lines() {
  for _ in $(seq 6000); do
    [ "$(cat "$1" 2>/dev/null | wc -l)" -ge "$2" ] && return 0
    kill -0 "$3" 2>/dev/null || return 1
    sleep 0.02
  done
  return 1
}
# the pid to signal: the run itself, or under MPI one of mpiexec's rank processes
target() {
  if [ ${#mpi[@]} -gt 0 ]; then pgrep -P "$1" | shuf -n 1; else echo "$1"; fi
}

train --metrics-file "$work/full.jsonl" >/dev/null || fail "uninterrupted run"
[ "$(wc -l <"$work/full.jsonl")" -eq $iters ] || fail "uninterrupted run: $(wc -l <"$work/full.jsonl") metrics lines"

# --- SIGTERM at a random step ----------------------------------------------------------------
# A step takes a few milliseconds, so on a fast machine the run can reach its last step before the
# signal lands (exit 0, the tracker at the last step): then it is repeated (at most 5 times).
for attempt in 1 2 3 4 5; do
  rm -rf "$work/ckpt" "$work/m.jsonl"
  k=$(shuf -i 3-25 -n 1)
  "${launch[@]}" --save "$work/ckpt" --metrics-file "$work/m.jsonl" >"$work/out" 2>&1 &
  pid=$!
  if wait_lines "$work/m.jsonl" "$k" "$pid"; then kill -TERM "$(target "$pid")"; fi
  wait "$pid"
  rc=$?
  n=$(cat "$work/ckpt/latest_checkpointed_iteration.txt" 2>/dev/null)
  [ "$rc" -eq 0 ] && [ "$n" = "$iters" ] || break
  echo "SIGTERM attempt $attempt: the run ended its $iters steps before the signal at step $k: again"
done
if [ "$rc" -eq 0 ] && grep -q "SIGTERM received: stopped after iteration $n, saved to .*iter_0*$n" "$work/out" \
   && [ "$n" -ge "$k" ] && [ "$n" -lt $iters ]; then
  ok
else
  fail "SIGTERM after step $k: exit $rc, tracker '$n': $(cat "$work/out")"
fi
train --load "$work/ckpt" --save "$work/ckpt" --metrics-file "$work/m.jsonl" >"$work/out2" 2>&1 \
  || fail "resumed run: $(cat "$work/out2")"
grep -q "resuming from iteration $n of " "$work/out2" && ok || fail "no resume banner: $(head -3 "$work/out2")"
if diff <(losses "$work/full.jsonl") <(losses "$work/m.jsonl") >/dev/null; then
  ok
else
  fail "SIGTERM at step $k then resume: losses or steps differ: $(diff <(losses "$work/full.jsonl") <(losses "$work/m.jsonl") | head -5)"
fi

# --- kill -9 after a save: the metrics of the lost steps are dropped on resume -------------------
# Frozen (SIGSTOP) as soon as rank 0 has logged step 13 or 14 (saves at 5, 10, 15, ...), then
# killed. A step takes a few milliseconds, so the freeze can land after the next save: then the
# metrics hold no step past the tracker's and the attempt is repeated (at most 5 times).
for attempt in 1 2 3 4 5; do
  rm -rf "$work/ckpt9" "$work/m9.jsonl"
  ranks=""
  "${launch[@]}" --save "$work/ckpt9" --save-interval 5 --metrics-file "$work/m9.jsonl" >/dev/null 2>&1 &
  pid=$!
  for _ in $(seq 6000); do
    l=$(cat "$work/m9.jsonl" 2>/dev/null | wc -l)
    if [ "$l" -ge 13 ] && [ $((l % 5)) -ne 0 ]; then
      ranks=$(if [ ${#mpi[@]} -gt 0 ]; then pgrep -P "$pid"; else echo "$pid"; fi)
      kill -STOP $ranks
      break
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.02
  done
  n=$(cat "$work/ckpt9/latest_checkpointed_iteration.txt" 2>/dev/null)
  lines=$(wc -l <"$work/m9.jsonl")
  kill -9 "$(target "$pid")"
  wait "$pid" 2>/dev/null
  # every rank, by the pids taken at the freeze: once mpiexec has exited they are no longer its
  # children, and a stopped rank that mpiexec's SIGCONT + SIGTERM later wakes would save and
  # write metrics beside the resumed run
  [ ${#mpi[@]} -gt 0 ] && { kill -9 $ranks 2>/dev/null; sleep 1; }
  [ -n "$n" ] && [ "$lines" -gt "$n" ] && break
  echo "kill -9 attempt $attempt: frozen at step $lines with the tracker at '$n': again"
done
[ -n "$n" ] && [ "$lines" -gt "$n" ] && ok || fail "kill -9: tracker '$n', $lines metrics lines (want more lines than saved steps)"
train --load "$work/ckpt9" --save "$work/ckpt9" --metrics-file "$work/m9.jsonl" >/dev/null 2>&1 || fail "resume after kill -9"
diff <(losses "$work/full.jsonl") <(losses "$work/m9.jsonl") >/dev/null && ok \
  || fail "kill -9 at step $lines, resumed from $n: $(diff <(losses "$work/full.jsonl") <(losses "$work/m9.jsonl") | head -5)"

# --- a second signal ends the run at once ------------------------------------------------------
if [ ${#mpi[@]} -eq 0 ]; then
  "${launch[@]}" --save "$work/ckpt2" --metrics-file "$work/m2.jsonl" >/dev/null 2>&1 &
  pid=$!
  # Two different signals (two pending SIGTERMs would merge into one).
  if wait_lines "$work/m2.jsonl" 3 "$pid"; then kill -TERM "$pid"; kill -INT "$pid"; fi
  wait "$pid"
  rc=$?
  [ "$rc" -eq 143 ] || [ "$rc" -eq 130 ] && ok || fail "SIGTERM then SIGINT: exit $rc, expected 143 or 130 (ended by the second signal)"
fi

echo "signal: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
