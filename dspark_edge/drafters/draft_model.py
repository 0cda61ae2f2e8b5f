"""An independent draft model: a smaller causal LM with the target's tokenizer, in its own
engine folder (``python -m export draft-model``), run autoregressively with its own KV cache.

Each round feeds the committed tokens it has not seen, then drafts k tokens one at a time
(greedy, or sampled from q_i filtered exactly like the target's p_i; under a grammar, from the
tokens it allows after the drafts before, ``DraftRequest.allowed``). After feedback its
cache is rolled back to the longest prefix that matches the committed context.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..backends import BackendOptions
from ..decoder import DecoderModel
from ..errors import EngineError
from ..grammar import Constraint
from ..manifest import Manifest, read_manifest, verify_role_files
from ..sampling import coupled_pick, greedy_top, probs, sample
from .base import AcceptanceTracker, BaseDrafter, Draft, DraftRequest

log = logging.getLogger(__name__)


def check_compatible(target: Manifest, draft: Manifest, draft_dir: Path) -> None:
    """The draft model must share the target's vocabulary and tokenizer, token for token."""
    if draft.model.vocab_size != target.model.vocab_size:
        raise EngineError(f"draft model {draft_dir} has vocabulary size {draft.model.vocab_size} but the target has "
                          f"{target.model.vocab_size}: a draft model must use the target's tokenizer")
    t_tok = target.file_entry(target.tokenizer.file).sha256
    d_tok = draft.file_entry(draft.tokenizer.file).sha256
    if t_tok != d_tok:
        raise EngineError(f"draft model {draft_dir} has a different tokenizer.json than the target "
                          f"(sha256 {d_tok[:12]}… vs {t_tok[:12]}…): its token ids would not mean the same text; "
                          "export a draft model that uses the target's tokenizer")


class DraftModelDrafter(BaseDrafter):
    name = "draft_model"
    needs_hidden = False
    observed_confidence = False  # blends the draft model's probabilities in: the offset applies

    def __init__(self, engine_dir: str | Path, target_manifest: Manifest, precision: str | None = None,
                 options: BackendOptions | None = None, max_tokens: int = 8, verify_hashes: bool = True,
                 learn_across_generations: bool = False) -> None:
        engine_dir = Path(engine_dir)
        manifest = read_manifest(engine_dir)
        if not manifest.variants_for("draft_model"):
            raise EngineError(f"{engine_dir} holds no draft_model variant; export one with "
                              "`python -m export draft-model`")
        check_compatible(target_manifest, manifest, engine_dir)
        precision = precision or manifest.precisions("draft_model")[0]
        verify_role_files(manifest, engine_dir, "draft_model", precision, check_hashes=verify_hashes)
        self.model = DecoderModel(manifest, engine_dir, precision, options=options, role="draft_model")
        if 1 not in self.model.widths:
            raise EngineError(f"draft model {engine_dir} lists no width-1 variant")
        self.manifest = manifest
        self.max_tokens = max_tokens
        self.learn_across_generations = learn_across_generations  # see NgramDrafter
        self.stats = AcceptanceTracker()
        self._cache = self.model.new_cache()
        self._tokens: list[int] = []  # tokens whose K/V are committed in the draft cache

    def begin(self, prompt_ids: Sequence[int]) -> None:
        if not self.learn_across_generations:
            self.stats = AcceptanceTracker()
        self._cache.reset()
        self._tokens = []

    def _sync(self, context: Sequence[int]) -> np.ndarray:
        """Bring the cache to ``context[:-1]``, run the last token; return its logits."""
        n = 0
        limit = min(len(self._tokens), len(context) - 1)
        while n < limit and self._tokens[n] == context[n]:
            n += 1
        self._cache.rollback(n)
        del self._tokens[n:]
        new = np.asarray(context[n:], dtype=np.int64)
        out = self.model.prefill(self._cache, new)
        self._tokens.extend(int(t) for t in new)
        return out.logits[-1]

    def propose(self, request: DraftRequest, rng: np.random.Generator) -> Draft:
        k = min(request.max_tokens, self.max_tokens)
        if k < 1 or len(request.context) > self._cache.capacity:
            return Draft.empty()
        logits = self._sync(request.context)
        k = min(k, self._cache.free + 1)  # k drafts write k-1 more positions
        greedy = request.temperature == 0.0
        tokens, qs, conf = [], [], []
        for i in range(k):
            if request.allowed is not None:  # under a grammar: draw from what it allows after the drafts so far
                row = request.allowed(tokens)
                if row is None:  # the drafts end the answer
                    break
                logits = Constraint.apply(logits[None], row[None])[0]
            # The confidence is the model's top probability, known before the draw: a width chosen
            # from the probability of the token actually drawn would depend on that draw, and the
            # sampled output would no longer follow the target (scheduler.py).
            if greedy:
                x, top = greedy_top(logits)
                conf.append(top)
            else:
                q = probs(logits, request.temperature, request.top_k, request.top_p)
                conf.append(float(q.max()))
                x = (sample(q, rng) if request.coupled_seed is None
                     else coupled_pick(q, request.coupled_seed, request.position + i))
                qs.append(q)
            tokens.append(x)
            if i + 1 < k:
                logits = self.model.step(self._cache, np.array([x], dtype=np.int64)).logits[-1]
                self._cache.commit(1)
                self._tokens.append(x)
        # Blend the model's own probability with what has actually been accepted per position.
        k = len(tokens)
        if k == 0:
            return Draft.empty()
        observed = self.stats.confidence(k)
        confidence = np.sqrt(np.asarray(conf) * observed)
        return Draft(np.asarray(tokens, dtype=np.int64), np.stack(qs) if qs else None, confidence)

    def feedback(self, drafted: int, accepted: int, committed: Sequence[int]) -> None:
        if drafted:
            self.stats.update(drafted, accepted)
