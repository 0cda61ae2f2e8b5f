"""Distillation of a DSpark drafter against its frozen target (CPU-capable, resumable).

Every step samples ``seqs_per_step`` training sequences and ``anchors`` block anchors in the
answer part of each; all blocks of a sequence share that sequence's context keys/values and
are trained in one masked attention pass (block k sees context positions < its anchor and its
own slots, nothing else). Losses per slot k, weighted by w_k = exp(-(k-1)/γ):

    L = α_ce · CE(x*_k) + α_tv · ‖p_d,k − p_t,k‖₁ + α_conf · BCE(c_k, c*_k),  c*_k = 1 − ½‖p_d,k − p_t,k‖₁

with the target's distribution p_t known through its top-K (the mass beyond is treated as 0,
so c*_k is a slight underestimate). The Markov input is the true previous token, which equals
the drafter's own previous draft whenever the earlier drafts were accepted. Validation
measures greedy accepted length exactly that way on held-out sequences.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .data import Sequences
from .model import DSparkDraft

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainOptions:
    steps: int = 1500
    seqs_per_step: int = 8
    anchors: int = 40
    lr: float = 6e-4
    warmup: int = 50
    alpha_ce: float = 0.1
    alpha_tv: float = 0.9
    alpha_conf: float = 1.0
    short_block: int = 3  # a share of blocks is trained at this length (the block-4 variant)
    short_share: float = 0.25
    hard_share: float = 0.0  # share of anchor draws weighted toward tokens the target found unlikely (see anchor_weights)
    text_share: float = 0.4  # share of each step's sequences drawn from teacher-forced text (when any)
    checkpoint_every: int = 50
    validate_every: int = 250
    seed: int = 0
    bf16: bool = False  # forward and loss under CPU autocast to bfloat16 (weights and optimizer stay FP32)


def choose_draft_vocab(data: Sequences, size: int, vocab_size: int) -> np.ndarray:
    """The ``size`` target ids the target emits most (answer tokens, then its top-K guesses)."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size} must be in [1, {vocab_size}]")
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i in range(len(data)):
        a, b = data.span(i)
        np.add.at(counts, data.tokens[a + int(data.prompt_lens[i]):b], 1000)
    np.add.at(counts, data.top_ids[:, :4].ravel(), 1)
    return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int64)


def split(data: Sequences | None, held_out: float = 0.06, seed: int = 0, answers: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(train ids, held-out ids). Sequence i is held out by the i-th draw of one seeded stream,
    so adding data (more prompts, more shards) never moves a held-out sequence into training:
    a resumed or extended run is still validated on sequences it never trained on. Only the
    first ``answers`` sequences (the target's own answers; default all) can be held out: what
    follows them (teacher-forced text) always trains."""
    n = len(data) if answers is None else answers
    u = np.random.default_rng(seed).random(n)
    val = u < held_out
    if not val.any():
        val[int(np.argmin(u))] = True
    return np.concatenate([np.flatnonzero(~val), np.arange(n, n if data is None else len(data))]), np.flatnonzero(val)


HELD_OUT = "held_out.json"


def recorded_split(data: Sequences | None, work: Path, answers: int, held_out: float = 0.06,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``split`` that keeps the held-out set a run started with: ``work/held_out.json`` records
    the held-out answers and how many answers existed; answers added later are held out by the
    stable draw, earlier ones exactly as recorded. A resumed or extended run (more prompts, more
    text) is thus always validated on answers its checkpoint never trained on, whatever rule
    chose them. Written on first use. ``data`` may be None: only ``answers`` (the count) is used."""
    _, fresh = split(data, held_out, seed, answers)
    path = work / HELD_OUT
    if not path.is_file():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"answers": answers, "held_out": [int(i) for i in fresh]}) + "\n",
                       encoding="utf-8")
        os.replace(tmp, path)
    rec = json.loads(path.read_text(encoding="utf-8"))
    known = min(int(rec["answers"]), answers)
    val = np.zeros(answers, dtype=bool)
    val[[i for i in rec["held_out"] if i < known]] = True
    val[fresh[fresh >= known]] = True
    text = np.arange(answers, answers if data is None else len(data))
    return np.concatenate([np.flatnonzero(~val), text]), np.flatnonzero(val)


