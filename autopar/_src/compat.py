"""The one place that touches version-dependent JAX internals.

Everything else in autopar uses public APIs only. Supported: jax 0.10.x
(Python 3.11) and jax 0.12.x (Python >= 3.12), where ``ClosedJaxpr`` merged into
``Jaxpr`` and ``scan`` params changed.
"""

from __future__ import annotations

import functools
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jcore
from jax.extend import source_info_util
from jax.extend.core import primitives as jprims
from jax.interpreters import ad, batching, mlir

Var = jcore.Var
Literal = jcore.Literal
DropVar = jcore.DropVar
Primitive = jcore.Primitive
JaxprEqn = jcore.JaxprEqn

# Primitive names of a nested ``jax.jit`` call inside a jaxpr.
_CALL_PRIMITIVES = frozenset({"pjit", "jit", "closed_call", "core_call"})


def weakly_typed(x: Any) -> Any:
    """``x`` with a weak type (as a Python scalar's), which no public API makes from an array."""
    from jax._src.lax import lax as lax_internal

    return lax_internal._convert_element_type(x, weak_type=True)


def is_tracer(x: Any) -> bool:
    """Whether ``x`` is a value being traced by a JAX transformation."""
    return isinstance(x, jax.core.Tracer)


def jaxpr_and_consts(closed: Any) -> tuple[Any, list[Any]]:
    """Splits a traced jaxpr into its open ``Jaxpr`` and its constants.

    jax 0.10 returns a ``ClosedJaxpr`` (``.jaxpr`` and ``.consts``); jax 0.12 returns a
    ``Jaxpr`` carrying ``.consts`` itself.
    """
    inner = getattr(closed, "jaxpr", None)
    if inner is not None and inner is not closed:
        return inner, list(closed.consts)
    consts = getattr(closed, "consts", ())
    return closed, list(consts)


def is_literal(atom: Any) -> bool:
    """Whether a jaxpr atom is a literal (a constant written inline)."""
    return isinstance(atom, Literal)


def is_dropvar(var: Any) -> bool:
    """Whether an equation output is discarded."""
    return isinstance(var, DropVar)


def literal_value(atom: Any) -> Any:
    """The value of a literal atom."""
    return atom.val


def is_call(eqn: Any) -> bool:
    """Whether ``eqn`` is a nested ``jit`` call that may be inlined."""
    return eqn.primitive.name in _CALL_PRIMITIVES and "jaxpr" in eqn.params


def sub_jaxprs(eqn: Any) -> list[Any]:
    """The open jaxprs an equation carries in its params (call bodies, custom rules' primals)."""
    found = []
    for value in eqn.params.values():
        if hasattr(value, "eqns"):
            found.append(value)
        elif hasattr(getattr(value, "jaxpr", None), "eqns"):
            found.append(value.jaxpr)
    return found


def bodies(eqn: Any) -> list[Any]:
    """Every open jaxpr inside ``eqn``: :func:`sub_jaxprs` and a ``cond``'s branches."""
    return sub_jaxprs(eqn) + [b for b, _ in cond_branches(eqn) or ()]


def cond_branches(eqn: Any) -> list[tuple[Any, list[Any]]] | None:
    """A ``cond``'s branches as ``(open jaxpr, constants)`` over its operands (after the index);
    None for any other equation."""
    if eqn.primitive.name != "cond":
        return None
    return [jaxpr_and_consts(b) for b in eqn.params["branches"]]


def call_body(eqn: Any) -> tuple[Any, list[Any]]:
    """The body jaxpr and constants of a nested ``jit`` call equation."""
    body = eqn.params["jaxpr"]
    if hasattr(body, "consts") or hasattr(body, "jaxpr"):
        return jaxpr_and_consts(body)
    return body, []


