"""The `attngen` command line: compile a spec to a standalone module, or build and run it on random data."""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer

from attngen.errors import SpecError
from attngen.version import __version__

try:  # typer >= 0.26 vendors click; its usage errors derive from TyperException
    from typer import TyperException as UsageFailure
except ImportError:  # earlier typer raises click's own
    from click import ClickException as UsageFailure

app = typer.Typer(add_completion=False,
                  help="Compile attention variants written in the .attn language into fused Triton kernels.")


DefineOption = Annotated[Optional[list[str]], typer.Option(
    "-D", "--define", metavar="NAME=VALUE", help="Override a param of the spec (repeatable).")]
TargetOption = Annotated[Optional[str], typer.Option(
    help="Plan for this GPU: a100, h100, h200 or interpreter (default: the GPU here, else the interpreter).")]


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"attngen {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True, help="Print attngen's version and exit.")] = False,
) -> None:
    """Compile attention variants written in the .attn language into fused Triton kernels."""


def _usage_error(message: str) -> NoReturn:
    """A bad argument: one `error:` line and exit status 2, as `main` reports typer's own usage errors."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _check_size(option: str, value: int | None, most: int | None = None) -> None:
    """A size given on the command line (None: not given, a default applies) is in [1, most]."""
    if value is None:
        return
    if value < 1:
        _usage_error(f"{option} must be at least 1, got {value}")
    if most is not None and value > most:
        _usage_error(f"{option} must be at most {most}, got {value}")


def _check_output(option: str, path: Path | None) -> None:
    # Checked before the work, which can take long, rather than when writing at the end.
    if path is not None and (path.is_dir() or not path.parent.is_dir()):
        _usage_error(f"{option} must be a file in an existing folder, got {str(path)!r}")


def _defines(items: list[str] | None) -> dict[str, int | float]:
    params: dict[str, int | float] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            _usage_error(f"-D must be NAME=VALUE, got {item!r}")
        try:
            params[name.strip()] = int(value) if value.strip().lstrip("-").isdigit() else float(value)
        except ValueError:
            _usage_error(f"-D: the value of {name.strip()!r} must be a number, got {value!r}")
    return params


def _fail(error: Exception) -> NoReturn:
    # Spec errors already read `file:line:col: ...` (exit 1); argument errors name the argument.
    if isinstance(error, SpecError):
        typer.echo(str(error), err=True)
        raise typer.Exit(1)
    _usage_error(str(error))


def _read_spec_first(spec: Path, define: list[str] | None) -> None:
    """Reads the spec and its overrides before anything imports torch and triton (seconds): a wrong
    spec is reported at once. Reading it again later costs milliseconds."""
    from attngen.errors import ArgumentError
    from attngen.frontend import load_spec, with_params

    try:
        with_params(load_spec(spec)[0], _defines(define))
    except (SpecError, ArgumentError, ValueError) as e:
        _fail(e)


@app.command("compile")
def compile_command(
    spec: Annotated[Path, typer.Argument(help="The .attn spec file.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the kernel module.")],
    define: DefineOption = None,
    target: TargetOption = None,
    thin: Annotated[bool, typer.Option("--thin", help="Write only the spec's part (its kernels and declaration), "
                                       "which imports attngen.runtime, as attngen.build caches it.")] = False,
) -> None:
    """Write a standalone, readable kernel module (imports only torch and triton) exposing attn(): the
    spec's kernels, then attngen's runtime inlined below a marker; with --thin, the spec's part alone."""
    _read_spec_first(spec, define)
    from attngen import ArgumentError, SpecError, compile_source

    _check_output("--output", output)
    try:
        source = compile_source(spec, params=_defines(define), target=target, thin=thin)
        output.write_text(source)
    except (SpecError, ArgumentError, ValueError) as e:
        _fail(e)
    except OSError as e:
        _usage_error(f"--output must be a file one can write, got {str(output)!r} ({e.strerror})")
    typer.echo(f"wrote {output} ({len(source.splitlines())} lines)")


