"""Run the pipeline's own stage commands for several param overrides, in parallel, without DVC.

For a machine that has the package but not DVC (a lent GPU, where only torch/transformers are
installed): each configuration gets a work dir with ``params.yaml`` + its ``-S``-style overrides,
and the commands of ``dvc.yaml`` are rendered (``${key}``, ``${item.*}``) and run in DVC's order
(the stages before the iterations, then per iteration its foreach stages, then the evaluations and
the rest). Stages whose params and inputs equal the shared prefix's (``prepare``, ``base``,
``sft`` when the config does not override ``data``/``base``/``sft``) run once and are shared.
On a machine with DVC use ``dvc exp run -S ...`` instead: this is the same recipe without the cache.

    python bench/sweep.py --sweep sweep.yaml --out /tmp/sweep --parallel 8 [-S key=value ...]

``sweep.yaml``: ``{name: [key=value, ...], ...}``. Prints one table row per config (the summary
metrics) and writes ``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
PREFIX_SECTIONS = ("data", "base", "sft")
PREFIX_STAGES = ("prepare", "base", "sft")


def apply_overrides(params: dict, overrides: list[str]) -> dict:
    """``key.sub=value`` (value parsed as YAML), like ``dvc exp run -S``."""
    out = json.loads(json.dumps(params))
    for item in overrides:
        key, _, raw = item.partition("=")
        node, *path = key.split(".")
        parts = [node, *path]
        cur = out
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = yaml.safe_load(raw)
    return out


def render(cmd: str, key: str | None, item: dict | None) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name == "key":
            return str(key)
        return str(item[name.removeprefix("item.")])
    return re.sub(r"\$\{([\w.]+)\}", sub, " ".join(cmd.split()))


def commands(dvc: dict, params: dict) -> list[tuple[str, str]]:
    """``(stage name, command)`` in an order that respects the pipeline's data flow."""
    before, per_iter, per_eval, after = [], [], [], []
    for name, st in dvc["stages"].items():
        if "foreach" not in st:
            (after if per_iter else before).append((name, render(st["cmd"], None, None)))
            continue
        table = st["foreach"].strip("${} ")
        (per_iter if table == "iterations" else per_eval).append((name, st["do"]["cmd"], table))
    out = list(before)
    for key, item in params.get("iterations", {}).items():
        out += [(f"{n}@{key}", render(c, key, item)) for n, c, _ in per_iter]
    for n, c, table in per_eval:
        out += [(f"{n}@{key}", render(c, key, item)) for key, item in params[table].items()]
    return out + after


def prunable(stage: str, params: dict) -> list[str]:
    """Checkpoints no later stage reads once ``stage`` is done: the policy an ``update@itN`` started from,
    unless an evaluation or the SFT/base reference reads it. (14 configs x 1.6 GB per checkpoint with its
    optimizer state filled a 64 GiB disk on the lent GPU after 3 iterations.)"""
    name, _, key = stage.partition("@")
    if name != "update" or key not in params.get("iterations", {}):
        return []
    policy = params["iterations"][key]["policy"]
    kept = {e["checkpoint"] for e in params.get("evaluations", {}).values()} | {"models/sft", "models/base"}
    return [] if policy in kept else [policy]


