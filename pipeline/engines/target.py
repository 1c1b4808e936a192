"""The target model: where it lives, what it is (its identity hashes), and its frozen tensors."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.engines.layer_ids import model_family_of


class TargetError(RuntimeError):
    pass


@dataclass(frozen=True)
class TargetInfo:
    name: str
    model_dir: Path
    num_layers: int
    hidden_size: int
    vocab_size: int
    identity: dict[str, Any]


def resolve_model_dir(config: RunConfig) -> Path:
    """A local directory with the target's config, weights and tokenizer (building the tiny one if needed)."""
    if config.target.source == "tiny":
        from pipeline.engines.tiny_target import ensure_tiny_target

        assert config.target.tiny is not None
        return ensure_tiny_target(config.target.tiny, config.storage.local_cache)
    path = Path(config.target.model_path or "")
    if not (path / "config.json").is_file():
        raise TargetError(
            f"target.model_path {config.target.model_path!r} is not a local model directory "
            "with config.json; download the model first (nothing is fetched from model hubs at run time)"
        )
    return path


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _canonical_config(model_dir: Path) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text())
    for volatile in ("transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        config.pop(volatile, None)
    return config


def text_config(model_dir: Path) -> dict[str, Any]:
    """The language-model part of a config (multimodal checkpoints nest it under text_config)."""
    config = _canonical_config(model_dir)
    return config.get("text_config", config)


def remote_code_files(model_dir: Path, config_name: str) -> list[str]:
    """The Python files a config file's auto_map names, e.g. config.json -> configuration_deepseek.py.

    Entries are "module.Class", a [slow, fast] pair for tokenizers, or "org/repo--module.Class" for
    code kept in another repository (then not in this directory; listed all the same).
    """
    path = model_dir / config_name
    if not path.is_file():
        return []
    auto_map = json.loads(path.read_text()).get("auto_map") or {}
    references = [
        ref for value in auto_map.values() for ref in (value if isinstance(value, list) else [value]) if ref
    ]
    return sorted({ref.split("--")[-1].rsplit(".", 1)[0] + ".py" for ref in references})


def _digest_files(digest, model_dir: Path, names: list[str]) -> None:
    for name in names:
        path = model_dir / name
        if path.is_file():
            digest.update(name.encode())
            digest.update(path.read_bytes())


def _tokenizer_hash(model_dir: Path) -> str:
    """Vocabulary files and, for a tokenizer shipped as code (Kimi's tiktoken one), that code."""
    digest = hashlib.sha256()
    vocabulary = ["tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "merges.txt"]
    _digest_files(digest, model_dir, vocabulary)
    _digest_files(digest, model_dir, remote_code_files(model_dir, "tokenizer_config.json"))
    return digest.hexdigest()


def _config_hash(model_dir: Path) -> str:
    """config.json and the configuration/modeling code it names: that code defines what its settings mean.

    Without such code the hash is that of config.json alone, as it always was.
    """
    canonical = json.dumps(_canonical_config(model_dir), sort_keys=True)
    code = remote_code_files(model_dir, "config.json")
    if not code:
        return _sha256_text(canonical)
    digest = hashlib.sha256(canonical.encode())
    _digest_files(digest, model_dir, code)
    return digest.hexdigest()


def chat_template_of(model_dir: Path) -> str:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tokenizer_config = model_dir / "tokenizer_config.json"
    if tokenizer_config.is_file():
        template = json.loads(tokenizer_config.read_text()).get("chat_template")
        if isinstance(template, str):
            return template
    raise TargetError(f"target at {model_dir} has no chat template")


# `hf download REPO --revision R --local-dir DIR` records, for each file, the commit it came from as the
# first line of DIR/.cache/huggingface/download/<file>.metadata (huggingface_hub's _local_folder.py)
DOWNLOAD_METADATA = Path(".cache") / "huggingface" / "download" / "config.json.metadata"


def downloaded_revision(model_dir: Path) -> str | None:
    """The commit a local model directory's config.json was downloaded at from the Hub, as `hf download
    --local-dir` records it; None for a directory made otherwise."""
    path = model_dir / DOWNLOAD_METADATA
    if not path.is_file():
        return None
    lines = path.read_text().splitlines()
    return lines[0].strip() or None if lines else None


def target_revision(config: RunConfig, model_dir: Path) -> str | None:
    """The revision a run records for its target: the commit a downloaded model directory holds (what a
    server started on that directory serves, whatever its --revision flag says: SGLang uses --revision only
    to download), which target.revision, when set, must name; else target.revision as configured."""
    held, wanted = downloaded_revision(model_dir), config.target.revision
    if held is None:
        return wanted
    if wanted is not None and wanted != held:
        raise TargetError(
            f"target.revision is {wanted!r}, but {model_dir} holds revision {held!r} (its "
            f"{DOWNLOAD_METADATA}): put that revision's weights there, or leave target.revision unset"
        )
    return held


def describe_target(config: RunConfig, model_dir: Path | None = None) -> TargetInfo:
    model_dir = model_dir or resolve_model_dir(config)
    text = text_config(model_dir)
    info = TargetInfo(
        name=config.target.name,
        model_dir=model_dir,
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=int(text["hidden_size"]),
        vocab_size=int(text["vocab_size"]),
        identity={
            "name": config.target.name,
            "source": config.target.source,
            "model_path": str(config.target.model_path or model_dir.name),
            "revision": target_revision(config, model_dir),
            "config_sha256": _config_hash(model_dir),
            "tokenizer_sha256": _tokenizer_hash(model_dir),
            "chat_template_sha256": _sha256_text(chat_template_of(model_dir)),
            # how SGLang reads aux layer ids for it; the exporter writes the drafter's ids by it
            "model_family": model_family_of(model_dir),
        },
    )
    for field in ("num_layers", "hidden_size", "vocab_size"):
        expected = getattr(config.target, field)
        if expected is not None and expected != getattr(info, field):
            raise TargetError(
                f"target.{field} is {expected} in the config but {getattr(info, field)} in {model_dir}"
            )
    return info


def require_trust_for_shipped_code(model_dir: Path, trust_remote_code: bool) -> None:
    """A directory that ships its own code (Kimi-K2.5 does) loads only when the config allows running it.

    Checked here because transformers' own refusal names its argument, not the setting to change.
    """
    if trust_remote_code:
        return
    shipped = {name: remote_code_files(model_dir, name) for name in ("config.json", "tokenizer_config.json")}
    shipped = {name: files for name, files in shipped.items() if files}
    if shipped:
        listing = "; ".join(f"{name} auto_map names {', '.join(files)}" for name, files in shipped.items())
        raise TargetError(
            f"the target at {model_dir} ships its own code ({listing}); loading it runs that code, "
            "so it needs target.trust_remote_code: true in the run config (servers: "
            "--trust-remote-code)"
        )


def load_tokenizer(model_dir: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    require_trust_for_shipped_code(model_dir, trust_remote_code)
    return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)


def load_model(model_dir: Path, dtype: str = "float32", trust_remote_code: bool = False):
    import torch
    from transformers import AutoModelForCausalLM

    require_trust_for_shipped_code(model_dir, trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
    )
    model.eval()
    return model


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, through the index when the checkpoint is sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise TargetError(f"no safetensors weights in {model_dir}")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as handle:
        return {name: single for name in handle.keys()}


def load_frozen_tensors(model_dir: Path) -> dict[str, Any]:
    """embed_tokens, lm_head and final norm of the target, read without loading the whole model."""
    from safetensors import safe_open

    files = _weight_files(model_dir)
    wanted = {"embed": "embed_tokens.weight", "lm_head": "lm_head.weight", "norm": "model.norm.weight"}
    tensors = {}
    for role, suffix in wanted.items():
        matches = sorted(name for name in files if name.endswith(suffix) and "mtp" not in name)
        if role == "lm_head" and not matches:
            matches = sorted(name for name in files if name.endswith("embed_tokens.weight"))  # tied
        if not matches:
            raise TargetError(f"target weights in {model_dir} have no tensor ending in {suffix}")
        with safe_open(str(files[matches[0]]), framework="pt") as handle:
            tensors[role] = handle.get_tensor(matches[0])
    return tensors
