"""Launches bound once per specialization (attngen/runtime/launch.py): the facts a launch is keyed by decide
Triton's specialization (checked against the JIT's own binder, on the CPU), a repeated launch reuses
the compiled kernel with the arguments the JIT would pass, and on a GPU the kernels reached that way
still match the reference. Call plans (runtime/plans.py's _CallPlan): a call whose tensors' facts recur skips
the checks and the family's rule, and never lets past a call the checks would stop."""

import inspect
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import JITFunction, create_function_from_signature

import attngen
from attngen import reference, testing
from attngen.runtime import attention as runtime_attention
from attngen.families.decode import runtime as decode
from attngen.families.hopper import runtime as hopper
from attngen.families.portable import runtime as portable
from attngen.runtime import kvcache, launch, launching, tables
from attngen.testing import strategies
from conftest import CPU_CALLS

SPECS = Path(__file__).parent.parent / "specs"


def _one_argument(x):
    pass


# The JIT's binder of a one-argument kernel (JITFunction itself: under TRITON_INTERPRET, triton.jit
# would give the interpreter's function, which has none).
_KERNEL = JITFunction(_one_argument)
_BINDER = create_function_from_signature(_KERNEL.signature, _KERNEL.params, make_backend(GPUTarget("cuda", 90, 32)))


def _specialization(arg):
    """How Triton 3.6's JIT specializes `arg` as a kernel's argument, for an sm_90 target."""
    return _BINDER(arg)[1][0]


_EDGES = [0, 1, 2, 15, 16, 17, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, -2**31, -2**31 - 16, 2**32, 2**63 - 16,
          2**63 - 1, 2**63, 2**64 - 16, -2**63]
ints = st.one_of(st.sampled_from(_EDGES), st.integers(-2**63, 2**64 - 1), st.integers(-64, 64).map(lambda n: n * 16))
tensors = st.tuples(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int8]),
                    st.integers(0, 40)).map(lambda d: torch.zeros(64, dtype=d[0])[d[1]:])


def _descriptor(dtype, box, offset):
    t = torch.zeros(4 * 64 * 128 + 64, dtype=dtype)[offset:offset + 4 * 64 * 128].view(4, 64, 128)
    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return TensorDescriptor.from_tensor(t, box, gl.NVMMASharedLayout.get_default_for(box, element))


descriptors = st.builds(_descriptor, st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
                        st.sampled_from([[1, 64, 128], [1, 128, 64], [1, 64, 64]]), st.sampled_from([0, 64]))
arguments = st.one_of(ints, tensors, descriptors, st.floats(allow_nan=True), st.booleans(), st.none())


@settings(max_examples=400, deadline=None)
@given(arguments, arguments)
def test_equal_facts_mean_equal_specializations(a, b):
    assert launch._launch_fact(a) is not launch._UNBOUND
    if launch._launch_fact(a) == launch._launch_fact(b):
        assert _specialization(a) == _specialization(b)


def test_the_facts_tell_apart_what_triton_tells_apart():
    # The converse is not needed for correctness (a finer key only binds more often), but the facts
    # are meant to be exactly Triton's: one key per specialization for these values.
    values = [*_EDGES, torch.zeros(8), torch.zeros(8)[1:], torch.zeros(8, dtype=torch.bfloat16), 0.5, True, None]
    by_fact = {}
    for value in values:
        by_fact.setdefault(launch._launch_fact(value), set()).add(str(_specialization(value)))
    assert all(len(specs) == 1 for specs in by_fact.values())
    assert len(by_fact) == len({str(_specialization(v)) for v in values})


class _Compiled(triton.compiler.CompiledKernel):
    """A compiled kernel that records its launches."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args: self.launches.append((grid, args))


class _Kernel:
    """A JIT function's surface as _launch uses it: signature, and kernel[grid](...) binding anew."""

    def __init__(self, fn):
        self.signature = inspect.signature(fn)
        self.bindings = []
        self.compiled = {}
        self.launcher = None

    def __getitem__(self, grid):
        def bind(*args, **options):
            self.bindings.append((grid, args, options))
            key = tuple(launch._launch_fact(a) for a in args) + tuple(options.items())
            return self.compiled.setdefault(key, _Compiled())
        return bind


