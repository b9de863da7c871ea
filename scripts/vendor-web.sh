#!/usr/bin/env bash
# `make web`: vendor xterm.js (from npm, pinned by host/web/package-lock.json) into
# host/web/static/vendor, which the web terminal page serves. Run at build time only:
# the service never fetches anything at run time. Skipped when the vendored files match
# the lock file already.
set -euo pipefail
cd "$(dirname "$0")/../host/web"
vendor=static/vendor
stamp="$vendor/.lock-sha256"
want=$(sha256sum package-lock.json | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "web: xterm.js already vendored ($vendor)"
  exit 0
fi
echo "web: npm ci (host/web)"
npm ci --no-audit --no-fund --loglevel=error
mkdir -p static
tmp=$(mktemp -d "static/.vendor.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
cp node_modules/@xterm/xterm/lib/xterm.mjs node_modules/@xterm/xterm/css/xterm.css \
   node_modules/@xterm/addon-fit/lib/addon-fit.mjs node_modules/@xterm/xterm/LICENSE "$tmp/"
echo "$want" >"$tmp/.lock-sha256"
chmod 0755 "$tmp"
rm -rf "$vendor"
mv "$tmp" "$vendor"
trap - EXIT
echo "web: vendored xterm.js into host/web/$vendor"
