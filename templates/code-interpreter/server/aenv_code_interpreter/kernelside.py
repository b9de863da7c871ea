"""What runs inside a python kernel process: the ipykernel launch and its display setup.

kernel.py starts kernels as `python3 -c "<put this package on sys.path>; main()"
-f <connection file>`, so the kernel gets this configuration without a kernelspec or
profile on disk. Nothing heavy is imported here: pandas is only looked at when user code
already imported it. ipykernel picks matplotlib's inline backend itself (it sets
MPLBACKEND when unset), so figures come back as PNG display data.
"""

from __future__ import annotations

import sys
from typing import Any


def main() -> None:
    # as ipykernel_launcher: drop '' (the launch cwd) while loading; IPython puts the
    # kernel's working directory back on sys.path itself
    if sys.path and sys.path[0] == "":
        del sys.path[0]
    from ipykernel.kernelapp import IPKernelApp
    from traitlets.config import Config

    config = Config()
    # tracebacks as plain text: the SDKs hand them to programs, not terminals
    config.InteractiveShell.colors = "nocolor"
    # long sequences in full, not cut at 1000 items with "..."
    config.PlainTextFormatter.max_seq_length = 0
    # no history database in $HOME shared (and locked) by every kernel
    config.HistoryManager.hist_file = ":memory:"
    app = IPKernelApp.instance(config=config)
    app.initialize()  # type: ignore[no-untyped-call]
    register_formatters(app.shell)
    app.start()  # type: ignore[no-untyped-call]


def register_formatters(shell: Any) -> None:
    """Add the `e2b/data` display format: a pandas DataFrame as {column: [values]}, which
    the SDKs expose as `Result.data`."""
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    class DataFrameFormatter(BaseFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict,)

        def __call__(self, obj: Any) -> Any:
            pandas = sys.modules.get("pandas")
            if pandas is None or not isinstance(obj, pandas.DataFrame):
                return super().__call__(obj)
            return dataframe_columns(obj)

    formatters = shell.display_formatter.formatters
    formatters["e2b/data"] = DataFrameFormatter(parent=shell.display_formatter)


def dataframe_columns(frame: Any) -> dict[str, list[Any]]:
    """{column name: values} of a DataFrame, JSON-safe (pandas' own JSON writer turns
    timestamps into ISO strings and NaN into null)."""
    import json

    split = json.loads(frame.to_json(orient="split", date_format="iso", index=False))
    columns = [str(c) for c in split["columns"]]
    values: list[list[Any]] = [[] for _ in columns]
    for row in split["data"]:
        for i, value in enumerate(row):
            values[i].append(value)
    return dict(zip(columns, values, strict=True))
