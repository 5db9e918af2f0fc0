"""Leases kept in the storage itself (`$PRX_DATA_ROOT/leases/...`), so every writer sees them
whatever started it: the UI, a sensor, two shells, two machines against one bucket.

    leases/writers/<asset>/<source>.json          one writer of (asset, source) at a time
    leases/trees/<source>.json                    one writer of a source's MDS tree at a time
    leases/readers/<source>/<version>/<id>.json   a reader of one tree version (many at once)

A lease file holds its owner (run id, host, pid, a random token), when it was taken and when
it expires. It is created atomically (locally `O_CREAT | O_EXCL`, file and folder flushed;
on S3 a PUT with `If-None-Match: *`) and replaced only by whoever read the version it
replaces (locally under an `flock` of a lock file beside it, comparing the bytes; on S3 a
PUT with `If-Match: <etag>`). A holder renews it from a heartbeat thread; a holder that dies
stops renewing, its lease expires and the next writer takes it over (and resumes, since
every stage is resumable). A writer on the holder's own machine (same boot and PID
namespace) takes it over at once when the holder's process is gone (`process_keys`). A
writer that cannot get a lease within its wait budget fails with a message naming the
holder.

Expiry compares wall clocks: machines sharing a bucket need clocks within a small fraction
of the lease's time to live (NTP gives milliseconds; the default TTL is two minutes).
"""

from __future__ import annotations

import contextvars
import fcntl
import functools
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from prx_assets.storage.failpoints import failpoint
from prx_assets.storage.object_store import StoreSettings, split_uri
from prx_assets.storage.process_keys import gone, process_key
from prx_assets.storage.refs import Location, sync_folder

logger = logging.getLogger(__name__)

LEASES_DIR = "leases"
TTL_ENV, WAIT_ENV = "PRX_LEASE_TTL_S", "PRX_LEASE_WAIT_S"
DEFAULT_TTL_S = 120.0  # a killed holder blocks the next writer at most this long
DEFAULT_WAIT_S = 3600.0  # how long a writer waits for a live holder before failing
READER_TTL_S = 600.0  # a loader's lease; renewed every third of it while it streams

# The Dagster run a lease taken in this context belongs to (set by the Dagster layer), so a
# holder named in an error is a run one can open in the UI.
current_run_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "prx_lease_run_id", default=None)


class LeaseHeldError(RuntimeError):
    """The lease is held by a live owner and the wait budget ran out."""


class LeaseLostError(RuntimeError):
    """This process's lease expired or was taken over: it must not commit anything."""


def default_ttl() -> float:
    return float(os.environ.get(TTL_ENV) or DEFAULT_TTL_S)


def default_wait() -> float:
    return float(os.environ.get(WAIT_ENV) or DEFAULT_WAIT_S)


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    run_id: str | None
    token: str

    @classmethod
    def here(cls) -> Owner:
        return cls(socket.gethostname(), os.getpid(), current_run_id.get(), uuid.uuid4().hex)

    def describe(self) -> str:
        run = f"run {self.run_id} " if self.run_id else ""
        return f"{run}(host {self.host}, pid {self.pid})"


@dataclass(frozen=True)
class LeaseBody:
    name: str
    owner: Owner
    taken_at: float
    expires_at: float
    # The holder's `process_keys.process_key`, beside `owner` so that a reader of an older
    # release (which builds `Owner` from every key it finds) still decodes the lease.
    process: str | None = None

    def encode(self) -> bytes:
        return json.dumps({"name": self.name, "owner": self.owner.__dict__,
                           "taken_at": self.taken_at, "expires_at": self.expires_at,
                           "process": self.process}, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> LeaseBody:
        raw = json.loads(data)
        return cls(raw["name"], Owner(**raw["owner"]), float(raw["taken_at"]),
                   float(raw["expires_at"]), raw.get("process"))

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires_at

    def describe(self) -> str:
        until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.expires_at))
        return f"{self.owner.describe()}, expires {until}"


# ------------------------------------------------------------------ where a lease is kept

class LeaseFile(Protocol):
    """One lease's file: atomic create, read with a version tag, compare-and-swap."""

    def create(self, data: bytes) -> str | None:
        """Write `data` if no lease file exists; its tag, or None if one exists."""

    def read(self) -> tuple[bytes, str] | None:
        """The bytes and tag, or None if absent."""

    def replace(self, data: bytes, tag: str) -> str | None:
        """Write `data` if the file is still at `tag`; the new tag, or None if not."""

    def remove(self, tag: str, expired: bytes) -> bool:
        """Remove the file if still at `tag` (on S3: replace it by `expired`, a copy of the
        lease that has expired)."""


