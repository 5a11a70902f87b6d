"""Instruction and chat data for fine-tuning, with the loss on the response tokens only.

Each jsonl record is ``{"prompt": ..., "response": ...}`` or ``{"messages": [{"role": ..., "content":
...}, ...]}`` (roles system, user, assistant), the latter rendered with the tokenizer's chat template
(transformers keeps it in ``chat_template.jinja`` or ``tokenizer_config.json``). The prompt's (or
non-assistant turns') targets are ``-100``, which the loss ignores, as is the padding; a record longer
than a sequence is cut (counted). A record per sequence, or with ``pack`` as many whole records as fit,
kept apart by per-record positions and an attention mask: no token attends to another record's.

The loss over a global batch is the mean over its response tokens, whatever the layout:
:meth:`tessera.Booster.token_mean_scale` makes each rank's summed loss count its tokens against the
global batch's.

Example::

    data = InstructionData(["sft.jsonl"], tokenizer, seq_len=512)
    data[0]  # {"x": 512 token ids, "y": 512 targets, -100 outside the response}
"""

from __future__ import annotations

import bisect
import itertools
import json
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from tessera.data.records import BadRecords, json_objects
from tessera.inputs import InputError

IGNORED = -100  # F.cross_entropy's ignore_index: not counted in the loss
HANDED_ENV = "TESSERA_INSTRUCTIONS_FILE"  # the records the launcher tokenized, handed to its ranks
ROLES = ("system", "user", "assistant")


def read_records(paths: list[str], bad: BadRecords) -> list[dict[str, Any]]:
    """Every record of the jsonl files, with its ``file:line``; a line that is not a JSON object goes to
    ``bad`` (stops there, or is left out and counted)."""
    records = []
    for path in paths:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
        records += [{**record, "_where": where} for where, record in json_objects(lines, path, bad)]
    return records


class ChatTemplate:
    """A tokenizer's chat template (transformers renders it), split into each message's text."""

    def __init__(self, tokenizer: Any) -> None:
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            where = getattr(tokenizer, "path", "bytes")
            raise InputError(
                f"the tokenizer '{where}' has no chat template (transformers keeps it in chat_template.jinja or in "
                "tokenizer_config.json's chat_template): write records as prompt/response, or give a tokenizer "
                "with a chat template."
            )
        self.renderer = tokenizer.hf

    def segments(self, messages: list[dict[str, str]]) -> list[tuple[str, str]]:
        """``(role, text)`` pieces of the rendered conversation, in order: each message's text (the conversation
        up to it, less the one before it); an assistant turn's header (what the template adds for
        ``add_generation_prompt``) goes with the turn before it, so the loss counts what the model says."""
        out, done = [], ""
        for k in range(1, len(messages) + 1):
            role = messages[k - 1]["role"]
            if role == "assistant":
                header = self.renderer.apply_chat_template(
                    messages[: k - 1], tokenize=False, add_generation_prompt=True
                )
                if header.startswith(done) and len(header) > len(done):
                    out.append(("header", header[len(done) :]))
                    done = header
            text = self.renderer.apply_chat_template(messages[:k], tokenize=False)
            if not text.startswith(done):
                raise InputError("the chat template does not render a conversation as its messages in order.")
            out.append((role, text[len(done) :]))
            done = text
        return out


class BadRecord(ValueError):
    """A record that cannot be used, and why (the reader names where: ``file:line``)."""


def tokenize_record(record: dict[str, Any], tokenizer: Any, chat: ChatTemplate | None) -> tuple[list[int], list[bool]]:
    """The record's tokens and which of them the loss counts (the response's, and its end token); a record
    that cannot be used raises :class:`BadRecord`."""
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise BadRecord("'messages' must be a non-empty list of {role, content} objects")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise BadRecord("every message needs a string 'content'")
            if m.get("role") not in ROLES:
                raise BadRecord(f"unknown role {m.get('role')!r} (roles: {', '.join(ROLES)})")
        if chat is None:  # the data's form, not one record's fault: stops, whatever on_bad_record says
            where = record.get("_where", "a record")
            raise InputError(f"{where}: a messages record needs a tokenizer with a chat template (data.tokenizer).")
        return _assistant_tokens(chat.segments([{"role": m["role"], "content": m["content"]} for m in messages]),
                                 tokenizer)  # fmt: skip
    prompt, response = record.get("prompt"), record.get("response")
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise BadRecord("a record needs string 'prompt' and 'response' fields, or 'messages'")
    head, tail = tokenizer.encode(prompt), [*tokenizer.encode(response), *tokenizer.end_of_document]
    return head + tail, [False] * len(head) + [True] * len(tail)


def _assistant_tokens(segments: list[tuple[str, str]], tokenizer: Any) -> tuple[list[int], list[bool]]:
    """The rendered conversation tokenized in one piece (the tokens the model will be prompted with, merges
    across a turn's boundary made: " self" after a header ending in a space), each token counted when it
    carries a character of an assistant turn."""
    text = "".join(piece for _, piece in segments)
    ids, offsets = tokenizer.encode_with_offsets(text)
    starts = list(itertools.accumulate((len(piece) for _, piece in segments), initial=0))
    roles = [role for role, _ in segments]

    def counted(start: int, end: int) -> bool:
        first, last = (bisect.bisect_right(starts, c) - 1 for c in (start, max(end - 1, start)))
        return any(roles[k] == "assistant" for k in range(first, min(last, len(roles) - 1) + 1))

    return ids, [counted(start, end) for start, end in offsets]


