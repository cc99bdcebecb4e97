"""``@autoparallel``: trace, plan, partition, compile and run a train step."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx

from autopar._src import autoplan, build, compat, driver, nnx_support, schedule, static_args, trace
from autopar._src.cluster import ClusterSpec
from autopar._src.options import Options, as_cluster
from autopar._src.plan import Plan


def autoparallel(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    num_microbatches: int | Literal["auto"] = 1,
    num_stages: int | Literal["auto"] = "auto",
    batch_argnums: int | Sequence[int] = (1,),
    devices: Sequence[Any] | None = None,
    schedule: schedule.ScheduleName = "1f1b",
    plan: Plan | None = None,
    donate_argnums: int | Sequence[int] = (),
    cluster: ClusterSpec | str | None = None,
    cost_model: Literal["analytic", "measured"] = "analytic",
    cost_cache: str | None = None,
    sharding: Literal["auto", "data"] = "auto",
    mesh_shape: Sequence[int] | None = None,
    static_argnums: int | Sequence[int] = (),
) -> Any:
    """Runs a single-device train step as a pipeline of sharded stages.

    With ``num_stages="auto"`` the loss is clustered into layers and Alpa's stage
    DP chooses the stages, their submeshes and (with ``num_microbatches="auto"``)
    the number of microbatches, for ``cluster`` (default: a preset matching the
    devices), so that every stage fits its devices' memory. An int ``num_stages``
    splits the loss into that many FLOP-balanced stages on equal submeshes, each a
    ``mesh_shape`` logical mesh (default: all its devices on ``"data"``).

    With ``sharding="auto"`` each stage's layouts come from an ILP over its equations
    (data parallel, Megatron-style tensor parallel over ``"model"``, sharded optimizer
    state when the cluster's memory asks for it); ``sharding="data"`` splits the batch and
    replicates the parameters and optimizer state, and the ILP lays out only the values the
    stages compute (so gradients are still reduced once per step).

    The step must compute its gradient with :func:`autopar.value_and_grad` (or
    :func:`autopar.grad`); the loss is cut into layers, grouped into stages on
    disjoint submeshes, and run per microbatch; everything else runs once per step
    on the accumulated gradients. Results equal ``jax.jit(fn)`` up to float
    rounding (for a loss that is a mean over the batch).

    Example:
      >>> @autopar.autoparallel(num_microbatches=4, num_stages=2)
      ... def train_step(state, batch):
      ...     loss, grads = autopar.value_and_grad(loss_fn)(state.params, batch)
      ...     return state.apply_gradients(grads=grads), loss

    ``donate_argnums`` works as in ``jax.jit``: the buffers of those arguments are
    reused for the outputs (typically the old state for the new one) and must not
    be used after a successful call. Every check runs before anything is
    dispatched, so a call that raises leaves its arguments valid. ``static_argnums`` too:
    those arguments are Python values the step is traced with (hashable; a mode, a flag), and
    each set of their values is planned and compiled once.

    Raises:
      ValueError: for invalid options (here) or arguments (at the first call).
    """
    argnums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
    donated = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    options = Options(
        num_microbatches=num_microbatches,
        num_stages=num_stages,
        batch_argnums=argnums,
        devices=None if devices is None else tuple(devices),
        schedule=schedule,
        plan=plan,
        donate_argnums=donated,
        cluster=cluster,
        cost_model=cost_model,
        cost_cache=cost_cache,
        sharding=sharding,
        mesh_shape=None if mesh_shape is None else tuple(mesh_shape),
        static_argnums=static,
    )
    if fn is None:
        return functools.partial(AutoParallel, options=options)
    return AutoParallel(fn, options=options)


class AutoParallel:
    """A train step wrapped by :func:`autoparallel`; call it like the step."""

    def __init__(self, fn: Callable[..., Any], options: Options) -> None:
        self.fn = fn
        self.options = options
        self._cache: dict[Any, driver.Executable] = {}
        self._pure: dict[Any, AutoParallel] = {}
        """Per NNX objects' positions and graph: the step as a pure function of their state."""
        self._static: dict[Any, AutoParallel] = {}
        """Per static arguments' values: the step as a function of the others."""
        self.by_name = 0
        """How many of the last arguments the step passes on by name (keyword-only)."""
        self._keywords: dict[Any, AutoParallel] = {}
        """Per count of positional arguments and names of those only passed by name: the step
        taking them last by position."""
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        named, positional = self._positional(args, kwargs)
        if named is not self:
            return named(*positional)
        inner, rest, _ = self._static_bound(positional)
        if inner is not self:
            return inner(*rest)
        if nnx_support.object_positions(positional):
            pure, pure_args, objs = self._functional(positional)
            state, out = pure(*pure_args)
            nnx.update(objs, state)
            return out
        leaves, in_tree = jax.tree.flatten(positional)
        exe = self._lookup(leaves, in_tree)
        return jax.tree.unflatten(exe.step.out_tree, _run(exe, leaves))

    def _functional(
        self, positional: tuple[Any, ...]
    ) -> tuple[AutoParallel, tuple[Any, ...], tuple[Any, ...]]:
        """For a step that updates NNX objects among its arguments in place (as under
        ``nnx.jit``): the wrapped pure step over their joint state
        (:func:`nnx_support.functional_step`), its arguments, and the objects to update."""
        positions = nnx_support.object_positions(positional)
        objs = tuple(positional[i] for i in positions)
        graphdef, state = nnx.split(objs)
        key = (positions, graphdef)
        pure = self._pure.get(key)
        if pure is None:
            options = dataclasses.replace(
                self.options,
                batch_argnums=nnx_support.moved_argnums(
                    self.options.batch_argnums, positions, "batch_argnums"
                ),
                donate_argnums=nnx_support.moved_argnums(
                    self.options.donate_argnums, positions, "donate_argnums"
                ),
            )
            pure = self._pure[key] = AutoParallel(
                nnx_support.functional_step(self.fn, positions, graphdef), options
            )
        others = tuple(x for i, x in enumerate(positional) if i not in positions)
        return pure, (state, *others), objs

    def timed(self, *args: Any, **kwargs: Any) -> tuple[Any, dict[tuple[int, str], float]]:
        """Runs one step waiting for every task; returns the outputs and measured times.

        The times are the median seconds of each stage's forward and backward tasks,
        keyed ``(stage, "F" | "B")``, or ``(stage, "F+B")`` where a stage runs each
        microbatch's forward and backward as one task (a one-stage plan, the last stage of
        1F1B); ready for ``plan.timeline(path, task_seconds=...)``. Waiting serialises the
        pipeline, so the step itself is slower than a normal call.
        """
        named, positional = self._positional(args, kwargs)
        if named is not self:
            return named.timed(*positional)
        inner, rest, _ = self._static_bound(positional)
        if inner is not self:
            return inner.timed(*rest)
        if nnx_support.object_positions(positional):
            pure, pure_args, objs = self._functional(positional)
            (state, out), measured = pure.timed(*pure_args)
            nnx.update(objs, state)
            return out, measured
        leaves, in_tree = jax.tree.flatten(positional)
        times: list[float] = []
        exe = self._lookup(leaves, in_tree)
        out = jax.tree.unflatten(exe.step.out_tree, _run(exe, leaves, times))
        per_task: dict[tuple[int, str], list[float]] = {}
        for task, seconds in zip(exe.program.tasks, times, strict=True):
            match = re.fullmatch(r"([FB])\d+\.\d+(\+B\d+\.\d+)?", task.label)
            if match:
                kind = "F+B" if match.group(2) else match.group(1)
                per_task.setdefault((task.stage, kind), []).append(seconds)
        return out, {k: float(np.median(v)) for k, v in per_task.items()}

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan for these arguments, without running the step."""
        return self.executable(*args, **kwargs).plan

    def input_shardings(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Where the step takes each argument leaf, without running it: a tuple of the arguments'
        pytrees (by position) holding, per leaf, the ``NamedSharding`` it is placed with on the
        first stage that reads it, or None for a leaf split into microbatches (the batch) or
        read by no stage. The arguments may be ``jax.ShapeDtypeStruct``s. An NNX object's
        entry is its ``nnx.State``, of shardings.

        A state the step returned is already there. Restoring a checkpoint onto these
        shardings (``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` as the target) puts
        every leaf on its stage's devices directly, rather than on one device first.
        """
        named, positional = self._positional(args, kwargs)
        if named is not self:  # those of the arguments passed by name left out
            return named.input_shardings(*positional)[: len(positional) - named.by_name]
        inner, rest, static = self._static_bound(positional)
        if inner is not self:
            return nnx_support.interleaved([None] * len(static), inner.input_shardings(*rest), static)
        positions = nnx_support.object_positions(positional)
        if positions:  # the objects' shardings as their state (nnx.State) holds them
            pure, pure_args, _ = self._functional(positional)
            state, *others = pure.input_shardings(*pure_args)
            return nnx_support.interleaved(state, others, positions)
        leaves, in_tree = jax.tree.flatten(positional)
        return tuple(jax.tree.unflatten(in_tree, self._lookup(leaves, in_tree).input_shardings()))

    def executable(self, *args: Any, **kwargs: Any) -> driver.Executable:
        """The compiled program for these arguments (for inspection)."""
        named, positional = self._positional(args, kwargs)
        if named is not self:
            return named.executable(*positional)
        inner, rest, _ = self._static_bound(positional)
        if inner is not self:
            return inner.executable(*rest)
        if nnx_support.object_positions(positional):
            pure, pure_args, _ = self._functional(positional)
            return pure.executable(*pure_args)
        return self._executable(positional)

    def _static_bound(
        self, positional: tuple[Any, ...]
    ) -> tuple[AutoParallel, tuple[Any, ...], tuple[int, ...]]:
        """With ``static_argnums``: the wrapped step with the static arguments bound to their
        values (one per set of values), the other arguments, and the static positions;
        otherwise this step and all arguments."""
        if not self.options.static_argnums:
            return self, positional, ()
        n = len(positional)
        static = static_args.positions(self.options.static_argnums, n)
        key = (n, static_args.key(positional, static))
        inner = self._static.get(key)
        if inner is None:
            options = dataclasses.replace(
                self.options,
                static_argnums=(),
                batch_argnums=static_args.moved(self.options.batch_argnums, static, n, "batch_argnums"),
                donate_argnums=static_args.moved(self.options.donate_argnums, static, n, "donate_argnums"),
            )
            inner = self._static[key] = AutoParallel(static_args.bound(self.fn, positional, static), options)
        return inner, static_args.others(positional, static), static

    def _positional(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[AutoParallel, tuple[Any, ...]]:
        """The step to call by position and its arguments (``batch_argnums`` and
        ``donate_argnums`` count positions), with those given by keyword put in their place.
        Those that cannot be (keyword-only, ``**kwargs``, after a parameter left to its default)
        follow the others, and a step wrapping this one, one per set of their names, passes them
        on by name."""
        if not kwargs:
            return self, args
        try:
            bound = inspect.signature(self.fn).bind(*args, **kwargs)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{getattr(self.fn, '__name__', 'the step')}() {e}") from e
        if not bound.kwargs:
            return self, bound.args
        names = tuple(sorted(bound.kwargs))
        key = (len(bound.args), names)
        inner = self._keywords.get(key)
        if inner is None:
            n = len(bound.args)  # negative argnums count from the last positional argument

            def absolute(nums: tuple[int, ...]) -> tuple[int, ...]:
                return tuple(a % n if -n <= a < 0 else a for a in nums)

            options = dataclasses.replace(
                self.options,
                batch_argnums=absolute(self.options.batch_argnums),
                donate_argnums=absolute(self.options.donate_argnums),
                static_argnums=absolute(self.options.static_argnums),
            )
            inner = AutoParallel(_by_name(self.fn, n, names), options)
            inner.by_name = len(names)
            self._keywords[key] = inner
        return inner, (*bound.args, *(bound.kwargs[k] for k in names))

    def _executable(self, args: tuple[Any, ...]) -> driver.Executable:
        return self._lookup(*jax.tree.flatten(args))

    def _lookup(self, leaves: list[Any], in_tree: Any) -> driver.Executable:
        """The executable for arguments with these leaves, built on first use."""
        try:
            key = (in_tree, tuple(map(_aval_key, leaves)))
        except _Traced:
            raise ValueError(
                f"{getattr(self.fn, '__name__', 'The step')}, decorated with autopar.autoparallel, was "
                "called inside a JAX transformation (jax.jit, vmap, grad, scan, ...), with traced "
                "arguments: it runs its own pipeline of compiled tasks on the devices, so call it "
                "from Python, outside any transformation."
            ) from None
        exe = self._cache.get(key)
        if exe is None:
            args = jax.tree.unflatten(in_tree, leaves)
            nnx_support.require_no_nested_objects(args)
            with trace.outside_user_mesh():
                exe = self._cache[key] = build.executable(self.fn, args, self.options)
        return exe


def _by_name(fn: Callable[..., Any], n: int, names: tuple[str, ...]) -> Callable[..., Any]:
    """``fn`` taking its arguments after the first ``n`` by position, passing them on by
    ``names``."""

    @functools.wraps(fn)
    def step(*args: Any) -> Any:
        return fn(*args[:n], **dict(zip(names, args[n:], strict=True)))

    return step


def _live_leaves(exe: driver.Executable, leaves: list[Any]) -> list[Any]:
    """The arguments' leaves, checked before anything is dispatched: no shapes without values,
    none deleted (e.g. donated to an earlier call) and no array donated twice (XLA would crash
    on either).

    Raises:
      ValueError: naming the leaf's path.
    """
    for i, x in enumerate(leaves):
        known = type(x) in _ARRAY_TYPES  # the common case: a type test, no slow isinstance
        if not known and isinstance(x, jax.ShapeDtypeStruct):
            raise ValueError(
                f"Argument {exe.step.input_paths()[i]} is a jax.ShapeDtypeStruct: running the step "
                "needs arrays. For a plan from shapes alone use the step's .plan(...) or autopar.plan_step."
            )
        if (known or isinstance(x, jax.Array)) and x.is_deleted():
            raise ValueError(
                f"Argument {exe.step.input_paths()[i]} is a deleted array (donated to an earlier call, "
                "or deleted): pass the arrays the previous step returned instead."
            )
    first: dict[int, int] = {}
    for i in exe.donated_leaf_ids:
        if isinstance(leaves[i], jax.Array) and first.setdefault(id(leaves[i]), i) != i:
            paths = exe.step.input_paths()
            raise ValueError(
                f"Arguments {paths[first[id(leaves[i])]]} and {paths[i]} are the same array, and "
                "donate_argnums donates it twice; pass a copy for one of them (e.g. jnp.copy)."
            )
    return leaves


def _run(exe: driver.Executable, leaves: list[Any], task_times: list[float] | None = None) -> list[Any]:
    """Runs ``exe`` on the arguments' leaves, checked first, and retires those donated to it."""
    with trace.outside_user_mesh():
        outs = exe(_live_leaves(exe, leaves), task_times=task_times)
    _retire_donated(exe, leaves, outs)
    return outs


def _retire_donated(exe: driver.Executable, leaves: list[Any], outs: list[Any]) -> None:
    """Deletes the donated arguments' arrays a call has not deleted itself, but for those it
    returns, so that passing one again is the "deleted array" error, as donation promises. A
    donated buffer the runtime has consumed may still read as alive (an array the caller also
    fetched with ``jax.device_get``), and running on it crashes the process."""
    returned = {id(x) for x in outs}
    for i in exe.donated_leaf_ids:
        x = leaves[i]
        if isinstance(x, jax.Array) and id(x) not in returned and not x.is_deleted():
            x.delete()


_ARRAY_TYPES: set[type] = set()
"""Classes of concrete ``jax.Array`` leaves seen so far (never tracers): a leaf of one of
them takes the fast path, a type test instead of ``jax.Array``'s slower ``isinstance``."""


class _Traced(Exception):
    """A leaf is a tracer."""


def _aval_key(x: Any) -> Any:
    # Weak types count, as for jax.jit: a Python float times bfloat16 is bfloat16, a float32
    # array times bfloat16 float32. The step returns a weak value weak (e.g. TrainState.step
    # from a Python int), so a training loop keeps one program. Typed key arrays have no
    # weak_type attribute; a key is never weak.
    if type(x) in _ARRAY_TYPES:  # the common case, per leaf and call: no aval built
        return (x.shape, x.dtype, getattr(x, "weak_type", False))
    if isinstance(x, np.ndarray):
        return (x.shape, x.dtype, False)
    if compat.is_tracer(x):
        raise _Traced
    if isinstance(x, jax.Array):
        _ARRAY_TYPES.add(type(x))
        return (x.shape, x.dtype, getattr(x, "weak_type", False))
    aval = jax.typeof(x)
    return (tuple(aval.shape), aval.dtype, aval.weak_type)


def plan_step(
    fn: Callable[..., Any],
    *args: Any,
    cluster: ClusterSpec | str,
    num_microbatches: int | Literal["auto"] = "auto",
    batch_argnums: int | Sequence[int] = (1,),
    schedule: schedule.ScheduleName = "1f1b",
    tensor_parallel: bool = True,
    sharding_costs: bool = False,
    platform: str = "",
) -> Plan:
    """Plans ``fn(*args)`` for ``cluster`` without devices: a dry run.

    ``args`` may be ``jax.ShapeDtypeStruct`` trees (e.g. from ``jax.eval_shape``), so
    models far larger than this machine's memory can be planned; nothing is
    allocated. Device ids in the plan are ``0 .. cluster.num_devices - 1``, host by
    host. ``tensor_parallel`` lets stages use logical meshes with a model axis.
    ``sharding_costs`` prices every stage with the per-layer sharding ILP, as a run with
    ``sharding="auto"`` does, for devices of ``platform`` (e.g. ``"gpu"``; slower than the
    analytic estimate on large clusters: one solve per distinct layer and logical mesh).

    Example:
      >>> abstract_state = jax.eval_shape(make_state)
      >>> plan = autopar.plan_step(train_step, abstract_state, batch,
      ...                          cluster=autopar.parse_cluster("2x8xH100"))

    Raises:
      ValueError: for invalid arguments.
      NoFeasiblePlanError: if no plan fits the cluster's memory.
    """
    if isinstance(fn, AutoParallel):  # the decorated step: plan the step it wraps
        fn = fn.fn
    cluster = as_cluster(cluster)
    argnums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
    Options(num_microbatches=num_microbatches, batch_argnums=argnums, schedule=schedule)
    nmb = 1 if num_microbatches == "auto" else num_microbatches
    batch_ids, batch_size = build.batch_leaves(args, argnums, nmb)
    _, plan = autoplan.auto_plan(
        fn,
        args,
        batch_ids=batch_ids,
        batch_size=batch_size,
        device_ids=list(range(cluster.num_devices)),
        num_microbatches=None if num_microbatches == "auto" else num_microbatches,
        schedule=schedule,
        spec=cluster,
        tensor_parallel=tensor_parallel,
        sharding_costs=sharding_costs,
        platform=platform,
        retrace=False,
    )
    return plan
