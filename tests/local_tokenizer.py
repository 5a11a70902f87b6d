"""A byte-level BPE tokenizer trained here, on the standard library's text (no hub): for the tokenizer,
data and fine-tuning tests."""

from __future__ import annotations

from pathlib import Path

from tessera.data.text import default_corpus

END = "<|endoftext|>"


def train_tokenizer(out_dir: Path, vocab_size: int = 400, files: int = 20) -> Path:
    """Train on the first ``files`` standard-library modules; write ``out_dir/tokenizer.json``; return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[END], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train(default_corpus()[:files], trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    return out_dir / "tokenizer.json"
