"""check: validate params.yaml before any other stage runs (grpo_pipeline/params_check.py)."""

from _common import parser


def main() -> None:
    import sys

    p = parser(__doc__)
    p.add_argument("--out", required=True, help="marker file every other stage depends on")
    args = p.parse_args()
    from grpo_pipeline.config import ParamsError
    from grpo_pipeline.params_check import check, write_marker

    try:
        params = check(args.params)
    except ParamsError as e:
        sys.exit(f"error: {e}")
    write_marker(args.out, args.params)
    print(f"{args.params}: ok ({len(params.iterations)} iterations)")


if __name__ == "__main__":
    main()
