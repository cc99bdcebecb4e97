"""``autopar demo``: plan and train a small GPT on simulated CPU devices."""

from __future__ import annotations

import time

from autopar._src.schedule import ScheduleName


def run(
    *,
    num_devices: int,
    num_stages: int,
    num_microbatches: int,
    schedule: ScheduleName,
    steps: int,
    batch_size: int,
) -> int:
    """Trains gpt-small for ``steps`` steps through autopar; prints plan and losses.

    Returns:
      The process exit status (0 when autopar's first step matches ``jax.jit``).
    """
    import jax

    # Simulated devices must be configured before JAX starts its CPU backend.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", num_devices)
    import numpy as np
    import optax
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    import autopar
    from models import train

    console = Console()
    config = train.GPTConfig.preset("gpt-small")
    step, state = train.setup("gpt", "linen", config, optax.adamw(3e-3))
    batches = [train.make_batch("gpt", config, batch_size, seed=i) for i in range(steps)]
    par = autopar.autoparallel(
        step, num_stages=num_stages, num_microbatches=num_microbatches, schedule=schedule
    )
    console.print(
        f"[bold]autopar demo[/bold]: GPT ({config.num_layers} layers, hidden {config.hidden}, "
        f"vocab {config.vocab_size}), batch {batch_size}, {jax.device_count()} CPU devices"
    )
    t0 = time.perf_counter()
    plan = par.plan(state, batches[0])
    console.print(str(plan))
    console.print(f"planned in {time.perf_counter() - t0:.1f} s (stages compile at the first step)")

    _, ref_loss = jax.jit(step)(state, batches[0])
    losses = []
    with Progress(console=console, transient=False) as progress:
        task = progress.add_task("training", total=steps)
        t_start = time.perf_counter()
        for i, batch in enumerate(batches):
            state, loss = par(state, batch)
            losses.append(float(loss))
            if i == 0:
                t_start = time.perf_counter()
            progress.update(task, advance=1, description=f"training  loss {losses[-1]:.4f}")
        elapsed = time.perf_counter() - t_start
    table = Table(title="losses")
    table.add_column("step")
    table.add_column("loss")
    for i in sorted({*range(0, steps, max(1, steps // 6)), steps - 1}):
        table.add_row(str(i), f"{losses[i]:.4f}")
    console.print(table)
    diff = abs(losses[0] - float(ref_loss))
    ok = bool(np.isclose(losses[0], float(ref_loss), rtol=1e-5, atol=1e-6))
    console.print(
        f"first-step loss vs single-device jax.jit: {losses[0]:.6f} vs {float(ref_loss):.6f} "
        f"(|diff| {diff:.1e}) {'OK' if ok else 'MISMATCH'}"
    )
    if steps > 1:
        console.print(f"{(steps - 1) / elapsed:.1f} steps/s after the first step")
    return 0 if ok else 1
