"""Group sampling (grpo_pipeline/sampling.py, run/sample.py) on a tiny random Llama served by real vLLM.

One vLLM engine for the whole session (conftest ``tiny_vllm``). The tiny model's next-token
distribution is near uniform, so stop-string tests stop on a space, which most of its tokens hold.
"""

from __future__ import annotations

import itertools
import math
import shutil
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_pipeline import sampling, schemas
from grpo_pipeline.config import SamplingConfig
from grpo_pipeline.data import generate_problems
from grpo_pipeline.run import sample as stage
from grpo_pipeline.sampling import (
    HFBackend,
    Request,
    SamplingSpec,
    cut_after_stop,
    filter_logits,
    request_seed,
)

N_PROMPTS, G = 6, 4


def problems(n: int, seed: int = 0) -> pl.DataFrame:
    """Math prompts with every column of the prompts schema (the coding ones null)."""
    df = generate_problems(n=n, seed=seed)
    return df.with_columns([pl.lit(None).alias(c) for c in schemas.schema("prompts").names if c not in df.columns])


def cfg(**kw) -> SamplingConfig:
    base = {"prompts_per_iteration": N_PROMPTS, "spare_prompts": 0, "group_size": G, "max_new_tokens": 16, "dtype": "float32",
            "max_model_len": 512, "stop": [" "], "batch_prompts": 4, "kv_cache_gib": 0.25, "hf_batch_size": G}
    return SamplingConfig(**{**base, **kw})


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny model is fastest on one thread (the in-process vLLM engine and HF share it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("prompts") / "train.parquet"
    schemas.write_table(problems(12), path, "prompts")
    return str(path)


@pytest.fixture(scope="module")
def tiny_hf(tiny_model) -> HFBackend:
    return HFBackend(tiny_model, dtype="float32", hf_batch_size=G)


@pytest.fixture(scope="module")
def tok(tiny_hf):
    return tiny_hf.tokenizer


def sample_run(tmp_path, tiny_model, prompts_file, backend, name="it0", **kw) -> tuple[pl.DataFrame, Path, dict]:
    out = tmp_path / name
    metrics = stage.run(cfg(backend=backend.name, **kw), iteration="it0", index=0, policy=tiny_model,
                        prompts_path=prompts_file, out=str(out), metrics_path=str(tmp_path / f"{name}.json"),
                        backend=backend)
    return schemas.read_table(out, "rollouts"), out, metrics


def requests(tok, n: int = 4, seed: int = 0) -> list[Request]:
    qs = generate_problems(n=n, seed=1)["question"].to_list()
    return [Request(f"q{i}", tok(q, add_special_tokens=False)["input_ids"], request_seed(seed, "t", f"q{i}"))
            for i, q in enumerate(qs)]


def check_stop_rule(samples, spec: SamplingSpec, tok) -> None:
    """text == decode(ids) cut after the first stop string; stop <=> stop string or EOS; length <=> budget."""
    for s in samples:
        full = tok.decode(s.token_ids, skip_special_tokens=True)
        text, stopped = cut_after_stop(full, spec.stop)
        assert s.text == text
        eos = s.token_ids[-1] == tok.eos_token_id
        if s.finish_reason == "stop":
            assert stopped or eos
            if stopped:  # the stop string ended generation: no earlier stop, kept at the end
                assert any(s.text.endswith(x) for x in spec.stop)
                assert not cut_after_stop(tok.decode(s.token_ids[:-1], skip_special_tokens=True), spec.stop)[1]
        else:
            assert s.finish_reason == "length" and len(s.token_ids) == spec.max_new_tokens
            assert not stopped and not eos


# --------------------------------------------------------------------------- the stage on vLLM
@pytest.mark.vllm
def test_stage_rows_schema_metadata_and_decoding(tiny_vllm, tiny_model, prompts_file, tok, tmp_path, capsys):
    ro, out, metrics = sample_run(tmp_path, tiny_model, prompts_file, tiny_vllm)
    assert sorted(p.name for p in out.iterdir()) == ["part-00000.parquet"]
    assert ro.height == N_PROMPTS * G and ro["prompt_id"].n_unique() == N_PROMPTS
    idx = ro.group_by("prompt_id").agg(pl.col("sample_idx").sort())["sample_idx"].to_list()
    assert idx == [list(range(G))] * N_PROMPTS
    pf = pq.ParquetFile(out / "part-00000.parquet")
    want = schemas.schema("rollouts")
    assert pf.schema_arrow.names == want.names and pf.schema_arrow.types == want.types
    assert pf.num_row_groups == math.ceil(N_PROMPTS / 4)  # one row group per engine call
    assert pf.metadata.row_group(0).column(0).compression == "ZSTD"
    meta = schemas.read_metadata(out, "rollouts")
    assert meta["spec"]["top_k"] == 0 and meta["spec"]["stop"] == [" "] and meta["sampling"]["max_new_tokens"] == 16
    assert meta["backend"] == "vllm" and meta["vllm"] and meta["torch"] and "seed_rule" in meta
    for r in ro.iter_rows(named=True):
        assert r["prompt_token_ids"] == tok(r["prompt"], add_special_tokens=False)["input_ids"]
        assert r["prompt_len"] == len(r["prompt_token_ids"]) and r["completion_len"] == len(r["completion_token_ids"])
        full = tok.decode(r["completion_token_ids"], skip_special_tokens=True)
        assert cut_after_stop(full, [" "])[0] == r["completion"]
        lps = r["completion_logprobs"]
        assert len(lps) == r["completion_len"] and all(math.isfinite(v) and v <= 0 for v in lps)
        assert r["policy"] == tiny_model and r["iteration"] == "it0"
        ids, ends = r["completion_token_ids"], r["completion_token_ends"]  # chars complete after each token
        want = [min(len(tok.decode(ids[: t + 1], skip_special_tokens=True).rstrip("\ufffd")), len(r["completion"]))
                for t in range(len(ids))]
        assert ends == want
    printed = capsys.readouterr().out
    for key in ("completion_tokens_per_s", "completion_len_mean", "completion_len_max", "truncated_share",
                "engine_startup_s", "sample_s", "write_s"):
        assert key in metrics and f" {key}=" in printed  # DVC metrics and the summary line
    assert metrics["sample_s"] > 0 and metrics["write_s"] > 0
    assert metrics["completions"] == ro.height and metrics["completion_len_max"] == ro["completion_len"].max()
    assert metrics["truncated_share"] == pytest.approx((ro["finish_reason"] == "length").mean(), abs=1e-4)
    assert (tmp_path / "it0.json").is_file()


@pytest.mark.vllm
def test_same_seed_same_rollouts_other_seed_differs(tiny_vllm, tiny_model, prompts_file, tok, tmp_path):
    cols = ["prompt_id", "sample_idx", "completion_token_ids", "completion", "finish_reason"]
    a = sample_run(tmp_path, tiny_model, prompts_file, tiny_vllm, "a", batch_prompts=4)[0]
    b = sample_run(tmp_path, tiny_model, prompts_file, tiny_vllm, "b", batch_prompts=4)[0]
    assert a.equals(b)  # a rerun: identical, log-probs included
    c = sample_run(tmp_path, tiny_model, prompts_file, tiny_vllm, "c", batch_prompts=6)[0]
    assert a.select(cols).equals(c.select(cols))  # other batching: same tokens (log-probs within float noise)
    for u, v in zip(a["completion_logprobs"].to_list(), c["completion_logprobs"].to_list()):
        assert u == pytest.approx(v, abs=1e-4)
    spec = SamplingSpec(n=G, max_new_tokens=8, stop=())
    x, y = (tiny_vllm.generate(requests(tok, 4, seed=seed), spec) for seed in (0, 1))
    assert all(u.token_ids != v.token_ids for g, h in zip(x, y) for u, v in zip(g, h))  # other seed, other rows
    groups = a.group_by("prompt_id").agg(pl.col("completion_token_ids").n_unique().alias("u"))
    assert (groups["u"] > 1).all()  # the G completions of a group differ


@pytest.mark.vllm
@pytest.mark.parametrize("stop", [(), (" ",), ("e", "a", "1")], ids=["none", "space", "several"])
def test_finish_reasons_vllm(tiny_vllm, tok, stop):
    spec = SamplingSpec(n=4, max_new_tokens=12, stop=stop)
    samples = [s for g in tiny_vllm.generate(requests(tok, 6), spec) for s in g]
    check_stop_rule(samples, spec, tok)
    reasons = [s.finish_reason for s in samples]
    assert reasons.count("length" if not stop else "stop") > len(reasons) // 2


@pytest.mark.vllm
def test_eager_engine_runs_vllms_compiled_sampler_helpers_eagerly(tiny_vllm, tok, monkeypatch):
    """enforce_eager, in process: vLLM's ``torch.compile``-decorated log-prob rank count runs under the
    ``force_eager`` stance (inductor compiled it inside the first ``generate`` of every stage process: 2-3 s)."""
    import torch._dynamo.eval_frame as ef
    import vllm.v1.sample.sampler as vsampler

    assert tiny_vllm._eager
    stances = []
    real = vsampler.batched_count_greater_than

    def spy(*a, **k):
        stances.append(ef._stance.stance)
        return real(*a, **k)

    monkeypatch.setattr(vsampler, "batched_count_greater_than", spy)
    tiny_vllm.generate(requests(tok, 3), SamplingSpec(n=2, max_new_tokens=4))
    assert stances and set(stances) == {"force_eager"}
    assert ef._stance.stance == "default"          # only around generate


def teacher_logits(model, req: Request, token_ids: list[int]) -> torch.Tensor:
    """(T, V) raw logits the model gives each sampled token's position."""
    ids = torch.tensor([req.prompt_token_ids + token_ids])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()                  # (P + T, V)
    return logits[len(req.prompt_token_ids) - 1: -1]


FILTERS = {  # name: (spec overrides, does token t pass at logits row l)
    "top_k": ({"top_k": 3}, lambda l, t: l[t] >= torch.topk(l, 3).values[-1] - 1e-4),
    "min_p": ({"min_p": 0.97}, lambda l, t: l.softmax(-1)[t] >= 0.97 * l.softmax(-1).max() - 1e-5),
    "top_p": ({"top_p": 0.01}, lambda l, t: (l.softmax(-1) * (l > l[t] + 1e-4)).sum() <= 0.01 + 1e-5),
}


@pytest.mark.vllm
@pytest.mark.parametrize("backend", ["vllm", "hf"])
@pytest.mark.parametrize("name", list(FILTERS))
def test_filters_pass_through(backend, name, tiny_vllm, tiny_hf, tok):
    kw, passes = FILTERS[name]
    engine = tiny_vllm if backend == "vllm" else tiny_hf
    reqs = requests(tok, 2)
    violations = {}
    for label, spec in (("on", SamplingSpec(n=3, max_new_tokens=8, stop=(), **kw)),
                        ("off", SamplingSpec(n=3, max_new_tokens=8, stop=()))):
        bad = 0
        for req, group in zip(reqs, engine.generate(reqs, spec)):
            for s in group:
                logits = teacher_logits(tiny_hf.model, req, s.token_ids)
                bad += sum(not passes(l, t) for l, t in zip(logits, s.token_ids))
        violations[label] = bad
    assert violations["on"] == 0 and violations["off"] > 0  # the check could fail without the filter


@pytest.mark.vllm
def test_hf_backend_same_schema_stop_rule_and_greedy(tiny_vllm, tiny_hf, tiny_model, prompts_file, tok, tmp_path):
    ro_v, out_v, _ = sample_run(tmp_path, tiny_model, prompts_file, tiny_vllm, "v")
    ro_h, out_h, _ = sample_run(tmp_path, tiny_model, prompts_file, tiny_hf, "h")
    assert pq.read_schema(out_h / "part-00000.parquet").remove_metadata() == \
        pq.read_schema(out_v / "part-00000.parquet").remove_metadata()
    assert ro_h.height == ro_v.height and schemas.read_metadata(out_h, "rollouts")["backend"] == "hf"
    for spec in (SamplingSpec(n=4, max_new_tokens=12, stop=(" ",)), SamplingSpec(n=2, max_new_tokens=6, stop=())):
        check_stop_rule([s for g in tiny_hf.generate(requests(tok, 3), spec) for s in g], spec, tok)
    greedy = SamplingSpec(n=1, temperature=0, max_new_tokens=10, stop=())
    reqs = requests(tok, 3)
    for gv, gh in zip(tiny_vllm.generate(reqs, greedy), tiny_hf.generate(reqs, greedy)):
        assert gv[0].token_ids == gh[0].token_ids
        assert gv[0].logprobs == pytest.approx(gh[0].logprobs, abs=1e-3)


def test_hf_seeds_reproduce_and_do_not_depend_on_batching(tiny_hf, tok):
    spec = SamplingSpec(n=G, max_new_tokens=8, stop=())
    reqs = requests(tok, 3)
    try:
        tiny_hf.batch_size = 3 * G  # three prompts of different lengths, left-padded in one batch
        together = tiny_hf.generate(reqs, spec)
        tiny_hf.batch_size = 2
        apart = [tiny_hf.generate([r], spec)[0] for r in reversed(reqs)][::-1]
    finally:
        tiny_hf.batch_size = G
    assert [[s.token_ids for s in g] for g in together] == [[s.token_ids for s in g] for g in apart]
    other = tiny_hf.generate(requests(tok, 3, seed=1), spec)
    assert all(u.token_ids != v.token_ids for g, h in zip(together, other) for u, v in zip(g, h))


def test_data_parallel_workers_write_shards_equal_to_one_worker(tiny_hf, tiny_model, prompts_file, tmp_path):
    outs = {dp: tmp_path / f"dp{dp}" for dp in (1, 2)}
    stage.run(cfg(backend="hf"), iteration="it0", index=0, policy=tiny_model, prompts_path=prompts_file,
              out=str(outs[1]), metrics_path=None, backend=tiny_hf)
    metrics = stage.run(cfg(backend="hf", data_parallel_size=2), iteration="it0", index=0, policy=tiny_model,
                        prompts_path=prompts_file, out=str(outs[2]), metrics_path=None)  # two spawned workers
    assert metrics["workers"] == 2 and metrics["completions"] == N_PROMPTS * G
    assert sorted(p.name for p in outs[2].iterdir()) == ["part-00000.parquet", "part-00001.parquet"]
    assert [schemas.read_metadata(f, "rollouts")["shard"] for f in sorted(outs[2].iterdir())] == [0, 1]
    one, two = schemas.read_table(outs[1], "rollouts"), schemas.read_table(outs[2], "rollouts")
    # per-request seeds: the rows do not depend on the number of workers (log-probs up to float noise:
    # an in-process vLLM engine, started earlier in this session, alters this process's CPU kernels)
    assert one.drop("completion_logprobs").equals(two.drop("completion_logprobs"))
    for u, v in zip(one["completion_logprobs"].to_list(), two["completion_logprobs"].to_list()):
        assert u == pytest.approx(v, abs=1e-4)
    assert pl.scan_parquet(outs[2] / "*.parquet").select(pl.len()).collect().item() == N_PROMPTS * G


def test_the_stage_loads_the_tokenizer_once(tiny_model, prompts_file, tmp_path, monkeypatch):
    """The stage's tokenizer (prompt rendering, the early missing-tokenizer check) is the engine's too."""
    from grpo_pipeline import checkpoint

    loads = []
    real = checkpoint.load_tokenizer

    def counting(path):
        loads.append(path)
        return real(path)

    monkeypatch.setattr(checkpoint, "load_tokenizer", counting)     # the engines import it at start-up
    monkeypatch.setattr(stage, "load_tokenizer", counting)
    metrics = stage.run(cfg(backend="hf"), iteration="it0", index=0, policy=tiny_model, prompts_path=prompts_file,
                        out=str(tmp_path / "it0"), metrics_path=None)
    assert metrics["completions"] == N_PROMPTS * G and loads == [tiny_model]


def test_a_failing_worker_fails_the_run_naming_it(tiny_model, prompts_file, tmp_path):
    broken = tmp_path / "no_weights"  # the tokenizer loads in the stage, the model fails in the workers
    shutil.copytree(tiny_model, broken, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(RuntimeError, match=r"sampling worker \d \(prompts \d+\.\.\d+\) failed .*no weights file"):
        stage.run(cfg(backend="hf", data_parallel_size=2), iteration="it0", index=0, policy=str(broken),
                  prompts_path=prompts_file, out=str(tmp_path / "o"), metrics_path=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no_weights"]  # no output, no temporary


# --------------------------------------------------------------------------- interruption, bad input
class Interrupting:
    """Delegates to a backend, raising KeyboardInterrupt on call ``at`` (a killed stage)."""

    name = "hf"

    def __init__(self, inner, at: int) -> None:
        self.inner, self.at, self.calls, self.startup_s = inner, at, 0, 0.0
        self.tokenizer = inner.tokenizer

    def versions(self):
        return self.inner.versions()

    def generate(self, reqs, spec):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.inner.generate(reqs, spec)

    def close(self):
        pass


def test_interrupted_run_leaves_no_output_and_rerun_is_clean(tiny_hf, tiny_model, prompts_file, tmp_path):
    with pytest.raises(KeyboardInterrupt):
        sample_run(tmp_path, tiny_model, prompts_file, Interrupting(tiny_hf, at=2))
    assert list(tmp_path.iterdir()) == []  # no final dir, no temporary left, no metrics
    stale = tmp_path / ".tmp-it0.killed"  # what a SIGKILLed run leaves
    stale.mkdir()
    (stale / "part-00000.parquet").write_bytes(b"PAR1 half written")
    ro, out, _ = sample_run(tmp_path, tiny_model, prompts_file, tiny_hf)
    assert ro.height == N_PROMPTS * G and not stale.exists()
    before = (out / "part-00000.parquet").read_bytes()
    with pytest.raises(KeyboardInterrupt):
        sample_run(tmp_path, tiny_model, prompts_file, Interrupting(tiny_hf, at=1))
    assert (out / "part-00000.parquet").read_bytes() == before  # the previous output survives
    assert sorted(p.name for p in tmp_path.iterdir()) == ["it0", "it0.json"]


def test_empty_prompt_file_is_an_error(tiny_hf, tiny_model, tmp_path):
    empty = tmp_path / "empty.parquet"
    schemas.write_table(problems(2).head(0), empty, "prompts")
    with pytest.raises(ValueError, match=r"empty\.parquet: the prompts file has no rows"):
        sample_run(tmp_path, tiny_model, str(empty), tiny_hf)


def test_prompt_longer_than_context_names_the_prompt(tiny_hf, tiny_model, tmp_path):
    df = problems(3).with_columns(question=pl.when(pl.col("prompt_id") == "syn-000001")
                         .then(pl.col("question") + " 12 + 7 = 19." * 200).otherwise(pl.col("question")))
    path = tmp_path / "long.parquet"
    schemas.write_table(df, path, "prompts")
    with pytest.raises(ValueError, match=r"prompt 'syn-000001' has \d+ tokens, more than the 448"):
        stage.run(cfg(backend="hf", prompts_per_iteration=3, max_model_len=512, max_new_tokens=64),
                  iteration="it0", index=0, policy=tiny_model, prompts_path=str(path), out=str(tmp_path / "o"),
                  metrics_path=None, backend=tiny_hf)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_checkpoint_without_tokenizer_is_a_clear_error(backend, tiny_model, prompts_file, tmp_path):
    if backend == "vllm":
        pytest.importorskip("vllm")
    broken = tmp_path / "no_tok"
    shutil.copytree(tiny_model, broken, ignore=shutil.ignore_patterns("tokenizer*"))
    c = cfg(backend=backend)
    with pytest.raises(FileNotFoundError, match=r"no_tok.* has no tokenizer config file"):
        stage.run(c, iteration="it0", index=0, policy=str(broken), prompts_path=prompts_file,
                  out=str(tmp_path / "o"), metrics_path=None)
    with pytest.raises(FileNotFoundError, match="tokenizer"):  # the backend alone checks before starting
        sampling.backend_for(c, str(broken))


# --------------------------------------------------------------------------- pure parts
@pytest.mark.parametrize("text,stop,want", [
    ("a b</answer> c", ("</answer>",), ("a b</answer>", True)),
    ("x y z", (" ", "y"), ("x ", True)),
    ("xyz", ("z", "y"), ("xy", True)),
    ("abc", (), ("abc", False)),
    ("abc", ("", "d"), ("abc", False)),
])
def test_cut_after_stop(text, stop, want):
    assert cut_after_stop(text, stop) == want


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), k=st.integers(1, 20), p=st.floats(0.05, 0.95), m=st.floats(0.0, 1.0),
       t=st.floats(0.3, 2.0))
def test_filter_logits_properties(seed, k, p, m, t):
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(seed)) * 3      # (B, V)
    for kw, check in (
        ({"top_k": k}, lambda keep, pr: (keep.sum(-1) == k).all()),
        ({"min_p": m}, lambda keep, pr: (keep == (pr >= m * pr.amax(-1, keepdim=True))).all()),
        ({"top_p": p}, lambda keep, pr: ((pr * keep).sum(-1) >= p - 1e-6).all()
         and (((pr * keep).sum(-1) - (pr + (~keep) * 9).amin(-1)) < p + 1e-6).all()),
    ):
        out = filter_logits(logits, temperature=t, **kw)
        keep = torch.isfinite(out)
        probs = (logits / t).softmax(-1)
        assert keep.gather(-1, logits.argmax(-1, keepdim=True)).all()  # the top token always survives
        assert check(keep, probs), kw
        assert torch.allclose(out[keep], (logits / t)[keep])


