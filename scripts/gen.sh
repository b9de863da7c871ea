#!/usr/bin/env bash
# Regenerate the envd Connect stubs from envd/spec/**/*.proto.
# Uses exactly the generator versions the e2b SDK pins (protoc-gen-py 0.6.0,
# protoc-gen-connectrpc 0.12.1) in a separate venv, because grpcio-tools (our
# protoc) pulls in Google's protobuf, which must not enter the runtime venv.
set -euo pipefail
cd "$(dirname "$0")/.."
GEN_VENV=${GEN_VENV:-${AENV_CACHE:-/var/cache/aenv}/venv-gen}
if [ ! -x "$GEN_VENV/bin/python" ]; then
  echo "gen: creating codegen venv at $GEN_VENV"
  python3 -m venv "$GEN_VENV"
  "$GEN_VENV/bin/pip" install -q "protoc-gen-py==0.6.0" "protoc-gen-connectrpc==0.12.1" grpcio-tools
fi
cd envd/spec
PATH="$GEN_VENV/bin:$PATH" "$GEN_VENV/bin/python" -m grpc_tools.protoc -I. \
  --py_out=. --connectrpc_out=. process/process.proto filesystem/filesystem.proto
echo "gen: envd/spec regenerated"
