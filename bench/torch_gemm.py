#!/usr/bin/env python3
"""Vendor-library baseline (cuBLAS / cuBLASLt through PyTorch) of `m3msa bench gemm`.

The same problems as the runtime's skinny projection GEMM: out[r, n] = x[r, :] . w[n, :] at M3's
projection shapes (per TP rank: qkv_proj [qkv_width, 6144] and o_proj [6144, 64 / tp * 128] at
TP 1 and 2, qkv_width as ModelConfig{}.sparse(tp).qkv_width() in src/core/config.cc), rows
1..16, output bf16:

- bf16 weights: torch.nn.functional.linear(x, w), run once with each BLAS library torch can
  prefer (torch.backends.cuda.preferred_blas_library: "cublas" and "cublaslt"; --blas picks); the
  faster one is median_us, both are recorded.
- fp8 e4m3 weights with per-output-channel f32 scales: torch._scaled_mm(x_fp8, w_fp8.t(),
  scale_a, scale_b, out_dtype=bf16) with the activations quantized per tensor (amax / 448, outside
  the timing unless --include-quant) and the weight scales per channel ("rowwise" /
  outer-vector scaling: scale_a [rows, 1] all equal, scale_b [1, n]). Where this torch build
  refuses rowwise scaling, per-tensor scales on both ("tensorwise", a lighter epilogue than the
  runtime's) are timed instead and the record says so; where it has no fp8 at all, fp8 is skipped
  with the reason. Rows it refuses below 16 are padded to 16 (op gets "pad16"). Per-tensor
  scaling is timed as an extra figure (tensorwise_us) next to rowwise.

Timing, as the C++ harness (bench/harness.h): `copies` weight copies (each with its own x and
scales) together more than --rotate-bytes (4 x the 60 MB L2), one torch.cuda CUDA graph of
`launches` (a multiple of copies, >= --min-launches) back-to-back calls cycling through them,
replayed after 2 warm-ups; one call = replay time / launches; median over replays, noise =
(p90 - p10) / median. The kernels that ran are listed once per configuration (torch.profiler;
--no-profile skips it) and a subset of outputs is checked against a float64 reference of the
same (quantized) inputs.

Writes {"results": [{shape, tp, n, k, rows, dtype, op, median_us | null, ...}], ...} to --json.

Usage: python3 bench/torch_gemm.py --json out.json [--quick] [--rows 1,16] [--dtypes bf16,fp8]
"""

import argparse
import json
import math
import statistics
import sys
import time

L2_BYTES = 60 << 20
FP8_MAX = 448.0

# ModelConfig{} defaults (include/m3msa/config.h).
HIDDEN = 6144
Q_HEADS = 64
KV_HEADS = 4
HEAD_DIM = 128
INDEX_HEADS = 4
INDEX_DIM = 128


def m3_shapes():
    """(name, tp, n, k) per TP rank, as bench/gemm_bench.cc computes them from ModelConfig{}."""
    out = []
    for tp in (1, 2):
        q = Q_HEADS // tp
        kv = KV_HEADS // tp if tp <= KV_HEADS else 1
        ih = INDEX_HEADS // tp if tp <= INDEX_HEADS else 1
        qkv_width = q * HEAD_DIM + 2 * kv * HEAD_DIM + ih * INDEX_DIM + INDEX_DIM
        out.append((f"qkv_tp{tp}", tp, qkv_width, HIDDEN))
        out.append((f"o_tp{tp}", tp, HIDDEN, q * HEAD_DIM))
    return out


