"""``python -m export train-drafter``: data → draft vocabulary → training → calibration →
a drafter folder (weights, config, calibration report and diagram), written atomically.

The work folder keeps the data shards, the checkpoint and the logs, so an interrupted run
(even kill -9) resumes where it stopped when started again with the same options.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dspark_edge.errors import ExportError

log = logging.getLogger(__name__)

WEIGHTS = "weights.npz"
CONFIG = "drafter.json"
# Peak learning rates. A run that continues a trained drafter (``init_from``) on new answers
# peaks lower: at the new drafter's peak its first steps unlearn part of what it starts from and
# the run ends barely above its start (docs/performance.md, "A lower peak for continuing runs").
NEW_LR = 6e-4
CONTINUE_LR = 2e-4


@dataclass(frozen=True)
class TrainDrafterOptions:
    target_engine: Path
    output: Path
    work: Path
    source: str = "default"
    prompts: int = 640
    max_new_tokens: int = 192
    text_tokens: int = 200_000
    copy_prompts: int = 256
    answers: Path | None = None  # recorded answers (``python -m export answers``) to reuse
    data: Path | None = None  # an answers file to train on whole (the data engine's); nothing is generated
    data_from: int = 0  # with ``data``: train on its answers from this index on (earlier runs trained on the rest)
    data_to: int | None = None  # with ``data``: ... up to this index (exclusive; None: the file's end); a
    # campaign file larger than one run can use is trained on a slice a run, and held-out answers
    # are drawn from the answers before this index only (the stable draw: a later, larger slice
    # keeps every earlier held-out answer held out)
    layers: int = 2
    slots: int = 7
    draft_vocab: int = 8192
    markov_rank: int = 128
    steps: int = 1500
    seqs_per_step: int = 8
    anchors: int = 40
    lr: float | None = None  # peak learning rate; None: NEW_LR, or CONTINUE_LR with init_from
    seed: int = 0
    mask_token_id: int | None = None  # the DeepSpec checkpoint's mask token; None: default_mask_token
    bf16: bool = False  # train under bfloat16 autocast (bench/train_bf16.py measures what it buys)
    init_from: Path | None = None  # a drafter folder whose weights (and draft vocabulary) start this run
    add_layers: int = 0  # with init_from: layers appended to its drafter, each starting as the identity
    reuse_features: tuple[Path, ...] = ()  # earlier work folders whose feature shards this run may take (Donors)

    def __post_init__(self) -> None:
        if self.lr is None:
            object.__setattr__(self, "lr", NEW_LR if self.init_from is None else CONTINUE_LR)
        if not self.lr >= 0:  # 0 trains nothing: a run that only re-validates and re-exports its start
            raise ExportError(f"--lr must be 0 or more, got {self.lr}")
        for name in ("prompts", "max_new_tokens", "layers", "slots", "draft_vocab", "markov_rank", "steps",
                     "seqs_per_step", "anchors"):
            if getattr(self, name) < 1:
                raise ExportError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("text_tokens", "copy_prompts"):
            if getattr(self, name) < 0:
                raise ExportError(f"--{name.replace('_', '-')} must be 0 (none) or more, got {getattr(self, name)}")
        if self.data_from < 0 or (self.data_from and self.data is None):
            raise ExportError(f"--data-from picks the answers of a --data file to train on; got {self.data_from}"
                              + ("" if self.data is not None else " without --data"))
        if self.data_to is not None and (self.data is None or self.data_to <= self.data_from):
            raise ExportError(f"--data-to {self.data_to} must come with --data and exceed --data-from {self.data_from}")
        if self.add_layers < 0 or (self.add_layers and self.init_from is None):
            raise ExportError(f"--add-layers grows the drafter of --init-from by that many layers; got {self.add_layers}"
                              + ("" if self.init_from is not None else " without --init-from (a new drafter takes "
                                 "--layers)"))
        if self.data is not None and self.answers is not None:
            raise ExportError("--data trains on every answer of its file and generates none; --answers (answers "
                              "to reuse while generating the rest) does not apply with it: pass one of them")
        from .data import check_donor_folders

        check_donor_folders(self.reuse_features)  # before the work folder is touched
        if not (self.target_engine / "manifest.json").is_file():
            raise ExportError(f"{self.target_engine} is not an engine folder (no manifest.json); export the target "
                              "first with `python -m export target`")


LEARNING_CURVE = "learning_curve.jsonl"


def write_learning_curve(path: Path, prior: Path | None, history: list[dict], seqs_per_step: int,
                         train_answers: int, held_out: int, data: str, runtime: dict | None = None) -> None:
    """``path``: the learning curve of a drafter across the runs that made it, one JSON line per
    validation: the run (1 = trained from the target's layers; each ``--init-from`` run adds
    one), optimizer steps and sequences drawn since the first run, the training and held-out
    answers this run had, and the held-out τ and per-position reach at uniform anchors; the
    run's last row adds ``runtime_tau`` / ``runtime_reach`` (``runtime``: rounds anchored where
    decoding would start them, ``train.runtime_walk``). ``prior``: the curve of
    the folder this run started from (``start_curve``), carried over, so a campaign's curve is
    one file, committed with its weights."""
    rows: list[dict] = []
    if prior is not None and prior.is_file():
        for line in prior.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                raise ExportError(f"{prior}: line {len(rows) + 1} is not JSON; repair or delete it (the curve "
                                  "then starts at this run)") from None
            if not isinstance(row, dict) or not {"run", "steps", "sequences_drawn"} <= set(row):
                raise ExportError(f"{prior}: line {len(rows) + 1} is not a learning-curve row; repair or delete it")
            rows.append(row)
    run = rows[-1]["run"] + 1 if rows else 1
    base_steps = rows[-1]["steps"] if rows else 0
    base_drawn = rows[-1]["sequences_drawn"] if rows else 0
    for h in history:
        rows.append({"run": run, "run_step": h["step"], "steps": base_steps + h["step"],
                     "sequences_drawn": base_drawn + h["step"] * seqs_per_step, "train_answers": train_answers,
                     "held_out_answers": held_out, "tau": round(h["tau"], 4),
                     "reach": [round(r, 4) for r in h["reach"]], "data": data})
    if runtime is not None and history:
        rows[-1] |= {"runtime_tau": round(runtime["tau"], 4), "runtime_reach": [round(r, 4) for r in runtime["reach"]]}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def start_curve(work: Path, init_from: Path) -> Path:
    """The learning curve ``init_from`` had when this work folder's run started, kept in the
    work folder: a run resumed or extended there later carries the same curve over, even after
    it has overwritten ``init_from`` with its own output."""
    kept = work / f"start_{LEARNING_CURVE}"
    if not kept.is_file():
        src = init_from / LEARNING_CURVE
        kept.write_text(src.read_text(encoding="utf-8") if src.is_file() else "", encoding="utf-8")
    return kept


def read_init(folder: Path, target_engine: Path, manifest):
    """(config, weights) of a drafter folder to start from, checked against the target."""
    from .install import _check_trained
    from .model import DraftConfig

    meta, _ = _check_trained(target_engine, folder, manifest, widen=True)
    try:
        cfg = DraftConfig.from_dict(meta["config"])
        with np.load(folder / WEIGHTS) as f:
            weights = {k: f[k] for k in f.files}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{folder} holds no readable drafter weights ({exc}); train one first") from exc
    if not cfg.qk_norm:
        raise ExportError(f"{folder} was trained without per-head q/k norms (an older architecture); it cannot "
                          "start a run of this one: train without --init-from")
    return cfg, weights


def default_mask(target_engine: Path, manifest) -> int:
    from dspark_edge.tokenizer import Tokenizer

    from .deepspec_export import default_mask_token

    return default_mask_token(Tokenizer.from_engine(target_engine, manifest), manifest.tokenizer.eos_ids)


def init_from_target(model, target) -> None:
    """Start the drafter's layers from the target's last layers (same shapes): measured on the
    embedded default, the first steps' cross-entropy is far lower than from a random start."""
    import torch

    src = target.model.layers[-len(model.layers):]
    with torch.no_grad():
        for mine, theirs in zip(model.layers, src):
            a, m = theirs.self_attn, theirs.mlp
            for dst, s in ((mine.q, a.q_proj), (mine.k, a.k_proj), (mine.v, a.v_proj), (mine.o, a.o_proj),
                           (mine.gate, m.gate_proj), (mine.up, m.up_proj), (mine.down, m.down_proj)):
                dst.weight.copy_(s.weight)
            mine.in_norm.weight.copy_(theirs.input_layernorm.weight)
            mine.post_norm.weight.copy_(theirs.post_attention_layernorm.weight)


