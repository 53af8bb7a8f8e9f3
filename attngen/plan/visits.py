"""Chooses how the kernels find the tiles a mask allows: closed-form ranges, a static tile table or one built in every call.

Every choice here visits exactly the tiles with an allowed pair and runs mask code exactly on the partial
ones; they differ in what that costs a call:

- closed form (`CLOSED`): each program computes its tile range from the analysis' bounds, a few int64
  operations; nothing else. Chosen whenever the analysis proves the ranges exact (analysis.spans,
  "exactness"): then nothing is cheaper.
- static table (`STATIC`): the mask reads no input, so its tiles depend only on the call's sizes. The
  tables (per kernel's tiles) are built by two small launches on the first call with those sizes and kept
  by the runtime, as FlexAttention's BlockMask is built once; a later call pays one dictionary lookup
  (`STATIC_LOOKUP_US` of host time) and each program one int32 load per visited tile, issued while the tile
  before it computes.
- table per call (`CALL`): the mask reads inputs whose values may change from call to call without the
  runtime seeing it (`.data` writes, views from numpy), so a table is built in every call: two launches per
  distinct kernel tiling (`TABLE_LAUNCH_US` of host time each, plus a classify kernel over every tile),
  unless the caller builds them once with attn.tile_tables() and passes them.
- the closed-form hull, where it is not exact, is never chosen: it visits every tile between a row's first
  and last allowed key and runs mask code on full tiles it cannot prove full, and for the masks it cannot
  bound (a band with global rows and columns, `%`, bit tests, a band's union) those wasted tiles grow with
  N^2, while a static table's cost does not grow at all and a per-call table's grows with the number of
  tiles it classifies, a tile's worth of mask evaluation each, never a tile's two matrix products.
"""

from __future__ import annotations

from typing import Literal

from attngen.analysis import Analysis

CLOSED, STATIC, CALL = "closed form", "static table", "table per call"
Visits = Literal["closed form", "static table", "table per call"]
# The model's host costs, estimates in microseconds, not measurements: a dictionary lookup in Python; one
# launch of a small kernel through Triton's launcher. `attngen bench` measures a table per call: its
# "attngen" row builds the tables, its "attngen, tile tables prebuilt" row does not.
STATIC_LOOKUP_US = 1
TABLE_LAUNCH_US = 5


def choose(facts: Analysis) -> tuple[Visits, str]:
    """(CLOSED, STATIC or CALL, why) for an analysed spec."""
    if not facts.tile_table:
        return CLOSED, ("the analysis proves the closed-form tile ranges exact for every tile size and length, "
                        "so the kernels compute them and follow no table")
    if not facts.table_reads:
        keyed = ", ".join(facts.table_sizes)
        return STATIC, (f"the closed-form ranges are not exact for this mask and it reads no input: its tiles depend "
                        f"only on {keyed}, so a table per tiling is built on the first call of those sizes and kept "
                        f"(~{STATIC_LOOKUP_US} us of host time a call after that), where a hull would visit empty "
                        f"tiles and mask full ones")
    return CALL, (f"the closed-form ranges are not exact for this mask and it reads {', '.join(facts.table_reads)}, "
                  f"whose values may change between calls: a table is built in every call (2 launches, "
                  f"~{2 * TABLE_LAUNCH_US} us, per kernel tiling), or once by attn.tile_tables() for inputs "
                  f"that stay fixed")
