"""Benchmark reports as text: a Markdown table, a PNG plot, and the marked
results block of a docs page regenerated from a report.

A *report* is what :func:`infer.tools.bench.run_benchmark` returns (one model);
functions here take a list of them (one per model).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from infer.errors import BenchmarkError

log = logging.getLogger(__name__)



def markers(name: str = "bench") -> tuple[str, str]:
    """The lines that delimit a generated block (``bench`` in
    docs/performance.md and README.md, ``batching`` in docs/performance.md)."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def model_name(report: dict[str, Any]) -> str:
    return Path(report["model"]["path"]).name


def machine_line(report: dict[str, Any]) -> str:
    """Where and how the figures were measured, in one sentence."""
    m, s = report["machine"], report["settings"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
    ram = f", {m['ram_bytes'] / 2**30:.0f} GiB RAM" if m.get("ram_bytes") else ""
    bw = m.get("read_bandwidth_bytes_s")
    bandwidth = f", memory read {bw / 1e9:.1f} GB/s" if bw else ""
    gpu = m.get("gpu")
    if gpu:
        gbw = m.get("gpu_read_bandwidth_bytes_s")
        bandwidth += (f"; GPU {gpu['name']} ({gpu['memory_bytes'] / 2**30:.0f} GiB"
                      + (f", memory read {gbw / 1e9:.0f} GB/s" if gbw else "") + ")")
    flags = f", {' '.join(m['cpu_flags'])}" if m.get("cpu_flags") else ""
    return (f"{report['date']} on {m['cpu']} ({m['cores']} logical cores{flags}{ram}{bandwidth}), {m['platform']}; "
            f"{versions}. Prompt {s['prompt_tokens']} tokens, {s['new_tokens']} new tokens greedy, "
            f"{s['threads']} threads, median of {s['repeats']} repeats.")


def markdown_table(reports: Sequence[dict[str, Any]]) -> str:
    """One row per model and engine: absolute figures, ratios to each
    report's baseline, and the fraction of the decode bandwidth bound."""
    baselines = {r.get("baseline") for r in reports if r.get("baseline")}
    against = f" (× {baselines.pop()})" if len(baselines) == 1 else " (× baseline)"
    head = ["model", "engine", "prefill tok/s", "decode tok/s", "TTFT ms", "load s", "peak RSS MB",
            f"prefill{against}", f"decode{against}", "decode / bound"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for report in reports:
        for e in report["engines"]:
            if e["status"] != "ok":
                cells = [model_name(report), e["label"], f"{e['status']}: {e['reason']}"] + [""] * (len(head) - 3)
                lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
                continue
            m, r = e["median"], e.get("ratios") or {}
            ttft = m["ttft_s"] * 1000 if m["ttft_s"] is not None else None
            rss = m["peak_rss_bytes"] / 2**20 if m["peak_rss_bytes"] is not None else None
            bound = e.get("bound_fraction")
            cells = [model_name(report), e["label"], _fmt(m["prefill_tok_s"]), _fmt(m["decode_tok_s"]),
                     _fmt(ttft, 0), _fmt(m["load_s"], 2), _fmt(rss, 0), _ratio(r.get("prefill_tok_s")),
                     _ratio(r.get("decode_tok_s")), _share(bound)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _share(fraction: float | None) -> str:
    """A fraction of the bound as a percentage (one decimal under 10%: GPU decoding of small models)."""
    if fraction is None:
        return "–"
    return f"{fraction:.1%}" if fraction < 0.1 else f"{fraction:.0%}"


def plot(reports: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> Path | None:
    """Bar charts of prefill, decode, load time and peak memory per engine,
    one group per model, written as a PNG. Returns None (and logs why) when
    matplotlib is not installed (``pip install infer-engine[bench]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot written (pip install 'infer-engine[bench]')")
        return None
    panels = [("prefill_tok_s", "prefill tokens/s", 1.0), ("decode_tok_s", "decode tokens/s", 1.0),
              ("load_s", "load time (s)", 1.0), ("peak_rss_bytes", "peak RSS above imports (MiB)", 2.0**-20)]
    labels: list[str] = []
    for report in reports:
        labels += [e["label"] for e in report["engines"] if e["status"] == "ok" and e["label"] not in labels]
    if not labels:
        log.warning("no engine has figures: no plot written")
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8 + 0.18 * len(labels)))
    width = 0.8 / len(labels)
    colors = plt.get_cmap("tab10")
    for ax, (metric, title, scale) in zip(axes, panels):
        for j, label in enumerate(labels):
            xs, ys = [], []
            for i, report in enumerate(reports):
                e = next((e for e in report["engines"] if e["label"] == label and e["status"] == "ok"), None)
                if e is not None and e["median"].get(metric) is not None:
                    xs.append(i + (j - (len(labels) - 1) / 2) * width)
                    ys.append(e["median"][metric] * scale)
            ax.bar(xs, ys, width, label=label, color=colors(j % 10))
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(reports)))
        ax.set_xticklabels([model_name(r).removesuffix(".gguf") for r in reports], fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(0, -0.12), ncol=2, frameon=False)
    fig.suptitle(f"infer bench — {reports[0]['machine']['cpu']}, {reports[0]['date'][:10]}", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def results_block(reports: Sequence[dict[str, Any]], image: str | None = None) -> str:
    """The Markdown of the ``bench`` block (see :func:`markers`)."""
    parts = [f"Measured {machine_line(reports[0])}", "", markdown_table(reports)]
    if image:
        parts += ["", f"![infer bench results]({image})"]
    return "\n".join(parts)


def update_marked_block(path: str | os.PathLike[str], text: str, name: str = "bench") -> None:
    """Replace what lies between the two :func:`markers` lines of ``path``
    with ``text``; the file must hold the pair once."""
    begin, end = markers(name)
    file = Path(path)
    content = file.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if len(pattern.findall(content)) != 1:
        raise BenchmarkError(f"{file} must hold exactly one {begin} … {end} block to update")
    file.write_text(pattern.sub(lambda _: f"{begin}\n{text}\n{end}", content), encoding="utf-8")
