#!/usr/bin/env bash
# dsp-serve end to end over HTTP on 127.0.0.1 (curl + jq), against a checkpoint trained at
# TP2 x DP2 on tiny Shakespeare and served at TP1 and TP2:
#  - /health, /v1/models, /metrics; a completion and a chat completion streamed and not
#    streamed give the same text; the stream is OpenAI's (data: chunks, usage with
#    stream_options.include_usage, data: [DONE]); greedy output over HTTP equals dsp-generate's;
#  - bad input answers a 4xx with OpenAI's error JSON naming the field, and the server stays up:
#    malformed JSON, wrong types, unknown model (404), empty prompt, a token id outside the
#    vocabulary, prompt + max_tokens over --max-model-len (both numbers named), out-of-range
#    sampling values, an unknown path; --api-key (401 without it); a full queue (503);
#  - a client that disconnects, streaming or not, has its requests aborted: 0 KV blocks in use;
#  - SIGTERM drains: the running request finishes whole, new ones get 503, the exit code is 0;
#  - with MPIEXEC given: the server on 2 MPI processes answers as the threads do, and kill -9
#    of one rank ends the whole job with mpiexec's message, not a hang.
# Every wait is bounded; every request goes to 127.0.0.1.
# Usage: serve_test.sh BIN_DIR DATA_FILE [MPIEXEC MPIEXEC_FLAGS...]
set -uo pipefail
bin=$1
data=$2
shift 2
mpi=("$@")
work=$(mktemp -d)
trap 'kill -9 $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
source "$(dirname "$0")/lib.sh"

# start_server NAME ARGS...: starts dsp-serve on a free port (stderr to $work/NAME.err), waits
# (at most 60 s) for /health to answer 200; sets $port and $pid.
start_server() {
  local name=$1
  shift
  "$@" --port 0 >"$work/$name.out" 2>"$work/$name.err" &
  pid=$!
  port=
  for _ in $(seq 600); do
    port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$work/$name.err" 2>/dev/null | sed 's/.*://')
    if [ -n "$port" ] && [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")" = 200 ]; then return 0; fi
    kill -0 $pid 2>/dev/null || break
    sleep 0.1
  done
  echo "server $name did not start: $(cat "$work/$name.err")"
  return 1
}
url() { echo "http://127.0.0.1:$port$1"; }
post() { curl -s --max-time 120 "$(url "$1")" -H 'Content-Type: application/json' -d "$2"; }
status_of() { curl -s --max-time 120 -o "$work/body" -w '%{http_code}' "$(url "$1")" -H 'Content-Type: application/json' -d "$2"; }
# the text of a stream's chunks, concatenated (completions: .text, chat: .delta.content)
stream_text() { sed -n 's/^data: //p' | grep -v '^\[DONE\]$' | jq -j '.choices[]? | (.text // .delta.content // "")'; }
# metric NAME: its value on the server's /metrics
metric() { curl -s --max-time 10 "$(url /metrics)" | awk -v m="$1" '$1 == m { print $2 }'; }
# wait_metric NAME VALUE: until the metric equals VALUE (at most 20 s)
wait_metric() {
  for _ in $(seq 200); do [ "$(metric "$1")" = "$2" ] && return 0; sleep 0.1; done
  return 1
}
# expect_error NAME STATUS PARAM TEXT BODY [PATH]: a 4xx with OpenAI's error JSON
expect_error() {
  local name=$1 want=$2 param=$3 text=$4 body=$5 path=${6:-/v1/completions} got
  got=$(status_of "$path" "$body")
  if [ "$got" != "$want" ]; then fail "$name: status $got, expected $want: $(cat "$work/body")"; return; fi
  if ! jq -e '.error | (.message | type == "string") and (.type | type == "string") and has("param") and has("code")' \
      "$work/body" >/dev/null; then fail "$name: not OpenAI's error JSON: $(cat "$work/body")"; return; fi
  if [ -n "$param" ] && [ "$(jq -r .error.param "$work/body")" != "$param" ]; then fail "$name: param $(jq -r .error.param "$work/body"), expected $param"; return; fi
  if ! jq -r .error.message "$work/body" | grep -qF -- "$text"; then fail "$name: message lacks '$text': $(cat "$work/body")"; return; fi
  ok
}

# A checkpoint trained at TP2 x DP2 (4 ranks).
"$bin/dsp-train" --data-path "$data" --world-size 4 --tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 \
  --num-attention-heads 4 --num-query-groups 2 --ffn-hidden-size 192 --seq-length 128 --micro-batch-size 4 \
  --global-batch-size 16 --lr 1e-2 --train-iters 100 --eval-interval 1000 --log-interval 1000 --peak-flops 1e10 \
  --save "$work/ckpt" >"$work/train.out" 2>&1 || { echo "training failed: $(cat "$work/train.out")"; exit 1; }

