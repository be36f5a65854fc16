"""Progress of the checkpoint tools on stderr: files and GB done, rate, ETA.

On a terminal it is a ``tqdm`` bar; otherwise (a log file, a pipe, a batch job) one plain line
every ``MEGATRON_EXT_PROGRESS_INTERVAL`` seconds (default 10) and a last line when done, so a job
log shows that a long verify of a 1 TB checkpoint is moving without filling up with carriage
returns, and a command that fails within the first seconds still prints its one error line only.
``quiet`` (the commands' ``-q``) shows nothing.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO


def _size(nbytes: float, like: float | None = None) -> str:
    """GB, or MB below 1 GB (``like`` picks the unit: a total's, so done/total share it)."""
    scale = like if like is not None else nbytes
    return f"{nbytes / 1e9:.2f} GB" if scale >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """``update(nbytes, files)`` as work is done; ``close()`` (or the ``with`` block's end) prints the last line."""

    def __init__(self, what: str, total_bytes: int | None = None, total_files: int | None = None, *,
                 quiet: bool = False, stream: TextIO | None = None, interval: float | None = None):
        self._bar = None
        self.what, self.total_bytes, self.total_files = what, total_bytes, total_files
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.bytes = 0
        self.files = 0
        self.started = time.monotonic()
        self._first_byte: float | None = None  # the rate counts from the first byte (after set-up phases)
        self._closed = False
        if interval is None:
            try:
                interval = float(os.environ.get("MEGATRON_EXT_PROGRESS_INTERVAL", "10"))
            except ValueError:
                interval = 10.0
        self.interval = interval
        self._last = self.started
        if quiet:
            return
        if _is_tty(self.stream):
            try:
                from tqdm import tqdm
            except ImportError:  # an install without it (a bare GPU node): the plain lines
                return
            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1000, desc=what,
                             file=self.stream, dynamic_ncols=True, leave=True)
            self._postfix()

    @property
    def total_bytes(self) -> int | None:
        return self._total_bytes

    @total_bytes.setter
    def total_bytes(self, value: int | None) -> None:
        """Known only once the work is planned (export, convert): the bar follows."""
        self._total_bytes = value
        if self._bar is not None:
            self._bar.total = value
            self._bar.refresh()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close(failed=exc[0] is not None)

    def update(self, nbytes: int = 0, files: int = 0) -> None:
        if nbytes and self._first_byte is None:
            self._first_byte = time.monotonic()
        self.bytes += nbytes
        self.files += files
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.update(nbytes)
            if files:
                self._postfix()
            return
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self._line()

    def note(self, text: str) -> None:
        """A one-off line (a phase without byte counts, such as megatron-core's own save)."""
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.write(f"{self.what}: {text}", file=self.stream)
        elif time.monotonic() - self.started >= self.interval:  # a long run: say what it does now
            print(f"{self.what}: {text} ({self.status()})", file=self.stream, flush=True)

    def close(self, failed: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.close()
        if failed:
            if self._bar is None and time.monotonic() - self.started >= self.interval:
                self._line("stopped")
            return
        self._line("done")

    # ------------------------------------------------------------------ text
    def status(self, final: bool = False) -> str:
        now = time.monotonic()
        elapsed = max(now - self.started, 1e-9)
        moving = max(now - (self._first_byte if self._first_byte is not None else self.started), 1e-9)
        parts = []
        if self.total_files is not None:
            parts.append(f"{self.files}/{self.total_files} files")
        elif self.files:
            parts.append(f"{self.files} files")
        if self.total_bytes is not None:
            total = _size(self.total_bytes)
            parts.append(f"{_size(self.bytes, self.total_bytes).split()[0]}/{total}")
        else:
            parts.append(_size(self.bytes))
        rate = self.bytes / moving
        parts.append(f"{_size(rate)}/s")
        if not final and self.total_bytes and 0 < self.bytes < self.total_bytes and rate > 0:
            parts.append(f"ETA {_duration((self.total_bytes - self.bytes) / rate)}")
        parts.append(f"elapsed {_duration(elapsed)}")
        return ", ".join(parts)

    def _postfix(self) -> None:
        if self._bar is not None and self.total_files is not None:
            self._bar.set_postfix_str(f"{self.files}/{self.total_files} files", refresh=False)

    def _line(self, state: str = "") -> None:
        print(f"{self.what}: {state + ': ' if state else ''}{self.status(final=bool(state))}", file=self.stream,
              flush=True)


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


__all__ = ["Progress"]
