"""Read back what each experiment tracker wrote to disk, through its own library (or file format), so a test
checks the tracker's files rather than our calls to it."""

from __future__ import annotations

from pathlib import Path


def tensorboard_scalars(run_dir: Path, tag: str) -> dict[int, float]:
    """``tag``'s values by step from the event files in ``<run_dir>/tensorboard`` (TensorBoard's own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def wandb_history(run_dir: Path, key: str) -> dict[int, float]:
    """``key``'s values by step from the offline runs under ``<run_dir>/wandb`` (every ``run-*.wandb`` file:
    a resumed run writes another). The file is a LevelDB-style log of 32 KiB blocks after a 7-byte header;
    each chunk is a 4-byte checksum, 2-byte length, 1-byte kind (1 full, 2 first, 3 middle, 4 last), then a
    piece of a protobuf ``Record``."""
    import json

    from wandb.proto.wandb_internal_pb2 import Record

    values: dict[int, float] = {}
    for path in sorted((run_dir / "wandb").glob("*/run-*.wandb")):
        data, pos, pending = path.read_bytes(), 7, b""
        assert data[:4] == b":W&B", path
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
                pos += 32768 - pos % 32768
                continue
            length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
            pending += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                record = Record.FromString(pending)
                pending = b""
                if record.WhichOneof("record_type") == "history":
                    items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item}  # fmt: skip
                    if key in items:
                        step = items["_step"] if "_step" in items else record.history.step.num
                        values[int(step)] = float(items[key])
    return values


def mlflow_history(run_dir: Path, key: str) -> tuple[dict[int, float], list[str]]:
    """``key``'s values by step in the local MLflow store ``<run_dir>/mlruns`` (MLflow's client), and the
    names of the runs the store holds."""
    import os

    import mlflow

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = mlflow.MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    values = {m.step: m.value for r in runs for m in client.get_metric_history(r.info.run_id, key)}
    return values, [r.info.run_name for r in runs]
