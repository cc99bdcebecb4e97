"""How a loop over the examples updates its carries: a running sum (``c + x``, ``c - x``,
``c.at[i].add(x)``, under a ``jnp.where`` or not), a running max or min, or something else;
and a generic ``lax.reduce``'s combiner. Used by :mod:`autopar._src.batch_scaling`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autopar._src import compat

_SAME = frozenset({"convert_element_type", "copy", "copy_p"})


class Links:
    """Which equation makes each value of a loop body, the nested ``jit`` calls in it (a
    ``jnp.where``) looked through: their bodies' values stand for their operands and results."""

    def __init__(self, eqns: Sequence[Any]):
        self.made: dict[Any, Any] = {}
        self.alias: dict[Any, Any] = {}
        self._add(eqns)

    def _add(self, eqns: Sequence[Any]) -> None:
        for q in eqns:
            inner = compat.operand_body(q) if compat.is_call(q) else None
            if inner is None:
                self.made.update((v, q) for v in q.outvars)
                continue
            self.alias.update(zip(inner.invars, q.invars, strict=True))
            self.alias.update(zip(q.outvars, inner.outvars, strict=True))
            self._add(inner.eqns)

    def source(self, atom: Any) -> Any:
        """``atom`` before any calls, casts or copies."""
        while not compat.is_literal(atom):
            if atom in self.alias:
                atom = self.alias[atom]
            elif atom in self.made and self.made[atom].primitive.name in _SAME:
                atom = self.made[atom].invars[0]
            else:
                break
        return atom

    def reads(self, atom: Any, var: Any) -> bool:
        """Whether ``atom`` is computed from ``var``."""
        stack, seen = [atom], set()
        while stack:
            a = stack.pop()
            if compat.is_literal(a) or a in seen:
                continue
            if a is var:
                return True
            seen.add(a)
            if a in self.alias:
                stack.append(self.alias[a])
            elif a in self.made:
                stack.extend(self.made[a].invars)
        return False


def update(v: Any, carried: Any, links: Links, depth: int = 0) -> tuple[str, list[Any], Any]:
    """How one iteration updates the carry ``carried`` to ``v``: ``("same", [], None)``,
    ``("sum", what it adds, eqn)`` (``c + x``, ``c - x``, ``c.at[i].add(x)``, also under a
    ``jnp.where`` keeping ``c``), ``("extreme", [], eqn)`` (a max or min), or
    ``("other", [], eqn)``."""
    v = links.source(v)
    if v is carried:
        return "same", [], None
    q = links.made.get(v)
    if q is None:
        return "other", [], None
    name, sources = q.primitive.name, [links.source(a) for a in q.invars]
    term = None
    if name in ("add", "add_any") and sources.count(carried) == 1:
        term = next(a for a, src in zip(q.invars, sources, strict=True) if src is not carried)
    elif name == "sub" and sources[0] is carried and sources[1] is not carried:
        term = q.invars[1]
    elif name == "scatter-add" and sources[0] is carried:
        term = q.invars[2]
    if term is not None:  # a running mean's term reads the carry: no plain sum
        read = links.reads(term, carried) or (name == "scatter-add" and links.reads(q.invars[1], carried))
        return ("other", [], q) if read else ("sum", [links.source(term)], q)
    if name in ("max", "min") and carried in sources:
        return "extreme", [], q
    if name == "select_n" and depth < 4:  # jnp.where(keep, c + x, c)
        cases = [update(a, carried, links, depth + 1) for a in q.invars[1:]]
        kinds = {kind for kind, _, _ in cases}
        if kinds <= {"same", "sum"} and "sum" in kinds:
            return "sum", [t for _, terms, _ in cases for t in terms], q
        if kinds <= {"same", "extreme"} and "extreme" in kinds:
            return "extreme", [], q
    return "other", [], q


def combiner(e: Any) -> str | None:
    """The one primitive a generic ``reduce`` combines with (``lax.reduce(x, 0., lambda a, b:
    a + b, ...)``), or None."""
    found = compat.sub_jaxprs(e)
    eqns = found[0].eqns if len(found) == 1 else []
    return eqns[0].primitive.name if len(eqns) == 1 else None
