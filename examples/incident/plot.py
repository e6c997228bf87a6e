"""The incident as a picture: the stream's lag and each agent's state over time.

``plot(record, path)`` draws what ``examples.demo_incident.run(..., record=[...])`` sampled
(one sample per signal and per catch-up poll) into a PNG: on top the lag in messages with
the stale threshold (1000) and the fresh-again level (hysteresis: 500), and the moments
``data_stale`` / ``data_fresh`` were pushed; below, one lane per agent: holding a GPU,
waiting for one, or parked by the scheduler on stale data. Needs matplotlib (the ``docs``
extra: ``pip install 'agent-data-fabric[docs]'``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLOURS = {"gpu": "#2e7d32", "waiting": "#bdbdbd", "parked": "#c62828"}


def plot(record: list[dict[str, Any]], path: str | Path, threshold: int = 1000) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    record = sorted(record, key=lambda s: s["t"])
    lagged = [s for s in record if s["lag"] is not None]
    fig, (top, lanes) = plt.subplots(
        2, 1, figsize=(9, 5), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    top.plot([s["t"] for s in lagged], [s["lag"] for s in lagged], color="#1565c0", lw=1.5)
    top.axhline(threshold, color="#c62828", ls="--", lw=1, label=f"stale above {threshold:,}")
    top.axhline(
        threshold / 2, color="#2e7d32", ls=":", lw=1, label="fresh again below (hysteresis)"
    )
    for s in record:
        if s["event"] in ("data_stale", "data_fresh"):
            colour = COLOURS["parked"] if s["event"] == "data_stale" else COLOURS["gpu"]
            top.axvline(s["t"], color=colour, lw=1, alpha=0.6)
            top.annotate(s["event"], (s["t"], threshold), rotation=90, fontsize=8,
                         xytext=(3, 8), textcoords="offset points", color=colour)  # fmt: skip
    top.set_ylim(bottom=0)
    top.set_ylabel("lag (messages)")
    top.set_title("Incident: a burst of 10^5 messages on the headline stream")
    top.legend(loc="upper right", fontsize=8)
    names = sorted({n for s in record for n in s["agents"]})
    end = record[-1]["t"] + 0.05 * (record[-1]["t"] - record[0]["t"] or 1)  # the last state
    for row, name in enumerate(names):
        states = [(s["t"], s["agents"].get(name, "waiting")) for s in record]
        for (t, state), (t_next, _) in zip(states, [*states[1:], (end, None)]):
            kind = "gpu" if state.startswith("GPU") else state
            lanes.barh(row, max(t_next - t, 0.05), left=t, height=0.6, color=COLOURS[kind])
    lanes.set_yticks(range(len(names)), names)
    lanes.set_xlabel("seconds since the incident began")
    lanes.legend(
        handles=[Patch(color=c, label=k if k != "gpu" else "holds a GPU") for k, c in COLOURS.items()],
        loc="upper right", fontsize=8, ncol=3,
    )  # fmt: skip
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
