"""Matplotlib figures of every chart type E2B documents, and what the SDKs must parse
from each (`Result.chart`): bar, line (datetime x), log scale, categorical scale,
scatter, pie, box and whiskers, a super chart (subplots) and an unknown chart. Shared by
tests/code_interpreter/test_charts.py (server process) and the e2e test (real VMs)."""

from __future__ import annotations

import base64
import datetime as dt
from typing import Any

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

BAR = """
import matplotlib.pyplot as plt
plt.figure(figsize=(6, 4))
plt.bar(['north', 'south', 'east', 'west'], [120, 80, 95, 60], label='Units')
plt.xlabel('Region')
plt.ylabel('Sales (units)')
plt.title('Sales by region')
plt.show()
"""

LINE_DATETIME = """
import datetime
import matplotlib.pyplot as plt
days = [datetime.date(2026, 1, 1) + datetime.timedelta(days=i) for i in range(30)]
plt.figure(figsize=(6, 4))
plt.plot(days, [i * i for i in range(30)], label='squares')
plt.plot(days, [30 * i for i in range(30)], label='linear')
plt.xlabel('Day (d)')
plt.ylabel('Load (kW)')
plt.title('Load over time')
plt.show()
"""

LOG_SCALE = """
import numpy as np
import matplotlib.pyplot as plt
x = np.linspace(0, 10, 50)
plt.plot(x, np.exp(x), label='e^x')
plt.yscale('log')
plt.xlabel('x')
plt.ylabel('Growth (log scale)')
plt.title('Exponential')
plt.grid(True)
plt.show()
"""

CATEGORICAL = """
import matplotlib.pyplot as plt
plt.plot([1, 2, 3, 4], ['low', 'mid', 'high', 'mid'])
plt.show()
"""

SCATTER = """
import matplotlib.pyplot as plt
plt.scatter([1, 2, 3, 4, 5], [2, 4, 1, 5, 3], label='first')
plt.scatter([1.5, 2.5, 3.5], [3, 3, 2], label='second')
plt.xlabel('A')
plt.ylabel('B')
plt.show()
"""

PIE = """
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.pie([75, 25], labels=['yes', 'no'], startangle=90)
plt.title('Answers')
plt.show()
"""

BOX = """
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.set_title('Scores')
ax.set_xlabel('Class')
ax.set_ylabel('Score')
ax.boxplot([[70, 72, 75, 80, 85], [60, 88, 90, 91, 95, 96]], tick_labels=['A', 'B'],
           patch_artist=True)
plt.show()
"""

SUPER = """
import numpy as np
import matplotlib.pyplot as plt
fig, axs = plt.subplots(1, 2, figsize=(8, 4))
fig.suptitle('Two views')
x = np.linspace(0, 6, 40)
axs[0].plot(x, np.sin(x))
axs[0].set_title('Wave')
axs[1].scatter([1, 2, 3], [3, 1, 2])
axs[1].set_title('Points')
axs[1].set_xlabel('X')
plt.show()
"""

UNKNOWN = """
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.add_artist(plt.Circle((0, 0), 1, fill=False))
ax.set_xlim(-2, 2)
ax.set_ylim(-2, 2)
plt.title('A circle')
plt.show()
"""

SAVEFIG_AND_PIL = """
import numpy as np
import matplotlib
import matplotlib.pyplot as plt
from PIL import Image
plt.plot([1, 2, 3])
plt.savefig('figure.png')
plt.close('all')
Image.fromarray((np.random.rand(8, 8, 3) * 255).astype('uint8')).save('noise.png')
print('saved')
"""


def _chart(execution: Any) -> Any:
    assert execution.error is None, f"{execution.error}"
    with_chart = [r for r in execution.results if r.chart is not None]
    assert len(with_chart) == 1, f"{execution.results}"
    result = with_chart[0]
    # the PNG comes beside the chart, as on E2B
    assert result.png and base64.b64decode(result.png).startswith(PNG_MAGIC)
    return result.chart


