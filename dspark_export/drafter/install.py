"""``python -m export drafter``: put a trained DSpark drafter into its target's engine folder.

Writes ``drafter-<id>/`` (the graph in each precision, ``tables.npz``, ``markov.npy``,
``embedding.npy``) beside
the target, validates the graph against PyTorch, then rewrites ``manifest.json`` atomically to
list it, and only then removes a previous drafter folder. Interrupted at any point, the engine
folder stays loadable: the manifest names either the old drafter or the new one, complete.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import numpy as np

from dspark_edge.errors import ExportError
from dspark_edge.manifest import DrafterInfo, Variant, file_entry, read_manifest, sha256_file, write_manifest

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16", "int8")


VALIDATION_TEXT = ("A bicycle stays upright mainly because of the way its rider steers and the geometry of its "
                   "front wheel. When the bike starts to lean, the rider turns the handlebars toward the lean, "
                   "which moves the wheels back under the centre of mass. The front fork is angled so that the "
                   "tyre's contact point trails behind the steering axis, and that trail makes the steering "
                   "correct itself. Speed helps too: the faster the wheels turn, the steadier the ride feels.")


def real_features(target_engine: Path, manifest) -> tuple[list[int], np.ndarray]:
    """(token ids, the target engine's hidden states [n, F]) for a fixed chat turn: the drafter's
    graphs are compared on the features they will meet. Real hidden states carry outlier
    channels (|x| in the tens of thousands on the embedded default) that random features lack,
    and quantizing a graph's activations per tensor breaks exactly there."""
    from dspark_edge.decoder import DecoderModel
    from dspark_edge.tokenizer import Tokenizer

    precisions = manifest.precisions("target")
    decoder = DecoderModel(manifest, target_engine, "fp32" if "fp32" in precisions else precisions[0])
    tok = Tokenizer.from_engine(target_engine, manifest)
    ids = tok.encode_chat([{"role": "user", "content": "How does a bicycle stay upright?"}]) + tok.encode(VALIDATION_TEXT)
    rows: list[np.ndarray] = []
    decoder.prefill(decoder.new_cache(), np.asarray(ids, dtype=np.int64), hidden_sink=rows)
    return ids, np.concatenate(rows).astype(np.float32)


def _check_trained(target_engine: Path, weights: Path, manifest, widen: bool = False) -> tuple[dict, int]:
    """(drafter.json, slots) of a drafter folder from ``train-drafter``, checked against the target.
    ``widen``: the drafter may read fewer of the target's streams than the engine exposes (a
    training run that starts from it widens it), never others."""
    if not (weights / "drafter.json").is_file():
        raise ExportError(f"{weights} holds no trained drafter (drafter.json) and is not a DeepSpec checkpoint "
                          "(config.json naming Qwen3DSparkModel); train one with `python -m export train-drafter`")
    meta = json.loads((weights / "drafter.json").read_text(encoding="utf-8"))
    if meta["target"]["source_sha256"] != manifest.model.source_sha256:
        raise ExportError(f"{weights} was trained against a target with source sha256 "
                          f"{meta['target']['source_sha256'][:12]}…, but {target_engine} was exported from "
                          f"{manifest.model.source_sha256[:12]}…; train a drafter for this target")
    mine, theirs = list(meta["target"]["hidden_state_layers"]), list(manifest.hidden_state_layers)
    if widen and set(mine) < set(theirs):
        return meta, int(meta["config"]["slots"])
    if mine != theirs:
        raise ExportError(f"{weights} reads target layers {mine} but {target_engine} exposes {theirs}; re-export "
                          f"the target with --hidden-layers {','.join(map(str, mine))}"
                          + (" (or train from this drafter on it: train-drafter --init-from widens a drafter to "
                             "streams it lacks)" if set(mine) < set(theirs) else ""))
    return meta, int(meta["config"]["slots"])


def _validate(model, graph: Path, cfg, ids: list[int], feats: np.ndarray, head_table: np.ndarray | None = None) -> dict:
    """Incremental rounds through the ONNX graph (context appended round by round, as the
    runtime does) against PyTorch from scratch, over real features: max |Δlogit| and the share
    of slots whose top-1 draft agrees. ``head_table``: fed to a graph with a shared head."""
    import onnxruntime as ort
    import torch

    from .onnx_export import HEAD_TABLE, reference_round

    sess = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    past = {f"past_{kv}.{i}": np.zeros((cfg.num_kv_heads, 0, cfg.head_dim), np.float32)
            for i in range(cfg.num_layers) for kv in ("key", "value")}
    t_feats = torch.from_numpy(feats)
    worst_l, top1, n = 0.0, [], 0
    cuts = list(range(min(37, len(ids) - 1), len(ids) - 1, 5))
    for cut in cuts:
        anchor = int(ids[cut])
        feed = {"features": feats[n:cut], "anchor_embedding": model.embed[anchor][None].numpy(),
                "block_positions": np.arange(cut, cut + cfg.slots, dtype=np.int64), **past}
        if head_table is not None:
            feed[HEAD_TABLE] = head_table
        out = sess.run(None, feed)
        n = cut
        ref_l, _ = reference_round(model, t_feats[:n], anchor, n, cfg.slots)
        worst_l = max(worst_l, float(np.abs(out[0] - ref_l).max()))
        top1.append(float((out[0].argmax(-1) == ref_l.argmax(-1)).mean()))
        past = {f"past_{kv}.{i}": out[2 + 2 * i + (kv == "value")] for i in range(cfg.num_layers)
                for kv in ("key", "value")}
    return {"max_abs_logit_diff": worst_l, "top1_agreement": float(np.mean(top1)), "rounds": len(cuts)}


MARKOV_DTYPES = ("float16", "float32")
FP16_MAX = float(np.finfo(np.float16).max)


def _markov_dtype(tab: dict, wanted: str, progress) -> str:
    """``wanted``, unless FP16 is wanted and a Markov weight lies outside its range."""
    if wanted == "float16":
        big = max((float(np.abs(tab[k]).max(initial=0.0)) for k in ("markov_in", "markov_out")), default=0.0)
        if not big < FP16_MAX:
            progress(f"      the Markov tables hold |w| = {big:.3g}, beyond FP16's range: stored in FP32")
            return "float32"
    return wanted


def _deepspec_rounds(reference, model, tab: dict, ids: list[int], feats: np.ndarray) -> dict:
    """The converted model's full-block rounds (PyTorch, this project's forward and the
    runtime's sequential step over the installed ``tab``les) against the DeepSpec reference over
    real features: drafts and confidences agree."""
    import torch

    from dspark_edge.drafters.dspark import sequential_step

    from .onnx_export import reference_round

    b = reference.cfg.block_size
    vocab_ids = tab["vocab_ids"]
    to_draft = np.full(reference.cfg.vocab_size, vocab_ids.size, dtype=np.int64)
    to_draft[vocab_ids] = np.arange(vocab_ids.size)
    conf_w = tab["conf_w"].astype(np.float64) if reference.cfg.confidence_head else None
    cuts = list(range(min(37, len(ids) - 1), len(ids) - 1, 5))
    same, worst = 0, 0.0
    for cut in cuts:
        anchor = int(ids[cut])
        want, conf = reference.propose(feats[:cut], anchor)
        u, h = reference_round(model, torch.from_numpy(feats[:cut]), anchor, cut, b)
        got, z = sequential_step(u, h, int(to_draft[anchor]), tab["markov_in"], tab["markov_out"], conf_w,
                                 float(tab["conf_b"][0]), lambda j, logits, cand: int(np.argmax(logits)),
                                 anchor_row=tab["markov_anchor"][anchor] if "markov_anchor" in tab else None)
        got = vocab_ids[got]
        same += int(np.array_equal(got, want))
        worst = max(worst, float(np.abs(z - conf).max()))
    return {"rounds": len(cuts), "drafts_identical": same, "max_abs_confidence_logit_diff": worst}


def _load_deepspec(target_engine: Path, weights: Path, manifest):
    from . import deepspec

    cfg, tensors, model = deepspec.load(weights, manifest, target_engine)
    digest = deepspec.fingerprint(weights)
    slots = cfg.block_size
    source = ("none: a DeepSpec checkpoint's confidences are used as trained (T = 1, b = 0 at every slot); "
              "the scheduler's online offset still applies" if cfg.confidence_head else
              "none: the checkpoint has no confidence head; each slot's confidence is the largest probability "
              "of its draft distribution (T = 1, b = 0), calibrated online by the scheduler's offset")
    temps, biases = [1.0] * slots, [0.0] * slots
    side = deepspec.read_calibration(weights, cfg)
    if side is not None:
        temps, biases = side
        source = f"{deepspec.CALIBRATION} beside the checkpoint (fitted where the drafter was trained)"
    meta = {"provenance": {"weights": str(weights), "format": f"DeepSpec {deepspec.ARCHITECTURE}",
                           "training_data": "unknown (an imported DeepSpec checkpoint)", "training_steps": "unknown",
                           "weights_sha256": digest, "deepspec_target_layer_ids": json.dumps(list(cfg.target_layer_ids)),
                           "mask_token_id": str(cfg.mask_token_id)},
            "temperatures": temps, "biases": biases,
            "calibration": {"source": source, "temperatures": temps, "biases": biases},
            "confidence": "head" if cfg.confidence_head else "draft_probability"}
    anchors = deepspec.anchor_table(cfg, tensors)
    return model, deepspec.Reference(cfg, tensors), digest, meta, {} if anchors is None else {"markov_anchor": anchors}


def _target_table(target_engine: Path, manifest):
    """(manifest entry, mapped array) of the target's separately stored embedding table, or
    (None, None) when its graphs keep theirs inside."""
    from dspark_edge.backends.tables import shared_table, target_table
    from dspark_edge.errors import EngineError
    from dspark_edge.manifest import verify_files

    entry = target_table(target_engine, manifest)
    if entry is None:
        return None, None
    verify_files(manifest, target_engine, [entry.file])
    try:
        return entry, shared_table(target_engine, manifest, entry)
    except EngineError as exc:
        raise ExportError(str(exc)) from None


def _equal(weights, table: np.ndarray | None) -> bool:
    return table is not None and tuple(weights.shape) == table.shape and np.array_equal(weights.numpy(), table)


def install_drafter(target_engine: Path, weights: Path, blocks: tuple[int, ...] | None = None,
                    precisions: tuple[str, ...] = PRECISIONS, source: str = "default", progress=print,
                    share_head: bool = True, markov_dtype: str = "float16") -> Path:
    """``weights``: a drafter folder from ``train-drafter``, or a DeepSpec checkpoint folder
    (``deepspec.py``). ``blocks`` (verify widths = drafts + 1): None lists 4 and 8 for a drafter
    trained here, and every verify width of the target from 2 to the checkpoint's block size + 1
    for a DeepSpec one. ``share_head``: when the drafter's LM head is exactly the target's
    separately stored embedding table (a full-vocabulary drafter of a tied target: DeepSpec
    copies the target's head and freezes it), the FP32 graph reads the target's table at run
    time instead of holding its own copy (the INT8 and FP16 graphs keep their own, quantized or
    halved); False keeps a copy in every graph. A drafter whose input embeddings are that table
    (any drafter of such a target) reads its anchors' rows there too, exact in FP32, and no
    ``embedding.npy`` is written. ``markov_dtype``: how ``markov.npy`` stores the Markov tables,
    "float16" (half the memory; rows are widened to FP32 as a round reads them) or "float32".
    Half precision changes drafts only where a slot's two best logits lie within its rounding
    (a DeepSpec checkpoint's bfloat16 weights are coarser still), which costs acceptance, never
    exactness; the install report counts the validation rounds whose drafts it changed. Tables
    with a value outside FP16's range are kept in FP32."""
    from . import deepspec
    from .onnx_export import convert_fp16, export_onnx, quantize_int8, tables

    manifest = read_manifest(target_engine)
    if markov_dtype not in MARKOV_DTYPES:
        raise ExportError(f"the Markov tables' dtype must be one of {list(MARKOV_DTYPES)}, got {markov_dtype!r}")
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad or not precisions:
        raise ExportError(f"drafter precisions must be among {list(PRECISIONS)}, got {list(precisions)}")
    imported = deepspec.is_deepspec(weights)
    reference = None
    target_widths = set(manifest.widths("target", manifest.precisions()[0]))
    if imported:
        progress(f"[1/3] reading the DeepSpec checkpoint {weights}")
        model, reference, digest, meta, extra_tables = _load_deepspec(target_engine, weights, manifest)
        slots = model.cfg.slots
        if blocks is None:
            blocks = tuple(sorted(w for w in target_widths if 2 <= w <= slots + 1))
    else:
        meta, slots = _check_trained(target_engine, weights, manifest)
        blocks = (4, 8) if blocks is None else blocks
        extra_tables = {}
    if not blocks or any(b < 2 or b - 1 > slots for b in blocks):
        raise ExportError(f"block sizes must be in [2, {slots + 1}] for a drafter of {slots} slots, "
                          f"got {list(blocks)}")
    missing = [b for b in blocks if b not in target_widths]
    if missing:
        raise ExportError(f"block sizes {missing} are not verify widths of {target_engine} "
                          f"({sorted(target_widths)}); a block of b drafts+anchor is verified at width b")
    if not imported:
        from ..sources import load_source, resolve_source
        from .build import load_drafter

        progress(f"[1/3] loading the target ({source}) and the drafter ({weights})")
        target, _ = load_source(resolve_source(source))
        model, meta = load_drafter(weights, target)
        del target
        digest = sha256_file(weights / "weights.npz")
    ids, feats = real_features(target_engine, manifest)
    cfg = model.cfg
    name, n = f"drafter-{digest[:8]}", 1
    while (target_engine / name).exists():  # never overwrite what the manifest may list
        name, n = f"drafter-{digest[:8]}-{n}", n + 1
    stage = target_engine / f".{name}.partial"
    rel = lambda p: f"{name}/{p}"  # noqa: E731
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        progress(f"[2/3] exporting the graph ({', '.join(precisions)}) and tables")
        report = {}
        tab = tables(model) | extra_tables
        if reference is not None:
            report["deepspec"] = _deepspec_rounds(reference, model, tab, ids, feats)
            rep = report["deepspec"]
            if rep["drafts_identical"] < rep["rounds"] or rep["max_abs_confidence_logit_diff"] > 1e-3:
                raise ExportError(f"the converted drafter differs from the DeepSpec forward ({rep}); not installing it")
        markov_dtype = _markov_dtype(tab, markov_dtype, progress)
        if reference is not None and markov_dtype == "float16":
            half = {k: (v.astype(np.float16).astype(np.float32) if k in ("markov_in", "markov_out") else v)
                    for k, v in tab.items()}
            report["deepspec"]["drafts_identical_fp16_markov"] = _deepspec_rounds(
                reference, model, half, ids, feats)["drafts_identical"]
        table_entry, target_rows = _target_table(target_engine, manifest)
        table = target_rows if share_head and "fp32" in precisions and _equal(model.head, target_rows) else None
        embedding = table_entry.file if _equal(model.embed, target_rows) else rel("embedding.npy")
        (stage / "fp32").mkdir()
        export_onnx(model, stage / "fp32" / "model.onnx", shared_head=table is not None)
        report["fp32"] = _validate(model, stage / "fp32" / "model.onnx", cfg, ids, feats, table)
        if report["fp32"]["max_abs_logit_diff"] > 1e-2:
            raise ExportError(f"the exported drafter differs from PyTorch (max |Δlogit| "
                              f"{report['fp32']['max_abs_logit_diff']:.3g}); not installing it")
        own = stage / "fp32" / "model.onnx"  # the graph with its own head, that INT8 and FP16 derive from
        if table is not None and ("int8" in precisions or "fp16" in precisions):
            (stage / ".own-head").mkdir()
            own = stage / ".own-head" / "model.onnx"
            export_onnx(model, own)
        if "int8" in precisions:
            (stage / "int8").mkdir()
            kept = quantize_int8(own, stage / "int8" / "model.onnx")
            report["int8"] = {**_validate(model, stage / "int8" / "model.onnx", cfg, ids, feats), "fp32_matmuls": kept}
        if "fp16" in precisions:
            (stage / "fp16").mkdir()
            convert_fp16(own, stage / "fp16" / "model.onnx")
            report["fp16"] = _validate(model, stage / "fp16" / "model.onnx", cfg, ids, feats)
        shutil.rmtree(stage / ".own-head", ignore_errors=True)
        if "fp32" not in precisions:
            shutil.rmtree(stage / "fp32")
        w1, w2 = tab.pop("markov_in"), tab.pop("markov_out")  # [Vd + 1, r], [r, Vd]
        np.save(stage / "markov.npy", np.concatenate([w1, np.concatenate([w2.T, np.zeros_like(w1[:1])])], axis=1)
                .astype(markov_dtype))
        np.savez(stage / "tables.npz", **tab)
        if embedding == rel("embedding.npy"):
            np.save(stage / "embedding.npy", model.embed.numpy().astype(np.float16))
        if imported:
            (stage / "calibration.json").write_text(json.dumps(meta["calibration"], indent=1) + "\n")
        else:
            (stage / "calibration.json").write_bytes((weights / "calibration.json").read_bytes())
        progress("[3/3] validation: " + ", ".join(
            f"{p} max|Δlogit| {r['max_abs_logit_diff']:.2e} top-1 {r['top1_agreement']:.0%}"
            for p, r in report.items() if p != "deepspec")
            + ("" if reference is None else f"; DeepSpec forward: drafts identical in "
               f"{report['deepspec']['drafts_identical']}/{report['deepspec']['rounds']} rounds"
               + ("" if "drafts_identical_fp16_markov" not in report["deepspec"] else
                  f" ({report['deepspec']['drafts_identical_fp16_markov']} with the FP16 Markov tables)")))
        if table is not None:
            progress(f"      the FP32 graph reads its LM head from the target's embedding table "
                     f"({table.nbytes / 2**20:.0f} MiB not held twice)")
        stage.rename(target_engine / name)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    old_files = {v.file.split("/")[0] for v in manifest.variants if v.role == "drafter"}
    keep_files = [f for f in manifest.files if f.path.split("/")[0] not in old_files]
    new_files = [file_entry(target_engine, rel(p)) for p in
                 [f"{pr}/model.onnx" for pr in precisions] + ["tables.npz", "markov.npy"]
                 + (["embedding.npy"] if embedding == rel("embedding.npy") else [])]
    variants = [v for v in manifest.variants if v.role != "drafter"] + [
        Variant(role="drafter", width=b, precision=pr, backend="onnxruntime", file=rel(f"{pr}/model.onnx"),
                device="gpu" if pr == "fp16" else "any")
        for pr in precisions for b in sorted(blocks)]
    if imported:
        provenance = {**meta["provenance"], "validation": json.dumps(report)}
    else:
        training = meta["training"]
        provenance = {"weights": str(weights), "training_data": training["data"],
                      "training_steps": str(training["steps"]), "weights_sha256": digest,
                      "validation": json.dumps(report)}
    info = DrafterInfo(kind="dspark", slots=slots, draft_vocab=cfg.draft_vocab, markov_rank=cfg.markov_rank,
                       num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                       feature_layers=tuple(cfg.feature_layers), temperatures=tuple(meta["temperatures"]),
                       biases=tuple(meta.get("biases", ())), confidence=meta.get("confidence", "head"),
                       tables=rel("tables.npz"), embedding=embedding, markov=rel("markov.npy"),
                       provenance=provenance, head="target_table" if table is not None else "own")
    new = dataclasses.replace(manifest, variants=tuple(variants), files=tuple(keep_files + new_files), drafter=info)
    write_manifest(new, target_engine)
    for old in old_files:
        if old != name:
            shutil.rmtree(target_engine / old, ignore_errors=True)
    progress(f"done: {target_engine} lists the DSpark drafter (blocks {list(blocks)}, {', '.join(precisions)})")
    return target_engine
