"""Checks and times the Gluon Hopper attention kernel (tools/hopper/gluon_attention.py) on an H100/H200.

    cd /work/main && PYTHONPATH=$PWD python tools/hopper/gpu_bench.py --out $OUT/hopper.json
    python tools/hopper/gpu_bench.py --dry-run          # CPU: parse arguments, list the plan, run nothing

1. Correctness, for bf16/fp16 x D 64/128 x causal off/on, on awkward shapes too (N=1, N=1000, N=129,
   GQA 32/8): O and LSE against SDPA's math backend in float32 (max abs error, NaN anywhere).
2. Timing (triton.testing.do_bench, median) of the Gluon kernel beside SDPA's cuDNN and flash backends,
   FlexAttention (torch.compile'd, causal block mask when causal) and this project's portable kernel
   (attngen.build(specs/causal.attn or specs/full.attn)), on B4 H16 N4096 D128 causal / non-causal,
   B4 H16 N8192 D64 causal, B1 H16 N16384 D128 causal. TFLOP/s counts 4*B*H*N*N*D, halved when causal.
3. Optionally (--sweep) the Gluon kernel's BLOCK_N / STAGES variants on the same shapes.

Every backend and case runs in its own try block: a failure is recorded in the JSON and the run goes on.
The JSON is rewritten after every section, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))

DTYPES = ("bf16", "fp16")
HEAD_DIMS = (64, 128)
# (B, H, HKV, N): N=1, ragged N (1000, 129), GQA 32/8, a multi-tile N with a ragged-free length.
CHECK_SHAPES = [(1, 4, 4, 1), (2, 8, 8, 1000), (1, 32, 8, 1000), (1, 4, 2, 129), (2, 4, 4, 2048)]
# (B, H, N, D, causal)
BENCH_SHAPES = [(4, 16, 4096, 128, True), (4, 16, 4096, 128, False), (4, 16, 8192, 64, True),
                (1, 16, 16384, 128, True)]
BACKENDS = ("gluon", "gluon_pp", "cudnn", "flash", "flex", "attngen")
GLUON_VARIANTS = {"gluon": False, "gluon_pp": True}  # name -> pingpong
SWEEP = {128: [(128, 2), (128, 3), (64, 3), (64, 4)], 64: [(128, 2), (128, 3), (128, 4), (64, 4)]}
TOL_O = {"bf16": 3e-2, "fp16": 5e-3}
TOL_LSE = 2e-3


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="hopper.json", help="JSON results file (default: hopper.json)")
    parser.add_argument("--dry-run", action="store_true",
                        help="parse arguments, import what is needed and print the plan; compiles and runs nothing")
    parser.add_argument("--skip-check", action="store_true", help="skip the correctness section")
    parser.add_argument("--skip-bench", action="store_true", help="skip the timing section")
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's BLOCK_N/STAGES variants")
    parser.add_argument("--backends", nargs="*", default=list(BACKENDS), choices=BACKENDS,
                        help="backends to time (default: all)")
    parser.add_argument("--variants", nargs="*", default=list(GLUON_VARIANTS), choices=list(GLUON_VARIANTS),
                        help="Gluon kernel variants to check (gluon: one 8-warp consumer; gluon_pp: pingpong)")
    parser.add_argument("--check-timeout", type=int, default=480,
                        help="seconds for one variant's correctness cases (run in a child process, so a kernel that "
                             "deadlocks on its mbarriers is killed and recorded instead of hanging the run)")
    parser.add_argument("--child-check", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="bf16", choices=DTYPES, help="dtype of the timed shapes")
    parser.add_argument("--warmup", type=int, default=100, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=500, help="do_bench repetition time, ms")
    return parser.parse_args(argv)


def flops(B, H, N, D, causal):
    total = 4.0 * B * H * N * N * D
    return total / 2 if causal else total


def _err(exc: BaseException) -> str:
    lines = [line for line in "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines() if line]
    return " | ".join(lines[-3:])[:600]


class Results:

    def __init__(self, path: str):
        self.path = Path(path)
        self.data = {"env": {}, "correctness": [], "bench": [], "sweep": []}

    def save(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2))


# ----------------------------------------------------------------------------------------------
# correctness


def reference(q, k, v, causal, sm_scale):
    """float32 SDPA (math backend) and the float32 natural-log LSE of the same scores."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    qf = q.float()
    kf = k.repeat_interleave(group, dim=1).float()
    vf = v.repeat_interleave(group, dim=1).float()
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, scale=sm_scale)
    s = (qf @ kf.transpose(-1, -2)) * sm_scale
    if causal:
        N = q.shape[2]
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return out, torch.logsumexp(s, dim=-1)


