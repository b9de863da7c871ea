#!/usr/bin/env bash
# Run the VM test suite once per VMM driver this host can run, and print a table:
#
#   driver | available? | reason | passed | failed | skipped
#
#   scripts/check-kvm.sh            qemu-kvm and firecracker rows (each where available)
#   scripts/check-kvm.sh --tcg      also the QEMU/TCG row (slow: 15+ minutes)
#   scripts/check-kvm.sh --dry-run  only the availability table, runs no test
#   scripts/check-kvm.sh -- -x -k snapshot   extra arguments for pytest
#
# Each row runs `pytest -m vm tests/runtime tests/orchestrator tests/e2e` with the driver
# chosen by AENV_VMM (qemu | firecracker) and, for QEMU, AENV_ACCEL (kvm | tcg). On a
# host without a usable KVM (e.g. PVM only) and without Firecracker both KVM rows are
# skipped with the reason, and nothing runs unless --tcg is given.
#
# A firecracker row that passes (some tests passed, none failed, no extra pytest arguments
# narrowing the suite) marks Firecracker verified on this host ($AENV_CACHE/firecracker-
# verified: its binary, version and the host kernel; host/vmm/verified.py): only then does
# `--vmm auto` pick it. A firecracker row with failures removes the mark.
#
# Exit status: 0 when no row that ran had failures, 1 otherwise, 2 on bad arguments.
# For tests: CHECK_KVM_AVAIL replaces the availability probe (lines "row<TAB>yes|no<TAB>
# reason"), CHECK_KVM_PYTEST the pytest command (it gets --junitxml=FILE and the tests).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
TESTS=(tests/runtime tests/orchestrator tests/e2e)
tcg=0 dry=0 extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tcg) tcg=1 ;;
    --dry-run) dry=1 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "check-kvm: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ -n "${CHECK_KVM_AVAIL:-}" ]; then
  avail=$(printf '%b\n' "$CHECK_KVM_AVAIL")
else
  avail=$("$PY" -c 'from host.vmm.pick import main; main()') || {
    echo "check-kvm: cannot probe the drivers with $PY" >&2; exit 2; }
fi
if [ -n "${CHECK_KVM_PYTEST:-}" ]; then
  read -r -a pytest_cmd <<<"$CHECK_KVM_PYTEST"
else
  pytest_cmd=("$PY" -m pytest)
fi

field() {  # field ROW N: column N of ROW's availability line
  printf '%s\n' "$avail" | awk -F '\t' -v r="$1" -v n="$2" '$1 == r && !found { print $n; found = 1 }'
}

counts() {  # counts JUNIT_XML: "passed failed skipped"
  "$PY" - "$1" <<'EOF'
import sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("- - -")
    sys.exit()
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
print(n["tests"] - n["failures"] - n["errors"] - n["skipped"], n["failures"] + n["errors"],
      n["skipped"])
EOF
}

verify_firecracker() {  # after the firecracker row: mark (or unmark) it verified here
  if [ "$failed" != 0 ]; then
    "$PY" -m host.vmm.pick --unmark-verified >&2
  elif [ "${#extra[@]}" != 0 ]; then
    echo "check-kvm: firecracker not marked verified: extra pytest arguments ran a" \
         "selection of the VM suite" >&2
  elif [ "$passed" = - ] || [ "$passed" = 0 ]; then
    echo "check-kvm: firecracker not marked verified: no VM test passed" >&2
  else
    "$PY" -m host.vmm.pick --mark-verified >&2 || status=1
  fi
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rows=(qemu-kvm firecracker qemu-tcg)
table=() status=0
for row in "${rows[@]}"; do
  ok=$(field "$row" 2)
  reason=$(field "$row" 3)
  [ -n "$ok" ] || { ok=no; reason="not probed"; }
  if [ "$row" = qemu-tcg ] && [ "$tcg" = 0 ]; then
    ok_col="$ok"; [ "$ok" = yes ] && reason="not run: pass --tcg (15+ minutes)"
    table+=("$row|$ok_col|$reason|-|-|-")
    continue
  fi
  if [ "$ok" != yes ] || [ "$dry" = 1 ]; then
    [ "$ok" = yes ] && reason="$reason (dry run)"
    table+=("$row|$ok|$reason|-|-|-")
    continue
  fi
  case "$row" in
    qemu-kvm) env_vars=(AENV_VMM=qemu AENV_ACCEL=kvm) ;;
    qemu-tcg) env_vars=(AENV_VMM=qemu AENV_ACCEL=tcg) ;;
    firecracker) env_vars=(AENV_VMM=firecracker) ;;
  esac
  xml="$tmp/$row.xml"
  echo "check-kvm: $row: ${env_vars[*]} pytest -m vm ${TESTS[*]} ${extra[*]}" >&2
  env "${env_vars[@]}" "${pytest_cmd[@]}" -m vm "--junitxml=$xml" "${TESTS[@]}" \
    ${extra[@]+"${extra[@]}"} >&2
  read -r passed failed skipped <<<"$(counts "$xml")"
  if [ "$failed" != 0 ]; then status=1; fi
  if [ "$row" = firecracker ]; then
    verify_firecracker
  fi
  table+=("$row|yes|$reason|$passed|$failed|$skipped")
done

{
  echo "driver|available?|reason|passed|failed|skipped"
  printf '%s\n' "${table[@]}"
} | awk -F '|' '
  function dashes(n,   s) { s = ""; while (n-- > 0) s = s "-"; return s }
  { for (i = 1; i <= NF; i++) { cell[NR, i] = $i; if (length($i) > w[i]) w[i] = length($i) } }
  END {
    for (r = 1; r <= NR; r++) {
      line = ""
      for (i = 1; i < 6; i++) line = line sprintf("%-*s | ", w[i], cell[r, i])
      print line cell[r, 6]
      if (r == 1) {
        line = ""
        for (i = 1; i < 6; i++) line = line dashes(w[i]) "-+-"
        print line dashes(w[6])
      }
    }
  }'
exit "$status"
