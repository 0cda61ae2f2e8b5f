"""How well calibrated are a DSpark drafter's confidences, with its confidence head and without
one (the draft distribution's largest probability), before and after the scheduler's online
offset?

    python bench/confidence_calibration.py --engine engines/smollm2-135m --drafter DEEPSPEC_DIR [--limit 12]

The checkpoint is imported twice into copies of the engine: as it is, and as a copy without its
confidence head (``enable_confidence_head: false``, the head's tensors dropped). Each decodes the
project's benchmark prompts greedily with the confidence scheduler. For every verified draft up
to a round's first rejection (the conditional acceptance the confidences predict) the report
pairs the confidence with the outcome: expected calibration error (10 equal-width bins) and
AUROC of the raw confidences and of the ones the scheduler used (shifted by its online offset),
the mean confidence and the acceptance rate.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np


def ece(p: np.ndarray, y: np.ndarray, bins: int = 10) -> float:
    idx = np.minimum((p * bins).astype(int), bins - 1)
    return float(sum(abs(p[idx == b].mean() - y[idx == b].mean()) * (idx == b).mean()
                     for b in range(bins) if (idx == b).any()))


def auroc(p: np.ndarray, y: np.ndarray) -> float | None:
    pos, neg = p[y == 1], p[y == 0]
    if not len(pos) or not len(neg):
        return None
    order = np.argsort(np.concatenate([pos, neg]), kind="mergesort")
    ranks = np.empty(order.size)
    ranks[order] = np.arange(1, order.size + 1)
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def headless_copy(src: Path, dst: Path) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("dspark_calibration.json"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["enable_confidence_head"] = False
    cfg.pop("confidence_head_with_markov", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    w = {k: v for k, v in load_file(str(dst / "model.safetensors")).items() if not k.startswith("confidence_head.")}
    save_file(w, str(dst / "model.safetensors"))
    return dst


class Collector:
    def __init__(self) -> None:
        self.raw: list[float] = []
        self.used: list[float] = []
        self.y: list[int] = []

    def on_round(self, info) -> None:
        from dspark_edge.scheduler import shifted
        from dspark_edge.verify import judged

        if not info.drafted:
            return
        offset = info.decision.confidence_offset if info.decision is not None else 0.0
        n = judged(info.drafted, info.accepted)
        conf = list(info.confidence[:n])
        self.raw += conf
        self.used += list(shifted(conf, offset))
        self.y += [1 if j < info.accepted else 0 for j in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--drafter", type=Path, required=True, help="a DeepSpec checkpoint with a confidence head")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()

    import dspark_edge
    from dspark_edge.bench import load_prompts
    from dspark_export.drafter.install import install_drafter

    prompts = load_prompts()[: args.limit]
    report = {"engine": str(args.engine), "drafter": str(args.drafter), "prompts": len(prompts)}
    with tempfile.TemporaryDirectory(dir=args.engine.parent) as tmp:
        for name in ("head", "no head"):
            ckpt = args.drafter if name == "head" else headless_copy(args.drafter, Path(tmp) / "headless")
            engine = Path(tmp) / f"engine-{name.replace(' ', '-')}"
            shutil.copytree(args.engine, engine, ignore=shutil.ignore_patterns("drafter-*"))
            install_drafter(engine, ckpt, precisions=("fp32",), progress=lambda m: print(m, file=sys.stderr))
            pipe = dspark_edge.load(engine, "fp32", drafter="dspark")
            col = Collector()
            pipe.add_observer(col)
            for i, rec in enumerate(prompts):
                pipe.generate(rec.get("messages") or rec["prompt"], max_new_tokens=args.max_new_tokens, ignore_eos=True)
                print(f"[{name} {i + 1}/{len(prompts)}]", file=sys.stderr, flush=True)
            pipe.close()
            raw, used, y = np.asarray(col.raw), np.asarray(col.used), np.asarray(col.y)
            report[name] = {"verified_drafts": int(y.size), "acceptance": round(float(y.mean()), 4) if y.size else None,
                            "mean_raw_confidence": round(float(raw.mean()), 4) if y.size else None,
                            "ece_raw": round(ece(raw, y), 4) if y.size else None,
                            "ece_after_online_offset": round(ece(used, y), 4) if y.size else None,
                            "auroc": round(auroc(raw, y), 4) if y.size and auroc(raw, y) is not None else None}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
