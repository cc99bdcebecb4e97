"""Several processes (``jax.distributed``): every process runs the same plan.

In JAX's multi-controller runtime each process calls every ``jit`` and ``device_put`` of
the step, and JAX runs the parts on its own devices. Planning runs on every process too,
but the sharding ILP and the stage search can stop at a time limit, so their results could
differ between processes, and two processes running different programs would wait on each
other's collectives for ever. So process 0's plan and layouts are the ones every process
uses: :func:`agree` sends its bytes to all.
"""

from __future__ import annotations

import jax
import numpy as np


def agree(data: bytes) -> bytes:
    """Process 0's ``data``, on every process (``data`` itself with one process).

    Every process must call this at the same point of the step's planning.
    """
    if jax.process_count() == 1:
        return data
    from jax.experimental import multihost_utils

    size = multihost_utils.broadcast_one_to_all(np.array([len(data)], np.int64))
    buffer = np.zeros(int(size[0]), np.uint8)
    if jax.process_index() == 0:
        buffer[:] = np.frombuffer(data, np.uint8)
    return multihost_utils.broadcast_one_to_all(buffer).tobytes()


def agree_ints(values: list[int]) -> list[int]:
    """Process 0's ``values`` (e.g. the ILP's chosen strategies), on every process."""
    return [int(v) for v in np.frombuffer(agree(np.asarray(values, np.int64).tobytes()), np.int64)]
