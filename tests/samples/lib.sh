# Shared pieces of the command-line test scripts (sourced): pass/fail counters and checks of
# exit codes, messages and the losses of metrics files. The caller sets $work (a temporary
# folder) before using expect_fail.
passed=0
failed=0
ok() { passed=$((passed + 1)); }
fail() { failed=$((failed + 1)); echo "FAILED: $*"; }

# expect_fail NAME EXPECTED_TEXT FORBIDDEN_PATH -- command...
expect_fail() {
  local name=$1 text=$2 forbidden=$3
  shift 4
  "$@" >"$work/out" 2>"$work/err"
  local rc=$?
  if [ "$rc" -eq 0 ]; then fail "$name: exit code 0"; return; fi
  if ! grep -qF -- "$text" "$work/err"; then fail "$name: stderr lacks '$text': $(cat "$work/err")"; return; fi
  if [ -n "$forbidden" ] && [ -e "$forbidden" ]; then fail "$name: partial output $forbidden"; return; fi
  ok
}

# step and loss of every line of a metrics file, as "step loss"
losses() { sed -E 's/.*"loss":([^,}]*).*"step":([0-9]+).*/\2 \1/' "$1"; }

# same_losses NAME EXPECTED.jsonl ACTUAL.jsonl: the same 6 steps, losses within 1e-5 relative
same_losses() {
  local name=$1 want=$2 got=$3 worst
  if [ "$(losses "$want" | wc -l)" -ne 6 ] || [ "$(losses "$got" 2>/dev/null | wc -l)" -ne 6 ]; then
    fail "$name: expected 6 losses in $want and $got"; return
  fi
  worst=$(paste -d' ' <(losses "$want") <(losses "$got") | awk '
    $1 != $3 { print "step mismatch"; exit }
    { d = $2 - $4; if (d < 0) d = -d; m = $2 < 0 ? -$2 : $2; r = d / m; if (r > worst) worst = r }
    END { if (worst == "") worst = 0; print worst }')
  awk -v w="$worst" 'BEGIN { exit !(w != "step mismatch" && w <= 1e-5) }' && ok \
    || fail "$name: losses differ from $(basename "$want") (max relative difference $worst)"
}

# exact_losses NAME EXPECTED.jsonl ACTUAL.jsonl: the same 6 steps and losses, digit for digit
exact_losses() {
  local name=$1 want=$2 got=$3
  if [ "$(losses "$want" | wc -l)" -eq 6 ] && diff <(losses "$want") <(losses "$got" 2>/dev/null) >/dev/null; then ok
  else fail "$name: losses differ from $(basename "$want"): $(diff <(losses "$want") <(losses "$got" 2>/dev/null))"; fi
}
