"""Reading `/metrics` pages in tests: parse with the Prometheus text parser, look samples
up by name and labels, and compare two scrapes. Reusable by any test (VM tests included):

    before = await scrape(client)            # or parse(text)
    ... create, pause ...
    after = await scrape(client)
    assert after.delta(before, "aenv_sandbox_operation_seconds_count", operation="pause") == 1
    assert after.value("aenv_sandboxes", state="paused") == 1
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, frozenset[tuple[str, str]]]


@dataclass(frozen=True)
class Scrape:
    """One parsed page: every sample by (sample name, labels), and each family's type."""

    samples: Mapping[Key, float]
    types: Mapping[str, str]

    def value(self, name: str, default: float | None = None, **labels: str) -> float:
        """The sample `name` with exactly these labels (KeyError if absent and no default)."""
        key = (name, frozenset(labels.items()))
        if key in self.samples:
            return self.samples[key]
        if default is not None:
            return default
        raise KeyError(f"no sample {name}{labels} in the scrape")

    def total(self, name: str, **labels: str) -> float:
        """The sum of the samples `name` whose labels include these (0 when none)."""
        want = set(labels.items())
        return sum(v for (n, lbls), v in self.samples.items() if n == name and want <= lbls)

    def delta(self, before: Scrape, name: str, **labels: str) -> float:
        """How much `total(name, **labels)` moved since `before`."""
        return self.total(name, **labels) - before.total(name, **labels)

    def names(self) -> set[str]:
        return {n for n, _ in self.samples}


def parse(text: str) -> Scrape:
    """Parse a page with prometheus_client's parser (raises ValueError if it is not the
    text format)."""
    samples: dict[Key, float] = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            if key in samples:
                raise ValueError(f"duplicate sample {s.name}{s.labels}")
            samples[key] = s.value
    return Scrape(samples, types)


async def scrape(client: httpx.AsyncClient, path: str = "/metrics") -> Scrape:
    """GET `path` (no API key) and parse it; checks status and content type."""
    r = await client.get(path, headers={"x-api-key": ""})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version="), r.headers
    return parse(r.text)


def scrape_sync(url: str) -> Scrape:
    """The same for a service on a real port (e.g. `python -m host` in a VM test)."""
    if not url.endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    r = httpx.get(url, timeout=30)
    assert r.status_code == 200, r.text
    return parse(r.text)
