"""Dropout masks and other per-example draws with several microbatches, equal to ``jax.jit``'s.

``jax.jit`` draws a dropout mask once for the whole batch, ``random_bits(key, (B, ...))``;
run per microbatch, the loss function draws ``random_bits(key, (B / M, ...))``, which are not
any microbatch's rows of it. JAX's default PRNG is counter based: element ``i`` of a draw is
``threefry(key, i)``, ``i`` its flat index in the draw's shape (``jax_threefry_partitionable``,
on by default). So microbatch ``j``'s rows of the whole batch's draw can be made alone: threefry
of their flat indices in the whole draw's shape (:func:`draw`). Keys split per example
(``jax.random.split(key, B)``) are made the same way.

:func:`find` pairs the loss function's draws traced at one microbatch with those traced at the
whole batch; a draw whose shape is ``M`` times longer in one dim for the whole batch reads the
microbatch's index, and holds its rows of each run of the examples that dim holds
(:mod:`~autopar._src.draw_layout`). :func:`with_index` replaces the loss function's equation that makes such
a draw, directly or inside nested ``jit``, ``scan``, ``while``, ``cond``, rematerialised
bodies and custom rules' primals (each traced again), by a ``jit`` call that also reads the
index, a value of each microbatch made once per step (:func:`index_op`). A PRNG that is not
counter based (``rbg``) draws the whole batch's values, and each microbatch keeps its rows.
Gamma variates (``jax.random.gamma``, ``beta``, ``dirichlet``) split their key per element,
then draw each with JAX's sampler: made alike from the microbatch's split keys. Where a draw
cannot be made so (gamma variates of another PRNG; inside a ``shard_map``; a shape that
changes otherwise with the batch, or in more than one dim) :func:`find` returns None, and each
microbatch draws from its own fold of the key instead (:mod:`~autopar._src.microbatch_keys`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p

from autopar._src import compat, draw_layout, example_order
from autopar._src.program import Op
from autopar._src.trace import TracedStep

_DRAWS = frozenset({"random_bits", "random_split", "random_gamma"})
_U32 = jnp.uint32
_WORD = 1 << 32


@dataclasses.dataclass(frozen=True)
class Scaled:
    """How a draw's shape follows the batch: ``whole``, its shape for the whole batch, is the
    microbatch's with dim ``dim`` ``num_microbatches`` times longer, its rows ``runs`` runs of
    the examples (:mod:`~autopar._src.draw_layout`): the microbatch's rows are a block of each."""

    whole: tuple[int, ...]
    dim: int
    runs: int = 1


@dataclasses.dataclass(frozen=True, eq=False)
class Draws:
    """The loss function's draws that follow the batch, and the var of the microbatch's index
    (a ``uint32`` scalar, tag ``j`` for microbatch ``j``) that their equations read."""

    scaled: Mapping[Path, Scaled]
    """The place of each such draw equation (at any depth) -> how its shape follows the batch."""
    top: frozenset[int]
    """Indices of the loss function's equations that make or hold such a draw."""
    index: Any


def find(step: TracedStep, whole: TracedStep, num_microbatches: int, index: Any = None) -> Draws | None:
    """The draws of ``step``'s loss function (traced at one microbatch) whose shape follows the
    batch in ``whole`` (traced at the whole batch), if every such draw can be made as ``jax.jit``
    makes it for the whole batch; None if one cannot (then keys are folded instead). ``index``:
    the microbatch's index to read (a new variable if None)."""
    mine, theirs = (s.jaxpr.eqns[s.region_index()].params["info"].jaxpr for s in (step, whole))
    scaled = scaled_draws(rng_eqns(mine.eqns), rng_eqns(theirs.eqns), num_microbatches)
    if not scaled:
        return None
    walk, (loss, _), twins = example_order.walked(step, whole, num_microbatches, run=True)
    return laid_out(
        scaled,
        lambda path: draw_layout.runs(loss.eqns, lambda e: twins.get(id(e)), path, walk, num_microbatches),
        index,
    )


