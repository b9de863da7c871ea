#!/usr/bin/env bash
# Install aenv as systemd services on Debian 12 (as root). Safe to run again: each step is
# skipped when already done, and an operator's config is never overwritten.
#
#   deploy/install.sh [--role node|gateway|scheduler|all[,...]] [--source DIR|TARBALL]
#                     [--with-redis] [--build] [--no-start] [--dry-run] [--list-packages]
#
# Layout:
#   /opt/aenv                   the code (copied from --source: this checkout by default, or
#                               a release tarball), installed editable into /opt/aenv/.venv
#                               (host/ reads templates/ and scripts next to it)
#   /usr/local/bin/aenv         -> /opt/aenv/.venv/bin/aenv (the CLI)
#   /etc/aenv/<role>.env        settings of each service (0600, created only when absent)
#   /etc/aenv/api_keys          the API keys clients use (0600, created when absent)
#   /etc/aenv/node_key          the cluster's node key: the gateway's, scheduler's and
#                               neighbours' calls into nodes; never a client's key (0600,
#                               created when absent; copy it to every machine of a cluster)
#   /var/lib/aenv               node state (0700); its api_keys -> /etc/aenv/api_keys, its
#                               node_key -> /etc/aenv/node_key
#   /var/cache/aenv             guest kernel and images (`make kernel image`, or --build)
#   /etc/systemd/system/aenv-{node,gateway,scheduler}.service
#
# --role      node (default): the host service; gateway, scheduler: the cluster services;
#             all: the three; a comma list for several.
# --with-redis  also install redis-server (the cluster store) on this machine.
# --build     node: also build what the node serves from source, in /opt/aenv
#             (`make web envd kernel image`, ~15 min the first time, cached in /var/cache/aenv).
# --no-start  enable the units but start nothing (no systemctl start, no daemons started by
#             package installs); implied when systemd is not running (a chroot, an image build).
# --dry-run   print what would change and change nothing.
# --list-packages  print the Debian packages the roles need and exit.
set -euo pipefail
umask 022  # /opt/aenv is read by the cluster services' unprivileged users

PREFIX=/opt/aenv
ETC=/etc/aenv
STATE=/var/lib/aenv
CACHE=/var/cache/aenv
UNIT_DIR=/etc/systemd/system
BIN_LINK=/usr/local/bin/aenv
EXCLUDES=(.git .venv node_modules __pycache__ .mypy_cache .ruff_cache .pytest_cache
          .hypothesis .schemathesis .cache '*.egg-info' build dist out tests)
KEEP=(.venv out build)   # kept in $PREFIX when the code is replaced (venv, --build outputs)

PKG_COMMON=(python3 python3-venv ca-certificates)
# what the node runs: VMMs and disk tools, netns + nftables, OCI pulls and imports (fuse2fs,
# libseccomp2 for the import helper's filters, isal's igzip to inflate gzip layers)
PKG_NODE=(qemu-system-x86 qemu-utils e2fsprogs fuse2fs libseccomp2 libarchive13 isal iproute2
          nftables kmod procps attr cpio xz-utils zstd skopeo)
# from bookworm-backports: QEMU 10 (the VM jail runs QEMU unprivileged, which needs 8.2+ to
# map a shared memory base without opening it for writing; bookworm's own is 7.2) and
# e2fsprogs 1.47.2 (`mke2fs -d -` reads a tar: an image's first layer streams into its
# ext4; with bookworm's 1.47.0 it goes through a tree, slower)
PKG_BACKPORTS=(qemu-system-x86 qemu-utils e2fsprogs fuse2fs)
# --build: the inputs of scripts/setup.sh's kernel, envd and rootfs steps, and `make web`
PKG_BUILD=(make linux-source-6.12 build-essential patch flex bison bc libelf-dev libssl-dev dwarves
           debootstrap erofs-utils python3.11-venv python3.11-dev patchelf scons libfuse3-3
           nodejs npm)

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
log() { printf 'install: %s\n' "$*"; }
die() { printf 'install: ERROR: %s\n' "$*" >&2; exit 1; }

roles_arg=node source="" with_redis=0 build=0 no_start=0 dry_run=0 list_packages=0
while [ $# -gt 0 ]; do
  case "$1" in
    --role) [ $# -ge 2 ] || die "--role needs a value"; roles_arg=$2; shift ;;
    --role=*) roles_arg=${1#*=} ;;
    --source) [ $# -ge 2 ] || die "--source needs a value"; source=$2; shift ;;
    --source=*) source=${1#*=} ;;
    --with-redis) with_redis=1 ;;
    --build) build=1 ;;
    --no-start) no_start=1 ;;
    --dry-run) dry_run=1 ;;
    --list-packages) list_packages=1 ;;
    -h|--help) usage 0 ;;
    *) echo "install: unknown argument: $1" >&2; usage 2 >&2 ;;
  esac
  shift
