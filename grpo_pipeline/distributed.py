"""The update on many processes: torchrun launch, DDP / FSDP2 wrapping, collectives, full state dicts.

One process per GPU (or per CPU slot with gloo), started by ``torchrun`` from the stage's own
command (:func:`torchrun_command`), ``update.distributed`` choosing the strategy:

* ``none``: one process, the model as it is.
* ``ddp``: ``DistributedDataParallel``; every rank holds the weights and AdamW state, gradients
  are averaged over ranks after the last micro-batch of a step (``no_sync`` before it).
* ``fsdp``: FSDP2 ``fully_shard`` on every decoder layer and on the root; weights, gradients
  and AdamW state are sharded over ranks and gradients reduce-scattered (averaged) after every
  micro-batch.  With ``dtype: bfloat16`` parameters are all-gathered in bf16 and gradients
  reduced in float32 (``MixedPrecisionPolicy``); the sharded master weights stay float32.

Both average gradients over the W ranks, so each rank's loss is normalised by the global counts
divided by W (see ``grpo_pipeline.update``).  Every rank takes a disjoint shard of each minibatch
and runs the same number of micro-batches (an empty one is a fully masked dummy row), so the
collectives of FSDP line up.  Only rank 0 writes files.  CPU runs use the gloo backend, CUDA runs
NCCL (with gloo beside it for CPU tensors).
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from grpo_pipeline.buckets import passes_for
from grpo_pipeline.config import UpdateConfig
from grpo_pipeline.policy import PolicyModule, enable_checkpointing

LAUNCHED_ENV = "TORCHELASTIC_RUN_ID"   # set by torchrun in every worker


@dataclass(frozen=True)
class DistContext:
    """Where this process stands: ``strategy``, ``rank`` of ``world_size``, and its device."""

    strategy: str = "none"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.strategy != "none"

    def reduce(self, values: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """All-reduce a tensor over ranks (``sum``, ``min`` or ``max``); identity on one process."""
        if not self.distributed:
            return values
        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        out = values.to(self.device, copy=True)
        dist.all_reduce(out, op=ops[op])
        return out.to(values.device)

    def broadcast_object(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def launched() -> bool:
    """True inside a torchrun worker."""
    return LAUNCHED_ENV in os.environ and "LOCAL_RANK" in os.environ


def torchrun_command(d: UpdateConfig.Distributed, script: str, argv: list[str]) -> list[str]:
    """The command that re-runs ``script argv`` under torchrun as ``d`` asks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={d.nproc_per_node}"]
    if d.nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={d.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={d.rdzv_endpoint}",
                "--rdzv-id=grpo-update"]
    return [*cmd, script, *argv]


def init(strategy: str) -> DistContext:
    """Join the process group torchrun set up (``strategy != "none"``), or describe the single process."""
    cuda = torch.cuda.is_available()
    if strategy == "none":
        return DistContext(device=torch.device("cuda" if cuda else "cpu"))
    if "WORLD_SIZE" not in os.environ:
        msg = (f"update.distributed.strategy is {strategy!r} but this process was not started by torchrun. "
               "Hint: run stages/update.py, which launches torchrun itself")
        raise RuntimeError(msg)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo", device_id=device if cuda else None)
    return DistContext(strategy, dist.get_rank(), dist.get_world_size(), local, device)


def close(ctx: DistContext) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


