"""Shared set-up of the CUDA suites (test_cuda_*.py): the skip rule, host <-> torch conversions,
and the two comparisons the C++ GPU tests use (tests/cuda/indexer_test_util.h and
attention_test_util.h): the near-tie rule of docs/spec.md section 4 for selections and the bf16
tolerance for attention. Everything is compared with the CPU reference backend of the same build."""

import os
import unittest

import numpy as np

import m3msa
import oracle
from common import THREADS, TestCase

try:
    import torch
except ImportError:  # CI has no torch: every CUDA suite skips
    torch = None


def skip_reason():
    """Why the CUDA suites cannot run here, or None."""
    if torch is None:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    info = m3msa.info()
    if not info["built_with_cuda"]:
        return "this m3msa module was built without CUDA"
    if not info["cuda_backend"]:
        return "the m3msa CUDA backend sees no device"
    return None


# M3MSA_REQUIRE_CUDA=1 (the GPU machine's step, scripts/gpu_steps/python-gpu.sh): a suite that
# cannot run fails instead of skipping, so a broken build or a missing GPU cannot pass as "OK".
REQUIRED = os.environ.get("M3MSA_REQUIRE_CUDA") == "1"


def requires_cuda(cls):
    reason = skip_reason()
    if reason is None:
        return cls
    if REQUIRED:
        def refuse(_):
            raise AssertionError(f"M3MSA_REQUIRE_CUDA=1 but {reason}")

        cls.setUpClass = classmethod(refuse)
        return cls
    return unittest.skip(reason)(cls)


# The CUDA kernels need head_dim = index_dim = block_size = 128 and <= 16 query heads per KV head;
# two KV heads of 8 query heads and a top-8 keep the CPU oracle quick while every rule matters.
GPU = dict(q_heads=16, kv_heads=2, index_heads=2, topk=8)


def gpu_config(**overrides):
    return m3msa.SparseConfig(**{**GPU, **overrides})


# Near-tie rule (tests/cuda/indexer_test_util.h): the GPU sums a token's 128 products in
# tensor-core order, the CPU in dimension order, so blocks whose scores differ by a few fp32
# roundings may swap across the k-th place; such a swap is accepted when both blocks' CPU scores
# are within this relative distance of the CPU's k-th selected score.
TIE_TOLERANCE = 1e-3


def to_torch(value, device="cuda"):
    """A NumPy array or m3msa.view on the GPU as torch: bf16 bits -> torch.bfloat16, fp8 bits ->
    torch.float8_e4m3fn, other arrays keep their dtype. None stays None."""
    if value is None:
        return None
    if isinstance(value, m3msa.TypedView):
        bits = np.ascontiguousarray(value.array)
        if value.dtype == "bf16":  # through int16: torch's uint16 support is partial
            return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(device)
        if value.dtype == "fp8_e4m3":
            return torch.from_numpy(bits.view(np.uint8)).view(torch.float8_e4m3fn).to(device)
        raise AssertionError(f"no torch dtype for {value.dtype}")
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return torch.from_numpy(np.ascontiguousarray(value)).to(device)


