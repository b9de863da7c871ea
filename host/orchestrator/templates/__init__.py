"""Templates: the store's template tables, names and ids, build requests and their logs,
uploaded build files, the built-in templates, lookup of built templates and the cluster's
catalog (see README.md).

Only the leaf modules are re-exported here: the operation modules (builds, lookup, files,
builtin, catalog) import the orchestrator's `opcontext`, which imports `store` and
`build_log` from this package, so importing them here would close a cycle at import time.
"""

from __future__ import annotations

from .build_log import BuildLogBuffer
from .store import TemplateStore

__all__ = ["BuildLogBuffer", "TemplateStore"]
