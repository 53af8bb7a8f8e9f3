"""The reductions of a spec's inputs over whole dims (`sum(x[b, :])`), computed in torch before the kernels
read them as inputs of their own: one function the runtime and the reference share."""

import torch


def reduce_input(x, op, dims, name="x"):
    """`x` reduced by `op` ("sum", "max", "min" or "mean") over its dims `dims`, the others kept in order.
    Ints and bools sum exactly in int64; max and min of bools are any and all; a mean is float (x's dtype
    if x is float, else float32); max and min pass their gradient to the first extreme of every row, as
    torch.max(dim) does. Max, min and mean of no elements raise ValueError, naming the input `name`."""
    kept = [d for d in range(x.dim()) if d not in dims]
    rows = x.permute(*kept, *dims).reshape(*(x.shape[d] for d in kept), -1) if dims else x.unsqueeze(-1)
    if rows.shape[-1] == 0 and op != "sum":
        raise ValueError(f"{op}() over dims {tuple(dims)} of input '{name}' must have at least one element to "
                         f"reduce, got shape {tuple(x.shape)}")
    if op == "sum":
        return rows.sum(-1) if x.is_floating_point() else rows.sum(-1, dtype=torch.int64)
    if op == "mean":
        return (rows if x.is_floating_point() else rows.float()).mean(-1)
    if x.dtype == torch.bool:
        return rows.any(-1) if op == "max" else rows.all(-1)
    return (rows.max(-1) if op == "max" else rows.min(-1)).values


def reduced_inputs(reductions, inputs, float_dtype=torch.float32):
    """The tensors the kernels read for a spec's reductions, by name: `reductions` are (name, op, source,
    dims) as a module declares them (FACTS.reductions), `inputs` the call's tensors by name; float results
    in `float_dtype` (float inputs are reduced in it)."""
    derived = {}
    for name, op, source, dims in reductions:
        x = inputs[source]
        reduced = reduce_input(x.to(float_dtype) if x.is_floating_point() else x, op, tuple(dims), source)
        derived[name] = reduced.to(float_dtype) if reduced.is_floating_point() else reduced
    return derived
