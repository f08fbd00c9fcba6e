#!/usr/bin/env python3
"""Fits the BF16-weight (BW) GEMV's launch-geometry rule to bgemv_bench's M = 1 sweep.

    python3 scripts/proto/fit-bw-rule.py LOG [LOG ...]

Each LOG is a bgemv_bench log (spacer or back to back); its "  sweep SHAPE m=1 VARIANT:
wW/sS us ..." lines give every (variant, warps, split) time. For a family of candidate
rules (`bw_geometry`: the fewest one-wave warps with `target` bytes in flight per SM, the
deep kernel from warp runs of `deep_run` steps, the pair and staged kernels where their
rules say, or never) it prints each rule's worst and mean ratio of its pick's time to the best time among
the kernels the library compiles (plain u2/u4, pair u2, silu u2, staged u2/u4), summed over
the logs, best rules first, and the picks of the best one.
"""
import itertools
import math
import re
import sys

SMS = 132
# CTAs per SM by warps of the BW kernels (ptxas: 124-128 registers: 16 warps per SM).
OCC = {w: 16 // w for w in range(2, 9)}
COMPILED = {"plain_u2", "plain_u4", "pair_u2", "silu_u2", "staged_u2", "staged_u4"}
SHAPES = {  # name -> (n, k, silu)
    "8B q|k|v": (6144, 4096, False),
    "8B o": (4096, 4096, False),
    "8B gate|up": (28672, 4096, True),
    "8B down": (4096, 14336, False),
    "70B q|k|v": (10240, 8192, False),
    "70B o": (8192, 8192, False),
    "70B gate|up": (57344, 8192, True),
    "70B down": (8192, 28672, False),
}


def parse(path):
    data = {}
    for line in open(path):
        m = re.match(r"\s+sweep (.+?) m=1 ([a-z]+ u\d+):(.*)", line)
        if not m or m.group(1) not in SHAPES:
            continue
        shape, var = m.group(1), m.group(2).replace(" ", "_")
        for w, s, us in re.findall(r"w(\d+)/s(\d+) (-?[\d.]+)", m.group(3)):
            data.setdefault(shape, {})[(var, int(w), int(s))] = float(us)
    return data


def geometry(groups, steps, step_bytes, u, target):
    """bw_geometry (src/gemv/packed/geometry.rs): the fewest one-wave warps with `target`
    bytes in flight per SM."""
    inflight = lambda w: groups * w * u * step_bytes // SMS
    one = [w for w in (2, 3, 4, 5, 6, 8) if groups <= SMS * OCC[w]]
    for w in one:
        if inflight(w) >= target:
            return w, 1
    return (max(one, key=inflight) if one else 2), 1


def pick(shape, target, deep_run, pair_ok, stage_ok):
    n, k, silu = SHAPES[shape]
    steps, tiles = k // 64, math.ceil(n / 16)
    if silu:
        kind, groups = "silu", math.ceil(n // 2 / 16)
    elif pair_ok and 2 * tiles >= 7 * SMS:
        kind, groups = "pair", math.ceil(tiles / 2)
    else:
        kind, groups = "plain", tiles
    step_bytes = (1 if kind == "plain" else 2) * 16 * 64 * 2
    us = [u for u in (4, 2) if f"{kind}_u{u}" in COMPILED]
    for u in us:
        w, s = geometry(groups, steps, step_bytes, u, target)
        if u == us[-1] or steps / (w * s) >= max(deep_run, u):
            break
    if kind == "plain" and stage_ok and groups * s <= 2 * SMS and f"staged_u{u}" in COMPILED:
        kind = "staged"
    return (f"{kind}_u{u}", w, s)


def main():
    logs = [parse(p) for p in sys.argv[1:]]
    rules = []
    for target, deep, pair_ok, stage_ok in itertools.product(
        [kb * 1024 for kb in (16, 24, 32, 40, 48, 56, 64, 80, 96)],
        (8, 16, 24, 32, 48, 64, 96, 128, 10**9), (True, False), (True, False)
    ):
        rule = (target, deep, pair_ok, stage_ok)
        ratios = []
        for data in logs:
            for shape, t in data.items():
                best = min(v for key, v in t.items() if key[0] in COMPILED)
                got = t.get(pick(shape, *rule))
                ratios.append(got / best if got else 9.9)
        rules.append((max(ratios), sum(ratios) / len(ratios), rule))
    rules.sort()
    for worst, mean, rule in rules[:15]:
        print(f"worst {worst:.3f} mean {mean:.4f}  target={rule[0] // 1024} KiB deep_run={rule[1]} pair={rule[2]} staged={rule[3]}")
    rule = rules[0][2]
    for i, data in enumerate(logs):
        print(f"-- {sys.argv[1 + i]}")
        for shape, t in data.items():
            best_key = min((key for key in t if key[0] in COMPILED), key=t.get)
            p = pick(shape, *rule)
            print(f"{shape:12} pick {p} {t.get(p, float('nan')):.2f}  best {best_key} {t[best_key]:.2f}")


if __name__ == "__main__":
    main()
