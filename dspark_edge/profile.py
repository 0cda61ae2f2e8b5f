"""Device profiles: measured cost of every variant of an engine on this device.

``measure_profile`` times, for every target precision, one target pass at every listed verify
width at a few context depths, and for every drafter precision one drafting round per block
size (warm-up, then the median of repeats), recording the device identity, the engine's
manifest hash, library versions and the temperature / frequency / load seen during the run.
Profiles are ``<device-key>.json`` files. ``load_profile`` looks for this device's in
``DSPARK_PROFILES`` when it is set, else in the user's profile folder (``profiles_dir()``:
``$XDG_DATA_HOME/dspark_edge/profiles``, by default ``~/.local/share/dspark_edge/profiles``), then
among the profiles shipped with the package (``SHIPPED_DIR``); it says when the one found is
stale (engine changed) or was measured while throttled. ``save_profile`` writes to
``DSPARK_PROFILES`` or the user's folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import ConfigError
from .strict_json import from_json_dict, to_json_dict

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MAX_PROFILE_BYTES = 4 << 20
SHIPPED_DIR = Path(__file__).resolve().parent / "profiles"  # package data: profiles of known devices
# The profile a mode race is timed with while it is being made (``profile_in_hand``); _SEARCH:
# none in hand, the folders are searched.
_SEARCH = object()
_IN_HAND: ContextVar = ContextVar("dspark_edge_profile_in_hand", default=_SEARCH)


@dataclass(frozen=True)
class Timing:
    role: str  # "target" | "drafter" | "slots" (one pass of the slots graph: several requests' tokens)
    precision: str
    width: int  # verify width, the drafter's block size, or the slots pass's tokens in all
    context: int  # committed positions before the pass
    median_ms: float
    p90_ms: float
    slots: int = 0  # "slots" rows: the requests the graph was built for


@dataclass(frozen=True)
class ModeSpeed:
    """One decoding mode (target precision, drafter) raced against plain decoding of the most
    precise target on this device (``dspark_edge.modes.measure_modes``): greedy, the same
    prompts in turns."""
    precision: str
    drafter: str  # a drafter spec, or "none" (plain decoding)
    tokens_per_s: float  # decode tokens over decode seconds, all prompts together
    vs_reference: float  # that rate over the most precise target's plain rate, in the same run
    equal: int  # answers equal to the most precise target's plain answers
    prompts: int
    max_new_tokens: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tokens_per_s) and self.tokens_per_s > 0 and math.isfinite(self.vs_reference)
                and self.vs_reference > 0):
            raise ValueError(f"impossible speeds {self.tokens_per_s} tok/s, {self.vs_reference}x")
        if not 0 <= self.equal <= self.prompts or self.prompts < 1 or self.max_new_tokens < 1:
            raise ValueError(f"impossible counts: {self.equal} equal of {self.prompts} prompts, "
                             f"{self.max_new_tokens} tokens")

    @property
    def exact(self) -> bool:
        return self.equal == self.prompts


@dataclass(frozen=True)
class DeviceProfile:
    schema_version: int
    device_key: str
    device: dict[str, str]
    engine: str
    engine_sha256: str  # hash over the sha256 of the engine's files (``manifest_sha``)
    versions: dict[str, str]
    created_utc: str
    max_temp_c: float | None
    cpu_other_percent: float
    throttled: bool
    timings: tuple[Timing, ...]
    modes: tuple[ModeSpeed, ...] = ()  # decoding modes raced end to end (``dspark_edge.modes``)
    # The target graphs each precision's timings were measured on (``precision_sha``): they stay
    # usable when the engine changes elsewhere (e.g. an int4 graph added beside FP32 and INT8).
    precision_sha256: dict[str, str] = field(default_factory=dict)

    def times(self, engine_dir: str | Path, precision: str, status: str) -> bool:
        """Whether this profile (found with ``status``) holds timings of ``precision``'s graphs
        as ``engine_dir`` has them now."""
        if status in ("ok", "throttled"):
            return True
        return status == "stale" and self.precision_sha256.get(precision) == precision_sha(engine_dir, precision)

    def verify_ms(self, precision: str, context: int = 256) -> dict[int, float]:
        """Median ms per verify width at the profiled depth nearest ``context``."""
        rows = [t for t in self.timings if t.role == "target" and t.precision == precision]
        if not rows:
            raise ConfigError(f"the profile has no target timings at precision {precision}; re-run "
                              "`python -m dspark_edge profile`")
        depth = min({t.context for t in rows}, key=lambda d: abs(d - context))
        return {t.width: t.median_ms for t in rows if t.context == depth}

    def slots_ms(self, precision: str, slots: int) -> dict[int, float]:
        """T(n): median ms of one slots-graph pass over n tokens in all, for a graph of ``slots``
        requests (empty when the profile has none for it)."""
        return {t.width: t.median_ms for t in self.timings
                if t.role == "slots" and t.precision == precision and t.slots == slots}

    def draft_ms(self, precision: str, block: int) -> float | None:
        rows = [t.median_ms for t in self.timings if t.role == "drafter" and t.precision == precision
                and t.width == block]
        return float(np.median(rows)) if rows else None


# Instruction-set tiers that change which kernels run (and so the shape of the verify curve),
# most capable first: the first one the CPU reports names its tier in the device key.
ISA_TIERS = (("amx", "amx_tile"), ("avx512vnni", "avx512_vnni"), ("avx512", "avx512f"),
             ("avxvnni", "avx_vnni"), ("avx2", "avx2"), ("neon", "asimd"))


def cpu_identity(cpuinfo: str) -> dict[str, str]:
    """What tells CPUs apart in ``/proc/cpuinfo`` (its first processor): the model name, and the
    family/model (x86) or implementer/part (Arm) numbers and the instruction-set tier. A
    virtual machine often reports only a brand ("AMD EPYC"), under which CPUs twice as fast
    as each other hide; the numbers and the tier tell them apart."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name.strip().lower(), value.strip())
    out: dict[str, str] = {}
    cpu = fields.get("model name") or fields.get("hardware")
    if cpu:
        out["cpu"] = cpu
    if "cpu family" in fields and "model" in fields:
        out["cpu_id"] = f"f{fields['cpu family']}m{fields['model']}"
    elif "cpu implementer" in fields and "cpu part" in fields:
        out["cpu_id"] = f"{fields['cpu implementer']}-{fields['cpu part']}"
    flags = set((fields.get("flags") or fields.get("features") or "").split())
    tier = next((name for name, flag in ISA_TIERS if flag in flags), None)
    if tier:
        out["isa"] = tier
    return out


