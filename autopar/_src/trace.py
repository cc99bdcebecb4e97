"""Tracing a train step: the grad region, inlining, and the traced step.

``autopar.value_and_grad`` marks the microbatched part of a step. Outside
``@autoparallel`` it is exactly ``jax.value_and_grad``. While ``@autoparallel``
traces a step it instead cuts the loss into layers, differentiates the marked
loss, and emits one ``grad_region`` equation holding the whole forward+backward
jaxpr; the equations before and after it run once per step.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from autopar._src import compat, cost, layers, remat_split


@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceOptions:
    """How ``value_and_grad`` cuts the loss while ``@autoparallel`` traces a step."""

    num_layers: int | None
    """Number of forward layers to cut the loss into (None: chosen by the clustering)."""
    cuts: tuple[int, ...] | None = None
    """Cut positions to reuse (from a saved plan) instead of choosing them."""


_OPTIONS: contextvars.ContextVar[TraceOptions | None] = contextvars.ContextVar(
    "autopar_trace_options", default=None
)
_USER_MESH: contextvars.ContextVar[Any] = contextvars.ContextVar("autopar_user_mesh", default=None)


@contextlib.contextmanager
def outside_user_mesh() -> Iterator[None]:
    """Runs autopar's own work, tracing the step included, without the mesh the caller set with
    ``jax.set_mesh``: its stages run on submeshes of their own, which ``jit`` refuses beside a
    context mesh over other devices, and an equation traced under a mesh keeps it. Without a
    mesh Flax's ``nn.with_logical_constraint`` is the identity; the step's other constraints
    name their own mesh and are dropped (:mod:`autopar._src.user_constraints`)."""
    mesh = jax.sharding.get_mesh()
    if mesh.empty:
        yield
        return
    token = _USER_MESH.set(mesh)
    try:
        with jax.set_mesh(None):
            yield
    finally:
        _USER_MESH.reset(token)


_REGIONS: contextvars.ContextVar[list[int]] = contextvars.ContextVar("autopar_regions")
"""How many grad regions the step being traced has made."""


@contextlib.contextmanager
def tracing(options: TraceOptions) -> Iterator[None]:
    """Makes ``value_and_grad`` emit a grad region while tracing a step."""
    token, made = _OPTIONS.set(options), _REGIONS.set([0])
    try:
        yield
    finally:
        _OPTIONS.reset(token)
        _REGIONS.reset(made)


def _several_gradients(times: str) -> ValueError:
    return ValueError(
        f"The step calls autopar.value_and_grad/grad {times}; autopar pipelines exactly one gradient "
        "computation per step. Combine the losses into one loss function, or, where one gradient "
        "needs another (sharpness-aware minimization, a GAN's two players), take the others with "
        "jax.grad: they run outside the pipeline, on the whole batch (num_microbatches=1)."
    )


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class RegionInfo:
    """What a ``grad_region`` equation holds (compared by identity)."""

    jaxpr: Any
    """Open jaxpr of value-and-grad; constvars then invars are the region inputs."""
    num_aux: int
    """Number of aux output leaves (after the value, before the gradients)."""
    num_grads: int
    """Number of gradient leaves (the last outputs)."""
    cuts: tuple[int, ...]
    """Forward cut positions in the flattened loss jaxpr."""
    layer_flops: tuple[float, ...]
    """Forward FLOPs of each layer, per call of the loss."""
    num_forward_eqns: int
    """Equations in the flattened forward loss jaxpr."""
    fingerprint: str
    """Hash of the forward's primitives and the differentiated inputs' shapes (not the batch size)."""
    layer_sources: tuple[tuple[str, str], ...]
    """Source lines of the first and last equation of each layer."""
    other_layer_counts: tuple[int, ...] = ()
    """Layer counts of the other automatic clusterings, for the stage search to plan with too
    (:func:`autopar._src.clustering.candidate_layer_counts`); empty when the count or cuts were
    given."""
    aux_paths: tuple[str, ...] = ()
    """Each aux output leaf's path in the aux pytree (``['QDense_1']['amax']``), for errors."""

    def output_name(self, index: int) -> str:
        """How errors name the region's output ``index``: the loss, an aux leaf (with its path
        where the aux is a pytree), a gradient."""
        if index == 0:
            return "The loss"
        if index <= self.num_aux:
            path = self.aux_paths[index - 1] if index - 1 < len(self.aux_paths) else ""
            return f"Aux output {index - 1}{f' ({path})' if path else ''} of the loss function"
        return f"The gradient of differentiated leaf {index - 1 - self.num_aux}"


