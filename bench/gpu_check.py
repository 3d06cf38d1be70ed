"""GPU check: one GRPO iteration of W1 (and of a ~0.5B random Llama) through the real stages, with MFU.

For a lent GPU machine, which has torch/transformers but neither DVC nor (usually) vLLM: the stage
commands of ``dvc.yaml`` are rendered and run in order by ``bench/sweep.py``'s machinery, in a copy of
the project per model: ``prepare``, ``base``, ``sft``, then ``sample@it0``, ``score@it0``,
``advantage@it0``, ``update@it0``. Printed per model: wall time of each stage (process start, imports
and model loads included), the sampler's completion tokens/s, the update's tokens/s, its model FLOP
(``grpo_pipeline.flops``) and achieved FLOP/s as a share of the device's bf16 matmul peak measured in
this run (MFU). Figures go to ``<out>/gpu_check.json``.

W1 (``bench/iteration.py``'s workload): SmolLM2-135M-Instruct, 8 prompts x G = 8, at most 128 new
tokens, one optimizer step over the 64 completions (mu = 1), beta 0.04, bf16. ``random-0.5b``: the
same family (Llama, SmolLM2's tokenizer) at ~0.5B parameters, random weights, built here; its
completions earn no reward, so group filtering is off for it and the update still runs its full
forward/backward (zero advantages, KL term) over the same token count.

    python bench/gpu_check.py --out /tmp/gpu                       # W1 and random-0.5b
    python bench/gpu_check.py --out /tmp/gpu --models w1 -S base.source=gguf -S base.path=/tmp/m.gguf
    python bench/gpu_check.py --out /tmp/gpu --dry-run             # print the params and commands only
    python bench/gpu_check.py --out /tmp/gpu --models w1-random,random-0.5b --tokenizer <SmolLM2 tokenizer dir>
                                  # W1's shapes with random weights, where the GGUF cannot travel

A GPU machine with torch, transformers, peft, pyarrow and pyyaml but no registry also needs (as cp312
manylinux wheels, ~56 MB, installed with ``pip install --no-index --no-deps --target``): pydantic,
pydantic-core, annotated-types, typing-inspection, typing-extensions, polars + polars-runtime-32,
math-verify, latex2sympy2_extended, antlr4-python3-runtime (4.9.3); put ``python`` on PATH (the stage
commands call it) and the repository on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_sweep", ROOT / "bench" / "sweep.py")
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)

STAGES = ("prepare", "base", "sft", "sample@it0", "score@it0", "advantage@it0", "update@it0")
W1 = ["sampling.prompts_per_iteration=8", "sampling.group_size=8", "sampling.max_new_tokens=128",
      "sampling.spare_prompts=0", "sampling.dtype=bfloat16", "update.dtype=bfloat16", "update.lr=1.0e-6",
      "update.beta=0.04", "update.epsilon=0.2", "update.mu=1", "update.minibatch_size=64",
      "update.micro_batch_size=16", "sampling.hf_batch_size=64", "update.lora=null"]   # W1: full fine-tuning, as TRL
# ~0.5B, SmolLM2's family (Llama): 32 layers x 14.1M + 56.6M tied embedding = 0.51B parameters
RANDOM_05B = {"hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 32, "num_attention_heads": 18,
              "num_key_value_heads": 6, "head_dim": 64, "tie_word_embeddings": True, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-5, "rope_theta": 100000.0}

# W1's own shapes (SmolLM2-135M) with random weights: where the packaged GGUF (98 MB) cannot travel to the GPU
# machine, the same FLOPs and memory through the same stages (its completions run to max_new_tokens)
SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "tie_word_embeddings": True, "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-5, "rope_theta": 100000.0}
RANDOM = {"random-0.5b": RANDOM_05B, "w1-random": SMOLLM2_135M}


def model_overrides(name: str, random_dir: Path) -> list[str]:
    if name == "w1":
        return []
    if name in RANDOM:
        return ["base.source=hf", f"base.path={random_dir}", "advantage.filter_groups=false"]
    raise SystemExit(f"unknown model {name!r}: w1 | {' | '.join(RANDOM)}")


def config_params(overrides: list[str], backend: str) -> dict:
    """params.yaml + W1 + one iteration (no evaluation) + ``overrides``, validated like the stages do."""
    from grpo_pipeline.config import Params
    from grpo_pipeline.iterations import table

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params.update(yaml.safe_load(table(1)))
    params["evaluations"] = {}
    params = sweep.apply_overrides(params, [*W1, f"sampling.backend={backend}", *overrides])
    Params.model_validate(params)
    return params


def stage_commands(params: dict) -> list[tuple[str, str]]:
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    return [(n, c) for n, c in sweep.commands(dvc, params) if n in STAGES]


def build_random_model(tokenizer_dir: Path, out: Path, arch: dict = RANDOM_05B) -> int:
    """A random-weight Llama with ``tokenizer_dir``'s tokenizer, saved as an HF checkpoint; its parameter count."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, **arch)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def run_model(name: str, overrides: list[str], out: Path, backend: str) -> dict:
    params = config_params(overrides, backend)
    dvc = {"stages": {}}
    full = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for n in ("check", *(s for s in STAGES if "@" not in s)):
        dvc["stages"][n] = full[n]
    for n in ("sample", "score", "advantage", "update"):
        dvc["stages"][n] = full[n]
    r = sweep.run_config(name, [], params, dvc, out, None, keep_checkpoints=True)
    work = out / name
    it = work / "metrics/iterations/it0"
    metrics = {s: json.loads((it / f"{s}.json").read_text()) for s in ("sample", "update") if (it / f"{s}.json").exists()}
    return {"name": name, "times": r.get("times", {}), "failed": r.get("failed"), "log_tail": r.get("log_tail"),
            **metrics}


