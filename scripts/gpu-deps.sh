#!/usr/bin/env bash
# Prepares, on a development machine, the libraries gpu-check.sh needs that the GPU machine's
# image lacks (it has CMake, nvcc and NCCL's Python wheel but not our Debian packages, and no
# network): downloads the Debian packages, unpacks them into .gpu-deps/root (git-ignored, about
# 40 MB) and prints how to carry it. gpu-check.sh uses .gpu-deps/root when it is there.
#
#   bash scripts/gpu-deps.sh      # then: device run with carry [".gpu-deps"]
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu-deps
packages=(libopenblas0-pthread libopenblas-pthread-dev libopenblas-dev libgfortran5 libquadmath0 doctest-dev
  nlohmann-json3-dev libbenchmark-dev libbenchmark1debian libcli11-dev zlib1g-dev zlib1g)
rm -rf "$out"
mkdir -p "$out/debs" "$out/root"
(cd "$out/debs" && apt-get download "${packages[@]}")
for deb in "$out"/debs/*.deb; do dpkg -x "$deb" "$out/root"; done
rm -rf "$out/debs"
# What the build does not need: OpenBLAS as a static library, LAPACK, the reference BLAS, documentation.
find "$out/root" -name 'libopenblas*.a' -delete  # keep the others: benchmark's CMake config names its .a files
rm -rf "$out/root/usr/share/doc" "$out/root/usr/share/lintian"
rm -f "$out/root"/usr/lib/x86_64-linux-gnu/openblas-pthread/{liblapack,libblas}.*
# zlib1g-dev's libz.so points at an absolute /lib path: point it at the carried library instead.
lib=$out/root/usr/lib/x86_64-linux-gnu
if [[ -d $out/root/lib/x86_64-linux-gnu ]]; then mv "$out"/root/lib/x86_64-linux-gnu/libz.so.* "$lib"/; fi
ln -sf libz.so.1 "$lib/libz.so"
[[ -e $lib/libz.so ]] || { echo "gpu-deps: libz.so does not resolve in $lib" >&2; exit 1; }
echo "gpu-deps: $(du -sh "$out" | cut -f1) in $out; carry it: run(carry=[\"$out\"], command=\"bash scripts/gpu-check.sh \$OUT/gpu-check.md\")"
