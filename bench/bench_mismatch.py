"""Sampler-trainer mismatch of real rollouts: one update (the stage body) on an iteration's rollouts.

Prints the update's ``mismatch/*`` metrics: how far the sampler's stored log-probs are from the
trainer's for the policy that sampled them (what ``update.rollout_correction`` would correct).
``--set`` overrides ``update.*`` params (YAML values), e.g. ``--set beta=0`` to skip the reference::

    python bench/bench_mismatch.py --policy models/sft --rollouts data/rollouts/it0 \\
        --advantages data/advantages/it0.parquet --set beta=0
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--policy", required=True, help="the checkpoint that sampled the rollouts")
    p.add_argument("--reference", default=None)
    p.add_argument("--rollouts", required=True)
    p.add_argument("--advantages", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="update.KEY override")
    a = p.parse_args()
    from grpo_pipeline.config import UpdateConfig, load_params
    from grpo_pipeline.run import update

    over = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in a.set)}
    cfg = UpdateConfig.model_validate({**load_params(a.params).update.model_dump(), **over})
    with tempfile.TemporaryDirectory() as tmp:
        m = update.run(cfg, policy=a.policy, reference=a.reference or a.policy, rollouts=a.rollouts,
                       advantages=a.advantages, out=str(Path(tmp) / "next"), metrics_path=None, steps_path=None)
    print(" ".join(f"{k}={v}" for k, v in m.items() if k.startswith("mismatch/")), f"tokens={m['tokens']}")


if __name__ == "__main__":
    main()
