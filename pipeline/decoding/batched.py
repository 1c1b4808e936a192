"""Batched decoding in the reference decoder: several sequences decoded together, each verify cycle ONE
target forward over every row's root and drafts, each row keeping its own accepted length.

Rows of a batch hold different numbers of tokens once they accept different numbers of drafts. Each KV
cache (the target's and the drafter's) keeps, per row, which of its columns are live (`RaggedRows`). A
forward attends to its row's live columns and, inside its own block, causally; its positions count the
row's live tokens. After verify the rejected drafts' columns die and the cache is compacted: each row's
live columns move to the right end, in order (left padding), so the cache is as long as its longest row.

The batch is static: a row that finishes (eos or max_new_tokens) leaves it and no new sequence takes its
slot (serving engines refill it: continuous batching is not modelled, for the baseline and the drafters
alike). Drafts are chains, greedy: every row's output equals its own greedy decoding, token for token.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import torch

from pipeline.decoding.reference_decoder import DecodeResult, NgramProposer
from pipeline.drafter.model import Eagle3Drafter

if TYPE_CHECKING:
    from transformers import DynamicCache

PAD_ID = 0  # the token in a block's padding columns: never live, never accepted


class RaggedRows:
    """Which columns of a batch's KV cache each row holds live ([B, L] bool)."""

    def __init__(self, batch: int) -> None:
        self.live = torch.zeros(batch, 0, dtype=torch.bool)

    @property
    def lengths(self) -> torch.Tensor:
        """Live tokens per row [B]: the position the row's next token takes."""
        return self.live.sum(1)

    def mask(self, block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Additive attention mask [B, 1, q, L + q]: each query sees its row's live columns, and the columns
        of the new block that `block` [B, q, q] allows."""
        batch, width = block.shape[0], block.shape[1]
        allowed = torch.cat([self.live[:, None, :].expand(batch, width, -1), block], dim=2)
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, float("-inf"))
        return mask[:, None]

    def extend(self, kept: torch.Tensor) -> torch.Tensor | None:
        """Append a block's columns (`kept` [B, q]: which stay live), then compact: the index [B, L'] that
        gathers every row's live columns to the right end, in order (None when nothing moves)."""
        live = torch.cat([self.live, kept], dim=1)
        width = int(live.sum(1).max()) if live.numel() else 0
        order = torch.argsort(live.to(torch.int8), dim=1, stable=True)  # dead columns first, each in order
        index = order[:, live.shape[1] - width :]
        if width == live.shape[1] and torch.equal(index, torch.arange(width).expand_as(index)):
            self.live = live
            return None
        self.live = torch.gather(live, 1, index)
        return index

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.live = self.live.index_select(0, rows)


