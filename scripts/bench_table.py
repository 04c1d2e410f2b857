#!/usr/bin/env python3
"""Renders a benchmark result file (`m3msa bench NAME --json FILE`, docs/benchmarks.md "Result
files") as a markdown table, so the tables of docs/benchmarks.md can be regenerated.

  scripts/bench_table.py bench/results/indexer.json
  scripts/bench_table.py bench/results/attention.json --where kv=fp8 --where q_len=1
  scripts/bench_table.py bench/results/layer.json --columns weights,tokens,q_len,context,median_us
  scripts/bench_table.py bench/results/moe-timeline-h100.json --where tp=4 --timeline

Columns: the benchmark's default set (DEFAULT_COLUMNS), or --columns (comma list of row keys;
`key=Heading` renames one). A column no row has is left out; a row without a value shows "-".
Above the table a line gives the command, card, date and commit (--no-header leaves it out).
--timeline: instead, per row that has one (`--timeline` runs), its stage timeline as the bench
printed it: per kernel, kind and stage, the records that reached it, on how many SMs, the first,
median and last time after the first recorded start, and the medians since each record's start
and of the stage itself.
Python 3 standard library only.
"""

import argparse
import json
import sys

# The columns of each benchmark's table in docs/benchmarks.md.
DEFAULT_COLUMNS = {
    "indexer": "batch,context,dtype,q_len,median_us,noise,bytes,floor_us,pct_of_floor,"
    "unfused_us,torch_us,check",
    "attention": "kv,batch,q_len,context,splits,merge,median_us,noise,bytes,floor_us,pct_of_floor",
    "sparse-step": "batch,context,dtype,q_len,median_us,noise,bytes,floor_us,pct_of_floor",
    "cp": "world_size,transport,batch,context,dtype,q_len,median_us,noise,exchange_merge_us,"
    "pct_of_floor,speedup_vs_replicated,speedup_vs_nccl,speedup_vs_allreduce_max",
    "layer": "tp,cp,weights,tokens,q_len,requests,context,indexer_overlap,median_us,noise,"
    "launches_per_layer,floor_us,ratio",
    "gemm": "shape,n,k,rows,dtype,median_us,noise,floor_us,pct_of_floor,torch_us,"
    "speedup_vs_torch,torch_op,check",
    "allreduce": "mode,rows,kib_per_rank,oneshot_us,oneshot_noise,nccl_us,nccl_over_oneshot,"
    "floor_us,oneshot_over_floor",
    "moe": "what,tp,dtype,tokens,kernels,distinct_experts_mean,median_us,noise,bytes,floor_us,"
    "pct_of_floor,check",
}

# The columns of a timeline (one entry per kernel, kind and stage) and their headings.
TIMELINE_COLUMNS = [("kernel", "kernel"), ("kind", "kind"), ("mark", "stage"),
                    ("reached", "reached"), ("sms", "SMs"), ("first_us", "first us"),
                    ("median_us", "median us"), ("last_us", "last us"),
                    ("median_since_start_us", "median since own start"),
                    ("median_stage_us", "median stage us")]

HEADINGS = {
    "median_us": "median us",
    "noise": "noise",
    "bytes": "MB",
    "floor_us": "floor us",
    "pct_of_floor": "% of floor",
    "q_len": "q",
    "unfused_us": "unfused us",
    "torch_us": "torch us",
    "exchange_merge_us": "exch+merge us",
    "speedup_vs_replicated": "x repl",
    "speedup_vs_nccl": "x nccl",
    "speedup_vs_allreduce_max": "x ar-max",
    "speedup_vs_torch": "x torch",
    "launches_per_layer": "launches",
    "indexer_overlap": "overlap",
    "world_size": "P",
    "requests": "reqs",
    "kib_per_rank": "KiB/rank",
    "oneshot_us": "one-shot us",
    "oneshot_noise": "noise",
    "nccl_us": "nccl us",
    "nccl_over_oneshot": "nccl / one-shot",
    "oneshot_over_floor": "one-shot / floor",
    "torch_op": "torch op",
    "distinct_experts_mean": "experts read",
}


def context_label(tokens):
    if tokens >= 1 << 20 and tokens % (1 << 20) == 0:
        return "%dM" % (tokens >> 20)
    if tokens >= 1 << 10 and tokens % (1 << 10) == 0:
        return "%dK" % (tokens >> 10)
    return str(tokens)


