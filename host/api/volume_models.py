"""The volume API's wire models, spelled as the SDKs' generated clients send and parse
them: `/volumes` (E2B's spec/openapi.yml) and `/volumecontent/{volumeID}/...` (E2B's
spec/openapi-volumecontent.yml)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field

from host.volumes.files import MAX_DEPTH

from .models import QueryModel, RequestModel, WireModel
from .types import Between

Uint32 = Annotated[int, Between(0, 2**32 - 1, "uint32")]
Mode = Annotated[int, Between(0, 0o7777, "uint32")]


class NewVolume(RequestModel):
    name: str = Field(description="[a-zA-Z0-9_-]+, unique")


class Volume(WireModel):
    volume_id: str = Field(alias="volumeID")
    name: str


class VolumeAndToken(Volume):
    token: str = Field(description="Bearer token of the volume content API (1 h)")


class VolumeEntryStat(WireModel):
    name: str
    type: Literal["unknown", "file", "directory", "symlink"]
    path: str
    size: int
    mode: int = Field(description="permission bits only")
    uid: int
    gid: int
    atime: datetime
    mtime: datetime
    ctime: datetime
    target: str | None = Field(default=None, description="of a symlink")


class PathQuery(QueryModel):
    path: str = Field(min_length=1, description="absolute within the volume")


class DirQuery(PathQuery):
    depth: Annotated[int, Between(0, MAX_DEPTH)] = Field(
        default=1, description="levels listed (0 reads as 1)")


class CreateQuery(PathQuery):
    uid: Uint32 | None = Field(default=None, description="default 9090")
    gid: Uint32 | None = Field(default=None, description="default 9090")
    mode: Mode | None = Field(default=None, description="default 0666 (files), 0777 (dirs)")
    force: bool = Field(default=False, description="overwrite / accept an existing "
                                                   "directory, make missing parents")


class VolumeMetadata(RequestModel):
    uid: Uint32 | None = None
    gid: Uint32 | None = None
    mode: Mode | None = None
