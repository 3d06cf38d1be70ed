import os

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_pipeline import schemas
from grpo_pipeline.io import atomic_dir, atomic_path, write_json
from grpo_pipeline.schemas import SchemaError


def adv_frame(n=4) -> pl.DataFrame:
    return pl.DataFrame({
        "iteration": ["it0"] * n, "prompt_id": [f"p{i // 2}" for i in range(n)],
        "sample_idx": [i % 2 for i in range(n)], "advantage": [float(i) for i in range(n)],
        "adv_mask": [True] * n, "step_advantages": [None] * n,
    })


def test_roundtrip_carries_kind_version_and_metadata(tmp_path):
    p = tmp_path / "a.parquet"
    schemas.write_table(adv_frame(), p, "advantages", metadata={"advantage": {"std": "population"}})
    df = schemas.read_table(p, "advantages")
    assert df["advantage"].to_list() == [0.0, 1.0, 2.0, 3.0]
    assert df.schema["sample_idx"] == pl.Int32
    assert schemas.read_metadata(p, "advantages") == {"advantage": {"std": "population"}}
    assert pq.ParquetFile(p).metadata.row_group(0).column(0).compression == "ZSTD"


def test_reader_names_file_and_problem(tmp_path):
    p = tmp_path / "a.parquet"
    schemas.write_table(adv_frame(), p, "advantages")
    with pytest.raises(SchemaError, match=r"a\.parquet: expected a scores file, found kind 'advantages'"):
        schemas.read_table(p, "scores")
    # written by something else: no kind/version metadata
    q = tmp_path / "plain.parquet"
    adv_frame().write_parquet(q)
    with pytest.raises(SchemaError, match="plain.parquet"):
        schemas.read_table(q, "advantages")
    # a future schema version
    t = pq.read_table(p)
    meta = {**t.schema.metadata, schemas.VERSION_KEY: b"99"}
    pq.write_table(t.replace_schema_metadata(meta), tmp_path / "v99.parquet")
    with pytest.raises(SchemaError, match="version 99"):
        schemas.read_table(tmp_path / "v99.parquet", "advantages")


def test_corrupt_and_missing_files(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(SchemaError, match="bad.parquet: not a readable Parquet"):
        schemas.read_table(bad, "advantages")
    with pytest.raises(SchemaError, match="not found"):
        schemas.read_table(tmp_path / "none.parquet", "advantages")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SchemaError, match="no advantages Parquet files"):
        schemas.read_table(tmp_path / "empty", "advantages")


def test_writer_rejects_missing_columns(tmp_path):
    with pytest.raises(SchemaError, match=r"missing columns \['adv_mask'"):
        schemas.write_table(adv_frame().drop("adv_mask"), tmp_path / "a.parquet", "advantages")
    assert not list(tmp_path.iterdir())


def test_stream_writer_appears_only_on_success(tmp_path):
    p = tmp_path / "s.parquet"
    with schemas.stream_writer(p, "advantages") as write:
        write(adv_frame())
        write(adv_frame())
    assert schemas.read_table(p, "advantages").height == 8
    assert [b.height for b in schemas.iter_batches(p, "advantages", batch_rows=3)] == [3, 3, 2]
    with pytest.raises(RuntimeError), schemas.stream_writer(tmp_path / "t.parquet", "advantages") as write:
        write(adv_frame())
        raise RuntimeError("killed")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["s.parquet"]


def test_atomic_file_keeps_the_old_content_on_failure(tmp_path):
    p = tmp_path / "m.json"
    write_json(p, {"a": 1})
    with pytest.raises(ValueError), atomic_path(p) as tmp:
        tmp.write_text("half")
        raise ValueError
    assert p.read_text().strip().startswith("{") and os.listdir(tmp_path) == ["m.json"]


def test_atomic_dir_swaps_whole_dirs(tmp_path):
    d = tmp_path / "ckpt"
    with atomic_dir(d) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(KeyboardInterrupt), atomic_dir(d) as tmp:
        (tmp / "a").write_text("2")
        raise KeyboardInterrupt
    assert (d / "a").read_text() == "1" and os.listdir(tmp_path) == ["ckpt"]
    with atomic_dir(d) as tmp:
        (tmp / "b").write_text("3")
    assert os.listdir(d) == ["b"]


def test_extra_reward_columns_survive(tmp_path):
    df = pl.DataFrame({"iteration": ["it0"], "prompt_id": ["p"], "sample_idx": [0], "reward": [1.0],
                       "reward_error": [None], "steps": [[]], "reward_accuracy": [1.0]},
                      schema_overrides={"reward_error": pl.Utf8, "steps": pl.List(pl.Struct({"start": pl.Int32, "end": pl.Int32, "reward": pl.Float64}))})
    schemas.write_table(df, tmp_path / "s.parquet", "scores")
    assert "reward_accuracy" in schemas.read_table(tmp_path / "s.parquet", "scores").columns
    assert isinstance(schemas.schema("scores"), pa.Schema)
