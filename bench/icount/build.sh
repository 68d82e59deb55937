#!/usr/bin/env bash
# Build the QEMU plugins in bench/icount (icount.c: instructions per block; phases.c: per
# thread and epoch) against the plugin header of the installed qemu-user's Debian source (the
# header is not packaged on its own).  build.sh [OUTDIR]; prints OUTDIR.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/qwc/icount}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
if [[ ! -f $OUT/qemu-plugin.h ]]; then
  src=$OUT/src && rm -rf "$src" && mkdir -p "$src/lists/partial" "$src/sources" && chmod 777 "$src"
  for f in /etc/apt/sources.list.d/*.sources; do
    sed 's/^Types: deb$/Types: deb-src/' "$f" >"$src/sources/${f##*/}"
  done
  opts=(-o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts="$src/sources"
        -o Dir::State::Lists="$src/lists" -o Debug::NoLocking=1)
  apt-get "${opts[@]}" update -qq
  version=$(dpkg-query -W -f='${source:Version}' qemu-user)
  (cd "$src" && apt-get "${opts[@]}" source --download-only -qq "qemu=$version" >/dev/null)
  tar -C "$src" -xf "$src"/qemu_*.orig.tar.xz --wildcards '*/include/qemu/qemu-plugin.h'
  cp "$src"/qemu-*/include/qemu/qemu-plugin.h "$OUT/"
  rm -rf "$src"
fi
for name in icount phases; do
  if [[ ! -f $OUT/libqwc_$name.so || $HERE/$name.c -nt $OUT/libqwc_$name.so ]]; then
    gcc -O2 -fPIC -shared -I"$OUT" "$HERE/$name.c" -o "$OUT/libqwc_$name.so" -lpthread
  fi
done
echo "$OUT"
