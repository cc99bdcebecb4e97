"""The command line's argument types: each checks one value before any work and says what it
expected (argparse prints the message with the argument's name)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

CPU_PRESET_SUFFIXES = ("-tiny", "-small")
"""``compare`` and ``bench`` run models on simulated CPU devices: only presets named like this
(and ``mlp``) are small enough; the others are the published sizes, for ``plan`` only."""


def int_at_least(minimum: int, *, auto: bool = False) -> Callable[[str], int | str]:
    """argparse type: an integer >= ``minimum`` (or ``"auto"``, with ``auto``)."""
    expected = ("a positive integer" if minimum == 1 else f"an integer >= {minimum}") + (
        " or 'auto'" if auto else ""
    )

    def parse(text: str) -> int | str:
        if auto and text == "auto":
            return text
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
positive_int_or_auto = int_at_least(1, auto=True)


def preset_name(text: str) -> str:
    """argparse type: the name of a model preset of ``models.registry``."""
    from models import registry

    if text not in registry.names():
        raise argparse.ArgumentTypeError(
            f"unknown model {text!r}; choose one of {', '.join(registry.names())}"
        )
    return text


def cpu_presets() -> list[str]:
    """The presets small enough to run on simulated CPU devices (``compare``, ``bench``)."""
    from models import registry

    return [n for n in registry.names() if n == "mlp" or n.endswith(CPU_PRESET_SUFFIXES)]


def cpu_preset_name(text: str) -> str:
    """argparse type: a preset of :func:`cpu_presets`."""
    from models import registry

    allowed = ", ".join(cpu_presets())
    if text not in registry.names():
        raise argparse.ArgumentTypeError(f"unknown model {text!r}; choose one of {allowed}")
    if text not in cpu_presets():
        raise argparse.ArgumentTypeError(
            f"{text!r} is too large to run on simulated CPU devices; choose one of {allowed} "
            f"(larger presets can be planned without running them: autopar plan --model {text} "
            "--cluster 1x8xA100)"
        )
    return text


def cluster_text(text: str) -> Any:
    """argparse type: a ``HOSTSxDEVICESxKIND`` cluster, parsed into a ``ClusterSpec``."""
    from autopar._src.cluster import parse_cluster

    try:
        return parse_cluster(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cluster_file(path: str) -> Any:
    """argparse type: a ``ClusterSpec`` JSON file (as ``autopar calibrate --out`` writes), loaded."""
    from autopar._src.cluster import ClusterSpec

    try:
        return ClusterSpec.load(path)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {e.strerror}") from None
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def output_path(path: str) -> str:
    """argparse type: a file path whose directory exists, checked before the work that would write it."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is a directory; expected a file path inside one")
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(
            f"the directory {directory!r} of {path!r} does not exist; create it or choose another path"
        )
    if not os.access(directory, os.W_OK):
        raise argparse.ArgumentTypeError(f"the directory {directory!r} of {path!r} is not writable")
    return path
