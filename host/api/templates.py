"""Handlers of the template build API (docs/e2b-template-api.md §3-9): request a build,
COPY upload links, start a build, its status, list / get / delete templates, aliases and
tags. One orchestrator call each; errors map through errors.py.

Template ids and aliases in paths may be names with a namespace and a tag: the SDKs
percent-encode them (`aenv%2Fapp%3Av1`) and the server decodes the path before routing, so
these routes capture them with the `path` convertor (routes.py orders the catch-all last).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response

from host.orchestrator.model import BuildRequest

from . import convert
from . import template_models as tm
from .errors import bad_request
from .sandboxes import no_content, orch, reply
from .types import encode_cursor
from .uploads import uploads

T = TypeVar("T")

# An SDK user agent ("e2b-python-sdk/2.63.0 ..."): infra picks the template format from
# that version and answers 400 when it cannot parse it.
_SDK_AGENT = re.compile(r"e2b-(?:js|python)-sdk/(\S+)")
_VERSION = re.compile(r"^v?\d+\.\d+\.\d+(?:[-+][0-9A-Za-z.+-]*)?$")


def _template_id(request: Request) -> str:
    return str(request.path_params["templateID"])


def _page(items: Sequence[T], key: Callable[[T], tuple[float, str]], *, limit: int,
          cursor: tuple[float, str] | None) -> tuple[list[T], dict[str, str] | None]:
    """Newest first, after the cursor, cut at `limit`; the X-Next-Token header if more."""
    ordered = sorted(items, key=key, reverse=True)
    if cursor is not None:
        ordered = [i for i in ordered if key(i) < cursor]
    page = ordered[:limit]
    if len(ordered) > limit:
        return page, {"X-Next-Token": encode_cursor(*key(page[-1]))}
    return page, None


# --- builds ---------------------------------------------------------------------------

async def request_build(request: Request, *, body: tm.TemplateBuildRequestV3) -> Response:
    name = body.name or body.alias
    if not name:
        raise bad_request("'name' is required")
    res = await orch(request).request_build(BuildRequest(
        name=name, tags=tuple(body.tags), cpu_count=body.cpu_count,
        memory_mb=body.memory_mb, min_free_disk_mb=body.min_free_disk_mb))
    return reply(convert.requested_build(res), 202)


async def file_upload_link(request: Request) -> Response:
    files_hash = str(request.path_params["hash"])
    present = await orch(request).template_file(_template_id(request), files_hash)
    url = uploads(request).signer.url(str(request.base_url), files_hash)
    return reply(tm.TemplateBuildFileUpload(present=present, url=url), 201)


def check_user_agent(user_agent: str | None) -> None:
    """400 for an e2b SDK user agent whose version does not parse (as infra answers)."""
    match = _SDK_AGENT.search(user_agent or "")
    if match and not _VERSION.match(match.group(1)):
        raise bad_request(f"Error when parsing user agent: {user_agent}")


async def start_build(request: Request, *, body: tm.TemplateBuildStartV2,
                      headers: tm.BuildHeaders) -> Response:
    check_user_agent(headers.user_agent)
    await orch(request).start_build(_template_id(request), str(request.path_params["buildID"]),
                                    convert.build_start(body))
    return Response(status_code=202)


async def build_status(request: Request, *, query: tm.BuildStatusQuery) -> Response:
    st = await orch(request).build_status(
        _template_id(request), str(request.path_params["buildID"]),
        offset=query.logs_offset, limit=query.limit, level=query.level)
    return reply(convert.build_status(st))


# --- templates ------------------------------------------------------------------------

async def list_v1(request: Request, *, query: tm.ListTemplatesQuery) -> Response:
    items = await orch(request).list_templates()
    items = sorted(items, key=lambda t: (t.created_at, t.template_id), reverse=True)
    return reply([convert.template(t) for t in items])


async def list_v2(request: Request, *, query: tm.ListTemplatesV2Query) -> Response:
    items = await orch(request).list_templates()
    page, headers = _page(items, lambda t: (t.created_at, t.template_id), limit=query.limit,
                          cursor=query.next_token)
    return reply([convert.template(t) for t in page], headers=headers)


async def get_one(request: Request, *, query: tm.TemplateBuildsQuery) -> Response:
    info = await orch(request).get_template(_template_id(request))
    builds, headers = _page(info.builds, lambda b: (b.created_at, b.build_id),
                            limit=query.limit, cursor=query.next_token)
    return reply(convert.template_with_builds(info, builds), headers=headers)


async def delete(request: Request) -> Response:
    """A built template, else a named snapshot (`Sandbox.delete_snapshot` lands here)."""
    await orch(request).delete_template(_template_id(request))
    return no_content()


async def alias(request: Request) -> Response:
    template_id, public = await orch(request).template_alias(str(request.path_params["alias"]))
    return reply(tm.TemplateAliasResponse(templateID=template_id, public=public))


# --- tags -----------------------------------------------------------------------------

async def assign_tags(request: Request, *, body: tm.AssignTemplateTagsRequest) -> Response:
    build_id, tags = await orch(request).assign_tags(body.target, body.tags)
    return reply(tm.AssignedTemplateTags(buildID=build_id, tags=tags), 201)


async def remove_tags(request: Request, *, body: tm.DeleteTemplateTagsRequest) -> Response:
    await orch(request).remove_tags(body.name, body.tags)
    return no_content()


async def list_tags(request: Request) -> Response:
    tags = await orch(request).list_tags(_template_id(request))
    return reply([convert.template_tag(t) for t in tags])
