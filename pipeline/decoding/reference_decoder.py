"""A small reference speculative decoder over a transformers target (batch size 1).

It exists to measure, on a CPU, what SGLang measures on GPUs: tokens per second and acceptance
length of plain decoding, n-gram (prompt-lookup) speculation and an EAGLE-3 drafter, all on the same
target forward code. Every method verifies drafts in ONE target forward over the KV cache. Greedy (no
`sampling`), it keeps only tokens equal to the target's own greedy choice, so outputs equal plain greedy
decoding; at temperature > 0 it verifies by SGLang's target-only rule (pipeline.decoding.sampling), so
outputs are draws from the target's own sampling distribution.

Acceptance length counts the bonus token: per verify cycle, accepted drafts + 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from pipeline.decoding import sampling as sampled
from pipeline.decoding.sampling import Sampling
from pipeline.drafter.model import DraftCache, Eagle3Drafter

if TYPE_CHECKING:
    from transformers import DynamicCache


@dataclass
class DecodeResult:
    tokens: list[int]
    seconds: float
    verify_forwards: int = 0
    cycle_tokens: int = 0  # tokens produced by verify cycles, before truncation at the end
    accepted_histogram: list[int] = field(default_factory=list)  # cycles that accepted 0..K drafts
    rows: list[list[int]] = field(default_factory=list)  # a batch's outputs, one per sequence (batched.py)

    @property
    def acceptance_length(self) -> float:
        return self.cycle_tokens / self.verify_forwards if self.verify_forwards else 0.0


class TargetRunner:
    """The target with a KV cache; returns greedy next tokens and (optionally) aux hidden states."""

    def __init__(self, model, aux_layer_ids: list[int] | None):
        from transformers import DynamicCache

        self.model = model
        self._cache_cls = DynamicCache
        self.hidden_indices = [k + 1 for k in aux_layer_ids] if aux_layer_ids else None
        self.cache: DynamicCache | None = None
        self.last_logits: torch.Tensor | None = None  # [T, V] of the last forward

    def distributions(self, sampling: Sampling) -> torch.Tensor:
        """The target's sampling distribution after each position of the last forward [T, V]."""
        if self.last_logits is None:
            raise RuntimeError("the target runner has not run a forward yet")
        return sampled.target_distribution(self.last_logits, sampling)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    def _started_cache(self) -> DynamicCache:
        if self.cache is None:
            raise RuntimeError("the target runner has no KV cache yet: call reset() first")
        return self.cache

    def reset(self) -> None:
        self.cache = self._cache_cls(config=self.model.config)

    def forward(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy next token after each given position [T], and aux states [T, 3H] when wanted."""
        ids = torch.tensor([token_ids], dtype=torch.long)
        kwargs = {"output_hidden_states": self.hidden_indices} if self.hidden_indices else {}
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=0, **kwargs)
        self.last_logits = out.logits[0]
        next_tokens = out.logits[0].argmax(-1)
        aux = None
        if self.hidden_indices:
            aux = torch.cat([out.hidden_states[i][0] for i in self.hidden_indices], dim=-1)
        return next_tokens, aux

    def crop(self, length: int) -> None:
        extra = self.length - length
        if extra > 0:
            self._started_cache().crop(-extra)

    def forward_tree(self, tree: DraftTree, root: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One verify forward over a draft tree: the root token, then every node, each attending to the
        cached prefix and its own ancestors only, at position prefix + depth."""
        prefix = self.length
        count = len(tree.tokens) + 1
        mask = torch.full((1, 1, count, prefix + count), float("-inf"))
        mask[..., :prefix] = 0.0
        for row, ancestors in enumerate(tree.ancestor_rows()):
            mask[0, 0, row, [prefix + a for a in ancestors]] = 0.0
        ids = torch.tensor([[root] + tree.tokens], dtype=torch.long)
        positions = torch.tensor([[prefix] + [prefix + d for d in tree.depths]], dtype=torch.long)
        kwargs = {"output_hidden_states": self.hidden_indices} if self.hidden_indices else {}
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask.to(self.model.dtype),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=0,
            **kwargs,
        )
        aux = None
        if self.hidden_indices:
            aux = torch.cat([out.hidden_states[i][0] for i in self.hidden_indices], dim=-1)
        self.last_logits = out.logits[0]
        return out.logits[0].argmax(-1), aux

    def keep(self, prefix: int, rows: list[int]) -> None:
        """Keep the cache's first `prefix` positions and then the given rows of the last forward, in order."""
        from transformers.cache_utils import CacheLayerMixin

        index = torch.tensor(list(range(prefix)) + [prefix + r for r in rows], dtype=torch.long)
        for layer in self._started_cache().layers:
            if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
                raise RuntimeError(f"cannot keep rows of a {type(layer).__name__}: no attention keys/values")
            layer.keys = layer.keys.index_select(2, index)
            layer.values = layer.values.index_select(2, index)


