"""Tar shards for tests: members added from bytes."""

from __future__ import annotations

import io
import tarfile


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
