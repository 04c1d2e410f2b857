"""Zero-copy tensor exchange: DLPack capsules (legacy and versioned, from any producer), the
buffer-protocol fallback, the CUDA dispatch and stream hand-off, and the NumPy dtype helpers."""

import ctypes
import sys
import unittest

import numpy as np

import m3msa
import oracle
from common import TestCase, small_config

# ---- A DLPack producer written with ctypes, so the tests control every field ----


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


class DLManagedTensorVersioned(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
VERSIONED_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                            ("deleter", DELETER)]
DLManagedTensorVersioned._fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                                     ("manager_ctx", ctypes.c_void_p),
                                     ("deleter", VERSIONED_DELETER), ("flags", ctypes.c_uint64),
                                     ("dl_tensor", DLTensor)]

PyCapsule_New = ctypes.pythonapi.PyCapsule_New
PyCapsule_New.restype = ctypes.py_object
PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

KDL_CPU, KDL_CUDA, KDL_OPENCL = 1, 2, 4
CODES = {np.dtype(np.int32): (0, 32), np.dtype(np.uint16): (4, 16),  # bf16 as kDLBfloat
         np.dtype(np.uint8): (1, 8), np.dtype(np.float32): (2, 32), np.dtype(np.int64): (0, 64)}


class Producer:
    """An array exported through hand-built DLPack structs. device_type KDL_CUDA gives a fake GPU
    tensor (its pointer is never dereferenced: the call must fail at dispatch)."""

    def __init__(self, array, device_type=KDL_CPU, versioned=False, read_only=False):
        self.array = array  # keeps the memory alive
        self.device_type = device_type
        self.versioned = versioned
        self.deleted = 0
        self.streams = []
        self.shape = (ctypes.c_int64 * array.ndim)(*array.shape)
        code, bits = CODES[array.dtype]
        tensor = DLTensor(array.ctypes.data if device_type == KDL_CPU else 0x1000,
                          DLDevice(device_type, 0), array.ndim, DLDataType(code, bits, 1),
                          self.shape, None, 0)
        if versioned:
            self._deleter = VERSIONED_DELETER(self._delete)
            self.managed = DLManagedTensorVersioned(1, 0, None, self._deleter,
                                                    1 if read_only else 0, tensor)
            self.name = ctypes.create_string_buffer(b"dltensor_versioned")
        else:
            self._deleter = DELETER(self._delete)
            self.managed = DLManagedTensor(tensor, None, self._deleter)
            self.name = ctypes.create_string_buffer(b"dltensor")

    def _delete(self, _):
        self.deleted += 1

    def __dlpack_device__(self):
        return (self.device_type, 0)

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        return PyCapsule_New(ctypes.addressof(self.managed), self.name, None)