def bind_eqn(eqn: Any, invals: Sequence[Any], caller: Any = None) -> list[Any]:
    """Applies ``eqn``'s primitive to ``invals`` (as ``jax.core.eval_jaxpr`` does). ``caller``:
    the traceback to give the new equation where ``eqn``'s has no frame of the user's code (an
    equation of a library's ``jit``, inlined: the call's)."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    # Older jax returned (subfuns, params); 0.10+ returns params only.
    subfuns, params = bound if isinstance(bound, tuple) else ([], bound)
    ctx = getattr(eqn, "ctx", None)
    manager = getattr(ctx, "manager", None) if ctx is not None else None
    # Re-binding under the equation's own source info keeps the user's file and line
    # (and name stack) on the new equation instead of autopar's evaluator.
    info = eqn.source_info
    traceback = info.traceback if caller is None or user_frame(info.traceback) else caller
    with source_info_util.user_context(traceback, name_stack=info.name_stack):
        if manager is not None:
            with manager:
                out = eqn.primitive.bind(*subfuns, *invals, **params)
        else:
            out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def remat_body(eqn: Any) -> Any | None:
    """The body of a rematerialised call (``jax.checkpoint``, ``nn.remat``), or None for any
    other equation. The body is an open jaxpr over the call's operands."""
    if eqn.primitive is not jprims.remat_p:
        return None
    body, consts = jaxpr_and_consts(eqn.params["jaxpr"])
    return None if consts or body.constvars else body


def inlinable_body(eqn: Any) -> Any | None:
    """The body of a nested ``jit`` call, a rematerialised call or a ``scan`` (one iteration), as
    an open jaxpr over the equation's operands; None for any other equation (and for bodies with
    constants)."""
    if is_call(eqn):
        body, consts = call_body(eqn)
        return None if consts or body.constvars else body
    loop = scan_loop(eqn)
    return loop.body if loop is not None else remat_body(eqn)


class Loop(NamedTuple):
    """A ``scan``'s body and how its operands split: constants, carries, scanned arrays."""

    body: Any
    """Open jaxpr of one iteration: constants, carries and slices in; carries and slices out."""
    num_consts: int
    num_carry: int
    length: int


def operand_body(eqn: Any) -> Any | None:
    """The body that takes ``eqn``'s operands and gives its results one for one: a nested ``jit``,
    a rematerialised call, or the primal of a ``custom_jvp``/``custom_vjp`` call; None for any
    other equation (a loop, a ``cond``) and for bodies with constants."""
    if is_call(eqn):
        body, consts = call_body(eqn)
        return None if consts or body.constvars else body
    remat = remat_body(eqn)
    if remat is not None or scan_loop(eqn) is not None or cond_branches(eqn) is not None:
        return remat
    found = sub_jaxprs(eqn)
    one = found[0] if len(found) == 1 else None
    if (
        one is None
        or one.constvars
        or (len(one.invars), len(one.outvars)) != (len(eqn.invars), len(eqn.outvars))
    ):
        return None
    return one


def scan_loop(eqn: Any) -> Loop | None:
    """The loop of a ``scan`` equation, or None for any other equation.

    The split is read off the avals, which every jax version keeps: a scanned operand or
    result has the body's aval with a leading ``length`` dim, a constant or carry has the
    body's aval, and the carries come first among the results.
    """
    if eqn.primitive.name != "scan":
        return None
    body, consts = jaxpr_and_consts(eqn.params["jaxpr"])
    length = eqn.params["length"]
    if (
        consts
        or body.constvars
        or len(body.invars) != len(eqn.invars)
        or len(body.outvars) != len(eqn.outvars)
    ):
        return None

    def same(a: Any, b: Any) -> bool:
        return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype

    def stacked(outer: Any, inner: Any) -> bool:
        return tuple(outer.shape) == (length, *inner.shape) and outer.dtype == inner.dtype

    ins = [(o.aval, b.aval) for o, b in zip(eqn.invars, body.invars, strict=True)]
    outs = [(o.aval, b.aval) for o, b in zip(eqn.outvars, body.outvars, strict=True)]
    fixed = next((i for i, (o, b) in enumerate(ins) if not same(o, b)), len(ins))
    num_carry = next((i for i, (o, b) in enumerate(outs) if not same(o, b)), len(outs))
    num_consts = fixed - num_carry
    if (
        num_consts < 0
        or not all(stacked(o, b) for o, b in ins[fixed:])
        or not all(stacked(o, b) for o, b in outs[num_carry:])
        or not all(same(ins[num_consts + i][1], outs[i][1]) for i in range(num_carry))
    ):
        return None
    return Loop(body, num_consts, num_carry, length)


