"""End to end, coding task kind: `dvc repro` of one GRPO iteration scored by running unit tests.

Like tests/test_e2e.py (tiny random Llama, real vLLM, DVC through the CLI), with
``data.task: coding`` and ``reward.weights.tests``: the score stage joins the hidden tests
from the prompts file and runs every completion in the sandbox.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import polars as pl
import pytest
import yaml

from grpo_pipeline import schemas
from grpo_pipeline.iterations import rewrite
from tests.test_e2e import ROOT, dvc

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PARAMS = {
    "data": {"task": "coding", "n_train": 8, "n_eval": 2, "seed": 0},
    "sft": {"epochs": 2, "lr": 3.0e-3, "batch_size": 4, "max_examples": 8, "warmup_ratio": 0.0, "max_length": 512},
    "sampling": {"prompts_per_iteration": 2, "group_size": 4, "max_new_tokens": 24, "dtype": "float32", "spare_prompts": 0,
                 "max_model_len": 1024},
    "reward": {"weights": {"accuracy": 0.0, "format": 1.0, "tests": 1.0}, "format_partial_credit": True,
               "tests": {"timeout_s": 2.0}},
    "advantage": {"filter_groups": False},  # counts below assume every row trains (filter: test_dynamic.py)
    "update": {"lr": 1.0e-3, "minibatch_size": 8, "micro_batch_size": 4},
    "evaluate": {"max_new_tokens": 16},
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_model):
    repo = tmp_path_factory.mktemp("e2e_coding") / "repo"
    repo.mkdir()
    for name in ("dvc.yaml", "stages", "grpo_pipeline"):
        src = ROOT / name
        (shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__")) if src.is_dir()
         else shutil.copy(src, repo / name))
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params.pop("iterations"), params.pop("evaluations")
    for section, values in {**PARAMS, "base": {"source": "hf", "path": tiny_model}}.items():
        params[section] = {**params.get(section, {}), **values}
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    rewrite(repo / "params.yaml", 1)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    dvc(repo, "init", "-q")
    dvc(repo, "repro")
    return repo


def test_coding_run_scores_by_tests(repo):
    prompts = schemas.read_table(repo / "data/prompts/train.parquet", "prompts")
    assert prompts.height == 8 and prompts["tests"].is_not_null().all() and prompts["entry_point"].is_not_null().all()
    ro = schemas.read_table(repo / "data/rollouts/it0", "rollouts")
    sc = schemas.read_table(repo / "data/scores/it0.parquet", "scores")
    assert sc.height == ro.height == 8
    assert sc["tests_reason"].null_count() == 0 and sc["reward_tests"].is_between(0, 1).all()
    assert (sc["tests_total"] == 5).all() and sc["reward"].null_count() == 0
    expect = sc["reward_format"] + sc["reward_tests"]
    assert (sc["reward"] - expect).abs().max() < 1e-9
    m = json.loads((repo / "metrics/iterations/it0/score.json").read_text())
    assert sum(v for k, v in m.items() if k.startswith("tests/reason/")) == 8
    ad = schemas.read_table(repo / "data/advantages/it0.parquet", "advantages")
    assert ad.height == 8 and ad["advantage"].is_finite().all()
    assert (repo / "models/it1/model.safetensors").is_file()
    assert json.loads((repo / "metrics/eval/it0.json").read_text())["prompts"] == 2


def test_score_stage_runs_hostile_completions_through_the_cli(repo):
    """The tiny model writes no code: put real and hostile code into the rollouts and rescore."""
    part = repo / "data/rollouts/it0/part-00000.parquet"
    ro = schemas.read_table(part, "rollouts")
    prompts = schemas.read_table(repo / "data/prompts/train.parquet", "prompts")
    ref = dict(prompts.select("prompt_id", "answer").iter_rows())
    ep = dict(prompts.select("prompt_id", "entry_point").iter_rows())
    bodies = ["{ref}", "def {ep}(*a):\n    return None", "def {ep}(*a):\n    while True:\n        pass",
              "x = [0]\nwhile True:\n    x.append(' ' * 10**6)"]
    texts = [f"<think>t</think><answer>```python\n{bodies[k].format(ref=ref[p], ep=ep[p])}\n```</answer>"
             for p, k in ro.select("prompt_id", "sample_idx").iter_rows()]
    schemas.write_table(ro.with_columns(completion=pl.Series(texts)), part, "rollouts")
    r = dvc(repo, "repro", "-s", "score@it0")
    assert "Running stage 'score@it0'" in r.stdout
    sc = schemas.read_table(repo / "data/scores/it0.parquet", "scores").sort("prompt_id", "sample_idx")
    assert sc["tests_reason"].to_list() == ["ok", "assertion", "timeout", "memory"] * 2
    assert sc["reward_tests"].to_list()[::4] == [1.0, 1.0] and sc["reward_error"].null_count() == 8
