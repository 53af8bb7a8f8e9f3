"""Attention sinks on the host: a spec's `sink:` logit of every query row, evaluated in torch for the forward kernels."""

import torch

from .operations import BINARY, FUNCTIONS, UNARY

# A sink arrives as FACTS.sink, a literal tree the emitter writes from the spec's IR
# (attngen.emit.module.sink_literal), each node a tuple:
#   ("const", type, value)  ("var", name)  ("size", name)  ("load", input, type, (index, ...))
#   ("unary", op, type, operand)  ("binary", op, type, left, right)  ("call", fn, type, (arg, ...))
# with params already replaced by their values. It is data, not code: this module gives it the meaning
# attngen.reference gives the IR (test_sinks checks that they agree), in float32 as the kernels compute.

# The functions whose arguments are floats whatever they are given (ir.FUNCTIONS' "float" rule).
_FLOAT_FUNCTIONS = frozenset({"tanh", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sigmoid", "sin", "cos", "tan",
                              "atan", "erf", "softcap"})
_INPUT_DTYPES = {"float": torch.float32, "int": torch.int64, "bool": torch.bool}


def _float(x):
    return x.to(torch.float32)


def _promote(*xs):
    if any(x.is_floating_point() for x in xs):
        return [_float(x) for x in xs]
    return list(xs)


def _evaluate(node, values, inputs, device):
    kind = node[0]
    if kind == "const":
        _, type_, value = node
        return torch.full((), float(value) if type_ == "float" else value, dtype=_INPUT_DTYPES[type_], device=device)
    if kind in ("var", "size"):
        return values[node[1]]
    if kind == "load":
        _, name, type_, index = node
        x = inputs[name]
        if _whole_dims(index, x.shape, values.whole):
            # Each index runs once over the whole of its dim, along an axis of the rows of its own (`sinks[h]` of
            # an (H,) input): the load is the input itself laid along those axes, with no bounds to check and
            # no gather (launches are most of a sink's cost).
            axes = [values.whole[i[1]][0] for i in index]
            shape = [1] * 4
            for axis, size in zip(axes, x.shape):
                shape[axis] = size
            return x.permute(sorted(range(len(axes)), key=axes.__getitem__)).reshape(shape).to(_INPUT_DTYPES[type_])
        indices = [_evaluate(i, values, inputs, device) for i in index]
        if indices:
            # Out-of-range indices read 0, as the kernels' masked loads do (never another entry).
            indices = torch.broadcast_tensors(*indices)
            inside = torch.ones_like(indices[0], dtype=torch.bool)
            for i, size in zip(indices, x.shape):
                inside = inside & (i >= 0) & (i < size)
            clamped = [i.clamp(0, size - 1) for i, size in zip(indices, x.shape)]
            x = torch.where(inside, x[tuple(clamped)], 0)
        return x.to(_INPUT_DTYPES[type_])
    if kind == "unary":
        _, op, _, operand = node
        x = _evaluate(operand, values, inputs, device)
        return UNARY[op](x)
    if kind == "binary":
        _, op, type_, left, right = node
        a, b = _evaluate(left, values, inputs, device), _evaluate(right, values, inputs, device)
        if op == "div" or (op == "pow" and type_ == "float"):
            a, b = _float(a), _float(b)
        return BINARY[op](*_promote(a, b))
    assert kind == "call", node
    _, fn, _, args = node
    args = [_evaluate(a, values, inputs, device) for a in args]
    if fn == "where":
        return torch.where(args[0], *_promote(*args[1:]))
    if fn in _FLOAT_FUNCTIONS:
        args = [_float(a) for a in args]
    return FUNCTIONS[fn](*_promote(*args))


# The row axes a whole load may be read along: an input dim declared B indexed by b, or H by h.
_ROW_AXES = {"b": "B", "h": "H"}


def whole_load(tree, inputs):
    """(input, index names) where a sink is one input read at b and h alone, each indexing a dim declared as
    its size (`sinks[h]` of an f32[H] input, `bias[b, h]` of f32[B, H]); None for any other sink. Such a sink's
    rows are the input itself, viewed (sink_view): no evaluation and no copy per call."""
    if tree[0] != "load" or not tree[3]:
        return None
    _, name, type_, index = tree
    names = tuple(i[1] if i[0] == "var" else None for i in index)
    dims = inputs[name][1]
    if (type_ != "float" or len(set(names)) != len(names) or len(dims) != len(names)
            or any(_ROW_AXES.get(n) != dim for n, dim in zip(names, dims))):
        return None
    return name, names


