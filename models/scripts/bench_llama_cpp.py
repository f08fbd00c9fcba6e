#!/usr/bin/env python3
"""llama.cpp (llama-cpp-python, CPU build) on the SmolLM2 GGUF: prompt and decode speed,
measured like `llama_decode` measures ours, plus tokenizer / greedy-output cross-checks.

    pip install llama-cpp-python          # builds llama.cpp from source (CPU)
    python models/scripts/bench_llama_cpp.py [--gguf PATH] [--threads 2] [--tokens 128]

Speed: the prompt (ChatML-rendered, as `llama_decode` renders it) is evaluated in one
batch (prompt tokens/s = prompt tokens / time to the first sampled token); then greedy
decoding runs `--tokens` steps, ignoring end-of-generation (decode tokens/s = steps /
time). `--check-tokenizer FILE` also compares llama.cpp's tokenization of FILE with the
token ids given in `--ids` (one per line), e.g. from our tokenizer.json.
"""

import argparse
import os
import time
from pathlib import Path

from llama_cpp import Llama

DEFAULT_GGUF = Path.home() / ".cache/candle-fp4/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(user):
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=str(DEFAULT_GGUF))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--check-tokenizer", default=None)
    ap.add_argument("--ids", default=None)
    a = ap.parse_args()
    llm = Llama(model_path=a.gguf, n_ctx=2048, n_batch=512, n_threads=a.threads,
                n_threads_batch=a.threads, verbose=False)
    toks = llm.tokenize(chatml(a.prompt).encode(), add_bos=False, special=True)
    print(f"llama.cpp: {a.gguf}, {a.threads} threads, prompt {len(toks)} tokens")
    for r in range(a.repeat):
        llm.reset()  # no prompt-prefix reuse between runs
        gen = llm.generate(toks, temp=0.0, top_k=1, reset=True)
        t0 = time.perf_counter()
        out = [next(gen)]
        t1 = time.perf_counter()
        for tok in gen:
            out.append(tok)
            if len(out) > a.tokens - 1:
                break
        t2 = time.perf_counter()
        steps = len(out) - 1
        print(f"run {r + 1}: prompt: {len(toks)} tokens, {len(toks) / (t1 - t0):.1f} tokens/s | "
              f"decode: {steps} tokens, {steps / (t2 - t1):.1f} tokens/s")
    text = llm.detokenize(out).decode(errors="replace")
    print("greedy output:", repr(text[:400]))
    if a.check_tokenizer:
        ours = [int(x) for x in Path(a.ids).read_text().split()]
        theirs = llm.tokenize(Path(a.check_tokenizer).read_bytes(), add_bos=False, special=False)
        same = ours == theirs
        first = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), None)
        print(f"tokenizer check: ours {len(ours)} tokens, llama.cpp {len(theirs)}, identical: {same}"
              + ("" if same else f", first difference at {first}"))


if __name__ == "__main__":
    main()
