"""``inspect``: an engine folder's manifest, variants, files, profile status and drafters."""

from __future__ import annotations

import json

from ..errors import DSparkError


def register(sub) -> None:
    """Add the ``inspect`` command to the subparsers ``sub``."""
    i = sub.add_parser("inspect", help="print an engine folder's manifest, variants, files and hashes, profile "
                                       "status and the telemetry sources of this machine (or --json)")
    i.add_argument("--engine", required=True, help="engine folder to inspect")
    i.add_argument("--verify-hashes", action="store_true", help="also check every file's sha256 against the manifest")
    i.add_argument("--json", action="store_true", help="print the manifest, profile status and telemetry as JSON")


def _ngram_table_summary(engine, manifest) -> dict | None:
    """The engine folder's corpus n-gram table as inspect reports it (None when it has none)."""
    from ..drafters.ngram_table import FILE_NAME, NgramTable
    from ..manifest import engine_path

    try:
        path = engine_path(engine, FILE_NAME)
        if not path.is_file():
            return None
        t = NgramTable.load_for(path, manifest)
    except DSparkError as exc:
        return {"file": FILE_NAME, "error": str(exc)}
    from ..drafters.ngram import calibration_weights

    cal = t.calibration
    calibration = None if cal is None else {
        "used": calibration_weights(t) is not None, "held_out_answers": cal.get("held_out_answers"), "judged_drafts": cal.get("judged_drafts"),
        "two_fold": cal.get("two_fold"), "constant": cal.get("constant")}
    return {"file": FILE_NAME, "format": t.meta.get("format"), "contexts": t.entries,
            "max_n": max(t.lengths, default=0), "answers": t.meta.get("answers"),
            "answer_tokens": t.meta.get("answer_tokens"), "calibration": calibration}


