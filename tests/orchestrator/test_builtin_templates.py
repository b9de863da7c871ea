"""Built-in templates built on first use (host/orchestrator/templates/builtin.py) over the
fake runtime, with a test recipe in place of the code interpreter's (whose pip tree and
real build run in tests/e2e/test_code_interpreter.py): one build however many creates
race, an ordinary template afterwards, a failure reported and retried, a user's template
of the same name preferred, and `fromTemplate` naming it. Also the recipe's archives."""

from __future__ import annotations

import asyncio
import tarfile
from pathlib import Path

import pytest

from host.builtin import archives, recipes
from host.builtin.recipes import Archive, Prepared, Recipe
from host.contract import BuildStep
from host.orchestrator import NodeOrchestrator
from host.orchestrator.envd import EnvdClient
from host.orchestrator.errors import OperationFailed
from host.orchestrator.model import CreateRequest
from host.orchestrator.templates.builtin import recipe_for

from .templating import build, files_hash

on_loop = pytest.mark.asyncio(loop_scope="function")

ALIAS = "code-interpreter-v1"


class FakeRecipe:
    """A recipe whose archive is a small tar and whose RUN step can be made to fail."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.prepared = 0
        self.fail = False

    async def prepare(self, cache: Path, progress) -> Prepared:
        self.prepared += 1
        src = self.tmp / "src"
        (src / "pkg").mkdir(parents=True, exist_ok=True)
        (src / "pkg" / "mod.py").write_text("X = 1\n")
        h = files_hash("builtin-test")
        path = cache / "a.tar"
        archives.write_tar(src, "src", path)
        run = "exit 1" if self.fail else "python3 -c 'import pkg'"
        return Prepared(steps=(BuildStep("COPY", ("src/", "/opt/x/", "root", ""), files_hash=h),
                               BuildStep("RUN", (run,))),
                        archives=(Archive(h, path),))


@pytest.fixture
def fake_recipe(tmp_path, monkeypatch) -> FakeRecipe:
    fr = FakeRecipe(tmp_path)
    monkeypatch.setitem(recipes.RECIPES, ALIAS, Recipe(
        alias=ALIAS, cpu_count=2, memory_mb=768, min_free_disk_mb=100,
        start_cmd="serve", ready_cmd="true", prepare=fr.prepare))
    return fr


@pytest.fixture
async def orch(store, rt, envd, tmp_path):
    (tmp_path / "cache").mkdir()
    o = NodeOrchestrator(store, rt, domain="sbx.test", builtin_cache=tmp_path / "cache",
                         envd=EnvdClient(transport=envd.transport()))
    await o.start(ttl_interval_s=3600)
    yield o
    await o.aclose()


def test_recipe_names() -> None:
    for ref in (ALIAS, f"aenv/{ALIAS}", f"{ALIAS}:default"):
        assert recipe_for(ref) is recipes.RECIPES[ALIAS]
    for ref in (f"{ALIAS}:v2", "base", "other", "bad name!"):
        assert recipe_for(ref) is None


@on_loop
async def test_first_use_builds_once_for_racing_creates(orch, rt, fake_recipe):
    infos = await asyncio.gather(*(orch.create(CreateRequest(template_id=ALIAS))
                                   for _ in range(3)))
    assert fake_recipe.prepared == 1
    built = [s for s in rt.build_specs if s.start_cmd == "serve"]
    assert len(built) == 1
    spec = built[0]
    assert (spec.machine.cpu_count, spec.machine.memory_mb) == (2, 768)
    assert spec.ready_cmd == "true" and [s.type for s in spec.steps] == ["COPY", "RUN"]
    assert len({i.sandbox_id for i in infos}) == 3
    assert {i.alias for i in infos} == {ALIAS}
    # an ordinary template afterwards: listed, and the next create builds nothing
    assert ALIAS in [a for t in await orch.list_templates() for a in t.aliases]
    await orch.create(CreateRequest(template_id=f"aenv/{ALIAS}"))
    assert fake_recipe.prepared == 1 and len(rt.build_specs) == 1


@on_loop
async def test_failed_build_is_reported_and_retried(orch, rt, fake_recipe):
    fake_recipe.fail = True
    with pytest.raises(OperationFailed, match=f"built-in template '{ALIAS}' failed.*exit code 1"):
        await orch.create(CreateRequest(template_id=ALIAS))
    fake_recipe.fail = False
    info = await orch.create(CreateRequest(template_id=ALIAS))
    assert info.alias == ALIAS and fake_recipe.prepared == 2


@on_loop
async def test_a_users_template_of_that_name_wins(orch, rt, fake_recipe):
    _, st = await build(orch, ALIAS, steps=(BuildStep("RUN", ("echo mine",)),))
    assert st.status == "ready"
    await orch.create(CreateRequest(template_id=ALIAS))
    assert fake_recipe.prepared == 0


@on_loop
async def test_from_template_naming_it_builds_it_first(orch, rt, fake_recipe):
    _, st = await build(orch, "on-top", from_template=ALIAS,
                        steps=(BuildStep("RUN", ("echo more",)),))
    assert st.status == "ready" and fake_recipe.prepared == 1
    on_top = rt.build_specs[-1]
    assert on_top.from_snapshot == rt.build_specs[0].snapshot_id


def test_archives_are_reproducible_and_rooted(tmp_path) -> None:
    src = tmp_path / "tree"
    (src / "a" / "__pycache__").mkdir(parents=True)
    (src / "a" / "m.py").write_text("x = 1\n")
    (src / "a" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"pyc")
    one, two = tmp_path / "one.tar", tmp_path / "two.tar"
    archives.write_tar(src, "tree", one, keep_pycache=False)
    archives.write_tar(src, "tree", two, keep_pycache=False)
    assert one.read_bytes() == two.read_bytes()
    with tarfile.open(one) as tar:
        names = tar.getnames()
        assert all(m.uid == 0 and m.uname == "root" for m in tar.getmembers())
    assert names == ["tree", "tree/a", "tree/a/m.py"]
    d1 = archives.tree_digest(src)
    (src / "a" / "m.py").write_text("x = 2\n")
    assert archives.tree_digest(src) != d1
    assert not list(tmp_path.glob(".*tmp*"))
