"""prepare: train and eval prompt sets as Parquet."""

from _common import params, parser


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--train-out", required=True)
    p.add_argument("--eval-out", required=True)
    p.add_argument("--metrics", default=None)
    args = p.parse_args()
    cfg = params(args, "data")
    from grpo_pipeline.run import prepare

    prepare.run(cfg.data, train_out=args.train_out, eval_out=args.eval_out, metrics_path=args.metrics)


if __name__ == "__main__":
    main()