@app.command("run")
def run_command(
    spec: Annotated[Path, typer.Argument(help="The .attn spec file.")],
    define: DefineOption = None,
    batch: Annotated[Optional[int], typer.Option(help="B (default 2 on a GPU, 1 on the CPU).")] = None,
    heads: Annotated[Optional[int], typer.Option(help="H (default 16 on a GPU, 2 on the CPU).")] = None,
    kv_heads: Annotated[Optional[int], typer.Option(help="HKV (default: heads).")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Q_LEN = KV_LEN (default 4096 on a GPU, 80 on the CPU).")] = None,
    head_dim: Annotated[Optional[int], typer.Option(help="D = DV (default 128 on a GPU, 32 on the CPU).")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="bf16, f16 or f32 (default bf16 on a GPU, f16 on the CPU).")] = None,
    check: Annotated[bool, typer.Option(help="Compare forward, LSE and all gradients with the float64 reference.")] = True,
) -> None:
    """Build a spec and run it forward and backward on random data, checked against the reference."""
    _read_spec_first(spec, define)
    from attngen.intervals import MAX_LENGTH
    from attngen.plan import HEAD_DIMS
    import torch

    import attngen
    from attngen import ArgumentError, SpecError, testing

    for option, value, most in (("--batch", batch, None), ("--heads", heads, None),
                                ("--kv-heads", kv_heads, None), ("--seq-len", seq_len, MAX_LENGTH),
                                ("--head-dim", head_dim, HEAD_DIMS[-1])):
        _check_size(option, value, most)
    gpu = torch.cuda.is_available()
    B = batch if batch is not None else (2 if gpu else 1)
    H = heads if heads is not None else (16 if gpu else 2)
    HKV = kv_heads if kv_heads is not None else H
    N = seq_len if seq_len is not None else (4096 if gpu else 80)
    D = head_dim if head_dim is not None else (128 if gpu else 32)
    if H % HKV:
        _usage_error(f"--heads must be a multiple of --kv-heads, got {H} and {HKV}")
    dtypes = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
    name = dtype or ("bf16" if gpu else "f16")
    if name not in dtypes:
        _usage_error(f"--dtype must be one of bf16, f16, f32, got {name!r}")
    device = "cuda" if gpu else "cpu"
    try:
        t0 = time.perf_counter()
        attn = attngen.build(spec, params=_defines(define))
        built = time.perf_counter() - t0
    except (SpecError, ArgumentError, ValueError) as e:
        _fail(e)
    try:
        q, k, v = testing.random_qkv(B, H, HKV, N, N, D, D, dtypes[name], device=device)
        inputs = testing.random_inputs(attn.spec, B, H, HKV, N, N, device=device)
    except (ArgumentError, ValueError) as e:
        _fail(e)
    except RuntimeError as e:  # the allocator refusing sizes that passed the checks above
        _usage_error(f"--batch, --heads, --seq-len and --head-dim must give tensors this machine can allocate, "
                     f"got B={B} H={H} HKV={HKV} N={N} D={D}: {str(e).splitlines()[0]}")
    where = torch.cuda.get_device_name() if gpu else "CPU (Triton interpreter)"
    typer.echo(f"{attn.spec.name}: B={B} H={H} HKV={HKV} N={N} D={D} {name} on {where}")
    typer.echo(f"  kernels: {attn.path} (built in {built:.2f} s)")
    for x in (q, k, v):
        x.requires_grad_()
    t0 = time.perf_counter()
    out = attn(q, k, v, **inputs)
    out.float().sum().backward()
    if gpu:
        torch.cuda.synchronize()
    typer.echo(f"  forward + backward: {time.perf_counter() - t0:.3f} s (first call, compiles included)")
    if gpu:
        import triton

        with torch.no_grad():
            ms = triton.testing.do_bench(lambda: attn(q, k, v, **inputs), return_mode="median")
        typer.echo(f"  forward: {ms:.3f} ms (median)")
    if check:
        try:
            testing.check_against_reference(attn.spec, attn, q.detach(), k.detach(), v.detach(), inputs)
        except AssertionError as e:
            typer.echo(f"  check against the float64 reference FAILED:\n{e}", err=True)
            raise typer.Exit(1)
        outputs = "out, dq, dk, dv" if attn.spec.sigmoid else "out, lse, dq, dk, dv"  # sigmoid has no LSE
        typer.echo(f"  {outputs}" + "".join(f", d{i.name}" for i in attn.spec.learnable_inputs)
                   + ": match the float64 reference")


