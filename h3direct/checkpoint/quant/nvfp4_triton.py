"""NVFP4 -> dense dequantization in one Triton pass, bitwise equal to `nvfp4.dequantize_nvfp4`'s torch path; and
NVFP4 -> e4m3 under per-row scales (the FP8 linears' `stream` mode), bitwise `w8a8.nvfp4_to_e4m3_reference`.

The W4A16 path makes every block linear's dense weight on each call, so this kernel is pure bandwidth: it reads
the packed codes (0.5 byte per value) and the swizzled E4M3 block scales (1/16 byte) and writes 2 or 4 bytes per
value. The work is cut into 16-value blocks (one block scale, 8 packed bytes = two int32 words): a program takes
`BLK` consecutive blocks of the row-major [N16, K16/16] block grid, which are contiguous both in the packed input
and in the [N16, K16] output, so loads and stores are wide and coalesced whatever N and K are.

Arithmetic, step for step the torch path's (`nvfp4.dequantize_nvfp4`):
    t = round_out(round_out(global) * block_scale)      # block_scale (E4M3) is exact in every output dtype
    w = round_out(e2m1(code) * t)
with round_out = round to nearest even into the output dtype (identity for fp32). In bf16/fp16 both products are
exact in fp32 (at most 8 x 4 significant bits), so one fp32 multiply and one rounding reproduce torch's
half-precision multiply. The roundings of the per-block values use integer arithmetic (bf16) or an explicit
round-to-nearest-even cast (fp16); the per-value rounding uses the GPU's round-to-nearest-even conversion when
compiled and the same integer arithmetic under Triton's CPU interpreter (`TRITON_INTERPRET=1`, whose bf16 cast
truncates). `tests/test_nvfp4_triton.py` checks the interpreted kernel on the CPU and the compiled one on a GPU.

The e4m3 conversion (`nvfp4_to_e4m3_triton`, run on every call of a `stream` FP8 linear) is the same kernel with
a fourth output: the fp32 value w (as above) times the reciprocal of its row's scale (`w8a8`'s rule: the reciprocal
an IEEE division, once per block; the product rounded once) and encoded by `w8a8_triton.encode_e4m3`, one byte a
value. Per value it reads half a byte of codes and writes one byte; the block scale is read and decoded once per 16
values, the row scale once per block.

NaN block scales (E4M3 0x7F / 0xFF; never written by quantization) give NaN values; the NaN bit pattern may differ
from torch's (and their e4m3 codes are not defined).
"""

from __future__ import annotations

import torch

from h3direct.checkpoint.quant.nvfp4_layout import BLOCK, TILE_COLS, scale_storage_shape
from h3direct.errors import CheckpointError
from h3direct.triton_build import FP_OPTIONS, OUT_CODES, build, for_device, interpreting

try:  # Triton is optional (CUDA wheels of torch ship it; the `test` extra installs it for the interpreter)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - environments without Triton
    triton = None

E4M3_OUT = 3  # the kernel's output code of the 8-bit conversions (e4m3, or int8 with the int8 encoder)

# Launch configs (blocks per program, warps) of the two uses of the kernel ("nvfp4_dequant", "nvfp4_e4m3"; the names
# `tools/tune_kernels.py` sweeps them under). Every config gives the same bits; the fastest depends on the GPU.
# `LAUNCH` holds, per CUDA compute capability, the best of `CONFIGS` timed at the DiT's block-linear shapes on a GPU of
# that capability (`tools/tune_kernels.py` prints such an entry); every other device gets `DEFAULT_LAUNCH`.
DEFAULT_LAUNCH: dict[str, tuple[int, int]] = {  # untuned: Triton's usual 4 warps, 32 values a thread
    "nvfp4_dequant": (256, 4),
    "nvfp4_e4m3": (256, 4),
}
LAUNCH: dict[tuple[int, int], dict[str, tuple[int, int]]] = {
    (9, 0): {"nvfp4_dequant": (512, 8), "nvfp4_e4m3": (256, 8)},  # Hopper (H100, H200)
}
CONFIGS = ((128, 4), (256, 4), (256, 8), (512, 4), (512, 8), (1024, 4), (1024, 8), (2048, 8))


def launch_config(kernel: str, device: torch.device | None) -> tuple[int, int]:
    """(blocks per program, warps) of `kernel` ("nvfp4_dequant" / "nvfp4_e4m3") on `device`: `LAUNCH` for its compute
    capability, else `DEFAULT_LAUNCH` (other GPUs, the CPU interpreter)."""
    return for_device(LAUNCH, DEFAULT_LAUNCH, device)[kernel]


