#!/usr/bin/env python3
"""Cross-check of `perplexity` with Hugging Face transformers (fp32, eager attention).

    python models/scripts/hf_perplexity.py MODEL_DIR [--text FILE] [--ctx 512] [--max-windows N]

MODEL_DIR is a BF16 Hugging Face Llama folder, or one of our NVFP4 (ModelOpt) folders:
NVFP4 weights are dequantized as ModelOpt does, e2m1 * (f32(e4m3 scale) * weight_scale_2),
i.e. W4A16 semantics. Tokenization uses the folder's tokenizer.json (the `tokenizers`
package), as plain text without special tokens, windows as in the Rust tool.
Needs torch, transformers, safetensors, tokenizers (e.g. the ModelOpt venv of
scripts/modelopt/make_tiny_checkpoint.py).
"""

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def dequantize(sd):
    out = {}
    for name, t in sd.items():
        if name.endswith(("weight_scale", "weight_scale_2", "input_scale")):
            continue
        p = name[: -len(".weight")]
        if t.dtype == torch.uint8 and f"{p}.weight_scale" in sd:
            codes = torch.stack([t & 0xF, t >> 4], dim=-1).reshape(t.shape[0], -1).long()
            s = sd[f"{p}.weight_scale"].float().repeat_interleave(16, dim=1)
            out[name] = E2M1[codes] * (s * sd[f"{p}.weight_scale_2"].float())
        else:
            out[name] = t.float()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--text", default=str(Path(__file__).resolve().parents[2] / "tests/data/text/alice_ch1-3.txt"))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=None)
    a = ap.parse_args()
    d = Path(a.model)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float().eval()
    sd = dequantize(load_file(str(d / "model.safetensors")))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert all(m == "lm_head.weight" for m in missing), missing
    model.tie_weights()
    model.config._attn_implementation = "eager"
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    ids = tok.encode(Path(a.text).read_text(), add_special_tokens=True).ids
    n = len(ids) // a.ctx
    if a.max_windows:
        n = min(n, a.max_windows)
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(n):
            w = torch.tensor([ids[i * a.ctx : (i + 1) * a.ctx]])
            logits = model(w).logits[0, :-1].float()
            lp = torch.log_softmax(logits, dim=-1)
            nll -= lp.gather(1, w[0, 1:, None]).sum().item()
            count += a.ctx - 1
            print(f"window {i + 1}/{n}: running perplexity {math.exp(nll / count):.4f}", flush=True)
    print(f"perplexity {math.exp(nll / count):.4f} over {count} scored tokens ({n} windows of {a.ctx}) | {d}")


if __name__ == "__main__":
    main()