# --- TP1 server of the TP2 checkpoint
start_server tp1 "$bin/dsp-serve" --model "$work/ckpt" --served-model-name demo --tensor-parallel-size 1 || exit 1
[ "$(curl -s "$(url /v1/models)" | jq -r '.data[0].id')" = demo ] && ok || fail "/v1/models does not list 'demo'"
[ "$(curl -s "$(url /v1/models)" | jq -r '.data[0].max_model_len')" = 128 ] && ok || fail "/v1/models: max_model_len"

# keep TEXT: TEXT with a sentinel, so that $(...) keeps its trailing newlines (strip it with ${x%.})
prompt='JULIET:\nO Romeo, Romeo!'  # 23 bytes once \n is a newline
sampled='"temperature": 0.8, "seed": 7'
whole=$(post /v1/completions "{\"model\": \"demo\", \"prompt\": \"$prompt\", \"max_tokens\": 48, $sampled}")
text=$(jq -j '.choices[0].text' <<<"$whole"; echo .)
text=${text%.}
[ "$(jq -r '.choices[0].finish_reason' <<<"$whole")" = length ] && [ "$(jq -r '.usage.completion_tokens' <<<"$whole")" = 48 ] \
  && [ "$(jq -r '.usage.prompt_tokens' <<<"$whole")" = 23 ] && [ "${#text}" -eq 48 ] && ok \
  || fail "completion: $whole"
post /v1/completions "{\"prompt\": \"$prompt\", \"max_tokens\": 48, $sampled, \"stream\": true, \"stream_options\": {\"include_usage\": true}}" >"$work/stream"
streamed=$(stream_text <"$work/stream"; echo .)
[ "${streamed%.}" = "$text" ] && ok || fail "streamed completion differs: '${streamed%.}' vs '$text'"
[ "$(grep -c '^data: {' "$work/stream")" = 49 ] && ok || fail "stream: expected 48 token chunks + usage, got $(grep -c '^data: {' "$work/stream")"
[ "$(grep '^data: ' "$work/stream" | tail -1)" = "data: [DONE]" ] && ok || fail "stream does not end with data: [DONE]"
[ "$(grep '^data: {' "$work/stream" | tail -1 | sed 's/^data: //' | jq -c '[.choices, .usage.completion_tokens, .usage.total_tokens]')" = '[[],48,71]' ] \
  && ok || fail "stream: the last chunk is not the usage: $(grep '^data: {' "$work/stream" | tail -1)"

# Output over HTTP equals dsp-generate's at the same TP, sampled with the same seed and greedy.
# (dsp-generate prints the prompt, the generated bytes, a newline and "--- 48 tokens ...".)
generate_text() {
  "$bin/dsp-generate" --load "$work/ckpt" --tensor-model-parallel-size 1 --prompt "$prompt" --max-new-tokens 48 "$@" >"$work/gen" 2>/dev/null
  local g
  g=$(sed -n '2,/^--- 48 tokens/p' "$work/gen" | sed '$d'; echo .)
  g=${g%.}
  printf '%s' "${g#$(printf 'JULIET:\nO Romeo, Romeo!')}" | head -c -1  # without the prompt and the newline before ---
}
generated=$(generate_text --temperature 0.8 --seed 7; echo .)
[ "${generated%.}" = "$text" ] && ok || fail "sampled HTTP text differs from dsp-generate's: '$text' vs '${generated%.}'"
greedy=$(post /v1/completions "{\"prompt\": \"$prompt\", \"max_tokens\": 48, \"temperature\": 0}" | jq -j '.choices[0].text'; echo .)
generated=$(generate_text; echo .)
[ "${generated%.}" = "${greedy%.}" ] && ok || fail "greedy HTTP text differs from dsp-generate's: '${greedy%.}' vs '${generated%.}'"
# Without a temperature a request samples at 1, as OpenAI's and vLLM's servers do: seeded, it
# equals the same request at temperature 1 and (for this prompt and seed) differs from greedy.
default_t=$(post /v1/completions "{\"prompt\": \"$prompt\", \"max_tokens\": 48, \"seed\": 7}" | jq -j '.choices[0].text'; echo .)
one_t=$(post /v1/completions "{\"prompt\": \"$prompt\", \"max_tokens\": 48, \"seed\": 7, \"temperature\": 1}" | jq -j '.choices[0].text'; echo .)
[ "$default_t" = "$one_t" ] && [ "$default_t" != "$greedy" ] && ok \
  || fail "the default temperature is not 1: '${default_t%.}' (default) vs '${one_t%.}' (1) vs '${greedy%.}' (0)"

