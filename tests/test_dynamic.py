"""Issue 14's levers: DAPO dynamic sampling (group filter), overlong filtering, dtype auto, eval errors."""

import json

import numpy as np
import polars as pl
import pytest

from grpo_pipeline import schemas
from grpo_pipeline.advantages import filter_groups
from grpo_pipeline.config import AdvantageConfig, RewardConfig
from grpo_pipeline.hardware import BF16_MIN_SPEEDUP, bf16_is_fast, cpu_bf16_speedup, cpu_flags, resolve_dtype
from grpo_pipeline.report import paired_difference
from grpo_pipeline.run import advantage, score
from grpo_pipeline.run.evaluate import eval_metrics, standard_error
from tests.test_stage_bodies import rollouts


# --------------------------------------------------------------------------- group filter (pure)
def _frames(rewards: dict[str, list[float | None]]):
    ids = [pid for pid, rs in rewards.items() for _ in rs]
    sc = pl.DataFrame({"prompt_id": ids, "reward": [r for rs in rewards.values() for r in rs]},
                      schema={"prompt_id": pl.String, "reward": pl.Float64})
    return sc, pl.DataFrame({"prompt_id": ids, "adv_mask": [True] * len(ids)})


@pytest.mark.parametrize(("rewards", "wanted", "kept_before", "mask", "counts"), [
    # all equal -> dropped; mixed -> kept
    ({"a": [1.0, 1.0], "b": [0.0, 2.0]}, None, 0, [False, False, True, True], (2, 1, 1, 0)),
    # nulls do not make a group informative: one valid reward is not a comparison
    ({"a": [None, 1.0], "b": [None, None], "c": [0.5, 0.0]}, None, 0, [False] * 4 + [True, True], (3, 2, 1, 0)),
    # the cap keeps the first informative groups in order; the rest is surplus
    ({"a": [0.0, 1.0], "b": [1.0, 1.0], "c": [1.0, 0.0], "d": [2.0, 0.0]}, 2, 0,
     [True, True, False, False, True, True, False, False], (4, 1, 2, 1)),
    # groups kept by earlier batches count towards the cap
    ({"a": [0.0, 1.0], "c": [1.0, 0.0]}, 2, 1, [True, True, False, False], (2, 0, 1, 1)),
    ({"a": [0.0, 1.0]}, 2, 2, [False, False], (1, 0, 0, 1)),
])
def test_filter_groups_table(rewards, wanted, kept_before, mask, counts):
    sc, adv = _frames(rewards)
    out, n = filter_groups(sc, adv, wanted=wanted, kept_before=kept_before)
    assert out["adv_mask"].to_list() == mask
    assert (n["groups"], n["dropped"], n["kept"], n["surplus"]) == counts


def test_filter_groups_keeps_earlier_masks_and_rejects_misaligned_frames():
    sc, adv = _frames({"a": [0.0, 1.0, 2.0]})
    out, _ = filter_groups(sc, adv.with_columns(adv_mask=pl.Series([True, False, True])))
    assert out["adv_mask"].to_list() == [True, False, True]
    sc, adv = _frames({"a": [0.0, 1.0], "b": [1.0, 1.0]})
    with pytest.raises(ValueError, match="row-aligned"):
        filter_groups(sc, adv.reverse())


# --------------------------------------------------------------------------- through the stages, on Parquet
@pytest.mark.parametrize("by", ["total", "accuracy"])
def test_advantage_stage_filters_groups_and_tops_up_from_spares(tmp_path, by):
    ro = rollouts(n_prompts=12, g=4, seed=3)
    schemas.write_table(ro, tmp_path / "ro/part-00000.parquet", "rollouts", metadata={"groups_wanted": 3})
    score.run(RewardConfig(), rollouts=str(tmp_path / "ro"), out=str(tmp_path / "s.parquet"), metrics_path=None)
    assert schemas.read_metadata(tmp_path / "s.parquet", "scores")["groups_wanted"] == 3
    m = advantage.run(AdvantageConfig(filter_groups=True, filter_reward=by), scores=str(tmp_path / "s.parquet"),
                      out=str(tmp_path / "a.parquet"), metrics_path=str(tmp_path / "m.json"), batch_rows=5)
    sc = schemas.read_table(tmp_path / "s.parquet", "scores")
    adv = schemas.read_table(tmp_path / "a.parquet", "advantages")
    col = "reward" if by == "total" else "reward_accuracy"
    informative = [pid for pid, g in sc.group_by("prompt_id", maintain_order=True) if g[col].n_unique() > 1]
    informative = [p[0] if isinstance(p, tuple) else p for p in informative]
    kept = adv.filter("adv_mask")["prompt_id"].unique(maintain_order=True).to_list()
    assert kept == informative[:3]                                   # the first three informative groups
    assert m["dynamic/kept_groups"] == 3 and m["dynamic/groups_wanted"] == 3
    assert m["dynamic/dropped_group_share"] == pytest.approx((12 - len(informative)) / 12, abs=1e-6)
    assert m["dynamic/surplus_groups"] == len(informative) - 3
    assert json.loads((tmp_path / "m.json").read_text())["dynamic/kept_groups"] == 3
    # without the filter, nothing is masked and the advantages themselves are the same
    plain = advantage.run(AdvantageConfig(filter_groups=False), scores=str(tmp_path / "s.parquet"), out=str(tmp_path / "b.parquet"),
                          metrics_path=None)
    assert "dynamic/kept_groups" not in plain
    np.testing.assert_array_equal(schemas.read_table(tmp_path / "b.parquet", "advantages")["advantage"].to_numpy(),
                                  adv["advantage"].to_numpy())