class InteropTest(TestCase):
    def setUp(self):
        self.cfg = small_config()
        self.c = oracle.make_case(self.cfg, np.random.default_rng(0), seq_lens=[300, 0, 17, 64],
                                  q_len=2)
        self.expected = m3msa.select_topk(self.cfg, self.c.index_q, self.c.index_cache,
                                          self.c.batch)

    def test_output_is_written_in_place(self):
        out = np.full_like(self.expected, 12345)
        got = m3msa.select_topk(self.cfg, self.c.index_q, self.c.index_cache, self.c.batch,
                                out=out)
        self.assertIs(got, out)
        np.testing.assert_array_equal(out, self.expected)
        attention_out = np.zeros((8, self.cfg.q_heads, self.cfg.head_dim), np.uint16)
        got = m3msa.sparse_attention(self.cfg, self.c.q, self.c.kv_cache, self.c.batch, out,
                                     attention_out)
        self.assertIs(got, attention_out)
        self.assertTrue(attention_out[0].any())

    def test_any_dlpack_producer_legacy_and_versioned(self):
        for versioned in (False, True):
            index_q = Producer(np.asarray(self.c.index_q.array), versioned=versioned)
            out_array = np.zeros_like(self.expected)
            out = Producer(out_array, versioned=versioned)
            m3msa.select_topk(self.cfg, index_q, self.c.index_cache, self.c.batch, out=out)
            np.testing.assert_array_equal(out_array, self.expected)  # written through the view
            self.assertEqual((index_q.deleted, out.deleted), (1, 1))  # handed back exactly once

    def test_read_only_versioned_output_is_refused(self):
        out = Producer(np.zeros_like(self.expected), versioned=True, read_only=True)
        with self.assertRaisesError("invalid_argument", "topk_idx", "read-only"):
            m3msa.select_topk(self.cfg, self.c.index_q, self.c.index_cache, self.c.batch,
                              out=out)
        self.assertEqual(out.deleted, 1)

    def test_bare_capsule_is_taken_once(self):
        capsule = np.asarray(self.c.index_q.array).__dlpack__()
        got = m3msa.select_topk(self.cfg, m3msa.view(capsule, "bf16"), self.c.index_cache,
                                self.c.batch)
        np.testing.assert_array_equal(got, self.expected)
        with self.assertRaisesError("invalid_argument", "index_q", "imported once"):
            m3msa.select_topk(self.cfg, m3msa.view(capsule, "bf16"), self.c.index_cache,
                              self.c.batch)

    def test_read_only_numpy_inputs_and_other_buffers(self):
        # NumPy < 2 will not export read-only arrays through DLPack: the buffer protocol takes them.
        index_q = np.asarray(self.c.index_q.array).copy()
        index_q.flags.writeable = False
        seq_lens = memoryview(np.asarray(self.c.batch.seq_lens))  # no __dlpack__ at all
        batch = m3msa.Batch.decode(seq_lens, self.c.index_table, q_len=2)
        got = m3msa.select_topk(self.cfg, m3msa.view(index_q, "bf16"), self.c.index_cache, batch)
        np.testing.assert_array_equal(got, self.expected)

    def test_cuda_tensors_dispatch_to_the_cuda_backend(self):
        fake = Producer(np.asarray(self.c.index_q.array), device_type=KDL_CUDA)
        out = np.zeros_like(self.expected)  # m3msa allocates next to torch tensors only
        info = m3msa.info()
        if not info["built_with_cuda"]:
            expected = ("unsupported", "CUDA backend not built", "index_q is on cuda:0")
            expected_attention = ("unsupported", "CUDA backend not built", "q is on cuda:0")
        elif not info["cuda_backend"]:
            expected = ("unsupported", "index_q is on cuda:0", "no CUDA device is visible")
            expected_attention = ("unsupported", "q is on cuda:0", "no CUDA device is visible")
        else:  # the CUDA backend takes the call, and refuses the CPU metadata beside the fake
            expected = expected_attention = ("invalid_argument", "batch.seq_lens", "cuda:0",
                                             "cpu")
        self.assertEqual(info["cuda_backend"],
                         info["built_with_cuda"] and info["cuda_device_count"] > 0)
        with self.assertRaisesError(*expected):
            m3msa.select_topk(self.cfg, fake, self.c.index_cache, self.c.batch, out, stream=1234)
        # The producer was told the consumer's stream (0 = legacy default is sent as 1).
        with self.assertRaisesError(*expected_attention):
            m3msa.sparse_attention(self.cfg, fake, self.c.kv_cache, self.c.batch, None,
                                   out=np.zeros((8, 4, 16), np.uint16), stream=0)
        expected_streams = [1234, 1]
        if "torch" not in sys.modules:  # without torch there is no current stream to look up
            with self.assertRaisesError(*expected):
                m3msa.select_topk(self.cfg, fake, self.c.index_cache, self.c.batch, out)
            expected_streams.append(None)
        self.assertEqual(fake.streams, expected_streams)
        self.assertEqual(fake.deleted, len(expected_streams))

    def test_error_types_are_the_builtin_ones(self):
        with self.assertRaises(ValueError) as raised:
            m3msa.select_topk(self.cfg, np.zeros((8, 2, 16), np.float32), self.c.index_cache,
                              self.c.batch)
        self.assertIsInstance(raised.exception, m3msa.InvalidArgumentError)
        self.assertIsInstance(raised.exception, m3msa.Error)
        with self.assertRaises(NotImplementedError) as raised:
            m3msa.score_blocks(self.cfg, Producer(np.asarray(self.c.index_q.array),
                                                  device_type=KDL_CUDA),
                               self.c.index_cache, self.c.batch, np.zeros((8, 2, 4), np.float32))
        self.assertEqual(raised.exception.code, "unsupported")
        self.assertIsInstance(raised.exception, m3msa.UnsupportedError)
        error = m3msa._errors.make_error("m3msa: timeout: rank 1 never arrived", "timeout",
                                         "rank 1 never arrived", 1)
        self.assertIsInstance(error, TimeoutError)
        self.assertIsInstance(error, m3msa.TimeoutError)
        self.assertEqual((error.rank, str(error)), (1, "m3msa: timeout: rank 1 never arrived"))
        self.assertIsInstance(m3msa._errors.make_error("x", "internal"), m3msa.InternalError)
        with self.assertRaisesError("invalid_argument", "plan", "str"):
            m3msa.select_topk(self.cfg, self.c.index_q, self.c.index_cache, self.c.batch,
                              plan="cuda")

    def test_cuda_plan_without_a_gpu(self):
        if m3msa.info()["cuda_backend"]:
            self.skipTest("a GPU is visible: test_cuda_*.py cover CudaPlan")
        with self.assertRaisesError("unsupported"):
            m3msa.CudaPlan(m3msa.SparseConfig(), max_reqs=1, device=0)
        with self.assertRaisesError("unsupported"):
            m3msa.CudaCpIndexer(m3msa.SparseConfig(), max_reqs=1, max_context=128,
                                world="single", device=0)

    def test_unsupported_devices_and_types(self):
        other = Producer(np.asarray(self.c.index_q.array), device_type=KDL_OPENCL)
        with self.assertRaisesError("invalid_argument", "out", "pass out="):
            m3msa.select_topk(self.cfg, other, self.c.index_cache, self.c.batch)
        with self.assertRaisesError("unsupported", "index_q", "device type 4"):
            m3msa.select_topk(self.cfg, other, self.c.index_cache, self.c.batch,
                              np.zeros_like(self.expected))
        with self.assertRaisesError("invalid_argument", "index_q", "float64", "convert"):
            m3msa.select_topk(self.cfg, np.zeros((8, 2, 16)), self.c.index_cache, self.c.batch)

    def test_info(self):
        info = m3msa.info()
        self.assertEqual(info["version"], m3msa.__version__)
        self.assertIsInstance(info["built_with_cuda"], bool)
        self.assertIsInstance(info["cuda_device_count"], int)


