"""Bad GPU calls raise the m3msa exception of their code, naming the argument: mixed devices,
wrong dtype / shape / stride, unsupported configurations, bad metadata contents (unplanned calls
check them on the host). InvalidArgumentError is a ValueError, UnsupportedError a
NotImplementedError. Skips without torch or a GPU."""

import unittest

import m3msa
from cuda_common import CudaTestCase, GpuCase, batch_to, gpu_config, requires_cuda, torch


@requires_cuda
class CudaErrorTest(CudaTestCase):
    @classmethod
    def setUpClass(cls):
        cls.cfg = gpu_config()
        cls.case = GpuCase(cls.cfg, num_reqs=3, seq_lens=[900, 0, 300], seed=1)

    def select(self, **overrides):
        c = self.case
        args = dict(index_q=c.index_q, index_cache=c.index_cache, batch=c.batch)
        args.update(overrides)
        return m3msa.select_topk(self.cfg, **args)

    def test_mixed_devices_name_the_argument(self):
        c = self.case
        with self.assertRaisesError("invalid_argument", "index_cache", "cpu") as check:
            self.select(index_cache=c.index_cache.cpu())
        self.assertIsInstance(check.error, ValueError)
        with self.assertRaisesError("invalid_argument", "index_cache", "cuda"):  # CPU backend
            self.select(index_q=c.index_q.cpu(), batch=batch_to(c.batch, "cpu"))
        with self.assertRaisesError("invalid_argument", "batch.seq_lens"):
            self.select(batch=batch_to(c.batch, "cpu"))
        with self.assertRaisesError("invalid_argument", "topk_idx", "cpu"):
            self.select(out=torch.zeros(3, 2, 8, dtype=torch.int32))
        with self.assertRaisesError("invalid_argument", "kv_cache", "cpu"):
            m3msa.sparse_attention(self.cfg, c.q, c.kv_cache.cpu(), c.batch, None)
        plan = m3msa.CudaPlan(self.cfg, max_reqs=4)
        with self.assertRaisesError("invalid_argument", "index_q", "cpu"):
            self.select(index_q=c.index_q.cpu(), plan=plan)

    def test_wrong_dtype_shape_and_stride(self):
        c = self.case
        with self.assertRaisesError("invalid_argument", "index_q", "bf16", "f32"):
            self.select(index_q=c.index_q.float())
        with self.assertRaisesError("invalid_argument", "index_q", "expected shape"):
            self.select(index_q=c.index_q[:, :1].contiguous())
        wide = torch.zeros(3, 2, 256, dtype=torch.bfloat16, device="cuda")
        with self.assertRaisesError("invalid_argument", "index_q", "contiguous"):
            self.select(index_q=wide[:, :, ::2])
        with self.assertRaisesError("invalid_argument", "topk_idx", "i32", "i64"):
            self.select(out=torch.zeros(3, 2, 8, dtype=torch.int64, device="cuda"))
        with self.assertRaisesError("invalid_argument", "out", "expected shape"):
            m3msa.sparse_attention(self.cfg, c.q, c.kv_cache, c.batch, None,
                                   out=torch.zeros(3, 16, 64, dtype=torch.bfloat16,
                                                   device="cuda"))
        with self.assertRaisesError("invalid_argument", "index_q", "float16"):
            self.select(index_q=c.index_q.half())

    def test_bad_table_entry_is_caught_by_the_unplanned_call(self):
        c = self.case
        table = c.batch.index_block_table.clone()
        table[0, 1] = 100_000
        batch = m3msa.Batch.decode(c.batch.seq_lens, table, c.batch.kv_block_table)
        with self.assertRaisesError("invalid_argument", "batch.index_block_table[0][1] = 100000"):
            self.select(batch=batch)

    def test_planned_call_guards_bad_tables_on_the_device(self):
        c = self.case
        table = c.batch.index_block_table.clone()
        table[0, 1] = 100_000  # never dereferenced: the kernel's guard records it
        batch = m3msa.Batch.decode(c.batch.seq_lens, table, c.batch.kv_block_table)
        plan = m3msa.CudaPlan(self.cfg, max_reqs=4)
        self.select(batch=batch, plan=plan)
        self.assertEqual(plan.device_status() & 1, 1)
        self.assertEqual(plan.device_status(), 0)  # cleared by the first read

    def test_unsupported_configurations(self):
        small = gpu_config(block_size=16, index_dim=16, head_dim=16, rope_dim=8)
        c = GpuCase(small, num_reqs=2, seq_lens=[40, 17], seed=2)  # valid for the CPU backend
        with self.assertRaisesError("unsupported", "CUDA indexer", "128") as check:
            m3msa.select_topk(small, c.index_q, c.index_cache, c.batch)
        self.assertIsInstance(check.error, NotImplementedError)
        with self.assertRaisesError("unsupported", "CUDA sparse attention", "128"):
            m3msa.sparse_attention(small, c.q, c.kv_cache, c.batch, None)
        with self.assertRaises(m3msa.UnsupportedError):
            m3msa.CudaPlan(small, max_reqs=1)

    def test_bad_plans(self):
        with self.assertRaisesError("invalid_argument", "max_q_len"):
            m3msa.CudaPlan(self.cfg, max_reqs=1, max_q_len=9)
        with self.assertRaisesError("invalid_argument", "max_reqs"):
            m3msa.CudaPlan(self.cfg, max_reqs=0)
        with self.assertRaisesError("invalid_argument", "device"):
            m3msa.CudaPlan(self.cfg, max_reqs=1, device=torch.cuda.device_count())
        with self.assertRaisesError("invalid_argument", "device"):
            m3msa.CudaPlan(self.cfg, max_reqs=1, device="cpu")

    def test_tensors_on_another_gpu(self):
        if torch.cuda.device_count() < 2:
            self.skipTest("needs two GPUs")
        c = self.case
        with self.assertRaisesError("invalid_argument", "index_cache", "cuda:1"):
            self.select(index_cache=c.index_cache.to("cuda:1"))
        plan = m3msa.CudaPlan(self.cfg, max_reqs=4, device=1)
        with self.assertRaisesError("invalid_argument", "batch.seq_lens", "cuda:1", "cuda:0"):
            self.select(plan=plan)


if __name__ == "__main__":
    unittest.main()