def gather_columns(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """tensor [B, h, L, d] with each row's columns taken by index [B, L']."""
    expanded = index[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
    return torch.gather(tensor, 2, expanded)


def block_of(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids [B, q] and each row's count of real tokens [B]."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([row + [PAD_ID] * (width - len(row)) for row in rows], dtype=torch.long)
    return ids, torch.tensor([len(row) for row in rows])


def causal_block(counts: torch.Tensor, width: int) -> torch.Tensor:
    """[B, q, q]: each real token sees the real tokens up to itself; a padding query sees only itself (a
    row with nothing to attend to would be NaN)."""
    real = torch.arange(width)[None, :] < counts[:, None]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    return (causal[None] & real[:, None, :]) | torch.eye(width, dtype=torch.bool)[None]


class BatchedTarget:
    """The target over a ragged batch, with one KV cache for all rows."""

    def __init__(self, model, aux_layer_ids: list[int] | None):
        self.model = model
        self.hidden_indices = [k + 1 for k in aux_layer_ids] if aux_layer_ids else None
        self.cache: DynamicCache | None = None
        self.rows = RaggedRows(0)

    def reset(self, batch: int) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.rows = RaggedRows(batch)

    def forward(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One forward of a block of tokens per row (right-padded, each row's tokens chained causally):
        greedy next token after each position [B, q], aux states [B, q, 3H] when wanted, and each row's
        count of real tokens [B]. `commit` must follow."""
        ids, counts = block_of(rows)
        width = ids.shape[1]
        positions = self.rows.lengths[:, None] + torch.arange(width)[None, :]
        mask = self.rows.mask(causal_block(counts, width), self.model.dtype)
        kwargs = {"output_hidden_states": self.hidden_indices} if self.hidden_indices else {}
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=0,
            **kwargs,
        )
        aux = None
        if self.hidden_indices:
            aux = torch.cat([out.hidden_states[i] for i in self.hidden_indices], dim=-1)
        return out.logits.argmax(-1), aux, counts

    def commit(self, kept: torch.Tensor) -> None:
        """Keep the last block's columns `kept` [B, q] live, drop the rest, compact the cache."""
        index = self.rows.extend(kept)
        if index is None:
            return
        for layer in self._layers():
            layer.keys = gather_columns(layer.keys, index)
            layer.values = gather_columns(layer.values, index)

    def drop_last_block(self) -> None:
        """Forget the last forward's block without committing it (nothing moves)."""
        width = self.rows.live.shape[1]
        for layer in self._layers():
            layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]

    def keep_rows(self, rows: list[int]) -> None:
        """Only these rows stay in the batch (the others finished)."""
        index = torch.tensor(rows, dtype=torch.long)
        self.rows.keep_rows(index)
        for layer in self._layers():
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)

    def _layers(self):
        from transformers.cache_utils import CacheLayerMixin

        if self.cache is None:
            raise RuntimeError("the batched target has no KV cache yet: call reset() first")
        for layer in self.cache.layers:
            if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
                raise RuntimeError(f"cannot compact a {type(layer).__name__}: no attention keys/values")
            yield layer


class BatchProposer(Protocol):
    def start(self, contexts: list[list[int]], aux: torch.Tensor | None, counts: torch.Tensor) -> None: ...

    def propose(self, contexts: list[list[int]], limits: list[int]) -> list[list[int]]: ...

    def accept(self, contexts: list[list[int]], accepted: list[int], aux: torch.Tensor | None) -> None: ...

    def keep_rows(self, rows: list[int]) -> None: ...


class NgramRows:
    """Prompt-lookup drafting, row by row (it runs on the host; only verification is batched)."""

    def __init__(self, proposer: NgramProposer):
        self.proposer = proposer

    def start(self, contexts, aux, counts) -> None:
        pass

    def propose(self, contexts: list[list[int]], limits: list[int]) -> list[list[int]]:
        return [
            self.proposer.propose(context, limit) for context, limit in zip(contexts, limits, strict=True)
        ]

    def accept(self, contexts, accepted, aux) -> None:
        pass

    def keep_rows(self, rows) -> None:
        pass


class EagleRows:
    """Chain drafting with an EAGLE-3 drafter over the whole batch: one drafter forward per draft step for
    every row, on a ragged KV cache of its own."""

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter
        self.rows = RaggedRows(0)
        self.past: tuple[torch.Tensor, torch.Tensor] | None = None
        self.next_draft = torch.zeros(0, dtype=torch.long)  # [B] target ids
        self.last_hidden: torch.Tensor | None = None  # [B, 1, H]

    def _decode(self, hidden: torch.Tensor, tokens: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """h_out of a block of positions appended to every row; their keys and values join the cache."""
        positions = self.rows.lengths[:, None] + torch.arange(tokens.shape[1])[None, :]
        mask = self.rows.mask(block, hidden.dtype)
        h_out, k, v = self.drafter.decode_rows(hidden, tokens, positions, self.past, mask)
        self.past = (
            (k, v)
            if self.past is None
            else (
                torch.cat([self.past[0], k], dim=2),
                torch.cat([self.past[1], v], dim=2),
            )
        )
        return h_out

    def _extend(self, hidden: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Append each row's first `counts` positions for good; the last one drafts the row's next token."""
        width = tokens.shape[1]
        h_out = self._decode(hidden, tokens, causal_block(counts, width))
        index = self.rows.extend(torch.arange(width)[None, :] < counts[:, None])
        if index is not None and self.past is not None:
            self.past = (gather_columns(self.past[0], index), gather_columns(self.past[1], index))
        self.last_hidden = h_out[torch.arange(h_out.shape[0]), counts - 1][:, None]
        self.next_draft = self._top1(self.last_hidden)

    def _top1(self, h_out: torch.Tensor) -> torch.Tensor:
        return self.drafter.draft_to_target(self.drafter.logits(h_out)[:, -1].argmax(-1))

    def start(self, contexts: list[list[int]], aux: torch.Tensor | None, counts: torch.Tensor) -> None:
        """After prefill: each row's aux rows 0..n-1 pair with its tokens 1..n (n: its first output)."""
        assert aux is not None
        self.rows = RaggedRows(len(contexts))
        self.past = None
        tokens, _ = block_of([context[1:] for context in contexts])
        self._extend(aux[:, : tokens.shape[1]], tokens, counts)

    def propose(self, contexts: list[list[int]], limits: list[int]) -> list[list[int]]:
        """A chain of up to `limits` drafts per row; the drafting positions leave the cache afterwards."""
        if self.last_hidden is None or self.past is None:
            raise RuntimeError("EagleRows.start() must run before drafting")
        drafts = [self.next_draft]
        hidden = self.last_hidden
        saved_live, saved_past = self.rows.live, self.past
        batch = len(contexts)
        for _ in range(max(limits) - 1):
            hidden = self._decode(hidden, drafts[-1][:, None], torch.ones(batch, 1, 1, dtype=torch.bool))
            self.rows.live = torch.cat([self.rows.live, torch.ones(batch, 1, dtype=torch.bool)], dim=1)
            drafts.append(self._top1(hidden))
        self.rows.live, self.past = saved_live, saved_past
        chains = torch.stack(drafts, dim=1).tolist()
        return [chain[:limit] for chain, limit in zip(chains, limits, strict=True)]

    def accept(self, contexts: list[list[int]], accepted: list[int], aux: torch.Tensor | None) -> None:
        """contexts already hold each row's accepted drafts and bonus token; aux [B, q, 3H] is the verify
        forward's, root first."""
        assert aux is not None
        counts = torch.tensor(accepted) + 1
        tokens, _ = block_of(
            [context[len(context) - n :] for context, n in zip(contexts, counts.tolist(), strict=True)]
        )
        self._extend(aux[:, : tokens.shape[1]], tokens, counts)

    def keep_rows(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.long)
        self.rows.keep_rows(index)
        if self.past is not None:
            self.past = (self.past[0].index_select(0, index), self.past[1].index_select(0, index))
        self.next_draft = self.next_draft.index_select(0, index)
        if self.last_hidden is not None:
            self.last_hidden = self.last_hidden.index_select(0, index)


def _finished(output: list[int], max_new_tokens: int, eos_id: int | None) -> bool:
    return len(output) >= max_new_tokens or (eos_id is not None and eos_id in output)


def _result(prompts: list[list[int]], contexts: list[list[int]], max_new_tokens: int, eos_id: int | None):
    """Each row's output after its prompt, cut after eos and at max_new_tokens."""
    rows = []
    for prompt, context in zip(prompts, contexts, strict=True):
        output = context[len(prompt) :]
        if eos_id in output:
            output = output[: output.index(eos_id) + 1]
        rows.append(output[:max_new_tokens])
    return rows


def batched_speculative_decode(
    target: BatchedTarget,
    proposer: BatchProposer | None,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int | None,
    steps: int,
) -> DecodeResult:
    """Every prompt decoded in one batch: greedy one token per forward (`proposer` None), or chains of up
    to `steps` drafts verified in one target forward per cycle. The result's `rows` are the outputs;
    `tokens` is all of them in order, `seconds` the batch's wall time, and acceptance is per row: a cycle
    counts once for every row it verified."""
    started = time.perf_counter()
    target.reset(len(prompts))
    predicted, aux, counts = target.forward(prompts)
    target.commit(torch.arange(predicted.shape[1])[None, :] < counts[:, None])
    contexts = [
        list(p) + [int(predicted[b, n - 1])]
        for b, (p, n) in enumerate(zip(prompts, counts.tolist(), strict=True))
    ]
    if proposer is not None:
        proposer.start(contexts, aux, counts)
    result = DecodeResult([], 0.0, accepted_histogram=[0] * (steps + 1))
    active = list(range(len(prompts)))
    active = _still_running(target, proposer, active, contexts, prompts, max_new_tokens, eos_id)
    while active:
        rows = [contexts[b] for b in active]
        limits = [
            min(steps, max_new_tokens - (len(c) - len(prompts[b]))) for b, c in zip(active, rows, strict=True)
        ]
        drafts = proposer.propose(rows, limits) if proposer is not None else [[] for _ in rows]
        predicted, aux, _ = target.forward(
            [[row[-1]] + chain for row, chain in zip(rows, drafts, strict=True)]
        )
        accepted = [_accepted(chain, predicted[r]) for r, chain in enumerate(drafts)]
        target.commit(torch.arange(predicted.shape[1])[None, :] <= torch.tensor(accepted)[:, None])
        for r, (row, chain, count) in enumerate(zip(rows, drafts, accepted, strict=True)):
            row.extend(chain[:count] + [int(predicted[r, count])])
        if proposer is not None:
            _count_cycles(result, accepted)
            proposer.accept(rows, accepted, aux)
        active = _still_running(target, proposer, active, contexts, prompts, max_new_tokens, eos_id)
    result.rows = _result(prompts, contexts, max_new_tokens, eos_id)
    result.tokens = [token for row in result.rows for token in row]
    result.seconds = time.perf_counter() - started
    return result


def _count_cycles(result: DecodeResult, accepted: list[int]) -> None:
    for count in accepted:
        result.verify_forwards += 1
        result.cycle_tokens += count + 1
        result.accepted_histogram[count] += 1


def _accepted(chain: list[int], predicted: torch.Tensor) -> int:
    count = 0
    while count < len(chain) and chain[count] == int(predicted[count]):
        count += 1
    return count


def _still_running(target, proposer, active, contexts, prompts, max_new_tokens, eos_id) -> list[int]:
    """The active rows that have not finished; finished rows leave the target's and proposer's batch."""
    keep = [
        r
        for r, b in enumerate(active)
        if not _finished(contexts[b][len(prompts[b]) :], max_new_tokens, eos_id)
    ]
    if len(keep) < len(active):
        target.keep_rows(keep)
        if proposer is not None:
            proposer.keep_rows(keep)
    return [active[r] for r in keep]