def _signature(X, n, s, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


@pytest.fixture
def compiled_launches(monkeypatch):
    monkeypatch.setattr(launch, "INTERPRETING", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "_LAUNCHES", {})


def test_a_repeated_launch_reuses_the_compiled_kernel(compiled_launches):
    kernel = _Kernel(_signature)
    x = torch.zeros(64)
    first = launch._launch(kernel, (4, 2), x, 32, 0.5, BLOCK=64, num_warps=4)
    assert len(kernel.bindings) == 1 and first.launches == []
    # Another length with the same facts (% 16, not 1), another scale, another aligned buffer: no binding.
    y = torch.ones(128)
    launch._launch(kernel, (8, 2), y, 48, 0.25, BLOCK=64, num_warps=4)
    assert len(kernel.bindings) == 1
    grid, args = first.launches[0]
    # A 3-D grid; every parameter in the signature's order: the keywords and the defaults after the
    # positional ones.
    assert grid == (8, 2, 1) and args[0] is y and args[1:] == (48, 0.25, 64, False)
    launch._launch(kernel, (5,), y, 48, 0.25, BLOCK=64, num_warps=4)
    assert first.launches[1][0] == (5, 1, 1)


@pytest.mark.parametrize("change", ["misaligned", "length 1", "length not % 16", "dtype", "constexpr", "option",
                                    "int64", "device"])
def test_a_launch_with_other_facts_binds_anew(compiled_launches, monkeypatch, change):
    kernel = _Kernel(_signature)
    x = torch.zeros(64)
    launch._launch(kernel, (1,), x, 32, 0.5, BLOCK=64, num_warps=4)
    args, options = [x, 32, 0.5], dict(BLOCK=64, num_warps=4)
    if change == "misaligned":
        args[0] = x[1:]
    elif change == "length 1":
        args[1] = 1
    elif change == "length not % 16":
        args[1] = 33
    elif change == "dtype":
        args[0] = x.to(torch.float16)
    elif change == "constexpr":
        options["BLOCK"] = 128
    elif change == "option":
        options["num_warps"] = 8
    elif change == "int64":
        args[1] = 2**32
    else:
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    launch._launch(kernel, (1,), *args, **options)
    assert len(kernel.bindings) == 2
    launch._launch(kernel, (1,), *args, **options)
    assert len(kernel.bindings) == 2  # and that key is kept too


def test_arguments_of_unknown_kinds_always_bind(compiled_launches):
    kernel = _Kernel(_signature)
    for _ in range(3):
        launch._launch(kernel, (1,), torch.zeros(4), "32", 0.5, BLOCK=64)
    assert len(kernel.bindings) == 3


def test_the_keys_kept_are_bounded(compiled_launches, monkeypatch):
    monkeypatch.setattr(launch, "_LAUNCH_KEYS", 4)
    kernel = _Kernel(_signature)
    for block in range(10):
        launch._launch(kernel, (1,), torch.zeros(4), 32, 0.5, BLOCK=block)
    assert len(launch._LAUNCHES[kernel]) <= 4


def test_the_interpreter_binds_every_launch(monkeypatch):
    monkeypatch.setattr(launch, "INTERPRETING", True)
    monkeypatch.setattr(launch, "_LAUNCHES", {})
    kernel = _Kernel(_signature)
    for _ in range(2):
        launch._launch(kernel, (1,), torch.zeros(4), 32, 0.5, BLOCK=64)
    assert len(kernel.bindings) == 2 and launch._LAUNCHES == {}


def test_inference_calls_make_no_autograd_node(monkeypatch):
    attn = attngen.build("attention causal\nmask: causal\n")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = testing.random_qkv(1, 2, 2, 20, 20, 16, 16, torch.float32, device=device, seed=1)
    q.requires_grad_()
    with_node = attn(q, k, v)
    assert with_node.grad_fn is not None
    monkeypatch.setattr(runtime_attention, "_Attention", None)  # any use of the autograd node now fails
    with torch.no_grad():
        without = attn(q, k, v)
    assert without.grad_fn is None
    torch.testing.assert_close(without, with_node.detach(), rtol=0, atol=0)
    assert attn(q.detach(), k, v).grad_fn is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("target", [None, "a100"], ids=["planned", "portable"])
def test_bound_launches_match_the_reference_on_gpu(target):
    # Two calls whose sizes differ but whose facts agree (lengths of equal residues mod 16, none 1): the
    # second reuses the first's compiled kernels with its own arguments, forward and backward.
    attn = attngen.build("attention causal_bound\nmask: causal\n", target=target)
    module = attn.module
    for q_len in (300, 172):
        q, k, v = testing.random_qkv(2, 4, 2, q_len, q_len + 21, 128, 128, torch.bfloat16, device="cuda", seed=q_len)
        testing.check_against_reference(attn.spec, attn, q, k, v)
    # The runtime's launch cache serves every module in the process: this module's kernels only.
    mine = {kernel: keys for kernel, keys in launch._LAUNCHES.items() if kernel.fn.__module__ == module.__name__}
    assert any(mine.values()) and all(len(keys) == 1 for keys in mine.values())


# --- call plans -------------------------------------------------------------------------------------

def _counting_checks(monkeypatch, module):
    calls = []
    check = module.ATTENTION._check
    monkeypatch.setattr(module.ATTENTION, "_check", lambda *args: calls.append(1) or check(*args))
    monkeypatch.setattr(module.ATTENTION, "call_plans", {})
    return calls


@CPU_CALLS
def test_a_call_with_the_facts_of_an_earlier_one_reuses_its_plan(monkeypatch):
    attn = attngen.build(SPECS / "document_causal.attn")
    checks = _counting_checks(monkeypatch, attn.module)
    q, k, v = testing.random_qkv(1, 2, 2, 40, 40, 16, 16, torch.float32, seed=1)
    doc = torch.arange(40, dtype=torch.int32) // 16
    first = attn(q, k, v, doc=doc)
    # New tensors (other values, other storage) of the same facts: no second check, the same answer for
    # the same values.
    again = attn(q.clone(), k.clone(), v.clone(), doc=doc.clone())
    assert len(checks) == 1 and len(attn.module.ATTENTION.call_plans) == 1
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    testing.check_against_reference(attn.spec, attn, q, k, v, {"doc": doc})


@CPU_CALLS
@pytest.mark.parametrize("change", ["dtype", "length", "head dim", "input shape", "input dtype", "missing input",
                                    "extra input", "not a tensor", "strides"])
def test_a_call_whose_facts_differ_is_checked_again(monkeypatch, change):
    # After a good call has made a plan, calls that differ from it in any fact the checks read are
    # checked in full: the bad ones fail with the checks' own errors.
    attn = attngen.build(SPECS / "document_causal.attn")
    checks = _counting_checks(monkeypatch, attn.module)
    q, k, v = testing.random_qkv(1, 2, 2, 40, 40, 16, 16, torch.float32, seed=2)
    inputs = {"doc": torch.zeros(40, dtype=torch.int32)}
    attn(q, k, v, **inputs)
    bad = {"dtype": "must share a dtype", "head dim": "head_dim", "input shape": "must have shape",
           "input dtype": "must have dtype", "missing input": "missing input", "extra input": "unknown input",
           "not a tensor": "must be a torch.Tensor"}
    if change == "dtype":
        k = k.to(torch.float16)
    elif change == "length":
        q = q[:, :, :33]
    elif change == "head dim":
        k = torch.cat([k, k], dim=-1)
    elif change == "input shape":
        inputs["doc"] = torch.zeros(41, dtype=torch.int32)
    elif change == "input dtype":
        inputs["doc"] = inputs["doc"].to(torch.int64)
    elif change == "missing input":
        inputs = {}
    elif change == "extra input":
        inputs["other"] = torch.zeros(40)
    elif change == "not a tensor":
        inputs["doc"] = [0] * 40
    else:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    if change in bad:
        with pytest.raises(ValueError, match=bad[change]):
            attn(q, k, v, **inputs)
    else:
        attn(q, k, v, **inputs)
    assert len(checks) == 2


@CPU_CALLS
def test_tensor_subclasses_are_checked_every_call(monkeypatch):
    class Tagged(torch.Tensor):
        pass

    attn = attngen.build("attention causal\nmask: causal\n")
    checks = _counting_checks(monkeypatch, attn.module)
    q, k, v = (t.as_subclass(Tagged) for t in testing.random_qkv(1, 2, 2, 24, 24, 16, 16, torch.float32, seed=3))
    for _ in range(2):
        attn(q, k, v)
    assert len(checks) == 2 and not attn.module.ATTENTION.call_plans


@CPU_CALLS
def test_the_plans_kept_are_bounded(monkeypatch):
    attn = attngen.build("attention causal\nmask: causal\n")
    _counting_checks(monkeypatch, attn.module)
    monkeypatch.setattr(attn.module.ATTENTION, "call_plan_keys", 3)
    for n in range(17, 27):
        attn(*testing.random_qkv(1, 1, 1, n, n, 16, 16, torch.float32, seed=n))
    assert 1 <= len(attn.module.ATTENTION.call_plans) <= 3


# The runtime's modules that launch kernels, each through its own imported _launch and _plan_site.
_LAUNCHING = (portable, launching, tables, hopper, decode, kvcache)


def _recorded_launches(monkeypatch, module):
    """Runs the module's launches through _launch as on a GPU (bound, plans included), but into fake
    kernels that record instead of running: each kernel's _Kernel, keyed by the real one."""
    fakes = {}
    launch_for_real = launch._launch

    def recorder(launcher):
        def recorded(kernel, grid, *args, **options):
            fake = fakes.setdefault(kernel, _Kernel(kernel.fn))
            fake.launcher = launcher  # the runtime module that launched it
            launch.INTERPRETING = False  # _launch binds only off the interpreter; the checks keep reading True
            try:
                return launch_for_real(fake, grid, *args, **options)
            finally:
                launch.INTERPRETING = True
        return recorded

    for launcher in _LAUNCHING:
        monkeypatch.setattr(launcher, "_launch", recorder(launcher))
    monkeypatch.setattr(launch, "_LAUNCHES", {})
    monkeypatch.setattr(module.ATTENTION, "call_plans", {})
    monkeypatch.setattr(launch, "_VERIFY_BINDS", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return fakes


@CPU_CALLS
@pytest.mark.parametrize("name", sorted(path.stem for path in SPECS.glob("*.attn")))
def test_every_site_a_plan_binds_sees_the_facts_it_was_bound_with(monkeypatch, name):
    # The portable family's and the decode family's sites, the table builds and the backward's, on the
    # CPU: calls of new tensors and values of the same facts, with dO of two layouts (a stride-0
    # expansion and a dense tensor), reach every bound site again, and _VERIFY_BINDS recomputes the
    # arguments' facts there (the GPU test does the same for the Hopper family's sites, results included).
    attn = attngen.build(SPECS / f"{name}.attn", target="a100")
    fakes = _recorded_launches(monkeypatch, attn.module)
    verified = []
    verify = launch._verify_bind
    monkeypatch.setattr(launch, "_verify_bind", lambda *args: verified.append(args[0]) or verify(*args))
    for q_len in (1, 1, 40, 40):  # the decode family's calls, then the portable family's
        q, k, v = testing.random_qkv(2, 4, 2, q_len, 48, 64, 64, torch.float32, seed=q_len)
        inputs = testing.random_inputs(attn.spec, 2, 4, 2, q_len, 48)
        for loss in (lambda out: out.sum(), lambda out: (out * torch.ones_like(out)).sum()):
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            loss(attn(q, k, v, **inputs)).backward()
        with torch.no_grad():
            attn(q, k, v, **inputs)
    plans = list(attn.module.ATTENTION.call_plans.values())
    assert len(plans) == 2 and all(plan.launches and len(plan.backwards) == 2 for plan in plans)
    # Every kernel bound once per set of facts, and every kernel relaunched through a plan's site.
    assert fakes and all(len(fake.bindings) == len(fake.compiled) for fake in fakes.values())
    relaunched = set(fakes.values())
    if attn.module.FACTS.static_tables is not None:  # a mask reading no input: its tables are built once and kept
        relaunched -= {fake for fake in fakes.values() if fake.launcher is tables}
    assert set(verified) == relaunched


@CPU_CALLS
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged16"])
def test_cache_call_plans_bind_sites_that_see_the_facts_they_were_bound_with(monkeypatch, paged):
    # A cache call's plan (kvcache._cache_plan) is keyed by its tensors' facts and kv_len's, q_offset's and the
    # page table's: other lengths, offsets and pages of the same facts reuse it, and every launch it binds
    # (the decode family's split and merge, the portable forward of a chunk of queries, the device check of
    # the values) recomputes its arguments' facts (_VERIFY_BINDS).
    attn = attngen.build(SPECS / "alibi_causal.attn", target="a100")
    fakes = _recorded_launches(monkeypatch, attn.module)
    verified = []
    verify = launch._verify_bind
    monkeypatch.setattr(launch, "_verify_bind", lambda *args: verified.append(args[0]) or verify(*args))
    for q_len in (1, 40):  # the decode family's calls, then the portable family's
        for seed in range(2):
            q, k, v = testing.random_qkv(2, 4, 2, q_len, 64, 64, 64, torch.float32, seed=seed)
            inputs = testing.random_inputs(attn.spec, 2, 4, 2, q_len, 64, seed=seed)
            kv_len = torch.tensor([64, 48 + seed], dtype=torch.int32)
            calls = [dict(kv_len=kv_len), dict(kv_len=kv_len, q_offset=kv_len - q_len - seed)]
            if paged:
                k, v, table = strategies.paged(k, v, 16, seed=seed)
                calls = [dict(call, page_table=table) for call in calls]
            else:
                calls.append(dict(q_offset=torch.tensor([0, seed], dtype=torch.int32)))
            with torch.no_grad():
                for call in calls:
                    attn(q, k, v, **call, **inputs)
    plans = [plan for key, plan in attn.module.ATTENTION.call_plans.items() if key[0] == "cache"]
    assert len(plans) == 2 * (2 if paged else 3) and all(plan.launches for plan in plans)
    assert not [key for key in attn.module.ATTENTION.call_plans if key[0] != "cache"]  # no dense call's plan made
    assert {fake.launcher for fake in fakes.values()} == {decode, portable, kvcache}
    assert fakes and all(len(fake.bindings) == len(fake.compiled) for fake in fakes.values())
    assert set(verified) == set(fakes.values())


@CPU_CALLS
def test_a_site_that_misses_a_fact_of_its_arguments_fails_the_check(monkeypatch):
    # The check above can fail: sites named without what tells them apart (the compaction of the
    # forward's tile table, 5 key tiles a row here, and of the backward's, 1 query tile a row) reuse
    # each other's bindings.
    attn = attngen.build(SPECS / "document_causal.attn", target="a100")
    _recorded_launches(monkeypatch, attn.module)
    for launcher in _LAUNCHING:
        monkeypatch.setattr(launcher, "_plan_site", lambda plan, *site: None if plan is None else
                            (plan.launches, site[0]))
    q, k, v = (t.requires_grad_() for t in testing.random_qkv(2, 4, 2, 40, 300, 64, 64, torch.float32, seed=5))
    doc = torch.zeros(300, dtype=torch.int32)
    with pytest.raises(AssertionError, match="other argument facts"):
        for _ in range(2):
            attn(q, k, v, doc=doc).sum().backward()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", sorted(path.stem for path in SPECS.glob("*.attn")))
@pytest.mark.parametrize("target", [None, "a100"], ids=["planned", "portable"])
def test_planned_launches_see_the_facts_they_were_bound_with_on_gpu(name, target, monkeypatch):
    # Every launch a plan binds recomputes its arguments' facts (_VERIFY_BINDS) and fails on a difference:
    # calls of new tensors, values and lengths of the same facts, forward (inference and training, whose
    # tables and launches the plan binds) and backward, each against float64.
    attn = attngen.build(SPECS / f"{name}.attn", target=target)
    monkeypatch.setattr(launch, "_VERIFY_BINDS", True)
    monkeypatch.setattr(attn.module.ATTENTION, "call_plans", {})
    for seed, (q_len, kv_len) in enumerate([(300, 321), (300, 321), (332, 353)]):
        q, k, v = testing.random_qkv(2, 4, 2, q_len, kv_len, 128, 128, torch.bfloat16, device="cuda", seed=seed)
        inputs = testing.random_inputs(attn.spec, 2, 4, 2, q_len, kv_len, device="cuda")
        with torch.no_grad():
            attn(q, k, v, **inputs)
        testing.check_against_reference(attn.spec, attn, q, k, v, inputs)
    plans = list(attn.module.ATTENTION.call_plans.values())
    assert len(plans) == 2 and all(plan.launches for plan in plans)
    # dO of other facts (a stride-0 expansion from .sum(), a dense one of the same values) gets
    # backward plans of its own, on the same call plan, with the same gradients.
    grads = []
    for loss in (lambda out: out.sum(), lambda out: (out * torch.ones_like(out)).sum()):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        loss(attn(q, k, v, **inputs)).backward()
        grads.append([q.grad, k.grad, v.grad])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    assert len(plans[-1].backwards) >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", ["causal", "alibi_causal", "document_causal", "gpt_oss_sinks"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged16"])
