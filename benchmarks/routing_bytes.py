"""Bytes the routing of one training step moves: per-site vs two-phase ("lookahead").

    python -m benchmarks.routing_bytes      # writes benchmarks/results/routing_bytes/analytic.json

Analytic, no GPU: full variant at the paper shapes (the paper's configurations, micro-batch x sequence
tokens), bf16 sources, one pipeline stage. Site j = 1 .. 2L+1 reads rows [0, j).

Per-site (mhar_kernels.depth_route history interface):
  forward   every site reads all its rows once, writes its output;
  backward  two passes over the rows (pass 1 for delta, pass 2 for the gradients), one
            read-modify-write of each row's fp32 gradient, grad_out read once.
Lookahead (mhar_kernels.lookahead), groups of G consecutive sites, the remainder first:
  forward   phase 1 reads the group's old rows [0, s0) once and writes the partials
            (acc [T, D] normalised in the rows' dtype, m and l [T, H] fp32) of the
            G - 1 sites after the first;
            the first site merges no rows, so phase 1 writes its output and log-sum-exp
            (the tensor-core kernel, where the kernels' rule picks it, writes its
            partial, which a merge of no rows reads);
            each other site reads its partial, its new rows [s0, j) and writes its
            output and log-sum-exp;
  backward  each site's merge reads grad_out and the output (delta), its new rows once,
            writes their gradients' factors (2H + 1 fp32 per token and row) and copies
            grad_out into the group's workspace; each new row's gradient is then formed
            once when due: its fp32 gradient read, per reading site that site's grad_out
            and factors read, the result written in the rows' dtype (the sublayer's
            gradient, no separate cast); phase 1 reads the old rows once,
            read-modify-writes their fp32 gradients once per group, and reads the G
            grad_outs, lse and delta. The last group's backward runs first: nothing
            has reached the fp32 gradients of its rows yet, so its phase 1 writes them
            without reading and its new rows read none.

``source_bytes`` counts the reads of history rows only (the quantity that is O(L^2) for
per-site routing); ``moved_bytes`` adds every other read and write listed above.
"""

import argparse
import math

import torch

from benchmarks.common import HEADS, check_out, default_out, step_cases, write_json
from megatron_mhar.ops.schedules import auto_group_size, group_ranges
from mhar_kernels.launch import dot_heads, use_tensor_cores

ES = 2  # bf16 activations
F32 = 4


def per_site(sites: int, t: int, d: int, h: int) -> dict:
    row, stat = t * d, t * h
    rows_read = sum(range(1, sites + 1))
    fwd_src = rows_read * row * ES
    bwd_src = 2 * rows_read * row * ES
    fwd = fwd_src + sites * (row * ES + stat * F32)
    bwd = bwd_src + rows_read * row * 2 * F32 + sites * (row * ES + stat * F32)
    return {
        "row_reads_fwd": rows_read, "row_reads_bwd": 2 * rows_read,
        "source_bytes_fwd": fwd_src, "source_bytes_bwd": bwd_src, "source_bytes_step": fwd_src + bwd_src,
        "moved_bytes_fwd": fwd, "moved_bytes_bwd": bwd, "moved_bytes_step": fwd + bwd,
        "saved_bytes": sites * stat * F32,
    }  # fmt: skip


def groups(sites: int, group: int):
    """(first site, number of sites) of each group, as the model forms them (remainder
    first); site j reads rows [0, j)."""
    return [(g.start, len(g)) for g in group_ranges(1, sites, group)]


def dots_forward(g: int, d: int, h: int) -> bool:
    """Whether a group of ``g`` sites runs the tensor-core phase-1 forward (the kernels'
    rule), which writes its first site's partial too (the row loop finishes that site)."""
    return use_tensor_cores("auto", g, dot_heads(d, h)[2], backward=False, dtype=torch.bfloat16)


