"""report: gather per-iteration and per-checkpoint metrics into curves for `dvc plots`."""

from _common import params, parser


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--iterations-dir", required=True)
    p.add_argument("--eval-dir", required=True)
    p.add_argument("--eval-data", default=None, help="dir of evaluate's Parquet outputs (paired final - SFT)")
    p.add_argument("--out", required=True, help="directory for train.json / eval.json")
    p.add_argument("--metrics", default=None)
    args = p.parse_args()
    cfg = params(args)
    from grpo_pipeline.report import write_report
    from grpo_pipeline.run import summary

    metrics = write_report(iter_dir=args.iterations_dir, eval_dir=args.eval_dir, iterations=list(cfg.iterations),
                           evaluations=list(cfg.evaluations), out_dir=args.out,
                           eval_data_dir=args.eval_data)
    summary("report", metrics, path=args.metrics)


if __name__ == "__main__":
    main()
