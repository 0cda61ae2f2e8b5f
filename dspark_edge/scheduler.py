"""The confidence scheduler: which verify width to run this round, from the drafter's
calibrated confidences, the device profile's cost curve corrected by observed step times, and
telemetry (heat, throttling, memory).

Pure math first (the paper's Algorithm 1, read for a device):
    survival a_j = Π_{i≤j} c_i;  tau(l) = 1 + Σ_{j≤l} a_j;  pick l maximising tau(l) / cost(l+1),
    scanning upward and stopping at the first step that does not improve.
The scan only uses what is known before a draft is drawn: c_j depends on x_{j-1}, never on
x_j. Where the listed widths skip (e.g. 4 → 6), the jump is judged from the survivals up to the
current width, extended with the last conditional c, so admitting x_4 never depends on x_4.

Then ``Scheduler``: small state (online cost correction, online confidence offsets by draft position,
thermal/memory modes with hysteresis, probes while parked) and a record of every decision with
its inputs and reason.

The confidence offset: a drafter's confidences are calibrated offline on held-out rounds of its
training distribution, and a workload it drafts better or worse for shifts them (measured:
docs/notes/, "DSpark drafter"). The scheduler therefore shifts each confidence in logit space by
an offset of its draft position, c'_j = σ(logit c_j + δ_j), and after each verified round moves
δ_j by ``online_calibration`` × (y_j − c'_j) for every verified draft j up to the first rejection
(y = 1 accepted, 0 rejected): a stochastic gradient step on the log-loss of the conditional
acceptance at that position. One offset per position because a workload unlike the drafter's
training data shifts the positions unequally (the DSpark drafter on prompts unlike its training
answers: δ about −0.6 for the first draft and −0.1 for the second), and one shared offset then
over-trusts some positions and under-trusts others (docs/performance.md, "An offset per draft
position"). Positions past ``OFFSET_POSITIONS`` share the last one's. δ depends only on past
rounds, so the width choice of a round still never looks at its own draws. Drafters whose confidences are observed acceptance
rates of the generation itself (the n-gram drafter's ``observed_confidence``) are neither
shifted nor counted: the pipeline passes ``shift=False`` and skips ``observe_acceptance``.

Exploration: both the offset and a drafter's own acceptance counts learn only from verified
drafts, and the cost correction of a width only from passes at that width. A bad stretch (a
run of rejections, a few slow wide passes) can make every draft look not worth verifying, and
then nothing would ever show otherwise (a replay that starts at δ = −3 verifies no draft at all:
docs/notes/, "Calibrated n-gram confidences"). So after
``explore_every`` rounds in a row whose drafts were all declined, one round verifies the first
draft (the narrowest listed width above 1); the choice depends only on that count. Each explored
draft that is rejected doubles that count for the next time (up to ``explore_every_max``), so a
drafter that keeps failing costs ever fewer wide passes; an accepted one resets it.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .config import check_field_types
from .errors import ConfigError
from .telemetry import Snapshot

log = logging.getLogger(__name__)


def _survival(confidence) -> tuple[list[float], list[float]]:
    """(clipped confidences, survivals) as Python floats: a round's arrays hold a few numbers,
    where numpy's per-call overhead is most of the cost."""
    c = [min(max(float(x), 0.0), 1.0) for x in confidence]
    return c, list(itertools.accumulate(c, operator.mul))


def survival(confidence) -> np.ndarray:
    """a_j = Π_{i≤j} c_i, confidences clipped to [0, 1]."""
    return np.asarray(_survival(confidence)[1], dtype=np.float64)


