"""Fine-tuning data (issue 15, item 4): prompt/response and chat records, the loss on response tokens only,
averaged over the global batch's response tokens in every layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from local_tokenizer import END, train_tokenizer
from parity import run_shared

import tessera
from tessera.data.instructions import IGNORED, InstructionData
from tessera.data.text import ByteTokenizer
from tessera.data.tokenizer import load_tokenizer
from tessera.inputs import InputError

SEQ, BATCH, STEPS = 32, 8, 2
PACKED = 96  # a packed sequence: room for several records


def _records(path: Path, n: int = 24) -> Path:
    """Prompts and responses of lengths that differ widely: ranks and micro-batches count unlike numbers of
    response tokens (and one record is longer than a sequence)."""
    lines = [json.dumps({"prompt": f"Q{i}: " + "x" * (i % 7), "response": "ab" * (1 + (i * 5) % 9)}) for i in range(n)]
    lines[3] = json.dumps({"prompt": "long " * 10, "response": "y" * 40})
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prompt_and_response_records_count_the_response_and_its_end_only(tmp_path: Path) -> None:
    data = InstructionData([str(_records(tmp_path / "a.jsonl"))], ByteTokenizer(), SEQ)
    prompt, response = "Q1: x", "ab" * 6
    ids = list((prompt + response).encode()) + [10]
    assert data[1]["x"][: len(ids) - 1].tolist() == ids[:-1]
    want = [IGNORED] * (len(prompt) - 1) + ids[len(prompt) :]
    assert data[1]["y"][: len(ids) - 1].tolist() == want and (data[1]["y"][len(ids) - 1 :] == IGNORED).all()
    assert data.truncated == 1 and len(data) == 24


def test_chat_records_count_the_assistant_turns_only(tmp_path: Path) -> None:
    tokenizer_json = train_tokenizer(tmp_path / "tok")
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}" + END + "{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")  # fmt: skip
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = load_tokenizer(str(tokenizer_json))
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "bye"}]  # fmt: skip
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    item = InstructionData([str(tmp_path / "c.jsonl")], tok, 64)[0]
    counted = item["y"][item["y"] != IGNORED].tolist()
    assert tok.decode(counted) == "hello there" + END  # not the header, the system, user or later turns


def test_chat_records_are_tokenized_whole_as_the_model_will_read_them(tmp_path: Path) -> None:
    """A header ending in a space: byte-level BPE merges it with the reply's first word (" self"), which
    tokenizing turn by turn would not; the merged token carries the reply, so the loss counts it."""
    tokenizer_json = train_tokenizer(tmp_path / "tok")
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}" + END + "{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")  # fmt: skip
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = load_tokenizer(str(tokenizer_json))
    assert tok.encode("assistant: ") + tok.encode("self.x") != tok.encode("assistant: self.x")  # a merge across
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "self.x"}]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    item = InstructionData([str(tmp_path / "c.jsonl")], tok, 64)[0]
    whole = tok.encode("user: hi" + END + "assistant: self.x" + END)
    assert item["x"][: len(whole) - 1].tolist() == whole[:-1]
    assert tok.decode(item["y"][item["y"] != IGNORED].tolist()) == " self.x" + END


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", r"c.jsonl:2: not a JSON object"),
        ('{"prompt": "p"}', r"c.jsonl:2: a record needs string 'prompt' and 'response'"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', r"c.jsonl:2: unknown role 'robot'"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "needs a tokenizer with a chat template"),
    ],
    ids=["not-json", "no-response", "unknown-role", "no-template"],
)
def test_bad_records_are_named_by_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    (tmp_path / "c.jsonl").write_text('{"prompt": "p", "response": "r"}\n' + line + "\n")
    with pytest.raises(InputError, match=message):
        InstructionData([str(tmp_path / "c.jsonl")], ByteTokenizer(), SEQ)


def test_bad_records_can_be_skipped_and_counted(tmp_path: Path) -> None:
    lines = ['{"prompt": "p", "response": "r"}', "not json", "[1]", '{"prompt": "p"}', '{"messages": []}']
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    data = InstructionData([str(tmp_path / "c.jsonl")], ByteTokenizer(), SEQ, on_bad_record="skip")
    assert data.skipped == 4 and len(data) == 1


def _model() -> torch.nn.Module:
    from tessera.models import hf

    torch.manual_seed(0)
    return hf.llama(n_layer=2, hidden=32, n_head=4, n_kv_head=2, ffn=64, vocab_size=256, seq_len=SEQ)


def _tessera_sft(plan_dict: dict, path: str, pack: bool = False, seq: int = SEQ) -> dict:
    from tessera.train.step import response_token_loss

    data = InstructionData([path], ByteTokenizer(), seq, pack=pack)
    booster = tessera.Booster(tessera.Plan.from_dict(plan_dict))
    model = _model()
    model, optimizer = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = []
    for step, batch in enumerate(booster.dataloader(data, global_batch_size=BATCH, seed=0)):
        if step == STEPS:
            break
        loss = booster.execute_pipeline(batch, model, response_token_loss(booster, batch), optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(booster.reduce_loss(loss)))
    state = booster.full_state_dict(model)
    return {"losses": losses, "params": state if torch.distributed.get_rank() == 0 else None}


LAYOUTS = {
    "ddp": tessera.DDP(),
    "ddp shares 3:1": tessera.Plan(dp_shares=(3, 1)),
    "zero3 2 micro-batches": tessera.Plan(zero=3, pipeline={"microbatches": 2}),
    "tp2": tessera.Plan(tp=2),
    "pp2": tessera.Plan(pp=2, pipeline={"microbatches": 2}),
    "Ulysses sp2": tessera.Plan(sp=2),
    "tp2 split-gather sp": tessera.Plan(tp=2, sp=2, sp_mode="split_gather"),
}


def _one_process(data: InstructionData) -> tuple[list[float], torch.nn.Module]:
    """Plain AdamW on one process over the sharded loader's global batches of ``data``: the mean over each
    batch's response tokens (packed sequences through their records' mask). The losses and the model."""
    from tessera.runtime.microbatches import keyword_inputs

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))  # the sharded loader's order
    losses = []
    for step in range(STEPS):
        batch = {k: torch.stack([data[int(i)][k] for i in order[step * BATCH : (step + 1) * BATCH]]) for k in data[0]}
        inputs = keyword_inputs(
            {"input_ids": batch["x"], **{k: batch[k] for k in ("position_ids", "documents") if k in batch}}
        )
        loss = F.cross_entropy(model(**inputs).logits.flatten(0, 1), batch["y"].flatten())  # token mean
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def _check_layouts(layouts: list[str], path: str, data: InstructionData, pack: bool = False) -> None:
    """Each layout's losses and parameters after STEPS steps equal :func:`_one_process`'s (1e-5); failures
    listed together."""
    want, model = _one_process(data)
    seq = data.x.shape[1]
    got = run_shared(2, {name: (_tessera_sft, (LAYOUTS[name].to_dict(), path, pack, seq)) for name in layouts})
    failures = []
    for name, ranks in got.items():
        try:
            torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(want), rtol=1e-5, atol=1e-5)
            for key, value in model.state_dict().items():
                torch.testing.assert_close(ranks[0]["params"][key], value, rtol=1e-5, atol=1e-5, msg=key)
        except AssertionError as exc:
            failures.append(f"{name}: {str(exc).splitlines()[0]}")
    assert not failures, "\n".join(failures)


def test_fine_tuning_averages_over_the_global_batch_s_response_tokens_in_every_layout(tmp_path: Path) -> None:
    """DDP, uneven shares 3:1, ZeRO-3, two micro-batches, tp2, pp2, Ulysses sp2, tp2 with split/gather sequence
    parallelism: the same losses and parameters after 2 AdamW steps as one process taking the mean over each
    global batch's response tokens (1e-5)."""
    path = str(_records(tmp_path / "sft.jsonl"))
    _check_layouts(list(LAYOUTS), path, InstructionData([path], ByteTokenizer(), SEQ))


