# aenv: make setup | gen | envd | kernel | image | web | run | cluster | test | bench | lint
# Everything runs from the repo's virtualenv (.venv), made by `make setup`.

PY        ?= .venv/bin/python
# Kernel and image builds are cached outside the repo, keyed by their inputs.
AENV_CACHE ?= /var/cache/aenv
export AENV_CACHE

.PHONY: setup gen envd kernel image web run cluster test test-fast bench lint clean

setup:            ## install system packages, the venv and the JS SDK for tests
	scripts/setup.sh

gen:              ## regenerate envd/spec/*_pb.py and *_connect.py from the .proto files
	scripts/gen.sh

envd:             ## freeze envd into one static executable: out/envd
	scripts/freeze-envd.sh

kernel:           ## build (or reuse) the guest kernel: $(AENV_CACHE)/kernel/<hash>/{bzImage,vmlinux}
	kernel/build.sh

image: envd kernel ## build (or reuse) the rootfs layers and manifest
	rootfs/build.sh

web:              ## vendor xterm.js (npm, pinned) for the web terminal page: host/web/static/vendor
	scripts/vendor-web.sh

run: web          ## run the host service on this machine's defaults
	$(PY) -m host

cluster: web      ## Redis, scheduler, gateway and 3 nodes on this machine (Ctrl+C stops them all)
	$(PY) -m host.cluster.local --nodes $(or $(NODES),3)

test: web image   ## the full test suite (what .ci/run runs); builds kernel and image first (cached)
	$(PY) -m pytest -q -ra --durations=25

test-fast: web    ## unit and envd tests only (no VMs)
	$(PY) -m pytest -q -ra -m "not vm"

bench:
	$(PY) bench/run_all.py

lint:
	$(PY) -m ruff check envd host tests bench

clean:
	rm -rf out build dist *.egg-info