def test_cache_call_plans_bind_launches_of_the_facts_they_saw_on_gpu(name, paged, monkeypatch):
    # A cache call's plan (kvcache._cache_plan): other lengths, offsets and pages of the same facts reuse it,
    # and every launch it binds (decode split and merge, the portable forward of a chunk, the device check)
    # recomputes its arguments' facts (_VERIFY_BINDS); each call against float64.
    attn = attngen.build(SPECS / f"{name}.attn")
    monkeypatch.setattr(launch, "_VERIFY_BINDS", True)
    monkeypatch.setattr(attn.module.ATTENTION, "call_plans", {})
    for q_len in (1, 1, 64, 64):
        q, k, v = testing.random_qkv(2, 8, 2, q_len, 512, 128, 128, torch.bfloat16, device="cuda", seed=q_len)
        inputs = testing.random_inputs(attn.spec, 2, 8, 2, q_len, 512, device="cuda", query_positions=600)
        kv_len = torch.randint(q_len, 513, (2,), dtype=torch.int32, device="cuda")
        call = {"kv_len": kv_len}
        if paged:
            k_pages, v_pages, call["page_table"] = strategies.paged(k, v, 16, seed=q_len)
        with torch.no_grad():
            out = attn(q, *((k_pages, v_pages) if paged else (k, v)), **call, **inputs)
        want, _ = reference.evaluate(attn.spec, q.double(), k.double(), v.double(), inputs, kv_len=kv_len)
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    plans = list(attn.module.ATTENTION.call_plans.values())
    assert len(plans) == 2 and all(plan.launches for plan in plans)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", ["causal", "document_causal", "learned_rel_bias", "gemma2_local"])
