"""Process supervision end to end: rollouts (token offsets recorded at sampling time) -> score -> advantage
(``estimator: process``) -> update, against an independent computation of every token's advantage.

The completions hold what broke the old character-to-token mapping: a special token inside a completion
(dropped from the text), Chinese characters the tiny byte-level tokenizer splits over several tokens, and
arithmetic claims right and wrong. The final answer is a step too, rewarded by accuracy.
"""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from grpo_pipeline import schemas
from grpo_pipeline.checkpoint import load_model, load_tokenizer, save_checkpoint
from grpo_pipeline.config import AdvantageConfig, RewardConfig, UpdateConfig
from grpo_pipeline.run import advantage as advantage_stage
from grpo_pipeline.run import sample as sample_stage
from grpo_pipeline.run import score as score_stage
from grpo_pipeline.run import update as update_stage
from grpo_pipeline.sampling import Request, Sample

GROUPS = {  # prompt_id: (answer, operation, completions)
    "p0": ("7", "add", [
        "<think>\n3 + 4 = 7\n小明有 3 个苹果。\n7 × 2 = 14\n</think><answer>7</answer>",
        "<think>\n3 + 4 = 8\n答案是 8 元。\n</think><answer>8</answer>",
        "<think>\n3 + 4 = 7\n</think><answer>7 元</answer>",
        "<think>\n5元÷3支=1.67元\n3 + 4 = 9\n</think><answer>9</answer>",
    ]),
    "p1": ("12", "mul", [  # every reasoning step right: only the answers differ
        "<think>\n3 * 4 = 12\n</think><answer>12</answer>",
        "<think>\n3 * 4 = 12\n</think><answer>13</answer>",
        "<think>\n3 * 4 = 12\n</think><answer>12</answer>",
        "<think>\n3 * 4 = 12\n</think><answer>21</answer>",
    ]),
}
DELTA = 1e-4


