"""The sweep's plots (benchmarks.sweep) from loadgen-shaped results: latency and throughput
against concurrency (one line per setting, the result's ``config.label``), acceptance per
position, controller depth over time."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _label(res: dict) -> str:
    return res["config"].get("label") or res["config"].get("model", "?")


def _by_setting(results):
    """label -> list of results sorted by max concurrency."""
    groups = defaultdict(list)
    for r in results:
        groups[_label(r)].append(r)
    for rs in groups.values():
        rs.sort(key=lambda r: r["config"].get("max_concurrency") or 0)
    return groups


def plot_latency_throughput(results, out: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for label, rs in sorted(_by_setting(results).items()):
        conc = [r["config"].get("max_concurrency") or 0 for r in rs]
        for ax, key in ((axes[0], "ttft_s"), (axes[1], "itl_s")):
            # (Rounds kept by sweep_report for pooling carry throughput only.)
            timed = [(c, r["metrics"][key]) for c, r in zip(conc, rs) if key in r["metrics"]]
            if timed:
                ax.plot([c for c, _ in timed], [m["median"] * 1e3 for _, m in timed], "o-", label=f"{label} p50")
                ax.plot([c for c, _ in timed], [m["p99"] * 1e3 for _, m in timed], "x--", label=f"{label} p99")
        axes[2].plot(conc, [r["metrics"]["output_throughput"] for r in rs], "o-", label=label)
    for ax, title, unit in ((axes[0], "TTFT", "ms"), (axes[1], "inter-token latency", "ms"),
                            (axes[2], "output throughput", "tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[2].legend(fontsize=7)
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path = out / "latency_throughput.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_acceptance(results, out: Path) -> Path | None:
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = False
    for r in results:
        per_pos = (r.get("acceptance") or {}).get("acceptance_per_position")
        if not per_pos:
            continue
        ks = sorted(per_pos, key=int)
        ax.plot([int(k) for k in ks], [per_pos[k] for k in ks], "o-",
                label=f"{_label(r)} c={r['config'].get('max_concurrency')}")
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted per draft")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    path = out / "acceptance_per_position.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_depth(results, out: Path) -> Path | None:
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for r in results:
        series = r.get("depth_series") or []
        if series:
            ax.step([t for t, _ in series], [d for _, d in series], where="post",
                    label=f"{_label(r)} c={r['config'].get('max_concurrency')}")
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("time (s)")
    ax.set_ylabel("controller depth")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    path = out / "depth_over_time.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def make_all(results, out_dir) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [plot_latency_throughput(results, out), plot_acceptance(results, out), plot_depth(results, out)]
    return [p for p in paths if p is not None]

