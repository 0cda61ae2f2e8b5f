"""Telemetry readers, traces, the background sampler, and device profiles."""

from __future__ import annotations

import time

import pytest

from dspark_edge.telemetry import (FakeReader, GpuReading, Sampler, Snapshot, SystemReader, TraceRecorder,
                                   TraceReplayer)


def _fake_sysfs(root, temp_milli=85000, cur_khz=1_000_000, max_khz=3_000_000, gpu_load=None):
    zone = root / "class" / "thermal" / "thermal_zone0"
    zone.mkdir(parents=True)
    (zone / "type").write_text("cpu-thermal\n")
    (zone / "temp").write_text(f"{temp_milli}\n")
    freq = root / "devices" / "system" / "cpu" / "cpu0" / "cpufreq"
    freq.mkdir(parents=True)
    (freq / "scaling_cur_freq").write_text(f"{cur_khz}\n")
    (freq / "cpuinfo_max_freq").write_text(f"{max_khz}\n")
    if gpu_load is not None:
        (root / "devices" / "gpu.0").mkdir(parents=True)
        (root / "devices" / "gpu.0" / "load").write_text(f"{gpu_load}\n")
    return root


def test_system_reader_on_this_machine():
    s = SystemReader(nvml=True).read()
    assert s.mem_total_mb > s.mem_available_mb > 0 and s.rss_mb > 10
    assert 0 <= s.cpu_other_percent <= s.cpu_percent + 1e-9 <= 100.0 + 1e-9


def test_sysfs_temperature_frequency_and_jetson_load(tmp_path):
    root = _fake_sysfs(tmp_path, temp_milli=85500, cur_khz=1_000_000, max_khz=3_000_000, gpu_load=731)
    r = SystemReader(sysfs_root=str(root), nvml=False)
    s = r.read()
    assert s.temps_c == {"cpu-thermal:0": 85.5} and s.max_temp_c == 85.5
    assert (s.cpu_freq_mhz, s.cpu_freq_max_mhz) == (1000.0, 3000.0)
    assert s.throttling and "cpufreq" in s.throttle_source
    assert s.gpu is not None and s.gpu.util_percent == pytest.approx(73.1)
    assert "jetson gpu load" in r.sources() and "sysfs cpufreq" in r.sources()


def test_full_clock_is_not_throttling(tmp_path):
    root = _fake_sysfs(tmp_path, cur_khz=2_900_000)
    assert not SystemReader(sysfs_root=str(root), nvml=False).read().throttling


def test_snapshot_json_round_trip_and_trace_replay(tmp_path):
    snap = Snapshot(t=1.5, mem_total_mb=100, mem_available_mb=50, temps_c={"a": 40.0},
                    gpu=GpuReading(10.0, 1.0, 2.0, 50.0, 900.0, 1400.0, ("hw_thermal",)), throttling=True,
                    throttle_source="nvml:hw_thermal")
    rec = TraceRecorder(FakeReader(snap), tmp_path / "t.jsonl")
    rec.read()
    rec.reader.set(t=2.0)
    rec.read()
    rec.close()
    replay = TraceReplayer(tmp_path / "t.jsonl")
    assert replay.read() == snap and replay.read().t == 2.0 and replay.read().t == 2.0  # last repeats
    with pytest.raises(ValueError, match="empty"):
        TraceReplayer([])


def test_sampler_reads_in_the_background_and_latest_is_cheap():
    reader = FakeReader()
    sampler = Sampler(reader, interval_s=0.01)
    reader.set(mem_available_mb=123.0)
    deadline = time.monotonic() + 2.0
    while sampler.latest.mem_available_mb != 123.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sampler.latest.mem_available_mb == 123.0
    t = time.perf_counter()
    for _ in range(10000):
        sampler.latest
    assert (time.perf_counter() - t) / 10000 < 1e-4  # ≪ 0.1 ms per step
    sampler.close()


def test_sampler_survives_a_failing_reader():
    class Flaky(FakeReader):
        calls = 0

        def read(self):
            self.calls += 1
            if self.calls > 1:
                raise OSError("sensor gone")
            return super().read()

    sampler = Sampler(Flaky(), interval_s=0.01)
    time.sleep(0.05)
    assert sampler.latest is not None and sampler._thread.is_alive()
    sampler.close()


