"""Kernel families are plug-ins: a family is a folder under attngen/families/ (its plan entry, emit side,
template and runtime side) and one entry in the registry, attngen/families/__init__.py. A second family is
added to a copy of the package that way and nothing else changed: the planner picks it where its entry says
it serves (and says why it did not elsewhere), its template and declaration reach the module, and its
runtime side serves the calls its rule admits, in the thin module and in a standalone bundle."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import attngen
from attngen.analysis import analyze
from attngen.plan import families, get_target
from conftest import NO_ATTNGEN

ROOT = Path(__file__).resolve().parent.parent
CAUSAL = ROOT / "specs" / "causal.attn"


def test_the_last_family_serves_every_target_and_says_so():
    spec = attngen.parse_spec(CAUSAL.read_text())
    for target in ("a100", "h100", "h200", "interpreter"):
        chosen, why = families.choose_families(analyze(spec), get_target(target))
        hopper = ("hopper",) if target in ("h100", "h200") else ()
        assert tuple(f.name for f in chosen) == ("decode", *hopper, "portable")
        assert why.endswith(f"portable: {families.by_name('portable').strength}")
        assert families.by_name("decode").per_call in why


# The mirror family: its template defines a constant from the spec's name, which its declaration hands to
# its runtime side; that serves one-query forward calls with the portable forward, counted.
MIRROR = {
    "__init__.py": '"""A test family: the portable forward for one-query calls, counted."""\n',
    "family.py": '''"""The mirror family's plan entry."""

from attngen.plan.family import Family

FAMILY = Family("mirror", "a test family", lambda facts, target: None if target.name != "a100" else "not on a100",
                kernels=("fwd",), per_call="one query")
''',
    "emit.py": '''"""The mirror family's emit side."""

DECLARATION = "marker=MIRROR_MARKER"
DEVICE_HELPERS = ()


def context(facts):
    return {"mirror_word": facts.spec.name}


def signatures(params):
    return {}
''',
    "kernels.py.jinja": "# rendered from the mirror family\nMIRROR_MARKER = {{ mirror_word | tojson }}\n",
    "runtime.py": '''"""The mirror family's runtime side."""

MIRROR_CALLS = []


class MirrorFamily:
    def __init__(self, rt, marker):
        self.rt, self.marker = rt, marker

    def serves(self, q, k, v, HKV, KV_LEN, cached):
        return q.shape[2] == 1

    def forward(self, q, k, v, tensors, table, cache=None, page_table=None, plan=None, sink=None):
        MIRROR_CALLS.append((self.marker, tuple(q.shape)))
        return self.rt._portable_forward(q, k, v, tensors, table, cache=cache, page_table=page_table, plan=plan,
                                         sink=sink)


FAMILY = MirrorFamily
''',
}

_SCRIPT = """
import sys
import torch
import attngen
from attngen import api
assert attngen.__file__.startswith(sys.argv[1]), attngen.__file__
causal = sys.argv[2]
for target in ("interpreter", "a100"):
    plan = api._prepare(causal, None, target)[3]
    source = attngen.compile_source(causal, target=target, thin=True)
    print(target, ",".join(plan.families), 'MIRROR_MARKER = "causal"' in source, plan.family_reason.split(";")[0])
attn = attngen.build(causal)
q, k, v = (torch.randn(1, 2, n, 16) for n in (1, 5, 5))
assert torch.equal(attn(q, k, v), attn.module._portable_forward(q, k, v, [], ())[0])
from attngen.families.mirror import runtime
print(runtime.MIRROR_CALLS, attn.module.forward_family(q, k, v))
# The standalone bundle carries the family's runtime side: it runs with attngen blocked from import.
with open(sys.argv[3], "w") as f:
    f.write(attngen.compile_source(causal, target="interpreter"))
"""

_RUN_BUNDLE = NO_ATTNGEN + """
import torch
import bundled
q, k, v = (torch.randn(1, 2, n, 16) for n in (1, 5, 5))
bundled.attn(q, k, v)
calls = [m.MIRROR_CALLS for name, m in sys.modules.items() if name.endswith("families.mirror.runtime")]
print(calls, bundled.forward_family(q, k, v))
"""


def test_a_new_family_is_a_folder_and_a_registry_line(tmp_path):
    package = tmp_path / "pkg" / "attngen"
    shutil.copytree(ROOT / "attngen", package, ignore=shutil.ignore_patterns("__pycache__"))
    folder = package / "families" / "mirror"
    folder.mkdir()
    for name, text in MIRROR.items():
        (folder / name).write_text(text)
    registry = package / "families" / "__init__.py"
    line = 'FAMILIES = ("decode", "hopper", "portable")\n'
    assert registry.read_text().count(line) == 1
    registry.write_text(registry.read_text().replace(line, 'FAMILIES = ("mirror", "decode", "hopper", "portable")\n'))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "pkg"), os.environ.get("PYTHONPATH", "")]),
           "ATTNGEN_CACHE_DIR": str(tmp_path / "cache"), "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", _SCRIPT, str(package), str(CAUSAL), str(tmp_path / "bundled.py")],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    interpreter, a100, calls = result.stdout.strip().splitlines()
    assert interpreter == "interpreter mirror,decode,portable True mirror (fwd for one query): a test family"
    assert a100 == "a100 decode,portable False not mirror: not on a100"
    assert calls == "[('causal', (1, 2, 1, 16))] mirror"

    result = subprocess.run([sys.executable, "-c", _RUN_BUNDLE, str(tmp_path)], capture_output=True, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ""}, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[[('causal', (1, 2, 1, 16))]] mirror"
