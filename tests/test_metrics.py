"""Per-round observers: the JSON-lines trace, Prometheus counters, the timeline plot, draft marks."""

from __future__ import annotations

import io
import json

import pytest

import dspark_edge
from dspark_edge.metrics import PrometheusMetrics, TraceWriter, read_trace, summarize
from dspark_edge.plots import plot_metadata, plot_timeline
from dspark_edge.telemetry import FakeReader

PROMPT = "one two three four one two three four one two three four one two"


@pytest.fixture(scope="module")
def spec(tiny_engine, tiny_draft_poor):
    """A draft model that is accepted sometimes: rounds of every kind."""
    pipe = dspark_edge.load(tiny_engine, "fp32", drafter=tiny_draft_poor, telemetry=FakeReader())
    yield pipe
    pipe.close()


def test_trace_records_every_round_and_agrees_with_stats(spec, tmp_path):
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, label="test") as trace:
        spec.add_observer(trace)
        try:
            r1 = spec.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
            r2 = spec.generate(PROMPT, max_new_tokens=12, ignore_eos=True, draft_tokens=3)
        finally:
            spec.remove_observer(trace)
    recs = read_trace(path)
    assert recs[0] == {"type": "header", "schema": 1, "label": "test"}
    for gen, r in ((0, r1), (1, r2)):
        rounds = [x for x in recs if x["type"] == "round" and x["generation"] == gen]
        summary = [x for x in recs if x["type"] == "summary" and x["generation"] == gen]
        assert len(summary) == 1 and summary[0]["stats"] == json.loads(json.dumps(r.stats.as_dict()))
        assert len(rounds) == r.stats.rounds and [x["round"] for x in rounds] == list(range(1, len(rounds) + 1))
        s = summarize(rounds)
        assert s["draft_n"] == r.stats.draft_n and s["draft_n_accepted"] == r.stats.draft_n_accepted
        assert s["widths"] == dict(sorted(r.stats.widths.items()))
        assert s["acceptance_per_position"] == pytest.approx(list(r.stats.acceptance_per_position))
        # the prefill gives the first token; every round commits its accepted drafts and one more
        committed = [r.token_ids[0]] + [t for x in rounds for t in x["tokens"]]
        assert tuple(committed[:len(r.token_ids)]) == r.token_ids
        assert summary[0]["prompt_ids"] == spec.encode_prompt(PROMPT)  # a text prompt, as is
        assert tuple(summary[0]["token_ids"]) == r.token_ids
        for x in rounds:
            assert x["accepted"] <= x["drafted"] == x["width"] - 1 and len(x["tokens"]) == x["accepted"] + 1
            # the proposed drafts: the accepted ones begin the committed tokens, the next one was rejected
            assert len(x["drafts"]) == x["drafted"] and x["drafts"][:x["accepted"]] == x["tokens"][:x["accepted"]]
            if x["accepted"] < x["drafted"]:
                assert x["drafts"][x["accepted"]] != x["tokens"][x["accepted"]]  # greedy: the target's token differs
            assert len(x["confidence"]) == x["drafted"] and x["verify_ms"] > 0
            assert x["telemetry"] is not None and "mem_available_mb" in x["telemetry"]
            assert x["drafting"] is None  # the draft model gives no account of its proposals
    auto = [x for x in recs if x["type"] == "round" and x["generation"] == 0]
    assert all(x["decision"]["reason"] and x["decision"]["width"] == x["width"] for x in auto)
    fixed = [x for x in recs if x["type"] == "round" and x["generation"] == 1]
    assert all(x["decision"] is None for x in fixed)


