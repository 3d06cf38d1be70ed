"""sft: SFT-format initialisation on template demonstrations."""

from _common import params, parser


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--base", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--metrics", default=None)
    args = p.parse_args()
    cfg = params(args, "sft")
    from grpo_pipeline.run import sft

    sft.run(cfg.sft, base=args.base, prompts=args.prompts, out=args.out, metrics_path=args.metrics)


if __name__ == "__main__":
    main()
