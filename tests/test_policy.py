"""Batched, padded log-probs equal per-sequence unpadded ones; the update and SFT loops move the weights."""

import re

import polars as pl
import pytest
import torch

from grpo_pipeline.buckets import length_buckets
from grpo_pipeline.checkpoint import load_model, load_tokenizer
from grpo_pipeline.config import SFTConfig, UpdateConfig
from grpo_pipeline.policy import collate, completion_logprobs, token_logprobs
from grpo_pipeline.sft import build_demonstrations, sft_loss, train_sft
from grpo_pipeline.update import NonFiniteError, Rollout, train


@pytest.fixture()
def model(tiny_model):
    torch.manual_seed(0)
    return load_model(tiny_model)


def rand_rollouts(n, vocab=500, seed=0, adv=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(3, vocab, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        c = torch.randint(3, vocab, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        a = float(torch.randn(1, generator=g)) if adv is None else adv
        out.append(Rollout(p, c, a, f"p{i}/0"))
    return out


def test_collate_layout():
    b = collate([[5, 6, 7], [8]], [[9], [10, 11, 12]], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 9, 0, 0], [0, 0, 8, 10, 11, 12]]
    assert b.completion_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 3, 3], [0, 0, 0, 1, 2, 3]]


def test_padded_batch_logprobs_equal_unpadded(model):
    rows = rand_rollouts(5)
    b = collate([r.prompt_ids for r in rows], [r.completion_ids for r in rows], pad_id=0)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, b)
        for i, r in enumerate(rows):
            ids = torch.tensor([r.prompt_ids + r.completion_ids])
            logits = model(ids).logits[0, len(r.prompt_ids) - 1: -1]                  # (C, V)
            ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(r.completion_ids)[:, None])[:, 0]
            torch.testing.assert_close(lp[i, : len(r.completion_ids)], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("buckets", [1, 3], ids=["one-pass", "length-buckets"])
@pytest.mark.parametrize("checkpointing", [False, True, "selective"],
                         ids=["plain", "gradient-checkpointing", "selective-checkpointing"])
def test_shared_prompt_forward_equals_full_forward_in_value_and_gradient(model, monkeypatch, checkpointing, buckets):
    """Rows of a group share their prompt: it runs once, its KV cache feeds the G completions.

    Under gradient checkpointing too: each block is replayed in backward with the same cache objects
    (HF's own cache would append the K/V a second time there); compared with the full forward
    without checkpointing, in value and in every parameter's gradient.  With length buckets the
    completions run in several passes on the same prompt K/V, each padded to its own longest row.
    """
    from grpo_pipeline import policy

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 9, 6)]
    rows = [(p, torch.randint(3, 500, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist())
            for p in prompts for _ in range(4)]
    rows += [(prompts[0], [7] * 17)]                        # one long completion: the others' padding to split off
    rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]      # groups interleaved
    b = collate([p for p, _ in rows], [c for _, c in rows], pad_id=0)
    adv = torch.randn(len(rows), 1, generator=g)

    def value_and_grads():
        model.zero_grad()
        lp, _ = policy.model_logprobs(model, b, length_buckets=buckets)                # (B, C)
        (lp * adv).sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    calls = []
    real = policy._shared_prompt_hidden
    monkeypatch.setattr(policy, "_shared_prompt_hidden",
                        lambda d, bt, **kw: calls.append(out := real(d, bt, **kw)) or out)
    model.train()
    if checkpointing:
        policy.enable_checkpointing(model, checkpointing)
        runs, mlp = [], model.get_decoder().layers[0].mlp
        monkeypatch.setattr(mlp, "forward", lambda x, f=mlp.forward: runs.append(x.shape) or f(x))
    lp_shared, g_shared = value_and_grads()
    assert calls and calls[0] is not None and calls[0].shape[:2] == b.completion_ids.shape   # took the shared path
    if checkpointing:
        passes = runs[: len(runs) // 2]                       # prompt, completion pass(es); replayed in backward
        split = len(length_buckets(b.completion_mask.sum(1).tolist(), buckets, policy.BUCKET_OVERHEAD_CELLS))
        assert (split > 1) == (buckets > 1)                  # the long row is split off from the short ones
        assert len(passes) == 1 + split and sorted(runs[len(passes):]) == sorted(passes)
        monkeypatch.undo()
        model.gradient_checkpointing_disable()
        assert not any("_can_checkpoint_with_cache" in vars(m) for m in model.modules())   # flag was temporary
    monkeypatch.setattr(policy, "_shared_prompt_hidden", lambda d, bt, **kw: None)
    lp_full, g_full = value_and_grads()
    torch.testing.assert_close(lp_shared, lp_full, atol=1e-5, rtol=1e-5)
    assert g_shared.keys() == g_full.keys() and len(g_full) > 5
    for n in g_full:
        torch.testing.assert_close(g_shared[n], g_full[n], atol=1e-5, rtol=1e-4, msg=n)
    with torch.no_grad():                                                              # and the unpadded truth
        for i, (p, c) in enumerate(rows):
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1: -1]
            ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
            torch.testing.assert_close(lp_shared[i, : len(c)], ref, atol=1e-5, rtol=1e-5)


