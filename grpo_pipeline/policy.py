"""Batches of (prompt, completion) token sequences and their per-token log-probs under a model.

Layout of a batch: prompts left-padded to P, completions right-padded to C, so every
completion starts at column P.  Position ids count real tokens only, as vLLM does, so the
log-probs match the sampler's.

Memory: the vocabulary projection is never materialised for the whole batch.  The decoder's
hidden states of the completion positions that hold a real token are projected through the
LM head ``chunk_size`` tokens at a time; each chunk's ``(n, V)`` logits live only inside that
chunk, in the forward pass *and* in backward (:class:`_HeadLogProb` keeps the chunk's ``(n, H)``
hidden states and recomputes the logits).  Prompt
positions and padding are never projected at all.  Models whose head is not a plain linear
map (logit soft-capping or scaling) fall back to the model's own forward with
``logits_to_keep``.

Compute: the G rows of a group share their prompt, so the decoder runs each distinct prompt of a
micro-batch once and the completions on its (gathered, differentiable) KV cache — the same
function, with prompt tokens computed once per group instead of G times (measured on the default
update, SmolLM2-135M, 64 rows: optimizer step 86 s -> 42 s, peak RSS 8.4 -> 5.3 GB), also under
gradient checkpointing (replay-safe cache layers) and multi-process FSDP2 (the ranks agree per micro-batch).

:class:`PolicyModule` wraps a Hugging Face causal LM so that this whole computation is one
``forward``: DDP and FSDP2 wrap that module, so their hooks (gradient sync, parameter
all-gather) see every use of the weights.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from grpo_pipeline.buckets import length_buckets as length_buckets_of

# A completion pass's fixed cost in padded-token cells (kernel launches, autocast's weight casts, smaller
# matrix products), against which splitting a micro-batch by length is weighed (grpo_pipeline.buckets).
BUCKET_OVERHEAD_CELLS = 64


@dataclass
class Batch:
    input_ids: torch.Tensor        # (B, P + C)
    attention_mask: torch.Tensor   # (B, P + C)
    position_ids: torch.Tensor     # (B, P + C)
    completion_ids: torch.Tensor   # (B, C)
    completion_mask: torch.Tensor  # (B, C) 1 on real completion tokens

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum())

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.position_ids,
                                               self.completion_ids, self.completion_mask)))


def collate(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *, pad_id: int) -> Batch:
    """Left-pad prompts, right-pad completions; every row needs at least one completion token."""
    P = max(len(p) for p in prompts)
    C = max(max(len(c) for c in completions), 1)
    B = len(prompts)
    ids = torch.full((B, P + C), pad_id, dtype=torch.long)   # (B, P+C)
    attn = torch.zeros((B, P + C), dtype=torch.long)         # (B, P+C)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, P - len(p): P] = torch.as_tensor(p, dtype=torch.long)
        ids[i, P: P + len(c)] = torch.as_tensor(c, dtype=torch.long)
        attn[i, P - len(p): P + len(c)] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)                  # (B, P+C)
    comp = ids[:, P:]                                          # (B, C)
    cmask = attn[:, P:].clone()                                # (B, C)
    return Batch(ids, attn, pos, comp, cmask)


def _plain_linear_head(model: torch.nn.Module) -> bool:
    """True when logits are exactly ``lm_head(decoder(x))`` (no soft-capping, scaling or temperature)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    odd = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return (isinstance(head, torch.nn.Linear) and hasattr(model, "get_decoder")
            and all(getattr(cfg, k, None) in (None, 1, 1.0) for k in odd))


HEAD_ROWS_CPU = 64   # rows per block of the head's logits on CPU: 64 x 49152 float32 = 12.6 MB (L3-sized)


def head_rows(device: torch.device, n: int) -> int:
    """Rows of the LM head's logits held at once: a cache-sized block on CPU, the whole chunk elsewhere.

    A (1024, 49152) float32 chunk is 190 MB; each fresh one costs first-touch page faults that, on a VM,
    outweigh the softmax itself (W1, 2-core AMD EPYC: 180-280 ms per chunk for ``z.exp()``; in 64-row
    blocks ~25 ms).  On a GPU small blocks would only add kernel launches.
    """
    return HEAD_ROWS_CPU if device.type == "cpu" else max(n, 1)


