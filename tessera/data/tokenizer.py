"""Tokenizers: bytes (nothing to train or download), or a Hugging Face ``tokenizer.json`` through the
``tokenizers`` library — a pretrained model's own by default.

``data.tokenizer: bytes`` keeps byte tokens; ``data.tokenizer: PATH`` takes a ``tokenizer.json`` file
or a directory holding one; left unset, a ``model.pretrained`` directory's own ``tokenizer.json`` is
used, and bytes otherwise.

Example:
    >>> tok = load_tokenizer("my_tokenizer/")
    >>> tok.decode(tok.encode("hello"))
    'hello'
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Protocol

from tessera.data.text import ByteTokenizer
from tessera.inputs import InputError

# The names tokenizers give the token that ends a document, most common first.
END_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>", "<eos>", "[SEP]")


class Tokenizer(Protocol):
    """What Tessera needs of a tokenizer."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: list[int]) -> str: ...

    @property
    def end_of_document(self) -> list[int]: ...


class HFTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` library (no special tokens added on encode: documents
    are separated by the end token, which packing puts between them)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as Inner

        try:
            self.inner = Inner.from_file(str(path))
        except Exception as exc:  # the Rust library's own error: not JSON, or not a tokenizer
            reason = " ".join(str(exc).split())[:200]
            raise InputError(
                f"data.tokenizer '{path}' is not a tokenizer.json the tokenizers library reads ({reason})."
            ) from None
        self.path = path
        self.vocab_size = self.inner.get_vocab_size(with_added_tokens=True)
        self._end = self._end_token(path.parent)

    def _end_token(self, folder: Path) -> list[int]:
        configured = None
        config = folder / "tokenizer_config.json"
        if config.is_file():
            try:
                eos = json.loads(config.read_text()).get("eos_token")
                configured = eos.get("content") if isinstance(eos, dict) else eos
            except (ValueError, AttributeError):
                configured = None
        for name in (configured, *END_TOKENS):
            if isinstance(name, str) and (token := self.inner.token_to_id(name)) is not None:
                return [token]
        return self.encode("\n")  # no end token: a newline, as the byte tokenizer separates files

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids and, for each, the (start, end) characters of ``text`` it stands for."""
        encoding = self.inner.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.inner.encode_batch(texts, add_special_tokens=False)]

    def decode(self, tokens: list[int]) -> str:
        return self.inner.decode([int(t) for t in tokens], skip_special_tokens=False)

    @property
    def end_of_document(self) -> list[int]:
        return self._end


@functools.lru_cache(maxsize=8)
def _hf_tokenizer(path: str) -> HFTokenizer:
    return HFTokenizer(Path(path))


def tokenizer_file(spec: str | Path, field: str = "data.tokenizer") -> Path:
    """The ``tokenizer.json`` a path names: the file itself, or the one in a directory."""
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise InputError(
                f"{field} '{spec}' is a directory without a tokenizer.json: give the tokenizer.json file, a "
                "directory holding one (tokenizer.save_pretrained writes it), or data.tokenizer: bytes."
            )
    elif not path.is_file():
        raise InputError(f"{field} '{spec}' does not exist: give a tokenizer.json, its directory, or bytes.")
    return path


def load_tokenizer(spec: str | None, pretrained: str | None = None) -> ByteTokenizer | HFTokenizer:
    """``spec`` ("bytes", a path, or None: the pretrained directory's own tokenizer, else bytes)."""
    if spec == "bytes" or (spec is None and pretrained is None):
        return ByteTokenizer()
    if spec is None:
        assert pretrained is not None
        if not (Path(pretrained) / "tokenizer.json").is_file():
            raise InputError(
                f"model.pretrained '{pretrained}' has no tokenizer.json, and data.tokenizer is not set: give "
                "data.tokenizer (a tokenizer.json or its directory), or data.tokenizer: bytes for byte tokens."
            )
        return _hf_tokenizer(str((Path(pretrained) / "tokenizer.json").resolve()))
    return _hf_tokenizer(str(tokenizer_file(spec).resolve()))