def test_ranks_agreement_decides_the_shared_prompt_forward(model, monkeypatch):
    """Under FSDP every rank must make the same decoder calls: with ``agree`` the two-pass forward runs
    when all ranks say yes, even on a micro-batch whose prompts are all distinct, and gives the same
    log-probs; when a rank says no, none takes it."""
    from grpo_pipeline import policy

    g = torch.Generator().manual_seed(2)
    rows = [(torch.randint(3, 500, (n,), generator=g).tolist(), torch.randint(3, 500, (m,), generator=g).tolist())
            for n, m in ((4, 3), (7, 5), (5, 1))]                                   # no prompt shared
    b = collate([p for p, _ in rows], [c for _, c in rows], pad_id=0)
    calls = []
    real = policy._shared_prompt_hidden
    monkeypatch.setattr(policy, "_shared_prompt_hidden",
                        lambda d, bt, **kw: calls.append(kw) or real(d, bt, **kw))
    asked = []
    with torch.no_grad():
        full, _ = policy.model_logprobs(model, b, share_prompts=False)
        lp, _ = policy.model_logprobs(model, b, agree=lambda ok: asked.append(ok) or ok)
        assert asked == [True] and calls == [{"force": True}]
        torch.testing.assert_close(lp, full, atol=1e-5, rtol=1e-5)
        lp_no, _ = policy.model_logprobs(model, b, agree=lambda ok: False)     # another rank cannot
        assert len(calls) == 1
        torch.testing.assert_close(lp_no, full, atol=1e-6, rtol=1e-6)
        assert real(model.get_decoder(), b) is None                             # alone: nothing to share


def test_update_moves_weights_and_zero_advantage_does_not(model, tiny_model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = UpdateConfig(lr=1e-3, beta=0.0, minibatch_size=4, micro_batch_size=2)
    hist, _ = train(model, rand_rollouts(8), cfg, pad_id=0)
    assert len(hist) == 2 and all(h["ratio_mean"] == pytest.approx(1.0) for h in hist[:1])
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())

    still = load_model(tiny_model)
    before = {k: v.clone() for k, v in still.state_dict().items()}
    train(still, rand_rollouts(8, adv=0.0), cfg, pad_id=0)
    assert all(torch.equal(before[k], v) for k, v in still.state_dict().items())


def test_update_with_reference_reports_kl(model, tiny_model):
    ref = load_model(tiny_model).eval()
    cfg = UpdateConfig(lr=1e-3, beta=0.1, minibatch_size=4, micro_batch_size=4, mu=2)
    hist, _ = train(model, rand_rollouts(4), cfg, pad_id=0, ref_model=ref)
    assert hist[0]["kl"] == pytest.approx(0.0, abs=1e-6)    # same weights at the first step
    assert hist[-1]["kl"] > 0 and hist[-1]["ratio_max"] != 1.0


