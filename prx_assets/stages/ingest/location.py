"""Where a source lives: a local folder or file, or an object-store prefix (`s3://...`),
opened through `pyarrow.fs` so every reader streams from either the same way.

A location is resolved on the driver (the standard AWS variables and any overrides become
explicit options, see `storage.object_store`) and pickled into Ray tasks, which build their
file system from those options, never from their own environment.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Optional

import pyarrow.fs as pafs

from prx_assets.storage import object_store

# Bounded client behaviour for source reads (as for tables): a dead endpoint fails fast.
CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 60.0
MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class SourceLocation:
    """A source's `uri` (an absolute local path, or `s3://bucket/prefix`), the resolved
    object-store options (None locally), and whether it names one file (a single tar or
    parquet file) rather than a folder or prefix."""

    uri: str
    options: Optional[tuple[tuple[str, str], ...]] = None
    single_file: bool = False

    @classmethod
    def of(cls, uri: "str | Path", overrides: Optional[Mapping[str, str]] = None
           ) -> "SourceLocation":
        text = object_store.as_uri(uri)
        if object_store.is_object_store(text):
            options = object_store.lance_options(text, overrides) or {}
            return cls(text.rstrip("/"), tuple(sorted(options.items())))
        return cls(str(Path(text.removeprefix("file://")).expanduser().absolute()))

    @property
    def is_local(self) -> bool:
        return self.options is None

    @property
    def storage_options(self) -> Optional[dict[str, str]]:
        """The options as Lance takes them (a Lance source on an object store)."""
        return dict(self.options) if self.options is not None else None

    @property
    def base(self) -> str:
        """The location as the file system names it (`bucket/prefix` on S3)."""
        return self.uri if self.is_local else self.uri.partition("://")[2]

    def filesystem(self) -> pafs.FileSystem:
        return _filesystem(self.options)

    def path_of(self, rel: str) -> str:
        """The file system path of a unit (a path relative to the location)."""
        return self.base if self.single_file else f"{self.base.rstrip('/')}/{rel}"

    def as_single_file(self) -> "SourceLocation":
        return replace(self, single_file=True)

    def check_reachable(self) -> None:
        """On an object store, fail at once naming the URI and the cause."""
        if not self.is_local:
            object_store.check_reachable(self.uri, dict(self.options or ()))

    def info(self, path: Optional[str] = None) -> pafs.FileInfo:
        return self.filesystem().get_file_info(path or self.base)


@functools.lru_cache(maxsize=8)
def _filesystem(options: Optional[tuple[tuple[str, str], ...]]) -> pafs.FileSystem:
    """One file system per process and configuration (an S3 client is costly to make)."""
    if options is None:
        return pafs.LocalFileSystem()
    return s3_filesystem(dict(options))


def s3_filesystem(options: Mapping[str, str]) -> pafs.S3FileSystem:
    """A pyarrow S3 file system from Lance-style options (`aws_endpoint`, `allow_http`...)."""
    endpoint = options.get("aws_endpoint") or None
    scheme = "https"
    if endpoint and "://" in endpoint:
        scheme, _, endpoint = endpoint.partition("://")
    elif endpoint and options.get("allow_http", "").lower() == "true":
        scheme = "http"
    key, secret = options.get("aws_access_key_id"), options.get("aws_secret_access_key")
    return pafs.S3FileSystem(
        access_key=key if key and secret else None,
        secret_key=secret if key and secret else None,
        session_token=options.get("aws_session_token") if key and secret else None,
        region=options.get("aws_region") or "us-east-1",
        endpoint_override=endpoint, scheme=scheme,
        connect_timeout=CONNECT_TIMEOUT_S, request_timeout=REQUEST_TIMEOUT_S,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=MAX_ATTEMPTS),
        allow_bucket_creation=False, allow_bucket_deletion=False,
        force_virtual_addressing=options.get("aws_virtual_hosted_style_request",
                                             "false").lower() == "true",
    )


def signature(size: Optional[int], mtime_ns: Optional[int]) -> str:
    """What a listing says about a file's content: its size and modification time (ns)."""
    return f"{size}:{mtime_ns}"
