"""The embedded tiny target: a small chat model built on this machine.

Corpus: the Python standard library's top-level modules, which every machine with Python has.
Every function becomes one chat turn: the user gives its signature and docstring, the assistant
answers with the body. A byte-level BPE tokenizer is trained on the same text, then a small model
for a fixed number of steps. The build is cached under a hash of the recipe and the corpus, so it
happens once per machine.

Two architectures:
- llama (default): LlamaForCausalLM with a `tokenizers` BPE, loadable by plain transformers.
- deepseek_v3: Kimi-K2.5 in everything but size. MLA + MoE, Kimi's long-context rope settings, a
  custom model_type whose configuration/modeling code ships in the directory (auto_map), and a
  tiktoken tokenizer shipped as code with Kimi's special tokens and chat format; loading it needs
  trust_remote_code. The tiktoken ranks are the trained BPE's (bytes first, then merges in order),
  so both encode text to the same tokens.

Held-out modules (chosen by a hash of their name) give the perplexity figure and the demo prompt
corpus, so the target never saw the prompts it is asked to answer in the demo.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from pipeline.config import TinyTargetRecipe
from pipeline.progress import Progress
from pipeline.storage import atomic_write

log = logging.getLogger(__name__)

BUILDER_VERSION = "2"
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
HELDOUT_EVERY = 10  # one module in ten, by name hash, is held out
MAX_PROMPT_CHARS = 900
MAX_RESPONSE_CHARS = 1500

# The deepseek_v3 (Kimi-style) target. Its code files are copied from pipeline/engines/tiny_kimi/.
KIMI_CODE_DIR = Path(__file__).resolve().parent / "tiny_kimi"
KIMI_CONFIG_CODE = "configuration_tiny_kimi.py"
KIMI_MODEL_CODE = "modeling_tiny_kimi.py"
KIMI_TOKENIZER_CODE = "tokenization_tiny_kimi.py"
KIMI_AUTO_MAP = {
    "AutoConfig": "configuration_tiny_kimi.TinyKimiConfig",
    "AutoModelForCausalLM": "modeling_tiny_kimi.TinyKimiForCausalLM",
}
KIMI_TOKENIZER_AUTO_MAP = {"AutoTokenizer": ["tokenization_tiny_kimi.TikTokenTokenizer", None]}
# Named special tokens by slot past the base vocabulary (negative: from the end), in Kimi-K2.5's order;
# the other slots are reserved. A turn ends with <|im_end|>: it is the eos token here, so generation
# stops there.
KIMI_SPECIAL_TOKENS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    5: "<|im_system|>",
    6: "<|im_middle|>",
    -2: "[UNK]",
    -1: "[PAD]",
}
KIMI_DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
# Kimi's chat format, without tools and thinking: a default system turn when none is given, a role
# name after each role token, <|im_end|> closing every turn.
KIMI_CHAT_TEMPLATE = (
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + KIMI_DEFAULT_SYSTEM + "<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "<|im_{{ message['role'] }}|>{{ message['role'] }}<|im_middle|>{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
# Kimi-K2.5's long context: 4K pre-training positions stretched 64x with YaRN, in the form
# transformers' DeepseekV3Config takes it (rope_parameters; checkpoints write rope_scaling + rope_theta).
KIMI_MAX_POSITION_EMBEDDINGS = 262144
KIMI_ROPE_PARAMETERS = {
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
KIMI_BUILD_THREADS = 1  # see _build_into


@dataclass(frozen=True)
class CodeTurn:
    """One function split into a prompt (signature + docstring) and a response (its body)."""

    module: str
    qualname: str
    prompt: str
    response: str


def stdlib_modules() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"this.py", "antigravity.py", "__hello__.py", "__phello__.foo.py"}
    return sorted(p for p in stdlib.glob("*.py") if p.name not in skip and not p.name.startswith("test"))


def is_heldout(module_name: str) -> bool:
    return int(hashlib.sha256(module_name.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0


def _split_function(source_lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> CodeTurn | None:
    """Prompt: signature, docstring and the first third of the body's statements; response: the rest.

    Giving part of the body makes the answer depend on the prompt's own names, so greedy answers
    of the small model are varied instead of one generic body for every function.
    """
    body = node.body
    first_body = body[0]
    has_doc = (
        isinstance(first_body, ast.Expr)
        and isinstance(first_body.value, ast.Constant)
        and isinstance(first_body.value.value, str)
    )
    statements = body[1:] if has_doc else body
    if not statements:
        return None
    given = len(statements) // 3
    if given:
        head_end = statements[given - 1].end_lineno
    else:
        head_end = first_body.end_lineno if has_doc else first_body.lineno - 1
    start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    prompt = "".join(source_lines[start:head_end])
    response = "".join(source_lines[head_end : node.end_lineno])
    indent = len(prompt) - len(prompt.lstrip(" "))
    prompt = "\n".join(line[indent:] for line in prompt.splitlines()).strip("\n")
    response = "\n".join(line[indent:] for line in response.splitlines()).rstrip()
    if not prompt or not response.strip() or len(prompt) > MAX_PROMPT_CHARS:
        return None
    return CodeTurn("", node.name, prompt, response[:MAX_RESPONSE_CHARS])


def module_turns(path: Path) -> list[CodeTurn]:
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    turns = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            turn = _split_function(lines, node)
            if turn is not None:
                turns.append(CodeTurn(path.stem, turn.qualname, turn.prompt, turn.response))
    turns.sort(key=lambda t: (t.module, t.qualname, t.prompt))
    return turns


def corpus_turns(heldout: bool, max_modules: int | None = None) -> list[CodeTurn]:
    modules = [p for p in stdlib_modules() if is_heldout(p.stem) == heldout]
    if max_modules is not None:
        modules = modules[:max_modules]
    return [turn for path in modules for turn in module_turns(path)]


# The demo corpus's two domains: functions of modules that read and write data formats, and the rest
# (the language runtime: syntax trees, threads, enums, temporary files, tracebacks). They differ in what a
# drafter meets: byte and field handling against control flow over objects.
DATA_FORMAT_MODULES = frozenset(
    {
        "mailbox",
        "tarfile",
        "pickletools",
        "stringprep",
        "imghdr",
        "colorsys",
        "uu",
        "zipfile",
        "csv",
        "wave",
        "aifc",
        "sunau",
        "plistlib",
        "quopri",
        "base64",
        "binhex",
        "mimetypes",
        "netrc",
        "gzip",
    }
)


def demo_domain(module: str) -> str:
    return "data-formats" if module in DATA_FORMAT_MODULES else "runtime"


def demo_conversations() -> list[dict]:
    """The built-in demo prompt corpus: ShareGPT-style conversations from held-out modules, each tagged
    with its domain (demo_domain)."""
    return [
        {
            "conversations": [{"from": "human", "value": t.prompt}, {"from": "gpt", "value": t.response}],
            "source": f"stdlib:{t.module}.{t.qualname}",
            "domain": demo_domain(t.module),
        }
        for t in corpus_turns(heldout=True)
    ]


def chat_text(turn: CodeTurn) -> str:
    return f"<|user|>{turn.prompt}<|end|>\n<|assistant|>{turn.response}<|end|>\n"


def corpus_hash(turns: list[CodeTurn]) -> str:
    digest = hashlib.sha256()
    for turn in turns:
        digest.update(chat_text(turn).encode())
    return digest.hexdigest()


def kimi_code_sha() -> str:
    """The code a deepseek_v3 build ships: a change to it rebuilds the target."""
    digest = hashlib.sha256()
    for name in (KIMI_CONFIG_CODE, KIMI_MODEL_CODE, KIMI_TOKENIZER_CODE):
        digest.update(name.encode())
        digest.update((KIMI_CODE_DIR / name).read_bytes())
    return digest.hexdigest()


def recipe_hash(recipe: TinyTargetRecipe, corpus_sha: str) -> str:
    payload: dict[str, Any]
    if recipe.architecture == "llama":
        # hashed without the fields added for deepseek_v3, so that Llama builds cached before keep their names
        payload = {"recipe": recipe.model_dump(exclude={"architecture", "deepseek_v3"})}
    else:
        payload = {"recipe": recipe.model_dump(), "code": kimi_code_sha()}
    payload.update({"corpus": corpus_sha, "builder": BUILDER_VERSION})
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def train_byte_bpe(turns: list[CodeTurn], vocab_size: int, special_tokens: list[str]):
    """A byte-level BPE (`tokenizers.Tokenizer`) with GPT-2's pre-tokenization, trained on the turns."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator((f"{t.prompt}\n{t.response}" for t in turns), trainer=trainer)
    return tokenizer