def to_numpy_bits(tensor):
    """A torch tensor back on the host: bf16 -> uint16 bits, fp8 -> uint8 bits, else as is."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor.view(torch.uint8).numpy()
    return tensor.numpy()


def batch_to(batch, device="cuda"):
    """The same m3msa.Batch with every metadata array on `device`."""
    fields = {name: to_torch(getattr(batch, name), device) for name in m3msa.Batch.__slots__[4:]}
    return m3msa.Batch(batch.kind, batch.num_reqs, q_len=batch.q_len,
                       num_tokens=batch.num_tokens, **fields)


class GpuCase:
    """A synthetic case (the C++ generator) on the host and on the GPU."""

    def __init__(self, cfg, **spec):
        self.cfg = cfg
        self.host = m3msa.synthetic_case(cfg, **spec)
        h = self.host
        self.batch = batch_to(h.batch)
        self.index_q, self.q = to_torch(h.index_q), to_torch(h.q)
        self.index_cache, self.kv_cache = to_torch(h.index_cache), to_torch(h.kv_cache)
        self.k_scale, self.v_scale = h.k_scale, h.v_scale
        self.rows = oracle.row_positions(h.batch)


class CudaTestCase(TestCase):
    def cpu_selection(self, case):
        h = case.host
        topk = m3msa.select_topk(case.cfg, h.index_q, h.index_cache, h.batch, threads=THREADS)
        scores = m3msa.score_blocks(case.cfg, h.index_q, h.index_cache, h.batch, threads=THREADS)
        return topk, scores

    def assertSelectionNearTie(self, case, gpu, cpu, scores):
        """GPU vs CPU selections under the near-tie rule; returns the number of accepted swaps."""
        cfg = case.cfg
        k, bs = cfg.topk, cfg.block_size
        gpu = np.asarray(gpu)
        self.assertEqual(gpu.shape, cpu.shape)
        swaps = 0

        def forced(b, nb):
            return b < cfg.init_blocks or b >= nb - cfg.local_blocks

        for row, (_, pos) in enumerate(case.rows):
            nb = pos // bs + 1 if pos >= 0 else 0
            expect = min(k, nb)
            for h in range(cfg.index_heads):
                g, r, s = gpu[row, h], cpu[row, h], scores[row, h]
                where = f"row {row} (pos {pos}, nb {nb}) head {h}"
                self.assertTrue((g[expect:] == -1).all(), f"{where}: {g} has > {expect} entries")
                valid = g[:expect]
                self.assertTrue(((valid >= 0) & (valid < nb)).all() and
                                len(set(valid.tolist())) == expect,
                                f"{where}: {g} is not {expect} distinct block ids in [0, nb)")
                for b in range(nb):
                    if forced(b, nb):
                        self.assertIn(b, valid, f"{where}: forced block {b} missing from {g}")
                scored = [b for b in r[:expect] if not forced(b, nb)]
                if not scored:
                    self.assertEqual(set(valid.tolist()), set(r[:expect].tolist()), where)
                    continue
                kth = float(s[scored[-1]])
                for b in set(valid.tolist()) ^ set(r[:expect].tolist()):
                    gap = abs(float(s[b]) - kth) / max(1.0, abs(kth))
                    self.assertLessEqual(gap, TIE_TOLERANCE,
                                         f"{where}: block {b} (CPU score {s[b]}) differs between "
                                         f"GPU {g} and CPU {r}; k-th score {kth}")
                    swaps += 1
                # Forced blocks first, then non-increasing CPU score (up to the tolerance).
                flags = [forced(b, nb) for b in valid]
                self.assertEqual(flags, sorted(flags, reverse=True),
                                 f"{where}: a forced block follows a scored one in {g}")
                ordered = [float(s[b]) for b in valid if not forced(b, nb)]
                for a, b in zip(ordered, ordered[1:]):
                    self.assertGreaterEqual(a, b - TIE_TOLERANCE * max(1.0, abs(b)),
                                            f"{where}: {g} out of score order")
        return swaps

    def assertAttentionClose(self, gpu_bits, cpu_bits, ulps=2.0, floor_fraction=0.25):
        """|gpu - ref| <= ulps * ulp_bf16(max(|ref|, m / 4)) with m the largest |ref| of the same
        (row, head) vector (tests/cuda/attention_test_util.h)."""
        gpu = oracle.bf16_decode(np.asarray(gpu_bits)).astype(np.float64)
        ref = oracle.bf16_decode(np.asarray(cpu_bits)).astype(np.float64)
        self.assertEqual(gpu.shape, ref.shape)
        vec_max = np.abs(ref).max(axis=-1, keepdims=True)
        magnitude = np.maximum(np.abs(ref), floor_fraction * vec_max)
        _, exponent = np.frexp(magnitude)
        ulp = np.where(magnitude < 1e-30, 2.0 ** -133, np.ldexp(1.0, exponent - 8))
        diff = np.where(np.isnan(gpu) & np.isnan(ref), 0.0, np.abs(gpu - ref))
        ratio = np.where(np.isnan(diff), np.inf, diff / (ulps * ulp))
        if not (ratio <= 1.0).all():
            worst = np.unravel_index(np.argmax(np.nan_to_num(ratio, nan=np.inf)), ratio.shape)
            self.fail(f"{int((ratio > 1).sum())} attention elements outside {ulps} bf16 ulps; "
                      f"worst at {worst}: gpu {gpu[worst]} ref {ref[worst]} "
                      f"(ratio {ratio[worst]:.2f})")

    def assertBitsNear(self, gpu_bits, cpu_bits, what, max_fraction=1e-4):
        """Bit-exact up to one code (one bf16 ulp / one fp8 step) on at most max_fraction of the
        elements (the preprocessing kernel's cos/sin come from CUDA's libm)."""
        gpu, ref = np.asarray(gpu_bits), np.asarray(cpu_bits)
        self.assertEqual((gpu.shape, gpu.dtype), (ref.shape, ref.dtype), what)
        signed = {1: np.int8, 2: np.int16}[gpu.dtype.itemsize]
        top = 1 << (8 * gpu.dtype.itemsize - 1)

        def ordered(bits):  # sign-magnitude codes -> integers that count codes apart
            b = bits.view(signed).astype(np.int64)
            return np.where(b < 0, -(b & (top - 1)), b)

        distance = np.abs(ordered(gpu) - ordered(ref))
        differ = int((distance > 0).sum())
        self.assertLessEqual(int(distance.max(initial=0)), 1,
                             f"{what}: element {np.unravel_index(np.argmax(distance), gpu.shape)} "
                             f"is {int(distance.max())} codes off")
        self.assertLessEqual(differ, max_fraction * distance.size + 0.5,
                             f"{what}: {differ} of {distance.size} elements differ by one code")
