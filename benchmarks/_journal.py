"""A JSON-lines journal of planned jobs, and the pool that plans them.

Every result is appended to the journal as soon as it is made (one write of one line, so
parallel processes append whole records), and jobs already in it are read back instead of
planned again: a long run that stops resumes where it stopped.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

Task = tuple[tuple[Any, ...], dict[str, Any]]
"""A job (positional identity) and its options (keyword arguments)."""


def key(task: Task) -> str:
    """The journal key of ``task``: its job and options as JSON."""
    job, options = task
    return json.dumps([list(job), {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}])


def read(path: str | None) -> dict[str, Any]:
    """Journal key -> result, of every job in the journal at ``path`` (empty if there is none)."""
    if path is None or not os.path.exists(path):
        return {}
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {r["key"]: r["cell"] for r in records}


def _call(task: Task, *, fn: Callable[..., Any], journal: str | None, done: dict[str, Any]) -> Any:
    """``fn(*job, **options)``, read back from ``done`` or computed and appended to ``journal``."""
    k = key(task)
    if k in done:
        return done[k]
    job, options = task
    result = fn(*job, **options)
    if journal is not None:
        fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps({"key": k, "cell": result}) + "\n").encode())
        finally:
            os.close(fd)
    return result


def run(
    fn: Callable[..., Any],
    tasks: Sequence[Task],
    *,
    journal: str | None,
    done: dict[str, Any],
    processes: int = 1,
    initializer: Callable[..., None] | None = None,
    initargs: tuple[Any, ...] = (),
) -> Iterator[tuple[Task, Any]]:
    """``(task, fn(*job, **options))`` for every task, in order, as results arrive.

    Tasks whose key is in ``done`` (:func:`read` of ``journal``) are read back, not run.
    With ``processes > 1`` the tasks run in that many spawned processes, each started with
    ``initializer(*initargs)``; ``fn`` must then be a module-level function.
    """
    if journal is not None:  # before any planning: the first result appends to it
        os.makedirs(os.path.dirname(os.path.abspath(journal)), exist_ok=True)
    call = functools.partial(_call, fn=fn, journal=journal, done=done)
    with (
        concurrent.futures.ProcessPoolExecutor(
            processes,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=initializer,
            initargs=initargs,
        )
        if processes > 1
        else contextlib.nullcontext() as pool
    ):
        yield from zip(tasks, pool.map(call, tasks) if pool else map(call, tasks), strict=True)
