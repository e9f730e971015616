"""Block-wise FP8 parameter all-gather: ``fully_shard(..., fp8_all_gather=Float8AllGather())``.

Eligible parameters (2-D, at least ``min_numel`` elements) are sent as ``float8_e4m3fn`` codes with
one fp32 scale per tile (``"128x128"``: 128 rows x 128 columns, DeepSeek-V3's weight tiles;
``"1x128"``: one row x 128 columns); every other parameter of the bucket is sent in the compute
dtype (``MixedPrecisionPolicy.param_dtype``) as before. Master weights, gradients and the
reduce-scatter are unchanged: the codes are a communication format only, the forward and backward
compute with the dequantized values (a straight-through estimator for the weights' gradients).

[Note: FP8 all-gather invariant]
*No tile crosses a rank boundary*, so each rank quantizes its own segment locally and the gathered,
dequantized tensor equals quantizing the full tensor unsharded with the same tiles, bitwise, for
every world size and plan. The runtime asks the planner for it: an eligible parameter's
``TensorSpec.align_rows`` is the tile height (128, or 1 for ``"1x128"``), and the planner allows a
rank boundary inside that tensor only where it is *both* a block boundary of the optimizer's spec
*and* a multiple of ``align_rows`` rows (the common coarsening of the two specs):

- ``elements(g)`` (AdamW g=1, 8-bit AdamW g=256): cuts at multiples of ``lcm(g, 128 * cols)``,
  i.e. ``128``-row strips (or a multiple of them when ``g`` does not divide ``128 * cols``);
- ``rows(k)`` (Shampoo): ``rows(lcm(k, 128))``, e.g. ``rows(1024)`` stays ``rows(1024)``;
- ``whole()`` (Muon): already satisfied (no cut inside the matrix); ``whole(row_splits=...)``: only
  the head boundaries that are multiples of 128 rows; a matrix the even layout must split is cut
  only on 128-row boundaries.

The optimizer's spec recorded on the parameter (``RaggedShard.spec``) is unchanged (Muon still sees a
matrix); only where ranks may cut is restricted. Tiles at the right and bottom edges may be
partial (``[300, 200]`` has 3 x 2 tiles of 128x128, the last ones 44 rows / 72 columns).

Per tile: ``scale = amax / 448`` (448 = e4m3's largest finite value; an all-zero tile gets scale 1),
``code = clamp(x / scale, -448, 448).to(float8_e4m3fn)``; dequantize ``(code.float() * scale)`` cast to
the compute dtype. Quantization reads the fp32 master shard (not a bf16 copy).

[Note: FP8 byte regions]
Rank ``r``'s part of the bucket travels as one byte region: its compute-dtype pieces (segment
order), then the fp32 scales of its FP8 pieces, then their codes (one byte per element), each
section 16-byte aligned. Region sizes are pure functions of the plan, so every rank knows every
region; the bucket moves with the bucket's own gather machinery over a byte "plan" of these regions
(a second ``DistributedBuffer`` of ``uint8``): one ``all_gather_single`` for an even bucket (regions
padded to the largest), one group of per-owner broadcasts (gloo) or one list ``all_gather`` (NCCL)
for a ragged one; the same single collective as without FP8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .plan import elements
from .plan import BucketPlan, Layout, Placement
from .plan import RaggedLayout

__all__ = ["Float8AllGather", "quantize_blockwise", "dequantize_blockwise", "E4M3_MAX"]

E4M3_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value."""

_TILES = {"128x128": (128, 128), "1x128": (1, 128)}
_ALIGN = 16  # bytes: every section of a region starts on this boundary (views of any dtype)


@dataclass(frozen=True, kw_only=True)
class Float8AllGather:
    """Communicate eligible parameters in ``float8_e4m3fn`` with one fp32 scale per tile."""

    tile: str = "128x128"
    """``"128x128"`` (a scale per 128x128 tile) or ``"1x128"`` (a scale per 128 columns of one row)."""
    min_numel: int = 128 * 128
    """Parameters with fewer elements stay in the compute dtype (as do all that are not 2-D)."""

    def __post_init__(self) -> None:
        if self.tile not in _TILES:
            raise ValueError(f"Float8AllGather.tile must be one of {sorted(_TILES)}, got {self.tile!r}")
        if not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"Float8AllGather.min_numel must be an int >= 0, got {self.min_numel!r}")

    @property
    def tile_shape(self) -> tuple[int, int]:
        return _TILES[self.tile]

    def eligible(self, shape: tuple[int, ...]) -> bool:
        """Whether a parameter of ``shape`` is gathered in FP8 (decided on the global shape)."""
        return len(shape) == 2 and math.prod(shape) >= max(self.min_numel, 1)


