"""The confidence scheduler: the width choice, its early stop (lossless sampling), the online
cost correction, and the thermal / memory modes over telemetry snapshots and replayed traces."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_edge.errors import ConfigError
from dspark_edge.scheduler import CostModel, Scheduler, SchedulerConfig, choose_multi, choose_width, survival
from dspark_edge.telemetry import Snapshot, TraceRecorder, TraceReplayer, FakeReader
from dspark_edge.verify import verify_sampling

WIDTHS = (1, 2, 3, 4, 6, 8)
# A CPU-like verify curve (ms): wide verification is cheap relative to a step.
CURVE = {1: 30.0, 2: 34.0, 3: 36.0, 4: 40.0, 6: 46.0, 8: 52.0}


def _cost(w):
    return CURVE[w] + (4.0 if w > 1 else 0.0)


@pytest.mark.parametrize("conf, expected", [
    ([0.99] * 7, 8),  # confident drafts: the widest width
    ([0.05] * 7, 1),  # hopeless drafts: plain step
    ([0.95, 0.9, 0.2, 0.2, 0.2, 0.2, 0.2], 3),  # survival collapses after two drafts
    ([0.9, 0.9, 0.9], 4),  # only three drafts offered: width 4 at most
    ([], 1),
])
def test_choose_width_table(conf, expected):
    assert choose_width(np.array(conf), WIDTHS, _cost)[0] == expected


def test_choose_width_stays_on_listed_widths():
    for seed in range(50):
        c = np.random.default_rng(seed).random(7)
        assert choose_width(c, WIDTHS, _cost)[0] in WIDTHS


def test_width_one_is_required():
    with pytest.raises(ConfigError, match="width 1"):
        choose_width(np.array([0.9]), (2, 4), _cost)


def _first_token_frequency(early_stop: bool, n: int = 20000) -> float:
    """The paper's Appendix A case: p_t = (0.7, 0.3), p_d = (0.5, 0.5), c_1 = 0.8, and c_2 high
    after drawing A, zero after B; steps/s 1.0, 0.5, 0.45 for widths 1, 2, 3."""
    rng = np.random.default_rng(0)
    logits = np.log(np.array([[0.7, 0.3]] * 3))
    q = np.array([[0.5, 0.5]] * 2)
    cost = {1: 1.0, 2: 2.0, 3: 1 / 0.45}.__getitem__
    a_count = 0
    for _ in range(n):
        x = rng.integers(0, 2, 2)
        conf = np.array([0.8, 0.9 if x[0] == 0 else 0.0])
        w, _ = choose_width(conf, (1, 2, 3), cost, early_stop=early_stop)
        out = verify_sampling(x[:w - 1], q[:w - 1], logits[:w], 1.0, 0, 1.0, rng)
        a_count += out.tokens[0] == 0
    return a_count / n


def test_early_stop_keeps_sampling_lossless_and_global_search_does_not():
    assert abs(_first_token_frequency(early_stop=True) - 0.7) < 0.015
    assert abs(_first_token_frequency(early_stop=False) - 0.85) < 0.015  # biased, as the paper shows


def test_jumps_over_unlisted_widths_do_not_read_the_draft_they_admit():
    # Widths 4 → 6 admit drafts 4 and 5; c_5 (which reads x_4) must not change the choice.
    base = np.array([0.95, 0.95, 0.95, 0.6, 0.9, 0.9, 0.9])
    for c5 in (0.0, 0.5, 1.0):
        c = base.copy()
        c[4] = c5
        w_with, _ = choose_width(c, WIDTHS, _cost)
        w_ref, _ = choose_width(base, WIDTHS, _cost)
        if w_ref <= 6:
            assert (w_with >= 6) == (w_ref >= 6)


def test_multi_request_admits_by_survival_with_early_stop():
    conf = [np.array([0.95, 0.9, 0.9]), np.array([0.3, 0.9]), np.array([0.9, 0.1])]
    per_token = lambda n: 20.0 + 2.0 * n  # noqa: E731
    admitted = choose_multi(conf, per_token)
    assert admitted[0] == 3 and admitted[1] == 0 and admitted[2] == 1
    assert choose_multi(conf, lambda n: 20.0 + 200.0 * n) == [0, 0, 0]  # verification too dear
    assert sum(choose_multi(conf, per_token, max_total=4)) == 1


def test_survival_is_the_running_product():
    assert np.allclose(survival(np.array([0.5, 0.5, 1.0])), [0.5, 0.25, 0.25])


def test_cost_correction_is_robust_and_per_width():
    cm = CostModel(CURVE, 4.0, window=8, min_obs=3)
    cm.observe(8, 104.0)
    assert cm.correction(2) == pytest.approx(2.0)  # global median before width 2 has its own
    for v in (34.0, 34.0, 34.0, 340.0):  # one outlier does not move the median
        cm.observe(2, v)
    assert cm.correction(2) == pytest.approx(1.0)


def test_noisy_neighbour_shortens_widths_when_wide_passes_slow_down():
    sched = Scheduler(CostModel(CURVE, 4.0), WIDTHS)
    snap = Snapshot(t=0, mem_total_mb=8000, mem_available_mb=4000)
    conf = np.array([0.97, 0.95, 0.95, 0.93, 0.93, 0.9, 0.9])
    assert sched.decide(conf, snap).width == 8
    for _ in range(6):  # a hog: wide passes now cost 3x, narrow ones 1.2x
        for w in WIDTHS:
            sched.observe(w, CURVE[w] * (3.0 if w >= 4 else 1.2))
    assert sched.decide(conf, snap).width < 4
    for _ in range(12):  # the hog ends
        for w in WIDTHS:
            sched.observe(w, CURVE[w])
    assert sched.decide(conf, snap).width == 8


def _snap(temp=None, throttling=False, avail=4000.0, t=0.0):
    return Snapshot(t=t, mem_total_mb=8000, mem_available_mb=avail, temps_c={} if temp is None else {"cpu": temp},
                    throttling=throttling, throttle_source="test" if throttling else None)


@pytest.mark.parametrize("snap, mode, drafts", [
    (_snap(), "normal", True),
    (_snap(temp=60), "normal", True),
    (_snap(temp=83), "hot", True),
    (_snap(throttling=True), "hot", True),
    (_snap(temp=95), "parked", False),
    (_snap(avail=200), "normal", False),  # memory tight: no drafter
])
def test_modes_from_snapshots(snap, mode, drafts):
    sched = Scheduler(CostModel(CURVE, 4.0), WIDTHS)
    assert sched.wants_draft(snap) is drafts
    assert sched.mode == mode


def test_hot_prefers_shorter_widths():
    conf = np.array([0.85] * 7)
    cool, hot = Scheduler(CostModel(CURVE, 4.0), WIDTHS), Scheduler(CostModel(CURVE, 4.0), WIDTHS)
    cool.wants_draft(_snap(temp=50))
    hot.wants_draft(_snap(temp=85))
    assert hot.decide(conf, _snap(temp=85)).width < cool.decide(conf, _snap(temp=50)).width


def test_heating_then_cooling_trace_follows_without_flapping(tmp_path):
    temps = list(np.linspace(60, 95, 30)) + [94, 89, 91, 88, 90, 89] + list(np.linspace(88, 55, 30))
    jitter = np.random.default_rng(0).normal(0, 1.2, len(temps))  # sensor noise
    path = tmp_path / "trace.jsonl"
    rec = TraceRecorder(FakeReader(), path)
    for i, (t, j) in enumerate(zip(temps, jitter)):
        rec.reader.set(t=float(i), temps_c={"cpu": float(t + j)})
        rec.read()
    rec.close()
    replay = TraceReplayer(path)
    sched = Scheduler(CostModel(CURVE, 4.0), WIDTHS)
    modes = []
    for _ in temps:
        sched.wants_draft(replay.read())
        modes.append(sched.mode)
    changes = sum(a != b for a, b in zip(modes, modes[1:]))
    assert modes[0] == "normal" and "parked" in modes and modes[-1] == "normal"
    assert changes <= 4  # normal → hot → parked → hot → normal, no flapping on noise


def test_parked_probes_periodically():
    sched = Scheduler(CostModel(CURVE, 4.0), WIDTHS, SchedulerConfig(probe_every=4))
    flags = [sched.wants_draft(_snap(temp=95)) for _ in range(12)]
    assert flags.count(True) == 3 and sched.mode == "parked"
    assert "parked while hot" in sched.decide(np.zeros(0), _snap(temp=95)).reason


def test_memory_squeeze_drops_and_restores_the_drafter():
    sched = Scheduler(CostModel(CURVE, 4.0), WIDTHS)
    avail = [4000, 3000, 350, 300, 500, 700, 900, 1500]
    got = [sched.wants_draft(_snap(avail=a)) for a in avail]
    assert got == [True, True, False, False, False, False, True, True]  # hysteresis 400 → 800 MiB
    sched.wants_draft(_snap(avail=300))
    assert "memory is low" in sched.decide(np.zeros(0), _snap(avail=300)).reason


def test_every_decision_is_recorded_with_its_inputs():
    sched = Scheduler(CostModel(CURVE, 4.0), WIDTHS)
    snap = _snap(temp=70)
    sched.wants_draft(snap)
    d = sched.decide(np.array([0.9, 0.8]), snap)
    assert sched.decisions[-1] is d and d.step == 1 and d.max_temp_c == 70
    assert d.survival == pytest.approx((0.9, 0.72)) and "width" in d.reason


def test_config_is_validated():
    with pytest.raises(ConfigError):
        SchedulerConfig(hot_c=95, park_c=90)
    with pytest.raises(ConfigError):
        SchedulerConfig(memory_low_mb=900, memory_ok_mb=800)


def test_gate_stops_drafting_when_speculation_does_not_pay_and_probes():
    sched = Scheduler(CostModel(CURVE, 4.0), WIDTHS, SchedulerConfig(probe_every=5))
    snap = _snap()
    assert sched.wants_draft(snap) and not sched.gated
    for _ in range(4):  # rounds of 1.2 tokens in 45 ms: slower than a 30 ms plain step
        sched.observe_round(1, 45.0)
    assert sched.gated
    flags = [sched.wants_draft(snap) for _ in range(10)]
    assert flags.count(True) == 2  # probes
    why = sched.decide(np.zeros(0), snap).reason  # what the panel and the trace show
    assert why.startswith("plain: the gate") and "22.2 tok/s" in why and "33.3 tok/s" in why
    for _ in range(12):  # drafts start paying: 3 tokens in 50 ms
        sched.observe_round(3, 50.0)
    assert not sched.gated and sched.wants_draft(snap)


def test_probes_that_draft_well_reopen_the_gate_within_a_few_probes():
    """A closed gate's only evidence is its probes: each weighs ``probe_weight``, so a drafter
    that pays again (a prompt it suits) drafts after two good probes, not after the hundred
    rounds probes at the gate's own weight took; one poor probe keeps it closed."""
    def probes_to_reopen(config):
        sched = Scheduler(CostModel(CURVE, 4.0), WIDTHS, config)
        snap = _snap()
        for _ in range(40):  # a long run of rounds slower than plain decoding closes the gate
            sched.wants_draft(snap)
            sched.observe_round(1, 45.0)
        assert sched.gated
        probes = 0
        for _ in range(400):
            if sched.wants_draft(snap):
                if not sched.gated:
                    return probes
                probes += 1
                sched.observe_round(2, 40.0)  # the probe drafts well: 50 tokens/s against 33 plain
        return probes

    assert probes_to_reopen(SchedulerConfig(probe_every=8)) == 2
    assert probes_to_reopen(SchedulerConfig(probe_every=8, probe_weight=0.05)) >= 10
    sched = Scheduler(CostModel(CURVE, 4.0), WIDTHS, SchedulerConfig(probe_every=2))
    for _ in range(40):
        sched.observe_round(1, 45.0)
    while not sched.wants_draft(_snap()):
        pass
    sched.observe_round(1, 45.0)  # a poor probe
    assert sched.gated


