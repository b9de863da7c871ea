"""The code-interpreter server of the code-interpreter-v1 template (runs in the guest).

An E2B-compatible HTTP API on :49999 over ipykernel kernels driven by jupyter_client:
app.py (routes), contexts.py (one kernel per context), execution.py (one run),
outputs.py (iopub -> NDJSON), envs.py (sandbox env vars from envd), kernel.py (the
process and its channels), kernelside.py (what runs in the kernel).
"""

from __future__ import annotations

from .app import build_app
from .settings import Settings

__all__ = ["Settings", "build_app"]