def scaled_draws(
    ours: Sequence[tuple[Path, Any, bool]],
    others: Sequence[tuple[Path, Any, bool]],
    num_microbatches: int,
    same_places: bool = False,
) -> dict[Path, Scaled] | None:
    """Of the draws ``ours`` (:func:`rng_eqns` traced at one microbatch) and ``others`` (at the
    whole batch), those whose shape follows the batch; None if one of them cannot be made per
    microbatch as ``jax.jit`` makes it (or the two differ, in places too with ``same_places``)."""
    if len(ours) != len(others):
        return None
    scaled: dict[Path, Scaled] = {}
    for (path, eqn, rebindable), (place, other, _) in zip(ours, others, strict=True):
        if eqn.primitive.name != other.primitive.name or (same_places and path != place):
            return None
        shape, whole_shape = _shape(eqn), _shape(other)
        if shape == whole_shape:
            continue
        dims = (
            [k for k, (a, b) in enumerate(zip(shape, whole_shape, strict=True)) if a != b]
            if len(shape) == len(whole_shape)
            else []
        )
        key_aval = eqn.invars[0].aval
        if (
            len(dims) != 1
            or whole_shape[dims[0]] != num_microbatches * shape[dims[0]]
            or whole_shape[dims[0]] >= _WORD
            or math.prod(whole_shape) > _WORD * _WORD
            or tuple(key_aval.shape) != tuple(other.invars[0].aval.shape)
            or not rebindable
            or (eqn.primitive.name == "random_gamma" and not _gamma_made_alone(key_aval))
        ):
            return None
        scaled[path] = Scaled(whole_shape, dims[0])
    return scaled


def laid_out(
    scaled: Mapping[Path, Scaled], runs: Callable[[Path], draw_layout.Runs], index: Any = None
) -> Draws | None:
    """The draws ``scaled``, each in the runs of the examples it holds (``runs`` of its place);
    None where one holds them so that no runs give ``jax.jit``'s."""
    laid = {}
    for path, found in scaled.items():
        held = runs(path)
        if held is None:
            return None
        laid[path] = dataclasses.replace(found, runs=held)
    index = compat.Var(compat.shaped_array((), _U32)) if index is None else index
    return Draws(scaled=laid, top=frozenset(path[0] for path in laid), index=index)


Path = tuple[int, ...]
"""Where an equation is: its index among the loss function's equations, then, for each body it
is nested in, the body's index among its equation's :func:`~autopar._src.compat.bodies` and
its own index there. JAX shares one equation object between calls of a cached ``jit`` (a
per-step draw and a per-example one of the same microbatch shape), so places tell draws apart
where ``id`` cannot."""


def rng_eqns(eqns: Sequence[Any]) -> list[tuple[Path, Any, bool]]:
    """``(place, equation, whether it can be traced again with the index)`` of every
    ``random_bits``, ``random_split`` and ``random_gamma`` in ``eqns``, nested ones too, in
    order."""
    found: list[tuple[Path, Any, bool]] = []

    def visit(path: Path, eqn: Any, rebindable: bool) -> None:
        if eqn.primitive.name in _DRAWS:
            found.append((path, eqn, rebindable))
        inner = rebindable and _rebindable(eqn)
        for b, body in enumerate(compat.bodies(eqn)):
            for k, e in enumerate(body.eqns):
                visit((*path, b, k), e, inner)

    for i, eqn in enumerate(eqns):
        visit((i,), eqn, True)
    return found


# The loss function is differentiated already: a custom rule's primal runs as it is.
_CUSTOM_CALLS = frozenset({"custom_jvp_call", "custom_vjp_call"})


def _shape(eqn: Any) -> tuple[int, ...]:
    """The shape a draw asks for from each key (a gamma draw's: its shape operand's, past the
    keys' dims, as ``jax.random.gamma`` splits each key)."""
    if eqn.primitive.name == "random_gamma":
        return tuple(eqn.invars[1].aval.shape[eqn.invars[0].aval.ndim :])
    return tuple(eqn.params["shape"])


def _gamma_made_alone(key_aval: Any) -> bool:
    """Whether gamma variates from one key of ``key_aval``'s PRNG can be made per microbatch:
    ``jax.random.gamma`` splits the key into one per element, by their flat index as threefry
    counts, then draws each (checked once against ``jax.random.gamma``)."""
    impl = compat.key_impl_name(key_aval)
    return not key_aval.shape and supported(impl) and _gamma_checked(impl)


