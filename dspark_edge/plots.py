"""A timeline of one generation: chosen width, acceptance, speed and telemetry per round.

Reads round records (``RoundInfo.as_dict()`` or a trace's ``"round"`` lines) and writes a
PNG with matplotlib (the ``demo`` extra; not needed to decode). The PNG's ``Description`` text
chunk lists the plotted series as JSON, so a test or a script can check what a plot holds
without looking at pixels.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ConfigError

WINDOW = 8  # rounds in the rolling acceptance and speed
MIN_MEMORY_SPAN_MB = 512.0  # the free-memory axis spans at least this much


def series(rounds: list[dict], window: int = WINDOW) -> dict[str, list[float | None]]:
    """The plotted values per round: width, drafted, accepted, rolling acceptance and tok/s,
    first-draft confidence and telemetry (None where a round has no reading)."""
    out: dict[str, list] = {k: [] for k in ("round", "width", "drafted", "accepted", "acceptance", "tok/s",
                                            "confidence[1]", "cpu %", "other processes' cpu %", "free memory MiB",
                                            "temperature °C")}
    for i, r in enumerate(rounds):
        recent = rounds[max(0, i - window + 1):i + 1]
        drafted = sum(x["drafted"] for x in recent)
        ms = sum(x["draft_ms"] + x["verify_ms"] for x in recent)
        t = r.get("telemetry") or {}
        temps = list((t.get("temps_c") or {}).values())
        out["round"].append(r["round"])
        out["width"].append(r["width"])
        out["drafted"].append(r["drafted"])
        out["accepted"].append(r["accepted"])
        out["acceptance"].append(sum(x["accepted"] for x in recent) / drafted if drafted else None)
        out["tok/s"].append(sum(len(x["tokens"]) for x in recent) / ms * 1e3 if ms > 0 else None)
        out["confidence[1]"].append(r["confidence"][0] if r["confidence"] else None)
        out["cpu %"].append(t.get("cpu_percent"))
        out["other processes' cpu %"].append(t.get("cpu_other_percent"))
        out["free memory MiB"].append(t.get("mem_available_mb"))
        out["temperature °C"].append(max(temps) if temps else None)
    return out


def plot_timeline(rounds: list[dict], path: str | Path, title: str = "dspark_edge timeline") -> list[str]:
    """Write the timeline PNG; returns the names of the series drawn (those with any value)."""
    from .paths import output_file, writing

    path = output_file(path, "plot")  # before the figure is drawn
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install matplotlib (or the project's demo extra)") from None
    if not rounds:
        raise ConfigError("nothing to plot: the generation ran no decoding round (max_new_tokens too small?)")
    s = series(rounds)
    x = s["round"]
    fig = Figure(figsize=(10, 9), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(4, 1, sharex=True)
    drawn: list[str] = []

    def line(ax, name, label=None, **kw):
        ys = s[name]
        if any(v is not None for v in ys):
            ax.plot(x, [float("nan") if v is None else v for v in ys], label=label or name, **kw)
            drawn.append(name)

    line(axes[0], "width", drawstyle="steps-mid", color="tab:blue")
    line(axes[0], "accepted", drawstyle="steps-mid", color="tab:green")
    axes[0].set_ylabel("tokens")
    axes[0].set_title(title)
    line(axes[1], "acceptance", label=f"acceptance (mean of the last {WINDOW} rounds)", color="tab:green")
    line(axes[1], "confidence[1]", color="tab:orange", alpha=0.7, marker=".", linestyle="none")
    axes[1].set_ylim(-0.05, 1.05)
    axes[1].set_ylabel("rate")
    line(axes[2], "tok/s", color="tab:purple")
    axes[2].set_ylabel(f"tok/s ({WINDOW}-round)")
    line(axes[3], "cpu %", label="cpu % (all processes)", color="tab:red")
    line(axes[3], "other processes' cpu %", color="tab:pink", linestyle=":")
    line(axes[3], "temperature °C", color="tab:brown")
    axes[3].set_ylabel("% / °C")
    axes[3].set_ylim(0, 105 if not any(s["temperature °C"]) else max(105, max(v for v in s["temperature °C"] if v) + 5))
    mem_ax = axes[3].twinx()
    line(mem_ax, "free memory MiB", color="tab:gray", linestyle="--")
    mem_ax.set_ylabel("free MiB")
    mem_ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    free = [v for v in s["free memory MiB"] if v is not None]
    if free:  # a span of a few MiB would look like a cliff: show at least MIN_MEMORY_SPAN_MB
        mid, half = (max(free) + min(free)) / 2, max(max(free) - min(free), MIN_MEMORY_SPAN_MB) / 2 * 1.1
        mem_ax.set_ylim(max(0.0, mid - half), mid + half)
    axes[3].set_xlabel("round")
    modes = [(r.get("decision") or {}).get("mode") for r in rounds]
    for i, m in enumerate(modes):  # shade rounds where the scheduler ran hot, parked or probed
        if m in ("hot", "parked", "probe"):
            for ax in axes:
                ax.axvspan(x[i] - 0.5, x[i] + 0.5, color={"hot": "orange", "parked": "red", "probe": "gold"}[m],
                           alpha=0.12, linewidth=0)
    for ax in list(axes) + [mem_ax]:
        if ax.get_lines():
            ax.legend(loc="upper left" if ax is not mem_ax else "upper right", fontsize=8)
    with writing(path, "plot"):
        fig.savefig(path, dpi=90, metadata={"Description": json.dumps({"series": drawn, "rounds": len(rounds),
                                                                    "title": title})})
    return drawn


def plot_metadata(path: str | Path) -> dict:
    """The series list written into a timeline PNG (``plot_timeline``'s Description chunk)."""
    from PIL import Image

    with Image.open(path) as im:
        return json.loads(im.text["Description"])
