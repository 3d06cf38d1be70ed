"""base: import the base model (GGUF or HF dir) into an HF-format checkpoint."""

from _common import params, parser


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cfg = params(args, "base")
    from grpo_pipeline.run import base

    base.run(cfg.base, out=args.out)


if __name__ == "__main__":
    main()
