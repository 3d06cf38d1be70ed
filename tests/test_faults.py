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


# --------------------------------------------------------------------------- sample: workers, temporaries
def test_killed_data_parallel_sample_leaves_no_worker_and_nothing_globbed(tiny_model, tmp_path):
    """Killed mid-run, the stage's spawned workers die with it (PR_SET_PDEATHSIG) and their shards,
    in the temporary directory, are not matched by the README's glob ``data/rollouts/*/*.parquet``."""
    from tests.test_sampling import problems

    schemas.write_table(problems(8), tmp_path / "train.parquet", "prompts")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"sampling": {
        "backend": "hf", "prompts_per_iteration": 8, "group_size": 2, "max_new_tokens": 600, "stop": [],
        "max_model_len": 1024, "data_parallel_size": 2, "batch_prompts": 1}}))
    tag = f"sample-kill-{os.getpid()}"
    out = tmp_path / "data" / "rollouts" / "it0"
    proc = subprocess.Popen([sys.executable, str(ROOT / "stages/sample.py"), "--iteration", "it0", "--index", "0",
                             "--policy", tiny_model, "--prompts", "train.parquet", "--out", str(out)],
                            cwd=tmp_path, env={**os.environ, "GRPO_FAULT_TAG": tag, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(tagged_processes(tag)) < 3:   # the stage and its 2 workers
        assert proc.poll() is None, "the sample stage ended early"
        time.sleep(0.5)
    workers = [p for p in tagged_processes(tag) if p.pid != proc.pid]
    assert len(workers) >= 2, "the workers did not start"
    rollouts_dir = tmp_path / "data" / "rollouts"
    while time.monotonic() < deadline and not [p for p in rollouts_dir.rglob("*") if p.is_file()]:
        assert proc.poll() is None, "the sample stage ended before it was killed"
        time.sleep(0.5)                                               # a worker is writing its shard
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(workers, timeout=15)
    assert not alive, f"workers survived the stage: {[p.pid for p in alive]}"
    assert proc.returncode == -9 and not out.exists()
    time.sleep(2)
    globbed = [f for d in os.listdir(rollouts_dir) if (rollouts_dir / d).is_dir()
               for f in os.listdir(rollouts_dir / d) if f.endswith(".parquet")]
    assert globbed == []                          # what the killed run left, no documented glob reads


# --------------------------------------------------------------------------- bad input: one line, naming file and row
def stage_error(script: str, args: list[str], cwd: Path) -> str:
    r = run_script(script, args, cwd=cwd)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and lines[-1].startswith("error: "), r.stderr[-2000:]
    return lines[-1]


@pytest.mark.parametrize(("name", "content", "expect"), [
    ("latin1.jsonl", '{"question": "ok", "answer": "1"}\n{"question": "caf\xe9", "answer": "2"}\n'.encode("latin-1"),
     r"latin1\.jsonl: line 2 \(byte offset 51\) is not UTF-8"),          # the byte 0xe9 of 'café'
    ("parquet.jsonl", b"PAR1\x15\x04\x15\x80\x01\x15\x80\xff\x00", r"parquet\.jsonl: line 1 \(byte offset \d+\) is not UTF-8"),
    ("jsonl.parquet", b'{"question": "q", "answer": "1"}\n', r"jsonl\.parquet: not a readable Parquet file"),
])
def test_bad_user_files_fail_prepare_in_one_line(tmp_path, name, content, expect):
    import re

    (tmp_path / name).write_bytes(content)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"data": {"source": "file", "path": name, "n_eval": 1}}))
    line = stage_error("prepare.py", ["--train-out", "t.parquet", "--eval-out", "e.parquet"], tmp_path)
    assert re.search(expect, line), line
    assert not (tmp_path / "t.parquet").exists()


def test_sft_prompt_longer_than_max_length_is_named(tiny_model, tmp_path):
    from grpo_pipeline.checkpoint import load_tokenizer
    from grpo_pipeline.sft import build_demonstrations
    from tests.test_sampling import problems

    tok = load_tokenizer(tiny_model)
    df = problems(4)
    m = max(len(p) for p, _ in build_demonstrations(df, tok, max_length=4096)) + 3
    demos = build_demonstrations(df, tok, max_length=m)                      # completions cut to fit
    assert all(len(p) + len(c) <= m for p, c in demos) and any(len(p) + len(c) == m for p, c in demos)
    long = df.with_columns(question=pl_when_row(df, 2, "seven " * 400))
    with pytest.raises(ValueError, match=rf"train\.parquet: prompt {long['prompt_id'][2]!r} has \d+ tokens, no room"):
        build_demonstrations(long, tok, max_length=256, source="train.parquet")
    skipped: list[str] = []                                              # the sft stage: skipped and counted
    assert len(build_demonstrations(long, tok, max_length=256, skipped=skipped)) == 3
    assert skipped == [long["prompt_id"][2]]


def pl_when_row(df, i: int, text: str):
    import polars as pl

    return pl.when(pl.int_range(pl.len()) == i).then(pl.lit(text)).otherwise(pl.col("question"))


def test_sample_checks_every_prompt_not_only_this_iterations(tiny_model, tmp_path):
    """A too-long prompt fails sample@it0 (naming it) even when a later iteration would draw it."""
    from grpo_pipeline.config import SamplingConfig
    from grpo_pipeline.run import sample
    from tests.test_sampling import problems

    df = problems(8)
    df = df.with_columns(question=pl_when_row(df, 7, "seven " * 600))
    schemas.write_table(df, tmp_path / "train.parquet", "prompts")
    cfg = SamplingConfig(backend="hf", prompts_per_iteration=2, group_size=2, max_new_tokens=8, max_model_len=512)
    with pytest.raises(ValueError, match=rf"prompt {df['prompt_id'][7]!r} has \d+ tokens, more than the 504"):
        sample.run(cfg, iteration="it0", index=0, policy=tiny_model, prompts_path=str(tmp_path / "train.parquet"),
                   out=str(tmp_path / "it0"), metrics_path=None)
    assert not (tmp_path / "it0").exists()


