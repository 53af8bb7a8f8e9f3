"""Chooses tile sizes for the three kernels from the target's shared memory, head dims and dtype, and records why."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from attngen import ir
from attngen import families as registry
from attngen.analysis import Analysis
from attngen.runtime import shared
from attngen.plan import visits as tile_visits
from attngen.plan.families import KERNELS, Family, choose_families
from attngen.plan.family import plain_steps
from attngen.plan.targets import Target

PlanDtype = Literal["f16", "bf16", "f32"]

DTYPES: tuple[str, ...] = tuple(shared._DTYPES.values())
HEAD_DIMS: tuple[int, ...] = (16, 32, 64, 128, 256)
ELEMENT_BYTES = {dtype: ir.DTYPE_BYTES[dtype] for dtype in DTYPES}

# Shared memory the compiler may need beyond the operand tiles (layout conversions, reductions).
HEADROOM_BYTES = 8 * 1024
MAX_REGISTERS_PER_THREAD = 255
# Pointers, offsets, loop counters, m_i / l_i and the like, per thread.
REGISTER_OVERHEAD = 32
MAX_WARPS = 8
MIN_BLOCK = shared._MIN_BLOCK
# On the GPU, head dims that are not powers of two get tiles at least this wide. Found by fuzzing on
# an H200 (Triton 3.6): with both head dims padded and the value tile narrower (D=17 with DV<=12,
# D=40 or 65 with DV<=23), the forward kernel with 128-row tiles returned wrong outputs or faulted
# (an illegal address, though compute-sanitizer saw no out-of-bounds access: a code generation
# fault for narrow masked tiles). In a sweep of (D, DV) (tools/head_dim_sweep.py, results in
# benchmarks/history/results/2026-11-30-h200-s3-head-dims.txt) every pair ran correctly, forward and
# backward, with both widths raised to 64.
MASKED_WIDTH_FLOOR = 64

INTERPRETER_TILES_REASON = (
    "interpreter: BLOCK_M=BLOCK_N=16, 4 warps, 1 stage for every kernel: the CPU interpreter "
    "has no shared-memory or register limits, and small tiles make tests cross several tiles"
)


class Tiles(BaseModel):
    """The launch shape of one kernel: its two tile sizes, warps per program and pipeline depth, and
    how many copies of its resident tile it holds (the persistent Hopper forward's Q: with two, the next
    work item's Q loads while this one computes)."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    buffers: int = 1

    def short(self) -> str:
        buffers = f" {self.buffers}buf" if self.buffers > 1 else ""
        return f"{self.block_m}x{self.block_n} {self.num_warps}w/{self.num_stages}s{buffers}"


class KernelPlan(BaseModel):
    """The tiles of all three kernels for one (padded head dim, padded value head dim, dtype), and
    those of the other families' kernels (`family_tiles`: (family, tiles) pairs)."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    head_dim_pad: int
    head_dim_v_pad: int
    dtype: PlanDtype
    fwd: Tiles
    bwd_dkdv: Tiles
    bwd_dq: Tiles
    reasons: tuple[str, ...]
    family_tiles: tuple[tuple[str, Tiles], ...] = ()


class Plan(BaseModel):
    """Every KernelPlan one target needs: each padded head dim pair and dtype the kernels accept."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    target: str
    entries: tuple[KernelPlan, ...]
    # The kernel families of the module, in the host's order of preference, the one that serves every call
    # last (plan.families): each one's templates and host code are in its folder, attngen/families/<family>/.
    families: tuple[str, ...] = registry.FAMILIES[-1:]
    family_reason: str = ""
    narrow: bool = False  # analysis.is_narrow: the starting tiles were the narrow mask's
    # How the kernels find the mask's tiles (plan.visits): closed form, a static table or a table per call.
    visits: tile_visits.Visits = tile_visits.CLOSED
    visits_reason: str = ""
    one_launch_backward: bool = True
    masked_width_floor: int = MIN_BLOCK

    @property
    def launch_reason(self) -> str:
        """Why the backward pass is one launch or two."""
        if self.one_launch_backward:
            return ("backward: dK/dV and dQ programs in one launch (FlashAttention-2's and FlexAttention's "
                    "layout: dQ programs fill the SMs that dK/dV's last wave leaves)")
        return ("backward: dK/dV and dQ as two launches on two streams, each with its own warp count "
                "(the mask is narrow: small dK/dV tiles with 4 warps beat one launch of 8-warp tiles)")

    def widths(self, head_dim: int, head_dim_v: int) -> tuple[int, int]:
        """The tile widths of the two head dims: each rounded up to a power of two >= 16, and when
        either is not a power of two (its loads are masked), both at least `masked_width_floor`."""
        _check_head_dim("head_dim", head_dim)
        _check_head_dim("head_dim_v", head_dim_v)
        return shared._tile_widths(head_dim, head_dim_v, self.masked_width_floor)

    def lookup(self, head_dim: int, head_dim_v: int, dtype: str) -> KernelPlan:
        """The entry for these (unpadded) head dims and dtype, at their tile widths (`widths`)."""
        d, dv = self.widths(head_dim, head_dim_v)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        for entry in self.entries:
            if (entry.head_dim_pad, entry.head_dim_v_pad, entry.dtype) == (d, dv, dtype):
                return entry
        raise ValueError(f"plan for target {self.target!r} has no entry for head_dim {d}, "
                         f"head_dim_v {dv}, dtype {dtype}")

    def summary(self) -> str:
        """One line per entry: tiles as BLOCK_MxBLOCK_N warps/stages for each kernel."""
        rows = [f"plan for {self.target}: BLOCK_MxBLOCK_N warps/stages",
                f"{'D':>4} {'DV':>4} {'dtype':<5}  {'fwd':<16} {'bwd_dkdv':<16} bwd_dq"]
        for e in self.entries:
            others = "".join(f"  {family}: {t.short()}" for family, t in e.family_tiles)
            rows.append(f"{e.head_dim_pad:>4} {e.head_dim_v_pad:>4} {e.dtype:<5}  "
                        f"{e.fwd.short():<16} {e.bwd_dkdv.short():<16} {e.bwd_dq.short():<16}{others}".rstrip())
        return "\n".join(rows)


def _check_head_dim(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value > HEAD_DIMS[-1]:
        raise ValueError(f"{name} must be at most {HEAD_DIMS[-1]}, got {value}")


# Starting points (BLOCK_M, BLOCK_N, num_warps, num_stages) for 16-bit inputs, keyed by the
# larger padded head dim (the smallest key >= it applies). From FlexAttention's H100/A100
# defaults, the Triton fused-attention tutorial and FlashAttention-2: the forward and dQ kernels
# keep a tall query tile resident and stream thin key tiles; dK/dV keeps a tall key tile
# resident and streams thin query tiles. f32 halves both blocks.
_Start = tuple[int, int, int, int]
_STARTS: dict[str, dict[str, dict[int, _Start]]] = {
    "sm90": {
        "fwd": {128: (128, 128, 8, 3), 256: (64, 64, 4, 3)},
        "bwd_dkdv": {128: (64, 128, 8, 3), 256: (64, 64, 8, 2)},
        "bwd_dq": {128: (128, 64, 8, 3), 256: (128, 32, 8, 2)},
    },
    "sm80": {
        "fwd": {64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (32, 64, 4, 3)},
        "bwd_dkdv": {64: (32, 128, 4, 3), 128: (64, 128, 8, 3), 256: (64, 64, 8, 2)},
        "bwd_dq": {128: (128, 64, 8, 3), 256: (64, 32, 8, 2)},
    },
}


# Narrow masks (analysis.is_narrow: windows, chunks, documents) start from smaller tiles, since most
# of their tiles are partial. Measured on an H200 (bf16, D=128, B=2 H=16 N=8192, tune_tiles.py):
# forward 64x64/4 warps against 128x128/8: sliding window 0.376 vs 0.427 ms, chunked 0.230 vs 0.290,
# documents 0.324 vs 0.416, but full 2.384 vs 2.204; forward+backward with dK/dV at 32x64/4 warps
# in two launches against 64x128/8 warps in one: sliding 1.581 vs 1.748, chunked 1.018 vs 1.133,
# documents 1.392 vs 1.460, but full 9.574 vs 9.232 and causal 5.128 vs 4.963.
_NARROW_STARTS: dict[str, dict[str, dict[int, _Start]]] = {
    "sm90": {
        "fwd": {128: (64, 64, 4, 3)},
        "bwd_dkdv": {128: (32, 64, 4, 3)},
    },
}


def _generation(target: Target) -> str:
    # Which starting points (a GPU generation, not a kernel family: plan.families): Hopper and
    # datacenter Blackwell share the 227 KiB budget; anything else starts from the Ampere points and
    # is shrunk by its own budget.
    return "sm90" if target.capability is not None and target.capability[0] in (9, 10) else "sm80"


def _start(generation: str, kernel: str, d: int, dv: int, dtype: str, narrow: bool = False) -> Tiles:
    table = _STARTS[generation][kernel]
    if narrow:
        table = {**table, **_NARROW_STARTS.get(generation, {}).get(kernel, {})}
    key = min(k for k in table if k >= max(d, dv))
    bm, bn, warps, stages = table[key]
    if dtype == "f32":
        bm, bn = max(MIN_BLOCK, bm // 2), max(MIN_BLOCK, bn // 2)
    return Tiles(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)


def _kib(n: float) -> str:
    k = n / 1024
    return f"{k:g} KiB" if k == int(k) else f"{k:.1f} KiB"


def smem_bytes(kernel: str, tiles: Tiles, head_dim: int, head_dim_v: int, dtype: str) -> int:
    """Shared memory of one program: its resident tiles plus `num_stages` copies of the streamed ones."""
    resident, streamed = _smem_parts(kernel, tiles, head_dim, head_dim_v, dtype)
    return resident + tiles.num_stages * streamed


def _smem_parts(kernel: str, t: Tiles, d: int, dv: int, dtype: str) -> tuple[int, int]:
    elt = ELEMENT_BYTES[dtype]
    if kernel == "fwd":
        return t.block_m * d * elt, t.block_n * (d + dv) * elt
    if kernel == "bwd_dkdv":
        return t.block_n * (d + dv) * elt, t.block_m * (d + dv) * elt
    if kernel == "bwd_dq":
        return t.block_m * (d + dv) * elt, t.block_n * (d + dv) * elt
    raise AssertionError(kernel)


def _smem_text(kernel: str, t: Tiles, d: int, dv: int, dtype: str) -> str:
    resident, streamed = _smem_parts(kernel, t, d, dv, dtype)
    names = {"fwd": ("Q tile", "(K+V)"), "bwd_dkdv": ("K+V tiles", "(Q+dO)"),
             "bwd_dq": ("Q+dO tiles", "(K+V)")}[kernel]
    return (f"{names[0]} {_kib(resident)} + {t.num_stages} x {names[1]} "
            f"{_kib(t.num_stages * streamed)} = {_kib(resident + t.num_stages * streamed)}")


def _fp32_live(kernel: str, t: Tiles, d: int, dv: int) -> tuple[int, str]:
    """fp32 values one program keeps live in registers, and what they are. A score expression's
    temporaries are not counted: the starting tiles were measured on the catalog's scores."""
    score = t.block_m * t.block_n
    if kernel == "fwd":
        return (score + t.block_m * dv, f"a {t.block_m}x{t.block_n} score tile and a {t.block_m}x{dv} accumulator")
    if kernel == "bwd_dkdv":
        return (2 * score + t.block_n * (d + dv),
                f"two {t.block_n}x{t.block_m} tiles (P^T, dP^T) and "
                f"{t.block_n}x{d} + {t.block_n}x{dv} dK/dV accumulators")
    return (2 * score + t.block_m * d,
            f"two {t.block_m}x{t.block_n} tiles (P, dP) and a {t.block_m}x{d} dQ accumulator")


def registers_per_thread(kernel: str, tiles: Tiles, head_dim: int, head_dim_v: int) -> int:
    """A rough estimate: the live fp32 tiles spread over the program's threads, plus fixed overhead."""
    live, _ = _fp32_live(kernel, tiles, head_dim, head_dim_v)
    threads = tiles.num_warps * 32
    return -(-live // threads) + REGISTER_OVERHEAD


def _registers_fit(target: Target, kernel: str, t: Tiles, d: int, dv: int) -> bool:
    regs = registers_per_thread(kernel, t, d, dv)
    return regs <= MAX_REGISTERS_PER_THREAD and regs * t.num_warps * 32 <= target.registers_per_sm


def _halvings(n: int):
    while n >= MIN_BLOCK:
        yield n
        n //= 2


def _tiles(kernel: str, resident: int, streamed: int, warps: int, stages: int) -> Tiles:
    if kernel == "bwd_dkdv":
        return Tiles(block_m=streamed, block_n=resident, num_warps=warps, num_stages=stages)
    return Tiles(block_m=resident, block_n=streamed, num_warps=warps, num_stages=stages)


def _candidates(kernel: str, start: Tiles, keep_streamed: bool = False):
    """Tiles from `start` down, in order of preference.

    The streamed tile shrinks first (cheapest: it only shortens each loop step), then the
    pipeline depth, then the resident tile (which sets the work and reuse per program); each
    shape is tried with more warps before a smaller one, to spread the registers.
    With `keep_streamed` (the mask is constant on blocks at least as long as the streamed tile),
    two pipeline stages come before a shorter streamed tile: a tile shorter than a block visits
    each block in pieces and doubles the tile table.
    """
    resident0, streamed0 = ((start.block_n, start.block_m) if kernel == "bwd_dkdv"
                            else (start.block_m, start.block_n))
    warps = dict.fromkeys((start.num_warps, max(start.num_warps, MAX_WARPS)))
    for resident in _halvings(resident0):
        if keep_streamed:
            for streamed in _halvings(streamed0):
                for stages in range(start.num_stages, 1, -1):
                    for w in warps:
                        yield _tiles(kernel, resident, streamed, w, stages)
        for stages in range(start.num_stages, 0, -1):
            for streamed in _halvings(streamed0):
                for w in warps:
                    yield _tiles(kernel, resident, streamed, w, stages)


def _scatter_bytes(kernel: str, t: Tiles, gather_bytes: int) -> int:
    """Shared memory beyond the Q/K/V tiles for score-tile-shaped input accesses, `gather_bytes`
    bytes per score element in all (4 for one f32 input indexed by q and k, 1 for a bool layout):
    each BLOCK_M x BLOCK_N gather is pipelined over `num_stages`, and the dQ kernel's atomic
    scatter of a learnable gradient converts layouts (value and address). Measured on an H200
    (bf16, 3 stages): learned_rel_bias (f32) needed 68 KiB beyond the tiles in dQ at 128x64 and
    D=DV=128, and 288 KiB in all at D=64/DV=128."""
    extra = 3 if kernel == "bwd_dq" else 1
    return gather_bytes * (t.num_stages + extra) * t.block_m * t.block_n


def _fit(target: Target, kernel: str, generation: str, d: int, dv: int, dtype: str,
         gather_bytes: int = 0, narrow: bool = False,
         mask_blocks: dict[str, int | None] | None = None) -> tuple[Tiles, list[str]]:
    """The first candidate from the generation's starting point that fits shared memory and registers."""
    start = _start(generation, kernel, d, dv, dtype, narrow)
    streamed_start, streamed_index = ((start.block_m, "q") if kernel == "bwd_dkdv" else (start.block_n, "k"))
    block = (mask_blocks or {}).get(streamed_index) or 0
    keep_streamed = block >= streamed_start
    full_budget = target.smem_per_block - HEADROOM_BYTES
    chosen = next((t for t in _candidates(kernel, start, keep_streamed)
                   if smem_bytes(kernel, t, d, dv, dtype) + _scatter_bytes(kernel, t, gather_bytes) <= full_budget
                   and _registers_fit(target, kernel, t, d, dv)), None)
    if chosen is None:
        raise ValueError(
            f"target {target.name!r} must offer more than {target.smem_per_block} bytes of shared "
            f"memory per block for {kernel} with head_dim {d}, head_dim_v {dv}, {dtype}; "
            f"even 16x16 tiles with 1 stage do not fit")

    t = chosen
    budget = full_budget - _scatter_bytes(kernel, t, gather_bytes)
    regs = registers_per_thread(kernel, t, d, dv)
    _, live_text = _fp32_live(kernel, t, d, dv)
    reasons = [
        f"{kernel}: BLOCK_M={t.block_m} BLOCK_N={t.block_n}, {t.num_warps} warps, "
        f"{t.num_stages} stages: {_smem_text(kernel, t, d, dv, dtype)} <= {_kib(budget)} "
        f"({_kib(target.smem_per_block)} per block less {_kib(HEADROOM_BYTES)} headroom)",
        f"{kernel}: ~{regs} registers per thread <= {MAX_REGISTERS_PER_THREAD}: {live_text} "
        f"in fp32 over {t.num_warps * 32} threads, + {REGISTER_OVERHEAD} overhead",
    ]
    if _scatter_bytes(kernel, t, gather_bytes):
        reasons.append(f"{kernel}: {_kib(_scatter_bytes(kernel, t, gather_bytes))} reserved for "
                       f"gathering inputs indexed by q and k ({gather_bytes} B per score element)")
    if t != start:
        start_smem = smem_bytes(kernel, start, d, dv, dtype)
        if start_smem > budget:
            why = f"needs {_kib(start_smem)} of shared memory > {_kib(budget)}"
        else:
            why = (f"needs ~{registers_per_thread(kernel, start, d, dv)} registers "
                   f"per thread > {MAX_REGISTERS_PER_THREAD}")
        streamed_name = "BLOCK_M" if kernel == "bwd_dkdv" else "BLOCK_N"
        resident_name = "BLOCK_N" if kernel == "bwd_dkdv" else "BLOCK_M"
        reasons.append(
            f"{kernel}: the {generation} {dtype} starting point BLOCK_M={start.block_m} "
            f"BLOCK_N={start.block_n}, {start.num_warps} warps, {start.num_stages} stages {why}; "
            + (f"tried more warps, then down to 2 stages (the mask is constant on blocks of "
               f"{block}), then a smaller {streamed_name}, a smaller {resident_name}"
               if keep_streamed else
               f"tried more warps, then a smaller {streamed_name}, fewer stages, a smaller {resident_name}"))
    return t, reasons


def plan(target: Target, *, gather_bytes: int = 0, narrow: bool = False,
         mask_blocks: dict[str, int | None] | None = None, families: tuple[Family, ...] = (),
         plain: bool = False) -> Plan:
    """Tiles for every padded head dim pair and dtype on `target`.

    `gather_bytes` is what the spec's loads indexed by both q and k read per score element.
    `narrow`: most of the mask's tiles are partial (analysis.is_narrow); smaller tiles, and the
    backward pass as two launches so dK/dV can use fewer warps than dQ.
    `mask_blocks`: for "q" and "k", the length of aligned blocks the mask is constant on, if any
    (analysis.block_steps of a tile-table mask); streamed tiles are kept that long if they can be.
    `families`: the kernel families beside the portable one whose tiles the entries also carry.
    `plain`: the spec's steps run no code of its own (family.plain_steps), which a family's tiles may take
    into account.
    """
    entries = []
    generation = _generation(target)
    for d in HEAD_DIMS:
        for dv in HEAD_DIMS:
            for dtype in DTYPES:
                others = [(f.name, f.tiles(target, d, dv, dtype, plain)) for f in families if f.tiles is not None]
                others += [(f.backward_name, f.backward_tiles(target, d, dv, dtype, plain)) for f in families
                           if f.backward_tiles is not None]
                family_tiles = tuple((name, Tiles(**dict(zip(Tiles.model_fields, shape))))
                                     for name, (shape, _) in others)
                family_reasons = tuple(why for _, (_, why) in others)
                if target.interpreter:
                    tiles = Tiles(block_m=16, block_n=16, num_warps=4, num_stages=1)
                    entries.append(KernelPlan(head_dim_pad=d, head_dim_v_pad=dv, dtype=dtype,
                                              fwd=tiles, bwd_dkdv=tiles, bwd_dq=tiles,
                                              reasons=(INTERPRETER_TILES_REASON, *family_reasons),
                                              family_tiles=family_tiles))
                    continue
                fitted = {k: _fit(target, k, generation, d, dv, dtype, gather_bytes, narrow,
                                  mask_blocks) for k in KERNELS}
                entries.append(KernelPlan(
                    head_dim_pad=d, head_dim_v_pad=dv, dtype=dtype,
                    fwd=fitted["fwd"][0], bwd_dkdv=fitted["bwd_dkdv"][0], bwd_dq=fitted["bwd_dq"][0],
                    reasons=tuple(r for k in KERNELS for r in fitted[k][1]) + family_reasons,
                    family_tiles=family_tiles))
    return Plan(target=target.name, entries=tuple(entries), narrow=narrow,
                one_launch_backward=target.interpreter or not narrow,
                masked_width_floor=MIN_BLOCK if target.interpreter else MASKED_WIDTH_FLOOR)


def plan_for(facts: Analysis, target: Target) -> Plan:
    """The plan of an analysed spec on `target`: the kernel families that serve it, and tiles shaped by
    its gathers and its mask."""
    families, why = choose_families(facts, target)
    # A tile table's mask constant on aligned blocks (a block layout) keeps tiles as long as a block.
    blocks = dict(facts.block_steps) if facts.tile_table else None
    tiles = plan(target, gather_bytes=facts.gather_bytes, narrow=facts.narrow, mask_blocks=blocks,
                 families=families, plain=plain_steps(facts))
    visits, visits_reason = tile_visits.choose(facts)
    return tiles.model_copy(update={"families": tuple(f.name for f in families), "family_reason": why,
                                    "visits": visits, "visits_reason": visits_reason})
