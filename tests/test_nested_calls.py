"""The sharding ILP inside nested calls and loops: ``jit`` bodies, ``jax.checkpoint`` blocks
and ``scan`` layer stacks are laid out like any other equations, and the driver pins them there."""

import jax
import numpy as np
from test_intra_op import _collectives, _dots, _gpt_on_one_stage, _hlo

from autopar._src import compat, intra_op, stage_values
from autopar._src.expansion import expand_calls
from autopar._src.strategy_graph import GraphOp, Inner, Tie


def _eqns(closed):
    return (closed.jaxpr if hasattr(closed, "jaxpr") and closed.jaxpr is not closed else closed).eqns


def test_nested_calls_expand_into_their_bodies():
    @jax.jit
    def act(h):
        return jax.nn.gelu(h)

    @jax.checkpoint
    def block(w, x):
        return act(x @ w) @ w.T

    closed = jax.make_jaxpr(lambda w, x: block(w, x) * 2.0)(np.ones((4, 4)), np.ones((8, 4)))
    jaxpr = closed.jaxpr if hasattr(closed, "jaxpr") else closed
    call, scale = jaxpr.eqns
    w, x = jaxpr.invars
    alias = {}
    ops = expand_calls(GraphOp(call, (w, x), tuple(call.outvars)), alias)
    names = [op.eqn.primitive.name for op in ops]
    assert "dot_general" in names and "checkpoint" not in names and "remat2" not in names
    assert "jit" not in names and "pjit" not in names  # the nested jit's body is inlined too
    assert ops[0].ins == (x, w)  # the body reads the call's operands
    depth = {len(name.path) for op in ops for name in op.outs if name is not None}
    assert depth == {1, 2}  # values of the checkpoint body, and of the jit body inside it
    assert all(name.path[0] == id(call) for op in ops for name in op.outs if name is not None)
    # The call's result is the body's last value (the jit's result is its body's), and an
    # equation that calls nothing is left alone.
    assert stage_values.alias_root(alias, call.outvars[0]) == ops[-1].outs[0]
    assert len(alias) == 2
    assert expand_calls(GraphOp(scale, (call.outvars[0], None), (scale.outvars[0],)), alias) == [
        GraphOp(scale, (call.outvars[0], None), (scale.outvars[0],))
    ]


def test_rematerialised_blocks_are_laid_out_inside():
    exe, chosen = _gpt_on_one_stage(hidden=256, num_heads=8, num_layers=1, remat=True)
    # The backward recomputes the block inside a checkpoint call; the ILP splits its heads as
    # it does the forward's, and the driver pins the values inside.
    recompute = {
        str(op.eqn.source_info.name_stack).split("/", 1)[1]: chosen.strategies[op.outs[0]]
        for op in _dots(exe)
        if isinstance(op.outs[0], Inner) and "rematted_computation" in str(op.eqn.source_info.name_stack)
    }
    for proj in ("query", "key", "value"):
        assert recompute[f"block_0/attn/{proj}"] == "column[model]", recompute
    assert recompute["block_0/attn/bqhd,bkhd->bhqk"] == "heads[model]", recompute
    assert recompute["block_0/attn/bhqk,bkhd->bqhd"] == "heads[model]", recompute
    assert any(isinstance(k, Inner) for k in chosen.pinned)
    hlo = _hlo(exe)
    assert not _collectives(hlo, "bqhd,bkhd->bhqk")
    assert not _collectives(hlo, "bhqk,bkhd->bqhd")
    # Still rematerialised: the recompute sits behind an optimization barrier.
    lowered = [
        fn.lower(*[jax.ShapeDtypeStruct(k[0].aval.shape, k[0].aval.dtype) for k in task.in_keys]).as_text()
        for task, fn in zip(exe.program.tasks, exe.fns, strict=True)
    ]
    assert any("optimization_barrier" in text for text in lowered)


def _scanned_loss(ws, x, b):
    def body(c, w):
        h = jax.numpy.tanh(c @ w + b)
        return h, h.sum()

    c, ys = jax.lax.scan(body, x, ws)
    return (c**2).sum() + ys.sum()


def test_scan_loops_split_into_constants_carries_and_scanned_arrays():
    args = (np.ones((3, 4, 4), np.float32), np.ones((8, 4), np.float32), np.ones(4, np.float32))
    closed = jax.make_jaxpr(jax.value_and_grad(_scanned_loss, argnums=(0, 2)))(*args)
    forward, backward = [e for e in _eqns(closed) if e.primitive.name == "scan"]
    fwd, bwd = compat.scan_loop(forward), compat.scan_loop(backward)
    assert (fwd.num_consts, fwd.num_carry, fwd.length) == (1, 1, 3)  # b; the activation; 3 layers
    assert (bwd.num_consts, bwd.num_carry, bwd.length) == (0, 2, 3)  # b's and x's cotangents carried
    assert not [e for e in _eqns(closed) if e.primitive.name != "scan" and compat.scan_loop(e) is not None]


def test_scan_expands_into_one_iteration_weighted_by_its_length():
    args = (np.ones((3, 4, 4), np.float32), np.ones((8, 4), np.float32), np.ones(4, np.float32))
    closed = jax.make_jaxpr(_scanned_loss)(*args)
    (scan,) = [e for e in _eqns(closed) if e.primitive.name == "scan"]
    ins = tuple(None if compat.is_literal(v) else v for v in scan.invars)
    alias, ties = {}, []
    ops = expand_calls(GraphOp(scan, ins, tuple(scan.outvars), weight=2), alias, ties)
    names = [op.eqn.primitive.name for op in ops]
    assert "scan" not in names and "dot_general" in names
    assert {op.weight for op in ops} == {6}  # 2 runs per step x 3 iterations
    # The stacked weights reach the body one slice at a time ...
    ws = scan.invars[-1]
    (first,) = [op for op in ops if ws in op.ins]
    assert first.eqn.primitive.name in ("slice", "dynamic_slice", "squeeze", "gather")
    # ... the carry out is tied to the carry in, and the results are the body's.
    carry_in = scan.invars[1]
    assert ties == [Tie(out=ties[0].out, into=carry_in, weight=6)]
    assert isinstance(ties[0].out, Inner) and stage_values.alias_root(alias, scan.outvars[0]) == ties[0].out
    stacked = stage_values.alias_root(alias, scan.outvars[1])
    (stack,) = [op for op in ops if stacked in op.outs]
    assert stack.eqn.outvars[0].aval.shape == (1,)  # one slice of the stacked f32[3]


def test_scanned_layer_stack_is_laid_out_inside_its_loop():
    exe, chosen = _gpt_on_one_stage(hidden=256, num_heads=8, num_layers=2, scan_layers=True, remat=True)
    ops, _, ties = intra_op.stage_ops(exe.program, 0)
    assert not [op for op in ops if op.eqn.primitive.name == "scan"]
    assert ties and all(t.weight == 2 for t in ties)  # two layers per loop
    # Inside the forward and backward loops the heads are split, as in an unrolled stack.
    scores = [
        chosen.strategies[op.outs[0]]
        for op in _dots(exe)
        if "bqhd,bkhd->bhqk" in str(op.eqn.source_info.name_stack)
    ]
    assert len(scores) >= 3 and set(scores) == {"heads[model]"}, scores
    hlo = _hlo(exe)
    assert "while" in hlo  # still a loop
    assert not _collectives(hlo, "bqhd,bkhd->bhqk")
    assert not _collectives(hlo, "bhqk,bkhd->bqhd")