def test_drafting_cost_is_sunk_within_a_round():
    # With drafting already paid, width 2 beats width 1 for any useful first draft.
    sched = Scheduler(CostModel(CURVE, 20.0), WIDTHS)
    assert sched.decide(np.array([0.3]), _snap()).width == 2


def test_gate_leaves_a_nearly_free_drafter_alone():
    """n-gram lookup costs ~0.03 ms: a round at break-even loses nothing, so the gate stays open
    and each round's width choice decides."""
    sched = Scheduler(CostModel(CURVE, 0.03), WIDTHS)
    for _ in range(10):
        sched.observe_round(1, 45.0)
    assert not sched.gated and sched.wants_draft(_snap())
    sched.costs.observe_draft(10.0)  # the same rounds with a costly drafter: gated
    assert sched.gated


def test_cost_curve_is_made_non_decreasing():
    from dspark_edge.scheduler import monotone

    assert monotone({1: 37.2, 2: 40.0, 3: 45.8, 4: 42.4, 6: 47.3, 8: 62.4}) == pytest.approx(
        {1: 37.2, 2: 40.0, 3: 44.1, 4: 44.1, 6: 47.3, 8: 62.4})
    assert monotone(CURVE) == CURVE  # already monotone: unchanged
    assert monotone({1: 50.0, 2: 30.0, 4: 10.0}) == pytest.approx({1: 30.0, 2: 30.0, 4: 30.0})


