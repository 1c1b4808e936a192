"""Hidden-state rows that may live in a local file instead of memory.

A 32K-token sample at Kimi-K2.5's width is 2.8 GB of float32 aux states. An engine that cannot promise
to hold that (SGLang's HTTP capture) writes the rows to a local file and hands over SpilledRows; whoever
reads them takes a bounded chunk of rows at a time. Tensors and spilled rows are read alike by row_chunks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

CHUNK_BYTES = 16 << 20  # float32 rows read (and encoded) at a time: 195 rows at Kimi-K2.5's aux width


class SpilledRowsError(ValueError):
    pass


@dataclass(frozen=True)
class SpilledRows:
    """A [rows, width] float32 matrix kept in a local file (row-major, raw) instead of in memory: what a
    capture too large to hold becomes. Read back a chunk of rows at a time."""

    path: Path
    rows: int
    width: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.width)

    def chunks(self, rows_per_chunk: int) -> Iterator[torch.Tensor]:
        with open(self.path, "rb") as handle:
            for start in range(0, self.rows, rows_per_chunk):
                count = min(rows_per_chunk, self.rows - start)
                values = np.fromfile(handle, dtype=np.float32, count=count * self.width)
                if values.size != count * self.width:
                    raise SpilledRowsError(f"{self.path} ends before its {self.rows} rows")
                yield torch.from_numpy(values).view(count, self.width)

    def load(self) -> torch.Tensor:
        """All rows in memory, the file removed."""
        values = np.fromfile(self.path, dtype=np.float32)
        if values.size != self.rows * self.width:
            raise SpilledRowsError(f"{self.path} holds {values.size} floats, not {self.rows} x {self.width}")
        self.discard()
        return torch.from_numpy(values).view(self.rows, self.width)

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


Rows = torch.Tensor | SpilledRows


def loaded(rows: Rows) -> torch.Tensor:
    return rows.load() if isinstance(rows, SpilledRows) else rows


def rows_per_chunk(width: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // max(4 * width, 1))


def row_chunks(rows: Rows, chunk_bytes: int = CHUNK_BYTES) -> Iterator[torch.Tensor]:
    """The rows of a tensor or a spilled matrix, a bounded chunk at a time."""
    per_chunk = rows_per_chunk(rows.shape[1] if len(rows.shape) > 1 else 1, chunk_bytes)
    if isinstance(rows, SpilledRows):
        yield from rows.chunks(per_chunk)
    else:
        yield from rows.split(per_chunk)