def test_overlong_filter_leaves_truncated_rows_out(tmp_path):
    from grpo_pipeline.run.update import load_rollouts

    ro = rollouts(n_prompts=2, g=4, seed=1).with_columns(
        finish_reason=pl.Series(["stop", "length", "stop", "stop", "length", "stop", "stop", "stop"]))
    schemas.write_table(ro, tmp_path / "ro/part-00000.parquet", "rollouts")
    score.run(RewardConfig(), rollouts=str(tmp_path / "ro"), out=str(tmp_path / "s.parquet"), metrics_path=None)
    advantage.run(AdvantageConfig(filter_groups=False), scores=str(tmp_path / "s.parquet"), out=str(tmp_path / "a.parquet"),
                  metrics_path=None)
    rows, left, _ = load_rollouts(str(tmp_path / "ro"), str(tmp_path / "a.parquet"))
    assert len(rows) == 8 and left == {"masked": 0, "overlong_masked": 0}
    rows, left, _ = load_rollouts(str(tmp_path / "ro"), str(tmp_path / "a.parquet"), overlong_filter=True)
    assert [r.key for r in rows] == ["p000/0", "p000/2", "p000/3", "p001/1", "p001/2", "p001/3"]
    assert left == {"masked": 0, "overlong_masked": 2}


