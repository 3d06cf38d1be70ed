"""DVC sees every change: each stage's code deps are its import closure, checked statically, against the
modules really imported at run time, and through a real ``dvc status`` in a temporary copy of the repo."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_pipeline import stagedeps

ROOT = Path(__file__).resolve().parent.parent


def test_dvc_yaml_code_deps_are_the_import_closures():
    assert stagedeps.check(ROOT / "dvc.yaml") == {}, "run `grpo-pipeline deps --write`"


def _code_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "repo"
    for d in stagedeps.CODE_ROOTS:
        shutil.copytree(ROOT / d, dst / d, ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("dvc.yaml", "params.yaml"):
        shutil.copy(ROOT / f, dst / f)
    return dst


def test_check_names_a_missing_and_an_unneeded_dep(tmp_path):
    repo = _code_copy(tmp_path)
    text = (repo / "dvc.yaml").read_text()
    update = text.index("  update:")
    text = text[:update] + text[update:].replace("        - grpo_pipeline/advantages.py\n", "", 1)
    text = text.replace("      - grpo_pipeline/run/prepare.py\n", "      - grpo_pipeline/run/prepare.py\n"
                        "      - grpo_pipeline/losses.py\n", 1)
    (repo / "dvc.yaml").write_text(text)
    bad = stagedeps.check(repo / "dvc.yaml")
    assert bad == {"update": (["grpo_pipeline/advantages.py"], []), "prepare": ([], ["grpo_pipeline/losses.py"])}
    # a new function-local import of a module is found, and --write puts it back
    run_sft = repo / "grpo_pipeline/run/sft.py"
    run_sft.write_text(run_sft.read_text() + "\n\ndef _later():\n    from grpo_pipeline import report  # noqa\n")
    assert "grpo_pipeline/report.py" in stagedeps.check(repo / "dvc.yaml")["sft"][0]
    stagedeps.rewrite(repo / "dvc.yaml")
    assert stagedeps.check(repo / "dvc.yaml") == {}
    assert yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]["sft"]["deps"][:3] == \
        ["data/checked_params.json", "models/base", "data/prompts/train.parquet"]


def _stage_runtime_modules(script: str) -> set[str]:
    """grpo_pipeline / stages files in ``sys.modules`` after running every import of ``script`` and its
    params check (the sections it passes to ``params(args, ...)``), in a fresh interpreter."""
    tree = ast.parse((ROOT / script).read_text())
    imports = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    sections = [a.value for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "params"
                for a in n.args if isinstance(a, ast.Constant)]
    code = "\n".join([
        "import sys, json", f"sys.path[0] = {str(ROOT / 'stages')!r}", *imports,
        "from grpo_pipeline.config import load_params",
        f"load_params({str(ROOT / 'params.yaml')!r}, sections={sections!r})",
        "print(json.dumps(sorted(getattr(m, '__file__', None) or '' for m in list(sys.modules.values()))))",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    files = {Path(f).resolve() for f in json.loads(out.stdout.strip().splitlines()[-1]) if f}
    return {f.relative_to(ROOT).as_posix() for f in files
            if f.is_relative_to(ROOT) and f.relative_to(ROOT).parts[0] in stagedeps.CODE_ROOTS}


def test_static_closure_covers_what_each_stage_imports_at_run_time():
    """Every module a stage script really loads (its imports, then its params check) is in its static closure."""
    for name, (script, _) in stagedeps.stage_scripts(ROOT / "dvc.yaml").items():
        runtime = _stage_runtime_modules(script)
        assert runtime - {"stages/_common.py", script} <= set(stagedeps.import_closure(script, ROOT)), name
        assert runtime, name


# --------------------------------------------------------------------------- real dvc status
def _dvc(repo: Path, *args: str) -> str:
    dvc = Path(sys.executable).with_name("dvc")
    r = subprocess.run([str(dvc), *args], cwd=repo, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr + r.stdout
    return r.stdout


def _status(repo: Path) -> set[str]:
    """Stages ``dvc status`` lists (the in-process API, one repo object per call: fresh hashes)."""
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        return {name.rsplit("dvc.yaml:", 1)[-1] for name in r.status()}  # the name, from cwd-relative addresses


@pytest.fixture(scope="module")
def dvc_repo(tmp_path_factory) -> Path:
    """A copy of the repo's code, dvc.yaml and params.yaml (one iteration), every out a placeholder,
    committed to dvc.lock as it is (``dvc commit -f``), so ``dvc status`` starts clean."""
    tmp = tmp_path_factory.mktemp("dvc")
    repo = _code_copy(tmp)
    params = (repo / "params.yaml").read_text()
    params = params[: params.index("# --- iterations table")] + (
        "# --- iterations table: generated by `grpo-pipeline iterations N`; do not edit below ---\n"
        "iterations:\n  it0: {index: 0, policy: models/sft, next: models/it1}\n"
        "evaluations:\n  base: {checkpoint: models/base, n_prompts: 0}\n  sft: {checkpoint: models/sft, n_prompts: 0}\n"
        "  it0: {checkpoint: models/it1, n_prompts: 0}\n")
    (repo / "params.yaml").write_text(params)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    _dvc(repo, "init", "-q")
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        for stage in r.index.stages:
            for out in stage.outs:
                p = Path(out.fs_path)
                if out.is_metric or out.plot or p.suffix in (".json", ".parquet"):
                    p.parent.mkdir(parents=True, exist_ok=True)
                    p.write_text("{}" if p.suffix == ".json" else "placeholder")
                else:
                    p.mkdir(parents=True, exist_ok=True)
                    (p / "part").write_text("placeholder")
    for d in ("metrics/iterations", "metrics/eval"):
        (repo / d).mkdir(parents=True, exist_ok=True)
    _dvc(repo, "commit", "-f", "-q")
    assert _status(repo) == set()
    return repo


def _expected(repo: Path, touched: str) -> set[str]:
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    params = yaml.safe_load((repo / "params.yaml").read_text())
    want = set()
    for name, (script, _) in stagedeps.stage_scripts(repo / "dvc.yaml").items():
        if touched in stagedeps.import_closure(script, repo):
            keys = params[stages[name]["foreach"][2:-1]] if "foreach" in stages[name] else [None]
            want |= {f"{name}@{k}" if k else name for k in keys}
    return want


def _touch_each(dvc_repo: Path, files: list[str]) -> set[str]:
    """Append a comment to each file in turn: `dvc status` lists the stages importing it, and only those."""
    seen_stages = set()
    for f in files:
        path = dvc_repo / f
        original = path.read_bytes()
        path.write_bytes(original + b"\n# touched\n")
        try:
            listed = _status(dvc_repo)
        finally:
            path.write_bytes(original)
        assert listed == _expected(dvc_repo, f), f
        seen_stages |= listed
    assert _status(dvc_repo) == set()
    return seen_stages


# modules the hand-written deps used to miss (update: advantages, checkpoint, schemas, config; evaluate: the
# sandbox; sft: policy), the scripts' shared helper, and one module no stage imports
SOME = ["grpo_pipeline/advantages.py", "grpo_pipeline/checkpoint.py", "grpo_pipeline/config.py",
        "grpo_pipeline/sandbox_supervisor.py", "grpo_pipeline/policy.py", "stages/_common.py",
        "grpo_pipeline/rewards/rowwise.py", "grpo_pipeline/report.py"]


def test_touching_a_module_reruns_exactly_its_importers(dvc_repo):
    assert _expected(dvc_repo, "grpo_pipeline/rewards/rowwise.py") == set()
    assert "update@it0" in _expected(dvc_repo, "grpo_pipeline/advantages.py")
    assert _touch_each(dvc_repo, SOME) >= {"update@it0", "evaluate@base", "sft", "report", "prepare"}


@pytest.mark.slow
def test_touching_any_module_reruns_exactly_its_importers(dvc_repo):
    """Every code file of the checkout (~2 min)."""
    files = sorted(p.relative_to(dvc_repo).as_posix() for d in stagedeps.CODE_ROOTS
                   for p in (dvc_repo / d).rglob("*.py"))
    seen_stages = _touch_each(dvc_repo, files)
    everything = set().union(*(_expected(dvc_repo, f) for f in files))
    assert seen_stages == everything and len(everything) == 1 + 3 + 4 + 3 + 1  # every stage reached (check too)
    assert "grpo_pipeline/rewards/rowwise.py" in files and _expected(dvc_repo, "grpo_pipeline/rewards/rowwise.py") \
        == set()  # a module no stage imports reruns nothing


def test_training_sampling_keys_do_not_rerun_evaluate(dvc_repo):
    path = dvc_repo / "params.yaml"
    original = path.read_text()
    try:
        path.write_text(original.replace("  group_size: 8 ", "  group_size: 4 "))
        listed = _status(dvc_repo)
        assert "sample@it0" in listed and not {"evaluate@base", "evaluate@sft"} & listed
        path.write_text(original.replace("  top_p: 1.0", "  top_p: 0.9"))
        assert {"sample@it0", "evaluate@base", "evaluate@sft"} <= _status(dvc_repo)
        sampling_seed = _replace_in_section(original, "sampling", "seed: 0", "seed: 3")
        path.write_text(_replace_in_section(sampling_seed, "update", "seed: 0", "seed: 3"))
        listed = _status(dvc_repo)
        assert "sample@it0" in listed and "update@it0" in listed and not {"evaluate@base", "evaluate@sft"} & listed
        path.write_text(_replace_in_section(original, "evaluate", "seed: 0", "seed: 3"))
        assert {"evaluate@base", "evaluate@sft"} <= _status(dvc_repo)
        path.write_text(original.replace("memory_mb: 256", "memory_mb: 512"))
        assert {"score@it0", "evaluate@base"} <= _status(dvc_repo)
    finally:
        path.write_text(original)


def _replace_in_section(text: str, section: str, old: str, new: str) -> str:
    """``text`` with the first ``old`` after the line ``<section>:`` replaced (a key of that section)."""
    start = text.index(f"\n{section}:")
    at = text.index(old, start)
    return text[:at] + new + text[at + len(old):]


class _Recorder:
    """A config proxy recording which keys are read."""

    def __init__(self, cfg) -> None:
        self._cfg, self.seen = cfg, set()

    def __getattr__(self, key: str):
        self.seen.add(key)
        return getattr(self._cfg, key)

    def model_copy(self, **kw):  # a copy (e.g. the resolved dtype) records into the same set
        copy = _Recorder(self._cfg.model_copy(**kw))
        copy.seen = self.seen
        return copy


def test_evaluate_reads_only_the_keys_dvc_yaml_gives_it(tiny_model, tmp_path):
    """A real evaluation (HF backend, tiny model, greedy and pass@k) reads no sampling / reward key that
    dvc.yaml leaves out of evaluate's params, so those keys can be left out safely."""
    from grpo_pipeline import schemas
    from grpo_pipeline.config import EvaluateConfig, RewardConfig, SamplingConfig
    from grpo_pipeline.data import generate_problems
    from grpo_pipeline.run import evaluate

    df = generate_problems(n=2, seed=0)
    df = df.with_columns([pl_lit_none(c) for c in schemas.schema("prompts").names if c not in df.columns])
    schemas.write_table(df, tmp_path / "eval.parquet", "prompts")
    sampling = _Recorder(SamplingConfig(backend="hf", max_new_tokens=8, max_model_len=512))
    reward = _Recorder(RewardConfig())
    evaluate.run(EvaluateConfig(max_new_tokens=4, pass_k=1, pass_samples=2), sampling, reward, name="t",
                 checkpoint=tiny_model, prompts=str(tmp_path / "eval.parquet"), out=str(tmp_path / "e.parquet"),
                 metrics_path=None)
    listed = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["evaluate"]["do"]["params"]
    assert sampling.seen and {f"sampling.{k}" for k in sampling.seen} <= set(listed), sampling.seen
    assert reward.seen and {f"reward.{k}" for k in reward.seen} <= set(listed), reward.seen
    assert "sampling.group_size" not in listed and "sampling.temperature" not in listed


def pl_lit_none(name: str):
    import polars as pl

    return pl.lit(None).alias(name)