def draft_config(target, feature_layers, layers: int, slots: int, draft_vocab: int, markov_rank: int):
    """A DraftConfig with the target's layer shape (``target``: the HF model) and DeepSpec's Qwen3
    layers (per-head q/k norms), so the drafter writes in DeepSpec's format."""
    from .model import DraftConfig

    c = target.config
    return DraftConfig(hidden_size=c.hidden_size, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                       head_dim=c.hidden_size // c.num_attention_heads, intermediate_size=c.intermediate_size,
                       num_layers=layers, feature_layers=tuple(feature_layers), rms_eps=c.rms_norm_eps,
                       rope_theta=float(c.rope_parameters["rope_theta"]), slots=slots, draft_vocab=draft_vocab,
                       markov_rank=markov_rank, qk_norm=True)


def build_model(cfg, target, vocab_ids: np.ndarray):
    import torch

    from .model import DSparkDraft

    emb = target.model.embed_tokens.weight.detach()
    head = target.lm_head.weight.detach()
    return DSparkDraft(cfg, emb, head, torch.from_numpy(vocab_ids), target.model.norm.weight.detach())


def save_drafter(model, folder: Path, meta: dict) -> None:
    """weights.npz (fp16 trainable tensors + int64 vocabulary) and drafter.json."""
    arrays = {}
    for k, v in model.trainable_state().items():
        a = v.detach().cpu().numpy()
        arrays[k] = a if a.dtype.kind in "iu" else a.astype(np.float16)
    np.savez(folder / WEIGHTS, **arrays)
    (folder / CONFIG).write_text(json.dumps({"config": model.cfg.to_dict(), **meta}, indent=2) + "\n",
                                 encoding="utf-8")


