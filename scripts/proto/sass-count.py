#!/usr/bin/env python3
"""Opcode histogram of a kernel's SASS (cuobjdump -sass output on stdin), whole function
and its longest backward-branch loop (the main loop), for the instruction budget."""
import re
import sys
from collections import Counter

ins = []  # (address, opcode, text)
for line in sys.stdin:
    m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", line)
    if m:
        ins.append((int(m.group(1), 16), m.group(3), m.group(4)))
best = None
for i, (a, op, rest) in enumerate(ins):
    if op.startswith("BRA"):
        t = re.search(r"0x([0-9a-f]+)", rest)
        if t and int(t.group(1), 16) < a:
            lo = int(t.group(1), 16)
            if best is None or a - lo > best[1] - best[0]:
                best = (lo, a)
def hist(sel):
    c = Counter(op.split(".")[0] for _, op, _ in sel)
    return len(sel), " ".join(f"{k} {v}" for k, v in c.most_common(16))
n, h = hist(ins)
print(f"function: {n} instructions: {h}")
if best:
    n, h = hist([x for x in ins if best[0] <= x[0] <= best[1]])
    print(f"main loop 0x{best[0]:x}..0x{best[1]:x}: {n} instructions: {h}")
