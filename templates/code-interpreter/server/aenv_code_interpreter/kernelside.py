"""What runs inside a python kernel process: the ipykernel launch and its display setup.

kernel.py starts kernels as `python3 -c "<put this package on sys.path>; main()"
-f <connection file>`, so the kernel gets this configuration without a kernelspec or
profile on disk. Nothing heavy is imported here: pandas and matplotlib are only looked
at when user code already imported them. ipykernel picks matplotlib's inline backend
itself (it sets MPLBACKEND when unset), so figures come back as PNG display data; the
`e2b/chart` formatter adds E2B's structured chart (E2B's own extractor, `e2b_charts`)
beside the PNG. PIL images are displayed when saved to a path (as on E2B), so an
agent that writes `plot.png` also gets the image back.
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

    class ChartFormatter(BaseFormatter):
        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict,)

        def __call__(self, obj: Any) -> Any:
            if "matplotlib" not in sys.modules:
                return super().__call__(obj)
            from matplotlib.figure import Figure
            if not isinstance(obj, Figure):
                return super().__call__(obj)
            return figure_chart(obj)

    formatters = shell.display_formatter.formatters
    formatters["e2b/data"] = DataFrameFormatter(parent=shell.display_formatter)
    formatters["e2b/chart"] = ChartFormatter(parent=shell.display_formatter)
    _display_saved_images()


def figure_chart(figure: Any) -> dict[str, Any] | None:
    """E2B's chart of a matplotlib figure; None (no chart, the PNG still goes) when the
    extractor cannot read it: a figure it does not know must not fail the user's cell."""
    try:
        from e2b_charts import chart_figure_to_dict
        chart: dict[str, Any] = chart_figure_to_dict(figure)
        return chart
    except Exception:  # noqa: BLE001 - the extractor walks arbitrary user figures
        return None


def _display_saved_images() -> None:
    """PIL's Image.save to a path also displays the image (E2B's template does the same);
    installed when PIL is first imported, so a kernel that never uses PIL never loads it."""
    import builtins

    original_import = builtins.__import__

    def patch() -> bool:
        image_module = sys.modules.get("PIL.Image")
        if image_module is None:
            return False
        original_save = image_module.Image.save
        if getattr(original_save, "_aenv_displays", False):
            return True

        def save(self: Any, fp: Any, format: Any = None, **params: Any) -> Any:
            result = original_save(self, fp, format, **params)
            if isinstance(fp, (str, bytes)) or hasattr(fp, "__fspath__"):
                from IPython.display import display
                display(self)
            return result

        save._aenv_displays = True  # type: ignore[attr-defined]
        image_module.Image.save = save
        return True

    def importing(name: str, *args: Any, **kwargs: Any) -> Any:
        module = original_import(name, *args, **kwargs)
        if name.startswith("PIL") and patch():
            builtins.__import__ = original_import
        return module

    if not patch():
        builtins.__import__ = importing


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