@functools.cache
def _gamma_checked(impl: str) -> bool:
    with jax.ensure_compile_time_eval():
        key = jax.random.key(3, impl=impl)
        whole = jnp.linspace(0.2, 4.0, 12).reshape(6, 2)
        expected = jax.random.gamma(key, whole)
        for j in range(2):
            try:
                made = _gamma(
                    key, whole[3 * j : 3 * (j + 1)], False, Scaled(whole.shape, 0), jnp.asarray(j, _U32)
                )
            except AttributeError:  # JAX's private sampler moved: fold the keys instead
                return False
            if not bool(jnp.allclose(made, expected[3 * j : 3 * (j + 1)], rtol=1e-6)):
                return False
    return True


def _gamma(key: Any, alphas: Any, log_space: bool, scaled: Scaled, index: Any) -> Any:
    keys = _bits("random_split", 0, tuple(alphas.shape), key, scaled, index)
    flat = compat.gamma_variates(keys.reshape(-1), alphas.reshape(-1), log_space)
    return flat.reshape(alphas.shape)


def _rebindable(eqn: Any) -> bool:
    return (
        compat.is_call(eqn)
        or (eqn.primitive.name in _CUSTOM_CALLS and compat.operand_body(eqn) is not None)
        or compat.cond_branches(eqn) is not None
        or compat.scan_loop(eqn) is not None
        or eqn.primitive.name == "while"
        or compat.remat_body(eqn) is not None
    )