def check_all(sbx: Any, charts: Any) -> None:
    """Every figure above through `sbx.run_code`, parsed by the SDK's `charts` module."""
    bar = _chart(sbx.run_code(BAR))
    assert isinstance(bar, charts.BarChart) and bar.type == charts.ChartType.BAR
    assert (bar.title, bar.x_label, bar.y_label) == ("Sales by region", "Region",
                                                    "Sales (units)")
    assert bar.y_unit == "units"
    assert [(b.label, b.value, b.group) for b in bar.elements] == [
        ("north", 120, "Units"), ("south", 80, "Units"), ("east", 95, "Units"),
        ("west", 60, "Units")]

    line = _chart(sbx.run_code(LINE_DATETIME))
    assert isinstance(line, charts.LineChart) and line.title == "Load over time"
    assert (line.x_unit, line.y_unit) == ("d", "kW")
    assert (line.x_scale, line.y_scale) == ("datetime", "linear")
    assert [e.label for e in line.elements] == ["squares", "linear"]
    assert len(line.elements[0].points) == 30
    first_x = line.elements[0].points[0][0]
    assert dt.datetime.fromisoformat(str(first_x)).date() == dt.date(2026, 1, 1)

    log = _chart(sbx.run_code(LOG_SCALE))
    assert isinstance(log, charts.LineChart)
    assert (log.x_scale, log.y_scale, log.y_unit) == ("linear", "log", "log scale")

    categorical = _chart(sbx.run_code(CATEGORICAL))
    assert isinstance(categorical, charts.LineChart)
    assert categorical.y_scale == "categorical"

    scatter = _chart(sbx.run_code(SCATTER))
    assert isinstance(scatter, charts.ScatterChart) and scatter.title is None
    assert [(e.label, len(e.points)) for e in scatter.elements] == [("first", 5),
                                                                    ("second", 3)]
    assert scatter.elements[0].points[1] == (2, 4)

    pie = _chart(sbx.run_code(PIE))
    assert isinstance(pie, charts.PieChart) and pie.title == "Answers"
    assert [(p.label, round(p.angle)) for p in pie.elements] == [("yes", 270), ("no", 90)]

    box = _chart(sbx.run_code(BOX))
    assert isinstance(box, charts.BoxAndWhiskerChart)
    assert box.type == charts.ChartType.BOX_AND_WHISKER
    assert [b.label for b in box.elements] == ["A", "B"]
    assert [b.median for b in box.elements] == [75, 90.5]
    assert box.elements[1].outliers == [60]

    sup = _chart(sbx.run_code(SUPER))
    assert isinstance(sup, charts.SuperChart) and sup.title == "Two views"
    wave, points = sup.elements
    assert isinstance(wave, charts.LineChart) and wave.title == "Wave"
    assert len(wave.elements[0].points) == 40
    assert isinstance(points, charts.ScatterChart) and points.x_label == "X"

    unknown = _chart(sbx.run_code(UNKNOWN))
    assert unknown.type == charts.ChartType.UNKNOWN and unknown.title == "A circle"
    assert len(unknown.elements) == 0


def _png_size(png: bytes) -> tuple[int, int]:
    # IHDR is the first chunk: width and height, 4 bytes each, big-endian
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


def check_saved_images(sbx: Any) -> None:
    """An image saved to a file comes back as a PNG result too, as on E2B: PIL's
    Image.save, and so matplotlib's savefig (it writes PNGs through PIL), of a figure
    closed before it could be shown."""
    execution = sbx.run_code(SAVEFIG_AND_PIL)
    assert execution.error is None, f"{execution.error}"
    assert execution.logs.stdout == ["saved\n"]
    pngs = [base64.b64decode(r.png) for r in execution.results if r.png]
    assert len(pngs) == 2, f"{execution.results}"
    assert all(png.startswith(PNG_MAGIC) for png in pngs)
    assert [_png_size(png) for png in pngs] == [(640, 480), (8, 8)]
