"""Hypothesis strategies over the whole language: random specs, shapes and inputs, and one case's check.

The strategies draw from the whole language, as users and attngen's own tests need them:

- `specs()`: well-typed random specs. Masks are `and`/`or`/`not` trees over affine atoms
  (windows, prefixes, chunks, `causal`), bit operations and data-dependent ones (document ids, block
  layouts, flags). Score expressions use every function and operator, over params and
  inputs of every dtype and dim form (B, H, HKV, Q_LEN, KV_LEN, a literal, `*`, a scalar),
  learnable ones included, and reductions of them over whole dims (`max(table[h, :])`). A spec sometimes has a `sink:` of the same functions over b, h, q,
  sizes, params and inputs, and a spec without a sink sometimes `normalize: sigmoid`. Each is drawn as text, so a failure shows a spec one can save
  and rerun; its IR prints back to equal text (`printer.to_source`).
- `cases()`: shapes and data, a `Case`. It covers B, H with a GQA ratio, and Q_LEN != KV_LEN,
  with lengths that are not tile multiples. Head dims need not be powers of two, and DV may
  differ from D. There is a dtype and a seed for q, k, v and the inputs (`tolerances.random_inputs`,
  whose lengths and prefixes reach 0, so some rows have no allowed key).
- `check_case(spec, fn, case)`: one case against the float64 reference, as every property uses it.

A `Case` prints as `B=1,H=2,...,seed=7`, the form `attngen check --case` reads back, so a
failure found anywhere is one command away from being rerun.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import torch
from hypothesis import strategies as st

from attngen import ir
from attngen.frontend import parse_spec
from attngen.testing import tolerances

DTYPES = {name: tolerances.TORCH_DTYPES[name] for name in ir.FLOAT_DTYPES}
# A case of dtype FP8 is an FP8 call (check_case): float8_e4m3fn q, k and v, drawn in f32 and rounded, with
# descale factors; a dense forward only (no cache call, no dropout).
FP8 = "fp8"
# Every dtype a case may have.
CASE_DTYPES = (*DTYPES, FP8)


# --- specs ---------------------------------------------------------------------------------------

# Every input a drawn spec may declare, with the mask atoms and score terms that read it.
INPUT_MENU: dict[str, tuple[str, list[str], list[str]]] = {
    "prefix": ("i32[B]", ["k < prefix[b]", "q < prefix[b] + w", "k * B < sum(prefix[:])"], []),
    "lens": ("i64[B]", ["k < lens[b]", "k < max(lens[:])"], ["lens[b] * 0.01", "mean(lens[:]) * 0.01"]),
    "flag": ("bool[B]", ["flag[b]", "min(flag[:])"], ["where(flag[b], score, -score)", "sum(flag[:]) * 0.1"]),
    "doc": ("i32[*]", ["doc[q] == doc[k]", "doc[k] <= doc[q]", "doc[k] < min(doc[:]) + 2"], []),
    "layout": ("bool[H, *, *]", ["layout[h, q // c, k // c]", "max(layout[h, :, k // c])"], []),
    "bias": ("f32[H]", [], ["bias[h]"]),
    "slopes": ("f32[HKV]", [], ["slopes[hkv] * (k - q) * 0.1"]),
    "qbias": ("f16[Q_LEN]", [], ["qbias[q]"]),
    "kbias": ("bf16[KV_LEN]", ["kbias[k] > -1.0"], ["kbias[k]"]),
    "table": ("f32[H, 17] learnable", [], ["table[h, clamp(q - k, -8, 8) + 8]", "max(table[h, :])",
                                           "mean(table[:, (q + k) % 17])"]),
    "gate": ("f32[] learnable", [], ["score * gate"]),
    "shift": ("f16[3] learnable", [], ["shift[(q + k) % 3]", "score * sum(shift[:])"]),
    # T5-style buckets: most tiles far from the diagonal read one entry (the Hopper family's point loads).
    "bucket": ("f32[H, 9] learnable", [], ["bucket[h, min(abs(q - k) // 16, 8)]", "min(bucket[h, :])"]),
}
AFFINE_ATOMS = ["causal", "causal_bottom_right", "q - k < w", "k - q <= w", "q // c == k // c",
                "k >= q - 2 * w", "q >= 3", "k < KV_LEN - 2", "h < 1", "(q + 1) // c >= k // c"]
OTHER_ATOMS = ["q % 3 != 1", "q * k < 200", "((q ^ k) & 3) != 1", "(q >> 2) >= (k >> 2)", "(q < 3) ^ (k > 5)",
               "~(q == k) | (k & 1 == 0)"]
# Integers past int32 at the drawn lengths (the kernels must widen them exactly as the reference does):
# a band with large coefficients, a fourth power, and products beyond 2**31.
INTEGER_ATOMS = ["q * 20000000 >= k * 20000000 - 3000000000", "(q - k) ** 4 < 60000 * w * w"]
INTEGER_LEAVES = ["(q - k) ** 4 * 1e-9", "(q * k * 40000) % 7 * 0.1", "(q + 3000000000) // 1000000000 * 0.5",
                  "((q << 30) ^ k) * 1e-9"]
# Values one off the interpreter's 16-wide tiles, where off-by-one errors in loop bounds show.
NEAR_TILES = [15, 16, 17, 31, 32, 33, 47, 48]
SCORE_LEAVES = ["score", "score * t", "(k - q) * 0.1", "(q - k) % 5 / 4", "(q + k) // 3 * 0.1", "t",
                "((q | k) & 7) * 0.1", "(~q >> 1) * 0.05"]
UNARY = ["tanh({})", "softcap({}, 2.0)", "sigmoid({})", "abs({})", "exp(-abs({}))", "exp2(tanh({}))",
         "log(1.0 + abs({}))", "log2(2.0 + abs({}))", "sqrt(1.0 + ({}) * ({}))", "rsqrt(1.0 + abs({}))",
         "({}) ** 2", "min({}, 1.0)", "max({}, -1.0)", "clamp({}, -2, 2)", "-({})", "floor({}) * 0.5",
         "ceil({}) * 0.5", "sin({})", "cos({})", "tan(tanh({}))", "atan({})", "erf({})", "sign({}) * 0.5",
         "round({}) * 0.5"]
# Comment text: anything but a line break (lone surrogates are left to tests/test_trust.py, since a
# failure report that holds one cannot be printed).
COMMENTS = st.text(st.characters(exclude_characters="\n", exclude_categories=["Cs"]), max_size=24) | \
    st.sampled_from(['"""; import os; os.system("touch pwned"); """', "C:\\xfiles \\N{DASH}", "-*- coding: rot13 -*-"])
# `sink:` terms: of b, h, hkv, q, sizes and params (never k or score), and of the inputs that may be drawn.
SINK_LEAVES = ["t", "0.5 * q - 1.0", "(h % 2) * 1.5", "1.0 * (Q_LEN - q) / (1 + KV_LEN)", "(b + hkv) * 0.25"]
SINK_TERMS: dict[str, list[str]] = {
    "lens": ["lens[b] * 0.1"], "flag": ["where(flag[b], 1.0, -1.0)"], "bias": ["bias[h] * 2.0"],
    "slopes": ["slopes[hkv]"], "qbias": ["qbias[q]"], "table": ["table[h, q % 17]", "max(table[h, :])"],
    "gate": ["gate * 3.0"],
    "shift": ["shift[q % 3]"], "bucket": ["bucket[h, min(q // 16, 8)]"],
}
assert SINK_TERMS.keys() <= INPUT_MENU.keys()
BINARY = ["({}) + ({})", "({}) - ({})", "({}) * ({})", "({}) / (1.0 + abs({}))",
          "where(q > k, {}, {})", "min({}, {})", "max({}, {})"]
SINK_BINARY = [b.replace("q > k", "q > h") for b in BINARY]


def _masks(atoms: list[str], depth: int) -> st.SearchStrategy[str]:
    leaf = st.sampled_from(atoms)
    if depth == 0:
        return leaf
    sub = _masks(atoms, depth - 1)
    return st.one_of(
        leaf, leaf,
        st.tuples(sub, sub, st.sampled_from(["and", "or"])).map(lambda x: f"({x[0]}) {x[2]} ({x[1]})"),
        sub.map(lambda x: f"not ({x})"))


def _scores(leaves: list[str], depth: int, binary: list[str] = BINARY) -> st.SearchStrategy[str]:
    leaf = st.sampled_from(leaves)
    if depth == 0:
        return leaf
    sub = _scores(leaves, depth - 1, binary)

    def unary(x):
        return x[0].replace("{}", x[1])

    return st.one_of(
        leaf,
        st.tuples(st.sampled_from(UNARY), sub).map(unary),
        st.tuples(st.sampled_from(binary), sub, sub).map(lambda x: x[0].format(x[1], x[2])))


@st.composite
def spec_texts(draw, max_depth: int = 3, with_mask: bool | None = None, with_score: bool | None = None,
               with_sink: bool | None = None, with_sigmoid: bool | None = None) -> str:
    """The source text of a random well-typed spec (`with_mask`, `with_score`, `with_sink`, `with_sigmoid`:
    always, never, or at random; a sink one time in four, and `normalize: sigmoid` one time in four of the
    specs without a sink, which needs softmax). Never drawing a sink or sigmoid draws nothing for them, so
    such specs are those the strategy drew before it had them."""
    if with_sink and with_sigmoid:
        raise ValueError("a sink needs softmax: with_sink and with_sigmoid cannot both be True")
    names = draw(st.lists(st.sampled_from(sorted(INPUT_MENU)), max_size=3, unique=True))
    lines = ["attention fuzzed",
             f"param w = {draw(st.one_of(st.integers(0, 12), st.sampled_from(NEAR_TILES)))}",
             f"param c = {draw(st.integers(1, 9))}",
             f"param t = {draw(st.sampled_from([0.5, -1.25, 2.0]))}"]
    lines += [f"input {name}: {INPUT_MENU[name][0]}" for name in names]
    atoms = AFFINE_ATOMS + OTHER_ATOMS + INTEGER_ATOMS + [a for n in names for a in INPUT_MENU[n][1]]
    leaves = SCORE_LEAVES + INTEGER_LEAVES + [s for n in names for s in INPUT_MENU[n][2]]
    if with_mask if with_mask is not None else draw(st.booleans()):
        lines.append(f"mask: {draw(_masks(atoms, draw(st.integers(0, max_depth))))}")
    if with_score if with_score is not None else draw(st.booleans()):
        lines.append(f"score: {draw(_scores(leaves, draw(st.integers(0, max_depth))))}")
    sink = with_sink if with_sink is not None else not with_sigmoid and draw(st.integers(0, 3)) == 0
    if sink:
        sink_leaves = SINK_LEAVES + [s for n in names for s in SINK_TERMS.get(n, [])]
        depth = draw(st.integers(0, min(max_depth, 2)))
        lines.append(f"sink: {draw(_scores(sink_leaves, depth, SINK_BINARY))}")
    elif with_sigmoid if with_sigmoid is not None else draw(st.integers(0, 3)) == 0:
        lines.append("normalize: sigmoid")
    if draw(st.integers(0, 4)) == 0:
        lines.append(f"scale: {draw(st.sampled_from(['0.25', 'rsqrt(D * 1.0) * t', '1.0 / D']))}")
    # Comments hold any text (quotes, backslashes, other line separators): it must never reach code.
    for i in draw(st.lists(st.integers(0, len(lines) - 1), max_size=2)):
        lines[i] += f"  # {draw(COMMENTS)}"
    return "\n".join(lines) + "\n"


def specs(max_depth: int = 3, with_mask: bool | None = None) -> st.SearchStrategy[ir.Spec]:
    """Random well-typed specs (parsed from `spec_texts`)."""
    return spec_texts(max_depth, with_mask).map(parse_spec)


# --- shapes and data -----------------------------------------------------------------------------

# How a case calls the kernels: a plain call, or a cache call (kv_len per row, q_offset) over a
# contiguous cache or a paged one (pages of 16 or 32 keys, shuffled).
CACHES = ("none", "contiguous", "paged16", "paged32")
# The fields a case may leave out, and their values then (the cases before them read as they did).
_CASE_DEFAULTS = {"cache": "none", "layout": "dense", "dropout": "0"}
# Dropout probabilities a plain call is drawn with, in percent (0: none, the most often).
DROPOUTS = (0, 0, 0, 15, 60)


@dataclass(frozen=True)
class Case:
    """One problem: sizes, dtype, the seed of q, k, v, dO, the inputs and a cache call's lengths and
    offsets, how the kernels are called (`cache`, one of CACHES; cache calls are forward only) and how
    q, k, v lie in memory (`layout`, one of tolerances.LAYOUTS) and the dropout probability of a plain call,
    in percent (`dropout`: 0 to 99; 0 without dropout)."""
    B: int
    H: int
    HKV: int
    Q_LEN: int
    KV_LEN: int
    D: int
    DV: int
    dtype: str
    seed: int
    cache: str = "none"
    layout: str = "dense"
    dropout: int = 0

    def __str__(self) -> str:
        # A plain call on dense tensors without dropout reads as before cache calls, layouts and dropout existed.
        return ",".join(f"{k}={v}" for k, v in asdict(self).items() if _CASE_DEFAULTS.get(k) != str(v))

    @classmethod
    def parse(cls, text: str) -> "Case":
        """The inverse of str(), as `example` below; a ValueError says what is wrong and shows it."""
        example = "B=1,H=2,HKV=1,Q_LEN=17,KV_LEN=5,D=24,DV=8,dtype=f32,seed=3"

        def wrong(why: str) -> ValueError:
            return ValueError(f"{why} (a case looks like {example})")
        items = [item for item in text.replace(" ", "").split(",") if item]
        for item in items:
            if "=" not in item:
                raise wrong(f"each item of a case must be NAME=VALUE, got {item!r}")
        values = dict(item.split("=", 1) for item in items)
        names = [f.name for f in fields(cls)]
        needed = [name for name in names if name not in _CASE_DEFAULTS]
        keys = [item.split("=", 1)[0] for item in items]
        if len(keys) != len(set(keys)) or not set(needed) <= set(keys) <= set(names):
            raise wrong(f"a case needs exactly {', '.join(needed)}, once each, and optionally "
                        f"{', '.join(_CASE_DEFAULTS)}; got {', '.join(keys) or 'nothing'}")
        values = {**_CASE_DEFAULTS, **values}
        for name in names:
            value, least = values[name], 0 if name in ("seed", "dropout") else 1
            choices = {"cache": CACHES, "layout": tolerances.LAYOUTS}.get(name)
            if choices is not None:
                if value not in choices:
                    raise wrong(f"{name} must be one of {', '.join(choices)}, got {value!r}")
                continue
            if name != "dtype" and not (value.isascii() and value.isdigit() and int(value) >= least):
                raise wrong(f"{name} must be an integer >= {least}, got {value!r}")
        case = cls(**{k: (v if k in ("dtype", "cache", "layout") else int(v)) for k, v in values.items()})
        if case.dropout > 99 or (case.dropout and case.cache != "none"):
            raise wrong(f"dropout must be a percentage from 0 to 99, and 0 in a cache call, got {case.dropout} "
                        f"with cache={case.cache}")
        if case.H % case.HKV:
            raise wrong(f"H must be a multiple of HKV, got H={case.H} and HKV={case.HKV}")
        if case.dtype not in CASE_DTYPES:
            raise wrong(f"dtype must be one of {', '.join(CASE_DTYPES)}, got {case.dtype!r}")
        if case.dtype == FP8 and (case.cache != "none" or case.dropout):
            raise wrong(f"an {FP8} case is a dense forward: cache=none and no dropout, got cache={case.cache} "
                        f"and dropout={case.dropout}")
        return case


@st.composite
def cases(draw, dtypes=("f32", "f16"), max_len: int = 48, max_head_dim: int = 40, caches=("none",),
          head_dims=None, min_len: int = 1, near_tiles=NEAR_TILES, layouts=tolerances.LAYOUTS,
          dropouts=DROPOUTS) -> Case:
    """Random shapes (GQA, Q_LEN != KV_LEN, odd lengths and head dims, DV != D), dtype, seed, a call
    from `caches` (plain calls twice as often as each cache layout, when both are allowed), a layout
    of q, k, v from `layouts` and a plain call's dropout percentage from `dropouts`.
    `head_dims`: the head dims to draw D and DV from (default 1 .. max_head_dim); lengths lie in
    [min_len, max_len], often at `near_tiles` (lengths at tile edges)."""
    hkv = draw(st.integers(1, 2))
    dims = st.sampled_from(list(head_dims)) if head_dims is not None else st.integers(1, max_head_dim)
    weighted = [c for c in caches for _ in range(2 if c == "none" else 1)]
    case = Case(B=draw(st.integers(1, 2)), H=hkv * draw(st.integers(1, 3)), HKV=hkv,
                Q_LEN=draw(_length(min_len, max_len, near_tiles)), KV_LEN=draw(_length(min_len, max_len, near_tiles)),
                D=draw(dims), DV=draw(dims),
                dtype=draw(st.sampled_from(list(dtypes))), seed=draw(st.integers(0, 2 ** 16)),
                cache=draw(st.sampled_from(weighted)), layout=draw(st.sampled_from(list(layouts))))
    if case.dtype == FP8:  # a dense forward
        return replace(case, cache="none")
    # Drawn last, so the fields above are drawn as they were before dropout; cache calls have none.
    return replace(case, dropout=draw(st.sampled_from(list(dropouts)))) if case.cache == "none" else case


def _length(min_len: int, max_len: int, near_tiles=NEAR_TILES) -> st.SearchStrategy[int]:
    near = [n for n in near_tiles if min_len <= n <= max_len]
    lengths = st.integers(min_len, max_len)
    return st.one_of(lengths, st.sampled_from(near)) if near else lengths


def case_data(spec: ir.Spec, case: Case, device: str = "cpu"):
    """q, k, v and the spec's inputs for a case, from its seed (inputs of any size, `*`, cover the
    query positions a cache case may draw: cache_data's offsets)."""
    dtype = torch.float32 if case.dtype == FP8 else DTYPES[case.dtype]
    q, k, v = tolerances.random_qkv(case.B, case.H, case.HKV, case.Q_LEN, case.KV_LEN, case.D, case.DV,
                                 dtype, device=device, seed=case.seed, layout=case.layout)
    if case.dtype == FP8:
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))  # in their layout
    positions = MAX_OFFSET_PER_KEY * case.KV_LEN + case.Q_LEN if case.cache != "none" else None
    inputs = tolerances.random_inputs(spec, case.B, case.H, case.HKV, case.Q_LEN, case.KV_LEN,
                                   device=device, seed=case.seed, query_positions=positions)
    return q, k, v, inputs


