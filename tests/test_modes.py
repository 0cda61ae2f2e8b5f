"""Decoding modes raced per device and the choice ``precision="auto"`` makes among them."""

from __future__ import annotations

import json
import shutil

import pytest

import dspark_edge
from dspark_edge.manifest import INT4_OUTPUT_KEY, read_manifest
from dspark_edge.modes import candidate_modes, choose_mode, measure_modes, needs_race, race_and_save
from dspark_edge.profile import ModeSpeed, device_identity, load_profile, manifest_sha, profile_with_modes, save_profile
from dspark_edge.telemetry import Snapshot

PROMPTS = [{"id": "a", "category": "t", "prompt": "The quick brown fox"},
           {"id": "b", "category": "t", "messages": [{"role": "user", "content": "Count to five."}]}]


def _with_int4(tiny_engine, tmp_path, output: str | None = "fp32"):
    """A copy of the tiny engine with int4 variants (a copy of the FP32 graph under that name:
    the choice's mechanics, not int4's kernels) whose manifest says what their output is."""
    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine, engine)
    shutil.copytree(engine / "target" / "fp32", engine / "target" / "int4")
    data = json.loads((engine / "manifest.json").read_text())
    renamed = lambda path: path.replace("target/fp32/", "target/int4/")  # noqa: E731
    data["variants"] += [{**v, "precision": "int4", "file": renamed(v["file"])} for v in data["variants"]
                         if v["role"] == "target" and v["precision"] == "fp32"]
    data["files"] += [{**f, "path": renamed(f["path"])} for f in data["files"] if f["path"].startswith("target/fp32/")]
    if output is not None:
        data["exporter"][INT4_OUTPUT_KEY] = output
    (engine / "manifest.json").write_text(json.dumps(data))
    return engine


@pytest.fixture
def profiles(tmp_path, monkeypatch):
    folder = tmp_path / "profiles"
    monkeypatch.setenv("DSPARK_PROFILES", str(folder))
    return folder


def _save_modes(engine, folder, modes, sha=None):
    prof = profile_with_modes(engine, tuple(modes), Snapshot(t=0.0, mem_total_mb=1.0, mem_available_mb=1.0))
    if sha is not None:
        prof = dspark_edge.profile.DeviceProfile(**{**prof.__dict__, "engine_sha256": sha})
    return save_profile(prof, folder)


def test_faithful_precisions_are_the_most_precise_and_an_int4_that_computes_fp32s_output(tiny_engine, tmp_path):
    assert read_manifest(tiny_engine).faithful_precisions() == ["fp32"]  # INT8 re-quantizes
    assert read_manifest(_with_int4(tiny_engine, tmp_path / "a")).faithful_precisions() == ["fp32", "int4"]
    assert read_manifest(_with_int4(tiny_engine, tmp_path / "b", "approximate")).faithful_precisions() == ["fp32"]
    assert read_manifest(_with_int4(tiny_engine, tmp_path / "c", None)).faithful_precisions() == ["fp32"]
    assert candidate_modes(read_manifest(_with_int4(tiny_engine, tmp_path / "d"))) == [
        ("fp32", None), ("fp32", "ngram+self"), ("int4", None), ("int4", "ngram+self")]


def test_a_race_times_every_candidate_mode_against_the_most_precise_plain(tiny_engine, tmp_path):
    engine = _with_int4(tiny_engine, tmp_path)
    seen = []
    modes = measure_modes(engine, prompts=PROMPTS, max_new_tokens=8, progress=seen.append)
    assert [(m.precision, m.drafter) for m in modes] == [
        ("fp32", "none"), ("fp32", "ngram+self"), ("int4", "none"), ("int4", "ngram+self")]
    assert modes[0].vs_reference == 1.0
    assert all(m.tokens_per_s > 0 and m.prompts == 2 and m.max_new_tokens == 8 for m in modes)
    # Speculation is lossless and this "int4" is the FP32 graph: every answer equals the reference's.
    assert all(m.exact for m in modes)
    assert any("2/2 answers equal" in line for line in seen)
    with pytest.raises(dspark_edge.ConfigError, match="2 tokens or more"):
        measure_modes(engine, prompts=PROMPTS, max_new_tokens=1)