@given(seed=st.integers(0, 2**31 - 1), it=st.sampled_from(["it0", "it1", "eval/sft"]), pid=st.text(min_size=1))
def test_request_seed_stable_31_bit_and_sensitive(seed, it, pid):
    s = request_seed(seed, it, pid)
    assert 0 <= s < 2**31 and s == request_seed(seed, it, pid)
    others = {request_seed(seed + 1, it, pid), request_seed(seed, it + "x", pid), request_seed(seed, it, pid + "x")}
    assert len(others - {s}) >= 2  # a 31-bit hash: a collision with s is possible, two are not


@given(n=st.integers(0, 500), parts=st.integers(1, 9))
def test_shard_bounds_cover_in_order(n, parts):
    b = stage.shard_bounds(n, parts)
    assert len(b) == parts and b[0][0] == 0 and b[-1][1] == n
    assert all(hi == lo2 for (_, hi), (lo2, _) in itertools.pairwise(b))
    assert max(hi - lo for lo, hi in b) - min(hi - lo for lo, hi in b) <= 1


def test_greedy_group_and_bad_config_are_errors():
    with pytest.raises(ValueError, match="identical completions"):
        SamplingSpec(n=4, temperature=0)
    with pytest.raises(ValueError, match="temperature is 0"):
        SamplingConfig(temperature=0)
    with pytest.raises(ValueError, match="must be below sampling.max_model_len"):
        SamplingConfig(max_new_tokens=512, max_model_len=512)