# Drawn query offsets reach this many times the cache's length (queries past every key included).
MAX_OFFSET_PER_KEY = 2


def cache_data(case: Case, device: str = "cpu") -> dict:
    """A cache case's kv_len (each row's, 0 .. KV_LEN) and q_offset (drawn, or left to its default
    kv_len - Q_LEN when every row has at least Q_LEN keys and the seed is even), from its seed."""
    g = torch.Generator().manual_seed(case.seed + 1)
    kv_len = torch.randint(0, case.KV_LEN + 1, (case.B,), generator=g, dtype=torch.int32)
    cache = {"kv_len": kv_len.to(device)}
    if case.seed % 2 or bool((kv_len < case.Q_LEN).any()):
        cache["q_offset"] = torch.randint(0, MAX_OFFSET_PER_KEY * case.KV_LEN + 1, (case.B,), generator=g,
                                          dtype=torch.int32).to(device)
    return cache


def paged(k: torch.Tensor, v: torch.Tensor, page_size: int, seed: int):
    """The contiguous cache k, v (B, HKV, KV_LEN, D) as shuffled pages (NUM_PAGES, PAGE_SIZE, HKV, D)
    with one spare page no row uses, and the page table (B, MAX_PAGES)."""
    B, HKV, n, _ = k.shape
    n_pages = -(-n // page_size)
    order = torch.randperm(B * n_pages + 1, generator=torch.Generator().manual_seed(seed))[:B * n_pages].to(k.device)

    def pages(x):
        x = torch.nn.functional.pad(x, (0, 0, 0, n_pages * page_size - n))
        x = x.view(B, HKV, n_pages, page_size, x.shape[-1]).permute(0, 2, 3, 1, 4)
        out = torch.zeros(B * n_pages + 1, page_size, HKV, x.shape[-1], dtype=x.dtype, device=x.device)
        out[order] = x.reshape(B * n_pages, page_size, HKV, x.shape[-1])
        return out
    return pages(k), pages(v), order.view(B, n_pages).to(torch.int32)


def check_case(spec: ir.Spec, fn, case: Case, device: str = "cpu") -> None:
    """Forward, LSE and every gradient of `fn` on one case, against the float64 reference (forward
    and LSE only for a cache call; the forward within its bound for an FP8 case, tolerances.check_fp8)."""
    __tracebackhide__ = True
    if case.dtype == FP8:
        tolerances.check_fp8(spec, fn, *case_data(spec, case, device), seed=case.seed)
        return
    if case.cache.startswith("paged"):
        # A paged cache holds whole pages: its length, the one inputs sized KV_LEN follow, is
        # MAX_PAGES * PAGE_SIZE; the rows' lengths stay within the case's KV_LEN.
        page_size = int(case.cache[5:])
        q, k, v, inputs = case_data(spec, replace(case, KV_LEN=-(-case.KV_LEN // page_size) * page_size), device)
    else:
        q, k, v, inputs = case_data(spec, case, device)
    if case.cache == "none":
        tolerances.check_against_reference(spec, fn, q, k, v, inputs, seed=case.seed, dropout_p=case.dropout / 100)
        return
    cache = cache_data(case, device)
    call = fn
    if case.cache.startswith("paged"):
        k_pages, v_pages, table = paged(k, v, page_size, case.seed)

        def call(q, k, v, **kwargs):
            return fn(q, k_pages, v_pages, page_table=table, **kwargs)
    tolerances.check_against_reference(spec, call, q, k, v, inputs, grads=False, seed=case.seed, cache=cache)