def device_identity(cpuinfo: str | None = None) -> tuple[str, dict[str, str]]:
    """(key, description) of this device; the key names the profile file. ``cpuinfo``: the
    text of ``/proc/cpuinfo`` (read when not given)."""
    import psutil

    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    cpu = cpu_identity(cpuinfo)
    ident = {"cpu": cpu.get("cpu") or platform.processor() or platform.machine(),
             **{k: v for k, v in cpu.items() if k != "cpu"},
             "cores": str(psutil.cpu_count() or 0), "machine": platform.machine(),
             "memory_gb": f"{psutil.virtual_memory().total / 2**30:.0f}", "system": platform.system()}
    gpu = ""
    try:
        import pynvml

        pynvml.nvmlInit()
        gpu = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        gpu = gpu.decode() if isinstance(gpu, bytes) else gpu
        ident["gpu"] = gpu
    except Exception:  # no NVML / no GPU: a CPU device
        pass
    parts = [ident["machine"], ident["cpu"], ident.get("cpu_id", ""), ident.get("isa", ""), f"{ident['cores']}c", gpu]
    key = re.sub(r"[^a-z0-9]+", "-", " ".join(parts).lower()).strip("-")
    return key, ident


def manifest_sha(engine_dir: Path) -> str:
    """The engine's identity for profiles: a hash over the sha256 of its target graph files
    (so a re-export of the same model on another machine of the same kind, or adding a
    drafter, keeps the verify curve the scheduler reads)."""
    from .manifest import read_manifest

    return _graphs_sha(read_manifest(Path(engine_dir)), None)