def test_corrected_cost_curve_stays_non_decreasing():
    """A width corrected upwards (an old, slow observation) never looks dearer than a wider one:
    the scan stops at the first non-improving width, so such a dip would hide the wider ones."""
    cm = CostModel(CURVE, 0.1, window=8, min_obs=3)
    for _ in range(3):
        cm.observe(2, CURVE[2] * 1.5)  # width 2 seen while the machine was busy
    for w in (1, 3, 4):
        for _ in range(3):
            cm.observe(w, CURVE[w])
    costs = [cm.verify(w) for w in sorted(CURVE)]
    assert costs == sorted(costs)
    assert cm.verify(2) <= cm.verify(3) and cm.verify(2) > CURVE[2]  # pooled, still above the profile
    conf = np.array([0.5, 0.9, 0.9])
    raw = {w: CURVE[w] * cm.correction(w) + 0.1 for w in CURVE}  # per-width corrections, not pooled
    assert choose_width(conf, WIDTHS, lambda w: raw[w])[0] == 1  # width 2's dip in value hides 3 and 4
    assert choose_width(conf, WIDTHS, cm.round)[0] == 4


def test_replay_counts_tokens_and_costs_of_each_policy():
    """bench/scheduler_replay.py: a round commits 1 + min(accepted, width - 1) tokens and costs
    verify(width) plus the drafting time when it drafted; plain steps cost verify(1)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from scheduler_replay import replay

    verify = {1: 10.0, 2: 12.0, 4: 15.0, 8: 24.0}
    widths = (1, 2, 4, 8)
    # 25 answer tokens; every position's block of 7 drafts has its first 3 accepted
    rec = {"category": "x", "acc": [3] * 24, "conf": [np.full(7, 0.9)] * 24, "draft_ms": 2.0}
    (plain,) = replay([rec], None, verify, widths)
    assert plain == pytest.approx(1 / 10.0)
    (k3,) = replay([rec], 3, verify, widths)  # width 4: 4 tokens a round for 15 + 2 ms (6 rounds: 24 tokens)
    assert k3 == pytest.approx(24 / (6 * 17.0))
    (k1,) = replay([rec], 1, verify, widths)  # width 2: 2 tokens for 12 + 2 ms
    assert k1 == pytest.approx(24 / (12 * 14.0))
    # the oracle verifies exactly the accepted drafts: 3 of them need width 4 (no width 3 here)
    (oracle,) = replay([rec], "oracle", verify, widths)
    assert oracle == pytest.approx(k3)
    # none accepted at the first position, then 1 at every later one: the oracle's first round
    # is a width-1 pass after drafting (1 token, 12 ms), the fixed length's a width-2 one (14 ms)
    mixed = {**rec, "acc": [0] + [1] * 23}
    (o,) = replay([mixed], "oracle", verify, widths)
    (f1,) = replay([mixed], 1, verify, widths)
    # (then eleven 2-token rounds of 14 ms, and a last plain step: no room left to draft)
    assert o == pytest.approx(24 / (12.0 + 11 * 14.0 + 10.0)) and f1 == pytest.approx(24 / (14.0 + 11 * 14.0 + 10.0))
    sched = Scheduler(CostModel(verify, 0.0), widths, SchedulerConfig())
    (auto,) = replay([rec], sched, verify, widths)
    assert auto > plain and sched.step > 0  # confident drafts that are accepted: it speculates
    # 0.9 said, 3 of 7 accepted: each position's offset learns from head confidences (up for
    # the three always accepted, down for the fourth, always rejected; none past the first
    # rejection) and, as in the pipeline, not from a drafter's observed rates.
    assert all(sched.offsets[:3] > 0) and sched.offsets[3] < 0 and not sched.offsets[4:].any()
    observed = Scheduler(CostModel(verify, 0.0), widths, SchedulerConfig())
    replay([{**rec, "observed_confidence": True}], observed, verify, widths)
    assert observed.step > 0 and observed.offset == 0.0
    assert all(d.confidence_offset == 0.0 for d in observed.decisions)


def test_online_offset_follows_observed_acceptance():
    """A drafter calibrated elsewhere says 0.4 for drafts accepted 90 % of the time: the offset
    rises, the adjusted confidences approach what is observed, and the chosen width widens."""
    sched = Scheduler(CostModel(CURVE, 4.0), WIDTHS)
    snap, conf = _snap(), np.full(7, 0.4)
    before = sched.decide(conf, snap).width
    rng = np.random.default_rng(0)
    for _ in range(200):
        hits = rng.random(7) < 0.9
        accepted = int(np.argmin(hits)) if not hits.all() else 7
        width = sched.decide(conf, snap).width
        sched.observe_acceptance(conf[:width - 1], min(accepted, width - 1))
    assert sched.offset > 1.5
    assert sched.adjusted(conf)[0] == pytest.approx(0.9, abs=0.08)
    after = sched.decide(conf, snap)
    assert after.width > before and after.confidence_offset == sched.offset
    # ... and back down when the same confidences start being rejected.
    for _ in range(300):
        width = sched.decide(conf, snap).width
        sched.observe_acceptance(conf[:width - 1], 0)
    assert sched.offset < 0 and sched.decide(conf, snap).width <= before


def test_online_offset_is_bounded_and_can_be_turned_off():
    sched = Scheduler(CostModel(CURVE, 4.0), WIDTHS, SchedulerConfig(max_offset=1.0))
    for _ in range(500):
        sched.observe_acceptance(np.full(3, 0.5), 3)
    assert sched.offset == pytest.approx(1.0)
    off = Scheduler(CostModel(CURVE, 4.0), WIDTHS, SchedulerConfig(online_calibration=0.0))
    for _ in range(50):
        off.observe_acceptance(np.full(3, 0.5), 3)
    conf = np.array([0.3, 0.2, 0.1])
    assert off.offset == 0.0 and np.array_equal(off.adjusted(conf), conf)
    with pytest.raises(ConfigError):
        SchedulerConfig(online_calibration=1.5)
    with pytest.raises(ConfigError):
        SchedulerConfig(gate_weight=0.0)


def test_a_short_run_of_rejections_does_not_close_the_gate():
    """The gate's rate moves slowly: five rejected rounds after many paying ones leave it open
    (with a weight of 0.2 they closed it, and only probes reopened it)."""
    for weight, gated in ((0.05, False), (0.2, True)):
        sched = Scheduler(CostModel(CURVE, 4.0), WIDTHS, SchedulerConfig(gate_weight=weight))
        for _ in range(20):
            sched.observe_round(3, 50.0)  # 60 tok/s, plain gives 33
        for _ in range(5):
            sched.observe_round(1, 60.0)  # 16.7 tok/s
        assert sched.gated is gated


def test_decide_without_shift_ignores_the_offset():
    """Observed-rate confidences (shift=False) are used as given even when an offset was learned."""
    sched = Scheduler(CostModel(CURVE, 4.0), WIDTHS)
    for _ in range(200):
        sched.observe_acceptance(np.full(3, 0.3), 3)
    assert sched.offset > 1.0
    conf, snap = np.full(7, 0.3), _snap()
    plain_choice = Scheduler(CostModel(CURVE, 4.0), WIDTHS).decide(conf, snap)
    unshifted = sched.decide(conf, snap, shift=False)
    assert unshifted.confidence_offset == 0.0 and unshifted.width == plain_choice.width
    assert unshifted.survival == plain_choice.survival
    assert sched.decide(conf, snap).survival[0] > unshifted.survival[0]


def test_declined_drafts_are_explored_so_a_low_offset_recovers():
    """Drafts declined round after round are never verified, so nothing would show they had
    become good: every ``explore_every`` declined rounds one verifies the first draft, and the
    offset, started far too low for drafts that are now always accepted, climbs back."""
    steep = {1: 10.0, 2: 15.0, 3: 19.0, 4: 23.0, 6: 30.0, 8: 37.0}  # an INT8-like curve
    conf, snap = np.full(3, 0.5), _snap()
    for explore, recovers in ((16, True), (0, False)):
        sched = Scheduler(CostModel(steep, 0.0), WIDTHS, SchedulerConfig(explore_every=explore))
        sched.offset = -3.0
        widths = []
        for _ in range(1000):
            d = sched.decide(conf, snap)
            widths.append(d.width)
            if d.width > 1:
                sched.observe_acceptance(conf[:d.width - 1], d.width - 1)  # every draft verified is accepted
        if recovers:
            first = widths.index(2)
            assert first == 15 and sched.decisions[first - 1000].mode == "probe"
            assert "explore" in sched.decisions[first - 1000].reason
            # learned: the last rounds verify drafts by choice, not by exploring
            assert sched.offset > 0 and all(d.width > 1 and d.mode == "normal" for d in list(sched.decisions)[-50:])
        else:
            assert set(widths) == {1} and sched.offset == -3.0
    with pytest.raises(ConfigError):
        SchedulerConfig(explore_every=-1)


def test_explorations_that_fail_come_ever_more_rarely_and_one_that_succeeds_resets_them():
    """Where explored drafts keep being rejected, each exploration doubles the wait before the
    next (16, 32, 64, … up to ``explore_every_max``); an accepted one brings it back to
    ``explore_every``. Without the outcome (nothing observed), the rate stays fixed."""
    steep = {1: 10.0, 2: 19.0, 3: 21.0, 4: 23.0, 6: 30.0, 8: 37.0}  # wide passes cost ~2 steps
    conf, snap = np.full(3, 0.3), _snap()

    def gaps(sched, rounds, accept_from=None):
        seen, last = [], 0
        for i in range(1, rounds + 1):
            d = sched.decide(conf, snap, shift=False)
            if d.width > 1:
                assert d.mode == "probe" and "explore" in d.reason
                seen.append(i - last)
                last = i
                sched.observe_outcome(1 if accept_from is not None and len(seen) >= accept_from else 0)
            else:
                sched.observe_outcome(0)
        return seen

    sched = Scheduler(CostModel(steep, 0.0), WIDTHS, SchedulerConfig(explore_every=16, explore_every_max=128))
    assert gaps(sched, 900) == [16, 32, 64, 128, 128, 128, 128, 128, 128]
    sched = Scheduler(CostModel(steep, 0.0), WIDTHS, SchedulerConfig(explore_every=16, explore_every_max=128))
    assert gaps(sched, 300, accept_from=3) == [16, 32, 64] + [16] * 11  # the third is accepted: back to 16
    with pytest.raises(ConfigError, match="explore_every_max"):
        SchedulerConfig(explore_every=32, explore_every_max=16)


def test_drafting_time_is_kept_per_source():
    """A drafter with two sources (n-gram lookup, a model) gets each one's drafting time in the
    rounds it drafts; without a source, the moving time over all rounds."""
    from dspark_edge.scheduler import CostModel

    costs = CostModel({1: 10.0, 2: 11.0}, 0.0)
    for _ in range(5):
        costs.observe_draft(40.0, source="self")
        costs.observe_draft(0.2, source="ngram")
    assert costs.drafting("ngram") == pytest.approx(0.2)
    assert costs.drafting("self") == pytest.approx(40.0)
    assert 0.2 < costs.drafting() < 40.0 and costs.drafting("unseen") == costs.drafting()
    assert costs.round(2, source="self") == pytest.approx(51.0)


def test_the_yardstick_measures_rounds_as_the_scheduler_chooses_them():
    """What a drafter that stops early asks (widths.Yardstick): the scheduler's own rule, cost
    curve and offset; a policy without a cost model gives none."""
    from dspark_edge.scheduler import CostModel, Scheduler, choose_width, shifted
    from dspark_edge.widths import FixedLength, Scheduled, SurvivalCut

    costs = {1: 10.0, 2: 11.0, 4: 13.0, 8: 20.0}
    sched = Scheduler(CostModel(costs, 0.0), tuple(costs))
    sched.offset = -0.4
    ys = Scheduled(sched).yardstick(tuple(costs))
    conf = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
    assert ys.best(conf, spent_ms=3.0) == choose_width(conf, tuple(costs), lambda w: 3.0 + sched.costs.verify(w))
    assert ys.at(4, 1.5, 2.0) == pytest.approx(2.5 / 15.0) and ys.plain() == pytest.approx(0.1)
    assert np.allclose(ys.shifted(conf), shifted(conf, -0.4))
    assert FixedLength(3).yardstick(tuple(costs)) is None and SurvivalCut(0.3).yardstick(tuple(costs)) is None
