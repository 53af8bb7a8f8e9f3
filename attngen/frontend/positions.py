"""Global positions for a piece of a sequence: the spec a shard's call runs, whose q, k, Q_LEN and KV_LEN are those
of the whole sequence, read from four scalar inputs, so the piece means what it means in the whole call.

Context parallelism splits a sequence over processes, and each process attends a block of queries (positions
q0 .. q0 + m - 1 of the whole sequence) to a block of keys (k0 .. k0 + n - 1). `shifted(spec)` derives the spec
that block's call runs: every `q` reads `q + q_start`, every `k` reads `k + k_start`, `Q_LEN` and `KV_LEN` read
the whole sequence's lengths, the four given as i32[] inputs; inputs declared with a Q_LEN or KV_LEN dim are
passed whole (the whole sequence's), so they are declared `*`. Nothing else changes (`b`, `h`, `hkv`, B, H,
HKV, D, params, scale), and the kernels are the ordinary ones, so a mask affine in q and k stays affine (its
tile bounds closed-form, the starts uniform constants of the bounds, as `prefix[b]` is), and a mask that reads
inputs at q or k follows tile tables built from the whole inputs.

Ints stay exact as everywhere: each start is read as `clamp(start, 0, max_start)` and each length as
`clamp(length, 1, max_length)`, so the interval analysis bounds the derived spec's ints, and the kernels and the
reference compute the same clamped values for any input. A caller passes starts and lengths within those
ranges (then the clamps change nothing): `attngen.distributed` checks them.
"""

from __future__ import annotations

from dataclasses import dataclass

from attngen import intervals, ir


@dataclass(frozen=True)
class Shifted:
    """A spec with global positions (`shifted`): `spec` reads the block's first query and key positions from
    the inputs named `q_start` and `k_start` and the whole sequence's lengths from `q_len` and `kv_len` (each
    an i32[] tensor); starts must lie in [0, max_start] and lengths in [1, max_length], the original spec's
    length limit."""
    spec: ir.Spec
    q_start: str
    k_start: str
    q_len: str
    kv_len: str
    max_start: int
    max_length: int

    @property
    def names(self) -> tuple[str, str, str, str]:
        return self.q_start, self.k_start, self.q_len, self.kv_len


def _fresh(base: str, taken: set[str]) -> str:
    """`base`, or `base` with a number, unused by the spec (its params, inputs) and by the language."""
    name, n = base, 0
    while name in taken or ir.name_problem(name) is not None:
        n += 1
        name = f"{base}{n}"
    taken.add(name)
    return name


def _int_const(value: int) -> ir.Const:
    return ir.Const(type="int", value=value)


def _clamped(name: str, lo: int, hi: int) -> ir.Expr:
    return ir.Call(type="int", fn="clamp", args=(ir.Load(type="int", input=name, index=()), _int_const(lo),
                                                 _int_const(hi)))


def _derive(spec: ir.Spec, names: tuple[str, str, str, str], max_start: int, max_length: int) -> ir.Spec:
    q_start, k_start, q_len, kv_len = names
    replacements = {
        ("var", "q"): ir.Binary(type="int", op="add", left=ir.Var(name="q"), right=_clamped(q_start, 0, max_start)),
        ("var", "k"): ir.Binary(type="int", op="add", left=ir.Var(name="k"), right=_clamped(k_start, 0, max_start)),
        ("size", "Q_LEN"): _clamped(q_len, 1, max_length),
        ("size", "KV_LEN"): _clamped(kv_len, 1, max_length),
    }

    def replace(node: ir.Expr) -> ir.Expr | None:
        if isinstance(node, (ir.Var, ir.Size)):
            return replacements.get((node.kind, node.name))
        return None

    inputs = [decl.model_copy(update={"dims": tuple("*" if d in ("Q_LEN", "KV_LEN") else d for d in decl.dims)})
              for decl in spec.inputs]
    inputs += [ir.InputDecl(name=name, dtype="i32", dims=()) for name in names]
    items = {item: ir.rewrite(getattr(spec, item), replace) for item in ("mask", "score", "sink")}
    name = f"{spec.name[:ir.MAX_NAME_LENGTH - 3]}_cp"
    # Validated anew (model_copy skips it): the derived spec is checked as any Spec built in Python is.
    return ir.Spec.model_validate({**spec.model_dump(), "name": name,
                                   "inputs": [i.model_dump() for i in inputs],
                                   **{item: (e.model_dump() if e is not None else None) for item, e in items.items()}})


def shifted(spec: ir.Spec) -> Shifted:
    """The spec of a block of a sequence at given global positions (the module's docstring says how).

    Starts are clamped to [0, max_start]: to the original spec's length limit when the derived spec's ints
    then still fit as far as the original's do (every spec whose ints are exact at every length), else to half
    of it, so that a block's positions (start + row) stay within the original's exact range."""
    original = spec
    limit, _ = intervals.length_limit(original)
    taken = {p.name for p in spec.params} | {i.name for i in spec.inputs}
    names = tuple(_fresh(base, taken) for base in ("q_start_", "k_start_", "q_len_", "kv_len_"))
    derived = _derive(original, names, max(limit - 1, 0), limit)
    if intervals.length_limit(derived)[0] < limit:
        derived = _derive(original, names, limit // 2, limit)
        max_start = limit // 2
    else:
        max_start = max(limit - 1, 0)
    return Shifted(derived, *names, max_start=max_start, max_length=limit)


def without_sink(spec: ir.Spec) -> ir.Spec:
    """`spec` with no `sink:` item: the spec of a part of a row's keys, whose sink the caller adds to the row once."""
    return ir.Spec.model_validate({**spec.model_dump(), "sink": None})


__all__ = ["Shifted", "shifted", "without_sink"]