@dataclass
class DraftTree:
    """Draft nodes in verify order: token (target id), parent (-1 for the root) and depth (1-based)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)

    def ancestor_rows(self) -> list[list[int]]:
        """For every verify row (0 = root, node i = row i + 1): the rows it may attend to, itself included."""
        rows = [[0]]
        for index, parent in enumerate(self.parents):
            rows.append(rows[parent + 1] + [index + 1])
        return rows

    def accepted_path(self, predicted: torch.Tensor) -> list[int]:
        """Nodes, root to leaf, whose token is what the target predicts after their parent."""
        path: list[int] = []
        parent = -1
        while True:
            want = int(predicted[parent + 1])
            nodes = enumerate(zip(self.tokens, self.parents, strict=True))
            child = next((i for i, (t, p) in nodes if p == parent and t == want), None)
            if child is None:
                return path
            path.append(child)
            parent = child


class Proposer(Protocol):
    def start(self, context: list[int], aux: torch.Tensor | None) -> None: ...

    def propose(self, context: list[int], steps: int) -> list[int]: ...

    def accept(self, context: list[int], accepted_count: int, aux: torch.Tensor | None) -> None: ...


class NgramProposer:
    """Prompt-lookup drafting: continue the latest earlier occurrence of the context's suffix, trying the
    longest suffix first (max_match tokens, down to min_match). It drafts a chain: SGLang's NGRAM drafts a
    tree over a trie of every request's tokens, with a BFS breadth this proposer has no counterpart for."""

    needs_aux = False

    def __init__(self, max_match: int = 4, min_match: int = 1):
        if not 1 <= min_match <= max_match:
            raise ValueError(
                f"n-gram match window needs 1 <= min_match <= max_match, got {min_match}..{max_match}"
            )
        self.max_match, self.min_match = max_match, min_match

    def start(self, context, aux) -> None:
        pass

    def propose(self, context: list[int], steps: int) -> list[int]:
        for size in range(min(self.max_match, len(context) - 1), self.min_match - 1, -1):
            suffix = context[-size:]
            for start in range(len(context) - size - 1, -1, -1):
                if context[start : start + size] == suffix:
                    follow = context[start + size : start + size + steps]
                    if follow:
                        return follow
        return []

    def accept(self, context, accepted_count, aux) -> None:
        pass


