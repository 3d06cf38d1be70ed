"""The update stage on a tiny Llama through the real forward: policy-gradient form at mu = 1, clipping,
DDP / FSDP2 (2 gloo processes) == one process, resume == one run, non-finite -> nothing written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file

from grpo_pipeline import policy, schemas, train_state
from grpo_pipeline.checkpoint import load_model, load_tokenizer, same_weights, save_checkpoint
from grpo_pipeline.config import UpdateConfig
from grpo_pipeline.distributed import DistContext, torchrun_command
from grpo_pipeline.losses import grpo_loss
from grpo_pipeline.policy import PolicyModule, collate, completion_logprobs
from grpo_pipeline.run import update as stage
from grpo_pipeline.update import NonFiniteError, Rollout, lr_lambda, micro_batches, train
from tests.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def one_thread():
    """The machine is shared: one intra-op thread is much faster than oversubscribed ones."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rand_rollouts(n, *, seed=0, vocab=500, per_token=False, adv=None, groups=False):
    """``groups``: rows p{k}/0..3 share their prompt, as a GRPO group does (the shared-prompt forward)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        if not (groups and i % 4):
            p = torch.randint(3, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        c = torch.randint(3, vocab, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        a = torch.randn(len(c) if per_token else 1, generator=g).tolist()
        out.append(Rollout(p, c, (a if per_token else a[0]) if adv is None else adv, f"p{i // 4}/{i % 4}"))
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, tiny_model):
    """An 'sft' policy checkpoint (with pipeline metadata) and a differently seeded reference."""
    root = tmp_path_factory.mktemp("ckpts")
    save_checkpoint(load_model(tiny_model), load_tokenizer(tiny_model), root / "sft", metadata={"stage": "sft"})
    ref = build_tiny_model(root / "ref", seed=1)
    return {"policy": str(root / "sft"), "reference": str(ref)}


def write_stage_inputs(d: Path, rows: list[Rollout], iteration="it0") -> tuple[str, str]:
    """Rollouts and advantages Parquet as the sample and advantage stages write them."""
    ro, ad = [], []
    for r in rows:
        pid, k = r.key.split("/")
        ro.append({"iteration": iteration, "prompt_id": pid, "sample_idx": int(k), "question": "q", "answer": "1",
                   "operation": None, "prompt": "p", "prompt_token_ids": r.prompt_ids, "completion": "c",
                   "completion_token_ids": r.completion_ids,
                   "completion_logprobs": r.sampler_logprobs or [0.0] * len(r.completion_ids),
                   "completion_token_ends": list(range(1, len(r.completion_ids) + 1)),
                   "finish_reason": "stop", "prompt_len": len(r.prompt_ids), "completion_len": len(r.completion_ids),
                   "policy": "x"})
        ad.append({"iteration": iteration, "prompt_id": pid, "sample_idx": int(k), "advantage": r.advantage,
                   "adv_mask": True})
    schemas.write_table(pl.DataFrame(ro, schema_overrides={"sample_idx": pl.Int32, "operation": pl.Utf8}),
                        d / "rollouts" / "part-00000.parquet", "rollouts", metadata={"sampling": {"max_new_tokens": 8}})
    step = pl.List(pl.Struct({"end": pl.Int32, "value": pl.Float64}))
    adv = pl.DataFrame(ad, schema_overrides={"sample_idx": pl.Int32}).with_columns(step_advantages=pl.lit(None, step))
    schemas.write_table(adv, d / "adv.parquet", "advantages")
    return str(d / "rollouts"), str(d / "adv.parquet")


def weights(path) -> dict[str, torch.Tensor]:
    return load_file(Path(path) / "model.safetensors")


# --------------------------------------------------------------------------- the objective through the model
def seq_logprobs(model, r: Rollout) -> torch.Tensor:
    """Straightforward: one unpadded sequence, the full logits, float32 log-softmax. (T,)"""
    ids = torch.tensor([r.prompt_ids + r.completion_ids])
    logits = model(ids).logits[0, len(r.prompt_ids) - 1: -1].float()            # (T, V)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.completion_ids)[:, None])[:, 0]


# d KL_k / d logp_theta, the KL term's weight on grad log pi (logp, logp_ref detached)
KL_GRAD = {"k1": lambda lp, ref: torch.ones_like(lp), "k2": lambda lp, ref: lp - ref,
           "k3": lambda lp, ref: 1.0 - torch.exp(ref - lp)}


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
@pytest.mark.parametrize("per_token", [False, True])
def test_mu_one_first_step_is_the_policy_gradient_plus_kl(tiny_model, ckpts, est, per_token):
    rows = rand_rollouts(6, seed=3, per_token=per_token)
    model, ref = load_model(tiny_model), load_model(ckpts["reference"]).eval()
    before = {k: v.clone() for k, v in model.named_parameters()}
    cfg = UpdateConfig(lr=1.0, beta=0.1, kl_estimator=est, mu=1, minibatch_size=6, micro_batch_size=2,
                       max_grad_norm=1e9)
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)        # theta_after = theta - grad
    hist, _ = train(model, rows, cfg, pad_id=0, ref_model=ref, optimizer=sgd)
    assert len(hist) == 1 and hist[0]["ratio_min"] == 1.0 and hist[0]["ratio_max"] == 1.0
    assert hist[0]["clip_frac_low"] == 0 and hist[0]["clip_frac_high"] == 0

    # spec 2: grad J = 1/G sum_i 1/|o_i| sum_t (A_it - beta dKL/dlogp) grad log pi(o_it); the loss is -J
    fresh = load_model(tiny_model)
    total = 0.0
    for r in rows:
        lp = seq_logprobs(fresh, r)
        with torch.no_grad():
            lp_ref = seq_logprobs(ref, r)
        a = torch.tensor(r.advantage) if per_token else torch.full_like(lp, r.advantage)
        w = (a - cfg.beta * KL_GRAD[est](lp.detach(), lp_ref)).detach()
        total = total - (w * lp).sum() / len(r.completion_ids) / len(rows)
    total.backward()
    for name, p in fresh.named_parameters():
        torch.testing.assert_close(before[name] - dict(model.named_parameters())[name], p.grad,
                                   rtol=2e-4, atol=2e-6, msg=name)


def test_clipped_tokens_give_no_gradient_through_the_model(tiny_model):
    rows = rand_rollouts(5, seed=4)
    b = collate([r.prompt_ids for r in rows], [r.completion_ids for r in rows], pad_id=0)
    g = torch.Generator().manual_seed(0)
    shift = torch.tensor([-0.5, 0.0, 0.5])[torch.randint(0, 3, b.completion_ids.shape, generator=g)]  # (B, C)
    adv = torch.tensor([r.advantage for r in rows])
    grads = []
    for only_unclipped in (False, True):
        model = load_model(tiny_model)
        logp, _ = completion_logprobs(PolicyModule(model, chunk_size=4), b)
        old = logp.detach() - shift                                            # r = exp(shift)
        if only_unclipped:   # independent: -1/G sum_i 1/|o_i| sum over tokens the min does not clip of r A
            r = torch.exp(logp - old)
            keep = b.completion_mask.bool() & ~(((r > 1.2) & (adv[:, None] > 0)) | ((r < 0.8) & (adv[:, None] < 0)))
            assert 0 < keep.sum() < b.completion_mask.sum()
            loss = -((r * adv[:, None] * keep).sum(-1) / b.completion_mask.sum(-1)).mean()
        else:
            loss, m = grpo_loss(logp, old, adv, b.completion_mask, beta=0.0, eps_low=0.2, kl_estimator="k3",
                                 aggregation="seq_mean_token_mean", loss="grpo", importance_sampling_level="token",
                                 rollout_correction="none", rollout_correction_level="token",
                                 rollout_correction_cap=3.0)
            assert m["clip_frac_low"] + m["clip_frac_high"] > 0
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_chunked_head_equals_full_logits_values_and_gradients(tiny_model, monkeypatch):
    rows = rand_rollouts(4, seed=5)
    b = collate([r.prompt_ids for r in rows], [r.completion_ids for r in rows], pad_id=0)
    out = []
    for plain in (True, False):
        monkeypatch.setattr(policy, "_plain_linear_head", lambda m, plain=plain: plain)
        model = load_model(tiny_model)
        lp, ent = policy.model_logprobs(model, b, chunk_size=3, with_entropy=True)
        (lp * torch.arange(1.0, 5.0)[:, None]).sum().backward()
        out.append((lp.detach(), ent, torch.cat([p.grad.flatten() for p in model.parameters()])))
    for x, y in zip(*out):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)   # float32 sums in another order


@pytest.mark.parametrize("kw", [{"gradient_checkpointing": True}, {"gradient_checkpointing": "selective"},
                                {"dtype": "bfloat16"}, {"dtype": "bfloat16", "gradient_checkpointing": True},
                                {"dtype": "bfloat16", "gradient_checkpointing": "selective"}])
def test_bf16_and_gradient_checkpointing_train(tiny_model, kw):
    rows = rand_rollouts(8, seed=6, groups=True)   # groups share prompts: the two-pass forward, replayed
    cfg = UpdateConfig(lr=1e-3, beta=0.0, mu=2, minibatch_size=4, micro_batch_size=2)
    base = load_model(tiny_model)
    ref_hist, _ = train(base, rows, cfg, pad_id=0)
    model = load_model(tiny_model)
    hist, _ = train(model, rows, cfg.model_copy(update=kw), pad_id=0)
    assert len(hist) == 4 and all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)
    if "dtype" in kw:   # bf16 forward: close to float32, not equal
        assert hist[0]["loss"] == pytest.approx(ref_hist[0]["loss"], rel=0.05, abs=1e-3)
        assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), base.parameters()))
    else:               # recomputation changes nothing
        for p, q in zip(model.parameters(), base.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- sharding and schedule
@given(n=st.integers(1, 40), world=st.integers(1, 4), size=st.integers(1, 5))
def test_micro_batches_partition_the_rows_with_equal_counts(n, world, size):
    rows = list(range(100, 100 + n))
    plans = [micro_batches(rows, DistContext(rank=r, world_size=world), size) for r in range(world)]
    active = [i for plan in plans for idx, on in plan if on for i in idx]
    assert sorted(active) == rows                                       # disjoint and complete
    assert len({len(plan) for plan in plans}) == 1                      # same forwards on every rank
    assert all(0 < len(idx) <= size for plan in plans for idx, _ in plan)


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_lr_schedule_continues_over_iterations(schedule):
    cfg = UpdateConfig(lr_schedule=schedule, warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    whole = [lr_lambda(cfg, 0)(s) for s in range(12)]
    split = [lr_lambda(cfg, 0)(s) for s in range(5)] + [lr_lambda(cfg, 5)(s) for s in range(7)]
    assert whole == split and whole[:2] == [0.5, 1.0]
    assert whole[-1] == (1.0 if schedule == "constant" else pytest.approx(0.1))


def test_config_and_launcher_errors():
    with pytest.raises(ValueError, match="total_steps"):
        UpdateConfig(lr_schedule="cosine")
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        UpdateConfig(lora=None, distributed={"strategy": "fsdp", "nnodes": 2})
    d = UpdateConfig(distributed={"strategy": "ddp", "nproc_per_node": 4, "nnodes": 2,
                                  "rdzv_endpoint": "h:29500"}).distributed
    cmd = torchrun_command(d, "stages/update.py", ["--out", "x"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--nnodes=2" in cmd and "--rdzv-endpoint=h:29500" in cmd
    assert cmd[-3:] == ["stages/update.py", "--out", "x"]


# --------------------------------------------------------------------------- the stage
UPD = {"lr": 1e-3, "beta": 0.1, "mu": 2, "minibatch_size": 6, "micro_batch_size": 2, "lora": None}  # full FT


def stage_run(cfg: UpdateConfig, ckpts, data, out: Path, *, policy=None):
    return stage.run(cfg, policy=policy or ckpts["policy"], reference=ckpts["reference"], rollouts=data[0],
                     advantages=data[1], out=str(out), metrics_path=str(out) + ".json",
                     steps_path=str(out) + ".steps.json")


@pytest.mark.parametrize(("strategy", "checkpointing"),
                         [("fsdp", False), ("ddp", False), ("fsdp", True), ("fsdp", "selective")])
def test_two_gloo_processes_match_one_process(tmp_path, ckpts, strategy, checkpointing):
    """Groups share prompts: under FSDP the ranks agree per micro-batch on the shared-prompt forward
    (else their layer all-gathers would not pair up), with gradient checkpointing too."""
    data = write_stage_inputs(tmp_path, rand_rollouts(11, seed=7, groups=True))  # ragged shards, a dummy row
    upd = {**UPD, "gradient_checkpointing": checkpointing}
    single = stage_run(UpdateConfig(**upd), ckpts, data, tmp_path / "single")
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"update": {**upd, "distributed": {"strategy": strategy, "nproc_per_node": 2}}}))
    out = tmp_path / "multi"
    r = subprocess.run([sys.executable, str(ROOT / "stages/update.py"), "--params", str(params), "--policy",
                        ckpts["policy"], "--reference", ckpts["reference"], "--rollouts", data[0], "--advantages",
                        data[1], "--out", str(out), "--metrics", f"{out}.json", "--steps", f"{out}.steps.json"],
                       check=False, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    multi = json.loads(Path(f"{out}.json").read_text())
    assert multi["world_size"] == 2 and single["world_size"] == 1
    w0, w1, w2 = weights(ckpts["policy"]), weights(tmp_path / "single"), weights(out)
    assert sorted(w1) == sorted(w2)
    moved = max(float((w1[k] - w0[k]).abs().max()) for k in w1)
    assert moved > 1e-3
    # AdamW's first steps move each weight by ~lr * g / (|g| + eps): for the few weights whose gradient is ~eps,
    # float32 summation order (gloo's all-reduce vs one process's sum) shifts the step by up to ~1e-5 of
    # 4e-3 moved; a wrong normaliser shows in grad_norm below (Adam itself is scale-invariant).
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=5e-5, msg=k)
    # per-step metrics are global: same loss, KL, clip shares and (normaliser-sensitive) gradient norm
    s1, s2 = (json.loads(Path(f"{p}.steps.json").read_text()) for p in (tmp_path / "single", out))
    for a, b in zip(s1, s2, strict=True):
        for key in ("loss", "policy_loss", "kl", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min",
                    "ratio_max", "entropy", "grad_norm", "tokens"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    o1, o2 = (torch.load(tmp_path / s / train_state.STATE_DIR / train_state.STATE_FILE, weights_only=True)
              for s in ("single", "multi"))
    assert o1["state"].keys() == o2["state"].keys()
    name = "lm.model.layers.0.mlp.up_proj.weight"
    torch.testing.assert_close(o2["state"][name]["exp_avg"], o1["state"][name]["exp_avg"], rtol=1e-3, atol=1e-7)


def test_resume_equals_two_updates_in_one_run(tmp_path, ckpts):
    cfg = UpdateConfig(**{**UPD, "lr_schedule": "cosine", "warmup_steps": 1, "total_steps": 8})
    rows_a, rows_b = rand_rollouts(10, seed=8, groups=True), rand_rollouts(9, seed=9, groups=True)
    da = write_stage_inputs(tmp_path / "a", rows_a)
    db = write_stage_inputs(tmp_path / "b", rows_b, iteration="it1")
    m1 = stage_run(cfg, ckpts, da, tmp_path / "it1")
    m2 = stage_run(cfg, ckpts, db, tmp_path / "it2", policy=str(tmp_path / "it1"))
    assert (m1["optimizer_state"], m2["optimizer_state"]) == ("fresh", "resumed")
    assert json.loads((tmp_path / "it2" / "grpo_pipeline.json").read_text())["train_state"]["global_step"] == 8
    steps = json.loads(Path(f"{tmp_path / 'it2'}.steps.json").read_text())
    assert [s["step"] for s in steps] == [4, 5, 6, 7]
    assert all(0 <= s["clip_frac_low"] <= 1 and s["ratio_min"] <= s["ratio_mean"] <= s["ratio_max"] for s in steps)
    assert all(s["tokens_per_s"] > 0 and s["peak_memory_mb"] > 0 for s in steps)

    # the same two updates in one process, one optimizer
    model, ref = load_model(ckpts["policy"]), load_model(ckpts["reference"]).eval()
    h1, opt = train(model, rows_a, cfg, pad_id=0, ref_model=ref, max_tokens=8)
    train(model, rows_b, cfg, pad_id=0, ref_model=ref, optimizer=opt, start_step=len(h1), max_tokens=8)
    w2 = weights(tmp_path / "it2")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(w2[k], v, rtol=0, atol=1e-7, msg=k)

    # the state travels inside the checkpoint: re-running update@it1 after it2 exists resumes the same moments
    m2b = stage_run(cfg, ckpts, db, tmp_path / "it2b", policy=str(tmp_path / "it1"))
    assert m2b["optimizer_state"] == "resumed"
    assert all(torch.equal(w2[k], v) for k, v in weights(tmp_path / "it2b").items())

    # fresh moments give another result and store none
    m3 = stage_run(cfg.model_copy(update={"optimizer_state": "fresh"}), ckpts, db, tmp_path / "it2f",
                   policy=str(tmp_path / "it1"))
    assert m3["optimizer_state"] == "fresh" and not (tmp_path / "it2f" / train_state.STATE_DIR).exists()
    assert any(not torch.equal(w2[k], v) for k, v in weights(tmp_path / "it2f").items())

    # moments paired with other weights are an error naming the file, never a silent fresh start
    (tmp_path / "it1" / "model.safetensors").write_bytes((tmp_path / "it2" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="it1/optimizer/manifest.json: the optimizer state belongs to other"):
        train_state.load_state(tmp_path / "it1")


def test_a_reference_with_the_policys_weights_is_pi_old_without_a_pass(tmp_path, ckpts):
    """Iteration 0 starts from the SFT model that is also the reference: same weights, so logp_ref = logp_old
    and the stage loads and runs no reference; the update equals one that runs the reference pass."""
    copy = tmp_path / "sft_copy"                       # the same weights in another directory
    shutil.copytree(ckpts["policy"], copy)
    cfg = UpdateConfig(**UPD)                          # mu 2, 2 minibatches: later steps use pi_old's pass
    rows = rand_rollouts(10, seed=3, groups=True)
    data = write_stage_inputs(tmp_path / "d", rows)
    shared = stage.run(cfg, policy=ckpts["policy"], reference=str(copy), rollouts=data[0], advantages=data[1],
                       out=str(tmp_path / "shared"), metrics_path=None, steps_path=str(tmp_path / "shared.steps.json"))
    assert shared["reference_logprobs"] == "pi_old"
    assert shared.get("time/reference_s", 0.0) == 0.0 and shared.get("time/load_reference_s", 0.0) == 0.0
    steps = json.loads((tmp_path / "shared.steps.json").read_text())
    assert steps[0]["kl"] == 0.0 and steps[-1]["kl"] > 0.0   # the policy moves away from pi_ref = pi_old

    model, ref = load_model(ckpts["policy"]), load_model(str(copy)).eval()   # the reference pass, in process
    hist, _ = train(model, rows, cfg, pad_id=0, ref_model=ref, max_tokens=8)
    for a, b in zip(steps, hist, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)       # steps.json rounds to 6 decimals
        assert a["kl"] == pytest.approx(b["kl"], abs=1e-6)
    w = weights(tmp_path / "shared")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(w[k], v, rtol=0, atol=1e-6, msg=k)

    other = stage_run(cfg, ckpts, data, tmp_path / "other")    # a differently seeded reference: its pass runs
    assert other["reference_logprobs"] == "reference pass" and other["time/reference_s"] > 0


def test_same_weights_compares_the_weight_bytes(tmp_path, ckpts):
    a = Path(ckpts["policy"])
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert same_weights(a, a) and same_weights(a, b)
    assert not same_weights(a, ckpts["reference"])
    st_file = b / "model.safetensors"
    data = bytearray(st_file.read_bytes())
    data[-1] ^= 1                                      # one bit of the last tensor
    st_file.write_bytes(bytes(data))
    assert not same_weights(a, b, chunk_size=4096)
    (b / "model.safetensors").unlink()
    assert not same_weights(a, b)                      # no weights at all


@pytest.mark.parametrize(("adv", "match"), [(float("nan"), "non-finite loss"), (1e30, "non-finite gradient")])
def test_non_finite_stops_and_writes_nothing(tmp_path, ckpts, adv, match):
    data = write_stage_inputs(tmp_path, rand_rollouts(6, seed=10, adv=adv))
    out = tmp_path / "next"
    with pytest.raises(NonFiniteError, match=match):
        stage_run(UpdateConfig(**UPD), ckpts, data, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adv.parquet", "rollouts"]


def test_update_max_tokens_wins_over_the_samplers_budget(tmp_path, ckpts):
    """Dr. GRPO's constant: update.max_tokens when set, else the rollouts' max_new_tokens (8 here).

    First step, ratio 1, beta 0: loss = -1/G sum_i A_i |o_i| / L, so L = 16 halves the loss of L = 8."""
    rows = rand_rollouts(4, seed=5)
    data = write_stage_inputs(tmp_path, rows)
    base = {"aggregation": "seq_mean_token_sum_norm", "beta": 0.0, "minibatch_size": 4, "micro_batch_size": 4}
    loss = {}
    for max_tokens in (None, 16):
        stage_run(UpdateConfig(**base, max_tokens=max_tokens), ckpts, data, tmp_path / f"out{max_tokens}")
        loss[max_tokens] = json.loads((tmp_path / f"out{max_tokens}.steps.json").read_text())[0]["loss"]
    want = -sum(r.advantage * len(r.completion_ids) for r in rows) / 4
    assert loss[None] == pytest.approx(want / 8, rel=1e-5) and loss[16] == pytest.approx(want / 16, rel=1e-5)


def test_update_attention_leaves_out_cudnn_on_a_gpu_only():
    """cuDNN attention returns NaN dQ for the fully masked rows of left-padded prompts (pytorch#196678): the
    update's forward excludes it on CUDA. No GPU here, so this checks the boundary: the backend flags torch
    reads when it picks a kernel, inside and after the context, and that CPU is left alone."""
    from grpo_pipeline.policy import attention_kernels

    before = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled())
    with attention_kernels(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before[0]
    with attention_kernels(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()) == before