@functools.cache
def _checked(impl: str, partitionable: bool) -> bool:
    """Whether :func:`_bits` gives ``jax.random``'s own draws for PRNG ``impl``: slices of a whole
    draw, along its first and its last dim, for 8 and 32 bits, and split keys."""
    with jax.ensure_compile_time_eval():
        key = jax.random.key(7, impl=impl)
        for whole, dim in (((6, 5), 0), ((3, 8), 1)):
            shape = tuple(n // 2 if k == dim else n for k, n in enumerate(whole))
            scaled = Scaled(whole, dim)
            for j in range(2):
                index = jnp.asarray(j, _U32)
                rows = slice(j * shape[dim], (j + 1) * shape[dim])
                cut = (slice(None),) * dim + (rows,)
                for width in (8, 32):
                    expected = jax.random.bits(key, whole, dtype=f"uint{width}")[cut]
                    if not bool(
                        jnp.array_equal(_bits("random_bits", width, shape, key, scaled, index), expected)
                    ):
                        return False
                split = _bits("random_split", 0, shape, key, scaled, index)
                expected = jax.random.split(key, whole)[cut]
                if not bool(jnp.array_equal(jax.random.key_data(split), jax.random.key_data(expected))):
                    return False
    return True


def supported(impl: str) -> bool:
    """Whether draws of PRNG ``impl`` are made per microbatch as ``jax.jit`` makes them for the
    whole batch: threefry, counter based (``jax_threefry_partitionable``), checked once."""
    return impl == "threefry2x32" and _checked(impl, compat.threefry_partitionable())


def draw(eqn: Any, key: Any, scaled: Scaled, index: Any, alphas: Any = None) -> Any:
    """The rows of the whole batch's draw that microbatch ``index`` reads, for ``eqn`` (a
    ``random_bits``, ``random_split`` or ``random_gamma`` of shape ``alphas`` whose shape follows
    the batch as ``scaled`` says): made alone for a counter-based PRNG (:func:`supported`), else
    cut from the whole batch's draw."""
    name, shape = eqn.primitive.name, _shape(eqn)
    if name == "random_gamma":
        return _gamma(key, alphas, eqn.params["log_space"], scaled, index)
    if supported(compat.key_impl_name(eqn.invars[0].aval)):
        return _bits(name, eqn.params.get("bit_width", 0), shape, key, scaled, index)
    (whole, *_) = compat.bind_eqn(eqn.replace(params={**eqn.params, "shape": scaled.whole}), [key])
    at = key.ndim + scaled.dim  # a draw from an array of keys has their dims first
    rows = shape[scaled.dim] // scaled.runs
    runs = whole.reshape(*whole.shape[:at], scaled.runs, -1, *whole.shape[at + 1 :])
    block = jax.lax.dynamic_slice_in_dim(runs, jnp.asarray(index, _U32) * _U32(rows), rows, at + 1)
    return block.reshape(*whole.shape[:at], rows * scaled.runs, *whole.shape[at + 1 :])


def _bits(name: str, width: int, shape: tuple[int, ...], key: Any, scaled: Scaled, index: Any) -> Any:
    data = jax.random.key_data(key)
    keys = data.shape[:-1]
    full = (*keys, *shape)
    k1, k2 = (jax.lax.broadcast_in_dim(data[..., w], full, tuple(range(len(keys)))) for w in (0, 1))
    hi, lo = (
        jax.lax.broadcast_in_dim(c, full, tuple(range(len(keys), len(full))))
        for c in _counters(shape, scaled, index)
    )
    bits1, bits2 = threefry2x32_p.bind(k1, k2, hi, lo)
    if name == "random_split":
        return jax.random.wrap_key_data(jnp.stack([bits1, bits2], axis=-1), impl=jax.random.key_impl(key))
    if width == 64:
        wide = jnp.dtype("uint64")
        return jax.lax.shift_left(bits1.astype(wide), jnp.asarray(32, wide)) | bits2.astype(wide)
    mixed = bits1 ^ bits2
    return mixed if width == 32 else mixed.astype(f"uint{width}")


def _counters(shape: tuple[int, ...], scaled: Scaled, index: Any) -> tuple[Any, Any]:
    """The flat indices in the whole draw's shape of microbatch ``index``'s elements, as ``uint64``
    split into high and low ``uint32`` words (as ``jax.random`` counts them)."""
    whole, dim = scaled.whole, scaled.dim
    strides = [math.prod(whole[k + 1 :]) for k in range(len(whole))]
    hi = jnp.zeros(shape, _U32)
    lo = jnp.zeros(shape, _U32)
    small = math.prod(whole) <= _WORD
    for k, n in enumerate(shape):
        if n == 1 and k != dim:
            continue
        at = jax.lax.broadcasted_iota(_U32, shape, k)
        if k == dim:  # row ``r`` of run ``q`` of the microbatch's, in the whole batch's run ``q``
            rows = n // scaled.runs
            if scaled.runs > 1:
                at = at + (at // _U32(rows)) * _U32(whole[k] // scaled.runs - rows)
            at = at + jnp.asarray(index, _U32) * _U32(rows)
        if small:  # every index fits one word
            lo = lo + at * _U32(strides[k])
        else:
            hi, lo = _add(hi, lo, *_times(at, strides[k]))
    return hi, lo


def _times(x: Any, c: int) -> tuple[Any, Any]:
    """``x * c`` modulo ``2**64`` as high and low words, for ``uint32`` ``x`` and ``0 <= c < 2**64``."""
    c_hi, c_lo = divmod(c, _WORD)
    xl, xh = x & _U32(0xFFFF), x >> _U32(16)
    cl, ch = _U32(c_lo & 0xFFFF), _U32(c_lo >> 16)
    low, high = xl * cl, xh * ch
    mid = xl * ch + xh * cl  # up to 33 bits: its carry is worth 2**48
    mid_carry = (mid < xl * ch).astype(_U32)
    lo = low + (mid << _U32(16))
    hi = high + (mid >> _U32(16)) + (mid_carry << _U32(16)) + (lo < low).astype(_U32) + x * _U32(c_hi)
    return hi, lo


def _add(a_hi: Any, a_lo: Any, b_hi: Any, b_lo: Any) -> tuple[Any, Any]:
    lo = a_lo + b_lo
    return a_hi + b_hi + (lo < a_lo).astype(_U32), lo


def with_index(eqn: Any, at: int, draws: Draws) -> Any:
    """``eqn``, the loss function's equation ``at`` (in ``draws.top``), as a ``jit`` call that also
    reads the microbatch's index and makes its draws as :func:`draw` does."""
    ins = [a for a in eqn.invars if not compat.is_literal(a)]

    def fn(*xs: Any) -> list[Any]:
        given = iter(xs[:-1])
        vals = [compat.literal_value(a) if compat.is_literal(a) else next(given) for a in eqn.invars]
        return _apply(eqn, (at,), vals, draws, xs[-1])

    closed = jax.make_jaxpr(lambda *xs: jax.jit(fn)(*xs))(*(a.aval for a in ins), draws.index.aval)
    traced, consts = compat.jaxpr_and_consts(closed)
    (call,) = traced.eqns
    assert not consts and not traced.constvars, "the traced draw closed over constants"
    return call.replace(invars=[*ins, draws.index], outvars=list(eqn.outvars), source_info=eqn.source_info)


def _run(
    jaxpr: Any, path: Path, consts: Sequence[Any], args: Sequence[Any], draws: Draws, index: Any
) -> list[Any]:
    env = dict(zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args], strict=True))

    def read(a: Any) -> Any:
        return compat.literal_value(a) if compat.is_literal(a) else env[a]

    for k, eqn in enumerate(jaxpr.eqns):
        outs = _apply(eqn, (*path, k), [read(a) for a in eqn.invars], draws, index)
        env.update((v, x) for v, x in zip(eqn.outvars, outs, strict=True) if not compat.is_dropvar(v))
    return [read(a) for a in jaxpr.outvars]


