"""`attngen compile` bundles a spec's thin module with attngen's runtime into one file that runs with
attngen unimportable, and computes what the thin module (the one attngen.build loads) computes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import attngen
from attngen.emit.bundle import RUNTIME_MARKER
from conftest import NO_ATTNGEN

ROOT = Path(__file__).resolve().parent.parent

# Runs in a fresh interpreter: a finder first on sys.meta_path refuses attngen, so the bundle can only
# use what it carries; then the bundle's forward and backward on fixed inputs are saved for the test.
_RUN_BUNDLE = NO_ATTNGEN + """
import torch
import bundled

q, k, v, inputs, saved = torch.load(sys.argv[2])
q, k, v = (t.requires_grad_() for t in (q, k, v))
out = bundled.attn(q, k, v, **inputs)
out.square().sum().backward()
assert not any(name == "attngen" or name.startswith("attngen.") for name in sys.modules)
torch.save((out.detach(), q.grad, k.grad, v.grad, bundled.forward_family(q, k, v, **inputs)), saved)
"""


@pytest.mark.parametrize("name", ["document_causal", "alibi_causal", "gpt_oss_sinks"])
def test_a_bundle_runs_without_attngen_and_agrees_with_the_thin_module(name, tmp_path):
    import torch

    from attngen import testing

    spec = (ROOT / "specs" / f"{name}.attn").read_text()
    (tmp_path / "bundled.py").write_text(attngen.compile_source(spec, target="interpreter"))
    attn = attngen.build(spec, target="interpreter")
    q, k, v = testing.random_qkv(1, 2, 2, 40, 40, 16, 16, torch.float32, seed=3)
    inputs = testing.random_inputs(attn.spec, 1, 2, 2, 40, 40)
    torch.save((q, k, v, inputs, str(tmp_path / "saved.pt")), tmp_path / "args.pt")
    result = subprocess.run([sys.executable, "-c", _RUN_BUNDLE, str(tmp_path), str(tmp_path / "args.pt")],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    out, dq, dk, dv, family = torch.load(tmp_path / "saved.pt")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    expected = attn(q, k, v, **inputs)
    expected.square().sum().backward()
    assert family == attn.forward_family(q, k, v, **inputs)
    for got, want in zip((out, dq, dk, dv), (expected, q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_bundle_is_the_thin_module_then_the_runtime_then_the_declaration():
    spec = (ROOT / "specs" / "sliding_window.attn").read_text()
    thin = attngen.compile_source(spec, target="h200", thin=True)
    bundled = attngen.compile_source(spec, target="h200")
    kernels, marker, runtime = bundled.partition(RUNTIME_MARKER)
    assert marker and "from attngen" not in bundled
    # The spec's part comes first, as the thin module has it (less its runtime imports).
    first_kernel = thin.index("@triton.jit")
    assert kernels.startswith(thin[:thin.index("from attngen.runtime")]) and thin[first_kernel:].startswith(
        kernels[kernels.index("@triton.jit"):].rstrip("\n"))
    # Only the runtime files a plan's families use: the a100 plan has no Hopper family.
    assert "'families.hopper.runtime': (r'''" in runtime and "'families.hopper.device': (r'''" in runtime
    assert "'families.hopper.runtime': (r'''" not in attngen.compile_source(spec, target="a100")
