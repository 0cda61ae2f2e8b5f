"""The public runtime: ``load(engine_dir)`` → ``Pipeline`` → ``generate`` / ``stream``.

One loop serves plain and speculative decoding: each round the drafter (if any) proposes
tokens, the target runs once over [pending token, drafts…] at a listed verify width, the
drafts are verified (greedy or rejection sampling), and the KV cache keeps only the
committed positions. Without drafts a round is a plain width-1 step. Each generation starts
from an empty KV cache, so a failed or cancelled generation leaves the pipeline usable.
One generation at a time per pipeline: a second concurrent call is refused with a clear
error (create one pipeline per thread instead).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .backends import BackendOptions
from .config import GenerationConfig, GenerationResult, GenerationStats
from .errors import ConfigError, DSparkError, GenerationError, PromptError
from .manifest import Manifest, read_manifest, verify_role_files
from .decoder import DecoderModel
from .drafters import NGRAM_SPECS, Draft, DraftRequest, create as create_drafter
from .sampling import choose, coupled_choice
from .scheduler import CostModel, Decision, Scheduler, SchedulerConfig
from .telemetry import Reader, Sampler, Snapshot
from .tokenizer import IncrementalDecoder, Tokenizer
from .verify import judged, verify_coupled, verify_greedy, verify_sampling

log = logging.getLogger(__name__)

Prompt = str | Sequence[Mapping[str, str]]
MAX_DRAFTER_FAILURES = 3


def load(engine_dir: str | Path, precision: str | None = None, *, drafter=None, backend: str = "onnxruntime",
         options: BackendOptions | None = None, verify_hashes: bool = True,
         scheduler: SchedulerConfig | bool | None = None, telemetry: Reader | None = None) -> "Pipeline":
    """Open an engine folder. ``precision`` defaults to the most precise one exported.

    ``drafter``: None (plain decoding), "dspark" / "dspark:<precision>" (the engine folder's
    DSpark drafter), "ngram" (prompt lookup, with the engine folder's corpus n-gram table
    when it has one, and the confidence model calibrated with it), "ngram:online" (the same table,
    confidences estimated online), "ngram:prompt" (prompt lookup alone), "self" / "self:<precision>" (the
    engine folder's INT8 graph, or that precision's, drafts for the target over its KV cache; the
    target must be more precise), "ngram+self" (the n-gram drafter and that copy), the path of a
    draft-model engine folder, or a Drafter object. ``verify_hashes`` checks the sha256 of the files
    this precision uses (sizes are always checked).

    ``scheduler``: with a drafter, the confidence scheduler picks each round's verify width
    (default ``SchedulerConfig()``; ``False`` keeps the simple survival cut). ``telemetry``: the
    reader it samples (default: this machine's ``SystemReader``).
    """
    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    drafter_options = drafter_backend_options(drafter, options)
    precision = precision or (manifest.precisions("target", backend) or [None])[0]
    verify_role_files(manifest, engine_dir, "target", precision, check_hashes=verify_hashes)
    target = DecoderModel(manifest, engine_dir, precision, backend, options)
    tokenizer = Tokenizer.from_engine(engine_dir, manifest)

    def make_drafter():
        return create_drafter(drafter, manifest, options=drafter_options, verify_hashes=verify_hashes,
                              engine_dir=engine_dir)

    pipe = Pipeline(manifest, engine_dir, target, tokenizer, make_drafter())
    if hasattr(pipe.drafter, "bind_target"):  # refuse a cache it cannot share now, not mid-generation
        pipe.drafter.bind_target(target, pipe._cache)
    if pipe.drafter is not None and scheduler is not False:
        pipe.enable_scheduler(scheduler if isinstance(scheduler, SchedulerConfig) else SchedulerConfig(),
                              telemetry, make_drafter if isinstance(drafter, (str, Path)) else None)
    return pipe


def drafter_backend_options(drafter, options: BackendOptions | None) -> BackendOptions | None:
    """The backend options a drafter given by name or path runs with: those of the target, but
    without thread spinning for a drafter with its own model. Two sessions take turns on the
    same cores, and the drafter's threads must not spin-wait after its short pass (a spinning
    drafter made the next width-2 target pass 61 instead of 40 ms, 2-core EPYC); the target
    keeps its own setting (docs/PERFORMANCE.md, "Two thread pools and BLAS"). Better still, with
    ``BackendOptions.shared_threads`` (``python -m dspark_edge`` sets it for such drafters) both run on
    one process-wide pool (docs/PERFORMANCE.md, "Self-drafting")."""
    if has_own_model(drafter) and not (options is not None and options.shared_threads):
        log.info("drafter in use: onnxruntime thread spinning disabled for the drafter's session")
        return replace(options or BackendOptions(), allow_spinning=False)
    return options


def has_own_model(drafter) -> bool:
    """Whether a drafter given by name or path runs a graph of its own beside the target."""
    return isinstance(drafter, (str, Path)) and str(drafter) not in (*NGRAM_SPECS, "none")


class Pipeline:
    def __init__(self, manifest: Manifest, engine_dir: Path, target: DecoderModel, tokenizer: Tokenizer,
                 drafter=None) -> None:
        self.manifest = manifest
        self.drafter = drafter
        self.engine_dir = engine_dir
        self.target = target
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(manifest.tokenizer.eos_ids)
        self._cache = target.new_cache()
        self._lock = threading.Lock()
        self.scheduler: Scheduler | None = None
        self._sampler: Sampler | None = None
        self._make_drafter = None
        self._unloaded = False  # the drafter was released under memory pressure
        self.profile_status = "unused"
        self.observers: list = []  # see add_observer
        if 1 not in target.widths:
            raise ConfigError(f"plain decoding needs a width-1 target variant; this engine lists {target.widths}")

    # -- scheduling ---------------------------------------------------------------------------
    def enable_scheduler(self, config: SchedulerConfig, telemetry: Reader | None = None, make_drafter=None) -> None:
        """Cost curve from this device's profile (or a quick measurement when there is none or
        it is stale), telemetry sampled in the background."""
        from .profile import cost_curve
        from .telemetry import SystemReader

        verify, status = cost_curve(self.target, self.engine_dir)
        self.profile_status = status
        if status == "throttled":
            log.warning("the device profile was measured while throttled; costs are corrected online")
        self.scheduler = Scheduler(CostModel(verify, 0.0, config.cost_window, config.min_observations),
                                   self.target.widths, config)
        self._sampler = Sampler(telemetry or SystemReader())
        self._make_drafter = make_drafter

    def telemetry(self) -> Snapshot | None:
        """The latest background telemetry reading (None when nothing samples it: see
        ``start_telemetry``)."""
        return None if self._sampler is None else self._sampler.latest

    def start_telemetry(self, reader: Reader | None = None) -> None:
        """Sample telemetry in the background even without the scheduler (for traces and
        displays). A no-op when it already runs."""
        from .telemetry import SystemReader

        if self._sampler is None:
            self._sampler = Sampler(reader or SystemReader())

    # -- observers --------------------------------------------------------------------------
    def add_observer(self, observer) -> None:
        """Call ``observer.on_round(RoundInfo)`` after every target pass and
        ``observer.on_generation(GenerationResult)`` when a generation ends (also one that
        failed). Either method may be absent. An observer that raises is logged and dropped:
        it never takes a generation down. ``dspark_edge.metrics`` has a JSON-lines trace writer
        and Prometheus counters."""
        self.observers.append(observer)

    def remove_observer(self, observer) -> None:
        self.observers.remove(observer)

    def _notify(self, method: str, arg) -> None:
        for obs in list(self.observers):
            fn = getattr(obs, method, None)
            if fn is None:
                continue
            try:
                fn(arg)
            except Exception as exc:
                log.warning("observer %r failed in %s (%s: %s); removed", obs, method, type(exc).__name__, exc)
                self.observers.remove(obs)

    def twin(self) -> "Pipeline":
        """A pipeline over the same loaded target and tokenizer with its own KV cache and no
        drafter: plain decoding next to this one without loading the model twice. The two may
        take turns in one thread (as the demo's race does), not run in two threads at once:
        they share the session's output buffers."""
        return Pipeline(self.manifest, self.engine_dir, self.target, self.tokenizer, None)

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None

    def _restore_drafter(self) -> None:
        """After a memory squeeze: take the drafter back once memory allows."""
        if self._unloaded and self._make_drafter is not None and self.scheduler is not None:
            snap = self.telemetry()
            if snap is not None:
                self.scheduler.update_modes(snap)
            if self.scheduler.memory_low:
                return
            self.drafter, self._unloaded = self._make_drafter(), False
            log.info("drafter reloaded")

    # -- prompts ----------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt (used as is) or of chat messages (through the chat template)."""
        if isinstance(prompt, (str, bytes, bytearray)):
            if not prompt.strip():
                raise PromptError("prompt is empty or whitespace only: give some text or chat messages")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = self.tokenizer.encode_chat(prompt)
        if not ids:
            raise PromptError("prompt encodes to no tokens: give some text or chat messages")
        return ids

    def _fit_context(self, ids: list[int], config: GenerationConfig) -> tuple[list[int], int]:
        capacity = self.target.capacity
        if len(ids) < capacity:
            return ids, 0
        if config.context_policy == "error":
            raise PromptError(f"prompt has {len(ids)} tokens but the context holds {capacity}: shorten it, "
                              "load with a larger max_context, or use context_policy='truncate'")
        reserve = max(1, min(config.max_new_tokens, capacity // 4))
        keep = capacity - reserve
        return ids[-keep:], len(ids) - keep

    # -- generation -------------------------------------------------------------------------
    def generate(self, prompt: Prompt, config: GenerationConfig | None = None, **overrides) -> GenerationResult:
        """Decode a whole answer. ``overrides`` replace fields of ``config``."""
        stream = self.stream(prompt, config, **overrides)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt: Prompt, config: GenerationConfig | None = None, **overrides) -> "TextStream":
        """An iterator of text pieces as they are decided; ``.result`` is set when it ends."""
        config = config or GenerationConfig()
        if overrides:
            try:
                config = replace(config, **overrides)
            except TypeError as exc:
                raise ConfigError(f"unknown generation option: {exc}") from exc
        vocab = self.manifest.model.vocab_size
        if any(t >= vocab for t in config.stop_token_ids):
            raise ConfigError(f"stop_token_ids {list(config.stop_token_ids)} lie outside the vocabulary "
                              f"(ids 0..{vocab - 1})")
        ids = self.encode_prompt(prompt)
        ids, truncated = self._fit_context(ids, config)
        return TextStream(self, ids, truncated, config)


class TextStream:
    """Iterates text pieces of one generation; ``cancel()`` stops it after the current step."""

    def __init__(self, pipeline: Pipeline, prompt_ids: list[int], truncated: int, config: GenerationConfig) -> None:
        self._pipeline = pipeline
        self._prompt_ids = prompt_ids
        self._truncated = truncated
        self.config = config
        self.result: GenerationResult | None = None
        self.token_ids: list[int] = []
        self.last_round: RoundInfo | None = None  # the latest target pass, for live displays
        self.from_draft: list[bool] = []  # parallel to token_ids: True where an accepted draft gave it
        self._cancel = threading.Event()
        self._iter = self._run()

    def __iter__(self) -> Iterator[str]:
        return self._iter

    def __next__(self) -> str:
        return next(self._iter)

    def cancel(self) -> None:
        """Stop after the current round; iterating on ends the stream with stop_reason "cancelled"."""
        self._cancel.set()

    def close(self) -> None:
        """Abandon the generation now (no result): frees the pipeline for the next one. Safe to
        call at any time, also after the stream ended."""
        self._iter.close()

    def _run(self) -> Iterator[str]:
        p = self._pipeline
        if not p._lock.acquire(blocking=False):
            raise DSparkError("this pipeline is already generating in another thread or stream: "
                              "finish that one first, or load one pipeline per thread")
        try:
            yield from self._decode(p)
        finally:
            p._lock.release()

    def _decode(self, p: Pipeline) -> Iterator[str]:
        cfg = self.config
        rng = np.random.default_rng(cfg.seed)
        coupled = cfg.temperature > 0 and cfg.sampling == "coupled"
        seed = cfg.seed  # coupled sampling's per-position noise needs one: a fresh one when none is given
        if coupled and seed is None:
            seed = int(np.random.SeedSequence().entropy % 2**63)
        eos = frozenset() if cfg.ignore_eos else p.eos_ids | set(cfg.stop_token_ids)
        widths_listed = p.target.widths
        if cfg.speculative:
            p._restore_drafter()
        drafter = p.drafter if cfg.speculative else None
        sched = p.scheduler if (drafter is not None and cfg.draft_tokens is None) else None
        max_drafts = max(widths_listed) - 1
        if cfg.draft_tokens is not None:
            if cfg.draft_tokens + 1 not in widths_listed:
                raise ConfigError(f"draft_tokens={cfg.draft_tokens} needs verify width {cfg.draft_tokens + 1}, "
                                  f"which this engine does not list {widths_listed}; pick one of "
                                  f"{[w - 1 for w in widths_listed]}")
            max_drafts = cfg.draft_tokens
        detok = IncrementalDecoder(p.tokenizer)
        cache = p._cache
        cache.reset()
        st = _RoundStats(max_drafts)
        text, emitted = "", 0
        hold = max((len(s) for s in cfg.stop), default=1) - 1  # chars that may start a stop string
        stop_reason, error, drafter_disabled, failures = "max_new_tokens", None, None, 0
        t0 = time.perf_counter()
        prefill_s = 0.0
        new_from_draft = 0  # how many of ``new`` are accepted drafts (the rest: the target's own)
        try:
            if cfg.max_new_tokens > 0:
                committed = list(self._prompt_ids)
                wants_hidden = drafter is not None and getattr(drafter, "needs_hidden", False)
                hidden_rows: list[np.ndarray] | None = [] if wants_hidden else None
                out = p.target.prefill(cache, np.asarray(committed, dtype=np.int64), hidden_sink=hidden_rows)
                new = [coupled_choice(out.logits[-1], cfg.temperature, cfg.top_k, cfg.top_p, seed, 0) if coupled
                       else choose(out.logits[-1], cfg.temperature, cfg.top_k, cfg.top_p, rng)]
                prefill_s = time.perf_counter() - t0
                if drafter is not None:
                    bind = getattr(drafter, "bind_target", None)
                    if bind is not None:  # a drafter that drafts over the target's KV cache
                        bind(p.target, cache)
                    drafter.begin(committed)
                while True:
                    done = False
                    for i, tok in enumerate(new):  # emit this round's tokens in order; stop mid-block if needed
                        self.token_ids.append(tok)
                        self.from_draft.append(i < new_from_draft)
                        if tok in eos:
                            stop_reason, done = "eos", True
                            break
                        text += detok.push([tok])
                        cut = _find_stop(text, cfg.stop, max(0, emitted - hold))
                        if cut is not None:
                            text, stop_reason, done = text[:cut], "stop_string", True
                            break
                        if len(self.token_ids) >= cfg.max_new_tokens:
                            done = True
                            break
                    if len(text) - hold > emitted and stop_reason != "stop_string":
                        piece, emitted = text[emitted:len(text) - hold], len(text) - hold
                        yield piece
                    if done:
                        break
                    if self._cancel.is_set():
                        stop_reason = "cancelled"
                        break
                    if cache.free < 1:
                        stop_reason = "context_full"
                        break
                    pending = new[-1]
                    # Drafts past the token budget or the context are wasted work.
                    k_max = min(max_drafts, cfg.max_new_tokens - len(self.token_ids) - 1, cache.free - 1)
                    draft = Draft.empty()
                    draft_ms = 0.0
                    said = None  # the drafter's account of this round's proposal
                    t_d = None  # when this round's drafting began, if it drafted
                    snap = p.telemetry()
                    wants = sched is None or sched.wants_draft(snap)
                    if sched is not None and sched.memory_low and drafter is not None:
                        drafter_disabled = f"available memory {snap.mem_available_mb:.0f} MiB is low: drafter unloaded"
                        log.warning("%s", drafter_disabled)
                        drafter, hidden_rows = None, None
                        if p._make_drafter is not None:
                            p.drafter, p._unloaded = None, True  # release its session; reloaded when memory allows
                    if drafter is not None and k_max > 0 and wants:
                        t_d = time.perf_counter()
                        try:
                            new_hidden = None
                            if hidden_rows is not None:
                                new_hidden = np.concatenate(hidden_rows) if hidden_rows else None
                                hidden_rows.clear()
                            proposal = drafter.propose(DraftRequest(
                                committed + [pending], k_max, cfg.temperature, cfg.top_k, cfg.top_p, new_hidden,
                                coupled_seed=seed if coupled else None, position=len(self.token_ids),
                                verify_cost=None if sched is None else sched.costs.verify,
                                confidence_offset=0.0 if sched is None else sched.offset), rng)
                            _check_draft(proposal, k_max, p.manifest.model.vocab_size)
                            draft, failures = proposal, 0
                            said = getattr(drafter, "last_proposal", None)
                            said = dict(said) if isinstance(said, dict) else None
                        except Exception as exc:  # a drafter must never take the generation down
                            failures += 1
                            log.warning("drafter %s failed (%s: %s)", drafter.name, type(exc).__name__, exc)
                            if failures >= MAX_DRAFTER_FAILURES:
                                drafter_disabled = f"{failures} consecutive failures, last: {type(exc).__name__}: {exc}"
                                log.warning("speculation disabled for this generation: %s", drafter_disabled)
                                drafter, hidden_rows = None, None
                        draft_ms = (time.perf_counter() - t_d) * 1e3
                        st.draft_s += draft_ms / 1e3
                    decision = None
                    # Confidences that are already this generation's observed rates get no offset.
                    observed = bool(getattr(drafter, "observed_confidence", False))
                    source = getattr(drafter, "source", None) if t_d is not None else None
                    if sched is not None:
                        decision = sched.decide(draft.confidence, snap, shift=not observed, source=source)
                        if t_d is not None:  # after the choice: it must not see this round's own time
                            sched.costs.observe_draft(draft_ms, source=source)
                        st.modes[decision.mode] = st.modes.get(decision.mode, 0) + 1
                        draft = draft.trimmed(decision.width - 1)
                    elif cfg.draft_tokens is None and len(draft) > 1:
                        draft = draft.trimmed(_survival_cut(draft.confidence, cfg.min_survival))
                    # The widest listed width the draft fills: an unfilled width is never padded.
                    width = max(w for w in widths_listed if w <= len(draft) + 1)
                    draft = draft.trimmed(width - 1)
                    t_v = time.perf_counter()
                    out = p.target.step(cache, np.concatenate(([pending], draft.tokens)).astype(np.int64))
                    if cfg.temperature == 0.0:
                        outcome = verify_greedy(draft.tokens, out.logits)
                    elif coupled:  # row 0 decides answer position len(token_ids)
                        outcome = verify_coupled(draft.tokens, out.logits, cfg.temperature, cfg.top_k, cfg.top_p,
                                                 seed, len(self.token_ids))
                    else:
                        outcome = verify_sampling(draft.tokens, draft.q, out.logits, cfg.temperature,
                                                  cfg.top_k, cfg.top_p, rng)
                    verify_ms = (time.perf_counter() - t_v) * 1e3
                    st.verify_s += verify_ms / 1e3
                    if sched is not None:
                        sched.observe(width, verify_ms)
                        if t_d is not None:
                            # Every round that paid for drafting counts toward the gate, also one
                            # whose drafts were all declined: its token cost a draft and a pass.
                            sched.observe_round(1 + outcome.accepted, (time.perf_counter() - t_d) * 1e3)
                        if len(draft) and not observed:
                            sched.observe_acceptance(draft.confidence, outcome.accepted)
                    cache.commit(1 + outcome.accepted)  # the anchor and the accepted drafts
                    if hidden_rows is not None and out.hidden is not None:
                        hidden_rows.append(out.hidden[:1 + outcome.accepted].copy())
                    committed.append(pending)
                    committed.extend(outcome.tokens[:-1])
                    st.record(width, len(draft), outcome)
                    self.last_round = RoundInfo(width, len(draft), outcome.accepted,
                                                tuple(float(c) for c in draft.confidence), st.draft_n, st.accepted,
                                                decision, index=st.rounds, tokens=tuple(int(t) for t in outcome.tokens),
                                                draft_ms=draft_ms, verify_ms=verify_ms,
                                                t_s=time.perf_counter() - t0, telemetry=snap, drafting=said)
                    if p.observers:
                        p._notify("on_round", self.last_round)
                    if drafter is not None and len(draft):
                        drafter.feedback(len(draft), outcome.accepted, committed)
                    new, new_from_draft = list(outcome.tokens), outcome.accepted
                if stop_reason not in ("stop_string", "eos"):
                    text += detok.flush()
                    cut = _find_stop(text, cfg.stop, max(0, emitted - hold))
                    if cut is not None:
                        text, stop_reason = text[:cut], "stop_string"
        except DSparkError as exc:
            stop_reason, error = "error", str(exc)
            log.error("generation failed after %d tokens: %s", len(self.token_ids), exc)
        except Exception as exc:  # a backend or numpy failure: report it with the partial output
            stop_reason, error = "error", f"{type(exc).__name__}: {exc}"
            log.exception("generation failed after %d tokens", len(self.token_ids))
        finally:
            cache.reset()
        total = time.perf_counter() - t0
        stats = st.finish(prompt_tokens=len(self._prompt_ids), new_tokens=len(self.token_ids),
                          prompt_truncated=self._truncated, prefill_s=prefill_s,
                          decode_s=max(0.0, total - prefill_s),
                          drafter=p.drafter.name if (p.drafter is not None and cfg.speculative) else "none",
                          drafter_disabled=drafter_disabled, modes=dict(st.modes))
        self.result = GenerationResult(text=text, token_ids=tuple(self.token_ids), stop_reason=stop_reason,
                                       stats=stats, error=error)
        if p.observers:
            p._notify("on_generation", self.result)
        if error is not None:
            raise GenerationError(f"generation failed: {error}", partial=self.result)
        if len(text) > emitted:
            yield text[emitted:]


@dataclass(frozen=True)
class RoundInfo:
    """One target pass: what was drafted, verified and committed, what it cost, and why."""

    width: int  # verify width of this target pass
    drafted: int
    accepted: int
    confidence: tuple[float, ...]  # the drafter's per-position confidence
    draft_n_total: int  # so far in this generation
    accepted_total: int
    decision: Decision | None = None  # the scheduler's choice and why, when it ran
    index: int = 0  # 1-based round number in this generation
    tokens: tuple[int, ...] = ()  # committed by this round: the accepted drafts, then the target's token
    draft_ms: float = 0.0  # drafting time of this round (0 when it did not draft)
    verify_ms: float = 0.0  # the target pass and the verification
    t_s: float = 0.0  # seconds since the generation began, at the end of this round
    telemetry: Snapshot | None = None  # the reading this round saw (None when nothing samples it)
    drafting: dict | None = None  # what the drafter did this round and why, when it says (``last_proposal``)

    def as_dict(self) -> dict:
        """A JSON-ready record (one trace line)."""
        from dataclasses import asdict

        d = {"round": self.index, "t_s": round(self.t_s, 6), "width": self.width, "drafted": self.drafted,
             "accepted": self.accepted, "tokens": list(self.tokens), "confidence": [round(c, 5) for c in self.confidence],
             "draft_ms": round(self.draft_ms, 4), "verify_ms": round(self.verify_ms, 4),
             "draft_n_total": self.draft_n_total, "accepted_total": self.accepted_total,
             "decision": None, "telemetry": None, "drafting": self.drafting}
        if self.decision is not None:
            d["decision"] = asdict(self.decision)
        if self.telemetry is not None:
            d["telemetry"] = asdict(self.telemetry)
        return d


class _RoundStats:
    """Accumulates per-round counts into GenerationStats."""

    def __init__(self, max_drafts: int) -> None:
        self.rounds = self.draft_n = self.accepted = self.bonus = 0
        self.widths: dict[str, int] = {}
        self.hist: dict[str, int] = {}
        self.reached = np.zeros(max(1, max_drafts), dtype=np.int64)
        self.kept = np.zeros(max(1, max_drafts), dtype=np.int64)
        self.draft_s = self.verify_s = 0.0
        self.modes: dict[str, int] = {}

    def record(self, width: int, drafted: int, outcome) -> None:
        self.rounds += 1
        self.widths[str(width)] = self.widths.get(str(width), 0) + 1
        if drafted:
            self.draft_n += drafted
            self.accepted += outcome.accepted
            self.bonus += int(outcome.bonus)
            self.hist[str(outcome.accepted)] = self.hist.get(str(outcome.accepted), 0) + 1
            self.reached[:judged(drafted, outcome.accepted)] += 1
            self.kept[:outcome.accepted] += 1

    def finish(self, **kw) -> GenerationStats:
        used = int(np.max(np.flatnonzero(self.reached), initial=-1)) + 1
        per_pos = tuple(float(k / r) for k, r in zip(self.kept[:used], self.reached[:used]))
        return GenerationStats(rounds=self.rounds, widths=self.widths, draft_n=self.draft_n,
                               draft_n_accepted=self.accepted, accept_length_hist=self.hist,
                               acceptance_per_position=per_pos, bonus_tokens=self.bonus,
                               draft_s=self.draft_s, verify_s=self.verify_s, **kw)


def _check_draft(draft: Draft, k_max: int, vocab: int) -> None:
    """A drafter's proposal must be usable as is: a bad one counts as a drafter failure, never
    reaches the target (an out-of-vocabulary id would fail the target pass)."""
    k = len(draft)
    if draft.tokens.ndim != 1 or k > k_max:
        raise ValueError(f"draft has shape {draft.tokens.shape}; at most {k_max} tokens were asked for")
    if k and (draft.tokens.min() < 0 or draft.tokens.max() >= vocab):
        raise ValueError(f"draft token ids must lie in [0, {vocab}); got {draft.tokens.tolist()}")
    c = draft.confidence
    if c.shape != (k,) or (k and not (np.all(np.isfinite(c)) and c.min() >= 0.0 and c.max() <= 1.0)):
        raise ValueError(f"draft confidences must be {k} numbers in [0, 1]; got {np.asarray(c).tolist()}")
    if draft.q is not None and (draft.q.shape[0] != k or draft.q.ndim != 2 or draft.q.shape[1] != vocab):
        raise ValueError(f"draft distributions have shape {draft.q.shape}; expected ({k}, {vocab})")


def _survival_cut(confidence: np.ndarray, min_survival: float) -> int:
    """How many drafts to keep: draft j (1-based) stays while prod(c_1..c_{j-1}) >= min_survival.

    Draft 1 always stays; the decision for draft j uses only the confidences before it
    (the early stop that keeps rejection sampling lossless)."""
    survival = np.cumprod(confidence[:-1])
    below = np.flatnonzero(survival < min_survival)
    return int(below[0]) + 1 if below.size else int(confidence.shape[0])


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Index where the earliest stop string begins in ``text[start:]``, or None."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None
