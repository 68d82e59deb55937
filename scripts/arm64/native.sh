#!/usr/bin/env bash
# qwc as a user of an ARM server meets it, on this x86 machine: an arm64 Debian 12 userland
# (debootstrap) run through QEMU 10's qemu-aarch64 registered with binfmt_misc, so that every
# process inside, pip's and the compiler's children too, is aarch64. It proves installs and
# behaviour, not speed. Not part of CI (about half an hour, an hour more with --board-bench); its
# results go in docs/history/arm-native.md.
#
#   scripts/arm64/native.sh [--tests 'PYTEST ARGS' | --no-tests] [--board-bench [native|cross]]
#
# Inside the root, with QEMU_CPU=max,sve128=on (a Neoverse-N2-like CPU: SVE2 at 128 bits,
# dotprod, i8mm, bf16), from a fresh clone of this checkout's HEAD:
#   1. the README's first command, which must end in " Paris.", with no torch installed;
#   2. `qwc targets`: `host` must be the arm-yitian kernels;
#   3. the route "compile elsewhere, copy": this machine's qwc compiles the same model with
#      --target arm-yitian, and a runtime-only install (`pip install '.[runtime]'`) in the root
#      runs it (`qwc run`: the same greedy text as the artifact compiled inside) and serves it
#      (the openai client gets an answer);
#   4. QEMU_CPU=neoverse-n1 (no i8mm, no SVE): that artifact is refused in one line, and
#      `qwc targets` picks arm-neon for `host`;
#   5. the test subset (TESTS below) in the root's venv;
#   6. with --board-bench, the board benchmark as on a board: scripts/arm64/board_bench.py in
#      the root on the copied artifact and the GGUF it came from (correctness of the harness,
#      not speed), with llama.cpp built in the root by bench/llamacpp.sh arm64-native (`native`,
#      the default: more than an hour, as its compiler runs under emulation) or this machine's
#      cross-built bench/llamacpp.sh arm64 copied in (`cross`: minutes).
# One summary line at the end; the full log is in $CACHE/native.log.
#
# Cached in ${XDG_CACHE_HOME:-~/.cache}/qwc/arm64-native: QEMU 10's static binaries and the
# arm64 root (built once, about 10 minutes). Each run clones anew into the root's /home/qwc.
# Needs root (debootstrap, chroot, binfmt_misc, bind mounts). Registers a binfmt handler of
# its own name, qwc-aarch64, and removes it again on exit; it touches no other handler.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${QWC_ARM64_NATIVE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/qwc/arm64-native}
ROOT=$CACHE/root
QEMU=$CACHE/qemu/usr/bin/qemu-aarch64
HANDLER=qwc-aarch64
BINFMT=/proc/sys/fs/binfmt_misc
# The test files that need no torch (scripts/setup.sh installs none on aarch64; most of the suite
# builds the `tiny` preset in torch) and fit in minutes of emulation: the torch-free route from a
# GGUF to a served answer, sampling, grammars, tool calls, the scheduler's policy, Q4 packing,
# the kernel cache, and the repository's own checks. docs/history/arm-native.md: the choice, time.
TESTS=${QWC_NATIVE_TESTS:-tests/models/test_torch_free.py tests/runtime/test_sampling.py tests/runtime/test_grammar.py
  tests/runtime/test_scheduler_policy.py tests/runtime/test_tools.py tests/runtime/test_progress.py tests/passes/test_q4.py
  tests/compiler/test_kernel_cache.py tests/test_layering.py tests/test_code_shape.py tests/test_docs.py}
TESTS=$(echo $TESTS)   # one line
RUN_TESTS=1
BOARD=
while (($#)); do
  case $1 in
    --tests) TESTS=$2; shift 2 ;;
    --no-tests) RUN_TESTS=0; shift ;;
    --board-bench)
      BOARD=native; shift
      if [[ ${1:-} == native || ${1:-} == cross ]]; then BOARD=$1; shift; fi ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "native: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
say() { echo "[native $(date +%H:%M:%S)] $*" >&2; }
die() { echo "native: $*" >&2; exit 1; }
[[ $(id -u) == 0 ]] || die "needs root (debootstrap, chroot, binfmt_misc)"
mkdir -p "$CACHE"
LOG=$CACHE/native.log
: >"$LOG"