def precision_sha(engine_dir: str | Path, precision: str) -> str:
    """``manifest_sha`` of one target precision's graph files."""
    from .manifest import read_manifest

    return _graphs_sha(read_manifest(Path(engine_dir)), precision)


def _graphs_sha(m, precision: str | None) -> str:
    target_files = {v.file for v in m.variants if v.role == "target" and precision in (None, v.precision)}
    entries = sorted((f for f in m.files if f.path in target_files), key=lambda f: f.path)
    return hashlib.sha256("".join(f"{f.path}:{f.sha256};" for f in entries).encode()).hexdigest()


def _time(fn, warmup: int, reps: int) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    ms = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ms), float(np.percentile(ms, 90))


def measure_profile(engine_dir: str | Path, contexts: tuple[int, ...] = (64, 512), warmup: int = 3, reps: int = 9,
                    progress=None, slots: tuple[int, ...] = (2, 4, 8), modes: bool = True,
                    mode_options=None) -> DeviceProfile:
    """Time every target width and drafter block at each context depth and, for each count in
    ``slots``, the pass cost table T(n) of a server batching that many requests (the slots graph
    the batch runner verifies several requests' drafts with: ``BatchRunner.measure_passes``),
    which ``serve --parallel N`` then reads instead of measuring at start. Slots counts the
    engine cannot batch (no fused graph, or no ``onnx`` package) are left out with a note.
    With ``modes``, the decoding modes are raced too (``dspark_edge.modes.measure_modes``, with
    ``mode_options``), for ``precision="auto"``."""
    from .backends import BackendOptions
    from .decoder import DecoderModel
    from .manifest import read_manifest
    from .telemetry import SystemReader

    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    capacity = min(BackendOptions().max_context, manifest.model.max_position_embeddings)
    widest = max(v.width for v in manifest.variants_for("target"))
    too_deep = [d for d in contexts if d + widest > capacity]
    if too_deep:  # before anything is measured
        raise ConfigError(f"context depths {too_deep} leave no room for the widest verify pass ({widest} tokens) in "
                          f"the {capacity}-token context; give --contexts at most {capacity - widest}")
    reader = SystemReader()
    temps, others, throttled = [], [], False

    def note():
        nonlocal throttled
        s = reader.read()
        if s.max_temp_c is not None:
            temps.append(s.max_temp_c)
        others.append(s.cpu_other_percent)
        throttled |= s.throttling

    rng = np.random.default_rng(0)
    timings = []
    for precision in manifest.precisions("target"):
        model = DecoderModel(manifest, engine_dir, precision)
        cache = model.new_cache()
        for depth in contexts:
            cache.reset()
            model.prefill(cache, rng.integers(10, manifest.model.vocab_size, depth).astype(np.int64))
            ids = {w: rng.integers(10, manifest.model.vocab_size, w).astype(np.int64) for w in model.widths}
            ms = _interleaved_ms(model, cache, ids.__getitem__, warmup, reps, after_repeat=note)
            for w in model.widths:
                timings.append(Timing("target", precision, w, depth, statistics.median(ms[w]),
                                      float(np.percentile(ms[w], 90))))
            if progress:
                progress(f"target {precision} at context {depth}: " +
                         " ".join(f"w{t.width}={t.median_ms:.1f}" for t in timings[-len(model.widths):]) + " ms")
        timings += _slots_timings(model, precision, slots, reps, note, progress)
        del model, cache
    if manifest.drafter is not None:
        from .drafters.dspark import DSparkDrafter

        for precision in manifest.precisions("drafter"):
            d = DSparkDrafter(engine_dir, manifest, precision, verify_hashes=False)
            for depth in contexts:
                for block in d.blocks:
                    d.begin(())
                    feats = rng.standard_normal((depth, d.feature_dim)).astype(np.float32)
                    d.base(feats, 5, depth, block - 1)
                    pos = [depth]

                    def one_round():
                        pos[0] += 1
                        d.base(feats[:1], 5, pos[0], block - 1)

                    med, p90 = _time(one_round, warmup, reps)
                    timings.append(Timing("drafter", precision, block, depth, med, p90))
                    note()
            if progress:
                progress(f"drafter {precision}: " + " ".join(
                    f"b{t.width}@{t.context}={t.median_ms:.1f}" for t in timings if t.role == "drafter"
                    and t.precision == precision) + " ms")
    measured = DeviceProfile(
        **_stamp(), engine=manifest.model.name, modes=(),
        precision_sha256={p: _graphs_sha(manifest, p) for p in manifest.precisions("target")},
        engine_sha256=_graphs_sha(manifest, None),
        max_temp_c=max(temps) if temps else None, cpu_other_percent=float(np.median(others)) if others else 0.0,
        throttled=throttled, timings=tuple(timings))
    if not modes:
        return measured
    from dataclasses import replace

    from .modes import measure_modes

    with profile_in_hand(measured):  # the modes run on the pass costs just measured, as they will later
        raced = measure_modes(engine_dir, progress=progress, options=mode_options)
    note()
    return replace(measured, modes=raced, max_temp_c=max(temps) if temps else None,
                   cpu_other_percent=float(np.median(others)) if others else 0.0, throttled=throttled)


