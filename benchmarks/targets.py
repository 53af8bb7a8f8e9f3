"""Issue 13's targets table: attngen beside cuDNN, SDPA flash and FlexAttention on the issue's shapes, each
target met or missed, for attngen as built for this GPU and for its portable family; prints it, writes JSON.
With issue 35's first-call cases (`--only first_call`): each catalog spec's first forward and backward with
cold caches, attngen's against Flex's.

    PYTHONPATH=$PWD python benchmarks/targets.py                      # every case, on an H200
    PYTHONPATH=$PWD python benchmarks/targets.py --quick              # a smoke run: N/4, three catalog specs
    PYTHONPATH=$PWD python benchmarks/targets.py --only causal,catalog --out causal-and-catalog.json
    python benchmarks/targets.py --list                               # the cases' names (no GPU needed)

A measurement is one spec at one size, timed as `attngen bench` times it (attngen.bench): the same q, k, v
and inputs for every implementation, Flex's BlockMask built outside the timed region, bf16 medians of
do_bench, the forward under no_grad and forward+backward with a fixed dO. Two attngen builds run side by
side: "attngen" (`attngen.build(spec)`, planned for this GPU: on an H200 the Hopper family's forward where
its rule serves the call) and "attngen portable" (planned for an A100: the portable family only, which
runs on the H200 as it is); the table says which family each one's forward ran.

A case is a measurement or two and the targets issue 13 sets on them. "x cuDNN" and "x Flex" targets are
speed ratios as attngen bench defines them (the other's time over attngen's: above 1, attngen is faster);
the softcap and learned_rel_bias targets are time ratios (the variant's time over plain attention's, both
by the same implementation). A target whose times are missing is "not measured", never "met".

A first-call case (group `first_call`) runs benchmarks/first_call.py's measurement: attngen's and Flex's first
forward and backward of the spec at B2 H16 N4096 D128, each in a process of its own whose Triton, Inductor and
attngen caches are empty folders; its target is attngen's first call no longer than Flex's (a speed ratio >= 1).

A backward case (group `backward`, issue 35's target 1) times a catalog spec at FA3's shapes (16k tokens a batch,
hidden 2048) as the other cases do; its rate target is the backward alone's (the forward+backward median less the
forward's, over 2.5 times the forward's FLOPs), beside forward+backward against cuDNN's at D=64 and D=128.

An FP8 case (group `fp8`, issue 35's target 4) times the FP8 call (docs/api.md, FP8 calls: float8_e4m3fn q, k and
v, descale factors of 1) at FA3's shapes (16k tokens a batch, hidden 2048) for both attngen builds, beside
attngen's bf16 call and cuDNN's bf16 forward; its targets are rates, TFLOP/s over the allowed pairs (4 * D FLOPs
each), the ratio being the rate reached over the rate asked.

Where Flex's own configurations run out of shared memory in its backward (a score reading a learnable table
does), its forward+backward is timed again with one pipeline stage in the backward (as `attngen bench` does,
and as a Flex user would pass it in kernel_options), on its own row, and the Flex targets judge that row.

Everything but `measure`, `measure_fp8` and `main` runs on the CPU (tests/test_targets_script.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path
from typing import Callable, Mapping

from attngen import bench
from attngen.bench import ATTNGEN, ATTNGEN_PREBUILT, FLEX, FLEX_ONE_STAGE, Problem, Timing

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
RESULTS = ROOT / "benchmarks" / "results"

PORTABLE = "attngen portable"
# An A100 plan offers the portable family alone; its kernels use no sm_90 feature, so they run on the H200.
PORTABLE_TARGET = "a100"
CUDNN = "sdpa cudnn"
# The two attngen builds each target is evaluated for, in the table's order.
JUDGED = (ATTNGEN, PORTABLE)
PHASES = {"fwd": "forward", "fwdbwd": "forward+backward", "bwd": "backward", "first": "first call"}
# Issue 35's first-call cases: one catalog spec's first forward and backward, compiles included, with cold
# Triton, Inductor and attngen caches (benchmarks/first_call.py, a process per implementation), attngen as built
# for this GPU beside Flex; the portable build is not measured there. Their shape is first_call.py's default.
FIRST_CALL = "first_call"
FIRST_CALL_SHAPE = (2, 16, 4096, 128)
FIRST_CALL_RUNS = {ATTNGEN: "attngen", FLEX: "flex"}  # the implementation's name in first_call.py
# Issue 35's FP8 cases: (label, N, D, TFLOP/s asked), at FA3's shapes: B = 16384 / N, H = 2048 / D.
FP8 = "fp8"
FP8_CASES = (("d128", 8192, 128, 1000.0), ("d256", 8192, 256, 1100.0))
ATTNGEN_BF16 = "attngen bf16"  # the FP8 case's bf16 call of the same build, beside it
# Issue 35's backward cases (target 1): (spec, N, D, TFLOP/s asked of the backward alone, forward+backward's
# speed asked against cuDNN's or None), at FA3's shapes.
BACKWARD = "backward"
BACKWARD_CASES = (("full", 8192, 64, 480.0, 1.0), ("causal", 8192, 64, 480.0, 1.0), ("full", 8192, 128, 580.0, 1.1),
                  ("causal", 8192, 128, 580.0, 1.1), ("full", 8192, 256, 450.0, None),
                  ("causal", 8192, 256, 450.0, None))

PLAIN = "attention plain\n"
SOFTCAP = "attention softcap\nparam cap = 30.0\nscore: softcap(score, cap)\n"
CATALOG = "catalog"  # the group name: --only catalog runs every catalog spec's case
QUICK_DIVISOR = 4  # --quick divides every sequence length by this
QUICK_CATALOG = ("causal", "document_causal", "gemma2_local")  # a mask, a tile-table mask, a score

MET, MISSED, NOT_MEASURED, SHOWN = "met", "missed", "not measured", "shown"


# --- cases and targets -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Measurement:
    """One spec at one size, every implementation timed on the same inputs."""
    label: str  # the spec's short name in the tables
    spec: str  # an .attn path or spec text, as attngen.build takes it
    problem: Problem
    first_call: bool = False  # a first call with cold caches (FIRST_CALL), not timed calls
    fp8: bool = False  # FP8 calls (FP8): float8_e4m3fn q, k and v

    @property
    def key(self) -> str:
        p = self.problem
        heads = f"H{p.H}" if p.HKV == p.H else f"H{p.H}/{p.HKV}"
        kind = "first call " if self.first_call else "fp8 " if self.fp8 else ""
        return f"{kind}{self.label} B{p.B} {heads} N{p.Q_LEN} D{p.D}"


@dataclass(frozen=True)
class Result:
    """What one measurement gave: each implementation's Timing, the family each attngen build's forward ran,
    why an implementation was not run at all, or why the whole measurement failed (`error`)."""
    timings: dict[str, Timing] = field(default_factory=dict)
    families: dict[str, str] = field(default_factory=dict)
    absent: dict[str, str] = field(default_factory=dict)
    error: str = ""
    rows: list[dict] = field(default_factory=list)  # bench.summarize's, for the raw-times table and the JSON
    notes: list[str] = field(default_factory=list)
    flops: dict[str, float] = field(default_factory=dict)  # phase -> FLOPs over the allowed pairs


Results = Mapping[str, Result]  # Measurement.key -> Result


def phase_ms(results: Results, measurement: Measurement, implementation: str,
             phase: str) -> tuple[float | None, str]:
    """`implementation`'s median ms for `phase` on `measurement`, or None and why there is none."""
    result = results.get(measurement.key)
    if result is None:
        return None, f"{measurement.key} not run"
    if result.error:
        return None, f"{measurement.key} failed: {result.error}"
    timing = result.timings.get(implementation)
    if implementation == FLEX and FLEX_ONE_STAGE in result.timings and _ms(timing, phase) is None:
        return phase_ms(results, measurement, FLEX_ONE_STAGE, phase)
    if timing is None:
        why = result.absent.get(implementation, "not run")
        return None, f"{implementation} on {measurement.key}: {why}"
    ms = _ms(timing, phase)
    if ms is None:
        return None, f"{implementation} on {measurement.key}: {timing.note or PHASES[phase] + ' not timed'}"
    return ms, ""


