#!/usr/bin/env bash
# Build llama.cpp's own tools from the llama-cpp-python sdist (the version every peer row uses),
# as the strongest build a user gets on each ISA:
#
#   bench/llamacpp.sh BUILD [DIR]
#
#   x86        clang, -march=native: the strongest build on this CPU. Where the CPU has AMX the
#              build has it too: GCC 12 miscompiles ggml's AMX tile config (ldtilecfg faults), and
#              clang 14 predefines __AMXINT8__ where ggml tests __AMX_INT8__, so a plain clang
#              build silently has no AMX; the defines below turn it on.
#   x86-gcc    GCC 12, -march=native without AMX (what a default build from source gives).
#   arm64      cross-built, static, for the Yitian 710's ISA (Armv9 SVE2, i8mm, dotprod) with the
#              Q4_0 repack on, run under qemu by bench/arm_icount.py.
#   arm64-native  built on an aarch64 machine itself (the ARM server, or scripts/arm64/native.sh's
#              root): GCC, -march from that CPU's /proc/cpuinfo features (SVE2, i8mm, dotprod,
#              fp16, bf16), OpenMP, the repack on. For scripts/arm64/board_bench.py there.
#   arm64-kleidiai  the same as arm64 with Arm's KleidiAI kernels on (-DGGML_CPU_KLEIDIAI=ON), the other
#              strong aarch64 build. llama.cpp's CMake downloads KleidiAI, which cannot be done
#              here: KLEIDIAI_SRC names the source (the v1.24.0 tarball or its unpacked folder, the
#              tag this llama.cpp asks for). clang 14 cross-compiles it (GCC 12 stops with an
#              internal compiler error on one KleidiAI file); it finds no aarch64 OpenMP, so ggml
#              runs its own thread pool.
#   arm64-kleidiai-omp  KleidiAI's kernels with GCC 12 and OpenMP, as arm64: the build a user with
#              GCC gets, whose threads wait in OpenMP's barriers (passive under OMP_WAIT_POLICY)
#              instead of ggml's spinning pool. GCC 12's vectorizer stops with an internal error
#              on one KleidiAI file at -O3 (kai_lhs_quant_pack_qai8dxp_bf16_neon.c, a bf16
#              activation packer no Q4_0 model calls): that file alone gets -fno-tree-vectorize.
#
# DIR defaults to ${XDG_CACHE_HOME:-~/.cache}/qwc/llamacpp-BUILD (x86: -BUILD-<hash of this CPU's
# flags>, so a cached native build never runs on another CPU). Builds (~20 min each on 2 cores)
# are cached there as TOOL-VERSION (x86: linked to the shared libraries in DIR/build/bin); prints
# DIR last. PYTHON: the interpreter whose pip fetches the sdist (default python3). LLAMACPP_SDIST:
# that sdist already fetched (its .tar.gz), for a machine where pip is slow: under emulation it
# takes longer than fetching it outside and copying it in.
set -euo pipefail
VERSION=$(sed -n 's/^VERSION = "\(.*\)".*/\1/p' "$(dirname "$0")/llamacpp.py")   # one place: bench/llamacpp.py
BUILD=${1:?usage: bench/llamacpp.sh x86|x86-gcc|arm64|arm64-native|arm64-kleidiai|arm64-kleidiai-omp [DIR]}
cpu=
[[ $BUILD == x86* ]] && cpu=-$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-8)
[[ $BUILD == arm64-native ]] && cpu=-$(grep -m1 '^Features' /proc/cpuinfo | sha256sum | cut -c1-8)
DIR=${2:-${XDG_CACHE_HOME:-$HOME/.cache}/qwc/llamacpp-$BUILD$cpu}
say() { echo "[llama.cpp $BUILD] $*" >&2; }
need() {   # Debian packages, installed when missing
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if ((${#missing[@]})); then
    say "installing ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
  fi
}
mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd)
kleidiai_source() {   # KLEIDIAI_SRC unpacked once into $DIR/kleidiai (llama.cpp's CMake would download it)
  kai=$DIR/kleidiai
  if [[ ! -f $kai/CMakeLists.txt ]]; then
    [[ -n ${KLEIDIAI_SRC:-} ]] || { echo "llamacpp.sh: $BUILD needs KLEIDIAI_SRC=<KleidiAI v1.24.0 source, .tar.gz or folder> (llama.cpp's CMake would download it)" >&2; exit 2; }
    rm -rf "$kai.partial" && mkdir -p "$kai.partial"
    if [[ -d $KLEIDIAI_SRC ]]; then cp -r "$KLEIDIAI_SRC/." "$kai.partial/"
    else tar -C "$kai.partial" -xzf "$KLEIDIAI_SRC"; fi
    # a tarball holds one top folder
    top=$(find "$kai.partial" -mindepth 1 -maxdepth 1)
    [[ $(wc -l <<<"$top") == 1 && -f $top/CMakeLists.txt ]] && { mv "$top" "$kai.top"; rm -rf "$kai.partial"; mv "$kai.top" "$kai.partial"; }
    [[ -f $kai.partial/CMakeLists.txt ]] || { echo "llamacpp.sh: $KLEIDIAI_SRC holds no KleidiAI source (no CMakeLists.txt)" >&2; exit 2; }
    mv "$kai.partial" "$kai"
  fi
}
case $BUILD in
  x86)
    TOOLS="llama-bench llama-perplexity llama-quantize llama-server llama-imatrix llama-completion"
    FLAGS=(-DGGML_NATIVE=ON -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++)
    if grep -q '^flags.* amx_int8' /proc/cpuinfo; then
      amx_defs="-D__AMX_TILE__=1 -D__AMX_INT8__=1 -D__AMX_BF16__=1"
      FLAGS+=("-DCMAKE_C_FLAGS=$amx_defs" "-DCMAKE_CXX_FLAGS=$amx_defs")
    fi
    need cmake ninja-build clang libomp-dev ;;
  x86-gcc)
    TOOLS="llama-bench llama-perplexity llama-quantize llama-server"
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    FLAGS=(-DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=$no_amx" "-DCMAKE_CXX_FLAGS=$no_amx")
    need cmake ninja-build g++ ;;
  arm64)
    TOOLS="llama-bench llama-completion"
    need cmake ninja-build g++-aarch64-linux-gnu
    cat >"$DIR/toolchain.cmake" <<TC
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
TC
    FLAGS=("-DCMAKE_TOOLCHAIN_FILE=$DIR/toolchain.cmake" -DGGML_NATIVE=OFF
      -DGGML_CPU_ARM_ARCH=armv9-a+sve2+i8mm+dotprod+fp16+bf16 -DGGML_CPU_REPACK=ON -DBUILD_SHARED_LIBS=OFF
      -DCMAKE_EXE_LINKER_FLAGS=-static "-DOpenMP_gomp_LIBRARY=$(aarch64-linux-gnu-gcc -print-file-name=libgomp.a)") ;;
  arm64-native)
    [[ $(uname -m) == aarch64 ]] || { echo "llamacpp.sh: arm64-native builds on an aarch64 machine (this is $(uname -m))" >&2; exit 2; }
    TOOLS="llama-bench"
    # The ISA from this CPU's own feature list, not GGML_NATIVE: ggml's native probe gave GCC 12
    # "-march=armv8-a+...+nodotprod+noi8mm+sve" in the emulated root, which it refuses (an
    # extension added after one removed), though the CPU has both.
    feats=" $(grep -m1 '^Features' /proc/cpuinfo | cut -d: -f2) "
    arch=armv8.2-a
    [[ $feats == *" sve2 "* ]] && arch=armv9-a
    for f in asimddp:dotprod asimdhp:fp16 i8mm:i8mm bf16:bf16 sve2:sve2; do
      [[ $feats == *" ${f%%:*} "* ]] && arch+=+${f#*:}
    done
    FLAGS=(-DGGML_NATIVE=OFF "-DGGML_CPU_ARM_ARCH=$arch" -DGGML_CPU_REPACK=ON)
    need cmake ninja-build g++ ;;
  arm64-kleidiai)
    TOOLS="llama-bench llama-completion"
    need cmake ninja-build clang-14 g++-aarch64-linux-gnu binutils-aarch64-linux-gnu
    kleidiai_source
    cat >"$DIR/toolchain.cmake" <<TC
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER clang-14)
set(CMAKE_CXX_COMPILER clang++-14)
set(CMAKE_C_COMPILER_TARGET aarch64-linux-gnu)
set(CMAKE_CXX_COMPILER_TARGET aarch64-linux-gnu)
set(CMAKE_ASM_COMPILER clang-14)
set(CMAKE_ASM_COMPILER_TARGET aarch64-linux-gnu)
TC
    FLAGS=("-DCMAKE_TOOLCHAIN_FILE=$DIR/toolchain.cmake" -DGGML_NATIVE=OFF
      -DGGML_CPU_ARM_ARCH=armv9-a+sve2+i8mm+dotprod+fp16+bf16 -DGGML_CPU_REPACK=ON -DGGML_CPU_KLEIDIAI=ON
      "-DFETCHCONTENT_SOURCE_DIR_KLEIDIAI=$kai" -DBUILD_SHARED_LIBS=OFF -DCMAKE_EXE_LINKER_FLAGS=-static) ;;
  arm64-kleidiai-omp)
    TOOLS="llama-bench llama-completion"
    need cmake ninja-build g++-aarch64-linux-gnu
    kleidiai_source
    cat >"$DIR/toolchain.cmake" <<TC
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
TC
    # runs after KleidiAI's project(); deferred past its own per-file -march options
    cat >"$DIR/kleidiai-gcc12.cmake" <<'KC'
