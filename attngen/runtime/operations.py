"""What each operator and function of the language computes on torch tensors: one table the runtime's host
evaluations (sinks.py) and the float64 reference (attngen.reference) both read, so the two cannot differ."""

import torch


def _integral(rounding):
    # floor, ceil and round of a float are ints in the language (ir.FUNCTIONS); of an int, the int itself.
    return lambda x: rounding(x).long() if x.is_floating_point() else x


UNARY = {"not": torch.logical_not, "neg": torch.neg, "invert": torch.bitwise_not}

BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow,
    # Python's floor semantics, also for negative operands: -7 // 2 == -4, -7 % 2 == 1
    "floordiv": lambda a, b: torch.div(a, b, rounding_mode="floor"), "mod": torch.remainder,
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
    "and": torch.logical_and, "or": torch.logical_or,
    # On int64, with counts in 0 .. 63 (checked at compile time), these are Python's: `>>` floors.
    "bitand": torch.bitwise_and, "bitor": torch.bitwise_or, "bitxor": torch.bitwise_xor,
    "lshift": torch.bitwise_left_shift, "rshift": torch.bitwise_right_shift,
}

# Every function but `where`, which the evaluators take apart (its condition is not promoted).
FUNCTIONS = {
    "tanh": torch.tanh, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log2": torch.log2,
    "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "sigmoid": torch.sigmoid, "abs": torch.abs,
    # round: the nearest int, ties to even, as Python's round() and torch.round.
    "floor": _integral(torch.floor), "ceil": _integral(torch.ceil), "round": _integral(torch.round),
    "min": torch.minimum, "max": torch.maximum,
    "clamp": lambda x, lo, hi: torch.minimum(torch.maximum(x, lo), hi),
    "softcap": lambda x, cap: cap * torch.tanh(x / cap),
    "sin": torch.sin, "cos": torch.cos, "tan": torch.tan, "atan": torch.atan, "erf": torch.erf,
    "sign": torch.sign,
}
