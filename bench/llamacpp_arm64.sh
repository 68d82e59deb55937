#!/usr/bin/env bash
# Cross-build llama.cpp's llama-bench for aarch64 (the peer of qwc's arm-yitian artifacts under
# qemu), from the same llama-cpp-python sdist bench/setup.sh builds for x86: static, for the
# Yitian 710's ISA (Armv9 SVE2, i8mm, dotprod), with its Q4_0 repack on, so it picks the 4x8
# layout, the dotprod GEMV and the i8mm GEMM it would pick on the real CPU.
#
#   bench/llamacpp_arm64.sh [DIR]     DIR defaults to ${XDG_CACHE_HOME:-~/.cache}/qwc/llamacpp-arm64
#
# Prints the path of llama-bench last. The build (~20 min on 2 cores) is cached in DIR.
set -euo pipefail
VERSION=0.3.36
DIR=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/qwc/llamacpp-arm64}
mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd)
OUT=$DIR/llama-bench-$VERSION
say() { echo "[llama.cpp arm64] $*" >&2; }
if [[ ! -x $OUT ]]; then
  for tool in aarch64-linux-gnu-gcc aarch64-linux-gnu-g++ cmake; do
    command -v "$tool" >/dev/null || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends g++-aarch64-linux-gnu cmake >/dev/null; break; }
  done
  src=$DIR/src
  if [[ ! -d $src/vendor/llama.cpp ]]; then
    say "fetching the llama-cpp-python $VERSION sdist"
    rm -rf "$DIR/sdist" && mkdir -p "$DIR/sdist"
    python3 -m pip download -q --no-deps --no-binary=:all: -d "$DIR/sdist" "llama-cpp-python==$VERSION" \
      2> >(grep -v "is ignored: it is neither" >&2)
    rm -rf "$src.partial" && mkdir -p "$src.partial"
    tar -C "$src.partial" --strip-components=1 -xzf "$DIR"/sdist/llama_cpp_python-$VERSION.tar.gz
    mv "$src.partial" "$src"
  fi
  gomp=$(aarch64-linux-gnu-gcc -print-file-name=libgomp.a)
  cat >"$DIR/toolchain.cmake" <<TC
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
TC
  say "building llama-bench for aarch64 (about 20 minutes)"
  rm -rf "$DIR/build"
  cmake -S "$src/vendor/llama.cpp" -B "$DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_TOOLCHAIN_FILE="$DIR/toolchain.cmake" -DGGML_NATIVE=OFF \
    -DGGML_CPU_ARM_ARCH=armv9-a+sve2+i8mm+dotprod+fp16+bf16 -DGGML_CPU_REPACK=ON \
    -DBUILD_SHARED_LIBS=OFF -DCMAKE_EXE_LINKER_FLAGS=-static -DOpenMP_gomp_LIBRARY="$gomp" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_TOOLS=ON >"$DIR/cmake.log" 2>&1 || { tail -20 "$DIR/cmake.log" >&2; exit 1; }
  cmake --build "$DIR/build" --target llama-bench -j 2 >"$DIR/build.log" 2>&1 || { tail -20 "$DIR/build.log" >&2; exit 1; }
  cp "$DIR/build/bin/llama-bench" "$OUT.partial" && mv "$OUT.partial" "$OUT"
fi
echo "$OUT"