cmake_language(DEFER CALL set_property SOURCE
  "${CMAKE_CURRENT_SOURCE_DIR}/kai/ukernels/matmul/pack/kai_lhs_quant_pack_qai8dxp_bf16_neon.c"
  APPEND PROPERTY COMPILE_OPTIONS -fno-tree-vectorize)
KC
    FLAGS=("-DCMAKE_TOOLCHAIN_FILE=$DIR/toolchain.cmake" -DGGML_NATIVE=OFF
      -DGGML_CPU_ARM_ARCH=armv9-a+sve2+i8mm+dotprod+fp16+bf16 -DGGML_CPU_REPACK=ON -DGGML_CPU_KLEIDIAI=ON
      "-DFETCHCONTENT_SOURCE_DIR_KLEIDIAI=$kai" "-DCMAKE_PROJECT_KleidiAI_INCLUDE=$DIR/kleidiai-gcc12.cmake"
      -DBUILD_SHARED_LIBS=OFF -DCMAKE_EXE_LINKER_FLAGS=-static
      "-DOpenMP_gomp_LIBRARY=$(aarch64-linux-gnu-gcc -print-file-name=libgomp.a)") ;;
  *) echo "llamacpp.sh: unknown build '$BUILD' (x86, x86-gcc, arm64, arm64-native, arm64-kleidiai or arm64-kleidiai-omp)" >&2; exit 2 ;;
