"""Arrow schemas of every Parquet artifact, versioned, and the one reader/writer pair.

Each file carries ``grpo_pipeline.kind`` and ``grpo_pipeline.schema_version`` in its
Parquet key-value metadata; readers check both and the required columns, and fail with
the file name and what is wrong.  Bump a version when a column changes meaning.

=============  ======================================  ==========================================
kind           path (default dvc.yaml)                 one row per
=============  ======================================  ==========================================
prompts        data/prompts/{train,eval}.parquet       problem
rollouts       data/rollouts/<it>/part-*.parquet       completion (prompt_id, sample_idx)
scores         data/scores/<it>.parquet                completion, reward columns ``reward_*``
advantages     data/advantages/<it>.parquet            completion
eval           data/eval/<checkpoint>.parquet          eval prompt (greedy completion + verdicts)
=============  ======================================  ==========================================

All rollouts at once: ``pl.scan_parquet("data/rollouts/*/*.parquet")``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from grpo_pipeline.io import atomic_path

KIND_KEY = b"grpo_pipeline.kind"
VERSION_KEY = b"grpo_pipeline.schema_version"
META_KEY = b"grpo_pipeline.metadata"

STEP = pa.struct([("start", pa.int32()), ("end", pa.int32()), ("reward", pa.float64())])
STEP_ADV = pa.struct([("end", pa.int32()), ("value", pa.float64())])

SCHEMAS: dict[str, tuple[int, pa.Schema]] = {
    "prompts": (2, pa.schema([  # v2: tests, entry_point
        ("prompt_id", pa.string()),      # stable id, unique per file
        ("question", pa.string()),       # the problem, without template
        ("answer", pa.string()),         # reference answer
        ("language", pa.string()),       # en | zh
        ("kind", pa.string()),           # problem kind (unit_price, ..., or user)
        ("operation", pa.string()),      # add | sub | mul | div | null: what the reasoning must show
        ("solution", pa.string()),       # worked steps for SFT demonstrations, or null
        ("source", pa.string()),         # synthetic | the user file name
        ("tests", pa.list_(pa.string())),  # coding: hidden test snippets (one assert each); null: math
        ("entry_point", pa.string()),    # coding: the function the tests call; null: math
    ])),
    "rollouts": (2, pa.schema([  # v2: completion_token_ends
        ("iteration", pa.string()),                 # it0, it1, ...
        ("prompt_id", pa.string()),                 # group key
        ("sample_idx", pa.int32()),                 # 0..G-1 inside the group
        ("question", pa.string()),
        ("answer", pa.string()),                    # reference, copied for self-contained files
        ("operation", pa.string()),
        ("prompt", pa.string()),                    # chat-templated prompt text
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("completion", pa.string()),
        ("completion_token_ids", pa.list_(pa.int32())),
        ("completion_logprobs", pa.list_(pa.float32())),  # sampler's log-probs (diagnostics)
        ("completion_token_ends", pa.list_(pa.int32())),  # per token: chars of `completion` complete once it
                                                          # is in (special tokens add 0, a split UTF-8 char
                                                          # counts at its last token); sampling.token_char_ends
        ("finish_reason", pa.string()),             # stop | length
        ("prompt_len", pa.int32()),
        ("completion_len", pa.int32()),
        ("policy", pa.string()),                    # checkpoint dir the policy came from
    ])),
    "scores": (1, pa.schema([
        ("iteration", pa.string()),
        ("prompt_id", pa.string()),
        ("sample_idx", pa.int32()),
        ("reward", pa.float64()),        # weighted sum of the reward_* columns; null if one is null
        ("reward_error", pa.string()),   # "<reward>: <error>" or null
        ("steps", pa.list_(STEP)),       # reasoning steps: char spans in completion + step reward
    ])),
    "advantages": (1, pa.schema([
        ("iteration", pa.string()),
        ("prompt_id", pa.string()),
        ("sample_idx", pa.int32()),
        ("advantage", pa.float64()),     # outcome advantage (process: first token's advantage)
        ("adv_mask", pa.bool_()),        # False: reward was null, row is left out of the loss
        ("step_advantages", pa.list_(STEP_ADV)),  # process supervision: normalised step rewards
    ])),
    "eval": (1, pa.schema([
        ("checkpoint", pa.string()),
        ("prompt_id", pa.string()),
        ("completion", pa.string()),
        ("answer", pa.string()),
        ("accuracy", pa.float64()),
        ("format", pa.float64()),
        ("completion_len", pa.int32()),
        ("finish_reason", pa.string()),
    ])),
}


class SchemaError(ValueError):
    """A Parquet artifact that is missing, corrupt, of another kind or version, or lacks columns."""


def schema(kind: str) -> pa.Schema:
    if kind not in SCHEMAS:
        raise ValueError(f"unknown artifact kind {kind!r}; known: {list(SCHEMAS)}")
    version, sch = SCHEMAS[kind]
    return sch.with_metadata({KIND_KEY: kind.encode(), VERSION_KEY: str(version).encode()})


def _conform(df: pl.DataFrame, kind: str, path: Path) -> pa.Table:
    """Order and cast ``df`` to the schema; extra columns (e.g. ``reward_*``) are kept after."""
    sch = schema(kind)
    missing = [n for n in sch.names if n not in df.columns]
    if missing:
        raise SchemaError(f"{path}: cannot write {kind}: missing columns {missing}")
    extra = [c for c in df.columns if c not in sch.names]
    table = df.select([*sch.names, *extra]).to_arrow()
    fields = [sch.field(n) for n in sch.names] + [table.schema.field(n) for n in extra]
    target = pa.schema(fields, metadata=sch.metadata)
    try:
        return table.cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise SchemaError(f"{path}: cannot write {kind}: {e}") from None


def write_table(df: pl.DataFrame, path: str | Path, kind: str, *, metadata: dict[str, Any] | None = None,
                row_group_size: int = 65536) -> None:
    """Write ``df`` as a ``kind`` artifact, atomically, zstd-compressed."""
    path = Path(path)
    table = _conform(df, kind, path)
    meta = dict(table.schema.metadata or {})
    if metadata:
        meta[META_KEY] = json.dumps(metadata, sort_keys=True).encode()
    table = table.replace_schema_metadata(meta)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd", row_group_size=row_group_size)


@contextlib.contextmanager
def stream_writer(path: str | Path, kind: str, *, metadata: dict[str, Any] | None = None,
                  extra_fields: list[pa.Field] | None = None) -> Iterator[Any]:
    """Write a ``kind`` artifact batch by batch (bounded memory); the file appears only on success.

    Yields ``write(df: pl.DataFrame)``; every call becomes one or more row groups.
    """
    path = Path(path)
    sch = schema(kind)
    fields = list(sch) + list(extra_fields or [])
    meta = dict(sch.metadata)
    if metadata:
        meta[META_KEY] = json.dumps(metadata, sort_keys=True).encode()
    full = pa.schema(fields, metadata=meta)
    with atomic_path(path) as tmp:
        writer = pq.ParquetWriter(tmp, full, compression="zstd")
        try:
            def write(df: pl.DataFrame) -> None:
                writer.write_table(_conform(df, kind, path).select(full.names).cast(full))
            yield write
        finally:
            writer.close()


def _open(path: Path, kind: str) -> pq.ParquetFile:
    if not path.exists():
        raise SchemaError(f"{path}: {kind} file not found")
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise SchemaError(f"{path}: not a readable Parquet file ({e})") from None
    meta = pf.schema_arrow.metadata or {}
    got_kind = meta.get(KIND_KEY, b"?").decode()
    got_ver = meta.get(VERSION_KEY, b"?").decode()
    want_ver, sch = SCHEMAS[kind]
    if got_kind != kind:
        raise SchemaError(f"{path}: expected a {kind} file, found kind {got_kind!r}")
    if got_ver != str(want_ver):
        raise SchemaError(f"{path}: {kind} schema version {got_ver}, this grpo_pipeline reads version {want_ver}")
    missing = [n for n in sch.names if n not in pf.schema_arrow.names]
    if missing:
        raise SchemaError(f"{path}: {kind} file lacks columns {missing}")
    return pf


def read_table(path: str | Path, kind: str, *, columns: list[str] | None = None) -> pl.DataFrame:
    """Read a whole ``kind`` artifact (one file, or every ``*.parquet`` of a directory)."""
    path = Path(path)
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not files:
        raise SchemaError(f"{path}: no {kind} Parquet files in this directory")
    frames = []
    for f in files:
        pf = _open(f, kind)
        try:
            frames.append(pl.from_arrow(pf.read(columns=columns)))
        except (pa.ArrowInvalid, OSError) as e:
            raise SchemaError(f"{f}: corrupt Parquet data ({e})") from None
    return pl.concat(frames, how="vertical_relaxed") if len(frames) > 1 else frames[0]


def iter_batches(path: str | Path, kind: str, *, batch_rows: int = 65536,
                 columns: list[str] | None = None) -> Iterator[pl.DataFrame]:
    """Stream a ``kind`` artifact (file or directory of shards) in batches of at most ``batch_rows``."""
    path = Path(path)
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not files:
        raise SchemaError(f"{path}: no {kind} Parquet files in this directory")
    for f in files:
        pf = _open(f, kind)
        try:
            for batch in pf.iter_batches(batch_size=batch_rows, columns=columns):
                yield pl.from_arrow(batch)
        except (pa.ArrowInvalid, OSError) as e:
            raise SchemaError(f"{f}: corrupt Parquet data ({e})") from None


def column_names(path: str | Path, kind: str) -> list[str]:
    """The columns of a ``kind`` artifact (its first file), from the footer alone."""
    path = Path(path)
    f = min(path.glob("*.parquet")) if path.is_dir() else path
    return list(_open(f, kind).schema_arrow.names)


def read_metadata(path: str | Path, kind: str) -> dict[str, Any]:
    """The ``metadata`` dict a writer attached (sampling params, versions, ...)."""
    path = Path(path)
    f = min(path.glob("*.parquet")) if path.is_dir() else path
    raw = (_open(f, kind).schema_arrow.metadata or {}).get(META_KEY)
    return json.loads(raw) if raw else {}
