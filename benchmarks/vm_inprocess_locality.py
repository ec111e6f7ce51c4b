"""Where a Ray scheduler actor's pages live after it binds itself, with and without migration, on a two-node VM.

Boots a fresh VM per measurement (page cache placement carries over otherwise)
and runs tests/vm_scripts/inprocess_bind.py in it: the process starts on node 0,
imports torch, touches --mib MiB (and 8 MiB of a shared mapping), runs the actor's bind
(``bind_scheduler_process``, for a GPU on node 1), touches --mib MiB more. Migration moves
the process's private anonymous pages only (mbind with MPOL_MF_MOVE): the shared
mapping's column shows its pages stay where they were.

    .venv/bin/python benchmarks/vm_inprocess_locality.py [--mib 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import numavm  # noqa: E402

SCRIPT = "tests/vm_scripts/inprocess_bind.py"


def measure(*, mib: int, migrate: bool) -> dict:
    args = ["--mib", str(mib)] + ([] if migrate else ["--no-migrate"])
    return numavm.run_script_in_vm(
        SCRIPT, *args, vm_args=["--nodes", "2", "--cpus", "4"], vm_timeout_s=300
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    numavm.require_vm()
    print(
        f"{'migration':<10} {'before':>8} {'after bind':>11} {'anon after bind':>16} {'after alloc':>12} {'anon':>7} {'shared':>7} {'bind s':>7} {'MiB':>5}  not moved"
    )
    for migrate in (False, True):
        out = measure(mib=args.mib, migrate=migrate)
        print(
            f"{'on' if migrate else 'off':<10} {out['ratio_before']:>8.3f} {out['ratio_after_bind']:>11.3f} "
            f"{out['anon_ratio_after_bind']:>16.3f} "
            f"{out['ratio_after_alloc']:>12.3f} {out['anon_ratio_after_alloc']:>7.3f} "
            f"{out['shared_ratio_after_bind']:>7.3f} {out['bind_seconds']:>7.3f} {out['resident_mib_before']:>5}  "
            f"{out['mappings_not_moved']}"
        )
    print(
        f"(share of resident kB on node 1, the target, of all pages (file pages, the shared page cache, stay) and of anonymous ones; shared: of the shared mapping, after the bind; MiB resident before the bind, torch imported; {args.mib} MiB touched before and after it; TCG emulation)"
    )


if __name__ == "__main__":
    main()
