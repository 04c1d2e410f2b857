"""bfloat16 and float8 e4m3 for NumPy, which has neither.

A bf16 tensor travels as uint16 bits and an fp8 e4m3 ("fn": bias 7, max 448, no inf) tensor as
uint8 bits, tagged with m3msa.view(array, dtype). The conversions round to nearest even exactly
as the C++ library does (include/m3msa/dtype.h): bf16 keeps NaN quiet, fp8 saturates to +-448.
"""

import numpy as np

from . import _m3msa
from ._errors import invalid

TypedView = _m3msa.TypedView


def view(array, dtype):
    """Tags `array` with the m3msa dtype its elements hold, without copying.

    dtype: 'bf16' (uint16 / int16 bits), 'fp8' (uint8 / int8 bits of fp8 e4m3), or any m3msa dtype
    ('f32', 'i32', 'i64', 'u64', 'u8') matching the array's own element type.
    """
    return TypedView(array, dtype)


def float32_to_bf16_bits(values):
    """float32 -> bf16 bits (uint16), round to nearest even, NaN kept quiet."""
    shape = np.shape(values)  # a scalar in, a 0-d array out (ascontiguousarray makes it 1-d)
    x = np.ascontiguousarray(values, dtype=np.float32)
    u = x.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet = (u >> np.uint32(16)) | np.uint32(0x0040)
    return np.where(nan, quiet, rounded).astype(np.uint16).reshape(shape)


def bf16_bits_to_float32(bits):
    b = np.ascontiguousarray(bits)
    if b.dtype not in (np.uint16, np.int16):
        raise invalid(f"bf16 bits: expected a uint16 array, got {b.dtype}")
    return (b.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(
        np.shape(bits))


def _fp8_table():
    table = np.empty(256, dtype=np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent, mantissa = (code >> 3) & 0xF, code & 0x7
        if exponent == 0xF and mantissa == 0x7:
            table[code] = np.nan
        elif exponent == 0:
            table[code] = sign * mantissa / 512.0
        else:
            table[code] = sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)
    return table


FP8_TABLE = _fp8_table()
_FP8_POSITIVE = FP8_TABLE[:0x7F].astype(np.float64)  # codes 0x00..0x7E ascending, 0x7E = 448


def fp8_bits_to_float32(bits):
    b = np.ascontiguousarray(bits)
    if b.dtype not in (np.uint8, np.int8):
        raise invalid(f"fp8 bits: expected a uint8 array, got {b.dtype}")
    return FP8_TABLE[b.view(np.uint8)].reshape(np.shape(bits))


def float32_to_fp8_bits(values):
    """float32 -> fp8 e4m3 bits (uint8): nearest even, saturating to +-448, NaN -> NaN."""
    x = np.asarray(values, dtype=np.float32)
    magnitude = np.abs(x).astype(np.float64)
    above = np.clip(np.searchsorted(_FP8_POSITIVE, magnitude, side="left"), 0, 0x7E)
    below = np.clip(above - 1, 0, 0x7E)
    to_below = magnitude - _FP8_POSITIVE[below]
    to_above = _FP8_POSITIVE[above] - magnitude
    take_below = (to_below < to_above) | ((to_below == to_above) & (below % 2 == 0))
    code = np.where(take_below, below, above)
    code = np.where(magnitude >= 448.0, 0x7E, code)
    code = np.where(np.isnan(x), 0x7F, code)
    code = code | np.where(np.signbit(x), 0x80, 0)
    return code.astype(np.uint8)


def as_bf16(values):
    """float values -> m3msa.view(bf16 bits, 'bf16')."""
    return view(float32_to_bf16_bits(values), "bf16")


def as_fp8(values, scale=1.0):
    """float values -> m3msa.view(fp8 bits of values / scale, 'fp8') (a KV cache's k/v_scale)."""
    return view(float32_to_fp8_bits(np.asarray(values, dtype=np.float32) / np.float32(scale)), "fp8")


def to_float32(tensor, scale=1.0):
    """A NumPy float32 copy of a tensor: decodes m3msa.view(..., 'bf16' | 'fp8') and raw arrays;
    fp8 values are multiplied by `scale` (read = stored * scale)."""
    if isinstance(tensor, TypedView):
        if tensor.dtype == "bf16":
            return bf16_bits_to_float32(np.asarray(tensor.array))
        if tensor.dtype == "fp8_e4m3":
            return fp8_bits_to_float32(np.asarray(tensor.array)) * np.float32(scale)
        tensor = tensor.array
    if type(tensor).__module__.split(".")[0] == "torch":
        return tensor.detach().float().cpu().numpy()
    return np.asarray(tensor).astype(np.float32)
