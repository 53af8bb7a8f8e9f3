"""Times the Hopper family against the portable forward on masks whose query tiles visit few key tiles
(chunked causal attention of several chunk sizes, short sequences), to place the family's rule.

    python tools/hopper/short_rows.py [--out FILE]

bf16, D=128, forward only, medians of triton.testing.do_bench; "tiles" is the mean number of 128-key
tiles a 128-row query tile visits (attngen's tile map).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

import attngen
from attngen.analysis import analyze
from attngen.report.tilemap import tile_map


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    cases = [(f"attention chunk{c}\nparam chunk = {c}\nmask: q // chunk == k // chunk and causal\n", 8, 8192)
             for c in (128, 256, 512, 1024, 2048)]
    cases += [("attention causal\nmask: causal\n", B, N) for B, N in ((64, 512), (16, 2048))]
    rows = []
    for text, B, N in cases:
        spec = attngen.load_spec(text)[0]
        grid = tile_map(analyze(spec), {"B": B, "H": 16, "HKV": 16, "Q_LEN": N, "KV_LEN": N}, 128, 128).grid
        tiles = float((grid > 0).sum()) / grid.shape[0]
        q, k, v = (torch.randn(B, 16, N, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        times = {}
        for name, target in (("hopper", None), ("portable", "a100")):
            attn = attngen.build(text, target=target) if target else attngen.build(text)
            with torch.no_grad():
                times[name] = triton.testing.do_bench(lambda: attn(q, k, v), warmup=25, rep=100,
                                                      return_mode="median")
                times[name + "_family"] = attn.forward_family(q, k, v)
        row = {"spec": spec.name, "B": B, "N": N, "tiles": round(tiles, 2), **times,
               "hopper_speedup": times["portable"] / times["hopper"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