def choose_width(confidence, widths: Sequence[int], cost, early_stop: bool = True) -> tuple[int, float]:
    """(verify width, expected tokens per unit cost). ``widths`` are the listed verify widths
    (1 must be among them), ``cost(w)`` the round cost at width w. ``early_stop=False`` is the
    retrospective global search: not lossless for a verify width (tests show why), used only
    where the choice cannot change what is drafted (the self drafter's staged check)."""
    c, a = _survival(confidence)
    listed = sorted(w for w in widths if w - 1 <= len(c))
    if not listed or listed[0] != 1:
        raise ConfigError(f"the scheduler needs width 1 among the widths, got {sorted(widths)}")
    best_w, best_v = 1, 1.0 / cost(1)
    for prev, w in zip(listed, listed[1:]):
        known = prev  # drafts 1..prev-1 admitted; a_1..a_prev are known before x_prev is drawn
        if early_stop:
            expected = sum(a[:known])
            if w - 1 > known:  # a skipped width: extend with the last conditional c
                expected += sum(a[known - 1] * c[known - 1] ** e for e in range(1, w - known))
        else:
            expected = sum(a[:w - 1])
        v = (1.0 + expected) / cost(w)
        if v > best_v:
            best_w, best_v = w, v
        elif early_stop:
            break
    return best_w, best_v


def choose_multi(confidences: Sequence[np.ndarray], cost_of_total, max_total: int | None = None) -> list[int]:
    """Drafts to verify per request, for a batch of requests: admit (request, position) pairs
    in order of survival while total expected tokens per unit cost improves; stop at the first
    pair that does not. ``cost_of_total(n)`` is the cost of one target pass over n tokens (the
    requests' anchors included). Returns drafts per request."""
    pool = []
    for r, c in enumerate(confidences):
        a = survival(c)
        pool += [(-a[j], r, j) for j in range(a.shape[0])]
    pool.sort()
    admitted = [0] * len(confidences)
    n = len(confidences)
    tokens = float(n)
    best = tokens / cost_of_total(n)
    for neg_a, r, j in pool:
        if j != admitted[r]:  # a prefix must be admitted in order
            continue
        if max_total is not None and n + 1 > max_total:
            break
        v = (tokens - neg_a) / cost_of_total(n + 1)
        if v <= best:
            break
        admitted[r], n, tokens, best = j + 1, n + 1, tokens - neg_a, v
    return admitted


OFFSET_POSITIONS = 16  # draft positions with an online confidence offset of their own


def shifted(confidence, offset: float | Sequence[float]) -> np.ndarray:
    """Confidences shifted in logit space, σ(logit c_j + δ_j) (the scheduler's online offsets; a
    drafter comparing its own sources applies them the same way). ``offset``: one δ for every
    position, or one per position (positions past its end take its last)."""
    per = None if isinstance(offset, (int, float)) else tuple(offset)
    if (per is None and offset == 0.0) or (per is not None and not any(per)):
        return np.asarray(confidence, dtype=np.float64)
    out = []
    for j, x in enumerate(confidence):  # a few numbers: plain floats are cheaper than numpy here
        c = min(max(float(x), 1e-6), 1.0 - 1e-6)
        d = offset if per is None else per[min(j, len(per) - 1)]
        out.append(1.0 / (1.0 + math.exp(-(math.log(c / (1.0 - c)) + d))))
    return np.asarray(out, dtype=np.float64)


