#!/usr/bin/env python3
"""PyTorch eager baseline of the decode indexer (docs/spec.md section 4) for `m3msa bench indexer`.

The same maths as the CUDA kernels, written the natural PyTorch way: gather each request's
index-K pages through its block table, one batched matmul of the (row, head) queries against every
token (bf16 inputs, fp32 accumulation inside cuBLAS, bf16 output), mask the tokens after each
row's position, max per 128-token block, force the row's own block, top-k, -1 where a row sees
fewer than k blocks. (Ties are not broken by block id and the scores are rounded to bf16, so the
selection can differ from the spec's in near-ties: this is a timing baseline, not an oracle.)

Timing: CUDA events around one call, after warm-up; the median of --reps calls. Inputs are not
rotated (PyTorch's overheads dominate the small cases, and L2 hits only flatter the baseline).
Writes {"results": [{batch, context, dtype, q_len, median_us | null, note}]} to --json.

Usage: python3 bench/torch_indexer.py --json out.json [--quick] [--max-tokens N]
"""

import argparse
import json
import statistics
import sys
import time

import torch

BLOCK = 128
DIM = 128
HEADS = 4
TOPK = 16


def make_inputs(batch, context, dtype, q_len, device, gen):
    nb = (context + BLOCK - 1) // BLOCK
    pages = batch * nb
    cache = (torch.rand(pages, BLOCK, DIM, device=device, generator=gen) * 2 - 1) * 1.7320508
    if dtype == "fp8":
        cache = cache.to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        cache = cache.to(torch.bfloat16)
    table = torch.randperm(pages, device=device, generator=gen).view(batch, nb).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    index_q = ((torch.rand(batch * q_len, HEADS, DIM, device=device, generator=gen) * 2 - 1)
               * 1.7320508).to(torch.bfloat16)
    return cache, table, seq_lens, index_q


def indexer(index_q, cache, table, seq_lens, q_len, fp8, k=TOPK):
    batch, nb = table.shape
    device = index_q.device
    keys = cache[table.long()]  # [B, nb, 128, D]
    if fp8:
        keys = keys.view(torch.float8_e4m3fn).to(torch.bfloat16)
    keys = keys.view(batch, nb * BLOCK, DIM)
    q = index_q.view(batch, q_len * HEADS, DIM)
    scores = torch.bmm(q, keys.transpose(1, 2)).float()  # [B, q*H, T]
    pos = (seq_lens.view(batch, 1) - q_len
           + torch.arange(q_len, device=device, dtype=torch.int32).view(1, q_len))  # [B, q]
    tokens = torch.arange(nb * BLOCK, device=device, dtype=torch.int32)
    hidden = tokens.view(1, 1, -1) > pos.view(batch, q_len, 1)  # [B, q, T]
    scores = scores.view(batch, q_len, HEADS, -1).masked_fill(hidden.unsqueeze(2), float("-inf"))
    block_scores = scores.view(batch, q_len, HEADS, nb, BLOCK).amax(-1)  # [B, q, H, nb]
    own = (torch.arange(nb, device=device).view(1, 1, -1)
           == (pos // BLOCK).unsqueeze(-1))  # [B, q, nb]
    block_scores = block_scores.masked_fill(own.unsqueeze(2), float("inf"))
    take = min(k, nb)
    values, idx = block_scores.topk(take, dim=-1)
    idx = torch.where(values == float("-inf"), torch.full_like(idx, -1), idx)
    if take < k:
        idx = torch.nn.functional.pad(idx, (0, k - take), value=-1)
    return idx.to(torch.int32)


def time_config(batch, context, dtype, q_len, reps, device):
    gen = torch.Generator(device=device)
    gen.manual_seed(batch * 1000003 + context)
    cache, table, seq_lens, index_q = make_inputs(batch, context, dtype, q_len, device, gen)
    fp8 = dtype == "fp8"
    for _ in range(2):
        indexer(index_q, cache, table, seq_lens, q_len, fp8)
    torch.cuda.synchronize()
    times = []
    budget = time.monotonic() + 3.0
    for i in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        indexer(index_q, cache, table, seq_lens, q_len, fp8)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000.0)
        if i >= 4 and time.monotonic() > budget:
            break
    del cache, table, seq_lens, index_q
    torch.cuda.empty_cache()
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--batches", default="1,4,32,128")
    parser.add_argument("--contexts", default="4096,32768,131072,524288,1048576")
    parser.add_argument("--dtypes", default="bf16,fp8")
    parser.add_argument("--q-lens", default="1,4")
    parser.add_argument("--quick", action="store_true", help="batches 1,32 x contexts 4K,128K")
    parser.add_argument("--max-tokens", type=int, default=16 << 20,
                        help="skip configurations with more batch x context tokens")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    if args.quick:
        batches, contexts = [1, 32], [4096, 131072]
    device = torch.device("cuda")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(device)}", flush=True)
    results = []
    for dtype in args.dtypes.split(","):
        for q_len in [int(x) for x in args.q_lens.split(",")]:
            for batch in batches:
                for context in contexts:
                    record = {"batch": batch, "context": context, "dtype": dtype,
                              "q_len": q_len, "median_us": None, "note": ""}
                    if batch * context > args.max_tokens:
                        record["note"] = f"skipped: more than {args.max_tokens} tokens"
                    else:
                        try:
                            record["median_us"] = time_config(batch, context, dtype, q_len,
                                                              args.reps, device)
                        except torch.cuda.OutOfMemoryError:
                            record["note"] = "out of memory"
                            torch.cuda.empty_cache()
                    results.append(record)
                    us = record["median_us"]
                    print(f"batch {batch:4d} context {context:8d} {dtype:4s} q {q_len}: "
                          + (f"{us:10.1f} us" if us is not None else record["note"]), flush=True)
    with open(args.json, "w") as out:
        json.dump({"benchmark": "torch_indexer", "torch": torch.__version__,
                   "device": torch.cuda.get_device_name(device), "results": results}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