def test_non_finite_advantage_stops_the_update(model):
    with pytest.raises(NonFiniteError, match="non-finite loss"):
        train(model, rand_rollouts(4, adv=float("nan")), UpdateConfig(beta=0.0, minibatch_size=4, micro_batch_size=4), pad_id=0)


def test_non_finite_loss_names_the_rows_of_its_micro_batch(model):
    """Finiteness is read once per step (no sync per micro-batch), yet the error names the micro-batch at fault."""
    rows = rand_rollouts(8)
    bad = max(range(8), key=lambda i: (rows[i].prompt_ids, len(rows[i].completion_ids), i))  # last micro-batch
    rows[bad] = Rollout(rows[bad].prompt_ids, rows[bad].completion_ids, float("nan"), rows[bad].key)
    cfg = UpdateConfig(beta=0.0, minibatch_size=8, micro_batch_size=2)
    with pytest.raises(NonFiniteError, match=rf"non-finite loss .*rows [^;]*\b{rows[bad].key}\b") as err:
        train(model, rows, cfg, pad_id=0)
    named = re.findall(r"p\d+/0", str(err.value))
    assert 1 <= len(named) <= 2, str(err.value)      # only its own micro-batch (2 rows), not the first one met


def test_sft_masks_prompt_and_lowers_loss(model, tiny_model, tiny_problems):
    tok = load_tokenizer(tiny_model)
    demos = build_demonstrations(tiny_problems.head(8), tok, max_length=256)
    p, c = demos[0]
    b = collate([p], [c], pad_id=tok.pad_token_id)
    # the loss sees exactly the completion tokens: the label mask is 1 on them and the prompt is outside it
    assert int(b.completion_mask.sum()) == len(c) and b.input_ids.shape[1] == len(p) + len(c)
    assert tok.decode(c).startswith("<think>") and tok.decode(c).endswith(tok.eos_token)
    with torch.no_grad():
        first, _ = sft_loss(model, [d[0] for d in demos], [d[1] for d in demos], pad_id=tok.pad_token_id)
    train_sft(model, demos, SFTConfig(epochs=8, lr=3e-3, batch_size=4, warmup_ratio=0.0), pad_id=tok.pad_token_id)
    with torch.no_grad():
        last, _ = sft_loss(model, [d[0] for d in demos], [d[1] for d in demos], pad_id=tok.pad_token_id)
    assert float(last) < 0.8 * float(first)


def test_sft_stops_on_a_non_finite_gradient_before_the_weights_change(model, tiny_model, tiny_problems):
    """A NaN gradient with a finite loss (what cuDNN attention gave on an H100 for left-padded prompts) stops
    SFT before the optimizer writes it into the weights."""
    tok = load_tokenizer(tiny_model)
    demos = build_demonstrations(tiny_problems.head(4), tok, max_length=256)
    weight = next(model.parameters())
    before = weight.detach().clone()
    handle = weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    try:
        with pytest.raises(RuntimeError, match="sft: non-finite gradient norm nan at step 0"):
            train_sft(model, demos, SFTConfig(epochs=1, batch_size=4), pad_id=tok.pad_token_id)
    finally:
        handle.remove()
    assert torch.equal(weight.detach(), before)


def test_sft_coding_demos_use_the_coding_instruction_and_skip_rows_without_reference(tiny_model):
    from grpo_pipeline.coding import generate_tasks
    from grpo_pipeline.template import CODING_SYSTEM_PROMPT

    tok = load_tokenizer(tiny_model)
    tasks = generate_tasks(n=3, seed=0)
    tasks = tasks.with_columns(answer=pl.when(pl.int_range(pl.len()) == 1).then(pl.lit("")).otherwise("answer"))
    demos = build_demonstrations(tasks, tok, max_length=1024)
    assert len(demos) == 2                                    # the row without a reference is not trained on
    prompt = tok.decode(demos[0][0])
    assert CODING_SYSTEM_PROMPT[:40] in prompt and tasks["question"][0][:30] in prompt
    assert "</answer>" in tok.decode(demos[0][1]) and tasks["answer"][0] in tok.decode(demos[0][1])