def sampling_weights(train_ids: np.ndarray, answers: int, text_share: float) -> np.ndarray | None:
    """Per-sequence probabilities giving teacher-forced text (ids ≥ ``answers``) ``text_share``
    of the draws; None (uniform) when there is no text."""
    is_text = train_ids >= answers
    n_text = int(is_text.sum())
    if n_text == 0 or n_text == train_ids.size:
        return None
    return np.where(is_text, text_share / n_text, (1.0 - text_share) / (train_ids.size - n_text))


def anchor_weights(data: Sequences, a: int, cand: np.ndarray, hard_share: float) -> np.ndarray | None:
    """Sampling probabilities over the candidate anchors ``cand`` (positions in the sequence
    starting at ``a``), or None for uniform. A runtime round starts right after the target
    overruled a draft, so its anchor tends to be a token the target itself was less sure of than
    the typical answer token. ``hard_share`` (in [0, 1)) of the probability mass goes to anchors
    in proportion to 1 − p, p the target's top-1 probability at the position before the anchor
    (the anchor's own probability whenever the anchor is the engine's greedy token); the rest is
    uniform, so every candidate keeps a nonzero chance."""
    if not 0.0 <= hard_share < 1.0:
        raise ValueError(f"hard_share {hard_share} must be in [0, 1)")
    if hard_share == 0.0 or cand.size == 0:
        return None
    p = np.exp(data.top_logp[a + cand - 1, 0].astype(np.float64))
    hard = np.clip(1.0 - p, 0.0, 1.0)
    total = hard.sum()
    uniform = np.full(cand.size, 1.0 / cand.size)
    if total <= 0.0:
        return uniform
    w = (1.0 - hard_share) * uniform + hard_share * hard / total
    return w / w.sum()


def make_batch(data: Sequences, seq_ids, anchors: int, slots: int, to_draft: np.ndarray, rng,
               short_block: int = 0, short_share: float = 0.0, fixed_anchors: list | None = None,
               hard_share: float = 0.0) -> dict:
    """Tensors for one step over sequences ``seq_ids`` (see the module docstring)."""
    vd = int(to_draft.max())
    spans = [data.span(int(i)) for i in seq_ids]
    lmax = max(b - a for a, b in spans)
    s, g = len(seq_ids), slots
    feats = np.zeros((s, lmax, data.aux.shape[1]), dtype=np.float32)
    anc = np.zeros((s, anchors), dtype=np.int64)
    anchor_pos = np.zeros((s, anchors), dtype=np.int64)
    glen = np.zeros((s, anchors), dtype=np.int64)  # effective block length, 0 = unused block
    prev = np.full((s, anchors, g), vd, dtype=np.int64)
    label = np.full((s, anchors, g), -100, dtype=np.int64)
    top_idx = np.zeros((s, anchors, g, data.top_ids.shape[1]), dtype=np.int64)
    top_p = np.zeros((s, anchors, g, data.top_ids.shape[1]), dtype=np.float32)
    valid = np.zeros((s, anchors, g), dtype=bool)
    for r, (i, (a, b)) in enumerate(zip(seq_ids, spans)):
        n_tok, p_len = b - a, int(data.prompt_lens[int(i)])
        feats[r, :n_tok] = data.aux[a:b]
        cand = np.arange(p_len, n_tok - 1)
        if fixed_anchors is not None:
            chosen = np.asarray(fixed_anchors[r], dtype=np.int64)
        elif cand.size:
            chosen = rng.choice(cand, size=min(anchors, cand.size), replace=False,
                                p=anchor_weights(data, a, cand, hard_share))
        else:
            chosen = np.zeros(0, dtype=np.int64)
        for c, n in enumerate(chosen[:anchors]):
            gl = short_block if (short_block and rng.random() < short_share) else g
            anc[r, c], anchor_pos[r, c], glen[r, c] = data.tokens[a + n], n, gl
            for j in range(g):
                t = n + j  # slot j predicts position t + 1 from the target's distribution at t
                if t + 1 >= n_tok:
                    break
                prev[r, c, j] = to_draft[data.tokens[a + t]]
                lab = to_draft[data.top_ids[a + t, 0]]  # the target engine's own choice
                label[r, c, j] = lab if lab < vd else -100
                ids = to_draft[data.top_ids[a + t]]
                top_idx[r, c, j] = np.where(ids < vd, ids, 0)
                top_p[r, c, j] = np.where(ids < vd, np.exp(data.top_logp[a + t].astype(np.float32)), 0.0)
                valid[r, c, j] = j < gl
    # Attention mask [S, 1, A*g, lmax + A*g]
    q_anchor = np.repeat(anchor_pos, g, axis=1)  # [S, A*g]
    ctx_ok = np.arange(lmax)[None, None, :] < q_anchor[:, :, None]
    blk = np.repeat(np.arange(anchors), g)
    slot = np.tile(np.arange(g), anchors)
    same = blk[:, None] == blk[None, :]
    key_slot_ok = slot[None, None, :] < np.repeat(glen, g, axis=1)[:, None, :]
    blk_ok = same[None] & key_slot_ok
    blk_ok |= (blk[:, None] == blk[None, :]) & (slot[:, None] == slot[None, :])[None]  # never an empty row
    mask = np.concatenate([ctx_ok, blk_ok], axis=2)[:, None]
    pos = q_anchor + np.tile(np.arange(g), anchors)[None]
    return {
        "feats": torch.from_numpy(feats), "anchors": torch.from_numpy(anc), "pos": torch.from_numpy(pos),
        "mask": torch.from_numpy(mask), "prev": torch.from_numpy(prev.reshape(s, -1)),
        "label": torch.from_numpy(label.reshape(s, -1)), "top_idx": torch.from_numpy(top_idx.reshape(s, anchors * g, -1)),
        "top_p": torch.from_numpy(top_p.reshape(s, anchors * g, -1)), "valid": torch.from_numpy(valid.reshape(s, -1)),
        "slot": torch.from_numpy(np.tile(np.arange(g), anchors)),
    }


