"""The `attngen` command line: compile a spec to a standalone module, or build and run it on random data."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from attngen.errors import SpecError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Compile attention variants written in the .attn language into fused Triton kernels.")

DefineOption = Annotated[Optional[list[str]], typer.Option(
    "-D", "--define", metavar="NAME=VALUE", help="Override a param of the spec (repeatable).")]
TargetOption = Annotated[Optional[str], typer.Option(
    help="Plan for this GPU: a100, h100, h200 or interpreter (default: the GPU here, else the interpreter).")]


def _defines(items: list[str] | None) -> dict[str, int | float]:
    params: dict[str, int | float] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise typer.BadParameter(f"must be NAME=VALUE, got {item!r}", param_hint="-D")
        try:
            params[name.strip()] = int(value) if value.strip().lstrip("-").isdigit() else float(value)
        except ValueError:
            raise typer.BadParameter(f"the value of {name.strip()!r} must be a number, got {value!r}",
                                     param_hint="-D") from None
    return params


def _fail(error: Exception) -> None:
    # Spec errors already read `file:line:col: ...`; argument errors name the argument.
    typer.echo(str(error) if isinstance(error, SpecError) else f"error: {error}", err=True)
    raise typer.Exit(1)


@app.command("compile")
def compile_command(
    spec: Annotated[Path, typer.Argument(help="The .attn spec file.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the kernel module.")],
    define: DefineOption = None,
    target: TargetOption = None,
) -> None:
    """Write a standalone, readable kernel module (imports only torch and triton) exposing attn()."""
    from attngen import ArgumentError, SpecError, compile_source

    try:
        source = compile_source(spec, params=_defines(define), target=target)
    except (SpecError, ArgumentError, ValueError) as e:
        _fail(e)
    output.write_text(source)
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
    import torch

    import attngen
    from attngen import ArgumentError, SpecError, testing

    gpu = torch.cuda.is_available()
    B = batch or (2 if gpu else 1)
    H = heads or (16 if gpu else 2)
    HKV = kv_heads or H
    N = seq_len or (4096 if gpu else 80)
    D = head_dim or (128 if gpu else 32)
    dtypes = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
    name = dtype or ("bf16" if gpu else "f16")
    if name not in dtypes:
        raise typer.BadParameter(f"must be one of bf16, f16, f32, got {name!r}", param_hint="--dtype")
    device = "cuda" if gpu else "cpu"
    try:
        t0 = time.perf_counter()
        attn = attngen.build(spec, params=_defines(define))
        built = time.perf_counter() - t0
        q, k, v = testing.random_qkv(B, H, HKV, N, N, D, D, dtypes[name], device=device)
        inputs = testing.random_inputs(attn.spec, B, H, HKV, N, N, device=device)
    except (SpecError, ArgumentError, ValueError) as e:
        _fail(e)
    where = torch.cuda.get_device_name() if gpu else "CPU (Triton interpreter)"
    typer.echo(f"{attn.spec.name}: B={B} H={H} HKV={HKV} N={N} D={D} {name} on {where}")
    typer.echo(f"  kernels: {attn.path} (built in {built:.2f} s)")
    for x in (q, k, v):
        x.requires_grad_()
    t0 = time.perf_counter()
    out, lse = attn(q, k, v, return_lse=True, **inputs)
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
        typer.echo("  out, lse, dq, dk, dv" + "".join(f", d{i.name}" for i in attn.spec.learnable_inputs)
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
) -> None:
    """Show the IR, the plan and why, the tile map, and the FLOPs and HBM traffic it implies."""
    from attngen import ArgumentError, SpecError, explain, load_spec
    from attngen.target import get_target

    try:
        parsed = load_spec(spec)[0].with_params(_defines(define))
        text, maps = explain.report(parsed, get_target(target), q_len, kv_len or q_len, head_dim,
                                    head_dim_v or head_dim, dtype)
        typer.echo(text)
        if plot is not None:
            explain.plot(maps, f"{parsed.name}: Q_LEN={q_len} KV_LEN={kv_len or q_len}", plot)
            typer.echo(f"\nwrote {plot}")
    except (SpecError, ArgumentError, ValueError) as e:
        _fail(e)


@app.command("check")
def check_command(
    spec: Annotated[Path, typer.Argument(help="The .attn spec file.")],
    define: DefineOption = None,
    examples: Annotated[int, typer.Option(help="How many random cases to try.")] = 50,
    device: Annotated[Optional[str], typer.Option(help="cuda or cpu (default: cuda when there is a GPU).")] = None,
    dtype: Annotated[Optional[list[str]], typer.Option(help="f32, f16 or bf16 (repeatable; default: f32 and f16, and bf16 on a GPU).")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Draw at random from this seed (default: the same fixed cases every run).")] = None,
    case: Annotated[Optional[str], typer.Option(help="Run just this case, as a failure prints it: B=..,H=..,...,seed=..")] = None,
) -> None:
    """Fuzz a spec's kernels against the float64 reference over random shapes and inputs; on failure,
    print the smallest failing case and a command that reruns it, and exit 1."""
    import torch

    import attngen
    from attngen import ArgumentError, SpecError, fuzz

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        raise typer.BadParameter(f"must be cuda or cpu, got {device!r}", param_hint="--device")
    if device == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter("no CUDA GPU here; use --device cpu (Triton's interpreter)", param_hint="--device")
    if device == "cpu" and torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise typer.BadParameter("the CPU needs Triton's interpreter, chosen before triton is imported: "
                                 "run TRITON_INTERPRET=1 attngen check ... --device cpu", param_hint="--device")
    dtypes = dtype or (["f32", "f16", "bf16"] if device == "cuda" else ["f32", "f16"])
    for name in dtypes:
        if name not in fuzz.DTYPES:
            raise typer.BadParameter(f"must be one of {', '.join(fuzz.DTYPES)}, got {name!r}", param_hint="--dtype")
        if name == "bf16" and device == "cpu":
            raise typer.BadParameter("bf16 needs a GPU: Triton's interpreter computes bf16 dots wrongly",
                                     param_hint="--dtype")
    if examples < 1:
        raise typer.BadParameter(f"must be at least 1, got {examples}", param_hint="--examples")
    try:
        attn = attngen.build(spec, params=_defines(define))
        single = fuzz.Case.parse(case) if case is not None else None
    except (SpecError, ArgumentError, ValueError) as e:
        _fail(e)
    defines = "".join(f" -D {d}" for d in define or [])
    if single is not None:
        try:
            fuzz.check_case(attn.spec, attn, single, device)
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
                                    seed=seed, on_example=seen)
        except Unsatisfiable:
            report = None
    if report is None:
        typer.echo(f"{attn.spec.name}: no case could be checked: the spec indexes an input out of range at "
                   "every size tried", err=True)
        raise typer.Exit(1)
    skipped = (f"; {report.skipped} case(s) skipped, where the spec indexes an input out of range "
               f"({report.skip_reason})") if report.skipped else ""
    if report.failure is None:
        typer.echo(f"{attn.spec.name}: {examples} random cases ({', '.join(dtypes)}, {device}) match the "
                   f"float64 reference: out, lse and every gradient{skipped}")
        return
    failure = report.failure
    typer.echo(f"{attn.spec.name}: FAILED. Smallest failing case hypothesis found:\n  {failure.case}\n"
               f"{type(failure.error).__name__}: {failure.error}\n\nrerun it with:\n"
               f"  attngen check {spec}{defines} --device {device} --case '{failure.case}'", err=True)
    raise typer.Exit(1)


def main() -> None:  # pragma: no cover - the console script calls app directly
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
