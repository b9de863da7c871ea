#!/usr/bin/env bash
# Build (or reuse) the guest root filesystem of an aenv image as layers + a manifest.
#
#   rootfs/build.sh [--force] [NAME]        NAME defaults to "default"
#
# Output in ${AENV_CACHE:-/var/cache/aenv}/images/NAME/:
# Files are content-versioned and never rewritten in place (a running VM's qcow2 backing
# file or a sandbox's block stack can keep using an older one): NAME-<inputs hash>.ext4,
# with stable symlinks base.ext4 / envd.ext4 / rootfs.ext4 -> the newest. The manifest
# names the versioned files. The 3 newest versions of each are kept.
#   base.ext4      layer 0, read-only BASE: Debian bookworm minbase (debootstrap) + packages
#                  (rootfs/packages.txt) + user `user` (passwordless sudo). ext4, sparse,
#                  ROOTFS_SIZE bytes apparent size.
#   envd.ext4      layer 1 as a small ext4 of its files: /usr/bin/envd (frozen, static),
#                  /usr/sbin/aenv-init (+ /usr/sbin/init -> aenv-init), /etc/aenv/release
#   rootfs.ext4    what a VM boots (root=/dev/vda): base.ext4 with layer 1 written into it
#                  in place (debugfs), so it differs from base.ext4 only in the blocks
#                  layer 1 touched. Use it read-only under a per-sandbox writable upper, or
#                  copy it (cp --sparse=always / qcow2 backing file) for a writable disk.
#   manifest.json  layer digests/sizes/formats, kernel path+hash, envd version, cmdline
# Caching: the base layer is reused while rootfs/packages.txt + the base recipe are unchanged
# (base-<hash>.ext4); layer 1 and rootfs.ext4 while out/envd + init.c are unchanged too.
# Every file is written to a temp name and renamed into place.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"

BASE_RECIPE_VERSION=1   # bump when the base recipe below changes
LAYER_RECIPE_VERSION=1  # bump when the envd layer recipe changes
SUITE=bookworm
MIRROR="${AENV_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
ROOTFS_SIZE="${AENV_ROOTFS_SIZE:-4G}"

force=0
NAME=default
for a in "$@"; do
  case "$a" in
    --force) force=1 ;;
    -*) echo "usage: rootfs/build.sh [--force] [NAME]" >&2; exit 2 ;;
    *) NAME="$a" ;;
  esac
done

CACHE="${AENV_CACHE:-/var/cache/aenv}"
IMG="$CACHE/images/$NAME"
ENVD_BIN="$REPO/out/envd"
INIT_SRC="$REPO/rootfs/init/init.c"
PACKAGES_FILE="$REPO/rootfs/packages.txt"

log() { printf 'image: %s\n' "$*" >&2; }
die() { printf 'image: ERROR: %s\n' "$*" >&2; exit 1; }
sha() { sha256sum "$1" | cut -d' ' -f1; }

for t in debootstrap mkfs.ext4 debugfs e2fsck gcc; do
  command -v "$t" >/dev/null || die "$t missing (make setup)"
done
[ -x "$ENVD_BIN" ] || die "$ENVD_BIN missing: run make envd first"
[ "$(id -u)" = 0 ] || die "must run as root (debootstrap)"

mkdir -p "$IMG"
exec 9>"$IMG/.lock"
flock 9
t_all=$(date +%s)

mapfile -t PACKAGES < <(sed -e 's/#.*//' -e '/^\s*$/d' "$PACKAGES_FILE" | tr -d ' \t')
BASE_HASH="$( { echo "recipe=$BASE_RECIPE_VERSION suite=$SUITE size=$ROOTFS_SIZE"
               printf '%s\n' "${PACKAGES[@]}" | LC_ALL=C sort
               sed -n '/^# BEGIN BASE RECIPE/,/^# END BASE RECIPE/p' "$0"; } | sha256sum | cut -c1-16)"