@pytest.mark.parametrize("target", [None, "a100"], ids=["planned", "portable"])
def test_packed_call_plans_bind_launches_of_the_facts_they_saw_on_gpu(name, target, monkeypatch):
    # A packed call's plan (packed.py's _packed_plan) is keyed by its tensors', offsets' and longest
    # lengths' facts: other sequence lengths of the same facts reuse it, and every launch it binds
    # recomputes its arguments' facts (_VERIFY_BINDS), forward and backward, each against float64.
    attn = attngen.build(SPECS / f"{name}.attn", target=target)
    monkeypatch.setattr(launch, "_VERIFY_BINDS", True)
    monkeypatch.setattr(attn.module.ATTENTION, "call_plans", {})
    # Two splits of 600 tokens with the same longest sequence (one plan), then more tokens (another).
    for seed, lengths in enumerate([[300, 1, 0, 299], [150, 300, 100, 50], [300, 17, 300, 129]]):
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        packed = dict(cu_seqlens_q=offsets, cu_seqlens_k=offsets, max_seqlen_q=300, max_seqlen_k=300)
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(sum(lengths), 4, 128, generator=g).to("cuda", torch.bfloat16)
        k, v = (torch.randn(sum(lengths), 2, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
        inputs = testing.random_inputs(attn.spec, len(lengths), 4, 2, 300, 300, seed=seed, device="cuda")
        with torch.no_grad():
            attn(q, k, v, **inputs, **packed)
        testing.check_against_reference(attn.spec, attn, q, k, v, inputs, packed=packed)
    plans = list(attn.module.ATTENTION.call_plans.values())
    assert len(plans) == 2 and all(plan.launches for plan in plans)
    assert all(backward.launches for plan in plans for backward in plan.backwards.values())