grad_region_p = compat.Primitive("autopar_grad_region")
grad_region_p.multiple_results = True


def _region_impl(*args: Any, info: RegionInfo) -> list[Any]:
    n = len(info.jaxpr.constvars)
    return compat.eval_jaxpr(info.jaxpr, args[:n], *args[n:])


grad_region_p.def_impl(_region_impl)
grad_region_p.def_abstract_eval(lambda *avals, info: [v.aval for v in info.jaxpr.outvars])
compat.register_lowering_from_fun(grad_region_p, _region_impl)
# Under vmap (per-example gradients) the region becomes its plain equations: no pipeline.
compat.register_batching_from_fun(grad_region_p, _region_impl)


def find_regions(jaxpr: Any) -> list[int]:
    """Indices of the grad-region equations of a flat step jaxpr."""
    return [i for i, e in enumerate(jaxpr.eqns) if e.primitive is grad_region_p]


def _normalize_argnums(argnums: int | Sequence[int], nargs: int) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for a in nums:
        if not -nargs <= a < nargs:
            raise ValueError(f"argnums={argnums!r} is out of range for {nargs} positional arguments")
    return tuple(a % nargs for a in nums)


def _region_value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int],
    has_aux: bool,
    args: tuple[Any, ...],
    options: TraceOptions,
) -> Any:
    nums = _normalize_argnums(argnums, len(args))
    diff_leaves, diff_tree = jax.tree.flatten(tuple(args[a] for a in nums))
    out_tree_box: list[Any] = []

    def loss_of_leaves(*leaves: Any) -> list[Any]:
        diff = jax.tree.unflatten(diff_tree, leaves)
        full = list(args)
        for a, x in zip(nums, diff, strict=True):
            full[a] = x
        out = fun(*full)
        value, aux = out if has_aux else (out, ())
        aux_leaves, aux_tree = jax.tree.flatten(aux)
        out_tree_box.append(aux_tree)
        return [value, *aux_leaves]

    # Closed-over tracers of the step become explicit inputs of the region.
    fwd_closed = jax.make_jaxpr(loss_of_leaves)(*diff_leaves)
    fwd_jaxpr, outer_consts = compat.jaxpr_and_consts(fwd_closed)
    aux_tree = out_tree_box[-1]

    total = sum(cost.eqn_flops(e) for e in fwd_jaxpr.eqns)
    big = remat_split.SPLIT_SHARE * total if total > 0 else None
    flat_closed = jax.make_jaxpr(lambda c, d: layers.inline_calls(fwd_jaxpr, c, d, split_remats=big))(
        outer_consts, diff_leaves
    )
    flat_jaxpr, flat_consts = compat.jaxpr_and_consts(flat_closed)
    other_counts: tuple[int, ...] = ()
    if options.cuts is not None:
        cuts = options.cuts
        layer_flops = layers.layer_flops_for_cuts(flat_jaxpr, cuts)
    else:
        cuts, layer_flops, other_counts = layers.choose_cuts(flat_jaxpr, options.num_layers)

    def marked_value_and_grad(consts_and_outer: list[Any], diff: list[Any]) -> list[Any]:
        def loss(d: list[Any]) -> tuple[Any, list[Any]]:
            outs = layers.eval_with_boundaries(flat_jaxpr, [], [*consts_and_outer, *d], cuts)
            return outs[0], outs[1:]

        value, pullback, aux = jax.vjp(loss, diff, has_aux=True)
        (grads,) = pullback(layers.cotangent_seed(value))
        return [value, *aux, *grads]

    inputs = [*flat_consts, *outer_consts]
    grad_closed = jax.make_jaxpr(marked_value_and_grad)(inputs, diff_leaves)
    grad_jaxpr, grad_consts = compat.jaxpr_and_consts(grad_closed)
    info = RegionInfo(
        jaxpr=grad_jaxpr,
        num_aux=aux_tree.num_leaves,
        num_grads=len(diff_leaves),
        cuts=tuple(cuts),
        layer_flops=tuple(layer_flops),
        num_forward_eqns=len(flat_jaxpr.eqns),
        fingerprint=_fingerprint(flat_jaxpr, diff_leaves),
        layer_sources=_layer_sources(flat_jaxpr, cuts),
        other_layer_counts=other_counts,
        aux_paths=tuple(
            jax.tree_util.keystr(path)
            for path, _ in jax.tree_util.tree_flatten_with_path(
                jax.tree.unflatten(aux_tree, range(aux_tree.num_leaves))
            )[0]
        ),
    )
    outs = grad_region_p.bind(*grad_consts, *inputs, *diff_leaves, info=info)
    value = outs[0]
    aux = jax.tree.unflatten(aux_tree, outs[1 : 1 + info.num_aux])
    grads = jax.tree.unflatten(diff_tree, outs[1 + info.num_aux :])
    grads = grads[0] if isinstance(argnums, int) else grads
    return ((value, aux), grads) if has_aux else (value, grads)