def test_auto_takes_the_fastest_mode_whose_answers_all_equal_the_reference(tiny_engine, tmp_path, profiles):
    engine = _with_int4(tiny_engine, tmp_path)
    m = read_manifest(engine)
    assert choose_mode(m, engine).reason.startswith("no decoding modes raced")
    assert needs_race(m, engine) and not needs_race(read_manifest(tiny_engine), tiny_engine)
    _save_modes(engine, profiles, [
        ModeSpeed("fp32", "none", 10.0, 1.0, 2, 2, 8),
        ModeSpeed("fp32", "ngram+self", 14.0, 1.4, 2, 2, 8),
        ModeSpeed("int4", "none", 30.0, 3.0, 1, 2, 8),  # fastest, but one answer differed: never chosen
        ModeSpeed("int4", "ngram+self", 20.0, 2.0, 2, 2, 8),
        ModeSpeed("int8", "none", 90.0, 9.0, 2, 2, 8)])  # not a faithful precision: never chosen
    assert not needs_race(m, engine)
    with dspark_edge.load(engine, "auto", drafter="auto") as pipe:
        assert pipe.target.precision == "int4" and pipe.drafter.name.startswith("ngram+self")
        assert "fastest exact mode raced" in pipe.mode_reason and "20.0 tok/s" in pipe.mode_reason
    with dspark_edge.load(engine, "fp32", drafter="auto") as pipe:  # a named precision: its best mode
        assert pipe.target.precision == "fp32" and pipe.drafter.name.startswith("ngram+self")
    with dspark_edge.load(engine, "auto") as pipe:  # plain decoding asked for: the fastest exact plain mode
        assert pipe.target.precision == "fp32" and pipe.drafter is None
    with dspark_edge.load(engine, "auto", drafter="ngram") as pipe:  # a drafter never raced: the most precise
        assert pipe.target.precision == "fp32" and pipe.drafter.name.startswith("ngram")
    with dspark_edge.load(engine) as pipe:  # nothing asked: the most precise, plainly, no choice made
        assert pipe.target.precision == "fp32" and pipe.drafter is None and pipe.mode_reason is None
    _save_modes(engine, profiles, [ModeSpeed("int4", "none", 30.0, 3.0, 2, 2, 8)], sha="0" * 64)
    assert load_profile(engine)[1] == "stale" and needs_race(m, engine)
    choice = choose_mode(m, engine)  # the engine changed since the race: the rule
    assert (choice.precision, choice.drafter) == ("fp32", "ngram+self") and "stale" in choice.reason


def test_an_int4_that_does_not_compute_fp32s_output_is_never_chosen(tiny_engine, tmp_path, profiles):
    engine = _with_int4(tiny_engine, tmp_path, "approximate")
    _save_modes(engine, profiles, [ModeSpeed("fp32", "none", 10.0, 1.0, 2, 2, 8),
                                   ModeSpeed("int4", "none", 30.0, 3.0, 2, 2, 8)])
    choice = choose_mode(read_manifest(engine), engine, drafter=None)
    assert (choice.precision, choice.drafter) == ("fp32", None)


def test_profiles_without_modes_load_and_impossible_modes_are_refused(tiny_engine, tmp_path, profiles):
    path = _save_modes(tiny_engine, profiles, [ModeSpeed("fp32", "none", 10.0, 1.0, 2, 2, 8)])
    data = json.loads(path.read_text())
    del data["modes"]  # a profile written before modes were raced
    path.write_text(json.dumps(data))
    prof, status = load_profile(tiny_engine)
    assert status == "ok" and prof.modes == ()
    for bad in ({"equal": 3}, {"tokens_per_s": -1.0}, {"vs_reference": float("nan")}, {"prompts": 0, "equal": 0}):
        row = {"precision": "fp32", "drafter": "none", "tokens_per_s": 10.0, "vs_reference": 1.0, "equal": 2,
               "prompts": 2, "max_new_tokens": 8, **bad}
        path.write_text(json.dumps({**data, "modes": [row]}))
        assert load_profile(tiny_engine)[1] == "corrupt", bad