def _apply(eqn: Any, path: Path, vals: list[Any], draws: Draws, index: Any) -> list[Any]:
    """``eqn``, at ``path``, on ``vals``, its draws that follow the batch (nested ones too) made
    for microbatch ``index`` as ``jax.jit`` makes them for the whole batch."""
    if path in draws.scaled:
        return [draw(eqn, vals[0], draws.scaled[path], index, *vals[1:])]
    if not any(len(p) > len(path) and p[: len(path)] == path for p in draws.scaled):
        return compat.bind_eqn(eqn, vals)
    bodies = compat.bodies(eqn)

    def run(body: Any, consts: Sequence[Any], *xs: Any, index: Any = index) -> list[Any]:
        b = next(b for b, known in enumerate(bodies) if body in (known, getattr(known, "jaxpr", None)))
        return _run(body, (*path, b), consts, xs, draws, index)

    if compat.is_call(eqn):
        return run(*compat.call_body(eqn), *vals)
    if eqn.primitive.name in _CUSTOM_CALLS:
        return run(compat.operand_body(eqn), [], *vals)
    branches = compat.cond_branches(eqn)
    if branches is not None:
        fns = [functools.partial(run, body, consts) for body, consts in branches]
        return list(jax.lax.switch(vals[0], fns, *vals[1:]))
    loop = compat.scan_loop(eqn)
    if loop is not None:
        fixed, carry = vals[: loop.num_consts], vals[loop.num_consts : loop.num_consts + loop.num_carry]

        def step(c: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
            out = run(loop.body, [], *fixed, *c, *x)
            return out[: loop.num_carry], out[loop.num_carry :]

        xs = vals[loop.num_consts + loop.num_carry :]
        params = eqn.params
        c, ys = jax.lax.scan(
            step, carry, xs, length=loop.length, reverse=params["reverse"], unroll=params["unroll"]
        )
        return [*c, *ys]
    if eqn.primitive.name == "while":
        params = eqn.params
        (cond, cond_consts), (body, body_consts) = (
            compat.jaxpr_and_consts(params[k]) for k in ("cond_jaxpr", "body_jaxpr")
        )
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cond_fixed, body_fixed = vals[:nc], vals[nc : nc + nb]
        return list(
            jax.lax.while_loop(
                lambda c: run(cond, cond_consts, *cond_fixed, *c)[0],
                lambda c: run(body, body_consts, *body_fixed, *c),
                vals[nc + nb :],
            )
        )
    remat = compat.remat_body(eqn)
    assert remat is not None, f"find() let a draw inside a {eqn.primitive.name} through"
    # The index as one more operand, so the rematerialised body closes over nothing.
    return compat.bind_with_body(
        eqn, remat, lambda *xs: run(remat, [], *xs[:-1], index=xs[-1]), vals, [index]
    )


def index_op(draws: Draws, num_microbatches: int) -> Op:
    """The op that makes every microbatch's index (once per step)."""
    outs = tuple((draws.index, j) for j in range(num_microbatches))
    return Op(kind="acc", mode="index", ins=(), outs=outs)
