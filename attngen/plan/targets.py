"""The device a plan is made for: the live GPU read from the driver, or a named preset."""

from __future__ import annotations

import torch
import triton
from pydantic import BaseModel, ConfigDict


class Target(BaseModel):
    """The limits of one kind of device that the planner sizes tiles against.

    `smem_per_block` is the opt-in maximum of shared memory one block may use, in bytes;
    `capability` is None for Triton's CPU interpreter, which has no real limits.
    """
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    capability: tuple[int, int] | None
    sm_count: int
    smem_per_block: int
    registers_per_sm: int
    interpreter: bool = False


# The interpreter runs on the CPU: its "shared memory" is host memory.
_UNLIMITED = 1 << 30

PRESETS: dict[str, Target] = {
    "a100": Target(name="a100", capability=(8, 0), sm_count=108, smem_per_block=166912,
                   registers_per_sm=65536),
    "h100": Target(name="h100", capability=(9, 0), sm_count=132, smem_per_block=232448,
                   registers_per_sm=65536),
    "h200": Target(name="h200", capability=(9, 0), sm_count=132, smem_per_block=232448,
                   registers_per_sm=65536),
    "interpreter": Target(name="interpreter", capability=None, sm_count=1,
                          smem_per_block=_UNLIMITED, registers_per_sm=_UNLIMITED, interpreter=True),
}


def _preset_for(capability: tuple[int, int]) -> Target | None:
    return next((t for t in PRESETS.values() if t.capability == capability), None)


def _smem_per_block(device: int, capability: tuple[int, int], props) -> int:
    # The driver's opt-in limit is the number that matters: kernels ask for it at launch.
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(device)["max_shared_mem"])
    except Exception:
        pass
    preset = _preset_for(capability)
    if preset is not None:
        return preset.smem_per_block
    # Every CUDA device since Kepler offers 48 KiB per block without opting in.
    return int(getattr(props, "shared_memory_per_block_optin", 49152))


def detect_target() -> Target:
    """The current GPU's limits, or the interpreter target when there is no GPU or TRITON_INTERPRET is set."""
    if triton.knobs.runtime.interpret or not torch.cuda.is_available():
        return PRESETS["interpreter"]
    device = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(device)
    capability = (props.major, props.minor)
    return Target(
        name=props.name,
        capability=capability,
        sm_count=props.multi_processor_count,
        smem_per_block=_smem_per_block(device, capability, props),
        registers_per_sm=int(getattr(props, "regs_per_multiprocessor", 65536)),
    )


def get_target(name: str | None) -> Target:
    """A preset by case-insensitive name, or the live device when `name` is None."""
    if name is None:
        return detect_target()
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"target must be one of {', '.join(PRESETS)}, got {name!r}") from None