@pytest.fixture(scope="module")
def policy(tiny_model, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("process") / "sft"
    save_checkpoint(load_model(tiny_model), load_tokenizer(tiny_model), out, metadata={"stage": "sft"})
    return str(out)


def _rollouts(tok, out_dir) -> tuple[pl.DataFrame, list[list[int]]]:
    """The rollouts file as the sample stage writes it (its own ``rollout_frame``), and each row's token ids."""
    special = tok.convert_tokens_to_ids("<|im_start|>")
    prompts, requests, samples, all_ids = [], [], [], []
    for pid, (answer, op, texts) in GROUPS.items():
        prompts.append({"prompt_id": pid, "question": "q", "answer": answer, "operation": op})
        requests.append(Request(pid, tok.encode("q", add_special_tokens=False), seed=0))
        group = []
        for k, text in enumerate(texts):
            ids = tok.encode(text, add_special_tokens=False)
            if k % 2 == 0:  # a special token inside the completion: not in its text
                ids = ids[:6] + [special] + ids[6:]
            assert tok.decode(ids, skip_special_tokens=True) == text
            group.append(Sample(ids, text, [-1.0] * len(ids), "stop"))
            all_ids.append(ids)
        samples.append(group)
    frame = sample_stage.rollout_frame(pl.DataFrame(prompts), ["q"] * len(prompts), requests, samples,
                                       iteration="it0", policy="models/sft", tokenizer=tok)
    schemas.write_table(frame, out_dir / "part-00000.parquet", "rollouts", metadata={"sampling": {"max_new_tokens": 96}})
    return frame, all_ids


def _char_starts(tok, ids: list[int], text: str) -> np.ndarray:
    """Independent (quadratic) reference: characters of ``text`` complete before token t."""
    starts = [len(tok.decode(ids[:t], skip_special_tokens=True).rstrip("\ufffd")) for t in range(len(ids))]
    return np.minimum(np.array(starts), len(text))


def _expected_token_advantages(tok, frame: pl.DataFrame, ids: list[list[int]], scores: pl.DataFrame) -> list:
    """Per row, A_t = sum of the group-normalised step rewards (population std + delta) of the steps
    ending after token t's first character."""
    df = frame.join(scores.select("prompt_id", "sample_idx", "steps", "reward_accuracy"), on=["prompt_id", "sample_idx"])
    out = []
    for pid in GROUPS:
        rows = df.filter(pl.col("prompt_id") == pid).sort("sample_idx")
        rewards = np.array([s["reward"] for steps in rows["steps"] for s in steps if s["reward"] is not None])
        mean, std = rewards.mean(), rewards.std()
        for i, r in enumerate(rows.iter_rows(named=True)):
            starts = _char_starts(tok, ids[list(GROUPS).index(pid) * 4 + i], r["completion"])
            a = np.zeros(len(starts))
            for s in r["steps"]:
                if s["reward"] is not None:
                    a += ((s["reward"] - mean) / (std + DELTA)) * (s["end"] > starts)
            out.append(a)
    return out


def test_process_supervision_end_to_end_through_the_update_stage(policy, tmp_path):
    tok = load_tokenizer(policy)
    frame, ids = _rollouts(tok, tmp_path / "rollouts")
    score_stage.run(RewardConfig(), rollouts=str(tmp_path / "rollouts"), out=str(tmp_path / "scores.parquet"),
                    metrics_path=None)
    scores = schemas.read_table(tmp_path / "scores.parquet", "scores")
    for steps, acc, text in zip(scores["steps"], scores["reward_accuracy"], frame["completion"]):
        assert steps[-1] == {"start": text.index("<answer>"), "end": len(text), "reward": acc}  # the answer step
    advantage_stage.run(AdvantageConfig(estimator="process", delta=DELTA), scores=str(tmp_path / "scores.parquet"),
                        out=str(tmp_path / "adv.parquet"), metrics_path=None)
    want = _expected_token_advantages(tok, frame, ids, scores)

    rows, left_out, _ = update_stage.load_rollouts(str(tmp_path / "rollouts"), str(tmp_path / "adv.parquet"))
    assert left_out["masked"] == 0 and len(rows) == len(want)
    for r, w in zip(rows, want):
        np.testing.assert_allclose(r.advantage, w, rtol=0, atol=1e-12, err_msg=r.key)
    # a right answer earns advantage: in p1 every reasoning step is right, only the answers differ
    p1 = {r.key: r.advantage[0] for r in rows if r.key.startswith("p1/")}
    assert p1["p1/0"] > 0 and p1["p1/2"] > 0 and p1["p1/1"] < 0 and p1["p1/3"] < 0
    # the old mapping (decoding every prefix with the special tokens kept) gives other advantages
    old = [len(tok.decode(i[: t + 1], skip_special_tokens=False)) for i in ids[:1] for t in range(len(i))]
    assert old != frame["completion_token_ends"][0].to_list()

    # through the update stage: first step, ratio 1, beta 0, seq_mean_token_mean: loss = -mean_i mean_t A_it
    cfg = UpdateConfig(beta=0.0, minibatch_size=8, micro_batch_size=4, lr=1e-6)
    update_stage.run(cfg, policy=policy, reference=None, rollouts=str(tmp_path / "rollouts"),
                     advantages=str(tmp_path / "adv.parquet"), out=str(tmp_path / "it1"),
                     metrics_path=None, steps_path=str(tmp_path / "steps.json"))
    loss = json.loads((tmp_path / "steps.json").read_text())[0]["loss"]
    assert loss == pytest.approx(-np.mean([w.mean() for w in want]), rel=1e-5, abs=1e-7)


def test_token_char_ends_handle_special_tokens_and_split_characters(tiny_model):
    from grpo_pipeline.sampling import token_char_ends

    tok = load_tokenizer(tiny_model)
    text = "<think>\n5元÷3支=1.67元\n</think><answer>七</answer>"
    ids = tok.encode(text, add_special_tokens=False)
    ids = ids[:3] + [tok.convert_tokens_to_ids("<|im_end|>")] + ids[3:]
    ends = token_char_ends(tok, ids, text)
    assert ends == [len(tok.decode(ids[: t + 1], skip_special_tokens=True).rstrip("\ufffd")) for t in range(len(ids))]
    assert ends[3] == ends[2] and ends[-1] == len(text)                       # the special token adds nothing
    split = [t for t in range(1, len(ids)) if ends[t] == ends[t - 1] and t != 3]
    assert split  # a token ending inside 元 / 支 / 七 completes no character
    assert token_char_ends(tok, ids, text[:10])[-1] == 10                     # clamped at a stop-string cut


def test_token_char_ends_equal_the_quadratic_reference_on_random_tokens(tiny_model):
    """Random ids (byte tokens that split or never form characters, special tokens): the linear offsets
    equal decoding every prefix and counting its complete characters."""
    import random

    from grpo_pipeline.sampling import token_char_ends

    tok = load_tokenizer(tiny_model)
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 16))]
        text = tok.decode(ids, skip_special_tokens=True)
        want = [len(tok.decode(ids[: t + 1], skip_special_tokens=True).rstrip("\ufffd")) for t in range(len(ids))]
        assert token_char_ends(tok, ids, text) == want, ids
