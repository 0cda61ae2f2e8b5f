"""The public runtime: ``load(engine_dir)`` → ``Pipeline`` → ``generate`` / ``stream``.

One loop serves plain and speculative decoding: each round the drafter (if any) proposes
tokens, the target runs once over [pending token, drafts…] at a listed verify width, the
drafts are verified (greedy or rejection sampling), and the KV cache keeps only the
committed positions (``rounds.Speculator``); ``TextStream`` turns the committed tokens into
text, stop strings and stop reasons. Without drafts a round is a plain width-1 step. Each
generation starts from an empty KV cache, so a failed or cancelled generation leaves the
pipeline usable.
One generation at a time per pipeline: a second concurrent call is refused with a clear
error (create one pipeline per thread instead). A pipeline and its twins share one loaded
target: their streams may take turns in one thread, and a stream from a second thread is
refused while one from the first is open. ``close()`` (or leaving a ``with`` block, or
dropping the pipeline) stops its telemetry thread; a stream still running then ends with
stop reason "cancelled", and later generations are refused.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path

import numpy as np

from .backends import BackendOptions
from .config import GenerationConfig, GenerationResult, TokenLogprob
from .errors import ConfigError, DSparkError, GenerationError, PromptError
from .manifest import Manifest, read_manifest, verify_role_files
from .decoder import DecoderModel
from .drafters import create as create_drafter
from .drafters.base import contract
from .drafters.spec import own_model
from .grammar import Constraint
from .sampling import choose, coupled_choice, token_logprobs
from .scheduler import CostModel, Scheduler, SchedulerConfig
from .telemetry import Reader, Sampler, Snapshot
from .tokenizer import IncrementalDecoder, Tokenizer
from .rounds import RoundInfo, Speculator, Target
from .widths import FixedLength, Scheduled, SurvivalCut

log = logging.getLogger(__name__)

# Text (used as is), chat messages (through the chat template), or token ids (used as they are).
Prompt = str | Sequence[Mapping[str, str]] | Sequence[int]


def load(engine_dir: str | Path, precision: str | None = None, *, drafter=None, backend: str = "onnxruntime",
         options: BackendOptions | None = None, verify_hashes: bool = True,
         scheduler: SchedulerConfig | bool | None = None, telemetry: Reader | None = None,
         chat_template: str | Path | None = None, requests: int = 1) -> "Pipeline":
    """Open an engine folder. ``precision`` defaults to the most precise one exported;
    "auto" picks, among the precisions whose output is the model's own
    (``Manifest.faithful_precisions``), the one of the fastest decoding mode raced on this
    device (``dspark_edge.modes``; with ``drafter="auto"`` that mode's drafter too), else the
    most precise. ``requests``: how many requests the pipeline will decode at once
    (``batch_slots``); above 1, "auto" takes the precision whose batched round costs least in
    this device's profile (``modes.choose_mode``).

    ``drafter``: None (plain decoding), "dspark" / "dspark:<precision>" (the engine folder's
    DSpark drafter), "ngram" (prompt lookup, with the engine folder's corpus n-gram table
    when it has one, and the confidence model calibrated with it), "ngram:online" (the same table,
    confidences estimated online), "ngram:prompt" (prompt lookup alone), "self" / "self:<precision>" (the
    engine folder's INT8 graph, or that precision's, drafts for the target over its KV cache; the
    target must be more precise), "ngram+self" (the n-gram drafter and that copy), "auto" (the
    one ``auto_drafter`` picks for this engine, precision and device), the path of a
    draft-model engine folder, or a Drafter object. ``verify_hashes`` checks the sha256 of the files
    this precision uses (sizes are always checked).

    ``scheduler``: with a drafter, the confidence scheduler picks each round's verify width
    (default ``SchedulerConfig()``; ``False`` keeps the simple survival cut). ``telemetry``: the
    reader it samples (default: this machine's ``SystemReader``). ``chat_template``: the path
    of a Jinja chat template to use instead of the engine folder's.
    """
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
        raise ConfigError(f"requests (how many requests decode at once) must be an integer >= 1, got {requests!r}")
    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    providers = (options or BackendOptions()).providers
    choice = None
    if precision != "auto":
        precision = precision or (manifest.precisions("target", backend) or [None])[0]
    if precision == "auto" or drafter == "auto":
        from .modes import choose_mode

        choice = choose_mode(manifest, engine_dir, backend, providers, None if precision == "auto" else precision,
                             drafter if drafter is None or isinstance(drafter, str) else str(drafter),
                             requests=requests)
        precision = choice.precision
        if drafter == "auto":
            drafter = choice.drafter
        log.info("mode: target %s, drafter %s (%s)", precision, drafter or "none", choice.reason)
    drafter_options = drafter_backend_options(drafter, options)
    verify_role_files(manifest, engine_dir, "target", precision, check_hashes=verify_hashes)
    target = DecoderModel(manifest, engine_dir, precision, backend, options)
    tokenizer = Tokenizer.from_engine(engine_dir, manifest, check_hashes=verify_hashes)
    if chat_template is not None:
        tokenizer.use_template(_read_template(Path(chat_template)), str(chat_template))

    def make_drafter(shared: dict | None = None):
        return create_drafter(drafter, manifest, options=drafter_options, verify_hashes=verify_hashes,
                              engine_dir=engine_dir, shared=shared)

    pipe = Pipeline(manifest, engine_dir, target, tokenizer, make_drafter())
    pipe.mode_reason = choice.reason if choice is not None else None
    if isinstance(drafter, (str, Path)):
        pipe._drafter_factory = make_drafter  # batch_slots gives each slot a drafter of its own
    if pipe.drafter is not None:
        bind = contract(pipe.drafter).bind_target  # a drafter lacking a method is refused here
        if bind is not None:  # and a cache it cannot share now, not mid-generation
            bind(target, pipe._cache)
    if pipe.drafter is not None and scheduler is not False:
        pipe.enable_scheduler(scheduler if isinstance(scheduler, SchedulerConfig) else SchedulerConfig(),
                              telemetry, make_drafter if isinstance(drafter, (str, Path)) else None)
    return pipe


def _read_template(path: Path) -> str:
    from .manifest import read_bounded
    from .tokenizer import MAX_TEMPLATE_BYTES

    if not path.is_file():
        raise ConfigError(f"chat template {path} does not exist or is not a file")
    try:
        return read_bounded(path, MAX_TEMPLATE_BYTES, ConfigError, "give another template").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"chat template {path} is not UTF-8 text (byte {exc.start})") from None


def auto_drafter(manifest: Manifest, precision: str, backend: str = "onnxruntime",
                 providers: Sequence[str] = ("CPUExecutionProvider",)) -> str:
    """The rule's drafter for ``precision``: what ``drafter="auto"`` stands for where this
    device's profile has no raced mode at that precision (``dspark_edge.modes``; a race
    compares this drafter with plain decoding). The rule: for a target
    above INT8 on the CPU with the engine's INT8 graph at hand, "ngram+self" (ahead of every
    DSpark drafter trained here, in the same runs: docs/performance.md); else the engine
    folder's DSpark drafter when it has one; else "ngram". Self-drafting is CPU-only here: on
    a GPU the copy's cost relative to the target's is unmeasured. A DSpark drafter that beats
    self-drafting on a CPU is asked for by name (``drafter="dspark"``)."""
    on_cpu = backend == "onnxruntime" and tuple(providers) == ("CPUExecutionProvider",)
    if on_cpu and precision != "int8" and "int8" in manifest.precisions("target", "onnxruntime"):
        return "ngram+self"
    if manifest.drafter is not None:
        return "dspark"
    return "ngram"


def drafter_backend_options(drafter, options: BackendOptions | None) -> BackendOptions | None:
    """The backend options a drafter given by name or path runs with: those of the target, but
    without thread spinning for a drafter with its own model. Two sessions take turns on the
    same cores, so the drafter's threads must not spin-wait after its short pass and slow the
    target's next one; the target keeps its own setting (measured: docs/notes/, "Two thread
    pools and BLAS"). Better still, with ``BackendOptions.shared_threads`` (``python -m
    dspark_edge`` sets it for such drafters) both run on one process-wide pool."""
    if own_model(drafter) and not (options is not None and options.shared_threads):
        log.info("drafter in use: onnxruntime thread spinning disabled for the drafter's session")
        return replace(options or BackendOptions(), allow_spinning=False)
    return options


class _SharedTarget:
    """Who is using a loaded target: the thread whose streams are open on it, and how many.
    The target's session reuses its output buffers, so passes from two threads would overwrite
    each other's logits; streams of one thread take turns safely."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: int | None = None
        self.open = 0

    def enter(self) -> None:
        me = threading.get_ident()
        with self._lock:
            if self.owner not in (None, me):
                raise DSparkError("this pipeline's target is generating in another thread (through the pipeline "
                                  "or one of its twins): finish that stream first, or load one pipeline per thread")
            self.owner, self.open = me, self.open + 1

    def leave(self) -> None:
        with self._lock:
            self.open -= 1
            if self.open == 0:
                self.owner = None