def _blocks(lm: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks to shard one by one (HF ``_no_split_modules``, else ``decoder.layers``)."""
    names = set(getattr(lm, "_no_split_modules", None) or ())
    found = [m for m in lm.modules() if type(m).__name__ in names]
    if found:
        return found
    layers = getattr(lm.get_decoder(), "layers", None) if hasattr(lm, "get_decoder") else None
    if layers is None:
        msg = f"cannot find the decoder layers of {type(lm).__name__} to shard with FSDP"
        raise ValueError(msg)
    return list(layers)


def load_device(ctx: DistContext) -> torch.device:
    """Where to load weights: FSDP loads on the CPU and moves only each rank's shards to its device."""
    return torch.device("cpu") if ctx.strategy == "fsdp" else ctx.device


def wrap(lm: torch.nn.Module, ctx: DistContext, cfg: UpdateConfig, *, train: bool = True) -> torch.nn.Module:
    """``lm`` as a :class:`PolicyModule`, wrapped for ``ctx.strategy`` (``train=False``: a frozen reference)."""
    if train:
        enable_checkpointing(lm, cfg.gradient_checkpointing)
    # FSDP2 all-gathers a layer's weights on each call: every rank must call the decoder as often as the
    # others, so the ranks agree (one all-reduce per micro-batch) on whether all take the shared-prompt
    # forward (two decoder calls) or none does.
    agree = None
    if ctx.strategy == "fsdp" and ctx.world_size > 1:
        def agree(ok: bool) -> bool:
            return bool(ctx.reduce(torch.tensor([float(ok)]), "min").item())
    module = PolicyModule(lm, chunk_size=cfg.logprob_chunk_size, agree=agree,   # under agree: one pass
                          length_buckets=passes_for(cfg.length_buckets, ctx.device.type))
    if ctx.strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        kw = {"mesh": mesh}
        if cfg.dtype == "bfloat16":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in _blocks(lm):
            fully_shard(block, **kw)
        fully_shard(module, **kw)
    elif ctx.strategy == "ddp" and train:
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(module, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None,
                                         broadcast_buffers=False)   # buffers (rotary tables) are constants
    return module


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside a (DDP-wrapped) :class:`PolicyModule`."""
    inner = getattr(module, "module", module)
    return inner.lm if isinstance(inner, PolicyModule) else inner


def no_sync(module: torch.nn.Module, ctx: DistContext, sync: bool):
    """DDP: skip the gradient all-reduce on all but the last micro-batch of a step."""
    if ctx.strategy == "ddp" and not sync and hasattr(module, "no_sync"):
        return module.no_sync()
    return contextlib.nullcontext()


def grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of the gradients (sharded FSDP gradients included)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(grads)
    return total.full_tensor() if hasattr(total, "full_tensor") else total


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_model_state(module: torch.nn.Module, ctx: DistContext) -> dict[str, torch.Tensor] | None:
    """The HF model's full state dict on CPU at rank 0 (``None`` elsewhere); all ranks must call it."""
    if ctx.strategy != "fsdp":
        return unwrap(module).state_dict() if ctx.is_main else None
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    sd = get_model_state_dict(module, options=_options(cpu_offload=True))
    if not ctx.is_main:
        return None
    seen, tied = set(), set()   # gathered tied weights are separate tensors: keep the first name, as HF does
    for name, p in unwrap(module).named_parameters(remove_duplicate=False):
        (tied.add(name) if id(p) in seen else seen.add(id(p)))
    return {k.removeprefix("lm."): v for k, v in sd.items() if k.removeprefix("lm.") not in tied}


def full_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> dict | None:
    """AdamW state keyed by parameter name (independent of strategy and world size) at rank 0."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    sd = get_optimizer_state_dict(module, optimizer, options=_options(cpu_offload=ctx.distributed))
    return _hyperless(sd) if ctx.is_main else None


def _hyperless(sd: dict) -> dict:
    """Drop the scheduler's ``initial_lr``: hyper-parameters come from params.yaml, only moments carry."""
    groups = [{k: v for k, v in g.items() if k != "initial_lr"} for g in sd.get("param_groups", [])]
    return {**sd, "param_groups": groups}


def load_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict | None,
                         ctx: DistContext) -> None:
    """Load a :func:`full_optimizer_state` (given on rank 0) into ``optimizer`` on every rank."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    optimizer.zero_grad(set_to_none=True)   # lets torch initialise the (lazy) AdamW state first
    opts = _options(broadcast_from_rank0=ctx.distributed)
    set_optimizer_state_dict(module, optimizer, optim_state_dict=_hyperless(state) if ctx.is_main else {}, options=opts)