def test_race_and_save_keeps_the_profiles_other_timings(tiny_engine, tmp_path, profiles):
    from dspark_edge.profile import Timing

    engine = _with_int4(tiny_engine, tmp_path)
    key, ident = device_identity()
    timed = dspark_edge.profile.DeviceProfile(
        schema_version=1, device_key=key, device=ident, engine="tiny", engine_sha256=manifest_sha(engine),
        versions={}, created_utc="now", max_temp_c=None, cpu_other_percent=0.0, throttled=False,
        timings=(Timing("target", "fp32", 1, 64, 1.0, 1.1),))
    save_profile(timed, profiles)
    race_and_save(engine, folder=profiles)
    prof, status = load_profile(engine)
    assert status == "ok" and prof.timings == timed.timings and len(prof.modes) == 4


def test_the_profile_command_races_the_modes_only(tiny_engine, tmp_path, profiles, capsys):
    from dspark_edge.cli import main

    engine = _with_int4(tiny_engine, tmp_path)
    assert main(["profile", "--engine", str(engine), "--modes-only", "--output-dir", str(profiles)]) == 0
    err = capsys.readouterr().err
    assert "int4 + plain:" in err and "answers equal to it" in err
    prof, status = load_profile(engine)
    assert status == "ok" and len(prof.modes) == 4 and prof.timings == ()
    assert main(["generate", "--engine", str(engine), "--raw", "The quick brown", "--max-new-tokens", "4"]) == 0
    best = max((m for m in prof.modes if m.exact), key=lambda m: m.tokens_per_s)
    ready = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("[load] ready"))
    assert f"target {best.precision}, drafter {best.drafter}" in ready.replace("ngram+self:int8", "ngram+self")


@pytest.mark.slow
def test_the_default_models_int4_answers_equal_fp32s_in_a_race(default_engine):
    """The embedded default's int4 graph (the GGUF's own blocks) races as a faithful precision,
    and its answers, plain and speculative, equal FP32's plain answers."""
    m = read_manifest(default_engine)
    assert m.faithful_precisions() == ["fp32", "int4"]
    modes = measure_modes(default_engine, max_new_tokens=24, prompts=dspark_edge.bench.load_prompts()[:3])
    assert {(x.precision, x.drafter) for x in modes} == {("fp32", "none"), ("fp32", "ngram+self"),
                                                        ("int4", "none"), ("int4", "ngram+self")}
    assert all(x.exact for x in modes), modes


def test_timings_of_unchanged_precisions_survive_an_added_precision(tiny_engine, tmp_path, profiles):
    """A profile measured before int4 was added to the engine keeps serving FP32's and INT8's
    pass costs (their graphs are the same), and a race keeps them in the profile it writes."""
    from dspark_edge.decoder import DecoderModel
    from dspark_edge.profile import DeviceProfile, Timing, cost_curve, precision_sha

    key, ident = device_identity()
    save_profile(DeviceProfile(
        schema_version=1, device_key=key, device=ident, engine="tiny", engine_sha256=manifest_sha(tiny_engine),
        versions={}, created_utc="now", max_temp_c=None, cpu_other_percent=0.0, throttled=False,
        timings=tuple(Timing("target", p, w, 64, 1.0 + w, 2.0 + w) for p in ("fp32", "int8") for w in (1, 2, 3, 4)),
        precision_sha256={p: precision_sha(tiny_engine, p) for p in ("fp32", "int8")}), profiles)
    engine = _with_int4(tiny_engine, tmp_path)
    prof, status = load_profile(engine)
    assert status == "stale" and prof.times(engine, "fp32", status) and not prof.times(engine, "int4", status)
    m = read_manifest(engine)
    curve, _ = cost_curve(DecoderModel(m, engine, "fp32"), engine)
    assert curve == {1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0}  # the profile's, not measured now
    race_and_save(engine, folder=profiles)
    prof, status = load_profile(engine)
    assert status == "ok" and len(prof.modes) == 4
    assert {t.precision for t in prof.timings} == {"fp32", "int8"} and set(prof.precision_sha256) == {"fp32", "int8"}
    # A precision whose graph changed is dropped: the int8 graph rewritten, its timings go.
    import onnx

    from dspark_edge.manifest import sha256_file

    data = json.loads((engine / "manifest.json").read_text())
    for f in data["files"]:
        if f["path"].startswith("target/int8/") and f["path"].endswith(".onnx"):
            graph = onnx.load(str(engine / f["path"]), load_external_data=False)
            graph.doc_string = "re-exported"
            onnx.save_model(graph, str(engine / f["path"]))
            f["sha256"], f["size"] = sha256_file(engine / f["path"]), (engine / f["path"]).stat().st_size
    (engine / "manifest.json").write_text(json.dumps(data))
    race_and_save(engine, folder=profiles)
    prof, _ = load_profile(engine)
    assert {t.precision for t in prof.timings} == {"fp32"}


