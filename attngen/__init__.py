"""attngen: compile attention variants written in a small language into fused Triton kernels."""

import os as _os

from attngen.version import __version__


def _interpret_without_gpu() -> None:
    # Triton picks compiled or interpreted kernels when it is first imported, so a machine
    # with no CUDA GPU must ask for the interpreter before anything imports triton.
    if "TRITON_INTERPRET" not in _os.environ:
        import torch

        if not torch.cuda.is_available():
            _os.environ["TRITON_INTERPRET"] = "1"


_interpret_without_gpu()

from attngen.api import Attention, build, compile_source, load_spec, parse_spec  # noqa: E402
from attngen.errors import ArgumentError, SpecError  # noqa: E402
from attngen.flex import to_flex  # noqa: E402
from attngen.ir import Spec  # noqa: E402
from attngen.merge import merge  # noqa: E402

__all__ = ["Attention", "ArgumentError", "Spec", "SpecError", "build", "compile_source", "merge",
           "load_spec", "parse_spec", "to_flex", "__version__"]