esac
todo=()
for t in $TOOLS; do [[ -x $DIR/$t-$VERSION ]] || todo+=("$t"); done
if ((${#todo[@]})); then
  src=$DIR/src
  if [[ ! -d $src/vendor/llama.cpp ]]; then
    say "fetching the llama-cpp-python $VERSION sdist"
    sdist=${LLAMACPP_SDIST:-$DIR/sdist/llama_cpp_python-$VERSION.tar.gz}
    if [[ -z ${LLAMACPP_SDIST:-} ]]; then
      rm -rf "$DIR/sdist" && mkdir -p "$DIR/sdist"
      "${PYTHON:-python3}" -m pip download -q --no-deps --no-binary=:all: -d "$DIR/sdist" "llama-cpp-python==$VERSION" \
        2> >(grep -v "is ignored: it is neither" >&2)
    fi
    [[ $sdist == */llama_cpp_python-$VERSION.tar.gz && -f $sdist ]] \
      || { echo "llamacpp.sh: $sdist is not the llama-cpp-python $VERSION sdist (llama_cpp_python-$VERSION.tar.gz)" >&2; exit 2; }
    rm -rf "$src.partial" && mkdir -p "$src.partial"
    tar -C "$src.partial" --strip-components=1 -xzf "$sdist"
    mv "$src.partial" "$src"
  fi
  say "building ${todo[*]} (about 20 minutes on 2 cores; an hour under emulation)"
  cmake -S "$src/vendor/llama.cpp" -B "$DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${FLAGS[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TOOLS=ON >"$DIR/cmake.log" 2>&1 || { tail -20 "$DIR/cmake.log" >&2; exit 1; }
  cmake --build "$DIR/build" --target "${todo[@]}" -j 2 >"$DIR/build.log" 2>&1 || { tail -20 "$DIR/build.log" >&2; exit 1; }
  for t in "${todo[@]}"; do cp "$DIR/build/bin/$t" "$DIR/$t.partial" && mv "$DIR/$t.partial" "$DIR/$t-$VERSION"; done
fi
echo "$DIR"
