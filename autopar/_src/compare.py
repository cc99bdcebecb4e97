"""Comparing autopar's plan with a hand-written pjit plan on the same devices."""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar._src.api import autoparallel


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manual:
    """What a pjit user writes: a mesh and the shardings of the step's arguments."""

    mesh: Mesh
    """The device mesh of the manual plan."""
    in_shardings: Any
    """Shardings of the step's positional arguments (a tuple of pytrees)."""
    name: str = "manual"
    """Label in reports."""

    @classmethod
    def from_rules(
        cls,
        mesh: Mesh,
        rules: Sequence[tuple[str, PartitionSpec]],
        args: tuple[Any, ...],
        *,
        batch_argnums: Sequence[int] = (1,),
        batch_axis: str = "data",
        name: str = "manual",
    ) -> Manual:
        """Shardings from rules on parameter paths, as in t5x/Flax partitioning rules.

        Each leaf of a non-batch argument takes the spec of the first rule whose
        regular expression matches its path (``jax.tree_util.keystr``; ``re.search``),
        else replicated; batch leaves are split over ``batch_axis``.

        Raises:
          ValueError: if a rule's spec has more dims than the leaf it matches.
        """
        specs = rule_specs(rules, args, batch_argnums=batch_argnums, batch_axis=batch_axis)
        shardings = jax.tree.map(
            lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )
        return cls(mesh=mesh, in_shardings=shardings, name=name)