class Pipeline:
    def __init__(self, manifest: Manifest, engine_dir: Path, target: DecoderModel, tokenizer: Tokenizer,
                 drafter=None, *, shared: _SharedTarget | None = None) -> None:
        self.manifest = manifest
        self.drafter = drafter
        self.engine_dir = engine_dir
        self.target = target
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(manifest.tokenizer.eos_ids)
        self._cache = target.new_cache()
        # The ids whose K/V ``_cache`` holds at positions 0… after the last generation, for
        # ``GenerationConfig.reuse_prefix``; empty whenever the cache holds nothing reusable.
        self._kept: tuple[int, ...] = ()
        self._lock = threading.Lock()
        self._shared = shared or _SharedTarget()
        self._streams: weakref.WeakSet = weakref.WeakSet()  # open streams, cancelled by close()
        self.closed = False
        self.mode_reason: str | None = None  # why load() chose this precision / drafter, when asked to
        self.scheduler: Scheduler | None = None
        self._sampler: Sampler | None = None
        self._telemetry_of: Pipeline | None = None  # a twin reads the telemetry of the pipeline it came from
        self._make_drafter = None
        self._unloaded = False  # the drafter was released under memory pressure
        self.profile_status = "unused"
        self.observers: list = []  # see add_observer
        self._drafter_factory = None  # makes another drafter like this one (load() sets it from a spec)
        self._slot = None  # (BatchRunner, slot index) for a pipeline of batch_slots
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
        self._set_sampler(Sampler(telemetry or SystemReader()))
        self._make_drafter = make_drafter

    def _set_sampler(self, sampler: Sampler) -> None:
        """Own ``sampler``: its thread stops at ``close()`` or when this pipeline is collected."""
        self._sampler = sampler
        self._finalizer = weakref.finalize(self, sampler.close)

    def telemetry(self) -> Snapshot | None:
        """The latest background telemetry reading (None when nothing samples it: see
        ``start_telemetry``)."""
        if self._sampler is None:
            return None if self._telemetry_of is None else self._telemetry_of.telemetry()
        return self._sampler.latest

    def start_telemetry(self, reader: Reader | None = None) -> None:
        """Sample telemetry in the background even without the scheduler (for traces and
        displays). A no-op when it already runs."""
        from .telemetry import SystemReader

        self._check_open()
        if self._sampler is None:
            self._set_sampler(Sampler(reader or SystemReader()))

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

    def twin(self, drafter=None, scheduler: Scheduler | None = None) -> "Pipeline":
        """A pipeline over the same loaded target and tokenizer with its own KV cache, and
        ``drafter`` (None: plain decoding) with ``scheduler`` (None: fixed widths): another
        decoding mode next to this one without loading the model twice. It reads this
        pipeline's telemetry (closing it leaves this one's running). The two may take turns in
        one thread (as the demo's race and ``bench_compare`` do), not run in two threads at
        once: they share the session's output buffers."""
        self._check_open()
        if drafter is not None:
            contract(drafter)  # a drafter lacking a method is refused here, not mid-round
        twin = Pipeline(self.manifest, self.engine_dir, self.target, self.tokenizer, drafter, shared=self._shared)
        twin.scheduler = scheduler
        twin._telemetry_of = self
        return twin

    def _profiled_pass_costs(self, slots: int) -> dict[int, float] | None:
        """The device profile's slots-pass cost table for ``slots`` requests at this precision
        (None where the profile is missing, stale or has none: the runner measures it)."""
        from .profile import load_profile

        prof, status = load_profile(self.engine_dir)
        if prof is None or not prof.times(self.engine_dir, self.target.precision, status):
            return None
        return prof.slots_ms(self.target.precision, slots) or None

    def batch_slots(self, n: int, gather_s: float = 0.02, verify_slots: bool = True) -> list["Pipeline"]:
        """``n`` pipelines over this one's loaded target whose generations run concurrently, one
        thread each, their target passes batched (``dspark_edge.batching``): continuous batching
        for a server. Each has a drafter of its own (made from the spec this pipeline was loaded
        with) and its own scheduler with this one's cost curve; they read this pipeline's
        telemetry and report to its observers. ``verify_slots``: drafts of several requests are
        verified in one pass (a second session of the target's graph, rewritten for it: a
        second copy of the weights in memory); off, a slot drafts only while no other slot is
        generating. Self-drafting batches too: every slot's drafter drafts with one shared copy
        over the runner's K/V rows, the copy steps of the slots drafting at the same moment in
        one batch of rows. A drafter that cannot draft for a slot is refused with a ConfigError
        naming the fix."""
        from .batching import BatchRunner, SlotModel

        self._check_open()
        if self.drafter is not None and self._drafter_factory is None:
            raise ConfigError("batching needs a drafter per slot: load the pipeline with a drafter spec "
                              "(e.g. drafter='ngram'), not a Drafter object")
        curve = dict(self.scheduler.costs.verify_ms) if self.scheduler is not None else None
        verify_slots = verify_slots and self.drafter is not None
        runner = BatchRunner(self.target, n, gather_s, verify_slots=verify_slots, curve=curve,
                             pass_costs=self._profiled_pass_costs(n) if verify_slots else None)
        slots = []
        shared: dict = {}  # models the slots' drafters share (the self drafter's copy)
        for i in range(n):
            drafter = self._drafter_factory(shared) if self.drafter is not None else None
            model = SlotModel(runner, i)
            if drafter is not None:
                try:  # a drafter that drafts over the target's own KV cache refuses a slot's
                    contract(drafter).bind_target(model, runner.caches[i])
                except DSparkError as exc:
                    raise ConfigError(f"the {drafter.name} drafter cannot be batched across requests ({exc}); "
                                      "serve it with --parallel 1, or pick another drafter ('ngram', "
                                      "'dspark')") from None
            p = Pipeline(self.manifest, self.engine_dir, model, self.tokenizer, drafter)
            p._slot, p._telemetry_of, p.observers = (runner, i), self, self.observers
            if self.scheduler is not None:
                cfg = self.scheduler.config
                p.scheduler = Scheduler(CostModel(dict(self.scheduler.costs.verify_ms), 0.0, cfg.cost_window,
                                                  cfg.min_observations), self.target.widths, cfg)
                p._make_drafter = self._make_drafter
            slots.append(p)
        return slots

    def close(self) -> None:
        """Stop the telemetry thread and end this pipeline: a stream still running ends after its
        current round (stop reason "cancelled"), later generations are refused. Safe from any
        thread, and more than once."""
        self.closed = True
        for stream in list(self._streams):
            stream.cancel()
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.close()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise DSparkError("this pipeline is closed: load the engine again with dspark_edge.load()")

    def _release_drafter(self) -> None:
        """Under a memory squeeze: drop a drafter this pipeline can load again (its session's
        memory goes with it); ``_restore_drafter`` takes it back once memory allows."""
        if self._make_drafter is not None:
            self.drafter, self._unloaded = None, True

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
    def reusable(self, prompt_ids: Sequence[int]) -> int:
        """How many leading tokens of ``prompt_ids`` the next generation with ``reuse_prefix``
        would take from the K/V kept of the last one (the prompt's last token is always run:
        its pass gives the first logits). A server with several slots sends a conversation's
        next turn to the slot that keeps its last one."""
        return _shared_prefix(self._kept, prompt_ids, len(prompt_ids) - 1)

    @property
    def kept_length(self) -> int:
        """How many tokens' K/V this pipeline keeps of its last generation for ``reuse_prefix``."""
        return len(self._kept)

    def encode_prompt(self, prompt: Prompt, special_in_content: bool = False) -> list[int]:
        """Token ids of a text prompt (used as is, special-token strings included), of chat
        messages (through the chat template; their content is text, special-token strings in it
        included, unless ``special_in_content``), or a prompt given as token ids (checked against
        the vocabulary, used as they are)."""
        if isinstance(prompt, (str, bytes, bytearray)):
            if not prompt.strip():
                raise PromptError("prompt is empty or whitespace only: give some text or chat messages")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, np.ndarray) or (isinstance(prompt, Sequence) and len(prompt) > 0
                                                and all(isinstance(t, (int, np.integer)) for t in prompt)):
            vocab = self.manifest.model.vocab_size
            bad = [t for t in prompt if isinstance(t, (bool, np.bool_)) or not 0 <= t < vocab]
            ids = [int(t) for t in prompt]
            if bad or (isinstance(prompt, np.ndarray) and prompt.dtype.kind not in "iu"):
                raise PromptError(f"a prompt of token ids takes integers in 0..{vocab - 1}, got {bad[:5] or prompt.dtype}")
        else:
            ids = self.tokenizer.encode_chat(prompt, special_in_content=special_in_content)
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
        self._check_open()
        config = config or GenerationConfig()
        if overrides:
            known = {f.name for f in fields(GenerationConfig)}
            unknown = sorted(set(overrides) - known)
            if unknown:
                raise ConfigError(f"unknown generation option {', '.join(unknown)}; GenerationConfig has "
                                  f"{', '.join(sorted(known))}")
            config = replace(config, **overrides)
        vocab = self.manifest.model.vocab_size
        if any(t >= vocab for t in config.stop_token_ids):
            raise ConfigError(f"stop_token_ids {list(config.stop_token_ids)} lie outside the vocabulary "
                              f"(ids 0..{vocab - 1})")
        outside = [t for t, _ in config.logit_bias if t >= vocab]
        if outside:
            raise ConfigError(f"logit_bias names token ids {outside[:5]} outside the vocabulary (ids 0..{vocab - 1})")
        ids = self.encode_prompt(prompt, config.special_in_content)
        ids, truncated = self._fit_context(ids, config)
        stream = TextStream(self, ids, truncated, config)
        self._streams.add(stream)
        return stream


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
        self.logprobs: list[TokenLogprob] = []  # parallel to token_ids with config.logprobs, else empty
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
        call at any time, also after the stream ended. From another thread while a round is
        running it cannot stop that thread's round: it cancels instead (the stream ends after
        the round, stop reason "cancelled")."""
        try:
            self._iter.close()
        except ValueError:  # "generator already executing": the round runs in another thread
            self.cancel()

    def _run(self) -> Iterator[str]:
        p = self._pipeline
        p._check_open()
        if not p._lock.acquire(blocking=False):
            raise DSparkError("this pipeline is already generating in another thread or stream: "
                              "finish that one first, or load one pipeline per thread")
        try:
            p._shared.enter()
        except DSparkError:
            p._lock.release()
            raise
        if p._slot is not None:
            p._slot[0].join(p._slot[1])
        try:
            yield from self._decode(p)
        finally:
            if p._slot is not None:
                p._slot[0].leave(p._slot[1])
            p._shared.leave()
            p._lock.release()

    def _decode(self, p: Pipeline) -> Iterator[str]:
        cfg = self.config
        rng = np.random.default_rng(cfg.seed)
        coupled = cfg.temperature > 0 and cfg.sampling == "coupled"
        seed = cfg.seed  # coupled sampling's per-position noise needs one: a fresh one when none is given
        if coupled and seed is None:
            seed = int(np.random.SeedSequence().entropy % 2**63)
        eos = frozenset() if cfg.ignore_eos else p.eos_ids | set(cfg.stop_token_ids)
        if cfg.grammar is not None:  # a complete grammar allows only the end-of-turn token: the answer ends
            eos |= p.eos_ids
        spec = self._speculator(p, rng, seed if coupled else None)
        st = spec.stats
        detok = IncrementalDecoder(p.tokenizer)
        cache = p._cache
        reuse = 0
        # A drafter that reads hidden states needs the whole prompt's, and so does scoring it.
        if cfg.reuse_prefix and spec.hidden_rows is None and cfg.prompt_logprobs is None \
                and cache.length == len(p._kept):
            reuse = p.reusable(self._prompt_ids)
        p._kept = ()  # claimed: kept again only if this generation ends cleanly
        if reuse:
            cache.rollback(reuse)
        else:
            cache.reset()
        text, emitted = "", 0
        hold = max((len(s) for s in cfg.stop), default=1) - 1  # chars that may start a stop string
        stop_reason, error = "max_new_tokens", None
        t0 = time.perf_counter()
        prefill_s = 0.0
        new_from_draft = 0  # how many of ``new`` are accepted drafts (the rest: the target's own)
        scored: list[TokenLogprob] = []  # with cfg.prompt_logprobs: prompt tokens 1, 2, … scored
        prompt = self._prompt_ids

        def score(rows: np.ndarray) -> None:  # a prefill chunk's rows: row r decides the token after it
            nxt = prompt[len(scored) + 1:len(scored) + 1 + rows.shape[0]]
            scored.extend(token_logprobs(rows[:len(nxt)], nxt, cfg.prompt_logprobs))

        sink = score if cfg.prompt_logprobs is not None else None
        try:
            if cfg.max_new_tokens == 0 and sink is not None:  # the prompt scored, nothing answered
                p.target.prefill(cache, np.asarray(prompt, dtype=np.int64), logits_sink=sink)
                prefill_s = time.perf_counter() - t0
            elif cfg.max_new_tokens > 0:
                committed = list(self._prompt_ids)
                out = p.target.prefill(cache, np.asarray(committed[reuse:], dtype=np.int64),
                                       hidden_sink=spec.hidden_rows, logits_sink=sink)
                first = spec.first_logits(out.logits[-1])
                new = [coupled_choice(first, cfg.temperature, cfg.top_k, cfg.top_p, seed, 0) if coupled
                       else choose(first, cfg.temperature, cfg.top_k, cfg.top_p, rng)]
                new_logprobs = (token_logprobs(out.logits[-1:], new, cfg.logprobs) if cfg.logprobs is not None
                                else None)
                prefill_s = time.perf_counter() - t0
                spec.begin(committed, cache, new[0])
                while True:
                    done = False
                    for i, tok in enumerate(new):  # emit this round's tokens in order; stop mid-block if needed
                        self.token_ids.append(tok)
                        self.from_draft.append(i < new_from_draft)
                        if new_logprobs is not None:
                            self.logprobs.append(new_logprobs[i])
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
                    info = spec.round(cache, committed, new[-1], len(self.token_ids),
                                      cfg.max_new_tokens - len(self.token_ids) - 1, t0, self._record)
                    new, new_from_draft, new_logprobs = list(info.tokens), info.accepted, spec.logprobs
                if stop_reason not in ("stop_string", "eos"):
                    text += detok.flush()
                    cut = _find_stop(text, cfg.stop, max(0, emitted - hold))
                    if cut is not None:
                        text, stop_reason = text[:cut], "stop_string"
            # Kept: the prompt and the answer but its last token (never run); not a full cache
            # (a batched slot's idle row takes a one-token pass at its length).
            if cfg.reuse_prefix and stop_reason != "cancelled" and cfg.max_new_tokens > 0 \
                    and cache.length == len(committed) and cache.free >= 1:
                p._kept = tuple(committed)
        except DSparkError as exc:
            stop_reason, error = "error", str(exc)
            log.error("generation failed after %d tokens: %s", len(self.token_ids), exc)
        except Exception as exc:  # a backend or numpy failure: report it with the partial output
            stop_reason, error = "error", f"{type(exc).__name__}: {exc}"
            log.exception("generation failed after %d tokens", len(self.token_ids))
        finally:
            if not p._kept:
                cache.reset()
        total = time.perf_counter() - t0
        stats = st.finish(prompt_tokens=len(self._prompt_ids), new_tokens=len(self.token_ids),
                          prompt_truncated=self._truncated, prefill_s=prefill_s,
                          decode_s=max(0.0, total - prefill_s),
                          drafter=p.drafter.name if (p.drafter is not None and cfg.speculative) else "none",
                          drafter_disabled=spec.disabled, modes=dict(st.modes), prompt_reused=reuse)
        self.result = GenerationResult(text=text, token_ids=tuple(self.token_ids), stop_reason=stop_reason,
                                       stats=stats, error=error, prompt_ids=tuple(int(t) for t in self._prompt_ids),
                                       logprobs=tuple(self.logprobs) if cfg.logprobs is not None else None,
                                       prompt_logprobs=(None, *scored) if sink is not None else None)
        if p.observers:
            p._notify("on_generation", self.result)
        if error is not None:
            raise GenerationError(f"generation failed: {error}", partial=self.result)
        if len(text) > emitted:
            yield text[emitted:]

    def _speculator(self, p: Pipeline, rng: np.random.Generator, coupled_seed: int | None) -> Speculator:
        """This generation's rounds: the drafter (reloaded if memory allows) unless the config
        decodes plainly, the scheduler unless it fixes the draft length."""
        cfg = self.config
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
        if cfg.draft_tokens is not None:
            policy = FixedLength(cfg.draft_tokens)
        elif sched is not None:
            policy = Scheduled(sched)
        else:
            policy = SurvivalCut(cfg.min_survival)
        room = (lambda: p._slot[0].draft_room(p._slot[1])) if p._slot is not None else (lambda: None)
        joint = p._slot is not None and p._slot[0].joint
        target = Target(p.target, p.telemetry, p.manifest.model.vocab_size, p._release_drafter, room,
                        offer=p.target.offer if joint else None,
                        last_choice=p.target.last_choice if joint else (lambda: None))
        constraint = None
        if cfg.grammar is not None:
            vocab = p.manifest.model.vocab_size
            constraint = Constraint(cfg.grammar, p.tokenizer.grammar_tokens(vocab, p.eos_ids), vocab)
        return Speculator(target, cfg, drafter, policy, max_drafts, rng, coupled_seed, constraint)

    def _record(self, info: RoundInfo) -> None:
        self.last_round = info
        p = self._pipeline
        if p.observers:
            p._notify("on_round", info)


def _shared_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading ids ``a`` and ``b`` share, at most ``limit``."""
    n = min(len(a), len(b), limit)
    if n <= 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(differ[0]) if differ.size else n


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Index where the earliest stop string begins in ``text[start:]``, or None."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None
