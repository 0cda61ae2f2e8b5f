"""Per-round metrics for embeddings and post-mortems: a JSON-lines trace and Prometheus counters.

Both are pipeline observers (``pipe.add_observer(obs)``): ``on_round`` receives each target
pass (``RoundInfo``), ``on_generation`` the result when a generation ends, also a failed one.

    trace = TraceWriter("run.jsonl")          # one {"type": "round", ...} line per round,
    pipe.add_observer(trace)                  # one {"type": "summary", ...} per generation

    prom = PrometheusMetrics()                # needs prometheus-client
    pipe.add_observer(prom)
    prometheus_client.start_http_server(9100, registry=prom.registry)   # or prom.text()

Prometheus names follow llama.cpp / vLLM: ``dspark_edge_draft_n_total``,
``dspark_edge_draft_n_accepted_total``, the ``dspark_edge_accept_length`` histogram and the
per-position counters ``dspark_edge_draft_n_per_pos_total`` /
``dspark_edge_draft_n_accepted_per_pos_total`` (label ``position``, 1-based).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from pathlib import Path
from typing import IO

from .errors import ConfigError
from .paths import output_file, writing
from .verify import judged

log = logging.getLogger(__name__)

TRACE_SCHEMA = 1


class TraceWriter:
    """Writes one JSON line per round and one summary line per generation, flushed as they come
    (a crash loses at most the line being written). Usable as a context manager."""

    def __init__(self, path: str | Path | IO[str], *, label: str | None = None) -> None:
        if isinstance(path, (str, Path)):
            path = output_file(path, "trace")
            with writing(path, "trace"):
                self._file = open(path, "w", encoding="utf-8")
            self._owned, self.path = True, path
        else:
            self._file, self._owned, self.path = path, False, None
        self.label = label
        self.generation = 0
        self._lock = threading.Lock()
        self._write({"type": "header", "schema": TRACE_SCHEMA, "label": label})

    def _write(self, record: dict) -> None:
        with self._lock, writing(self.path or "(stream)", "trace"):
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()

    def on_round(self, info) -> None:
        self._write({"type": "round", "generation": self.generation, **info.as_dict()})

    def on_generation(self, result) -> None:
        self._write({"type": "summary", "generation": self.generation, "stop_reason": result.stop_reason,
                     "error": result.error, "new_tokens": len(result.token_ids), "stats": result.stats.as_dict(),
                     "prompt_ids": list(result.prompt_ids), "token_ids": list(result.token_ids)})
        self.generation += 1

    def close(self) -> None:
        if self._owned and not self._file.closed:
            try:
                self._file.close()
            except OSError:  # the write that failed has said so; closing must not raise again
                pass

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_trace(path: str | Path) -> list[dict]:
    """The records of a trace file; a bad line is an error naming the line."""
    from .strict_json import read_jsonl

    records = []
    for n, rec in read_jsonl(path, ConfigError, cut_tail_ok=True):
        if "type" not in rec:
            raise ConfigError(f"{path}:{n}: not a dspark_edge trace record (no 'type')")
        if rec["type"] == "round":
            _check_round(rec, f"{path}:{n}")
        records.append(rec)
    if not records or records[0].get("type") != "header":
        raise ConfigError(f"{path} is not a dspark_edge trace (no header line)")
    if records[0].get("schema", 0) > TRACE_SCHEMA:
        raise ConfigError(f"{path} has trace schema {records[0]['schema']}; this runtime reads up to {TRACE_SCHEMA}: "
                          "upgrade dspark_edge")
    return records


_ROUND_FIELDS = {"round": int, "generation": int, "width": int, "drafted": int, "accepted": int, "tokens": list,
                 "confidence": list, "draft_ms": (int, float), "verify_ms": (int, float)}


def _check_round(rec: dict, where: str) -> None:
    """A round record has what the summaries and plots read, of the right types."""
    for key, kind in _ROUND_FIELDS.items():
        value = rec.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ConfigError(f"{where}: round record field {key!r} is {value!r}; not a trace this runtime wrote")
    if rec["width"] < 1 or not 0 <= rec["accepted"] <= rec["drafted"] or rec["draft_ms"] < 0 or rec["verify_ms"] < 0:
        raise ConfigError(f"{where}: round record with impossible counts or times; not a trace this runtime wrote")
    if not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in rec["confidence"]):
        raise ConfigError(f"{where}: round record field 'confidence' must hold numbers")
    for key in ("telemetry", "decision"):
        if rec.get(key) is not None and not isinstance(rec[key], dict):
            raise ConfigError(f"{where}: round record field {key!r} must be an object or null")


def summarize(rounds: list[dict]) -> dict:
    """Aggregate round records (``type == "round"``): counts, acceptance, widths, modes, costs."""
    drafted = [r for r in rounds if r["drafted"]]
    draft_n = sum(r["drafted"] for r in drafted)
    accepted = sum(r["accepted"] for r in drafted)
    reached: Counter = Counter()
    kept: Counter = Counter()
    for r in drafted:
        for pos in range(1, judged(r["drafted"], r["accepted"]) + 1):
            reached[pos] += 1
        for pos in range(1, r["accepted"] + 1):
            kept[pos] += 1
    tokens = sum(len(r["tokens"]) for r in rounds)
    ms = sum(r["draft_ms"] + r["verify_ms"] for r in rounds)
    modes = Counter(r["decision"]["mode"] for r in rounds if r.get("decision"))
    return {
        "rounds": len(rounds), "tokens": tokens, "draft_n": draft_n, "draft_n_accepted": accepted,
        "acceptance_rate": accepted / draft_n if draft_n else 0.0,
        "mean_accept_length": accepted / len(drafted) if drafted else 0.0,
        "tokens_per_round": tokens / len(rounds) if rounds else 0.0,
        "acceptance_per_position": [kept[p] / reached[p] for p in sorted(reached)],
        "widths": dict(sorted(Counter(str(r["width"]) for r in rounds).items())),
        "modes": dict(modes),
        "draft_ms_per_round": sum(r["draft_ms"] for r in rounds) / len(rounds) if rounds else 0.0,
        "verify_ms_per_round": sum(r["verify_ms"] for r in rounds) / len(rounds) if rounds else 0.0,
        "tokens_per_s_rounds": tokens / ms * 1e3 if ms else 0.0,
    }


class PrometheusMetrics:
    """Counters, histograms and gauges in a ``prometheus_client`` registry (its own by default)."""

    def __init__(self, registry=None, namespace: str = "dspark_edge") -> None:
        try:
            import prometheus_client as pc
        except ImportError:
            raise ConfigError("Prometheus metrics need the prometheus-client package: "
                              "pip install prometheus-client") from None
        self._pc = pc
        self.registry = registry if registry is not None else pc.CollectorRegistry()
        kw = {"namespace": namespace, "registry": self.registry}
        self.generations = pc.Counter("generations", "Generations ended, by stop reason", ["stop_reason"], **kw)
        self.tokens = pc.Counter("generation_tokens", "Tokens generated", **kw)
        self.rounds = pc.Counter("rounds", "Target passes, by verify width", ["width"], **kw)
        self.draft_n = pc.Counter("draft_n", "Draft tokens verified", **kw)
        self.draft_n_accepted = pc.Counter("draft_n_accepted", "Draft tokens accepted", **kw)
        self.per_pos = pc.Counter("draft_n_per_pos", "Drafts verified that reached this position (1-based)",
                                  ["position"], **kw)
        self.per_pos_accepted = pc.Counter("draft_n_accepted_per_pos", "Drafts accepted at this position (1-based)",
                                           ["position"], **kw)
        self.accept_length = pc.Histogram("accept_length", "Accepted drafts per drafted round",
                                          buckets=tuple(range(0, 17)), **kw)
        self.verify_seconds = pc.Histogram("verify_seconds", "Target pass and verification time per round",
                                           buckets=(.002, .005, .01, .02, .035, .05, .075, .1, .2, .5, 1.0), **kw)
        self.draft_seconds = pc.Histogram("draft_seconds", "Drafting time per drafted round",
                                          buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2), **kw)
        self.modes = pc.Counter("scheduler_rounds", "Rounds by scheduler mode", ["mode"], **kw)
        self.tokens_per_s = pc.Gauge("last_tokens_per_second", "Decode speed of the last generation", **kw)
        self.mem_available = pc.Gauge("mem_available_bytes", "Available memory at the last round", **kw)
        self.rss = pc.Gauge("rss_bytes", "Resident memory of this process at the last round", **kw)
        self.cpu = pc.Gauge("cpu_percent", "CPU load (all cores) at the last round", **kw)
        self.temp = pc.Gauge("max_temperature_celsius", "Hottest sensor at the last round (NaN: none)", **kw)
        self.throttling = pc.Gauge("throttling", "1 while the device reports throttling", **kw)

    def on_round(self, info) -> None:
        self.rounds.labels(width=str(info.width)).inc()
        self.verify_seconds.observe(info.verify_ms / 1e3)
        if info.drafted:
            self.draft_n.inc(info.drafted)
            self.draft_n_accepted.inc(info.accepted)
            self.accept_length.observe(info.accepted)
            self.draft_seconds.observe(info.draft_ms / 1e3)
            for pos in range(1, judged(info.drafted, info.accepted) + 1):
                self.per_pos.labels(position=str(pos)).inc()
            for pos in range(1, info.accepted + 1):
                self.per_pos_accepted.labels(position=str(pos)).inc()
        if info.decision is not None:
            self.modes.labels(mode=info.decision.mode).inc()
        s = info.telemetry
        if s is not None:
            self.mem_available.set(s.mem_available_mb * 2**20)
            self.rss.set(s.rss_mb * 2**20)
            self.cpu.set(s.cpu_percent)
            self.temp.set(s.max_temp_c if s.max_temp_c is not None else float("nan"))
            self.throttling.set(1.0 if s.throttling else 0.0)

    def on_generation(self, result) -> None:
        self.generations.labels(stop_reason=result.stop_reason).inc()
        self.tokens.inc(len(result.token_ids))
        self.tokens_per_s.set(result.stats.tokens_per_s)

    def text(self) -> str:
        """The registry in Prometheus text format."""
        return self._pc.generate_latest(self.registry).decode()

    def write(self, path: str | Path) -> None:
        """Write the text format to ``path`` atomically (node_exporter's textfile collector)."""
        path = output_file(path, "Prometheus metrics file")
        with writing(path, "Prometheus metrics file"):
            self._pc.write_to_textfile(str(path), self.registry)
