"""Per-equation cost estimates used to balance layers.

Only heavy operations (``dot_general``, ``ragged_dot``, convolutions) count towards the FLOP
balance, as in Alpa's layer clustering; nested jaxprs (custom_jvp, remat, scan,
cond, while) are walked, a ``scan`` body counted ``length`` times.
"""

from __future__ import annotations

import math
from typing import Any

import jax.extend.core as jcore
import numpy as np

from autopar._src import compat


def _prod(xs: Any) -> int:
    return int(math.prod(int(x) for x in xs))


def aval_bytes(aval: Any) -> int:
    """Bytes of one array with abstract value ``aval`` (0 for tokens and the like)."""
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    return _prod(shape) * itemsize(dtype)


def itemsize(dtype: Any) -> int:
    """Bytes of one element of ``dtype``."""
    # Extended dtypes (PRNG keys) carry their own itemsize; NumPy cannot read them.
    size = getattr(dtype, "itemsize", None)
    return int(size if size is not None else np.dtype(dtype).itemsize)


def splits_over_batch(aval: Any, rows: int) -> bool:
    """Whether a per-microbatch value is split over the data axis: its leading dim is the
    microbatch's rows (the runtime's rule, which the memory model follows)."""
    shape: tuple[int, ...] = getattr(aval, "shape", ())
    return len(shape) >= 1 and rows > 0 and shape[0] == rows


THREEFRY_OPS = 120.0
"""Integer operations threefry2x32 spends per pair of words (a dropout mask's element),
counted as FLOPs: it is as compute bound."""


def eqn_flops(eqn: Any) -> float:
    """FLOPs of the heavy operations in one equation (0 for light ones)."""
    return float(sum(eqn_flops_by_dtype(eqn).values()))


RANDOM_BITS_DTYPE = "uint32"
"""The dtype random bits are counted in (threefry's integer rounds)."""


def eqn_flops_by_dtype(eqn: Any) -> dict[str, float]:
    """FLOPs of the heavy operations in one equation, by the dtype they compute in."""
    name = eqn.primitive.name
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs_shape = eqn.invars[0].aval.shape
        k = _prod(lhs_shape[d] for d in lhs_contract)
        return {str(eqn.invars[0].aval.dtype): 2.0 * _prod(eqn.outvars[0].aval.shape) * k}
    if name == "ragged_dot_general":  # each row meets one group's weights
        dims = eqn.params["ragged_dot_dimension_numbers"]
        (lhs_contract, _), _ = dims.dot_dimension_numbers
        lhs_shape = eqn.invars[0].aval.shape
        k = _prod(lhs_shape[d] for d in lhs_contract)
        out = _prod(eqn.outvars[0].aval.shape)
        if any(d in lhs_contract for d in dims.lhs_ragged_dimensions):  # out leads with the groups
            out //= max(int(eqn.outvars[0].aval.shape[0]), 1)
        return {str(eqn.invars[0].aval.dtype): 2.0 * out * k}
    if name == "conv_general_dilated":
        rhs_shape = eqn.invars[1].aval.shape
        dn = eqn.params["dimension_numbers"]
        out_feature_dim = dn.rhs_spec[0]
        per_output = _prod(rhs_shape) // max(int(rhs_shape[out_feature_dim]), 1)
        return {str(eqn.invars[0].aval.dtype): 2.0 * _prod(eqn.outvars[0].aval.shape) * per_output}
    if name == "fft":  # 5 n log2 n per transform of n points (complex), the usual count
        lengths = eqn.params["fft_lengths"]
        points = _prod(lengths)
        transforms = _prod(eqn.outvars[0].aval.shape[: -len(lengths)])
        return {str(eqn.invars[0].aval.dtype): 5.0 * transforms * points * math.log2(max(points, 2))}
    if name in ("threefry2x32", "random_bits"):  # 20 rounds of add, rotate and xor on two words
        return {RANDOM_BITS_DTYPE: THREEFRY_OPS * _prod(eqn.outvars[0].aval.shape)}
    total: dict[str, float] = {}
    repeat = float(eqn.params.get("length", 1)) if name == "scan" else 1.0
    for sub in jcore.jaxprs_in_params(eqn.params):
        body, _ = compat.jaxpr_and_consts(sub)
        for e in body.eqns:
            for dtype, f in eqn_flops_by_dtype(e).items():
                total[dtype] = total.get(dtype, 0.0) + repeat * f
    return total
