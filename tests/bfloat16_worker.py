"""Run by test_bfloat16.py in its own process, with XLA's excess precision off: a bfloat16
model's step through autopar on two stages of one device each equals ``jax.jit``'s, bit for bit.

Usage: ``python bfloat16_worker.py NUM_MICROBATCHES``; prints one JSON line with the largest
difference of the losses and parameters over three steps.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=2 --xla_allow_excess_precision=false"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import autopar  # noqa: E402

VOCAB, D = 64, 32


class MixedPrecisionLM(nn.Module):
    """float32 parameters, bfloat16 compute, a float32 head."""

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, D, dtype=jnp.bfloat16)(ids)
        for _ in range(4):
            h = nn.LayerNorm(dtype=jnp.bfloat16)(x)
            x = x + nn.Dense(D, dtype=jnp.bfloat16)(jax.nn.gelu(nn.Dense(2 * D, dtype=jnp.bfloat16)(h)))
        return nn.Dense(VOCAB, dtype=jnp.float32)(x.astype(jnp.float32))


def main(num_microbatches: int) -> None:
    net = MixedPrecisionLM()
    rng = np.random.default_rng(0)
    batches = [{"ids": rng.integers(0, VOCAB, (8, 8)).astype(np.int32)} for _ in range(3)]
    params = net.init(jax.random.key(0), batches[0]["ids"])["params"]

    def step(params, batch):
        def loss_fn(p):
            logits = net.apply({"params": p}, batch["ids"])
            labels = jnp.roll(batch["ids"], -1, axis=1)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = autopar.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss

    par = autopar.autoparallel(step, num_stages=2, num_microbatches=num_microbatches)
    ref = jax.jit(step)
    p_par = p_ref = params
    worst = 0.0
    for batch in batches:
        (p_par, l_par), (p_ref, l_ref) = par(p_par, batch), ref(p_ref, batch)
        pairs = zip(jax.tree.leaves((p_par, l_par)), jax.tree.leaves((p_ref, l_ref)), strict=True)
        worst = max(worst, *(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs))
    moved = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(p_par), jax.tree.leaves(params), strict=True)
    )
    print(json.dumps({"largest_difference": worst, "largest_update": moved}))


if __name__ == "__main__":
    main(int(sys.argv[1]))