# --------------------------------------------------------------------------- token_logprobs
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_token_logprobs_matches_full_log_softmax(chunk_size, dtype):
    g = torch.Generator().manual_seed(9)
    logits = (4 * torch.randn(3, 5, 11, generator=g)).to(dtype)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    leaf = logits.clone().requires_grad_(True)
    logp, ent = token_logprobs(leaf, labels, chunk_size=chunk_size)
    ref_leaf = logits.clone().requires_grad_(True)
    full = torch.log_softmax(ref_leaf.to(torch.promote_types(dtype, torch.float32)), dim=-1)  # (B, T, V)
    want = full.gather(-1, labels[..., None]).squeeze(-1)
    want_ent = -(full.exp() * full).sum(-1)
    assert logp.shape == labels.shape and logp.dtype == want.dtype and ent.dtype == want.dtype
    torch.testing.assert_close(logp, want, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-6)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-5)
    (logp.sum() + 0.5 * ent.sum()).backward()
    (want.sum() + 0.5 * want_ent.sum()).backward()
    torch.testing.assert_close(leaf.grad, ref_leaf.grad)


@pytest.mark.parametrize("chunk_size", [1, 4, 6])
def test_token_logprobs_never_log_softmaxes_more_than_a_chunk(monkeypatch, chunk_size):
    seen = []
    real = torch.log_softmax

    def spy(x, *args, **kwargs):
        seen.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(torch, "log_softmax", spy)
    logits = torch.randn(2, 7, 5, dtype=torch.bfloat16)
    token_logprobs(logits, torch.zeros(2, 7, dtype=torch.long), chunk_size=chunk_size)
    assert sum(seen) == 14 and max(seen) <= chunk_size


@pytest.mark.parametrize(
    ("logits", "labels", "match"),
    [
        (torch.randn(2, 3, 4), torch.full((2, 3), -100), r"labels must lie in \[0, 4\)"),
        (torch.randn(2, 3, 4), torch.full((2, 3), 4), r"labels must lie in \[0, 4\)"),
        (torch.randn(2, 3, 4), torch.zeros(2, 4, dtype=torch.long), "expected logits"),
    ],
)
def test_token_logprobs_rejects_bad_input(logits, labels, match):
    with pytest.raises(ValueError, match=match):
        token_logprobs(logits, labels)


def test_step_phases_are_timed_within_the_step(model):
    """forward_s and backward_s (CPU: perf_counter spans; GPU: CUDA events read once per step) are positive
    and, with the optimizer's share, fit inside the step's wall time."""
    hist, _ = train(model, rand_rollouts(8), UpdateConfig(beta=0.0, minibatch_size=4, micro_batch_size=2), pad_id=0)
    for h in hist:
        assert h["forward_s"] > 0 and h["backward_s"] > 0
        assert h["forward_s"] + h["backward_s"] + h["optimizer_s"] <= h["time_s"]


def test_selective_checkpointing_recomputes_no_matmul(tiny_model):
    """Full checkpointing replays each block's matmuls in backward; selective replays only element-wise ops:
    its matmul FLOPs over forward + backward equal those without checkpointing, its gradients too."""
    from torch.utils.flop_counter import FlopCounterMode

    from grpo_pipeline import policy

    g = torch.Generator().manual_seed(3)
    rows = [(torch.randint(3, 500, (6,), generator=g).tolist(), torch.randint(3, 500, (5,), generator=g).tolist())
            for _ in range(4)]
    b = collate([p for p, _ in rows], [c for _, c in rows], pad_id=0)
    flops, grads = {}, {}
    for mode in (False, True, "selective"):
        m = load_model(tiny_model).train()
        policy.enable_checkpointing(m, mode)
        with FlopCounterMode(display=False) as counter:
            lp, _ = completion_logprobs(m, b)
            lp.sum().backward()
        flops[mode] = counter.get_total_flops()
        grads[mode] = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
    assert flops[True] > flops[False] * 1.1            # full checkpointing: the blocks' forward matmuls again
    assert flops["selective"] == flops[False]
    torch.testing.assert_close(grads["selective"], grads[False], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-5, atol=1e-6)


