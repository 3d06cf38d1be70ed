"""sample@itN: G completions per prompt from the iteration's policy, to Parquet."""

from _common import params, parser


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--iteration", required=True)
    p.add_argument("--index", type=int, required=True, help="position of the iteration: picks its prompts")
    p.add_argument("--policy", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--metrics", default=None)
    args = p.parse_args()
    cfg = params(args, "sampling")
    from grpo_pipeline.run import sample

    sample.run(cfg.sampling, iteration=args.iteration, index=args.index, policy=args.policy,
               prompts_path=args.prompts, out=args.out, metrics_path=args.metrics)


if __name__ == "__main__":
    main()