chat='{"messages": [{"role": "system", "content": "Speak as Romeo."}, {"role": "user", "content": "Who art thou?"}], "max_tokens": 40, "temperature": 0'
reply=$(post /v1/chat/completions "$chat}")
[ "$(jq -r '.object' <<<"$reply")" = chat.completion ] && [ "$(jq -r '.choices[0].message.role' <<<"$reply")" = assistant ] \
  && [ "$(jq -r '.usage.completion_tokens' <<<"$reply")" = 40 ] && ok || fail "chat: $reply"
post /v1/chat/completions "$chat, \"stream\": true}" >"$work/chat_stream"
[ "$(stream_text <"$work/chat_stream")" = "$(jq -j '.choices[0].message.content' <<<"$reply")" ] && ok || fail "streamed chat differs"
[ "$(grep -m1 '^data: {' "$work/chat_stream" | sed 's/^data: //' | jq -r '.choices[0].delta.role')" = assistant ] && ok \
  || fail "chat stream: the first chunk has no role"
# Several prompts and n choices: OpenAI's index order (prompt-major), each greedy choice alike.
multi=$(post /v1/completions '{"prompt": ["ROMEO:", [74, 85, 76]], "n": 2, "max_tokens": 8, "logprobs": 2, "temperature": 0}')
[ "$(jq -c '[.choices[].index]' <<<"$multi")" = '[0,1,2,3]' ] && [ "$(jq -r '.choices[0].text == .choices[1].text' <<<"$multi")" = true ] \
  && [ "$(jq -r '.choices[0].logprobs.top_logprobs[0] | length' <<<"$multi")" = 2 ] && [ "$(jq -r .usage.prompt_tokens <<<"$multi")" = 9 ] \
  && ok || fail "multi-prompt completion: $multi"

# Bad input: a 4xx with OpenAI's error JSON; the server stays up.
expect_error "malformed JSON" 400 "" "not valid JSON" '{"prompt": "x", '
expect_error "body not an object" 400 "" "JSON object" '[1, 2]'
expect_error "wrong type" 400 max_tokens "must be an integer" '{"prompt": "x", "max_tokens": "ten"}'
expect_error "unknown model" 404 model "gpt-4" '{"model": "gpt-4", "prompt": "x"}'
expect_error "empty prompt" 400 prompt "empty" '{"prompt": ""}'
expect_error "token id outside the vocabulary" 400 prompt "token id 300" '{"prompt": [1, 300]}'
expect_error "over --max-model-len" 400 prompt "maximum context length is 128 tokens. However, you requested 136 tokens (6 in the prompt, 130 for the completion)" \
  '{"prompt": "ROMEO:", "max_tokens": 130}'
expect_error "top_p" 400 top_p "got 0" '{"prompt": "x", "top_p": 0}'
expect_error "repetition_penalty" 400 repetition_penalty "got 0" '{"prompt": "x", "repetition_penalty": 0}'
expect_error "presence_penalty" 400 presence_penalty "got 3" '{"prompt": "x", "presence_penalty": 3}'
expect_error "frequency_penalty" 400 frequency_penalty "got -2.5" '{"prompt": "x", "frequency_penalty": -2.5}'
expect_error "chat without messages" 400 messages "required" '{"prompt": "x"}' /v1/chat/completions
expect_error "unknown path" 404 "" "no route" '{}' /v1/embeddings
[ "$(curl -s -o "$work/body" -w '%{http_code}' -X GET "$(url /v1/completions)")" = 405 ] && [ "$(jq -r .error.type "$work/body")" = invalid_request_error ] \
  && ok || fail "GET /v1/completions: $(cat "$work/body")"
# Without a body (no Content-Length) a request gets the status it gets with one, a POST path 411.
# (Answered at once: the test's curl gives up after 2 s, under httplib's 5 s read timeout.)
for case in "POST /v1/completions 411 Content-Length" "PUT /v1/completions 405 not allowed" "POST /v1/models 405 not allowed" \
    "DELETE /v1/completions 405 not allowed" "POST /v1/nothing 404 no route"; do
  read -r method path want words <<<"$case"
  got=$(curl -s --max-time 2 -o "$work/body" -w '%{http_code}' -X "$method" "$(url "$path")")
  [ "$got" = "$want" ] && jq -r .error.message "$work/body" | grep -qF "$words" && ok || fail "$method $path without a body: $got $(cat "$work/body")"