def sink_view(x, names, B, H, rows):
    """The (B, H, rows) sink rows of a whole_load sink: input x (checked: its dims are its declared sizes)
    along the axes its `names` index, fp32, expanded over the others with no copy; the kernels read its
    strides (0 along an expanded axis), and its gradient is the rows' gradient summed back by autograd."""
    if x.dtype != torch.float32:
        x = x.float()
    if names == ("h", "b"):
        x = x.t()
    # One view and one expansion (a view of a dense input; reshape copies one in other strides).
    return x.reshape(B if "b" in names else 1, H if "h" in names else 1, 1).expand(B, H, rows)


def sink_rows(tree, inputs, *, B, H, HKV, Q_LEN, KV_LEN, D, device, b=None, q=None, q_offset=None, kv_len=None):
    """The sink of every query row of a call, fp32, shaped as its `q` positions broadcast with (B, H).

    By default the (B, H, Q_LEN) rows of a training call. A cache call gives `q_offset` and `kv_len`
    ((B,) ints: row i of batch b sits at position q_offset[b] + i, KV_LEN is kv_len[b]). A packed call
    gives `b` and `q` itself, (TOTAL_Q,) ints (each token's sequence and its position in it), and
    Q_LEN and KV_LEN as (TOTAL_Q,) tensors of that sequence's lengths: the result is then (H, TOTAL_Q).
    The rows may be an expansion (stride 0 where they do not vary): the kernels read them by their strides.
    """
    # Only the names the sink reads are made (_Values), each a device tensor made by a kernel (torch.full,
    # arange), never copied from the host: a call stays capturable in a CUDA graph and costs few launches.
    def scalar(n):
        return torch.full((), n, dtype=torch.int64, device=device)

    def per_row(t):
        return t.to(device=device, dtype=torch.int64).view(B, 1, 1, 1)

    def heads():
        return torch.arange(H, device=device).view(1, H, 1, 1)

    if b is not None:  # a packed call: one axis of tokens after the heads
        def token(t):
            return t.to(device=device, dtype=torch.int64).view(1, 1, -1, 1)
        makers = {"b": lambda: token(b), "q": lambda: token(q), "Q_OFFSET": lambda: scalar(0),
                  "Q_LEN": lambda: token(Q_LEN), "KV_LEN": lambda: token(KV_LEN)}
        shape = (1, H, b.shape[0])
        whole = {"h": (1, H)}
    else:
        def offset():
            return per_row(q_offset) if q_offset is not None else scalar(0)
        makers = {"b": lambda: torch.arange(B, device=device).view(B, 1, 1, 1),
                  "q": lambda: torch.arange(Q_LEN, device=device).view(1, 1, Q_LEN, 1) + offset(),
                  "Q_OFFSET": offset, "Q_LEN": lambda: scalar(Q_LEN),
                  "KV_LEN": lambda: per_row(kv_len) if kv_len is not None else scalar(KV_LEN)}
        shape = (B, H, Q_LEN)
        whole = {"b": (0, B), "h": (1, H)} | ({"q": (2, Q_LEN)} if q_offset is None else {})
    makers |= {"h": heads, "hkv": lambda: heads() // (H // HKV), "B": lambda: scalar(B), "H": lambda: scalar(H),
               "HKV": lambda: scalar(HKV), "D": lambda: scalar(D)}
    # Broadcast onto the rows (a sink of constants alone is one 0-dim tensor), with no copy.
    sink = _float(_evaluate(tree, _Values(makers, whole), inputs, device)).expand(*shape, 1)[..., 0]
    return sink[0] if b is not None else sink


class _Values(dict):
    """The index variables and sizes of a call's rows, each made on its first use by `makers`; `whole`, those
    that are aranges over a whole axis of the rows: name -> (axis, extent)."""

    def __init__(self, makers, whole):
        super().__init__()
        self.makers, self.whole = makers, whole

    def __missing__(self, name):
        value = self[name] = self.makers[name]()
        return value


def _whole_dims(index, shape, whole):
    """Whether every index of a load is a distinct variable of `whole` whose extent is its dim's size."""
    return (bool(index) and len({i[1] for i in index if i[0] == "var"}) == len(index)
            and all(i[0] == "var" and i[1] in whole and whole[i[1]][1] == size for i, size in zip(index, shape)))

