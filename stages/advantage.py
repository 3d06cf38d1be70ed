"""advantage@itN: group-relative advantages, to Parquet."""

from _common import params, parser


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--scores", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--metrics", default=None)
    args = p.parse_args()
    cfg = params(args, "advantage")
    from grpo_pipeline.run import advantage

    advantage.run(cfg.advantage, scores=args.scores, out=args.out, metrics_path=args.metrics)


if __name__ == "__main__":
    main()
