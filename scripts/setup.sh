#!/usr/bin/env bash
# Installs the Debian packages dsp needs to build, test and benchmark (idempotent).
# Checks each package with `dpkg -s` first, so it returns at once when all are present;
# otherwise runs `apt-get update` once and installs only the missing ones (needs root,
# or sudo when available).
set -euo pipefail

packages=(
  cmake                # >= 3.25 (CMakePresets.json version 6)
  g++                  # C++20
  make
  libopenblas-dev      # CBLAS (host GEMM), found as BLAS with BLA_VENDOR=OpenBLAS
  doctest-dev          # tests
  libbenchmark-dev     # benchmarks/ (Google Benchmark)
  nlohmann-json3-dev   # configs, checkpoint manifests
  libcli11-dev         # samples' command lines
  zlib1g-dev           # checksums (crc32)
  libopenmpi-dev       # comm::MpiComm (DSP_ENABLE_MPI turns on when CMake finds MPI)
  openmpi-bin          # mpiexec: the MPI tests and `mpiexec -n N dsp-train`
  ccache               # .ci/run's compiler cache (optional for other builds)
  libcpp-httplib-dev   # dsp-serve's HTTP server and bench_serving's client (cpp-httplib)
  pkg-config           # finds cpp-httplib (cpp-httplib.pc)
  curl                 # tests/samples/serve_test.sh speaks HTTP to dsp-serve with it
  jq                   # ... and reads the JSON answers with it
)

missing=()
for p in "${packages[@]}"; do
  # `dpkg -s` also succeeds for removed-but-configured packages: require "install ok installed".
  if dpkg -s "$p" 2>/dev/null | grep -q '^Status: install ok installed'; then
    echo "setup: $p is installed"
  else
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present, nothing to do"
  exit 0
fi

echo "setup: missing: ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1; then
  sudo=(sudo)
else
  echo "setup: need root (or sudo) to install: ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
echo "setup: apt-get update"
"${sudo[@]}" apt-get update
echo "setup: apt-get install -y --no-install-recommends ${missing[*]}"
"${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
echo "setup: done"
