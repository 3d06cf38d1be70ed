"""score@itN: rule rewards for every completion, to Parquet."""

from _common import params, parser


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rollouts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", default=None, help="prompts file: coding rows' hidden tests, joined on prompt_id")
    p.add_argument("--metrics", default=None)
    args = p.parse_args()
    cfg = params(args, "reward")
    from grpo_pipeline.run import score

    score.run(cfg.reward, rollouts=args.rollouts, out=args.out, metrics_path=args.metrics,
              prompts=args.prompts)


if __name__ == "__main__":
    main()
