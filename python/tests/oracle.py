"""A tiny NumPy oracle of docs/spec.md, independent of the C++ library: brute-force block scores and
top-k selection (section 4), attention in float64 (section 5), preprocessing (section 2), and a
builder of small random cases with shuffled page tables and NaN garbage wherever nothing may be
read (after each context, in unused pages), so a read out of bounds shows as a wrong answer."""

import struct

import numpy as np

import m3msa


# ---- Element types (own decoders: the oracle shares no code with what it checks) ----

def bf16_decode(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def bf16_round(values):
    """float -> nearest-even bf16 value, as float64."""
    x = np.asarray(values, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    out = u.astype(np.uint32).view(np.float32).astype(np.float64)
    return np.where(np.isnan(x), np.nan, out)


def fp8_decode(bits):
    bits = np.asarray(bits, dtype=np.uint8).astype(np.int64)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    value = sign * np.where(exponent == 0, mantissa / 512.0, normal)
    return np.where((exponent == 0xF) & (mantissa == 0x7), np.nan, value).astype(np.float32)


def decode(tensor, scale=1.0):
    """float32 values of an m3msa.view or a plain array (fp8 values times scale)."""
    if isinstance(tensor, m3msa.TypedView):
        if tensor.dtype == "bf16":
            return bf16_decode(tensor.array)
        if tensor.dtype == "fp8_e4m3":
            return fp8_decode(tensor.array) * np.float32(scale)
        tensor = tensor.array
    return np.asarray(tensor, dtype=np.float32)


def encode(values, dtype, scale=1.0):
    values = np.asarray(values, dtype=np.float32)
    if dtype == "bf16":
        return m3msa.as_bf16(values)
    return m3msa.as_fp8(values, scale)


# ---- Cases ----

NAN_BITS = {"bf16": 0x7FC0, "fp8": 0x7F}


class Case:
    pass


def row_positions(batch):
    """[(req, pos)] per row; pos = -1 for a dead row (docs/spec.md section 3)."""
    rows = []
    if batch.kind == "decode":
        for req, seq_len in enumerate(np.asarray(batch.seq_lens)):
            for j in range(batch.q_len):
                rows.append((req, int(seq_len) - batch.q_len + j if seq_len > 0 else -1))
    else:
        cu, context = np.asarray(batch.cu_seqlens_q), np.asarray(batch.context_lens)
        for req in range(batch.num_reqs):
            for i in range(cu[req + 1] - cu[req]):
                rows.append((req, int(context[req]) + i))
    return rows


def _tables(rng, lengths, block_size, extra_pages, max_blocks):
    need = [-(-n // block_size) for n in lengths]
    pages = sum(need) + extra_pages
    order = rng.permutation(pages)
    table = np.full((len(lengths), max_blocks), -1, dtype=np.int32)  # -1 past what is needed
    used = 0
    for req, n in enumerate(need):
        table[req, :n] = order[used:used + n]
        used += n
    return table, pages


def make_case(cfg, rng, *, seq_lens=None, q_len=1, cu_seqlens=None, context_lens=None,
              index_dtype="bf16", kv_dtype="bf16", k_scale=1.0, v_scale=1.0, integer=False,
              extra_pages=2):
    """A decode case (seq_lens, q_len) or a prefill case (cu_seqlens, context_lens). integer:
    small integer values everywhere, so every score is exact and ties are common."""
    c = Case()
    c.cfg = cfg
    bs = cfg.block_size
    if seq_lens is not None:
        c.batch = m3msa.Batch.decode(np.asarray(seq_lens, np.int32), q_len=q_len)
        lengths = [int(n) for n in seq_lens]
    else:
        cu = np.asarray(cu_seqlens, np.int32)
        ctx = np.asarray(context_lens, np.int32)
        c.batch = m3msa.Batch.prefill(cu, ctx)
        lengths = [int(ctx[r] + cu[r + 1] - cu[r]) for r in range(len(ctx))]
    c.lengths = lengths
    max_blocks = max([-(-n // bs) for n in lengths] + [1]) + 1
    c.index_table, index_pages = _tables(rng, lengths, bs, extra_pages, max_blocks)
    c.kv_table, kv_pages = _tables(rng, lengths, bs, extra_pages, max_blocks)
    c.batch.index_block_table = c.index_table
    c.batch.kv_block_table = c.kv_table
    c.rows = row_positions(c.batch)
    rows = len(c.rows)

    def draw(shape, scale=1.0):
        if integer:
            return rng.integers(-3, 4, size=shape).astype(np.float32)
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    # Caches: values where a context lives, NaN garbage everywhere else.
    index_values = np.full((index_pages, bs, cfg.index_dim), np.nan, np.float32)
    kv_values = np.full((kv_pages, cfg.kv_heads, 2, bs, cfg.head_dim), np.nan, np.float32)
    for req, n in enumerate(lengths):
        for p in range(n):
            index_values[c.index_table[req, p // bs], p % bs] = draw(cfg.index_dim)
            kv_values[c.kv_table[req, p // bs], :, :, p % bs] = draw(
                (cfg.kv_heads, 2, cfg.head_dim))
    kv_values[:, :, 0] *= np.float32(k_scale)
    kv_values[:, :, 1] *= np.float32(v_scale)
    c.index_cache = encode(index_values, index_dtype)
    kv_stored = kv_values.copy()
    kv_stored[:, :, 0] /= np.float32(k_scale)
    kv_stored[:, :, 1] /= np.float32(v_scale)
    c.kv_cache = encode(kv_stored, kv_dtype)
    c.k_scale, c.v_scale = k_scale, v_scale
    c.index_q = m3msa.as_bf16(draw((rows, cfg.index_heads, cfg.index_dim)))
    c.q = m3msa.as_bf16(draw((rows, cfg.q_heads, cfg.head_dim), 0.5))
    return c


# ---- Section 4: scores and selection ----

def scores(c):
    """S(t, h, b): [rows, H, max_blocks] float32, -inf where a row sees no block. Dot products
    accumulate in fp32 in dimension order (the CPU reference's documented order; each product of
    two bf16 / fp8 values is exact in fp32), NaN is sticky in the max."""
    cfg, bs = c.cfg, c.cfg.block_size
    cache = decode(c.index_cache)
    query = decode(c.index_q)
    out = np.full((len(c.rows), cfg.index_heads, c.index_table.shape[1]), -np.inf, np.float32)
    for row, (req, pos) in enumerate(c.rows):
        if pos < 0:
            continue
        for b in range(pos // bs + 1):
            end = min(bs * b + bs, pos + 1)
            keys = cache[c.index_table[req, b], : end - bs * b]  # [n, D]
            acc = np.zeros((cfg.index_heads, keys.shape[0]), np.float32)
            for d in range(cfg.index_dim):
                acc = (acc + query[row, :, d:d + 1] * keys[None, :, d]).astype(np.float32)
            nan = np.isnan(acc).any(axis=1)
            out[row, :, b] = np.where(nan, np.nan, np.max(np.where(np.isnan(acc), 0, acc), axis=1))
    return out


def ordered(score):
    u = struct.unpack("<I", struct.pack("<f", float(score)))[0]
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return 0
    if u == 0x80000000:
        u = 0
    return u ^ 0xFFFFFFFF if u & 0x80000000 else u | 0x80000000


def sort_key(cfg, score, block, nb):
    forced = block < cfg.init_blocks or block >= nb - cfg.local_blocks
    image = 0xFFFFFFFF if forced else ordered(score)
    return (image << 32) | (0xFFFFFF - block)


def select(c, block_scores=None):
    """topk_idx [rows, H, k] int32 by brute force over sort keys."""
    cfg = c.cfg
    block_scores = scores(c) if block_scores is None else block_scores
    out = np.full((len(c.rows), cfg.index_heads, cfg.topk), -1, np.int32)
    for row, (_, pos) in enumerate(c.rows):
        if pos < 0:
            continue
        nb = pos // cfg.block_size + 1
        for h in range(cfg.index_heads):
            keys = sorted((sort_key(cfg, block_scores[row, h, b], b, nb) for b in range(nb)),
                          reverse=True)[: cfg.topk]
            out[row, h, : len(keys)] = [0xFFFFFF - (key & 0xFFFFFF) for key in keys]
    return out


def keys(c, block_scores=None):
    """The full selection as sort keys [rows, H, k] uint64, 0-padded (nominate with 1 shard)."""
    cfg = c.cfg
    block_scores = scores(c) if block_scores is None else block_scores
    out = np.zeros((len(c.rows), cfg.index_heads, cfg.topk), np.uint64)
    for row, (_, pos) in enumerate(c.rows):
        if pos < 0:
            continue
        nb = pos // cfg.block_size + 1
        for h in range(cfg.index_heads):
            ranked = sorted((sort_key(cfg, block_scores[row, h, b], b, nb) for b in range(nb)),
                            reverse=True)[: cfg.topk]
            out[row, h, : len(ranked)] = ranked
    return out


# ---- Section 5: attention in float64 ----

def attention(c, topk_idx=None):
    """[rows, QH, HD] float64; topk_idx None = dense causal attention; dead rows are zeros."""
    cfg, bs = c.cfg, c.cfg.block_size
    kv = decode(c.kv_cache).astype(np.float64)
    if c.kv_cache.dtype == "fp8_e4m3":  # scales apply to fp8 caches (read = stored * scale)
        kv[:, :, 0] *= c.k_scale
        kv[:, :, 1] *= c.v_scale
    q = decode(c.q).astype(np.float64)
    group = cfg.q_heads // cfg.kv_heads
    out = np.zeros((len(c.rows), cfg.q_heads, cfg.head_dim))
    for row, (req, pos) in enumerate(c.rows):
        if pos < 0:
            continue
        for g in range(cfg.q_heads):
            kvh = g // group
            if topk_idx is None:
                blocks = range(pos // bs + 1)
            else:
                blocks = [int(b) for b in topk_idx[row, kvh] if b >= 0]
            positions = [p for b in blocks for p in range(bs * b, min(bs * b + bs, pos + 1))]
            pages = [c.kv_table[req, p // bs] for p in positions]
            keys = np.stack([kv[page, kvh, 0, p % bs] for page, p in zip(pages, positions)])
            values = np.stack([kv[page, kvh, 1, p % bs] for page, p in zip(pages, positions)])
            logits = keys @ q[row, g] / np.sqrt(cfg.head_dim)
            weights = np.exp(logits - logits.max())
            out[row, g] = weights @ values / weights.sum()
    return out


def bf16_close(actual, expected, ulps=1.0, floor=1e-5):
    """Elementwise |actual - expected| <= ulps * 2^-7 * |expected| + floor (2^-7 |x| is one bf16
    ulp or more); returns (ok, message naming the worst element)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    tolerance = ulps * 2.0 ** -7 * np.abs(expected) + floor
    error = np.abs(actual - expected)
    bad = ~(error <= tolerance)
    if not bad.any():
        return True, ""
    worst = np.unravel_index(np.argmax(np.where(bad, error - tolerance, -np.inf)), error.shape)
    return False, (f"{int(bad.sum())} of {bad.size} elements off; worst at {tuple(map(int, worst))}: "
                   f"got {actual[worst]!r}, expected {expected[worst]!r}")


# ---- Section 2: preprocessing ----

def rms_norm(x, weight, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + weight)


def rope(x, pos, rope_dim, theta):
    """NeoX rotation of dims [0, rope_dim) of each head (last axis), float64."""
    half = rope_dim // 2
    angle = pos * theta ** (-2.0 * np.arange(half) / rope_dim)
    cos, sin = np.cos(angle), np.sin(angle)
    out = np.array(x, np.float64)
    a, b = x[..., :half], x[..., half:rope_dim]
    out[..., :half] = a * cos - b * sin
    out[..., half:rope_dim] = b * cos + a * sin
    return out


def rope_tolerance(normed, rope_dim):
    """One bf16 ulp of each RoPE input (the normed values are rounded to bf16 first, possibly one
    ulp apart from the oracle's) on each output."""
    half = rope_dim // 2
    partner = np.zeros_like(normed)
    partner[..., :half] = normed[..., half:rope_dim]
    partner[..., half:rope_dim] = normed[..., :half]
    return 2.0 ** -7 * (np.abs(normed) + np.abs(partner))


def preprocess(cfg, qkv, weights, positions):
    """Per row: (q [QH, HD], k [KVH, HD], v [KVH, HD], index_q [H, D], index_k [D]) in float64,
    plus the tolerance of each (q, k, index_q, index_k) from rope_tolerance()."""
    q_norm, k_norm, iq_norm, ik_norm = (bf16_decode(w).astype(np.float64) for w in weights)
    x = bf16_decode(qkv).astype(np.float64)
    hd, d = cfg.head_dim, cfg.index_dim
    widths = [cfg.q_heads * hd, cfg.kv_heads * hd, cfg.kv_heads * hd, cfg.index_heads * d, d]
    bounds = np.cumsum([0] + widths)
    parts = [x[:, bounds[i]:bounds[i + 1]] for i in range(5)]
    rows = x.shape[0]
    q = parts[0].reshape(rows, cfg.q_heads, hd)
    k = parts[1].reshape(rows, cfg.kv_heads, hd)
    v = parts[2].reshape(rows, cfg.kv_heads, hd)
    iq = parts[3].reshape(rows, cfg.index_heads, d)
    ik = parts[4].reshape(rows, 1, d)
    out, tol = {}, {}
    for name, tensor, weight in (("q", q, q_norm), ("k", k, k_norm), ("index_q", iq, iq_norm),
                                 ("index_k", ik, ik_norm)):
        normed = bf16_round(rms_norm(tensor, weight, cfg.rms_eps))
        roped = np.stack([rope(normed[r], positions[r], cfg.rope_dim, cfg.rope_theta)
                          for r in range(rows)])
        out[name], tol[name] = roped, rope_tolerance(normed, cfg.rope_dim)
    out["v"] = v
    out["index_k"], tol["index_k"] = out["index_k"][:, 0], tol["index_k"][:, 0]
    return out, tol
