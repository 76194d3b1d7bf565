#!/usr/bin/env bash
# The llama.cpp peer of dsp's server: llama.cpp's own `llama-server`, built from source, serving
# a merged dsp checkpoint converted to GGUF, so the two servers can be compared on the same cores
# (docs/llama_server.md: what is compared, the checks, the caveats).
#
#   tools/llama_server.sh build
#       Downloads the llama-cpp-python source distribution (pinned below; its vendor/llama.cpp is
#       llama.cpp at a fixed commit) with pip, extracts vendor/llama.cpp, builds llama-server
#       (CMake, Release, CPU only, native arch, static, -j2, no web UI download, no HTTPS), and
#       makes a venv with the Python packages of the bundled convert_hf_to_gguf.py (its own
#       requirements file, less its extra index of PyTorch's CPU wheels, which is not reached
#       here: torch comes from PyPI). Idempotent: a step whose result exists is skipped.
#   tools/llama_server.sh convert MERGED_DIR OUT.gguf [extra converter args, e.g. --model-name NAME]
#       Converts a merged dsp checkpoint (dsp-reshard --merge: model.safetensors, config.json and,
#       for a byte model, tokenizer.json + tokenizer_config.json) to an fp32 GGUF with the bundled
#       converter, run through tools/llama_convert.py (it lets the converter accept dsp's
#       byte-level tokenizer; see there).
#   tools/llama_server.sh serve OUT.gguf PORT [extra llama-server args]
#       Starts llama-server on 127.0.0.1:PORT in the foreground: continuous batching over
#       DSP_PEER_SLOTS slots (default 4) of DSP_PEER_SLOT_CTX tokens each (default 128, the demo's
#       seq length; -c = slots x that), DSP_PEER_THREADS threads (default 2), -b 512 -ub 512, and
#       dsp's default arithmetic: an fp32 KV cache and no flash attention (llama.cpp's flash
#       attention casts K and V to fp16 first; `-fa on -ctk f16 -ctv f16` is its fast path, the
#       peer of dsp's --kv-cache-dtype fp16). Extra arguments are appended (a later flag wins).
#       Prints the command line first.
#   tools/llama_server.sh path
#       Prints the llama-server binary's path.
#
# Environment: DSP_PEER_DIR (default ~/.cache/dsp/peer) holds the download, the source, the
# build and the venv; DSP_PEER_PYTHON (default python3) makes the venv; DSP_PEER_JOBS (default 2)
# the build's parallel jobs.
set -euo pipefail

version=0.3.36  # llama-cpp-python; its vendor/llama.cpp is what is built
peer=${DSP_PEER_DIR:-$HOME/.cache/dsp/peer}
src=$peer/llama.cpp-$version
build=$src/build
server=$build/bin/llama-server
venv=$peer/venv-$version
tools=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
}

fetch_source() {
  [ -f "$src/CMakeLists.txt" ] && [ -f "$src/convert_hf_to_gguf.py" ] && return
  mkdir -p "$peer/download"
  local sdist=$peer/download/llama_cpp_python-$version.tar.gz
  if [ ! -f "$sdist" ]; then
    echo "== download llama-cpp-python $version (source) =="
    pip download --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$peer/download"
  fi
  echo "== extract vendor/llama.cpp into $src =="
  rm -rf "$src.tmp"
  mkdir -p "$src.tmp"
  tar -xzf "$sdist" -C "$src.tmp" --strip-components=3 "llama_cpp_python-$version/vendor/llama.cpp"
  rm -rf "$src"
  mv "$src.tmp" "$src"
}

build_server() {
  if [ -x "$server" ]; then
    echo "llama-server: $server (built)"
    return
  fi
  echo "== build llama-server (Release, CPU, -j${DSP_PEER_JOBS:-2}) =="
  # LLAMA_CURL is gone from this llama.cpp (model downloads use cpp-httplib); HTTPS (OpenSSL),
  # the web UI (an npm build or a download) and the tests are left out: nothing is fetched at
  # build time.
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON >"$peer/cmake-configure.log" \
    || { cat "$peer/cmake-configure.log"; exit 1; }
  cmake --build "$build" --target llama-server -j "${DSP_PEER_JOBS:-2}"
  echo "llama-server: $server"
}

make_venv() {
  if [ -f "$venv/.ready" ]; then
    echo "converter venv: $venv (ready)"
    return
  fi
  echo "== converter venv: $venv =="
  "${DSP_PEER_PYTHON:-python3}" -m venv "$venv"
  # The converter's own requirements (torch, numpy, sentencepiece, transformers, protobuf, gguf),
  # less the extra index of PyTorch's CPU wheels (only PyPI is reached: its torch brings the CUDA
  # runtime wheels too, a few GB, unused here).
  local reqs=$src/requirements
  sed '/^--extra-index-url/d' "$reqs/requirements-convert_hf_to_gguf.txt" >"$reqs/requirements-convert_hf_to_gguf.pypi.txt"
  "$venv/bin/pip" install --disable-pip-version-check -q -r "$reqs/requirements-convert_hf_to_gguf.pypi.txt"
  # the converter imports the bundled gguf-py first (sys.path); install it too, so its
  # dependencies are there
  "$venv/bin/pip" install --disable-pip-version-check -q "$src/gguf-py"
  "$venv/bin/python" -c "import torch, transformers, numpy, gguf, sentencepiece"
  touch "$venv/.ready"
  echo "converter venv: $venv"
}

need_built() {
  [ -x "$server" ] && [ -f "$venv/.ready" ] || { echo "llama_server.sh: run '$0 build' first" >&2; exit 1; }
}

cmd=${1:-}
case "$cmd" in
  build)
    mkdir -p "$peer"
    fetch_source
    build_server
    make_venv
    ;;
  convert)
    [ $# -ge 3 ] || usage
    need_built
    merged=$2 out=$3
    shift 3
    [ -f "$merged/model.safetensors" ] && [ -f "$merged/config.json" ] \
      || { echo "llama_server.sh: $merged is not a merged checkpoint (dsp-reshard --merge)" >&2; exit 1; }
    [ -f "$merged/tokenizer.json" ] \
      || { echo "llama_server.sh: $merged has no tokenizer.json (a byte model merged by an older dsp-reshard?)" >&2; exit 1; }
    "$venv/bin/python" "$tools/llama_convert.py" "$src" "$merged" --outtype f32 --outfile "$out" "$@"
    ;;
  serve)
    [ $# -ge 3 ] || usage
    need_built
    gguf=$2 port=$3
    shift 3
    slots=${DSP_PEER_SLOTS:-4} slot_ctx=${DSP_PEER_SLOT_CTX:-128} threads=${DSP_PEER_THREADS:-2}
    args=("$server" -m "$gguf" --host 127.0.0.1 --port "$port" --cont-batching -np "$slots"
          -c $((slots * slot_ctx)) -t "$threads" -tb "$threads" -b 512 -ub 512 -fa off -ctk f32 -ctv f32 --no-webui
          "$@")
    printf '%q ' "${args[@]}"
    echo
    exec "${args[@]}"
    ;;
  path)
    echo "$server"
    ;;
  *)
    usage
    ;;
esac
