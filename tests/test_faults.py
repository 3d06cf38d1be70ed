"""Fault injection: stages SIGKILLed at several points, then rerun, must give what an uninterrupted run
gives (bit for bit), leave no process behind and nothing a documented glob reads.

The kills are real (``tests/faultinject/sitecustomize.py`` SIGKILLs the stage process just before or
after one of its atomic renames, or after a delay); the stages run as ``dvc repro`` runs them, as
subprocesses of their scripts.  The pipeline-wide kills through ``dvc repro`` are in
``tests/test_faults_dvc.py`` (slow).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from grpo_pipeline import schemas, train_state
from grpo_pipeline.checkpoint import load_model, load_tokenizer, save_checkpoint
from tests.test_update import UPD, rand_rollouts, write_stage_inputs
from tests.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ROOT / "tests" / "faultinject"


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path``, by relative name."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(path).rglob("*")) if p.is_file()}


def run_script(script: str, args: list[str], *, cwd: Path, fault: str | None = None, tag: str = "",
               timeout: float = 600) -> subprocess.CompletedProcess:
    """``python stages/<script> args`` in ``cwd``; ``fault``: a ``GRPO_FAULT`` point for that script."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAULTS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "GRPO_FAULT_TAG": tag}
    env.pop("GRPO_FAULT", None)
    if fault:
        env["GRPO_FAULT"] = f"{script}|{fault}"
    return subprocess.run([sys.executable, str(ROOT / "stages" / script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Live processes started with ``GRPO_FAULT_TAG=tag`` in their environment (a stage and its workers)."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("GRPO_FAULT_TAG") == tag and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


# --------------------------------------------------------------------------- update
@pytest.fixture(scope="module")
def update_inputs(tmp_path_factory, tiny_model):
    """An SFT-like policy, a reference, two iterations' rollouts + advantages, and the params file."""
    root = tmp_path_factory.mktemp("upd")
    models = root / "models"
    save_checkpoint(load_model(tiny_model), load_tokenizer(tiny_model), models / "sft", metadata={"stage": "sft"})
    build_tiny_model(models / "ref", seed=1)
    for it, seed in (("it0", 8), ("it1", 9)):
        write_stage_inputs(root / "data" / it, rand_rollouts(12, seed=seed, groups=True), iteration=it)
    (root / "params.yaml").write_text(yaml.safe_dump({"update": {**UPD, "lr_schedule": "cosine", "warmup_steps": 1,
                                                                 "total_steps": 8}}))
    return root


def update_args(it: str, policy: str, nxt: str) -> list[str]:
    return ["--policy", policy, "--reference", "models/ref", "--rollouts", f"data/{it}/rollouts", "--advantages",
            f"data/{it}/adv.parquet", "--out", nxt, "--metrics", f"metrics/{it}.json", "--steps",
            f"metrics/{it}.steps.json"]


def copy_tree(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


def two_updates(d: Path) -> None:
    for it, policy, nxt in (("it0", "models/sft", "models/it1"), ("it1", "models/it1", "models/it2")):
        r = run_script("update.py", update_args(it, policy, nxt), cwd=d)
        assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def uninterrupted(update_inputs, tmp_path_factory) -> Path:
    ref = copy_tree(update_inputs, tmp_path_factory.mktemp("ref") / "run")
    two_updates(ref)
    return ref


def test_update_is_bitwise_reproducible_across_processes(update_inputs, uninterrupted, tmp_path):
    """Same machine, same inputs: the checkpoint and its AdamW state are byte-identical (item 7)."""
    b = copy_tree(update_inputs, tmp_path / "b")
    two_updates(b)
    for name in ("it1", "it2"):
        da, db = tree_digest(uninterrupted / "models" / name), tree_digest(b / "models" / name)
        assert f"{train_state.STATE_DIR}/{train_state.STATE_FILE}" in da and "model.safetensors" in da
        assert da == db, name


# kill points of update@it1 (whose policy models/it1 carries the AdamW state of update@it0)
UPDATE_KILLS = [
    "timer:2",                                 # starting: nothing written yet
    "replace:models/it2:before",               # trained, the checkpoint not yet renamed in
    "replace:models/it2:after",                # checkpoint (with its AdamW state) in place, no metrics yet
    "replace:it1.steps.json:after",            # steps written, the metrics not
]


@pytest.mark.parametrize("point", UPDATE_KILLS)
def test_killed_update_then_rerun_equals_uninterrupted(update_inputs, uninterrupted, tmp_path, point):
    ref = uninterrupted
    d = copy_tree(update_inputs, tmp_path / "killed")
    r = run_script("update.py", update_args("it0", "models/sft", "models/it1"), cwd=d)
    assert r.returncode == 0, r.stderr[-3000:]
    killed = run_script("update.py", update_args("it1", "models/it1", "models/it2"), cwd=d, fault=point)
    assert killed.returncode == -9, (point, killed.stderr[-2000:])
    # whatever the point: models/it2 is absent or complete with its own state, models/it1 untouched
    assert tree_digest(d / "models/it1") == tree_digest(ref / "models/it1")
    if (d / "models/it2").exists():
        assert tree_digest(d / "models/it2") == tree_digest(ref / "models/it2")
    # the rerun (what `dvc repro` does: the metrics are missing, so the stage runs again)
    r = run_script("update.py", update_args("it1", "models/it1", "models/it2"), cwd=d)
    assert r.returncode == 0, r.stderr[-3000:]
    assert tree_digest(d / "models/it2") == tree_digest(ref / "models/it2")
    assert not [p.name for p in (d / "models").iterdir() if p.name.startswith(".tmp-")]
