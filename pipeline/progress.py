"""Progress for long work: a bar in a terminal, periodic log lines elsewhere (Airflow, CI)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator, Sized
from typing import Generic

from typing_extensions import TypeVar

T = TypeVar("T", default=object)  # updated by hand (no iterable): a Progress[object]
log = logging.getLogger("pipeline.progress")


class Progress(Generic[T]):
    """Wraps an iterable (or is updated by hand) and reports progress.

    With a terminal on stderr it draws a tqdm bar; otherwise it logs one line every
    `log_interval_s` seconds and one at the end, so task logs show work moving.
    """

    def __init__(
        self,
        iterable: Iterable[T] | None = None,
        total: int | None = None,
        desc: str = "",
        unit: str = "it",
        log_interval_s: float = 30.0,
        enabled: bool = True,
    ) -> None:
        self.iterable = iterable
        self.total = total if total is not None else _length(iterable)
        self.desc = desc
        self.unit = unit
        self.count = 0
        self.log_interval_s = log_interval_s
        self.started = time.monotonic()
        self.last_log = self.started
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=desc, unit=unit, dynamic_ncols=True, leave=False)
        self.enabled = enabled

    def __iter__(self) -> Iterator[T]:
        assert self.iterable is not None
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def update(self, n: int = 1) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if self.enabled and now - self.last_log >= self.log_interval_s:
            self.last_log = now
            log.info("%s", self._line(now))

    def _line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        rate = self.count / elapsed
        line = f"{self.desc}: {self.count}"
        if self.total:
            eta = (self.total - self.count) / rate if rate > 0 else float("inf")
            line += f"/{self.total} ({100 * self.count / self.total:.0f}%, eta {eta:.0f}s)"
        return line + f", {rate:.1f} {self.unit}/s, {elapsed:.0f}s elapsed"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.enabled and self.count:
            log.info("%s (done)", self._line(time.monotonic()))
        self.enabled = False


def _length(iterable: Iterable[object] | None) -> int | None:
    if not isinstance(iterable, Sized):
        return None
    try:
        return len(iterable)
    except TypeError:  # a __len__ that refuses (e.g. a DataLoader over an IterableDataset)
        return None
