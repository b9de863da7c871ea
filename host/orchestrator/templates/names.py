"""Template names, tags and ids, as E2B spells them (docs/e2b-template-api.md §3).

A name is `[namespace/]alias[:tag]`, trimmed and lower-cased; aliases and namespaces match
`^[a-z0-9-_]+$`, tags `^[a-z0-9-_.]+$` and may not be UUIDs. This node is one team, whose
namespace is `TEAM`: a name in another namespace is rejected. Template ids are 20
characters of [a-z0-9]; build ids are UUIDs.
"""

from __future__ import annotations

import re
import secrets
import string
import uuid
from dataclasses import dataclass

from ..errors import InvalidRequest

TEAM = "aenv"                 # this node's one team (its namespace, `names` entries)
DEFAULT_TAG = "default"
MAX_NAME = 128

_ALIAS = re.compile(r"^[a-z0-9_-]+$")
_TAG = re.compile(r"^[a-z0-9_.-]+$")
_TEMPLATE_ID = re.compile(r"^[a-z0-9]{20}$")
_FILES_HASH = re.compile(r"^[0-9a-f]{64}$")
_ALNUM = string.ascii_lowercase + string.digits


@dataclass(frozen=True)
class TemplateName:
    """A parsed name: `alias`, the `tag` it carries (None: none given)."""

    alias: str
    tag: str | None = None
    namespace: str | None = None

    @property
    def full(self) -> str:
        """`<team>/<alias>`, as E2B lists a template's `names`."""
        return f"{TEAM}/{self.alias}"


def new_template_id() -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(20))


def new_build_id() -> str:
    return str(uuid.uuid4())


def is_template_id(value: str) -> bool:
    return bool(_TEMPLATE_ID.match(value))


def is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


def is_files_hash(value: str) -> bool:
    return bool(_FILES_HASH.match(value))


def check_tag(tag: str) -> str:
    """`tag` lower-cased, or InvalidRequest."""
    tag = tag.strip().lower()
    if not _TAG.match(tag):
        raise InvalidRequest(f"invalid tag '{tag}': tags must match {_TAG.pattern}")
    if is_uuid(tag):
        raise InvalidRequest(f"invalid tag '{tag}': a tag may not be a UUID")
    return tag


def parse_name(name: str) -> TemplateName:
    """`[namespace/]alias[:tag]` -> TemplateName; InvalidRequest when malformed or in
    another namespace than this node's team."""
    text = name.strip().lower()
    if not text:
        raise InvalidRequest("template name must not be empty")
    if len(text) > MAX_NAME:
        raise InvalidRequest(f"template name must be at most {MAX_NAME} characters")
    namespace: str | None = None
    if "/" in text:
        namespace, text = text.split("/", 1)
        if not _ALIAS.match(namespace):
            raise InvalidRequest(f"invalid namespace '{namespace}': namespaces must match "
                                 f"{_ALIAS.pattern}")
        if namespace != TEAM:
            raise InvalidRequest(f"namespace '{namespace}' is not this team's ('{TEAM}')")
    alias, sep, tag = text.partition(":")
    if not _ALIAS.match(alias):
        raise InvalidRequest(f"invalid template name '{alias}': names must match "
                             f"{_ALIAS.pattern}")
    return TemplateName(alias=alias, tag=check_tag(tag) if sep else None, namespace=namespace)


def lookup_name(name: str) -> TemplateName | None:
    """Like `parse_name` for a lookup (a sandbox's template, a fromTemplate): None when
    `name` cannot name a built template, so the caller tries snapshots next."""
    try:
        return parse_name(name)
    except InvalidRequest:
        return None


def build_tags(name: TemplateName, tags: list[str] | tuple[str, ...]) -> list[str]:
    """The tags a build gets (§3): the name's tag first (`default` dropped), then `tags`,
    de-duplicated; none at all is ["default"]."""
    out: list[str] = []
    if name.tag and name.tag != DEFAULT_TAG:
        out.append(name.tag)
    for tag in tags:
        t = check_tag(tag)
        if t not in out:
            out.append(t)
    return out or [DEFAULT_TAG]
