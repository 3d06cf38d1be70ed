"""LoRA for the update (``update.lora``) through peft: adapters in, a merged HF checkpoint out.

Each update attaches adapters ``W + (alpha / r) B A`` to the ``target_modules`` of the policy it loads
(``B = 0``: the policy is unchanged at the first step), trains only ``A`` and ``B``, and writes the
merged weights as a plain HF checkpoint, so ``sample`` loads it through vLLM exactly as a fully
fine-tuned one.

Carrying AdamW across iterations (``update.optimizer_state: carry``) carries the adapters with
their moments: the state written beside the optimizer's holds ``A`` and ``B``; the next update
loads the merged checkpoint, attaches adapters, sets them to the carried ``A``, ``B`` and subtracts
their product from the base weights (``W0 = W_merged - (alpha / r) B A``, float32 rounding
aside), so training continues one LoRA run whose moments belong to its parameters.  A state
without adapters, or with other shapes (rank, targets changed), starts fresh.

Under bfloat16 autocast the frozen base weights are stored in bfloat16 for the update
(:func:`compute_copies`): autocast casts a weight that does not require grad again at every matrix
product (its cast cache keeps only trainable leaves), ~6 bytes of memory traffic per parameter per
forward pass; a bfloat16 copy gives the same products without it.  The float32 weights are kept and
put back before merging (:func:`merged`), so the checkpoint is not rounded to bfloat16.
"""

from __future__ import annotations

import torch

from grpo_pipeline.config import UpdateConfig

ADAPTER_KEY = "lora_adapter"   # the adapters' entry in the carried optimizer state
ADAPTER = "default"            # peft's adapter name


def attach(model: torch.nn.Module, cfg: UpdateConfig.LoRA) -> torch.nn.Module:
    """``model`` with fresh LoRA adapters (peft ``PeftModel``; only the adapters require grad)."""
    from peft import LoraConfig, get_peft_model

    targets = [n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    missing = [t for t in cfg.target_modules if t not in targets]
    if missing:
        msg = (f"update.lora.target_modules {missing} match no linear layer of the policy; "
               f"its linear layers are named {sorted(set(targets))}")
        raise ValueError(msg)
    conf = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=list(cfg.target_modules),
                      lora_dropout=cfg.dropout, bias="none")
    return get_peft_model(model, conf)


def _layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors by parameter name (CPU copies)."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if ".lora_" in n}


def resume(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> bool:
    """Set the adapters to ``state`` and take their product out of the (merged) base weights.

    Returns False, changing nothing, when ``state`` does not fit these adapters (names or shapes).
    """
    params = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    if set(params) != set(state) or any(params[n].shape != state[n].shape for n in params):
        return False
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(state[n])
        for layer in _layers(model).values():
            base = layer.get_base_layer().weight
            base.sub_(layer.get_delta_weight(ADAPTER).to(base.dtype))   # W0 = W_merged - (alpha/r) B A
    return True


def compute_copies(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.nn.Parameter]:
    """Store the adapted layers' frozen base weights in ``dtype`` (the autocast dtype); return the originals.

    Under autocast the products are bit for bit those of the original weights (autocast casts them
    to ``dtype`` first); :func:`merged` with the returned originals restores them before merging.
    """
    originals: dict[str, torch.nn.Parameter] = {}
    for name, layer in _layers(model).items():
        base = layer.get_base_layer()
        if base.weight.dtype == dtype or base.weight.requires_grad:
            continue
        originals[name] = base.weight
        base.weight = torch.nn.Parameter(base.weight.detach().to(dtype), requires_grad=False)
    return originals


def merged(model: torch.nn.Module, originals: dict[str, torch.nn.Parameter] | None = None) -> torch.nn.Module:
    """The HF model with the adapters folded into its weights (peft ``merge_and_unload``, in place);
    base weights that :func:`compute_copies` replaced are put back first (the merge is in their dtype)."""
    layers = _layers(model)
    for name, weight in (originals or {}).items():
        layers[name].get_base_layer().weight = weight
    return model.merge_and_unload()