@pytest.mark.slow
def test_the_shipped_profiles_time_the_default_exports_graphs(default_engine):
    """Every shipped profile that names its graphs per precision names the embedded default's
    as the exporter writes them now (int4 beside them or not): a change to the exported FP32 or
    INT8 graph would leave those profiles silently unused."""
    from dspark_edge.profile import SHIPPED_DIR, precision_sha, read_profile

    named = [read_profile(p) for p in sorted(SHIPPED_DIR.glob("*.json"))]
    named = [p for p in named if p.precision_sha256]
    assert named, "no shipped profile names its graphs per precision"
    for prof in named:
        for precision, sha in prof.precision_sha256.items():
            assert sha == precision_sha(default_engine, precision), (prof.device_key, precision)
            assert prof.times(default_engine, precision, "stale")


def test_bench_auto_is_the_rules_drafter_even_where_plain_decoding_raced_fastest(tiny_engine, profiles, capsys):
    from dspark_edge.cli import main

    _save_modes(tiny_engine, profiles, [ModeSpeed("fp32", "none", 30.0, 1.0, 2, 2, 8),
                                        ModeSpeed("fp32", "ngram+self", 20.0, 0.67, 2, 2, 8)])
    with dspark_edge.load(tiny_engine, drafter="auto") as pipe:  # what generate would load: plain
        assert pipe.drafter is None and "raced" in pipe.mode_reason
    assert main(["bench", "--engine", str(tiny_engine), "--limit", "1", "--max-new-tokens", "6", "--repeats", "2",
                 "--depth", "16", "--drafter", "auto", "--draft-tokens", "2"]) == 0
    assert list(json.loads(capsys.readouterr().out)["comparison"]["variants"]) == [
        "plain", "ngram+self:int8 auto", "ngram+self:int8 k=2"]


def test_a_mode_that_cannot_load_sits_the_race_out(tiny_engine, tmp_path):
    engine = _with_int4(tiny_engine, tmp_path)
    graph = next((engine / "target" / "int8").glob("*.onnx"))
    graph.write_bytes(graph.read_bytes()[:-1] + b"\0")  # same size, another hash: the INT8 copy is refused
    seen = []
    modes = measure_modes(engine, prompts=PROMPTS[:1], max_new_tokens=4, progress=seen.append)
    assert [(m.precision, m.drafter) for m in modes] == [("fp32", "none"), ("int4", "none")]
    assert any("fp32 + ngram+self: left out" in line for line in seen)