def test_packed_records_share_a_sequence_but_see_only_themselves(tmp_path: Path) -> None:
    """Whole records, as many as fit, in order; each token's record and position within it; through a Hugging
    Face model, each record's logits in a packed sequence equal its logits alone."""
    from tessera.runtime.microbatches import keyword_inputs

    path = str(_records(tmp_path / "a.jsonl"))
    alone = InstructionData([path], ByteTokenizer(), PACKED)
    packed = InstructionData([path], ByteTokenizer(), PACKED, pack=True)
    assert len(packed) < len(alone) / 2 and packed.truncated == alone.truncated == 0
    assert (packed.y != IGNORED).sum() == (alone.y != IGNORED).sum()  # every response token, once
    model = _model().eval()
    item = packed[0]
    records = int(item["documents"].max()) + 1
    assert records >= 2 and item["position_ids"][item["documents"] == 1][0] == 0
    with torch.no_grad():
        packed = {
            "input_ids": item["x"][None],
            "position_ids": item["position_ids"][None],
            "documents": item["documents"][None],
        }
        logits = model(**keyword_inputs(packed)).logits[0]
        for d in range(records):
            where = item["documents"] == d
            single = model(item["x"][where][None]).logits[0]
            torch.testing.assert_close(logits[where], single, rtol=1e-5, atol=1e-5)


def test_packed_fine_tuning_matches_one_process_in_every_layout(tmp_path: Path) -> None:
    """DDP, shares 3:1, ZeRO-3 with two micro-batches, tp2, pp2 (each stage builds the mask from the records'
    ids passed on with the positions), Ulysses sp2 (each rank a slice of the tokens and positions, the mask
    over the whole sequence) and tp2 with split/gather sequence parallelism on packed records equal one process
    training the same packed sequences with the records' mask (1e-5); `tessera train` refuses packing for a
    model that takes no mask."""
    path = str(_records(tmp_path / "sft.jsonl", n=120))
    data = InstructionData([path], ByteTokenizer(), PACKED, pack=True)
    assert len(data) >= STEPS * BATCH
    _check_layouts(list(LAYOUTS), path, data, pack=True)
    import yaml
    from test_checkpoint import tiny_config

    from tessera.config import ConfigError
    from tessera.launch.preflight import check_training

    config = tiny_config(tmp_path / "runs", 4, 4, {"preset": "ddp"})  # the reference Llama: no mask argument
    config["data"] = {"instructions": [path], "pack": True, "seq_len": PACKED}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match="data.pack keeps records apart .* which a Hugging Face model takes"):
        check_training(str(tmp_path / "c.yaml"), [], 2, 1, overwrite=True)
