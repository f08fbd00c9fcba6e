#!/usr/bin/env python3
"""Searches the E2M1 raw-bits decode family that works on the natural nibble order of an
UltraQuant slot word (kernels/nvfp4_decode.cuh `e2m1_raw_pairs`): out = ((q >> s) & I) * K & M,
for s in {0, 4, 8, 12, 16}, every nibble-subset isolation mask I, every two-term multiplier
K = 2^a + 2^b, and every output pair (nibble u -> low bf16, nibble v -> high bf16) with
M = 0x81c081c0 (sign at bit 15, e1 e0 m at bits 8..6 of each half). Prints, per (s, I) that
decodes at least one pair exactly on 3,000 random words and the edge patterns, the pairs it
decodes. The question it answers (docs/benchmarks.md, thirtieth session): can one isolation
feed two output pairs? (No: every (s, I) decodes exactly one pair.) Runs ~4 minutes."""
import random

random.seed(1)
M = 0x81C081C0


def target(q, u, v):
    def half(n):
        return ((n >> 3) & 1) << 15 | (n & 7) << 6

    return half((q >> (4 * u)) & 0xF) | half((q >> (4 * v)) & 0xF) << 16


samples = [random.getrandbits(32) for _ in range(3000)]
samples += [0xFFFFFFFF, 0, 0x88888888, 0x77777777]
for s in [0, 4, 8, 12, 16]:
    for im in range(1, 256):
        iso = sum(0xF << (4 * j) for j in range(8) if im >> j & 1)
        ys = [(q >> s) & iso for q in samples]
        pairs = set()
        for a in range(32):
            for b in range(a + 1, 32):
                k = (1 << a) | (1 << b)
                outs = [(y * k) & M for y in ys]
                for u in range(8):
                    for v in range(8):
                        if u != v and all(o == target(q, u, v) for o, q in zip(outs, samples)):
                            pairs.add((u, v))
        if pairs:
            nib = [j for j in range(8) if im >> j & 1]
            print(f"q >> {s:2}, nibbles {nib}: pairs {sorted(pairs)}")