@contextmanager
def profile_in_hand(profile: DeviceProfile | None) -> Iterator[None]:
    """Within the block (this thread or task), ``load_profile`` without a folder answers with
    ``profile`` (None: as if this device had none), its status judged against the engine as for
    one read from disk, instead of searching the profile folders. A mode race run while a
    profile is made uses it: the modes are timed on the pass costs that loading later reads, not
    on costs measured at load (no profile saved yet) or on another folder's profile of this
    device."""
    token = _IN_HAND.set(profile)
    try:
        yield
    finally:
        _IN_HAND.reset(token)


def profile_with_modes(engine_dir: str | Path, modes: tuple[ModeSpeed, ...], reading,
                       existing: DeviceProfile | None = None) -> DeviceProfile:
    """``existing`` (this device's profile of this engine) with its raced modes replaced by
    ``modes``, or a profile holding the modes alone (the scheduler then measures pass costs at
    load, as without a profile). ``reading``: the telemetry ``Snapshot`` over the race (its
    temperature, other processes' load and throttling are recorded with a new profile)."""
    from dataclasses import replace

    from .manifest import read_manifest

    manifest = read_manifest(Path(engine_dir))
    sha = _graphs_sha(manifest, None)
    if existing is not None and existing.engine_sha256 != sha:
        # The engine changed since: keep the timings of the precisions whose graphs did not.
        kept = {p for p in existing.precision_sha256 if existing.times(engine_dir, p, "stale")}
        existing = replace(existing, engine_sha256=sha, precision_sha256={p: existing.precision_sha256[p] for p in kept},
                           timings=tuple(t for t in existing.timings if t.role == "drafter" or t.precision in kept))
    if existing is not None:
        return replace(existing, modes=tuple(modes))
    return DeviceProfile(
        **_stamp(), engine=manifest.model.name, engine_sha256=sha,
        max_temp_c=reading.max_temp_c, cpu_other_percent=float(reading.cpu_other_percent),
        throttled=bool(reading.throttling), timings=(), modes=tuple(modes))