def check_variant(variant: str, out_path: str):
    """Child process: run one variant's cases, appending one JSON line per case as soon as it starts
    (state "started") and when it ends, so the parent can tell which case hung."""
    import torch
    import gluon_attention as ga

    failures = 0
    log = open(out_path, "a", buffering=1)
    for dtype in DTYPES:
        td = torch.bfloat16 if dtype == "bf16" else torch.float16
        for D in HEAD_DIMS:
            for causal in (False, True):
                for B, H, HKV, N in CHECK_SHAPES:
                    case = dict(variant=variant, dtype=dtype, B=B, H=H, HKV=HKV, N=N, D=D, causal=causal)
                    log.write(json.dumps(dict(case, state="started")) + "\n")
                    try:
                        torch.manual_seed(0)
                        q = torch.randn(B, H, N, D, device="cuda", dtype=td)
                        k = torch.randn(B, HKV, N, D, device="cuda", dtype=td)
                        v = torch.randn(B, HKV, N, D, device="cuda", dtype=td)
                        sm_scale = 1.0 / math.sqrt(D)
                        out, lse = ga.attention(q, k, v, causal=causal, pingpong=GLUON_VARIANTS[variant])
                        torch.cuda.synchronize()
                        ref_out, ref_lse = reference(q, k, v, causal, sm_scale)
                        err_o = (out.float() - ref_out).abs().max().item()
                        err_l = (lse - ref_lse).abs().max().item()
                        nan = bool(out.isnan().any().item() or lse.isnan().any().item())
                        ok = (not nan) and err_o <= TOL_O[dtype] and err_l <= TOL_LSE
                        case.update(max_abs_err_o=err_o, max_abs_err_lse=err_l, nan=nan, ok=ok)
                    except Exception as exc:  # record and go on
                        ok = False
                        case.update(ok=False, error=_err(exc))
                    failures += not ok
                    log.write(json.dumps(dict(case, state="done")) + "\n")
                    detail = case.get("error") or (f"max|dO|={case['max_abs_err_o']:.2e} "
                                                   f"max|dLSE|={case['max_abs_err_lse']:.2e} nan={case['nan']}")
                    print(f"  {variant:<8} {dtype} D{D:<3} {'causal' if causal else 'full  '} B{B} H{H} HKV{HKV} N{N:<5} "
                          f"{'ok  ' if ok else 'FAIL'} {detail}", flush=True)
    return failures