# --------------------------------------------------------------------------- dtype auto
def test_cpu_flags_and_bf16_decision(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n\nprocessor : 1\nflags : fpu\n")
    assert "avx512_bf16" in cpu_flags(str(info)) and "avx2" in cpu_flags(str(info))
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()
    assert bf16_is_fast(cuda=False, flags=frozenset({"avx2", "amx_bf16"}), speedup=2.8)[0]
    fast, reason = bf16_is_fast(cuda=False, flags=frozenset({"avx2", "avx512_bf16"}), speedup=0.57)
    assert not fast and "0.57x" in reason                           # the flag alone is not enough
    fast, reason = bf16_is_fast(cuda=False, flags=frozenset({"avx2", "avx512f"}))
    assert not fast and "emulated" in reason


def test_cpu_bf16_probe_measures_this_machine():
    """The real probe: a positive finite ratio, and the decision on this CPU follows it."""
    r = cpu_bf16_speedup()
    assert 1e-4 < r < 100     # an AVX2-only Zen 3 measures 0.012-0.016 alone and under 0.01 beside other load
    fast, reason = bf16_is_fast(cuda=False, flags=frozenset({"avx512_bf16"}))
    assert fast == (r >= BF16_MIN_SPEEDUP) and f"{r:.2f}x" in reason


def test_resolve_dtype(capsys):
    assert resolve_dtype("float32", what="x") == "float32" and resolve_dtype("bfloat16", what="x") == "bfloat16"
    assert capsys.readouterr().out == ""                              # explicit choices are not announced
    assert resolve_dtype("auto", what="update", cuda=False, flags=frozenset({"avx512_bf16"}), speedup=2.8) == "bfloat16"
    assert resolve_dtype("auto", what="update", cuda=False, flags=frozenset({"avx512_bf16"}), speedup=0.6) == "float32"
    assert resolve_dtype("auto", what="update", cuda=False, flags=frozenset({"avx2"})) == "float32"
    out = capsys.readouterr().out
    assert "[update] dtype auto -> bfloat16 (CPU has avx512_bf16; bf16 matmul measured 2.80x float32's)" in out
    assert "-> float32 (CPU has avx512_bf16; bf16 matmul measured 0.60x float32's, under 1.2x)" in out
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("float16", what="x")


# --------------------------------------------------------------------------- eval errors
def test_eval_metrics_carry_standard_errors():
    acc = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    df = pl.DataFrame({"accuracy": acc, "format": [1.0] * 8, "completion_len": [3] * 8, "finish_reason": ["stop"] * 8})
    m = eval_metrics(df)
    assert m["accuracy"] == pytest.approx(0.375)
    assert m["accuracy_se"] == pytest.approx(round(float(np.std(acc, ddof=1) / np.sqrt(8)), 4))
    assert m["format_se"] == 0.0 and standard_error(pl.Series([1.0])) == 0.0


def test_paired_difference(tmp_path):
    a = pl.DataFrame({"prompt_id": ["p1", "p2", "p3", "p4"], "accuracy": [0.0, 1.0, 0.0, 0.0]})
    b = pl.DataFrame({"prompt_id": ["p4", "p3", "p2", "p1", "p9"], "accuracy": [1.0, 1.0, 1.0, 0.0, 1.0]})
    a.write_parquet(tmp_path / "sft.parquet")
    b.write_parquet(tmp_path / "it5.parquet")
    mean, se, n = paired_difference(tmp_path / "sft.parquet", tmp_path / "it5.parquet")
    d = np.array([0.0, 0.0, 1.0, 1.0])                                # p1..p4: after - before
    assert n == 4 and mean == pytest.approx(d.mean()) and se == pytest.approx(d.std(ddof=1) / 2)
    assert paired_difference(tmp_path / "sft.parquet", tmp_path / "nope.parquet") is None


# --------------------------------------------------------------------------- nothing left to learn from
def test_update_with_every_row_left_out_keeps_the_policy(tmp_path, tiny_model):
    """All groups filtered (or all rows truncated): the next checkpoint is the policy, no step, no error."""
    from safetensors.torch import load_file

    from grpo_pipeline.checkpoint import load_model, load_tokenizer, read_checkpoint_metadata, save_checkpoint
    from grpo_pipeline.config import UpdateConfig
    from grpo_pipeline.run import update as stage
    from tests.test_update import rand_rollouts, write_stage_inputs

    policy = tmp_path / "policy"
    save_checkpoint(load_model(tiny_model), load_tokenizer(tiny_model), policy, metadata={"stage": "sft"})
    ro, adv = write_stage_inputs(tmp_path, rand_rollouts(8, seed=2, groups=True))
    table = schemas.read_table(adv, "advantages").with_columns(adv_mask=pl.lit(False))
    schemas.write_table(table, adv, "advantages")
    out = tmp_path / "next"
    m = stage.run(UpdateConfig(beta=0.0, minibatch_size=4, micro_batch_size=4, dtype="float32"), policy=str(policy),
                  reference=None, rollouts=ro, advantages=adv, out=str(out), metrics_path=str(tmp_path / "m.json"),
                  steps_path=str(tmp_path / "s.json"))
    assert m["steps"] == 0 and m["masked"] == 8
    a, b = load_file(policy / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert read_checkpoint_metadata(out)["parent"] == str(policy)
    assert json.loads((tmp_path / "m.json").read_text())["steps"] == 0


def test_filter_reward_missing_component_falls_back_to_the_total(tmp_path, capsys):
    schemas.write_table(rollouts(n_prompts=3, g=4, seed=5), tmp_path / "ro/part-00000.parquet", "rollouts")
    score.run(RewardConfig(), rollouts=str(tmp_path / "ro"), out=str(tmp_path / "s.parquet"), metrics_path=None)
    m = advantage.run(AdvantageConfig(filter_groups=True, filter_reward="tests"), scores=str(tmp_path / "s.parquet"),
                      out=str(tmp_path / "a.parquet"), metrics_path=None)
    assert "no 'reward_tests'" in capsys.readouterr().out
    total = advantage.run(AdvantageConfig(filter_groups=True, filter_reward="total"), scores=str(tmp_path / "s.parquet"),
                          out=str(tmp_path / "b.parquet"), metrics_path=None)
    assert m["dynamic/kept_groups"] == total["dynamic/kept_groups"]


def test_auto_dtype_env_overrides_the_hardware_check(monkeypatch, capsys):
    monkeypatch.setenv("GRPO_AUTO_DTYPE", "bfloat16")
    assert resolve_dtype("auto", what="update") == "bfloat16"
    assert "[update] dtype auto -> bfloat16 (GRPO_AUTO_DTYPE=bfloat16)" in capsys.readouterr().out
    assert resolve_dtype("float32", what="update") == "float32"           # an explicit dtype wins
    monkeypatch.setenv("GRPO_AUTO_DTYPE", "fp16")
    with pytest.raises(ValueError, match="GRPO_AUTO_DTYPE='fp16'"):
        resolve_dtype("auto", what="update")
