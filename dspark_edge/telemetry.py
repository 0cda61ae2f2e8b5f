"""Device telemetry: one reader protocol returning an immutable ``Snapshot``.

Sources: psutil (memory, this process's RSS, CPU load overall and of other processes), Linux
sysfs (``/sys/class/thermal/thermal_zone*/temp``, cpufreq ``scaling_cur_freq`` /
``cpuinfo_max_freq``), NVML through ``nvidia-ml-py`` (utilisation, memory, temperature, clocks,
throttle reasons) and Jetson-style sysfs GPU load. A missing source (no NVML library, no GPU, no
thermal zones in a VM) is normal and leaves its fields empty. ``Sampler`` reads in a background
thread so the decode loop only picks up the latest snapshot (an attribute read). ``FakeReader``,
``TraceRecorder`` and ``TraceReplayer`` serve tests and post-mortems. Knows nothing about decoding.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

# NVML clock-event reasons that mean the GPU is slowed by heat or power (nvmlClocksEventReason*).
_NVML_THROTTLE = {0x2: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
                  0x80: "hw_power_brake"}


@dataclass(frozen=True)
class GpuReading:
    util_percent: float
    mem_used_mb: float
    mem_total_mb: float
    temp_c: float | None = None
    clock_mhz: float | None = None
    max_clock_mhz: float | None = None
    throttle_reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class Snapshot:
    t: float  # time.monotonic() of the reading
    mem_total_mb: float = 0.0
    mem_available_mb: float = 0.0
    rss_mb: float = 0.0
    cpu_percent: float = 0.0  # all cores, 0..100
    cpu_other_percent: float = 0.0  # the share of other processes, 0..100
    temps_c: dict[str, float] = field(default_factory=dict)  # zone → °C
    cpu_freq_mhz: float | None = None
    cpu_freq_max_mhz: float | None = None
    gpu: GpuReading | None = None
    throttling: bool = False
    throttle_source: str | None = None  # what set the flag

    @property
    def max_temp_c(self) -> float | None:
        temps = list(self.temps_c.values()) + ([self.gpu.temp_c] if self.gpu and self.gpu.temp_c else [])
        return max(temps) if temps else None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict, where: str = "snapshot") -> "Snapshot":
        from .errors import ConfigError
        from .strict_json import from_json_dict

        return from_json_dict(cls, d, where, error=ConfigError)


def sanitized(s: Snapshot) -> Snapshot:
    """Drop readings no real device gives (a broken sensor or driver): temperatures outside
    -40..150 °C, negative memory, loads outside 0..100 %. Logged, never fatal."""
    bad = {k: v for k, v in s.temps_c.items() if not -40.0 <= v <= 150.0}
    changes: dict = {}
    if bad:
        changes["temps_c"] = {k: v for k, v in s.temps_c.items() if k not in bad}
    if s.mem_available_mb < 0 or s.mem_total_mb < 0 or s.mem_available_mb > max(s.mem_total_mb, 0) > 0:
        changes["mem_available_mb"], changes["mem_total_mb"] = 0.0, 0.0
        bad["memory"] = s.mem_available_mb
    if not 0.0 <= s.cpu_percent <= 100.0 or not 0.0 <= s.cpu_other_percent <= 100.0:
        changes["cpu_percent"], changes["cpu_other_percent"] = 0.0, 0.0
        bad["cpu"] = s.cpu_percent
    if s.gpu is not None and s.gpu.temp_c is not None and not -40.0 <= s.gpu.temp_c <= 150.0:
        changes["gpu"] = replace(s.gpu, temp_c=None)
        bad["gpu_temp"] = s.gpu.temp_c
    if bad:
        log.warning("ignoring implausible telemetry readings: %s", bad)
        return replace(s, **changes)
    return s


class Reader(Protocol):
    def read(self) -> Snapshot: ...


def _read_float(path: str) -> float | None:
    try:
        with open(path, encoding="ascii") as f:
            return float(f.read().strip())
    except (OSError, ValueError):
        return None


class SysfsThermal:
    """Thermal zones and CPU frequency from Linux sysfs (absent in most VMs)."""

    def __init__(self, root: str = "/sys") -> None:
        self.zones = []
        for zone in sorted(glob.glob(f"{root}/class/thermal/thermal_zone*")):
            kind = Path(zone, "type")
            name = kind.read_text().strip() if kind.is_file() else Path(zone).name
            self.zones.append((f"{name}:{Path(zone).name[12:]}", f"{zone}/temp"))
        cpu = f"{root}/devices/system/cpu/cpu0/cpufreq"
        self.cur, self.max = f"{cpu}/scaling_cur_freq", f"{cpu}/cpuinfo_max_freq"
        self.jetson_gpu = next((p for p in (f"{root}/devices/gpu.0/load", f"{root}/devices/platform/gpu.0/load",
                                            f"{root}/devices/platform/17000000.gpu/load") if os.path.isfile(p)), None)

    def temps(self) -> dict[str, float]:
        out = {}
        for name, path in self.zones:
            v = _read_float(path)
            if v is not None:
                out[name] = v / 1000.0  # millidegrees
        return out

    def freq(self) -> tuple[float | None, float | None]:
        cur, mx = _read_float(self.cur), _read_float(self.max)
        return (cur / 1000.0 if cur else None), (mx / 1000.0 if mx else None)

    def jetson_load(self) -> float | None:
        v = _read_float(self.jetson_gpu) if self.jetson_gpu else None
        return None if v is None else v / 10.0  # per mille


class Nvml:
    """NVML for GPU 0, or nothing when the library or a GPU is absent."""

    def __init__(self) -> None:
        self.handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as exc:  # ImportError, NVMLError (no driver / no GPU): both are normal
            log.debug("NVML unavailable: %s", exc)

    def read(self) -> GpuReading | None:
        if self.handle is None:
            return None
        nv, h = self.nv, self.handle
        try:
            util, mem = nv.nvmlDeviceGetUtilizationRates(h), nv.nvmlDeviceGetMemoryInfo(h)
            temp = float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
            clock = float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
            max_clock = float(nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM))
            mask = int(nv.nvmlDeviceGetCurrentClocksThrottleReasons(h))
        except Exception as exc:  # a GPU that fell off the bus must not stop decoding
            log.warning("NVML read failed: %s", exc)
            return None
        reasons = tuple(name for bit, name in _NVML_THROTTLE.items() if mask & bit)
        return GpuReading(float(util.gpu), mem.used / 2**20, mem.total / 2**20, temp, clock, max_clock, reasons)


class SystemReader:
    """Every source this machine has, merged into one snapshot."""

    def __init__(self, sysfs_root: str = "/sys", nvml: bool = True, freq_throttle_ratio: float = 0.6) -> None:
        import psutil

        self.psutil, self.proc = psutil, psutil.Process()
        self.proc.cpu_percent(None)
        psutil.cpu_percent(None)
        self.sysfs = SysfsThermal(sysfs_root)
        self.nvml = Nvml() if nvml else None
        self.freq_throttle_ratio = freq_throttle_ratio
        self.ncpu = psutil.cpu_count() or 1

    def sources(self) -> list[str]:
        out = ["psutil"]
        if self.sysfs.zones:
            out.append(f"sysfs thermal ({len(self.sysfs.zones)} zones)")
        if os.path.isfile(self.sysfs.cur):
            out.append("sysfs cpufreq")
        if self.sysfs.jetson_gpu:
            out.append("jetson gpu load")
        if self.nvml is not None and self.nvml.handle is not None:
            out.append("nvml")
        return out

    def read(self) -> Snapshot:
        vm = self.psutil.virtual_memory()
        total = self.psutil.cpu_percent(None)
        mine = self.proc.cpu_percent(None) / self.ncpu
        cur, mx = self.sysfs.freq()
        gpu = self.nvml.read() if self.nvml is not None else None
        load = self.sysfs.jetson_load()
        if gpu is None and load is not None:
            gpu = GpuReading(load, 0.0, 0.0)
        throttling, source = False, None
        if gpu is not None and gpu.throttle_reasons:
            throttling, source = True, "nvml:" + ",".join(gpu.throttle_reasons)
        elif cur and mx and cur < self.freq_throttle_ratio * mx:
            throttling, source = True, f"cpufreq {cur:.0f}/{mx:.0f} MHz"
        return Snapshot(t=time.monotonic(), mem_total_mb=vm.total / 2**20, mem_available_mb=vm.available / 2**20,
                        rss_mb=self.proc.memory_info().rss / 2**20, cpu_percent=total,
                        cpu_other_percent=max(0.0, total - mine), temps_c=self.sysfs.temps(), cpu_freq_mhz=cur,
                        cpu_freq_max_mhz=mx, gpu=gpu, throttling=throttling, throttle_source=source)


class FakeReader:
    """Returns ``snapshot`` (set it to whatever a test needs)."""

    def __init__(self, snapshot: Snapshot | None = None) -> None:
        self.snapshot = snapshot or Snapshot(t=0.0, mem_total_mb=8192, mem_available_mb=4096)

    def set(self, **changes) -> None:
        self.snapshot = replace(self.snapshot, **changes)

    def read(self) -> Snapshot:
        return self.snapshot


class TraceRecorder:
    """Wraps a reader and appends every snapshot it returns to a JSON-lines file."""

    def __init__(self, reader: Reader, path: str | Path) -> None:
        self.reader, self.file = reader, open(path, "a", encoding="utf-8")

    def read(self) -> Snapshot:
        s = self.reader.read()
        self.file.write(s.to_json() + "\n")
        self.file.flush()
        return s

    def close(self) -> None:
        self.file.close()


class TraceReplayer:
    """Replays a recorded trace, one snapshot per ``read`` (the last repeats at the end)."""

    def __init__(self, path_or_snapshots) -> None:
        if isinstance(path_or_snapshots, (str, Path)):
            from .errors import ConfigError
            from .strict_json import read_jsonl

            self.snapshots = [Snapshot.from_dict(rec, f"{path_or_snapshots}:{n}")
                              for n, rec in read_jsonl(path_or_snapshots, ConfigError)]
        else:
            self.snapshots = list(path_or_snapshots)
        if not self.snapshots:
            raise ValueError("an empty telemetry trace cannot be replayed")
        self.i = 0

    def read(self) -> Snapshot:
        s = self.snapshots[min(self.i, len(self.snapshots) - 1)]
        self.i += 1
        return s


class Sampler:
    """Reads ``reader`` every ``interval_s`` in a daemon thread; ``latest`` never blocks.

    The first reading is waited for at most ``first_wait_s``: a reader that fails or blocks
    leaves ``latest`` at an empty snapshot (nothing known: no temperatures, no memory figures),
    with a warning, and never stops a load. A reading that is not a Snapshot counts as a
    failed one."""

    def __init__(self, reader: Reader, interval_s: float = 0.2, first_wait_s: float = 2.0) -> None:
        self.reader, self.interval_s = reader, interval_s
        self.latest: Snapshot = Snapshot(t=time.monotonic())
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dspark-telemetry", daemon=True)
        self._thread.start()
        if not self._first.wait(first_wait_s):
            log.warning("telemetry reader %r gave no reading within %.1f s; running without telemetry until it does",
                        reader, first_wait_s)

    def _read(self) -> None:
        try:
            snap = self.reader.read()
            if not isinstance(snap, Snapshot):
                raise TypeError(f"read() returned {type(snap).__name__}, not a Snapshot")
            self.latest = sanitized(snap)  # one reference swap: readers see old or new
        except Exception as exc:  # telemetry must never take decoding down
            log.warning("telemetry read failed: %s: %s", type(exc).__name__, exc)

    def _run(self) -> None:
        self._read()
        self._first.set()
        while not self._stop.wait(self.interval_s):
            self._read()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)