class _HeadLogProb(torch.autograd.Function):
    """``log softmax(h W^T + b)[label]`` (n,) float32 and the entropy (n,), keeping only ``h`` for backward.

    The logits are made and used in row blocks (:func:`head_rows`), never as one (n, V) float32 tensor.
    Backward recomputes each block's logits and turns them, in place, into the gradient
    ``dlogp/dz = onehot(label) - softmax(z)``, written into one (n, V) buffer of the matmul dtype; no
    autograd graph over the vocabulary.  Matmuls run in the autocast dtype when autocast is on (as
    ``F.linear`` would).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, with_entropy: bool):
        dev = hidden.device.type
        cd = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
        n = hidden.shape[0]
        lse, picked, entropy = (torch.zeros(n, dtype=torch.float32, device=hidden.device) for _ in range(3))
        with torch.autocast(dev, enabled=False):
            hc, wc, bc = _operands(hidden, weight, bias, cd)
            R = head_rows(hidden.device, n)
            for r in range(0, n, R):
                rows = slice(r, r + R)
                # one (R, V) float32 block, shifted in place: z - m, m the row max (what logsumexp does in
                # a temporary); its exponentials give lse and, where asked, the entropy
                z = torch.nn.functional.linear(hc[rows], wc, bc).float()            # (R, V) logits
                m = z.amax(dim=-1)                                                   # (R,)
                z.sub_(m[:, None])                                                   # z - m <= 0
                z_label = z.gather(-1, labels[rows, None]).squeeze(-1)               # (R,)
                if with_entropy:   # H = lse - sum_v p_v z_v = log s - sum_v e_v (z_v - m) / s
                    e = z.exp()                                                      # (R, V)
                    s = e.sum(dim=-1)                                                # (R,)
                    log_s = s.log()
                    entropy[rows] = log_s - e.mul_(z).sum(dim=-1) / s   # pairwise sums: 4e-7 of float64
                    del e
                else:
                    log_s = z.exp_().sum(dim=-1).log()                               # z is not needed again
                del z
                lse[rows] = m + log_s                                                # (R,) logsumexp
                picked[rows] = z_label - log_s                                       # (R,) log p(label)
        ctx.cd = cd
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    def backward(ctx, g, _g_entropy):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        n = hidden.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            hc, wc, bc = _operands(hidden, weight, bias, ctx.cd)
            grad = torch.empty(n, wc.shape[0], dtype=ctx.cd, device=hidden.device)    # (n, V) dlogp/dz
            R = head_rows(hidden.device, n)
            for r in range(0, n, R):
                rows = slice(r, r + R)
                z = torch.nn.functional.linear(hc[rows], wc, bc).float()            # (R, V) logits again
                z.sub_(lse[rows, None]).exp_().mul_(-g[rows, None])                  # -g softmax(z)
                z[torch.arange(z.shape[0], device=z.device), labels[rows]] += g[rows]  # + g onehot
                grad[rows] = z
                del z
            d_hidden = (grad @ wc).to(hidden.dtype)                                  # (n, H)
            d_weight = (grad.t() @ hc).to(weight.dtype) if ctx.needs_input_grad[1] else None
            d_bias = grad.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return d_hidden, d_weight, d_bias, None, None


def _operands(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype) -> tuple:
    """``(x, w, b)`` in the matmul dtype (the frozen weight's cast reused: :func:`frozen_cast`)."""
    return x.to(dtype), frozen_cast(w, dtype), None if b is None else b.to(dtype)


_FROZEN_CASTS: dict[int, tuple] | None = None     # id(weight) -> (key, weight, cast), inside frozen_casts()


@contextlib.contextmanager
def frozen_casts():
    """Within this block, :func:`frozen_cast` keeps each frozen weight's cast and reuses it (the update's
    passes and steps: ``grpo_pipeline.update``); the copies are dropped on exit."""
    global _FROZEN_CASTS
    outer, _FROZEN_CASTS = _FROZEN_CASTS, ({} if _FROZEN_CASTS is None else _FROZEN_CASTS)
    try:
        yield
    finally:
        _FROZEN_CASTS = outer


def frozen_cast(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``w.to(dtype)``; inside :func:`frozen_casts`, made once per frozen, unchanged weight.

    The LM head runs with autocast off (:class:`_HeadLogProb`), so autocast's cast cache does not apply,
    and a frozen head (LoRA: tied to the frozen embedding) was cast again at every chunk, once forward
    and twice backward (~40 ms for SmolLM2's 28 M-entry head on 2 cores).  A weight that trains is
    cast each time (it changes every step; under FSDP its storage is re-gathered); an in-place change
    of a frozen one bumps its version and so makes a new copy.
    """
    if w.dtype == dtype or w.requires_grad or _FROZEN_CASTS is None:
        return w.to(dtype)
    key = (w._version, w.data_ptr(), dtype)
    hit = _FROZEN_CASTS.get(id(w))
    if hit is not None and hit[0] == key and hit[1] is w:
        return hit[2]
    out = w.to(dtype)
    _FROZEN_CASTS[id(w)] = (key, w, out)
    return out


@functools.cache
def _replay_safe_layers() -> tuple[type, type]:
    """Two ``DynamicLayer`` kinds whose ``update`` a gradient-checkpointing replay can repeat.

    * ``PromptLayer`` *sets* the prompt pass's K/V (an ordinary layer appends, so a replay would
      double it);
    * ``PrefixLayer`` holds a fixed prefix (B, h, P, d) and returns prefix + new without storing.
    """
    from transformers.cache_utils import DynamicLayer

    class PromptLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
            return key_states, value_states

    class PrefixLayer(DynamicLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            super().__init__()
            self.lazy_initialization(keys, values)
            self.keys, self.values = keys, values

        def update(self, key_states, value_states, *args, **kwargs):
            return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)

    return PromptLayer, PrefixLayer


# Selective activation checkpointing: a replay in backward recomputes the cheap element-wise ops (norms,
# rotary, SiLU, products, casts) but takes matrix products and attention from what the forward saved, so
# backward does no matmul twice; the saved products are most, not all, of a block's activations.
_SAVED_OPS = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention")


def _save_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if getattr(op, "_opname", "") in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_save_matmuls)


def enable_checkpointing(lm: torch.nn.Module, mode: bool | str) -> None:
    """Gradient checkpointing of ``lm``'s blocks: ``True`` recomputes each block's forward in backward
    (least memory), ``"selective"`` recomputes only its element-wise ops (no matmul twice), ``False`` none."""
    if not mode:
        return
    kwargs: dict = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = _selective_context
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _checkpointed_layers(decoder: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The decoder's blocks that checkpoint activations now; ``None`` where they are not HF
    ``GradientCheckpointingLayer`` s (their cache handling under checkpointing is unknown)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if not any(getattr(m, "gradient_checkpointing", False) for m in decoder.modules()):
        return []
    layers = list(getattr(decoder, "layers", None) or [])
    if not layers or not all(isinstance(m, GradientCheckpointingLayer) for m in layers):
        return None
    return [m for m in layers if m.gradient_checkpointing]


def attention_kernels(device: torch.device):
    """The attention kernels a differentiated forward may use (its backward follows): on a GPU all but cuDNN's.

    Left-padded prompts give fully masked query rows under an explicit mask. cuDNN's attention, torch's first
    choice on Hopper, returns NaN in dQ for such rows (pytorch/pytorch#196678, a regression in torch 2.11;
    memory-efficient and math attention are clean): on an H100 with torch 2.11 ``bench/gpu_check.py``'s update
    stopped on a NaN gradient norm while its loss and the reference pass were finite. Used by
    every forward that is differentiated (update, SFT) and around its ``backward`` (where gradient checkpointing
    reruns attention)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def can_share_prompts(decoder: torch.nn.Module) -> bool:
    """Whether :func:`_shared_prompt_hidden` can run this decoder (plain dynamic cache, known checkpointing)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    cache = DynamicCache(config=getattr(decoder, "config", None))
    return (all(type(layer) is DynamicLayer for layer in cache.layers)     # no sliding window etc.
            and _checkpointed_layers(decoder) is not None)


def _shared_prompt_hidden(decoder: torch.nn.Module, batch: Batch, *, force: bool = False,
                          length_buckets: int = 1) -> torch.Tensor | None:
    """(B, C, H) decoder states that predict the completion tokens, each distinct prompt run once.

    A GRPO group's G rows share one prompt.  The U distinct prompts (U, P) go through the decoder
    once, keeping each layer's keys and values; those are gathered to the B rows (an index,
    differentiable) and the completions (B, C) run on top of them.  Gradients reach the prompt's
    computation through the cached keys and values, so the result equals the full (B, P + C)
    forward: same function, fewer FLOPs (prompt tokens once per group instead of G times).

    Under gradient checkpointing each block's forward is replayed in backward with the same
    cache object; the prompt pass's cache *sets* its K/V and the completion pass's reads a fixed
    prefix and stores nothing, so a replay computes exactly what the forward did (HF drops a
    cache under checkpointing because its ordinary cache would append a second time).

    ``length_buckets`` > 1: the completions run in up to that many passes on the same prompt
    keys/values, rows of similar length together (``grpo_pipeline.buckets``), each pass padded to its
    own longest row instead of the micro-batch's: the same values and gradients, fewer padded cells.

    ``None`` when nothing is shared or split (unless ``force``: FSDP needs every rank to make the same
    decoder calls, so it runs one pass) or the model cannot (:func:`can_share_prompts`); the caller
    then runs the full forward.
    """
    from transformers.cache_utils import DynamicCache

    P = batch.input_ids.shape[1] - batch.completion_ids.shape[1]
    if P < 1 or not can_share_prompts(decoder):
        return None
    key = torch.cat([batch.input_ids[:, :P], batch.attention_mask[:, :P]], dim=1)   # (B, 2P): pads count
    uniq, inverse = torch.unique(key, dim=0, return_inverse=True)                     # (U, 2P), (B,)
    if force or length_buckets <= 1:                                                  # one pass: no host sync
        lengths, groups = None, [list(range(key.shape[0]))]
    else:
        lengths = batch.completion_mask.sum(1).tolist()                               # (B,) real tokens per row
        groups = length_buckets_of(lengths, length_buckets, BUCKET_OVERHEAD_CELLS)
    if uniq.shape[0] == key.shape[0] and len(groups) == 1 and not force:
        return None
    first = torch.empty(uniq.shape[0], dtype=torch.long, device=inverse.device)      # (U,) one row per prompt
    first.scatter_(0, inverse, torch.arange(len(inverse), device=inverse.device))
    config = getattr(decoder, "config", None)
    prompt_layer, _ = _replay_safe_layers()
    prompt_cache = DynamicCache(config=config)
    prompt_cache.layers = [prompt_layer() for _ in prompt_cache.layers]
    checkpointed = _checkpointed_layers(decoder) or []
    for m in checkpointed:                 # let HF pass these replay-safe caches through its checkpointing
        m._can_checkpoint_with_cache = True
    try:
        out = decoder(input_ids=batch.input_ids[first, :P], attention_mask=batch.attention_mask[first, :P],
                      position_ids=batch.position_ids[first, :P], past_key_values=prompt_cache, use_cache=True)
        last = out.last_hidden_state[inverse, -1:]                            # (B, 1, H): predicts o_1
        if len(groups) == 1:
            return torch.cat([last, _completion_pass(decoder, batch, prompt_cache, inverse, P)], dim=1)  # (B, C, H)
        C = batch.completion_ids.shape[1]
        parts = []
        for rows in groups:                                                   # (b,) rows of similar length
            r = torch.tensor(rows, device=inverse.device)
            Cb = max(1, max(lengths[i] for i in rows))
            h = last[r]                                                       # (b, 1, H)
            if Cb > 1:
                part = Batch(batch.input_ids[r, : P + Cb], batch.attention_mask[r, : P + Cb],
                            batch.position_ids[r, : P + Cb], batch.completion_ids[r, :Cb], batch.completion_mask[r, :Cb])
                h = torch.cat([h, _completion_pass(decoder, part, prompt_cache, inverse[r], P)], dim=1)  # (b, Cb, H)
            parts.append(torch.nn.functional.pad(h, (0, 0, 0, C - Cb)))       # (b, C, H)
        order = torch.tensor([i for rows in groups for i in rows], device=inverse.device)
        return torch.cat(parts)[torch.argsort(order)]                         # (B, C, H) in the batch's row order
    finally:
        for m in checkpointed:
            m.__dict__.pop("_can_checkpoint_with_cache", None)


def _completion_pass(decoder: torch.nn.Module, batch: Batch, prompt_cache, inverse: torch.Tensor,
                     P: int) -> torch.Tensor:
    """(B, C - 1, H): completion tokens o_1 .. o_{C-1} (predicting o_2 .. o_C) on the rows' prompt K/V."""
    from transformers.cache_utils import DynamicCache

    _, prefix_layer = _replay_safe_layers()
    cache = DynamicCache(config=getattr(decoder, "config", None))
    cache.layers = [prefix_layer(layer.keys[inverse], layer.values[inverse])       # (U, ...) -> (B, ...)
                    for layer in prompt_cache.layers]
    comp = decoder(input_ids=batch.input_ids[:, P:-1], attention_mask=batch.attention_mask[:, :-1],
                   position_ids=batch.position_ids[:, P:-1], past_key_values=cache, use_cache=True)
    return comp.last_hidden_state


def _fused_logprobs(model: torch.nn.Module, batch: Batch, *, chunk_size: int, with_entropy: bool,
                    share_prompts: bool = True, agree: Callable[[bool], bool] | None = None,
                    length_buckets: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    C = batch.completion_ids.shape[1]
    decoder = model.get_decoder()
    hidden = None
    if share_prompts and agree is None:
        hidden = _shared_prompt_hidden(decoder, batch, length_buckets=length_buckets) if C > 1 else None
    elif share_prompts and agree(C > 1 and batch.input_ids.shape[1] > C and can_share_prompts(decoder)):
        hidden = _shared_prompt_hidden(decoder, batch, force=True)   # all ranks: the same two decoder calls
    if hidden is None:
        out = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      position_ids=batch.position_ids, use_cache=False)
        hidden = out.last_hidden_state[:, -(C + 1):-1]                     # (B, C, H): t predicts token t+1
    valid = batch.completion_mask.bool()                                   # (B, C)
    h, labels = hidden[valid], batch.completion_ids[valid]                 # (N, H), (N,)
    empty = labels.numel() == 0
    if empty:  # a fully masked (dummy) micro-batch still uses every weight, so DDP / FSDP gradients line up
        h, labels = hidden[:1, :1].reshape(1, -1), batch.completion_ids[:1, :1].reshape(1)
    head = model.get_output_embeddings()
    picked, ents = [], []
    for s in range(0, labels.shape[0], chunk_size):
        lp, ent = _HeadLogProb.apply(h[s: s + chunk_size], head.weight, head.bias, labels[s: s + chunk_size],
                                     with_entropy)
        picked.append(lp)
        ents.append(ent)
    zeros = torch.zeros(valid.shape, dtype=torch.float32, device=hidden.device)  # (B, C)
    if empty:
        return zeros + 0.0 * picked[0].sum(), (zeros.clone() if with_entropy else None)
    logp = zeros.masked_scatter(valid, torch.cat(picked))                  # (B, C), 0 at padding
    entropy = zeros.masked_scatter(valid, torch.cat(ents)) if with_entropy else None
    return logp, entropy


def _logits_logprobs(model: torch.nn.Module, batch: Batch, *, chunk_size: int,
                     with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    C = batch.completion_ids.shape[1]
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, logits_to_keep=C + 1, use_cache=False)
    logits = out.logits[:, :-1, :]                             # (B, C, V): position t predicts token t+1
    logp, entropy = token_logprobs(logits, batch.completion_ids, chunk_size=chunk_size)
    valid = batch.completion_mask.bool()
    return torch.where(valid, logp, 0.0), (torch.where(valid, entropy, 0.0).detach() if with_entropy else None)


def model_logprobs(model: torch.nn.Module, batch: Batch, *, chunk_size: int = 1024, with_entropy: bool = False,
                   share_prompts: bool = True, agree: Callable[[bool], bool] | None = None,
                   length_buckets: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(o_t | q, o_<t) (B, C) float32 of a plain HF causal LM, 0 at padding; entropy (B, C) if asked.

    ``share_prompts``: rows with the same prompt run it once (see :func:`_shared_prompt_hidden`;
    plain-linear-head models only).  ``agree``: under FSDP, the AND of a flag over all ranks; the
    shared-prompt forward then runs on every rank or on none, so all make the same decoder calls.
    ``length_buckets``: up to that many completion passes per batch, rows of similar length together
    (less padding; one process only: FSDP ranks must make the same calls).
    """
    if chunk_size < 1:
        msg = f"chunk_size must be >= 1, got {chunk_size}"
        raise ValueError(msg)
    if _plain_linear_head(model):
        return _fused_logprobs(model, batch, chunk_size=chunk_size, with_entropy=with_entropy,
                               share_prompts=share_prompts, agree=agree, length_buckets=length_buckets)
    return _logits_logprobs(model, batch, chunk_size=chunk_size, with_entropy=with_entropy)


class PolicyModule(torch.nn.Module):
    """An HF causal LM whose ``forward`` returns completion log-probs (and entropies), for DDP / FSDP.

    The wrapped model is ``self.lm``; parameters are shared, not copied.  ``length_buckets``: see
    :func:`model_logprobs` (ignored under ``agree``).
    """

    def __init__(self, lm: torch.nn.Module, *, chunk_size: int = 1024, share_prompts: bool = True,
                 agree: Callable[[bool], bool] | None = None, length_buckets: int = 1) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_size = chunk_size
        self.share_prompts = share_prompts
        self.agree = agree
        self.length_buckets = length_buckets

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                completion_ids: torch.Tensor, completion_mask: torch.Tensor, with_entropy: bool = False):
        b = Batch(input_ids, attention_mask, position_ids, completion_ids, completion_mask)
        return model_logprobs(self.lm, b, chunk_size=self.chunk_size, with_entropy=with_entropy,
                              share_prompts=self.share_prompts, agree=self.agree, length_buckets=self.length_buckets)


def is_policy_module(model: torch.nn.Module) -> bool:
    """A :class:`PolicyModule`, also once FSDP2-sharded or inside DDP (``.module``)."""
    return isinstance(model, PolicyModule) or isinstance(getattr(model, "module", None), PolicyModule)


def completion_logprobs(model: torch.nn.Module, batch: Batch, *, chunk_size: int = 1024,
                        with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(o_t | q, o_<t) for every completion token: (B, C) float32, 0 at padding; entropy (B, C) if asked.

    ``model`` is an HF causal LM or a (wrapped) :class:`PolicyModule`.
    """
    if is_policy_module(model):
        return model(batch.input_ids, batch.attention_mask, batch.position_ids, batch.completion_ids,
                     batch.completion_mask, with_entropy=with_entropy)
    return model_logprobs(model, batch, chunk_size=chunk_size, with_entropy=with_entropy)


# --------------------------------------------------------------------------- log-probs from logits
def _chunk_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(logits.dtype, torch.float32)  # float32, or float64 for float64 logits
    logsm = torch.log_softmax(logits.to(dtype), dim=-1)  # (N, V)
    picked = logsm.gather(-1, labels[:, None]).squeeze(-1)  # (N,)
    entropy = -(logsm.exp() * logsm).sum(-1)  # (N,)
    return picked, entropy


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, *, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(logits)[label]`` and entropy ``-sum_v p_v log p_v`` per token, in chunks.

    The ``B*T`` tokens are processed ``chunk_size`` at a time, each chunk upcast to float32, so
    the full ``(B, T, V)`` float32 log-softmax never exists at once in the forward pass.
    (Autograd keeps each chunk's log-softmax for backward; wrap in ``torch.no_grad()`` for
    pi_old / pi_ref.)

    Parameters
    ----------
    logits : (B, T, V) any float dtype; already aligned so ``logits[:, t]`` predicts ``labels[:, t]``.
    labels : (B, T) integer token ids in ``[0, V)`` (replace padding ids such as -100 first).

    Returns
    -------
    logp : (B, T) float32 (float64 for float64 logits).
    entropy : (B, T) same dtype.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        msg = f"expected logits (B, T, V) and labels (B, T), got {tuple(logits.shape)} and {tuple(labels.shape)}"
        raise ValueError(msg)
    if chunk_size < 1:
        msg = f"chunk_size must be >= 1, got {chunk_size}"
        raise ValueError(msg)
    vocab = logits.shape[-1]
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= vocab):
        msg = f"labels must lie in [0, {vocab}); got min {int(labels.min())}, max {int(labels.max())}"
        raise ValueError(msg)
    flat_logits = logits.reshape(-1, vocab)  # (B*T, V)
    flat_labels = labels.reshape(-1)  # (B*T,)
    parts = [
        _chunk_logprobs(flat_logits[s : s + chunk_size], flat_labels[s : s + chunk_size])
        for s in range(0, flat_labels.shape[0], chunk_size)
    ]
    if not parts:  # no tokens at all
        empty = torch.empty(labels.shape, dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device)
        return empty, empty.clone()
    logp = torch.cat([p for p, _ in parts]).view(labels.shape)  # (B, T)
    entropy = torch.cat([h for _, h in parts]).view(labels.shape)  # (B, T)
    return logp, entropy