def cell(key, value):
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    if key == "context" and isinstance(value, int):
        return context_label(value)
    if isinstance(value, (int, float)):
        if key == "bytes":
            return "%.1f" % (value / 1e6)
        if key in ("noise", "oneshot_noise", "nccl_noise"):
            return "%.1f%%" % (100.0 * value)
        if key.startswith("pct_"):
            return "%.0f%%" % value
        if isinstance(value, int):
            return str(value)
        if key.startswith("speedup_") or key in ("ratio", "nccl_over_oneshot",
                                                 "oneshot_over_floor"):
            return "%.2f" % value
        return "%.1f" % value if abs(value) >= 100 else "%.2f" % value
    return str(value).replace("|", "\\|")


def parse_where(items):
    where = []
    for item in items:
        if "=" not in item:
            raise SystemExit("bench_table.py: --where takes KEY=VALUE, got %r" % item)
        key, value = item.split("=", 1)
        where.append((key, value))
    return where


def matches(row, where):
    for key, value in where:
        if key not in row:
            return False
        got = row[key]
        if isinstance(got, bool):
            got = "true" if got else "false"
        if str(got) != value:
            return False
    return True


def header(doc, benchmark):
    return "`%s` on %s, %s, commit %s%s" % (
        doc.get("command", "m3msa bench " + benchmark), doc.get("card", "?"),
        str(doc.get("date", "?"))[:10], doc.get("commit", "unknown"),
        "" if doc.get("complete", True) else " (incomplete: stopped by a time limit)")


def print_timelines(doc, rows, spec, no_header):
    """Each row's timeline (rows without one are skipped), under a line naming the row."""
    timed = [r for r in rows if r.get("timeline")]
    if not timed:
        raise SystemExit("bench_table.py: no selected row has a timeline (run the bench with "
                         "--timeline)")
    keys = [item.partition("=")[0] for item in spec.split(",")]
    out = []
    if not no_header:
        out.append(header(doc, doc.get("benchmark", "?")))
        out.append("")
    for r in timed:
        label = ", ".join("%s %s" % (k, cell(k, r[k])) for k in keys
                          if isinstance(r.get(k), (int, str, bool)) and k != "check")
        out.append("%s: %s us" % (label, cell("median_us", r.get("median_us"))))
        out.append("")
        out.append("| " + " | ".join(h for _, h in TIMELINE_COLUMNS) + " |")
        out.append("|" + "---|" * len(TIMELINE_COLUMNS))
        for t in r["timeline"]:
            values = []
            for k, _ in TIMELINE_COLUMNS:
                v = t.get(k)
                if k == "reached" and "units" in t:
                    values.append("%s/%s" % (v, t["units"]))
                elif isinstance(v, float):
                    values.append("%.2f" % v)
                else:
                    values.append("-" if v is None else str(v).replace("|", "\\|"))
            out.append("| " + " | ".join(values) + " |")
        out.append("")
    sys.stdout.write("\n".join(out))
    return 0


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", help="a result file written by `m3msa bench NAME --json FILE`")
    parser.add_argument("--columns", help="comma list of row keys (key=Heading renames one)")
    parser.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                        help="keep rows whose KEY prints as VALUE (repeatable)")
    parser.add_argument("--no-header", action="store_true",
                        help="only the table, without the command / card / date / commit line")
    parser.add_argument("--timeline", action="store_true",
                        help="print each selected row's stage timeline instead of the table")
    args = parser.parse_args(argv)

    with open(args.file, encoding="utf-8") as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or "rows" not in doc:
        raise SystemExit("bench_table.py: %s is not a result file (no \"rows\")" % args.file)
    benchmark = doc.get("benchmark", "?")
    rows = [r for r in doc["rows"] if matches(r, parse_where(args.where))]

    spec = args.columns or DEFAULT_COLUMNS.get(benchmark)
    if spec is None:
        spec = ",".join(k for k, v in (rows[0].items() if rows else [])
                        if not isinstance(v, (dict, list)))
    columns = []
    for item in spec.split(","):
        key, _, heading = item.partition("=")
        if any(key in r for r in rows):
            columns.append((key, heading or HEADINGS.get(key, key)))

    if args.timeline:
        return print_timelines(doc, rows, spec, args.no_header)

    out = []
    if not args.no_header:
        out.append(header(doc, benchmark))
        out.append("")
    out.append("| " + " | ".join(h for _, h in columns) + " |")
    out.append("|" + "---|" * len(columns))
    for r in rows:
        out.append("| " + " | ".join(cell(k, r.get(k)) for k, _ in columns) + " |")
    sys.stdout.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