done
[ "$(curl -s -o "$work/body" -w '%{http_code}' -H 'Transfer-Encoding: chunked' "$(url /v1/completions)" -H 'Content-Type: application/json' \
    -d '{"prompt": "x"}')" = 411 ] && ok || fail "a chunked request body: $(cat "$work/body")"
# Values at the ends of their ranges: a repetition penalty of 1e-40 saturates logits, no crash.
[ "$(status_of /v1/completions '{"prompt": "ROMEO:", "max_tokens": 4, "repetition_penalty": 1e-40}')" = 200 ] && ok \
  || fail "repetition_penalty 1e-40: $(cat "$work/body")"
expect_error "max_tokens near 2^63" 400 prompt "context length" '{"prompt": "x", "max_tokens": 9223372036854775807}'
[ "$(curl -s -o /dev/null -w '%{http_code}' "$(url /health)")" = 200 ] && ok || fail "the server is down after bad input"
# HTTP/1.0: no chunked encoding; the body runs to the end of the connection.
curl -s -0 -i "$(url /v1/completions)" -H 'Content-Type: application/json' -d '{"prompt": "ROMEO:", "max_tokens": 4}' >"$work/http10"
! grep -qi '^transfer-encoding' "$work/http10" && sed '1,/^\r$/d' "$work/http10" | jq -e '.usage.completion_tokens == 4' >/dev/null \
  && ok || fail "HTTP/1.0: $(cat "$work/http10")"
# A second server on the same port fails at once (no SO_REUSEPORT sharing).
"$bin/dsp-serve" --model "$work/ckpt" --port "$port" >/dev/null 2>"$work/second.err"
[ $? -ne 0 ] && grep -q "cannot listen on 127.0.0.1:$port" "$work/second.err" && ok || fail "a second server on port $port: $(cat "$work/second.err")"

# Clients that disconnect: a stream closed after its first bytes, and a whole response cut
# after 0.3 s (when it had not finished by then: curl's exit code 28). Their requests end as
# aborted and every KV block is free again. Of the cut response's 128 completions, those that
# finished between the cut and the server seeing it (a fast machine) count as finished by
# length: aborted + finished by length grow by 256 together, aborted by at least 128.
finished_count() { curl -s "$(url /metrics)" | grep -F "dsp:request_success_total{finished_reason=\"$1\"}" | awk '{n = $2} END {print n + 0}'; }
length_before=$(finished_count length)
aborted_before=$(finished_count abort)
curl -sN --max-time 60 "$(url /v1/completions)" -d '{"prompt": [[1,2],[3,4]], "n": 64, "max_tokens": 120, "stream": true}' | head -c 100 >/dev/null
curl -s --max-time 0.3 "$(url /v1/completions)" -d '{"prompt": [[5,6],[7,8]], "n": 64, "max_tokens": 120}' >/dev/null
cut_rc=$?
wait_metric dsp:kv_cache_used_blocks 0 && wait_metric dsp:num_requests_running 0 && ok || fail "blocks in use after disconnects: $(metric dsp:kv_cache_used_blocks)"
aborted=$(( $(finished_count abort) - aborted_before ))
by_length=$(( $(finished_count length) - length_before ))
if [ "$cut_rc" -eq 28 ]; then
  [ "$aborted" -ge 128 ] && [ $((aborted + by_length)) -eq 256 ] && ok \
    || fail "256 completions of disconnected clients: $aborted aborted, $by_length finished by length"
else  # the cut response finished within 0.3 s: only the stream's 128 are aborted
  [ "$aborted" -eq 128 ] && ok || fail "expected 128 disconnected requests aborted, /metrics says $aborted"
fi
for m in dsp:num_requests_waiting dsp:kv_cache_usage_perc dsp:num_preemptions_total dsp:prefix_cache_queries_total \
    dsp:prompt_tokens_total dsp:generation_tokens_total dsp:time_to_first_token_seconds_count \
    dsp:inter_token_latency_seconds_count dsp:e2e_request_latency_seconds_count; do
  [ -n "$(metric $m)" ] && ok || fail "/metrics lacks $m"
done

# SIGTERM drains: the running request finishes whole; new ones get 503; exit code 0.
post /v1/completions '{"prompt": [[1,2,3],[4,5,6],[7,8,9],[10,11,12]], "n": 64, "max_tokens": 120}' >"$work/drained" &
client=$!
for _ in $(seq 200); do [ "$(metric dsp:num_requests_running)" != 0 ] && break; sleep 0.05; done
kill -TERM $pid
sleep 0.2
expect_error "new request while draining" 503 "" "shutting down" '{"prompt": "x"}'
[ "$(curl -s -o /dev/null -w '%{http_code}' "$(url /health)")" = 503 ] && ok || fail "/health is not 503 while draining"
wait $client
[ "$(jq -r '[.choices[] | select(.finish_reason == "length")] | length' "$work/drained")" = 256 ] && ok \
  || fail "the drained request did not finish whole: $(head -c 300 "$work/drained")"