def num_tiles(rows: int, cols: int, tile: tuple[int, int]) -> tuple[int, int]:
    return -(-rows // tile[0]), -(-cols // tile[1])


def quantize_blockwise(
    x: torch.Tensor, tile: tuple[int, int], *, codes: torch.Tensor | None = None, scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (2-D, rows x cols) to ``(codes [rows, cols] e4m3fn, scales [tr, tc] fp32)`` per tile
    (edge tiles partial). ``codes`` / ``scales``: optional outputs to write into."""
    rows, cols = x.shape
    tr, tc = num_tiles(rows, cols, tile)
    th, tw = tile
    xf = x.float()
    pr, pc = tr * th - rows, tc * tw - cols
    padded = torch.nn.functional.pad(xf.abs(), (0, pc, 0, pr)) if (pr or pc) else xf.abs()
    amax = padded.view(tr, th, tc, tw).amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    full = s.repeat_interleave(th, dim=0)[:rows].repeat_interleave(tw, dim=1)[:, :cols]
    q = (xf / full).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    if codes is not None:
        codes.copy_(q)
        q = codes
    if scales is not None:
        scales.copy_(s)
        s = scales
    return q, s


def dequantize_blockwise(
    codes: torch.Tensor, scales: torch.Tensor, tile: tuple[int, int], *, dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: ``codes.float() * scale`` per tile, cast to ``dtype``."""
    rows, cols = codes.shape
    th, tw = tile
    full = scales.repeat_interleave(th, dim=0)[:rows].repeat_interleave(tw, dim=1)[:, :cols]
    y = codes.float() * full
    if out is None:
        return y.to(dtype)
    out.copy_(y)
    return out


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True, kw_only=True)
class _Piece:
    """One tensor's piece in one rank's byte region."""

    index: int  # placement index in the bucket
    start: int  # element range of the tensor held by the rank
    end: int
    seg_offset: int  # where it sits in that rank's element segment
    fp8: bool
    hp_offset: int = 0  # compute-dtype pieces: element offset in the region's compute-dtype section
    scale_offset: int = 0  # fp8 pieces: fp32 offset in the scales section; scale grid shape
    scale_shape: tuple[int, int] = (0, 0)
    code_offset: int = 0  # fp8 pieces: byte offset in the codes section


@dataclass(frozen=True, kw_only=True)
class _Region:
    pieces: tuple[_Piece, ...]
    hp_numel: int
    scales_byte_offset: int
    scales_numel: int
    codes_byte_offset: int
    nbytes: int


class Float8Gather:
    """The FP8 all-gather of one bucket (see [Note: FP8 byte regions])."""

    def __init__(
        self, *, plan: BucketPlan, fp8: list[bool], config: Float8AllGather, param_dtype: torch.dtype,
        group, device: torch.device, even: bool,
    ) -> None:
        from ._buffer import DistributedBuffer

        self.plan = plan
        self.fp8 = list(fp8)
        self.tile = config.tile_shape
        self.param_dtype = param_dtype
        isz = torch.empty((), dtype=param_dtype).element_size()
        self.regions: list[_Region] = []
        for r in range(plan.world_size):
            pieces, hp, sc, cd = [], 0, 0, 0
            for lp in plan.local_pieces(r):
                pl = plan.placements[lp.index]
                if self.fp8[lp.index]:
                    cols = pl.shape[1]
                    nrows = (lp.end - lp.start) // cols
                    grid = num_tiles(nrows, cols, self.tile)
                    pieces.append(_Piece(index=lp.index, start=lp.start, end=lp.end, seg_offset=lp.seg_offset,
                                         fp8=True, scale_offset=sc, scale_shape=grid, code_offset=cd))
                    sc += grid[0] * grid[1]
                    cd += lp.end - lp.start
                else:
                    pieces.append(_Piece(index=lp.index, start=lp.start, end=lp.end, seg_offset=lp.seg_offset,
                                         fp8=False, hp_offset=hp))
                    hp += lp.end - lp.start
            s0 = _up(hp * isz)
            c0 = s0 + _up(sc * 4)
            self.regions.append(_Region(pieces=tuple(pieces), hp_numel=hp, scales_byte_offset=s0, scales_numel=sc,
                                        codes_byte_offset=c0, nbytes=_up(c0 + cd)))
        sizes = [g.nbytes for g in self.regions]
        if even:
            sizes = [max(sizes, default=0)] * len(sizes)
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + s)
        placements = tuple(
            Placement(name=f"rank{r}", shape=(g.nbytes,), spec=elements(1), offset=bounds[r],
                      shard=RaggedLayout((g.nbytes,), tuple(min(max(b - bounds[r], 0), g.nbytes) for b in bounds)))
            for r, g in enumerate(self.regions)
        )
        byte_plan = BucketPlan(name=f"{plan.name}/fp8", layout=Layout.EVEN if even else Layout.RAGGED,
                               placements=placements, rank_bounds=tuple(bounds), itemsize=1)
        self.bounds = bounds
        self.buffer = DistributedBuffer(byte_plan, group=group, device=device, dtype=torch.uint8)
        # No persistent byte segment: ``pack`` builds this rank's region for each gather (transient).
        self.buffer.segment = torch.empty(0, dtype=torch.uint8, device=self.buffer.device)
        self.rank = self.buffer.rank

    @property
    def total_nbytes(self) -> int:
        return self.bounds[-1]

    def _sections(self, flat: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = self.regions[r]
        hp = flat[: g.hp_numel * self.param_dtype.itemsize].view(self.param_dtype)
        sc = flat[g.scales_byte_offset : g.scales_byte_offset + 4 * g.scales_numel].view(torch.float32)
        cd = flat[g.codes_byte_offset : g.codes_byte_offset + (g.nbytes - g.codes_byte_offset)]
        return hp, sc, cd.view(torch.float8_e4m3fn)

    def pack(self, segment: torch.Tensor) -> torch.Tensor:
        """This rank's byte region from its fp32 master segment (quantizing its FP8 pieces)."""
        send = torch.zeros(self.buffer.segment_numel, dtype=torch.uint8, device=segment.device)
        g = self.regions[self.rank]
        hp, sc, cd = self._sections(send, self.rank)
        with torch.no_grad():
            for pc in g.pieces:
                n = pc.end - pc.start
                x = segment[pc.seg_offset : pc.seg_offset + n]
                if not pc.fp8:
                    hp[pc.hp_offset : pc.hp_offset + n].copy_(x)
                    continue
                cols = self.plan.placements[pc.index].shape[1]
                quantize_blockwise(
                    x.view(n // cols, cols), self.tile,
                    codes=cd[pc.code_offset : pc.code_offset + n].view(n // cols, cols),
                    scales=sc[pc.scale_offset : pc.scale_offset + pc.scale_shape[0] * pc.scale_shape[1]].view(
                        pc.scale_shape
                    ),
                )
        return send

    def unpack(self, recv: torch.Tensor, out: torch.Tensor) -> None:
        """Decode every rank's region of the gathered bytes into the flat compute-dtype buffer
        ``out`` (the bucket's ``total_numel`` elements; padding left untouched)."""
        with torch.no_grad():
            for r, g in enumerate(self.regions):
                if g.nbytes == 0:
                    continue
                flat = recv[self.bounds[r] : self.bounds[r] + g.nbytes]
                hp, sc, cd = self._sections(flat, r)
                for pc in g.pieces:
                    pl = self.plan.placements[pc.index]
                    n = pc.end - pc.start
                    dst = out[pl.offset + pc.start : pl.offset + pc.end]
                    if not pc.fp8:
                        dst.copy_(hp[pc.hp_offset : pc.hp_offset + n])
                        continue
                    cols = pl.shape[1]
                    dequantize_blockwise(
                        cd[pc.code_offset : pc.code_offset + n].view(n // cols, cols),
                        sc[pc.scale_offset : pc.scale_offset + pc.scale_shape[0] * pc.scale_shape[1]].view(
                            pc.scale_shape
                        ),
                        self.tile, dtype=self.param_dtype, out=dst.view(n // cols, cols),
                    )


def tile_aligned(placement: Placement, tile_rows: int) -> bool:
    """Every rank boundary of ``placement`` falls on a multiple of ``tile_rows`` rows (pure)."""
    cols = placement.shape[1]
    unit = tile_rows * cols
    n = placement.numel
    return all(b in (0, n) or b % unit == 0 for b in placement.shard.bounds)