def forward_batch(model: DSparkDraft, batch: dict) -> dict:
    """Per-slot tensors [S, A*γ]: log p_d(label), TV, c*, confidence logit, greedy hit."""
    feats, pos = batch["feats"], batch["pos"]
    s, lmax, _ = feats.shape
    ctx = model.context(feats)
    ctx_pos = torch.arange(lmax).expand(s, lmax)
    kv = [layer.context_kv(ctx, ctx_pos) for layer in model.layers]
    h = model.block_hidden(batch["anchors"], pos, kv, batch["mask"])
    bias, row = model.markov(batch["prev"])
    logits = model.base_logits(h) + bias
    logp = torch.log_softmax(logits, -1)
    p = logp.exp()
    label = batch["label"]
    lab_logp = logp.gather(-1, label.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    pd_top = p.gather(-1, batch["top_idx"]) * (batch["top_p"] > 0)
    tv = (pd_top - batch["top_p"]).abs().sum(-1) + (1 - pd_top.sum(-1))
    c_star = torch.minimum(pd_top, batch["top_p"]).sum(-1)
    conf_logit = model.confidence_logit(h.detach(), row.detach())
    hit = (logits.argmax(-1) == label) & (label >= 0)
    return {"lab_logp": lab_logp, "tv": tv, "c_star": c_star.detach(), "conf_logit": conf_logit, "hit": hit}


@torch.no_grad()
def greedy_rounds(model: DSparkDraft, batch: dict, anchors: int,
                  slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Greedy drafting exactly as the runtime does it (each slot's Markov input is the drafter's
    own previous draft). Returns (accepted drafts [N], raw confidence logits [N, γ], valid
    slots [N]) for the N used blocks, and which of the S·A blocks were used (a block is unused
    when it has no slot or its first label lies outside the draft vocabulary)."""
    feats, pos = batch["feats"], batch["pos"]
    s, lmax, _ = feats.shape
    ctx = model.context(feats)
    kv = [layer.context_kv(ctx, torch.arange(lmax).expand(s, lmax)) for layer in model.layers]
    h = model.block_hidden(batch["anchors"], pos, kv, batch["mask"]).reshape(s, anchors, slots, -1)
    u = model.base_logits(h)
    label = batch["label"].reshape(s, anchors, slots)
    valid = (batch["valid"] & (batch["label"] >= 0)).reshape(s, anchors, slots)
    prev = model.to_draft[batch["anchors"]]
    z, alive, accepted = [], torch.ones(s, anchors, dtype=torch.bool), torch.zeros(s, anchors, dtype=torch.long)
    for k in range(slots):
        bias, row = model.markov(prev)
        x = (u[:, :, k] + bias).argmax(-1)
        z.append(model.confidence_logit(h[:, :, k], row))
        alive &= (x == label[:, :, k]) & valid[:, :, k]
        accepted += alive.long()
        prev = x
    used = valid[:, :, 0].reshape(-1).numpy()
    z = torch.stack(z, -1).reshape(s * anchors, slots).numpy()[used]
    n_valid = valid.sum(-1).reshape(-1).numpy()[used]
    return accepted.reshape(-1).numpy()[used], z, n_valid, used


def loss_of(out: dict, batch: dict, opts: TrainOptions, slots: int) -> tuple[torch.Tensor, dict]:
    valid = batch["valid"].float()
    w = torch.exp(-batch["slot"].float() / slots)[None] * valid
    has_label = (batch["label"] >= 0).float()
    norm = w.sum().clamp(min=1.0)
    ce = -(out["lab_logp"] * w * has_label).sum() / norm
    tv = (out["tv"] * w).sum() / norm
    conf = (F.binary_cross_entropy_with_logits(out["conf_logit"], out["c_star"], reduction="none") * w).sum() / norm
    loss = opts.alpha_ce * ce + opts.alpha_tv * tv + opts.alpha_conf * conf
    return loss, {"ce": float(ce.detach()), "tv": float(tv.detach()), "conf": float(conf.detach())}


def accepted_lengths(hit: torch.Tensor, valid: torch.Tensor, anchors: int, slots: int) -> np.ndarray:
    """Greedy accepted drafts per block: leading run of hits over the block's valid slots."""
    h = (hit & valid).reshape(-1, anchors, slots).numpy()
    v = valid.reshape(-1, anchors, slots).numpy()
    run = np.cumprod(h, axis=-1).sum(-1)
    return run[v[..., 0]]


def validation_anchors(data: Sequences, seq_ids, anchors: int, seed: int = 1) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for i in seq_ids:
        a, b = data.span(int(i))
        cand = np.arange(int(data.prompt_lens[int(i)]), b - a - 1)
        out.append(np.sort(rng.choice(cand, size=min(anchors, cand.size), replace=False)) if cand.size else cand)
    return out


def held_out_rounds(model: DSparkDraft, data: Sequences, val_ids, slots: int, anchors: int | None = 24,
                    seed: int = 1, per_sequence: list | None = None, progress=None,
                    every_s: float = 60.0, rows: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``greedy_rounds`` over held-out sequences at fixed anchors (``anchors=None``: every
    answer position). Concatenated (accepted, z, valid slots) of the used blocks. With
    ``anchors=None``, ``per_sequence`` (a list) receives for each sequence the accepted drafts
    at each answer position in order, 0 at an unused block (its target token lies outside the
    draft vocabulary, so no draft matches it): what ``runtime_walk`` reads. ``progress`` (a
    callable taking a line) hears the count done, the rate and the time left at most once every
    ``every_s`` seconds, and once at the end; the walk over every position of thousands of
    answers takes many minutes.

    The blocks go through the drafter ``rows`` chunks of at most 64 anchors at a time, one chunk
    a row of the batch (one answer's chunks, or several answers'), in the order one chunk at a
    time would take them: a block's drafts depend only on its own answer (the attention mask
    keeps each row to its answer's positions), so batching changes what one call computes, not
    the rounds or their order."""
    if rows < 1:
        raise ValueError(f"rows must be at least 1, got {rows}")
    model.eval()
    rng = np.random.default_rng(seed)
    to_draft = model.to_draft.numpy()
    parts = []
    pending: list = []  # (answer's place in val_ids, first anchor's index, anchors, answer id)
    fulls: list[np.ndarray] = []

    def flush():
        width = max(chunk.size for _, _, chunk, _ in pending)
        batch = make_batch(data, [i for *_, i in pending], width, slots, to_draft, rng,
                           fixed_anchors=[chunk for _, _, chunk, _ in pending])
        acc, z, n_valid, used = greedy_rounds(model, batch, width, slots)
        used = used.reshape(len(pending), width)
        ends = np.cumsum(used.sum(1))  # acc holds each row's used blocks in turn
        starts = np.concatenate([[0], ends[:-1]])
        for r, (k, c0, _, _) in enumerate(pending):
            fulls[k][c0 + np.flatnonzero(used[r])] = acc[starts[r]:ends[r]]
        parts.append((acc, z, n_valid))
        pending.clear()

    t0 = last = time.monotonic()
    for done, i in enumerate(val_ids):
        if progress is not None and done and time.monotonic() - last >= every_s:
            last = time.monotonic()
            per = (last - t0) / done
            progress(f"{done}/{len(val_ids)} held-out answers ({per * 1000:.0f} ms each, "
                     f"ETA {per * (len(val_ids) - done) / 60:.1f} min)")
        a, b = data.span(int(i))
        cand = np.arange(int(data.prompt_lens[int(i)]), b - a - 1)
        if anchors is not None and cand.size > anchors:
            cand = np.sort(rng.choice(cand, size=anchors, replace=False))
        fulls.append(np.zeros(cand.size, dtype=np.int64))
        for c0 in range(0, cand.size, 64):
            pending.append((done, c0, cand[c0:c0 + 64], i))
            if len(pending) == rows:
                flush()
    if pending:
        flush()
    if per_sequence is not None and anchors is None:
        per_sequence.extend(fulls)
    if progress is not None:
        progress(f"{len(val_ids)}/{len(val_ids)} held-out answers in {(time.monotonic() - t0) / 60:.1f} min")
    model.train()
    if not parts:
        return np.zeros(0, dtype=np.int64), np.zeros((0, slots), dtype=np.float32), np.zeros(0, dtype=np.int64)
    return tuple(np.concatenate([p[k] for p in parts]) for k in range(3))


def runtime_walk(per_sequence: list[np.ndarray], slots: int) -> dict:
    """Greedy acceptance where the runtime meets it, from the accepted drafts at every answer
    position (``held_out_rounds(anchors=None, per_sequence=...)``): the first round drafts from
    the answer's first token, and each next round from the token right after the last accepted
    draft (the target's own token there), as decoding at a fixed block of ``slots`` drafts
    proceeds. Uniform anchors weigh every position alike; these rounds start right after a
    rejection more often, harder positions, so this τ is the lower and the one decoding sees
    on these answers. Returns τ (accepted + 1 a round), the rounds and the per-position reach."""
    rounds = []
    for acc in per_sequence:
        n = 0
        while n < acc.size:
            rounds.append(int(acc[n]))
            n += int(acc[n]) + 1
    r = np.asarray(rounds, dtype=np.int64)
    if not r.size:
        return {"tau": 1.0, "rounds": 0, "reach": [0.0] * slots}
    return {"tau": float(1 + r.mean()), "rounds": int(r.size),
            "reach": [float((r >= k).mean()) for k in range(1, slots + 1)]}


def validate(model: DSparkDraft, data: Sequences, val_ids, slots: int, anchors: int = 24) -> dict:
    """Greedy accepted length τ (accepted drafts + 1) and per-position reach on held-out data."""
    acc, _, _ = held_out_rounds(model, data, val_ids, slots, anchors)
    return {"tau": float(1 + acc.mean()), "blocks": int(acc.size),
            "reach": [float((acc >= k).mean()) for k in range(1, slots + 1)]}


def validate_runtime(model: DSparkDraft, data: Sequences, val_ids, slots: int) -> dict:
    """``runtime_walk`` over held-out data: τ in rounds anchored where decoding starts them."""
    per: list = []
    held_out_rounds(model, data, val_ids, slots, anchors=None, per_sequence=per)
    return runtime_walk(per, slots)


def _lr(step: int, opts: TrainOptions) -> float:
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    t = (step - opts.warmup) / max(1, opts.steps - opts.warmup)
    return opts.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def save_checkpoint(path: Path, model: DSparkDraft, opt, step: int, history: list) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.trainable_state(), "opt": opt.state_dict(), "step": step, "history": history,
                "config": model.cfg.to_dict()}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict:
    """A work folder's checkpoint, read as data only (``weights_only``: tensors, numbers,
    strings, lists and dicts; a pickle that would run code is refused, not executed)."""
    from dspark_edge.errors import ExportError

    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError or EOFError by cause
        raise ExportError(f"{path} is not a checkpoint this exporter wrote ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); delete it to start the "
                          "training afresh") from None
    if not isinstance(state, dict) or not {"model", "opt", "step", "history"} <= set(state):
        raise ExportError(f"{path} lacks the fields of a training checkpoint; delete it to start afresh")
    return state


def train(model: DSparkDraft, data: Sequences, train_ids, val_ids, work: Path, opts: TrainOptions,
          progress=None, answers: int | None = None) -> dict:
    """Train until ``opts.steps``, resuming from ``work/checkpoint.pt`` when present. Sequences
    from ``answers`` on are teacher-forced text, drawn with ``opts.text_share``."""
    weights = sampling_weights(np.asarray(train_ids), len(data) if answers is None else answers, opts.text_share)
    to_draft = model.to_draft.numpy()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.01, betas=(0.9, 0.95))
    ckpt, step, history = work / "checkpoint.pt", 0, []
    if ckpt.is_file():
        state = load_checkpoint(ckpt)
        if "config" in state and state["config"] != model.cfg.to_dict():
            from dspark_edge.errors import ExportError

            theirs = state["config"] if isinstance(state["config"], dict) else {}
            diff = sorted(k for k, v in model.cfg.to_dict().items() if theirs.get(k) != v)
            raise ExportError(f"{ckpt} holds a drafter of another shape ({', '.join(diff) or 'config'} differ: "
                              f"{', '.join(f'{k} {theirs.get(k)!r} there, {getattr(model.cfg, k)!r} now' for k in diff)}); "
                              "resume with the options that started it, or pass another --work folder")
        model.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["opt"])
        step, history = state["step"], state["history"]
        if progress:
            progress(f"resumed at step {step}")
    slots = model.cfg.slots
    t0, t_step0, recent = time.perf_counter(), step, []
    log_f = open(work / "train.log", "a", encoding="utf-8")
    model.train()
    while step < opts.steps:
        for g in opt.param_groups:
            g["lr"] = _lr(step, opts)
        # Each step's draws depend on (seed, step) alone: a run resumed from a checkpoint takes
        # exactly the batches the uninterrupted run takes, so it continues it bit for bit.
        rng = np.random.default_rng([opts.seed, step])
        ids = rng.choice(train_ids, size=opts.seqs_per_step, replace=False, p=weights)
        batch = make_batch(data, ids, opts.anchors, slots, to_draft, rng, opts.short_block, opts.short_share,
                           hard_share=opts.hard_share)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=opts.bf16):
            out = forward_batch(model, batch)
            loss, parts = loss_of(out, batch, opts, slots)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        hit = out["hit"] & batch["valid"]
        recent.append({**parts, "loss": float(loss.detach()), "acc1": float(hit.reshape(-1, slots)[:, 0].float().mean())})
        if step % 10 == 0 or step == opts.steps:
            avg = {k: float(np.mean([r[k] for r in recent])) for k in recent[0]}
            recent = []
            rate = (time.perf_counter() - t0) / (step - t_step0)
            msg = (f"step {step}/{opts.steps} loss {avg['loss']:.3f} ce {avg['ce']:.3f} tv {avg['tv']:.3f} "
                   f"conf {avg['conf']:.3f} acc@1 {avg['acc1']:.3f} ({rate:.1f} s/step, "
                   f"ETA {rate * (opts.steps - step) / 60:.0f} min)")
            log_f.write(json.dumps({"step": step, **avg, "s_per_step": rate}) + "\n")
            log_f.flush()
            if progress:
                progress(msg)
        if step % opts.validate_every == 0 or step == opts.steps:
            v = validate(model, data, val_ids, slots)
            history.append({"step": step, **v})
            log_f.write(json.dumps({"step": step, "validation": v}) + "\n")
            log_f.flush()
            if progress:
                progress(f"validation at step {step}: τ {v['tau']:.2f}, reach " +
                         " ".join(f"{x:.2f}" for x in v["reach"]))
        if step % opts.checkpoint_every == 0 or step == opts.steps:
            save_checkpoint(ckpt, model, opt, step, history)
    log_f.close()
    return {"steps": step, "history": history}