def plan_copies(weight_bytes, rotate_bytes, max_copies, min_launches):
    copies = max(1, min(max_copies, rotate_bytes // weight_bytes + 1))
    launches = copies * ((min_launches + copies - 1) // copies)
    return copies, launches


def check_columns(n, count):
    cols = {0, n - 1}
    span = max(1, n // max(count, 1))
    for i in range(count):
        cols.add(min(n - 1, i * n // max(count, 1) + (i * 7919 + 3) % span))
    return sorted(cols)


def as_double(torch, t, idx=None):
    """t (or its rows idx) as float64; fp8 goes through uint8 views and float32, which every
    torch with fp8 supports (index_select / float64 casts of fp8 may not be)."""
    if t.dtype in (getattr(torch, "float8_e4m3fn", None),):
        if idx is not None:
            t = t.view(torch.uint8).index_select(0, idx).view(t.dtype)
        return t.float().double()
    return (t.index_select(0, idx) if idx is not None else t).double()


def check_outputs(torch, out, x, w, w_scale, cols, loose):
    """max |got - ref| / tol over out[:, cols] (float64 reference of the same inputs).

    x: [rows, k] (bf16, or fp8 already multiplied back by its scale as float64), w: [n, k].
    tol = c * sum|x w| * scale + |ref| / 256 with c = 4e-6 (bf16 operands, fp32 accumulation) or
    1e-4 with `loose` (fp8 tensor-core accumulation is not full fp32 on every part).
    """
    idx = torch.tensor(cols, device=out.device, dtype=torch.long)
    xd = as_double(torch, x)
    wd = as_double(torch, w, idx)
    sc = as_double(torch, w_scale, idx) if w_scale is not None else None
    ref = xd @ wd.t()
    mag = xd.abs() @ wd.abs().t()
    if sc is not None:
        ref = ref * sc
        mag = mag * sc
    got = out[: x.shape[0]].index_select(1, idx).double()
    tol = (1e-4 if loose else 4e-6) * mag + ref.abs() / 256.0 + 1e-30
    ratio = ((got - ref).abs() / tol)
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    return float(ratio.max())


def rel_rms_error(torch, out, x, w, w_scale, cols):
    """||got - ref|| / ||ref|| over out[:, cols], ref = float64 x @ (w * scale)^T."""
    idx = torch.tensor(cols, device=out.device, dtype=torch.long)
    ref = (as_double(torch, x) @ as_double(torch, w, idx).t()) * as_double(torch, w_scale, idx)
    got = out[: x.shape[0]].index_select(1, idx).double()
    return float((got - ref).norm() / ref.norm().clamp(min=1e-300))


def kernel_names(torch, fn):
    """Names of the GPU kernels one call runs (torch.profiler), or a note why not."""
    try:
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = []
        for evt in prof.key_averages():
            key = evt.key
            if key and not key.startswith(("cudaLaunch", "cudaDevice", "cudaStream", "Memcpy",
                                           "Memset", "aten::", "cuda", "Activity")) and key not in names:
                if getattr(evt, "device_type", None) is not None and "CUDA" not in str(
                        evt.device_type):
                    continue
                names.append(key)
        return names
    except Exception as e:  # profiling is informative only
        return [f"(profiler unavailable: {str(e).splitlines()[0] if str(e) else type(e).__name__})"]


def library_of(names):
    text = " ".join(names).lower()
    libs = []
    if "cutlass" in text or "f8f8bf16" in text:
        libs.append("CUTLASS")
    if any(s in text for s in ("nvjet", "xmma", "gemv", "cublas", "gemmk", "splitk", "sm90_",
                               "ampere_", "sm80_")):
        libs.append("cuBLAS(Lt)")
    return "+".join(libs) if libs else "?"


def time_graph(torch, calls, launches, reps, budget_s=0.5):
    """Median / p10 / p90 us per call of a CUDA graph of `launches` calls (calls[i % copies])."""
    copies = len(calls)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (workspaces, heuristics)
        for c in range(copies):
            calls[c]()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        keep = [calls[i % copies]() for i in range(launches)]
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    per_call = []
    spent = 0.0
    for i in range(reps):
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        ms = start.elapsed_time(stop)
        per_call.append(ms * 1000.0 / launches)
        spent += ms / 1000.0
        if i >= 4 and spent > budget_s:
            break
    del keep, graph
    qs = sorted(per_call)

    def pct(q):
        pos = q * (len(qs) - 1)
        lo = int(math.floor(pos))
        hi = min(len(qs) - 1, lo + 1)
        return qs[lo] + (qs[hi] - qs[lo]) * (pos - lo)

    med = statistics.median(qs)
    return {"median_us": med, "p10_us": pct(0.1), "p90_us": pct(0.9),
            "noise": (pct(0.9) - pct(0.1)) / med if med > 0 else 0.0, "reps": len(qs)}


def uniform(torch, shape, gen, device):
    """Unit-variance uniform values in [-sqrt 3, sqrt 3], as the C++ benchmarks draw them."""
    return (torch.rand(*shape, device=device, generator=gen) * 2 - 1) * 1.7320508075688772


class Fp8Support:
    """What this torch build's _scaled_mm takes, probed once on a small problem."""

    def __init__(self, torch, device):
        self.rowwise = False
        self.tensorwise = False
        self.reason = ""
        if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
            self.reason = "this torch has no torch.float8_e4m3fn / torch._scaled_mm"
            return
        try:
            cap = torch.cuda.get_device_capability(device)
            a = torch.ones(16, 64, device=device).to(torch.float8_e4m3fn)
            b = torch.ones(32, 64, device=device).to(torch.float8_e4m3fn)
        except Exception as e:
            self.reason = "fp8 tensors unusable: " + first_line(e)
            return
        if cap < (8, 9):
            self.reason = f"compute capability {cap[0]}.{cap[1]} has no fp8 tensor cores"
            return
        errors = []
        try:
            torch._scaled_mm(a, b.t(), scale_a=torch.ones(16, 1, device=device),
                             scale_b=torch.ones(1, 32, device=device), out_dtype=torch.bfloat16)
            self.rowwise = True
        except Exception as e:
            errors.append("rowwise: " + first_line(e))
        try:
            one = torch.ones((), device=device)
            torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            self.tensorwise = True
        except Exception as e:
            errors.append("tensorwise: " + first_line(e))
        self.reason = "; ".join(errors)

    def describe(self):
        if self.rowwise:
            return "rowwise (per-channel weight scales)" + (
                ", tensorwise" if self.tensorwise else "")
        if self.tensorwise:
            return "tensorwise only (rowwise refused: " + self.reason + ")"
        return "none (" + self.reason + ")"


def first_line(e):
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def scaled_mm_call(torch, xq, w, scale_a, scale_b, pad_to):
    """A _scaled_mm closure; with pad_to, x is padded with zero rows (and its scale rows)."""
    if pad_to and xq.shape[0] < pad_to:
        xp = torch.zeros(pad_to, xq.shape[1], device=xq.device, dtype=torch.uint8).view(
            torch.float8_e4m3fn)
        xp[: xq.shape[0]] = xq
        xq = xp
        if scale_a.dim() == 2:
            scale_a = scale_a[:1].expand(pad_to, 1).contiguous()
    wt = w.t()
    return lambda: torch._scaled_mm(xq, wt, scale_a=scale_a, scale_b=scale_b,
                                    out_dtype=torch.bfloat16)


def quantize_per_tensor(torch, x):
    scale = (x.float().abs().amax() / FP8_MAX).clamp(min=1e-12)
    return (x.float() / scale).to(torch.float8_e4m3fn), scale.reshape(())


def run_fp8(torch, args, fp8, shape, rows, device, gen, copies, launches, record):
    _, _, n, k = shape
    ws, scales, xs, xqs, sas = [], [], [], [], []
    for _ in range(copies):
        ws.append(uniform(torch, (n, k), gen, device).to(torch.float8_e4m3fn))
        scales.append(0.015 + 0.01 * torch.rand(n, device=device, generator=gen))
        x = uniform(torch, (rows, k), gen, device).to(torch.bfloat16)
        xq, sa = quantize_per_tensor(torch, x)
        xs.append(x)
        xqs.append(xq)
        sas.append(sa)

    def calls_for(mode, pad_to):
        calls = []
        for c in range(copies):
            if mode == "rowwise":
                sa = sas[c].reshape(1, 1).expand(rows, 1).contiguous()
                sb = scales[c].reshape(1, n).contiguous()
            else:  # one per-tensor weight scale (not the runtime's numerics; timing only)
                sa = sas[c]
                sb = scales[c][:1].reshape(()).contiguous()
            if args.include_quant:
                x = xs[c]

                def call(c=c, x=x, sb=sb):
                    xq, s = quantize_per_tensor(torch, x)
                    sa_ = s.reshape(1, 1).expand(rows, 1) if mode == "rowwise" else s
                    return scaled_mm_call(torch, xq, ws[c], sa_.contiguous(), sb, pad_to)()
                calls.append(call)
            else:
                calls.append(scaled_mm_call(torch, xqs[c], ws[c], sa, sb, pad_to))
        return calls

    def first_working(mode):
        for pad_to in (0, 16):
            if pad_to and rows >= pad_to:
                break
            try:
                calls = calls_for(mode, pad_to)
                calls[0]()
                torch.cuda.synchronize()
                return calls, pad_to, ""
            except Exception as e:
                err = first_line(e)
        return None, 0, err

    modes = []
    if fp8.rowwise:
        modes.append("rowwise")
    if fp8.tensorwise:
        modes.append("tensorwise")
    if not modes:
        record["note"] = "fp8 skipped: " + fp8.reason
        return
    notes = []
    for mode in modes:
        calls, pad_to, err = first_working(mode)
        if calls is None:
            notes.append(f"{mode} refused: {err}")
            continue
        timing = time_graph(torch, calls, launches, args.reps)
        op = "smm " + mode + (" pad16" if pad_to else "")
        if "op" not in record:  # the first mode that ran is the comparison (rowwise first)
            record.update(timing)
            record["op"] = op
            record["kernels"] = [] if args.no_profile else kernel_names(torch, calls[0])
            record["library"] = library_of(record["kernels"])
            out = calls[0]()
            xd = as_double(torch, xqs[0]) * sas[0].double()
            wsc = scales[0] if mode == "rowwise" else scales[0][:1].expand(n)
            worst = check_outputs(torch, out, xd, ws[0], wsc, check_columns(n, args.check_cols),
                                  loose=True)
            record["check"] = "ok" if worst <= 1.0 else f"off: max err / tol {worst:.3g}"
            record["worst_err_over_tol"] = worst
            # What the per-tensor fp8 activations cost in accuracy vs the bf16 x the runtime uses.
            record["rel_rms_err_vs_bf16_x"] = rel_rms_error(torch, out, xs[0], ws[0], wsc,
                                                            check_columns(n, args.check_cols))
            if mode != "rowwise":
                notes.append("per-channel (rowwise) weight scales refused by this torch: timed "
                             "with one per-tensor weight scale (a lighter epilogue)")
        record[f"{mode}_us"] = timing["median_us"]
        record[f"{mode}_op"] = op
    record["quant_in_timing"] = bool(args.include_quant)
    if notes:
        record["note"] = "; ".join(notes)


def run_bf16(torch, args, shape, rows, device, gen, copies, launches, record):
    _, _, n, k = shape
    ws = [uniform(torch, (n, k), gen, device).to(torch.bfloat16) for _ in range(copies)]
    xs = [uniform(torch, (rows, k), gen, device).to(torch.bfloat16) for _ in range(copies)]
    linear = torch.nn.functional.linear
    calls = [lambda c=c: linear(xs[c], ws[c]) for c in range(copies)]
    libs = ["cublas", "cublaslt"] if args.blas == "both" else [args.blas]
    prefer = getattr(torch.backends.cuda, "preferred_blas_library", None)
    previous = prefer() if prefer is not None else None
    best = None
    notes = []
    try:
        for lib in libs:
            if lib != "default":
                if prefer is None:
                    notes.append(f"{lib}: torch.backends.cuda.preferred_blas_library missing")
                    continue
                prefer(lib)
            try:
                timing = time_graph(torch, calls, launches, args.reps)
            except Exception as e:
                notes.append(f"{lib}: {first_line(e)}")
                continue
            kernels = [] if args.no_profile else kernel_names(torch, calls[0])
            record[f"{lib}_us"] = timing["median_us"]
            record[f"{lib}_kernels"] = kernels
            if best is None or timing["median_us"] < best[1]["median_us"]:
                best = (lib, timing, kernels)
    finally:
        if prefer is not None and previous is not None:
            prefer(previous)
    if best is None:
        record["note"] = "; ".join(notes) or "no BLAS library ran"
        return
    lib, timing, kernels = best
    record.update(timing)
    record["op"] = "linear" + ("" if lib == "default" else "/" + ("lt" if lib == "cublaslt"
                                                                   else "cublas"))
    record["kernels"] = kernels
    record["library"] = library_of(kernels)
    out = calls[0]()
    worst = check_outputs(torch, out, xs[0], ws[0], None, check_columns(n, args.check_cols),
                          loose=False)
    record["check"] = "ok" if worst <= 1.0 else f"off: max err / tol {worst:.3g}"
    record["worst_err_over_tol"] = worst
    if notes:
        record["note"] = "; ".join(notes)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    names = [s[0] for s in m3_shapes()]
    parser.add_argument("--json", required=True, help="write the results here")
    parser.add_argument("--shapes", default=",".join(names), help="projection shapes")
    parser.add_argument("--rows", default="1,2,4,8,16", help="token rows")
    parser.add_argument("--dtypes", default="bf16,fp8", help="weight dtypes")
    parser.add_argument("--quick", action="store_true", help="rows 1,16 only, at most 20 reps")
    parser.add_argument("--blas", default="both", choices=["both", "cublas", "cublaslt", "default"],
                        help="bf16: the BLAS library torch prefers (both: each, the faster counts)")
    parser.add_argument("--include-quant", action="store_true",
                        help="fp8: time the per-tensor activation quantization too")
    parser.add_argument("--reps", type=int, default=50, help="graph replays (at most)")
    parser.add_argument("--rotate-bytes", type=int, default=4 * L2_BYTES,
                        help="weight bytes one graph cycles through (more than this)")
    parser.add_argument("--max-copies", type=int, default=256, help="at most this many copies")
    parser.add_argument("--min-launches", type=int, default=64,
                        help="calls per graph, at least (a multiple of the copies)")
    parser.add_argument("--check-cols", type=int, default=128,
                        help="output columns checked against the float64 reference")
    parser.add_argument("--no-profile", action="store_true",
                        help="do not list the kernels that ran (torch.profiler)")
    parser.add_argument("--seed", type=int, default=1, help="random seed of the inputs")
    args = parser.parse_args()

    try:
        import torch
    except ImportError as e:
        print(f"torch_gemm.py: cannot import torch ({e}); this baseline needs PyTorch with CUDA",
              file=sys.stderr)
        return 2
    try:
        has_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception as e:
        has_gpu = False
        print(f"torch_gemm.py: CUDA unusable: {first_line(e)}", file=sys.stderr)
    if not has_gpu:
        print(f"torch_gemm.py: no CUDA GPU visible to torch {torch.__version__} "
              f"(built with CUDA {torch.version.cuda}); nothing measured", file=sys.stderr)
        return 2

    shapes = {s[0]: s for s in m3_shapes()}
    try:
        chosen = [shapes[s] for s in args.shapes.split(",")]
        rows_list = [int(r) for r in args.rows.split(",")]
    except (KeyError, ValueError) as e:
        print(f"torch_gemm.py: bad --shapes / --rows ({e}); shapes: {', '.join(shapes)}",
              file=sys.stderr)
        return 2
    dtypes = args.dtypes.split(",")
    if any(d not in ("bf16", "fp8") for d in dtypes) or any(r < 1 or r > 16 for r in rows_list):
        print("torch_gemm.py: --dtypes takes bf16, fp8; --rows 1..16", file=sys.stderr)
        return 2
    if args.quick:
        rows_list = [1, 16]
        args.reps = min(args.reps, 20)

    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    fp8 = Fp8Support(torch, device) if "fp8" in dtypes else None
    device_name = torch.cuda.get_device_name(device)
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {device_name}", flush=True)
    if fp8 is not None:
        print(f"fp8 _scaled_mm: {fp8.describe()}", flush=True)
    results = []
    doc = {"benchmark": "torch_gemm", "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": device_name, "fp8_support": fp8.describe() if fp8 else "not asked",
           "fp8_activations": "per-tensor amax / 448, "
                              + ("inside" if args.include_quant else "outside") + " the timing",
           "bf16_blas": args.blas,
           "bf16_reduced_precision_reduction":
               bool(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction),
           "results": results}
    gen = torch.Generator(device=device)
    for dtype in dtypes:
        for shape in chosen:
            for rows in rows_list:
                name, tp, n, k = shape
                w_bytes = n * k * (1 if dtype == "fp8" else 2) + (n * 4 if dtype == "fp8" else 0)
                copies, launches = plan_copies(w_bytes, args.rotate_bytes, args.max_copies,
                                               args.min_launches)
                record = {"shape": name, "tp": tp, "n": n, "k": k, "rows": rows, "dtype": dtype,
                          "median_us": None, "copies": copies, "launches": launches}
                gen.manual_seed(args.seed * 1000003 + n * 31 + k + rows)
                start = time.monotonic()
                try:
                    if dtype == "fp8":
                        run_fp8(torch, args, fp8, shape, rows, device, gen, copies, launches,
                                record)
                    else:
                        run_bf16(torch, args, shape, rows, device, gen, copies, launches, record)
                except torch.cuda.OutOfMemoryError:
                    record["note"] = "out of memory"
                except Exception as e:  # one configuration failing must not lose the others
                    record["note"] = f"failed: {type(e).__name__}: {first_line(e)}"
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                results.append(record)
                us = record["median_us"]
                line = (f"{name:8s} rows {rows:2d} {dtype:4s}: "
                        + (f"{us:9.2f} us  {record.get('op', '')}  [{record.get('check', '')}]"
                           f"  {record.get('library', '')}"
                           if us is not None else "-") +
                        (f"  ({record['note']})" if record.get("note") else "") +
                        f"  {time.monotonic() - start:.1f} s")
                print(line, flush=True)
                if record.get("kernels"):
                    print("    kernels: " + " | ".join(record["kernels"])[:400], flush=True)
                with open(args.json, "w") as out:  # after every configuration
                    json.dump(doc, out, indent=2)
    with open(args.json, "w") as out:
        json.dump(doc, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
