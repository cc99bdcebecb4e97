"""Measured costs: the on-disk cache answers repeated measurements and survives bad files."""

import dataclasses
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import pytest

from autopar._src import measure as measure_mod
from autopar._src.measure import (
    CostCache,
    CostCacheWarning,
    CostKey,
    default_cache_dir,
    hash_jaxpr,
    measure,
    measure_many,
    time_callable,
)


def _matmul(x):
    return jnp.tanh(x @ x)


@pytest.fixture
def x():
    return jnp.full((64, 64), 0.5, jnp.float32)


def _key(x, **overrides) -> CostKey:
    fields = dict(
        jaxpr_hash=hash_jaxpr(jax.make_jaxpr(_matmul)(x)),
        mesh_shape=(1,),
        axis_names=("data",),
        shardings=("PartitionSpec()",),
        device_kind=jax.devices()[0].device_kind,
    )
    return CostKey(**{**fields, **overrides})


class Counted:
    """A jitted function that counts its calls and lowerings."""

    def __init__(self, fn):
        self.jitted = jax.jit(fn)
        self.calls = 0
        self.lowerings = 0

    def __call__(self, *args):
        self.calls += 1
        return self.jitted(*args)

    def lower(self, *args):
        self.lowerings += 1
        return self.jitted.lower(*args)


def test_second_measurement_is_a_cache_hit_without_compiling_or_running(tmp_path, x):
    key = _key(x)
    fn = Counted(_matmul)
    compiled: list[str] = []
    cache = CostCache(tmp_path)
    first = measure(fn, (x,), key=key, cache=cache, warmup=1, runs=3, compile_counter=compiled)
    assert first > 0
    assert compiled == [key.digest()] and fn.lowerings == 1
    assert cache.stats.misses == 1 and cache.stats.hits == 0 and cache.stats.writes == 1
    entry = json.loads((tmp_path / f"{key.digest()}.json").read_text())
    assert entry["seconds"] == first and entry["runs"] == 3
    assert CostKey.from_dict(entry) == key

    calls, lowerings = fn.calls, fn.lowerings
    # A fresh cache object over the same directory stands for a second planning run.
    again = CostCache(tmp_path)
    second = measure(fn, (x,), key=key, cache=again, warmup=1, runs=3, compile_counter=compiled)
    assert second == first
    assert compiled == [key.digest()]
    assert (fn.calls, fn.lowerings) == (calls, lowerings)
    assert again.stats.hits == 1 and again.stats.misses == 0 and again.stats.writes == 0


def test_plain_callables_are_timed_directly(tmp_path, x):
    calls = []
    jitted = jax.jit(_matmul)

    def step(a):
        calls.append(1)
        return jitted(a)

    cache = CostCache(tmp_path)
    key = _key(x)
    assert measure(step, (x,), key=key, cache=cache, warmup=2, runs=3) > 0
    assert len(calls) == 5
    assert measure(step, (x,), key=key, cache=cache, warmup=2, runs=3) == cache.get(key)
    assert len(calls) == 5
    # Without a cache every call measures.
    measure(step, (x,), key=key, cache=None, warmup=0, runs=1)
    assert len(calls) == 6


def _valid_entry(key: CostKey, seconds: float = 0.25) -> str:
    return json.dumps({**key.to_dict(), "seconds": seconds, "runs": 5})


@pytest.mark.parametrize(
    ("label", "content", "reason"),
    [
        ("garbage", b"\x00\xff\xfe not json at all {", "not valid JSON"),
        ("another key", "other-key", "another key"),
        ("negative seconds", "negative", "positive finite"),
        ("infinite seconds", "infinite", "positive finite"),
        ("missing fields", json.dumps({"seconds": 1.0, "runs": 1}).encode(), "missing key field"),
        ("a list", b"[1, 2, 3]", "expected a JSON object"),
    ],
)
def test_bad_cache_files_are_ignored_with_a_warning_and_replaced(tmp_path, x, label, content, reason):
    key = _key(x)
    if content == "other-key":
        content = _valid_entry(dataclasses.replace(key, mesh_shape=(2,), axis_names=("data",))).encode()
    elif content == "negative":
        content = _valid_entry(key, seconds=-1.0).encode()
    elif content == "infinite":
        content = json.dumps({**key.to_dict(), "seconds": float("inf"), "runs": 5}).encode()
    cache = CostCache(tmp_path)
    path = cache.path(key)
    path.write_bytes(content)

    fn = Counted(_matmul)
    with pytest.warns(CostCacheWarning, match=reason) as record:
        seconds = measure(fn, (x,), key=key, cache=cache, warmup=0, runs=1)
    assert str(path) in str(record[0].message)
    assert fn.lowerings == 1 and cache.stats.invalid == 1 and cache.stats.writes == 1
    # The bad file was overwritten by the measurement: the next lookup is a silent hit.
    assert cache.get(key) == seconds and cache.stats.hits == 1
    assert json.loads(path.read_text())["seconds"] == seconds


