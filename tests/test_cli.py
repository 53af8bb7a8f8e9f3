"""The command line, the standalone module it writes, the on-disk cache, the examples and the wheel."""

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def _run(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=600)


def test_compile_writes_a_standalone_module(tmp_path):
    out = tmp_path / "alibi_kernel.py"
    result = _run("-m", "attngen.cli", "compile", str(ROOT / "specs" / "alibi_causal.attn"), "-o", str(out))
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert "score: score + slopes[h] * (k - q)" in text and "fingerprint" in text and "# Plan:" in text
    assert "attngen" not in [line.split()[1] for line in text.splitlines() if line.startswith(("import ", "from "))]
    # The module runs with attngen made unimportable: it needs only torch and triton.
    script = f"""
import sys, torch
sys.modules["attngen"] = None
sys.path.insert(0, {str(tmp_path)!r})
import alibi_kernel
q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
out = alibi_kernel.attn(q, k, v, slopes=torch.ones(2))
print(tuple(out.shape))
"""
    result = _run("-c", script, env={"TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr
    assert "(1, 2, 20, 16)" in result.stdout


def test_spec_errors_exit_nonzero_with_position_and_no_traceback(tmp_path):
    bad = tmp_path / "sliding.attn"
    bad.write_text("attention sliding\nparam window = 4\nmask: causal and q - k < windw\n")
    result = _run("-m", "attngen.cli", "compile", str(bad), "-o", str(tmp_path / "k.py"))
    assert result.returncode == 1
    assert f"{bad}:3:26: unknown name 'windw' (did you mean 'window'?)" in result.stderr
    assert "^^^^^" in result.stderr and "Traceback" not in result.stderr


def test_defines_override_params_and_are_checked(tmp_path):
    spec = ROOT / "specs" / "sliding_window.attn"
    ok = _run("-m", "attngen.cli", "compile", str(spec), "-o", str(tmp_path / "k.py"), "-D", "window=512")
    assert ok.returncode == 0, ok.stderr
    assert "(fingerprint " in (tmp_path / "k.py").read_text()
    default = _run("-m", "attngen.cli", "compile", str(spec), "-o", str(tmp_path / "d.py"))
    assert (tmp_path / "k.py").read_text() != (tmp_path / "d.py").read_text()  # 512 is baked in
    unknown = _run("-m", "attngen.cli", "compile", str(spec), "-o", str(tmp_path / "k.py"), "-D", "windw=3")
    assert unknown.returncode == 2 and "unknown param 'windw'" in unknown.stderr
    malformed = _run("-m", "attngen.cli", "compile", str(spec), "-o", str(tmp_path / "k.py"), "-D", "window")
    assert malformed.returncode == 2 and "NAME=VALUE" in malformed.stderr
    assert "Traceback" not in unknown.stderr + malformed.stderr


def test_run_checks_the_kernel_against_the_reference():
    result = _run("-m", "attngen.cli", "run", str(ROOT / "specs" / "learned_rel_bias.attn"), "--seq-len", "40")
    assert result.returncode == 0, result.stderr
    assert "out, lse, dq, dk, dv, dtable: match the float64 reference" in result.stdout


def test_second_build_in_a_new_process_does_not_render(tmp_path):
    spec = str(ROOT / "specs" / "causal.attn")
    env = {"ATTNGEN_CACHE_DIR": str(tmp_path)}
    first = _run("-c", f"import attngen; print(attngen.build({spec!r}).path)", env=env)
    assert first.returncode == 0, first.stderr
    path = Path(first.stdout.strip())
    stamp = path.stat().st_mtime_ns
    script = f"""
import attngen.api
def refuse(*args, **kwargs):
    raise SystemExit("rendered again")
attngen.api.render = refuse
print(attngen.build({spec!r}).path)
"""
    second = _run("-c", script, env=env)
    assert second.returncode == 0, second.stderr + second.stdout
    assert Path(second.stdout.strip()) == path and path.stat().st_mtime_ns == stamp


def test_quickstart_example_runs():
    result = _run(str(ROOT / "examples" / "quickstart.py"))
    assert result.returncode == 0, result.stderr
    assert "out (1, 4, 200, 64)" in result.stdout


def test_wheel_carries_grammar_templates_and_the_runtime(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                             "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    if result.returncode != 0 and "No module named" in result.stderr:
        pytest.fail(f"building the wheel needs setuptools and wheel installed: {result.stderr[-500:]}")
    assert result.returncode == 0, result.stderr[-2000:]
    wheel = next(tmp_path.glob("attngen-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    package = ROOT / "attngen"
    data = {f"attngen/{p.relative_to(package).as_posix()}" for pattern in ("**/*.lark", "**/*.jinja", "runtime/*.py")
            for p in package.glob(pattern)}
    assert "attngen/frontend/grammar/attn.lark" in data and any(n.endswith("fwd.py.jinja") for n in data)
    assert data <= names, f"missing from the wheel: {sorted(data - names)}"
    # The package ships its type hints, and the wheel states its license and carries its text.
    assert "attngen/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)[-10:]
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: MIT" in metadata


def test_explain_prints_the_ir_plan_tile_map_and_costs(tmp_path):
    plot = tmp_path / "map.png"
    result = _run("-m", "attngen.cli", "explain", str(ROOT / "specs" / "sliding_window.attn"),
                  "--q-len", "8192", "-D", "window=1024", "--target", "h200", "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "mask: (and:bool (ge:bool q k) (lt:bool (sub:int q k) window))" in text
    # A window is a narrow mask: smaller forward tiles, and the backward pass in two launches.
    assert "forward 64x64 4w/3s   dK/dV 32x64 4w/3s   dQ 128x64 8w/3s" in text and "why: fwd:" in text
    assert "why: the mask is narrow for tiling" in text and "as two launches" in text
    # dQ: 64 query tiles x 128 key tiles; the band of 1024 keys covers 16 + 1 key tiles per row at most.
    assert "dQ       128x64 (query x key) tiles, 64 x 128 = 8192: full 840, partial 240, empty 7112" in text
    assert "forward  64x64 (query x key) tiles, 128 x 128 = 16384: full 1800, partial 240, empty 14344" in text
    assert "closed-form loop bounds (exact)" in text
    assert "FLOPs: 4.28 GFLOP against 34.36 GFLOP dense (12.5%)" in text
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_explain_says_what_is_decided_at_run_time():
    result = _run("-m", "attngen.cli", "explain", str(ROOT / "specs" / "document_causal.attn"),
                  "--q-len", "1000", "--target", "h100")
    assert result.returncode == 0, result.stderr
    assert "tile table" in result.stdout and "decided at run time" in result.stdout
    assert "empty 56" in result.stdout  # the causal part is known statically: the upper triangle
    bad = _run("-m", "attngen.cli", "explain", str(ROOT / "specs" / "causal.attn"), "--q-len", "0")
    assert bad.returncode == 2 and "--q-len must be at least 1, got 0" in bad.stderr


def test_explain_says_which_tile_list_the_kernels_follow_and_why():
    """The plan's choice of tile list: a table per call for a mask reading inputs, a kept table for one that
    reads none (with what the closed-form hull would visit instead, at these lengths), the closed form where
    it is exact."""
    per_call = _run("-m", "attngen.cli", "explain", str(ROOT / "specs" / "document_causal.attn"), "--q-len", "256")
    assert "mask: tile table per call" in per_call.stdout and "it reads doc, whose values may change" in per_call.stdout
    closed = _run("-m", "attngen.cli", "explain", str(ROOT / "specs" / "causal.attn"), "--q-len", "256")
    assert "mask: closed form" in closed.stdout and "proves the closed-form tile ranges exact" in closed.stdout
    result = _run("-m", "attngen.cli", "explain", str(ROOT / "benchmarks" / "published" / "global_band.attn"),
                  "--q-len", "1024", "--target", "h200")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "mask: static tile table" in text and "it reads no input: its tiles depend only on Q_LEN, KV_LEN" in text
    assert "from the mask evaluated at these lengths (its static tile table: exact)" in text
    # Forward tiles 64x64: 16 x 16 tiles. The table visits the band's and the global rows' and columns' tiles;
    # the hull, which cannot bound abs(), visits all 256 and masks every full one but those of the first row and
    # column of tiles (the 64 global tokens), 16 + 15 tiles it proves full.
    mapped = re.search(r"forward  64x64 \(query x key\) tiles, 16 x 16 = 256: full (\d+), partial (\d+), empty (\d+)", text)
    hull = re.search(r"forward  the closed-form hull would visit (\d+) tiles \((\d+) of them empty\) and mask (\d+) "
                     r"full ones; the table visits (\d+)", text)
    full, partial, empty = map(int, mapped.groups())
    assert hull.groups() == tuple(str(n) for n in (256, empty, full - 31, full + partial))


def test_explain_shows_a_context_parallel_call():
    result = _run("-m", "attngen.cli", "explain", str(ROOT / "specs" / "sliding_window.attn"), "--q-len", "65536",
                  "-D", "window=4096", "--context-parallel", "4", "--load-balance", "contiguous", "--target", "h200")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "context parallel over 4 rank(s), contiguous sharding (rank r holds chunk r)" in text
    assert "  q chunk   2 (rank 2): . P P ." in text  # a window shorter than a shard sees the shard before it
    assert "ring: how far each rank's K/V shard travels: 0: 1 step(s), 1: 1 step(s), 2: 1 step(s), 3: home only" in text
    assert "schedule: ring (modelled ring" in text
    bad = _run("-m", "attngen.cli", "explain", str(ROOT / "specs" / "causal.attn"), "--q-len", "100",
               "--context-parallel", "3")
    assert bad.returncode == 2 and not bad.stdout and "needs its length to be a multiple of 6, got 100" in bad.stderr


@pytest.mark.slow
def test_check_fuzzes_a_spec_and_reruns_one_case():
    spec = str(ROOT / "specs" / "sliding_window.attn")
    ok = _run("-m", "attngen.cli", "check", spec, "-D", "window=5", "--examples", "4", "--device", "cpu")
    assert ok.returncode == 0, ok.stderr
    assert "4 random cases (f32, f16, cpu) match the float64 reference" in ok.stdout
    one = _run("-m", "attngen.cli", "check", spec, "--device", "cpu",
               "--case", "B=1,H=2,HKV=1,Q_LEN=19,KV_LEN=33,D=12,DV=20,dtype=f32,seed=4")
    assert one.returncode == 0 and "matches the float64 reference" in one.stdout, one.stderr
    bad = _run("-m", "attngen.cli", "check", spec, "--device", "cpu", "--case", "B=1,H=2")
    assert bad.returncode == 2 and "a case needs exactly" in bad.stderr
    # The interpreter's bf16 dots are done in fp32, so bf16 is checked on the CPU too.
    bf16 = _run("-m", "attngen.cli", "check", spec, "--device", "cpu", "--dtype", "bf16", "--examples", "2")
    assert bf16.returncode == 0 and "2 random cases (bf16, cpu) match" in bf16.stdout, bf16.stderr
    fp8 = _run("-m", "attngen.cli", "check", spec, "--device", "cpu", "--dtype", "fp8", "--examples", "2")
    assert fp8.returncode == 0 and "2 random cases (fp8, cpu): FP8 calls' out within its bound" in fp8.stdout, fp8.stderr


def test_check_reports_the_smallest_failure_and_how_to_rerun_it(monkeypatch):
    """A kernel that goes wrong once a query has two keys: the report names the smallest such case."""
    from typer.testing import CliRunner

    from attngen.cli import app
    from attngen.testing import fuzz

    real = fuzz.check_case

    def broken(spec, fn, case, device="cpu"):
        if case.KV_LEN > 1:
            raise AssertionError("out: max error 1 exceeds the allowed 0.001")
        real(spec, fn, case, device)
    monkeypatch.setattr(fuzz, "check_case", broken)
    spec = str(ROOT / "specs" / "causal.attn")
    result = CliRunner().invoke(app, ["check", spec, "--examples", "5", "--device", "cpu", "--dtype", "f32"])
    assert result.exit_code == 1
    assert "FAILED. Smallest failing case hypothesis found:\n  B=1,H=1,HKV=1,Q_LEN=1,KV_LEN=2,D=1,DV=1,dtype=f32,seed=0" \
        in result.output
    assert f"attngen check {spec} --device cpu --case 'B=1,H=1,HKV=1,Q_LEN=1,KV_LEN=2,D=1,DV=1,dtype=f32,seed=0'" \
        in result.output


# --- bad arguments: one `error:` line on stderr and exit status 2, never a traceback or a default ------

CAUSAL = str(ROOT / "specs" / "causal.attn")


def _attngen(monkeypatch, capsys, *args):
    """`attngen ARGS` run in this process through the console script's entry point: (status, stdout, stderr)."""
    from attngen.cli import main

    monkeypatch.setattr(sys, "argv", ["attngen", *args])
    status = main()
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _assert_usage_error(result, message):
    status, _, err = result
    assert "Traceback" not in err
    assert (status, err) == (2, f"error: {message}\n")


@pytest.mark.parametrize("args, message", [
    (["explain", CAUSAL, "--q-len", "8", "--kv-len", "0"], "--kv-len must be at least 1, got 0"),
    (["run", CAUSAL, "--seq-len", "0"], "--seq-len must be at least 1, got 0"),
    (["run", CAUSAL, "--seq-len", "-4"], "--seq-len must be at least 1, got -4"),
    (["run", CAUSAL, "--heads", "3", "--kv-heads", "2"], "--heads must be a multiple of --kv-heads, got 3 and 2"),
])
def test_sizes_below_one_are_refused_not_replaced_by_defaults(monkeypatch, capsys, args, message):
    _assert_usage_error(_attngen(monkeypatch, capsys, *args), message)


def test_output_files_must_be_in_an_existing_folder(monkeypatch, capsys, tmp_path):
    module, image = tmp_path / "missing_dir" / "k.py", tmp_path / "nonexistent" / "map.png"
    _assert_usage_error(_attngen(monkeypatch, capsys, "compile", CAUSAL, "-o", str(module)),
                        f"--output must be a file in an existing folder, got {str(module)!r}")
    _assert_usage_error(_attngen(monkeypatch, capsys, "explain", CAUSAL, "--q-len", "8", "--plot", str(image)),
                        f"--plot must be a file in an existing folder, got {str(image)!r}")


def test_lengths_fit_int32_and_tile_maps_are_capped(monkeypatch, capsys):
    _assert_usage_error(_attngen(monkeypatch, capsys, "explain", CAUSAL, "--q-len", "10000000000"),
                        "--q-len must be at most 2147483647, got 10000000000")
    # The longest length allowed still asks for 2**49 tiles of 128x64 (h200's causal forward tiles).
    _assert_usage_error(_attngen(monkeypatch, capsys, "explain", CAUSAL, "--q-len", "2147483647", "--target", "h200"),
                        "--q-len and --kv-len must give at most 67108864 tiles per map, got 2147483647 x 2147483647 "
                        "in 128x64 tiles = 562949953421312")


@pytest.mark.parametrize("case, why", [
    ("garbage", "each item of a case must be NAME=VALUE, got 'garbage'"),
    ("B=x,H=2,HKV=1,Q_LEN=17,KV_LEN=5,D=24,DV=8,dtype=f32,seed=3", "B must be an integer >= 1, got 'x'"),
    ("B=1,H=3,HKV=2,Q_LEN=17,KV_LEN=5,D=24,DV=8,dtype=f32,seed=3", "H must be a multiple of HKV, got H=3 and HKV=2"),
])
def test_a_bad_case_says_what_a_case_looks_like(monkeypatch, capsys, case, why):
    _assert_usage_error(_attngen(monkeypatch, capsys, "check", CAUSAL, "--case", case),
                        f"--case: {why} (a case looks like B=1,H=2,HKV=1,Q_LEN=17,KV_LEN=5,D=24,DV=8,dtype=f32,seed=3)")


@pytest.mark.parametrize("args, message", [
    (["run", CAUSAL, "--batch", "0"], "--batch must be at least 1, got 0"),
    (["run", CAUSAL, "--heads", "0"], "--heads must be at least 1, got 0"),
    (["run", CAUSAL, "--kv-heads", "-1"], "--kv-heads must be at least 1, got -1"),
    (["run", CAUSAL, "--head-dim", "300"], "--head-dim must be at most 256, got 300"),
    (["explain", CAUSAL, "--q-len", "8", "--head-dim", "0"], "--head-dim must be at least 1, got 0"),
    (["explain", CAUSAL, "--q-len", "8", "--head-dim-v", "257"], "--head-dim-v must be at most 256, got 257"),
    (["check", CAUSAL, "--examples", "0"], "--examples must be at least 1, got 0"),
    (["explain", CAUSAL, "--q-len", "8", "--context-parallel", "0"], "--context-parallel must be at least 1, got 0"),
    (["explain", CAUSAL, "--q-len", "8", "--context-parallel", "2", "--schedule", "tree"],
     "--schedule must be one of auto, ring, allgather, got 'tree'"),
    (["explain", CAUSAL, "--q-len", "8", "--target", "b200"],
     "target must be one of a100, h100, h200, interpreter, got 'b200'"),
])
def test_every_numeric_option_and_library_argument_error_is_a_usage_error(monkeypatch, capsys, args, message):
    _assert_usage_error(_attngen(monkeypatch, capsys, *args), message)


@pytest.mark.parametrize("args, message", [
    (["explain", CAUSAL, "--q-len", "1e10"], "Invalid value for '--q-len'"),  # the rest is typer's wording
    (["explain", CAUSAL], "Missing option '--q-len'."),
    (["explain", CAUSAL, "--q-len", "8", "--bogus"], "No such option: --bogus"),
])
def test_typer_usage_errors_are_one_error_line(monkeypatch, capsys, args, message):
    status, _, err = _attngen(monkeypatch, capsys, *args)
    assert status == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_help_still_works_and_python_m_uses_the_same_entry_point(monkeypatch, capsys):
    status, out, _ = _attngen(monkeypatch, capsys, "explain", "--help")
    assert status == 0 and "--q-len" in out
    result = _run("-m", "attngen.cli", "explain", CAUSAL, "--q-len", "1e10")
    assert result.returncode == 2 and result.stderr.startswith("error: Invalid value for '--q-len'")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr



@pytest.mark.parametrize("q_len, head_dim, dtype, wording", [
    ("8", "256", "f32", "(1.5x more)"), ("64", "256", "f32", "(about the same)"), ("4096", "128", "bf16", "(3.8x less)")])
def test_explain_says_whether_traffic_is_more_or_less_than_standard_attention(monkeypatch, capsys, q_len, head_dim,
                                                                               dtype, wording):
    # Short sequences with wide f32 heads move more bytes than the N x N matrices they avoid.
    status, out, err = _attngen(monkeypatch, capsys, "explain", CAUSAL, "--q-len", q_len, "--head-dim", head_dim,
                                "--dtype", dtype, "--target", "h200")
    assert status == 0, err
    assert out.rstrip().endswith(wording)


def test_version_prints_the_package_version(monkeypatch, capsys):
    from attngen.version import __version__

    assert _attngen(monkeypatch, capsys, "--version") == (0, f"attngen {__version__}\n", "")



def test_a_define_that_empties_the_mask_is_one_warning_line(tmp_path):
    result = _run("-m", "attngen.cli", "compile", str(ROOT / "specs" / "sliding_window.attn"),
                  "-o", str(tmp_path / "k.py"), "-D", "window=-5")
    assert result.returncode == 0 and result.stdout.startswith("wrote "), result.stderr
    assert result.stderr == ("warning: spec 'sliding_window': the mask allows no key to any query, at every length "
                             "with window=-5: every output row is 0 and its LSE -inf\n")


def test_help_and_spec_errors_do_not_import_torch_or_triton(tmp_path):
    # Importing torch takes seconds; a user's first `--help` or typo should not wait for it.
    bad = tmp_path / "bad.attn"
    bad.write_text("attention t\nparam window = 4\nmask: causal && q - k < windw\n")
    script = f"""
import sys
from attngen.cli import main
for args in (["--help"], ["--version"], ["compile", {str(bad)!r}, "-o", {str(tmp_path / "k.py")!r}]):
    sys.argv = ["attngen", *args]
    status = main()
    print("status", status, sorted(m for m in ("torch", "triton") if m in sys.modules))
"""
    result = _run("-c", script)
    assert result.stdout.count("status") == 3, result.stderr
    assert "status 0 []" in result.stdout and "status 1 []" in result.stdout, result.stdout
    assert "unexpected '&&'; use 'and'" in result.stderr


def test_attngen_asks_for_the_interpreter_when_triton_is_first_imported(tmp_path):
    script = """
import os, sys, attngen
assert "torch" not in sys.modules and "triton" not in sys.modules
import triton
import torch
print(os.environ.get("TRITON_INTERPRET"), torch.cuda.is_available())
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    value, gpu = result.stdout.split()
    assert value == ("None" if gpu == "True" else "1")