def _stamp() -> dict:
    """The fields every new profile carries: schema, this device, library versions, time."""
    import onnxruntime

    from . import __version__

    key, ident = device_identity()
    return {"schema_version": SCHEMA_VERSION, "device_key": key, "device": ident,
            "versions": {"dspark-edge": __version__, "onnxruntime": onnxruntime.__version__, "numpy": np.__version__},
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _slots_timings(model, precision: str, counts: tuple[int, ...], reps: int, note, progress) -> list[Timing]:
    from .batching import BatchRunner
    from .errors import DSparkError

    out = []
    for p in sorted({int(c) for c in counts if int(c) > 1}):
        try:
            runner = BatchRunner(model, p, measure=False)
        except DSparkError as exc:
            if progress:
                progress(f"slots {precision}: not measured ({exc})")
            return out
        if runner.slots_pass is None:
            if progress:
                progress(f"slots {precision}: not measured (this engine or install has no slots graph; see the log)")
            return out
        table = runner.measure_passes(max(model.widths), repeats=max(3, reps // 3))
        del runner  # its second session and K/V rows go before the next count's are made
        note()
        out += [Timing("slots", precision, n, 0, ms, ms, slots=p) for n, ms in sorted(table.items())]
        if progress:
            progress(f"slots {precision}, {p} requests: " + " ".join(f"n{n}={ms:.1f}" for n, ms in sorted(table.items()))
                     + " ms")
    return out


def verify_curve_ms(model, depth: int = 128, repeats: int = 3, warmup: int = 2, seed: int = 0) -> dict[int, float]:
    """Median ms of one target pass at each listed width after ``depth`` cached positions,
    widths interleaved so drift hits every width alike."""
    rng = np.random.default_rng(seed)
    cache = model.new_cache()
    vocab = model.manifest.model.vocab_size
    model.prefill(cache, rng.integers(0, vocab, size=depth, dtype=np.int64))
    times = _interleaved_ms(model, cache, lambda w: rng.integers(0, vocab, size=w, dtype=np.int64), warmup, repeats)
    return {w: statistics.median(v) for w, v in times.items()}


def _interleaved_ms(model, cache, ids, warmup: int, repeats: int, after_repeat=None) -> dict[int, list[float]]:
    """ms of each of ``repeats`` target passes per listed width (``ids(w)``: the w tokens of a
    pass), after ``warmup`` untimed rounds. Widths are interleaved, one pass each per repeat: a
    drift of the machine's speed (boost clocks, a neighbour's load) lands on every width alike
    instead of on whichever width was being timed when it came, which would bend the curve the
    scheduler reads. ``after_repeat()`` runs after every round, outside the timing."""
    times: dict[int, list[float]] = {w: [] for w in model.widths}
    for rep in range(warmup + repeats):
        for w in model.widths:
            step_ids = ids(w)
            t0 = time.perf_counter()
            model.step(cache, step_ids)
            if rep >= warmup:
                times[w].append((time.perf_counter() - t0) * 1e3)
        if after_repeat is not None:
            after_repeat()
    return times


def quick_verify_ms(model, context: int = 128) -> dict[int, float]:
    """A rough verify curve measured now (a second or so), for a device without a profile."""
    return verify_curve_ms(model, depth=min(context, model.capacity // 2))


def cost_curve(model, engine_dir: str | Path) -> tuple[dict[int, float], str]:
    """Pass ms per listed width of ``model`` (one precision of ``engine_dir``) from this
    device's profile, or measured now (about a second) where there is none or it is stale;
    and the profile's status (``load_profile``)."""
    prof, status = load_profile(engine_dir)
    curve = None
    if prof is not None and prof.times(engine_dir, model.precision, status):
        if not any(t.role == "target" and t.precision == model.precision for t in prof.timings):
            # Not a fault: a profile holding only a modes race (the demo's first run writes one),
            # or timed before this precision was exported.
            status = "untimed"
        else:
            try:
                curve = _usable(prof.verify_ms(model.precision))
            except ConfigError as exc:
                log.warning("device profile not used: %s; measuring the pass cost now", exc)
                status = "unusable"
    if curve is None:
        log.info("device profile %s: measuring the %s pass cost now (run `python -m dspark_edge profile "
                 "--engine %s` to keep one)", status, model.precision, engine_dir)
        curve = quick_verify_ms(model)
    return {w: ms for w, ms in curve.items() if w in model.widths}, status


def profiles_dir() -> Path:
    """Where profiles are written: ``DSPARK_PROFILES``, else the user's profile folder."""
    env = os.environ.get("DSPARK_PROFILES")
    if env:
        return Path(env)
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "dspark_edge" / "profiles"


def profile_dirs() -> list[Path]:
    """Where profiles are looked for, in order: ``DSPARK_PROFILES`` alone when set, else the
    user's folder, then the shipped profiles."""
    return [profiles_dir()] if os.environ.get("DSPARK_PROFILES") else [profiles_dir(), SHIPPED_DIR]


def _usable(curve: dict[int, float]) -> dict[int, float]:
    """A profile's curve, refused when a cost is not a positive finite number of ms."""
    bad = {w: ms for w, ms in curve.items() if not (math.isfinite(ms) and ms > 0)}
    if bad:
        raise ConfigError(f"the profile has impossible pass costs {bad}")
    return curve


def save_profile(profile: DeviceProfile, folder: Path | None = None) -> Path:
    from .paths import output_dir, writing

    folder = output_dir(folder or profiles_dir(), "profile folder")
    path = folder / f"{profile.device_key}.json"
    tmp = path.with_suffix(".json.tmp")
    with writing(path, "profile"):
        tmp.write_text(json.dumps(to_json_dict(profile), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    return path


def read_profile(path: Path) -> DeviceProfile:
    from .manifest import read_bounded

    raw = read_bounded(path, MAX_PROFILE_BYTES, ConfigError, "re-run `python -m dspark_edge profile`")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # JSON and UTF-8 errors are ValueErrors
        raise ConfigError(f"{path}: not a readable profile ({type(exc).__name__}: {str(exc)[:160]}); re-run "
                          "`python -m dspark_edge profile`") from None
    return from_json_dict(DeviceProfile, data, str(path), error=ConfigError)


_SAID_MISSING: set[tuple[str, str]] = set()


def _say_missing(folders: list[Path], key: str) -> None:
    """Warn once per folders and device when they hold profiles, none of them this device's:
    the key includes the CPU model and its instruction sets, so a profile measured on an AVX2
    machine does not apply on an AVX-512 one of the same family."""
    others = sorted({p.stem for f in folders if f.is_dir() for p in f.glob("*.json")})
    where = ", ".join(map(str, folders))
    if not others or (where, key) in _SAID_MISSING:
        return
    _SAID_MISSING.add((where, key))
    log.warning("no device profile for this device (%s) in %s, which hold %s (other CPUs or instruction sets); "
                "the pass cost is measured at load instead (about a second). Run `python -m dspark_edge "
                "profile --engine ENGINE` to keep one for this device", key, where, ", ".join(others))


def load_profile(engine_dir: str | Path, folder: Path | None = None,
                 quiet: bool = False) -> tuple[DeviceProfile | None, str]:
    """This device's profile for ``engine_dir`` and a status: "ok", "missing", "stale" (the engine
    changed since), "throttled" (measured while the device was throttling), or "corrupt" (not
    readable, or a link out of its folder: ignored with a warning). ``quiet``: a caller that only
    asks whether there is one (``modes.needs_race``) leaves the warning about a missing profile
    to the load that will use it."""
    held = _IN_HAND.get() if folder is None else _SEARCH
    if held is None:
        return None, "missing"
    if held is not _SEARCH:
        return _with_status(held, engine_dir)
    key, _ = device_identity()
    folders = [folder] if folder is not None else profile_dirs()
    found = [f for f in folders if (f / f"{key}.json").is_file()]
    if not found:
        if not quiet:
            _say_missing(folders, key)
        return None, "missing"
    folder = found[0]
    path = folder / f"{key}.json"
    if folder.resolve() not in path.resolve().parents:
        log.warning("device profile ignored: %s links outside %s", path, folder)
        return None, "corrupt"
    try:
        profile = read_profile(path)
    except ConfigError as exc:  # a corrupt profile must not block loading: the cost is measured instead
        log.warning("device profile ignored: %s", exc)
        return None, "corrupt"
    return _with_status(profile, engine_dir)


def _with_status(profile: DeviceProfile, engine_dir: str | Path) -> tuple[DeviceProfile, str]:
    if profile.engine_sha256 != manifest_sha(Path(engine_dir)):
        return profile, "stale"
    return profile, "throttled" if profile.throttled else "ok"