def _tag(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class LocalLeaseFile:
    """A lease on a local (or shared POSIX) disk. Create is `O_EXCL`; replace and remove
    compare the bytes under an `flock` of `<name>.lock`, held only for that step (a killed
    process drops it)."""

    path: Path

    def create(self, data: bytes) -> str | None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return None
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        sync_folder(self.path.parent)
        return _tag(data)

    def read(self) -> tuple[bytes, str] | None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        return data, _tag(data)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def replace(self, data: bytes, tag: str) -> str | None:
        with self._locked():
            current = self.read()
            if current is None or current[1] != tag:
                return None
            Location(str(self.path)).write_bytes(data)  # temp file, fsync, rename, fsync dir
            return _tag(data)

    def remove(self, tag: str, expired: bytes) -> bool:
        with self._locked():
            current = self.read()
            if current is None or current[1] != tag:
                return False
            self.path.unlink()
            sync_folder(self.path.parent)
            return True


@functools.lru_cache(maxsize=8)
def _client(settings: StoreSettings):
    from prx_assets.storage.object_store import lease_client

    return lease_client(settings)


@dataclass(frozen=True)
class S3LeaseFile:
    """A lease object on S3: `If-None-Match: *` creates, `If-Match: <etag>` replaces. A
    removed lease is replaced by an expired one (a conditional delete is not implemented by
    every server); an expired lease is free to take."""

    bucket: str
    key: str
    settings: StoreSettings

    def _put(self, data: bytes, **condition: str) -> str | None:
        import botocore.exceptions as bx

        try:
            answer = _client(self.settings).put_object(Bucket=self.bucket, Key=self.key,
                                                       Body=data, **condition)
        except bx.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            # 412: the condition failed; 409: a concurrent conditional write won.
            if code in ("PreconditionFailed", "ConditionalRequestConflict") \
                    or status in (409, 412):
                return None
            raise
        return str(answer["ETag"])

    def create(self, data: bytes) -> str | None:
        return self._put(data, IfNoneMatch="*")

    def read(self) -> tuple[bytes, str] | None:
        import botocore.exceptions as bx

        try:
            answer = _client(self.settings).get_object(Bucket=self.bucket, Key=self.key)
        except bx.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise
        return answer["Body"].read(), str(answer["ETag"])

    def replace(self, data: bytes, tag: str) -> str | None:
        return self._put(data, IfMatch=tag)

    def remove(self, tag: str, expired: bytes) -> bool:
        return self.replace(expired, tag) is not None


def lease_file(location: Location) -> LeaseFile:
    if location.is_local:
        return LocalLeaseFile(location.path)
    _, bucket, key = split_uri(location.uri)
    assert location.settings is not None  # an s3:// Location made by a Storage has them
    return S3LeaseFile(bucket, key, location.settings)


# ------------------------------------------------------------------ the lease

@dataclass
class Lease:
    """An exclusive lease on `location` (a `.json` file under `leases/`). Use as a context
    manager: taken (waiting up to `wait_s` for a live holder, taking over an expired one),
    renewed every third of `ttl_s` by a heartbeat thread, released at the end."""

    location: Location
    ttl_s: float = field(default_factory=default_ttl)
    wait_s: float = field(default_factory=default_wait)
    poll_s: float = 0.2
    log: Callable[[str], None] = logger.info
    owner: Owner = field(default_factory=Owner.here)
    process: str | None = field(default_factory=process_key)  # the owner's, from /proc
    _file: LeaseFile | None = field(default=None, init=False, repr=False)
    _tag: str | None = field(default=None, init=False, repr=False)
    _body: LeaseBody | None = field(default=None, init=False, repr=False)
    _lost: str | None = field(default=None, init=False, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)

    @property
    def name(self) -> str:
        return self.location.uri

    def _new_body(self, taken_at: float | None = None) -> LeaseBody:
        now = time.time()
        return LeaseBody(self.name, self.owner, taken_at or now, now + self.ttl_s,
                         self.process)

    def acquire(self) -> Lease:
        """Take the lease; LeaseHeldError naming the holder after `wait_s`."""
        self._file = lease_file(self.location)
        started = time.monotonic()
        waited_on: str | None = None
        while True:
            body = self._new_body()
            tag = self._file.create(body.encode())
            if tag is None:
                current = self._file.read()
                if current is None:
                    continue  # released between our create and read
                holder = LeaseBody.decode(current[0])
                expired = holder.expired()
                if expired or gone(holder.process):
                    tag = self._file.replace(body.encode(), current[1])
                    if tag is not None and holder.expires_at > 0:
                        why = ("expired: the holder stopped renewing" if expired else
                               "its process is gone from this machine")
                        self.log(f"lease {self.name}: took over from {holder.describe()} "
                                 f"({why})")
            if tag is not None:
                self._tag, self._body = tag, body
                return self
            if time.monotonic() - started >= self.wait_s:
                raise LeaseHeldError(
                    f"lease {self.name} is held by {holder.describe()}; waited "
                    f"{self.wait_s:.0f} s (PRX_LEASE_WAIT_S). Wait for that run to finish, or "
                    "stop it; a killed holder's lease expires on its own")
            if waited_on != holder.owner.token:
                waited_on = holder.owner.token
                self.log(f"lease {self.name}: waiting for {holder.describe()}")
                failpoint("leases.waiting")
            time.sleep(self.poll_s)

    def renew(self) -> None:
        """Push the expiry forward; marks the lease lost if someone else holds it now."""
        assert self._file is not None and self._tag is not None and self._body is not None
        if self._body.expired():
            self._lost = f"expired at {self._body.expires_at:.0f} before it was renewed"
            return
        body = self._new_body(self._body.taken_at)
        tag = self._file.replace(body.encode(), self._tag)
        if tag is None:
            self._lost = "replaced by another owner"
            return
        self._tag, self._body = tag, body

    def check(self) -> None:
        """Raise LeaseLostError unless this process still holds the lease (before a
        commit that only the holder may make)."""
        if self._lost is None and self._body is not None and self._body.expired():
            self._lost = "expired (heartbeat did not renew it in time)"
        if self._lost is not None:
            raise LeaseLostError(f"lease {self.name} lost: {self._lost}; nothing committed")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._file is not None and self._tag is not None and self._body is not None \
                and self._lost is None:
            body = self._body
            self._file.remove(self._tag, LeaseBody(body.name, body.owner, body.taken_at,
                                                   0.0).encode())
        self._tag = None

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.renew()
            except Exception as exc:  # a store hiccup: the next beat retries before expiry
                self.log(f"lease {self.name}: renewal failed ({exc}); retrying")
            if self._lost is not None:
                self.log(f"lease {self.name} lost: {self._lost}")
                return

    def __enter__(self) -> Lease:
        self.acquire()
        self._thread = threading.Thread(target=self._heartbeat, daemon=True,
                                        name=f"lease-heartbeat {self.location.name}")
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def leases_root(data_root: Location) -> Location:
    return data_root / LEASES_DIR


def writer_lease(data_root: Location, asset: str, source: str, **kwargs) -> Lease:
    """The lease of one writer of (asset, source)."""
    return Lease(leases_root(data_root) / "writers" / asset / f"{source}.json", **kwargs)


def tree_lease(data_root: Location, source: str, **kwargs) -> Lease:
    """The lease of one writer of a source's MDS tree (mds_shards, skip_lists, a rewrite)."""
    return Lease(leases_root(data_root) / "trees" / f"{source}.json", **kwargs)


# ------------------------------------------------------------------ reader leases

@dataclass(frozen=True)
class ReaderLease:
    """A reader's hold on one tree version: the tree is not removed before `expires_at`."""

    location: Location
    source: str
    version: str
    expires_at: float

    @property
    def lease_id(self) -> str:
        return self.location.name.removesuffix(".json")

    def renewed(self, seconds: float) -> ReaderLease:
        body = _reader_body(self.source, self.version, time.time() + seconds)
        self.location.write_bytes(body)
        return ReaderLease(self.location, self.source, self.version, time.time() + seconds)

    def release(self) -> None:
        self.location.delete()


def _reader_body(source: str, version: str, expires_at: float) -> bytes:
    owner = Owner.here()
    return json.dumps({"source": source, "version": version, "expires_at": expires_at,
                       "owner": {**owner.__dict__, "token": None}}, sort_keys=True).encode()


def readers_dir(data_root: Location, source: str) -> Location:
    return leases_root(data_root) / "readers" / source


def take_reader_lease(data_root: Location, source: str, version: str, seconds: float
                      ) -> ReaderLease:
    """A new reader lease on `source`'s tree `version` for `seconds` (its own file: readers
    never contend)."""
    location = readers_dir(data_root, source) / version / f"{uuid.uuid4().hex}.json"
    expires_at = time.time() + seconds
    location.write_bytes(_reader_body(source, version, expires_at))
    return ReaderLease(location, source, version, expires_at)


def held_versions(data_root: Location, source: str, now: float | None = None) -> set[str]:
    """Tree versions of `source` that a live reader lease holds; expired lease files are
    removed on the way."""
    now = time.time() if now is None else now
    held = set()
    folder = readers_dir(data_root, source)
    for version in folder.folders():
        for file in (folder / version).files(".json"):
            try:
                expires_at = float(json.loads(file.read_text())["expires_at"])
            except FileNotFoundError:
                continue
            if expires_at > now:
                held.add(version)
            else:
                file.delete()
    return held


class ReaderLeaseKeeper:
    """Renews reader leases from a daemon thread while a loader streams; dropped (not
    renewed) in a copy sent to a worker process: the process that made it renews."""

    def __init__(self, leases: list[ReaderLease], ttl_s: float = READER_TTL_S):
        self.leases, self.ttl_s = leases, ttl_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="reader-leases")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.leases = [lease.renewed(self.ttl_s) for lease in self.leases]
            except Exception as exc:  # retried on the next beat, well before expiry
                logger.warning(f"renewing reader leases failed ({exc}); retrying")

    def release(self) -> None:
        self._stop.set()
        for lease in self.leases:
            lease.release()

    def __getstate__(self) -> dict:
        return {"leases": self.leases, "ttl_s": self.ttl_s}

    def __setstate__(self, state: dict) -> None:
        self.leases, self.ttl_s = state["leases"], state["ttl_s"]
        self._stop = threading.Event()
        self._stop.set()  # a worker's copy: the parent renews