def _layer_sources(forward: Any, cuts: Sequence[int]) -> tuple[tuple[str, str], ...]:
    bounds = [0, *cuts, len(forward.eqns)]
    lines = [compat.source_line(e, missing="") for e in forward.eqns]
    spans = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        known = [line for line in lines[a:b] if line]
        spans.append((known[0], known[-1]) if known else ("", ""))
    return tuple(spans)


def _fingerprint(forward: Any, diff_leaves: Sequence[Any]) -> str:
    """Identifies a loss by its operations and parameter shapes, whatever the batch size."""
    digest = hashlib.sha256()
    for eqn in forward.eqns:
        digest.update(eqn.primitive.name.encode())
    for x in diff_leaves:
        aval = compat.aval_of(x)
        digest.update(f"{tuple(aval.shape)}{aval.dtype}".encode())
    return digest.hexdigest()[:16]


def value_and_grad(fun: Callable[..., Any], argnums: Any = 0, has_aux: bool = False) -> Callable[..., Any]:
    """Drop-in for ``jax.value_and_grad`` that marks the microbatched part of a step.

    Under ``@autopar.autoparallel`` the loss is cut into pipeline layers and run
    per microbatch; the gradients (and value and aux) are averaged over
    microbatches, which for a mean loss equals the gradient of the whole batch.
    Elsewhere it is ``jax.value_and_grad``. Differentiating with respect to a Flax
    NNX module differentiates its ``nnx.Param`` state, or the state an ``nnx.DiffState`` among
    ``argnums`` names (``nnx.DiffState(0, nnx.LoRAParam)``), as ``nnx.value_and_grad``.

    Example:
      >>> loss, grads = autopar.value_and_grad(loss_fn)(params, batch)
    """
    from autopar._src import nnx_support

    def wrapped(*args: Any) -> Any:
        return nnx_support.call_value_and_grad(_value_and_grad_arrays, fun, argnums, has_aux, args)

    return wrapped


def _value_and_grad_arrays(
    fun: Callable[..., Any], argnums: int | Sequence[int], has_aux: bool, args: tuple[Any, ...]
) -> Any:
    options = _OPTIONS.get()
    if options is None:
        return jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)(*args)
    made = _REGIONS.get()
    made[0] += 1
    # Nested use (a value_and_grad inside the loss) is an ordinary JAX grad.
    token = _OPTIONS.set(None)
    try:
        return _region_value_and_grad(fun, argnums, has_aux, args, options)
    except ValueError as e:
        if made[0] > 1:  # a second loss, cut into layers, may have none: the cause is the second
            raise _several_gradients("more than once") from e
        raise
    finally:
        _OPTIONS.reset(token)