def train_tokenizer(turns: list[CodeTurn], vocab_size: int):
    from transformers import PreTrainedTokenizerFast

    tokenizer = train_byte_bpe(turns, vocab_size, SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def token_stream(tokenizer, turns: list[CodeTurn], render=chat_text):
    """Token ids of all turns, each rendered to chat text by `render`, one after the other."""
    import torch

    ids: list[int] = []
    for turn in turns:
        ids.extend(tokenizer(render(turn), add_special_tokens=False)["input_ids"])
    return torch.tensor(ids, dtype=torch.long)


def _backbone_config(recipe: TinyTargetRecipe, tokenizer) -> dict[str, Any]:
    """The model config settings both tiny architectures take from the recipe and the tokenizer."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": recipe.hidden_size,
        "intermediate_size": recipe.intermediate_size,
        "num_hidden_layers": recipe.num_layers,
        "num_attention_heads": recipe.num_heads,
        "num_key_value_heads": recipe.num_heads,
        "tie_word_embeddings": False,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def build_model(recipe: TinyTargetRecipe, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **_backbone_config(recipe, tokenizer),
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def _batch(stream, seq_len: int, batch_size: int, generator):
    import torch

    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


def train_model(model, stream, recipe: TinyTargetRecipe) -> dict:
    import torch

    generator = torch.Generator().manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.learning_rate, betas=(0.9, 0.95), weight_decay=0.1
    )
    warmup = max(1, recipe.train_steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, recipe.train_steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    model.train()
    started = time.monotonic()
    loss_value = float("nan")
    for _ in Progress(range(recipe.train_steps), total=recipe.train_steps, desc="tiny target training"):
        batch = _batch(stream, recipe.seq_len, recipe.batch_size, generator)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        loss_value = loss.item()
    seconds = time.monotonic() - started
    tokens = recipe.train_steps * recipe.batch_size * recipe.seq_len
    return {
        "train_seconds": round(seconds, 1),
        "train_tokens": tokens,
        "final_train_loss": round(loss_value, 4),
        "train_tokens_per_s": round(tokens / seconds, 1),
    }


def heldout_perplexity(model, stream, seq_len: int, max_windows: int = 64) -> float:
    import torch

    model.eval()
    windows = min(max_windows, (len(stream) - 1) // seq_len)
    total, count = 0.0, 0
    with torch.no_grad():
        for w in range(windows):
            chunk = stream[w * seq_len : (w + 1) * seq_len].unsqueeze(0)
            loss = model(input_ids=chunk, labels=chunk).loss
            total += loss.item() * (seq_len - 1)
            count += seq_len - 1
    return math.exp(total / count)


def distinct_2(sequences: list[list[int]]) -> float:
    """Unique bigrams over all bigrams, over the generated tokens of all sequences."""
    bigrams = [tuple(seq[i : i + 2]) for seq in sequences for i in range(len(seq) - 1)]
    return len(set(bigrams)) / max(1, len(bigrams))


def greedy_samples(
    model, tokenizer, turns: list[CodeTurn], count: int, max_new_tokens: int = 64
) -> list[list[int]]:
    """Greedy answers of the model to `count` prompts spread over the given turns."""
    import torch

    from pipeline.decoding.reference_decoder import TargetRunner, greedy_decode

    model.eval()
    runner = TargetRunner(model, None)
    stride = max(1, len(turns) // count)
    outputs = []
    with torch.inference_mode():
        for turn in turns[::stride][:count]:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": turn.prompt}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            outputs.append(greedy_decode(runner, list(ids), max_new_tokens, tokenizer.eos_token_id).tokens)
    return outputs


def tiktoken_ranks(bpe) -> dict[bytes, int]:
    """tiktoken ranks of a trained byte-level BPE: the 256 bytes in byte order, then every merge's
    token in merge order, so that a lower rank is an earlier merge as tiktoken assumes."""
    from pipeline.engines.tiny_kimi.tokenization_tiny_kimi import byte_to_char

    char_to_byte = {char: byte for byte, char in byte_to_char().items()}
    ranks = {bytes([byte]): byte for byte in range(256)}
    for left, right in json.loads(bpe.to_str())["model"]["merges"]:
        token = bytes(char_to_byte[c] for c in left + right)
        if token in ranks:
            raise RuntimeError(f"BPE training produced {token!r} by two merges; tiktoken ranks need one each")
        ranks[token] = len(ranks)
    return ranks


def bpe_tiktoken_agreement(bpe, ranks: dict[bytes, int], texts: list[str]) -> dict[str, int]:
    """How many texts the trained BPE and tiktoken (with ranks derived from it) encode differently.

    tiktoken merges any adjacent pair whose bytes form a token, the BPE only pairs it learned; on
    text where that could differ the two would disagree, so the build counts it.
    """
    import tiktoken

    from pipeline.engines.tiny_kimi.tokenization_tiny_kimi import PRETOKENIZE_PATTERN, byte_to_char

    char_to_byte = {char: byte for byte, char in byte_to_char().items()}
    rank_of_id = {i: ranks[bytes(char_to_byte[c] for c in token)] for token, i in bpe.get_vocab().items()}
    encoding = tiktoken.Encoding(
        "agreement", pat_str=PRETOKENIZE_PATTERN, mergeable_ranks=ranks, special_tokens={}
    )
    by_bpe = [[rank_of_id[i] for i in e.ids] for e in bpe.encode_batch(texts, add_special_tokens=False)]
    by_tiktoken = encoding.encode_ordinary_batch(texts)
    return {"texts": len(texts), "different": sum(a != b for a, b in zip(by_bpe, by_tiktoken, strict=True))}


def kimi_special_tokens(base_vocab: int) -> dict[int, str]:
    from pipeline.engines.tiny_kimi.tokenization_tiny_kimi import SPECIAL_TOKEN_SLOTS

    return {base_vocab + slot % SPECIAL_TOKEN_SLOTS: name for slot, name in KIMI_SPECIAL_TOKENS.items()}


def write_kimi_tokenizer(directory: Path, ranks: dict[bytes, int]) -> None:
    """tiktoken.model, the tokenizer code and tokenizer_config.json (auto_map, special tokens, chat
    template)."""
    from pipeline.engines.tiny_kimi.tokenization_tiny_kimi import write_ranks

    write_ranks(ranks, directory / "tiktoken.model")
    shutil.copyfile(KIMI_CODE_DIR / KIMI_TOKENIZER_CODE, directory / KIMI_TOKENIZER_CODE)
    special = {
        "content": None,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    tokenizer_config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": KIMI_TOKENIZER_AUTO_MAP,
        "bos_token": "[BOS]",
        "eos_token": "<|im_end|>",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "added_tokens_decoder": {
            str(i): {**special, "content": name} for i, name in kimi_special_tokens(len(ranks)).items()
        },
        "chat_template": KIMI_CHAT_TEMPLATE,
        "model_max_length": KIMI_MAX_POSITION_EMBEDDINGS,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def build_kimi_model(recipe: TinyTargetRecipe, tokenizer):
    """A TinyKimiForCausalLM (DeepSeek-V3 under its own model_type), its config naming the shipped code."""
    from pipeline.engines.tiny_kimi.configuration_tiny_kimi import TinyKimiConfig
    from pipeline.engines.tiny_kimi.modeling_tiny_kimi import TinyKimiForCausalLM

    shape = recipe.deepseek_v3
    if shape is None:
        raise ValueError("a tiny Kimi model needs recipe.deepseek_v3 (architecture 'deepseek_v3')")
    config = TinyKimiConfig(
        **_backbone_config(recipe, tokenizer),
        **shape.model_dump(),  # MLA and MoE sizes, named as DeepSeek-V3's config names them
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        norm_topk_prob=True,
        num_mtp_layers=0,
        max_position_embeddings=KIMI_MAX_POSITION_EMBEDDINGS,
        rope_parameters=dict(KIMI_ROPE_PARAMETERS),
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
    )
    config.auto_map = dict(KIMI_AUTO_MAP)
    return TinyKimiForCausalLM(config)


def kimi_chat_render(tokenizer):
    def render(turn: CodeTurn) -> str:
        messages = [{"role": "user", "content": turn.prompt}, {"role": "assistant", "content": turn.response}]
        return tokenizer.apply_chat_template(messages, tokenize=False)

    return render


def _prepare_kimi(directory: Path, recipe: TinyTargetRecipe, turns: list[CodeTurn]):
    """The tokenizer, written first and loaded back from the directory as users load it, and what the
    build trains on: the token stream, the chat rendering, the tokenizer agreement figures."""
    from transformers import AutoTokenizer

    from pipeline.engines.tiny_kimi.tokenization_tiny_kimi import SPECIAL_TOKEN_SLOTS

    bpe = train_byte_bpe(turns, recipe.vocab_size - SPECIAL_TOKEN_SLOTS, [])
    ranks = tiktoken_ranks(bpe)
    write_kimi_tokenizer(directory, ranks)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=True)
    agreement = bpe_tiktoken_agreement(bpe, ranks, [text for t in turns for text in (t.prompt, t.response)])
    if agreement["different"]:
        log.warning(
            "tiktoken and the BPE it came from encode %d of %d corpus texts differently",
            agreement["different"],
            agreement["texts"],
        )
    render = kimi_chat_render(tokenizer)
    return tokenizer, token_stream(tokenizer, turns, render), render, {"tiktoken_vs_bpe": agreement}


@contextlib.contextmanager
def _torch_threads(count: int | None):
    """torch's intra-op threads set to `count` for the duration (None: left as they are)."""
    import torch

    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _build_into(directory: Path, recipe: TinyTargetRecipe, turns: list[CodeTurn], corpus_sha: str) -> None:
    kimi = recipe.architecture == "deepseek_v3"
    # A model this small runs as many tiny ops, the MoE and MLA ones more than Llama's: a second intra-op
    # thread saved ~20% of the Kimi-style build on an idle 2-core machine and cost 5-10x whenever other
    # processes shared the cores (measured here), so that build runs on one.
    with _torch_threads(KIMI_BUILD_THREADS if kimi else None):
        _train_and_save(directory, recipe, turns, corpus_sha)


def _train_and_save(
    directory: Path, recipe: TinyTargetRecipe, turns: list[CodeTurn], corpus_sha: str
) -> None:
    import torch

    torch.manual_seed(recipe.seed)
    kimi = recipe.architecture == "deepseek_v3"
    if kimi:
        tokenizer, stream, render, extra = _prepare_kimi(directory, recipe, turns)
        model = build_kimi_model(recipe, tokenizer)
    else:
        tokenizer = train_tokenizer(turns, recipe.vocab_size)
        stream, render, extra = token_stream(tokenizer, turns), chat_text, {}
        model = build_model(recipe, tokenizer)
    log.info(
        "tiny target: %d parameters, %d training tokens available",
        sum(p.numel() for p in model.parameters()),
        len(stream),
    )
    stats = train_model(model, stream, recipe)
    heldout = corpus_turns(heldout=True)
    heldout_stream = token_stream(tokenizer, heldout, render)
    samples = greedy_samples(model, tokenizer, heldout, count=32)
    stats.update(extra)
    stats.update(
        {
            "heldout_perplexity": round(heldout_perplexity(model, heldout_stream, recipe.seq_len), 2),
            "greedy_distinct_2": round(distinct_2(samples), 4),
            "parameters": sum(p.numel() for p in model.parameters()),
            "corpus_sha256": corpus_sha,
            "corpus_turns": len(turns),
            "recipe": recipe.model_dump(),
            "builder_version": BUILDER_VERSION,
            "torch_threads": torch.get_num_threads(),
        }
    )
    model.save_pretrained(directory)
    if kimi:  # the tokenizer is in the directory already
        for name in (KIMI_CONFIG_CODE, KIMI_MODEL_CODE):
            shutil.copyfile(KIMI_CODE_DIR / name, directory / name)
    else:
        tokenizer.save_pretrained(directory)
    (directory / "build.json").write_text(json.dumps(stats, indent=2, sort_keys=True))
    log.info("tiny target built: %s", {k: v for k, v in stats.items() if k != "recipe"})


def _corpus_files_fingerprint(max_modules: int | None) -> str:
    """Names, sizes and mtimes of the corpus files: a cheap key for the (expensive) corpus hash."""
    digest = hashlib.sha256(f"{BUILDER_VERSION}:{max_modules}".encode())
    for path in stdlib_modules():
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def cached_corpus_hash(cache_dir: Path, max_modules: int | None) -> tuple[str, list[CodeTurn] | None]:
    """The corpus hash, parsing the standard library only when its files changed since last time."""
    index_path = cache_dir / "targets" / "corpus-hashes.json"
    fingerprint = _corpus_files_fingerprint(max_modules)
    index = json.loads(index_path.read_text()) if index_path.exists() else {}
    if fingerprint in index:
        return index[fingerprint], None
    turns = corpus_turns(heldout=False, max_modules=max_modules)
    if not turns:
        raise RuntimeError(
            "no training text found in the Python standard library; cannot build the tiny target"
        )
    index[fingerprint] = corpus_hash(turns)
    with atomic_write(index_path) as partial:
        partial.write_text(json.dumps(index))
    return index[fingerprint], turns


def ensure_tiny_target(recipe: TinyTargetRecipe, cache_dir: str | Path) -> Path:
    """The directory of the tiny target for this recipe, building it once if it is not cached."""
    corpus_sha, turns = cached_corpus_hash(Path(cache_dir), recipe.max_corpus_modules)
    directory = Path(cache_dir) / "targets" / f"tiny-{recipe_hash(recipe, corpus_sha)}"
    if (directory / "build.json").exists():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(directory.with_suffix(".lock")):
        if (directory / "build.json").exists():
            return directory
        turns = turns or corpus_turns(heldout=False, max_modules=recipe.max_corpus_modules)
        staging = directory.with_name(directory.name + f".building-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        log.info("building tiny target %s (cached afterwards)", directory.name)
        try:
            _build_into(staging, recipe, turns, corpus_sha)
            os.replace(staging, directory)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return directory