def test_auto_for_several_requests_takes_the_precision_whose_batched_round_costs_least(tiny_engine, tmp_path,
                                                                                      profiles):
    """The race times one request at a time; a server decoding several at once takes the
    precision whose round of that many requests costs least in the profile (its slots table,
    else its verify curve), then that precision's fastest raced mode."""
    from dspark_edge.modes import batched_cost_ms
    from dspark_edge.profile import Timing

    engine = _with_int4(tiny_engine, tmp_path)
    m = read_manifest(engine)
    modes = [ModeSpeed("fp32", "none", 10.0, 1.0, 2, 2, 8), ModeSpeed("fp32", "ngram+self", 14.0, 1.4, 2, 2, 8),
             ModeSpeed("int4", "none", 20.0, 2.0, 2, 2, 8)]

    def timing(role, precision, width, ms, slots=None):
        return Timing(role=role, precision=precision, width=width, context=256, median_ms=ms, p90_ms=ms,
                      **({"slots": slots} if slots else {}))

    def save(timings):
        path = _save_modes(engine, profiles, modes)
        prof = load_profile(engine)[0]
        save_profile(dspark_edge.profile.DeviceProfile(**{**prof.__dict__, "timings": tuple(timings)}), profiles)
        return path

    # int4: cheap alone (width 1), dear in a batch of 4; FP32 the reverse.
    save([timing("target", "fp32", w, ms) for w, ms in ((1, 20.0), (4, 22.0))]
         + [timing("target", "int4", w, ms) for w, ms in ((1, 11.0), (4, 28.0))])
    alone, batched = choose_mode(m, engine), choose_mode(m, engine, requests=4)
    assert (alone.precision, alone.drafter) == ("int4", None)
    assert (batched.precision, batched.drafter) == ("fp32", "ngram+self")
    assert batched.reason.startswith("for 4 requests at once the fp32 target") and "int4 28.0 ms" in batched.reason
    assert choose_mode(m, engine, requests=2).precision == "int4"  # width 2 not profiled: the race's choice
    # The slots table, where profiled for that many requests, is the round's cost.
    save([timing("target", p, w, 20.0) for p in ("fp32", "int4") for w in (1, 4)]
         + [timing("slots", "fp32", 4, 30.0, slots=4), timing("slots", "int4", 4, 25.0, slots=4)])
    assert batched_cost_ms(load_profile(engine)[0], "int4", 4) == 25.0
    assert choose_mode(m, engine, requests=4).precision == "int4"
    with dspark_edge.load(engine, "auto", drafter="auto", requests=4) as pipe:
        assert pipe.target.precision == "int4" and "4 requests at once" in pipe.mode_reason
    for bad in (0, -2, "4", 2.0, True):
        with pytest.raises(dspark_edge.ConfigError, match="requests"):
            dspark_edge.load(engine, "auto", requests=bad)


def test_a_profile_holding_only_a_race_measures_the_pass_cost_without_a_warning(tiny_engine, profiles, caplog):
    """The demo's first run writes a profile with the modes race and no timings: loading then
    measures the pass cost as without a profile, and says so at info level, not as a fault."""
    import logging

    _save_modes(tiny_engine, profiles, [ModeSpeed("fp32", "none", 10.0, 1.0, 2, 2, 8)])
    with caplog.at_level(logging.INFO, logger="dspark_edge"):
        with dspark_edge.load(tiny_engine, "fp32", drafter="ngram") as pipe:
            assert pipe.profile_status == "untimed" and pipe.scheduler is not None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "measuring the fp32 pass cost now" in caplog.text


def _timed_profile(engine, ms: float):
    from dspark_edge.profile import Timing

    key, ident = device_identity()
    return dspark_edge.profile.DeviceProfile(
        schema_version=1, device_key=key, device=ident, engine="tiny", engine_sha256=manifest_sha(engine),
        versions={}, created_utc="now", max_temp_c=None, cpu_other_percent=0.0, throttled=False,
        timings=tuple(Timing("target", "fp32", w, 64, ms * w, ms * w) for w in (1, 2, 3, 4)))


def _spy_on_races(monkeypatch, engine):
    """measure_modes, recording the profile that loading finds while each race runs."""
    import dspark_edge.modes as modes

    seen, real = [], modes.measure_modes

    def spy(engine_dir, **kw):
        prof, status = load_profile(engine_dir)
        with dspark_edge.load(engine_dir, "fp32", drafter="ngram") as pipe:
            seen.append((status, prof.timings if prof is not None else None, pipe.profile_status))
        return real(engine_dir, **{**kw, "prompts": PROMPTS, "max_new_tokens": 8})

    monkeypatch.setattr(modes, "measure_modes", spy)
    return seen