def grad(fun: Callable[..., Any], argnums: Any = 0, has_aux: bool = False) -> Callable[..., Any]:
    """Drop-in for ``jax.grad``; see :func:`value_and_grad`."""
    vag = value_and_grad(fun, argnums=argnums, has_aux=has_aux)

    def wrapped(*args: Any) -> Any:
        if has_aux:
            (_, aux), g = vag(*args)
            return g, aux
        _, g = vag(*args)
        return g

    return wrapped


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class TracedStep:
    """A train step traced to one flat jaxpr (nested jits inlined)."""

    jaxpr: Any
    """Flat open jaxpr of the step."""
    arg_vars: tuple[Any, ...]
    """The jaxpr vars of the flattened positional arguments, in order."""
    const_bindings: tuple[tuple[Any, Any], ...]
    """``(var, value)`` for every other input var: constants captured while tracing."""
    in_tree: Any
    """Pytree structure of the step's positional arguments."""
    out_tree: Any
    """Pytree structure of the step's output."""

    def input_paths(self) -> list[str]:
        """The pytree path of each argument leaf, e.g. ``[0].params['w']``."""
        return _leaf_paths(self.in_tree)

    def output_paths(self) -> list[str]:
        """The pytree path of each output leaf, e.g. ``[1]`` for the loss of ``(state, loss)``."""
        return _leaf_paths(self.out_tree)

    def derived(self, seeds: set[Any]) -> set[Any]:
        """``seeds`` and the values the step computes from them outside the grad region."""
        found, at = set(seeds), self.region_index()
        for i, eqn in enumerate(self.jaxpr.eqns):
            if i != at and any(not compat.is_literal(a) and a in found for a in eqn.invars):
                found.update(eqn.outvars)
        return found

    def region_index(self) -> int | None:
        """Index of the grad-region equation, or None when the step has none.

        Raises:
          ValueError: if the step calls ``autopar.value_and_grad`` more than once.
        """
        found = find_regions(self.jaxpr)
        if len(found) > 1:
            raise _several_gradients(f"{len(found)} times")
        return found[0] if found else None


def _leaf_paths(tree: Any) -> list[str]:
    leaves = jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(tree, range(tree.num_leaves)))[0]
    return [jax.tree_util.keystr(p) for p, _ in leaves]


def trace_step(fn: Callable[..., Any], args: tuple[Any, ...], options: TraceOptions) -> TracedStep:
    """Traces ``fn(*args)`` abstractly into one flat jaxpr; nothing is computed."""
    leaves, in_tree = jax.tree.flatten(args)
    out_tree_box: list[Any] = []

    def flat_fn(*xs: Any) -> list[Any]:
        out = fn(*jax.tree.unflatten(in_tree, xs))
        out_leaves, out_tree = jax.tree.flatten(out)
        out_tree_box.append(out_tree)
        return out_leaves

    with tracing(options):
        try:
            closed = jax.make_jaxpr(flat_fn)(*leaves)
        except RuntimeError as e:
            user_mesh = _USER_MESH.get()
            if user_mesh is None or "mesh" not in str(e):
                raise
            raise ValueError(
                f"The step needs the mesh set with jax.set_mesh ({user_mesh}) while it is traced, "
                f"which autopar leaves, since its stages run on submeshes of their own: {e} Give "
                "a with_sharding_constraint its mesh (a NamedSharding; autopar drops it) or remove it."
            ) from e
    jaxpr, consts = compat.jaxpr_and_consts(closed)
    flat = jax.make_jaxpr(lambda c, xs: layers.inline_calls(jaxpr, c, xs, split_conds=True))(
        consts, list(leaves)
    )
    flat_jaxpr, flat_consts = compat.jaxpr_and_consts(flat)
    invars = list(flat_jaxpr.invars)
    n = len(consts)
    bindings = list(zip(flat_jaxpr.constvars, flat_consts, strict=True))
    bindings += list(zip(invars[:n], consts, strict=True))
    return TracedStep(
        jaxpr=flat_jaxpr,
        arg_vars=tuple(invars[n:]),
        const_bindings=tuple(bindings),
        in_tree=in_tree,
        out_tree=out_tree_box[-1],
    )