if triton is not None:

    def _dequant_kernel(words_ptr, scale_ptr, g_ptr, out_ptr, rs_ptr, total, NB, TILES_PER_ROW, BLK: tl.constexpr,
                        OUT: tl.constexpr, EVEN: tl.constexpr, INTERPRET: tl.constexpr, ENCODE: tl.constexpr):
        # words: int32 [N16 * NB, 2] (block i = row i // NB, scale column i % NB; word h holds columns 8h..8h+7,
        # byte j of a word the columns 2j (high nibble) and 2j + 1 (low nibble)); out: [N16 * NB, 16] values.
        # OUT: 0 fp32, 1 fp16, 2 bf16 (16-bit outputs are stored as their int16 bit patterns), 3 e4m3 codes (uint8)
        # of the fp32 values times the reciprocal of their row's scale rs[row] (ENCODE: `w8a8_triton.encode_e4m3`)
        pid = tl.program_id(0)
        i = pid * BLK + tl.arange(0, BLK)  # [BLK] blocks of this program (int32: the caller checks the range)
        half = tl.arange(0, 2)
        k = tl.arange(0, 8)
        if EVEN:
            w = tl.load(words_ptr + (i[:, None] * 2 + half[None, :]))  # [BLK, 2]
        else:
            w = tl.load(words_ptr + (i[:, None] * 2 + half[None, :]), mask=(i < total)[:, None], other=0)

        # block scale of (row r, column b) in cuBLAS' 128x4 tiles: tile (r // 128, b // 4), then inside the tile
        # [32 rows r % 32][4 row groups (r // 32) % 4][4 columns b % 4], 512 bytes a tile
        iu = i.to(tl.uint32)  # unsigned: divisions and remainders without sign fix-ups
        r = iu // NB.to(tl.uint32)
        b = iu - r * NB.to(tl.uint32)
        off = ((r // 128) * TILES_PER_ROW.to(tl.uint32) + b // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + b % 4
        if EVEN:
            sc = tl.load(scale_ptr + off).to(tl.int32)
        else:
            sc = tl.load(scale_ptr + off, mask=i < total, other=0).to(tl.int32)
        # E4M3 -> fp32, exact: normals by placing exponent and mantissa, subnormals as mantissa * 2^-9
        ex = (sc >> 3) & 15
        mt = sc & 7
        s = tl.where(ex == 0, mt.to(tl.float32) * 0.001953125,
                     (((ex + 120) << 23) | (mt << 20)).to(tl.float32, bitcast=True))
        s = tl.where((sc & 127) == 127, tl.full(s.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True), s)
        # the sign as a bit: compiled, `-s` may lower to 0 - s, which turns the scale -0 (byte 0x80) into +0
        s = (s.to(tl.int32, bitcast=True) | ((sc & 128) << 24)).to(tl.float32, bitcast=True)

        g = tl.load(g_ptr)
        if OUT == 0 or OUT == 3:
            t = g * s
        elif OUT == 1:
            g = g.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)
            t = (g * s).to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)
        else:  # bf16: round to nearest even by integer arithmetic (exact here and in the interpreter)
            gb = g.to(tl.uint32, bitcast=True)
            g = (((gb + 0x7FFF + ((gb >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
            tb = (g * s).to(tl.uint32, bitcast=True)
            t = (((tb + 0x7FFF + ((tb >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)

        # E2M1 code (sign, 2 exponent bits, 1 mantissa bit) -> fp32 bits: sign to bit 31, the 3 magnitude bits to
        # bits 24..22 (the low exponent bits and the top mantissa bit), which reads as 2^-126 times the E2M1 value
        # (code 1 = 0.5 lands on the subnormal 2^-127, as E2M1's own subnormal does); the multiply by 2^126 is exact.
        # Shift the nibble to the top of the word, then arithmetically right by 6 (the sign fills bits 31..25) and
        # keep bits 31 and 24..22 (mask 0x81C00000 as a signed int32): 3 integer operations a value.
        top = w[:, :, None] << (28 - 4 * (k ^ 1))[None, None, :]  # [BLK, 2, 8], column 8h + k's nibble on top
        bits = (top >> 6) & -2118123520
        v = bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126
        val = v * t[:, None, None]

        out_off = i[:, None, None] * 16 + half[None, :, None] * 8 + k[None, None, :]
        if OUT == 0:
            y = val
        elif OUT == 3:  # the row's scale, once per block: its IEEE reciprocal times each value, as the torch reference
            if EVEN:
                rs = tl.load(rs_ptr + r)
            else:
                rs = tl.load(rs_ptr + r, mask=i < total, other=1.0)
            inverse = tl.math.div_rn(rs * 0.0 + 1.0, rs)
            y = ENCODE(val * inverse[:, None, None], INTERPRET)
        elif OUT == 1:
            y = val.to(tl.float16, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True)
        elif INTERPRET:  # the interpreter's bf16 cast truncates: round by integer arithmetic
            vb = val.to(tl.uint32, bitcast=True)
            y = ((vb + 0x7FFF + ((vb >> 16) & 1)) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)
        else:
            y = val.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True)
        if EVEN:
            tl.store(out_ptr + out_off, y)
        else:
            tl.store(out_ptr + out_off, y, mask=(i < total)[:, None, None])


def _storage(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor):
    """Checks NVFP4 storage; (int32 words of the codes, uint8 tiled scales, fp32 global [1], rows, blocks a row,
    scale tiles a row)."""
    if triton is None:
        raise RuntimeError("the NVFP4 Triton kernel needs Triton, which is not importable here")
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise CheckpointError(f"NVFP4 packed weight must be 2D uint8, got {packed.dtype} {list(packed.shape)}")
    rows, half = packed.shape
    if (2 * half) % BLOCK:
        raise CheckpointError(f"NVFP4 packed weight [{rows}, {half}] holds {2 * half} columns, not a multiple of 16")
    nb = 2 * half // BLOCK
    rp, cp = scale_storage_shape(rows, nb)
    if block_scale.element_size() != 1 or block_scale.numel() != rp * cp:
        raise CheckpointError(f"block-scale tensor has {block_scale.numel()} elements of {block_scale.dtype}, "
                              f"expected {rp}x{cp} bytes (tiled layout of {rows}x{nb} scales)")
    dev = packed.device
    if block_scale.device != dev:
        raise ValueError(f"NVFP4 block scales are on {block_scale.device}, the packed weight on {dev}")
    if rows * nb * BLOCK >= 2**31:
        raise ValueError(f"NVFP4 weight [{rows}, {2 * half}] has 2^31 or more values; the kernel indexes with int32")
    scales = block_scale.reshape(-1).view(torch.uint8)
    scales = scales if scales.is_contiguous() else scales.contiguous()
    packed = packed.contiguous()
    if packed.data_ptr() % 4:  # an unaligned view: the kernel reads int32 words
        packed = packed.clone()
    g = global_scale.to(device=dev, dtype=torch.float32).reshape(1)
    return packed.view(torch.int32), scales, g, rows, nb, cp // TILE_COLS


def _launch(storage, dst: torch.Tensor, out_code: int, row_scales: torch.Tensor | None, config: tuple[int, int],
            fmt: str = "e4m3"):
    words, scales, g, rows, nb, tiles = storage
    total = rows * nb
    if total == 0:
        return
    blk, warps = config
    encode = None
    if out_code == E4M3_OUT:
        from h3direct.checkpoint.quant.w8a8_triton import device_functions

        encode = device_functions(fmt)[1]
    rs = row_scales if row_scales is not None else g  # unread placeholder
    build(_dequant_kernel, do_not_specialize=["NB", "TILES_PER_ROW"])[(triton.cdiv(total, blk),)](
        words, scales, g, dst, rs, total, nb, tiles, BLK=blk, OUT=out_code, EVEN=total % blk == 0,
        INTERPRET=interpreting(), ENCODE=encode, num_warps=warps, **FP_OPTIONS)


def dequantize_nvfp4_triton(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                            out_dtype: torch.dtype = torch.bfloat16,
                            config: tuple[int, int] | None = None) -> torch.Tensor:
    """packed uint8 [N16, K16/2], tiled E4M3 block scales, fp32 global scale -> dense [N16, K16] in `out_dtype`
    (fp32, fp16 or bf16), bitwise equal to `nvfp4.dequantize_nvfp4`. `config`: (blocks per program, warps); None:
    `launch_config("nvfp4_dequant", packed.device)`."""
    if out_dtype not in OUT_CODES:
        raise ValueError(f"NVFP4 dequantization to {out_dtype} is not supported (fp32, fp16 or bf16)")
    storage = _storage(packed, block_scale, global_scale)
    out = torch.empty((packed.shape[0], 2 * packed.shape[1]), dtype=out_dtype, device=packed.device)
    dst = out if out_dtype == torch.float32 else out.view(torch.int16)
    _launch(storage, dst, OUT_CODES[out_dtype], None, config or launch_config("nvfp4_dequant", packed.device))
    return out


def nvfp4_to_codes_triton(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                          row_scales: torch.Tensor, config: tuple[int, int] | None = None,
                          fmt: str = "e4m3") -> torch.Tensor:
    """NVFP4 storage (as `dequantize_nvfp4_triton`) and fp32 per-row scales [N16] -> 8-bit codes of format `fmt`
    [N16, K16] (the whole padded storage: float8_e4m3fn, or int8 through `w8a8_triton.encode_int8`), bitwise
    `w8a8.nvfp4_to_codes_reference`. `config`: None: `launch_config("nvfp4_e4m3", packed.device)`."""
    storage = _storage(packed, block_scale, global_scale)
    rows = packed.shape[0]
    if row_scales.shape != (rows,):
        raise ValueError(f"row scales of shape {list(row_scales.shape)} for an NVFP4 weight of {rows} rows")
    rs = row_scales.to(device=packed.device, dtype=torch.float32).contiguous()
    int8 = fmt == "int8"
    out = torch.empty((rows, 2 * packed.shape[1]), dtype=torch.int8 if int8 else torch.uint8, device=packed.device)
    _launch(storage, out, E4M3_OUT, rs, config or launch_config("nvfp4_e4m3", packed.device), fmt=fmt)
    return out if int8 else out.view(torch.float8_e4m3fn)


nvfp4_to_e4m3_triton = nvfp4_to_codes_triton  # the default format's name
