"""`attngen bench`: times a spec's kernels on the GPU beside FlexAttention and, for plain attention, SDPA.

Every implementation runs the same q, k, v and inputs. FlexAttention gets the spec through
`attngen.to_flex` under `torch.compile(flex_attention)`, with its BlockMask built once, outside the
timed region (as attngen's tile tables are in the row "attngen, tile tables prebuilt", shown for
masks that read inputs; plain "attngen" builds those in every call, its default, and keeps the tables of a
mask that reads no input after the first call, which the timer's warm-up makes). SDPA runs only specs it
can express exactly: no score expression, and no mask or `causal` (or `causal_bottom_right` when
Q_LEN == KV_LEN), with the spec's scale.

Times are medians of `triton.testing.do_bench`: the forward under torch.no_grad, forward+backward
with a fixed dO and the gradients reset to None between runs.

FLOPs count only the allowed (b, h, q, k) pairs, in FlashAttention's convention: 2 * D + 2 * DV a pair
forward (the QK^T and PV products), the backward 2.5x the forward, so forward+backward 3.5x. The pairs
are counted by evaluating the spec's mask with `attngen.reference` (the definition of the spec) on the
benchmark's own inputs, a block of query rows at a time: exactly when the grid the mask depends on has
at most EXACT_EVALUATIONS points (B and H count only if the mask reads b or h), else on SAMPLED_ROWS
query rows drawn at random (seeded; every key, batch and head of each) and scaled up, an unbiased estimate.
The same count serves every implementation, so TFLOP/s compare as the times do.
"""

from __future__ import annotations

import json
import platform
import time
import warnings
from dataclasses import asdict, dataclass, replace
from datetime import date
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import Tensor

from attngen import ir
from attngen.errors import ArgumentError
from attngen.reference import evaluate_expr, make_env, scale_value
from attngen.report.tilemap import describe_flops

# Above this many mask evaluations the allowed pairs are estimated from sampled query rows.
EXACT_EVALUATIONS = 2 ** 32
SAMPLED_ROWS = 1024
# The most mask evaluations at once (intermediate int64 tensors of this many elements: 128 MiB).
CHUNK_EVALUATIONS = 2 ** 24
BACKWARD_FACTOR = 2.5  # FlashAttention's count: the backward does 2.5x the forward's matmul work

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}

ATTNGEN = "attngen"
ATTNGEN_PREBUILT = "attngen, tile tables prebuilt"
FLEX = "flex (torch.compile)"
# Flex again with one pipeline stage in its backward, where every configuration of its own asks for more shared
# memory than the GPU has (a score reading a learnable table: 233472 bytes, where an H200 has 232448): its own
# tiles then fit. `bwd_` options reach the backward kernel alone (torch's flex_attention lowering).
FLEX_ONE_STAGE = f"{FLEX}, one-stage backward"
FLEX_ONE_STAGE_OPTIONS = {"bwd_num_stages": 1}
SDPA_BACKENDS = {"sdpa flash": "FLASH_ATTENTION", "sdpa cudnn": "CUDNN_ATTENTION"}


@dataclass(frozen=True)
class Problem:
    """The sizes, dtype and layout of q, k, v (testing.LAYOUTS) of one benchmark (DV = D); the command's
    options give them."""
    B: int
    H: int
    HKV: int
    Q_LEN: int
    KV_LEN: int
    D: int
    dtype: str
    layout: str = "dense"

    def sizes(self) -> dict[str, int]:
        return {"B": self.B, "H": self.H, "HKV": self.HKV, "Q_LEN": self.Q_LEN, "KV_LEN": self.KV_LEN}

    def describe(self) -> str:
        return (f"B={self.B} H={self.H} HKV={self.HKV} Q_LEN={self.Q_LEN} KV_LEN={self.KV_LEN} "
                f"D={self.D} {self.dtype}{_layout_words(self.layout)}")


@dataclass(frozen=True)
class Timing:
    """One implementation's medians in ms (None: not run), and why not where it was not."""
    implementation: str
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    first_call_s: float | None = None
    note: str = ""
    # The GPU's own time per call (gpu_time=True): the sum of its kernels' times, host gaps left out.
    fwd_gpu_ms: float | None = None
    fwdbwd_gpu_ms: float | None = None


