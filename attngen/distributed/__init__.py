"""attngen.distributed: context-parallel attention over torch.distributed (NCCL on GPUs, gloo on the CPU).

A long sequence is split over the ranks of a process group; each rank holds its shard of q, k and v and gets
its shard of O (and LSE) and of the gradients, equal to what one process computes on the whole sequence:
masks and scores see the whole sequence's positions and lengths, and pairs of a query chunk and a key chunk
that the mask leaves empty are never computed.

    import attngen, attngen.distributed as cp_
    attn = attngen.build("specs/causal.attn")
    cp = cp_.context_parallel(attn, load_balance="zigzag", schedule="auto")
    q, k, v = (cp_.shard(x, dim=2) for x in (q, k, v))     # (B, heads, rows of this rank, D)
    out = cp(q, k, v, **inputs)                             # inputs whole on every rank
"""

from attngen.distributed.context import ContextParallel
from attngen.distributed.schedule import LOAD_BALANCES, SCHEDULES, Plan, chunks
from attngen.distributed.shards import shard, unshard


def context_parallel(attn, group=None, load_balance: str = "zigzag", schedule: str = "auto",
                     reduce_input_grads: bool = True) -> ContextParallel:
    """A context-parallel call of a built attention over `group` (None: the default group).

    load_balance: "zigzag" (rank r holds chunks r and 2W-1-r of 2W: even work under causal masks) or
    "contiguous" (rank r holds the r-th W-th), as `shard` splits. schedule: "ring" (K/V shards travel from rank
    to rank, each step's transfer under its kernels; partial results merge by LSE), "allgather" (K/V gathered
    once, dK/dV reduce-scattered) or "auto" (by the model `cp.explain(q, k, v)` states). reduce_input_grads:
    sum the learnable inputs' gradients over the group (every rank's loss counts, as for q, k and v); pass
    False when a data-parallel wrapper already reduces them over the group.
    """
    return ContextParallel(attn, group, load_balance, schedule, reduce_input_grads)


__all__ = ["ContextParallel", "LOAD_BALANCES", "Plan", "SCHEDULES", "chunks", "context_parallel", "shard", "unshard"]
