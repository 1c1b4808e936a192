"""Tokenizer of the tiny Kimi-style target: a tiktoken BPE shipped as code, laid out like Kimi-K2.5's.

`tiktoken.model` holds one `base64(token bytes) rank` line per base token; a token's rank is both its
id and its merge priority. Special tokens follow the base vocabulary in a fixed number of slots (Kimi-
K2.5: 163,584 base tokens, then 256 slots), named where tokenizer_config.json's added_tokens_decoder
names them and `<|reserved_token_{id}|>` elsewhere.
"""

from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path

import tiktoken
from transformers import AddedToken, PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}
SPECIAL_TOKEN_SLOTS = 16
# GPT-2's pre-tokenization: the ranks come from a byte-level BPE trained behind the same split, so
# tiktoken encodes text to the ids that BPE gives it.
PRETOKENIZE_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def byte_to_char() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte, so that a token's bytes read as a string."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


def read_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """The ranks in a tiktoken.model file, read directly: tiktoken.load caches local files by path
    in a temporary folder and would keep serving old ranks after the file changed."""
    ranks = {}
    for number, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ValueError(f"{path}:{number}: expected 'base64(token) rank'")
        ranks[base64.b64decode(fields[0])] = int(fields[1])
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be 0..{len(ranks) - 1}, each once")
    return ranks


def write_ranks(ranks: dict[bytes, int], path: str | os.PathLike) -> None:
    lines = [
        base64.b64encode(token) + b" " + str(rank).encode()
        for token, rank in sorted(ranks.items(), key=lambda item: item[1])
    ]
    Path(path).write_bytes(b"\n".join(lines) + b"\n")


def _content(token) -> str:
    return token.content if isinstance(token, AddedToken) else token["content"]


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str,
        bos_token: str = "[BOS]",
        eos_token: str = "[EOS]",
        unk_token: str = "[UNK]",
        pad_token: str = "[PAD]",
        added_tokens_decoder: dict | None = None,
        **kwargs,
    ):
        ranks = read_ranks(vocab_file)
        named = {int(i): _content(token) for i, token in (added_tokens_decoder or {}).items()}
        slots = range(len(ranks), len(ranks) + SPECIAL_TOKEN_SLOTS)
        self.special_tokens = {named.get(i, f"<|reserved_token_{i}|>"): i for i in slots}
        self.vocab_file = vocab_file
        self.model = tiktoken.Encoding(
            name=Path(vocab_file).name,
            pat_str=PRETOKENIZE_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        chars = byte_to_char()
        self.byte_decoder = {char: byte for byte, char in chars.items()}
        self.decoder = {rank: "".join(chars[byte] for byte in token) for token, rank in ranks.items()}
        self.decoder.update({i: name for name, i in self.special_tokens.items()})
        self.encoder = {token: i for i, token in self.decoder.items()}
        named_roles = {str(bos_token), str(eos_token), str(unk_token), str(pad_token)}
        kwargs.setdefault(
            "extra_special_tokens", [name for name in self.special_tokens if name not in named_roles]
        )
        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            added_tokens_decoder={
                i: AddedToken(name, special=True, normalized=False) for name, i in self.special_tokens.items()
            },
            **kwargs,
        )

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.encoder)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        # special tokens were split off by the caller; whatever remains is ordinary text
        return [self.decoder[i] for i in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder.get(token, self.encoder[str(self.unk_token)])

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(self.byte_decoder[char] for char in "".join(tokens)).decode("utf-8", "replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        target = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(target):
            shutil.copyfile(self.vocab_file, target)
        return (target,)


__all__ = ["TikTokenTokenizer"]
