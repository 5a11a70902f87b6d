"""`tessera data prepare` tokens/s, and the shard loader's tokens/s against what a training step consumes.

Corpus: the standard library's ``*.py`` files (recursively), as jsonl records ``{"text": ...}`` up to
``--mb`` MB, cut into 4 jsonl files. Tokenizer: a byte-level BPE of ``--vocab`` tokens trained here on
20 of those files with the ``tokenizers`` library (bytes with ``--vocab 0``). Measured, in one run:

1. ``prepare`` with 1 worker and with 2 workers (a fresh folder each; repetitions interleaved), tokens/s;
2. the loader: ``TokenShards`` windows through the Booster's sharded loader (shuffled, one process),
   tokens/s of batches delivered;
3. a training step of the demo model (``examples/demo.yaml``'s Llama at its batch, fp32, AdamW) on one
   process: the tokens/s training consumes.

    python benchmarks/data_prepare.py [--mb 40] [--reps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import torch


def write_corpus(folder: Path, megabytes: float) -> list[str]:
    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "**" / "*.py"), recursive=True))
    outs = [(folder / f"part{i}.jsonl").open("w") for i in range(4)]
    size, n = 0, 0
    for path in files:
        text = Path(path).read_text(errors="replace")
        outs[n % 4].write(json.dumps({"text": text}) + "\n")
        size, n = size + len(text.encode()), n + 1
        if size >= megabytes * 1e6:
            break
    for f in outs:
        f.close()
    print(f"corpus: {n} documents, {size / 1e6:.1f} MB of text in 4 jsonl files")
    return [str(folder / f"part{i}.jsonl") for i in range(4)]


def train_bpe(folder: Path, vocab: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tessera.data.text import default_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train(default_corpus()[:20], trainer)
    tok.save(str(folder / "tokenizer.json"))
    return str(folder / "tokenizer.json")


def loader_tokens_per_s(folder: Path, seq_len: int, batch: int, batches: int) -> float:
    import tessera
    from tessera.data.shards import TokenShards

    booster = tessera.Booster(tessera.DDP())
    loader = booster.dataloader(TokenShards(folder, seq_len), global_batch_size=batch, seed=0)
    batches = min(batches, len(loader) - 1)
    it = iter(loader)
    next(it)  # the first batch builds the shuffle
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * batch * seq_len / (time.perf_counter() - start)


def training_tokens_per_s(vocab: int, seq_len: int, batch: int, steps: int) -> float:
    import torch.nn.functional as F

    from tessera.models import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=vocab, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384,
                              max_seq_len=seq_len))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, vocab, (batch, seq_len + 1))
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        logits = model(x[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return batch * seq_len / statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=40.0)
    parser.add_argument("--vocab", type=int, default=8000, help="BPE vocabulary; 0: bytes")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import os

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import tessera
    from tessera.data.prepare import prepare

    tessera.init(backend="gloo")
    result: dict = {"prepare": {1: [], 2: []}}
    with tempfile.TemporaryDirectory(prefix="tessera-prepare-") as tmp:
        tmp_path = Path(tmp)
        inputs = write_corpus(tmp_path, args.mb)
        tokenizer = train_bpe(tmp_path, args.vocab) if args.vocab else "bytes"
        for rep in range(args.reps):
            for workers in (1, 2) if rep % 2 == 0 else (2, 1):
                out = tmp_path / f"out_{rep}_{workers}"
                start = time.perf_counter()
                index = prepare(inputs, out, tokenizer, workers=workers, progress=False)
                rate = index["tokens"] / (time.perf_counter() - start)
                result["prepare"][workers].append(rate)
                print(f"rep {rep}: prepare, {workers} worker(s): {rate:,.0f} tokens/s ({index['tokens']:,} tokens)")
        result["tokens"], result["bytes_per_token"] = index["tokens"], args.mb * 1e6 / index["tokens"]
        vocab = index["vocab_size"]
        result["loader"] = [loader_tokens_per_s(out, 128, 16, 2000) for _ in range(args.reps)]
    result["training"] = [training_tokens_per_s(vocab, 128, 16, 10) for _ in range(args.reps)]
    prep = {w: statistics.median(r) for w, r in result["prepare"].items()}
    loader, training = statistics.median(result["loader"]), statistics.median(result["training"])
    print(f"\nprepare: {prep[1]:,.0f} tokens/s with 1 worker, {prep[2]:,.0f} with 2 ({prep[2] / prep[1]:.2f}x)")
    print(f"loader (TokenShards, shuffled, batch 16 x 128): {loader:,.0f} tokens/s")
    print(f"training (demo Llama, vocab {vocab}, batch 16 x 128, one process): {training:,.0f} tokens/s")
    print(f"loader / training: {loader / training:,.0f}x")
    if args.json:
        args.json.write_text(json.dumps({**result, "median": {"prepare": prep, "loader": loader,
                                                              "training": training}}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