# The Debian mirror this machine's apt uses, for the root's apt and for trixie's QEMU.
mirror() {
  local uri
  uri=$(grep -rhoE '^URIs: *[^ ]+/debian/?$' /etc/apt/sources.list.d/ 2>/dev/null | head -1 | awk '{print $2}')
  [[ -n $uri ]] || uri=$(grep -hoE '^deb +[^ ]+/debian/? ' /etc/apt/sources.list 2>/dev/null | head -1 | awk '{print $2}')
  [[ -n $uri ]] || die "no Debian mirror found in /etc/apt"
  echo "${uri%/}"
}

# Debian 12's qemu-user (7.2) dies loading torch's, onnxruntime's and TVM's C extensions;
# Debian 13's (10.x, static) runs them. Fetched with a private apt state: nothing is installed.
fetch_qemu() {
  [[ -x $QEMU ]] && return
  say "fetching Debian 13's qemu-user (static qemu-aarch64) into $CACHE/qemu"
  local state=$CACHE/apt-trixie
  rm -rf "$state" "$CACHE/qemu.partial" && mkdir -p "$state/lists/partial" "$state/archives/partial" "$state/parts"
  : >"$state/status"
  echo "deb $(mirror) trixie main" >"$state/parts/trixie.list"
  local opts=(-o Dir::State::status="$state/status" -o Dir::State::Lists="$state/lists"
    -o Dir::Cache::archives="$state/archives" -o Dir::Etc::SourceList=/dev/null
    -o Dir::Etc::SourceParts="$state/parts" -o Dir::Etc::Preferences=/dev/null
    -o Dir::Etc::PreferencesParts=/dev/null -o Debug::NoLocking=1 -o APT::Sandbox::User="$(id -un)")
  apt-get "${opts[@]}" update -qq
  (cd "$state/archives" && apt-get "${opts[@]}" download -qq qemu-user)
  dpkg-deb -x "$state"/archives/qemu-user_*.deb "$CACHE/qemu.partial"
  "$CACHE/qemu.partial/usr/bin/qemu-aarch64" --version | head -1 >&2
  rm -rf "$CACHE/qemu" && mv "$CACHE/qemu.partial" "$CACHE/qemu" && rm -rf "$state"
}

# F: the kernel opens the interpreter now, so it works inside the chroot without a copy there.
register_binfmt() {
  mountpoint -q "$BINFMT" || mount binfmt_misc -t binfmt_misc "$BINFMT"
  [[ -e $BINFMT/$HANDLER ]] && echo -1 >"$BINFMT/$HANDLER"
  local magic='\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00'
  local mask='\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff'
  echo ":$HANDLER:M::$magic:$mask:$QEMU:FOCP" >"$BINFMT/register"
}

MOUNTS=()
cleanup() {
  local i
  for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do umount -l "${MOUNTS[i]}" 2>/dev/null || true; done
  [[ -n ${SERVER_PID:-} ]] && kill "$SERVER_PID" 2>/dev/null || true
  [[ -e $BINFMT/$HANDLER ]] && echo -1 >"$BINFMT/$HANDLER" || true
}
trap cleanup EXIT

mount_root() {
  local d
  for d in proc sys dev dev/pts; do
    mkdir -p "$ROOT/$d"
    mountpoint -q "$ROOT/$d" && continue
    case $d in
      proc) mount -t proc proc "$ROOT/proc" ;;
      *) mount --rbind "/$d" "$ROOT/$d" ;;
    esac
    MOUNTS+=("$ROOT/$d")
  done
}

# The registries are reached as from this machine: its resolver, pip configuration and CAs.
copy_network_config() {
  cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
  [[ -f /etc/pip.conf ]] && cp /etc/pip.conf "$ROOT/etc/pip.conf"
  if [[ -d /usr/local/share/ca-certificates ]]; then
    mkdir -p "$ROOT/usr/local/share/ca-certificates"
    cp -r /usr/local/share/ca-certificates/. "$ROOT/usr/local/share/ca-certificates/"
  fi
  local f
  for f in "${SSL_CERT_FILE:-}" "${PIP_CERT:-}" /etc/ssl/certs/ca-certificates.crt; do
    [[ -n $f && -f $f ]] || continue
    mkdir -p "$ROOT$(dirname "$f")" && cp "$f" "$ROOT$f"
  done
}

