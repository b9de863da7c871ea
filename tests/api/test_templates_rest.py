"""The template build API over ASGI: the HTTP mapping of every template route (status
codes, field names, error bodies per docs/e2b-template-api.md), signed uploads, and
percent-encoded names in paths. The orchestrator is real, its runtime the fake (no VM);
answers are also parsed with the Python SDK's generated models, as the SDK would."""

from __future__ import annotations

import hashlib
import os
import stat
import time
import uuid
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from e2b.api.client.models import (
    AssignedTemplateTags,
    TemplateAliasResponse,
    TemplateBuildFileUpload,
    TemplateBuildInfo,
    TemplateRequestResponseV3,
    TemplateWithBuilds,
)
from e2b.api.client.models import Template as SdkTemplate
from e2b.api.client.models import TemplateTag as SdkTag

from host.api.uploads import SECRET_FILE
from host.config import ConfigError, parse_config

from .conftest import API_KEY
from .template_service import NodeService

pytestmark = pytest.mark.asyncio(loop_scope="function")

H = hashlib.sha256(b"files").hexdigest()
BASE = "http://api.sbx.test"


@pytest.fixture
async def svc(tmp_path):
    s = NodeService(tmp_path, max_upload_bytes=1024)
    await s.start()
    yield s
    await s.aclose()
    s.close_store()


@pytest.fixture
async def api(svc):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=svc.app), base_url=BASE,
                                 headers={"X-API-Key": API_KEY}) as c:
        yield c


async def request(api, name="my-tpl", **more):
    r = await api.post("/v3/templates", json={"name": name, **more})
    assert r.status_code == 202, r.text
    return r.json()


async def finish(api, tid, bid):
    for _ in range(500):
        st = (await api.get(f"/templates/{tid}/builds/{bid}/status")).json()
        if st["status"] in ("ready", "error"):
            return st
    raise AssertionError(f"build {bid} did not finish: {st}")


async def built(api, name="my-tpl", steps=(), **start):
    req = await request(api, name)
    r = await api.post(f"/v2/templates/{req['templateID']}/builds/{req['buildID']}",
                       json={"fromTemplate": "base", "force": False, "steps": list(steps),
                             **start})
    assert r.status_code == 202, r.text
    return req, await finish(api, req["templateID"], req["buildID"])


def err(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["code"] == status and set(body) <= {"code", "message", "error_code"}
    return str(body["message"])


# ---- POST /v3/templates --------------------------------------------------------------

async def test_request_build(api):
    body = await request(api, "My-Tpl:v1", tags=["extra"], cpuCount=2, memoryMB=1024)
    assert set(body) == {"templateID", "buildID", "public", "names", "tags", "aliases"}
    assert body["names"] == ["aenv/my-tpl"] and body["aliases"] == ["my-tpl"]
    assert body["tags"] == ["v1", "extra"] and body["public"] is False
    TemplateRequestResponseV3.from_dict(body)
    assert "'name' is required" in err(await api.post("/v3/templates", json={}), 400)
    assert "'cpuCount'" in err(await api.post("/v3/templates",
                                              json={"name": "x", "cpuCount": 0}), 400)
    assert "namespace 'other'" in err(await api.post("/v3/templates",
                                                     json={"name": "other/x"}), 400)
    assert err(await api.post("/v3/templates", json={"name": "base"}), 403) == \
        "Alias 'base' already used"
    assert err(await api.post("/v3/templates", json={"name": body["templateID"]}), 409) == \
        f"Alias '{body['templateID']}' is already used"


# ---- files and signed uploads --------------------------------------------------------

async def test_upload_link_and_signed_put(api, svc):
    req = await request(api)
    r = await api.get(f"/templates/{req['templateID']}/files/{H}")
    assert r.status_code == 201, r.text
    link = r.json()
    TemplateBuildFileUpload.from_dict(link)
    assert link["present"] is False
    url = urlsplit(link["url"])
    assert f"{url.scheme}://{url.netloc}" == BASE and url.path == f"/template-files/{H}"
    assert set(parse_qs(url.query)) == {"expires", "signature"}
    secret = svc.state_dir / SECRET_FILE
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=svc.app)) as anon:
        put = await anon.put(link["url"], content=b"tar bytes")  # no API key
        assert put.status_code == 200, put.text
        assert (svc.files_dir / H).read_bytes() == b"tar bytes"
        again = (await api.get(f"/templates/my-tpl/files/{H}")).json()
        assert again["present"] is True and again["url"]
        forged = link["url"].split("&signature=")[0] + "&signature=" + "0" * 64
        assert "invalid or has expired" in err(await anon.put(forged, content=b"x"), 403)
        other = link["url"].replace(H, "a" * 64)
        err(await anon.put(other, content=b"x"), 403)
        svc.app.state.uploads.signer.clock = lambda: 2e10  # long after it expired
        err(await anon.put(link["url"], content=b"x"), 403)
        svc.app.state.uploads.signer.clock = time.time
        big = (await api.get(f"/templates/my-tpl/files/{'b' * 64}")).json()["url"]
        assert "limit of 1024 bytes" in err(await anon.put(big, content=b"x" * 2000), 413)
        assert not (svc.files_dir / ("b" * 64)).exists()
        assert [p.name for p in svc.files_dir.iterdir()] == [H]
        err(await anon.get(link["url"]), 401)  # only the PUT is open
    assert err(await api.get("/templates/my-tpl/files/nothex"), 400) == "Invalid files hash"
    err(await api.get(f"/templates/nope/files/{H}"), 404)


