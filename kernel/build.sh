#!/usr/bin/env bash
# Build (or reuse) the aenv guest kernel from Debian's linux-source-6.12 package.
#
#   kernel/build.sh                build if needed; prints the output dir on the last line
#   kernel/build.sh --print-path   print the cache dir for the current inputs (no build);
#                                  exit 1 if that kernel is not built yet
#   kernel/build.sh --force        rebuild even if cached
#
# Output: ${AENV_CACHE:-/var/cache/aenv}/kernel/<hash>/{vmlinux,bzImage,config,System.map,
#         build.log,info.json,DONE}  and the symlink  ${AENV_CACHE}/kernel/current -> <hash>
# hash = sha256(fragment + patches + base config choice + linux-source package version +
#        script version)
# A build counts as done only when <hash>/DONE exists; <hash>/ itself is created by an
# atomic rename of a temp dir, so an interrupted build is never taken for a finished one.
set -euo pipefail

BUILD_SCRIPT_VERSION=2
BASE_CONFIG=allnoconfig
PKG=linux-source-6.12
TARBALL=/usr/src/linux-source-6.12.tar.xz

HERE="$(cd "$(dirname "$0")" && pwd)"
FRAGMENT="$HERE/microvm.config"
shopt -s nullglob
PATCHES=("$HERE"/patches/*.patch)   # applied in name order (kernel/README.md)
shopt -u nullglob
CACHE="${AENV_CACHE:-/var/cache/aenv}/kernel"

log() { printf 'kernel: %s\n' "$*" >&2; }
die() { printf 'kernel: ERROR: %s\n' "$*" >&2; exit 1; }

mode=build
case "${1:-}" in
  --print-path) mode=print ;;
  --force) mode=force ;;
  "") ;;
  *) die "unknown argument: $1 (use --print-path or --force)" ;;
esac

[ -f "$TARBALL" ] || die "$TARBALL missing: apt-get install $PKG (make setup)"
PKG_VERSION="$(dpkg-query -W -f='${Version}' "$PKG" 2>/dev/null || true)"
[ -n "$PKG_VERSION" ] || die "package $PKG not installed"

HASH="$( { printf 'base=%s\npkg=%s %s\nscript=%s\n--\n' "$BASE_CONFIG" "$PKG" "$PKG_VERSION" \
          "$BUILD_SCRIPT_VERSION"; cat "$FRAGMENT" ${PATCHES[@]+"${PATCHES[@]}"}; } | sha256sum | cut -c1-16)"
OUT="$CACHE/$HASH"

if [ "$mode" = print ]; then
  echo "$OUT"
  [ -f "$OUT/DONE" ] || exit 1
  exit 0
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
if ! flock -n 9; then
  log "another kernel build holds $CACHE/.lock; waiting"
  flock 9
fi

set_current() {
  ln -sfn "$HASH" "$CACHE/.current.tmp.$$"
  mv -Tf "$CACHE/.current.tmp.$$" "$CACHE/current"
}

if [ "$mode" != force ] && [ -f "$OUT/DONE" ]; then
  log "cached: $OUT (inputs unchanged)"
  set_current
  echo "$OUT"
  exit 0
fi

t0=$(date +%s)
JOBS="$(nproc)"

# 1. unpack the source once per package version (into the cache, not the repo)
SRC_PARENT="$CACHE/src-${PKG_VERSION//[^A-Za-z0-9.+-]/_}"
SRC="$SRC_PARENT/linux-source-6.12"
if [ ! -f "$SRC_PARENT/UNPACKED" ]; then
  log "[1/5] unpacking $TARBALL ($PKG $PKG_VERSION) into $SRC_PARENT"
  rm -rf "$SRC_PARENT.tmp"
  mkdir -p "$SRC_PARENT.tmp"
  tar -C "$SRC_PARENT.tmp" -xf "$TARBALL"
  [ -f "$SRC_PARENT.tmp/linux-source-6.12/Makefile" ] || die "unexpected tarball layout"
  rm -rf "$SRC_PARENT"
  mv "$SRC_PARENT.tmp" "$SRC_PARENT"
  touch "$SRC_PARENT/UNPACKED"
else
  log "[1/5] source already unpacked: $SRC"
fi

WORK="$CACHE/.work-$HASH"
rm -rf "$WORK"
mkdir -p "$WORK/build" "$WORK/out"
BLOG="$WORK/out/build.log"
: >"$BLOG"

# 1b. our patches, on a copy of the source made of hard links (seconds, no space): patch
#     writes each file it changes anew and renames it into place, so the unpacked source
#     shared by every build keeps its original files (checked below)
if [ "${#PATCHES[@]}" -gt 0 ]; then
  log "[1/5] applying ${#PATCHES[@]} patch(es) from kernel/patches"
  cp -al "$SRC" "$WORK/src"
  for p in "${PATCHES[@]}"; do
    patch -d "$WORK/src" -p1 --no-backup-if-mismatch --forward <"$p" >>"$BLOG" 2>&1 \
      || { tail -20 "$BLOG"; die "patch $(basename "$p") does not apply to $PKG $PKG_VERSION"; }
    for f in $(sed -n 's|^+++ b/\([^[:space:]]*\).*|\1|p' "$p"); do
      [ "$(stat -c %i "$WORK/src/$f")" != "$(stat -c %i "$SRC/$f")" ] \
        || die "patching $f changed the shared source $SRC (a hard link was written through)"
    done
  done
  SRC="$WORK/src"
fi

# 2. configure out of tree: base config, merge fragment, olddefconfig
K=(make -C "$SRC" O="$WORK/build" ARCH=x86_64)
log "[2/5] configuring: $BASE_CONFIG + $(basename "$FRAGMENT") (hash $HASH, log $BLOG)"
"${K[@]}" "$BASE_CONFIG" >>"$BLOG" 2>&1 || { tail -20 "$BLOG"; die "make $BASE_CONFIG failed"; }
(cd "$WORK/build" && ARCH=x86_64 "$SRC/scripts/kconfig/merge_config.sh" -m -O "$WORK/build" \
   .config "$FRAGMENT") >>"$BLOG" 2>&1 || { tail -20 "$BLOG"; die "merge_config.sh failed"; }
"${K[@]}" olddefconfig >>"$BLOG" 2>&1 || { tail -20 "$BLOG"; die "make olddefconfig failed"; }

# 3. verify every option of the fragment survived
log "[3/5] verifying fragment options in .config"
missing=0
while IFS= read -r line; do
  case "$line" in
    CONFIG_*=*)
      grep -qxF -- "$line" "$WORK/build/.config" || {
        have="$(grep -E "^(# )?${line%%=*}[= ]" "$WORK/build/.config" || echo "(absent)")"
        log "  DROPPED: want '$line', got '$have'"; missing=$((missing+1)); } ;;
    "# CONFIG_"*" is not set")
      sym="${line#\# }"; sym="${sym%% *}"
      if grep -qE "^${sym}=" "$WORK/build/.config"; then
        log "  DROPPED: want '$line', got '$(grep -E "^${sym}=" "$WORK/build/.config")'"
        missing=$((missing+1))
      fi ;;
  esac
done <"$FRAGMENT"
[ "$missing" -eq 0 ] || die "$missing fragment option(s) were dropped by Kconfig (see above)"
log "  all $(grep -cE '^(CONFIG_|# CONFIG_.* is not set)' "$FRAGMENT") fragment options present"

# 4. build vmlinux + bzImage, with periodic progress lines
log "[4/5] building vmlinux + bzImage with -j$JOBS (output in $BLOG)"
"${K[@]}" -j"$JOBS" vmlinux bzImage >>"$BLOG" 2>&1 &
mpid=$!
trap 'kill $mpid 2>/dev/null || true' EXIT INT TERM
while kill -0 "$mpid" 2>/dev/null; do
  for _ in $(seq 30); do kill -0 "$mpid" 2>/dev/null || break; sleep 1; done
  kill -0 "$mpid" 2>/dev/null || break
  n=$(grep -cE '^\s+(CC|AS|LD|AR)\b' "$BLOG" || true)
  log "  ... $(( $(date +%s) - t0 ))s, $n objects built; last: $(tail -1 "$BLOG" | cut -c1-90)"
done
if ! wait "$mpid"; then
  trap - EXIT INT TERM
  tail -30 "$BLOG" >&2
  die "kernel build failed (full log: $BLOG)"
fi
trap - EXIT INT TERM

# 5. publish atomically
log "[5/5] publishing to $OUT"
B="$WORK/build"
cp "$B/vmlinux" "$B/arch/x86/boot/bzImage" "$B/System.map" "$WORK/out/"
cp "$B/.config" "$WORK/out/config"
cp "$FRAGMENT" "$WORK/out/microvm.config"
if [ "${#PATCHES[@]}" -gt 0 ]; then cp "${PATCHES[@]}" "$WORK/out/"; fi
KREL="$(cat "$B/include/config/kernel.release")"
secs=$(( $(date +%s) - t0 ))
cat >"$WORK/out/info.json" <<EOF
{
  "hash": "$HASH",
  "kernel_release": "$KREL",
  "package": "$PKG",
  "package_version": "$PKG_VERSION",
  "base_config": "$BASE_CONFIG",
  "build_script_version": $BUILD_SCRIPT_VERSION,
  "build_seconds": $secs,
  "vmlinux": "$OUT/vmlinux",
  "bzImage": "$OUT/bzImage"
}
EOF
sync -f "$WORK/out/vmlinux" 2>/dev/null || true
touch "$WORK/out/DONE"
rm -rf "$OUT.old"
[ -e "$OUT" ] && mv "$OUT" "$OUT.old"
mv "$WORK/out" "$OUT"
rm -rf "$OUT.old" "$WORK"
set_current
log "done in ${secs}s: $KREL, vmlinux $(du -h "$OUT/vmlinux" | cut -f1), bzImage $(du -h "$OUT/bzImage" | cut -f1)"
echo "$OUT"
