"""One GRPO iteration of workload W1 through the real DVC stages, beside HF TRL's GRPOTrainer.

W1: SmolLM2-135M-Instruct (the default base model), 8 prompts x G = 8 completions, at most 128
new tokens, temperature 1.0, beta 0.04, epsilon 0.2, lr 1e-6, one optimizer step over the 64
completions, mu = 1.

Ours: ``dvc repro -f -s <stage>`` for sample@it0, score@it0, advantage@it0, update@it0 in a
scratch copy of the project (DVC overhead and every model load / engine start-up included).
TRL: ``GRPOTrainer(use_vllm=False)`` for ``max_steps=1`` on the same prompts, same reward rules,
in its own process (model load excluded from its step time, which favours TRL), with the same
memory allocator as our stages (``GRPO_ALLOCATOR``, ``grpo_pipeline/allocator.py``; ``--trl-allocator
system``: glibc's defaults, as a TRL user gets them).  The two
alternate ``--rounds`` times.  Peak memory is the largest resident set of any one process of
each side (``RUSAGE_CHILDREN``), i.e. the heaviest stage for ours.  The sampling and update stages'
rows break their wall time down by part (from the stages' own metrics: engine start-up, generation,
writing; loads, reference pass, pi_old pass, forward, backward, optimizer, writing); ``rest`` is what
the stage's metrics do not time: process start, imports, the tokenizer, DVC's own work (hashing and
caching the outputs).

    python bench/iteration.py --precision bf16 --rounds 2      # needs: pip install -e '.[bench]'
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # grpo_pipeline from this checkout
STAGES = ["sample@it0", "score@it0", "advantage@it0", "update@it0"]
MEASURE = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
           "r = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True); "
           "w = time.perf_counter() - t; "
           "print(r.stdout[-3000:]); "
           "print('@@', r.returncode, w, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)")


def measure(cmd: list[str], cwd: Path, env: dict | None = None) -> tuple[float, float, str]:
    """(wall seconds, peak RSS MiB of the largest descendant, output tail) of ``cmd``."""
    r = subprocess.run([sys.executable, "-c", MEASURE, *cmd], cwd=cwd, capture_output=True, text=True, env=env, check=False)
    out, last = r.stdout.rsplit("@@", 1)
    rc, wall, rss = last.split()
    if int(rc) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out[-3000:]}\n{r.stderr[-2000:]}")
    return float(wall), float(rss), out


def setup(work: Path, precision: str) -> Path:
    """A scratch copy of the project with W1 params, base + (one-step) SFT already built."""
    repo = work / "repo"
    if not (repo / "models/sft").exists():
        shutil.rmtree(repo, ignore_errors=True)
        repo.mkdir(parents=True)
        subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
        subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=repo, check=True)
    for name in ("dvc.yaml", "stages", "grpo_pipeline"):      # this checkout's code, also in a reused scratch copy
        src, dst = ROOT / name, repo / name
        if src.is_dir():
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dst)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params.pop("iterations"), params.pop("evaluations")
    dt = "bfloat16" if precision == "bf16" else "float32"
    params["sft"].update(max_examples=8, batch_size=8, epochs=1)       # SFT is not part of W1: one step
    params["sampling"].update(prompts_per_iteration=8, group_size=8, max_new_tokens=128, temperature=1.0, dtype=dt,
                              spare_prompts=0)
    # W1 trains on all 64 completions, as TRL's step does: with dynamic sampling on (the default), the
    # one-step SFT's mostly all-wrong groups were dropped and the update took no step at all
    params["advantage"].update(filter_groups=False)
    params["update"].update(lr=1e-6, beta=0.04, epsilon=0.2, mu=1, minibatch_size=64, dtype=dt,
                            lora=None)    # W1 is full fine-tuning, as TRL's step (the default recipe uses LoRA)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    from grpo_pipeline.iterations import rewrite

    rewrite(repo / "params.yaml", 1)
    subprocess.run([sys.executable, "-m", "dvc", "repro", "sft"], cwd=repo, check=True, capture_output=True)
    return repo


def sample_parts(m: dict, wall: float) -> dict[str, float]:
    """sample@it0's wall seconds by part (the stage's metrics); ``rest``: process start, imports, tokenizer, DVC."""
    parts = {"engine start-up": m.get("engine_startup_s", 0.0), "generation": m.get("sample_s", 0.0),
             "writing": m.get("write_s", 0.0)}
    return {**parts, "rest": wall - sum(parts.values())}


def update_parts(m: dict, wall: float) -> dict[str, float]:
    """update@it0's wall seconds by phase (``time/*`` metrics); ``rest``: process start, imports, DVC's hashing."""
    t = lambda k: m.get(f"time/{k}_s", 0.0)  # noqa: E731
    parts = {"loads": t("load_reference") + t("load_policy"), "reference": t("reference"),
             "pi_old": t("old_logprobs"), "forward": t("forward"), "backward": t("backward"),
             "optimizer": t("optimizer"), "writing": t("write")}
    return {**parts, "rest": wall - sum(parts.values())}


def run_ours(repo: Path) -> dict:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    res = {}
    for stage in STAGES:
        wall, rss, _ = measure([sys.executable, "-m", "dvc", "repro", "-f", "-s", stage], repo, env)
        res[stage] = {"wall_s": wall, "peak_rss_mb": rss}
    upd = json.loads((repo / "metrics/iterations/it0/update.json").read_text())
    if not upd.get("steps") or upd.get("sequences") != 64:
        sys.exit(f"W1's update trained on {upd.get('sequences')} sequences in {upd.get('steps')} steps, not 64 in 1")
    res["update_tokens_per_s"] = upd.get("tokens_per_s")
    smp = json.loads((repo / "metrics/iterations/it0/sample.json").read_text())
    res["sample@it0"]["parts"] = sample_parts(smp, res["sample@it0"]["wall_s"])
    res["update@it0"]["parts"] = update_parts(upd, res["update@it0"]["wall_s"])
    res["total_s"] = sum(v["wall_s"] for k, v in res.items() if k in STAGES)
    res["peak_rss_mb"] = max(v["peak_rss_mb"] for k, v in res.items() if k in STAGES)
    return res


def run_trl(repo: Path, precision: str, *, same_allocator: bool = True) -> dict:
    # TRL's process gets the allocator our stage processes re-execute themselves with (grpo_pipeline/allocator.py)
    from grpo_pipeline.allocator import environment

    env = {**os.environ, **(environment(dict(os.environ))[0] if same_allocator else {})}
    wall, rss, out = measure([sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(repo),
                              "--precision", precision], repo, env)
    line = [ln for ln in out.splitlines() if ln.startswith("TRL ")][-1]
    res = json.loads(line[4:])
    res.update(process_wall_s=wall, peak_rss_mb=rss)
    return res


def trl_worker(repo: Path, precision: str) -> None:
    """Inside its own process: one GRPOTrainer step on the prompts sample@it0 used."""
    import polars as pl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_pipeline.config import RewardConfig
    from grpo_pipeline.rewards import score_frame
    from grpo_pipeline.template import messages

    ro = pl.read_parquet(repo / "data/rollouts/it0/*.parquet").unique("prompt_id", maintain_order=True)
    ds = Dataset.from_dict({"prompt": [messages(q) for q in ro["question"]], "answer": ro["answer"].to_list()})
    cfg = RewardConfig()

    def _score(completions, answer, col):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        df = pl.DataFrame({"prompt_id": [str(i) for i in range(len(texts))], "sample_idx": [0] * len(texts),
                           "completion": texts, "answer": answer, "operation": [None] * len(texts)},
                          schema_overrides={"sample_idx": pl.Int32, "operation": pl.Utf8})
        return score_frame(df, cfg)[0][col].fill_null(0.0).to_list()

    def accuracy(completions, answer, **_):
        return _score(completions, answer, "reward_accuracy")

    def fmt(completions, answer, **_):
        return _score(completions, answer, "reward_format")

    model_dir = repo / "models/base"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    args = GRPOConfig(
        output_dir=str(repo / "trl_out"), num_generations=8, per_device_train_batch_size=64,
        max_completion_length=128, temperature=1.0, beta=0.04, epsilon=0.2, learning_rate=1e-6,
        max_steps=1, num_iterations=1, bf16=precision == "bf16", use_cpu=True, use_vllm=False,
        loss_type="grpo", logging_steps=1, report_to="none", save_strategy="no", seed=0)

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.step_s = time.perf_counter() - self.t0

    timer = Timer()
    trainer = GRPOTrainer(model=model, args=args, reward_funcs=[accuracy, fmt], train_dataset=ds,
                          processing_class=tok, callbacks=[timer])
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    print("TRL " + json.dumps({"step_s": getattr(timer, "step_s", train_s), "train_s": train_s}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/grpo-bench-iteration")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--trl-allocator", choices=["same", "system"], default="same",
                    help="TRL's process: our stages' allocator (default, a like-for-like run) or the system's")
    ap.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trl_worker:
        return trl_worker(Path(a.trl_worker), a.precision)
    repo = setup(Path(a.workdir) / a.precision, a.precision)
    ours, trl = [], []
    for r in range(a.rounds):
        ours.append(run_ours(repo))
        print(f"round {r}: ours {ours[-1]['total_s']:.1f} s, peak {ours[-1]['peak_rss_mb']:.0f} MiB", flush=True)
        if not a.skip_trl:
            trl.append(run_trl(repo, a.precision, same_allocator=a.trl_allocator == "same"))
            print(f"round {r}: TRL step {trl[-1]['step_s']:.1f} s, peak {trl[-1]['peak_rss_mb']:.0f} MiB", flush=True)
    print(f"\nW1, {a.precision}, {a.rounds} rounds (median of rounds)")
    med = lambda xs: sorted(xs)[len(xs) // 2]
    print(f"{'stage':<16}{'wall s':>10}{'peak MiB':>10}")
    for s in STAGES:
        parts = ""
        if "parts" in ours[0][s]:   # each part's median over the rounds
            parts = "   " + ", ".join(f"{k} {med([o[s]['parts'][k] for o in ours]):.1f}" for k in ours[0][s]["parts"])
        print(f"{s:<16}{med([o[s]['wall_s'] for o in ours]):>10.1f}{med([o[s]['peak_rss_mb'] for o in ours]):>10.0f}"
              + parts)
    o_total, o_rss = med([o["total_s"] for o in ours]), med([o["peak_rss_mb"] for o in ours])
    print(f"{'ours total':<16}{o_total:>10.1f}{o_rss:>10.0f}   update {med([o['update_tokens_per_s'] for o in ours])} tok/s")
    if trl:
        t_step, t_rss = med([t["step_s"] for t in trl]), med([t["peak_rss_mb"] for t in trl])
        print(f"{'TRL step':<16}{t_step:>10.1f}{t_rss:>10.0f}   (process wall {med([t['process_wall_s'] for t in trl]):.1f} s)")
        print(f"\nratio ours/TRL: time {o_total / t_step:.2f}x (target <= 0.25), peak memory {o_rss / t_rss:.2f}x (target <= 0.45)")


if __name__ == "__main__":
    main()
