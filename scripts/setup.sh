#!/usr/bin/env bash
# Install everything the project and its tests need on a fresh Debian 12 machine
# (as root): system packages, the repo venv (.venv) and the JS SDK used by tests.
# Safe to run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  qemu-utils                            # qemu-io / qemu-img / qemu-storage-daemon
  debootstrap e2fsprogs erofs-utils     # rootfs layers
  fuse2fs libseccomp2                   # OCI layers applied on the host (host/runtime/hostimport.py; its seccomp filters)
  isal                                  # ... igzip: a gzip layer inflated in 0.4x the time of zlib (host/images/gunzip.py)
  libarchive13                          # ... an image's first layer read by mke2fs -d - itself (e2fsprogs loads it)
  libfuse3-3                            # volume mounts: bundled into the frozen envd (envd/volumes)
  linux-source-6.12 build-essential patch flex bison bc libelf-dev libssl-dev dwarves  # guest kernel
  python3.11-venv python3.11-dev patchelf scons  # frozen envd (PyInstaller + staticx, Debian python)
  attr iproute2 nftables cpio xz-utils zstd
  libnss-myhostname   # tests/e2e/test_tls.py: *.localhost -> loopback in its netns (postinst also adds it to /etc/nsswitch.conf)
  busybox-static                        # memsnap VM tests: busybox guest root (tests/vmm/memsnap); tests/images busybox image
  skopeo                                # host/images: pull OCI images into the local OCI cache
  docker-registry apache2-utils         # tests/images: a local registry (distribution 2.8) and htpasswd -B for its auth
  nginx wrk                             # proxy benchmark peer and load generator
  nodejs npm                            # the JS e2b SDK in tests; xterm.js vendored for the web terminal
  chromium                              # tests/web: the web terminal in a real headless browser
  redis-server                          # cluster state (gateway, scheduler) and its tests
  docker-compose                        # tests/deploy: `docker-compose config` validates deploy/compose without a daemon
  docker.io                             # tests/deploy: the Docker images built and a node container restarted by a dockerd the tests start
  r-cran-irkernel default-jdk-headless  # tests/code_interpreter: the R and Java kernels run on this host too
)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
# node may come from outside Debian (e.g. a preinstalled nodejs); accept either.
if command -v node >/dev/null && command -v npm >/dev/null; then
  missing=("${missing[@]/nodejs}"); missing=("${missing[@]/npm}")
fi
read -r -a missing <<<"${missing[*]:-}"
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: apt-get install ${missing[*]}"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

# From bookworm-backports (same Debian mirror): QEMU 10, since the VM jail runs QEMU
# unprivileged, which needs `memory-backend-file,readonly=on,rom=off` (8.2+) to map a shared
# base memory file copy-on-write without opening it for writing (bookworm's own QEMU is
# 7.2); e2fsprogs 1.47.2, whose `mke2fs -d -` reads a tar (1.47.1+): an image's first layer
# streams into its ext4 (host/images/streamed.py; bookworm's 1.47.0 goes through a tree).
QEMU_MIN_MAJOR=10
BACKPORTS_PACKAGES=(qemu-system-x86 qemu-utils e2fsprogs fuse2fs)
# (the readers below take the first match but read to the end: one that exits early, like
# `| head -1`, can SIGPIPE the writer, which pipefail turns into a failed setup)
qemu_major() {
  qemu-system-x86_64 --version 2>/dev/null |
    awk 'match($0, /version [0-9]+\./) && !found { print substr($0, RSTART + 8, RLENGTH - 9); found = 1 }'
}
mke2fs_reads_tar() {  # 1.47.1 or later
  mke2fs -V 2>&1 | awk 'match($0, /^mke2fs [0-9]+\.[0-9]+\.[0-9]+/) && !found {
    split(substr($0, 8, RLENGTH - 7), v, "."); found = 1
    ok = (v[1] > 1 || (v[1] == 1 && (v[2] > 47 || (v[2] == 47 && v[3] >= 1)))) }
    END { exit ok ? 0 : 1 }'
}
if [ "$(qemu_major || true)" != "" ] && [ "$(qemu_major)" -ge "$QEMU_MIN_MAJOR" ] &&
   mke2fs_reads_tar; then
  :
else
  src=/etc/apt/sources.list.d/aenv-backports.sources
  if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
    uri=$(awk '/^URIs:/ && !found { print $2; found = 1 }' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    echo "setup: adding bookworm-backports (${uri:-http://deb.debian.org/debian}) for QEMU $QEMU_MIN_MAJOR and e2fsprogs 1.47.2"
    printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      "${uri:-http://deb.debian.org/debian}" > "$src"
  fi
  echo "setup: apt-get install -t bookworm-backports ${BACKPORTS_PACKAGES[*]}"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q -t bookworm-backports "${BACKPORTS_PACKAGES[@]}"
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  python3 -m venv .venv
fi
echo "setup: pip install -e .[test,build]"
.venv/bin/pip install -q --disable-pip-version-check -e ".[test,build]"

if [ ! -d tests/js/node_modules/e2b ] || [ ! -d tests/js/node_modules/@e2b/code-interpreter ]; then
  echo "setup: npm install (tests/js)"
  (cd tests/js && npm install --no-audit --no-fund --loglevel=error)
fi

# envd tests run processes as the unprivileged `user`, like inside a guest.
id user >/dev/null 2>&1 || useradd --create-home --shell /bin/bash user
echo "setup: done"
