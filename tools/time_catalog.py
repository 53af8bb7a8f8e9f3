"""Kernel times of every catalog spec with whichever attngen is importable, as JSON: run it once per
version of attngen (PYTHONPATH) in the same GPU session to compare two commits side by side.

    python tools/time_catalog.py --warm --only causal     # compile one spec's kernels (run several at once)
    PYTHONPATH=/path/to/old python tools/time_catalog.py --label old --out old.json
    PYTHONPATH=.             python tools/time_catalog.py --label new --out new.json
    python tools/time_catalog.py --compare old.json new.json

--folder DIR times the specs of another folder (e.g. random specs from benchmarks/random_variants.py --export);
--shape B,H,N another batch, head count (K and V's too) and length than B2 H16 N8192.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(B=2, H=16, HKV=16, Q_LEN=8192, KV_LEN=8192, D=128, DV=128)


def time_catalog(only: list[str] | None, warm_only: bool = False, shape: dict[str, int] = SHAPE,
                 folder: Path = ROOT / "specs") -> dict[str, dict[str, float]]:
    import torch
    from triton.testing import do_bench

    import attngen
    from attngen import testing

    results = {}
    for path in sorted(Path(folder).glob("*.attn")):
        if only and path.stem not in only:
            continue
        attn = attngen.build(str(path))
        s = shape
        q, k, v = (torch.randn(s["B"], h, n, s["D"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for h, n in ((s["H"], s["Q_LEN"]), (s["HKV"], s["KV_LEN"]), (s["HKV"], s["KV_LEN"])))
        inputs = testing.random_inputs(attn.spec, s["B"], s["H"], s["HKV"], s["Q_LEN"], s["KV_LEN"], device="cuda")
        for decl in attn.spec.learnable_inputs:
            inputs[decl.name].requires_grad_(True)
        out = attn(q, k, v, **inputs)
        assert torch.isfinite(out).all(), f"{path.stem}: non-finite output"
        dout = torch.randn_like(out)
        torch.autograd.backward(attn(q, k, v, **inputs), dout)
        if warm_only:
            continue
        with torch.no_grad():
            forward = do_bench(lambda: attn(q, k, v, **inputs), warmup=50, rep=300)
        step = do_bench(lambda: torch.autograd.backward(attn(q, k, v, **inputs), dout), warmup=50, rep=300,
                        grad_to_none=[q, k, v])
        results[path.stem] = {"fwd": forward, "fwd_bwd": step}
        print(f"{path.stem:<22} fwd {forward:7.3f} ms  fwd+bwd {step:7.3f} ms", file=sys.stderr, flush=True)
    return results


def compare(old_path: str, new_path: str) -> None:
    old, new = json.loads(Path(old_path).read_text()), json.loads(Path(new_path).read_text())
    print(f"{'spec':<22} {'fwd old':>8} {'fwd new':>8} {'ratio':>6}   {'f+b old':>8} {'f+b new':>8} {'ratio':>6}")
    for name in old["times"]:
        a, b = old["times"][name], new["times"].get(name)
        if b is None:
            continue
        print(f"{name:<22} {a['fwd']:8.3f} {b['fwd']:8.3f} {b['fwd'] / a['fwd']:6.3f}   "
              f"{a['fwd_bwd']:8.3f} {b['fwd_bwd']:8.3f} {b['fwd_bwd'] / a['fwd_bwd']:6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="")
    parser.add_argument("--out")
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    parser.add_argument("--warm", action="store_true", help="only compile and run each spec once")
    parser.add_argument("--head-dim", type=int, default=SHAPE["D"], help="D and DV of q, k and v")
    parser.add_argument("--folder", default=ROOT / "specs", help="the folder of the .attn specs (default specs/)")
    parser.add_argument("--shape", help="B,H,N: batch, heads (of q, k and v) and length (default 2,16,8192)")
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare)
        return
    import attngen
    shape = dict(SHAPE, D=args.head_dim, DV=args.head_dim)
    if args.shape:
        B, H, N = (int(x) for x in args.shape.split(","))
        shape.update(B=B, H=H, HKV=H, Q_LEN=N, KV_LEN=N)
    if args.warm:
        time_catalog(args.only, warm_only=True, shape=shape, folder=args.folder)
        return
    result = {"label": args.label, "attngen": attngen.__file__, "shape": shape,
              "times": time_catalog(args.only, shape=shape, folder=args.folder)}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