def _ms(timing: Timing | None, phase: str) -> float | None:
    if timing is None:
        return None
    if phase == "first":
        return timing.first_call_s * 1000 if timing.first_call_s is not None else None
    if phase == "bwd":  # the backward alone: forward+backward less the forward, both medians
        return timing.fwdbwd_ms - timing.fwd_ms if None not in (timing.fwd_ms, timing.fwdbwd_ms) else None
    return timing.fwd_ms if phase == "fwd" else timing.fwdbwd_ms


def times(bound: float) -> str:
    """A target's factor as the issue writes it: 1.0x, 0.9x, 2.0x."""
    return f"{bound:.1f}x" if round(bound, 1) == bound else f"{bound:g}x"


@dataclass(frozen=True)
class SpeedTarget:
    """attngen's `phase` at least `at_least` times as fast as `other`'s on one measurement."""
    measurement: Measurement
    phase: str
    other: str
    at_least: float

    @property
    def measurements(self) -> tuple[Measurement, ...]:
        return (self.measurement,)

    @property
    def bound(self) -> float:
        return self.at_least

    def describe(self) -> str:
        return f"{PHASES[self.phase]} >= {times(self.at_least)} {self.other}"

    def ratio(self, results: Results, implementation: str) -> tuple[float | None, str]:
        """The other's time over `implementation`'s (above 1: faster), or None and why there is none."""
        ours, why = phase_ms(results, self.measurement, implementation, self.phase)
        theirs, why_theirs = phase_ms(results, self.measurement, self.other, self.phase)
        if ours is None or theirs is None:
            return None, why or why_theirs
        return theirs / ours, ""

    def meets(self, ratio: float) -> bool:
        return ratio >= self.at_least