def lookahead(sites: int, t: int, d: int, h: int, group: int) -> dict:
    row, stat = t * d, t * h
    old = new = 0
    fwd_other = bwd_other = 0
    last = groups(sites, group)[-1]
    for s0, g in groups(sites, group):
        first_in_backward = (s0, g) == last  # stores, does not read, the fp32 gradients
        merged = sum(range(g))  # site s0 + k merges k new rows
        old += s0
        new += merged
        # phase 1 writes (acc, m, l) per site but the first, whose out and lse it writes;
        # each other site's merge reads its partial, writes out and lse. The tensor-core
        # forward writes the first site's partial too, for a merge of no new rows.
        dots = dots_forward(g, d, h)
        partial, output = row * ES + 2 * stat * F32, row * ES + stat * F32  # acc / l in the rows' dtype
        fwd_other += (g if dots else g - 1) * (2 * partial + output) + (0 if dots else output)
        # merges: grad_out + out read, delta written, grad_out copied, each pair's factors
        # written; each new row: fp32 gradient read, per pair grad_out and factors read,
        # the gradient written in the rows' dtype.
        factors = (2 * stat + t) * F32
        bwd_other += g * (2 * row * ES + stat * F32 + 2 * row * ES + stat * F32) + merged * factors
        bwd_other += (g - 1) * row * ((0 if first_in_backward else F32) + ES) + merged * (row * ES + factors)
        # phase 1: fp32 RMW of the old rows, the G grad_outs, lse and delta read.
        bwd_other += s0 * row * (1 if first_in_backward else 2) * F32 + g * (row * ES + 2 * stat * F32)
    reads = old + new
    src = reads * row * ES
    # The largest group's partials.
    partials = max(g * (row * ES + 2 * stat * F32) for _, g in groups(sites, group))
    return {
        "group": group, "groups": len(groups(sites, group)),
        "row_reads_fwd": reads, "row_reads_bwd": reads, "row_reads_phase1": old, "row_reads_merge": new,
        "source_bytes_fwd": src, "source_bytes_bwd": src, "source_bytes_step": 2 * src,
        "moved_bytes_fwd": src + fwd_other, "moved_bytes_bwd": src + bwd_other,
        "moved_bytes_step": 2 * src + fwd_other + bwd_other,
        "saved_bytes": sites * stat * F32,
        "transient_partials_bytes": partials,
    }  # fmt: skip


def report() -> dict:
    out = {
        "note": __doc__.strip().splitlines()[0],
        "dtype": "bfloat16", "heads": HEADS, "variant": "full", "pipeline_stages": 1,
        "auto_group": "integer nearest sqrt(0.84 (2L + 1))", "models": [],
    }  # fmt: skip
    for case in step_cases():
        if case.variant != "full":
            continue
        name, layers, d, t = case.name, case.layers, case.d, case.t
        sites = 2 * layers + 1
        base = per_site(sites, t, d, HEADS)
        auto = auto_group_size(sites)
        la = lookahead(sites, t, d, HEADS, auto)
        sweep = {}
        for g in sorted({1, 2, 4, 8, 16, round(math.sqrt(sites)), auto}):
            r = lookahead(sites, t, d, HEADS, g)
            sweep[str(g)] = {k: r[k] for k in ("source_bytes_step", "moved_bytes_step", "transient_partials_bytes")}
        out["models"].append({
            "model": name, "layers": layers, "d": d, "tokens": t, "sites": sites,
            "per_site": base, "lookahead": la,
            "source_bytes_ratio_step": base["source_bytes_step"] / la["source_bytes_step"],
            "moved_bytes_ratio_step": base["moved_bytes_step"] / la["moved_bytes_step"],
            "group_sweep": sweep,
        })  # fmt: skip
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=default_out("routing_bytes", "analytic"),
                        help="JSON report (default: %(default)s)")
    args = parser.parse_args()
    check_out(parser, args.out)
    data = report()
    write_json(args.out, data)
    gb = 1e9
    print(f"{'model':5s} {'G':>2s} {'src GB/step per-site':>21s} {'lookahead':>9s} {'x':>5s} "
          f"{'moved GB per-site':>17s} {'lookahead':>9s} {'x':>5s}")  # fmt: skip
    for m in data["models"]:
        p, la = m["per_site"], m["lookahead"]
        print(f"{m['model']:5s} {la['group']:2d} {p['source_bytes_step'] / gb:21.2f} "
              f"{la['source_bytes_step'] / gb:9.2f} {m['source_bytes_ratio_step']:5.2f} "
              f"{p['moved_bytes_step'] / gb:17.2f} {la['moved_bytes_step'] / gb:9.2f} "
              f"{m['moved_bytes_ratio_step']:5.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
