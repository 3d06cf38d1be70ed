"""Fault injection through `dvc repro` on the real pipeline (tiny model, 2 iterations, real vLLM / DVC).

Each case SIGKILLs one stage at one point (``tests/faultinject``: just before / after one of its
atomic renames, or after a delay), then checks what a user relies on: ``dvc status`` says the stage is
out of date, no process of the stage survives, the documented globs read only real outputs, and a plain
``dvc repro`` (run cache off, so the stages really run again) brings back exactly the outputs of the
uninterrupted run, reruns nothing else and leaves ``dvc status`` clean.  Also: an output written in
place, and params errors, which must stop `dvc repro` before any output is deleted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.test_e2e import make_repo
from tests.test_faults import FAULTS, tagged_processes

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

# (stage, kill point): each stage at least once, the update at the points of the carried AdamW state
KILLS = [
    ("check", "replace:checked_params:before"),
    ("prepare", "replace:train.parquet:after"),
    ("base", "replace:models/base:before"),
    ("sft", "replace:models/sft:after"),
    ("sample@it0", "replace:rollouts/it0:before"),   # deterministic: a timer races a fast machine
    ("sample@it1", "replace:rollouts/it1:after"),
    ("score@it0", "replace:scores/it0:after"),
    ("advantage@it1", "replace:advantages/it1:before"),
    ("update@it0", "replace:models/it1:after"),
    ("update@it1", "replace:models/it2:before"),
    ("update@it1", "replace:models/it2:after"),
    ("update@it1", "replace:update_steps.json:after"),
    ("evaluate@it1", "replace:data/eval/it1:after"),
    ("report", "replace:curves/eval.json:after"),
]


def dvc_cmd(repo: Path, *args: str, fault: str | None = None, tag: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "GRPO_FAULT_TAG": tag,
           "PYTHONPATH": os.pathsep.join([str(FAULTS), os.environ.get("PYTHONPATH", "")])}
    env.pop("GRPO_FAULT", None)
    if fault:
        env["GRPO_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=env, capture_output=True, text=True,
                          check=False)


def out_hashes(repo: Path) -> dict[str, str]:
    """md5 of every cached output in dvc.lock (metrics hold timings, so they are left out)."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    return {o["path"]: o["md5"] for st in lock["stages"].values() for o in st.get("outs", [])
            if not o["path"].startswith("metrics/")}


def stray_parquet(repo: Path) -> list[str]:
    """Files the README's globs (data/rollouts/*/*.parquet, data/scores/*.parquet, ...) read that are no output."""
    outs = set(out_hashes(repo))
    found = []
    for pattern in ("data/rollouts/*/*.parquet", "data/scores/*.parquet", "data/advantages/*.parquet",
                    "data/eval/*.parquet"):
        base, *_ = pattern.split("*")
        depth = pattern.count("*")
        for dirpath, _, files in os.walk(repo / base):   # os.walk also lists hidden names, as polars' glob does
            rel = Path(dirpath).relative_to(repo / base)
            if len(rel.parts) == depth - 1:
                found += [str(Path(base) / rel / f) for f in files if f.endswith(".parquet")]
    return [f for f in found if not any(f == o or f.startswith(o + "/") for o in outs)]


def running_stages(stdout: str) -> set[str]:
    return {line.split("'")[1] for line in stdout.splitlines() if line.startswith("Running stage '")}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, tiny_model):
    repo = make_repo(tmp_path_factory.mktemp("faults") / "repo", tiny_model)
    return repo, out_hashes(repo)


@pytest.mark.parametrize(("stage", "point"), KILLS, ids=[f"{s}-{p}" for s, p in KILLS])
def test_kill_then_repro_equals_uninterrupted(pipeline, stage, point):
    repo, reference = pipeline
    script = f"stages/{stage.split('@')[0]}.py"
    tag = f"{stage}-{point}"
    r = dvc_cmd(repo, "repro", "-f", "-s", stage, fault=f"{script}|{point}", tag=tag)
    assert r.returncode != 0, f"{stage} was not killed at {point}:\n{r.stdout[-2000:]}"
    deadline = time.monotonic() + 10                      # PR_SET_PDEATHSIG is prompt, a reap takes a moment
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not tagged_processes(tag), "a process of the killed stage survived"
    status = dvc_cmd(repo, "status").stdout
    assert f"{stage}:" in status, f"dvc status does not report the killed {stage}:\n{status}"
    assert stray_parquet(repo) == []
    r = dvc_cmd(repo, "repro", "--no-run-cache")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # the stage reruns (or DVC checks its cached outputs out again); a later stage reruns only if an output changed
    assert running_stages(r.stdout) <= {stage}, "the rerun changed an output, so later stages ran again"
    assert out_hashes(repo) == reference
    assert "up to date" in dvc_cmd(repo, "status").stdout


def test_output_written_in_place_does_not_poison_the_cache(pipeline):
    repo, reference = pipeline
    weights = repo / "models/it1/model.safetensors"
    with open(weights, "r+b") as f:        # an editor / a script writing into the tracked output in place
        f.seek(4096)
        f.write(b"\0" * 64)
    status = dvc_cmd(repo, "status").stdout
    assert "update@it0:" in status and "modified" in status
    r = dvc_cmd(repo, "repro")
    assert r.returncode == 0, r.stdout[-3000:]
    assert out_hashes(repo) == reference
    assert "up to date" in dvc_cmd(repo, "status").stdout


@pytest.mark.parametrize(("edit", "message"), [
    ({"update": {"lr": -1.0}}, "update.lr"),
    ({"updat": {"lr": 1.0}}, "unknown key 'updat'"),
])
def test_params_error_stops_before_any_output_is_deleted(pipeline, edit, message):
    repo, reference = pipeline
    path = repo / "params.yaml"
    good = path.read_text()
    metrics = sorted(str(p.relative_to(repo)) for p in (repo / "metrics").rglob("*.json"))
    params = yaml.safe_load(good)
    for section, values in edit.items():
        params[section] = {**params.get(section, {}), **values}
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        check = subprocess.run([sys.executable, "-m", "grpo_pipeline", "check"], cwd=repo, capture_output=True,
                               text=True, check=False, env={**os.environ, "PYTHONPATH": str(repo)})
        assert check.returncode != 0 and message in check.stderr     # the CLI agrees with the check stage
        r = dvc_cmd(repo, "repro")
        assert r.returncode != 0 and message in r.stdout + r.stderr
        assert running_stages(r.stdout) == {"check"}
        assert sorted(str(p.relative_to(repo)) for p in (repo / "metrics").rglob("*.json")) == metrics
        assert all((repo / p).exists() for p in reference if p != "data/checked_params.json")   # DVC removed
        # only the check stage's own marker, which it writes again once the params are valid
    finally:
        path.write_text(good)
    r = dvc_cmd(repo, "repro")
    assert r.returncode == 0 and running_stages(r.stdout) <= {"check"}
    assert out_hashes(repo) == reference
    assert json.loads((repo / "data/checked_params.json").read_text()) == {"checked": "params.yaml"}
