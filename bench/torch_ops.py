#!/usr/bin/env python3
"""The cost of the torch entry points: one decode step's indexer + attention (M3 TP 1 shapes: 4
index heads x 128, top-16 of 128-token blocks, 64 q / 4 KV heads x 128, bf16) captured into a
CUDA graph three ways, each replayed and timed:

  raw     the m3msa Python calls with a CudaPlan (select_topk, sparse_attention)
  op      torch.ops.m3msa.index_decode + sparse_attn_decode (m3msa.torch: plan cached per shape)
  vllm    m3msa.vllm.minimax_m3_index_decode + minimax_m3_sparse_attn_decode on vLLM's layouts
          (a head-major selection buffer of larger capacity, the cache [blocks, 2, 128, KVH, HD])

For each: the median replay time of the graph (CUDA events around --reps replays, after warm-up;
inputs not rotated), the kernel / copy / memset nodes in the captured graph (the op and vllm
graphs should hold exactly raw's kernels: no extra launches, no copies), and the byte floor of the
step (index cache + the selected KV blocks, over 4.57 TB/s). A path the library refuses is
recorded with the error (say, vLLM's cache layout on a CUDA attention that reads the packed
layout only).

Writes {"results": [{batch, context, path, median_us | null, kernels, copies, memsets, floor_us,
note}]} to --json and a table to stdout.

Usage: PYTHONPATH=<build>/python python3 bench/torch_ops.py --json out.json [--quick] [--reps N]
"""

import argparse
import json
import math
import os
import re
import statistics
import tempfile

import torch

import m3msa
import m3msa.torch  # noqa: F401  (registers torch.ops.m3msa)
import m3msa.vllm as mvllm

BLOCK, DIM, HEADS, TOPK, Q_HEADS = 128, 128, 4, 16, 64
PEAK_BYTES_PER_S = 4.57e12


def make_step(batch, context, gen):
    nb = -(-context // BLOCK)
    pages = batch * nb
    dev = "cuda"

    def rand(*shape):
        return (torch.rand(*shape, device=dev, generator=gen) * 2 - 1).to(torch.bfloat16)

    s = {}
    s["index_cache"] = rand(pages, BLOCK, DIM)
    s["kv_ours"] = rand(pages, HEADS, 2, BLOCK, DIM)
    s["kv_vllm"] = s["kv_ours"].permute(0, 2, 3, 1, 4).contiguous()
    s["table"] = torch.randperm(pages, device=dev, generator=gen).view(batch, nb).to(torch.int32)
    s["seq_lens"] = torch.full((batch,), context, dtype=torch.int32, device=dev)
    s["index_q"] = rand(batch, HEADS, DIM)
    s["q"] = rand(batch, Q_HEADS, DIM)
    s["topk"] = torch.empty((batch, HEADS, TOPK), dtype=torch.int32, device=dev)
    s["topk_hm"] = torch.empty((HEADS, batch + 8, TOPK), dtype=torch.int32, device=dev)
    s["out"] = torch.empty_like(s["q"])
    return s


def floor_us(batch, context):
    index_bytes = context * DIM * 2
    kv_bytes = min(context, TOPK * BLOCK) * HEADS * 2 * DIM * 2
    return batch * (index_bytes + kv_bytes) / PEAK_BYTES_PER_S * 1e6


def paths(s, cfg, plan):
    batch = m3msa.Batch.decode(s["seq_lens"], s["table"], s["table"])

    def raw():
        m3msa.select_topk(cfg, s["index_q"], s["index_cache"], batch, s["topk"], plan=plan)
        m3msa.sparse_attention(cfg, s["q"], s["kv_ours"], batch, s["topk"], s["out"], plan=plan)

    def op():
        torch.ops.m3msa.index_decode(s["index_q"], s["index_cache"], s["table"], s["seq_lens"],
                                     1, TOPK, 0, 1, False, False, s["topk"])
        torch.ops.m3msa.sparse_attn_decode(s["q"], s["kv_ours"], "ours", s["topk"], s["table"],
                                           s["seq_lens"], 1, 1.0, 1.0, s["out"])

    def vllm():
        topk = mvllm.minimax_m3_index_decode(s["index_q"], s["index_cache"], s["table"],
                                             s["seq_lens"], 0, TOPK, 0, 1, HEADS, 1, 1,
                                             out=s["topk_hm"])
        mvllm.minimax_m3_sparse_attn_decode(s["q"], s["kv_vllm"], topk, s["table"],
                                            s["seq_lens"], HEADS, 1 / math.sqrt(DIM), s["out"], 1)

    return {"raw": raw, "op": op, "vllm": vllm}


def graph_nodes(graph_fn):
    """(kernels, copies, memsets) of a freshly captured graph of graph_fn, from its DOT dump."""
    try:  # torch >= 2.6 drops the captured graph at instantiation unless asked to keep it
        graph = torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        graph = torch.cuda.CUDAGraph()
    if not hasattr(graph, "enable_debug_mode"):
        return None, None, None
    graph.enable_debug_mode()
    with torch.cuda.graph(graph):
        graph_fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "graph.dot")
        graph.debug_dump(path)
        if not os.path.exists(path):  # this torch wrote no dump: the counts stay unknown
            return None, None, None
        text = open(path).read()
    kinds = re.findall(r'label="\{?\s*(\w+)', text)
    return (sum(k == "KERNEL" for k in kinds), sum(k == "MEMCPY" for k in kinds),
            sum(k == "MEMSET" for k in kinds))


def time_graph(fn, reps):
    fn()  # eager first: creates any plan outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    cfg = m3msa.SparseConfig()
    gen = torch.Generator(device="cuda").manual_seed(1)
    grid = [(1, 4096), (32, 32768)] if args.quick else \
        [(b, c) for b in (1, 8, 32) for c in (4096, 32768, 131072)]
    results = []
    print(f"{'batch':>5} {'context':>7} {'path':>5} {'us':>9} {'floor':>7} "
          f"{'kernels':>7} {'copies':>6} {'memsets':>7}  note")
    for batch_size, context in grid:
        s = make_step(batch_size, context, gen)
        plan = m3msa.CudaPlan(cfg, max_reqs=batch_size, max_q_len=1)
        for name, fn in paths(s, cfg, plan).items():
            row = {"batch": batch_size, "context": context, "path": name, "median_us": None,
                   "kernels": None, "copies": None, "memsets": None,
                   "floor_us": floor_us(batch_size, context), "note": ""}
            try:
                row["median_us"] = time_graph(fn, args.reps)
                row["kernels"], row["copies"], row["memsets"] = graph_nodes(fn)
            except m3msa.Error as error:
                row["note"] = f"{type(error).__name__}: {error.message}"
            results.append(row)
            us = "-" if row["median_us"] is None else f"{row['median_us']:.2f}"
            print(f"{batch_size:>5} {context:>7} {name:>5} {us:>9} {row['floor_us']:>7.2f} "
                  f"{str(row['kernels']):>7} {str(row['copies']):>6} {str(row['memsets']):>7}  "
                  f"{row['note']}", flush=True)
            with open(args.json, "w") as f:
                json.dump({"results": results, "torch": torch.__version__,
                           "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
