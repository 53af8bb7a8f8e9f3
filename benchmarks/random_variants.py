"""Variants nobody wrote by hand: random specs from attngen's own spec strategy, timed on the GPU against
FlexAttention, and the distribution of the ratios.

    python benchmarks/random_variants.py [--count 50] [--seed 0] [--start 0] [--end 50] [--n 4096] [--json FILE] [--visits]
                                         [--warm JOBS]
    python benchmarks/random_variants.py --published [--visits] [--json FILE]
    python benchmarks/random_variants.py --summarize FILE [FILE ...]
    python benchmarks/random_variants.py --start 44 --end 45 --export DIR

The specs are `attngen.testing.strategies.spec_texts(with_mask=True, with_sink=False, with_sigmoid=False)`
(Flex has neither sinks nor sigmoid): masks of every atom (windows, chunks, prefixes, documents, block layouts,
flags, integers past int32, `%` and products) under `and`/`or`/`not`, scores of every function, learnable inputs included, drawn with a fixed seed, so a
run is repeatable and `--start`/`--end` split one list of `--count` over several device calls. The strategy sizes
its params (`w`, `c`) for 48-token interpreter cases; here they are scaled by N // 48, so windows and
chunks keep their proportion to the sequence. A spec whose mask allows no pair at these sizes is
listed and left out of the ratios.

Each spec runs as `attngen bench` runs one (attngen.bench): the same q, k, v and inputs for attngen
(`attngen.build`, with whatever the planner chose for its tiles: closed-form ranges, tables kept after
the first call for a mask that reads no input, or tables built in every call, whose prebuilt times are
recorded too) and Flex (`to_flex(spec)` under `torch.compile(flex_attention)`, its BlockMask built
outside the timed region); medians of `triton.testing.do_bench`, forward under no_grad, forward+backward
with a fixed dO. Ratio: Flex's time over attngen's (above 1, attngen is faster). The target: median >=
1.3x forward and >= 1.2x forward+backward, none below 1.0x, over at least 50 specs at N >= 4k. The default
shape, B4 H16 N4096 D64, holds 16k tokens a batch, as FlashAttention-3's figures do. Each row also has each
side's GPU time (bench.kernel_ms: its kernels' sum, the host's gaps left out) and their ratio, so a spec whose
call is bound by its host's time (a mask that allows few pairs, where both sides' calls are mostly Python and
launches) is told apart from one whose kernels are slower.

`--visits` also records, per spec, what the portable kernels visit at this N for one batch row and head
(`visit_counts`, bf16 tiles) against the tiles the reference mask needs: visited, needed, wasted (empty
tiles visited) and full tiles run with mask code, per kernel, so a slow spec can be told apart from one
that visits too much. `--no-time` skips the timing (and the GPU: on a CPU the interpreter counts, at a
small --n). `--published` runs the four published masks of benchmarks/published (2-D neighbourhood, block
diffusion, sliding tiles with text, global tokens and a band; their params are written for N = 4096)
instead of drawn specs. `--summarize` merges the rows of several --json files (a run split over device
calls by --start/--end) and prints their summary. `--warm JOBS` first runs every spec once in JOBS worker
processes and drops the results: compiling attngen's kernels and Flex's graphs is most of a spec's time, and
in parallel it fills the on-disk caches (Triton's, Inductor's) that the timed pass, one spec at a time on
the GPU, then reads. `--export DIR` writes the selected specs as .attn files, as drawn and scaled to --n, for
the tools that take a spec file (tools/host_split.py, tools/hopper/ncu_profile.sh).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from attngen import ir, testing, with_params
from attngen.frontend import parse_spec
from attngen.frontend.printer import to_source
from attngen.testing import strategies

PUBLISHED = Path(__file__).resolve().parent / "published"

# The params the strategy declares whose values are lengths (windows, chunks): scaled with N.
LENGTH_PARAMS = ("w", "c")


def draw_specs(count: int, seed: int = 0) -> list[str]:
    """`count` spec texts with a mask, drawn by hypothesis from `seed` (the same list every run of the same
    hypothesis version; the texts themselves are what the results record). Hypothesis draws small
    examples first and larger ones later, and many differ only in what they declare: of the distinct
    (mask, score) pairs of 30 * count draws, `count` evenly spaced ones are kept."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    pool: dict[tuple[str, str], str] = {}

    @hypothesis_seed(seed)
    @settings(database=None, max_examples=30 * count, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategies.spec_texts(with_mask=True, with_sink=False, with_sigmoid=False))  # Flex has neither
    def draw(text: str) -> None:
        pool.setdefault(_variant(text), text)

    draw()
    if len(pool) < count:
        raise RuntimeError(f"the strategy gave {len(pool)} distinct variants of the {count} asked for")
    texts = list(pool.values())
    return [texts[i * len(texts) // count] for i in range(count)]


def _variant(text: str) -> tuple[str, str]:
    """What a spec computes, as far as telling variants apart goes: its mask and score lines, comments off."""
    lines = {line.split(":", 1)[0]: line.split("#", 1)[0].strip() for line in text.splitlines() if ":" in line}
    return lines.get("mask", ""), lines.get("score", "")


def scaled(text: str, n: int) -> ir.Spec:
    """The spec of `text` with its length params scaled from the strategy's 48-token cases to length `n`."""
    spec = parse_spec(text)
    factor = max(1, n // 48)
    overrides = {p.name: p.value * factor for p in spec.params
                 if p.name in LENGTH_PARAMS and isinstance(p.value, int)}
    return with_params(spec, overrides)


def _summary(ratios: list[float]) -> dict:
    if not ratios:
        return {"count": 0}
    ordered = sorted(ratios)
    return {"count": len(ordered), "median": statistics.median(ordered), "min": ordered[0],
            "p10": ordered[len(ordered) // 10], "max": ordered[-1], "below_1": sum(r < 1.0 for r in ordered)}


def visit_row(spec: ir.Spec, n: int, head_dim: int, device: str) -> dict:
    """What the portable kernels visit at Q_LEN = KV_LEN = n for one batch row and head, per kernel, against
    the tiles the mask needs (attngen.testing.visits.visit_summary), and how the plan finds them."""
    import attngen
    from attngen.testing import visits

    attn = attngen.build(spec)
    q, k, v = testing.random_qkv(1, 1, 1, n, n, head_dim, head_dim, torch.bfloat16, device=device, seed=2)
    inputs = testing.random_inputs(attn.spec, 1, 1, 1, n, n, device=device, seed=2)
    return {"tile_list": attn.plan.visits, **visits.visit_summary(attn, q, k, v, inputs)}


def _specs(args) -> list[tuple[int | str, str, ir.Spec]]:
    """(index or name, text, spec) of what this run measures."""
    if args.published:
        return [(path.stem, path.read_text(), parse_spec(path.read_text())) for path in sorted(PUBLISHED.glob("*.attn"))]
    texts = draw_specs(args.count, args.seed)[args.start:args.end]
    return [(index, text, scaled(text, args.n)) for index, text in enumerate(texts, start=args.start)]


def _export(args) -> None:
    """--export: the selected specs as .attn files, as drawn and scaled to --n."""
    folder = Path(args.export)
    folder.mkdir(parents=True, exist_ok=True)
    for index, text, spec in _specs(args):
        (folder / f"rv{index}.attn").write_text(text)
        (folder / f"rv{index}-n{args.n}.attn").write_text(to_source(spec))
        print(folder / f"rv{index}.attn", folder / f"rv{index}-n{args.n}.attn")


def _describe_visits(row: dict) -> str:
    seen = row.get("visits")
    if not seen:
        return ""
    parts = [f"{kernel} {s['visited']}/{s['needed']} visited/needed, {s['wasted']} wasted, {s['masked_full']} full masked"
             for kernel, s in seen.items() if kernel != "tile_list"]
    return f"\n    tiles ({seen['tile_list']}): " + "; ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--start", type=int, default=0, help="measure the drawn specs from this index")
    parser.add_argument("--end", type=int, help="... up to (not including) this index (default: all --count)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n", type=int, default=4096, help="Q_LEN = KV_LEN")
    parser.add_argument("--batch", type=int, default=4, help="16k tokens a batch at the default N, as FA3 measures")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--json", help="write every row and the summary to this file")
    parser.add_argument("--visits", action="store_true", help="also count each kernel's visited tiles against those needed")
    parser.add_argument("--no-time", action="store_true", help="time nothing (with --visits: count only)")
    parser.add_argument("--published", action="store_true", help="the published masks of benchmarks/published")
    parser.add_argument("--warm", type=int, default=1, metavar="JOBS",
                        help="first compile every spec in JOBS worker processes, then time them one by one")
    parser.add_argument("--summarize", nargs="+", metavar="FILE", help="merge these --json files' rows and summarize")
    parser.add_argument("--export", metavar="DIR",
                        help="write each selected spec as DIR/rvINDEX.attn (as drawn: tools/host_split.py scales "
                             "it) and DIR/rvINDEX-nN.attn (scaled to --n: for attngen.build, tools/hopper/one_call.py)")
    args = parser.parse_args()
    if args.export:
        _export(args)
        return 0
    if args.summarize:
        rows = [row for name in args.summarize for row in json.loads(Path(name).read_text())["rows"]]
        print(json.dumps(_summaries(rows), indent=1))
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.no_time:
        print("error: random_variants.py times kernels on a CUDA GPU, and this machine has none (--no-time --visits "
              "counts tiles on the CPU)", file=sys.stderr)
        return 2

    specs = _specs(args)
    if args.warm > 1:
        _warm(args, specs)
    from attngen import bench

    problem = _problem(bench, args)
    rows: list[dict] = []
    summary: dict = {}
    for index, text, spec in specs:
        row = _row(args, bench, problem, device, index, text, spec)
        rows.append(row)
        ratios = "  ".join(f"{label} {_ratio(row.get(key))}" for label, key in (
            ("fwd", "fwd_ratio"), ("fwd+bwd", "fwdbwd_ratio"), ("GPU fwd", "fwd_gpu_ratio"),
            ("GPU fwd+bwd", "fwdbwd_gpu_ratio")))
        print(f"[{index}] allowed {row.get('allowed', float('nan')):.3f}  {ratios}  "
              f"{row.get('note', '')}{_describe_visits(row)}\n    " + text.strip().replace("\n", "\n    "), flush=True)
        summary = _write(args, rows)  # after every spec: a run cut short keeps what it measured
    print(json.dumps(summary, indent=1))
    return 0


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _row(args, bench, problem, device: str, index, text: str, spec: ir.Spec) -> dict:
    """One spec's row: the share of pairs its mask allows, its visited tiles (--visits) and its times."""
    row: dict = {"index": index, "spec": text, "params": spec.param_values}
    try:
        inputs = testing.random_inputs(spec, problem.B, problem.H, problem.HKV, args.n, args.n, device=device, seed=2)
        counted = bench.count_flops(spec, problem, inputs, device=device)
        row["allowed"] = counted.pairs / counted.total_pairs
        if counted.pairs == 0:
            row["note"] = "the mask allows no pair at these sizes"
        else:
            if args.visits:
                row["visits"] = visit_row(spec, args.n, args.head_dim, device)
            if not args.no_time:
                row.update(_timed(bench, spec, problem, counted))
    except Exception as e:  # one spec's failure is its row's note; the run goes on
        row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return row


def _problem(bench, args):
    """The shapes every spec of the run is timed at."""
    return bench.Problem(args.batch, args.heads, args.heads, args.n, args.n, args.head_dim, "bf16")


def _warm(args, specs) -> None:
    """Each spec's row computed once in --warm worker processes, its results dropped: the compiles it runs
    (attngen's kernels, Flex's graphs under Inductor, the visit-counting kernels) land in the on-disk caches
    that the timed pass then reads, so the compiling, which is most of a spec's time, runs in parallel on
    the machine's cores while the timing stays alone on the GPU."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    with ProcessPoolExecutor(max_workers=args.warm, mp_context=context) as pool:
        for index in pool.map(_warm_one, [(vars(args), *spec) for spec in specs]):
            print(f"[{index}] compiled", flush=True)


def _warm_one(job) -> int | str:
    """A worker's spec (_warm): its row, discarded."""
    arguments, index, text, spec = job
    args = argparse.Namespace(**arguments)
    from attngen import bench

    device = "cuda" if torch.cuda.is_available() else "cpu"
    problem = _problem(bench, args)
    _row(args, bench, problem, device, index, text, spec)
    return index


def _timed(bench, spec: ir.Spec, problem, counted) -> dict:
    """One spec's times and ratios against Flex (attngen.bench.run), with the prebuilt tables' times where the
    mask's tables are built in every call."""
    _, timed, _ = bench.run(spec, None, problem, counted=counted, gpu_time=True)
    by_name = {r["implementation"]: r for r in timed}
    ours, flex = by_name.get(bench.ATTNGEN, {}), by_name.get(bench.FLEX, {})
    prebuilt = by_name.get(bench.ATTNGEN_PREBUILT, {})
    return {"attngen_fwd_ms": ours.get("fwd_ms"), "attngen_fwdbwd_ms": ours.get("fwdbwd_ms"),
            "prebuilt_fwd_ms": prebuilt.get("fwd_ms"), "prebuilt_fwdbwd_ms": prebuilt.get("fwdbwd_ms"),
            "flex_fwd_ms": flex.get("fwd_ms"), "flex_fwdbwd_ms": flex.get("fwdbwd_ms"),
            "fwd_ratio": flex.get("fwd_ratio"), "fwdbwd_ratio": flex.get("fwdbwd_ratio"),
            "attngen_fwd_gpu_ms": ours.get("fwd_gpu_ms"), "attngen_fwdbwd_gpu_ms": ours.get("fwdbwd_gpu_ms"),
            "flex_fwd_gpu_ms": flex.get("fwd_gpu_ms"), "flex_fwdbwd_gpu_ms": flex.get("fwdbwd_gpu_ms"),
            "fwd_gpu_ratio": flex.get("fwd_gpu_ratio"), "fwdbwd_gpu_ratio": flex.get("fwdbwd_gpu_ratio"),
            "note": "; ".join(n for n in (ours.get("note"), flex.get("note")) if n)}


def _summaries(rows: list[dict]) -> dict:
    """The ratios' summary of `rows`, forward and forward+backward, and the tiles wasted where counted."""
    summary = {part: _summary([r[f"{part}_ratio"] for r in rows if r.get(f"{part}_ratio")])
               for part in ("fwd", "fwdbwd", "fwd_gpu", "fwdbwd_gpu")}
    counted = [r["visits"] for r in rows if r.get("visits")]
    if counted:
        summary["visits"] = {"specs": len(counted),
                             "with_wasted_tiles": sum(any(v[k]["wasted"] for k in ("fwd", "dkdv", "dq")) for v in counted),
                             "with_masked_full_tiles": sum(any(v[k]["masked_full"] for k in ("fwd", "dkdv", "dq"))
                                                           for v in counted)}
    return summary


def _write(args, rows: list[dict]) -> dict:
    """The summary of `rows` (_summaries), written with them to --json if given."""
    import triton

    summary = _summaries(rows)
    if args.json:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
                       "args": vars(args), "summary": summary, "rows": rows}, f, indent=1)
    return summary


if __name__ == "__main__":
    sys.exit(main())
