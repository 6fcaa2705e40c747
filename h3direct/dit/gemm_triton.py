"""Triton GEMM y = x Wᵀ (bf16 in, fp32 accumulate) with the DiT block's elementwise work fused into its epilogue.

Experimental (issue 13): nothing in the model calls it yet; `benchmarks/tgemm_bench.py` measures it against
cuBLAS on the H200 and decides. x [M, K] (unit column stride, any row stride: fc2 reads a strided view),
W [N, K] row-major, fp32 accumulator per [BM, BN] tile. Epilogues (`EPI`), each fp32 inside with one rounding:

- ``plain``: y = acc -> [M, N].
- ``swiglu``: W's rows interleaved gate/up (row 2j = gate j, row 2j+1 = up j: `interleave_gate_up`), so a tile's
  accumulator holds gate and up of the same BN/2 features in adjacent columns; y = silu(gate)·up -> [M, N/2].
  The eager path rounds fc1's output, then silu, then the product (three roundings): here one.
- ``gated residual``: x[r] += acc[r]·gate[idx[r]] in place on the residual stream (idx = adaLN row of each
  sequence row, -1: row untouched, as `fused.gated_residual_`); the [M, N] GEMM output never reaches memory.
- ``qk norm rope``: BN = head_dim, so a tile is one head of BM rows; q and k heads get the per-head RMSNorm
  (weight) and the partial split-half rotation by the [1, S, 1, R, 2, 2] table (`rope.rms_norm_rope`), v heads
  pass through; the [M, 3·H·D] output holds q | k | v ready for attention.

Two ways to load the tiles, chosen per config: TMA tensor descriptors (host `TensorDescriptor`; zero padding out of
bounds) or plain pointer arithmetic with masks (`tl.make_block_ptr` is gone from newer Triton, the interpreter here
rejects it). Tile order is grouped (GROUP_M row tiles share a column of W tiles in L2); `persistent` launches one
program per SM looping over tiles (optionally warp-specialised, where the Triton build supports it on the GPU).

CPU: `TRITON_INTERPRET=1` runs every variant (tests/test_gemm_triton.py). The interpreter's bf16 `tl.dot` is
broken (garbage), so there the operands are widened to fp32 first (bf16 products are exact in fp32), and bf16
stores round to nearest even by integer arithmetic (the interpreter truncates on `.to`), as `fused.py` does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from h3direct.dit import fused

triton = fused.triton
if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except Exception:  # pragma: no cover - Triton builds without host tensor descriptors
        TensorDescriptor = None
else:  # pragma: no cover
    TensorDescriptor = None

EPI_PLAIN, EPI_SWIGLU, EPI_RESIDUAL, EPI_QK_ROPE, EPI_QK_ROPE_PAIRED = 0, 1, 2, 3, 4
_OUT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@dataclass(frozen=True)
class Config:
    """One kernel configuration. bm/bn/bk: tile; group_m: row tiles per group of the swizzled order; stages: software
    pipeline depth; warps: per program; tma: descriptor loads (else pointer loads); persistent: one program per SM;
    ws: warp specialisation of the persistent loop (`tl.range(..., warp_specialize=True)`); tma_store: the plain /
    SwiGLU / rope epilogues store through a descriptor (else pointer stores; its staging buffer costs shared memory:
    with it a 128x256x64 tile fits 3 pipeline stages in the H200's 227 KiB, without it 4)."""

    bm: int = 128
    bn: int = 256
    bk: int = 64
    group_m: int = 8
    stages: int = 3
    warps: int = 8
    tma: bool = True
    persistent: bool = False
    ws: bool = False
    tma_store: bool = True

    def __post_init__(self):
        for name in ("bm", "bn", "bk"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Config.{name} = {v}: a power of two >= 16")
        if self.ws and not self.persistent:
            raise ValueError("Config.ws needs persistent=True (it specialises the persistent tile loop)")

    @property
    def name(self) -> str:
        kind = ("P" if self.persistent else "N") + ("ws" if self.ws else "") + ("-tma" if self.tma else "-ptr")
        kind += "" if self.tma_store or not self.tma else "-pst"
        return f"{kind}-{self.bm}x{self.bn}x{self.bk}-g{self.group_m}-s{self.stages}-w{self.warps}"


# the table the entry points pick from, by (N, K) of the call; anything else takes DEFAULT. Filled from the H200
# sweep (benchmarks/tgemm_bench.py prints the winners); until then the configuration Triton's Hopper tutorials use.
DEFAULT = Config()
TABLE: dict[tuple[int, int], Config] = {}


def config_for(n: int, k: int, epilogue: int = EPI_PLAIN) -> Config:
    cfg = TABLE.get((n, k), DEFAULT)
    if epilogue == EPI_QK_ROPE and cfg.bn != 128:
        cfg = Config(**{**cfg.__dict__, "bn": 128})
    return cfg


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# ---- kernel ---------------------------------------------------------------------------------------------------

if triton is not None:
    def _gemm_kernel(a, b, c, M, N, K, stride_am, stride_bn, stride_cm,
                     e_ptr, e_idx, e_tab, stride_e, stride_ts, stride_tj, stride_ta, stride_tb, R, HEADS, eps,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                     TMA: tl.constexpr, TMA_STORE: tl.constexpr, WS: tl.constexpr, EPI: tl.constexpr,
                     OUT: tl.constexpr,
                     EVEN_K: tl.constexpr, I64: tl.constexpr, INTERPRET: tl.constexpr):
        # a, b, c: tensors (pointer mode) or TensorDescriptors (TMA). One loop over tiles: the grid is either one
        # program per tile (one iteration each) or one per SM (persistent). Epilogue arguments (by EPI):
        #   residual: e_ptr = gate [n_rows, N] (row stride stride_e), e_idx = [M] int32 adaLN row (-1: skip);
        #   qk rope:  e_ptr = norm weights [2, BN] (q, k), e_tab = rotation table, R rotated pairs, HEADS per third.
        # I64: 64-bit output offsets (else 32-bit, when they fit: fewer registers in the epilogue).
        num_pid_m = (M + BM - 1) // BM
        num_pid_n = (N + BN - 1) // BN
        num_tiles = num_pid_m * num_pid_n
        k_tiles = (K + BK - 1) // BK
        rk = tl.arange(0, BK)
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), warp_specialize=WS):
            # grouped order: GROUP_M consecutive row tiles sweep the column tiles together (W tiles stay in L2)
            in_group = GROUP_M * num_pid_n
            first_m = (tile // in_group) * GROUP_M
            size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
            pid_m = first_m + (tile % in_group) % size_m
            pid_n = (tile % in_group) // size_m
            off_m = pid_m * BM
            off_n = pid_n * BN
            rm = off_m + tl.arange(0, BM)
            rn = off_n + tl.arange(0, BN)
            acc = tl.full((BM, BN), 0.0, tl.float32)  # (tl.zeros: compiled-mode only once imported)
            if TMA:
                for kt in range(k_tiles):
                    xa = a.load([off_m, kt * BK])
                    wb = b.load([off_n, kt * BK])
                    if INTERPRET:  # the interpreter's bf16 dot is broken; bf16 products are exact in fp32
                        acc = tl.dot(xa.to(tl.float32), wb.to(tl.float32).T, acc, input_precision="ieee")
                    else:
                        acc = tl.dot(xa, wb.T, acc)
            else:
                # rows past M / N read row 0 (in bounds, never stored): no mask on the M and N axes
                am = tl.where(rm < M, rm, 0).to(tl.int64)
                bn = tl.where(rn < N, rn, 0).to(tl.int64)
                a_ptrs = a + am[:, None] * stride_am + rk[None, :]
                b_ptrs = b + bn[:, None] * stride_bn + rk[None, :]
                for kt in range(k_tiles):
                    if EVEN_K:
                        xa = tl.load(a_ptrs)
                        wb = tl.load(b_ptrs)
                    else:
                        kin = (kt * BK + rk) < K
                        xa = tl.load(a_ptrs, mask=kin[None, :], other=0.0)
                        wb = tl.load(b_ptrs, mask=kin[None, :], other=0.0)
                    if INTERPRET:
                        acc = tl.dot(xa.to(tl.float32), wb.to(tl.float32).T, acc, input_precision="ieee")
                    else:
                        acc = tl.dot(xa, wb.T, acc)
                    a_ptrs += BK
                    b_ptrs += BK

            # ---- epilogue: fp32 in, one rounding at the store
            row_in = rm < M
            if I64:
                row_off = rm.to(tl.int64)
            else:
                row_off = rm
            if EPI == 1:
                # interleaved columns: (gate j, up j) adjacent -> [BM, BN/2] each
                g, u = tl.split(tl.reshape(acc, (BM, BN // 2, 2)))
                if INTERPRET:
                    y = g / (1.0 + tl.exp(-g)) * u
                else:
                    y = libdevice.div_rn(g, 1.0 + libdevice.exp(-g)) * u
                off_c = off_n // 2
                rc = off_c + tl.arange(0, BN // 2)
                n_out = N // 2
            elif EPI == 2:
                r = tl.load(e_idx + rm, mask=row_in, other=-1)
                live = (row_in & (r >= 0))[:, None] & (rn < N)[None, :]
                r = tl.maximum(r, 0)  # (n_rows · stride_e < 2^31: checked on the host)
                gate = tl.load(e_ptr + r[:, None] * stride_e + rn[None, :], mask=live, other=0.0).to(tl.float32)
                x_ptrs = c + row_off[:, None] * stride_cm + rn[None, :]
                x = tl.load(x_ptrs, mask=live, other=0.0).to(tl.float32)
                y = x + acc * gate
                off_c = off_n
                rc = rn
                n_out = N
            elif EPI == 3:
                # BN = head_dim: this tile is head pid_n of q | k | v; q and k heads: RMSNorm then rotation. v heads
                # take the same arithmetic with identity factors (inv_rms 1, weight 1, table [[1, 0], [0, 1]]), which
                # is exact and lets acc die early (fewer live [BM, BN] tensors: no spills at 128x128, 8 warps)
                third = pid_n // HEADS  # 0 q, 1 k, 2 v
                qk = third < 2
                d = tl.arange(0, BN)
                if INTERPRET:
                    ss = tl.reduce(acc * acc, 1, tl.standard._sum_combine)
                else:
                    ss = tl.sum(acc * acc, axis=1)
                inv_rms = tl.where(qk, 1.0 / tl.sqrt_rn(ss / BN + eps), 1.0)
                lim = tl.where(qk, BN, 0)  # columns that get the norm (all, or none for v): an integer mask
                w = tl.load(e_ptr + tl.minimum(third, 1) * BN + d, mask=d < lim, other=1.0).to(tl.float32)
                nrm = acc * inv_rms[:, None] * w[None, :]
                lo = d < R
                rot = d < 2 * R
                partner = tl.where(lo, d + R, tl.where(rot, d - R, d))
                nrm_p = tl.gather(nrm, tl.broadcast_to(partner[None, :], (BM, BN)), 1)
                # out[j] = T[j,0,0]·n[j] + T[j,0,1]·n[j+R], out[j+R] = T[j,1,0]·n[j] + T[j,1,1]·n[j+R] (j < R);
                # 32-bit offsets (the host checks the table has < 2^31 elements)
                j = tl.where(lo, d, d - R)
                ai = tl.where(lo, 0, 1)
                t_off = tl.where(row_in, rm, 0)[:, None] * stride_ts + (j * stride_tj + ai * stride_ta)[None, :]
                tmask = row_in[:, None] & (d < tl.minimum(2 * R, lim))[None, :]
                c_self = tl.load(e_tab + t_off + (ai * stride_tb)[None, :], mask=tmask, other=1.0).to(tl.float32)
                c_part = tl.load(e_tab + t_off + ((1 - ai) * stride_tb)[None, :], mask=tmask, other=0.0).to(tl.float32)
                y = nrm * c_self + nrm_p * c_part
                off_c = off_n
                rc = rn
                n_out = N
            elif EPI == 4:
                # as EPI 3, but q / k heads' weight rows are in pair order (`qk_pair_order`): tile column 2p holds
                # head dim p and 2p+1 dim p+R (p < R), then the R.. pass-through dims in order; the rotation
                # partners are adjacent columns (a register-local split, no gather), stored back to head order.
                third = pid_n // HEADS
                qk = third < 2
                lim = tl.where(qk, BN, 0)
                x1, x2 = tl.split(tl.reshape(acc, (BM, BN // 2, 2)))
                if INTERPRET:
                    ss = tl.reduce(x1 * x1 + x2 * x2, 1, tl.standard._sum_combine)
                else:
                    ss = tl.sum(x1 * x1 + x2 * x2, axis=1)
                inv_rms = tl.where(qk, 1.0 / tl.sqrt_rn(ss / BN + eps), 1.0)
                p = tl.arange(0, BN // 2)
                paired = p < R
                dim1 = tl.where(paired, p, 2 * p)  # head dim of column 2p (pass-through columns: 2R + 2(p - R))
                dim2 = tl.where(paired, p + R, 2 * p + 1)
                wbase = e_ptr + tl.minimum(third, 1) * BN
                w1 = tl.load(wbase + dim1, mask=dim1 < lim, other=1.0).to(tl.float32)
                w2 = tl.load(wbase + dim2, mask=dim2 < lim, other=1.0).to(tl.float32)
                n1 = x1 * inv_rms[:, None] * w1[None, :]
                n2 = x2 * inv_rms[:, None] * w2[None, :]
                t_off = tl.where(row_in, rm, 0)[:, None] * stride_ts + (p * stride_tj)[None, :]
                tmask = row_in[:, None] & (p < tl.where(qk, R, 0))[None, :]
                t00 = tl.load(e_tab + t_off, mask=tmask, other=1.0).to(tl.float32)
                t01 = tl.load(e_tab + t_off + stride_tb, mask=tmask, other=0.0).to(tl.float32)
                o1 = n1 * t00 + n2 * t01
                t10 = tl.load(e_tab + t_off + stride_ta, mask=tmask, other=0.0).to(tl.float32)
                t11 = tl.load(e_tab + t_off + stride_ta + stride_tb, mask=tmask, other=1.0).to(tl.float32)
                o2 = n1 * t10 + n2 * t11
                y = tl.reshape(tl.join(o1, o2), (BM, BN))
                dcol = tl.reshape(tl.join(dim1, dim2), (BN,))  # head dim of each tile column (q / k heads)
                rc = off_n + tl.where(qk, dcol, tl.arange(0, BN))
                off_c = off_n
                n_out = N
            else:
                y = acc
                off_c = off_n
                rc = rn
                n_out = N

            if OUT == 2 and INTERPRET:  # round to nearest even by integer arithmetic (the interpreter truncates)
                bits = y.to(tl.uint32, bitcast=True)
                y = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            if OUT == 2:
                y = y.to(tl.bfloat16)
            elif OUT == 1:
                y = y.to(tl.float16)
            if EPI == 2:
                tl.store(x_ptrs, y, mask=live)
            elif TMA_STORE:
                c.store([off_m, off_c], y)
            else:
                c_ptrs = c + row_off[:, None] * stride_cm + rc[None, :]
                tl.store(c_ptrs, y, mask=row_in[:, None] & (rc < n_out)[None, :])


_BUILT: dict = {}


def _kernel():
    key = _interpreting()
    k = _BUILT.get(key)
    if k is None:
        k = _BUILT[key] = triton.jit(_gemm_kernel)
    return k


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 3  # CPU interpreter: a few programs, so the persistent loop runs several tiles each


def tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned base addresses and row strides, and unit column stride."""
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               for t in tensors)


def _desc(t: torch.Tensor, block: list[int]):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, epi: int, cfg: Config, *, e_ptr=None, e_idx=None,
            e_tab=None, stride_e=0, tab_strides=(0, 0, 0, 0), rot_pairs=0, heads=1, eps=0.0) -> None:
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"gemm: x [{m}, {k}] and W {list(w.shape)} disagree on K")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("gemm: x and W need unit column stride")
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gemm: x {x.dtype} and W {w.dtype}: both bf16 or both fp16")
    if m == 0:
        return
    tiles = triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn)
    grid = (min(tiles, _num_sms(x.device)),) if cfg.persistent else (tiles,)
    store_tma = cfg.tma and cfg.tma_store and epi in (EPI_PLAIN, EPI_SWIGLU, EPI_QK_ROPE)
    if cfg.tma:
        if TensorDescriptor is None:
            raise RuntimeError("gemm: this Triton has no triton.tools.tensor_descriptor (use a tma=False config)")
        if not tma_ok(x, w, *([out] if store_tma else [])):
            raise ValueError("gemm: TMA config on tensors without 16-byte aligned base / row stride "
                             "(use a tma=False config)")
        a = _desc(x, [cfg.bm, cfg.bk])
        b = _desc(w, [cfg.bn, cfg.bk])
        c = _desc(out, [cfg.bm, cfg.bn // 2 if epi == EPI_SWIGLU else cfg.bn]) if store_tma else out
    else:
        a, b, c = x, w, out
    dummy = out
    _kernel()[grid](
        a, b, c, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        dummy if e_ptr is None else e_ptr, dummy if e_idx is None else e_idx, dummy if e_tab is None else e_tab,
        stride_e, *tab_strides, rot_pairs, heads, float(eps),
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, TMA=cfg.tma, TMA_STORE=store_tma, WS=cfg.ws, EPI=epi,
        OUT=_OUT_CODE[out.dtype], EVEN_K=k % cfg.bk == 0,
        I64=m * out.stride(0) >= 2**31, INTERPRET=_interpreting(),
        num_warps=cfg.warps, num_stages=cfg.stages)


# ---- entry points ---------------------------------------------------------------------------------------------

def linear(x: torch.Tensor, w: torch.Tensor, cfg: Config | None = None) -> torch.Tensor:
    """x [M, K] @ W[N, K]ᵀ -> [M, N] in x's dtype (no bias)."""
    cfg = cfg or config_for(w.shape[0], w.shape[1])
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, w, out, EPI_PLAIN, cfg)
    return out


def linear_swiglu(x: torch.Tensor, w_interleaved: torch.Tensor, cfg: Config | None = None) -> torch.Tensor:
    """fc1 + SwiGLU: x [M, K], W [2F, K] with gate/up rows interleaved (`interleave_gate_up`) -> silu(gate)·up
    [M, F], fp32 inside, one rounding."""
    cfg = cfg or config_for(w_interleaved.shape[0], w_interleaved.shape[1], EPI_SWIGLU)
    n = w_interleaved.shape[0]
    if n % cfg.bn:
        raise ValueError(f"linear_swiglu: 2F = {n} is not a multiple of the tile width {cfg.bn}")
    out = torch.empty(x.shape[0], n // 2, dtype=x.dtype, device=x.device)
    _launch(x, w_interleaved, out, EPI_SWIGLU, cfg)
    return out


def linear_gated_residual_(stream: torch.Tensor, x: torch.Tensor, w: torch.Tensor, gate: torch.Tensor, runs,
                           cfg: Config | None = None) -> torch.Tensor:
    """out_proj / fc2 + gated residual, in place: stream[r] += (x Wᵀ)[r]·gate[row of r] for the rows of `runs`
    (others untouched), fp32 inside, one rounding into the stream. stream [M, N] (unit column stride), gate
    [n_rows, N] (any row stride, any float dtype). Returns stream."""
    m, n = stream.shape
    if x.shape[0] != m or w.shape[0] != n or stream.stride(-1) != 1:
        raise ValueError(f"linear_gated_residual_: stream {list(stream.shape)}, x {list(x.shape)}, "
                         f"W {list(w.shape)} (stream needs unit column stride)")
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    if gate.shape[0] * gate.stride(0) >= 2**31:
        raise ValueError(f"linear_gated_residual_: gate {list(gate.shape)} too large for 32-bit offsets")
    cfg = cfg or config_for(n, w.shape[1], EPI_RESIDUAL)
    idx = fused.row_index(runs, m, stream.device)
    _launch(x, w, stream, EPI_RESIDUAL, cfg, e_ptr=gate, e_idx=idx, stride_e=gate.stride(0))
    return stream


def linear_qk_norm_rope(x: torch.Tensor, w: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                        table: torch.Tensor, eps: float, heads: int, cfg: Config | None = None, *,
                        paired: bool = False) -> torch.Tensor:
    """qkv projection with the q/k per-head RMSNorm + partial split-half rope fused: x [M, K], W [3·H·D, K],
    table [1, M, 1, R, 2, 2] -> [M, 3·H·D] (q | k | v, heads of D), what `rms_norm_rope_` leaves in the eager
    qkv buffer, fp32 inside and one rounding (eager: the projection's, then the norm+rope kernel's).
    paired: W's rows are in `qk_pair_order` (permuted once, e.g. on the NVFP4 rows at load), so the epilogue finds
    each rotation partner in the adjacent column instead of gathering it across the tile; the output is in the
    ordinary head order either way."""
    n = w.shape[0]
    dim = q_weight.shape[0]
    if n != 3 * heads * dim or table.shape[-3] * 2 > dim or table.shape[1] != x.shape[0]:
        raise ValueError(f"linear_qk_norm_rope: W {list(w.shape)}, heads {heads}, head_dim {dim}, "
                         f"table {list(table.shape)}, rows {x.shape[0]}")
    if table.stride(1) * table.shape[1] >= 2**31:
        raise ValueError(f"linear_qk_norm_rope: table {list(table.shape)} too large for 32-bit offsets")
    cfg = cfg or config_for(n, w.shape[1], EPI_QK_ROPE)
    if cfg.bn != dim:
        raise ValueError(f"linear_qk_norm_rope: the tile width {cfg.bn} must be the head dim {dim}")
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    norm_w = torch.stack([q_weight, k_weight]).to(torch.float32).contiguous()
    _launch(x, w, out, EPI_QK_ROPE_PAIRED if paired else EPI_QK_ROPE, cfg, e_ptr=norm_w, e_tab=table,
            tab_strides=(table.stride(1), table.stride(3), table.stride(4), table.stride(5)),
            rot_pairs=table.shape[-3], heads=heads, eps=eps)
    return out


def qk_pair_order(heads: int, dim: int, rot_pairs: int, device=None) -> torch.Tensor:
    """[3·H·D] row order of the qkv weight for `linear_qk_norm_rope(paired=True)`: in every q and k head, dims
    (p, p + R) become rows (2p, 2p + 1) for p < R, the pass-through dims follow in order; v heads unchanged."""
    p = torch.arange(rot_pairs)
    head = torch.cat([torch.stack([p, p + rot_pairs], 1).reshape(-1), torch.arange(2 * rot_pairs, dim)])
    base = torch.arange(3 * heads)[:, None] * dim
    order = torch.where(torch.arange(3 * heads)[:, None] < 2 * heads, base + head[None, :],
                        base + torch.arange(dim)[None, :])
    return order.reshape(-1).to(device)


# ---- fc1 weight layout for the SwiGLU epilogue ----------------------------------------------------------------

def gate_up_order(f: int, device=None) -> torch.Tensor:
    """[2F] row order that interleaves fc1's [gate | up] rows: new row 2j = gate j, 2j+1 = up j."""
    j = torch.arange(f, device=device)
    return torch.stack([j, j + f], dim=1).reshape(-1)


def interleave_gate_up(w: torch.Tensor) -> torch.Tensor:
    """fc1 weight [2F, K] (gate rows, then up rows) -> [2F, K] interleaved for `linear_swiglu`."""
    return w[gate_up_order(w.shape[0] // 2, w.device)]


def permute_nvfp4_rows(packed: torch.Tensor, block_scale: torch.Tensor, order: torch.Tensor, rows: int):
    """An NVFP4 weight's rows reordered before dequantisation (exact: each row's packed codes and block scales are
    independent of the others): packed [rows, K/2] uint8 rows indexed directly; block_scale is in the cuBLAS 128x4
    swizzled layout (not row-major), so it is unswizzled, its rows reordered, and swizzled again. `rows` is the
    unpadded row count, a multiple of 16 (no padding rows to keep in place). Returns (packed, block_scale)."""
    from h3direct.checkpoint.quant import nvfp4

    if rows % 16 or packed.shape[0] != rows or order.numel() != rows:
        raise ValueError(f"permute_nvfp4_rows: {rows} rows (packed {list(packed.shape)}, order {order.numel()}): "
                         "need one index per row, rows a multiple of 16")
    order = order.to(packed.device)
    scales = nvfp4.unswizzle_block_scales(block_scale, rows, 2 * packed.shape[1] // nvfp4.BLOCK)
    return packed[order].contiguous(), nvfp4.swizzle_block_scales(scales[order].contiguous())


def interleave_gate_up_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, rows: int):
    """fc1's NVFP4 weight (rows = 2F) in `linear_swiglu`'s interleaved order (see `permute_nvfp4_rows`)."""
    return permute_nvfp4_rows(packed, block_scale, gate_up_order(rows // 2), rows)


# ---- offline compile (no GPU) -----------------------------------------------------------------------------------

SM90_SHARED_BYTES = 232448  # the H100/H200 per-block shared-memory limit (227 KiB)


def compile_offline(cfg: Config, epi: int = EPI_PLAIN, capability: int = 90) -> dict:
    """Compile the kernel for an NVIDIA target without a GPU (`triton.compile` of the AST with Triton's bundled
    ptxas), with the argument properties of a real call (bf16 tensors, 16-byte aligned pointers and strides, M
    unaligned): lowering errors show up here, and the shared memory the configuration needs. Returns
    {"shared": bytes, "wgmma": whether the dot became warpgroup MMAs, "fits": shared <= the sm_90 limit}."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = triton.jit(_gemm_kernel)
    store_tma = cfg.tma and cfg.tma_store and epi in (EPI_PLAIN, EPI_SWIGLU, EPI_QK_ROPE)

    def desc(rows, cols):
        return f"tensordesc<bf16[{rows},{cols}]>"
    sig = {"a": desc(cfg.bm, cfg.bk) if cfg.tma else "*bf16", "b": desc(cfg.bn, cfg.bk) if cfg.tma else "*bf16",
           "c": desc(cfg.bm, cfg.bn // 2 if epi == EPI_SWIGLU else cfg.bn) if store_tma else "*bf16",
           "e_ptr": "*bf16" if epi == EPI_RESIDUAL else "*fp32", "e_idx": "*i32", "e_tab": "*bf16", "eps": "fp32"}
    for name in ("M", "N", "K", "stride_am", "stride_bn", "stride_cm", "stride_e", "stride_ts", "stride_tj",
                 "stride_ta", "stride_tb", "R", "HEADS"):
        sig[name] = "i32"
    constexprs = {"BM": cfg.bm, "BN": cfg.bn, "BK": cfg.bk, "GROUP_M": cfg.group_m, "TMA": cfg.tma,
                  "TMA_STORE": store_tma, "WS": cfg.ws, "EPI": epi, "OUT": _OUT_CODE[torch.bfloat16],
                  "EVEN_K": True, "I64": False, "INTERPRET": False}
    sig.update(dict.fromkeys(constexprs, "constexpr"))
    names = list(fn.arg_names)
    aligned = ("a", "b", "c", "N", "K", "stride_am", "stride_bn", "stride_cm", "e_ptr", "e_idx", "e_tab", "stride_e",
               "stride_ts")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned if not sig[n].startswith("tensordesc")}
    src = ASTSource(fn, {n: sig[n] for n in names}, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                       options={"num_warps": cfg.warps, "num_stages": cfg.stages})
    shared = int(k.metadata.shared)
    return {"shared": shared, "wgmma": "warp_group_dot" in k.asm["ttgir"], "fits": shared <= SM90_SHARED_BYTES}
