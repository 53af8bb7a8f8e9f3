"""What a feature costs: a spec with it against the same spec without it, timed side by side on the GPU
(the targets: a sink <= 1.05x the time without it; sigmoid attention <= 1.0x the same spec with softmax; a
deterministic backward <= 1.15x).

    python benchmarks/feature_cost.py [--shape B,H,N,D ...] [--only WORD ...] [--json FILE]

Each row: forward (no_grad) and forward+backward median ms (triton.testing.do_bench), bf16, the same
q, k, v for both builds; the ratio is the feature's time over the time without it. `--only` keeps the rows
whose feature names contain one of the words (e.g. `--only sigmoid deterministic`); several shapes run one
after another.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

import attngen
from attngen import testing

# (feature, spec with it, the same spec without it)
CASES = [
    ("sink (gpt_oss_sinks: window 128, a learned sink per head)",
     "specs/gpt_oss_sinks.attn",
     "attention gpt_oss_no_sink\nparam window = 128\nmask: causal and q - k < window\n", {}),
    ("sink on causal attention",
     "attention causal_sink\ninput sinks: f32[H] learnable\nmask: causal\nsink: sinks[h]\n",
     "specs/causal.attn", {}),
    # Sigmoid against softmax of the very same scores (the -log(KV_LEN) bias changes no softmax, but costs the
    # same), and against the catalog's ALiBi, which lacks that term.
    ("sigmoid (sigmoid_alibi against the same spec with softmax)",
     "specs/sigmoid_alibi.attn",
     "attention softmax_alibi_log\ninput slopes: f32[H]\nmask: causal\n"
     "score: score + slopes[h] * (k - q) - log(KV_LEN)\n", {}),
    ("sigmoid (sigmoid_alibi against alibi_causal)", "specs/sigmoid_alibi.attn", "specs/alibi_causal.attn", {}),
    # No score expression: the scale applied in exp2's argument (DEFER_SCALE) on both sides.
    ("sigmoid on plain causal attention", "attention sigmoid_causal\nnormalize: sigmoid\nmask: causal\n",
     "specs/causal.attn", {}),
    # The same build with and without deterministic mode (its options: attngen.build's keywords, for the build
    # with the feature and, if a fifth element gives them, for the one without).
    ("deterministic backward (causal)", "specs/causal.attn", "specs/causal.attn", {"deterministic": True}),
    ("deterministic backward (learned_rel_bias: a learned table's exact sums)", "specs/learned_rel_bias.attn",
     "specs/learned_rel_bias.attn", {"deterministic": True}),
    # The portable family's own cost of it (planned for an A100: the portable kernels alone), whose backward
    # writes dQ, dK and dV once a tile either way.
    ("deterministic backward on the portable family (causal)", "specs/causal.attn", "specs/causal.attn",
     {"deterministic": True, "target": "a100"}, {"target": "a100"}),
]


def _time(attn, q, k, v, inputs, dout, backward):
    if not backward:
        with torch.no_grad():
            return triton.testing.do_bench(lambda: attn(q, k, v, **inputs), warmup=25, rep=200)
    leaves = [q, k, v, *(t for t in inputs.values() if t.requires_grad)]
    return triton.testing.do_bench(lambda: torch.autograd.grad(attn(q, k, v, **inputs), leaves, dout),
                                   warmup=25, rep=200)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", default=["2,16,8192,128"], help="B,H,N,D (one or more)")
    parser.add_argument("--only", nargs="*", help="only the rows whose feature names contain one of these words")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    cases = [case for case in CASES if not args.only or any(word in case[0] for word in args.only)]
    rows = []
    for shape in args.shape:
        rows += _rows(cases, *(int(x) for x in shape.split(",")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
                       "rows": rows}, f, indent=1)


def _rows(cases, B, H, N, D):
    """Each case's row at one shape, printed as it is measured."""
    q, k, v = (t.requires_grad_() for t in testing.random_qkv(B, H, H, N, N, D, D, torch.bfloat16, device="cuda"))
    dout = torch.randn_like(q)
    rows = []
    for feature, with_it, without, options, *without_options in cases:
        row = {"feature": feature, "shape": [B, H, N, D]}
        for name, spec, build_options in (("with", with_it, options),
                                          ("without", without, without_options[0] if without_options else {})):
            attn = attngen.build(spec, **build_options)
            inputs = testing.random_inputs(attn.spec, B, H, H, N, N, device="cuda")
            for decl in attn.spec.learnable_inputs:  # the others are data: no gradient
                inputs[decl.name].requires_grad_()
            row[f"{name} families"] = (attn.forward_family(q, k, v, **inputs), attn.backward_family(q, k, v, **inputs))
            for part, backward in (("fwd", False), ("fwd+bwd", True)):
                row[f"{name} {part} ms"] = _time(attn, q, k, v, inputs, dout, backward)
        for part in ("fwd", "fwd+bwd"):
            row[f"{part} ratio"] = row[f"with {part} ms"] / row[f"without {part} ms"]
        rows.append(row)
        print(f"{feature} B{B} H{H} N{N} D{D} bf16, families {row['with families']}:")
        for part in ("fwd", "fwd+bwd"):
            print(f"  {part:8s} with {row[f'with {part} ms']:.3f} ms, without {row[f'without {part} ms']:.3f} ms: "
                  f"{row[f'{part} ratio']:.3f}x", flush=True)
    return rows


if __name__ == "__main__":
    main()
