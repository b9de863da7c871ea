#!/usr/bin/env bash
# Freeze envd (python -m envd) into one fully static executable: out/envd
#
# PyInstaller --onefile with Debian's /usr/bin/python3.11 (in its own build venv at
# ${AENV_CACHE}/venv-freeze), then staticx so the binary needs nothing from the guest's
# libc (`ldd out/envd`: not a dynamic executable; runs in an empty chroot with /proc and a
# writable /tmp). Skipped when the inputs (envd/**/*.py, pyproject.toml, this script, the
# freeze venv's package set) are unchanged: out/envd.inputs holds their hash.
#
#   scripts/freeze-envd.sh           build if needed
#   scripts/freeze-envd.sh --force   rebuild
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"

FREEZE_SCRIPT_VERSION=3
PYTHON=/usr/bin/python3.11
CACHE="${AENV_CACHE:-/var/cache/aenv}"
VENV="$CACHE/venv-freeze"
OUT="$REPO/out"
BUILD="$REPO/build/freeze-envd"
# Runtime deps of envd (from pyproject.toml) + the freezing tools.
REQS=(
  "connectrpc>=0.12.1,<0.13" "protobuf-py>=0.6.0,<0.7" "starlette>=0.40" "uvicorn>=0.30"
  "websockets>=12" "psutil>=5.9" "python-multipart>=0.0.34" "inotify_simple>=2.0"
  "mfusepy>=3.1,<4" "pyinstaller>=6.5" "staticx>=0.14"
)

log() { printf 'freeze-envd: %s\n' "$*" >&2; }
die() { printf 'freeze-envd: ERROR: %s\n' "$*" >&2; exit 1; }

force=0
[ "${1:-}" = "--force" ] && force=1

[ -x "$PYTHON" ] || die "$PYTHON missing (apt-get install python3.11-venv python3.11-dev)"
command -v patchelf >/dev/null || die "patchelf missing (apt-get install patchelf)"
# volume mounts (envd/volumes): mfusepy loads libfuse 3 with ctypes, so it is bundled by hand
# (awk reads to the end: exiting at the first match would SIGPIPE ldconfig, fatal under pipefail)
LIBFUSE3="$(/sbin/ldconfig -p | awk '/libfuse3\.so\.3 / && !found {print $NF; found = 1}')"
[ -n "$LIBFUSE3" ] || die "libfuse3 missing (apt-get install libfuse3-3)"

mkdir -p "$OUT" "$CACHE"
exec 9>"$CACHE/.freeze-envd.lock"
flock 9

# 1. the freeze venv (Debian python: staticx fails on pyenv builds' RUNPATH tags)
REQ_HASH="$(printf '%s\n' "${REQS[@]}" | sha256sum | cut -c1-16)"
if [ ! -f "$VENV/.ready-$REQ_HASH" ]; then
  log "[1/4] creating freeze venv $VENV with $PYTHON"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  { "$VENV/bin/pip" install -q --disable-pip-version-check --upgrade pip wheel &&
    "$VENV/bin/pip" install -q --disable-pip-version-check "${REQS[@]}"; } >"$CACHE/venv-freeze.log" 2>&1 \
    || { grep -v 'is ignored: it is neither' "$CACHE/venv-freeze.log" | tail -20 >&2; die "pip install failed"; }
  touch "$VENV/.ready-$REQ_HASH"
else
  log "[1/4] freeze venv ready: $VENV"
fi

# 2. input hash: sources, pyproject, this script, installed package versions
INPUT_HASH="$( {
  echo "script=$FREEZE_SCRIPT_VERSION"
  sha256sum scripts/freeze-envd.sh pyproject.toml
  find envd -name '*.py' -not -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
  "$VENV/bin/pip" freeze --disable-pip-version-check 2>/dev/null | LC_ALL=C sort
} | sha256sum | cut -c1-16)"
if [ "$force" = 0 ] && [ -x "$OUT/envd" ] && [ "$(cat "$OUT/envd.inputs" 2>/dev/null)" = "$INPUT_HASH" ]; then
  log "cached: $OUT/envd (inputs unchanged, $INPUT_HASH)"
  exit 0
fi

t0=$(date +%s)
rm -rf "$BUILD"
mkdir -p "$BUILD"
cat >"$BUILD/envd_main.py" <<'EOF'
import sys

from envd.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
EOF

# 3. PyInstaller: uvicorn/websockets pick implementations by dynamic import, connectrpc and
#    protobuf-py load codecs/runtime modules lazily: collect all their submodules.
log "[2/4] PyInstaller --onefile (log $BUILD/pyinstaller.log)"
# --strip: symbol tables out of the bundled .so files (pyqwest's alone is 4 MB) = less to
# inflate and write at every start (under TCG each start costs ~10x the host time).
(cd "$BUILD" && "$VENV/bin/pyinstaller" --onefile --strip --noconfirm --clean --log-level WARN \
   --name envd --paths "$REPO" \
   --distpath "$BUILD/dist" --workpath "$BUILD/work" --specpath "$BUILD" \
   --collect-submodules envd \
   --collect-submodules uvicorn \
   --collect-submodules websockets \
   --collect-submodules connectrpc \
   --collect-submodules protobuf \
   --collect-submodules starlette \
   --collect-submodules h11 \
   --collect-submodules anyio \
   --hidden-import mfusepy --add-binary "$LIBFUSE3:." \
   --hidden-import uvicorn.loops.auto --hidden-import uvicorn.loops.asyncio \
   --hidden-import uvicorn.protocols.http.auto --hidden-import uvicorn.protocols.http.h11_impl \
   --hidden-import uvicorn.protocols.websockets.auto \
   --hidden-import uvicorn.protocols.websockets.websockets_impl \
   --hidden-import uvicorn.protocols.websockets.websockets_sansio_impl \
   --hidden-import uvicorn.lifespan.on --hidden-import uvicorn.lifespan.off \
   envd_main.py) >"$BUILD/pyinstaller.log" 2>&1 || { tail -30 "$BUILD/pyinstaller.log" >&2; die "pyinstaller failed"; }

# 4. staticx: bundle the loader + libc so the binary runs on any Linux (empty chroot too).
#    --no-compress: no xz pass at every start (measured: ~40% less start-up CPU together
#    with --strip above, for +2 MB).
log "[3/4] staticx"
"$VENV/bin/staticx" --strip --no-compress "$BUILD/dist/envd" "$BUILD/envd.static" >"$BUILD/staticx.log" 2>&1 \
  || { tail -30 "$BUILD/staticx.log" >&2; die "staticx failed"; }

log "[4/4] smoke test: --help"
"$BUILD/envd.static" --help >/dev/null 2>"$BUILD/smoke.log" || { cat "$BUILD/smoke.log" >&2; die "frozen envd --help failed"; }

install -m 0755 "$BUILD/envd.static" "$OUT/envd.tmp"
mv -f "$OUT/envd.tmp" "$OUT/envd"
echo "$INPUT_HASH" >"$OUT/envd.inputs.tmp" && mv -f "$OUT/envd.inputs.tmp" "$OUT/envd.inputs"
log "done in $(( $(date +%s) - t0 ))s: $OUT/envd ($(du -h "$OUT/envd" | cut -f1), inputs $INPUT_HASH)"