def run_config(name: str, overrides: list[str], base_params: dict, dvc: dict, out: Path, shared: Path | None,
               threads: int = 0, keep_checkpoints: bool = False) -> dict:
    work = out / name
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(".git", ".venv", ".dvc", "data", "models", "metrics",
                                                                  ".whl", ".gguf", ".site", "dvc_plots", "__pycache__"))
    params = apply_overrides(base_params, overrides)
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    prefix_shared = shared is not None and all(params[s] == base_params[s] for s in PREFIX_SECTIONS)
    if prefix_shared:
        for d in ("data/prompts", "models/base", "models/sft"):
            (work / d).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(shared / d, work / d)
    env = {**os.environ, "PYTHONPATH": f"{work}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # `python` = this one
    if threads:  # parallel configs: each its share of the cores (16 threads x 8 configs spin-wait each other)
        env.update({k: str(threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")})
    times: dict[str, float] = {}
    log = (work / "sweep.log").open("w")
    for stage, cmd in commands(dvc, params):
        if prefix_shared and stage in PREFIX_STAGES:
            continue
        t0 = time.perf_counter()
        r = subprocess.run(cmd, check=False, shell=True, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
        times[stage] = round(time.perf_counter() - t0, 1)
        print(f"  {name}: {stage} {times[stage]} s{' FAILED' if r.returncode else ''}", flush=True)
        if r.returncode:
            log.close()
            tail = (work / "sweep.log").read_text(errors="replace").splitlines()[-12:]
            return {"name": name, "overrides": overrides, "failed": stage, "times": times, "log_tail": tail,
                    "eval": _evals(work)}
        for ckpt in [] if keep_checkpoints else prunable(stage, params):
            shutil.rmtree(work / ckpt, ignore_errors=True)
    summary = json.loads((work / "metrics/summary.json").read_text()) if (work / "metrics/summary.json").exists() else {}
    curve = json.loads((work / "metrics/curves/train.json").read_text()) if (work / "metrics/curves/train.json").exists() else []
    return {"name": name, "overrides": overrides, "summary": summary, "times": times,
            "wall_s": round(sum(times.values()), 1), "train": curve, "eval": _evals(work)}


def _evals(work: Path) -> dict:
    return {f.stem: json.loads(f.read_text()) for f in sorted((work / "metrics/eval").glob("*.json"))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", required=True, help="YAML {name: [key=value, ...]}")
    p.add_argument("--out", required=True)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--results", default=None, help="results JSON (default: <out>/results.json)")
    p.add_argument("--iterations", type=int, default=0, help="regenerate the iterations table (0: keep)")
    p.add_argument("--eval-every", type=int, default=1)
    p.add_argument("--eval-prompts", type=int, default=0)
    p.add_argument("--no-base-eval", action="store_true", help="skip evaluate@base")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep every iteration's checkpoint (default: delete those no later stage reads)")
    p.add_argument("-S", "--set", action="append", default=[], help="override for every config (key=value)")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sweep = yaml.safe_load(Path(args.sweep).read_text())
    base_params = apply_overrides(yaml.safe_load((ROOT / "params.yaml").read_text()), args.set)
    if args.iterations:  # the table `grpo-pipeline iterations N` would write
        sys.path.insert(0, str(ROOT))
        from grpo_pipeline.iterations import table

        base_params.update(yaml.safe_load(table(args.iterations, eval_every=args.eval_every,
                                                eval_prompts=args.eval_prompts)))
        if args.no_base_eval:
            base_params["evaluations"].pop("base", None)
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    # the shared prefix: prepare, base, sft once, with the common params
    t0 = time.perf_counter()
    prefix = run_config("_prefix", [], base_params, {"stages": {k: v for k, v in dvc["stages"].items()
                                                               if k in PREFIX_STAGES}}, out, None)
    print(f"prefix {prefix.get('times')} ({time.perf_counter() - t0:.0f} s)", flush=True)
    if "failed" in prefix:
        sys.exit(f"prefix failed at {prefix['failed']}:\n" + "\n".join(prefix["log_tail"]))
    results_path = Path(args.results or out / "results.json")
    with ThreadPoolExecutor(args.parallel) as pool:
        threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // args.parallel))
        futures = [pool.submit(run_config, n, ov, base_params, dvc, out, out / "_prefix", threads,
                               args.keep_checkpoints)
                   for n, ov in sweep.items()]
        results = []
        for f in as_completed(futures):
            r = f.result()
            results.append(r)
            results_path.write_text(json.dumps(results, indent=1))   # after each config: a timeout keeps the rest
            s = r.get("summary", {})
            print(f"{r['name']:<28} sft {s.get('sft/accuracy')} final {s.get('final/accuracy')} "
                  f"(diff {s.get('final_minus_sft/accuracy')} +- {s.get('final_minus_sft/accuracy_se')}) "
                  f"format {s.get('final/format')} wall {r.get('wall_s')} s {'FAILED at ' + r['failed'] if 'failed' in r else ''}",
                  flush=True)
            if "failed" in r:
                print("\n".join("    " + ln[-300:] for ln in r["log_tail"]), flush=True)


if __name__ == "__main__":
    main()