def while_body(eqn: Any) -> tuple[Any, int] | None:
    """A ``while``'s body (an open jaxpr over its body constants and carries, returning the
    carries) and how many predicate constants come first among its operands; None for any
    other equation and for a body with constants."""
    if eqn.primitive.name != "while":
        return None
    body, consts = jaxpr_and_consts(eqn.params["body_jaxpr"])
    skip = eqn.params["cond_nconsts"]
    if consts or body.constvars or len(body.invars) != len(eqn.invars) - skip:
        return None
    return body, skip


def bind_with_body(
    eqn: Any, body: Any, fn: Callable[..., Sequence[Any]], invals: Sequence[Any], extra: Sequence[Any] = ()
) -> list[Any]:
    """Binds ``eqn`` (a rematerialised call, a ``scan`` or a ``while``) on ``invals`` with its body ``body``
    replaced by the trace of ``fn`` (same operands and results), keeping every other param: a
    checkpoint's policy and barrier against CSE, a scan's length, direction and unrolling.
    A rematerialised call may take ``extra`` operands after its own (``fn`` then takes them too)."""
    avals = [v.aval for v in body.invars] + [aval_of(x) for x in extra]
    closed = jax.make_jaxpr(lambda *xs: list(fn(*xs)))(*avals)
    new, consts = jaxpr_and_consts(closed)
    if consts:
        raise RuntimeError(f"a {eqn.primitive.name} body traced to {len(consts)} constants; expected none")
    key = "body_jaxpr" if eqn.primitive.name == "while" else "jaxpr"
    old = eqn.params[key]
    if getattr(old, "jaxpr", None) is not None and old.jaxpr is not old:  # a ClosedJaxpr (jax 0.10)
        new = jcore.ClosedJaxpr(new, [])
    return list(eqn.primitive.bind(*invals, *extra, **{**eqn.params, key: new}))


def key_impl_name(aval: Any) -> str:
    """The name of the PRNG implementation of a typed key's aval (``"threefry2x32"``)."""
    return str(aval.dtype._impl.name)


def gamma_variates(keys: Any, alphas: Any, log_space: bool) -> Any:
    """One gamma variate per key and shape ``alphas`` (flat arrays), each drawn as
    ``jax.random.gamma`` draws an element from its own split key (JAX's private per-element
    sampler, vectorised as its lowering does)."""
    from jax._src.random import core as random_core

    one = functools.partial(random_core._gamma_one, log_space=log_space)
    return jax.vmap(one)(keys, alphas)


def threefry_partitionable() -> bool:
    """Whether threefry counts a draw's elements by their flat index in its shape
    (``jax_threefry_partitionable``, on by default)."""
    return bool(jax.config.values["jax_threefry_partitionable"])


def source_line(eqn: Any, missing: str = "a line JAX did not record") -> str:
    """``file:line (function)`` of the user code that made ``eqn``: the innermost frame outside
    installed libraries (JAX, Flax, optax, ...) and autopar itself, else JAX's summary, else
    ``missing`` (equations inlined from a nested ``jit`` may have no frames)."""
    frame = user_frame(eqn.source_info.traceback)
    if frame is not None:
        return f"{frame.file_name}:{frame.line_num} ({frame.function_name})"
    return source_info_util.summarize(eqn.source_info) or missing


def user_frame(traceback: Any) -> Any | None:
    """The innermost frame of ``traceback`` outside installed libraries and autopar, or None."""
    for frame in getattr(traceback, "frames", None) or ():
        path = os.path.abspath(frame.file_name)
        if not any(part in _LIBRARY_DIRS for part in pathlib.PurePath(path).parts) and not path.startswith(
            _AUTOPAR_DIR
        ):
            return frame
    return None


