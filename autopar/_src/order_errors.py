"""What :mod:`~autopar._src.example_order` says when it refuses a loss function with microbatches.

Each error names the equation and its source line (``at``), the sort whose order it breaks where
there is one (``sort``: the sort equation and its line), and what to do instead.
"""

from __future__ import annotations

from typing import Any

Sort = tuple[Any, str]
"""A sort equation and its source line."""


def _first(e: Any) -> str:
    return repr(str(e).splitlines()[0])


def mixed_orders(e: Any, at: str, sort: Sort | None) -> ValueError:
    """``e`` combines rows in a sort's order (or numbered by position) with rows in another."""
    if sort is None:
        return ValueError(
            f"The loss function combines rows of the batch with their positions (at {at}: "
            f"{_first(e)}). With microbatches each numbers only its own rows, so neither the loss "
            "nor its gradients would be the whole batch's. Use num_microbatches=1."
        )
    return ValueError(
        f"The loss function sorts the examples (at {sort[1]}: {_first(sort[0])}) and then combines "
        f"them, in that order, with what is in another (at {at}: {_first(e)}: the batch's order, "
        "positions such as a weight per rank, or another sort's). With microbatches each sorts only "
        "its own examples, so neither the loss nor its gradients would be the whole batch's. Put "
        "the rows back in the batch's order first (scatter them back, `zeros.at[order].set(y)`, or "
        "gather by the inverse permutation), or use num_microbatches=1."
    )


def rows_not_numbered(e: Any, at: str, sort: Sort, rows: int, numbered: int) -> ValueError:
    """``e`` picks ``rows`` rows by a sort's positions, which number ``numbered``."""
    return ValueError(
        f"The loss function sorts the examples (at {sort[1]}: {_first(sort[0])}) and picks the rows "
        f"of another array by its positions (at {at}: {_first(e)}: {rows} rows, where the "
        f"positions number {numbered}). With microbatches each sorts only its own examples, so "
        "neither the loss nor its gradients would be the whole batch's. Gather and scatter by the "
        "positions the rows they number (`y[order]`, `zeros.at[order].set(y)`; `order // k` for "
        "rows repeated k times), or use num_microbatches=1."
    )


def renumbered(e: Any, at: str, nmb: int) -> ValueError:
    """``e`` compares integers read from the batch with the rows' numbers."""
    return ValueError(
        f"The loss function compares indices read from the batch with the rows' numbers (at {at}: "
        f"{_first(e)}), as a one-hot of partner rows (`jax.nn.one_hot(batch['partner'], n)`) "
        f"does: the indices number the whole batch's rows, while with num_microbatches={nmb} each "
        "microbatch numbers its own from 0, so the loss and its gradients would not be the whole "
        "batch's. Do it in the data pipeline, or use num_microbatches=1."
    )


def positions(e: Any, at: str, made: Any, made_at: str) -> ValueError:
    """``e`` reads the rows' positions as numbers (a weight per row, ranks) with the examples;
    ``made`` made those numbers (``e`` itself, where it does)."""
    numbered = "" if made is e else f", numbered at {made_at}: {_first(made)}"
    return ValueError(
        f"The loss function combines the examples with their positions in the batch (at {at}: "
        f"{_first(e)}{numbered}): a weight per row (`jnp.linspace(a, b, n)`), ranks (a double argsort). With "
        "microbatches each numbers only its own rows, so neither the loss nor its gradients would "
        "be the whole batch's. Compute them in the data pipeline and pass them in the batch, or use "
        "num_microbatches=1."
    )


def pairs(e: Any, at: str, nmb: int) -> ValueError:
    """``e`` reads the positions of pairs of examples (a mask of the diagonal)."""
    return ValueError(
        f"The loss function pairs the examples with each other and reads the pairs' positions (at "
        f"{at}: {_first(e)}), as a triplet loss's hardest negative or a contrastive loss's in-batch "
        f"negatives do: with num_microbatches={nmb} each microbatch would pair only its own "
        "examples, so neither the loss nor its gradients would be the whole batch's. Use "
        "num_microbatches=1."
    )


def reversed_rows(e: Any, at: str, flip: Any, flipped_at: str, nmb: int) -> ValueError:
    """``e`` reads rows reversed along the batch by ``flip`` other than to sort them."""
    return ValueError(
        f"The loss function takes examples by their place in the batch: it reverses the rows (at "
        f"{flipped_at}: {_first(flip)}) and reads them in that order (at {at}: {_first(e)}), as "
        f"mixup's partner `jnp.flip(x, 0)`. With num_microbatches={nmb} each microbatch reverses "
        "only its own rows, so the partners would not be the whole batch's. Rows reversed to be "
        "sorted (`jnp.argsort(x, descending=True)`) are followed. Pick partners in the data "
        "pipeline and pass them in the batch, or use num_microbatches=1."
    )


