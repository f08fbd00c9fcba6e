#!/usr/bin/env python3
"""Quantize a BF16 Hugging Face Llama folder with NVIDIA ModelOpt (W4A16_NVFP4_CFG) and
export it, to compare with our quantizer's output byte for byte:

    python models/scripts/modelopt_export_w4a16.py BF16_DIR OUT_DIR
    cmp OUT_DIR/model.safetensors OUR_NVFP4_DIR/model.safetensors

Environment: the ModelOpt venv of scripts/modelopt/make_tiny_checkpoint.py (torch 2.11,
transformers 5.14.1, nvidia-modelopt 0.47.0), CPU only. W4A16 weight quantization does
not depend on the calibration data (no activation scales); the loop only runs the model.
"""

import sys

import modelopt.torch.quantization as mtq
import torch
from modelopt.torch.export import export_hf_checkpoint
from transformers import LlamaForCausalLM

src, out = sys.argv[1], sys.argv[2]
model = LlamaForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))


def loop(m):
    with torch.no_grad():
        for i in range(ids.shape[0]):
            m(ids[i : i + 1])


mtq.quantize(model, mtq.W4A16_NVFP4_CFG, loop)
export_hf_checkpoint(model, export_dir=out)
print("exported", out)