def test_profile_round_trip_and_staleness(tmp_path, tiny_engine):
    from dspark_edge.profile import DeviceProfile, Timing, device_identity, load_profile, manifest_sha, save_profile

    key, ident = device_identity()
    prof = DeviceProfile(schema_version=1, device_key=key, device=ident, engine="tiny",
                         engine_sha256=manifest_sha(tiny_engine), versions={}, created_utc="now", max_temp_c=None,
                         cpu_other_percent=0.0, throttled=False,
                         timings=(Timing("target", "fp32", 1, 64, 1.0, 1.1), Timing("target", "fp32", 2, 64, 1.5, 1.6)))
    save_profile(prof, tmp_path)
    got, status = load_profile(tiny_engine, tmp_path)
    assert status == "ok" and got == prof and got.verify_ms("fp32") == {1: 1.0, 2: 1.5}
    save_profile(DeviceProfile(**{**prof.__dict__, "engine_sha256": "0" * 64}), tmp_path)
    assert load_profile(tiny_engine, tmp_path)[1] == "stale"
    save_profile(DeviceProfile(**{**prof.__dict__, "throttled": True}), tmp_path)
    assert load_profile(tiny_engine, tmp_path)[1] == "throttled"
    assert load_profile(tiny_engine, tmp_path / "none")[1] == "missing"


ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma

processor\t: 1
model name\t: something else
"""


def test_cpu_identity_tells_apart_cpus_that_share_a_brand_name():
    from dspark_edge.profile import cpu_identity

    zen4 = cpu_identity(ZEN4)
    assert zen4 == {"cpu": "AMD EPYC", "cpu_id": "f25m17", "isa": "avx2"}  # the first processor only
    older = cpu_identity(ZEN4.replace("cpu family\t: 25", "cpu family\t: 23").replace("model\t\t: 17", "model\t\t: 49"))
    assert older["cpu"] == zen4["cpu"] and older["cpu_id"] == "f23m49"
    assert cpu_identity(ZEN4.replace("avx2 fma", "avx2 avx512f avx512_vnni"))["isa"] == "avx512vnni"
    arm = cpu_identity("processor\t: 0\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\nCPU part\t: 0xd42\n")
    assert arm == {"cpu_id": "0x41-0xd42", "isa": "neon"}
    assert cpu_identity("") == {}


def test_device_key_names_the_cpu_numbers():
    from dspark_edge.profile import device_identity

    key, ident = device_identity(cpuinfo=ZEN4)
    assert "-amd-epyc-f25m17-avx2-" in key and ident["cpu_id"] == "f25m17" and ident["isa"] == "avx2"
    assert device_identity(cpuinfo=ZEN4.replace("model\t\t: 17", "model\t\t: 1"))[0] != key


def test_measure_profile_on_the_tiny_engine(tiny_engine):
    from dspark_edge.profile import measure_profile

    prof = measure_profile(tiny_engine, contexts=(8, 32), warmup=1, reps=2)
    rows = [t for t in prof.timings if t.role == "target"]
    assert {(t.precision, t.width, t.context) for t in rows} == {
        (p, w, c) for p in ("fp32", "int8") for w in (1, 2, 3, 4) for c in (8, 32)}
    assert all(t.median_ms > 0 for t in rows) and prof.versions["onnxruntime"]
    # The pass cost table of a server batching 2, 4 and 8 requests: T(n) from n = P (each request
    # one token) to P × the widest width (4), for each precision.
    for p in ("fp32", "int8"):
        for slots in (2, 4, 8):
            table = prof.slots_ms(p, slots)
            assert min(table) == slots and max(table) == 4 * slots and all(ms > 0 for ms in table.values())
    assert prof.slots_ms("fp32", 3) == {}
    # The modes whose output is the model's own, raced: the tiny engine's FP32, plainly and with its drafter.
    assert [(m.precision, m.drafter) for m in prof.modes] == [("fp32", "none"), ("fp32", "ngram+self")]
    assert prof.modes[0].vs_reference == 1.0 and all(m.exact for m in prof.modes)


def test_implausible_readings_are_ignored_with_a_warning(caplog):
    from dspark_edge.scheduler import CostModel, Scheduler
    from dspark_edge.telemetry import sanitized

    bad = Snapshot(t=0, mem_total_mb=8000, mem_available_mb=-5.0, temps_c={"cpu": 200.0, "ok": 50.0},
                   cpu_percent=250.0)
    with caplog.at_level("WARNING"):
        s = sanitized(bad)
    assert "implausible" in caplog.text
    assert s.temps_c == {"ok": 50.0} and s.mem_total_mb == 0.0 and s.cpu_percent == 0.0
    sched = Scheduler(CostModel({1: 1.0, 2: 1.2}, 0.1), (1, 2))
    assert sched.wants_draft(s) and sched.mode == "normal" and not sched.memory_low
    sampler = Sampler(FakeReader(bad), interval_s=10)
    assert sampler.latest.temps_c == {"ok": 50.0}
    sampler.close()


def test_profile_cli_rejects_bad_contexts(tiny_engine, capsys):
    from dspark_edge.cli import main

    assert main(["profile", "--engine", str(tiny_engine), "--contexts", "abc"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert main(["profile", "--engine", str(tiny_engine), "--slots", "2,x"]) == 2
    assert "comma-separated request counts" in capsys.readouterr().err
    assert main(["profile", "--engine", str(tiny_engine), "--slots", "1,4"]) == 2
    assert "2 or more requests" in capsys.readouterr().err