_LIBRARY_DIRS = frozenset({"site-packages", "dist-packages"})
_AUTOPAR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def last_reads(jaxpr: Any) -> dict[Any, int]:
    """Each variable's last reader's position in ``jaxpr.eqns`` (their number for an output)."""
    last: dict[Any, int] = {}
    for i, e in enumerate(jaxpr.eqns):
        for a in e.invars:
            if not is_literal(a):
                last[a] = i
    for a in jaxpr.outvars:
        if not is_literal(a):
            last[a] = len(jaxpr.eqns)
    return last


def eval_jaxpr(jaxpr: Any, consts: Sequence[Any], *args: Any) -> list[Any]:
    """Evaluates an open jaxpr on ``consts`` and ``args``."""
    env: dict[Any, Any] = {}

    def read(a: Any) -> Any:
        return literal_value(a) if is_literal(a) else env[a]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        outs = bind_eqn(eqn, [read(a) for a in eqn.invars])
        for v, x in zip(eqn.outvars, outs, strict=True):
            if not is_dropvar(v):
                env[v] = x
    return [read(a) for a in jaxpr.outvars]


def is_zero_cotangent(ct: Any) -> bool:
    """Whether ``ct`` is JAX's symbolic zero (co)tangent."""
    return type(ct) is ad.Zero


def instantiate_zero(ct: Any) -> Any:
    """Turns a symbolic zero (co)tangent into an array of zeros."""
    return ad.instantiate_zeros(ct)


def register_identity_rules(
    prim: Primitive,
    jvp: Callable[..., Any],
    transpose: Callable[..., Any],
) -> None:
    """Registers JVP, transpose, batching (identity on the batched values) and an identity MLIR
    lowering for ``prim``."""
    ad.primitive_jvps[prim] = jvp
    ad.primitive_transposes[prim] = transpose
    batching.primitive_batchers[prim] = lambda args, dims, **params: (prim.bind(*args, **params), dims)
    mlir.register_lowering(prim, lambda ctx, *args, **params: list(args))


def register_constant_rules(prim: Primitive) -> None:
    """Registers JVP (a zero tangent) and batching (unbatched) for ``prim``, which has no
    operands and one result."""

    def jvp(primals: Sequence[Any], tangents: Sequence[Any], **params: Any) -> tuple[Any, Any]:
        out = prim.bind(*primals, **params)
        return out, jax.numpy.zeros_like(out)

    ad.primitive_jvps[prim] = jvp
    batching.primitive_batchers[prim] = lambda args, dims, **params: (prim.bind(*args, **params), None)


def register_batching_from_fun(prim: Primitive, fun: Callable[..., Any]) -> None:
    """Batches ``prim`` (with multiple results) by ``jax.vmap`` of the Python function ``fun``,
    which computes it from its operands and params: under ``vmap`` the primitive is replaced by
    what ``fun`` binds."""

    def rule(args: Sequence[Any], dims: Sequence[int | None], **params: Any) -> tuple[list[Any], list[int]]:
        outs = jax.vmap(lambda *a: fun(*a, **params), in_axes=tuple(dims))(*args)
        return list(outs), [0] * len(outs)

    batching.primitive_batchers[prim] = rule


def register_lowering_from_fun(prim: Primitive, fun: Callable[..., Any]) -> None:
    """Lowers ``prim`` by tracing the Python function ``fun``."""
    mlir.register_lowering(prim, mlir.lower_fun(fun, multiple_results=prim.multiple_results))


def shaped_array(shape: tuple[int, ...], dtype: Any) -> Any:
    """The abstract value of an array of ``shape`` and ``dtype`` (for abstract evaluation rules)."""
    return jax.core.ShapedArray(shape, dtype)


def aval_of(x: Any) -> Any:
    """The abstract value (shape, dtype) of an array or tracer."""
    return jax.typeof(x)
