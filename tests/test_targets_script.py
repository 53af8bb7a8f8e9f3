"""benchmarks/targets.py's logic on the CPU: every target met or missed on made-up timings, a missing time
"not measured" (never "met"), a case for every catalog spec, --only, the tables and the JSON document."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest
import torch

from attngen.bench import ATTNGEN, ATTNGEN_PREBUILT, FLEX, Timing

ROOT = Path(__file__).parent.parent


def _load_script():
    spec = importlib.util.spec_from_file_location("benchmarks_targets", ROOT / "benchmarks" / "targets.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


targets = _load_script()
PORTABLE, CUDNN = targets.PORTABLE, targets.CUDNN


def _case(name: str):
    return next(c for c in targets.cases() if c.name == name)


def _result(families=None, **times) -> "targets.Result":
    """A Result whose implementations ran with these (fwd ms, fwd+bwd ms)."""
    timings = {name.replace("_", " "): Timing(name.replace("_", " "), fwd, fwdbwd)
               for name, (fwd, fwdbwd) in times.items()}
    return targets.Result(timings=timings, families=families or {})


# --- target evaluation ---------------------------------------------------------------------------------

def test_speed_target_met_missed_by_ratio_of_the_others_time_over_ours():
    causal = _case("causal")
    forward, backward = causal.targets  # forward >= 1.0x cuDNN, forward+backward >= 0.9x cuDNN
    results = {causal.measurements[0].key: _result(attngen=(0.50, 2.0), attngen_portable=(0.70, 2.5),
                                                   sdpa_cudnn=(0.55, 2.0))}
    met = targets.evaluate(forward, results, ATTNGEN)
    assert (met.status, met.ratio) == (targets.MET, pytest.approx(1.1))
    missed = targets.evaluate(forward, results, PORTABLE)
    assert (missed.status, missed.ratio) == (targets.MISSED, pytest.approx(0.55 / 0.70))
    # 2.0 / 2.5 = 0.8 < 0.9; exactly level with cuDNN (1.0 >= 0.9) is met
    assert targets.evaluate(backward, results, PORTABLE).status == targets.MISSED
    assert targets.evaluate(backward, results, ATTNGEN).status == targets.MET


def test_speed_target_on_the_bound_is_met_and_just_below_is_missed():
    causal = _case("causal")
    forward = causal.targets[0]
    key = causal.measurements[0].key
    assert targets.evaluate(forward, {key: _result(attngen=(0.5, None), sdpa_cudnn=(0.5, None))},
                            ATTNGEN).status == targets.MET
    assert targets.evaluate(forward, {key: _result(attngen=(0.5, None), sdpa_cudnn=(0.4999, None))},
                            ATTNGEN).status == targets.MISSED


def test_time_target_is_variant_time_over_plain_time_by_the_same_implementation():
    case = _case("learned_rel_bias")  # forward+backward learned_rel_bias <= 2.0x plain
    bias, plain = case.measurements
    target, = case.targets
    results = {bias.key: _result(attngen=(1.0, 7.0), attngen_portable=(1.0, 9.0)),
               plain.key: _result(attngen=(0.9, 4.0), attngen_portable=(1.0, 4.0))}
    ours = targets.evaluate(target, results, ATTNGEN)
    assert (ours.status, ours.ratio) == (targets.MET, pytest.approx(1.75))
    portable = targets.evaluate(target, results, PORTABLE)
    assert (portable.status, portable.ratio) == (targets.MISSED, pytest.approx(2.25))


def test_softcap_forward_has_a_bound_and_its_forward_backward_is_shown_unjudged():
    case = _case("softcap")
    forward, backward = case.targets
    softcap, plain = case.measurements
    results = {softcap.key: _result(attngen=(1.2, 5.0), attngen_portable=(1.4, 5.0)),
               plain.key: _result(attngen=(1.0, 4.0), attngen_portable=(1.0, 4.0))}
    assert targets.evaluate(forward, results, ATTNGEN).status == targets.MET  # 1.2 <= 1.3
    assert targets.evaluate(forward, results, PORTABLE).status == targets.MISSED  # 1.4 > 1.3
    shown = targets.evaluate(backward, results, ATTNGEN)
    assert (shown.status, shown.ratio) == (targets.SHOWN, pytest.approx(1.25))


def test_every_kind_of_missing_time_is_not_measured_with_its_reason():
    causal, softcap = _case("causal"), _case("softcap")
    forward, backward = causal.targets
    key = causal.measurements[0].key
    timed = _result(attngen=(0.5, None), sdpa_cudnn=(0.5, 2.0))
    refused = targets.Result(timings={ATTNGEN: Timing(ATTNGEN, 0.5, 2.0),
                                      CUDNN: Timing(CUDNN, note="forward refused: RuntimeError: no kernel")})
    sdpa_absent = targets.Result(timings={ATTNGEN: Timing(ATTNGEN, 0.5, 2.0)},
                                 absent={CUDNN: "SDPA cannot run it (the spec has a score expression)"})
    cases = [
        (forward, {}, ATTNGEN, "not run"),  # the measurement was never run (--only, or cut short)
        (forward, {key: targets.Result(error="OutOfMemoryError: CUDA out of memory")}, ATTNGEN, "OutOfMemoryError"),
        (forward, {key: timed}, PORTABLE, "attngen portable on"),  # an implementation with no Timing
        (backward, {key: timed}, ATTNGEN, "forward+backward not timed"),  # --no-backward
        (forward, {key: refused}, ATTNGEN, "no kernel"),  # the other failed: its note is the reason
        (forward, {key: sdpa_absent}, ATTNGEN, "score expression"),
        # a time target with its plain measurement missing
        (softcap.targets[0], {softcap.measurements[0].key: timed}, ATTNGEN, "plain"),
    ]
    for target, results, implementation, reason in cases:
        verdict = targets.evaluate(target, results, implementation)
        assert (verdict.status, verdict.ratio) == (targets.NOT_MEASURED, None), (target.describe(), results)
        assert reason in verdict.why


def test_flex_with_a_one_stage_backward_judges_the_flex_targets_where_flexs_own_tiles_did_not_fit():
    rel = _case("catalog/learned_rel_bias")
    forward, backward = rel.targets  # forward >= 1.2x Flex, forward+backward >= 1.1x Flex
    key = rel.measurements[0].key
    ran_out = Timing(FLEX, 11.0, None, note="forward+backward failed: InductorError: out of resource: shared memory")
    one_stage = Timing(targets.FLEX_ONE_STAGE, 11.5, 30.0)
    ours = Timing(ATTNGEN, 2.0, 12.0)
    results = {key: targets.Result(timings={ATTNGEN: ours, FLEX: ran_out, targets.FLEX_ONE_STAGE: one_stage})}
    assert targets.evaluate(backward, results, ATTNGEN).ratio == pytest.approx(30.0 / 12.0)
    assert targets.evaluate(forward, results, ATTNGEN).ratio == pytest.approx(11.0 / 2.0)  # Flex's own forward
    without = {key: targets.Result(timings={ATTNGEN: ours, FLEX: ran_out})}
    verdict = targets.evaluate(backward, without, ATTNGEN)
    assert (verdict.status, verdict.ratio) == (targets.NOT_MEASURED, None) and "out of resource" in verdict.why


# --- the cases -------------------------------------------------------------------------------------------

def test_every_catalog_spec_has_a_case_with_the_flex_targets_at_the_catalog_size():
    stems = {path.stem for path in (ROOT / "specs").glob("*.attn")}
    catalog = {c.name.split("/", 1)[1]: c for c in targets.cases() if c.group == targets.CATALOG}
    assert set(catalog) == stems and len(stems) >= 11
    for stem, case in catalog.items():
        m, = case.measurements
        assert Path(m.spec) == ROOT / "specs" / f"{stem}.attn"
        p = m.problem
        assert (p.B, p.H, p.HKV, p.Q_LEN, p.KV_LEN, p.D, p.dtype) == (2, 16, 16, 8192, 8192, 128, "bf16")
        assert [(t.phase, t.other, t.at_least) for t in case.targets] == [("fwd", FLEX, 1.2), ("fwdbwd", FLEX, 1.1)]


def test_every_catalog_spec_has_a_first_call_case_judged_against_flexs_first_call():
    stems = {path.stem for path in (ROOT / "specs").glob("*.attn")}
    first = {c.name.split("/", 1)[1]: c for c in targets.cases() if c.group == targets.FIRST_CALL}
    assert set(first) == stems
    case = first["causal"]
    m, = case.measurements
    target, = case.targets
    assert m.first_call and m.key == "first call causal B2 H16 N4096 D128"
    assert (target.phase, target.other, target.at_least) == ("first", FLEX, 1.0)
    assert target.describe() == f"first call >= 1.0x {FLEX}"

    def result(ours, theirs, portable_absent=True):
        timings = {ATTNGEN: Timing(ATTNGEN, first_call_s=ours), FLEX: Timing(FLEX, first_call_s=theirs, note="x")}
        return {m.key: targets.Result(timings, absent={PORTABLE: "not this build"} if portable_absent else {})}

    met = targets.evaluate(target, result(6.0, 15.0), ATTNGEN)
    assert (met.status, met.ratio) == (targets.MET, pytest.approx(2.5))
    assert targets.evaluate(target, result(16.0, 15.0), ATTNGEN).status == targets.MISSED
    unmeasured = targets.evaluate(target, result(6.0, None), ATTNGEN)
    assert unmeasured.status == targets.NOT_MEASURED and FLEX in unmeasured.why
    portable = targets.evaluate(target, result(6.0, 15.0), PORTABLE)
    assert portable.status == targets.NOT_MEASURED and "not this build" in portable.why


def test_a_first_call_measurement_runs_each_implementation_by_first_call_py(monkeypatch):
    calls = []

    def run_one(implementation, spec_name, shape):
        calls.append((implementation, spec_name, shape))
        return ({"first_s": 6.5} if implementation == "attngen"
                else {"spec": spec_name, "implementation": implementation, "error": "flex cannot express it"})

    monkeypatch.setitem(sys.modules, "first_call", type(sys)("first_call"))
    monkeypatch.setattr(sys.modules["first_call"], "run_one", run_one, raising=False)
    m, = _case("first_call/gpt_oss_sinks").measurements
    result = targets.measure_first_call(m, lambda what: None)
    assert calls == [("attngen", "gpt_oss_sinks", "2,16,4096,128"), ("flex", "gpt_oss_sinks", "2,16,4096,128")]
    assert result.timings[ATTNGEN].first_call_s == 6.5
    assert result.timings[FLEX].first_call_s is None and result.timings[FLEX].note == "flex cannot express it"
    verdict = targets.evaluate(_case("first_call/gpt_oss_sinks").targets[0], {m.key: result}, ATTNGEN)
    assert verdict.status == targets.NOT_MEASURED and "flex cannot express it" in verdict.why


def test_the_issues_shapes_and_bounds():
    described = {c.name: ([m.key for m in c.measurements], [t.describe() for t in c.targets])
                 for c in targets.cases()
                 if c.group not in (targets.CATALOG, targets.FIRST_CALL, targets.FP8, targets.BACKWARD)}
    assert described == {
        "full": (["full B4 H16 N4096 D128"],
                 ["forward >= 1.0x sdpa cudnn", "forward+backward >= 0.9x sdpa cudnn"]),
        "causal": (["causal B4 H16 N4096 D128"],
                   ["forward >= 1.0x sdpa cudnn", "forward+backward >= 0.9x sdpa cudnn"]),
        "causal_d64": (["causal B4 H16 N8192 D64"],
                       ["forward >= 0.9x sdpa cudnn", f"forward >= 1.2x {FLEX}",
                        "forward+backward >= 0.9x sdpa cudnn", f"forward+backward >= 1.2x {FLEX}"]),
        "softcap": (["softcap B2 H16 N8192 D128", "plain B2 H16 N8192 D128"],
                    ["forward time softcap <= 1.3x plain", "forward+backward time softcap (no target) vs plain"]),
        "learned_rel_bias": (["learned_rel_bias B4 H16 N4096 D128", "plain B4 H16 N4096 D128"],
                             ["forward+backward time learned_rel_bias <= 2.0x plain"]),
    }
    softcap, plain = _case("softcap").measurements
    assert (softcap.spec, plain.spec) == (targets.SOFTCAP, targets.PLAIN)


def test_fp8_cases_ask_issue_35s_rates_at_fa3s_shapes():
    described = {c.name: ([m.key for m in c.measurements], [t.describe() for t in c.targets])
                 for c in targets.cases() if c.group == targets.FP8}
    assert described == {"fp8/d128": (["fp8 full B2 H16 N8192 D128"], ["forward >= 1000 TFLOP/s"]),
                         "fp8/d256": (["fp8 full B2 H8 N8192 D256"], ["forward >= 1100 TFLOP/s"])}


def test_backward_cases_ask_issue_35s_backward_rates_at_fa3s_shapes():
    described = {c.name: ([m.key for m in c.measurements], [t.describe() for t in c.targets])
                 for c in targets.cases() if c.group == targets.BACKWARD}
    assert described["backward/full_d64"] == (["full B2 H32 N8192 D64"], [
        "backward >= 480 TFLOP/s", "forward+backward >= 1.0x sdpa cudnn"])
    assert described["backward/causal_d128"] == (["causal B2 H16 N8192 D128"], [
        "backward >= 580 TFLOP/s", "forward+backward >= 1.1x sdpa cudnn"])
    assert described["backward/full_d256"] == (["full B2 H8 N8192 D256"], ["backward >= 450 TFLOP/s"])
    assert len(described) == 6


def test_a_backward_rate_is_the_backward_s_flops_over_forward_backward_less_forward():
    case = _case("backward/full_d64")
    m = case.measurements[0]
    forward = 4 * 64 * 2 * 32 * 8192 * 8192
    results = {m.key: targets.Result(timings={ATTNGEN: Timing(ATTNGEN, 1.0, 3.5), PORTABLE: Timing(PORTABLE, 1.0)},
                                     flops={"fwd": forward, "fwdbwd": 3.5 * forward, "bwd": 2.5 * forward})}
    met = targets.evaluate(case.targets[0], results, ATTNGEN)
    assert met.ratio == pytest.approx(2.5 * forward / 2.5e9 / 480)  # 2.5 x the FLOPs in 2.5 ms
    # No forward+backward time: the backward is not measured, never counted as a rate of the forward alone.
    assert targets.evaluate(case.targets[0], results, PORTABLE).status == targets.NOT_MEASURED


def test_a_rate_target_is_the_rate_reached_over_the_rate_asked():
    case = _case("fp8/d128")
    m, = case.measurements
    flops = 4 * 128 * 2 * 16 * 8192 * 8192  # every pair of the full spec: 4 * D FLOPs each
    results = {m.key: targets.Result(timings={ATTNGEN: Timing(ATTNGEN, 1.0), PORTABLE: Timing(PORTABLE, 2.5)},
                                     flops={"fwd": flops, "fwdbwd": 3.5 * flops})}
    met = targets.evaluate(case.targets[0], results, ATTNGEN)
    assert (met.status, met.ratio) == (targets.MET, pytest.approx(flops / 1e9 / 1000))  # 1.1 PFLOP/s
    missed = targets.evaluate(case.targets[0], results, PORTABLE)
    assert (missed.status, missed.ratio) == (targets.MISSED, pytest.approx(flops / 2.5e9 / 1000))
    assert targets.evaluate(case.targets[0], {}, ATTNGEN).status == targets.NOT_MEASURED


def test_measurement_keys_name_one_spec_and_size_each():
    seen = {}
    for case in targets.cases() + targets.cases(quick=True):
        for m in case.measurements:
            assert seen.setdefault(m.key, m) == m, m.key


def test_quick_shrinks_n_and_keeps_a_few_catalog_specs():
    quick = targets.cases(quick=True)
    catalog = [c.name for c in quick if c.group == targets.CATALOG]
    assert catalog == [f"catalog/{s}" for s in sorted(targets.QUICK_CATALOG)]
    assert {m.problem.Q_LEN for c in quick for m in c.measurements} == {1024, 2048}


def test_only_selects_cases_and_groups_in_order_and_refuses_unknown_names():
    names = [c.name for c in targets.select(targets.cases(), ["softcap", "catalog", "full"])]
    assert names[0] == "full" and names[-1] == "softcap" and len(names) == 2 + len(targets.catalog_stems())
    assert [c.name for c in targets.select(targets.cases(), ["catalog/causal"])] == ["catalog/causal"]
    with pytest.raises(ValueError, match="--only must name cases or groups among .* got nope"):
        targets.select(targets.cases(), ["causal", "nope"])
    # a measurement two selected cases share is timed once
    cases = targets.select(targets.cases(), ["softcap", "learned_rel_bias"])
    assert [m.key for m in targets.measurements(cases)] == [
        "softcap B2 H16 N8192 D128", "plain B2 H16 N8192 D128", "learned_rel_bias B4 H16 N4096 D128",
        "plain B4 H16 N4096 D128"]


def test_parse_args_only_and_list(capsys):
    args = targets.parse_args(["--only", "causal,softcap", "--quick", "--no-backward"])
    assert [c.name for c in args.selected] == ["causal", "softcap"] and args.quick and args.no_backward
    assert targets.main(["--list", "--only", "causal_d64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("causal_d64: forward >= 0.9x sdpa cudnn;") and "[causal B4 H16 N8192 D64]" in out
    with pytest.raises(SystemExit):
        targets.parse_args(["--only", "nope"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_no_gpu_is_an_error_and_exit_status_2(capsys):
    assert targets.main(["--only", "causal"]) == 2
    assert "times kernels on a CUDA GPU" in capsys.readouterr().err


# --- rows, tables, JSON -----------------------------------------------------------------------------------

def _measured_causal():
    causal = _case("causal")
    key = causal.measurements[0].key
    result = targets.Result(
        timings={ATTNGEN: Timing(ATTNGEN, 0.5, 2.5), PORTABLE: Timing(PORTABLE, 0.7, None, note="backward failed"),
                 CUDNN: Timing(CUDNN, 0.525, 2.0)},
        families={ATTNGEN: "hopper", PORTABLE: "portable"},
        rows=[{"implementation": ATTNGEN}, {"implementation": ATTNGEN_PREBUILT}, {"implementation": PORTABLE},
              {"implementation": CUDNN}])
    return [causal], {key: result}


def test_target_rows_and_table():
    from rich.console import Console

    selected, results = _measured_causal()
    rows = targets.target_rows(selected, results)
    assert [(r["case"], r["target"]) for r in rows] == [("causal", "forward >= 1.0x sdpa cudnn"),
                                                        ("causal", "forward+backward >= 0.9x sdpa cudnn")]
    assert [(r[ATTNGEN]["status"], r[PORTABLE]["status"]) for r in rows] == [
        (targets.MET, targets.MISSED), (targets.MISSED, targets.NOT_MEASURED)]
    assert (rows[0][ATTNGEN]["family"], rows[0][PORTABLE]["family"]) == ("hopper", "portable")

    console = Console(file=io.StringIO(), width=240, record=True)
    console.print(targets.targets_table(rows, "Issue 13's targets [test]"))
    text = console.export_text()
    assert "Issue 13's targets [test]" in text  # the title taken as text, brackets and all
    first, second = (line for line in text.splitlines() if line.startswith("│ causal"))
    cells = [cell.strip() for cell in first.split("│")[1:-1]]
    assert cells[2:8] == ["1.050x", "met", "hopper", "0.750x", "missed", "portable"]
    assert "0.800x" in second and "not measured" in second
    assert "attngen portable on causal B4 H16 N4096 D128: backward failed" in second
    assert targets.tally(rows) == ["attngen: 1 of 2 targets met, 1 missed, 0 not measured",
                                   "attngen portable: 0 of 2 targets met, 1 missed, 1 not measured"]


def test_tally_leaves_out_ratios_shown_with_no_target_and_the_table_gives_a_shared_reason_once():
    from rich.console import Console

    rows = targets.target_rows([_case("softcap")], {})  # nothing measured: the forward target and a shown ratio
    assert [r[ATTNGEN]["status"] for r in rows] == [targets.NOT_MEASURED, targets.NOT_MEASURED]
    assert targets.tally(rows)[0] == "attngen: 0 of 1 targets met, 0 missed, 1 not measured"
    console = Console(file=io.StringIO(), width=240, record=True)
    console.print(targets.targets_table(rows, "t"))
    text = console.export_text()
    assert text.count("softcap B2 H16 N8192 D128 not run") == 2 and "attngen portable:" not in text


def test_families_of_a_two_measurement_target_are_named_where_they_differ():
    case = _case("softcap")
    softcap, plain = case.measurements
    results = {softcap.key: targets.Result(families={ATTNGEN: "portable"}),
               plain.key: targets.Result(families={ATTNGEN: "hopper"})}
    assert targets.families(case.targets[0], results, ATTNGEN) == "softcap: portable, plain: hopper"
    assert targets.families(case.targets[0], {}, ATTNGEN) == "-"


def test_raw_rows_name_the_family_after_each_attngen_build():
    _, results = _measured_causal()
    result, = results.values()
    assert [r["implementation"] for r in targets.raw_rows(result)] == [
        "attngen [hopper]", "attngen, tile tables prebuilt [hopper]", "attngen portable [portable]", CUDNN]


def test_format_ratio_keeps_three_decimals():
    assert [targets.format_ratio(r) for r in (0.9996, 0.996, 1.5, None)] == ["1.000x", "0.996x", "1.500x", "-"]


def test_json_document_round_trips_with_targets_and_times():
    selected, results = _measured_causal()
    plan = targets.measurements(selected)
    document = json.loads(json.dumps(targets.document({"gpu": "test"}, selected, plan, results)))
    assert document["info"] == {"gpu": "test"}
    assert [t[ATTNGEN]["status"] for t in document["targets"]] == [targets.MET, targets.MISSED]
    measured = document["measurements"]["causal B4 H16 N4096 D128"]
    assert measured["families"] == {ATTNGEN: "hopper", PORTABLE: "portable"}
    assert measured["problem"]["Q_LEN"] == 4096 and measured["spec"].endswith("specs/causal.attn")
