"""Command line: ``python -m autopar`` / ``autopar``."""

from __future__ import annotations

import argparse
import sys

EPILOG = """examples:
  python -m autopar demo                      # GPT on 8 simulated CPU devices, 2 stages x 4 microbatches
  python -m autopar demo --stages 4 --microbatches 8 --schedule gpipe --steps 20
  autopar plan --model gpt-2.6b --cluster 1x8xV100 --json out.json --timeline out.png
  autopar compare --model gpt-tiny --manual megatron
  autopar bench --model gpt-small --stages 1 2 4
  autopar calibrate --devices 8 --out cluster.json   # measure devices -> a cluster spec file
  autopar plan --model gpt-1.3b --cluster-file cluster.json
"""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``autopar`` command.

    Argument errors, and errors a user can cause while a command runs (``ValueError``, among
    them autopar's ``NoFeasiblePlanError`` and bad JSON, and ``OSError``), end the program
    with one ``autopar <command>: error: <message>`` line on stderr and exit status 2;
    anything else is a bug and propagates with its traceback.
    """
    from autopar._src import cli
    from autopar._src.cli_args import positive_int

    parser = argparse.ArgumentParser(
        prog="autopar",
        description="Automatic pipeline and sharding plans for JAX train steps.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="plan and train a small GPT on simulated CPU devices",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--devices", type=positive_int, default=8, help="simulated CPU devices (default 8)")
    demo.add_argument("--stages", type=positive_int, default=2, help="pipeline stages (default 2)")
    demo.add_argument(
        "--microbatches", type=positive_int, default=4, help="microbatches per step (default 4)"
    )
    demo.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    demo.add_argument("--steps", type=positive_int, default=30, help="training steps (default 30)")
    demo.add_argument("--batch-size", type=positive_int, default=32)
    cli.add_commands(sub)
    cli.add_bench(sub)
    cli.add_calibrate(sub)
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (ValueError, OSError) as e:
        # json.JSONDecodeError, NoFeasiblePlanError and NoLayoutFitsError are ValueErrors.
        print(f"{sub.choices[args.command].prog}: error: {_message(e)}", file=sys.stderr)
        raise SystemExit(2) from None


def _message(error: BaseException) -> str:
    """``error`` as one line."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        text = f"{error.strerror}: {error.filename!r}"
    else:
        text = str(error) or type(error).__name__
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _run(args: argparse.Namespace) -> int:
    from autopar._src import cli

    if args.command == "calibrate":
        return cli.run_calibrate(args)
    if args.command == "bench":
        return cli.run_bench(args)
    if args.command == "plan":
        return cli.run_plan(args)
    if args.command == "compare":
        return cli.run_compare(args)
    if args.command == "demo":
        from autopar._src import demo as demo_mod

        return demo_mod.run(
            num_devices=args.devices,
            num_stages=args.stages,
            num_microbatches=args.microbatches,
            schedule=args.schedule,
            steps=args.steps,
            batch_size=args.batch_size,
        )
    raise AssertionError(f"unhandled command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
