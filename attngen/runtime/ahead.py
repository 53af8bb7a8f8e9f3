"""A call's kernels compiled ahead and side by side: the first call of each plan compiles every kernel its
forward and backward will launch, in a pool of threads, before it launches any.

Triton compiles a kernel at its first launch, so a training step's first call compiled the forward's kernels,
and its backward then the row terms', the backward's and dQ's finish kernel, one after another. Here the call's
host code first runs once over meta stand-ins of its tensors (same shapes, strides, dtypes and 16-byte
alignment, no memory) while each launch is instead handed to Triton as a compile (its `warmup`: the same
argument facts and options decide the same specialization) under Triton's AsyncCompileMode, whose compiles
run in the pool; the launcher's C module is built and the binary loaded there too. The long parts of a
compile (LLVM's passes, ptxas and the C compiler, the last two in child processes) run outside the GIL, so
the pool's compiles overlap. The call then runs as usual and finds each kernel compiled.

Nothing the stand-in run computes is kept: its launches launch nothing, its tile tables are built without
being kept, and its outputs are meta tensors, dropped. A launch whose arguments turn out to have other facts
than the stand-ins' (an upstream gradient in another layout) compiles at its launch, as it would without
this. Where Triton's binder and launcher run: triton 3.6 (the families pin it).
"""

import contextvars
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from triton.runtime import _async_compile

from .plans import _backward_plan

# ATTNGEN_COMPILE_AHEAD=0 turns it off: each kernel then compiles at its first launch.
ENABLED = os.environ.get("ATTNGEN_COMPILE_AHEAD", "1").lower() not in ("0", "false", "off", "no")

# Set while a call's host code runs over stand-ins: _launch then compiles instead of launching.
AHEAD = contextvars.ContextVar("attngen_compile_ahead", default=False)

# The last exception a stand-in run raised (the call then compiles at each launch, as without this): tests
# read it, since a call must not fail for a step that only saves time.
LAST_ERROR = None

_POOL = None
_POOL_LOCK = threading.Lock()


def _pool():
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="attngen-compile")
    return _POOL


class _LoadingPool:
    """The pool as AsyncCompileMode's executor: each compile also builds its launcher and loads its binary
    on `device`, in its worker (Triton would do both at the first launch, on the caller's thread, for its
    current device, whose kernel cache the compile goes to)."""

    def __init__(self, device):
        self.device = device

    def submit(self, compile_kernel):
        def compile_and_load():
            kernel = compile_kernel()
            with torch.cuda.device(self.device):
                kernel._init_handles()
            return kernel
        return _pool().submit(compile_and_load)


def _stand_in(t):
    """A meta tensor of t's shape, strides and dtype whose data_ptr() has t's alignment to 16 bytes (the
    fact Triton specializes a pointer on); None for None."""
    if t is None:
        return None
    offset = (t.data_ptr() % 16) // t.element_size()
    extent = offset + 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0)
    return torch.empty(extent, dtype=t.dtype, device="meta").as_strided(t.shape, t.stride(), offset)


def compile_ahead(rt, plan, q, k, v, tensors, sink, dropout, deterministic, backward, packed=None):
    """At the first call of `plan` (and at its first call with a backward), compiles the call's kernels in
    the pool, the backward's too when `backward`, and returns once all are compiled. The arguments are
    Attention.attn's (or a packed call's, `packed` its (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k)) after its checks, as it hands them to the families: q, k, v, the inputs' `tensors`, the
    `sink` rows and `dropout`. Does nothing without a plan, when turned off, off the GPU, or inside another
    AsyncCompileMode."""
    global LAST_ERROR
    if plan is None or plan.compiled >= 1 + backward:
        return
    plan.compiled = 1 + backward
    if not ENABLED or not q.is_cuda or _async_compile.active_mode.get() is not None:
        return
    try:
        with _async_compile.AsyncCompileMode(_LoadingPool(torch.cuda.current_device()), ignore_errors=True):
            stand_in_run(rt, plan, q, k, v, tensors, sink, dropout, deterministic, backward, packed)
    except Exception as e:  # the call compiles at each launch instead; the tests read LAST_ERROR
        LAST_ERROR = e


def stand_in_run(rt, plan, q, k, v, tensors, sink, dropout, deterministic, backward, packed=None):
    """The call's host code (its forward, and its backward when `backward`, with dO in out's layout, as
    the next operation's gradient usually comes) over stand-ins of its tensors, with AHEAD set, so that its
    launches compile and launch nothing; keeps no tile table and counts none."""
    built = rt.table_stats["built"]
    token = AHEAD.set(True)
    try:
        with torch.no_grad():
            mq, mk, mv, msink = map(_stand_in, (q, k, v, sink))
            mtensors = [_stand_in(t) for t in tensors]
            mdropout = (_stand_in(dropout[0]), dropout[1]) if dropout is not None else None
            wanted_sink = msink if sink is not None and sink.requires_grad else None
            if packed is not None:
                offsets = (_stand_in(packed[0]), _stand_in(packed[1]), *packed[2:])
                out, lse = rt._packed_forward(mq, mk, mv, mtensors, *offsets, msink, plan, mdropout)
                if backward:  # autograd hands the packed node a zero dLSE for an LSE the caller did not use
                    do, dlse = torch.empty_like(out), torch.zeros_like(lse)
                    rt._packed_backward(mq, mk, mv, out, lse, do, dlse, mtensors, *offsets,
                                        _backward_plan(plan, do, dlse), deterministic, wanted_sink, mdropout)
                return
            sizes = plan.sizes[:5]
            # A table built here holds nothing (its launches only compile): never kept.
            build = lambda key: rt._build_table(key, sizes, mq.device, mtensors, keep=False)  # noqa: E731
            known = {}  # the forward's tables, which the backward reuses where its tiles agree, as in a call
            out, lse = rt._forward_with_tables(mq, mk, mv, mtensors, known, build, plan, msink, mdropout)
            if backward:
                rt._backward_with_tables(mq, mk, mv, out, lse, torch.empty_like(out), None, mtensors, known, build, plan,
                                         deterministic, wanted_sink, mdropout)
    finally:
        AHEAD.reset(token)
        rt.table_stats["built"] = built
