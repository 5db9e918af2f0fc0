"""Starting and joining Ray: embedded and local by default, a cluster when RAY_ADDRESS is set."""

from __future__ import annotations

import logging
import os

import ray

from prx_assets.engine import failpoints
from prx_assets.engine.progress import quiet_ray_data

LOOPBACK = "127.0.0.1"


def connect(address: str | None = None, num_cpus: int | None = None,
            object_store_mb: int | None = None) -> bool:
    """Initialise Ray once per process; returns True when this call started it.

    An already-initialised Ray (a test session, a notebook) is reused and left running.
    Ray Data's own progress dumps are turned off here: stages report their own line.
    """
    quiet_ray_data()
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    os.environ.setdefault("LANCE_LOG", "error")  # "creating a new dataset" is not a warning
    # Workers of a cluster do not inherit this process's environment (embedded ones do).
    runtime_env = {"env_vars": {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
                                "LANCE_LOG": os.environ["LANCE_LOG"],
                                **failpoints.forwarded_env()}}
    if address:
        ray.init(address=address, _node_ip_address=LOOPBACK if _is_local(address) else None,
                 logging_level=logging.WARNING, runtime_env=runtime_env)
    else:
        ray.init(
            num_cpus=num_cpus,
            object_store_memory=object_store_mb * (1 << 20) if object_store_mb else None,
            _node_ip_address=LOOPBACK,
            include_dashboard=False,
            logging_level=logging.WARNING,
            runtime_env=runtime_env,
        )
    return True


def _is_local(address: str) -> bool:
    return address == "auto" or LOOPBACK in address or "localhost" in address


def disconnect() -> None:
    if ray.is_initialized():
        ray.shutdown()
