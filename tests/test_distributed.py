"""Context parallelism (attngen.distributed): the plans (pairs the mask leaves empty, how far K/V shards travel,
the transfers every rank posts, the schedule), refused calls, and calls over 2 and 4 processes on gloo, through
Triton's interpreter, whose shards of O, LSE and every gradient match the float64 reference of the whole
sequence within the data-derived tolerance. The spec each rank runs is tested in test_positions.py."""

import json
import math
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attngen
from attngen import intervals
from attngen.distributed import schedule as schedules
from attngen.distributed.shards import _assemble, _disassemble
from attngen.errors import ArgumentError
from attngen.runtime.shared import _empty_in_layout
from attngen.testing import random_inputs, random_qkv
from attngen.testing.tolerances import (FLOOR_ULPS, FP32_EPS, assert_matches_reference, default_floor,
                                        output_error_effect, reference_error, summation_scales)
from conftest import CPU_CALLS

SPECS = Path(__file__).resolve().parent.parent / "specs"
SMALL = {"window": 7, "cap": 2.0, "chunk": 8, "block": 16}


def _spec(name):
    spec = attngen.load_spec(SPECS / f"{name}.attn")[0]
    return attngen.with_params(spec, {p.name: SMALL[p.name] for p in spec.params if p.name in SMALL})


# --- plans ----------------------------------------------------------------------------------------------

def _sizes(N, H=4, HKV=4):
    return schedules.Sizes(1, H, HKV, N, N, 64, 64, 2)


def test_chunks_cover_the_sequence_once():
    for balance in schedules.LOAD_BALANCES:
        for world in (1, 2, 3, 4):
            held = sorted((c.start, c.end) for r in range(world) for c in schedules.chunks(48, world, r, balance))
            assert held[0][0] == 0 and held[-1][1] == 48 and all(a[1] == b[0] for a, b in zip(held, held[1:]))
    assert schedules.chunks(64, 4, 1, "zigzag") == (schedules.Chunk(8, 8, 0), schedules.Chunk(48, 8, 8))
    with pytest.raises(ArgumentError, match="multiple of 8"):
        schedules.chunks(60, 4, 0, "zigzag")


def test_shards_assemble_into_the_sequence_and_back():
    x = torch.arange(48 * 3).view(48, 3)
    for balance in schedules.LOAD_BALANCES:
        pieces = _disassemble(x, 4, balance)
        assert pieces.shape == (4, 12, 3)
        assert torch.equal(_assemble(pieces, 48, 4, balance), x)
        starts = [c.start for c in schedules.chunks(48, 4, 2, balance)]
        assert int(pieces[2, 0, 0]) == starts[0] * 3


def test_causal_pairs_under_zigzag_balance_the_work():
    plan = schedules.plan(_spec("causal"), 4, "zigzag", _sizes(64), "ring")
    work = [sum(2 if c == intervals.TileClass.FULL else 1 for j in range(4) for _, _, c in plan.pairs(r, j))
            for r in range(4)]
    assert len(set(work)) == 1, work  # every rank the same number of (half-)pairs
    assert all(plan.needs[r][j] for r in range(4) for j in range(4))  # each rank's late chunk sees every shard
    assert plan.reach == (3, 3, 3, 3)
    contiguous = schedules.plan(_spec("causal"), 4, "contiguous", _sizes(64), "ring")
    assert contiguous.reach == (3, 2, 1, 0)  # shard j is needed by ranks j..3 only: it never wraps round


def test_a_window_shorter_than_a_shard_moves_keys_one_step():
    plan = schedules.plan(_spec("sliding_window"), 4, "contiguous", _sizes(64), "auto")
    assert plan.reach == (1, 1, 1, 0)
    assert [len(plan.messages(s, backward=False)) for s in range(4)] == [3, 0, 0, 0]
    chunked = schedules.plan(_spec("chunked_causal"), 4, "zigzag", _sizes(64), "auto")
    assert chunked.reach == (0, 0, 0, 0) and chunked.schedule == "ring"  # nothing moves at all


@pytest.mark.parametrize("name, balance", [("causal", "zigzag"), ("sliding_window", "zigzag"),
                                           ("document_causal", "contiguous"), ("full", "contiguous")])