class EagleProposer:
    """Chain drafting with an EAGLE-3 drafter on its own KV cache."""

    needs_aux = True

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter
        self.cache = DraftCache()
        self.next_draft: int | None = None
        self.last_hidden: torch.Tensor | None = None

    def _extend(self, aux: torch.Tensor, next_tokens: list[int], start: int) -> None:
        h_out = self.drafter.decode(aux[None], torch.tensor([next_tokens]), start, self.cache)
        self.last_hidden = h_out[:, -1:]
        self.next_draft = self._top1(self.last_hidden)

    def _top1(self, h_out: torch.Tensor) -> int:
        draft_id = self.drafter.logits(h_out)[0, -1].argmax()
        return int(self.drafter.draft_to_target(draft_id))

    def start(self, context: list[int], aux: torch.Tensor | None) -> None:
        """After prefill: aux rows 0..n-1 pair with tokens 1..n (the last one is the first output)."""
        assert aux is not None
        self.cache = DraftCache()
        self._extend(aux, context[1:], 0)

    def _started(self) -> tuple[int, torch.Tensor]:
        """The next chain draft and the drafter's last h_out, both set by start() and accept()."""
        if self.next_draft is None or self.last_hidden is None:
            raise RuntimeError("EagleProposer.start() must run before drafting")
        return self.next_draft, self.last_hidden

    def propose(self, context: list[int], steps: int) -> list[int]:
        next_draft, hidden = self._started()
        drafts = [next_draft]
        position = len(context) - 1
        for _ in range(steps - 1):
            hidden = self.drafter.decode(hidden, torch.tensor([[drafts[-1]]]), position, self.cache)
            drafts.append(self._top1(hidden))
            position += 1
        return drafts

    def propose_tree(self, context: list[int], steps: int, topk: int, budget: int) -> DraftTree:
        """EAGLE's dynamic tree (expand_tree), pruned to its `budget` best nodes (best_nodes)."""
        _, last_hidden = self._started()
        nodes = expand_tree(self.drafter, self.cache, last_hidden, len(context) - 1, steps, topk)
        return nodes.draft_tree(best_nodes(nodes, budget), self.drafter)

    def accept(self, context: list[int], accepted_count: int, aux: torch.Tensor | None) -> None:
        """context already holds the accepted drafts and the bonus token; aux rows are the verified
        positions of the accepted path (root first)."""
        assert aux is not None
        new = accepted_count + 1
        start = len(context) - 1 - new
        self.cache.crop(start)
        self._extend(aux[:new], context[start + 1 :], start)


class WholeChainProposer:
    """A chain proposer that drafts all `steps` tokens in every cycle, also when the request needs fewer, as
    an engine that schedules no partial drafts does (vLLM: "We don't schedule partial draft tokens",
    vllm/v1/core/sched/scheduler.py:673-676, and it counts every draft accepted, also past max_tokens:
    scheduler.py:2110-2135, vllm/v1/spec_decode/metrics.py:41-49). Counted so, the reference decoder's
    acceptance is comparable draft for draft with such an engine's counters."""

    def __init__(self, proposer: Proposer, steps: int):
        self.proposer = proposer
        self.steps = steps
        self.needs_aux = getattr(proposer, "needs_aux", False)

    def start(self, context: list[int], aux: torch.Tensor | None) -> None:
        self.proposer.start(context, aux)

    def propose(self, context: list[int], steps: int) -> list[int]:
        return self.proposer.propose(context, self.steps)

    def accept(self, context: list[int], accepted_count: int, aux: torch.Tensor | None) -> None:
        self.proposer.accept(context, accepted_count, aux)


@dataclass
class TreeNodes:
    """Every node an EAGLE tree expansion drafted, in expansion order: cumulative log-prob, draft-vocabulary
    token, parent node (-1: the root) and depth (1-based)."""

    scores: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)

    def add(self, score: float, token: int, parent: int, depth: int) -> int:
        self.scores.append(score)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(depth)
        return len(self.tokens) - 1

    def draft_tree(self, kept: list[int], drafter: Eagle3Drafter) -> DraftTree:
        """The kept nodes (each after its parent) as a DraftTree of target ids, renumbered in that order."""
        index: dict[int, int] = {}
        tree = DraftTree()
        for node in kept:
            index[node] = len(tree.tokens)
            tree.tokens.append(int(drafter.draft_to_target(torch.tensor(self.tokens[node]))))
            tree.parents.append(-1 if self.parents[node] == -1 else index[self.parents[node]])
            tree.depths.append(self.depths[node])
        return tree


