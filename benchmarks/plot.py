"""Plot a bench_plan.py result: device time per plan against verify entries, one series per implementation,
with the memory roofline (minimum bytes over the measured copy bandwidth) and SPEC 5's SGLang anchors.

    python benchmarks/plot.py benchmarks/results/plan-*.json [-o plot.png]    (needs the [plot] extra)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("-o", "--output", type=Path, help="PNG path (default: beside the JSON)")
    args = ap.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("kv-canary: plotting needs matplotlib: pip install 'kv-canary[plot]'") from None
    data = json.loads(args.result.read_text())
    rows = [r for r in data["rows"] if "graph_us" in r]
    fig, ax = plt.subplots(figsize=(8, 5))
    for impl in sorted({r["impl"] for r in rows}):
        pts = sorted((r["entries"], r["graph_us"], r["workload"]) for r in rows if r["impl"] == impl)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{impl} (graph replay)")
    floor = sorted({(r["entries"], r["floor_us"]) for r in rows})
    ax.plot([f[0] for f in floor], [f[1] for f in floor], "k--", label="roofline (min bytes / copy bandwidth)")
    ax.plot([f[0] for f in floor], [1.3 * f[1] + 3 for f in floor], "k:", label="SPEC 5 target: 1.3 x roofline + 3 us")
    anchors = sorted({(r["entries"], r["anchor_sglang_us"]) for r in rows if r.get("anchor_sglang_us")})
    ax.plot([a[0] for a in anchors], [a[1] for a in anchors], "rx", markersize=9, label="SGLang planner (SPEC 5)")
    for r in rows:
        if r["impl"] == "cupy":
            ax.annotate(r["workload"], (r["entries"], r["graph_us"]), fontsize=7, xytext=(4, -10),
                        textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("verify entries per plan")
    ax.set_ylabel("device time per plan (us)")
    gpu = data.get("gpu", {}).get("name", "GPU")
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