def test_every_rank_holds_the_shards_it_needs_when_it_needs_them(name, balance):
    """Replaying the ring's transfers: a shard reaches a rank exactly at the steps plan.holds says, every rank
    that needs a shard holds it at some step, and the backward's dK/dV sums reach their owner once, having
    passed every rank that added to them."""
    world = 4
    plan = schedules.plan(_spec(name), world, balance, _sizes(64), "ring")
    at = {r: r for r in range(world)}  # rank -> shard held
    visited = {j: [j] for j in range(world)}
    riding, home = {}, {j: 0 for j in range(world)}
    for s in range(world + 1):
        messages = plan.messages(s, backward=True)
        assert len(set(messages)) == len(messages)
        arriving, sums = {}, {}
        for m in messages:
            if m.kind == "kv":
                assert at.get(m.src) == m.shard
                arriving[m.dst] = m.shard
            elif m.kind == "acc":
                assert riding.pop(m.src) == m.shard
                sums[m.dst] = m.shard
            else:
                assert riding.pop(m.src) == m.shard and m.dst == m.shard
                home[m.shard] += 1
        for r in range(world):
            if s < world:
                assert plan.holds(r, s) == at.get(r)
                shard = at.get(r)
                if shard is not None and s > 0 and (plan.needs[r][shard] or sums.get(r) == shard):
                    riding[r] = shard
                    visited[shard].append(r)
        at = arriving
    assert not riding
    for j in range(world):
        assert home[j] == (1 if plan.reach[j] > 0 else 0)
        assert {r for r in range(world) if plan.needs[r][j]} <= set(visited[j])


def test_the_schedule_model_rings_long_shards_and_gathers_short_ones():
    causal = _spec("causal")
    long = schedules.plan(causal, 8, "zigzag", _sizes(128 * 1024, H=16, HKV=16), "auto")
    short = schedules.plan(causal, 8, "zigzag", _sizes(4096, H=16, HKV=16), "auto")
    assert long.schedule == "ring" and short.schedule == "allgather"
    assert "modelled ring" in long.reason and "all-gather" in long.reason
    asked = schedules.plan(causal, 8, "zigzag", _sizes(4096), "ring")
    assert asked.schedule == "ring" and asked.reason.startswith("as asked")
    text = long.explain()
    assert "zigzag sharding" in text and "schedule: ring" in text and "q chunk   0 (rank 0): P . ." in text


def test_calls_that_cannot_run_context_parallel_are_refused():
    from attngen.distributed import context_parallel

    attn = attngen.build(SPECS / "causal.attn")
    cp = context_parallel(attn)
    q = torch.zeros(1, 1, 8, 4)
    with pytest.raises(ArgumentError, match="dropout_p must be 0"):
        cp(q, q, q, dropout_p=0.1)
    with pytest.raises(ArgumentError, match="cu_seqlens_q cannot be passed"):
        cp(q, q, q, cu_seqlens_q=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ArgumentError, match="unknown input"):
        cp(q, q, q, q_start_=torch.zeros((), dtype=torch.int32))
    with pytest.raises(ArgumentError, match="load_balance must be one of"):
        context_parallel(attn, load_balance="striped")
    with pytest.raises(ArgumentError, match="schedule must be one of"):
        context_parallel(attn, schedule="tree")
    with pytest.raises(ArgumentError, match="torch.distributed initialised"):
        cp(q, q, q)


# --- calls over several processes -----------------------------------------------------------------------

# (spec, load balance, schedule, B, H, HKV, N, *options): small enough for the interpreter, chunks that cross its
# tiles. Options: "transposed" (q, k, v transposed views of (B, N, heads, D) tensors), "local_input_grads"
# (reduce_input_grads=False: each rank's share of the learnable inputs' gradients, summed here).
TWO_RANKS = [
    ("causal", "zigzag", "ring", 1, 2, 1, 64),
    ("document_causal", "contiguous", "allgather", 1, 2, 2, 64, "transposed"),
    ("learned_rel_bias", "zigzag", "ring", 1, 2, 1, 64, "local_input_grads"),
    ("gpt_oss_sinks", "contiguous", "allgather", 1, 2, 1, 64),
    ("alibi_causal", "zigzag", "allgather", 2, 4, 2, 32),
    ("sigmoid_alibi", "zigzag", "ring", 1, 2, 1, 64),
]
FOUR_RANKS = [
    ("sliding_window", "contiguous", "ring", 1, 2, 1, 64),
    ("causal", "zigzag", "ring", 1, 2, 2, 64),
]
SLOW_SPECS = sorted(p.stem for p in SPECS.glob("*.attn"))