# A root is only ever removed with nothing mounted in it (a run killed before its cleanup leaves
# this machine's /dev and /sys bound inside).
remove_root() {
  if awk -v p="$1/" 'index($2, p) == 1 {found = 1} END {exit !found}' /proc/mounts; then
    die "$1 still has file systems mounted in it (an earlier run killed?): umount them first"
  fi
  rm -rf "$1"
}

# What a fresh arm64 server has, plus what the README assumes of Debian 12: python3 with venv,
# git, and a C compiler (TVM links the compiled model with it).
build_root() {
  [[ -x $ROOT/usr/bin/python3.11 && -f $ROOT/.qwc-root-ready ]] && return
  command -v debootstrap >/dev/null || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
  say "debootstrap arm64 bookworm into $ROOT (several minutes: its second stage runs under emulation)"
  remove_root "$ROOT.partial"
  debootstrap --arch=arm64 --variant=minbase \
    --include=python3,python3-venv,python3-dev,git,ca-certificates,g++,make,cmake,procps \
    bookworm "$ROOT.partial" "$(mirror)" >>"$LOG" 2>&1 || die "debootstrap failed (see $LOG)"
  remove_root "$ROOT" && mv "$ROOT.partial" "$ROOT"
  touch "$ROOT/.qwc-root-ready"
}

# The README's first fenced command line, as the user copies it.
readme_command() { awk '/^```/ {n++; next} n == 1 {print; exit}' "$REPO/README.md"; }

# seconds since $1 (a `date +%s`)
since() { echo $(($(date +%s) - $1)); }

CLONE=/home/qwc/qwc
ART=/home/qwc/artifacts
PROMPT="The capital of France is"
SUMMARY=()
check() {  # check NAME CONDITION-RESULT DETAIL
  if [[ $2 == 0 ]]; then SUMMARY+=("$1: ok${3:+ ($3)}"); else SUMMARY+=("$1: FAILED${3:+ ($3)}"); FAILED=1; fi
  say "${SUMMARY[-1]}"
}
summary() {
  local line item
  line="native: $( ((FAILED)) && echo FAILED || echo passed) in $(since "$T0")s"
  for item in "${SUMMARY[@]}"; do line+="; $item"; done
  echo "$line"
}
FAILED=0

# 1. A fresh clone of this checkout's HEAD, and the README's first command in it.
readme_first_command() {
  rm -rf "$ROOT/home/qwc" && mkdir -p "$ROOT/home/qwc"
  git clone -q "$REPO" "$ROOT$CLONE"
  in_root 'apt-get update -qq' >>"$LOG" 2>&1 || true   # `qwc data fetch` uses apt-get download
  local cmd t0 rc=0
  cmd=$(readme_command)
  say "README's first command: $cmd"
  t0=$(date +%s)
  in_root "cd $CLONE && $cmd" >"$CACHE/readme.out" 2>>"$LOG" || rc=$?
  local secs; secs=$(since "$t0")
  cat "$CACHE/readme.out" >>"$LOG"
  local torch=0
  in_root "$CLONE/.venv/bin/python -c 'import importlib.util as u, sys; sys.exit(u.find_spec(\"torch\") is None)'" && torch=1
  local size; size=$(du -sm "$ROOT$CLONE/.venv" | cut -f1)
  local cuda; cuda=$(in_root "$CLONE/.venv/bin/pip list 2>/dev/null" | grep -ciE '^(nvidia-|triton)' || true)
  # the same install on this machine (x86: the torch extra too), for the size criterion (<= 1.2x)
  local x86; x86=$(du -sm "$REPO/.venv" 2>/dev/null | cut -f1)
  local r=0
  { grep -q ' Paris\.' "$CACHE/readme.out" && [[ $rc == 0 && $torch == 0 && $cuda == 0 ]] &&
    { [[ -z $x86 ]] || ((size * 10 <= x86 * 12)); }; } || r=1
  check readme $r "${secs}s, exit $rc, torch installed: $torch, CUDA packages: $cuda, venv ${size} MiB (x86's ${x86:-?} MiB)"
}

# 2. `qwc targets`: what `host` means on this CPU.
host_target_is() {  # host_target_is DECODE PREFILL
  local line
  line=$(in_root "$CLONE/.venv/bin/qwc targets" 2>>"$LOG" | awk '$1 == "host"')
  echo "$line" >>"$LOG"
  [[ $(awk '{print $4, $5}' <<<"$line") == "$1 $2" ]]
}