@dataclass(frozen=True)
class SchedulerConfig:
    """Every knob of the scheduler, with its default. Temperatures in °C, memory in MiB."""

    hot_c: float = 80.0  # at or above: prefer shorter widths (energy-aware cost)
    park_c: float = 90.0  # at or above: park speculation (plain decoding, periodic probes)
    hysteresis_c: float = 5.0  # leave a mode only this far below its threshold
    energy_bias: float = 0.25  # hot: cost(w) *= 1 + energy_bias * (w - 1)
    probe_every: int = 16  # parked: one speculative round every this many rounds
    memory_low_mb: float = 400.0  # available memory below this: drop the drafter
    memory_ok_mb: float = 800.0  # ... and take it back above this
    cost_window: int = 12  # observed step times kept per width (robust median)
    min_observations: int = 3  # before a width's own correction is trusted
    gate_draft_share: float = 0.05  # the gate acts only when drafting costs this share of a plain step
    gate_weight: float = 0.05  # weight of each speculative round in the gate's moving rate
    probe_weight: float = 0.25  # weight of a probe round (it stands for the probe_every rounds the gate skipped)
    max_record: int = 1024  # decisions kept in memory (a trace keeps them all: dspark_edge.metrics)
    online_calibration: float = 0.1  # step size of the online confidence offset (0: confidences as given)
    max_offset: float = 3.0  # every offset stays within ± this (logits)
    explore_every: int = 16  # drafts offered and declined this many rounds in a row: verify one (0: never)
    explore_every_max: int = 256  # ... doubling after each explored draft rejected, up to this

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.max_record < 1:
            raise ConfigError(f"max_record must be >= 1, got {self.max_record}")
        if not self.hot_c < self.park_c:
            raise ConfigError(f"hot_c ({self.hot_c}) must be below park_c ({self.park_c})")
        if self.hysteresis_c < 0 or self.energy_bias < 0:
            raise ConfigError("hysteresis_c and energy_bias must be >= 0")
        if not 0.0 < self.gate_weight <= 1.0:
            raise ConfigError(f"gate_weight must be in (0, 1], got {self.gate_weight}")
        if not 0.0 < self.probe_weight <= 1.0:
            raise ConfigError(f"probe_weight must be in (0, 1], got {self.probe_weight}")
        if not 0.0 <= self.gate_draft_share <= 1.0:
            raise ConfigError(f"gate_draft_share must be in [0, 1], got {self.gate_draft_share}")
        if self.explore_every < 0:
            raise ConfigError(f"explore_every must be >= 0 (0: never), got {self.explore_every}")
        if self.explore_every_max < self.explore_every:
            raise ConfigError(f"explore_every_max ({self.explore_every_max}) must be >= explore_every "
                              f"({self.explore_every})")
        if self.probe_every < 1 or self.cost_window < 1 or self.min_observations < 1:
            raise ConfigError("probe_every, cost_window and min_observations must be >= 1")
        if not self.memory_low_mb < self.memory_ok_mb:
            raise ConfigError("memory_low_mb must be below memory_ok_mb")
        if not 0.0 <= self.online_calibration <= 1.0 or self.max_offset < 0:
            raise ConfigError(f"online_calibration must be in [0, 1] and max_offset >= 0, got "
                              f"{self.online_calibration} and {self.max_offset}")


