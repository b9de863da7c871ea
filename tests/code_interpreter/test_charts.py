"""Charts through the unmodified Python SDK (debug mode) against the server process:
each chart type E2B documents comes back as a parsed `chart` beside its PNG."""

from __future__ import annotations

from typing import Any

import pytest

from . import charts as figures

ci = pytest.importorskip("e2b_code_interpreter")


def test_every_chart_type(sandbox: Any) -> None:
    figures.check_all(sandbox, ci.charts)


def test_saved_images_come_back(sandbox: Any) -> None:
    figures.check_saved_images(sandbox)


def test_a_figure_the_extractor_cannot_read_still_gives_its_png(sandbox: Any) -> None:
    execution = sandbox.run_code(
        "import matplotlib.pyplot as plt\nfig = plt.figure()\n"
        "fig.add_subplot(projection='polar').plot([0, 1, 2], [1, 2, 3])\nplt.show()")
    assert execution.error is None
    assert [bool(r.png) for r in execution.results] == [True]
