"""Tokenizers: bytes (nothing to train or download), or a Hugging Face tokenizer read the way transformers
writes it — a pretrained model's own by default.

``data.tokenizer: bytes`` keeps byte tokens; ``data.tokenizer: PATH`` takes a tokenizer directory (what
``tokenizer.save_pretrained`` writes: ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``,
special and added tokens) or a lone ``tokenizer.json`` file; left unset, a ``model.pretrained`` directory's
own tokenizer is used, and bytes otherwise.

Example:
    >>> tok = load_tokenizer("my_tokenizer/")
    >>> tok.decode(tok.encode("hello"))
    'hello'
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from tessera.data.text import ByteTokenizer
from tessera.inputs import InputError

# The names tokenizers give the token that ends a document, most common first.
END_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>", "<eos>", "[SEP]")
# What marks a directory as a tokenizer's: the fast tokenizer's file, or the config transformers writes.
TOKENIZER_MARKS = ("tokenizer.json", "tokenizer_config.json")


class Tokenizer(Protocol):
    """What Tessera needs of a tokenizer."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: list[int]) -> str: ...

    @property
    def end_of_document(self) -> list[int]: ...


class HFTokenizer:
    """A Hugging Face tokenizer, read by transformers from its directory (``PreTrainedTokenizerFast``, or
    ``AutoTokenizer`` where there is no ``tokenizer.json`` to read as it is); it encodes through its
    ``tokenizers`` backend with no special tokens added: documents are separated by the end token
    (``eos_token``), which packing puts between them. ``chat_template``: the tokenizer's own, wherever
    transformers keeps it (``chat_template.jinja`` or ``tokenizer_config.json``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.hf = _read(path)
        self.inner = self.hf.backend_tokenizer
        self.vocab_size = self.inner.get_vocab_size(with_added_tokens=True)
        self._end = self._end_token()

    def _end_token(self) -> list[int]:
        for name in (self.hf.eos_token, *END_TOKENS):
            if isinstance(name, str) and (token := self.inner.token_to_id(name)) is not None:
                return [token]
        return self.encode("\n")  # no end token: a newline, as the byte tokenizer separates files

    @property
    def chat_template(self) -> str | None:
        template = self.hf.chat_template
        if isinstance(template, dict):  # several named templates: the default one
            template = template.get("default")
        return template or None

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


def _read(path: Path) -> Any:
    """The transformers tokenizer at ``path`` (a directory, or a tokenizer.json file), or a bad-input error."""
    from tokenizers import Tokenizer as Inner

    folder = path if path.is_dir() else path.parent
    json_file = path if path.is_file() else folder / "tokenizer.json"
    if json_file.is_file():  # the tokenizers library's own reason, where transformers would give a KeyError
        try:
            Inner.from_file(str(json_file))
        except Exception as exc:  # the Rust library's error: not JSON, or not a tokenizer
            reason = " ".join(str(exc).split())[:200]
            raise InputError(
                f"data.tokenizer '{json_file}' is not a tokenizer.json transformers reads ({reason})."
            ) from None
    with _quiet_transformers():
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        try:
            if path.is_file() and path.name != "tokenizer.json":  # a file by another name: no directory to read
                return PreTrainedTokenizerFast(tokenizer_file=str(path))
            if json_file.is_file():
                return PreTrainedTokenizerFast.from_pretrained(str(folder))
            tokenizer = AutoTokenizer.from_pretrained(str(folder))  # e.g. a sentencepiece model, converted
        except (OSError, ValueError, KeyError, ImportError) as exc:
            reason = " ".join(str(exc).split())[:240]
            raise InputError(
                f"data.tokenizer '{path}': transformers cannot read a tokenizer there ({reason}). Give a directory "
                "that tokenizer.save_pretrained wrote, a tokenizer.json, or data.tokenizer: bytes."
            ) from None
    if not getattr(tokenizer, "is_fast", False):
        raise InputError(
            f"data.tokenizer '{path}' is a slow (Python) tokenizer: save it as a fast one "
            "(AutoTokenizer.from_pretrained(..., use_fast=True).save_pretrained(...) writes tokenizer.json)."
        )
    return tokenizer


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' own logging held at ERROR while it reads a tokenizer (it warns, e.g., when the class a
    directory names is not the one reading it: harmless here, as the backend is what encodes)."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


@functools.lru_cache(maxsize=8)
def _hf_tokenizer(path: str) -> HFTokenizer:
    return HFTokenizer(Path(path))


def is_tokenizer_dir(path: Path) -> bool:
    """Whether ``path`` is a directory holding a tokenizer (its tokenizer.json or tokenizer_config.json)."""
    return path.is_dir() and any((path / name).is_file() for name in TOKENIZER_MARKS)


def tokenizer_source(spec: str | Path, field: str = "data.tokenizer") -> Path:
    """What a path names as a tokenizer: a directory holding one, or a tokenizer.json file."""
    path = Path(spec)
    if path.is_dir():
        if not is_tokenizer_dir(path):
            raise InputError(
                f"{field} '{spec}' is a directory without a tokenizer (no tokenizer.json or tokenizer_config.json): "
                "give the directory tokenizer.save_pretrained wrote, a tokenizer.json, or data.tokenizer: bytes."
            )
    elif not path.is_file():
        raise InputError(f"{field} '{spec}' does not exist: give a tokenizer directory, a tokenizer.json, or bytes.")
    return path


def load_tokenizer(spec: str | None, pretrained: str | None = None) -> ByteTokenizer | HFTokenizer:
    """``spec`` ("bytes", a path, or None: the pretrained directory's own tokenizer, else bytes)."""
    if spec == "bytes" or (spec is None and pretrained is None):
        return ByteTokenizer()
    if spec is None:
        assert pretrained is not None
        if not is_tokenizer_dir(Path(pretrained)):
            raise InputError(
                f"model.pretrained '{pretrained}' has no tokenizer (no tokenizer.json or tokenizer_config.json), and "
                "data.tokenizer is not set: give data.tokenizer (a tokenizer directory or tokenizer.json), or "
                "data.tokenizer: bytes for byte tokens."
            )
        return _hf_tokenizer(str(Path(pretrained).resolve()))
    return _hf_tokenizer(str(tokenizer_source(spec).resolve()))


# The files transformers reads a tokenizer from (those a directory has are copied whole: bit for bit, so an
# export or a prepared folder holds the tokenizer as it was written), and the patterns of the others.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.json", "vocab.json", "vocab.txt", "merges.txt", "generation_config.json")  # fmt: skip
TOKENIZER_PATTERNS = ("*.jinja", "*.model", "*.tiktoken", "additional_chat_templates")


def copy_tokenizer(source: Path, out_dir: Path) -> list[str]:
    """Copy the tokenizer at ``source`` (a directory, or a tokenizer.json file) into ``out_dir``: every file
    of it there is (a chat template in ``chat_template.jinja`` included). Returns the names copied."""
    import shutil

    out_dir.mkdir(parents=True, exist_ok=True)
    if source.is_file():
        shutil.copy2(source, out_dir / "tokenizer.json")
        return ["tokenizer.json"]
    found = {source / name for name in TOKENIZER_FILES} | {p for g in TOKENIZER_PATTERNS for p in source.glob(g)}
    copied = []
    for path in sorted(p for p in found if p.exists()):
        if path.is_dir():
            shutil.copytree(path, out_dir / path.name, dirs_exist_ok=True)
        else:
            shutil.copy2(path, out_dir / path.name)
        copied.append(path.name)
    return copied
