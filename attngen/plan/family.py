"""What a kernel family's plan entry says (Family): which specs and targets it serves, which kernels it
provides, by what rule the host picks it for a call, and its tiles. Each family's entry is in its folder
(attngen/families/<name>/family.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from attngen.analysis import Analysis
from attngen.plan.targets import Target

KERNELS: tuple[str, ...] = ("fwd", "bwd_dkdv", "bwd_dq")
# (target, d, dv, dtype, plain) -> ((BLOCK_M, BLOCK_N, num_warps, num_stages[, buffers]), why): planner.Tiles'
# fields of a forward or a backward, given whether the spec's steps are plain (plain_steps): a step of no mask,
# score, sink or sigmoid code holds fewer registers, so it may take wider tiles.
TileRule = Callable[[Target, int, int, str, bool], tuple[tuple[int, ...], str]]


def plain_steps(facts: Analysis) -> bool:
    """Whether the spec's forward and backward steps run no code of its own: no mask, score or sink, softmax
    weights."""
    spec = facts.spec
    return spec.mask is None and spec.score is None and spec.sink is None and spec.normalize == "softmax"


@dataclass(frozen=True)
class Family:
    """A kernel family: `name` is its folder's; `problem(analysis, target)` says why it cannot serve that
    spec on that target (None: it can), `strength` why it is chosen when it can.

    The last family of the registry (attngen.families) provides every kernel and serves every call.
    Another family provides `kernels` (a subset of KERNELS) for the calls its `per_call` rule admits,
    checked by the host on each call's shapes (its folder's runtime.py); the other calls and kernels go
    down the list. `tiles` gives its forward's launch shape per padded head dim pair and dtype, and
    `backward_tiles` its backward's (both given whether the spec's steps are plain), if it has one (it
    then follows the tile tables, built for its tiles); `follows_tables` says whether its forward follows
    the mask's tile tables (built for its tiles) or decides every element of the mask's hull;
    `packed_forward` and `packed_backward` whether its
    forward and backward kernels also serve packed calls (sequences in FlashAttention's varlen layout,
    their grid following the sequences); `gathers_every_tile` whether its kernels load a score's input
    gathers on every tile, not once per tile where the index is constant on it (`attngen explain`);
    `deterministic`, for a family with a backward, (whether its backward runs a spec's deterministic calls,
    how it sums them so, or why it does not); `dropout` whether its kernels apply dropout (a call's
    dropout_p > 0, regenerating the keep-mask in its backward; the others pass such calls on); `fp8_forward`
    whether its forward takes FP8 calls (float8_e4m3fn q, k and v with descale factors; the others pass them
    on)."""
    name: str
    strength: str
    problem: Callable[[Analysis, Target], str | None]
    kernels: tuple[str, ...] = KERNELS
    per_call: str = "every call"
    tiles: TileRule | None = None
    backward_tiles: TileRule | None = None
    follows_tables: bool = False
    packed_forward: bool = False
    packed_backward: bool = False
    gathers_every_tile: bool = False
    deterministic: Callable[[Analysis], tuple[bool, str]] | None = None
    dropout: bool = False
    fp8_forward: bool = False

    @property
    def backward_name(self) -> str:
        """The name the host knows this family's backward by (its tiles, its tile table)."""
        return f"{self.name}_bwd"
