"""Object-store locations (`s3://bucket/prefix`): the settings every client gets, and a
preflight that turns a bad bucket, bad credentials or a dead endpoint into one clear error.

Settings come from the standard variables (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`, `AWS_ALLOW_HTTP`), overridden by
explicit storage options (Lance's / object_store's key names). They are resolved on the
driver and passed to every Lance call explicitly, because Ray tasks run in worker processes
whose environment was fixed when the cluster started.

Retries and timeouts are bounded: Lance's defaults wait up to minutes on an endpoint that
accepts connections but never answers, and Lance re-lists a table's versions several times
before giving up, so a dead endpoint multiplies every timeout. The preflight makes one
request with short timeouts before Lance sees the location.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath

# Bounded client behaviour for every object-store request Lance makes; a resource's storage
# options override any of them. Per request: 5 s to connect, 60 s in all (Lance uploads in
# parts of ~5 MB, so a healthy request takes well under that); at most 3 retries within 60 s.
DEFAULT_LANCE_OPTIONS = {
    "connect_timeout": "5s",
    "timeout": "60s",
    "client_max_retries": "3",
    "client_retry_timeout": "60",
}
# The preflight is one request: a short budget, no retries.
PREFLIGHT_CONNECT_TIMEOUT_S = 3.0
PREFLIGHT_READ_TIMEOUT_S = 10.0

# Environment variable -> Lance storage-option key.
_ENV_KEYS = {
    "AWS_ENDPOINT_URL": "aws_endpoint",
    "AWS_ACCESS_KEY_ID": "aws_access_key_id",
    "AWS_SECRET_ACCESS_KEY": "aws_secret_access_key",
    "AWS_SESSION_TOKEN": "aws_session_token",
    "AWS_REGION": "aws_region",
    "AWS_ALLOW_HTTP": "allow_http",
}
# Aliases object_store accepts for the same settings, folded into the keys above.
_ALIASES = {
    "endpoint": "aws_endpoint", "endpoint_url": "aws_endpoint", "aws_endpoint_url": "aws_endpoint",
    "access_key_id": "aws_access_key_id", "secret_access_key": "aws_secret_access_key",
    "session_token": "aws_session_token", "token": "aws_session_token",
    "aws_token": "aws_session_token",
    "region": "aws_region", "aws_allow_http": "allow_http",
}
# (bucket, resolved options) already checked in this process: one preflight per bucket and
# configuration, not one per table access.
_CHECKED: set[tuple] = set()
_COLLAPSED_SCHEME = re.compile(r"^([a-z][a-z0-9+.-]*):/(?!/)")


class ObjectStoreError(OSError):
    """An object-store location that cannot be used; the message names the URI and why."""


def is_object_store(uri: str | PurePath) -> bool:
    return "://" in as_uri(uri) and not as_uri(uri).startswith("file://")


def as_uri(location: str | PurePath) -> str:
    """A location as a URI string. `Path("s3://b/k")` collapses the `//` to `s3:/b/k`; such a
    path still names the object-store location, so the scheme is restored."""
    text = str(location)
    return _COLLAPSED_SCHEME.sub(r"\1://", text) if isinstance(location, PurePath) else text


def split_uri(uri: str) -> tuple[str, str, str]:
    """(scheme, bucket, key prefix) of `scheme://bucket/prefix`."""
    scheme, _, rest = as_uri(uri).partition("://")
    bucket, _, key = rest.partition("/")
    return scheme, bucket, key


def lance_options(uri: str | PurePath,
                  overrides: Mapping[str, str] | StoreSettings | None = None
                  ) -> dict[str, str] | None:
    """The storage options for a Lance call on `uri`: None for a local path; for an object
    store, the bounded defaults, then the standard variables, then `overrides` (settings
    already resolved are taken as they are)."""
    if not is_object_store(uri):
        return None
    if isinstance(overrides, StoreSettings):
        return overrides.as_lance()
    options = dict(DEFAULT_LANCE_OPTIONS)
    for env, key in _ENV_KEYS.items():
        if os.environ.get(env):
            options[key] = os.environ[env]
    for key, value in (overrides or {}).items():
        options[_ALIASES.get(key.lower(), key.lower())] = str(value)
    return options


# Settings whose values never print (a handle's repr, a log line, asset metadata).
SECRET_KEYS = frozenset({"aws_access_key_id", "aws_secret_access_key", "aws_session_token"})


@dataclass(frozen=True)
class StoreSettings:
    """Object-store settings resolved once (on the driver): the bounded defaults, the
    standard variables, then explicit overrides, in Lance's key names. Hashable, so one
    client per configuration is cached; its repr masks the credentials."""

    items: tuple[tuple[str, str], ...]

    @classmethod
    def resolve(cls, uri: str | PurePath,
                overrides: Mapping[str, str] | StoreSettings | None = None
                ) -> StoreSettings:
        if isinstance(overrides, StoreSettings):
            return overrides
        return cls(tuple(sorted((lance_options(uri, overrides) or {}).items())))

    def as_lance(self) -> dict[str, str]:
        """Lance's (and Ray Data's `read_lance`) `storage_options`."""
        return dict(self.items)

    def get(self, key: str, default: str | None = None) -> str | None:
        return dict(self.items).get(key, default)

    def __repr__(self) -> str:
        shown = ", ".join(f"{key}={'***' if key in SECRET_KEYS else value}"
                          for key, value in self.items)
        return f"StoreSettings({shown})"


def check_reachable(uri: str | PurePath,
                    options: Mapping[str, str] | StoreSettings | None = None) -> None:
    """Fail at once, naming `uri` and the cause, if its bucket is missing, the credentials are
    refused or the endpoint does not answer; one listing request, no retries."""
    uri = as_uri(uri)
    if not is_object_store(uri):
        return
    scheme, bucket, prefix = split_uri(uri)
    if scheme not in ("s3", "s3a"):
        return  # other stores: Lance's own (bounded) errors are the check
    resolved = StoreSettings.resolve(uri, options).as_lance()
    key = (bucket, tuple(sorted(resolved.items())))
    if key in _CHECKED:
        return
    client = _s3_client(resolved)
    endpoint = resolved.get("aws_endpoint") or "the AWS endpoint"
    import botocore.exceptions as bx

    try:
        client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1)
    except bx.ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        message = exc.response.get("Error", {}).get("Message", "") or str(exc)
        if code == "NoSuchBucket":
            cause = f"bucket {bucket!r} does not exist at {endpoint}"
        elif code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
                      "InvalidToken", "ExpiredToken", "403"):
            cause = f"credentials refused by {endpoint} ({code}: {message})"
        else:
            cause = f"{endpoint} answered {code}: {message}"
        raise ObjectStoreError(f"cannot use {uri}: {cause}") from None
    except (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError,
            bx.ConnectionClosedError) as exc:
        raise ObjectStoreError(f"cannot use {uri}: endpoint {endpoint} is unreachable "
                               f"({type(exc).__name__})") from None
    except bx.NoCredentialsError:
        raise ObjectStoreError(f"cannot use {uri}: no credentials (set AWS_ACCESS_KEY_ID and "
                               f"AWS_SECRET_ACCESS_KEY or the storage options)") from None
    _CHECKED.add(key)


def _s3_client(options: Mapping[str, str]):
    import boto3
    from botocore.config import Config

    virtual = options.get("aws_virtual_hosted_style_request", "false").lower() == "true"
    config = Config(connect_timeout=PREFLIGHT_CONNECT_TIMEOUT_S,
                    read_timeout=PREFLIGHT_READ_TIMEOUT_S,
                    retries={"total_max_attempts": 1},
                    s3={"addressing_style": "virtual" if virtual else "path"})
    return boto3.client(
        "s3", config=config,
        endpoint_url=options.get("aws_endpoint"),
        aws_access_key_id=options.get("aws_access_key_id"),
        aws_secret_access_key=options.get("aws_secret_access_key"),
        aws_session_token=options.get("aws_session_token"),
        region_name=options.get("aws_region") or "us-east-1",
    )


def lease_client(settings: StoreSettings):
    """A boto3 client for lease objects (conditional puts, which pyarrow's S3FileSystem
    cannot send): the preflight's short timeouts and a single attempt per request, since
    a lease's caller retries on its own schedule."""
    return _s3_client(settings.as_lance())


