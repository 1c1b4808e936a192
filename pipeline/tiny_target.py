"""The embedded tiny target: a Llama-architecture chat model built on this machine.

Corpus: the Python standard library's top-level modules, which every machine with Python has.
Every function becomes one chat turn: the user gives its signature and docstring, the assistant
answers with the body. A byte-level BPE tokenizer is trained on the same text, then a small
LlamaForCausalLM for a fixed number of steps. The build is cached under a hash of the recipe and
the corpus, so it happens once per machine.

Held-out modules (chosen by a hash of their name) give the perplexity figure and the demo prompt
corpus, so the target never saw the prompts it is asked to answer in the demo.
"""

from __future__ import annotations

import ast
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

from pipeline.config import TinyTargetRecipe
from pipeline.locking import file_lock
from pipeline.progress import Progress

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
    has_doc = (isinstance(first_body, ast.Expr) and isinstance(first_body.value, ast.Constant)
               and isinstance(first_body.value.value, str))
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
    response = "".join(source_lines[head_end:node.end_lineno])
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


def demo_conversations() -> list[dict]:
    """The built-in demo prompt corpus: ShareGPT-style conversations from held-out modules."""
    return [
        {"conversations": [{"from": "human", "value": t.prompt}, {"from": "gpt", "value": t.response}],
         "source": f"stdlib:{t.module}.{t.qualname}"}
        for t in corpus_turns(heldout=True)
    ]


def chat_text(turn: CodeTurn) -> str:
    return f"<|user|>{turn.prompt}<|end|>\n<|assistant|>{turn.response}<|end|>\n"


def corpus_hash(turns: list[CodeTurn]) -> str:
    digest = hashlib.sha256()
    for turn in turns:
        digest.update(chat_text(turn).encode())
    return digest.hexdigest()


def recipe_hash(recipe: TinyTargetRecipe, corpus_sha: str) -> str:
    payload = json.dumps({"recipe": recipe.model_dump(), "corpus": corpus_sha, "builder": BUILDER_VERSION},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def train_tokenizer(turns: list[CodeTurn], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator((f"{t.prompt}\n{t.response}" for t in turns), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|end|>", pad_token="<|pad|>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        chat_template=CHAT_TEMPLATE, model_max_length=4096,
    )


def token_stream(tokenizer, turns: list[CodeTurn]):
    import torch

    ids: list[int] = []
    for turn in turns:
        ids.extend(tokenizer(chat_text(turn), add_special_tokens=False)["input_ids"])
    return torch.tensor(ids, dtype=torch.long)


def build_model(recipe: TinyTargetRecipe, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers, num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads, max_position_embeddings=1024, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def _batch(stream, seq_len: int, batch_size: int, generator):
    import torch

    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([stream[s:s + seq_len] for s in starts.tolist()])


def train_model(model, stream, recipe: TinyTargetRecipe) -> dict:
    import torch

    generator = torch.Generator().manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=0.1)
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
    for step in Progress(range(recipe.train_steps), total=recipe.train_steps, desc="tiny target training"):
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
    return {"train_seconds": round(seconds, 1), "train_tokens": tokens, "final_train_loss": round(loss_value, 4),
            "train_tokens_per_s": round(tokens / seconds, 1)}


def heldout_perplexity(model, stream, seq_len: int, max_windows: int = 64) -> float:
    import torch

    model.eval()
    windows = min(max_windows, (len(stream) - 1) // seq_len)
    total, count = 0.0, 0
    with torch.no_grad():
        for w in range(windows):
            chunk = stream[w * seq_len:(w + 1) * seq_len].unsqueeze(0)
            loss = model(input_ids=chunk, labels=chunk).loss
            total += loss.item() * (seq_len - 1)
            count += seq_len - 1
    return math.exp(total / count)


def distinct_2(sequences: list[list[int]]) -> float:
    """Unique bigrams over all bigrams, over the generated tokens of all sequences."""
    bigrams = [tuple(seq[i:i + 2]) for seq in sequences for i in range(len(seq) - 1)]
    return len(set(bigrams)) / max(1, len(bigrams))


def greedy_samples(model, tokenizer, turns: list[CodeTurn], count: int, max_new_tokens: int = 64) -> list[list[int]]:
    """Greedy answers of the model to `count` prompts spread over the given turns."""
    import torch

    from pipeline.spec_decode import TargetRunner, greedy_decode

    model.eval()
    runner = TargetRunner(model, None)
    stride = max(1, len(turns) // count)
    outputs = []
    with torch.inference_mode():
        for turn in turns[::stride][:count]:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": turn.prompt}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
            outputs.append(greedy_decode(runner, list(ids), max_new_tokens, tokenizer.eos_token_id).tokens)
    return outputs


def _build_into(directory: Path, recipe: TinyTargetRecipe, turns: list[CodeTurn], corpus_sha: str) -> None:
    import torch

    torch.manual_seed(recipe.seed)
    tokenizer = train_tokenizer(turns, recipe.vocab_size)
    stream = token_stream(tokenizer, turns)
    model = build_model(recipe, tokenizer)
    log.info("tiny target: %d parameters, %d training tokens available",
             sum(p.numel() for p in model.parameters()), len(stream))
    stats = train_model(model, stream, recipe)
    heldout = corpus_turns(heldout=True)
    heldout_stream = token_stream(tokenizer, heldout)
    samples = greedy_samples(model, tokenizer, heldout, count=32)
    stats.update({
        "heldout_perplexity": round(heldout_perplexity(model, heldout_stream, recipe.seq_len), 2),
        "greedy_distinct_2": round(distinct_2(samples), 4),
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus_sha256": corpus_sha,
        "corpus_turns": len(turns),
        "recipe": recipe.model_dump(),
        "builder_version": BUILDER_VERSION,
        "torch_threads": torch.get_num_threads(),
    })
    model.save_pretrained(directory)
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
        raise RuntimeError("no training text found in the Python standard library; cannot build the tiny target")
    index[fingerprint] = corpus_hash(turns)
    index_path.parent.mkdir(parents=True, exist_ok=True)
    staging = index_path.with_name(f".{index_path.name}.{os.getpid()}")
    staging.write_text(json.dumps(index))
    os.replace(staging, index_path)
    return index[fingerprint], turns


def ensure_tiny_target(recipe: TinyTargetRecipe, cache_dir: str | Path) -> Path:
    """The directory of the tiny target for this recipe, building it once if it is not cached."""
    corpus_sha, turns = cached_corpus_hash(Path(cache_dir), recipe.max_corpus_modules)
    directory = Path(cache_dir) / "targets" / f"tiny-{recipe_hash(recipe, corpus_sha)}"
    if (directory / "build.json").exists():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(directory.with_suffix(".lock")):
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
