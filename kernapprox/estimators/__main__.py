"""Print the estimator registry and each estimator's declared capabilities: ``python -m kernapprox.estimators``.

The registry itself is :mod:`kernapprox.estimators.registry`; this is the estimator package's command line (a
``__main__`` module: nothing imports it, so running it loads no module twice and runpy has nothing to warn about).
"""

from __future__ import annotations

import argparse
import sys

from kernapprox.estimators.registry import TABLE_COLUMNS, available_estimators, estimator_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kernapprox.estimators",
        description="List the registered estimators with their declared capabilities (a markdown table).",
        epilog="columns: " + "; ".join(f"{name}: {text}" for name, text in TABLE_COLUMNS.items()))
    parser.add_argument("--names", action="store_true", help="print only the registry names, one per line")
    args = parser.parse_args(argv)
    print("\n".join(available_estimators()) if args.names else estimator_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