@dataclass(frozen=True)
class TimeTarget:
    """`variant`'s time for `phase` at most `at_most` times `plain`'s, both by the same implementation;
    with `at_most` None the ratio is shown beside the targets and judged against nothing."""
    variant: Measurement
    plain: Measurement
    phase: str
    at_most: float | None

    @property
    def measurements(self) -> tuple[Measurement, ...]:
        return (self.variant, self.plain)

    @property
    def bound(self) -> float | None:
        return self.at_most

    def describe(self) -> str:
        limit = f"<= {times(self.at_most)}" if self.at_most is not None else "(no target) vs"
        return f"{PHASES[self.phase]} time {self.variant.label} {limit} {self.plain.label}"

    def ratio(self, results: Results, implementation: str) -> tuple[float | None, str]:
        """The variant's time over plain's (below 1: the variant is cheaper), or None and why there is none."""
        variant, why = phase_ms(results, self.variant, implementation, self.phase)
        plain, why_plain = phase_ms(results, self.plain, implementation, self.phase)
        if variant is None or plain is None:
            return None, why or why_plain
        return variant / plain, ""

    def meets(self, ratio: float) -> bool:
        return self.at_most is not None and ratio <= self.at_most


@dataclass(frozen=True)
class RateTarget:
    """`phase` at `tflops` TFLOP/s or more (the FLOPs of the measurement's allowed pairs over the median time);
    the ratio is the rate reached over `tflops` (1 or more: met)."""
    measurement: Measurement
    phase: str
    tflops: float

    @property
    def measurements(self) -> tuple[Measurement, ...]:
        return (self.measurement,)

    @property
    def bound(self) -> float:
        return 1.0

    def describe(self) -> str:
        return f"{PHASES[self.phase]} >= {self.tflops:g} TFLOP/s"

    def ratio(self, results: Results, implementation: str) -> tuple[float | None, str]:
        """The rate `implementation` reached over the one asked, or None and why there is none."""
        ms, why = phase_ms(results, self.measurement, implementation, self.phase)
        if ms is None:
            return None, why
        return results[self.measurement.key].flops[self.phase] / ms / 1e9 / self.tflops, ""

    def meets(self, ratio: float) -> bool:
        return ratio >= 1.0


Target = SpeedTarget | TimeTarget | RateTarget


@dataclass(frozen=True)
class Case:
    """A name for --only and the targets issue 13 sets on one or two measurements."""
    name: str
    targets: tuple[Target, ...]

    @property
    def group(self) -> str:
        return self.name.split("/")[0]

    @property
    def measurements(self) -> tuple[Measurement, ...]:
        unique = {m.key: m for t in self.targets for m in t.measurements}
        return tuple(unique.values())