def is_not_found(exc: BaseException) -> bool:
    """Whether a Lance error says the table was never written (as opposed to a bucket,
    credential or network problem, which must not read as "absent")."""
    text = str(exc)
    return isinstance(exc, FileNotFoundError) or ("was not found" in text and "Dataset" in text)


# ------------------------------------------------------------------ files (not Lance tables)

def filesystem(uri: str | PurePath,
               overrides: Mapping[str, str] | StoreSettings | None = None):
    """(pyarrow FileSystem, path inside it) for a location: the local file system for a
    folder, an S3FileSystem with the same resolved settings Lance gets for `s3://...`.
    For plain files under the root (MDS shards, sidecars, pointers, opt-out and ablation
    lists); S3FileSystem.copy_file is a server-side CopyObject (no bytes through us)."""
    import pyarrow.fs as pafs

    uri = as_uri(uri)
    if not is_object_store(uri):
        return pafs.LocalFileSystem(), str(PurePath(uri.removeprefix("file://")))
    scheme, bucket, key = split_uri(uri)
    if scheme not in ("s3", "s3a"):
        raise ObjectStoreError(f"cannot use {uri}: only s3:// object stores are supported here")
    settings = StoreSettings.resolve(uri, overrides)
    check_reachable(uri, settings)  # a bad bucket, key or endpoint fails once, by name
    return s3_filesystem(settings), f"{bucket}/{key}".rstrip("/")


