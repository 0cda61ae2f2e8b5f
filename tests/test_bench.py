"""The benchmark's paired ratios: bootstrap intervals over prompts and the scheduled variant
against the best fixed length, overall and per category."""

from __future__ import annotations

import pytest

from dspark_edge.bench import paired_comparison, ratio_interval


def row(pid, cat, tokens_per_s, pass_index=0, new_tokens=65):
    return {"id": pid, "category": cat, "pass": pass_index, "new_tokens": new_tokens,
            "decode_s": (new_tokens - 1) / tokens_per_s}


def test_ratio_is_exact_when_every_prompt_agrees():
    a = [row(f"p{i}", "x", 20.0 * (1 + i)) for i in range(6)]
    b = [row(f"p{i}", "x", 20.0 * (1 + i) / 1.1) for i in range(6)]
    r = ratio_interval(a, b)
    assert r["ratio"] == pytest.approx(1.1, abs=1e-4)
    assert r["ci95"] == pytest.approx([1.1, 1.1], abs=1e-4)
    assert r["prompts"] == 6


def test_interval_widens_with_disagreeing_prompts_and_holds_the_ratio():
    speed = [1.4, 0.8, 1.3, 0.9, 1.2, 0.85, 1.35, 0.95]
    a = [row(f"p{i}", "x", 30.0 * s) for i, s in enumerate(speed)]
    b = [row(f"p{i}", "x", 30.0) for i in range(len(speed))]
    r = ratio_interval(a, b)
    lo, hi = r["ci95"]
    assert lo < r["ratio"] < hi
    assert hi - lo > 0.1  # prompts that disagree this much cannot pin the ratio to a few percent
    assert r == ratio_interval(a, b)  # the resampling is seeded


def test_passes_of_one_prompt_are_resampled_together():
    a = [row("p0", "x", 10.0, 0), row("p0", "x", 30.0, 1), row("p1", "x", 20.0, 0), row("p1", "x", 20.0, 1)]
    b = [row("p0", "x", 20.0, 0), row("p0", "x", 20.0, 1), row("p1", "x", 20.0, 0), row("p1", "x", 20.0, 1)]
    r = ratio_interval(a, b)
    assert r["prompts"] == 2
    # decode rate over both passes of p0: 128 tokens in 6.4 + 2.13 s, against 128 in 6.4 s for b
    assert r["ratio"] == pytest.approx((256 / (6.4 + 6.4 / 3 + 3.2 + 3.2)) / (256 / 12.8), abs=1e-4)


def test_scheduled_variant_is_compared_with_the_best_fixed_length_per_category():
    drafter = object()
    variants = [("plain", None, {}), ("d auto", drafter, {}), ("d k=1", drafter, {"draft_tokens": 1}),
                ("d k=2", drafter, {"draft_tokens": 2})]
    rates = {  # category code: k=2 is best; category chat: k=1 is best
        "plain": {"code": 20, "chat": 20}, "d auto": {"code": 27, "chat": 25},
        "d k=1": {"code": 24, "chat": 26}, "d k=2": {"code": 30, "chat": 22}}
    rows = {name: [row(f"{cat}-{i}", cat, rate) for cat, rate in by_cat.items() for i in range(3)]
            for name, by_cat in rates.items()}
    out = paired_comparison(rows, variants)
    assert set(out["vs_plain"]) == {"d auto", "d k=1", "d k=2"}
    assert out["vs_plain"]["d k=2"]["ratio"] == pytest.approx(
        (6 * 64 / (3 * 64 / 30 + 3 * 64 / 22)) / 20, abs=1e-4)
    entry = out["d auto vs best fixed"]
    assert entry["best_fixed"] == "d k=2"  # the higher rate over the whole set
    assert entry["by_category"]["code"]["best_fixed"] == "d k=2"
    assert entry["by_category"]["code"]["ratio"] == pytest.approx(0.9, abs=1e-4)
    assert entry["by_category"]["chat"]["best_fixed"] == "d k=1"
    assert entry["by_category"]["chat"]["ratio"] == pytest.approx(25 / 26, abs=1e-4)
    assert "d k=1 vs best fixed" not in out  # fixed lengths are not scheduled variants