done

ROLES=()
IFS=, read -r -a _roles <<<"$roles_arg"
for r in "${_roles[@]}"; do
  case "$r" in
    all) ROLES+=(node gateway scheduler) ;;
    node|gateway|scheduler) ROLES+=("$r") ;;
    *) die "unknown role '$r' (node, gateway, scheduler, all)" ;;
  esac
done
# unique, in a fixed order
read -r -a ROLES <<<"$(for r in node gateway scheduler; do
  [[ " ${ROLES[*]} " == *" $r "* ]] && printf '%s ' "$r"; done)"
has_role() { [[ " ${ROLES[*]} " == *" $1 "* ]]; }

packages() {
  local p=("${PKG_COMMON[@]}")
  has_role node && p+=("${PKG_NODE[@]}")
  has_role node && [ "$build" = 1 ] && p+=("${PKG_BUILD[@]}")
  [ "$with_redis" = 1 ] && p+=(redis-server)
  printf '%s\n' "${p[@]}" | awk '!seen[$0]++'
}
if [ "$list_packages" = 1 ]; then packages; exit 0; fi

[ "$(id -u)" = 0 ] || [ "$dry_run" = 1 ] || die "must run as root"
if [ -r /etc/os-release ]; then
  # shellcheck disable=SC1091
  . /etc/os-release
  [ "${ID:-}" = debian ] && [ "${VERSION_ID:-}" = 12 ] ||
    log "warning: written for Debian 12, this is ${PRETTY_NAME:-unknown}"
fi

# systemd runs this machine only when booted with it (sd_booted(3)); not in a chroot, not
# during an image build: then nothing is started, as with --no-start.
systemd_running=0
[ -d /run/systemd/system ] && systemd_running=1
if [ "$systemd_running" = 1 ] && command -v systemd-detect-virt >/dev/null &&
   systemd-detect-virt --quiet --chroot; then
  systemd_running=0
fi
start=1
if [ "$no_start" = 1 ]; then start=0
elif [ "$systemd_running" = 0 ]; then start=0; log "systemd is not running here: nothing is started"
fi

tmp=$(mktemp -d)
own_policy=0
trap 'rm -rf "$tmp"; if [ "$own_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi' EXIT

changes=()
changed() { changes+=("$1"); log "$1"; }
# run CMD...: the one door of every change (--dry-run prints it instead)
run() {
  if [ "$dry_run" = 1 ]; then printf 'install: would run: %s\n' "$*"; else "$@"; fi
}

# --- packages ----------------------------------------------------------------------------
mapfile -t want < <(packages)
missing=()
for p in "${want[@]}"; do
  [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] ||
    missing+=("$p")
done
# e2fsprogs is on every Debian: older than 1.47.1 it is upgraded from backports
if [[ " ${want[*]} " == *" e2fsprogs "* ]] &&
   dpkg --compare-versions "$(dpkg-query -W -f='${Version}' e2fsprogs 2>/dev/null || echo 0)" lt 1.47.1 &&
   [[ " ${missing[*]} " != *" e2fsprogs "* ]]; then
  missing+=(e2fsprogs fuse2fs)
