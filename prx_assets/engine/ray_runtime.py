"""Starting and joining Ray: embedded and local by default, a cluster when RAY_ADDRESS is set."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import ray
import ray.data

from prx_assets.engine.progress import quiet_ray_data
from prx_assets.engine.redact import credential_names
from prx_assets.storage import failpoints

LOOPBACK = "127.0.0.1"
# The embedded object store: this much per CPU, at least the floor, at most Ray's own
# default share of memory. Ray's default (30 % of RAM) let a partition's raw images sit in
# shared memory ahead of the image stage, so the process tree's footprint grew with the
# source; Ray Data backpressures its reads against what the store holds.
OBJECT_STORE_PER_CPU = 1 << 30
OBJECT_STORE_FLOOR = 2 << 30
OBJECT_STORE_RAM_SHARE = 0.3
# glibc keeps freed memory of a worker that decoded a large image (its mmap threshold grows
# with every large free), so idle workers held gigabytes between stages. A fixed threshold
# sends buffers above it to mmap, returned to the system when freed.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(32 << 20)}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def connect(address: str | None = None, num_cpus: int | None = None,
            object_store_mb: int | None = None) -> bool:
    """Initialise Ray once per process; returns True when this call started it.

    An already-initialised Ray (a test session, a notebook) is reused and left running.
    Ray Data's own progress dumps are turned off here: stages report their own line.
    """
    quiet_ray_data()
    if ray.is_initialized():
        configure_ray_data()
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    os.environ.setdefault("LANCE_LOG", "error")  # "creating a new dataset" is not a warning
    # Workers of a cluster do not inherit this process's environment (embedded ones do).
    runtime_env = {"env_vars": {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
                                "LANCE_LOG": os.environ["LANCE_LOG"], **MALLOC_ENV,
                                **failpoints.forwarded_env()}}
    return_freed_memory()
    if address:
        ray.init(address=address, _node_ip_address=LOOPBACK if _is_local(address) else None,
                 logging_level=logging.WARNING, runtime_env=runtime_env)
    else:
        with credentials_withheld():
            ray.init(
                num_cpus=num_cpus,
                object_store_memory=(object_store_mb * (1 << 20) if object_store_mb
                                     else default_object_store_bytes(num_cpus)),
                _node_ip_address=LOOPBACK,
                include_dashboard=False,
                logging_level=logging.WARNING,
                runtime_env=runtime_env,
            )
    configure_ray_data()
    start_ray_data()
    return True


# The thread starting Ray Data in the background (`start_ray_data`), until it is joined.
_ray_data_start: threading.Thread | None = None


def start_ray_data() -> threading.Thread:
    """Ray Data's first execution in a process waits for its own actors (stats, autoscaling
    coordinator, locations) and a worker to start: 3-10 s alone on 2 cores, 30 s loaded,
    paid inside the run's first stage. A one-row dataset run on a daemon thread starts them
    while the caller goes on (building the Dagster definitions, listing the first source);
    every later dataset of the process finds them. Failures are the first stage's to meet:
    this thread ignores them."""
    global _ray_data_start
    _ray_data_start = threading.Thread(target=_run_one_row, name="ray-data-start",
                                       daemon=True)
    _ray_data_start.start()
    return _ray_data_start


def _run_one_row() -> None:
    try:
        # No CPU asked (the rows are made here, the map needs none): a stage's pool may
        # hold every CPU by the time this runs, and Ray Data warns of a task that cannot
        # be scheduled.
        ray.data.from_items([{"id": 0}]).map_batches(_same, batch_format="pyarrow",
                                                     num_cpus=0).take_all()
    except Exception:  # a warm-up only: the stages meet and report Ray's errors
        logging.getLogger(__name__).debug("Ray Data's background start failed", exc_info=True)


def _same(batch):
    return batch


@contextmanager
def credentials_withheld() -> Iterator[None]:
    """The credential variables out of this process's environment while embedded Ray starts:
    its raylet, and every worker the raylet starts, inherit the environment of that moment,
    and a worker's environment dump showed OPENAI_API_KEY and AWS_* keys. Workers need none:
    Lance and object-store clients get credentials as resolved options (`TableRef`,
    `Location`), the captioner its key in its spec."""
    withheld = {name: os.environ.pop(name) for name in credential_names()}
    try:
        yield
    finally:
        os.environ.update(withheld)


# Read output blocks a dataset should have at least, per CPU of the cluster. Ray Data's
# default (200 whatever the cluster) split each batch of a one-fragment table into 200
# blocks of a row or none: thousands of objects and tasks, and the driver's scheduling loop
# spent 9 of a thumbnail stage's 30 CPU-seconds on them.
READ_BLOCKS_PER_CPU = 2
# The largest block Ray Data makes (default 128 MB): 400 raw images per block made one
# decoding task of a minute and held 128 MB in a read worker at a time. Small blocks keep
# tasks short on every stage and each worker's working set small.
MAX_BLOCK_BYTES = 16 << 20


def configure_ray_data() -> None:
    """This process's Ray Data block sizes: the minimum of read blocks from the cluster's
    CPUs, and MAX_BLOCK_BYTES."""
    context = ray.data.DataContext.get_current()
    cpus = int(ray.cluster_resources().get("CPU", 1))
    context.read_op_min_num_blocks = max(2, READ_BLOCKS_PER_CPU * cpus)
    context.target_max_block_size = MAX_BLOCK_BYTES
def default_object_store_bytes(num_cpus: int | None = None,
                               memory_bytes: int | None = None) -> int:
    """The embedded object store's size: OBJECT_STORE_PER_CPU per CPU, at least the floor,
    at most Ray's default share of the machine's memory."""
    cpus = num_cpus or os.cpu_count() or 1
    memory = memory_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    wanted = max(OBJECT_STORE_FLOOR, cpus * OBJECT_STORE_PER_CPU)
    return int(min(wanted, OBJECT_STORE_RAM_SHARE * memory))


def return_freed_memory() -> None:
    """The driver's side of MALLOC_ENV (its allocator started before us): large buffers go
    to mmap and back to the system when freed. A no-op where libc has no mallopt."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    libc.mallopt(_M_TRIM_THRESHOLD, 32 << 20)


def _is_local(address: str) -> bool:
    return address == "auto" or LOOPBACK in address or "localhost" in address


def disconnect() -> None:
    global _ray_data_start
    if _ray_data_start is not None:  # not shut down under the background start
        _ray_data_start.join()
        _ray_data_start = None
    if ray.is_initialized():
        ray.shutdown()