@dataclass(frozen=True)
class Flops:
    """The allowed (b, h, q, k) pairs of a problem, and the FLOPs they imply."""
    pairs: float
    total_pairs: int
    exact: bool
    forward: float
    forward_backward: float

    def describe(self) -> str:
        how = "counted exactly" if self.exact else "estimated from random query rows"
        return (f"{100 * self.pairs / self.total_pairs:.1f}% of the (b, h, q, k) pairs allowed ({how}); "
                f"forward {describe_flops(self.forward)}, forward+backward {describe_flops(self.forward_backward)}")


# --- FLOPs -------------------------------------------------------------------------------------------

def allowed_pairs(spec: ir.Spec, sizes: Mapping[str, int], inputs: Mapping[str, Tensor] | None = None, *,
                  D: int = 128, device: torch.device | str = "cpu",
                  exact_evaluations: int = EXACT_EVALUATIONS, sampled_rows: int = SAMPLED_ROWS,
                  seed: int = 0) -> tuple[float, bool]:
    """How many (b, h, q, k) the spec's mask allows on this grid, and whether the count is exact (else an
    estimate from `sampled_rows` random query rows). Raises the reference's errors (an index out of range)."""
    B, H, Q_LEN, KV_LEN = sizes["B"], sizes["H"], sizes["Q_LEN"], sizes["KV_LEN"]
    if spec.mask is None:
        return float(B * H * Q_LEN * KV_LEN), True
    env = make_env(spec, D=D, inputs=inputs, device=device, **sizes)
    # Only the dims the mask reads are materialised: B and H count where it reads b, or h and hkv.
    heads = (B if ir.uses(spec.mask, ir.Var, "b") else 1) * (
        H if ir.uses(spec.mask, ir.Var, "h") or ir.uses(spec.mask, ir.Var, "hkv") else 1)
    exact = heads * Q_LEN * KV_LEN <= exact_evaluations
    if exact:
        rows = torch.arange(Q_LEN)
    else:
        g = torch.Generator().manual_seed(seed)
        rows = torch.randperm(Q_LEN, generator=g)[:sampled_rows].sort().values
    per_chunk = max(1, CHUNK_EVALUATIONS // (heads * KV_LEN))
    count = 0
    with torch.no_grad():
        for chunk in rows.split(per_chunk):
            q = chunk.to(device).view(1, 1, -1, 1)
            allowed = evaluate_expr(spec.mask, replace(env, values={**env.values, "q": q}))
            # The mask broadcasts over the dims it does not read: each of its points stands for that many.
            count += int(allowed.sum()) * (B * H * len(chunk) * KV_LEN // allowed.numel())
    return (float(count) if exact else count * Q_LEN / len(rows)), exact


def flops(pairs: float, D: int, DV: int) -> tuple[float, float]:
    """(forward, forward+backward) FLOPs of attention over `pairs` allowed (q, k) pairs."""
    forward = 2.0 * (D + DV) * pairs
    return forward, (1 + BACKWARD_FACTOR) * forward


def count_flops(spec: ir.Spec, problem: Problem, inputs: Mapping[str, Tensor] | None = None, *,
                device: torch.device | str = "cpu", **options) -> Flops:
    pairs, exact = allowed_pairs(spec, problem.sizes(), inputs, D=problem.D, device=device, **options)
    total = problem.B * problem.H * problem.Q_LEN * problem.KV_LEN
    return Flops(pairs, total, exact, *flops(pairs, problem.D, problem.D))


# --- what runs -----------------------------------------------------------------------------------------

def _mask_of(builtin: str) -> ir.Expr:
    from attngen.api import parse_spec
    return parse_spec(f"attention m\nmask: {builtin}\n").mask


def sdpa_is_causal(spec: ir.Spec, q_len: int, kv_len: int) -> tuple[bool | None, str]:
    """SDPA's is_causal for this spec, or None and why SDPA cannot run it exactly."""
    if spec.score is not None:
        return None, "the spec has a score expression"
    if spec.sink is not None:
        return None, "the spec has a sink"
    if spec.sigmoid:
        return None, "the spec is sigmoid attention"
    if spec.mask is None:
        return False, ""
    square = q_len == kv_len
    if spec.mask == _mask_of("causal"):
        # SDPA documents is_causal as top-left aligned, but torch.nn.attention.bias warns that its
        # backends have differed on non-square shapes: only the square case means one thing everywhere.
        return (True, "") if square else (None, "causal with Q_LEN != KV_LEN, where SDPA's backends "
                                                "disagree on the alignment")
    if spec.mask == _mask_of("causal_bottom_right") and square:
        return True, ""
    return None, "SDPA runs no mask but causal"


def implementations(attn, variant, q: Tensor, k: Tensor, v: Tensor, inputs: Mapping[str, Tensor], *,
                    block_mask=None, flex_kernel: Callable | None = None, tile_tables=None,
                    sdpa_backends: Mapping[str, object] | None = None,
                    is_causal: bool | None = None) -> dict[str, Callable[[], Tensor]]:
    """name -> a call computing the spec's output: attngen (`attn`, an attngen.build callable), attngen with
    prebuilt `tile_tables` (where given), Flex (`variant`, from attngen.to_flex, run by `flex_kernel` with
    `block_mask`), and each SDPA backend by name (torch.nn.attention.SDPBackend members) where
    `is_causal` is not None."""
    calls: dict[str, Callable[[], Tensor]] = {ATTNGEN: lambda: attn(q, k, v, **inputs)}
    if tile_tables is not None:
        calls[ATTNGEN_PREBUILT] = lambda: attn(q, k, v, tile_tables=tile_tables, **inputs)
    calls[FLEX] = flex_call(variant, q, k, v, inputs, block_mask=block_mask, flex_kernel=flex_kernel)
    if is_causal is not None:
        from torch.nn.attention import sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        scale = scale_value(attn.spec, q.shape[-1])
        gqa = q.shape[1] != k.shape[1]

        def sdpa(backend):
            def call() -> Tensor:
                with sdpa_kernel(backend):
                    return scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa)
            return call
        for name, backend in (sdpa_backends or {}).items():
            calls[name] = sdpa(backend)
    return calls


def flex_call(variant, q: Tensor, k: Tensor, v: Tensor, inputs: Mapping[str, Tensor], *, block_mask=None,
              flex_kernel: Callable | None = None, kernel_options: dict | None = None) -> Callable[[], Tensor]:
    """A call of Flex (`variant`, from attngen.to_flex, run by `flex_kernel`, else eager flex_attention)
    with `block_mask` and, where given, `kernel_options`."""
    flex = flex_kernel or _eager_flex()
    kwargs: dict = {}

    def call() -> Tensor:
        # Flex's arguments made in the first call (untimed, and a failure there is its row's note), then
        # kept, as its BlockMask is: the timed calls run flex_attention alone.
        if not kwargs:
            kwargs.update(variant.kwargs(q, k, block_mask=block_mask, **inputs))
            if kernel_options is not None:
                kwargs["kernel_options"] = kernel_options
        return flex(q, k, v, **kwargs)
    return call


class _Inexpressible:
    """Stands in for the FlexVariant of a spec Flex cannot express: every use raises to_flex's error, which
    becomes the Flex row's note."""

    def __init__(self, error: ArgumentError):
        self.error = error

    def kwargs(self, *args, **kwargs):
        raise self.error

    block_mask = kwargs


def _eager_flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention


# --- results -------------------------------------------------------------------------------------------

def summarize(timings: list[Timing], counted: Flops) -> list[dict]:
    """The table's rows: times, TFLOP/s over the allowed pairs, and ratios (the other's time over attngen's:
    attngen's speed over the other's; above 1, attngen is faster)."""
    base = next((t for t in timings if t.implementation == ATTNGEN), None)

    def tflops(work: float, ms: float | None) -> float | None:
        return work / ms / 1e9 if ms else None

    def ratio(ms: float | None, ours: float | None) -> float | None:
        return ms / ours if ms and ours else None

    rows = []
    for t in timings:
        rows.append({
            "implementation": t.implementation,
            "fwd_ms": t.fwd_ms, "fwd_tflops": tflops(counted.forward, t.fwd_ms),
            "fwd_ratio": ratio(t.fwd_ms, base and base.fwd_ms),
            "fwdbwd_ms": t.fwdbwd_ms, "fwdbwd_tflops": tflops(counted.forward_backward, t.fwdbwd_ms),
            "fwdbwd_ratio": ratio(t.fwdbwd_ms, base and base.fwdbwd_ms),
            "fwd_gpu_ms": t.fwd_gpu_ms, "fwd_gpu_ratio": ratio(t.fwd_gpu_ms, base and base.fwd_gpu_ms),
            "fwdbwd_gpu_ms": t.fwdbwd_gpu_ms, "fwdbwd_gpu_ratio": ratio(t.fwdbwd_gpu_ms, base and base.fwdbwd_gpu_ms),
            "first_call_s": t.first_call_s, "note": t.note})
    return rows


COLUMNS = (("fwd ms", "fwd_ms", "{:.3f}"), ("fwd TFLOP/s", "fwd_tflops", "{:.1f}"),
           ("fwd ratio", "fwd_ratio", "{:.2f}x"), ("fwd+bwd ms", "fwdbwd_ms", "{:.3f}"),
           ("fwd+bwd TFLOP/s", "fwdbwd_tflops", "{:.1f}"), ("fwd+bwd ratio", "fwdbwd_ratio", "{:.2f}x"))
# Shown when the rows have GPU times (run's gpu_time).
GPU_COLUMNS = (("fwd GPU ms", "fwd_gpu_ms", "{:.3f}"), ("fwd+bwd GPU ms", "fwdbwd_gpu_ms", "{:.3f}"))


def table(rows: list[dict], title: str):
    """A rich Table of summarized rows; '-' where a value is missing, the reason in the last column."""
    from rich.table import Table
    from rich.text import Text

    columns = COLUMNS + (GPU_COLUMNS if any(row.get(key) is not None for row in rows for _, key, _ in GPU_COLUMNS)
                         else ())
    t = Table(title=title)
    t.add_column("implementation", no_wrap=True)
    for header, _, _ in columns:
        t.add_column(header, justify="right")
    t.add_column("note")
    for row in rows:
        # Text, not markup: a note quotes error messages, which may hold brackets.
        t.add_row(Text(row["implementation"]),
                  *[fmt.format(row[key]) if row.get(key) is not None else "-" for _, key, fmt in columns],
                  Text(row["note"]))
    return t


def write_json(path: Path, info: dict, rows: list[dict]) -> None:
    path.write_text(json.dumps({"info": info, "rows": rows}, indent=1) + "\n")


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ArgumentError("--plot needs matplotlib: pip install 'attngen[plot]'") from None


def plot(rows: list[dict], title: str, path: Path) -> None:
    """A bar chart of TFLOP/s per implementation, forward and forward+backward side by side."""
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["implementation"] for r in rows]
    series = [("forward", "fwd_tflops", "#4e79a7"), ("forward+backward", "fwdbwd_tflops", "#f28e2b")]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.8 * len(rows)), 4.5))
    for i, (label, key, color) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(rows))]
        values = [r[key] or 0.0 for r in rows]
        bars = ax.bar(xs, values, width, label=label, color=color)
        ax.bar_label(bars, labels=[f"{r[key]:.0f}" if r[key] else "n/a" for r in rows], fontsize=8)
    ax.set_xticks(range(len(rows)), names, rotation=15, ha="right")
    ax.set_ylabel("TFLOP/s (allowed pairs)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- timing on the GPU ---------------------------------------------------------------------------------

def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


def _synchronize(x: Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


# Calls profiled for a GPU time (kernel_ms).
GPU_TIME_CALLS = 10


def kernel_times(fn: Callable[[], object], before: Callable[[], None] = lambda: None, *, calls: int = GPU_TIME_CALLS,
                 warmup: int = 3) -> dict[str, float]:
    """Each kernel's GPU microseconds per call of fn, by kernel name (torch.profiler's CUDA events), averaged
    over `calls` calls after `warmup` unprofiled ones. `before` runs ahead of each call and should launch no
    kernel (it sets gradients to None)."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        before()
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            before()
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time / calls
    return dict(totals)


def kernel_ms(fn: Callable[[], object], before: Callable[[], None] = lambda: None) -> float:
    """The GPU's time of one call of fn: the sum of its kernels' times (kernel_times), with the gaps the host
    leaves between them not counted. A call's do_bench time is at least this; where it is well above, the call
    is bound by its host time."""
    return sum(kernel_times(fn, before).values()) / 1e3


def _time(name: str, call: Callable[[], Tensor], leaves: list[Tensor], dout: Tensor, backward: bool,
          step: Callable[[str], None], gpu_time: bool = False) -> Timing:
    """The forward's median under no_grad, then forward+backward's; the first call of each (compiles
    included) untimed; with `gpu_time`, each one's GPU time too (kernel_ms). A failure (a backend refusing
    the shape, a compile error) ends the row with a note."""
    import triton

    def bench(fn, grad_to_none=None) -> float:
        return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")

    def first_call(fn) -> float:
        t0 = time.perf_counter()
        _synchronize(fn())
        return time.perf_counter() - t0

    def forward_backward() -> Tensor:
        out = call()
        out.backward(dout)
        return out

    times: dict[str, float] = {}
    phase = "forward"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SDPA explains a refusal in warnings too; the note says it
            step(f"{name}: first forward (compiles)")
            with torch.no_grad():
                times["first"] = first_call(call)
                step(f"{name}: timing the forward")
                times["fwd"] = bench(call)
                if gpu_time:
                    times["fwd_gpu"] = kernel_ms(call)
            if backward:
                phase = "forward+backward"
                step(f"{name}: first forward+backward (compiles)")
                times["first"] += first_call(forward_backward)
                step(f"{name}: timing forward+backward")
                times["fwdbwd"] = bench(forward_backward, grad_to_none=leaves)
                if gpu_time:
                    times["fwdbwd_gpu"] = kernel_ms(forward_backward, before=lambda: _clear_grads(leaves))
        note = ""
    except Exception as e:
        verb = "refused" if name in SDPA_BACKENDS else "failed"
        note = f"{phase} {verb}: {_first_line(e)}"
    first = times.get("first")
    return Timing(name, times.get("fwd"), times.get("fwdbwd"), round(first, 2) if first is not None else None, note,
                  times.get("fwd_gpu"), times.get("fwdbwd_gpu"))


def _clear_grads(leaves: list[Tensor]) -> None:
    """Gradients set to None, as do_bench's grad_to_none does, so a backward writes them instead of adding."""
    for x in leaves:
        x.grad = None


def time_all(calls: Mapping[str, Callable[[], Tensor]], leaves: list[Tensor], dout: Tensor, backward: bool,
             step: Callable[[str], None], *, flex_one_stage: Callable[[], Tensor] | None = None,
             gpu_time: bool = False) -> tuple[list[Timing], list[str]]:
    """_time of every call, in order, then, where Flex's forward+backward ran out of shared memory,
    `flex_one_stage` (Flex with FLEX_ONE_STAGE_OPTIONS) on a row of its own: (timings, notes)."""
    timings = [_time(name, call, leaves, dout, backward, step, gpu_time) for name, call in calls.items()]
    flex = next((t for t in timings if t.implementation == FLEX), None)
    # Triton's OutOfResources, as Inductor words it in the error _time keeps the first line of.
    if (backward and flex_one_stage is not None and flex is not None and flex.fwdbwd_ms is None
            and "out of resource" in flex.note):
        timings.append(_time(FLEX_ONE_STAGE, flex_one_stage, leaves, dout, backward, step, gpu_time))
        return timings, [f"Flex's own backward configurations ran out of shared memory; '{FLEX_ONE_STAGE}' "
                         f"passes kernel_options={FLEX_ONE_STAGE_OPTIONS}."]
    return timings, []


def run(spec, params: dict | None, problem: Problem, *, backward: bool = True, device: str = "cuda",
        step: Callable[[str], None] = lambda _: None,
        counted: Flops | None = None, gpu_time: bool = False) -> tuple[dict, list[dict], list[str]]:
    """Build and time everything on the GPU: (info, summarized rows, notes). `spec` and `params` as in
    attngen.build; `step` is told what is being done (the command shows it while kernels compile);
    `counted`: the problem's count_flops, where the caller made it already (with the inputs this draws,
    testing.random_inputs(..., seed=2)); `gpu_time`: each row has its GPU time too (kernel_ms), which tells a
    call bound by its host from one bound by its kernels."""
    import triton
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.flex_attention import flex_attention

    import attngen
    from attngen import testing

    if device == "cuda" and not torch.cuda.is_available():
        raise ArgumentError("attngen bench times kernels on a CUDA GPU, and this machine has none")
    step("building attngen's kernels")
    attn = attngen.build(spec, params=params)
    try:
        variant = attngen.to_flex(attn.spec)
    except ArgumentError as e:  # a spec Flex cannot express (a sink, sigmoid): its row says why
        variant = _Inexpressible(e)
    B, H, HKV, N, M, D = problem.B, problem.H, problem.HKV, problem.Q_LEN, problem.KV_LEN, problem.D
    q, k, v = testing.random_qkv(B, H, HKV, N, M, D, D, DTYPES[problem.dtype], device=device, seed=2,
                                 layout=problem.layout)
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, M, device=device, seed=2)
    if counted is None:
        step("counting the allowed pairs")
        counted = count_flops(attn.spec, problem, inputs, device=device)
    learnable = [inputs[i.name].requires_grad_() for i in attn.spec.learnable_inputs]
    leaves = [x.requires_grad_() for x in (q, k, v)] + learnable
    dout = torch.randn_like(q)  # in q's layout: a model that reads O as a transposed view passes dO as one

    step("building Flex's BlockMask")
    try:
        block_mask = variant.block_mask(q, k, **inputs)
    except Exception:  # made again in Flex's first call, where a failure becomes its row's note
        block_mask = None
    tables = None
    facts = attn.module.FACTS
    if facts.tile_table and facts.static_tables is None:  # tables built in every call: time them prebuilt too
        tables = attn.tile_tables(q, k, v, **inputs)
    # A fresh compile: past dynamo's recompile limit flex_attention would silently run eagerly.
    torch._dynamo.reset()
    flex_kernel = torch.compile(flex_attention, dynamic=False)
    is_causal, why_not = sdpa_is_causal(attn.spec, N, M)
    backends = {name: getattr(SDPBackend, member) for name, member in SDPA_BACKENDS.items()}
    calls = implementations(attn, variant, q, k, v, inputs, block_mask=block_mask, flex_kernel=flex_kernel,
                            tile_tables=tables, sdpa_backends=backends, is_causal=is_causal)
    one_stage = flex_call(variant, q, k, v, inputs, block_mask=block_mask, flex_kernel=flex_kernel,
                          kernel_options=FLEX_ONE_STAGE_OPTIONS)
    timings, retried = time_all(calls, leaves, dout, backward, step, flex_one_stage=one_stage, gpu_time=gpu_time)

    info = {"spec": attn.spec.name, "params": attn.spec.param_values,
            **asdict(problem), "DV": D, "backward": backward,
            "allowed_pairs": counted.pairs, "allowed_pairs_exact": counted.exact,
            "flops_fwd": counted.forward, "flops_fwdbwd": counted.forward_backward,
            "gpu": torch.cuda.get_device_name() if device == "cuda" else device, "torch": torch.__version__,
            "triton": triton.__version__, "attngen": attngen.__version__, "python": platform.python_version(),
            "date": str(date.today())}
    notes = [f"FLOPs: {counted.describe()}; forward 2*(D+DV) a pair, forward+backward {1 + BACKWARD_FACTOR}x.",
             "ratio: the other's time over attngen's (above 1: attngen is faster).", *retried]
    if is_causal is None:
        notes.append(f"SDPA: not run ({why_not}).")
    if tables is not None:
        notes.append("attngen builds its tile tables in every call by default; Flex's BlockMask is built "
                     "outside the timed region, as attngen's are in 'attngen, tile tables prebuilt'.")
    elif facts.static_tables is not None:
        notes.append("the mask reads no input: attngen builds its tile tables on the first call (untimed) and "
                     "keeps them, as Flex's BlockMask is built outside the timed region.")
    return info, summarize(timings, counted), notes


def title(info: dict) -> str:
    return (f"{info['spec']}: B={info['B']} H={info['H']} HKV={info['HKV']} Q_LEN={info['Q_LEN']} "
            f"KV_LEN={info['KV_LEN']} D={info['D']} {info['dtype']}{_layout_words(info.get('layout', 'dense'))} "
            f"on {info['gpu']}")


def _layout_words(layout: str) -> str:
    return "" if layout == "dense" else ", q, k, v transposed views of (B, N, heads, D)"