# --------------------------------------------------------------------------- custom rewards
def _hang(completions, answers, **_):
    time.sleep(3600)


def _batch_fails(completions, answers, **_):
    if len(completions) > 1:
        raise TypeError("expects one completion")
    return [1.0]


def _always_none(completions, answers, **_):
    return [None] * len(completions)


@pytest.fixture
def user_rewards(monkeypatch):
    from tests.conftest import install_module

    install_module(monkeypatch, "fault_rewards", _hang, _batch_fails, _always_none)


def score_with(tmp_path, fn: str, **custom):
    from grpo_pipeline.config import CustomReward, RewardConfig
    from grpo_pipeline.run import score
    from tests.test_stage_bodies import rollouts

    schemas.write_table(rollouts(n_prompts=2, g=2), tmp_path / "ro/part-00000.parquet", "rollouts")
    cfg = RewardConfig(custom=[CustomReward(name="mine", function=f"fault_rewards:{fn}", **custom)])
    return score.run(cfg, rollouts=str(tmp_path / "ro"), out=str(tmp_path / "scores.parquet"), metrics_path=None)


def test_hanging_custom_reward_times_out_naming_it(user_rewards, tmp_path):
    from grpo_pipeline.rewards.custom import RewardTimeout

    t0 = time.monotonic()
    with pytest.raises(RewardTimeout, match=r"reward 'mine', called on a batch of 4 completions: no result within 1 s"):
        score_with(tmp_path, "hang", timeout_s=1.0)
    assert time.monotonic() - t0 < 30 and not (tmp_path / "scores.parquet").exists()


def test_custom_reward_batch_failure_is_logged(user_rewards, tmp_path, capsys):
    metrics = score_with(tmp_path, "batch_fails")
    assert "reward 'mine': the call on a batch of 4 completions failed (mine: TypeError: expects one" in \
        capsys.readouterr().err
    assert metrics["mine/nulls"] == 0


def test_all_null_custom_reward_fails_the_score_stage(user_rewards, tmp_path):
    with pytest.raises(ValueError, match=r"custom reward 'mine' \(fault_rewards:always_none\) returned no value"):
        score_with(tmp_path, "always_none")
    assert not (tmp_path / "scores.parquet").exists()


# --------------------------------------------------------------------------- params: checked before anything runs
def dvc_repo_with(tmp_path: Path, params: dict) -> Path:
    """The real dvc.yaml and stage code with ``params`` as params.yaml."""
    import shutil

    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("dvc.yaml", "stages", "grpo_pipeline"):
        src = ROOT / name
        shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__")) if src.is_dir() else \
            shutil.copy(src, repo / name)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return repo


def real_params() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


@pytest.mark.parametrize(("edit", "message"), [
    (lambda p: p, None),
    (lambda p: {**p, "sampling_extra": {"x": 1}}, "unknown key 'sampling_extra'"),
    (lambda p: {k: v for k, v in p.items() if k != "advantage"}, "missing section 'advantage'"),
    (lambda p: {k: v for k, v in p.items() if k not in ("iterations", "evaluations")}, "missing section 'evaluations'"),
    (lambda p: {**p, "update": {**p["update"], "lr": "fast"}}, "update.lr"),
])
def test_check_agrees_with_dvc_and_the_stages(tmp_path, edit, message):
    """`grpo-pipeline check` refuses what DVC refuses once it reaches a stage (a section dvc.yaml reads is
    missing: the stages would use defaults, DVC does not) and what a stage refuses (unknown sections and keys,
    bad values); the check stage runs the same function and writes its marker only for a valid file."""
    repo = dvc_repo_with(tmp_path, edit(real_params()))
    cli = subprocess.run([sys.executable, "-m", "grpo_pipeline", "check"], cwd=repo, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(repo)}, check=False)
    stage = subprocess.run([sys.executable, "stages/check.py", "--out", "data/checked_params.json"], cwd=repo,
                           capture_output=True, text=True, check=False)
    if message is None:
        assert cli.returncode == 0 and stage.returncode == 0, cli.stderr + stage.stderr
        assert (repo / "data/checked_params.json").read_text() == '{\n  "checked": "params.yaml"\n}\n'
    else:
        assert cli.returncode == 1 and message in cli.stderr, cli.stderr
        assert stage.returncode == 1 and message in stage.stderr and "Traceback" not in stage.stderr
        assert not (repo / "data/checked_params.json").exists()


def test_update_with_nothing_to_learn_carries_the_adamw_state(update_inputs, uninterrupted, tmp_path):
    """All rows masked: the next checkpoint is the policy, and its AdamW state goes along with it."""
    import polars as pl

    d = copy_tree(uninterrupted, tmp_path / "d")
    adv = pl.read_parquet(d / "data/it1/adv.parquet").with_columns(adv_mask=pl.lit(False))
    schemas.write_table(adv, d / "data/it1/adv.parquet", "advantages")
    r = run_script("update.py", update_args("it1", "models/it1", "models/it2"), cwd=d)
    assert r.returncode == 0, r.stderr[-3000:]
    state, reason = train_state.load_state(d / "models/it2")
    assert reason == "resumed"
    it1 = torch_load(d / "models/it1" / train_state.STATE_DIR / train_state.STATE_FILE)
    assert state["state"].keys() == it1["state"].keys()
    assert all((state["state"][k]["exp_avg"] == it1["state"][k]["exp_avg"]).all() for k in it1["state"])


def torch_load(path: Path) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)
