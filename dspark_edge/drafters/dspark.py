"""The DSpark block drafter at run time (``python -m export drafter`` puts it in the target's
engine folder).

One round: the target features of the positions committed since the last round are appended
to the drafter's context cache inside its graph (each position once), and one pass over the
block [anchor, mask, …] gives base logits U [γ, Vd] and hidden states h [γ, H]. Then the
sequential step runs in numpy, left to right:

    r_k = W1[x_{k-1}]                   (x_0 = anchor)
    p_k = softmax(U_k + r_k · W2)       → x_k (argmax, or a draw for sampling)
    c_k = σ((w · [h_k ; r_k] + b) / T_k + b_k)   calibrated confidence, known before x_k is drawn
          (a drafter without a confidence head: the logit of max p_k in place of w · [h_k ; r_k] + b)

The LM head runs once per block inside the graph; the sequential step touches an r-wide row
and an r × Vd matrix. Drafts live in the draft vocabulary (``vocab_ids``); q is returned over
the full vocabulary (zero outside it) for lossless sampling. Under a grammar
(``DraftRequest.allowed``) x_k is drawn from the tokens it allows after x_1 … x_{k-1} (q is then
that masked distribution), and the block ends before a slot where none of the draft vocabulary
can follow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..backends import BackendOptions
from ..backends.tables import map_npy, shared_table, target_table
from ..errors import NPZ_ERRORS, ConfigError, EngineError
from ..manifest import Manifest, engine_path, verify_files, verify_role_files
from ..sampling import coupled_pick, probs, sample
from ..widths import Yardstick
from .base import BaseDrafter, Draft, DraftRequest

log = logging.getLogger(__name__)

HEAD_TABLE = "head_table"  # the drafter graph's input for a shared LM head (export.drafter.onnx_export)


def sigmoid(x: np.ndarray | float) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, dtype=np.float64)))


def max_probability_logit(logits: np.ndarray) -> float:
    """logit(p), p = softmax(logits).max(): the confidence a drafter without a confidence head
    reports for a slot (p clipped to [1e-12, 1 - 1e-12]). It reads the slot's logits, which
    depend on the drafts before it only, so like the head's it is known before the draft."""
    x = logits.astype(np.float64)
    lse = float(x.max() + np.log(np.exp(x - x.max()).sum()))
    p = min(max(float(np.exp(x.max() - lse)), 1e-12), 1.0 - 1e-12)
    return float(np.log(p) - np.log1p(-p))