def test_put_rejects_invalid_times(tmp_path, x):
    cache = CostCache(tmp_path)
    for seconds in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="seconds"):
            cache.put(_key(x), seconds, 1)
    with pytest.raises(ValueError, match="runs"):
        cache.put(_key(x), 1.0, 0)
    assert not list(tmp_path.iterdir())


def test_digest_changes_when_any_field_changes(x):
    key = _key(x)
    assert key.digest() == _key(x).digest()
    changed = [
        dict(jaxpr_hash=hash_jaxpr(jax.make_jaxpr(lambda a: a @ a)(x))),
        dict(mesh_shape=(2,)),
        dict(mesh_shape=(1, 1), axis_names=("data", "model")),
        dict(axis_names=("model",)),
        dict(shardings=("PartitionSpec('data',)",)),
        dict(shardings=()),
        dict(device_kind="another device"),
        dict(jax_version="0.0.1"),
    ]
    digests = {key.digest()} | {dataclasses.replace(key, **c).digest() for c in changed}
    assert len(digests) == len(changed) + 1


def test_hash_jaxpr_is_stable_and_distinguishes_computations(x):
    assert hash_jaxpr(jax.make_jaxpr(_matmul)(x)) == hash_jaxpr(jax.make_jaxpr(_matmul)(x))
    assert hash_jaxpr(jax.make_jaxpr(_matmul)(x)) != hash_jaxpr(jax.make_jaxpr(_matmul)(x[:32, :32]))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(jaxpr_hash=""), "jaxpr_hash"),
        (dict(mesh_shape=(0,)), "mesh_shape"),
        (dict(mesh_shape=[1]), "mesh_shape"),
        (dict(axis_names=("a", "b")), "axis_names"),
        (dict(shardings=(None,)), "shardings"),
        (dict(device_kind=3), "device_kind"),
    ],
)
def test_invalid_keys_are_rejected_naming_the_field(x, overrides, field):
    with pytest.raises(ValueError, match=field):
        _key(x, **overrides)


def test_writes_are_atomic_and_leave_no_temporary_files(tmp_path, x, monkeypatch):
    cache = CostCache(tmp_path / "nested" / "dir")
    keys = [_key(x, mesh_shape=(n,)) for n in (1, 2, 4)]
    for i, key in enumerate(keys):
        cache.put(key, 0.1 * (i + 1), 3)
        cache.put(key, 0.2 * (i + 1), 3)
    names = sorted(p.name for p in cache.directory.iterdir())
    assert names == sorted(f"{k.digest()}.json" for k in keys)

    # A write that fails half-way leaves the old entry intact and no temporary file.
    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(measure_mod.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        cache.put(keys[0], 9.0, 1)
    monkeypatch.undo()
    assert sorted(p.name for p in cache.directory.iterdir()) == names
    assert cache.get(keys[0]) == pytest.approx(0.2)


def test_default_dir_honours_the_environment_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "costs"))
    assert default_cache_dir() == tmp_path / "costs"
    monkeypatch.delenv("AUTOPAR_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == pathlib.Path(tmp_path / "home" / ".cache" / "autopar" / "costs")


def test_get_on_a_missing_directory_is_a_miss(tmp_path, x):
    cache = CostCache(tmp_path / "does-not-exist")
    assert cache.get(_key(x)) is None
    assert cache.stats.misses == 1
    assert not os.path.exists(cache.directory)


def test_time_callable_and_argument_checks(x):
    fn = jax.jit(_matmul)
    assert time_callable(fn, (x,), warmup=0, runs=1) > 0
    with pytest.raises(ValueError, match="runs"):
        time_callable(fn, (x,), runs=0)
    with pytest.raises(ValueError, match="warmup"):
        time_callable(fn, (x,), warmup=-1)
    with pytest.raises(ValueError, match="key"):
        measure(fn, (x,), key="not a key", cache=None)


def test_measure_many_measures_each_candidate_once(tmp_path, x):
    cache = CostCache(tmp_path)
    fns = [Counted(_matmul), Counted(lambda a: a + 1.0)]
    items = [
        ("matmul", fns[0], (x,), _key(x)),
        ("add", fns[1], (x,), _key(x, jaxpr_hash=hash_jaxpr(jax.make_jaxpr(lambda a: a + 1.0)(x)))),
    ]
    compiled: list[str] = []
    first = measure_many(items, cache, progress=True, warmup=0, runs=1, compile_counter=compiled)
    assert len(first) == 2 and all(s > 0 for s in first) and len(compiled) == 2
    second = measure_many(items, cache, progress=False, compile_counter=compiled)
    assert second == first and len(compiled) == 2
    assert [f.lowerings for f in fns] == [1, 1]
    with pytest.raises(ValueError, match="item 0"):
        measure_many([("only a label",)], cache, progress=False)
