"""Tokenizers (issue 15, item 2; issue 33, item 1): bytes, or a Hugging Face tokenizer read by transformers from
its directory (a pretrained model's own by default); the vocabulary checked against the model before anything
runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from local_tokenizer import END, train_tokenizer
from test_checkpoint import tiny_config

from tessera.config import ConfigError, parse_config
from tessera.data.text import ByteTokenizer, PackedText, default_corpus
from tessera.data.tokenizer import HFTokenizer, load_tokenizer
from tessera.inputs import InputError
from tessera.models.build import build_model


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


def test_a_trained_tokenizer_round_trips_and_packs_files_as_documents(tokenizer_json: Path) -> None:
    tok = load_tokenizer(str(tokenizer_json.parent))  # the directory holding tokenizer.json
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 400
    text = "def main() -> None:\n    return 'ünïcode'\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.end_of_document == [tok.inner.token_to_id(END)]
    files = default_corpus()[20:23]
    data = PackedText(files, 64, max_bytes=1 << 30, tokenizer=tok)
    want = [t for f in files for t in [*tok.encode(Path(f).read_text()), *tok.end_of_document]]
    assert data.tokens.tolist() == want
    assert len(want) < 0.6 * sum(Path(f).stat().st_size for f in files)  # BPE merges: fewer tokens than bytes
    held = PackedText(files, 64, max_bytes=1000, skip_bytes=500, tokenizer=tok)  # a byte window of the text
    joined = b"".join(Path(f).read_bytes() + b"\n" for f in files)[500:1500]
    assert held.tokens.tolist() == [*tok.encode(joined.decode().removesuffix("\n")), *tok.end_of_document]
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer) and isinstance(load_tokenizer(None), ByteTokenizer)


def _config(tmp_path: Path, model: dict, **data) -> dict:
    config = tiny_config(tmp_path, 2, 2, {"preset": "ddp"})
    model = model if "pretrained" in model else {**config["model"], **model}  # a pretrained one has no sizes
    return {**config, "model": model, "data": {**config["data"], **data}}


def test_the_model_is_sized_to_the_tokenizer_or_checked_against_it(tokenizer_json: Path, tmp_path: Path) -> None:
    sized = build_model(parse_config(_config(tmp_path, {}, tokenizer=str(tokenizer_json))))
    assert sized.tok_embeddings.num_embeddings == 400  # the reference Llama takes the tokenizer's size
    small = tmp_path / "small"
    from tessera.models import hf

    hf.llama(n_layer=1, hidden=32, n_head=4, n_kv_head=2, ffn=64, vocab_size=300, seq_len=32).save_pretrained(small)
    with pytest.raises(ConfigError, match=r"vocabulary of 300 tokens, but the data's tokenizer \(data.tokenizer .*"
                       r"\) gives ids up to 399"):  # fmt: skip
        build_model(parse_config(_config(tmp_path, {"pretrained": str(small)}, tokenizer=str(tokenizer_json))))
    with pytest.raises(InputError, match=r"has no tokenizer \(no tokenizer.json .*\), and data.tokenizer is not set"):
        build_model(parse_config(_config(tmp_path, {"pretrained": str(small)})))
    (small / "tokenizer.json").write_text(tokenizer_json.read_text())  # its own, by default: too large for it
    with pytest.raises(ConfigError, match=r"\(its own tokenizer\) gives ids up to 399"):
        build_model(parse_config(_config(tmp_path, {"pretrained": str(small)})))
    assert build_model(parse_config(_config(tmp_path, {"pretrained": str(small)}, tokenizer="bytes"))) is not None


def test_a_tokenizer_that_is_not_there_or_not_one_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.tokenizer='nowhere.json' does not exist"):
        parse_config(_config(tmp_path, {}, tokenizer="nowhere.json"))
    with pytest.raises(InputError, match="is a directory without a tokenizer"):
        load_tokenizer(str(tmp_path))
    bad = tmp_path / "tokenizer.json"
    bad.write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(InputError, match="is not a tokenizer.json transformers reads"):
        load_tokenizer(str(bad))
    assert torch.equal(PackedText(default_corpus()[:1], 16, 200).tokens, PackedText(default_corpus()[:1], 16, 200,
                       tokenizer=ByteTokenizer()).tokens)  # fmt: skip


def test_a_tokenizer_saved_by_transformers_brings_its_chat_template_special_and_added_tokens(
    tokenizer_json: Path, tmp_path: Path
) -> None:
    """Current transformers writes the chat template to chat_template.jinja (tokenizer_config.json holds none):
    read from the directory, the template, the end token the config names and an added token all work, and
    chat records train; every file is copied whole (a prepared folder or an export carries the tokenizer)."""
    from transformers import PreTrainedTokenizerFast

    from tessera.data.instructions import IGNORED, InstructionData
    from tessera.data.tokenizer import copy_tokenizer

    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}<eot>{% endfor %}"
    saved = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    saved.add_special_tokens({"eos_token": "<eot>"})  # an added token, and the end of a document
    saved.chat_template = template + "{% if add_generation_prompt %}[assistant]{% endif %}"
    saved.save_pretrained(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    tok = load_tokenizer(str(tmp_path / "saved"))
    assert tok.vocab_size == 401 and tok.end_of_document == [400] == tok.encode("<eot>")
    assert tok.chat_template == saved.chat_template
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    item = InstructionData([str(tmp_path / "c.jsonl")], tok, 32)[0]
    assert tok.decode(item["y"][item["y"] != IGNORED].tolist()) == "hello<eot>"
    copied = copy_tokenizer(tmp_path / "saved", tmp_path / "copy")
    assert set(copied) == {p.name for p in (tmp_path / "saved").iterdir()}
    again = load_tokenizer(str(tmp_path / "copy"))
    assert again.chat_template == tok.chat_template and again.end_of_document == [400]