def load_drafter(folder: Path, target):
    """The trained drafter (PyTorch, FP32) from a drafter folder, around ``target``'s tables."""
    import torch

    from .model import DraftConfig

    meta = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    cfg = DraftConfig.from_dict(meta["config"])
    w = np.load(folder / WEIGHTS)
    model = build_model(cfg, target, w["vocab_ids"])
    model.load_state_dict({k: torch.from_numpy(w[k].astype(np.float32) if w[k].dtype.kind == "f" else w[k])
                           for k in w.files}, strict=True)
    model.eval()
    return model, meta


def train_drafter(opts: TrainDrafterOptions, progress=print) -> Path:
    import torch

    from dspark_edge.decoder import DecoderModel
    from dspark_edge.manifest import read_manifest
    from dspark_edge.tokenizer import Tokenizer

    from ..sources import load_source, resolve_source
    from . import calibrate
    from .data import (
        Donors,
        answer_feature_shards,
        build_shards,
        check_digest,
        count_sequences,
        load_shards,
    )
    from .prompts import copy_prompts, training_prompts
    from .text import build_text_shards, fingerprint, package_documents, text_sequences
    from .train import (
        TrainOptions,
        choose_draft_vocab,
        held_out_rounds,
        recorded_split,
        runtime_walk,
        train,
    )

    torch.manual_seed(opts.seed)
    manifest = read_manifest(opts.target_engine)
    if not manifest.hidden_state_layers:
        raise ExportError(f"{opts.target_engine} exposes no hidden states; re-export it with --hidden-layers")
    if "fp32" not in manifest.precisions():
        raise ExportError(f"{opts.target_engine} has no fp32 target; the drafter learns from the FP32 target")
    from ..answers import load_answers

    # Recorded answers are checked before anything is loaded or written: --answers (by prompt
    # ids, reused while generating the rest) or --data (every one of them trained on).
    known = load_answers(opts.answers, manifest, opts.max_new_tokens).by_prompt() if opts.answers else None
    recorded = load_answers(opts.data, manifest, opts.max_new_tokens) if opts.data else None
    opts.work.mkdir(parents=True, exist_ok=True)
    (opts.work / "options.json").write_text(json.dumps({k: str(v) for k, v in asdict(opts).items()}, indent=2))
    source = resolve_source(opts.source)
    progress(f"[1/4] loading the target ({source.description})")
    target, _ = load_source(source)
    if opts.init_from is None and opts.draft_vocab > manifest.model.vocab_size:
        raise ExportError(f"--draft-vocab {opts.draft_vocab} exceeds the target's vocabulary ({manifest.model.vocab_size})")
    decoder = DecoderModel(manifest, opts.target_engine, "fp32")
    tok = Tokenizer.from_engine(opts.target_engine, manifest)
    docs = package_documents() if (opts.text_tokens or (opts.copy_prompts and recorded is None)) else []
    donors = Donors(list(opts.reuse_features), decoder, 16) if opts.reuse_features else None
    chosen = held = None  # with --data-from: the answers trained or validated on, the held-out ones (file indices)
    if recorded is not None:
        if opts.data_from >= len(recorded):
            raise ExportError(f"--data-from {opts.data_from}: {opts.data} holds {len(recorded)} answers; pass an "
                              "index below that (the first answer not trained on yet)")
        end = len(recorded) if opts.data_to is None else opts.data_to
        if end > len(recorded):
            raise ExportError(f"--data-to {end}: {opts.data} holds {len(recorded)} answers; pass at most that")
        if opts.data_from or end < len(recorded):
            held = recorded_split(None, opts.work, end, seed=opts.seed)[1]
            chosen = np.union1d(held, np.arange(opts.data_from, end))
            progress(f"[2/4] the engine's features for answers {opts.data_from}–{end - 1} and the "
                     f"{len(held)} held-out answers before {end} of {opts.data} ({len(chosen)} of {len(recorded)}; "
                     "resumable)")
        else:
            progress(f"[2/4] the engine's features for the {len(recorded)} answers in {opts.data} (resumable)")
        picked = range(len(recorded)) if chosen is None else chosen.tolist()
        shards = answer_feature_shards(decoder, [recorded.pair(i) for i in picked], opts.work / "answers",
                                       progress=lambda s: progress("      " + s), donors=donors)
        counts = ", ".join(f"{v} {k}" for k, v in recorded.meta.get("answers", {}).items())
        data_note = (f"the target's greedy answers recorded in {opts.data.name} ({counts}; made by "
                     f"{recorded.meta.get('made_by', 'python -m export answers')}"
                     + ("" if chosen is None else f"; trained on those at {opts.data_from}–{end - 1}")
                     + ") and its FP32 engine's teacher-forced features")
    else:
        prompts = training_prompts(opts.seed)
        if opts.prompts > len(prompts):
            raise ExportError(f"--prompts {opts.prompts} exceeds the {len(prompts)} training prompts")
        progress(f"[2/4] target answers and features for {opts.prompts} prompts (resumable"
                 + (f"; {len(known)} recorded answers in {opts.answers} are reused" if known is not None else "") + ")")
        shards = build_shards(target, decoder, tok, prompts[:opts.prompts], opts.work / "data", manifest.tokenizer.eos_ids[0],
                              manifest.tokenizer.pad_id, opts.max_new_tokens, progress=lambda s: progress("      " + s),
                              known=known)
        copy_note = "no copy tasks"
        if opts.copy_prompts:
            limit = manifest.model.max_position_embeddings - opts.max_new_tokens
            made = copy_prompts(docs, opts.copy_prompts, opts.seed)
            tasks = [t for t in made if len(tok.encode_chat(t["messages"])) <= limit]  # prompt and answer fit
            if len(tasks) < len(made):
                progress(f"      copy tasks: {len(made) - len(tasks)} of {len(made)} skipped, their prompt and "
                         f"--max-new-tokens {opts.max_new_tokens} exceed the target's {manifest.model.max_position_embeddings} "
                         "positions")
            copy_note = (f"the target's answers to {len(tasks)} copy tasks (summarise / rewrite / explain a paragraph "
                         f"or function taken from the same installed documents, fingerprint {fingerprint(docs)})")
            progress(f"      copy tasks: {len(tasks)} prompts that carry a text or code to work from (resumable)")
            folder = opts.work / "copy"
            check_digest(folder, "prompts.sha256",
                         hashlib.sha256(json.dumps([opts.max_new_tokens, tasks]).encode()).hexdigest(),
                         f"the installed packages, --copy-prompts or --max-new-tokens changed since; delete {folder} "
                         "to rebuild them, or pass --copy-prompts 0")
            shards += build_shards(target, decoder, tok, tasks, folder, manifest.tokenizer.eos_ids[0],
                                   manifest.tokenizer.pad_id, opts.max_new_tokens,
                                   progress=lambda s: progress("      copy " + s), known=known)
        data_note = (f"the target's greedy answers to {opts.prompts} project prompts (export/drafter/prompts.py) "
                     f"and its FP32 engine's teacher-forced features; {copy_note}")
    answers = count_sequences(shards)
    text_note = "no teacher-forced text"
    if opts.text_tokens:
        windows = text_sequences(tok, docs, 256, opts.text_tokens)
        text_note = (f"{sum(len(a) for _, a in windows)} teacher-forced tokens in {len(windows)} windows of "
                     f"{len(docs)} installed documents (package READMEs, standard-library modules; "
                     f"fingerprint {fingerprint(docs)})")
        progress(f"      text: {text_note} (resumable)")
        shards += build_text_shards(decoder, windows, opts.work / "text", progress=lambda s: progress("      " + s),
                                    donors=donors)
    if donors is not None:
        progress(f"      {donors.taken} feature shards taken from {', '.join(map(str, opts.reuse_features))}")
    del decoder
    data = load_shards(shards)
    if chosen is None:
        train_ids, val_ids = recorded_split(data, opts.work, answers, seed=opts.seed)
    else:  # positions in the loaded shards: the chosen answers in file order, then the text
        is_held = np.isin(chosen, held)
        train_ids = np.concatenate([np.flatnonzero(~is_held), np.arange(answers, len(data))])
        val_ids = np.flatnonzero(is_held)
    vocab_path = opts.work / "vocab_ids.npy"
    init = read_init(opts.init_from, opts.target_engine, manifest) if opts.init_from is not None else None
    prior_curve = start_curve(opts.work, opts.init_from) if opts.init_from is not None else None
    if init is not None and vocab_path.is_file() and not np.array_equal(np.load(vocab_path), init[1]["vocab_ids"]):
        raise ExportError(f"{opts.work} was started with another draft vocabulary than {opts.init_from}'s; "
                          "pass another --work folder")
    if not vocab_path.is_file():
        np.save(vocab_path, init[1]["vocab_ids"] if init is not None else
                choose_draft_vocab(data, opts.draft_vocab, manifest.model.vocab_size))
    vocab_ids = np.load(vocab_path)
    answer = np.concatenate([data.tokens[data.span(i)[0] + int(data.prompt_lens[i]):data.span(i)[1]] for i in val_ids])
    coverage = float(np.isin(answer, vocab_ids).mean())
    progress(f"      {len(data)} sequences ({data.tokens.size} tokens); draft vocabulary {vocab_ids.size} "
             f"covers {coverage:.1%} of held-out answer tokens")
    if init is not None:
        cfg = init[0]
        progress(f"      starting from {opts.init_from} ({cfg.num_layers} layers, {cfg.slots} slots, rank "
                 f"{cfg.markov_rank}; its shape wins over --layers/--slots/--markov-rank)")
    else:
        cfg = draft_config(target, manifest.hidden_state_layers, opts.layers, opts.slots, int(vocab_ids.size),
                           opts.markov_rank)
    model = build_model(cfg, target, vocab_ids)
    if init is not None:
        model.load_state_dict({k: torch.from_numpy(v.astype(np.float32) if v.dtype.kind == "f" else v)
                               for k, v in init[1].items()}, strict=True)
        streams = tuple(manifest.hidden_state_layers)
        if cfg.feature_layers != streams:
            model.widen(streams)
            progress(f"      widened from target streams {list(cfg.feature_layers)} to {list(streams)} (the "
                     "engine exposes more; the new streams' context columns start at zero: the drafter computes "
                     "what it computed before)")
            cfg = model.cfg
        if opts.add_layers:
            model.grow(opts.add_layers)
            cfg = model.cfg
            progress(f"      grown to {cfg.num_layers} layers (the new ones start as the identity: the drafter "
                     "computes what it computed before)")
    else:
        init_from_target(model, target)
    progress(f"[3/4] training {sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6:.1f} M "
             f"parameters for {opts.steps} steps (log: {opts.work / 'train.log'})")
    t0 = time.perf_counter()
    tr_opts = TrainOptions(steps=opts.steps, seqs_per_step=min(opts.seqs_per_step, len(train_ids)),
                           anchors=opts.anchors, lr=opts.lr, seed=opts.seed,
                           validate_every=min(250, opts.steps), checkpoint_every=min(50, opts.steps),
                           bf16=opts.bf16)
    result = train(model, data, train_ids, val_ids, opts.work, tr_opts, progress=lambda s: progress("      " + s),
                   answers=answers)
    progress("[4/4] calibrating the confidence head on held-out rounds")
    per_sequence: list = []
    accepted, z, _ = held_out_rounds(model, data, val_ids, cfg.slots, anchors=None, per_sequence=per_sequence,
                                      progress=lambda s: progress("      " + s))
    runtime = runtime_walk(per_sequence, cfg.slots)
    progress(f"      held-out τ where decoding meets it (rounds from each answer's start, each after the last "
             f"accepted draft; {runtime['rounds']} rounds of {cfg.slots} drafts): {runtime['tau']:.2f}, first draft "
             f"{runtime['reach'][0]:.0%} (uniform anchors: {result['history'][-1]['tau']:.2f})")
    half = np.random.default_rng(opts.seed).permutation(accepted.size) < accepted.size // 2
    progress(f"      fitting the confidence temperatures on {int(half.sum())} of {accepted.size} held-out blocks")
    temps, biases = calibrate.fit_calibration(z[half], accepted[half])
    rep = calibrate.report(z[~half], accepted[~half], temps, biases)
    rep["fit_blocks"] = int(half.sum())
    stage = opts.output.parent / f".{opts.output.name}.partial"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    calibrate.write_report(rep, stage / "calibration.json")
    calibrate.reliability_png(z[~half], accepted[~half], temps, stage / "reliability.png", biases=biases)
    meta = {
        "target": {"name": manifest.model.name, "source_sha256": manifest.model.source_sha256,
                   "hidden_state_layers": list(manifest.hidden_state_layers)},
        "temperatures": [float(t) for t in temps],
        "biases": [float(b) for b in biases],
        "training": {"command": " ".join(sys.argv), "options": {k: str(v) for k, v in asdict(opts).items()},
                     "data": f"{data_note}; {text_note}",
                     "sequences": len(data), "tokens": int(data.tokens.size), "steps": result["steps"],
                     "validation": result["history"], "runtime_validation": runtime,
                     "draft_vocab_coverage": coverage,
                     "minutes_this_run": round((time.perf_counter() - t0) / 60, 1)},
    }
    save_drafter(model, stage, meta)
    write_learning_curve(stage / LEARNING_CURVE, prior_curve, result["history"], seqs_per_step=tr_opts.seqs_per_step,
                         train_answers=int(np.sum(np.asarray(train_ids) < answers)), held_out=len(val_ids),
                         data=str(opts.data or opts.answers or opts.work), runtime=runtime)
    from .deepspec_export import DEEPSPEC_DIR, write_deepspec

    write_deepspec(model, target.config.to_dict(), stage / DEEPSPEC_DIR, mask_token_id=opts.mask_token_id
                   if opts.mask_token_id is not None else default_mask(opts.target_engine, manifest),
                   anchors=opts.anchors, temperatures=meta["temperatures"], biases=meta["biases"],
                   provenance={"target": meta["target"], "training_data": meta["training"]["data"],
                               "training_steps": result["steps"]})
    progress(f"      DeepSpec checkpoint: {opts.output / DEEPSPEC_DIR}")
    if opts.output.exists():
        old = opts.output.parent / f".{opts.output.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        opts.output.rename(old)
        stage.rename(opts.output)
        shutil.rmtree(old)
    else:
        stage.rename(opts.output)
    progress(f"done: {opts.output} (held-out τ {result['history'][-1]['tau']:.2f})")
    return opts.output
