"""``grpo-pipeline``: the project's command line (the stages themselves run through ``dvc repro``).

    grpo-pipeline iterations N [--eval-every K] [--eval-prompts P]  regenerate the iterations table in params.yaml
    grpo-pipeline check [params.yaml]             validate params.yaml (as the check stage and DVC read it, registered names too)
    grpo-pipeline deps [--check | --write]        each stage's code deps from its imports (see stagedeps.py)
    grpo-pipeline inspect [--iteration it0] ...   rollouts with rewards and advantages, per group
"""

from __future__ import annotations

import argparse
import sys


def _iterations(args: argparse.Namespace) -> None:
    from grpo_pipeline.config import load_params
    from grpo_pipeline.iterations import rewrite

    rewrite(args.params, args.n, eval_every=args.eval_every, eval_prompts=args.eval_prompts)
    load_params(args.params)
    print(f"{args.params}: iterations table now has {args.n} iterations (it0..it{args.n - 1}); run `dvc repro`")


def _check(args: argparse.Namespace) -> None:
    from grpo_pipeline.params_check import check

    p = check(args.params, args.dvc_yaml)
    print(f"{args.params}: ok ({len(p.iterations)} iterations)")


def _deps(args: argparse.Namespace) -> None:
    from grpo_pipeline.stagedeps import main as deps_main

    sys.exit(deps_main(args.dvc_yaml, check_only=args.check, write=args.write))


def _inspect(args: argparse.Namespace) -> None:
    from grpo_pipeline.inspect import inspect

    inspect(data_dir=args.data, iteration=args.iteration, prompt_id=args.prompt_id, only_wrong=args.only_wrong,
            only_truncated=args.only_truncated, limit=args.limit, summary_only=args.summary)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="grpo-pipeline", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    it = sub.add_parser("iterations", help="regenerate the iterations table for N iterations")
    it.add_argument("n", type=int)
    it.add_argument("--eval-every", type=int, default=1)
    it.add_argument("--eval-prompts", type=int, default=0,
                    help="eval prompts for the base and intermediate checkpoints (0: all; SFT and final: always all)")
    it.add_argument("--params", default="params.yaml")
    it.set_defaults(fn=_iterations)
    ck = sub.add_parser("check", help="validate params.yaml")
    ck.add_argument("params", nargs="?", default="params.yaml")
    ck.add_argument("--dvc-yaml", default=None, help="the dvc.yaml that reads it (default: beside params.yaml)")
    ck.set_defaults(fn=_check)
    dp = sub.add_parser("deps", help="print (or --check) each dvc.yaml stage's code deps, from its imports")
    dp.add_argument("--check", action="store_true", help="exit 1 naming each stage whose deps differ")
    dp.add_argument("--write", action="store_true", help="rewrite the code deps in dvc.yaml")
    dp.add_argument("--dvc-yaml", default="dvc.yaml")
    dp.set_defaults(fn=_deps)
    ins = sub.add_parser("inspect", help="print rollouts per group with rewards and advantages")
    ins.add_argument("--data", default="data", help="the pipeline's data dir (default: data)")
    ins.add_argument("--iteration", default=None)
    ins.add_argument("--prompt-id", default=None)
    ins.add_argument("--only-wrong", action="store_true")
    ins.add_argument("--only-truncated", action="store_true")
    ins.add_argument("--limit", type=int, default=5, help="groups to print (default 5)")
    ins.add_argument("--summary", action="store_true", help="only the per-iteration summary")
    ins.set_defaults(fn=_inspect)
    args = p.parse_args(argv)
    try:
        args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