def test_a_profiles_race_runs_on_the_pass_costs_it_has_just_measured(tiny_engine, profiles, monkeypatch):
    """Not on costs measured at load (nothing is saved yet), nor on another profile of this
    device that loading would find: the race times the modes as they will run."""
    from dspark_edge.profile import measure_profile

    save_profile(_timed_profile(tiny_engine, 9.0), profiles)  # what loading finds outside the race
    seen = _spy_on_races(monkeypatch, tiny_engine)
    prof = measure_profile(tiny_engine, contexts=(8,), warmup=1, reps=2, slots=())
    assert seen == [("ok", prof.timings, "ok")] and len(prof.modes) == 2
    assert load_profile(tiny_engine)[0].timings == _timed_profile(tiny_engine, 9.0).timings  # the block ended


def test_race_and_save_into_a_folder_races_on_that_folders_profile(tiny_engine, tmp_path, profiles, monkeypatch):
    other = tmp_path / "other"
    save_profile(_timed_profile(tiny_engine, 9.0), profiles)  # first on the search path
    kept = _timed_profile(tiny_engine, 2.0)
    save_profile(kept, other)
    seen = _spy_on_races(monkeypatch, tiny_engine)
    race_and_save(tiny_engine, folder=other)
    assert seen == [("ok", kept.timings, "ok")]
    race_and_save(tiny_engine, folder=tmp_path / "empty")  # no profile there: raced as without one
    assert seen[1][:2] == ("missing", None) and seen[1][2] != "ok"
    assert load_profile(tiny_engine, other)[0].timings == kept.timings and load_profile(tiny_engine, other)[0].modes


def test_asking_whether_to_race_leaves_the_missing_profile_warning_to_the_load(tiny_engine, tmp_path, profiles,
                                                                                caplog):
    """The demo asks before it races in a process of its own, which warns: said once, not twice."""
    engine = _with_int4(tiny_engine, tmp_path)
    save_profile(_timed_profile(engine, 1.0), profiles).rename(profiles / "another-device.json")
    with caplog.at_level("WARNING"):
        assert needs_race(read_manifest(engine), engine)
    assert "no device profile" not in caplog.text
    with caplog.at_level("WARNING"):
        assert load_profile(engine) == (None, "missing")
    assert "no device profile for this device" in caplog.text and "another-device" in caplog.text


def test_auto_keeps_to_the_modes_that_fit_in_the_memory_available(tiny_engine, tmp_path, profiles, caplog):
    """A device that cannot hold the target beside its self-drafting copy decodes in the fastest
    mode that fits; with no mode fitting, in the smallest, and the reason says so."""
    from dspark_edge.modes import mode_mib, need_mib

    engine = _with_int4(tiny_engine, tmp_path)
    m = read_manifest(engine)
    _save_modes(engine, profiles, [ModeSpeed("fp32", "none", 10.0, 1.0, 2, 2, 8),
                                   ModeSpeed("fp32", "ngram+self", 30.0, 3.0, 2, 2, 8),
                                   ModeSpeed("int4", "none", 20.0, 2.0, 2, 2, 8)])
    plain, copied = mode_mib(m, "int4", None), mode_mib(m, "fp32", "ngram+self")
    graphs = sum(f.size for f in m.files if f.path.startswith(("target/fp32/", "target/int8/"))) / 2**20
    assert plain < copied <= graphs + plain  # the copy's INT8 graph on top of the target's files and K/V
    assert choose_mode(m, engine, free_mib=1e9).drafter == "ngram+self"
    with caplog.at_level("WARNING"):
        tight = choose_mode(m, engine, free_mib=(need_mib(m, "int4", None) + need_mib(m, "fp32", "ngram+self")) / 2)
    assert (tight.precision, tight.drafter) == ("int4", None)  # the fastest of those that fit
    assert "fp32 + ngram+self, faster, needs about" in tight.reason and "needs about" in caplog.text
    none = choose_mode(m, engine, free_mib=1.0)
    assert none.drafter is None and "no raced mode fits" in none.reason