def _case_id(case):
    return "{}-{}-{}-B{}H{}KV{}-N{}".format(*case) + "".join(f"-{x}" for x in case[7:])


def _check_call(case, world, rank, device, dtype, D):
    """One case on this rank: cp on the shards against the float64 reference of the whole sequence."""
    from attngen.distributed import context_parallel, shard, unshard

    name, balance, schedule, B, H, HKV, N, *options = case
    spec = _spec(name)
    attn = attngen.build(spec)
    reduce_input_grads = "local_input_grads" not in options
    cp = context_parallel(attn, load_balance=balance, schedule=schedule, reduce_input_grads=reduce_input_grads)
    assert cp.plan(*(torch.empty(B, h, N // world, D, dtype=dtype) for h in (H, HKV, HKV))).schedule == schedule
    layout = "transposed" if "transposed" in options else "dense"
    q, k, v = random_qkv(B, H, HKV, N, N, D, D, dtype, device, seed=7, layout=layout)
    inputs = random_inputs(spec, B, H, HKV, N, N, device=device, seed=7)
    learnable = [i.name for i in spec.learnable_inputs]
    split = lambda x: shard(x, dim=2, load_balance=balance)  # noqa: E731
    local = [split(x).requires_grad_() for x in (q, k, v)]
    mine = {n: x.clone().requires_grad_(n in learnable) for n, x in inputs.items()}
    softmax = spec.normalize == "softmax"  # a sigmoid spec's rows have no LSE: its parts add
    if softmax:
        out, lse = cp(*local, return_lse=True, **mine)
    else:
        out, lse = cp(*local, **mine), None
        with pytest.raises(ArgumentError, match="return_lse=True needs a softmax spec"):
            cp(*local, return_lse=True, **mine)
    # O in q's layout and the gradients in q's, k's and v's, by the rule of one process's calls.
    assert out.stride() == _empty_in_layout(local[0], D).stride()
    whole_out = unshard(out.detach(), dim=2, load_balance=balance)
    g = torch.Generator().manual_seed(11)
    dout = torch.randn(whole_out.shape, generator=g).to(device, dtype)
    if softmax:
        whole_lse = unshard(lse.detach(), dim=2, load_balance=balance)
        dlse = torch.where(torch.isfinite(whole_lse), torch.randn(whole_lse.shape, generator=g).to(device), 0.0)
        torch.autograd.backward([out, lse], [split(dout), split(dlse)])
    else:
        dlse = None
        out.backward(split(dout))
    assert all(x.grad.stride() == _empty_in_layout(x, D).stride() for x in local)

    ref = reference_error(spec, q, k, v, inputs, dtype, dout=dout, dlse=dlse)
    scales = summation_scales(spec, q, k, v, inputs, dout=dout, dlse=dlse)
    scales["lse"] = 1.0 + math.sqrt(N)
    effects = output_error_effect(spec, q, k, v, inputs, whole_out, dout)
    actual = {"out": out, "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
    if softmax:
        actual["lse"] = lse
    actual |= {f"d_{n}": mine[n].grad for n in learnable}  # summed over the ranks: the whole gradient
    if not reduce_input_grads:
        for n in learnable:
            dist.all_reduce(actual[f"d_{n}"])
    for key, x in actual.items():
        truth, low = ref.truth[key], ref.low_precision[key]
        floor = default_floor(truth, x.dtype) + FLOOR_ULPS * FP32_EPS * scales.get(key, 0.0) + effects.get(key, 0.0)
        if not key.startswith("d_"):
            truth, low = split(truth), split(low)
        assert_matches_reference(f"rank {rank}: {key}", x, truth, low, floor=floor)
    # Without gradients the forward is the same, and no autograd node is made.
    with torch.no_grad():
        again = cp(*(x.detach() for x in local), **inputs)
    assert again.grad_fn is None and torch.equal(again, out.detach())


def _check_shards(world, rank, device):
    """shard and unshard are inverses, along any dim; unshard's gradient sums every rank's."""
    from attngen.distributed import shard, unshard

    x = torch.arange(4 * world * 3 * 8 * world, dtype=torch.float32, device=device).view(4 * world, 3, 8 * world)
    for balance in schedules.LOAD_BALANCES:
        for dim in (0, 2, -1):
            piece = shard(x, dim=dim, load_balance=balance)
            assert piece.shape[dim] == x.shape[dim] // world
            assert torch.equal(unshard(piece, dim=dim, load_balance=balance), x)
        piece = shard(x, load_balance=balance).requires_grad_()
        (unshard(piece, load_balance=balance) * x).sum().backward()
        assert torch.equal(piece.grad, world * shard(x, load_balance=balance))


def _worker(rank, world, init_file, out_dir, cases, device, dtype, D):
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    results = {}
    try:
        for case in cases:
            try:
                if case == "shards":
                    _check_shards(world, rank, device)
                else:
                    _check_call(case, world, rank, device, getattr(torch, dtype), D)
                results[_case_id(case) if case != "shards" else case] = None
            except Exception:  # every case is reported, whichever fails
                results[_case_id(case) if case != "shards" else case] = traceback.format_exc()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def _run(world, cases, tmp_path, device="cpu", dtype="float32", D=16):
    """Runs the cases in `world` processes (gloo on the CPU; NCCL, one GPU each, on CUDA), every rank checking its
    shards; fails with every failed case's traceback."""
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    mp.start_processes(_worker, args=(world, str(tmp_path / "init"), str(out_dir), cases, device, dtype, D),
                       nprocs=world, start_method="spawn")
    failures = []
    for rank in range(world):
        results = json.loads((out_dir / f"rank{rank}.json").read_text())
        assert len(results) == len(cases)
        failures += [f"{case} on rank {rank}:\n{error}" for case, error in results.items() if error is not None]
    assert not failures, "\n".join(failures)


@CPU_CALLS
def test_two_ranks_give_the_single_process_results(tmp_path):
    _run(2, ["shards", *TWO_RANKS], tmp_path)


# Two ranks stay in the default tier.
@pytest.mark.slow
@CPU_CALLS
def test_four_ranks_give_the_single_process_results(tmp_path):
    _run(4, ["shards", *FOUR_RANKS], tmp_path)


# The slow tier: the rest of the catalog, each spec with both sharding and both schedules over the two tests.
@pytest.mark.slow
@CPU_CALLS
@pytest.mark.parametrize("schedule", ["ring", "allgather"])
def test_two_ranks_give_the_single_process_results_for_the_catalog(schedule, tmp_path):
    _run(2, [(name, schedules.LOAD_BALANCES[(n + (schedule == "ring")) % 2], schedule, 1, 4, 2, 64)
             for n, name in enumerate(SLOW_SPECS)], tmp_path)


@pytest.mark.slow
@CPU_CALLS
def test_four_ranks_give_the_single_process_results_for_the_catalog(tmp_path):
    cases = [(name, schedules.LOAD_BALANCES[n % 2], ("ring", "allgather")[n // 2 % 2], 1, 2, 1, 64)
             for n, name in enumerate(SLOW_SPECS)]
    _run(4, cases, tmp_path)


# On GPUs: bf16, the Hopper family's kernels where the GPU has them (D = 64), lengths whose chunks span many tiles.
GPU_CASES = [
    ("causal", "zigzag", "ring", 1, 4, 2, 2048),
    ("document_causal", "zigzag", "allgather", 1, 4, 2, 2048),
    ("sliding_window", "contiguous", "ring", 1, 4, 4, 2048),
    ("alibi_causal", "contiguous", "allgather", 2, 4, 4, 1024),
    ("learned_rel_bias", "zigzag", "ring", 1, 4, 4, 1024),
    ("gpt_oss_sinks", "zigzag", "ring", 1, 4, 4, 1024, "transposed"),
]


@pytest.mark.gpu
def test_one_gpu_as_a_group_of_one_gives_the_single_process_results(tmp_path):
    """NCCL's collectives and the schedules on one GPU (a group of one: its zigzag shard is two chunks)."""
    _run(1, GPU_CASES, tmp_path, "cuda", "bfloat16", 64)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpus_give_the_single_process_results(tmp_path):
    _run(min(torch.cuda.device_count(), 4), ["shards", *GPU_CASES], tmp_path, "cuda", "bfloat16", 64)
