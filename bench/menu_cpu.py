"""The drain's CPU for one menu between its answer and its store: the JSON decoded, validated,
normalised and encoded (``crawl_menu``'s own work), in microseconds of process time per menu.

    python bench/menu_cpu.py [--stores 2000] [--rounds 5]

The simulator's menus (20-60 products, prices and percentages as it draws them), versions 0 and
1, in that order in one process: what a first crawl and then a resync decode. No database and
no server: run each tree's copy (it imports the ``tq_pipelines`` beside it) to compare two trees;
the first pass over each version and the best of ``--rounds``.
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tq_pipelines.crawl.menu import encode_menu, normalise_menu  # noqa: E402
from tq_pipelines_demo.simulator import PlatformProfile, SimulatedPlatform  # noqa: E402


def per_menu(bodies: list[bytes], rounds: int) -> tuple[float, float]:
    """Microseconds of process time per menu: the first pass over ``bodies``, and the best of
    ``rounds`` (with whatever the first left cached)."""
    times = []
    for _ in range(rounds):
        began = time.process_time()
        for body in bodies:
            encode_menu(normalise_menu(json.loads(body)))
        times.append((time.process_time() - began) / len(bodies) * 1e6)
    return round(times[0], 1), round(min(times), 1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stores", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    platform = SimulatedPlatform(PlatformProfile("bench", stores=args.stores), started_at=time.time())
    stores = list(platform.stores.values())
    result = {"stores": len(stores), "tree": str(ROOT)}
    for version in (0, 1):
        bodies = [json.dumps(platform.menu(s, version)).encode() for s in stores]
        first, best = per_menu(bodies, args.rounds)
        result[f"version_{version}_us_per_menu"] = {"first_pass": first, "best": best}
    result["products_per_menu"] = round(sum(s.products for s in stores) / len(stores), 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
