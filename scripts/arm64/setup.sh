#!/usr/bin/env bash
# Prepare this x86_64 Debian 12 machine to run qwc's aarch64 artifacts under QEMU user-mode
# emulation (there is no ARM hardware here). Idempotent: completed steps are skipped.
#
#   scripts/arm64/setup.sh [DIR]        DIR defaults to ${XDG_CACHE_HOME:-~/.cache}/qwc/arm64
#
# DIR receives:
#   sysroot/  Debian's arm64 python3.11 and libstdc++ unpacked (never installed on the host:
#             apt runs with a private state whose only architecture is arm64)
#   site/     aarch64 wheels: the TVM runtime qwc pins, numpy, tokenizers
#   env.sh    source it; then "$QWC_ARM64_PY" script.py runs the arm64 python
# Host packages it may apt-get install (root): qemu-user, the aarch64 cross g++ and binutils.
set -euo pipefail

DIR=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/qwc/arm64}
mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd)
TVM_VERSION=0.27.0.post1
TVM_FFI_VERSION=0.1.14.post1   # 0.1.15.post2 segfaults in tensorize (see pyproject.toml)
say() { echo "[qwc arm64] $*" >&2; }

missing=()
for tool in qemu-aarch64 aarch64-linux-gnu-g++ aarch64-linux-gnu-objdump dpkg-deb; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if ((${#missing[@]})); then
  say "installing host packages for: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    qemu-user g++-aarch64-linux-gnu binutils-aarch64-linux-gnu libc6-dev-arm64-cross dpkg-dev >/dev/null
fi

if [[ ! -x $DIR/sysroot/usr/bin/python3.11 ]]; then
  say "fetching Debian's arm64 python3.11 into $DIR/sysroot"
  state=$DIR/apt-state
  rm -rf "$state" && mkdir -p "$state/lists/partial" "$state/archives/partial" "$state/sources"
  : >"$state/status"
  # The machine's own Debian sources, which name no architecture, serve arm64 as well.
  cp /etc/apt/sources.list.d/*.sources "$state/sources/" 2>/dev/null || true
  [[ -f /etc/apt/sources.list ]] && cp /etc/apt/sources.list "$state/sources/host.list"
  apt_opts=(
    -o APT::Architecture=arm64 -o APT::Architectures::=arm64
    -o Dir::State::status="$state/status" -o Dir::State::Lists="$state/lists"
    -o Dir::Cache::archives="$state/archives" -o Dir::Etc::SourceList=/dev/null
    -o Dir::Etc::SourceParts="$state/sources" -o Dir::Etc::Preferences=/dev/null
    -o Dir::Etc::PreferencesParts=/dev/null -o Debug::NoLocking=1 -o APT::Sandbox::User="$(id -un)"
  )
  apt-get "${apt_opts[@]}" update -qq
  apt-get "${apt_opts[@]}" install -y -qq --download-only --no-install-recommends python3.11 libstdc++6 >/dev/null
  rm -rf "$DIR/sysroot.partial" && mkdir -p "$DIR/sysroot.partial"
  for deb in "$state"/archives/*.deb; do dpkg-deb -x "$deb" "$DIR/sysroot.partial"; done
  mv "$DIR/sysroot.partial" "$DIR/sysroot" && rm -rf "$state"
fi

stamp=$DIR/site/.qwc-tvm-$TVM_VERSION-ffi-$TVM_FFI_VERSION-mld-0.6.0-rpc
if [[ ! -f $stamp ]]; then
  say "installing aarch64 wheels (apache-tvm $TVM_VERSION, numpy, tokenizers, RPC server deps) into $DIR/site"
  rm -rf "$DIR/site.partial"
  python3 -m pip install -q --disable-pip-version-check --only-binary=:all: \
    --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 --python-version 3.11 \
    --implementation cp --abi cp311 --abi abi3 --abi none --target "$DIR/site.partial" \
    "apache-tvm==$TVM_VERSION" "apache-tvm-ffi==$TVM_FFI_VERSION" "numpy==2.4.6" "ml-dtypes==0.6.0" "tokenizers==0.23.3" \
    "cloudpickle==3.1.2" "psutil==7.2.2" \
    2> >(grep -v "is ignored: it is neither" >&2)
  rm -rf "$DIR/site" && mv "$DIR/site.partial" "$DIR/site" && touch "$stamp"
fi

cat >"$DIR/env.sh" <<ENV
# Written by qwc's scripts/arm64/setup.sh. QEMU_CPU: SVE2, dotprod, i8mm, bf16 with 128-bit
# vectors as on Neoverse-N2 (plain "max" would mean 512-bit SVE).
export QEMU_CPU=max,sve128=on
export QEMU_LD_PREFIX=$DIR/sysroot
export QWC_ARM64_SITE=$DIR/site
export QWC_ARM64_PY="qemu-aarch64 -L $DIR/sysroot $DIR/sysroot/usr/bin/python3.11"
ENV
say "ready: source $DIR/env.sh, then \$QWC_ARM64_PY script.py (PYTHONPATH=\$QWC_ARM64_SITE)"