@app.command("explain")
def explain_command(
    spec: Annotated[Path, typer.Argument(help="The .attn spec file.")],
    q_len: Annotated[int, typer.Option("--q-len", help="Query length Q_LEN.")],
    kv_len: Annotated[Optional[int], typer.Option("--kv-len", help="Key length KV_LEN (default: Q_LEN).")] = None,
    define: DefineOption = None,
    target: TargetOption = None,
    head_dim: Annotated[int, typer.Option(help="D, the query/key head dim.")] = 128,
    head_dim_v: Annotated[Optional[int], typer.Option(help="DV, the value head dim (default: D).")] = None,
    dtype: Annotated[str, typer.Option(help="bf16, f16 or f32.")] = "bf16",
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Draw the tile maps into this image (needs matplotlib).")] = None,
    context_parallel: Annotated[Optional[int], typer.Option(
        "--context-parallel", metavar="W",
        help="Also show a context-parallel call over W ranks: the chunk pairs computed, the ring's paths, the schedule and why.")] = None,
    load_balance: Annotated[str, typer.Option(help="With --context-parallel: zigzag or contiguous.")] = "zigzag",
    schedule: Annotated[str, typer.Option(help="With --context-parallel: auto, ring or allgather.")] = "auto",
    heads: Annotated[int, typer.Option(help="With --context-parallel: H, the query heads (the schedule's model).")] = 16,
    kv_heads: Annotated[Optional[int], typer.Option(help="With --context-parallel: HKV (default: H).")] = None,
    batch: Annotated[int, typer.Option(help="With --context-parallel: B.")] = 1,
) -> None:
    """Show the IR, the plan and why, the tile map, and the FLOPs and HBM traffic it implies."""
    _read_spec_first(spec, define)
    from attngen.intervals import MAX_LENGTH
    from attngen.plan import DTYPES, HEAD_DIMS
    from attngen import ArgumentError, SpecError, api
    from attngen.report import explain

    for option, value, most in (("--q-len", q_len, MAX_LENGTH), ("--kv-len", kv_len, MAX_LENGTH),
                                ("--head-dim", head_dim, HEAD_DIMS[-1]),
                                ("--head-dim-v", head_dim_v, HEAD_DIMS[-1]), ("--context-parallel", context_parallel, None),
                                ("--heads", heads, None), ("--kv-heads", kv_heads, None), ("--batch", batch, None)):
        _check_size(option, value, most)
    if dtype not in DTYPES:
        _usage_error(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if context_parallel is not None:
        from attngen.distributed.schedule import LOAD_BALANCES, SCHEDULES

        if load_balance not in LOAD_BALANCES:
            _usage_error(f"--load-balance must be one of {', '.join(LOAD_BALANCES)}, got {load_balance!r}")
        if schedule not in SCHEDULES:
            _usage_error(f"--schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        if heads % (kv_heads or heads):
            _usage_error(f"--heads must be a multiple of --kv-heads, got {heads} and {kv_heads}")
    _check_output("--plot", plot)
    kv_len = kv_len if kv_len is not None else q_len
    try:
        result = api.explain(spec, params=_defines(define), target=target, q_len=q_len, kv_len=kv_len,
                             head_dim=head_dim, head_dim_v=head_dim_v if head_dim_v is not None else head_dim,
                             dtype=dtype)
        parallel = ""
        if context_parallel is not None:
            from attngen.distributed import schedule as schedules

            dv = head_dim_v if head_dim_v is not None else head_dim
            sizes = schedules.Sizes(batch, heads, kv_heads or heads, q_len, kv_len, head_dim, dv,
                                    4 if dtype == "f32" else 2)
            parallel = "\n\n" + schedules.plan(result.spec, context_parallel, load_balance, sizes, schedule).explain()
        typer.echo(result.text + parallel)
        if plot is not None:
            explain.plot(result.maps, f"{result.spec.name}: Q_LEN={q_len} KV_LEN={kv_len}", plot)
            typer.echo(f"\nwrote {plot}")
    except (SpecError, ArgumentError, ValueError) as e:
        _fail(e)
    except OSError as e:
        _usage_error(f"--plot must be a file one can write, got {str(plot)!r} ({e.strerror})")


@app.command("check")
def check_command(
    spec: Annotated[Path, typer.Argument(help="The .attn spec file.")],
    define: DefineOption = None,
    examples: Annotated[int, typer.Option(help="How many random cases to try.")] = 50,
    device: Annotated[Optional[str], typer.Option(help="cuda or cpu (default: cuda when there is a GPU).")] = None,
    dtype: Annotated[Optional[list[str]], typer.Option(help="f32, f16, bf16 or fp8 (an FP8 call's forward, within its bound; repeatable; default: f32 and f16, and bf16 on a GPU).")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Draw at random from this seed (default: the same fixed cases every run).")] = None,
    case: Annotated[Optional[str], typer.Option(help="Run just this case, as a failure prints it: B=..,H=..,...,seed=..")] = None,
) -> None:
    """Fuzz a spec's kernels against the float64 reference over random shapes and inputs, in plain calls
    and KV-cache calls (contiguous and paged, where the spec takes them); on failure, print the
    smallest failing case and a command that reruns it, and exit 1."""
    _read_spec_first(spec, define)
    from attngen.intervals import MAX_LENGTH
    from attngen.plan import HEAD_DIMS
    import torch

    import attngen
    from attngen import ArgumentError, SpecError
    from attngen.testing import fuzz, strategies

    _check_size("--examples", examples)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        _usage_error(f"--device must be cuda or cpu, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        _usage_error("--device must be cpu (Triton's interpreter) on a machine with no CUDA GPU, got 'cuda'")
    if device == "cpu" and torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        _usage_error("--device cpu must run in Triton's interpreter, chosen before triton is imported: "
                     "run TRITON_INTERPRET=1 attngen check ... --device cpu")
    dtypes = dtype or (["f32", "f16", "bf16"] if device == "cuda" else ["f32", "f16"])
    for name in dtypes:
        if name not in strategies.CASE_DTYPES:
            _usage_error(f"--dtype must be one of {', '.join(strategies.CASE_DTYPES)}, got {name!r}")
    try:
        single = strategies.Case.parse(case) if case is not None else None
    except ValueError as e:
        _usage_error(f"--case: {e}")
    if single is not None:
        for field, value, most in (("Q_LEN", single.Q_LEN, MAX_LENGTH), ("KV_LEN", single.KV_LEN, MAX_LENGTH),
                                   ("D", single.D, HEAD_DIMS[-1]), ("DV", single.DV, HEAD_DIMS[-1])):
            _check_size(f"--case's {field}", value, most)
    try:
        attn = attngen.build(spec, params=_defines(define))
    except (SpecError, ArgumentError, ValueError) as e:
        _fail(e)
    caches = strategies.CACHES  # every spec takes every call: training, contiguous and paged caches
    defines = "".join(f" -D {d}" for d in define or [])
    if single is not None:
        try:
            strategies.check_case(attn.spec, attn, single, device)
        except Exception as e:
            typer.echo(f"{attn.spec.name}: FAILED on {single}\n{type(e).__name__}: {e}", err=True)
            raise typer.Exit(1)
        typer.echo(f"{attn.spec.name}: {single} matches the float64 reference")
        return
    from hypothesis.errors import Unsatisfiable
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[case]}"), transient=True) as progress:
        task = progress.add_task(f"{attn.spec.name} on {device}", total=examples, case="")

        def seen(c):
            done = progress.tasks[0].completed
            if done >= examples:
                progress.update(task, description=f"{attn.spec.name}: shrinking a failure")
            progress.update(task, advance=1 if done < examples else 0, case=str(c))
        try:
            report = fuzz.fuzz_spec(attn.spec, attn, examples=examples, device=device, dtypes=dtypes,
                                    seed=seed, on_example=seen, caches=caches)
        except Unsatisfiable:
            report = None
    if report is None:
        typer.echo(f"{attn.spec.name}: no case could be checked: the spec indexes an input out of range at "
                   "every size tried", err=True)
        raise typer.Exit(1)
    skipped = (f"; {report.skipped} case(s) skipped, where the spec indexes an input out of range "
               f"({report.skip_reason})") if report.skipped else ""
    if report.failure is None:
        outputs = "out" if attn.spec.sigmoid else "out and lse"  # sigmoid attention has no LSE
        calls = f"; KV-cache calls too ({', '.join(c for c in caches if c != 'none')}: {outputs})"
        fp8 = "FP8 calls' out within its bound of the float64 reference (dequantized q, k, v; P rounded to e4m3)"
        if set(dtypes) == {strategies.FP8}:  # FP8 calls are dense forwards: nothing else was drawn
            typer.echo(f"{attn.spec.name}: {examples} random cases ({strategies.FP8}, {device}): {fp8}{skipped}")
            return
        fp8 = f"; {fp8}" if strategies.FP8 in dtypes else ""
        typer.echo(f"{attn.spec.name}: {examples} random cases ({', '.join(dtypes)}, {device}) match the "
                   f"float64 reference: {outputs.replace(' and ', ', ')} and every gradient, with dropout and without"
                   f"{calls}{fp8}{skipped}")
        return
    failure = report.failure
    typer.echo(f"{attn.spec.name}: FAILED. Smallest failing case hypothesis found:\n  {failure.case}\n"
               f"{type(failure.error).__name__}: {failure.error}\n\nrerun it with:\n"
               f"  attngen check {spec}{defines} --device {device} --case '{failure.case}'", err=True)
    raise typer.Exit(1)


@app.command("bench")
def bench_command(
    spec: Annotated[Path, typer.Argument(help="The .attn spec file.")],
    define: DefineOption = None,
    q_len: Annotated[int, typer.Option("--q-len", help="Query length Q_LEN.")] = 8192,
    kv_len: Annotated[Optional[int], typer.Option("--kv-len", help="Key length KV_LEN (default: Q_LEN).")] = None,
    batch: Annotated[int, typer.Option(help="B.")] = 2,
    heads: Annotated[int, typer.Option(help="H, the query heads.")] = 16,
    kv_heads: Annotated[Optional[int], typer.Option(help="HKV (default: heads).")] = None,
    head_dim: Annotated[int, typer.Option(help="D = DV.")] = 128,
    dtype: Annotated[str, typer.Option(help="bf16 or f16.")] = "bf16",
    layout: Annotated[str, typer.Option(help="q, k, v as dense (B, H, N, D) tensors, or as the transposed "
                                             "views of (B, N, H, D) ones that transformers passes.")] = "dense",
    backward: Annotated[bool, typer.Option(help="Time forward+backward too.")] = True,
    gpu_time: Annotated[bool, typer.Option("--gpu-time", help="Also give each call's GPU time, the sum of its "
                                           "kernels' (torch.profiler): where a call's time is well above it, the "
                                           "host bounds the call.")] = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Draw TFLOP/s as bars into this image (needs matplotlib).")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the rows to this JSON file.")] = None,
) -> None:
    """Time a spec's kernels on the GPU, forward and forward+backward, beside FlexAttention running the same
    variant (attngen.to_flex, torch.compile) and, for plain attention, SDPA's flash and cuDNN backends."""
    from attngen.intervals import MAX_LENGTH
    from attngen.plan import HEAD_DIMS
    import torch

    from attngen import ArgumentError, SpecError, bench, load_spec, with_params
    from attngen.testing.tolerances import LAYOUTS

    for option, value, most in (("--q-len", q_len, MAX_LENGTH), ("--kv-len", kv_len, MAX_LENGTH),
                                ("--batch", batch, None), ("--heads", heads, None), ("--kv-heads", kv_heads, None),
                                ("--head-dim", head_dim, HEAD_DIMS[-1])):
        _check_size(option, value, most)
    kv_heads = kv_heads if kv_heads is not None else heads
    if heads % kv_heads:
        _usage_error(f"--heads must be a multiple of --kv-heads, got {heads} and {kv_heads}")
    if dtype not in bench.DTYPES:
        _usage_error(f"--dtype must be one of {', '.join(bench.DTYPES)}, got {dtype!r}")
    if layout not in LAYOUTS:
        _usage_error(f"--layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    _check_output("--plot", plot)
    _check_output("--json", json_path)
    params = _defines(define)
    try:
        with_params(load_spec(spec)[0], params)
        if plot is not None:
            bench.require_matplotlib()
    except (SpecError, ArgumentError, ValueError) as e:
        _fail(e)
    if not torch.cuda.is_available():
        _usage_error("attngen bench times kernels on a CUDA GPU, and this machine has none "
                     "(attngen run and attngen check work on the CPU)")
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        _usage_error("attngen bench must time compiled kernels, got TRITON_INTERPRET set: unset it")
    problem = bench.Problem(batch, heads, kv_heads, q_len, kv_len if kv_len is not None else q_len, head_dim, dtype,
                            layout)

    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(f"{spec.name}: starting", total=None)
        try:
            info, rows, notes = bench.run(spec, params, problem, backward=backward, gpu_time=gpu_time,
                                          step=lambda what: progress.update(task, description=what))
        except (SpecError, ArgumentError, ValueError) as e:
            _fail(e)
        except torch.cuda.OutOfMemoryError as e:
            _usage_error(f"--batch, --heads, --q-len, --kv-len and --head-dim must give tensors the GPU can hold, "
                         f"got {problem.describe()}: {str(e).splitlines()[0]}")
    console = Console()
    if not console.is_terminal:  # a log or a pipe: the whole table, not one cut to 80 columns
        console = Console(width=132)
    console.print(bench.table(rows, bench.title(info)))
    for note in notes:
        console.print(note, markup=False, highlight=False)
    try:
        if json_path is not None:
            bench.write_json(json_path, info, rows)
            typer.echo(f"wrote {json_path}")
        if plot is not None:
            bench.plot(rows, bench.title(info), plot)
            typer.echo(f"wrote {plot}")
    except OSError as e:
        _usage_error(f"--json and --plot must be files one can write, got {e.filename!r} ({e.strerror})")
    if rows[0]["fwd_ms"] is None:
        typer.echo(f"attngen's own kernels did not run: {rows[0]['note']}", err=True)
        raise typer.Exit(1)


def _format_warning(message, category, filename, lineno, line=None) -> str:
    # A user of the command runs no Python of their own: where the warning was raised is noise.
    return f"warning: {message}\n"


def main() -> int:
    """The console script: typer's own usage errors (not an integer, a missing or unknown option) come
    out as one `error:` line with exit status 2, like attngen's checks, instead of typer's panel;
    warnings as one `warning:` line each."""
    warnings.formatwarning = _format_warning
    try:
        # A bare `attngen` shows the help, as `attngen --help` does.
        return app(args=sys.argv[1:] or ["--help"], standalone_mode=False) or 0
    except UsageFailure as e:
        typer.echo(f"error: {' '.join(e.format_message().split())}", err=True)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