def cmd_inspect(args) -> int:
    from ..manifest import read_manifest, verify_files
    from ..strict_json import to_json_dict

    from ..profile import load_profile
    from ..telemetry import SystemReader

    m = read_manifest(args.engine)
    verify_files(m, args.engine, check_hashes=args.verify_hashes)
    prof, status = load_profile(args.engine)
    sources = SystemReader().sources()
    table = _ngram_table_summary(args.engine, m)
    from ..pipeline import auto_drafter

    auto = {p: auto_drafter(m, p) for p in m.precisions("target", "onnxruntime")}  # onnxruntime on the CPU
    mode = None
    if m.precisions("target", "onnxruntime"):
        from ..modes import choose_mode

        mode = choose_mode(m, args.engine, precision=None)  # what --precision auto --drafter auto load here
    if args.json:
        print(json.dumps({**to_json_dict(m), "profile": {"status": status,
                                                         "device_key": prof.device_key if prof else None,
                                                         "created_utc": prof.created_utc if prof else None},
                          "ngram_table": table,
                          "auto_drafter": auto,
                          "auto_mode": None if mode is None else {"precision": mode.precision,
                                                                  "drafter": mode.drafter, "reason": mode.reason},
                          "faithful_precisions": m.faithful_precisions("onnxruntime"),
                          "telemetry_sources": sources,
                          "hashes_verified": bool(args.verify_hashes)}, indent=2))
        return 0
    print(f"engine     {args.engine} (schema v{m.schema_version}, created {m.created_utc})")
    print(f"model      {m.model.name} [{m.model.architecture}] {m.model.num_layers} layers, hidden "
          f"{m.model.hidden_size}, heads {m.model.num_heads}/{m.model.num_kv_heads}, vocab {m.model.vocab_size}")
    print(f"source     {m.model.source} (sha256 {m.model.source_sha256[:12]}…)")
    print(f"tokenizer  eos {list(m.tokenizer.eos_ids)}, bos {m.tokenizer.bos_id} (add_bos={m.tokenizer.add_bos}), "
          f"chat template: {'yes' if m.tokenizer.chat_template_file else 'no'}")
    print(f"hidden     layers {list(m.hidden_state_layers)} -> {m.io.hidden_states}")
    print(f"graph      {'portable (standard operators' if m.io.kv_layout == 'append' else 'fused (ONNX Runtime'}"
          f", KV layout {m.io.kv_layout})")
    for role in ("target", "drafter", "draft_model"):
        for p in m.precisions(role):
            for backend in sorted({v.backend for v in m.variants_for(role, p)}):
                vs = m.variants_for(role, p, backend)
                files = {v.file for v in vs}
                gpu = "  [GPU]" if any(v.device == "gpu" for v in vs) else ""
                print(f"{role:<10} {p:<5} {backend:<11} widths {list(m.widths(role, p, backend))}  "
                      f"{', '.join(sorted(files))}{gpu}")
    if "int4_weights" in m.exporter:
        print(f"int4       weights: {m.exporter['int4_weights']}")
    for t in m.embedding_tables:
        print(f"embedding  {t.graph} gathers from {t.file} (memory-mapped)")
    for e in m.tensorrt:
        print(f"tensorrt   {e.precision:<5} {e.file}: profiles {[w or 'prefill' for w in e.profiles]}, context "
              f"<= {e.max_context}, TensorRT {e.tensorrt_version}, built for {e.gpu} (compute {e.compute_capability})")
    for r in m.validation:
        print(f"validation {r.precision:<5} max|Δlogit| {r.max_abs_logit_diff:.2e}  greedy "
              f"{r.greedy_tokens_matched}/{r.greedy_tokens_compared}  top-1 {r.teacher_forced_top1:.0%}  "
              f"{'passed' if r.passed else 'FAILED'}")
    if m.drafter is not None:
        d = m.drafter
        print(f"drafter    dspark: {d.num_layers} layers, {d.slots} slots, draft vocab {d.draft_vocab}, Markov rank "
              f"{d.markov_rank}, calibrated T {' '.join(f'{t:.2f}' for t in d.temperatures)}"
              + (f", b {' '.join(f'{b:+.2f}' for b in d.biases)}" if d.biases else ""))
        print("           LM head: " + ("the target's embedding table (FP32 graph; not held twice)"
                                       if d.head == "target_table" else "its own") + f"; embeddings: {d.embedding}")
    if table is not None:
        print(f"ngram      corpus table {table['file']}: " + (
            f"{table['contexts']} contexts (up to {table['max_n']} tokens) from {table['answers']} answers"
            if "error" not in table else f"unusable: {table['error']}"))
        cal = table.get("calibration")
        if cal is None and "error" not in table:
            print("           confidences estimated online (the table has no calibration)")
        elif cal is not None:
            fit = cal.get("two_fold") or {}
            print(f"           calibrated confidences{'' if cal['used'] else ' (fitted for other features: unused)'}: "
                  f"{cal['judged_drafts']} held-out drafts, log-loss {fit.get('log_loss')} "
                  f"(constant {(cal.get('constant') or {}).get('log_loss')}), ECE {fit.get('ece')}, "
                  f"AUROC {fit.get('auroc')}")
    if auto:
        print("auto       the rule's drafter: " + ", ".join(f"{d} for the {p} target" for p, d in auto.items())
              + " (onnxruntime on the CPU)")
    if mode is not None:
        print(f"           --precision auto --drafter auto: target {mode.precision}, drafter {mode.drafter or 'none'} "
              f"({mode.reason}); output the model's own at {', '.join(m.faithful_precisions('onnxruntime'))}")
    if prof is None:
        from ..profile import device_identity

        print(f"profile    {status} for this device ({device_identity()[0]}): the scheduler measures the verify "
              f"curve for a second at load; `python -m dspark_edge profile --engine {args.engine}` keeps one")
    else:
        timed = {t.precision for t in prof.timings if t.role == "target"}
        usable = [p for p in m.precisions("target") if p in timed and prof.times(args.engine, p, status)]
        print(f"profile    {status} ({prof.device_key}, {prof.created_utc}): timings of "
              f"{', '.join(usable) or 'no target precision'} in use; {len(prof.modes)} decoding modes raced")
    print(f"telemetry  {', '.join(sources)}")
    total = sum(f.size for f in m.files)
    print(f"files      {len(m.files)}, {total / 2**20:.1f} MiB, "
          f"{'sha256 verified' if args.verify_hashes else 'sizes verified'}")
    for f in sorted(m.files, key=lambda f: f.path):
        print(f"           {f.sha256[:16]}  {f.size / 2**20:9.2f} MiB  {f.path}")
    return 0
