"""bfloat16 compute: autopar's cuts change no rounding of their own.

XLA keeps fused bfloat16 operations' intermediate values in float32 unless told not to
(``--xla_allow_excess_precision``), so a fusion that a stage boundary cuts rounds where
``jax.jit``'s does not. With that off, every bfloat16 operation rounds alike in both, and a
step over two stages of one device each equals ``jax.jit``'s bit for bit. With microbatches,
each microbatch's bfloat16 weight gradient is rounded before the float32 sum, where ``jax.jit``
rounds the whole batch's once: those differ by bfloat16 rounding (the user guide says so).
"""

import json
import os
import subprocess
import sys

WORKER = os.path.join(os.path.dirname(__file__), "bfloat16_worker.py")


def _run(num_microbatches: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    proc = subprocess.run(
        [sys.executable, WORKER, str(num_microbatches)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_bfloat16_step_over_two_stages_equals_jit_bit_for_bit():
    report = _run(1)
    assert report["largest_update"] > 1e-3  # training moved the parameters
    assert report["largest_difference"] == 0.0, report
