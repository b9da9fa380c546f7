"""The figures of one ``scripts/gpu_check.sh`` run in one file (``summary.json`` beside them) and a few lines.

    python scripts/gpu_summary.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PARTS = ("first_light", "swap_fleet", "gpu_engines")


def main() -> int:
    out = Path(sys.argv[1])
    summary = {}
    for name in PARTS:
        f = out / f"{name}.json"
        summary[name] = json.loads(f.read_text()) if f.exists() else None
    for name, server in ((summary["first_light"] or {}).get("servers") or {}).items():
        print(f"{name}: {server.get('summary')}; logprob gap {server.get('logprob_gap')}")
    for kind in ("full", "lora"):
        fleet = (summary["swap_fleet"] or {}).get(kind)
        if fleet:
            tps = {m: round(v, 1) for m, v in fleet["tokens_per_s"].items()}
            print(f"{kind} swaps: fleet tokens/s {tps}, keep / drain {fleet['keep_over_drain']}")
    checks = (summary["gpu_engines"] or {}).get("checks") or {}
    print(f"engines: {sum(c['ok'] for c in checks.values())} of {len(checks)} checks passed")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