fi
if [ "${#missing[@]}" -gt 0 ]; then
  changed "apt-get install ${missing[*]}"
  if [ "$start" = 0 ] && [ ! -e /usr/sbin/policy-rc.d ] && [ "$dry_run" = 0 ]; then
    # no daemon of a package (redis-server) starts when nothing may start
    own_policy=1
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 0755 /usr/sbin/policy-rc.d
  fi
  backports=() plain=()
  for p in "${missing[@]}"; do
    if [[ " ${PKG_BACKPORTS[*]} " == *" $p "* ]]; then backports+=("$p"); else plain+=("$p"); fi
  done
  if [ "${#backports[@]}" -gt 0 ] &&
     ! grep -rqs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d/; then
    uri=$(awk '/^URIs:/ && !found { print $2; found = 1 }' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    changed "add bookworm-backports (${uri:-http://deb.debian.org/debian}) for QEMU 10 and e2fsprogs 1.47.2"
    [ "$dry_run" = 1 ] || printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      "${uri:-http://deb.debian.org/debian}" >/etc/apt/sources.list.d/aenv-backports.sources
  fi
  run apt-get update -q
  if [ "${#plain[@]}" -gt 0 ]; then
    run env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      "${plain[@]}"
  fi
  if [ "${#backports[@]}" -gt 0 ]; then
    run env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      -t bookworm-backports "${backports[@]}"
  fi
  if [ "$own_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; own_policy=0; fi
fi

# --- code --------------------------------------------------------------------------------
if [ -z "$source" ]; then
  source=$(cd "$(dirname "$0")/.." && pwd)
elif [ -f "$source" ]; then
  mkdir "$tmp/src"
  tar -xf "$source" -C "$tmp/src"
  top=("$tmp"/src/*)
  if [ "${#top[@]}" = 1 ] && [ -d "${top[0]}" ]; then source=${top[0]}; else source=$tmp/src; fi
fi
[ -f "$source/pyproject.toml" ] && [ -d "$source/host" ] ||
  die "$source is not an aenv source tree (no pyproject.toml / host/)"
source=$(cd "$source" && pwd)
[ "$source" != "$PREFIX" ] || die "--source is $PREFIX itself"

# The tree, as one deterministic archive of its files (no directories: their mtimes change
# whenever a __pycache__ appears): its hash says whether $PREFIX holds this version already.
# Modes are normalised: a checkout made under umask 077 must still be readable by all.
prune=()
for e in "${EXCLUDES[@]}"; do
  case "$e" in build|dist|out|tests) prune+=(-path "./$e" -o) ;; *) prune+=(-name "$e" -o) ;; esac
done
(cd "$source" && find . \( "${prune[@]}" -false \) -prune -o \( -type f -o -type l \) \
   ! -name '*.pyc' -print0 | LC_ALL=C sort -z |
 tar --null --no-recursion -T - --owner=0 --group=0 --numeric-owner --format=gnu \
   --mode=u+rwX,go+rX,go-w -cf "$tmp/code.tar")
code_hash=$(sha256sum "$tmp/code.tar" | cut -d' ' -f1)
stamp=$PREFIX/.aenv-source
code_changed=0
if [ "$(cat "$stamp" 2>/dev/null)" != "$code_hash" ]; then
  code_changed=1
  changed "code: $source -> $PREFIX (${code_hash:0:12})"
  if [ "$dry_run" = 0 ]; then
    mkdir -p "$PREFIX"
    chmod 0755 "$PREFIX"
    keep=()
    for k in "${KEEP[@]}"; do keep+=(! -name "$k"); done
    find "$PREFIX" -mindepth 1 -maxdepth 1 "${keep[@]}" -exec rm -rf {} +
    tar -xf "$tmp/code.tar" -C "$PREFIX" --no-same-owner
    echo "$code_hash" >"$stamp"
  fi
fi

# --- venv --------------------------------------------------------------------------------
venv=$PREFIX/.venv
if [ ! -x "$venv/bin/python" ]; then
  changed "venv: $venv"
  run python3 -m venv "$venv"
fi
# Editable: pip runs again only when the dependencies or the interpreter change.
pip_stamp="$venv/.aenv-pip"
pip_want=$( { cat "$source/pyproject.toml"; python3 --version; } | sha256sum | cut -d' ' -f1)
if [ "$(cat "$pip_stamp" 2>/dev/null)" != "$pip_want" ]; then
  changed "pip install -e $PREFIX"
  run "$venv/bin/pip" install -q --disable-pip-version-check -e "$PREFIX"
  [ "$dry_run" = 1 ] || echo "$pip_want" >"$pip_stamp"
fi
if [ "$(readlink "$BIN_LINK" 2>/dev/null)" != "$venv/bin/aenv" ]; then
  changed "link $BIN_LINK -> $venv/bin/aenv"
  run ln -sfn "$venv/bin/aenv" "$BIN_LINK"
fi

# --- config and state --------------------------------------------------------------------
# ensure_dir PATH MODE
ensure_dir() {
  if [ ! -d "$1" ]; then
    changed "mkdir -m $2 $1"
    run install -d -m "$2" -o root -g root "$1"
  elif [ "$(stat -c %a "$1")" != "${2#0}" ]; then
    changed "chmod $2 $1"
    run chmod "$2" "$1"
  fi
}
ensure_dir "$ETC" 0755
for role in "${ROLES[@]}"; do
  conf=$ETC/$role.env
  if [ -e "$conf" ]; then
    [ "$(stat -c %a "$conf")" = 600 ] || log "warning: $conf is not mode 0600"
  else
    changed "config: $conf (defaults; edit it, it is never overwritten)"
    run install -m 0600 -o root -g root "$source/deploy/systemd/$role.env" "$conf"
  fi
done
# The clients' keys for the whole installation: the gateway checks them, and so does a node
# that clients reach directly.
keys=$ETC/api_keys
if [ ! -e "$keys" ]; then
  if [ -f "$STATE/api_keys" ] && [ ! -L "$STATE/api_keys" ]; then
    changed "keys: $keys (from $STATE/api_keys)"
    run install -m 0600 -o root -g root "$STATE/api_keys" "$keys"
  else
    changed "keys: $keys (a new key)"
    if [ "$dry_run" = 0 ]; then
      (umask 077; printf 'e2b_%s\n' "$(head -c 30 /dev/urandom | base64 | tr '+/' '-_')" >"$keys")
    fi
  fi
fi
# The node key: what the gateway, the scheduler and neighbouring nodes send to nodes. A
# secret of its own (a client's key opens no node's /cluster/ routes, nor the scheduler),
# the same file on every machine of a cluster.
node_key=$ETC/node_key
if [ ! -e "$node_key" ]; then
  if [ -f "$STATE/node_key" ] && [ ! -L "$STATE/node_key" ]; then
    changed "node key: $node_key (from $STATE/node_key)"
    run install -m 0600 -o root -g root "$STATE/node_key" "$node_key"
  else
    changed "node key: $node_key (a new key; copy it to every machine of the cluster)"
    if [ "$dry_run" = 0 ]; then
      (umask 077; printf 'aenv_node_%s\n' "$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')" >"$node_key")
    fi
  fi
fi
if has_role node; then
  ensure_dir "$STATE" 0700
  ensure_dir "$CACHE" 0755
  # link_state NAME TARGET: the node reads <state>/NAME
  link_state() {
    if [ ! -e "$STATE/$1" ] && [ ! -L "$STATE/$1" ]; then
      changed "keys: $STATE/$1 -> $2"
      run ln -s "$2" "$STATE/$1"
    elif [ ! -L "$STATE/$1" ] && [ -e "$2" ] && ! cmp -s "$STATE/$1" "$2"; then
      log "warning: $STATE/$1 differs from $2 (the node uses only its own)"
    fi
  }
  link_state api_keys "$keys"
  link_state node_key "$node_key"
fi

# --- build (node, --build) ----------------------------------------------------------------
if has_role node && [ "$build" = 1 ]; then
  # each target is skipped by its own script when its inputs are unchanged
  log "make web envd kernel image (in $PREFIX, cached in $CACHE)"
  run env AENV_CACHE="$CACHE" make -C "$PREFIX" web envd kernel image
elif has_role node && [ ! -e "$CACHE/kernel/current" ]; then
  log "note: no guest kernel/image in $CACHE yet: run again with --build, or copy" \
      "$CACHE/{kernel,images} from a machine that ran \`make kernel image\`"
fi

# --- units -------------------------------------------------------------------------------
units_changed=0
for role in "${ROLES[@]}"; do
  unit=aenv-$role.service
  if ! cmp -s "$source/deploy/systemd/$unit" "$UNIT_DIR/$unit" 2>/dev/null; then
    units_changed=1
    changed "unit: $UNIT_DIR/$unit"
    run install -D -m 0644 -o root -g root "$source/deploy/systemd/$unit" "$UNIT_DIR/$unit"
  fi
done
if command -v systemctl >/dev/null; then
  if [ "$systemd_running" = 1 ] && [ "$units_changed" = 1 ]; then
    run systemctl daemon-reload
  fi
  for role in "${ROLES[@]}"; do
    unit=aenv-$role.service
    # works offline too (a chroot): it only links the unit into multi-user.target.wants
    if [ "$(systemctl is-enabled "$unit" 2>/dev/null)" != enabled ]; then
      changed "systemctl enable $unit"
      run systemctl enable --quiet "$unit"
    fi
    if [ "$start" = 1 ]; then
      if ! systemctl is-active --quiet "$unit"; then
        changed "systemctl start $unit"
        run systemctl start "$unit"
      elif [ "$code_changed" = 1 ] || [ "$units_changed" = 1 ]; then
        changed "systemctl restart $unit"
        run systemctl restart "$unit"
      fi
    fi
  done
else
  log "warning: no systemctl here: the units are installed, not enabled"
fi

if [ "${#changes[@]}" = 0 ]; then
  log "nothing to do: roles ${ROLES[*]} already installed"
elif [ "$dry_run" = 1 ]; then
  log "dry run: ${#changes[@]} changes to make for roles ${ROLES[*]}"
else
  log "done (${#changes[@]} changes): roles ${ROLES[*]}"
  has_role node && [ "$start" = 1 ] &&
    log "node: API http://127.0.0.1:3000, key: head -1 $keys (settings: $ETC/node.env)"
fi
exit 0