for _ in $(seq 300); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
wait $pid
rc=$?
[ $rc -eq 0 ] && grep -q "SIGTERM: draining" "$work/tp1.err" && ok || fail "after SIGTERM: exit code $rc, $(tail -3 "$work/tp1.err")"

# --- TP2 server with an API key and a queue of 2: 401 without the key; 400 or 503 when full.
start_server tp2 "$bin/dsp-serve" --model "$work/ckpt" --served-model-name demo --api-key sekret --max-num-seqs 2 --max-queue 2 \
  --max-num-batched-tokens 8 || exit 1
[ "$(curl -s -o "$work/body" -w '%{http_code}' "$(url /v1/models)")" = 401 ] && [ "$(jq -r .error.code "$work/body")" = invalid_api_key ] \
  && ok || fail "no key: $(cat "$work/body")"
tp2=$(curl -s --max-time 60 "$(url /v1/completions)" -H 'Authorization: Bearer sekret' -d "{\"prompt\": \"$prompt\", \"max_tokens\": 48, $sampled}")
[ "$(jq -j '.choices[0].text' <<<"$tp2"; echo .)" = "$text." ] && ok || fail "TP2 text differs from TP1's (a near-tie?): $tp2"
# More completions than the queue could ever hold: 400. Eight requests of 2 sent at once, each
# with a 96-token prompt prefilled 8 tokens a step (--max-num-batched-tokens 8): the first two
# requests' prompts wait for their first token for at least 12 steps, and the others meanwhile
# get 503 server_busy; every answer is a 200 or that 503.
[ "$(curl -s -o "$work/body" -w '%{http_code}' "$(url /v1/completions)" -H 'Authorization: Bearer sekret' \
    -d '{"prompt": "x", "n": 3}')" = 400 ] && [ "$(jq -r .error.param "$work/body")" = n ] && ok || fail "n over --max-queue: $(cat "$work/body")"
long=$(printf 'a%.0s' $(seq 96))
for i in $(seq 8); do
  curl -s --max-time 60 -o "$work/q$i" -w '%{http_code}\n' "$(url /v1/completions)" -H 'Authorization: Bearer sekret' \
    -d "{\"prompt\": \"$long\", \"n\": 2, \"max_tokens\": 8}" >"$work/q$i.code" &
done
wait $(jobs -p | grep -v "^$pid\$")
codes=$(cat "$work"/q*.code | sort | uniq -c | tr -s ' ' | tr '\n' ';')
busy=$(grep -l server_busy "$work"/q[0-9] 2>/dev/null | wc -l)
[ "$(cat "$work"/q*.code | grep -vc '^\(200\|503\)$')" = 0 ] && [ "$(grep -c '^503$' "$work"/q*.code | awk -F: '{s += $2} END {print s}')" = "$busy" ] \
  && [ "$busy" -ge 1 ] && ok || fail "queue full: codes $codes, $busy server_busy"
kill -TERM $pid
wait $pid && ok || fail "TP2 server: exit code after SIGTERM"

# --- MPI: two processes, the front on rank 0; kill -9 of rank 1 ends the job.
if [ ${#mpi[@]} -gt 0 ]; then
  start_server mpi "${mpi[@]}" -n 2 "$bin/dsp-serve" --model "$work/ckpt" --served-model-name demo || exit 1
  got=$(post /v1/completions "{\"prompt\": \"$prompt\", \"max_tokens\": 48, $sampled}")
  [ "$(jq -j '.choices[0].text' <<<"$got"; echo .)" = "$text." ] && ok || fail "MPI TP2 text differs: $got"
  rank1=$(pgrep -P $pid -f dsp-serve | sort -n | tail -1)
  kill -9 "$rank1"
  ended=0
  for _ in $(seq 300); do kill -0 $pid 2>/dev/null || { ended=1; break; }; sleep 0.1; done
  wait $pid
  rc=$?
  [ $ended -eq 1 ] && [ $rc -ne 0 ] && grep -q "signal 9" "$work/mpi.err" && ok \
    || fail "kill -9 of rank 1: ended=$ended rc=$rc: $(tail -5 "$work/mpi.err")"
fi

echo "serve_test: $passed passed, $failed failed"
[ $failed -eq 0 ]
