"""Plot bench_plan.py's result: device time per plan against verify entries, one series per implementation,
with the floor (fewest bytes over the measured copy bandwidth), SGLang's anchors and the targets.

    python benchmarks/plot.py [benchmarks/results/plan.json] [-o plot.png]    (needs the [plot] extra)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path, nargs="?", default=Path(__file__).parent / "results" / "plan.json")
    ap.add_argument("-o", "--output", type=Path, help="PNG path (default: beside the JSON)")
    args = ap.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("kv-canary: plotting needs matplotlib: pip install matplotlib") from None
    data = json.loads(args.result.read_text())
    rows = [f for f in data["figures"] if f["name"].endswith(" graph") and f["value"] is not None]
    fig, ax = plt.subplots(figsize=(8, 5))
    for impl in sorted({r["impl"] for r in rows}):
        pts = sorted((r["entries"], r["value"]) for r in rows if r["impl"] == impl)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{impl} (graph replay)")
    floor = sorted({(r["entries"], r["floor"]) for r in rows})
    ax.plot([f[0] for f in floor], [f[1] for f in floor], "k--", label="floor (fewest bytes / copy bandwidth)")
    targets = sorted({(r["entries"], r["target"]["value"]) for r in rows if r["target"]})
    ax.plot([t[0] for t in targets], [t[1] for t in targets], "g^", markersize=8, label="target")
    anchors = sorted({(r["entries"], r["anchor"]) for r in rows if r["anchor"]})
    ax.plot([a[0] for a in anchors], [a[1] for a in anchors], "rx", markersize=9, label="SGLang's planner")
    for r in rows:
        if r["impl"] == "cupy":
            ax.annotate(r["name"].split()[1], (r["entries"], r["value"]), fontsize=7, xytext=(4, -10),
                        textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("verify entries per plan")
    ax.set_ylabel("device time per plan (us)")
    gpu = data["gpu"].get("name") or "GPU"
    ax.set_title(f"kv-canary plan kernels on {gpu} ({data.get('commit', '')[:8]})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    out = args.output or args.result.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
