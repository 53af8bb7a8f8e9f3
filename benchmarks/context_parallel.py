"""Context parallelism on GPUs: what global positions cost a rank's kernels (one GPU), and how a call scales over
W GPUs with NCCL against one GPU and against torch's context_parallel + SDPA.

One GPU: the kernels of the spec with global positions against the plain spec's on the same shard shapes
(`offsets`: a diagonal chunk pair deep in the sequence, whose visited tiles are the plain spec's exactly), and
every rank's pairs and merges of a W-rank zigzag call run one after the other with no communication
(`simulate`: the ranks' compute against one GPU's whole call):

    python benchmarks/context_parallel.py offsets [--shape B,H,L,D] [--json FILE]
    python benchmarks/context_parallel.py simulate --world 8 [--shape B,H,N,D] [--json FILE]

W GPUs, one process each (torchrun): forward+backward of a context-parallel call against one GPU's call on the
whole sequence (scaling efficiency = one GPU's time / (W x the W GPUs' time), the slowest rank's), by each
schedule, and torch's context_parallel + SDPA (causal) as the anchor; --check compares every rank's shards
with one GPU's call:

    torchrun --nproc-per-node W benchmarks/context_parallel.py scaling [--lengths 65536,131072,262144]
        [--specs causal,document_causal,sliding_window] [--schedules auto,ring,allgather] [--check] [--json FILE]

bf16, B=1 H=16 D=128 by default (the anchor's shapes); sliding windows of 4096 keys, documents of 8192 tokens.
`--device cpu --dtype f32` (and `--backend gloo` with torchrun) runs tiny shapes through Triton's interpreter,
to try the script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import attngen
from attngen import testing
from attngen.distributed import context_parallel, schedule as schedules, shard
from attngen.distributed.context import ContextParallel
from attngen.merge import combine

SPECS = {"causal": ("specs/causal.attn", {}), "sliding_window": ("specs/sliding_window.attn", {"window": 4096}),
         "document_causal": ("specs/document_causal.attn", {}), "alibi_causal": ("specs/alibi_causal.attn", {}),
         "learned_rel_bias": ("specs/learned_rel_bias.attn", {})}
DOCUMENT = 8192  # tokens per document of document_causal
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def _bench(fn, device, reps=20):
    """Median ms of fn() (do_bench on a GPU; a plain loop on the CPU, for trying the script)."""
    if device == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=10, rep=200)
    fn()
    times = []
    for _ in range(max(3, reps // 5)):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _inputs(spec, B, H, N, device, dtype):
    """The spec's inputs for a whole sequence of N: documents of DOCUMENT tokens, others at random."""
    inputs = testing.random_inputs(spec, B, H, H, N, N, device=device)
    if "doc" in inputs:
        inputs["doc"] = (torch.arange(N, device=device) // min(DOCUMENT, max(N // 4, 1))).to(torch.int32)
    for name, t in inputs.items():
        if spec.input(name).learnable:
            t.requires_grad_()
    return inputs


def _fwd_bwd(fn, leaves, dout):
    def run():
        out = fn()
        torch.autograd.grad(out, [t for t in leaves if t.requires_grad], dout)
    return run


def offsets(args) -> list[dict]:
    """Per spec: plain spec on an L x L call against the spec with global positions on the diagonal pair of a chunk
    at position 7 L (the same tiles visited), forward and forward+backward."""
    B, H, L, D = (int(x) for x in args.shape.split(","))
    dtype, device = DTYPES[args.dtype], args.device
    rows = []
    for name in args.specs.split(","):
        path, params = SPECS[name]
        attn = attngen.build(path, params=params)
        cp = ContextParallel(attn)
        start, N = 7 * L, 8 * L
        q, k, v = (t.requires_grad_() for t in testing.random_qkv(B, H, H, L, L, D, D, dtype, device=device))
        dout = torch.randn_like(q)
        whole = _inputs(attn.spec, B, H, N, device, dtype)
        local = {n: (t[start:start + L] if attn.spec.input(n).dims == ("KV_LEN",) else t) for n, t in whole.items()}
        s = cp.shifted
        positions = {s.q_start: torch.full((), start, dtype=torch.int32, device=device),
                     s.k_start: torch.full((), start, dtype=torch.int32, device=device),
                     s.q_len: torch.full((), N, dtype=torch.int32, device=device),
                     s.kv_len: torch.full((), N, dtype=torch.int32, device=device)}
        row = {"spec": name, "shape": [B, H, L, D], "dtype": args.dtype, "chunk start": start}
        leaves = [q, k, v, *local.values()]
        for label, fn in (("plain", lambda: attn(q, k, v, **local)),
                          ("global positions", lambda: cp.part(q, k, v, **whole, **positions))):
            with torch.no_grad():
                row[f"{label} fwd ms"] = _bench(fn, device)
            row[f"{label} fwd+bwd ms"] = _bench(_fwd_bwd(fn, leaves + list(whole.values()), dout), device)
        for part in ("fwd", "fwd+bwd"):
            row[f"{part} ratio"] = row[f"global positions {part} ms"] / row[f"plain {part} ms"]
        print(f"{name} B{B} H{H} L{L} D{D} {args.dtype} (a chunk at {start} of {N}): global positions over plain "
              f"fwd {row['fwd ratio']:.3f}x ({row['global positions fwd ms']:.3f} / {row['plain fwd ms']:.3f} ms), "
              f"fwd+bwd {row['fwd+bwd ratio']:.3f}x ({row['global positions fwd+bwd ms']:.3f} / "
              f"{row['plain fwd+bwd ms']:.3f} ms)", flush=True)
        rows.append(row)
    return rows


def simulate(args) -> list[dict]:
    """Per spec: each rank's pairs of a W-rank zigzag call (its kernels and merges, forward, then backward by
    attn.gradients), run one after the other on this GPU, against one GPU's call on the whole sequence."""
    B, H, N, D = (int(x) for x in args.shape.split(","))
    W, dtype, device = args.world, DTYPES[args.dtype], args.device
    rows = []
    for name in args.specs.split(","):
        path, params = SPECS[name]
        attn = attngen.build(path, params=params)
        cp = ContextParallel(attn)
        q, k, v = (t.requires_grad_() for t in testing.random_qkv(B, H, H, N, N, D, D, dtype, device=device))
        dout = torch.randn_like(q)
        inputs = _inputs(attn.spec, B, H, N, device, dtype)
        one = _bench(_fwd_bwd(lambda: attn(q, k, v, **inputs), [q, k, v, *inputs.values()], dout), device)
        sizes = schedules.Sizes(B, H, H, N, N, D, D, q.element_size())
        plan = schedules.plan(attn.spec, W, "zigzag", sizes, "ring")
        with torch.no_grad():
            out, lse = attn(q, k, v, return_lse=True, **inputs)

        def rank_work(r):
            def run():
                for j in range(W):
                    parts = {}
                    for a, b, _ in plan.pairs(r, j):
                        qc, kc = plan.q_chunks[r][a], plan.kv_chunks[j][b]
                        rows_q, rows_k = slice(qc.start, qc.end), slice(kc.start, kc.end)
                        positions = cp._positions(qc, kc.start, sizes, q.device)
                        o, lse_part = cp.part(q[:, :, rows_q], k[:, :, rows_k], v[:, :, rows_k], return_lse=True,
                                              **inputs, **positions)
                        parts[a] = (o, lse_part) if a not in parts else combine([parts[a][0], o], [parts[a][1], lse_part])
                        cp.part.gradients(q[:, :, rows_q], k[:, :, rows_k], v[:, :, rows_k], out[:, :, rows_q],
                                          lse[:, :, rows_q], dout[:, :, rows_q], **inputs, **positions)
            return run

        with torch.no_grad():
            ranks = [_bench(rank_work(r), device) for r in range(W)]
        row = {"spec": name, "shape": [B, H, N, D], "world": W, "one GPU fwd+bwd ms": one,
               "rank fwd+bwd ms": ranks, "compute efficiency": one / (W * max(ranks))}
        print(f"{name} B{B} H{H} N{N} D{D} {args.dtype}: one GPU {one:.2f} ms; {W} zigzag ranks' compute (no "
              f"communication) {min(ranks):.2f}-{max(ranks):.2f} ms: efficiency {row['compute efficiency']:.3f}",
              flush=True)
        rows.append(row)
    return rows


def _time_all(fn, device, reps):
    """The slowest rank's median ms of fn(), every rank starting together."""
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    t = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _torch_anchor(q, k, v, dout, device, reps):
    """torch's context_parallel + SDPA, causal, forward+backward including the sharding (as measured in the issue)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel

    mesh = init_device_mesh(device, (dist.get_world_size(),))

    def run():
        buffers = [q.detach().clone(), k.detach().clone(), v.detach().clone(), dout.clone()]
        # Sharded in place and left so: the shards become leaves that require grad, which cannot be resized back.
        with torch_context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(buffers)):
            ql, kl, vl = (t.requires_grad_() for t in buffers[:3])
            out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
            out.backward(buffers[3])
    return _time_all(run, device, reps)


def scaling(args) -> list[dict]:
    import torch.distributed as dist

    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(args.backend)
    W, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[args.dtype]
    B, H, D = (int(x) for x in args.shape.split(","))
    rows = []
    for N in (int(x) for x in args.lengths.split(",")):
        q, k, v = testing.random_qkv(B, H, H, N, N, D, D, dtype, device=device, seed=1)
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
        for name in args.specs.split(","):
            path, params = SPECS[name]
            attn = attngen.build(path, params=params)
            inputs = _inputs(attn.spec, B, H, N, device, dtype)
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            one = _time_all(_fwd_bwd(lambda: attn(qq, kk, vv, **inputs), [qq, kk, vv], dout), device, args.reps)
            row = {"spec": name, "N": N, "world": W, "shape": [B, H, D], "dtype": args.dtype, "one GPU ms": one}
            for schedule in args.schedules.split(","):
                cp = context_parallel(attn, load_balance="zigzag", schedule=schedule)
                local = [shard(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
                dl = shard(dout, dim=2)
                chosen = cp.plan(*local).schedule
                t = _time_all(_fwd_bwd(lambda: cp(*local, **inputs), local, dl), device, args.reps)
                row[f"{schedule} ms"], row[f"{schedule} runs"] = t, chosen
                row[f"{schedule} efficiency"] = one / (W * t)
                if args.check:
                    row[f"{schedule} max error"] = _check(attn, cp, q, k, v, inputs, dout, local, dl)
            if name == "causal" and not args.no_anchor:
                try:
                    row["torch context_parallel + SDPA ms"] = _torch_anchor(q, k, v, dout, device, args.reps)
                except Exception as e:  # the anchor's API is experimental: report why it did not run
                    row["torch context_parallel + SDPA"] = f"unavailable: {type(e).__name__}: {e}"
            if rank == 0:
                print(json.dumps(row), flush=True)
            rows.append(row)
    dist.destroy_process_group()
    return rows if rank == 0 else []


def _check(attn, cp, q, k, v, inputs, dout, local, dl):
    """The largest |cp - one GPU| over every rank's shards of out, lse, dq, dk, dv, relative to the largest |one GPU|."""
    import torch.distributed as dist

    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = attn(qq, kk, vv, return_lse=True, **inputs)
    dq, dk, dv = torch.autograd.grad(out, [qq, kk, vv], dout)
    mine = [t.detach().requires_grad_() for t in local]
    o, lse_cp = cp(*mine, return_lse=True, **inputs)
    grads = torch.autograd.grad(o, mine, dl)
    worst = 0.0
    for got, want in zip([o, lse_cp, *grads], [out, lse, dq, dk, dv]):
        got, want = got.detach().float(), shard(want.detach(), dim=2).float()
        finite = torch.isfinite(want)
        error = (torch.where(finite, got - want, 0.0).abs().max() / want[finite].abs().max().clamp_min(1e-30)).reshape(1)
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
        worst = max(worst, float(error))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["offsets", "simulate", "scaling"])
    parser.add_argument("--shape", help="offsets: B,H,L,D (a shard's rows); simulate: B,H,N,D; scaling: B,H,D")
    parser.add_argument("--specs", default="causal,sliding_window,document_causal,alibi_causal")
    parser.add_argument("--world", type=int, default=8, help="simulate: the ranks")
    parser.add_argument("--lengths", default="65536,131072,262144", help="scaling: the whole sequence's lengths")
    parser.add_argument("--schedules", default="auto,ring,allgather", help="scaling: the schedules to time")
    parser.add_argument("--check", action="store_true", help="scaling: compare with one GPU's call")
    parser.add_argument("--no-anchor", action="store_true", help="scaling: skip torch's context_parallel")
    parser.add_argument("--reps", type=int, default=10, help="scaling: timed repetitions")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--backend", default="nccl", help="scaling: nccl, or gloo with --device cpu")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    args.shape = args.shape or {"offsets": "1,16,8192,128", "simulate": "1,16,65536,128", "scaling": "1,16,128"}[args.mode]
    rows = {"offsets": offsets, "simulate": simulate, "scaling": scaling}[args.mode](args)
    if args.json and rows:
        import triton

        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "triton": triton.__version__,
                       "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
