"""Kernel families are plug-ins: a folder of templates under attngen/emit/families/, its runtime side
(attngen/runtime/<family>.py), and an entry each in plan/families.py, runtime/families.py and
emit/module.py's FAMILY_KERNELS. A second family is added to a copy of the package with nothing else
changed, and the planner picks it where its entry says it serves, and says why it did not elsewhere."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import attngen
from attngen.analysis import analyze
from attngen.plan import families, get_target

ROOT = Path(__file__).resolve().parent.parent
CAUSAL = ROOT / "specs" / "causal.attn"


def test_the_portable_family_serves_every_target_last_and_says_so():
    spec = attngen.parse_spec(CAUSAL.read_text())
    for target in ("a100", "h100", "h200", "interpreter"):
        chosen, why = families.choose_families(analyze(spec), get_target(target))
        hopper = (families.HOPPER,) if target in ("h100", "h200") else ()
        assert chosen == (families.DECODE, *hopper, families.PORTABLE)
        assert why.endswith(f"portable: {families.PORTABLE.strength}") and families.DECODE.per_call in why


MIRROR_KERNELS = "# rendered from the mirror family\n"
MIRROR_RUNTIME = """\"\"\"A test family: the portable forward, counted.\"\"\"

MIRROR_CALLS = []


class MirrorFamily:
    def __init__(self, rt):
        self.rt = rt

    def serves(self, q, k, v, HKV, KV_LEN, cached):
        return q.shape[2] == 1

    def forward(self, q, k, v, tensors, table, cache=None, page_table=None, plan=None, sink=None):
        MIRROR_CALLS.append(tuple(q.shape))
        return self.rt._portable_forward(q, k, v, tensors, table, cache=cache, page_table=page_table, plan=plan,
                                         sink=sink)
"""


def test_a_new_family_is_a_folder_and_an_entry(tmp_path):
    package = tmp_path / "pkg" / "attngen"
    shutil.copytree(ROOT / "attngen", package, ignore=shutil.ignore_patterns("__pycache__"))
    mirror = package / "emit" / "families" / "mirror"
    mirror.mkdir()
    (mirror / "kernels.py.jinja").write_text(MIRROR_KERNELS)
    (package / "runtime" / "mirror.py").write_text(MIRROR_RUNTIME)
    script = f"""
import os
import torch
import attngen
from attngen import api
from attngen.plan import families
from attngen.emit import module
from attngen.runtime import families as runtime_families
module.FAMILY_KERNELS["mirror"] = ""
runtime_families.FAMILIES["mirror"] = ("mirror", "MirrorFamily")
assert attngen.__file__.startswith({str(package)!r}), attngen.__file__
MIRROR = families.Family("mirror", "a test family", lambda facts, target: None if target.name != "a100" else "not on a100",
                         kernels=("fwd",), per_call="one query")
families.FAMILIES = (MIRROR, *families.FAMILIES)
for target in ("interpreter", "a100"):
    plan = api._prepare({str(CAUSAL)!r}, None, target)[3]
    source = attngen.compile_source({str(CAUSAL)!r}, target=target)
    print(target, ",".join(plan.families), {MIRROR_KERNELS!r} in source, plan.family_reason.split(";")[0])
attn = attngen.build({str(CAUSAL)!r})
q, k, v = (torch.randn(1, 2, n, 16) for n in (1, 5, 5))
assert torch.equal(attn(q, k, v), attn.module._portable_forward(q, k, v, [], ())[0])
from attngen.runtime import mirror
print(mirror.MIRROR_CALLS, attn.module.forward_family(q, k, v))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "pkg"), os.environ.get("PYTHONPATH", "")]),
           "ATTNGEN_CACHE_DIR": str(tmp_path / "cache"), "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    interpreter, a100, calls = result.stdout.strip().splitlines()
    assert interpreter == "interpreter mirror,decode,portable True mirror (fwd for one query): a test family"
    assert a100 == "a100 decode,portable False not mirror: not on a100"
    assert calls == "[(1, 2, 1, 16)] mirror"
