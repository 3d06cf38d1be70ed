"""evaluate: greedy accuracy and format compliance of a checkpoint on the eval prompts."""

from _common import params, parser


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--name", required=True, help="label of the checkpoint (base, sft, it1, ...)")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--metrics", default=None)
    p.add_argument("--n-prompts", type=int, default=0, help="first n eval prompts (0: evaluate.n_prompts, else all)")
    args = p.parse_args()
    cfg = params(args, "evaluate", "sampling")
    from grpo_pipeline.run import evaluate

    evaluate.run(cfg.evaluate, cfg.sampling, cfg.reward, name=args.name, checkpoint=args.checkpoint,
                 prompts=args.prompts, out=args.out, metrics_path=args.metrics, n_prompts=args.n_prompts)


if __name__ == "__main__":
    main()
