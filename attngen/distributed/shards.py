"""Sharding a sequence over a process group: which rows each rank holds (contiguous or zigzag), and the
collectives every context-parallel call shares."""

from __future__ import annotations

import torch
import torch.distributed as dist

from attngen.errors import ArgumentError
from attngen.distributed.schedule import Chunk, chunks


def _world(group) -> tuple[int, int]:
    """(size, rank) of the group (None: the default one)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ArgumentError("attngen.distributed needs torch.distributed initialised (dist.init_process_group) first")
    return dist.get_world_size(group), dist.get_rank(group)


def _peer(group, rank: int) -> int:
    """A group rank as the global rank point-to-point operations take."""
    return rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, rank)


# Both collectives take the ranks' tensors one after the other along dim 0 (gloo insists on that shape): they are
# passed flat, and viewed as (W, *shape) here. torch 2.13 names them *_single, earlier releases *_tensor.
def _gather_into(output, tensor, group):
    """output (W, *tensor.shape) <- every rank's tensor."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output.view(-1), tensor.contiguous().view(-1), group=group)


def _reduce_scatter_into(output, tensor, group):
    """output <- the sum over the ranks of their tensor[rank] ((W, *output.shape))."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output.view(-1), tensor.contiguous().view(-1), group=group)


def _rows(x, chunk: Chunk):
    """The rows of a chunk in a (B, heads, rows, ...) shard: a view."""
    return x[:, :, chunk.local:chunk.local + chunk.length]


def _dim(x, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise ArgumentError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ArgumentError(f"dim must be a dim of x's {x.dim()}, got {dim}")
    return dim % x.dim()


def shard(x: torch.Tensor, group=None, dim: int = 2, load_balance: str = "zigzag") -> torch.Tensor:
    """This rank's shard of the whole sequence `x` (the same on every rank) along `dim`: with "contiguous" rows
    r * n / W .. (r + 1) * n / W - 1, with "zigzag" chunks r and 2W - 1 - r of 2W, one after the other (a causal
    mask then gives every rank as much work). Differentiable as slicing is: x's gradient is this rank's share."""
    dim = _dim(x, dim)
    world, rank = _world(group)
    parts = [x.narrow(dim, c.start, c.length) for c in chunks(x.shape[dim], world, rank, load_balance)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _assemble(pieces: torch.Tensor, length: int, world: int, load_balance: str) -> torch.Tensor:
    """(W, rows, ...) shards, rows first, as the whole (length, ...) sequence."""
    whole = pieces.new_empty((length, *pieces.shape[2:]))
    for j in range(world):
        for c in chunks(length, world, j, load_balance):
            whole[c.start:c.end] = pieces[j, c.local:c.local + c.length]
    return whole


def _disassemble(whole: torch.Tensor, world: int, load_balance: str) -> torch.Tensor:
    """The whole (length, ...) sequence, rows first, as (W, rows, ...) shards."""
    length = whole.shape[0]
    pieces = whole.new_empty((world, length // world, *whole.shape[1:]))
    for j in range(world):
        for c in chunks(length, world, j, load_balance):
            pieces[j, c.local:c.local + c.length] = whole[c.start:c.end]
    return pieces


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, load_balance):
        world, _ = _world(group)
        ctx.group, ctx.dim, ctx.load_balance, ctx.world = group, dim, load_balance, world
        rows_first = x.movedim(dim, 0).contiguous()
        pieces = rows_first.new_empty((world, *rows_first.shape))
        _gather_into(pieces, rows_first, group)
        return _assemble(pieces, world * rows_first.shape[0], world, load_balance).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        pieces = _disassemble(grad.movedim(ctx.dim, 0), ctx.world, ctx.load_balance).contiguous()
        mine = pieces.new_empty(pieces.shape[1:])
        _reduce_scatter_into(mine, pieces, ctx.group)
        return mine.movedim(0, ctx.dim), None, None, None


def unshard(x: torch.Tensor, group=None, dim: int = 2, load_balance: str = "zigzag") -> torch.Tensor:
    """The whole sequence from every rank's shard `x` along `dim` (shard's inverse, on every rank; an all-gather).
    Differentiable: each rank's shard gets the sum over the ranks of their gradients' rows of it (every rank's
    loss counts, as a reduce-scatter)."""
    dim = _dim(x, dim)
    return _Unshard.apply(x, group, dim, load_balance)