# 3. Compiled here (x86, --target arm-yitian), copied, and run by a runtime-only install there.
runtime_only_route() {
  local host_qwc=$REPO/.venv/bin/qwc
  [[ -x $host_qwc ]] || die "$host_qwc missing: run scripts/setup.sh on this machine first"
  rm -rf "$ROOT$ART" && mkdir -p "$ROOT$ART"
  say "compiling build/smollm2.onnx here with --target arm-yitian, into the root's $ART"
  "$host_qwc" -q compile "$ROOT$CLONE/build/smollm2.onnx" --target arm-yitian -o "$ROOT$ART/smollm2.qwc" >>"$LOG" 2>&1
  say "pip install '.[runtime]' into the root's /opt/qwc-runtime"
  local t0; t0=$(date +%s)
  in_root "rm -rf /opt/qwc-runtime && python3 -m venv /opt/qwc-runtime &&
           /opt/qwc-runtime/bin/pip install -q --progress-bar off '$CLONE[runtime]'" >>"$LOG" 2>&1
  local secs; secs=$(since "$t0")
  local heavy; heavy=$(in_root '/opt/qwc-runtime/bin/pip list 2>/dev/null' | grep -ciE '^(torch|onnx|onnxruntime|transformers|gguf) ' || true)
  local size; size=$(du -sm "$ROOT/opt/qwc-runtime" | cut -f1)
  check runtime-install "$heavy" "${secs}s, ${size} MiB, compiler or torch packages: $heavy"
  in_root "/opt/qwc-runtime/bin/qwc run $ART/smollm2.qwc --prompt '$PROMPT' --max-new-tokens 24" \
    >"$CACHE/runtime-run.out" 2>>"$LOG" || true
  in_root "$CLONE/.venv/bin/qwc run $CLONE/build/smollm2.qwc --prompt '$PROMPT' --max-new-tokens 24" \
    >"$CACHE/native-run.out" 2>>"$LOG" || true
  local r=0
  { [[ -s $CACHE/runtime-run.out ]] && cmp -s "$CACHE/runtime-run.out" "$CACHE/native-run.out"; } || r=1
  check runtime-run $r "$(head -c 80 "$CACHE/runtime-run.out" | tr '\n' ' ')"
  serve_answers_openai
}

SERVER_PID=
serve_answers_openai() {
  local port
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  # exec all the way down (chroot, env, bash, qwc's own restart), so SERVER_PID is the server's
  (root_command; exec "${ROOT_CMD[@]}" "exec /opt/qwc-runtime/bin/qwc serve $ART/smollm2.qwc --port $port --ctx 256") \
    >>"$LOG" 2>&1 &
  SERVER_PID=$!
  local client="
import sys, time, openai
c = openai.OpenAI(base_url='http://127.0.0.1:$port/v1', api_key='none', max_retries=0, timeout=600)
for _ in range(600):
    try:
        c.models.list(); break
    except openai.APIConnectionError:
        time.sleep(1)
r = c.completions.create(model='smollm2', prompt='$PROMPT', max_tokens=8, temperature=0)
print(repr(r.choices[0].text)); sys.exit(r.usage.completion_tokens < 1)"
  local rc=0 out
  out=$(in_root "$CLONE/.venv/bin/python -c \"$client\"" 2>>"$LOG") || rc=$?
  kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=
  check serve-openai $rc "$out"
}

# 4. A CPU without i8mm or SVE: the arm-yitian artifact is refused in one line, `host` is arm-neon.
neoverse_n1() {
  local rc=0 err
  err=$(QEMU_CPU=neoverse-n1 in_root "/opt/qwc-runtime/bin/qwc run $ART/smollm2.qwc --prompt Hi --max-new-tokens 1" 2>&1 >/dev/null) || rc=$?
  echo "$err" >>"$LOG"
  local r=0
  [[ $rc != 0 && $(wc -l <<<"$err") == 1 && $err == *i8mm* ]] || r=1
  check n1-refused $r "exit $rc: $err"
  r=0
  QEMU_CPU=neoverse-n1 host_target_is w4a8-sdot w4a8-sdot || r=1
  check n1-host-is-arm-neon $r
}