def expand_tree(
    drafter: Eagle3Drafter,
    cache: DraftCache,
    last_hidden: torch.Tensor,
    position: int,
    steps: int,
    topk: int,
) -> TreeNodes:
    """EAGLE's dynamic tree expansion from the drafter's state after the last verified token (its cache and
    last h_out; `position` is that token's), as SGLang 0.5.23 grows it: the root's `topk` best children,
    then at every further depth all `topk` children of each of the `topk` frontier nodes become candidates
    and the `topk` best of them by cumulative log-prob (over all parents, not per parent) are the next
    frontier, for `steps` depths (speculative/spec_utils.py:438-469 select_top_k_tokens). Every candidate,
    topk + (steps - 1) * topk^2 in all, enters the rerank (best_nodes; speculative/eagle_utils.py:100-112).
    `cache` is left as it was."""
    nodes = TreeNodes()
    logp = torch.log_softmax(drafter.logits(last_hidden)[0, -1].float(), -1)
    best = logp.topk(topk)
    frontier = [
        nodes.add(score, draft_id, -1, 1)
        for score, draft_id in zip(best.values.tolist(), best.indices.tolist(), strict=True)
    ]
    branches = cache.expanded(topk)
    hidden = last_hidden.expand(topk, -1, -1)
    for depth in range(2, steps + 1):
        fed = torch.tensor([[nodes.tokens[n]] for n in frontier])
        h = drafter.decode(hidden, drafter.draft_to_target(fed), position + depth - 2, branches)
        logp = torch.log_softmax(drafter.logits(h)[:, -1].float(), -1)
        child = logp.topk(topk, dim=-1)
        totals = torch.tensor([nodes.scores[n] for n in frontier])[:, None] + child.values
        candidates = [
            [
                nodes.add(float(totals[row, col]), int(child.indices[row, col]), parent, depth)
                for col in range(topk)
            ]
            for row, parent in enumerate(frontier)
        ]
        chosen = totals.flatten().topk(topk).indices
        rows, columns = chosen // topk, chosen % topk
        frontier = [candidates[row][col] for row, col in zip(rows.tolist(), columns.tolist(), strict=True)]
        branches.reorder(rows)
        hidden = h.index_select(0, rows)
    return nodes


def best_nodes(nodes: TreeNodes, budget: int, max_depth: int | None = None) -> list[int]:
    """EAGLE's rerank: the `budget` highest-scoring nodes (of depth <= `max_depth`), each after its parent.
    The tree of `steps` depths is the first `steps` depths of a deeper expansion, so `max_depth` gives the
    smaller trees from one expansion."""
    order = sorted(range(len(nodes.tokens)), key=lambda n: (-nodes.scores[n], n))
    kept: list[int] = []
    seen: set[int] = set()
    for node in order:
        if len(kept) == budget:
            break
        if max_depth is not None and nodes.depths[node] > max_depth:
            continue
        if nodes.parents[node] != -1 and nodes.parents[node] not in seen:
            continue
        kept.append(node)
        seen.add(node)
    return kept


def tree_speculative_decode(
    target: TargetRunner,
    proposer: EagleProposer,
    prompt: list[int],
    max_new_tokens: int,
    eos_id: int | None,
    steps: int,
    topk: int,
    draft_tokens: int,
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
) -> DecodeResult:
    """Speculative decoding with a draft tree verified in one target forward (tree attention mask);
    greedy, or sampled with `sampling` (draws from `generator`)."""

    def verify(context: list[int], produced: int):
        tree = proposer.propose_tree(context, steps, topk, draft_tokens - 1)
        prefix = target.length
        predicted, aux = target.forward_tree(tree, context[-1])
        if sampling is None:
            path = tree.accepted_path(predicted)
            following = int(predicted[path[-1] + 1 if path else 0])  # the target's choice after the path
        else:
            path, following = sampled.verify_tree(
                tree.tokens, tree.parents, target.distributions(sampling), _generator(generator)
            )
        rows = [0] + [node + 1 for node in path]
        target.keep(prefix, rows)
        new_tokens = [tree.tokens[node] for node in path] + [following]
        return new_tokens, len(path), aux[rows] if aux is not None else None

    return _decode_cycles(
        target, proposer, prompt, verify, max_new_tokens, eos_id, steps, sampling, generator
    )


