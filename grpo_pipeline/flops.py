"""Model FLOPs of the update and its share of a matmul peak measured on this machine (MFU).

Counting (the usual "6 N D" convention, attention's score/value products left out: they are
small next to the weights at these lengths):

* ``N``: the decoder's parameters without the token embedding and the LM head
  (:func:`param_counts`); each token the decoder processes costs ``2 N`` forward.
* the LM head (``H x V``) is applied to completion tokens only (``grpo_pipeline.policy``):
  ``2 H V`` per completion token forward.
* tokens: each distinct prompt once (a group's rows share it) plus every completion token,
  the work a perfect implementation cannot avoid; padding and gradient-checkpointing recompute
  are not counted (model FLOPs, not hardware FLOPs).
* a forward + backward costs 3 forwards (forward, input gradients, weight gradients) for a trained
  weight, 2 for a frozen one (no weight gradient: LoRA's base matrices, a frozen LM head); a no-grad
  pass (reference, pi_old) 1.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch


def _decoder_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters without the token embedding and the LM head (a tied one listed once by ``parameters()``)."""
    skip = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return [p for p in model.parameters() if id(p) not in skip]


def param_counts(model: torch.nn.Module) -> tuple[int, int]:
    """``(N, H * V)``: decoder parameters without embedding and LM head, and the LM head's weight size.

    A tied head counts once, as the head (its input-embedding use is a lookup, no FLOPs).
    """
    return sum(p.numel() for p in _decoder_params(model)), model.get_output_embeddings().weight.numel()


def trainable_counts(model: torch.nn.Module) -> tuple[int, bool]:
    """``(N_trained, head_trained)``: the decoder parameters :func:`param_counts` counts that get a gradient
    (all of them in full fine-tuning, LoRA's adapters only under LoRA), and whether the LM head does."""
    n = sum(p.numel() for p in _decoder_params(model) if p.requires_grad)
    return n, bool(model.get_output_embeddings().weight.requires_grad)


def forward_flops(n_params: int, head_params: int, *, decoder_tokens: int, head_tokens: int) -> float:
    """FLOPs of one forward pass: ``2 N`` per decoder token plus ``2 H V`` per projected token."""
    return 2.0 * n_params * decoder_tokens + 2.0 * head_params * head_tokens


def useful_tokens(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> tuple[int, int]:
    """``(decoder_tokens, completion_tokens)``: distinct prompts once, plus every completion token."""
    distinct = {tuple(p) for p in prompts}
    n_comp = sum(len(c) for c in completions)
    return sum(len(p) for p in distinct) + n_comp, n_comp


def update_flops(n_params: int, head_params: int, *, decoder_tokens: int, head_tokens: int,
                 train_passes: float = 1, nograd_passes: float = 0, trained_params: int | None = None,
                 head_trained: bool = True) -> float:
    """Model FLOPs of ``train_passes`` forward+backward and ``nograd_passes`` forward-only passes over the rows.

    A forward+backward is the forward, the input gradients (one more forward's FLOPs) and the weight
    gradients of the ``trained_params`` (None: all ``n_params``) and of the head if ``head_trained``.
    """
    fwd = forward_flops(n_params, head_params, decoder_tokens=decoder_tokens, head_tokens=head_tokens)
    trained = n_params if trained_params is None else trained_params
    weight_grads = forward_flops(trained, head_params if head_trained else 0,
                                 decoder_tokens=decoder_tokens, head_tokens=head_tokens)
    return train_passes * (2.0 * fwd + weight_grads) + nograd_passes * fwd


def matmul_peak(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *, size: int = 2048,
                seconds: float = 1.0) -> float:
    """Best measured FLOP/s of a ``size``-square matmul in ``dtype`` on ``device`` (all threads), over ~``seconds``."""
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=g).to(device, dtype)
    b = torch.randn(size, size, generator=g).to(device, dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    a @ b
    sync()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds or best == float("inf"):
        t = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t)
    return 2.0 * size**3 / best


def mfu(flops: float, seconds: float, peak: float) -> float:
    """Achieved FLOP/s as a share of ``peak`` FLOP/s."""
    return flops / seconds / peak if seconds > 0 and peak > 0 else float("nan")