def rule_specs(
    rules: Sequence[tuple[str, PartitionSpec]],
    args: tuple[Any, ...],
    *,
    batch_argnums: Sequence[int] = (1,),
    batch_axis: str = "data",
) -> tuple[Any, ...]:
    """The ``PartitionSpec`` of every leaf of ``args`` under path rules (see :meth:`Manual.from_rules`).

    Raises:
      ValueError: if a rule's spec has more dims than the leaf it matches.
    """
    compiled = [(re.compile(pattern), spec) for pattern, spec in rules]

    def for_leaf(path: Any, leaf: Any) -> PartitionSpec:
        text = jax.tree_util.keystr(path)
        for pattern, spec in compiled:
            if pattern.search(text):
                if len(spec) > np.ndim(leaf):
                    raise ValueError(
                        f"Rule {pattern.pattern!r} gives {spec} to {text} of shape {np.shape(leaf)}"
                    )
                return spec
        return PartitionSpec()

    return tuple(
        jax.tree.map(lambda leaf: PartitionSpec(batch_axis), arg)
        if i in batch_argnums
        else jax.tree_util.tree_map_with_path(for_leaf, arg)
        for i, arg in enumerate(args)
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comparison:
    """Result of :func:`compare`."""

    autopar_step_seconds: float
    """Median step time of autopar's plan."""
    manual_step_seconds: float
    """Median step time of the manual plan."""
    autopar_memory_bytes: int
    """Largest per-device footprint of one autopar executable (compiled memory analysis)."""
    manual_memory_bytes: int
    """Per-device footprint of the manual executable (compiled memory analysis)."""
    max_loss_difference: float
    """Largest absolute difference between the two runs' losses."""
    max_state_difference: float
    """Largest absolute difference between the two runs' final states."""
    agree: bool
    """Whether losses and states agree within the tolerances."""


def _footprint(compiled: Any) -> int:
    m = compiled.memory_analysis()
    return int(
        m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    )


def _leaves(tree: Any) -> list[np.ndarray]:
    out = []
    for x in jax.tree.leaves(tree):
        if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append(np.asarray(x, dtype=np.float64))
    return out


def compare(
    fn: Callable[..., Any],
    state: Any,
    batches: Sequence[Any],
    *,
    manual: Manual,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    print_table: bool = True,
    **autoparallel_options: Any,
) -> Comparison:
    """Runs ``fn(state, batch)`` for every batch with autopar and with a manual pjit plan.

    Both start from ``state`` on the same devices; step times are medians over the
    batches after a warm-up step (the runs alternate step by step); memory is each
    compiled executable's argument + output + temporary bytes minus aliased bytes.

    Example:
      >>> manual = autopar.Manual.from_rules(mesh, [(r"kernel", P(None, "model"))], (state, batch))
      >>> result = autopar.compare(train_step, state, batches, manual=manual, num_stages=2)

    Raises:
      ValueError: if fewer than two batches are given.
    """
    if len(batches) < 2:
        raise ValueError(f"compare needs at least 2 batches (one warms up), got {len(batches)}")
    par = autoparallel(fn, **autoparallel_options)
    state_sh = manual.in_shardings[0]
    jitted = jax.jit(fn, in_shardings=manual.in_shardings)
    s_par, s_man = state, jax.device_put(state, state_sh)
    losses_par, losses_man, t_par, t_man = [], [], [], []
    for i, batch in enumerate(batches):
        b_man = jax.device_put(batch, manual.in_shardings[1])
        t0 = time.perf_counter()
        s_par, loss = jax.block_until_ready(par(s_par, batch))
        t1 = time.perf_counter()
        losses_par.append(loss)
        s_man = jax.device_put(s_man, state_sh)
        t2 = time.perf_counter()
        s_man, loss = jax.block_until_ready(jitted(s_man, b_man))
        t3 = time.perf_counter()
        losses_man.append(loss)
        if i:
            t_par.append(t1 - t0)
            t_man.append(t3 - t2)
    exe = par.executable(state, batches[0])
    autopar_memory = 0
    for i, f in enumerate(exe.fns):
        autopar_memory = max(autopar_memory, _footprint(f.lower(*exe.abstract_inputs(i)).compile()))
    manual_memory = _footprint(
        jitted.lower(
            jax.device_put(state, state_sh), jax.device_put(batches[0], manual.in_shardings[1])
        ).compile()
    )
    loss_diff = max(
        float(np.max(np.abs(a - b))) for a, b in zip(_leaves(losses_par), _leaves(losses_man), strict=True)
    )
    pairs = list(zip(_leaves(s_par), _leaves(s_man), strict=True))
    state_diff = max(float(np.max(np.abs(a - b), initial=0.0)) for a, b in pairs)
    agree = all(np.allclose(a, b, rtol=rtol, atol=atol) for a, b in pairs) and all(
        np.allclose(a, b, rtol=rtol, atol=atol)
        for a, b in zip(_leaves(losses_par), _leaves(losses_man), strict=True)
    )
    result = Comparison(
        autopar_step_seconds=statistics.median(t_par),
        manual_step_seconds=statistics.median(t_man),
        autopar_memory_bytes=autopar_memory,
        manual_memory_bytes=manual_memory,
        max_loss_difference=loss_diff,
        max_state_difference=state_diff,
        agree=agree,
    )
    if print_table:
        print(comparison_table(result, manual.name))
    return result


def comparison_table(result: Comparison, manual_name: str = "manual") -> str:
    """The comparison as a text table."""
    import io

    from rich.console import Console
    from rich.table import Table

    table = Table(title="autopar vs " + manual_name, title_justify="left")
    for col in ("plan", "median step", "peak memory / device"):
        table.add_column(col)
    table.add_row(
        "autopar",
        f"{result.autopar_step_seconds * 1e3:.1f} ms",
        f"{result.autopar_memory_bytes / 2**20:.2f} MiB (largest executable)",
    )
    table.add_row(
        manual_name,
        f"{result.manual_step_seconds * 1e3:.1f} ms",
        f"{result.manual_memory_bytes / 2**20:.2f} MiB",
    )
    buf = io.StringIO()
    console = Console(file=buf, width=100, force_terminal=False, color_system=None)
    console.print(table)
    verdict = "agree" if result.agree else "DIFFER"
    console.print(
        f"losses and states {verdict}: max |loss diff| {result.max_loss_difference:.2e}, "
        f"max |state diff| {result.max_state_difference:.2e}"
    )
    return buf.getvalue().rstrip()


def megatron_rules(model_axis: str = "model") -> list[tuple[str, PartitionSpec]]:
    """Megatron-LM tensor parallelism for the models in ``models/``.

    GPT, BERT and the MoE transformer: column-split q/k/v and the first MLP matmul, row-split
    the attention output and the second MLP matmul, vocabulary-split embeddings; each
    expert's feed-forward split the same way inside the expert (its hidden dim). Wide-ResNet:
    each bottleneck's wide 3x3 convolution split over its output channels and the 1x1
    convolution after it over its input channels (the MLP pair's column and row).
    """
    col, row = PartitionSpec(None, model_axis), PartitionSpec(model_axis, None)
    return [
        (r"\['(query|key|value|fc_in)'\]\['kernel'\]", col),
        (r"\['(query|key|value|fc_in)'\]\['bias'\]", PartitionSpec(model_axis)),
        (r"\['(out|fc_out)'\]\['kernel'\]", row),
        (r"\['embed'\]\['embedding'\]", row),
        (r"\['lm_head'\]\['kernel'\]", col),
        (r"\['w_in'\]", PartitionSpec(None, None, model_axis)),
        (r"\['w_out'\]", PartitionSpec(None, model_axis, None)),
        (r"\['conv_2'\]\['kernel'\]", PartitionSpec(None, None, None, model_axis)),
        (r"\['bn_2'\]\['(scale|bias)'\]", PartitionSpec(model_axis)),
        (r"\['conv_3'\]\['kernel'\]", PartitionSpec(None, None, model_axis, None)),
    ]