# ---- start and status ----------------------------------------------------------------

async def test_start_build_and_status(api, svc):
    req = await request(api)
    tid, bid = req["templateID"], req["buildID"]
    r = await api.post(f"/v2/templates/aenv%2Fmy-tpl/builds/{bid}", json={
        "fromTemplate": "base", "force": False, "startCmd": "sleep 1", "readyCmd": "true",
        "steps": [{"type": "RUN", "args": ["echo hi"], "force": False},
                  {"type": "ENV", "args": ["A", "1"], "force": False},
                  {"type": "USER", "args": ["root"], "force": False}]},
        headers={"User-Agent": "e2b-python-sdk/2.63.0"})
    assert r.status_code == 202 and r.content == b""
    st = await finish(api, tid, bid)
    TemplateBuildInfo.from_dict(st)
    assert st["status"] == "ready" and st["logs"] == [] and "reason" not in st
    assert st["logEntries"][0]["step"] == "base" and st["logEntries"][0]["level"] == "info"
    assert st["logEntries"][0]["timestamp"].endswith("Z") or "+00:00" in st["logEntries"][0][
        "timestamp"]
    page = (await api.get(f"/templates/my-tpl%3Adefault/builds/{bid}/status",
                          params={"logsOffset": 2, "limit": 1, "level": "info"})).json()
    assert page["logEntries"] == [st["logEntries"][2]]
    (spec,) = svc.runtime.build_specs
    assert [(s.type, s.args) for s in spec.steps] == [("RUN", ("echo hi",)), ("ENV", ("A", "1")),
                                                       ("USER", ("root",))]
    assert (spec.start_cmd, spec.ready_cmd) == ("sleep 1", "true")
    again = await api.post(f"/v2/templates/{tid}/builds/{bid}", json={"fromImage": "x"})
    assert err(again, 400) == "build is not in waiting state"


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"fromImage": "x", "steps": [{"type": "FROB", "args": []}]}, 400,
     "step 1: command type 'FROB' is not implemented"),
    ({"fromImage": "x", "steps": [{"type": "COPY", "args": ["a", "/"], "filesHash": H}]}, 400,
     "were never uploaded"),
    ({"fromImage": "x", "steps": [{"type": "ENV", "args": ["A"]}]}, 400, "key/value pairs"),
    ({"fromTemplate": "nope"}, 400, "fromTemplate 'nope'"),
    ({}, 400, "exactly one of 'fromImage' and 'fromTemplate'"),
    ({"fromImage": "x", "fromImageRegistry": {"type": "aws", "awsAccessKeyId": "a",
                                              "awsSecretAccessKey": "b", "awsRegion": "c"}},
     400, "type 'aws' is not supported"),
    ({"fromImage": "x", "steps": "RUN"}, 400, "'steps' must be an array"),
])
async def test_start_build_errors(api, body, status, message):
    req = await request(api)
    r = await api.post(f"/v2/templates/{req['templateID']}/builds/{req['buildID']}", json=body)
    assert message in err(r, status)


async def test_start_build_ids_and_user_agent(api):
    req = await request(api)
    tid, bid = req["templateID"], req["buildID"]
    start = {"fromImage": "x"}
    assert "must be a UUID" in err(await api.post(f"/v2/templates/{tid}/builds/nope",
                                                  json=start), 400)
    other = str(uuid.uuid4())
    assert err(await api.post(f"/v2/templates/{tid}/builds/{other}", json=start), 400) == \
        f"Build '{other}' not found"
    err(await api.post(f"/v2/templates/nope/builds/{bid}", json=start), 404)
    bad_ua = await api.post(f"/v2/templates/{tid}/builds/{bid}", json=start,
                            headers={"User-Agent": "e2b-js-sdk/banana"})
    assert "Error when parsing user agent" in err(bad_ua, 400)
    assert err(await api.get(f"/templates/{tid}/builds/{other}/status"), 400) == \
        f"Build '{other}' not found"