def test_rollout_stats_merge_takes_slowest_worker():
    a, b = stage.RolloutStats(completions=4, completion_tokens=40, max_len=12, truncated=1, seconds=2.0), \
        stage.RolloutStats(completions=4, completion_tokens=20, max_len=9, truncated=3, seconds=1.0)
    a.merge(b)
    m = a.as_metrics()
    assert m["completion_tokens_per_s"] == 30.0 and m["completion_len_max"] == 12 and m["truncated_share"] == 0.5


def test_vllms_per_weight_narrowing_warning_is_dropped_and_nothing_else():
    """vLLM warns once per weight when a float32 checkpoint is served in bf16 (270 lines per sample stage for
    SmolLM2); the engine's log filter drops exactly those, from the logger that really emits them."""
    import logging

    import torch
    from vllm.model_executor.models import utils as vllm_utils

    from grpo_pipeline.sampling import _QUIET_NARROWING

    assert vllm_utils.logger.name == "vllm.model_executor.models.utils"
    msg = "Attempted to load weight %s with dtype %s into parameter with dtype %s"

    def record(m, args):
        return logging.LogRecord(vllm_utils.logger.name, logging.WARNING, __file__, 1, m, args, None)

    assert not _QUIET_NARROWING.filter(record(msg, ("lm_head.weight", torch.float32, torch.bfloat16)))
    assert _QUIET_NARROWING.filter(record(msg, ("lm_head.weight", torch.float64, torch.float32)))
    assert _QUIET_NARROWING.filter(record("Some other warning %s", ("x",)))
