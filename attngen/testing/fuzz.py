"""`attngen check`'s runner: fuzz one spec's kernels over random cases and report the smallest failure."""

from __future__ import annotations

from dataclasses import dataclass

from attngen import ir
from attngen.errors import IndexOutOfRange
from attngen.testing.strategies import DROPOUTS, Case, cases, check_case

@dataclass(frozen=True)
class Failure:
    """The smallest failing case hypothesis found, and what went wrong on it."""
    case: Case
    error: BaseException


@dataclass
class FuzzReport:
    """How a fuzzing run went: the failure (None if none), and the cases skipped because the spec
    indexes an input out of range at their sizes (with one example of why)."""
    failure: Failure | None = None
    skipped: int = 0
    skip_reason: str = ""


def fuzz_spec(spec: ir.Spec, fn, *, examples: int, device: str, dtypes, seed: int | None = None,
              on_example=None, caches=("none",), dropouts=DROPOUTS) -> FuzzReport:
    """Fuzz one spec's kernels (`fn`) over random cases.

    A case whose sizes make the spec index an input out of range (`doc[q]` with a KV_LEN-sized doc
    and Q_LEN > KV_LEN) is outside what the spec defines: it is skipped and counted, not failed.
    Hypothesis shrinks a failure to the smallest case it can and runs it once more at the end,
    so the last failure recorded is the one to report. `caches`: the calls to try (strategies.CACHES);
    `dropouts`: the dropout percentages plain calls are drawn with (those above 0 need `fn.dropout_mask`).
    """
    from hypothesis import HealthCheck, Phase, given, reject, settings
    from hypothesis import seed as with_seed

    failures: list[Failure] = []
    report = FuzzReport()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is None,
              suppress_health_check=list(HealthCheck), print_blob=False, report_multiple_bugs=False,
              phases=[Phase.explicit, Phase.generate, Phase.shrink])
    @given(case=cases(dtypes=tuple(dtypes), caches=tuple(caches), dropouts=tuple(dropouts)))
    def run(case: Case) -> None:
        if on_example is not None:
            on_example(case)
        try:
            check_case(spec, fn, case, device)
        except IndexOutOfRange as e:
            report.skipped += 1
            report.skip_reason = report.skip_reason or str(e)
            reject()
        except Exception as e:  # any other exception is a failure of the spec's kernels on this case
            failures.append(Failure(case, e))
            raise

    if seed is not None:
        run = with_seed(seed)(run)
    try:
        run()
    except Exception:
        if not failures:
            raise
        report.failure = failures[-1]
    return report
