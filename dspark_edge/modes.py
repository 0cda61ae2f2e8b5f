"""Decoding modes raced on this device, and the choice ``precision="auto"`` makes among them.

A mode is a target precision and a drafter. Only *faithful* precisions take part
(``Manifest.faithful_precisions``: the most precise target, and an int4 graph that holds the
source's own 4-bit blocks at FP32's precision), with plain decoding and the drafter
``auto_drafter`` names for each. ``measure_modes`` decodes the same prompts greedily in every
mode in turn (the order rotating from prompt to prompt, so the machine's drift lands on all
alike) and records each mode's decode rate, its ratio to the most precise target's plain rate
in the same run, and how many of its answers equal that target's plain answers. The results go
into this device's profile (``DeviceProfile.modes``).

``choose_mode`` picks the fastest mode whose answers all equal the reference's and whose
weights and K/V fit in the memory available now (``need_mib``: a device that cannot hold the
FP32 target beside its self-drafting copy decodes in the fastest mode that fits); without a
profile that has raced modes it falls back on the rule (the most precise target with
``auto_drafter``'s drafter), which is what the runtime did before modes were measured. Which
mode wins depends on the CPU (the INT4 kernels' speed against FP32's varies by instruction set
and memory bandwidth), so the choice is measured per device rather than fixed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import ConfigError, DSparkError
from .profile import ModeSpeed

log = logging.getLogger(__name__)

RACE_PROMPTS = 6  # prompts of the project's benchmark set a race decodes
RACE_TOKENS = 48  # tokens per answer
# A mode fits when its files and K/V times MEMORY_FACTOR plus MEMORY_FIXED_MIB fit in the memory
# available: onnxruntime's arenas, activations and per-pass scratch come on top of the weights.
# Measured for the default model (bench/memory.py, every verify width used): 805 MiB resident
# for FP32 and 422 MiB for int4 over the interpreter's, against 713 and 229 MiB of files and K/V.
MEMORY_FACTOR = 1.1
MEMORY_FIXED_MIB = 200.0


@dataclass(frozen=True)
class ModeChoice:
    precision: str
    drafter: str | None  # None: plain decoding
    reason: str


def candidate_modes(manifest, backend: str = "onnxruntime",
                    providers: Sequence[str] = ("CPUExecutionProvider",)) -> list[tuple[str, str | None]]:
    """(precision, drafter) pairs a race compares: every faithful precision, plainly and with
    the drafter ``auto_drafter`` names for it."""
    from .pipeline import auto_drafter

    modes: list[tuple[str, str | None]] = []
    for precision in manifest.faithful_precisions(backend):
        modes.append((precision, None))
        drafter = auto_drafter(manifest, precision, backend, providers)
        if drafter is not None:
            modes.append((precision, drafter))
    return modes


def measure_modes(engine_dir: str | Path, prompts: list[dict] | None = None, max_new_tokens: int = RACE_TOKENS,
                  progress: Callable[[str], None] | None = None, options=None) -> tuple[ModeSpeed, ...]:
    """Race the engine's candidate modes on the CPU (``candidate_modes``), greedily, over
    ``prompts`` (default: the first ``RACE_PROMPTS`` of the project's benchmark set), each
    answer exactly ``max_new_tokens`` long. The first mode is the reference: the most precise
    target decoding plainly.

    ``options``: the backend options of every mode (default: sessions with pools of their own
    that do not spin, so the modes' sessions take turns on the cores without spinning against
    each other). A program that is the race's own process passes
    ``BackendOptions(shared_threads=True)``: the process-wide pool, as the command line decodes
    with a drafter that has a graph of its own (once that pool exists, onnxruntime refuses
    sessions with pools of their own in the process; this package's sessions then join it)."""
    from .backends import BackendOptions
    from .bench import load_prompts
    from .config import GenerationConfig
    from .manifest import read_manifest
    from .pipeline import load

    if max_new_tokens < 2:
        raise ConfigError(f"a mode race needs answers of 2 tokens or more, got {max_new_tokens}")
    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    prompts = prompts if prompts is not None else load_prompts()[:RACE_PROMPTS]
    if not prompts:
        raise ConfigError("a mode race needs at least one prompt")
    candidates = candidate_modes(manifest)
    if not candidates:
        raise ConfigError(f"{engine_dir} has no onnxruntime target to race")
    # Sessions that do not spin, also where this onnxruntime cannot share a pool: they take turns.
    options = replace(options, allow_spinning=False) if options is not None else BackendOptions(allow_spinning=False)
    modes, pipes = [], []
    for i, (precision, drafter) in enumerate(candidates):
        try:
            pipes.append(load(engine_dir, precision, drafter=drafter, options=options))
        except DSparkError as exc:  # e.g. a drafter's graph that fails its hash: that mode sits out
            if i == 0:
                raise
            log.warning("mode %s + %s left out of the race: %s", precision, drafter or "plain", exc)
            if progress:
                progress(f"{precision} + {drafter or 'plain'}: left out ({exc})")
            continue
        modes.append((precision, drafter))
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True)
    warm = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    try:
        for pipe in pipes:  # untimed: first-run allocations and kernel selection
            pipe.generate(_prompt_of(prompts[0]), warm)
        tokens = [0] * len(modes)
        seconds = [0.0] * len(modes)
        answers: list[list[tuple[int, ...]]] = [[] for _ in modes]
        for n, rec in enumerate(prompts):
            order = [(n + i) % len(modes) for i in range(len(modes))]
            for i in order:
                r = pipes[i].generate(_prompt_of(rec), cfg)
                tokens[i] += r.stats.new_tokens - 1  # the prefill's token is not decoded
                seconds[i] += r.stats.decode_s
                answers[i].append(tuple(r.token_ids))
            if progress:
                progress(f"race: prompt {n + 1}/{len(prompts)}")
    finally:
        for pipe in pipes:
            pipe.close()
    rates = [t / s if s > 0 else 0.0 for t, s in zip(tokens, seconds)]
    if min(rates) <= 0:
        raise ConfigError("a mode race measured no decode time; give longer answers")
    out = []
    for i, (precision, drafter) in enumerate(modes):
        equal = sum(a == b for a, b in zip(answers[i], answers[0]))
        out.append(ModeSpeed(precision, drafter or "none", round(rates[i], 2), round(rates[i] / rates[0], 4), equal,
                             len(prompts), max_new_tokens))
        if progress:
            progress(f"{precision} + {drafter or 'plain'}: {rates[i]:.1f} tok/s, {rates[i] / rates[0]:.2f}x "
                     f"{modes[0][0]} plain, {equal}/{len(prompts)} answers equal to it")
    return tuple(out)


def _prompt_of(rec: dict):
    return rec.get("messages") or rec["prompt"]


def mode_mib(manifest, precision: str, drafter: str | None) -> float:
    """MiB a mode holds in memory, from the files it loads and its K/V: the target graph of
    ``precision`` (external data and embedding table included), the copy a self drafter drafts
    with (another precision of the target: INT8 unless named), a DSpark drafter's graph, and one
    context's K/V buffers (FP32, the default context)."""
    from .backends import BackendOptions
    from .manifest import role_files

    files = {f.path: f.size for f in role_files(manifest, "target", precision)}
    for part in (drafter or "none").split("+"):
        name, _, wanted = part.partition(":")
        if name == "self":
            files |= {f.path: f.size for f in role_files(manifest, "target", wanted or "int8")}
        elif name == "dspark":
            drafted = wanted or next(iter(manifest.precisions("drafter")), "")
            files |= {f.path: f.size for f in role_files(manifest, "drafter", drafted)}
    m = manifest.model
    kv = m.num_layers * 2 * m.num_kv_heads * m.head_dim * min(BackendOptions().max_context,
                                                               m.max_position_embeddings) * 4
    return (sum(files.values()) + kv) / 2**20


def need_mib(manifest, precision: str, drafter: str | None) -> float:
    """The memory a mode is taken to need: ``mode_mib`` with onnxruntime's share on top."""
    return mode_mib(manifest, precision, drafter) * MEMORY_FACTOR + MEMORY_FIXED_MIB


def available_mib() -> float:
    """The memory available to a new process now (psutil's estimate), in MiB."""
    import psutil

    return psutil.virtual_memory().available / 2**20


def batched_cost_ms(profile, precision: str, requests: int) -> float | None:
    """What one round of ``requests`` requests decoding at once costs at ``precision`` on this
    device: the profile's slots-graph pass over one token of each (``profile --slots``), else
    its verify curve at that width (the same tokens through the same matmuls); None when the
    profile holds neither."""
    table = profile.slots_ms(precision, requests)
    if requests in table:
        return table[requests]
    try:
        curve = profile.verify_ms(precision)
    except ConfigError:
        return None
    return curve.get(requests)


def choose_mode(manifest, engine_dir: str | Path, backend: str = "onnxruntime",
                providers: Sequence[str] = ("CPUExecutionProvider",), precision: str | None = None,
                drafter: str | None = "auto", requests: int = 1, free_mib: float | None = None) -> ModeChoice:
    """The mode to decode in: among this device's raced modes at a faithful precision whose
    answers all equalled the reference's (at ``precision`` only, when given; with ``drafter``
    only, unless it is "auto"), the fastest; else the rule: ``precision`` or the most precise
    target, with ``auto_drafter``'s drafter (or ``drafter``).

    ``requests`` > 1 (a server decoding that many at once): the race timed one request at a
    time, and a precision fast alone can be slow in a batch (onnxruntime's 4-bit kernel with
    FP32 activations unpacks its weights for every pass of more than one row). So the precision
    is the raced one whose round of that many requests costs least in the profile
    (``batched_cost_ms``), and the mode the fastest raced at it (its drafter is what a request
    alone in the batch drafts with).

    Of the raced modes, only those that fit in ``free_mib`` (default: the memory available now)
    are taken (``need_mib``); where none fits, the smallest one, and the reason says what did
    not fit."""
    from .pipeline import auto_drafter
    from .profile import load_profile

    faithful = manifest.faithful_precisions(backend)
    on_cpu = backend == "onnxruntime" and tuple(providers) == ("CPUExecutionProvider",)
    pool = [precision] if precision is not None else faithful
    why = "no decoding modes raced on this device"
    if on_cpu and pool:
        profile, status = load_profile(engine_dir)
        if profile is not None and status in ("ok", "throttled") and profile.modes:
            wanted = None if drafter == "auto" else (drafter or "none")  # compared as spelled
            runs = [m for m in profile.modes if m.precision in pool and m.precision in faithful and m.exact
                    and (wanted is None or m.drafter == wanted)]
            batch = ""
            costs = {p: batched_cost_ms(profile, p, requests)
                     for p in dict.fromkeys(m.precision for m in runs)} if requests > 1 else {}
            if len(costs) > 1 and None not in costs.values():
                cheapest = min(costs, key=costs.get)
                runs = [m for m in runs if m.precision == cheapest]
                batch = (f"for {requests} requests at once the {cheapest} target, whose round of them costs least "
                         "here (" + ", ".join(f"{p} {ms:.1f} ms" for p, ms in costs.items()) + "); its ")
            if runs:
                runs, short = _that_fit(manifest, runs, free_mib)
                best = max(runs, key=lambda m: m.tokens_per_s)
                raced = (f"fastest exact mode raced on this device: {best.tokens_per_s:.1f} tok/s, "
                         f"{best.vs_reference:.2f}x plain {faithful[0]} ({best.equal}/{best.prompts} answers equal)")
                return ModeChoice(best.precision, None if best.drafter == "none" else best.drafter,
                                  (batch + raced if batch else "the " + raced) + short)
            why = "no raced mode matches"
        elif profile is not None and status not in ("ok", "throttled"):
            why = f"this device's profile is {status}"
    chosen = precision or (faithful[0] if faithful else (manifest.precisions("target", backend) or [None])[0])
    if chosen is None:
        raise ConfigError("the engine has no target for this backend")
    pick = auto_drafter(manifest, chosen, backend, providers) if drafter == "auto" else drafter
    what = "the most precise target" if precision is None else f"the {chosen} target"
    if drafter == "auto":
        what += " with the rule's drafter"
    return ModeChoice(chosen, pick, f"{why}: {what} (race the modes: `python -m dspark_edge profile --engine "
                                    f"{engine_dir} --modes-only`)")



def _that_fit(manifest, runs: list, free_mib: float | None) -> tuple[list, str]:
    """The raced modes that fit in the memory available (see ``choose_mode``), and what the
    reason adds when the fastest did not."""
    need = {(m.precision, m.drafter): need_mib(manifest, m.precision, None if m.drafter == "none" else m.drafter)
            for m in runs}
    free = available_mib() if free_mib is None else free_mib
    fit = [m for m in runs if need[(m.precision, m.drafter)] <= free]
    fastest = max(runs, key=lambda m: m.tokens_per_s)
    if fastest in fit:
        return runs, ""
    kept = fit or [min(runs, key=lambda m: need[(m.precision, m.drafter)])]
    what = f"{fastest.precision} + {fastest.drafter}"
    log.warning("the fastest raced mode (%s) needs about %.0f MiB, %.0f MiB are available: decoding in the "
                "fastest that fits", what, need[(fastest.precision, fastest.drafter)], free)
    return kept, (f"; {what}, faster, needs about {need[(fastest.precision, fastest.drafter)]:.0f} "
                  f"MiB and {free:.0f} MiB are available" + ("" if fit else ", and no raced mode fits: the smallest"))


def needs_race(manifest, engine_dir: str | Path, backend: str = "onnxruntime",
               providers: Sequence[str] = ("CPUExecutionProvider",)) -> bool:
    """Whether ``precision="auto"`` has a choice to make that this device has not raced yet: the
    engine has more than one faithful precision, runs on the CPU, and this device's profile of
    this engine holds no raced modes."""
    from .profile import load_profile

    if backend != "onnxruntime" or tuple(providers) != ("CPUExecutionProvider",):
        return False
    if len(manifest.faithful_precisions(backend)) < 2:
        return False
    profile, status = load_profile(engine_dir, quiet=True)  # the race's own load says what is missing
    return profile is None or status not in ("ok", "throttled") or not profile.modes


def race_and_save(engine_dir: str | Path, progress: Callable[[str], None] | None = None,
                  folder: Path | None = None, options=None) -> Path:
    """Race the engine's modes (``measure_modes`` with ``options``) and keep them in this
    device's profile (its timings kept where they are of this engine's graphs). Returns the
    profile's path. With ``folder``, the modes are timed on that folder's profile of this
    device (or none), the one they are kept with, not on the one loading would find first."""
    from contextlib import nullcontext

    from .profile import load_profile, profile_in_hand, profile_with_modes, save_profile
    from .telemetry import SystemReader

    t0 = time.perf_counter()
    existing, _ = load_profile(engine_dir, folder)  # a stale one keeps the timings that still apply
    reader = SystemReader()
    reader.read()  # the next reading's load is over the race
    with profile_in_hand(existing) if folder is not None else nullcontext():
        modes = measure_modes(engine_dir, progress=progress, options=options)
    reading = reader.read()
    path = save_profile(profile_with_modes(engine_dir, modes, reading, existing), folder)
    log.info("raced %d decoding modes in %.0f s; kept in %s", len(modes), time.perf_counter() - t0, path)
    return path
