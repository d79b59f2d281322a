"""The figures line every reliability scenario prints (the README quotes them)."""

from __future__ import annotations


def report(scenario: str, **figures) -> None:
    """Prints ``RELIABILITY <scenario> key=value ...``."""
    line = " ".join(f"{key}={value}" for key, value in figures.items())
    print(f"RELIABILITY {scenario} {line}", flush=True)
