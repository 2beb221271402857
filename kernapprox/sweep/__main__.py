"""``python -m kernapprox.sweep status [FOLDER]``: which committed figures were made by today's code.

Reads each findings file of ``FOLDER`` (default ``figures``), compares the code digest on its last line with the
digest of its study's code now (:func:`kernapprox.sweep.figure_status`) and prints one line per figure; exits with
1 when any figure is stale or unknown (``--strict``) so that a release check can refuse them, else 0.
"""

from __future__ import annotations

import argparse
import sys

from ._figures import figure_status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernapprox.sweep",
                                     description="Which committed figures were made by today's code.")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="the code digest of each findings file against today's code")
    status.add_argument("folder", nargs="?", default="figures")
    status.add_argument("--strict", action="store_true", help="exit 1 if any figure is stale or unknown")
    args = parser.parse_args(argv)
    rows = figure_status(args.folder)
    for row in rows:
        print(f"{row.status:8s} {row.path.name:40s} {row.module:36s} recorded {row.recorded or '-':16s} "
              f"now {row.current or '-'}")
    bad = [row for row in rows if row.status != "current"]
    print(f"{len(rows) - len(bad)} of {len(rows)} figures made by today's code", file=sys.stderr)
    return 1 if args.strict and bad else 0


if __name__ == "__main__":
    sys.exit(main())