@functools.lru_cache(maxsize=8)
def s3_filesystem(settings: StoreSettings):
    """One S3FileSystem per configuration (thread-safe, reused: building one per file would
    dominate copying a version's thousands of small requests), from Lance-style settings:
    the endpoint with or without its scheme, plain HTTP when `allow_http`, virtual-hosted
    addressing when asked, the bounded timeouts and retries."""
    import pyarrow.fs as pafs

    endpoint = settings.get("aws_endpoint") or None
    scheme = "http" if (settings.get("allow_http") or "false").lower() == "true" else "https"
    if endpoint and "://" in endpoint:
        scheme, _, endpoint = endpoint.partition("://")
    key, secret = settings.get("aws_access_key_id"), settings.get("aws_secret_access_key")
    return pafs.S3FileSystem(
        access_key=key if key and secret else None,
        secret_key=secret if key and secret else None,
        session_token=settings.get("aws_session_token") if key and secret else None,
        region=settings.get("aws_region") or "us-east-1",
        endpoint_override=endpoint, scheme=scheme,
        connect_timeout=PREFLIGHT_CONNECT_TIMEOUT_S,
        request_timeout=_seconds(settings.get("timeout") or "60s"),
        retry_strategy=pafs.AwsStandardS3RetryStrategy(
            max_attempts=int(settings.get("client_max_retries") or 3)),
        force_virtual_addressing=(settings.get("aws_virtual_hosted_style_request")
                                  or "false").lower() == "true",
        check_directory_existence_before_creation=False,
        allow_bucket_creation=False, allow_bucket_deletion=False)


def _seconds(duration: str) -> float:
    """`60s` / `500ms` / `2m` (object_store's duration strings) as seconds."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*(ms|s|m|h)?\s*", duration)
    if not match:
        raise ValueError(f"not a duration: {duration!r}")
    value, unit = float(match.group(1)), match.group(2) or "s"
    return value * {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}[unit]


# What an object store answers when it is briefly unable to (S3's 500/503 "SlowDown",
# a gateway's 502/504): worth a retry of the step, unlike a refused key or a missing bucket.
_TRANSIENT = re.compile(r"(?:status|code|http|answered)[^0-9\n]{0,16}5(?:00|02|03|04)\b"
                        r"|SlowDown|ServiceUnavailable|Service Unavailable"
                        r"|Internal Server Error|Bad Gateway|Gateway Time-?out", re.IGNORECASE)


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) is an object store's transient
    server error (5xx), so the step that met it may run again."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError | RuntimeError | ObjectStoreError) \
                and _TRANSIENT.search(str(seen)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