def report(r: dict, peak: float) -> str:
    up, sa = r.get("update", {}), r.get("sample", {})
    gfs = up.get("gflop_per_s")
    mfu = gfs * 1e9 / peak if gfs and peak else float("nan")
    stages = " ".join(f"{k} {v:.1f}s" for k, v in r["times"].items())
    return (f"{r['name']}: {stages} | sample {sa.get('completion_tokens_per_s')} completion tok/s | update "
            f"{up.get('tokens_per_s')} tok/s, {up.get('model_gflop')} GFLOP at {gfs} GFLOP/s = MFU {mfu:.1%} of "
            f"{peak / 1e12:.0f} TFLOP/s bf16{' | FAILED at ' + r['failed'] if r.get('failed') else ''}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="w1,random-0.5b")
    p.add_argument("--backend", choices=["auto", "vllm", "hf"], default="auto", help="auto: vllm where importable")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer dir for random-0.5b (default: W1's imported base model, running W1 first)")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("-S", "--set", action="append", default=[], help="override for every model (key=value)")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    backend = args.backend if args.backend != "auto" else ("vllm" if importlib.util.find_spec("vllm") else "hf")
    names = args.models.split(",")
    if args.dry_run:
        for n in names:
            params = config_params([*model_overrides(n, out / f"{n}-init"), *args.set], backend)
            print(f"# {n}: sampling {params['sampling']}\n# update {params['update']}")
            print("\n".join(f"{s}: {c}" for s, c in stage_commands(params)))
        return
    import torch

    from grpo_pipeline.flops import matmul_peak

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    peak = matmul_peak(torch.bfloat16, dev, size=8192 if dev == "cuda" else 1024)
    print(f"bf16 matmul peak on {dev}: {peak / 1e12:.1f} TFLOP/s; backend {backend}", flush=True)
    results = []
    for n in names:
        if n in RANDOM:
            src = args.tokenizer or next((out / r["name"] / "models/base" for r in results if r["name"] == "w1"), None)
            if src is None:  # the tokenizer comes from W1's imported base model
                results.append(run_model("w1", [*args.set], out, backend))
                src = out / "w1" / "models/base"
            t = time.perf_counter()
            count = build_random_model(src, out / f"{n}-init", RANDOM[n])
            print(f"{n}: {count / 1e9:.2f}B parameters, built in {time.perf_counter() - t:.0f} s", flush=True)
        r = run_model(n, [*model_overrides(n, out / f"{n}-init"), *args.set], out, backend)
        results.append(r)
        print(report(r, peak), flush=True)
        if r.get("failed"):
            print("\n".join(r["log_tail"] or []), flush=True)
    (out / "gpu_check.json").write_text(json.dumps({"peak_flops": peak, "device": dev, "backend": backend,
                                                    "results": results}, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