# 5. The test subset, in the venv the README's command made (the torch-free tests).
test_subset() {
  local t0 rc=0; t0=$(date +%s)
  in_root "cd $CLONE && .venv/bin/python -m pytest -p no:cacheprovider -q $TESTS" >"$CACHE/tests.out" 2>&1 || rc=$?
  cat "$CACHE/tests.out" >>"$LOG"
  check tests $rc "$(tail -1 "$CACHE/tests.out"), $(since "$t0")s, $(wc -w <<<"$TESTS") files"
}

# 6. The board benchmark in the root: both engines on the same model, llama.cpp built there
# (native) or here (cross).
board_bench() {
  local t0 rc=0 tools; t0=$(date +%s)
  rm -f "$CACHE/board.out"   # a failed build must not count an earlier run's rows
  if [[ $BOARD == cross ]]; then
    local here; here=$(bash "$REPO/bench/llamacpp.sh" arm64 2>>"$LOG" | tail -1)
    tools=/opt/llama-cross
    mkdir -p "$ROOT$tools" && cp "$here/llama-bench-0.3.36" "$ROOT$tools/"
  else
    # pip under emulation takes many minutes to fetch the sdist; this machine's fetches it (it
    # is the same file on every platform) and the root's build reads it from /opt
    local sdist=$CACHE/sdist/llama_cpp_python-0.3.36.tar.gz
    if [[ ! -f $sdist ]]; then
      mkdir -p "$CACHE/sdist"
      python3 -m pip download -q --no-deps --no-binary=:all: -d "$CACHE/sdist" llama-cpp-python==0.3.36 2>>"$LOG" \
        || die "could not fetch the llama-cpp-python sdist (see $LOG)"
    fi
    mkdir -p "$ROOT/opt/sdist" && cp "$sdist" "$ROOT/opt/sdist/"
    say "building llama.cpp in the root (bench/llamacpp.sh arm64-native; more than an hour emulated)"
    tools=$(in_root "cd $CLONE && LLAMACPP_SDIST=/opt/sdist/${sdist##*/} bash bench/llamacpp.sh arm64-native" 2>>"$LOG" | tail -1) || rc=$?
  fi
  local built; built=$(since "$t0")
  if ((rc == 0)); then
    in_root "cd $CLONE && .venv/bin/python scripts/arm64/board_bench.py $ART/smollm2.qwc \$(.venv/bin/qwc -q data fetch | awk '\$1 == \"smollm2\" {print \$2}') \
             --threads 1,2 -p 16 -n 4 -r 1 --qwc /opt/qwc-runtime/bin/qwc --llama-bench $tools/llama-bench-0.3.36" \
      >"$CACHE/board.out" 2>>"$LOG" || rc=$?
    cat "$CACHE/board.out" >>"$LOG"
    grep -q '^| 2 |' "$CACHE/board.out" || rc=1
  fi
  check board-bench $rc "llama.cpp ($BOARD) ready in ${built}s; $(grep -c '^| [0-9]' "$CACHE/board.out" 2>/dev/null || echo 0) rows"
}

# ROOT_CMD: `bash -c` inside the root as its root user, with the environment of a login there.
root_command() {
  ROOT_CMD=(chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
    LANG=C.UTF-8 "QEMU_CPU=${QEMU_CPU:-max,sve128=on}" SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180 bash -c)
}
in_root() { root_command; "${ROOT_CMD[@]}" "$1"; }

# Everything runs from this function, read whole before it starts: editing the script during a
# run (an hour) cannot change the run.
main() {
  fetch_qemu
  register_binfmt
  build_root
  copy_network_config
  mount_root
  [[ $(in_root 'uname -m') == aarch64 ]] || die "the root does not run as aarch64 (binfmt handler $HANDLER)"
  say "root ready: $(in_root 'uname -m; python3 --version' | tr '\n' ' ')"
  [[ ${QWC_NATIVE_ROOT_ONLY:-0} == 1 ]] && return 0

  T0=$(date +%s)
  readme_first_command
  # everything after uses the venv and the ONNX graph that command made
  if ((FAILED)); then summary; return 1; fi
  r=0
  host_target_is w4a8-sdot w4a8-smmla || r=1
  check host-is-arm-yitian $r
  runtime_only_route
  neoverse_n1
  ((RUN_TESTS)) && test_subset
  [[ -n $BOARD ]] && board_bench
  summary
  return $FAILED
}

main; exit $?