def _generator(generator: torch.Generator | None) -> torch.Generator:
    if generator is None:
        raise ValueError("sampled decoding needs a torch.Generator for its draws")
    return generator


def _next_token(target: TargetRunner, sampling: Sampling | None, generator: torch.Generator | None) -> int:
    """The token after the last forward's last row: greedy, or drawn with `sampling`."""
    assert target.last_logits is not None
    if sampling is None:
        return int(target.last_logits[-1].argmax())
    last = sampled.target_distribution(target.last_logits[-1:], sampling)[0]
    return sampled.draw(last, _generator(generator))


def greedy_decode(
    target: TargetRunner,
    prompt: list[int],
    max_new_tokens: int,
    eos_id: int | None,
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
) -> DecodeResult:
    """Plain decoding, one target forward per token: greedy, or sampled with `sampling`."""
    started = time.perf_counter()
    target.reset()
    target.forward(prompt)
    tokens = [_next_token(target, sampling, generator)]
    while len(tokens) < max_new_tokens and tokens[-1] != eos_id:
        target.forward(tokens[-1:])
        tokens.append(_next_token(target, sampling, generator))
    return DecodeResult(tokens, time.perf_counter() - started)


def speculative_decode(
    target: TargetRunner,
    proposer,
    prompt: list[int],
    max_new_tokens: int,
    eos_id: int | None,
    steps: int,
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
) -> DecodeResult:
    """Speculative decoding with a chain of drafts verified in one target forward; greedy, or sampled
    with `sampling` (draws from `generator`)."""

    def verify(context: list[int], produced: int):
        drafts = proposer.propose(context, min(steps, max_new_tokens - produced))
        verified, aux = target.forward([context[-1]] + drafts)
        if sampling is None:
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == int(verified[accepted]):
                accepted += 1
            following = int(verified[accepted])
        else:
            accepted, following = sampled.verify_chain(
                drafts, target.distributions(sampling), _generator(generator)
            )
        target.crop(len(context) + accepted)
        return drafts[:accepted] + [following], accepted, aux

    return _decode_cycles(
        target, proposer, prompt, verify, max_new_tokens, eos_id, steps, sampling, generator
    )


def _decode_cycles(
    target: TargetRunner,
    proposer,
    prompt: list[int],
    verify,
    max_new_tokens: int,
    eos_id: int | None,
    steps: int,
    sampling: Sampling | None,
    generator: torch.Generator | None,
) -> DecodeResult:
    """Prefill, then draft-and-verify cycles; `verify(context, produced)` returns the cycle's new
    tokens, how many drafts were accepted and the target's aux hidden states for the proposer."""
    started = time.perf_counter()
    target.reset()
    _, aux = target.forward(prompt)
    context = list(prompt) + [_next_token(target, sampling, generator)]
    proposer.start(context, aux)
    result = DecodeResult([], 0.0, accepted_histogram=[0] * (steps + 1))
    produced = 1
    while produced < max_new_tokens and context[-1] != eos_id:
        new_tokens, accepted, aux = verify(context, produced)
        context.extend(new_tokens)
        result.verify_forwards += 1
        result.cycle_tokens += len(new_tokens)
        result.accepted_histogram[accepted] += 1
        produced += len(new_tokens)
        if eos_id in new_tokens or produced >= max_new_tokens:
            break
        proposer.accept(context, accepted, aux)
    output = context[len(prompt) :]
    if eos_id in output:
        output = output[: output.index(eos_id) + 1]
    result.tokens = output[:max_new_tokens]
    result.seconds = time.perf_counter() - started
    return result
