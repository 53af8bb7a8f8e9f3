"""Testing attention kernels against the float64 reference: data-derived tolerances, hypothesis strategies, the fuzzer.

The strategies are public, for tests of your own:

    from hypothesis import given
    from attngen import testing

    @given(spec=testing.specs(), case=testing.cases())
    def test_my_compiler_change(spec, case):
        testing.check_case(spec, attngen.build(spec), case)
"""

from attngen.testing.strategies import Case, cases, check_case, spec_texts, specs
from attngen.testing.tolerances import (DEFAULT_FACTOR, FLOOR_ULPS, FP32_EPS, TORCH_DTYPES, ReferenceRun,
                                        assert_matches_reference, check_against_reference, default_floor,
                                        output_error_effect, random_inputs, random_qkv, reference_error,
                                        summation_scales)

__all__ = ["DEFAULT_FACTOR", "FLOOR_ULPS", "FP32_EPS", "TORCH_DTYPES", "ReferenceRun", "assert_matches_reference",
           "check_against_reference", "default_floor", "output_error_effect", "random_inputs", "random_qkv",
           "reference_error", "summation_scales",
           # hypothesis strategies and one case's check (attngen.testing.strategies)
           "Case", "cases", "check_case", "spec_texts", "specs"]
