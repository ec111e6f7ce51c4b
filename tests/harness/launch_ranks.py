"""Runs a ``rank_probe`` job in this interpreter, as an engine's launching process: the
job as JSON on stdin, its results as one JSON line marked ``RESULT`` on stdout.

    python tests/harness/launch_ranks.py < job.json

Every rank it spawns imports this script again (as ``__mp_main__``), so it does nothing
more at import.
"""

import json
import sys

import rank_probe

if __name__ == "__main__":
    results = rank_probe.run_job(json.load(sys.stdin))
    print(rank_probe.RESULT + json.dumps(results), flush=True)
