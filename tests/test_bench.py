"""attngen bench: its checks and no-GPU error, the FLOP count against brute force, which SDPA backends run,
the callables it times (on the CPU), the table, plot and JSON; on a GPU, a real run."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

import attngen
from attngen import bench, testing, with_params
from attngen.bench import ATTNGEN, ATTNGEN_PREBUILT, FLEX, Flops, Problem, Timing

ROOT = Path(__file__).parent.parent
CAUSAL = str(ROOT / "specs" / "causal.attn")

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _spec(name: str, **params):
    return with_params(attngen.load_spec(ROOT / "specs" / f"{name}.attn")[0], params or None)


def _attngen(monkeypatch, capsys, *args):
    """`attngen ARGS` in this process through the console script's entry point: (status, stdout, stderr)."""
    from attngen.cli import main

    monkeypatch.setattr(sys, "argv", ["attngen", *args])
    status = main()
    captured = capsys.readouterr()
    return status, captured.out, captured.err


# --- the command's checks --------------------------------------------------------------------------

def test_no_gpu_is_one_error_line_and_exit_status_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status, out, err = _attngen(monkeypatch, capsys, "bench", CAUSAL)
    assert (status, out) == (2, "")
    assert err == ("error: attngen bench times kernels on a CUDA GPU, and this machine has none "
                   "(attngen run and attngen check work on the CPU)\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_no_gpu_error_from_the_console_script():
    import subprocess

    result = subprocess.run([sys.executable, "-m", "attngen.cli", "bench", CAUSAL, "--q-len", "128"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: attngen bench times kernels on a CUDA GPU") and result.stderr.count("\n") == 1


@pytest.mark.parametrize("args, message", [
    (["--q-len", "0"], "--q-len must be at least 1, got 0"),
    (["--kv-len", "-3"], "--kv-len must be at least 1, got -3"),
    (["--head-dim", "300"], "--head-dim must be at most 256, got 300"),
    (["--batch", "0"], "--batch must be at least 1, got 0"),
    (["--heads", "6", "--kv-heads", "4"], "--heads must be a multiple of --kv-heads, got 6 and 4"),
    (["--dtype", "f32"], "--dtype must be one of bf16, f16, got 'f32'"),
    (["--layout", "bnhd"], "--layout must be one of dense, transposed, got 'bnhd'"),
    (["-D", "window"], "-D must be NAME=VALUE, got 'window'"),
    (["-D", "windw=3"], "params: unknown param 'windw' (the spec declares: window)"),
])
def test_options_are_checked_before_anything_runs(monkeypatch, capsys, args, message):
    status, _, err = _attngen(monkeypatch, capsys, "bench", str(ROOT / "specs" / "sliding_window.attn"), *args)
    assert (status, err) == (2, f"error: {message}\n")


def test_output_files_must_be_in_an_existing_folder(monkeypatch, capsys, tmp_path):
    for option in ("--plot", "--json"):
        path = tmp_path / "missing" / "x"
        status, _, err = _attngen(monkeypatch, capsys, "bench", CAUSAL, option, str(path))
        assert (status, err) == (2, f"error: {option} must be a file in an existing folder, got {str(path)!r}\n")


# --- FLOPs -----------------------------------------------------------------------------------------

SIZES = {"B": 2, "H": 3, "HKV": 3, "Q_LEN": 37, "KV_LEN": 53}


def _brute_force(allowed) -> int:
    """Pairs allowed by a Python predicate of (b, h, q, k), one at a time."""
    return sum(allowed(b, h, q, k) for b in range(SIZES["B"]) for h in range(SIZES["H"])
               for q in range(SIZES["Q_LEN"]) for k in range(SIZES["KV_LEN"]))


PREFIX = torch.tensor([5, 30], dtype=torch.int32)
LAYOUT = torch.rand(3, 5, 7, generator=torch.Generator().manual_seed(0)) < 0.5
FLOP_CASES = [
    ("full", {}, {}, lambda b, h, q, k: True),
    ("causal", {}, {}, lambda b, h, q, k: q >= k),
    ("causal_bottom_right", {}, {}, lambda b, h, q, k: q + 53 - 37 >= k),
    ("sliding_window", {"window": 8}, {}, lambda b, h, q, k: q >= k and q - k < 8),
    ("chunked_causal", {"chunk": 8}, {}, lambda b, h, q, k: q // 8 == k // 8 and q >= k),
    ("prefix_lm", {}, {"prefix": PREFIX}, lambda b, h, q, k: k < PREFIX[b] or q >= k),
    ("block_sparse", {"block": 8}, {"layout": LAYOUT}, lambda b, h, q, k: bool(LAYOUT[h, q // 8, k // 8])),
]


@pytest.mark.parametrize("name, params, inputs, allowed", FLOP_CASES, ids=[c[0] for c in FLOP_CASES])
def test_allowed_pairs_are_counted_exactly_as_brute_force_counts_them(monkeypatch, name, params, inputs, allowed):
    spec = _spec(name, **params)
    expected = _brute_force(allowed)
    assert bench.allowed_pairs(spec, SIZES, inputs) == (expected, True)
    # A block of rows at a time, however small the blocks.
    monkeypatch.setattr(bench, "CHUNK_EVALUATIONS", 100)
    assert bench.allowed_pairs(spec, SIZES, inputs) == (expected, True)


def test_sampled_rows_estimate_the_count_and_say_so():
    spec = _spec("sliding_window", window=8)
    exact = _brute_force(lambda b, h, q, k: q >= k and q - k < 8)
    # Every row drawn (in random order): the estimate is the count.
    assert bench.allowed_pairs(spec, SIZES, exact_evaluations=0, sampled_rows=37) == (exact, False)
    # 20 of 37 rows: rows allow 1 to 8 keys (mean 7.24, sd 1.79), so the estimate's standard error is
    # 1.79 / sqrt(20) * sqrt(17 / 36) / 7.24 = 3.8% of the truth; 10% is 2.6 of them (and the seed is fixed).
    pairs, is_exact = bench.allowed_pairs(spec, SIZES, exact_evaluations=0, sampled_rows=20)
    assert not is_exact and abs(pairs - exact) < 0.1 * exact


def test_flops_are_flash_attentions_convention_over_the_allowed_pairs():
    problem = Problem(B=2, H=4, HKV=4, Q_LEN=64, KV_LEN=64, D=32, dtype="bf16")
    counted = bench.count_flops(_spec("causal"), problem)
    pairs = 2 * 4 * 64 * 65 // 2
    assert (counted.pairs, counted.total_pairs, counted.exact) == (pairs, 2 * 4 * 64 * 64, True)
    assert counted.forward == 4 * 32 * pairs  # 2*D for QK^T, 2*DV for PV, per allowed pair
    assert counted.forward_backward == 3.5 * counted.forward
    assert "50.8% of the (b, h, q, k) pairs allowed (counted exactly)" in counted.describe()


# --- what runs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, q_len, kv_len, expected", [
    ("full", 64, 64, False), ("full", 64, 80, False), ("causal", 64, 64, True), ("causal", 64, 80, None),
    ("causal_bottom_right", 64, 64, True), ("causal_bottom_right", 80, 64, None), ("sliding_window", 64, 64, None),
    ("alibi_causal", 64, 64, None), ("learned_rel_bias", 64, 64, None), ("document_causal", 64, 64, None),
])
def test_sdpa_runs_only_what_it_computes_exactly(name, q_len, kv_len, expected):
    is_causal, why = bench.sdpa_is_causal(_spec(name), q_len, kv_len)
    assert is_causal is expected and (why == "") == (expected is not None)


def test_a_scale_alone_keeps_a_spec_plain_for_sdpa():
    spec = attngen.parse_spec("attention scaled\nscale: 0.5 / D\nmask: causal\n")
    assert bench.sdpa_is_causal(spec, 32, 32) == (True, "")


def test_a_sink_is_not_plain_for_sdpa_and_its_flex_row_says_why():
    spec = attngen.parse_spec("attention sunk\nmask: causal\nsink: 1.0\n")
    assert bench.sdpa_is_causal(spec, 32, 32) == (None, "the spec has a sink")
    attn = attngen.build(spec)
    q, k, v = testing.random_qkv(1, 2, 2, 8, 8, 16, 16, torch.float32)
    with pytest.raises(attngen.ArgumentError) as refused:
        attngen.to_flex(spec)
    calls = bench.implementations(attn, bench._Inexpressible(refused.value), q, k, v, {})
    timing = bench._time(FLEX, calls[FLEX], [], torch.zeros(1), False, lambda _: None)
    assert timing.fwd_ms is None and "must have no 'sink:' to run as FlexAttention" in timing.note


def test_the_callables_compute_the_same_attention():
    from torch.nn.attention import SDPBackend

    attn = attngen.build(CAUSAL)
    flex = attngen.to_flex(attn.spec)
    q, k, v = testing.random_qkv(1, 4, 2, 40, 40, 16, 16, torch.float32)
    is_causal, _ = bench.sdpa_is_causal(attn.spec, 40, 40)
    calls = bench.implementations(attn, flex, q, k, v, {}, sdpa_backends={"sdpa math": SDPBackend.MATH},
                                  is_causal=is_causal)
    assert list(calls) == [ATTNGEN, FLEX, "sdpa math"]
    truth = attngen.reference.evaluate(attn.spec, q.double(), k.double(), v.double())[0]
    low = attngen.reference.evaluate(attn.spec, q, k, v)[0]
    for name, call in calls.items():
        testing.assert_matches_reference(name, call(), truth, low)


def _one_call(fn, warmup=25, rep=100, grad_to_none=None, return_mode="median"):
    """do_bench's stand-in on the CPU: one call, its wall time in ms."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def test_the_whole_run_on_the_cpu_with_a_stand_in_timer(monkeypatch):
    """bench.run end to end with do_bench timing one call and torch.compile left out (the CPU's Flex is eager
    and has no backward): every implementation gets a row, with times or the reason it has none."""
    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench", _one_call)
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    steps = []
    info, rows, notes = bench.run(str(ROOT / "specs" / "document_causal.attn"), None,
                                  Problem(1, 2, 1, 48, 48, 16, "bf16"), device="cpu", step=steps.append)
    assert [r["implementation"] for r in rows] == [ATTNGEN, ATTNGEN_PREBUILT, FLEX]
    for row in rows[:2]:
        assert row["fwd_ms"] > 0 and row["fwdbwd_ms"] > 0 and row["note"] == ""
    assert rows[0]["fwd_ratio"] == 1.0
    assert rows[2]["fwd_ms"] is not None or rows[2]["note"].startswith("forward failed: ")
    assert info["spec"] == "document_causal" and info["Q_LEN"] == 48 and info["allowed_pairs_exact"]
    assert "SDPA: not run (SDPA runs no mask but causal)." in notes
    assert "attngen: first forward (compiles)" in steps and "building Flex's BlockMask" in steps


class _BackwardRaises(torch.autograd.Function):
    """The identity, whose backward raises `error` as Flex's backward compile does."""

    @staticmethod
    def forward(ctx, x, error):
        ctx.error = error
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ctx.error


def test_flex_is_timed_again_with_a_one_stage_backward_only_where_its_own_ran_out_of_shared_memory(monkeypatch):
    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench", _one_call)
    x = torch.randn(4, 8, requires_grad=True)
    dout = torch.randn(4, 8)
    out_of_resource = RuntimeError("No valid triton configs. OutOfMemoryError: out of resource: "
                                   "triton_tem_fused_flex_attention_backward_2 Required: 233472")
    ran = []

    def one_stage():
        ran.append("one stage")
        return x * 3

    def timed(flex_error, backward=True):
        calls = {ATTNGEN: lambda: x * 2, FLEX: lambda: _BackwardRaises.apply(x * 2, flex_error)}
        return bench.time_all(calls, [x], dout, backward, lambda _: None, flex_one_stage=one_stage)

    timings, notes = timed(out_of_resource)
    assert [t.implementation for t in timings] == [ATTNGEN, FLEX, bench.FLEX_ONE_STAGE]
    flex, retried = timings[1], timings[2]
    assert flex.fwd_ms is not None and flex.fwdbwd_ms is None and "out of resource" in flex.note
    assert retried.fwd_ms is not None and retried.fwdbwd_ms is not None and retried.note == ""
    assert len(notes) == 1 and str(bench.FLEX_ONE_STAGE_OPTIONS) in notes[0]
    # Another failure, or no backward asked for: no second Flex row
    ran.clear()
    for timings, notes in (timed(RuntimeError("boom")), timed(out_of_resource, backward=False)):
        assert [t.implementation for t in timings] == [ATTNGEN, FLEX] and notes == []
    assert ran == []


def test_flex_call_passes_kernel_options_where_given():
    flex = attngen.to_flex(_spec("causal"))
    q, k, v = testing.random_qkv(1, 2, 2, 16, 16, 16, 16, torch.float32)
    seen = []

    def kernel(q, k, v, **kwargs):
        seen.append(kwargs.get("kernel_options"))
        return q

    bench.flex_call(flex, q, k, v, {}, flex_kernel=kernel)()
    bench.flex_call(flex, q, k, v, {}, flex_kernel=kernel, kernel_options=bench.FLEX_ONE_STAGE_OPTIONS)()
    assert seen == [None, {"bwd_num_stages": 1}]


# --- table, plot, JSON -------------------------------------------------------------------------------

COUNTED = Flops(pairs=1e9, total_pairs=2_000_000_000, exact=True, forward=5e11, forward_backward=1.75e12)
TIMINGS = [Timing(ATTNGEN, 1.0, 4.0, 3.2), Timing(FLEX, 2.0, 5.0, 40.0), Timing("sdpa flash", 0.5, None, 1.0),
           Timing("sdpa cudnn", note="forward refused: RuntimeError: No available kernel [shape]")]


def test_rows_carry_tflops_and_ratios_against_attngen():
    rows = bench.summarize(TIMINGS, COUNTED)
    assert rows[0] == {"implementation": ATTNGEN, "fwd_ms": 1.0, "fwd_tflops": 500.0, "fwd_ratio": 1.0,
                            "fwdbwd_ms": 4.0, "fwdbwd_tflops": 437.5, "fwdbwd_ratio": 1.0, "fwd_gpu_ms": None,
                            "fwd_gpu_ratio": None, "fwdbwd_gpu_ms": None, "fwdbwd_gpu_ratio": None,
                            "first_call_s": 3.2, "note": ""}
    assert (rows[1]["fwd_ratio"], rows[1]["fwdbwd_ratio"]) == (2.0, 1.25)  # attngen twice as fast forward
    assert (rows[2]["fwd_ratio"], rows[2]["fwdbwd_tflops"], rows[2]["fwdbwd_ratio"]) == (0.5, None, None)
    assert rows[3]["fwd_ms"] is None and rows[3]["fwd_ratio"] is None


def test_gpu_times_get_ratios_of_their_own():
    timings = [Timing(ATTNGEN, 1.0, 4.0, fwd_gpu_ms=0.5, fwdbwd_gpu_ms=2.0),
               Timing(FLEX, 0.8, 5.0, fwd_gpu_ms=0.75, fwdbwd_gpu_ms=3.0)]
    flex = bench.summarize(timings, COUNTED)[1]
    assert (flex["fwd_ratio"], flex["fwd_gpu_ratio"], flex["fwdbwd_gpu_ratio"]) == (0.8, 1.5, 1.5)


def test_the_table_shows_every_row_and_why_one_is_empty():
    from rich.console import Console

    console = Console(record=True, width=220)
    console.print(bench.table(bench.summarize(TIMINGS, COUNTED), "causal: B=2 ..."))
    text = console.export_text()
    for header in ("implementation", "fwd ms", "fwd TFLOP/s", "fwd ratio", "fwd+bwd ms", "fwd+bwd TFLOP/s",
                   "fwd+bwd ratio", "note"):
        assert header in text
    attngen_line = next(line for line in text.splitlines() if line.startswith("│ attngen"))
    assert all(cell in attngen_line for cell in ("1.000", "500.0", "1.00x", "4.000", "437.5"))
    assert "forward refused: RuntimeError: No available kernel [shape]" in text  # brackets are not markup


def test_kernel_times_average_each_kernel_over_the_profiled_calls(monkeypatch):
    """bench.kernel_times on the CPU, torch.profiler stood in for by one that sees two kernels a call (and a
    CPU event, which is not counted): each kernel's microseconds per call, and kernel_ms their sum in ms;
    `before` runs ahead of every call, warm-up ones included."""
    import contextlib
    import types

    import torch.profiler

    calls = []
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    @contextlib.contextmanager
    def profile(activities):
        seen = len(calls)
        prof = types.SimpleNamespace(events=lambda: [types.SimpleNamespace(name=name, device_type=kind, device_time=us)
                                                     for _ in range(len(calls) - seen)
                                                     for name, kind, us in (("fwd", cuda, 30.0), ("bwd", cuda, 70.0),
                                                                            ("host", cpu, 500.0))])
        yield prof
    monkeypatch.setattr(torch.profiler, "profile", profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    befores = []
    times = bench.kernel_times(lambda: calls.append("call"), lambda: befores.append("before"), calls=4, warmup=2)
    assert times == {"fwd": 30.0, "bwd": 70.0} and len(calls) == len(befores) == 6
    assert bench.kernel_ms(lambda: calls.append("call")) == 0.1


def test_the_table_shows_gpu_times_where_the_rows_have_them():
    from rich.console import Console

    timings = [Timing(ATTNGEN, 1.0, 4.0, fwd_gpu_ms=0.5, fwdbwd_gpu_ms=2.0), Timing(FLEX, 0.8, 5.0)]
    console = Console(record=True, width=260)
    console.print(bench.table(bench.summarize(timings, COUNTED), "causal: B=2 ..."))
    text = console.export_text()
    assert "fwd GPU ms" in text and "fwd+bwd GPU ms" in text
    attngen_line = next(line for line in text.splitlines() if line.startswith("│ attngen"))
    assert "0.500" in attngen_line and "2.000" in attngen_line
    console = Console(record=True, width=260)
    console.print(bench.table(bench.summarize(TIMINGS, COUNTED), "causal: B=2 ..."))
    assert "GPU ms" not in console.export_text()  # rows without GPU times: no such columns


def test_gpu_time_reaches_the_run(monkeypatch, capsys):
    """`attngen bench --gpu-time` asks bench.run for GPU times (on the CPU, with the GPU check and the run
    stood in for; tests/test_bench.py's GPU test times them)."""
    seen = {}

    def run(spec, params, problem, **options):
        seen.update(options)
        return {"spec": "causal", "B": 1, "H": 1, "HKV": 1, "Q_LEN": 64, "KV_LEN": 64, "D": 64, "dtype": "bf16",
                "layout": "dense", "gpu": "a stand-in"}, bench.summarize(TIMINGS, COUNTED), []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run", run)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    status, out, err = _attngen(monkeypatch, capsys, "bench", CAUSAL, "--q-len", "64", "--gpu-time")
    assert status == 0, err
    assert seen["gpu_time"] is True


def test_json_and_plot_are_written(tmp_path):
    rows = bench.summarize(TIMINGS, COUNTED)
    bench.write_json(tmp_path / "rows.json", {"spec": "causal"}, rows)
    assert json.loads((tmp_path / "rows.json").read_text()) == {"info": {"spec": "causal"}, "rows": rows}
    bench.plot(rows, "causal: B=2 ...", tmp_path / "bars.png")
    assert (tmp_path / "bars.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(attngen.ArgumentError, match=r"--plot needs matplotlib: pip install 'attngen\[plot\]'"):
        bench.require_matplotlib()


# --- on the GPU --------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_bench_times_attngen_flex_and_sdpa_on_the_gpu(monkeypatch, capsys, tmp_path):
    out = tmp_path / "causal.json"
    status, text, err = _attngen(monkeypatch, capsys, "bench", CAUSAL, "--q-len", "1024", "--heads", "4",
                                 "--json", str(out), "--plot", str(tmp_path / "causal.png"), "--gpu-time")
    assert status == 0, err
    rows = {r["implementation"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == [ATTNGEN, FLEX, "sdpa flash", "sdpa cudnn"]
    for name in (ATTNGEN, FLEX):
        assert rows[name]["fwd_ms"] > 0 and rows[name]["fwdbwd_ms"] > 0 and rows[name]["fwd_tflops"] > 0, rows[name]
        assert 0 < rows[name]["fwdbwd_gpu_ms"] <= rows[name]["fwdbwd_ms"] * 1.05, rows[name]
    assert "fwd TFLOP/s" in text and "fwd GPU ms" in text and (tmp_path / "causal.png").exists()


@pytest.mark.gpu
def test_gpu_times_are_the_kernels_share_of_each_call():
    """bench.run(gpu_time=True): each implementation's GPU time, the sum of its kernels, is above 0 and at most
    its do_bench time (which adds the host's gaps and a cold L2), forward and forward+backward."""
    info, rows, _ = bench.run(CAUSAL, None, Problem(1, 4, 4, 1024, 1024, 64, "bf16"), gpu_time=True)
    for row in rows:
        for part in ("fwd", "fwdbwd"):
            assert 0 < row[f"{part}_gpu_ms"] <= row[f"{part}_ms"] * 1.05, row


@pytest.mark.gpu
def test_bench_gives_every_implementation_the_transposed_views(monkeypatch, capsys, tmp_path):
    out = tmp_path / "causal.json"
    status, text, err = _attngen(monkeypatch, capsys, "bench", CAUSAL, "--q-len", "1024", "--heads", "4",
                                 "--layout", "transposed", "--json", str(out))
    assert status == 0, err
    result = json.loads(out.read_text())
    assert result["info"]["layout"] == "transposed" and "transposed views" in text
    rows = {r["implementation"]: r for r in result["rows"]}
    assert list(rows) == [ATTNGEN, FLEX, "sdpa flash", "sdpa cudnn"]
    assert all(row["fwd_ms"] > 0 and row["fwdbwd_ms"] > 0 for row in rows.values()), rows


# --- benchmarks/random_variants.py -------------------------------------------------------------------

def _random_variants():
    import importlib.util

    spec = importlib.util.spec_from_file_location("random_variants", ROOT / "benchmarks" / "random_variants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_random_variants_draw_the_same_distinct_masked_specs_every_run():
    rv = _random_variants()
    texts = rv.draw_specs(6, seed=3)
    assert texts == rv.draw_specs(6, seed=3)
    variants = [rv._variant(t) for t in texts]
    assert len(set(variants)) == 6 and all(mask.startswith("mask: ") for mask, _ in variants)
    for text in texts:
        spec = rv.scaled(text, 4096)
        drawn = attngen.load_spec(text)[0].param_values
        assert spec.param_values == {**drawn, **{n: drawn[n] * (4096 // 48) for n in rv.LENGTH_PARAMS}}
        attngen.to_flex(spec)  # every drawn construct has a Flex spelling to time against


def test_random_variants_split_one_drawn_list_by_start_and_end():
    """--start/--end take a slice of the --count specs drawn, so device calls split one list between them."""
    import argparse

    rv = _random_variants()
    args = argparse.Namespace(published=False, count=6, seed=3, start=2, end=4, n=4096)
    assert [(index, text) for index, text, _ in rv._specs(args)] == list(enumerate(rv.draw_specs(6, seed=3), 0))[2:4]


def test_random_variants_needs_a_gpu(monkeypatch, capsys):
    rv = _random_variants()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["random_variants.py", "--count", "1"])
    assert rv.main() == 2
    assert "random_variants.py times kernels on a CUDA GPU" in capsys.readouterr().err


def test_random_variants_count_visits_against_the_needed_tiles(monkeypatch, capsys, tmp_path):
    """--visits --no-time on the CPU: each published mask's kernels (static tables) visit exactly the tiles
    the mask needs; --summarize merges runs' rows."""
    rv = _random_variants()
    out = tmp_path / "published.json"
    monkeypatch.setattr(sys, "argv", ["random_variants.py", "--published", "--n", "48", "--no-time", "--visits",
                                      "--json", str(out)])
    assert rv.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["index"] for row in rows] == ["block_diffusion", "global_band", "natten_2d", "sliding_tiles_text"]
    for row in rows:
        seen = row["visits"]
        assert seen["tile_list"] == "static table", row
        for kernel in ("fwd", "dkdv", "dq"):
            assert seen[kernel]["visited"] == seen[kernel]["needed"] > 0 and seen[kernel]["missed"] == 0, row
            assert seen[kernel]["wasted"] == seen[kernel]["masked_full"] == seen[kernel]["unmasked_partial"] == 0, row
    assert "fwd 9/9 visited/needed, 0 wasted, 0 full masked" in capsys.readouterr().out  # global_band: 3 x 3 tiles
    monkeypatch.setattr(sys, "argv", ["random_variants.py", "--summarize", str(out), str(out)])
    assert rv.main() == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["visits"] == {"specs": 8, "with_wasted_tiles": 0, "with_masked_full_tiles": 0}
    assert summary["fwd"] == {"count": 0}


@pytest.mark.slow
def test_random_variants_warm_compiles_every_spec_in_workers_and_changes_no_row(monkeypatch, capsys, tmp_path):
    """--warm 2: every spec runs first in two worker processes (their compiles fill the on-disk caches), then
    the pass that records rows, whose rows are those of a run without --warm."""
    import importlib

    # The spawned workers import the script by name, and pickle finds its functions only in that module.
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.delitem(sys.modules, "random_variants", raising=False)
    rv = importlib.import_module("random_variants")
    rows = {}
    for warm in ("1", "2"):
        out = tmp_path / f"warm{warm}.json"
        monkeypatch.setattr(sys, "argv", ["random_variants.py", "--published", "--n", "48", "--no-time", "--visits",
                                          "--warm", warm, "--json", str(out)])
        assert rv.main() == 0
        rows[warm] = json.loads(out.read_text())["rows"]
        printed = capsys.readouterr().out
        compiled = sorted(line.split()[0] for line in printed.splitlines() if line.endswith(" compiled"))
        assert compiled == ([] if warm == "1" else
                            ["[block_diffusion]", "[global_band]", "[natten_2d]", "[sliding_tiles_text]"])
    assert rows["2"] == rows["1"] and len(rows["1"]) == 4
