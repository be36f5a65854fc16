"""argparse types for numbers, shared by the command line and the benchmarks' own arguments, so that a
bad value is refused while parsing (one line, exit 2) and not deep inside a run."""

from __future__ import annotations

import argparse
import math


def number(kind, low: float, inclusive: bool = True):
    """An argparse type: a finite ``kind`` >= ``low`` (> ``low`` when not ``inclusive``)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole number' if kind is int else 'number'}") from None
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"{text} must be {'>=' if inclusive else '>'} {low:g}")
        return value

    return parse


POSITIVE_INT, NONNEG_INT = number(int, 1), number(int, 0)
POSITIVE, NONNEG = number(float, 0, inclusive=False), number(float, 0)