def sequential_step(u: np.ndarray, h: np.ndarray, anchor: int, w1: np.ndarray, w2: np.ndarray,
                    conf_w: np.ndarray | None, conf_b: float, choose, top_k: int | None = None,
                    anchor_row: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The Markov head and the confidence logits, left to right over k slots.

    u [k, Vd] base logits, h [k, H]; ``anchor`` and the returned drafts are draft-vocabulary
    indices (Vd = outside it). ``anchor_row`` [r], when given, is the anchor's own Markov row
    (a drafter whose W1 has a row for every target token, when the anchor lies outside the
    draft vocabulary). ``choose(j, logits, candidates)`` picks draft j from its logits
    U_j + B_j over ``candidates`` (draft-vocabulary indices; None: all Vd) and returns an index
    into them. With ``top_k``, the Markov bias is added to the ``top_k`` largest base logits of
    each slot only (r × top_k work instead of r × Vd): drafts outside them are never proposed,
    which costs acceptance, never exactness. ``w1`` and ``w2`` may be FP16 (``markov.npy``):
    the rows a slot reads are widened to FP32; without ``top_k`` ``w2`` must be FP32. ``conf_w`` None: no confidence head, z_j is
    ``max_probability_logit`` of slot j's logits. Returns (drafts [k], raw confidence logits
    z [k]); z_j is computed from x_{j-1} only, before draft j is chosen.

    The products are written with ``einsum``, which numpy runs on the calling thread: ``@``
    hands an r × Vd product to the BLAS library, whose worker threads then busy-wait for more
    work and take the cores the target's next pass needs (on a 2-core CPU that doubled the
    target's verify time and the drafter's round: 89 vs 48 ms per k=1 round)."""
    k, hidden = h.shape
    drafts, z = np.zeros(k, dtype=np.int64), np.zeros(k)
    zh = None if conf_w is None else np.einsum("kh,h->k", h.astype(np.float64), conf_w[:hidden])
    narrow = top_k is not None and top_k < u.shape[1]
    cands = largest(u, top_k) if narrow else None
    prev = anchor
    for j in range(k):
        row = (anchor_row if j == 0 and anchor_row is not None else w1[prev]).astype(np.float32, copy=False)
        cand = cands[j] if narrow else None
        logits = (u[j, cand] + np.einsum("r,rv->v", row, w2[:, cand].astype(np.float32, copy=False)) if narrow
                  else u[j] + np.einsum("r,rv->v", row, w2))
        if zh is None:
            z[j] = max_probability_logit(logits)
        else:
            z[j] = float(zh[j] + np.einsum("r,r->", conf_w[hidden:], row)) + conf_b
        picked = choose(j, logits, cand)
        drafts[j] = prev = int(cand[picked]) if narrow else picked
    return drafts, z


def largest(u: np.ndarray, k: int) -> list[np.ndarray]:
    """The indices of the ``k`` largest values of each row of ``u`` [rows, n], one array a row
    (in no particular order; between equal values at the k-th place, any). The set is exactly
    ``np.argpartition(row, -k)[-k:]``'s up to such ties, found faster for k ≪ n: a threshold
    from every ``stride``-th value of the row (its q-th largest sample, q set so that about
    1.25 k values pass), then ``argpartition`` over the values at or above it only. Whenever
    fewer than ``k`` pass, the whole row is partitioned, so the set never depends on the draw.
    The partition over a sample and a comparison replace a partition of the whole row: the
    slot's largest cost in a round (docs/performance.md, "A DSpark round's sequential step")."""
    rows, n = u.shape
    stride = n // (8 * k)
    if stride < 2:
        return [np.argpartition(r, -k)[-k:] for r in u]
    sample = u[:, ::stride]
    q = min(sample.shape[1], -(-5 * k // (4 * stride)))  # ceil(1.25 k / stride) samples at or above
    thr = np.partition(sample, sample.shape[1] - q, axis=1)[:, sample.shape[1] - q]
    passing = u >= thr[:, None]
    out = []
    for r, keep in zip(u, passing):
        idx = np.flatnonzero(keep)
        if idx.size < k:
            idx = np.argpartition(r, -k)[-k:]
        elif idx.size > k:
            idx = idx[np.argpartition(r[idx], -k)[-k:]]
        out.append(idx)
    return out


def _mapped(path: Path) -> np.ndarray:
    """One of the drafter's own .npy tables, memory-mapped (``map_npy``); EngineError when it
    is not a readable one."""
    try:
        return map_npy(path)
    except (ValueError, OSError) as exc:
        raise EngineError(f"{path} is not a readable .npy table ({exc}); re-install the drafter") from None


MARKOV_TOP_K = 256
BLOCK_MEAN_WEIGHT = 0.2  # weight of the newest round in the block choice's running means
BLOCK_REFRESH = 16  # with a yardstick, the widest block runs at least once in this many rounds
FULL_MARKOV_MAX = 1024  # a draft vocabulary this small is biased whole (the top-k would hold a quarter of it)
MARKOV_COPY_MAX_BYTES = 64 << 20  # W2 larger than this as FP32 stays memory-mapped under a top-k (``_markov``)


class DSparkDrafter(BaseDrafter):
    name = "dspark"
    needs_hidden = True
    observed_confidence = False  # calibrated offline: the scheduler's online offset applies

    def __init__(self, engine_dir: str | Path, manifest: Manifest, precision: str | None = None,
                 options: BackendOptions | None = None, verify_hashes: bool = True,
                 markov_top_k: int | None | str = "auto", block_choice: bool = True) -> None:
        """``markov_top_k``: add the Markov bias to this many of each slot's largest base logits
        (``sequential_step``); None: to all of them; "auto": ``MARKOV_TOP_K`` when the draft
        vocabulary holds more than ``FULL_MARKOV_MAX`` tokens, else all. ``block_choice``: with
        the scheduler's yardstick, pick each round's block by its worth (``_choose_block``);
        False: always the widest block the round's drafts fit."""
        from ..backends.ort import open_session

        engine_dir = Path(engine_dir)
        info = manifest.drafter
        if info is None:
            raise EngineError(f"{engine_dir} has no DSpark drafter; add one with `python -m export drafter "
                              f"--target {engine_dir} --weights <drafter folder>`")
        available = manifest.precisions("drafter")
        precision = precision or available[0]
        if precision not in available:
            raise ConfigError(f"drafter precision {precision!r} is not in {engine_dir} (it has {available})")
        verify_role_files(manifest, engine_dir, "drafter", precision, check_hashes=verify_hashes)
        verify_files(manifest, engine_dir, [f for f in (info.tables, info.embedding, info.markov) if f],
                     check_hashes=verify_hashes)
        variants = manifest.variants_for("drafter", precision, "onnxruntime")
        self.info, self.precision = info, precision
        self.blocks = tuple(sorted(v.width for v in variants))  # verify widths = drafts + 1
        self.session = open_session(str(engine_dir / variants[0].file), options or BackendOptions())
        # A graph with a head_table input reads its LM head rows from the target's embedding
        # table (manifest: head "target_table"): the target's own mapping, not a copy.
        self.head_table = None
        if HEAD_TABLE in {i.name for i in self.session.get_inputs()}:
            table = target_table(engine_dir, manifest) if info.head == "target_table" else None
            if table is None:
                raise EngineError(f"{engine_dir}: the {precision} drafter graph reads its LM head from the target's "
                                  "embedding table, but the manifest lists none for it; re-install the drafter")
            verify_files(manifest, engine_dir, [table.file], check_hashes=verify_hashes)
            self.head_table = shared_table(engine_dir, manifest, table)
            if self.session.get_providers()[0] != "CPUExecutionProvider":
                log.warning("the %s drafter reads its LM head from the target's table in host memory: on %s every "
                            "round copies it to the device. Use the fp16 drafter there, or re-install with "
                            "--own-head", precision, self.session.get_providers()[0])
        try:  # every member read here: a damaged one fails now, not in a later round
            with np.load(engine_path(engine_dir, info.tables), allow_pickle=False) as z:
                t = {k: z[k] for k in z.files}
            self.vocab_ids = t["vocab_ids"].astype(np.int64)
            self.conf_b = float(t["conf_b"][0])
            self.conf_w = t["conf_w"].astype(np.float64) if info.confidence == "head" else None
            if info.markov is None and not {"markov_in", "markov_out"} <= t.keys():  # installed before markov.npy
                raise KeyError("markov_in, markov_out")
        except NPZ_ERRORS as exc:
            raise EngineError(f"{engine_dir / info.tables} is not a readable drafter table ({type(exc).__name__}: "
                              f"{str(exc)[:160]}); re-install the drafter") from None
        if markov_top_k == "auto":
            markov_top_k = MARKOV_TOP_K if self.vocab_ids.size > FULL_MARKOV_MAX else None
        if markov_top_k is not None and (isinstance(markov_top_k, bool) or not isinstance(markov_top_k, int)
                                         or markov_top_k < 1):
            raise ConfigError(f"markov_top_k must be a positive integer, None or 'auto', got {markov_top_k!r}")
        self.markov_top_k = markov_top_k
        self.w1, self.w2 = self._markov(engine_dir, info, t, markov_top_k)
        # An imported drafter with a d2t vocabulary keeps W1's rows for every target token (FP16):
        # an anchor outside the draft vocabulary reads its own row.
        self.anchor_rows = t.get("markov_anchor")
        target_rows = next((e for e in manifest.embedding_tables if e.file == info.embedding), None)
        # only read rows are paged in; the target's own table through its one mapping
        self.embedding = (shared_table(engine_dir, manifest, target_rows) if target_rows is not None
                          else _mapped(engine_path(engine_dir, info.embedding)))
        if self.embedding.shape != (manifest.model.vocab_size, manifest.model.hidden_size):
            raise EngineError(f"{engine_dir / info.embedding} holds shape {self.embedding.shape}, not the target's "
                              f"[{manifest.model.vocab_size}, {manifest.model.hidden_size}] embeddings; re-install the drafter")
        self.to_draft = np.full(manifest.model.vocab_size, self.vocab_ids.size, dtype=np.int64)
        self.to_draft[self.vocab_ids] = np.arange(self.vocab_ids.size)
        self.temperatures = np.asarray(info.temperatures, dtype=np.float64)
        self.biases = np.asarray(info.biases or (0.0,) * info.slots, dtype=np.float64)
        self.hidden_size = manifest.model.hidden_size
        self.vocab_size = manifest.model.vocab_size
        self.feature_dim = manifest.model.hidden_size * len(info.feature_layers)
        self._shape = (info.num_kv_heads, info.head_dim)
        # What each block has cost and the confidences it drew (running means over rounds, this
        # drafter's lifetime): the block choice under a yardstick (``_choose_block``).
        self.block_ms: dict[int, float] = {}
        self.expected_confidence = np.full(info.slots, np.nan)
        self._since_widest = 0
        self._block_runs: dict[int, int] = {}
        self.block_choice = block_choice
        self.begin(())

    def _markov(self, engine_dir: Path, info, tables, top_k) -> tuple[np.ndarray, np.ndarray]:
        """(W1 [Vd + 1, r], W2 [r, Vd]). From ``markov.npy`` (memory-mapped, FP16 or FP32): W1's
        rows read in place (one row a slot). W2 is held as FP32 in memory: with a Markov top-k
        as the transpose of a contiguous W2ᵀ, whose candidate rows a slot gathers without
        widening FP16 on every read (numpy widens FP16 element by element, which cost more than
        the rest of the gather); biasing the whole draft vocabulary, as W2 itself (the faster
        product there). A W2 whose FP32 copy would exceed
        ``MARKOV_COPY_MAX_BYTES`` stays in the mapping with a top-k (a round then reads and
        widens only its candidates' rows): memory wins over that speed for a very large table."""
        if info.markov is None:
            return tables["markov_in"].astype(np.float32), tables["markov_out"].astype(np.float32)
        vd, r = self.vocab_ids.size, info.markov_rank
        path = engine_path(engine_dir, info.markov)
        both = _mapped(path)
        if both.shape != (vd + 1, 2 * r) or both.dtype not in (np.float16, np.float32):
            raise EngineError(f"{path} holds a {both.dtype} array of shape {both.shape}, not the float16 or "
                              f"float32 [{vd + 1}, {2 * r}] Markov tables of this drafter; re-install the drafter")
        w2t = both[:vd, r:]
        if top_k is None:
            return both[:, :r], np.ascontiguousarray(w2t.T, dtype=np.float32)
        if vd * r * 4 > MARKOV_COPY_MAX_BYTES:
            return both[:, :r], w2t.T
        return both[:, :r], np.ascontiguousarray(w2t, dtype=np.float32).T

    @property
    def max_drafts(self) -> int:
        return max(self.blocks) - 1

    def begin(self, prompt_ids: Sequence[int]) -> None:
        empty = np.zeros((self._shape[0], 0, self._shape[1]), dtype=np.float32)
        self._past = [empty] * (2 * self.info.num_layers)
        self._n = 0  # context positions in the cache

    def _block_for(self, k: int) -> int:
        for b in self.blocks:
            if b - 1 >= k:
                return b
        return self.blocks[-1]

    def _choose_block(self, k: int, yardstick: Yardstick | None) -> int:
        """The block this round runs. Without a yardstick (a fixed draft count): the smallest
        that holds ``k`` drafts. With one, among the blocks up to that one, the one whose round
        is worth most by the scheduler's rule, ``Yardstick.best`` over the running mean of the
        confidences each slot drew (as the scheduler sees them) with that block's running
        drafting time spent: a wider block drafts more, and costs more, whether or not the
        scheduler then verifies its last drafts. A block not timed yet runs twice first (its first
        run with a new shape is slow), and the widest every ``BLOCK_REFRESH`` rounds, so that the
        confidences of the slots only it draws stay current."""
        widest = self._block_for(k)
        candidates = [b for b in self.blocks if b <= widest]
        if yardstick is None or len(candidates) == 1 or not self.block_choice:
            return widest
        untimed = [b for b in candidates if self._block_runs.get(b, 0) < 2]
        if untimed:
            return untimed[-1]
        known = self.expected_confidence
        self._since_widest += 1
        if np.isnan(known[:widest - 1]).any() or self._since_widest >= BLOCK_REFRESH:
            return widest
        worth = {b: yardstick.best(known[:b - 1], self.block_ms[b], [w for w in yardstick.widths if w <= b])[1]
                 for b in candidates}
        return max(candidates, key=lambda b: (worth[b], -b))

    def base(self, new_hidden: np.ndarray | None, anchor: int, position: int, slots: int):
        """Append the new context rows and run the block: (U [γ, Vd], h [γ, H])."""
        rows = np.zeros((0, self.feature_dim), np.float32) if new_hidden is None else new_hidden
        if self._n + rows.shape[0] != position:
            raise EngineError(f"drafter context out of step: {self._n} cached + {rows.shape[0]} new positions, "
                              f"but the anchor sits at {position}")
        feed = {"features": np.ascontiguousarray(rows, dtype=np.float32),
                "anchor_embedding": np.asarray(self.embedding[anchor], dtype=np.float32)[None],
                "block_positions": np.arange(position, position + slots, dtype=np.int64)}
        for i in range(self.info.num_layers):
            feed[f"past_key.{i}"], feed[f"past_value.{i}"] = self._past[2 * i], self._past[2 * i + 1]
        if self.head_table is not None:
            feed[HEAD_TABLE] = self.head_table
        out = self.session.run(None, feed)
        self._past, self._n = out[2:], position
        return out[0], out[1]

    def propose(self, request: DraftRequest, rng: np.random.Generator) -> Draft:
        k = min(request.max_tokens, self.max_drafts)
        anchor, position = int(request.context[-1]), len(request.context) - 1
        block = self._choose_block(k, request.yardstick)
        k = min(k, block - 1)
        t0 = time.perf_counter()
        u, h = self.base(request.new_hidden, anchor, position, block - 1)
        if k < 1:
            return Draft.empty()
        greedy = request.temperature == 0.0
        qs: list[np.ndarray] = []
        drawn: list[int] = []  # the drafts so far, as target ids (under a grammar)
        kept = k  # under a grammar: how many drafts can be kept (those before one it ends or bars)

        def choose(j: int, logits: np.ndarray, cand: np.ndarray | None) -> int:
            nonlocal kept
            if request.allowed is not None:
                ids = self.vocab_ids if cand is None else self.vocab_ids[cand]
                row = request.allowed(drawn) if j < kept else None
                keep = None if row is None else row[ids]
                if keep is None or not keep.any():  # no draft of this vocabulary can follow here
                    kept = min(kept, j)
                    return 0  # a placeholder, cut below
                logits = np.where(keep, logits, np.float32(-np.inf))
                picked = self._choose(j, logits, cand, greedy, request, qs, rng)
                drawn.append(int(ids[picked]))
                return picked
            return self._choose(j, logits, cand, greedy, request, qs, rng)

        anchor_row = None if self.anchor_rows is None else self.anchor_rows[anchor]
        idx, z = sequential_step(u[:k], h[:k], int(self.to_draft[anchor]), self.w1, self.w2, self.conf_w,
                                 self.conf_b, choose, self.markov_top_k, anchor_row)
        conf = sigmoid(z / self.temperatures[:k] + self.biases[:k])
        self._note_round(block, (time.perf_counter() - t0) * 1e3, conf, request.yardstick)
        return Draft(self.vocab_ids[idx[:kept]], np.stack(qs[:kept]) if qs[:kept] else None, conf[:kept])

    def _choose(self, j: int, logits: np.ndarray, cand: np.ndarray | None, greedy: bool, request: DraftRequest,
                qs: list, rng: np.random.Generator) -> int:
        """Draft ``j`` from its logits over ``cand`` (draft-vocabulary indices; None: all): the
        argmax, or a draw whose distribution over the target's vocabulary goes to ``qs``."""
        if greedy:
            return int(np.argmax(logits))
        qd = probs(logits, request.temperature, request.top_k, request.top_p)
        q = np.zeros(self.vocab_size)
        q[self.vocab_ids if cand is None else self.vocab_ids[cand]] = qd
        qs.append(q)
        if request.coupled_seed is not None:  # the target's noise for this position, over its vocabulary
            picked = int(self.to_draft[coupled_pick(q, request.coupled_seed, request.position + j)])
            return picked if cand is None else int(np.flatnonzero(cand == picked)[0])
        return sample(qd, rng)

    def _note_round(self, block: int, ms: float, conf: np.ndarray, yardstick: Yardstick | None) -> None:
        """Running means for ``_choose_block``: the block's drafting time, and each slot's
        confidence as the scheduler sees it (the slots this round drew)."""
        if block == self.blocks[-1]:
            self._since_widest = 0
        runs = self._block_runs[block] = self._block_runs.get(block, 0) + 1
        old = self.block_ms.get(block, ms)
        self.block_ms[block] = ms if runs <= 2 else old + BLOCK_MEAN_WEIGHT * (ms - old)
        seen = conf if yardstick is None else yardstick.shifted(conf)
        known = self.expected_confidence[:seen.size]
        self.expected_confidence[:seen.size] = np.where(np.isnan(known), seen,
                                                        known + BLOCK_MEAN_WEIGHT * (seen - known))

    def feedback(self, drafted: int, accepted: int, committed: Sequence[int]) -> None:
        """Nothing to learn: the confidences are calibrated offline."""
