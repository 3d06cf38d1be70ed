"""update@itN: one GRPO policy update, writing the next HF checkpoint."""

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
    cfg = params(args)
    from grpo_pipeline.run import update

    update.run(cfg.update, policy=args.policy, reference=args.reference, rollouts=args.rollouts,
               advantages=args.advantages, out=args.out, metrics_path=args.metrics, steps_path=args.steps)


if __name__ == "__main__":
    main()
