#!/usr/bin/env python3
"""Compares benchmark result files (`m3msa bench NAME --json FILE`, docs/benchmarks.md "Result
files") of a change against the code before it, cell by cell: the A/B that docs/benchmarks.md
reports as "before -> now".

  scripts/bench_compare.py --base out/ab/indexer_m3msa-base_*.json --new out/ab/indexer_m3msa_*.json
  scripts/bench_compare.py --base before.json --new after.json --metric p90_us --where dtype=fp8

Each side may be several files, e.g. the alternating rounds of scripts/gpu_steps/ab-bench.sh; a
cell takes the smallest value of its side's rounds (the better round, as the docs' A/B tables
do). A cell is a row's configuration: its integer, string and boolean fields but `check`, `reps`
and `copies` (or --key, a comma list). Prints a markdown table of the cells both sides have (the
configuration columns that vary, base, new, change) and the geometric mean of new / base.
Python 3 standard library only.
"""

import argparse
import json
import math
import sys

NOT_CONFIGURATION = {"check", "reps", "copies"}


def configuration_keys(row):
    return sorted(
        k
        for k, v in row.items()
        if k not in NOT_CONFIGURATION and isinstance(v, (int, str, bool))
    )


def sort_value(v):
    """Numbers in numeric order, before strings."""
    return (0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v))


def load(paths, metric, keys, where):
    """{cell: best value} over the files, and the configuration keys used."""
    cells = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            sys.exit(f"bench_compare: cannot read {path}: {e}")
        for row in doc.get("rows", []):
            if any(str(row.get(k)) != v for k, v in where):
                continue
            if metric not in row or not isinstance(row[metric], (int, float)):
                continue
            row_keys = keys or configuration_keys(row)
            cell = tuple((k, row.get(k)) for k in row_keys)
            value = float(row[metric])
            cells[cell] = min(value, cells.get(cell, value))
    return cells


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", nargs="+", required=True, help="result files of the code before")
    ap.add_argument("--new", nargs="+", required=True, help="result files of the change")
    ap.add_argument("--metric", default="median_us", help="the compared field (default median_us)")
    ap.add_argument("--key", default="", help="comma list of the fields that name a cell")
    ap.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                    help="only rows whose KEY prints as VALUE (repeatable)")
    args = ap.parse_args()
    where = []
    for w in args.where:
        if "=" not in w:
            sys.exit(f"bench_compare: --where wants KEY=VALUE, got {w!r}")
        where.append(tuple(w.split("=", 1)))
    keys = [k for k in args.key.split(",") if k]
    base = load(args.base, args.metric, keys, where)
    new = load(args.new, args.metric, keys, where)
    both = sorted(set(base) & set(new), key=lambda c: [sort_value(v) for _, v in c])
    if not both:
        sys.exit("bench_compare: no cell is in both sides (check --key / --where / --metric)")
    names = [k for k, _ in both[0]]
    varying = [i for i, k in enumerate(names) if len({c[i][1] for c in both}) > 1] or [0]
    print("| " + " | ".join(names[i] for i in varying) + f" | base {args.metric} | new | change |")
    print("|" + "---|" * (len(varying) + 3))
    logs = []
    for cell in both:
        b, n = base[cell], new[cell]
        if b > 0 and n > 0:
            logs.append(math.log(n / b))
        change = f"{100.0 * (n / b - 1.0):+.1f} %" if b > 0 else "-"
        print("| " + " | ".join(str(cell[i][1]) for i in varying) + f" | {b:.2f} | {n:.2f} | {change} |")
    geomean = math.exp(sum(logs) / len(logs)) if logs else float("nan")
    only = len(set(base) ^ set(new))
    print(f"\ngeomean new / base {geomean:.4f} over {len(logs)} cells"
          + (f"; {only} cells in one side only" if only else ""))


if __name__ == "__main__":
    main()
