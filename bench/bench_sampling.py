"""Benchmark the sampling stage against raw ``vllm.LLM.generate``, and against the HF backend.

On the same prompts, seeds and sampling params, in one process and one engine:

1. raw vLLM: ``llm.generate(token ids, SamplingParams)`` — the floor;
2. the stage: :func:`grpo_pipeline.run.sample.run` with that engine passed in — reading the
   prompts, chat template and tokenisation, generation, decoding, Parquet writing and metrics:
   everything but engine start-up. Target: at most 5% over raw;
3. the HF backend through the same stage code (its own model, batched decoding).

The raw and stage runs alternate, after a warm-up on the same prompts (so both see a warm
prefix cache), and each figure is the median of ``--repeats`` runs. The engine start-up is timed
separately (``--startup-both`` also times the other engine-core mode: in-process vs its own
process). The stage's rollouts are checked to be token-for-token those of raw vLLM.

Usage::

    python bench/bench_sampling.py                       # tiny random Llama (built offline), anywhere
    python bench/bench_sampling.py --model models/base   # an HF dir, e.g. SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout: grpo_pipeline, tests.tiny

from grpo_pipeline import sampling, schemas
from grpo_pipeline.checkpoint import load_tokenizer
from grpo_pipeline.config import SamplingConfig
from grpo_pipeline.data import generate_problems
from grpo_pipeline.run import sample as stage
from grpo_pipeline.sampling import select_prompts


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: a tiny random Llama)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hf-prompts", type=int, default=None, help="prompts for the HF run (default: all)")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--startup-both", action="store_true", help="also time the other engine-core mode's start-up")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="sampling.cpu_threads")
    return p.parse_args()


def prompts_file(tmp: Path, n: int) -> str:
    df = generate_problems(n=n, seed=0)
    df = df.with_columns([pl.lit(None).alias(c) for c in schemas.schema("prompts").names if c not in df.columns])
    path = tmp / "train.parquet"
    schemas.write_table(df, path, "prompts")
    return str(path)


def main() -> None:
    args = parse()
    tmp = Path(tempfile.mkdtemp(prefix="bench_sampling."))
    if args.model is None:
        from tests.tiny import build_tiny_model

        model = str(build_tiny_model(tmp / "tiny"))
    else:
        model = args.model
    prompts = prompts_file(tmp, args.prompts)
    cfg = SamplingConfig(prompts_per_iteration=args.prompts, group_size=args.group_size,
                         max_new_tokens=args.max_new_tokens, dtype=args.dtype, max_model_len=1024,
                         kv_cache_gib=1.0, cpu_threads=args.threads, hf_batch_size=32)

    # the exact requests the stage builds (same template, ids, seeds)
    tok = load_tokenizer(model)
    rows = select_prompts(schemas.read_table(prompts, "prompts"), index=0, per_iteration=cfg.prompts_per_iteration,
                          seed=cfg.seed)
    requests, _ = sampling.build_requests(rows, tok, iteration="it0", seed=cfg.seed,
                                       max_prompt_len=cfg.max_model_len - cfg.max_new_tokens, source=prompts)
    spec = sampling.spec_from(cfg)

    backend = sampling.backend_for(cfg, model)
    print(f"model {model}  prompts {len(requests)} x G={spec.n}  max_new_tokens {spec.max_new_tokens}  "
          f"engine {backend.engine_args}  load {os.getloadavg()[0]:.2f}")
    print(f"engine start-up: {backend.startup_s:.2f} s")
    llm = backend.llm
    params = [backend.sampling_params(spec, r.seed) for r in requests]
    inputs = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]

    def timed(fn):
        """(wall s, CPU s of this process, result); with the engine in-process the CPU time is all the work."""
        w0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        return time.perf_counter() - w0, time.process_time() - c0, result

    def raw():
        return llm.generate(inputs, params, use_tqdm=False)

    def staged(name: str, engine, c: SamplingConfig = cfg) -> Path:
        stage.run(c, iteration="it0", index=0, policy=model, prompts_path=prompts, out=str(tmp / name),
                  metrics_path=None, backend=engine)
        return tmp / name

    inner = []  # wall time of the engine's generate inside each stage run: the rest is the stage's own code
    engine_generate = llm.generate

    def counted(*a, **kw):
        w0 = time.perf_counter()
        try:
            return engine_generate(*a, **kw)
        finally:
            inner.append(time.perf_counter() - w0)

    raw()  # warm-up: prefix cache, allocator
    runs: dict[str, list[tuple[float, float]]] = {"raw": [], "stage": []}
    own: list[float] = []
    for k in range(args.repeats):
        wall, cpu, outs = timed(raw)
        runs["raw"].append((wall, cpu))
        llm.generate, inner[:] = counted, []
        wall, cpu, out = timed(lambda k=k: staged(f"stage{k}", backend))
        llm.generate = engine_generate
        runs["stage"].append((wall, cpu))
        own.append(wall - sum(inner))
    ro = schemas.read_table(out, "rollouts")
    same = ro["completion_token_ids"].to_list() == [list(c.token_ids) for o in outs for c in o.outputs]
    tokens = int(ro["completion_len"].sum())
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in runs.items()}
    in_process = backend.engine_args["in_process"]
    for k, label in (("raw", "raw vLLM generate"), ("stage", "sampling stage   ")):
        w, c = med[k]
        print(f"{label}: wall {w:.3f} s ({tokens / w:.0f} completion tokens/s)  cpu {c:.3f} s   "
              f"runs wall {[round(x, 3) for x, _ in runs[k]]}")
    (rw, rc), (sw, sc) = med["raw"], med["stage"]
    print(f"stage / raw vLLM: wall {sw / rw:.3f} ({100 * (sw / rw - 1):+.1f}%)"
          + (f", cpu {sc / rc:.3f} ({100 * (sc / rc - 1):+.1f}%)" if in_process else "")
          + f"   target <= +5%   identical tokens: {same}   completion tokens {tokens}")
    o = statistics.median(own)
    print(f"the stage's own code (all but the engine's generate): {o:.3f} s = {100 * o / rw:.1f}% of raw vLLM time   "
          f"runs {[round(x, 3) for x in own]}")
    r = rw
    backend.close()

    if args.startup_both:
        other = SamplingConfig(**{**cfg.model_dump(), "engine_in_process": not in_process})
        b2 = sampling.backend_for(other, model)
        print(f"engine start-up, in_process={not in_process}: {b2.startup_s:.2f} s")
        b2.close()

    if not args.no_hf:
        n_hf = args.hf_prompts or args.prompts
        hcfg = SamplingConfig(**{**cfg.model_dump(), "backend": "hf", "prompts_per_iteration": n_hf})
        hf = sampling.backend_for(hcfg, model)
        dt_hf, _, _ = timed(lambda: staged("hf", hf, hcfg))
        per_tok_raw = r / tokens
        hf_tokens = int(schemas.read_table(tmp / "hf", "rollouts")["completion_len"].sum())
        print(f"HF backend stage:  {dt_hf:.3f} s  ({hf_tokens / dt_hf:.0f} completion tokens/s, {n_hf} prompts, "
              f"start-up {hf.startup_s:.2f} s)")
        print(f"HF / raw vLLM, time per completion token: {(dt_hf / hf_tokens) / per_tok_raw:.2f}")
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
