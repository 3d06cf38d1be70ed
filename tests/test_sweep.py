"""bench/sweep.py: overrides, the stage order it renders from the real dvc.yaml, and the per-config thread share."""
from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_sweep", ROOT / "bench" / "sweep.py")
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)


def test_overrides_parse_yaml_and_leave_the_input_alone():
    base = {"update": {"lr": 1e-6, "beta": 0.04}, "reward": {"weights": {"accuracy": 1.0}}}
    out = sweep.apply_overrides(base, ["update.lr=2.0e-5", "reward.weights={accuracy: 1.0, format: 0.2}",
                                       "data.languages=[en]"])
    assert out["update"] == {"lr": 2e-5, "beta": 0.04}
    assert out["reward"]["weights"] == {"accuracy": 1.0, "format": 0.2}
    assert out["data"]["languages"] == ["en"]
    assert base["update"]["lr"] == 1e-6 and "data" not in base


def test_commands_follow_the_data_flow_of_dvc_yaml():
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    names = [n for n, _ in sweep.commands(dvc, params)]
    cmds = [c for _, c in sweep.commands(dvc, params)]
    assert not any("${" in c for c in cmds)
    iters = list(params["iterations"])
    pos = {n: i for i, n in enumerate(names)}
    for a, b in itertools.pairwise(iters):                  # iteration k finishes before k+1 samples
        assert pos[f"update@{a}"] < pos[f"sample@{b}"]
    for it in iters:
        assert pos["sft"] < pos[f"sample@{it}"] < pos[f"score@{it}"] < pos[f"advantage@{it}"] < pos[f"update@{it}"]
    last_update = pos[f"update@{iters[-1]}"]
    assert all(pos[f"evaluate@{e}"] > last_update for e in params["evaluations"])
    assert names[-1] == "report"


def test_each_config_gets_its_share_of_the_threads(tmp_path, monkeypatch):
    probe = f"{sys.executable} -c \"import os; print('threads', os.environ.get('OMP_NUM_THREADS'))\""
    dvc = {"stages": {"probe": {"cmd": probe}}}
    monkeypatch.setattr(sweep, "ROOT", ROOT / "bench")    # a small tree to copy
    r = sweep.run_config("c", [], {}, dvc, tmp_path, None, threads=3)
    assert "failed" not in r, r
    assert "threads 3" in (tmp_path / "c" / "sweep.log").read_text()
    r = sweep.run_config("fails", [], {}, {"stages": {"bad": {"cmd": f"{sys.executable} -c 'raise SystemExit(3)'"}}},
                         tmp_path, None)
    assert r["failed"] == "bad"
    json.dumps(r)                                          # results.json stays writable


def test_only_checkpoints_no_later_stage_reads_are_pruned():
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    evaluated = {e["checkpoint"] for e in params["evaluations"].values()}
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    pruned = [c for stage, _ in sweep.commands(dvc, params) for c in sweep.prunable(stage, params)]
    assert pruned and not set(pruned) & (evaluated | {"models/sft", "models/base"})
    assert len(pruned) == len(set(pruned))
    names = [n for n, _ in sweep.commands(dvc, params)]
    for it, item in params["iterations"].items():           # pruned only after the last stage that reads it
        if item["policy"] in pruned:
            readers = [i for i, (n, c) in enumerate(sweep.commands(dvc, params)) if item["policy"] + " " in c + " "]
            assert max(readers) <= names.index(f"update@{it}")
    assert sweep.prunable("sample@it0", params) == [] and sweep.prunable("update@nope", params) == []
