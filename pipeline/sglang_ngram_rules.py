"""What SGLang 0.5.23 does with the NGRAM speculative-decoding launch flags, checked without a GPU.

The benchmark config (pipeline.benchmark_settings.NgramServerSetting) refuses an n-gram setting that SGLang
would refuse or silently change, and the stand-in server (harness.sglang_standin) refuses to start on what
SGLang refuses. Read in the 0.5.23 wheel (sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl; paths
inside it):

- sglang/srt/arg_groups/speculative_hook.py:1285-1370 (_handle_ngram): the draft tree's topk is set to
  --speculative-ngram-max-bfs-breadth whatever --speculative-eagle-topk says (:1309-1313);
  --speculative-num-draft-tokens defaults to 12 (:1314-1323); --speculative-num-steps, when not given,
  becomes num_draft_tokens // topk (:1324-1330), 0 when the breadth exceeds the draft tokens; topk > 1
  with page_size > 1 raises unless the attention backend is flashinfer (:1355-1365); DP attention raises
  (:1366-1370).
- sglang/srt/arg_groups/overrides.py:1340-1363: page_size defaults to 1 on CUDA; :1143-1201: flashmla
  forces 64, trtllm_mla and cutedsl_mla force 64 unless 32 or 64, trtllm_mha 64 unless 16/32/64/128,
  hpc_ops 64.
- sglang/kernels/jit/csrc/ngram_corpus/ngram.cpp:13-30: the n-gram corpus throws at startup when
  max_trie_depth <= 1, min_bfs_breadth < 1 or min_bfs_breadth > max_bfs_breadth.
- sglang/kernels/jit/csrc/ngram_corpus/trie.cpp:222-263 and param.h:29-37: a draft holds
  num_draft_tokens - 1 tree nodes, found by matching the context's suffixes of up to max_trie_depth - 1
  tokens; the breadth per level goes from max_bfs_breadth (shortest match) to min_bfs_breadth (longest).
- sglang/srt/arg_groups/fields/spec.py:252-271: defaults min breadth 1, max breadth 10, match type BFS,
  trie depth 18, capacity 10,000,000. 0.5.23 has no match-window flags (the min/max match window of
  0.5.9 and earlier are gone): max_trie_depth is the longest suffix matched.

Without --attention-backend the backend is SGLang's pick for the GPU, taken here to keep page size 1: so it
is for MLA targets on Hopper (fa3, arg_groups/model_override_base.py:335-337), but DeepSeek-family targets
on Blackwell get trtllm_mla (arg_groups/model_overrides/deepseek_v2.py:178-188), pages of 64, which refuse
breadth > 1: name the backend in benchmark.sglang.extra_args there. Not modelled: the device check
(:1287-1291), the external-corpus flags (:1331-1349), SM100 NVFP4 (kv_cache_hook.py:189-203) and
--decode-attention-backend.
"""

from __future__ import annotations

from dataclasses import dataclass

SGLANG_VERSION = "0.5.23"
DEFAULT_NGRAM_DRAFT_TOKENS = 12  # speculative_hook.py:1314-1323
PAGE_TREE_BACKEND = "flashinfer"  # the only backend _handle_ngram allows topk > 1 with page_size > 1 on
# overrides.py:1143-1201: (page sizes a backend keeps, the page size it forces otherwise)
FORCED_PAGE_SIZES: dict[str, tuple[tuple[int, ...], int]] = {
    "flashmla": ((64,), 64),
    "trtllm_mla": ((32, 64), 64),
    "cutedsl_mla": ((32, 64), 64),
    "trtllm_mha": ((16, 32, 64, 128), 64),
    "hpc_ops": ((64,), 64),
}
HOOK = "sglang/srt/arg_groups/speculative_hook.py"
CORPUS = "sglang/kernels/jit/csrc/ngram_corpus/ngram.cpp"


@dataclass(frozen=True)
class NgramLaunch:
    """An NGRAM server's launch flags; None: the flag was not given."""

    num_draft_tokens: int | None = None
    min_bfs_breadth: int = 1
    max_bfs_breadth: int = 10
    max_trie_depth: int = 18
    eagle_topk: int | None = None
    num_steps: int | None = None
    attention_backend: str | None = None
    page_size: int | None = None
    dp_attention: bool = False

    @property
    def draft_tokens(self) -> int:
        """--speculative-num-draft-tokens as SGLang runs it."""
        return DEFAULT_NGRAM_DRAFT_TOKENS if self.num_draft_tokens is None else self.num_draft_tokens

    @property
    def steps(self) -> int:
        """--speculative-num-steps as SGLang runs it."""
        return self.draft_tokens // self.max_bfs_breadth if self.num_steps is None else self.num_steps

    @property
    def effective_page_size(self) -> int:
        """The page size after SGLang's default and the attention backend's constraint."""
        page = 1 if self.page_size is None else self.page_size
        kept, forced = FORCED_PAGE_SIZES.get(self.attention_backend or "", ((page,), page))
        return page if page in kept else forced