async def test_failed_build_status_has_the_reason(api):
    _, st = await built(api, "bad", steps=[{"type": "RUN", "args": ["exit 1"], "force": False}])
    TemplateBuildInfo.from_dict(st)
    assert st["status"] == "error"
    assert st["reason"]["message"] == "Command 'exit 1' failed with exit code 1"
    assert st["reason"]["step"] == "1"
    assert [e["message"] for e in st["reason"]["logEntries"]][-1].startswith("Build failed")


# ---- templates -----------------------------------------------------------------------

async def test_list_get_delete(api):
    ids = [(await built(api, f"t{i}"))[0]["templateID"] for i in range(3)]
    listed = (await api.get("/templates")).json()
    assert [t["templateID"] for t in listed] == ids[::-1]
    for t in listed:
        SdkTemplate.from_dict(t)
        assert t["createdBy"] is None and t["lastSpawnedAt"] is None
        assert t["buildStatus"] == "ready" and t["spawnCount"] == 0
    first = await api.get("/v2/templates", params={"limit": 2})
    assert [t["templateID"] for t in first.json()] == ids[:0:-1]
    rest = await api.get("/v2/templates", params={"nextToken": first.headers["x-next-token"]})
    assert [t["templateID"] for t in rest.json()] == ids[:1]
    assert "x-next-token" not in rest.headers
    sbx = await api.post("/v2/sandboxes", json={"templateID": "t0"})
    assert sbx.status_code == 201, sbx.text
    assert (sbx.json()["templateID"], sbx.json()["alias"]) == (ids[0], "t0")
    one = (await api.get("/templates/aenv%2Ft0")).json()
    TemplateWithBuilds.from_dict(one)
    assert one["spawnCount"] == 1 and one["lastSpawnedAt"] and len(one["builds"]) == 1
    assert "used by 1 sandbox" in err(await api.delete("/templates/t0"), 400)
    assert (await api.delete(f"/sandboxes/{sbx.json()['sandboxID']}")).status_code == 204
    assert (await api.delete("/templates/t0")).status_code == 204
    err(await api.get("/templates/t0"), 404)
    err(await api.delete("/templates/t0"), 404)


async def test_aliases(api):
    req, _ = await built(api)
    for ref in ("my-tpl", "aenv%2Fmy-tpl%3Adefault", "MY-TPL"):
        r = await api.get(f"/templates/aliases/{ref}")
        assert r.json() == {"templateID": req["templateID"], "public": False}
        TemplateAliasResponse.from_dict(r.json())
    assert (await api.get("/templates/aliases/base")).json() == {"templateID": "base",
                                                                 "public": True}
    err(await api.get("/templates/aliases/nope"), 404)
    err(await api.get("/templates/aliases/my-tpl%3Av9"), 404)
    err(await api.get("/templates/aliases/other%2Fmy-tpl"), 400)


async def test_tags(api):
    req, _ = await built(api)
    r = await api.post("/templates/tags", json={"target": "my-tpl:default", "tags": ["v1"]})
    assert r.status_code == 201 and r.json() == {"buildID": req["buildID"], "tags": ["v1"]}
    AssignedTemplateTags.from_dict(r.json())
    listed = (await api.get(f"/templates/{req['templateID']}/tags")).json()
    assert sorted(t["tag"] for t in listed) == ["default", "v1"]
    for t in listed:
        SdkTag.from_dict(t)
    gone = await api.request("DELETE", "/templates/tags", json={"name": "my-tpl", "tags": ["v1"]})
    assert gone.status_code == 204
    assert "cannot be removed" in err(await api.request(
        "DELETE", "/templates/tags", json={"name": "my-tpl", "tags": ["default"]}), 400)
    assert "with tag 'v1' not found" in err(await api.request(
        "DELETE", "/templates/tags", json={"name": "my-tpl", "tags": ["v1"]}), 404)
    err(await api.post("/templates/tags", json={"target": "nope", "tags": ["x"]}), 404)
    err(await api.post("/templates/tags", json={"target": "my-tpl"}), 400)
    err(await api.get("/templates/nope/tags"), 404)


async def test_upload_limit_setting() -> None:
    assert parse_config([], env={}).template_upload_mib == 2048
    cfg = parse_config(["--template-upload-mib", "64"], env={})
    assert cfg.template_upload_mib == 64
    assert parse_config([], env={"AENV_TEMPLATE_UPLOAD_MIB": "8"}).template_upload_mib == 8
    with pytest.raises(ConfigError, match="template_upload_mib"):
        parse_config(["--template-upload-mib", "0"], env={})