@dataclass(frozen=True)
class Verdict:
    """One build's standing against one target: its ratio, the verdict, and why there is no ratio."""
    ratio: float | None
    status: str  # MET, MISSED, NOT_MEASURED, or SHOWN (a ratio with no target)
    why: str = ""


def evaluate(target: Target, results: Results, implementation: str) -> Verdict:
    """Whether `implementation` meets `target` on these results; missing times are NOT_MEASURED."""
    ratio, why = target.ratio(results, implementation)
    if ratio is None:
        return Verdict(None, NOT_MEASURED, why)
    if target.bound is None:
        return Verdict(ratio, SHOWN)
    return Verdict(ratio, MET if target.meets(ratio) else MISSED)


def catalog_stems(quick: bool = False) -> list[str]:
    """The catalog's specs (specs/*.attn) by name, QUICK_CATALOG's alone with --quick."""
    stems = sorted(path.stem for path in SPECS.glob("*.attn"))
    return [s for s in stems if s in QUICK_CATALOG] if quick else stems


def cases(quick: bool = False) -> list[Case]:
    """Issue 13's cases in the table's order; --quick divides N by QUICK_DIVISOR and keeps QUICK_CATALOG."""
    def size(B: int, H: int, N: int, D: int) -> Problem:
        n = N // QUICK_DIVISOR if quick else N
        return Problem(B=B, H=H, HKV=H, Q_LEN=n, KV_LEN=n, D=D, dtype="bf16")

    def catalog(stem: str, problem: Problem) -> Measurement:
        return Measurement(stem, str(SPECS / f"{stem}.attn"), problem)

    result = []
    for stem in ("full", "causal"):
        m = catalog(stem, size(4, 16, 4096, 128))
        result.append(Case(stem, (SpeedTarget(m, "fwd", CUDNN, 1.0), SpeedTarget(m, "fwdbwd", CUDNN, 0.9))))
    m = catalog("causal", size(4, 16, 8192, 64))
    result.append(Case("causal_d64", tuple(SpeedTarget(m, phase, other, at_least) for phase in ("fwd", "fwdbwd")
                                           for other, at_least in ((CUDNN, 0.9), (FLEX, 1.2)))))
    for stem in catalog_stems(quick):
        m = catalog(stem, size(2, 16, 8192, 128))
        result.append(Case(f"{CATALOG}/{stem}", (SpeedTarget(m, "fwd", FLEX, 1.2),
                                                 SpeedTarget(m, "fwdbwd", FLEX, 1.1))))
    softcap = Measurement("softcap", SOFTCAP, size(2, 16, 8192, 128))
    plain = Measurement("plain", PLAIN, size(2, 16, 8192, 128))
    result.append(Case("softcap", (TimeTarget(softcap, plain, "fwd", 1.3), TimeTarget(softcap, plain, "fwdbwd", None))))
    bias = catalog("learned_rel_bias", size(4, 16, 4096, 128))
    plain = Measurement("plain", PLAIN, size(4, 16, 4096, 128))
    result.append(Case("learned_rel_bias", (TimeTarget(bias, plain, "fwdbwd", 2.0),)))
    for stem in catalog_stems(quick):
        m = Measurement(stem, str(SPECS / f"{stem}.attn"), size(*FIRST_CALL_SHAPE), first_call=True)
        result.append(Case(f"{FIRST_CALL}/{stem}", (SpeedTarget(m, "first", FLEX, 1.0),)))
    for stem, N, D, tflops, against_cudnn in BACKWARD_CASES:
        m = catalog(stem, size(16384 // N, 2048 // D, N, D))
        speed = (SpeedTarget(m, "fwdbwd", CUDNN, against_cudnn),) if against_cudnn is not None else ()
        result.append(Case(f"{BACKWARD}/{stem}_d{D}", (RateTarget(m, "bwd", tflops), *speed)))
    for label, N, D, tflops in FP8_CASES:
        m = Measurement("full", str(SPECS / "full.attn"), size(16384 // N, 2048 // D, N, D), fp8=True)
        result.append(Case(f"{FP8}/{label}", (RateTarget(m, "fwd", tflops),)))
    return result


def select(all_cases: list[Case], only: list[str] | None) -> list[Case]:
    """The cases --only names (a case's name, or a group such as `catalog`), in the table's order."""
    if not only:
        return all_cases
    known = {c.name for c in all_cases} | {c.group for c in all_cases}
    unknown = [name for name in only if name not in known]
    if unknown:
        raise ValueError(f"--only must name cases or groups among {', '.join(sorted(known))}, "
                         f"got {', '.join(unknown)}")
    return [c for c in all_cases if c.name in only or c.group in only]


def measurements(selected: list[Case]) -> list[Measurement]:
    """Every measurement the cases need, once each, in the cases' order."""
    unique = {m.key: m for case in selected for m in case.measurements}
    return list(unique.values())


# --- rows and tables -------------------------------------------------------------------------------

def families(target: Target, results: Results, implementation: str) -> str:
    """The family `implementation`'s forward ran on the target's measurements: one name where they agree."""
    ran = {m.label: results[m.key].families.get(implementation, "-") if m.key in results else "-"
           for m in target.measurements}
    names = set(ran.values())
    return names.pop() if len(names) == 1 else ", ".join(f"{label}: {name}" for label, name in ran.items())


def target_rows(selected: list[Case], results: Results) -> list[dict]:
    """One row per (case, target): each judged build's ratio, verdict, why not measured, and family."""
    rows = []
    for case in selected:
        for target in case.targets:
            row = {"case": case.name, "target": target.describe(), "bound": target.bound,
                   "measurements": [m.key for m in target.measurements]}
            for implementation in JUDGED:
                verdict = evaluate(target, results, implementation)
                row[implementation] = {**asdict(verdict), "family": families(target, results, implementation)}
            rows.append(row)
    return rows


def format_ratio(ratio: float | None) -> str:
    # Three decimals: a ratio just short of its bound must not print as the bound itself.
    return f"{ratio:.3f}x" if ratio is not None else "-"


STATUS_STYLES = {MET: "green", MISSED: "bold red", NOT_MEASURED: "yellow", SHOWN: "dim"}


def targets_table(rows: list[dict], title: str):
    """A rich Table of target_rows: ratio, verdict and family for each judged build, why not where not."""
    from rich.table import Table
    from rich.text import Text

    t = Table(title=Text(title))
    t.add_column("case", no_wrap=True)
    t.add_column("target")
    for implementation in JUDGED:
        t.add_column(implementation, justify="right", no_wrap=True)
        t.add_column("verdict", no_wrap=True)
        t.add_column("family")
    t.add_column("why not measured")
    for row in rows:
        cells = []
        for implementation in JUDGED:
            judged = row[implementation]
            cells += [format_ratio(judged["ratio"]), Text(judged["status"], style=STATUS_STYLES[judged["status"]]),
                      Text(judged["family"])]
        # Each reason names the implementation or measurement it is about; one both builds share shows once.
        why = "; ".join(dict.fromkeys(row[i]["why"] for i in JUDGED if row[i]["why"]))
        # Text, not markup: the reasons quote error messages, which may hold brackets.
        t.add_row(Text(row["case"]), Text(row["target"]), *cells, Text(why))
    return t


def tally(rows: list[dict]) -> list[str]:
    """One line per judged build: how many targets it met, missed, or could not be judged on (ratios shown
    with no target count in none of these)."""
    lines = []
    for implementation in JUDGED:
        judged = [row[implementation]["status"] for row in rows if row["bound"] is not None]
        lines.append(f"{implementation}: {judged.count(MET)} of {len(judged)} targets met, "
                     f"{judged.count(MISSED)} missed, {judged.count(NOT_MEASURED)} not measured")
    return lines


def raw_rows(result: Result) -> list[dict]:
    """bench.summarize's rows with the family each attngen build's forward ran after its name."""
    families = {**result.families}
    if ATTNGEN in families:  # the same build, its tile tables passed in
        families.setdefault(ATTNGEN_PREBUILT, families[ATTNGEN])
    return [{**row, "implementation": f"{row['implementation']} [{families[row['implementation']]}]"}
            if row["implementation"] in families else row for row in result.rows]


def document(info: dict, selected: list[Case], plan: list[Measurement], results: Results) -> dict:
    """The JSON file's content: the run's info, the target rows, and every measurement's times."""
    measured = {}
    for m in plan:
        if m.key in results:
            result = results[m.key]
            measured[m.key] = {"label": m.label, "spec": m.spec, "problem": asdict(m.problem),
                               "families": result.families, "absent": result.absent, "error": result.error,
                               "rows": result.rows, "notes": result.notes}
    return {"info": info, "targets": target_rows(selected, results), "measurements": measured}


# --- timing on the GPU -----------------------------------------------------------------------------

class Unbuilt:
    """Stands in for an attngen build that failed: calling it raises the build's error, so bench._time
    turns it into that implementation's note and the run goes on."""

    def __init__(self, spec, error: Exception):
        self.spec, self.error = spec, error

    def __call__(self, *args, **kwargs):
        raise self.error


def _raiser(error: Exception) -> Callable:
    def call():
        raise error
    return call


def _phase_flops(counted: bench.Flops) -> dict[str, float]:
    """The FLOPs of each timed phase (RateTarget's numerator): the backward alone's are forward+backward's less
    the forward's, as its time is."""
    return {"fwd": counted.forward, "fwdbwd": counted.forward_backward,
            "bwd": counted.forward_backward - counted.forward}


def measure(m: Measurement, backward: bool, step: Callable[[str], None]) -> Result:
    """Build and time every implementation on one measurement, as bench.run does, with the portable build
    beside attngen's; a failure of one implementation is its note, of the whole set-up the Result's error."""
    import torch
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.flex_attention import flex_attention

    import attngen
    from attngen import testing

    spec = attngen.load_spec(m.spec)[0]
    builds = {}
    for name, target in ((ATTNGEN, None), (PORTABLE, PORTABLE_TARGET)):
        step(f"{m.key}: building {name}")
        try:
            builds[name] = attngen.build(m.spec, target=target)
        except Exception as e:
            builds[name] = Unbuilt(spec, e)
    attn, portable = builds[ATTNGEN], builds[PORTABLE]
    p = m.problem
    q, k, v = testing.random_qkv(p.B, p.H, p.HKV, p.Q_LEN, p.KV_LEN, p.D, p.D, bench.DTYPES[p.dtype],
                                 device="cuda", seed=2)
    inputs = testing.random_inputs(spec, p.B, p.H, p.HKV, p.Q_LEN, p.KV_LEN, device="cuda", seed=2)
    step(f"{m.key}: counting the allowed pairs")
    counted = bench.count_flops(spec, p, inputs, device="cuda")
    learnable = [inputs[i.name].requires_grad_() for i in spec.learnable_inputs]
    leaves = [x.requires_grad_() for x in (q, k, v)] + learnable
    dout = torch.randn_like(q)

    ran = {}
    for name, build in builds.items():
        try:
            ran[name] = build.forward_family(q, k, v, **inputs) if not isinstance(build, Unbuilt) else "not built"
        except Exception as e:
            ran[name] = f"unknown ({bench._first_line(e)})"

    step(f"{m.key}: building Flex's BlockMask")
    flex_error = None
    try:
        variant = attngen.to_flex(spec)
    except Exception as e:
        variant, flex_error = None, e
    block_mask = None
    if variant is not None:
        try:
            block_mask = variant.block_mask(q, k, **inputs)
        except Exception:  # made again in Flex's first call, where a failure becomes its row's note
            pass
    tables = None
    if not isinstance(attn, Unbuilt) and attn.module.FACTS.tile_table:
        tables = attn.tile_tables(q, k, v, **inputs)
    # A fresh compile: past dynamo's recompile limit flex_attention would silently run eagerly.
    torch._dynamo.reset()
    flex_kernel = torch.compile(flex_attention, dynamic=False)
    is_causal, why_not = bench.sdpa_is_causal(spec, p.Q_LEN, p.KV_LEN)
    backends = {name: getattr(SDPBackend, member) for name, member in bench.SDPA_BACKENDS.items()}
    calls = bench.implementations(attn, variant, q, k, v, inputs, block_mask=block_mask, flex_kernel=flex_kernel,
                                  tile_tables=tables, sdpa_backends=backends, is_causal=is_causal)
    if flex_error is not None:
        calls[FLEX] = _raiser(flex_error)
    # The portable build right after attngen's, so the raw table reads the two side by side.
    calls = {ATTNGEN: calls.pop(ATTNGEN), PORTABLE: lambda: portable(q, k, v, **inputs), **calls}
    one_stage = None
    if variant is not None:
        one_stage = bench.flex_call(variant, q, k, v, inputs, block_mask=block_mask, flex_kernel=flex_kernel,
                                    kernel_options=bench.FLEX_ONE_STAGE_OPTIONS)
    timings, retried = bench.time_all(calls, leaves, dout, backward, lambda what: step(f"{m.key}: {what}"),
                                      flex_one_stage=one_stage)
    notes = [f"FLOPs: {counted.describe()}"]
    if retried:
        notes += [*retried, f"The Flex targets judge '{FLEX_ONE_STAGE}' where '{FLEX}' has no time."]
    absent = {} if is_causal is not None else {name: f"SDPA cannot run it ({why_not})" for name in bench.SDPA_BACKENDS}
    if tables is not None:
        notes.append(f"'{ATTNGEN}' builds its tile tables in every call; '{ATTNGEN_PREBUILT}' and Flex build "
                     "theirs outside the timed region; the targets judge the first.")
    return Result({t.implementation: t for t in timings}, ran, absent, "", bench.summarize(timings, counted), notes,
                  _phase_flops(counted))


def measure_first_call(m: Measurement, step: Callable[[str], None]) -> Result:
    """Each implementation's first call on one catalog spec, cold caches, in a process of its own
    (benchmarks/first_call.py); a failure is that implementation's note."""
    import first_call  # benchmarks/first_call.py, beside this script

    p = m.problem
    shape = f"{p.B},{p.H},{p.Q_LEN},{p.D}"
    timings = {}
    for implementation, name in FIRST_CALL_RUNS.items():
        step(f"{m.key}: {implementation}'s first call, cold caches")
        row = first_call.run_one(name, Path(m.spec).stem, shape)
        timings[implementation] = Timing(implementation, first_call_s=row.get("first_s"),
                                         note=row.get("error", "") or row.get("ahead_error", "") or "")
    return Result(timings, absent={PORTABLE: "first calls are measured for attngen as built for this GPU"},
                  notes=[f"{name}: first call {t.first_call_s:.2f} s" if t.first_call_s is not None
                         else f"{name}: no first call ({t.note})" for name, t in timings.items()])


def measure_fp8(m: Measurement, step: Callable[[str], None]) -> Result:
    """The FP8 forward of each attngen build on one measurement (float8_e4m3fn q, k and v, descale factors
    of 1), beside attngen's bf16 call and cuDNN's bf16 forward on the same values; a failure is that
    implementation's note."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import attngen
    from attngen import testing

    spec = attngen.load_spec(m.spec)[0]
    p = m.problem
    q, k, v = testing.random_qkv(p.B, p.H, p.HKV, p.Q_LEN, p.KV_LEN, p.D, p.D, torch.bfloat16, device="cuda",
                                 seed=2)
    inputs = testing.random_inputs(spec, p.B, p.H, p.HKV, p.Q_LEN, p.KV_LEN, device="cuda", seed=2)
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    scales = {name: torch.ones(p.B, p.HKV, device="cuda") for name in ("q_descale", "k_descale", "v_descale")}
    step(f"{m.key}: counting the allowed pairs")
    counted = bench.count_flops(spec, p, inputs, device="cuda")
    builds, ran = {}, {}
    for name, target in ((ATTNGEN, None), (PORTABLE, PORTABLE_TARGET)):
        step(f"{m.key}: building {name}")
        try:
            builds[name] = attngen.build(m.spec, target=target)
            ran[name] = builds[name].forward_family(q8, k8, v8, **inputs)
        except Exception as e:
            builds[name], ran[name] = Unbuilt(spec, e), "not built"
    calls = {name: (lambda b=b: b(q8, k8, v8, **scales, **inputs)) for name, b in builds.items()}
    calls[ATTNGEN_BF16] = lambda: builds[ATTNGEN](q, k, v, **inputs)
    is_causal, why_not = bench.sdpa_is_causal(spec, p.Q_LEN, p.KV_LEN)
    absent = {}
    if is_causal is None:
        absent[CUDNN] = f"SDPA cannot run it ({why_not})"
    else:
        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return sdpa(q, k, v, is_causal=is_causal)
        calls[CUDNN] = cudnn
    timings, _ = bench.time_all(calls, [], None, False, lambda what: step(f"{m.key}: {what}"))
    notes = [f"FLOPs: {counted.describe()}",
             f"'{ATTNGEN}' and '{PORTABLE}' are FP8 calls (float8_e4m3fn q, k, v); '{ATTNGEN_BF16}' and "
             f"'{CUDNN}' the same values in bf16."]
    return Result({t.implementation: t for t in timings}, ran, absent, "", bench.summarize(timings, counted),
                  notes, _phase_flops(counted))


def run_info(args: argparse.Namespace) -> dict:
    """The run's context, as bench.run's info dict gives it."""
    import torch
    import triton

    import attngen

    return {"date": str(date.today()), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "attngen": attngen.__version__, "python": platform.python_version(),
            "dtype": "bf16", "quick": args.quick, "backward": not args.no_backward, "only": args.only,
            "portable_target": PORTABLE_TARGET}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: sequence lengths / {QUICK_DIVISOR}, catalog specs "
                             f"{', '.join(QUICK_CATALOG)} only")
    parser.add_argument("--only", type=lambda text: [n for n in text.split(",") if n], metavar="NAME[,NAME]",
                        help=f"run these cases only: a case's name or '{CATALOG}' for every catalog spec (--list)")
    parser.add_argument("--no-backward", action="store_true", help="time the forward only")
    parser.add_argument("--out", type=Path, help="the JSON file (default: benchmarks/results/<date>-targets.json)")
    parser.add_argument("--list", action="store_true", help="print the cases and their targets, run nothing")
    args = parser.parse_args(argv)
    try:
        args.selected = select(cases(args.quick), args.only)
    except ValueError as e:
        parser.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # a log or a pipe: whole tables, not ones cut to 80 columns
        console = Console(width=200)
    if args.list:
        for case in args.selected:
            console.print(f"{case.name}: " + "; ".join(t.describe() for t in case.targets)
                          + f"  [{', '.join(m.key for m in case.measurements)}]", markup=False, highlight=False)
        return 0

    import torch
    if not torch.cuda.is_available():
        print("error: benchmarks/targets.py times kernels on a CUDA GPU, and this machine has none", file=sys.stderr)
        return 2
    out = args.out or RESULTS / f"{date.today()}-targets.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    info = run_info(args)
    plan = measurements(args.selected)
    start = time.perf_counter()

    def step(what: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f} s] {what}", file=sys.stderr, flush=True)

    results: dict[str, Result] = {}
    for m in plan:
        try:
            results[m.key] = (measure_first_call(m, step) if m.first_call else measure_fp8(m, step) if m.fp8
                              else measure(m, backward=not args.no_backward, step=step))
        except Exception as e:  # the set-up failed (out of memory, an input the spec refuses): its targets say so
            results[m.key] = Result(error=bench._first_line(e))
        torch.cuda.empty_cache()
        result = results[m.key]
        if result.error:
            console.print(f"{m.key}: {result.error}", markup=False, highlight=False)
        elif result.rows:
            dtype = "float8_e4m3fn" if m.fp8 else m.problem.dtype
            console.print(bench.table(raw_rows(result), f"{m.key} {dtype} on {info['gpu']}"))
            for note in result.notes:
                console.print(note, markup=False, highlight=False)
        # Rewritten after every measurement: a run cut short still leaves what it measured.
        out.write_text(json.dumps(document(info, args.selected, plan, results), indent=1) + "\n")

    rows = target_rows(args.selected, results)
    quick = " (--quick: smaller N, the targets' shapes are not these)" if args.quick else ""
    title = f"Issue 13's and 35's targets, bf16 (the fp8 cases: float8_e4m3fn), on {info['gpu']}{quick}"
    console.print(targets_table(rows, title))
    for line in tally(rows):
        console.print(line, markup=False, highlight=False)
    console.print("speed ratio: the other's time over attngen's (above 1: attngen is faster); time ratio: the "
                  "variant's time over plain's, same implementation.", markup=False, highlight=False)
    console.print(f"wrote {out} ({time.perf_counter() - start:.0f} s)", markup=False, highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