def test_fused_head_matches_float64_log_softmax_and_entropy_on_a_large_vocabulary():
    """The LM head's fused log-prob (``_HeadLogProb``: the logits never leave one chunk buffer) against
    float64 ``log_softmax`` at a vocabulary and logit scale like SmolLM2's (V = 49152, |logits| ~10 on average):
    log-probs, entropies (computed from the shifted logits, no ``lse - sum p z`` cancellation) and gradients."""
    from grpo_pipeline.policy import _HeadLogProb

    g = torch.Generator().manual_seed(3)
    n, H, V = 96, 64, 49152
    hidden = torch.randn(n, H, generator=g) + 0.5
    weight = 0.6 * torch.randn(V, H, generator=g) + 0.3         # a shared offset: logits far from 0
    labels = torch.randint(0, V, (n,), generator=g)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    logp, ent = _HeadLogProb.apply(h, w, None, labels, True)
    z = torch.nn.functional.linear(hidden, weight).double()      # the same float32 logits, then float64
    assert z.abs().mean() > 5                                     # the scale where cancellation showed
    full = torch.log_softmax(z, dim=-1)                                              # (n, V)
    torch.testing.assert_close(logp.double(), full.gather(-1, labels[:, None]).squeeze(-1), rtol=0, atol=2e-5)
    torch.testing.assert_close(ent.double(), -(full.exp() * full).sum(-1), rtol=0, atol=2e-5)  # lse - sum p z: 1.4e-3
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    want = torch.log_softmax(h64 @ w64.t(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
    logp.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)


def test_fused_head_in_row_blocks_matches_float64_for_any_block_size(monkeypatch):
    """The head's row blocks (``HEAD_ROWS_CPU``) that divide n, do not, exceed it, or are one row: the same
    log-probs, entropies and gradients as float64, so no row is skipped or counted twice, forward or back."""
    from grpo_pipeline import policy

    g = torch.Generator().manual_seed(5)
    n, H, V = 37, 16, 3000
    hidden = torch.randn(n, H, generator=g)
    weight = 2 * torch.randn(V, H, generator=g)
    bias = torch.randn(V, generator=g)
    labels = torch.randint(0, V, (n,), generator=g)
    h64, w64, b64 = (t.double().requires_grad_(True) for t in (hidden, weight, bias))
    full = torch.log_softmax(torch.nn.functional.linear(h64, w64, b64), dim=-1)
    want = full.gather(-1, labels[:, None]).squeeze(-1)
    want_ent = -(full.exp() * full).sum(-1).detach()
    want.sum().backward()
    for rows in (1, 7, 37, 64):
        monkeypatch.setattr(policy, "HEAD_ROWS_CPU", rows)
        h, w, b = (t.clone().requires_grad_(True) for t in (hidden, weight, bias))
        logp, ent = policy._HeadLogProb.apply(h, w, b, labels, True)
        torch.testing.assert_close(logp.double(), want.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(ent.double(), want_ent, rtol=0, atol=1e-5)
        logp.sum().backward()
        for got, ref in ((h, h64), (w, w64), (b, b64)):
            torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-4, atol=1e-5)
        lp_only, ent0 = policy._HeadLogProb.apply(hidden, weight, bias, labels, False)
        torch.testing.assert_close(lp_only, logp.detach(), rtol=0, atol=0)
        assert not ent0.any()