def monotone(curve: dict[int, float]) -> dict[int, float]:
    """The least-squares non-decreasing fit of a cost curve (pool adjacent violators): a wider
    pass is never cheaper, so a measured dip (timing noise) is averaged with its neighbour
    instead of making that width look like a bargain."""
    widths = sorted(curve)
    blocks: list[list[float]] = []  # [sum, count] per pooled block
    for w in widths:
        blocks.append([curve[w], 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    out, i = {}, 0
    for total, n in blocks:
        for _ in range(int(n)):
            out[widths[i]] = total / n
            i += 1
    return out


class CostModel:
    """Round cost (ms) per verify width: the profile's curve (made non-decreasing) times an
    online correction, the median ratio observed/profiled of the last few rounds at that width
    (the median over all widths until a width has its own), so a busy or throttled device shows
    within a few rounds. The corrected curve is made non-decreasing again: per-width corrections
    come from different moments (a rarely used width keeps an older one), and a width that looks
    dearer than the next wider one would stop the scheduler's upward scan early."""

    def __init__(self, verify_ms: dict[int, float], draft_ms: float, window: int = 12, min_obs: int = 3) -> None:
        self.verify_ms, self.draft_ms = monotone(verify_ms), float(draft_ms)
        self.draft_by_source: dict[str, float] = {}  # for a drafter with several sources (ngram+self)
        self.ratios: dict[int, deque] = {w: deque(maxlen=window) for w in verify_ms}
        self.all_ratios: deque = deque(maxlen=window)
        self.min_obs = min_obs
        self._corr: dict[int, float] = {}
        self._global = 1.0
        self._verify = dict(self.verify_ms)  # the corrected, non-decreasing curve

    def correction(self, width: int) -> float:
        """Cached: recomputed only when a round is observed."""
        return self._corr.get(width, self._global)

    def _refresh(self, width: int) -> None:
        own = self.ratios.get(width)
        if own is not None and len(own) >= self.min_obs:
            self._corr[width] = statistics.median(own)
        self._global = statistics.median(self.all_ratios) if self.all_ratios else 1.0
        self._verify = monotone({w: v * self.correction(w) for w, v in self.verify_ms.items()})

    def verify(self, width: int) -> float:
        return self._verify[width]

    def drafting(self, source: str | None = None) -> float:
        """The moving drafting time of rounds drafted by ``source`` (all rounds' when None or
        not seen yet)."""
        return self.draft_by_source.get(source, self.draft_ms) if source is not None else self.draft_ms

    def round(self, width: int, drafting: bool = True, source: str | None = None) -> float:
        return self.verify(width) + (self.drafting(source) if drafting else 0.0)

    def observe_draft(self, ms: float, weight: float = 0.2, source: str | None = None) -> None:
        """Drafting time is measured directly (moving average, overall and per ``source``); it
        needs no profile."""
        self.draft_ms = ms if self.draft_ms <= 0 else (1 - weight) * self.draft_ms + weight * ms
        if source is not None:
            old = self.draft_by_source.get(source)
            self.draft_by_source[source] = ms if old is None else (1 - weight) * old + weight * ms

    def observe(self, width: int, verify_ms: float) -> None:
        if width in self.verify_ms and verify_ms > 0:
            r = verify_ms / self.verify_ms[width]
            self.ratios[width].append(r)
            self.all_ratios.append(r)
            self._refresh(width)


@dataclass(frozen=True)
class Decision:
    step: int
    mode: str  # "normal" | "hot" | "parked" | "probe"
    width: int
    drafts_offered: int
    expected_tokens_per_ms: float
    reason: str
    max_temp_c: float | None
    throttling: bool
    mem_available_mb: float
    cpu_other_percent: float
    correction: float
    survival: tuple[float, ...] = field(default=())  # after the confidence offset
    confidence_offset: float = 0.0  # δ_1, added to the first confidence's logit this round
    confidence_offsets: tuple[float, ...] = field(default=())  # δ_j of each draft position this round


class Scheduler:
    """Per-generation state; ``decide`` is called once per round after drafting."""

    def __init__(self, costs: CostModel, widths: Sequence[int], config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.costs = costs
        self.widths = tuple(sorted(widths))
        self.mode = "normal"
        self.memory_low = False
        self.step = 0
        self._since_probe = 0
        self._probing = False  # this round drafts because it is a probe of the closed gate
        self.spec_rate: float | None = None  # tokens per ms of recent speculative rounds
        self._spec_rounds = 0
        self.offsets = np.zeros(OFFSET_POSITIONS)  # the online confidence offsets δ_j (logits) by draft position
        self._declined = 0  # rounds in a row whose offered drafts were all declined
        self._explore_after = self.config.explore_every  # declined rounds before the next explore
        self._explored = False  # this round verifies a draft only to explore
        self._source: str | None = None  # the drafter's source of this round's drafts (see decide)
        self.decisions: deque[Decision] = deque(maxlen=self.config.max_record)

    # -- modes ------------------------------------------------------------------------------
    def update_modes(self, snap: Snapshot | None) -> None:
        """Hot, parked and memory modes from a reading; None (nothing samples telemetry, or the
        pipeline was closed) keeps the modes as they are."""
        if snap is None:
            return
        cfg, t = self.config, snap.max_temp_c
        hot = snap.throttling or (t is not None and t >= cfg.hot_c)
        cool = not snap.throttling and (t is None or t < cfg.hot_c - cfg.hysteresis_c)
        old = self.mode
        if t is not None and t >= cfg.park_c:
            self.mode = "parked"
        elif self.mode == "parked":
            if t is None or t < cfg.park_c - cfg.hysteresis_c:
                self.mode = "hot" if not cool else "normal"
        elif hot:
            self.mode = "hot"
        elif self.mode == "hot" and cool:
            self.mode = "normal"
        if self.mode != old:
            log.info("scheduler mode %s → %s (max temp %s °C, throttling %s)", old, self.mode, t, snap.throttle_source)
        if not self.memory_low and snap.mem_total_mb > 0 and snap.mem_available_mb < cfg.memory_low_mb:
            self.memory_low = True
            log.warning("available memory %.0f MiB < %.0f MiB: dropping the drafter", snap.mem_available_mb,
                        cfg.memory_low_mb)
        elif self.memory_low and snap.mem_available_mb >= cfg.memory_ok_mb:
            self.memory_low = False
            log.info("available memory %.0f MiB: drafter may come back", snap.mem_available_mb)

    def wants_draft(self, snap: Snapshot) -> bool:
        """Before drafting: False when parked, or when speculative rounds have recently produced
        fewer tokens per ms than plain steps would (the gate), except on a probe round; False
        when memory is low."""
        self.update_modes(snap)
        if self.memory_low:
            return False
        self._probing = False
        if self.mode == "parked" or self.gated:
            self._since_probe += 1
            if self._since_probe >= self.config.probe_every:
                self._since_probe, self._probing = 0, True
                return True
            return False
        return True

    @property
    def gated(self) -> bool:
        """Speculation is not paying: the observed speculative rate is below the plain rate.
        Only for a drafter whose drafting costs something: a nearly free one (n-gram lookup)
        loses nothing by offering drafts, and the width choice already weighs them."""
        if self.spec_rate is None or self._spec_rounds < self.config.min_observations:
            return False
        if self.costs.draft_ms < self.config.gate_draft_share * self.costs.verify(1):
            return False
        return self.spec_rate < 1.0 / self.costs.verify(1)

    def observe_round(self, tokens: int, ms: float, weight: float | None = None) -> None:
        """A speculative round's outcome: committed tokens and its time (drafting + verify),
        folded into the gate's moving rate with ``gate_weight``. The weight is small on purpose:
        the rate is kept across generations, so one prompt's short run of rejected wide rounds
        must not close the gate for the next (bench/scheduler_replay.py measures the choice). A
        probe round, the gate's only evidence while it is closed, weighs ``probe_weight``: at
        the gate's weight a closed gate would stay closed for about a hundred rounds into a
        prompt the drafter suits, long after its probes drafted well."""
        probing, self._probing = self._probing, False
        if ms <= 0:
            return
        if weight is None:
            weight = self.config.probe_weight if probing else self.config.gate_weight
        rate = tokens / ms
        self.spec_rate = rate if self.spec_rate is None else (1 - weight) * self.spec_rate + weight * rate
        self._spec_rounds += 1

    def _cost(self, w: int) -> float:
        # Within a round the drafting is already paid; every width, 1 included, carries it, so
        # the choice compares what each width adds. Whether to draft at all is the gate's call.
        # It is the moving time of past rounds (of this round's source), never this round's
        # own: a drafter that stops early drafts for a time that depends on its draws.
        c = self.costs.round(w, drafting=True, source=self._source)
        if self.mode in ("hot", "parked"):
            c *= 1.0 + self.config.energy_bias * (w - 1)
        return c

    @property
    def offset(self) -> float:
        """The first draft position's online offset δ_1 (each position has its own: ``offsets``)."""
        return float(self.offsets[0])

    @offset.setter
    def offset(self, value: float) -> None:
        """Set every position's offset to ``value``."""
        self.offsets[:] = value

    def adjusted(self, confidence: np.ndarray) -> np.ndarray:
        """The drafter's confidences shifted by the online offsets: σ(logit c_j + δ_j)."""
        return shifted(confidence, self.offsets)

    def observe_acceptance(self, confidence: np.ndarray, accepted: int) -> None:
        """A verified round: the drafter's confidences for the drafts it verified (before the
        offsets) and how many were accepted. Moves each verified position's offset, up to the
        first rejection, toward what was observed there."""
        lr = self.config.online_calibration
        if lr <= 0.0:
            return
        c = self.adjusted(confidence)
        n = min(int(accepted) + 1, c.shape[0])  # positions up to the first rejection
        if n < 1:
            return
        y = (np.arange(n) < accepted).astype(np.float64)
        bound = self.config.max_offset
        m = min(n, OFFSET_POSITIONS)
        self.offsets[:m] = np.clip(self.offsets[:m] + lr * (y[:m] - c[:m]), -bound, bound)
        if n > m:  # the positions past the last share its offset
            self.offsets[-1] = float(np.clip(self.offsets[-1] + lr * float((y[m:] - c[m:]).sum()), -bound, bound))

    def decide(self, confidence: np.ndarray, snap: Snapshot | None, shift: bool = True, source: str | None = None) -> Decision:
        """The verify width for drafts with these calibrated confidences, shifted by the online
        offset unless ``shift`` is false (confidences that are observed acceptance rates already,
        as the n-gram drafter's are). ``source``: which of a drafter's sources drafted them
        (its drafting time is costed apart)."""
        self.step += 1
        self._source = source
        snap = snap if snap is not None else Snapshot(t=0.0)  # nothing samples telemetry: nothing known
        confidence = np.asarray(confidence)
        k = int(confidence.shape[0])
        use = shift and k > 0
        if use:
            confidence = self.adjusted(confidence)
        mode = "probe" if (self.mode == "parked" or self.gated) and k else self.mode
        if k == 0:
            width, value, why = 1, 1.0 / self._cost(1), self._why_no_drafts()
        else:
            fits = [w for w in self.widths if w - 1 <= k]
            width, value = choose_width(confidence, fits, self._cost)
            why = (f"tau/cost best at width {width} (stopped at the first non-improving width)"
                   + (", energy-weighted: hot" if self.mode == "hot" else ""))
            self._declined = self._declined + 1 if width == 1 else 0
            if width > 1:  # verifying drafts by choice: the estimates say they pay, explore at the base rate
                self._explore_after = self.config.explore_every
            explore = self._explore_after
            if explore and self._declined >= explore and len(fits) > 1:
                # Declined drafts are never verified, so nothing would ever show that they had
                # become worth verifying: the offset (and a drafter's own acceptance counts)
                # would stay where a bad stretch left them. One narrow verify now and then keeps
                # them learning. It depends on the count of past rounds only, never on this
                # round's draws, so sampling stays exact.
                width, mode, self._declined, self._explored = fits[1], "probe", 0, True
                value = 1.0 / self._cost(width)
                why = (f"explore: drafts declined {explore} rounds in a row; verifying the first keeps the "
                       "confidence estimates learning")
        d = Decision(self.step, mode, width, k, value, why, snap.max_temp_c, snap.throttling,
                     snap.mem_available_mb, snap.cpu_other_percent, self.costs.correction(width),
                     tuple(_survival(confidence)[1]), self.offset if use else 0.0,
                     tuple(round(float(x), 4) for x in self.offsets[:max(k, 1)]) if use else ())
        self.decisions.append(d)
        return d

    def _why_no_drafts(self) -> str:
        if self.memory_low:
            return "plain: available memory is low, the drafter is unloaded"
        if self.mode == "parked":
            return f"plain: parked while hot (probe every {self.config.probe_every} rounds)"
        if self.gated:
            return (f"plain: the gate - speculative rounds gave {self.spec_rate * 1e3:.1f} tok/s, plain steps "
                    f"{1e3 / self.costs.verify(1):.1f} tok/s (probe every {self.config.probe_every} rounds)")
        return "plain: the drafter offered no drafts"

    def observe(self, width: int, verify_ms: float) -> None:
        self.costs.observe(width, verify_ms)

    def observe_outcome(self, accepted: int) -> None:
        """How many drafts this round's verify accepted. An explored draft that was rejected
        doubles the wait before the next exploration (up to ``explore_every_max``): where drafts
        keep failing (a target whose wider passes cost far more than one step, a text the
        drafter cannot follow) each exploration costs a wider pass for nothing, and at a fixed
        rate that cost stays. An accepted one returns the wait to ``explore_every``. Only past
        rounds decide, so sampling stays exact."""
        if not self._explored:
            return
        self._explored = False
        cfg = self.config
        self._explore_after = cfg.explore_every if accepted else min(2 * self._explore_after, cfg.explore_every_max)
