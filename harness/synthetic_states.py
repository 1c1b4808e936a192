"""Synthetic hidden states of any width, for the SGLang stand-in: capture at Kimi-K2.5's width on a CPU.

A transformers forward of a 32K-token sequence at width 7168 does not fit this machine, but what the
capture client has to survive is the response, not the model: with --synthetic-hidden-size H the stand-in
answers return_hidden_states requests from fixed synthetic weights instead of a forward. Every token's
aux row is its row of a bf16 table [vocab, 3H] (bf16 values, as SGLang's bf16 targets give, so the JSON
has their length), sent as SGLang 0.5.23 sends it: the float32 tensor's .tolist() through orjson (each
table row serialised once and reused). Top-K log-probs come from a fixed rule. The body streams out a few
hundred rows at a time, so the server never holds it whole, and whoever reads the capture can recompute
every value (SyntheticStates.rows).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson
import torch

ROWS_PER_PIECE = 256
_MARK = "\u0000hidden-states\u0000"


class SyntheticStates:
    """Fixed synthetic weights: TABLE_ROWS rows of 3H bf16 values; token t's aux row is row t % TABLE_ROWS."""

    TABLE_ROWS = 256

    def __init__(self, vocab_size: int, hidden_size: int, seed: int = 0):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        generator = torch.Generator().manual_seed(seed)
        table = torch.randn(self.TABLE_ROWS, 3 * hidden_size, generator=generator) * 2
        self.table = table.to(torch.bfloat16).float().numpy()  # bf16 values, float32 as SGLang sends them
        self._row_json: list[bytes] | None = None

    def rows(self, ids: list[int]) -> np.ndarray:
        """The aux rows [len(ids), 3H] (float32) a capture of these token ids returns."""
        return self.table[np.asarray(ids, dtype=np.int64) % self.TABLE_ROWS]

    def topk(self, ids: list[int], k: int) -> list[list[list[Any]]]:
        """Per position, SGLang's top-K entries [logprob, token id, text]: ids following the token, log-probs
        falling by 0.5."""
        return [
            [[-0.5 * (j + 1), (token + j + 1) % self.vocab_size, None] for j in range(k)] for token in ids
        ]

    def response(self, request: dict[str, Any], ids: list[int], eos: int) -> Iterator[bytes]:
        """A /generate response to a capture request (max_new_tokens 1) over `ids`, in pieces."""
        meta: dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": len(ids),
            "completion_tokens": 1,
            "cached_tokens": 0,
            "hidden_states": _MARK,
        }
        if request.get("return_logprob") and request.get("top_logprobs_num"):
            rows = self.topk(ids, int(request["top_logprobs_num"]))
            meta["input_top_logprobs"] = [None] + rows[:-1]
            meta["output_top_logprobs"] = rows[-1:]
        head, tail = orjson.dumps({"text": "", "output_ids": [eos], "meta_info": meta}).split(
            orjson.dumps(_MARK)
        )
        yield head + b"[["
        row_bytes = self.row_json()
        for start in range(0, len(ids), ROWS_PER_PIECE):
            piece = b",".join(row_bytes[t % self.TABLE_ROWS] for t in ids[start : start + ROWS_PER_PIECE])
            yield (b"," if start else b"") + piece
        yield b"]]" + tail

    def row_json(self) -> list[bytes]:
        """Each table row as SGLang's response writes it: the float32 values as .tolist()'s doubles through
        orjson (serialised once: the same bytes, without serialising a 7 GB body row by row)."""
        if self._row_json is None:
            self._row_json = [
                orjson.dumps(row.astype(np.float64), option=orjson.OPT_SERIALIZE_NUMPY) for row in self.table
            ]
        return self._row_json
