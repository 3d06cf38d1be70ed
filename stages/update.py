"""update@itN: one GRPO policy update, writing the next HF checkpoint.

With ``update.distributed.strategy`` ddp or fsdp this script re-runs itself under torchrun
(``nproc_per_node`` x ``nnodes`` processes), so ``dvc.yaml`` keeps one command.  With
``nnodes > 1`` the same command must be started on every node (e.g. by ``srun``); they meet at
``rdzv_endpoint``.
"""

import os
import sys

from _common import params, parser


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--policy", required=True)
    p.add_argument("--reference", default=None)
    p.add_argument("--rollouts", required=True)
    p.add_argument("--advantages", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--metrics", default=None)
    p.add_argument("--steps", default=None, help="per-optimizer-step metrics (DVC plot)")
    args = p.parse_args()
    cfg = params(args, "update")
    from grpo_pipeline import distributed

    if cfg.update.distributed.strategy != "none" and not distributed.launched():
        cmd = distributed.torchrun_command(cfg.update.distributed, os.path.abspath(__file__), sys.argv[1:])
        print("launching:", " ".join(cmd), flush=True)
        os.execv(cmd[0], cmd)

    from grpo_pipeline.run import update
    from grpo_pipeline.update import NonFiniteError

    try:
        update.run(cfg.update, policy=args.policy, reference=args.reference, rollouts=args.rollouts,
                   advantages=args.advantages, out=args.out, metrics_path=args.metrics, steps_path=args.steps)
    except NonFiniteError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