def check_correctness(results: Results, args):
    import subprocess
    import tempfile

    print("== correctness vs SDPA math (float32)", flush=True)
    failures = 0
    hung = []
    for variant in args.variants:
        with tempfile.TemporaryDirectory() as folder:
            log = Path(folder, "cases.jsonl")
            log.touch()
            cmd = [sys.executable, __file__, "--child-check", variant, "--child-out", str(log)]
            try:
                subprocess.run(cmd, timeout=args.check_timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        done = [c for c in lines if c["state"] == "done"]
        started = [c for c in lines if c["state"] == "started"]
        for case in done:
            case.pop("state")
            results.data["correctness"].append(case)
            failures += not case["ok"]
        if len(started) > len(done) or timed_out:
            # The case that started but never finished: a deadlock (or a crash) inside the kernel.
            last = dict(started[-1]) if len(started) > len(done) else dict(variant=variant)
            last.pop("state", None)
            last.update(ok=False, error=("timed out after %d s (deadlock?)" % args.check_timeout) if timed_out
                        else "child process died in this case")
            results.data["correctness"].append(last)
            failures += 1
            hung.append(variant)
            print(f"  {variant}: {last['error']} in {last}", flush=True)
        results.save()
    print(f"  {failures} failing case(s)")
    return failures, hung


# ----------------------------------------------------------------------------------------------
# timing


def make_backends(names, causal, N, device):
    """name -> (callable(q, k, v) or None, error string or None). Builds are outside the timed region."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import gluon_attention as ga

    backends = {}
    for name in names:
        try:
            if name in GLUON_VARIANTS:
                fn = lambda q, k, v, pp=GLUON_VARIANTS[name]: ga.attention(q, k, v, causal=causal,  # noqa: E731
                                                                           pingpong=pp)
            elif name in ("cudnn", "flash"):
                backend = SDPBackend.CUDNN_ATTENTION if name == "cudnn" else SDPBackend.FLASH_ATTENTION

                def fn(q, k, v, backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            elif name == "flex":
                from torch.nn.attention.flex_attention import create_block_mask, flex_attention

                flex = torch.compile(flex_attention)
                block_mask = None
                if causal:
                    block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, B=None, H=None, Q_LEN=N, KV_LEN=N,
                                                   device=device)
                fn = lambda q, k, v, bm=block_mask, flex=flex: flex(q, k, v, block_mask=bm)  # noqa: E731
            elif name == "attngen":
                import attngen

                spec = (ROOT / "specs" / ("causal.attn" if causal else "full.attn")).read_text()
                fn = attngen.build(spec)
            backends[name] = (fn, None)
        except Exception as exc:
            backends[name] = (None, _err(exc))
    return backends


def time_fn(fn, q, k, v, warmup, rep, prepared=None):
    """prepared: a no-argument launcher (gluon_attention.prepare) timed instead of fn(q, k, v)."""
    import torch
    import triton

    call = prepared or (lambda: fn(q, k, v))
    call()  # compile / autotune outside the timed region
    torch.cuda.synchronize()
    return triton.testing.do_bench(call, warmup=warmup, rep=rep, return_mode="median")


def bench(results: Results, args):
    import torch

    import gluon_attention as ga

    td = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(f"== timing ({args.dtype}, do_bench median, warmup {args.warmup} ms, rep {args.rep} ms)")
    rows = []
    for B, H, N, D, causal in BENCH_SHAPES:
        torch.manual_seed(0)
        q = torch.randn(B, H, N, D, device="cuda", dtype=td)
        k = torch.randn(B, H, N, D, device="cuda", dtype=td)
        v = torch.randn(B, H, N, D, device="cuda", dtype=td)
        shape = dict(B=B, H=H, N=N, D=D, causal=causal, dtype=args.dtype)
        row = dict(shape, ms={}, tflops={}, errors={})
        for name, (fn, error) in make_backends(args.backends, causal, N, q.device).items():
            if fn is None:
                row["errors"][name] = error
                continue
            try:
                prepared = (ga.prepare(q, k, v, causal=causal, pingpong=GLUON_VARIANTS[name])
                            if name in GLUON_VARIANTS else None)
                ms = time_fn(fn, q, k, v, args.warmup, args.rep, prepared)
                row["ms"][name] = ms
                row["tflops"][name] = flops(B, H, N, D, causal) / (ms * 1e-3) / 1e12
            except Exception as exc:
                row["errors"][name] = _err(exc)
            torch.cuda.empty_cache()
        # speed_vs[variant][ref] = time of ref / time of variant: above 1 the Gluon variant is faster.
        row["speed_vs"] = {var: {ref: row["ms"][ref] / row["ms"][var] for ref in ("cudnn", "flex", "flash", "attngen")
                                 if ref in row["ms"]} for var in GLUON_VARIANTS if var in row["ms"]}
        rows.append(row)
        results.data["bench"].append(row)
        results.save()
        print_row(row, flush=True)
    print_table(rows)
    return rows


def print_row(row, flush=False):
    label = f"B{row['B']} H{row['H']} N{row['N']} D{row['D']} {'causal' if row['causal'] else 'full'}"
    parts = [f"{n} {row['ms'][n]:.3f} ms {row['tflops'][n]:.0f} TF/s" for n in row["ms"]]
    parts += [f"{n} FAILED" for n in row["errors"]]
    print(f"  {label}: " + "; ".join(parts), flush=flush)
    for n, e in row["errors"].items():
        print(f"      {n}: {e}", flush=flush)


def print_table(rows):
    names = [n for n in BACKENDS if any(n in r["ms"] or n in r["errors"] for r in rows)]
    print()
    variants = [v for v in GLUON_VARIANTS if any(v in r["ms"] for r in rows)]
    head = f"{'shape':<28}" + "".join(f"{n + ' ms':>12}{'TF/s':>7}" for n in names) + "".join(
        f"{v + '/cuDNN':>15}{v + '/Flex':>14}" for v in variants)
    print(head)
    print("-" * len(head))
    for r in rows:
        label = f"B{r['B']} H{r['H']} N{r['N']} D{r['D']} {'causal' if r['causal'] else 'full'}"
        cells = ""
        for n in names:
            if n in r["ms"]:
                cells += f"{r['ms'][n]:>12.3f}{r['tflops'][n]:>7.0f}"
            else:
                cells += f"{'fail':>12}{'':>7}"
        for var in variants:
            ratio = r["speed_vs"].get(var, {})
            cells += f"{ratio['cudnn']:>15.3f}" if "cudnn" in ratio else f"{'-':>15}"
            cells += f"{ratio['flex']:>14.3f}" if "flex" in ratio else f"{'-':>14}"
        print(f"{label:<28}{cells}")
    print("(V/X = time of X / time of Gluon variant V: above 1 the Gluon kernel is faster; "
          "cuDNN-relative speed = V/cuDNN)")


def sweep(results: Results, args):
    import torch

    import gluon_attention as ga

    td = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print("== sweep of the Gluon kernel's BLOCK_N / STAGES")
    for B, H, N, D, causal in BENCH_SHAPES:
        q = torch.randn(B, H, N, D, device="cuda", dtype=td)
        k = torch.randn(B, H, N, D, device="cuda", dtype=td)
        v = torch.randn(B, H, N, D, device="cuda", dtype=td)
        for (block_n, stages), variant in [(c, var) for var in args.variants for c in SWEEP[D]]:
            entry = dict(variant=variant, B=B, H=H, N=N, D=D, causal=causal, block_n=block_n, stages=stages)
            try:
                prepared = ga.prepare(q, k, v, causal=causal, block_n=block_n, stages=stages,
                                      pingpong=GLUON_VARIANTS[variant])
                ms = time_fn(None, q, k, v, args.warmup, args.rep, prepared)
                entry.update(ms=ms, tflops=flops(B, H, N, D, causal) / (ms * 1e-3) / 1e12)
                print(f"  {variant:<8} B{B} H{H} N{N} D{D} {'causal' if causal else 'full'} BLOCK_N={block_n} STAGES={stages}: "
                      f"{ms:.3f} ms {entry['tflops']:.0f} TF/s", flush=True)
            except Exception as exc:
                entry["error"] = _err(exc)
                print(f"  ... BLOCK_N={block_n} STAGES={stages}: FAILED {entry['error']}", flush=True)
            results.data["sweep"].append(entry)
            results.save()


def environment():
    import torch
    import triton

    env = dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
               cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available()
               else None, time=time.strftime("%Y-%m-%d %H:%M:%S"))
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["capability"] = list(torch.cuda.get_device_capability())
    return env


def dry_run(args):
    import torch  # noqa: F401  (the imports are part of what a dry run checks)
    import triton  # noqa: F401

    import gluon_attention as ga

    print(f"dry run: out={args.out} dtype={args.dtype} backends={args.backends} variants={args.variants} "
          f"sweep={args.sweep}")
    print(f"  gluon configs (head_dim -> BLOCK_M, BLOCK_N, STAGES): {ga.CONFIGS}")
    if not args.skip_check:
        n = len(args.variants) * len(DTYPES) * len(HEAD_DIMS) * 2 * len(CHECK_SHAPES)
        print(f"  correctness: {n} cases, shapes (B, H, HKV, N) {CHECK_SHAPES}")
    if not args.skip_bench:
        for B, H, N, D, causal in BENCH_SHAPES:
            print(f"  bench B{B} H{H} N{N} D{D} {'causal' if causal else 'full'}: "
                  f"{flops(B, H, N, D, causal) / 1e12:.2f} TFLOP per call")
    for spec in ("causal.attn", "full.attn"):
        path = ROOT / "specs" / spec
        print(f"  attngen spec {path}: {'found' if path.exists() else 'MISSING'}")
    try:
        import attngen  # noqa: F401
        print("  attngen imports")
    except Exception as exc:
        print(f"  attngen does not import: {_err(exc)}")
    print("  (nothing compiled or run)")


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        dry_run(args)
        return 0
    if args.child_check:
        return 1 if check_variant(args.child_check, args.child_out) else 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this script needs an H100/H200 (use --dry-run on the CPU)", file=sys.stderr)
        return 2
    if torch.cuda.get_device_capability()[0] != 9:
        print(f"warning: the kernel targets sm_90, this device is sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
    results = Results(args.out)
    results.data["env"] = environment()
    results.data["args"] = vars(args)
    results.save()
    print(json.dumps(results.data["env"]))
    failures = 0
    if not args.skip_check:
        failures, hung = check_correctness(results, args)
        # A variant that deadlocked would hang the timing loop too: leave it out.
        args.backends = [b for b in args.backends if b not in hung]
        args.variants = [v for v in args.variants if v not in hung]
    if not args.skip_bench:
        bench(results, args)
    if args.sweep:
        sweep(results, args)
    results.data["correctness_failures"] = failures
    results.save()
    print(f"wrote {results.path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
