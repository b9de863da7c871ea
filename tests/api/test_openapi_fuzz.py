"""schemathesis fuzzes the REST API from its own /openapi.json (bounded examples) and
must find no 5xx and no response that contradicts the document. The document is the one
generated from the route table and the wire models (host/api/openapi.py), checked first.

The API runs over the in-memory Orchestrator double (HTTP-mapping test only).
Not checked: `positive_data_acceptance` (opaque `nextToken` cursors and the double-encoded
`metadata` filter are strings the schema cannot constrain; random ones are rightly 400)
and `unsupported_method` for TRACE-like methods handled by uvicorn.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from host.api.openapi import document

from .conftest import API_KEY

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance,response_headers_conformance,"
          "negative_data_rejection,missing_required_header,ignored_auth")


@pytest.mark.slow
def test_schemathesis_finds_no_server_errors(api_server, orch, tmp_path: Path) -> None:
    for _ in range(3):
        orch.add()
    served = httpx.get(f"{api_server.url}/openapi.json", headers={"X-API-Key": API_KEY})
    assert served.json() == json.loads(json.dumps(document())), "not the generated document"
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    if st is None:
        pytest.skip("schemathesis CLI not installed")
    proc = subprocess.run(
        [st, "run", f"{api_server.url}/openapi.json", "-H", f"X-API-Key: {API_KEY}",
         "--max-examples", "20", "--seed", "7", "--checks", CHECKS, "--no-color",
         "--workers", "1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    assert "Server error" not in proc.stdout, report
