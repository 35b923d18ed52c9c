"""Trajectory export: JSON lines always, Parquet when pyarrow is installed.

JSONL holds one :class:`~dsec.rl.agent.types.Trajectory` per line, whole (messages with
tool calls, token ids and logprobs; steps with observations, errors, infra errors and
timings; reward, verdict, model), and reads back exactly (:func:`read_jsonl`).
:class:`JsonlWriter` appends as episodes finish and flushes each line, so a crashed run
keeps every trajectory it wrote (a torn last line is reported, never silently skipped).

Parquet (:func:`write_parquet`) is one row per trajectory with flat columns for filtering
(task, group, epoch, reward, passed, infra_error, end, steps, times, model) and
``messages``/``steps`` as JSON text columns, which every dataframe library reads.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator
from typing import IO, Any, Self

import msgspec

from dsec.errors import InvalidArgument
from dsec.rl.agent.types import Trajectory, trajectory_from_json, trajectory_to_json

__all__ = ["JsonlWriter", "read_jsonl", "to_row", "write_jsonl", "write_parquet"]


class JsonlWriter:
    """Append trajectories to ``path`` (created if absent), one flushed line each."""

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.path = os.fspath(path)
        self.fsync = fsync
        self._f: IO[bytes] = open(self.path, "ab")  # noqa: SIM115 - closed in close()
        self.written = 0

    def write(self, traj: Trajectory) -> None:
        self._f.write(trajectory_to_json(traj) + b"\n")
        self._f.flush()
        if self.fsync:
            os.fsync(self._f.fileno())
        self.written += 1

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_jsonl(trajs: Iterable[Trajectory], dest: str | os.PathLike[str] | IO[bytes]) -> int:
    """Write ``trajs`` as JSON lines to a path (replaced) or a binary file; returns how many."""
    if isinstance(dest, (str, os.PathLike)):
        with open(dest, "wb") as f:
            return write_jsonl(trajs, f)
    n = 0
    for t in trajs:
        dest.write(trajectory_to_json(t) + b"\n")
        n += 1
    return n


def read_jsonl(src: str | os.PathLike[str] | IO[bytes]) -> Iterator[Trajectory]:
    """Trajectories from a JSONL file; a bad line raises naming its line number."""
    if isinstance(src, (str, os.PathLike)):
        with open(src, "rb") as f:
            yield from read_jsonl(f)
        return
    for no, line in enumerate(src, 1):
        if not line.strip():
            continue
        try:
            yield trajectory_from_json(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise InvalidArgument(f"line {no} of the trajectory file is not a trajectory: "
                                  f"{exc}") from exc


def to_row(t: Trajectory) -> dict[str, Any]:
    """The flat Parquet row of a trajectory."""
    enc = msgspec.json.encode
    return {
        "episode_id": t.episode_id, "task_id": t.task_id, "group_id": t.group_id,
        "epoch": t.epoch, "reward": t.reward,
        "passed": None if t.verdict is None else t.verdict.passed,
        "verdict_detail": None if t.verdict is None else t.verdict.detail,
        "infra_error": t.infra_error, "end": t.end, "answer": t.answer,
        "num_steps": len(t.steps), "num_messages": len(t.messages),
        "started_at": t.timings.started_at, "total_s": t.timings.total_s,
        "setup_s": t.timings.setup_s, "model_s": t.timings.model_s,
        "tool_s": t.timings.tool_s, "judge_s": t.timings.judge_s,
        "model": None if t.model is None else t.model.model,
        "messages": enc(t.messages).decode(), "steps": enc(t.steps).decode(),
        "metadata": enc(t.metadata).decode(),
    }


def write_parquet(trajs: Iterable[Trajectory], dest: str | os.PathLike[str] | io.BytesIO
                  ) -> int:
    """Write ``trajs`` as a Parquet table (needs pyarrow); returns the row count."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise InvalidArgument("Parquet export needs pyarrow (pip install pyarrow); JSONL "
                              "export (write_jsonl) needs nothing") from exc
    rows = [to_row(t) for t in trajs]
    schema = pa.schema([
        ("episode_id", pa.string()), ("task_id", pa.string()), ("group_id", pa.string()),
        ("epoch", pa.int64()), ("reward", pa.float64()), ("passed", pa.bool_()),
        ("verdict_detail", pa.string()), ("infra_error", pa.string()), ("end", pa.string()),
        ("answer", pa.string()), ("num_steps", pa.int64()), ("num_messages", pa.int64()),
        ("started_at", pa.float64()), ("total_s", pa.float64()), ("setup_s", pa.float64()),
        ("model_s", pa.float64()), ("tool_s", pa.float64()), ("judge_s", pa.float64()),
        ("model", pa.string()), ("messages", pa.string()), ("steps", pa.string()),
        ("metadata", pa.string())])
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, dest if isinstance(dest, io.BytesIO) else os.fspath(dest))
    return len(rows)