def test_plain_decoding_is_the_fixed_width_to_beat_where_drafting_does_not_pay():
    drafter = object()
    variants = [("plain", None, {}), ("d auto", drafter, {}), ("d k=1", drafter, {"draft_tokens": 1})]
    rates = {"plain": {"qa": 30, "math": 20}, "d auto": {"qa": 29, "math": 24}, "d k=1": {"qa": 25, "math": 26}}
    rows = {name: [row(f"{cat}-{i}", cat, rate) for cat, rate in by_cat.items() for i in range(2)]
            for name, by_cat in rates.items()}
    entry = paired_comparison(rows, variants)["d auto vs best fixed"]
    assert entry["by_category"]["qa"]["best_fixed"] == "plain"
    assert entry["by_category"]["qa"]["ratio"] == pytest.approx(29 / 30, abs=1e-4)
    assert entry["by_category"]["math"]["best_fixed"] == "d k=1"


def test_with_several_drafters_each_scheduler_also_meets_the_best_fixed_width_of_any():
    a, b = object(), object()
    variants = [("plain", None, {}), ("a auto", a, {}), ("a k=1", a, {"draft_tokens": 1}),
                ("b auto", b, {}), ("b k=1", b, {"draft_tokens": 1})]
    rates = {"plain": 20, "a auto": 27, "a k=1": 24, "b auto": 26, "b k=1": 30}
    rows = {name: [row(f"qa-{i}", "qa", rate) for i in range(2)] for name, rate in rates.items()}
    out = paired_comparison(rows, variants)
    entry = out["a auto vs best fixed"]
    assert entry["best_fixed"] == "a k=1" and entry["overall"]["ratio"] == pytest.approx(27 / 24, abs=1e-4)
    assert entry["best_fixed_any"]["best_fixed"] == "b k=1"
    assert entry["best_fixed_any"]["ratio"] == pytest.approx(27 / 30, abs=1e-4)
    one = paired_comparison({n: rows[n] for n in ("plain", "a auto", "a k=1")}, variants[:3])
    assert "best_fixed_any" not in one["a auto vs best fixed"]  # one drafter: its own best is the best


class _Stats:
    def __init__(self, rounds):
        self.tokens_per_s, self.decode_s, self.new_tokens, self.rounds = 50.0, 0.1, 6, rounds
        self.draft_n = self.draft_n_accepted = 0
        self.accept_length_hist, self.widths = {}, {"1": rounds}
        self.drafter_disabled = None


class _Result:
    def __init__(self, rounds):
        self.token_ids, self.stats = (1, 2, 3, 4, 5, 6), _Stats(rounds)


class _Sched:
    def __init__(self):
        self.costs = type("C", (), {"draft_ms": 0.0})()
        self.offsets, self.gated, self.rounds = [0.0] * 16, False, 0


class _FakePipe:
    """Records which drafter and scheduler each generation ran with, through which twin."""

    def __init__(self, drafter=None, scheduler=None, calls=None):
        self.drafter, self.scheduler = drafter, _Sched() if calls is None else scheduler
        self.calls, self.twins, self.closed = [] if calls is None else calls, [], False

    def twin(self, drafter=None, scheduler=None):
        twin = _FakePipe(drafter, scheduler, self.calls)
        self.twins.append(twin)
        return twin

    def close(self):
        self.closed = True

    def generate(self, prompt, cfg, **overrides):
        if self.drafter is not None:  # the pipeline consults its scheduler only with a drafter
            self.scheduler.rounds += 1
        self.calls.append((self.drafter, self.scheduler, "draft_tokens" in overrides))
        return _Result(5)


def test_each_drafter_keeps_its_own_scheduler():
    from dspark_edge.bench import bench_compare

    own = object()
    pipe = _FakePipe(own)
    first = pipe.scheduler
    a, b = object(), object()
    variants = [("plain", None, {}), ("a auto", a, {}), ("a k=1", a, {"draft_tokens": 1}), ("b auto", b, {})]
    prompts = [{"id": f"p{i}", "category": "x", "prompt": "hi"} for i in range(3)]
    report = bench_compare(pipe, prompts, variants, max_new_tokens=6, passes=2)
    used = {id(d): {id(s) for d2, s, _ in pipe.calls if d2 is d} for d in (a, b)}
    assert len(used[id(a)]) == 1 and len(used[id(b)]) == 1
    assert used[id(a)] != used[id(b)] and id(first) not in used[id(a)] | used[id(b)]
    assert pipe.scheduler is first and first.rounds == 0  # the pipeline's own is left as it was
    assert pipe.drafter is own and not any(d is own for d, _, _ in pipe.calls)  # and so is its drafter
    assert len(pipe.twins) == 3 and all(t.closed for t in pipe.twins)  # one per drafter (plain too), closed
    assert set(report["variants"]["a auto"]["scheduler"]) == {"draft_ms", "confidence_offsets", "gated"}
    assert report["variants"]["a auto"]["scheduler"]["confidence_offsets"] == [0.0] * 8
    assert "scheduler" not in report["variants"]["a k=1"]
