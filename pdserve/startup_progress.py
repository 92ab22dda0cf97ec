"""What `pdserve serve` says while it starts: one line per phase with the seconds since start-up
began (Ray, Redis, the model, each worker as it becomes healthy, ready), so the half minute
of worker start-up is never silent. On a terminal a progress bar of the workers stays beneath
the lines; elsewhere (a pipe, a log file) the lines alone. Embedded apps (tests, benchmarks)
use `StartupProgress.silent()`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO


class StartupProgress:
    def __init__(self, total_workers: int, stream: TextIO | None = sys.stderr) -> None:
        self._began = time.monotonic()
        self._stream = stream
        self._bar = None
        if stream is not None and stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total} workers"),
                TimeElapsedColumn(),
                console=Console(file=stream),
                transient=True,
            )
            self._task = self._bar.add_task("starting", total=total_workers)
            self._bar.start()

    def mute(self) -> None:
        """No more lines (Ctrl-C: the line that says so is the last one)."""
        self.close()
        self._stream = None

    @classmethod
    def silent(cls) -> StartupProgress:
        return cls(0, stream=None)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._began

    def phase(self, text: str) -> None:
        """One line: `text (12.3 s)`."""
        line = f"{text} ({self.elapsed_s:.1f} s)"
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False)
            self._bar.update(self._task, description=text)
        elif self._stream is not None:
            print(line, file=self._stream, flush=True)

    def worker_done(self, text: str) -> None:
        """A worker became healthy or failed to: its line, and one more on the bar."""
        self.phase(text)
        if self._bar is not None:
            self._bar.advance(self._task)

    def close(self) -> None:
        """Removes the bar (the lines stay); call once start-up ended, however it ended."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def weights_size(model_dir: Path) -> str:
    """The checkpoint's size on disk, e.g. "3.1 MiB" (what each worker loads)."""
    files = [*model_dir.glob("*.safetensors"), *model_dir.glob("*.bin")]
    size, unit = float(sum(p.stat().st_size for p in files)), "B"
    for larger in ("KiB", "MiB", "GiB"):
        if size < 1024:
            break
        size, unit = size / 1024, larger
    return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"