def _problem(what: str, consequence: str, where: str) -> str:
    return f"{what}: SGLang {SGLANG_VERSION} {consequence} ({where})"


def refusals(launch: NgramLaunch) -> list[str]:
    """Why SGLang 0.5.23 would not start an NGRAM server with these flags; [] if it would."""
    problems = []
    if launch.max_trie_depth <= 1:
        problems.append(
            _problem(
                f"max trie depth {launch.max_trie_depth}",
                "fails at startup: it must be > 1",
                f"{CORPUS}:13-16",
            )
        )
    if launch.min_bfs_breadth < 1 or launch.min_bfs_breadth > launch.max_bfs_breadth:
        problems.append(
            _problem(
                f"BFS breadth {launch.min_bfs_breadth}..{launch.max_bfs_breadth}",
                "fails at startup: it needs 1 <= min_bfs_breadth <= max_bfs_breadth",
                f"{CORPUS}:17-26",
            )
        )
    page = launch.effective_page_size
    if launch.max_bfs_breadth > 1 and page > 1 and launch.attention_backend != PAGE_TREE_BACKEND:
        backend = launch.attention_backend or "the default backend"
        problems.append(
            _problem(
                f"BFS breadth {launch.max_bfs_breadth} (the tree's topk) with page size {page} on {backend}",
                f"fails at startup: topk > 1 with page_size > 1 runs only on {PAGE_TREE_BACKEND}; use "
                "--speculative-ngram-max-bfs-breadth 1, page size 1 or --attention-backend flashinfer",
                f"{HOOK}:1355-1365",
            )
        )
    if launch.dp_attention:
        problems.append(_problem("--enable-dp-attention", "fails at startup with NGRAM", f"{HOOK}:1366-1370"))
    return problems


def silent_changes(launch: NgramLaunch) -> list[str]:
    """What SGLang 0.5.23 would run otherwise than these flags say, without failing."""
    changes = []
    if launch.eagle_topk is not None and launch.eagle_topk != launch.max_bfs_breadth:
        changes.append(
            _problem(
                f"--speculative-eagle-topk {launch.eagle_topk}",
                f"replaces it with the max BFS breadth {launch.max_bfs_breadth}",
                f"{HOOK}:1309-1313",
            )
        )
    if launch.num_draft_tokens is None:
        changes.append(
            _problem(
                "no --speculative-num-draft-tokens",
                f"drafts {DEFAULT_NGRAM_DRAFT_TOKENS} tokens per step",
                f"{HOOK}:1314-1323",
            )
        )
    if launch.num_steps is None and launch.max_bfs_breadth >= 1 and launch.steps == 0:
        changes.append(
            _problem(
                f"max BFS breadth {launch.max_bfs_breadth} over {launch.draft_tokens} draft tokens",
                f"sets topk {launch.max_bfs_breadth} and num_steps {launch.draft_tokens} // "
                f"{launch.max_bfs_breadth} = 0; a tree of {launch.draft_tokens - 1} nodes cannot be "
                "that broad, so keep the breadth <= the draft tokens",
                f"{HOOK}:1309-1330",
            )
        )
    return changes


def launch_from_args(args: list[str]) -> NgramLaunch:
    """The NGRAM-relevant flags of a launch command line (`--flag value` or `--flag=value`)."""
    values: dict[str, str] = {}
    flags = set()
    for index, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, _, inline = arg.partition("=")
        flags.add(name)
        following = args[index + 1] if index + 1 < len(args) else ""
        values[name] = inline or (following if not following.startswith("--") else "")

    def given(flag: str) -> int | None:
        if flag not in values:
            return None
        try:
            return int(values[flag])
        except ValueError:
            raise ValueError(f"{flag} takes an integer, got {values[flag]!r}") from None

    def number(flag: str, default: int) -> int:
        value = given(flag)
        return default if value is None else value

    defaults = NgramLaunch()
    return NgramLaunch(
        num_draft_tokens=given("--speculative-num-draft-tokens"),
        min_bfs_breadth=number("--speculative-ngram-min-bfs-breadth", defaults.min_bfs_breadth),
        max_bfs_breadth=number("--speculative-ngram-max-bfs-breadth", defaults.max_bfs_breadth),
        max_trie_depth=number("--speculative-ngram-max-trie-depth", defaults.max_trie_depth),
        eagle_topk=given("--speculative-eagle-topk"),
        num_steps=given("--speculative-num-steps"),
        attention_backend=values.get("--attention-backend"),
        page_size=given("--page-size"),
        dp_attention="--enable-dp-attention" in flags,
    )
