"""Batches of (prompt, completion) token sequences and their per-token log-probs under a model.

Layout of a batch: prompts left-padded to P, completions right-padded to C, so every
completion starts at column P and the logits of the completion positions are the last
C + 1 columns of the forward pass (``logits_to_keep``): the prompt's logits are never
computed over the vocabulary.  Position ids count real tokens only, as vLLM does, so
the log-probs match the sampler's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from grpo_pipeline.losses import token_logprobs


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


def completion_logprobs(model: torch.nn.Module, batch: Batch, *, chunk_size: int = 1024,
                        with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(o_t | q, o_<t) for every completion token: (B, C), and the entropy (B, C) if asked."""
    C = batch.completion_ids.shape[1]
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, logits_to_keep=C + 1, use_cache=False)
    logits = out.logits[:, :-1, :]                             # (B, C, V): position t predicts token t+1
    logp, entropy = token_logprobs(logits, batch.completion_ids, chunk_size=chunk_size)
    return logp, (entropy if with_entropy else None)
