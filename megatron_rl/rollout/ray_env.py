"""Ray's single-machine switch, which must be decided before Ray is imported (this module imports no Ray).

`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` chooses between a single-machine setup, whose GCS, raylet and workers listen
on loopback, and cluster mode, which binds them to every interface even for `ray.init()` on one machine
(measured: Ray 2.60 started by `ray.init(_node_ip_address='127.0.0.1')` listens on `*`). Ray reads it once, when
it is imported (`ray._private.ray_constants.ENABLE_RAY_CLUSTER`), and the processes it starts inherit it.
"""

from __future__ import annotations

import os

LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""The environment variable of the switch ("0": loopback only)."""


def prefer_loopback_ray() -> None:
    """Make a local Ray started later in this process (and its workers) listen on loopback only. Call it before
    `ray` (or a module that imports it) is first imported: entry points do (the CLI, the benchmarks, the tests).
    Not for processes that join a multi-node cluster: their addresses must be routable."""
    os.environ.setdefault(LOCAL_ONLY_ENV, "0")