class InstructionData(Dataset):
    """Records as sequences of ``seq_len`` tokens: ``x`` the tokens (padded), ``y`` the next tokens where
    the loss counts them, else -100. ``truncated``: records longer than ``seq_len + 1`` tokens, cut.

    ``pack=False``: one record per sequence. ``pack=True``: whole records, in order, as many as fit in each
    sequence, kept apart: items also carry ``documents`` (each token's record within the sequence; -1 for
    padding) and ``position_ids`` (counted from 0 in each record), from which the runtime builds the
    attention mask that stops a token attending to another record's
    (:func:`tessera.runtime.microbatches.keyword_inputs`, :func:`tessera.packing.records_mask`)."""

    def __init__(
        self,
        paths: list[str],
        tokenizer: Any,
        seq_len: int,
        on_bad_record: str = "stop",
        pad_id: int = 0,
        pack: bool = False,
        records: list[dict[str, Any]] | None = None,
        field: str = "data.instructions",
    ) -> None:
        """``records``: rows already read (each with its ``_where``), from the sources ``paths`` names, which
        the config's ``field`` gave."""
        bad = BadRecords(on_bad_record)
        records = read_records(paths, bad) if records is None else records
        needs_chat = any("messages" in r for r in records)
        chat = ChatTemplate(tokenizer) if needs_chat and hasattr(tokenizer, "hf") else None  # bytes: none
        self.truncated, pieces = 0, []
        for record in records:
            try:
                ids, counted = tokenize_record(record, tokenizer, chat)
            except BadRecord as exc:
                bad(record["_where"], str(exc))
                continue
            if len(ids) > seq_len + 1:
                self.truncated += 1
                ids, counted = ids[: seq_len + 1], counted[: seq_len + 1]
            pieces.append((ids, counted))
        self.skipped = bad.skipped
        if not pieces:
            raise InputError(f"{field} {', '.join(paths)} hold no records ({bad.skipped} skipped).")
        groups = _pack(pieces, seq_len) if pack else [[p] for p in pieces]
        n = len(groups)
        self.x = torch.full((n, seq_len), pad_id, dtype=torch.long)
        self.y = torch.full((n, seq_len), IGNORED, dtype=torch.long)
        self.documents = torch.full((n, seq_len), -1, dtype=torch.long) if pack else None
        self.positions = torch.zeros((n, seq_len), dtype=torch.long) if pack else None
        for i, group in enumerate(groups):
            start = 0
            for d, (ids, counted) in enumerate(group):
                length = len(ids) - 1  # a record of k tokens gives k - 1 (input, target) pairs
                tokens = torch.tensor(ids)
                self.x[i, start : start + length] = tokens[:-1]
                self.y[i, start : start + length] = torch.where(torch.tensor(counted[1:]), tokens[1:], IGNORED)
                if pack:
                    self.documents[i, start : start + length] = d
                    self.positions[i, start : start + length] = torch.arange(length)
                start += length
        if not bool((self.y != IGNORED).any()):
            raise InputError(f"{field} {', '.join(paths)}: no record has a response token to learn.")

    def __len__(self) -> int:
        return len(self.x)

    # The launcher tokenizes every record before launch (to name a bad one then); its ranks read the result
    # instead of tokenizing again (HANDED_ENV names the file).
    def save(self, path: str | Path, key: str) -> None:
        """Write the tokenized records to ``path``, marked with ``key`` (what they were made from)."""
        fields = {"x": self.x, "y": self.y, "documents": self.documents, "positions": self.positions}
        torch.save({"key": key, "truncated": self.truncated, "skipped": self.skipped, **fields}, path)

    @classmethod
    def saved(cls, path: str | Path, key: str) -> InstructionData | None:
        """The records :meth:`save` wrote to ``path``, or None when it holds none made from ``key``."""
        try:
            stored = torch.load(path, weights_only=True)
        except (OSError, RuntimeError, ValueError):
            return None
        if not isinstance(stored, dict) or stored.get("key") != key:
            return None
        data = cls.__new__(cls)
        data.x, data.y, data.documents, data.positions = (stored[k] for k in ("x", "y", "documents", "positions"))
        data.truncated, data.skipped = stored["truncated"], stored["skipped"]
        return data

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = {"x": self.x[i], "y": self.y[i]}
        if self.documents is not None and self.positions is not None:
            item["documents"], item["position_ids"] = self.documents[i], self.positions[i]
        return item


def records_key(data: Any, pretrained: str | None) -> str:
    """What a tokenized set of records is made from: a config's ``data`` section and its pretrained model
    (whose tokenizer it may be)."""
    return json.dumps({"data": data.model_dump(mode="json"), "pretrained": pretrained}, sort_keys=True)


def _pack(pieces: list[tuple[list[int], list[bool]]], seq_len: int) -> list[list[tuple[list[int], list[bool]]]]:
    """Records in order, a new sequence whenever the next would not fit (a record of k tokens takes k - 1)."""
    groups: list[list[tuple[list[int], list[bool]]]] = [[]]
    used = 0
    for piece in pieces:
        length = len(piece[0]) - 1
        if groups[-1] and used + length > seq_len:
            groups.append([])
            used = 0
        groups[-1].append(piece)
        used += length
    return groups
