"""Measured costs: time compiled candidates on the real devices and cache the results on disk.

The analytic cost model (:mod:`autopar._src.planner`) predicts a stage's time from FLOPs,
bytes and link figures; this module measures it instead. A measurement is keyed by
what determines it: the computation (a hash of its jaxpr), the mesh it runs on, the
input shardings, the device kind and the JAX version (:class:`CostKey`). Results live in
a directory with one JSON file per key (:class:`CostCache`), so a second planning run on
the same machine compiles and runs nothing it has measured before.

Example:
  >>> cache = CostCache(default_cache_dir())
  >>> fn = jax.jit(lambda x: x @ x)
  >>> x = jnp.ones((512, 512))
  >>> key = CostKey(
  ...     jaxpr_hash=hash_jaxpr(jax.make_jaxpr(fn)(x)),
  ...     mesh_shape=(1,),
  ...     axis_names=("data",),
  ...     shardings=("PartitionSpec()",),
  ...     device_kind=jax.devices()[0].device_kind,
  ... )
  >>> seconds = measure(fn, (x,), key=key, cache=cache)  # compiles and times
  >>> seconds == measure(fn, (x,), key=key, cache=cache)  # read back from disk
  True
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeGuard

import jax

CACHE_DIR_ENV = "AUTOPAR_CACHE_DIR"
"""Environment variable that overrides the default cache directory."""

# A reading below the timer's resolution is noise; flooring it keeps cache entries positive.
_MIN_SECONDS = 1e-9

_KEY_FIELDS = ("jaxpr_hash", "mesh_shape", "axis_names", "shardings", "device_kind", "jax_version")


class CostCacheWarning(UserWarning):
    """A cache file could not be used (unreadable, another key, an invalid time); it counts as a miss."""


def hash_jaxpr(closed_jaxpr: Any) -> str:
    """A stable hash of a jaxpr's text: the hex SHA-256 of ``str(closed_jaxpr)``.

    Variable names are assigned when the jaxpr is printed, so the same computation
    traced in two processes gives the same hash.
    """
    return hashlib.sha256(str(closed_jaxpr).encode("utf-8")).hexdigest()


def default_cache_dir() -> pathlib.Path:
    """``$AUTOPAR_CACHE_DIR`` if set and non-empty, else ``~/.cache/autopar/costs`` (read at each call)."""
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return pathlib.Path(override).expanduser()
    return pathlib.Path.home() / ".cache" / "autopar" / "costs"


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostKey:
    """What a measured time depends on; equal keys may share one measurement."""

    jaxpr_hash: str
    """Hash of the measured computation's jaxpr (:func:`hash_jaxpr`)."""
    mesh_shape: tuple[int, ...]
    """Shape of the device mesh the computation runs on."""
    axis_names: tuple[str, ...]
    """Names of the mesh axes, one per entry of ``mesh_shape``."""
    shardings: tuple[str, ...]
    """String forms of the inputs' partition specs, in argument order."""
    device_kind: str
    """``jax.Device.device_kind`` of the mesh's devices."""
    jax_version: str = jax.__version__
    """JAX version the time was measured with (compilers change between versions)."""

    def __post_init__(self) -> None:
        for name in ("jaxpr_hash", "device_kind", "jax_version"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"CostKey.{name} must be a non-empty string, got {value!r}")
        shape = self.mesh_shape
        if not isinstance(shape, tuple) or not all(_is_int(d) and d >= 1 for d in shape):
            raise ValueError(f"CostKey.mesh_shape must be a tuple of ints >= 1, got {shape!r}")
        for name in ("axis_names", "shardings"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(s, str) for s in value):
                raise ValueError(f"CostKey.{name} must be a tuple of strings, got {value!r}")
        if len(self.axis_names) != len(shape):
            raise ValueError(
                f"CostKey.axis_names {self.axis_names!r} must name each of the {len(shape)} axes of "
                f"mesh_shape {shape!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The key as JSON-compatible data (tuples become lists)."""
        return {name: _jsonable(getattr(self, name)) for name in _KEY_FIELDS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostKey:
        """The key written by :meth:`to_dict`.

        Raises:
          ValueError: if a field is missing or has an invalid value.
        """
        missing = [name for name in _KEY_FIELDS if name not in data]
        if missing:
            raise ValueError(f"missing key field(s) {missing}")
        values = {name: data[name] for name in _KEY_FIELDS}
        for name in ("mesh_shape", "axis_names", "shardings"):
            if not isinstance(values[name], list):
                raise ValueError(f"key field {name!r} must be a list, got {values[name]!r}")
            values[name] = tuple(values[name])
        return cls(**values)

    def digest(self) -> str:
        """Hex SHA-256 of the key's canonical JSON; any change to any field changes it."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


@dataclasses.dataclass(kw_only=True)
class CacheStats:
    """Counters of one :class:`CostCache` (mutable: they count as the cache is used)."""

    hits: int = 0
    """Lookups answered from a valid file."""
    misses: int = 0
    """Lookups with no usable file (including invalid ones)."""
    invalid: int = 0
    """Files that were found but ignored (each also counts as a miss)."""
    writes: int = 0
    """Entries written."""


class CostCache:
    """Measured seconds on disk, one ``<digest>.json`` file per :class:`CostKey`.

    Files hold the key's fields plus ``seconds`` and ``runs``. They are written to a
    temporary file in the same directory and moved into place with ``os.replace``, so a
    reader never sees half a file. A file that cannot be used (bad JSON, missing
    fields, another key, a time that is not positive and finite) is ignored with a
    :class:`CostCacheWarning`; the next :meth:`put` for its key replaces it.

    The directory is created by the first :meth:`put`.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        if not isinstance(directory, str | os.PathLike):
            raise ValueError(f"CostCache directory must be a path, got {directory!r}")
        self.directory = pathlib.Path(directory)
        self.stats = CacheStats()

    def __repr__(self) -> str:
        return f"CostCache({str(self.directory)!r})"

    def path(self, key: CostKey) -> pathlib.Path:
        """The file that holds ``key``'s entry."""
        return self.directory / f"{key.digest()}.json"

    def get(self, key: CostKey) -> float | None:
        """The cached seconds for ``key``, or None when there is no usable entry."""
        _check_key(key)
        path = self.path(key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            self.stats.misses += 1
            return None
        except OSError as e:
            return self._invalid(path, f"it cannot be read ({e})")
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return self._invalid(path, f"it is not valid JSON ({e})")
        if not isinstance(data, dict):
            return self._invalid(path, f"it holds a {type(data).__name__}, expected a JSON object")
        try:
            stored = CostKey.from_dict(data)
        except (TypeError, ValueError) as e:
            return self._invalid(path, f"its key fields are invalid: {e}")
        if stored != key:
            diff = [n for n in _KEY_FIELDS if getattr(stored, n) != getattr(key, n)]
            return self._invalid(path, f"it is for another key (fields {diff} differ)")
        seconds, runs = data.get("seconds"), data.get("runs")
        if not (isinstance(seconds, int | float) and not isinstance(seconds, bool)):
            return self._invalid(path, f"'seconds' is {seconds!r}, expected a number")
        if not (math.isfinite(seconds) and seconds > 0):
            return self._invalid(path, f"'seconds' is {seconds!r}, expected a positive finite number")
        if not (_is_int(runs) and runs >= 1):
            return self._invalid(path, f"'runs' is {runs!r}, expected an int >= 1")
        self.stats.hits += 1
        return float(seconds)

    def put(self, key: CostKey, seconds: float, runs: int) -> None:
        """Stores ``seconds`` (the median of ``runs`` timed runs) for ``key``, atomically.

        Raises:
          ValueError: if ``seconds`` is not positive and finite or ``runs`` is not an int >= 1.
        """
        _check_key(key)
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise ValueError(f"CostCache.put: seconds must be a number, got {seconds!r}")
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"CostCache.put: seconds must be positive and finite, got {seconds!r}")
        if not (_is_int(runs) and runs >= 1):
            raise ValueError(f"CostCache.put: runs must be an int >= 1, got {runs!r}")
        entry = {**key.to_dict(), "seconds": float(seconds), "runs": runs}
        text = json.dumps(entry, indent=1, sort_keys=True) + "\n"
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.path(key)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{target.stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                # mkstemp makes the file private to its owner; cache entries are ordinary readable files.
                os.fchmod(f.fileno(), 0o644)
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self.stats.writes += 1

    def _invalid(self, path: pathlib.Path, why: str) -> float | None:
        """Counts and warns of an unusable entry; None, as for a miss."""
        self.stats.invalid += 1
        self.stats.misses += 1
        warnings.warn(
            f"Ignoring cost cache file {str(path)!r}: {why}. It is treated as a miss and will be "
            "overwritten by the next measurement of its key.",
            CostCacheWarning,
            stacklevel=3,
        )
        return None


def _check_key(key: Any) -> None:
    if not isinstance(key, CostKey):
        raise ValueError(f"key must be a CostKey, got {type(key).__name__}: {key!r}")


def _check_counts(warmup: int, runs: int) -> None:
    if not (_is_int(warmup) and warmup >= 0):
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if not (_is_int(runs) and runs >= 1):
        raise ValueError(f"runs must be an int >= 1, got {runs!r}")


def time_callable(fn: Callable[..., Any], args: Sequence[Any], *, warmup: int = 2, runs: int = 5) -> float:
    """Median seconds of ``jax.block_until_ready(fn(*args))`` over ``runs`` calls after ``warmup`` calls.

    ``fn`` is called ``warmup + runs`` times on the same arguments, so it must not
    donate them.

    Raises:
      ValueError: if ``warmup < 0`` or ``runs < 1``.
    """
    _check_counts(warmup, runs)
    args = tuple(args)
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    key: CostKey,
    cache: CostCache | None,
    warmup: int = 2,
    runs: int = 5,
    compile_counter: list[str] | None = None,
) -> float:
    """Seconds per call of ``fn(*args)``: from ``cache`` if it holds ``key``, else measured and stored.

    On a hit nothing is compiled or run. On a miss a jitted ``fn`` (one with ``.lower``)
    is lowered and compiled once, outside the timing, and the compiled executable is
    timed with :func:`time_callable`; any other callable (e.g. an ``autoparallel`` step)
    is timed directly, its warm-up calls absorbing compilation. The median is written to
    ``cache`` (when given) and returned.

    Args:
      fn: the computation, jitted or any callable of ``args``; it must not donate them.
      args: its arguments.
      key: what the time depends on (see :class:`CostKey`).
      cache: where to look up and store the time; None always measures.
      warmup: untimed calls before the timed ones.
      runs: timed calls; their median is the result.
      compile_counter: if given, ``key.digest()`` is appended each time ``fn`` is
        compiled and timed (so tests can check that a cached call did neither).

    Raises:
      ValueError: for a key that is not a :class:`CostKey` or invalid ``warmup``/``runs``.
    """
    _check_key(key)
    _check_counts(warmup, runs)
    if cache is not None:
        cached = cache.get(key)
        if cached is not None:
            return cached
    args = tuple(args)
    if compile_counter is not None:
        compile_counter.append(key.digest())
    lower = getattr(fn, "lower", None)
    target = lower(*args).compile() if callable(lower) else fn
    seconds = max(time_callable(target, args, warmup=warmup, runs=runs), _MIN_SECONDS)
    if cache is not None:
        cache.put(key, seconds, runs)
    return seconds


@contextlib.contextmanager
def _progress_bar(enabled: bool, total: int) -> Iterator[Callable[[str | None], None]]:
    if not enabled:
        yield lambda _label: None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("measuring", total=total)

        def step(label: str | None) -> None:
            if label is None:
                bar.advance(task)
            else:
                bar.update(task, description=f"measuring {label}")

        yield step


def measure_many(
    items: Sequence[tuple[str, Callable[..., Any], Sequence[Any], CostKey]],
    cache: CostCache | None,
    progress: bool = True,
    *,
    warmup: int = 2,
    runs: int = 5,
    compile_counter: list[str] | None = None,
) -> list[float]:
    """:func:`measure` of each ``(label, fn, args, key)`` in turn, one at a time, under a progress bar.

    Candidates run one after another, never concurrently, so they do not share the
    devices or the host's cores while being timed.

    Returns:
      Seconds per call of each item, in order.
    """
    items = list(items)
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 4):
            raise ValueError(f"measure_many: item {i} must be (label, fn, args, key), got {item!r}")
    results = []
    with _progress_bar(progress, len(items)) as step:
        for label, fn, args, key in items:
            step(str(label))
            results.append(
                measure(
                    fn, args, key=key, cache=cache, warmup=warmup, runs=runs, compile_counter=compile_counter
                )
            )
            step(None)
    return results