class DtypeHelpersTest(TestCase):
    def test_bf16_round_trip_and_rounding(self):
        values = np.array([1.0, -2.5, 3.14159, 1e-3, np.inf, -0.0], np.float32)
        bits = m3msa.float32_to_bf16_bits(values)
        self.assertEqual(bits.dtype, np.uint16)
        self.assertEqual(int(bits[0]), 0x3F80)
        self.assertEqual(int(bits[5]), 0x8000)
        self.assertEqual(int(m3msa.float32_to_bf16_bits(np.float32(1.0 + 2.0 ** -8))), 0x3F80)
        self.assertEqual(int(m3msa.float32_to_bf16_bits(np.float32(1.0 + 3 * 2.0 ** -8))), 0x3F82)
        self.assertTrue(np.isnan(m3msa.bf16_bits_to_float32(m3msa.float32_to_bf16_bits(np.nan))))
        np.testing.assert_array_equal(m3msa.bf16_bits_to_float32(bits)[:2], values[:2])

    def test_fp8_codes(self):
        cases = [(1.0, 0x38), (448.0, 0x7E), (1000.0, 0x7E), (-1000.0, 0xFE), (2.0 ** -9, 0x01),
                 (-0.0, 0x80), (0.0, 0x00), (1.0625, 0x38), (1.1875, 0x3A), (2.0 ** -6, 0x08),
                 (3 * 2.0 ** -10, 0x02)]  # ties go to the even code
        for value, code in cases:
            self.assertEqual(int(m3msa.float32_to_fp8_bits(np.float32(value))), code, value)
        self.assertEqual(int(m3msa.float32_to_fp8_bits(np.float32(np.nan))), 0x7F)
        every = np.arange(256, dtype=np.uint8)
        finite = ~np.isnan(m3msa.fp8_bits_to_float32(every))
        np.testing.assert_array_equal(
            m3msa.float32_to_fp8_bits(m3msa.fp8_bits_to_float32(every))[finite], every[finite])

    def test_views(self):
        typed = m3msa.as_fp8(np.ones((2, 3)), scale=0.5)
        self.assertEqual(typed.dtype, "fp8_e4m3")
        self.assertEqual(typed.shape, (2, 3))
        self.assertIn("uint8", repr(typed))
        np.testing.assert_array_equal(m3msa.to_float32(typed, scale=0.5), np.ones((2, 3)))


if __name__ == "__main__":
    unittest.main()