def positions_returned(name: str) -> ValueError:
    """The aux output ``name`` holds the rows' positions in their microbatch."""
    return ValueError(
        f"{name} holds the rows' positions in their microbatch "
        "(ranks, say): each microbatch numbers only its own rows, so the concatenated values would "
        "not be the whole batch's. Compute them after the step, or use num_microbatches=1."
    )


def sorted_returned(name: str, sort: Sort) -> ValueError:
    """The aux output ``name`` holds a value per example in ``sort``'s order."""
    return ValueError(
        f"{name} holds a value per example in the order of a sort "
        f"(at {sort[1]}: {_first(sort[0])}): with microbatches each sorts only its own examples, so "
        "the concatenated rows would not be the whole batch's. Return them in the batch's order or "
        "use num_microbatches=1."
    )


def placed_by_position(e: Any, at: str, placed: Any, placed_at: str) -> ValueError:
    """``e`` reads rows placed by position where the traces differ (a Python loop over rows)."""
    return ValueError(
        f"The loss function places rows by their position in the batch (at {placed_at}: "
        f"{_first(placed)}), and its trace differs between one microbatch and the whole batch "
        "beyond the shapes, as a Python loop over the rows (`[f(row) for row in x]`) makes it; "
        f"what is made from them (at {at}: {_first(e)}) may mix examples by their positions, "
        "which with microbatches number only each microbatch's own. Write the per-example "
        "computation with jax.vmap, or use num_microbatches=1."
    )


def rows_one_by_one(e: Any, at: str) -> ValueError:
    """``e`` (``unstack``) takes the batch's rows one by one, where the traces differ."""
    return ValueError(
        f"The loss function takes the batch's rows one by one (at {at}: {_first(e)}), as a Python "
        "loop over the rows (`[f(row) for row in x]`) does: its trace differs there between one "
        "microbatch and the whole batch, and the rows cannot be followed through the loop (a sum "
        "of them by `+`, or a few of them, would not be the whole batch's with microbatches). "
        "Write the per-example computation with jax.vmap, or use num_microbatches=1."
    )


def misplaced(e: Any, at: str, sort: Sort) -> ValueError:
    """``e`` picks rows by a sort's positions that number rows laid out otherwise."""
    return ValueError(
        f"The loss function sorts the examples (at {sort[1]}: {_first(sort[0])}) and picks rows by "
        f"its positions that are laid out otherwise than the sorted ones (at {at}: {_first(e)}): "
        "`order // k` names each copy's row only where the sorted values are each row's k copies "
        "side by side (`x.reshape(-1)` of [n, k], `jnp.repeat`), not runs of all the rows "
        "(`jnp.concatenate([a, b])`, `jnp.tile`), and an iota gathered by it must be laid out as "
        "the sorted values. With microbatches the rows would be other examples' than the whole "
        "batch's. Lay them out alike, or use num_microbatches=1."
    )


def mixed_layouts(e: Any, at: str) -> ValueError:
    """``e`` combines rows laid out as copies of the examples with runs of them."""
    return ValueError(
        f"The loss function combines rows laid out as runs of all the examples one after the other "
        f"(`jnp.concatenate([a, b])`, `jnp.tile`, `x.T.reshape(-1)`) with rows laid out otherwise "
        f"(at {at}: {_first(e)}): a microbatch's runs are its own examples', so its rows would meet "
        "other examples' than the whole batch's. Lay them out alike (`jnp.stack([a, b], 1)"
        ".reshape(-1)` for copies side by side), or use num_microbatches=1."
    )


def split_examples(e: Any, at: str, nmb: int) -> ValueError:
    """``e`` splits rows along the batch otherwise than into the runs they are laid out in."""
    return ValueError(
        f"The loss function takes examples by their place in the batch (at {at}: {_first(e)}): it "
        f"splits the rows into parts, and with num_microbatches={nmb} each microbatch would split its "
        "own examples, so a part would hold other examples than the whole batch's part. Split along "
        "another dim, split only runs of all the examples (`jnp.concatenate([a, b])`) back into them, "
        "or use num_microbatches=1."
    )


def tiled_returned(name: str) -> ValueError:
    """The aux output ``name`` holds rows laid out as runs of all the examples."""
    return ValueError(
        f"{name} holds rows laid out as runs of all the examples one "
        "after the other (`jnp.concatenate([a, b])`, `jnp.tile`): the microbatches' values "
        "concatenated would not be the whole batch's. Return them with one dim per example, or use "
        "num_microbatches=1."
    )