# ---------------------------------------------------------------------------------------
# layer 0: base
# BEGIN BASE RECIPE
customize_base() {  # $1 = root dir
  local R="$1"
  # npm (and its node-* libraries) through apt in the chroot: debootstrap cannot resolve
  # npm's virtual dependencies
  chroot "$R" /usr/bin/apt-get -q update >/dev/null
  DEBIAN_FRONTEND=noninteractive chroot "$R" /usr/bin/apt-get -q install -y \
    --no-install-recommends npm >/dev/null
  chroot "$R" /usr/bin/apt-get clean
  chroot "$R" /usr/sbin/useradd --create-home --shell /bin/bash --uid 1000 --user-group user
  chroot "$R" /usr/sbin/usermod -aG sudo user
  echo 'user ALL=(ALL:ALL) NOPASSWD: ALL' >"$R/etc/sudoers.d/user"
  chmod 0440 "$R/etc/sudoers.d/user"
  chroot "$R" /usr/bin/passwd -d root >/dev/null
  echo aenv >"$R/etc/hostname"
  printf '127.0.0.1\tlocalhost\n127.0.1.1\taenv\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' >"$R/etc/hosts"
  # the guest init writes it from aenv.dns= (default: QEMU user networking's DNS)
  echo 'nameserver 10.0.2.3' >"$R/etc/resolv.conf"
  : >"$R/etc/fstab"
  : >"$R/etc/machine-id"
  # no network in the guest is needed: drop apt lists/caches, docs, man pages, logs
  rm -rf "$R"/var/lib/apt/lists/* "$R"/var/cache/apt/*.bin "$R"/var/cache/apt/archives/*.deb \
         "$R"/var/cache/debconf/*-old "$R"/var/lib/dpkg/*-old "$R"/var/log/*.log \
         "$R"/var/log/apt/* "$R"/usr/share/doc/* "$R"/usr/share/man/* "$R"/usr/share/info/* \
         "$R"/usr/share/lintian "$R"/tmp/* "$R"/root/.cache
  find "$R/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} +
  mkdir -p "$R/home/user" && chroot "$R" /bin/chown -R user:user /home/user
  # Every command the SDKs start is `bash -l -c CMD`, so the login profiles run each time.
  # Debian's /etc/profile asks `$(id -u)`: a fork and an exec, 80 of the 145 ms a
  # `bash -l -c true` took in a TCG guest. bash knows its EUID; other shells still ask id.
  sed -i 's/"$(id -u)"/"${EUID:-$(id -u)}"/g' "$R/etc/profile"
  grep -q 'EUID:-$(id -u)' "$R/etc/profile" || { echo "etc/profile: id -u not found" >&2; exit 1; }
  # root's ~/.profile runs `mesg n` (another exec) in every login shell; only a terminal
  # has a message permission to turn off
  sed -i 's/^mesg n 2> \/dev\/null || true$/if [ -t 0 ]; then mesg n 2> \/dev\/null || true; fi/' \
    "$R/root/.profile"
}
# END BASE RECIPE

# remove a work dir, first detaching anything an interrupted debootstrap left mounted in it
clean_dir() {
  local m
  for m in $(findmnt -rn -o TARGET 2>/dev/null | grep -F "$1/" | sort -r); do
    umount -l "$m" 2>/dev/null || true
  done
  rm -rf "$1"
}
BASE_FILE="$IMG/base-$BASE_HASH.ext4"
publish_link() {  # $1 = link name, $2 = target basename
  ln -sfn "$2" "$IMG/.$1.tmp.$$" && mv -Tf "$IMG/.$1.tmp.$$" "$IMG/$1"
}
prune() {  # $1 = prefix: keep the 3 newest PREFIX-*.ext4 (and their side files)
  local old
  for old in $(ls -1t "$IMG/$1"-*.ext4 2>/dev/null | tail -n +4); do
    rm -f "$old" "${old%.ext4}.packages" "${old%.ext4}.version"
  done
}
if [ "$force" = 0 ] && [ -f "$BASE_FILE" ] && [ -f "${BASE_FILE%.ext4}.packages" ]; then
  log "[1/4] base layer cached: $BASE_FILE"
else
  t0=$(date +%s)
  W="$IMG/.tmp-base"
  clean_dir "$W"; mkdir -p "$W"
  log "[1/4] debootstrap $SUITE minbase + ${PACKAGES[*]} (log $W/debootstrap.log)"
  debootstrap --variant=minbase --include="$(IFS=,; echo "${PACKAGES[*]}")" \
    "$SUITE" "$W/root" "$MIRROR" >"$W/debootstrap.log" 2>&1 &
  dpid=$!
  while kill -0 "$dpid" 2>/dev/null; do
    sleep 10
    kill -0 "$dpid" 2>/dev/null && log "  ... $(( $(date +%s) - t0 ))s: $(tail -1 "$W/debootstrap.log" | cut -c1-90)"
  done
  wait "$dpid" || { tail -20 "$W/debootstrap.log" >&2; die "debootstrap failed (log $W/debootstrap.log)"; }
  log "  customizing (user, sudo, hostname, cleanup)"
  customize_base "$W/root"
  log "  mkfs.ext4 -d ($ROOTFS_SIZE, $(du -sh "$W/root" | cut -f1) used)"
  mkfs.ext4 -q -F -L aenv-root -m 0 -b 4096 -I 256 -E lazy_itable_init=0,lazy_journal_init=0 \
    -d "$W/root" "$W/base.ext4" "$ROOTFS_SIZE" || die "mkfs.ext4 failed"
  e2fsck -fn "$W/base.ext4" >/dev/null 2>&1 || die "e2fsck of base.ext4 failed"
  chroot "$W/root" dpkg-query -W -f='${Package}=${Version}\n' >"$W/packages.lock"
  mv -f "$W/packages.lock" "${BASE_FILE%.ext4}.packages"
  mv -f "$W/base.ext4" "$BASE_FILE"
  clean_dir "$W"
  log "  base layer done in $(( $(date +%s) - t0 ))s"
fi

# ---------------------------------------------------------------------------------------
# layer 1: envd + init, and the merged rootfs.ext4
ENVD_SHA="$(sha "$ENVD_BIN")"
GCC_V="$(gcc -dumpfullversion 2>/dev/null || gcc -dumpversion)"
LAYER_HASH="$( { echo "recipe=$LAYER_RECIPE_VERSION base=$BASE_HASH gcc=$GCC_V envd=$ENVD_SHA"
                sha256sum "$INIT_SRC"
                sed -n '/^# BEGIN LAYER RECIPE/,/^# END LAYER RECIPE/p' "$0"; } | sha256sum | cut -c1-16)"

ROOTFS_FILE="$IMG/rootfs-$LAYER_HASH.ext4"
LAYER_FILE="$IMG/envd-$LAYER_HASH.ext4"
if [ "$force" = 0 ] && [ -f "$ROOTFS_FILE" ] && [ -f "$LAYER_FILE" ] && [ -f "${LAYER_FILE%.ext4}.version" ]; then
  log "[2/4] envd layer + rootfs cached ($LAYER_HASH)"
else
  t0=$(date +%s)
  W="$IMG/.tmp-layer"
  rm -rf "$W"; mkdir -p "$W/files/usr/bin" "$W/files/usr/sbin" "$W/files/etc/aenv"
  log "[2/4] envd layer: compiling init, writing envd.ext4 and rootfs.ext4"
# BEGIN LAYER RECIPE
  gcc -static -Os -Wall -o "$W/aenv-init" "$INIT_SRC"
  strip "$W/aenv-init"
  install -m 0755 "$W/aenv-init" "$W/files/usr/sbin/aenv-init"
  ln -s aenv-init "$W/files/usr/sbin/init"
  ln -s aenv-init "$W/files/usr/sbin/aenv-exec"  # envd's credential switch (init.c)
  install -m 0755 "$ENVD_BIN" "$W/files/usr/bin/envd"
  ENVD_VERSION="$(sed -n 's/^__version__ = "\(.*\)".*/\1/p' envd/__init__.py)"
  GIT_REV="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  printf 'ENVD_VERSION=%s\nENVD_SHA256=%s\nBUILD_REV=%s\nIMAGE=%s\n' \
    "$ENVD_VERSION" "$ENVD_SHA" "$GIT_REV" "$NAME" >"$W/files/etc/aenv/release"
  # layer 1 on its own (small ext4 of just its files)
  mkfs.ext4 -q -F -L aenv-envd -m 0 -b 4096 -d "$W/files" "$W/envd.ext4" 64M
  # merged: base + layer 1 written in place, so only the touched blocks differ from base
  cp --sparse=always "$BASE_FILE" "$W/rootfs.ext4"
  cat >"$W/debugfs.cmds" <<EOF
cd /usr/sbin
rm init
rm aenv-init
write $W/files/usr/sbin/aenv-init aenv-init
symlink init aenv-init
rm aenv-exec
symlink aenv-exec aenv-init
cd /usr/bin
rm envd
write $W/files/usr/bin/envd envd
cd /etc
mkdir aenv
cd /etc/aenv
rm release
write $W/files/etc/aenv/release release
cd /
sif /usr/sbin/aenv-init mode 0100755
sif /usr/bin/envd mode 0100755
sif /etc/aenv/release mode 0100644
sif /etc/aenv mode 040755
sif /usr/sbin/aenv-init uid 0
sif /usr/sbin/aenv-init gid 0
sif /usr/bin/envd uid 0
sif /usr/bin/envd gid 0
sif /etc/aenv/release uid 0
sif /etc/aenv/release gid 0
sif /etc/aenv uid 0
sif /etc/aenv gid 0
EOF
  debugfs -w -f "$W/debugfs.cmds" "$W/rootfs.ext4" >"$W/debugfs.log" 2>&1 || { cat "$W/debugfs.log" >&2; die "debugfs failed"; }
# END LAYER RECIPE
  e2fsck -fn "$W/rootfs.ext4" >"$W/fsck.log" 2>&1 || { cat "$W/fsck.log" >&2; die "e2fsck of rootfs.ext4 failed"; }
  # check what landed (sizes must match the sources)
  for f in usr/bin/envd usr/sbin/aenv-init; do
    got="$(debugfs -R "stat /$f" "$W/rootfs.ext4" 2>/dev/null | awk '/Size: / && !found { sub(/.*Size: /, ""); sub(/[^0-9].*/, ""); print; found = 1 }')"
    [ "$got" = "$(stat -c %s "$W/files/$f")" ] || die "/$f in rootfs.ext4 has size '$got'"
  done
  echo "$ENVD_VERSION" >"$W/envd.version"
  mv -f "$W/envd.version" "${LAYER_FILE%.ext4}.version"
  mv -f "$W/envd.ext4" "$LAYER_FILE"
  mv -f "$W/rootfs.ext4" "$ROOTFS_FILE"
  rm -rf "$W"
  log "  envd layer + rootfs done in $(( $(date +%s) - t0 ))s"
fi

# ---------------------------------------------------------------------------------------
# manifest (rewritten when missing or when the kernel changed)
KDIR="$(kernel/build.sh --print-path 2>/dev/null || true)"
[ -n "$KDIR" ] && [ -f "$KDIR/DONE" ] || { log "  warning: kernel not built yet (make kernel); manifest has no kernel"; KDIR=""; }
publish_link base.ext4 "$(basename "$BASE_FILE")"
publish_link envd.ext4 "$(basename "$LAYER_FILE")"
publish_link rootfs.ext4 "$(basename "$ROOTFS_FILE")"
prune base; prune envd; prune rootfs
if [ -f "$IMG/manifest.json" ] && grep -qF "\"dir\": \"$KDIR\"" "$IMG/manifest.json" \
   && grep -qF "\"path\": \"$ROOTFS_FILE\"" "$IMG/manifest.json"; then
  log "[3/4] manifest up to date"
else
  log "[3/4] hashing layers, writing manifest.json"
  python3 - "$IMG" "$NAME" "$KDIR" "$BASE_HASH" "$LAYER_HASH" "$ENVD_BIN" "$SUITE" "$ROOTFS_SIZE" \
    "$(basename "$BASE_FILE")" "$(basename "$LAYER_FILE")" "$(basename "$ROOTFS_FILE")" <<'EOF'
import hashlib, json, os, sys, time
(img, name, kdir, base_hash, layer_hash, envd_bin, suite, size,
 base_fn, layer_fn, rootfs_fn) = sys.argv[1:]

_cache_path = os.path.join(img, ".digests.json")
try:
    _cache = json.load(open(_cache_path))
except (OSError, ValueError):
    _cache = {}


def digest(path):
    """sha256 of the full contents; memoized by (path, inode, size, mtime) in .digests.json."""
    st = os.stat(path)
    key = f"{path}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    if key in _cache:
        return _cache[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    _cache[key] = "sha256:" + h.hexdigest()
    with open(_cache_path + ".tmp", "w") as f:
        json.dump(_cache, f)
    os.replace(_cache_path + ".tmp", _cache_path)
    return _cache[key]

def fileinfo(fn, **extra):
    p = os.path.join(img, fn)
    st = os.stat(p)
    return {"path": p, "size": st.st_size, "allocated": st.st_blocks * 512,
            "digest": digest(p), **extra}

kernel = None
if kdir:
    info = json.load(open(os.path.join(kdir, "info.json")))
    kernel = {"dir": kdir, "hash": info["hash"], "release": info["kernel_release"],
              "vmlinux": os.path.join(kdir, "vmlinux"), "bzImage": os.path.join(kdir, "bzImage"),
              "vmlinux_digest": digest(os.path.join(kdir, "vmlinux"))}
with open(os.path.join(img, base_fn[:-len(".ext4")] + ".packages")) as f:
    packages = f.read().split()
with open(os.path.join(img, layer_fn[:-len(".ext4")] + ".version")) as f:
    envd_version = f.read().strip()
cmdline = ("console=ttyS0 reboot=t panic=-1 quiet cryptomgr.notests tsc_early_khz={tsc_khz} "
           "root=/dev/vda rw rootfstype=ext4")
manifest = {
    "format_version": 1,
    "name": name,
    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "rootfs": fileinfo(rootfs_fn, format="ext4", device="/dev/vda",
                       contents="base.ext4 with layer 'envd' applied in place (block-level: "
                                "differs from base.ext4 only in the blocks layer 1 wrote)"),
    "layers": [
        fileinfo(base_fn, name="base", format="ext4", readonly=True,
                 inputs_hash=base_hash, suite=suite, variant="minbase",
                 packages=packages),
        fileinfo(layer_fn, name="envd", format="ext4-files", readonly=True,
                 inputs_hash=layer_hash, applies_to="base",
                 files=["/usr/bin/envd", "/usr/sbin/aenv-init", "/usr/sbin/init",
                        "/etc/aenv/release"]),
    ],
    "kernel": kernel,
    "envd": {"path": "/usr/bin/envd", "version": envd_version, "port": 49983,
             "size": os.path.getsize(envd_bin), "digest": digest(envd_bin)},
    "init": {"path": "/usr/sbin/aenv-init", "alias": "/sbin/init"},
    "user": {"name": "user", "uid": 1000, "home": "/home/user", "sudo": "NOPASSWD"},
    "cmdline": cmdline,
    "cmdline_params": {
        "tsc_early_khz": "host TSC kHz; required under TCG on -M microvm",
        "aenv.ip": "ADDR/PREFIX for the NIC (default 10.0.2.15/24 = QEMU user net); 'none' skips",
        "aenv.gw": "default gateway (default 10.0.2.2 when aenv.ip is absent)",
        "aenv.dns": "comma-separated nameservers written to /etc/resolv.conf (default 10.0.2.3)",
        "aenv.iface": "NIC name (default eth0)",
        "aenv.hostname": "hostname (default: /etc/hostname = aenv)",
        "aenv.envd": "envd binary (default /usr/bin/envd)",
    },
}
tmp = os.path.join(img, "manifest.json.tmp")
with open(tmp, "w") as f:
    json.dump(manifest, f, indent=2)
    f.write("\n")
os.replace(tmp, os.path.join(img, "manifest.json"))
EOF
fi
ln -sfn "$NAME" "$CACHE/images/.current.tmp.$$" && mv -Tf "$CACHE/images/.current.tmp.$$" "$CACHE/images/current" 2>/dev/null || true
log "[4/4] done in $(( $(date +%s) - t_all ))s: $IMG ($(basename "$ROOTFS_FILE") $(du -h "$ROOTFS_FILE" | cut -f1) allocated, envd $(du -h "$ENVD_BIN" | cut -f1))"
echo "$IMG"
