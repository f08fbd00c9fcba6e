#!/usr/bin/env python3
"""Summarise an ncu --csv --page raw trace of one decode step (gpu__time_duration.sum per
kernel): total kernel time, and time and count per kernel family (name up to '<' or '(')."""
import csv, re, sys
from collections import defaultdict

rows = []
with open(sys.argv[1], newline="") as f:
    lines = [l for l in f if l.startswith('"')]
rd = csv.DictReader(lines)
for r in rd:
    try:
        us = float(r["gpu__time_duration.sum"].replace(",", "")) / 1e3  # ns -> us
    except (KeyError, ValueError):
        continue  # the units row
    rows.append((r["Kernel Name"], us))
fam = defaultdict(lambda: [0, 0.0])
for name, us in rows:
    k = re.split(r"[<(]", name)[0].strip()
    fam[k][0] += 1
    fam[k][1] += us
total = sum(us for _, us in rows)
print(f"kernels {len(rows)}  kernel time {total:.1f} us")
print(f"{'kernel':<48} {'count':>6} {'total us':>9} {'mean us':>8}")
for k, (n, us) in sorted(fam.items(), key=lambda kv: -kv[1][1]):
    print(f"{k[:48]:<48} {n:>6} {us:>9.1f} {us / n:>8.2f}")