def test_read_trace_names_a_bad_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"type": "header", "schema": 1}\n{"type": "round"\n')
    with pytest.raises(dspark_edge.ConfigError, match=r"bad.jsonl:2: not valid JSON"):
        read_trace(p)
    p.write_text('{"type": "header", "schema": 99}\n')
    with pytest.raises(dspark_edge.ConfigError, match="schema 99"):
        read_trace(p)
    with pytest.raises(dspark_edge.ConfigError, match="does not exist"):
        TraceWriter(tmp_path / "no" / "t.jsonl")


def test_prometheus_counts_match_the_generation(spec):
    prom = PrometheusMetrics()
    spec.add_observer(prom)
    try:
        r = spec.generate(PROMPT, max_new_tokens=20, ignore_eos=True, draft_tokens=2)
    finally:
        spec.remove_observer(prom)
    text = prom.text()

    def value(name, **labels):
        return prom.registry.get_sample_value(name, labels)

    s = r.stats
    assert value("dspark_edge_draft_n_total") == s.draft_n > 0
    assert value("dspark_edge_draft_n_accepted_total") == s.draft_n_accepted
    assert value("dspark_edge_generation_tokens_total") == s.new_tokens == 20
    assert value("dspark_edge_generations_total", stop_reason="max_new_tokens") == 1
    assert value("dspark_edge_rounds_total", width="3") == s.widths.get("3", 0)
    assert value("dspark_edge_accept_length_count") == sum(s.accept_length_hist.values())
    for pos, rate in enumerate(s.acceptance_per_position, 1):
        reached = value("dspark_edge_draft_n_per_pos_total", position=str(pos))
        kept = value("dspark_edge_draft_n_accepted_per_pos_total", position=str(pos)) or 0.0
        assert kept / reached == pytest.approx(rate)
    assert "# TYPE dspark_edge_accept_length histogram" in text


def test_failing_observer_is_dropped_and_generation_goes_on(spec, caplog):
    class Broken:
        def on_round(self, info):
            raise RuntimeError("boom")

    broken = Broken()
    spec.add_observer(broken)
    plain = spec.generate(PROMPT, max_new_tokens=8, speculative=False)
    r = spec.generate(PROMPT, max_new_tokens=8)
    assert broken not in spec.observers and r.token_ids == plain.token_ids
    assert "observer" in caplog.text and "boom" in caplog.text


def test_from_draft_marks_the_accepted_drafts(spec):
    stream = spec.stream(PROMPT, max_new_tokens=30, ignore_eos=True, draft_tokens=3)
    rounds = []
    spec.add_observer(type("Rec", (), {"on_round": lambda self, i: rounds.append(i)})())
    try:
        "".join(stream)
    finally:
        spec.observers.clear()
    marks = stream.from_draft
    assert len(marks) == len(stream.token_ids) and marks[0] is False
    expected = [False] + [k < info.accepted for info in rounds for k in range(len(info.tokens))]
    assert marks == expected[:len(marks)]
    # drafts never run past the token budget, so every accepted draft was emitted
    assert len(expected) == len(marks) and sum(marks) == stream.result.stats.draft_n_accepted > 0


def test_twin_decodes_plainly_next_to_its_pipeline(spec):
    twin = spec.twin()
    assert twin.drafter is None and twin.target is spec.target
    a, b = spec.stream(PROMPT, max_new_tokens=16), twin.stream(PROMPT, max_new_tokens=16)
    done_a = done_b = False
    while not (done_a and done_b):  # take turns, as the demo's race does
        if not done_a:
            done_a = next(a, None) is None
        if not done_b:
            done_b = next(b, None) is None
    assert a.result.token_ids == b.result.token_ids  # greedy FP32: lossless


def test_plot_has_the_expected_series(spec, tmp_path):
    rounds = []
    spec.add_observer(type("Rec", (), {"on_round": lambda self, i: rounds.append(i.as_dict())})())
    try:
        spec.generate(PROMPT, max_new_tokens=20, ignore_eos=True)
    finally:
        spec.observers.clear()
    out = tmp_path / "t.png"
    drawn = plot_timeline(rounds, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = plot_metadata(out)
    assert meta["rounds"] == len(rounds) and meta["series"] == drawn
    assert {"width", "accepted", "tok/s", "cpu %", "free memory MiB"} <= set(drawn)
    with pytest.raises(dspark_edge.ConfigError, match="nothing to plot"):
        plot_timeline([], out)


def test_stream_close_frees_the_pipeline(spec):
    s = spec.stream(PROMPT, max_new_tokens=30)
    next(s)
    s.close()
    assert spec.generate(PROMPT, max_new_tokens=4).stop_reason in ("max_new_tokens", "eos")
    s.close()  # idempotent


def test_trace_to_a_file_object():
    buf = io.StringIO()
    TraceWriter(buf).close()
    assert json.loads(buf.getvalue())["type"] == "header"
