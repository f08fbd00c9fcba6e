#!/usr/bin/env python3
"""Make a tiny random Llama checkpoint and export it with NVIDIA ModelOpt (NVFP4).

Writes, relative to the repository root:

  tests/data/modelopt_tiny/
      original.safetensors   BF16 weights exactly as fed to ModelOpt (HF names)
      model.safetensors      ModelOpt export, mtq.NVFP4_DEFAULT_CFG (W4A4)
      config.json, hf_quant_config.json, generation_config.json (as exported)
      README.md              generated: versions, command, tensor listing, checks
  tests/data/modelopt_tiny_w4a16/   (unless --no-w4a16)
      config.json, hf_quant_config.json, generation_config.json
      tensors.txt            listing of the W4A16 export's tensors
      (its model.safetensors is NOT committed, to stay under the size budget:
       the script checks that every tensor in it is bit-identical to the
       NVFP4 export's tensor of the same name, and that it only lacks the
       `input_scale` tensors; pass --keep-w4a16-weights to write it anyway)

Runs on CPU.  Deterministic given --seed (default 0).

Environment (PyPI only; torch from PyPI pulls its CUDA wheels, which is fine:
it still runs on CPU):

    python3 -m venv /root/.cache/modelopt-venv
    . /root/.cache/modelopt-venv/bin/activate
    pip install torch==2.11.0
    pip install "transformers<5.15" nvidia-modelopt==0.47.0 requests safetensors accelerate
    python scripts/modelopt/make_tiny_checkpoint.py

Versions used for the committed fixture: see tests/data/modelopt_tiny/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]

# Model shape: awkward on purpose; K is a multiple of 64 for every quantized Linear.
MODEL_CFG = dict(
    hidden_size=192,
    intermediate_size=320,
    num_hidden_layers=2,
    num_attention_heads=3,  # head_dim 64
    num_key_value_heads=1,
    head_dim=64,
    vocab_size=256,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

SPECIAL_LAYER = "model.layers.0.mlp.down_proj.weight"  # [N=192, K=320] -> 20 blocks/row
# (row, block) positions of the planted special cases, all in SPECIAL_LAYER.
ZERO_BLOCK = (5, 3)  # whole 16-block exactly 0 -> ModelOpt scale 1.0 (E4M3 0x38)
TINY_BLOCK = (7, 0)  # values ~1e-6: scale below 2^-9 -> clamped to 2^-9 (E4M3 0x01)
SUBNORMAL_BLOCK = (9, 1)  # amax chosen so the E4M3 scale is the subnormal 5 * 2^-9 (0x05)
OUTLIER = (11, 100, -0.75)  # (row, col, value): drives amax / weight_scale_2
CALIB = dict(n_seq=4, seq_len=32)
REF_LEN = 12  # tokens in the reference-logits sequence

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def build_model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**MODEL_CFG)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                # RMSNorm gains: around 1, not exactly 1, so they matter in a test.
                v = 1.0 + 0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float32)
            else:
                v = 0.02 * torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(v.to(torch.bfloat16))

        w = dict(model.named_parameters())[SPECIAL_LAYER]
        r, c, val = OUTLIER
        w[r, c] = val
        ws2 = torch.tensor(abs(val), dtype=torch.bfloat16).float() / (6.0 * 448.0)
        r, b = ZERO_BLOCK
        w[r, 16 * b : 16 * b + 16] = 0.0
        r, b = TINY_BLOCK
        w[r, 16 * b : 16 * b + 16] = (
            1e-6 * torch.linspace(-1.0, 1.0, 16, dtype=torch.float32)
        ).to(torch.bfloat16)
        r, b = SUBNORMAL_BLOCK
        # scale = amax / (6 * ws2) should be 5 * 2^-9 exactly in E4M3 (subnormal 0x05)
        target_amax = 5 * 2.0**-9 * 6.0 * float(ws2)
        v = torch.randn(16, generator=gen, dtype=torch.float32)
        v = v / v.abs().max() * target_amax
        w[r, 16 * b : 16 * b + 16] = v.to(torch.bfloat16)
    return model


def calib_batches(seed: int):
    gen = torch.Generator().manual_seed(seed + 1)
    return [
        torch.randint(0, MODEL_CFG["vocab_size"], (1, CALIB["seq_len"]), generator=gen)
        for _ in range(CALIB["n_seq"])
    ]


def load_bf16(path: Path):
    from transformers import LlamaForCausalLM

    try:
        m = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    except TypeError:  # older transformers
        m = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
    return m.eval()


def quantize_and_export(src: Path, cfg_name: str, out: Path, seed: int):
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    model = load_bf16(src)
    batches = calib_batches(seed)

    def forward_loop(m):
        with torch.no_grad():
            for ids in batches:
                m(input_ids=ids)

    mtq.quantize(model, getattr(mtq, cfg_name), forward_loop)
    if out.exists():
        shutil.rmtree(out)
    export_hf_checkpoint(model, export_dir=out)
    return model


def st_listing(path: Path):
    """[(name, dtype string as safetensors reports it, shape)] from the file header."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        hdr = json.loads(f.read(n))
    meta = hdr.pop("__metadata__", None)
    return [(k, v["dtype"], v["shape"]) for k, v in sorted(hdr.items())], meta


def fmt_listing(rows):
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{n:<{w}}  {d:<8} {s}" for n, d, s in rows)


def e4m3_to_f32(u8: np.ndarray) -> np.ndarray:
    """Independent E4M3FN decode (bias 7, subnormals, 0x7F/0xFF NaN)."""
    u = u8.astype(np.int32)
    s = np.where(u & 0x80, -1.0, 1.0)
    e = (u >> 3) & 0xF
    m = u & 0x7
    val = np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * 2.0 ** (e - 7))
    val = np.where((u & 0x7F) == 0x7F, np.nan, val)
    return (s * val).astype(np.float32)


def checks(orig_path: Path, exp_dir: Path):
    """Verify the export against an independent numpy decode and ModelOpt's own dequantize.

    Returns a list of markdown lines."""
    from safetensors import safe_open
    from safetensors.numpy import load_file as np_load  # noqa: F401  (F8 not in numpy)
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    lines = []
    exp = {}
    with safe_open(exp_dir / "model.safetensors", "pt") as f:
        for k in f.keys():
            exp[k] = f.get_tensor(k)
    orig = {}
    with safe_open(orig_path, "pt") as f:
        for k in f.keys():
            orig[k] = f.get_tensor(k)

    qnames = sorted(k[: -len(".weight_scale")] for k in exp if k.endswith(".weight_scale"))
    n_order_diff = 0
    n_total = 0
    max_rel = 0.0
    all_match_mo = True
    all_match_requant = True
    for q in qnames:
        wq = exp[q + ".weight"]
        sc = exp[q + ".weight_scale"]
        s2 = exp[q + ".weight_scale_2"]
        assert wq.dtype == torch.uint8 and sc.dtype == torch.float8_e4m3fn
        assert s2.dtype == torch.float32 and s2.dim() == 0
        N, Kh = wq.shape
        K = 2 * Kh
        assert tuple(sc.shape) == (N, K // 16), (q, sc.shape)
        # numpy decode, our order: e2m1 * (f32(scale) * ws2), all fp32
        codes = wq.numpy()
        lo, hi = codes & 0xF, codes >> 4
        c = np.empty((N, K), np.uint8)
        c[:, 0::2], c[:, 1::2] = lo, hi
        e = E2M1[c]
        s_f32 = e4m3_to_f32(sc.view(torch.uint8).numpy())
        assert np.array_equal(s_f32, sc.float().numpy()), "E4M3 decode mismatch vs torch"
        g = np.float32(s2.item())
        bs = (s_f32 * g).astype(np.float32)  # fp32 product
        ours = (e.reshape(N, K // 16, 16) * bs[:, :, None]).reshape(N, K)
        other = ((e.reshape(N, K // 16, 16) * s_f32[:, :, None]) * g).reshape(N, K)
        n_order_diff += int((ours != other).sum())
        n_total += ours.size
        # ModelOpt's own dequantization
        qt = NVFP4QTensor(torch.Size([N, K]), torch.float32, wq)
        mo = qt.dequantize(dtype=torch.float32, scale=sc, double_scale=s2, block_sizes={-1: 16})
        if not np.array_equal(mo.numpy(), ours):
            all_match_mo = False
        # Re-quantize the original BF16 weight with ModelOpt's quantize using the
        # exported global scale: must reproduce codes and block scales bit for bit.
        w0 = orig[q + ".weight"]
        qt2, sc2, _ = NVFP4QTensor.quantize(w0, 16, weights_scaling_factor_2=s2)
        if not (
            torch.equal(qt2._quantized_data, wq)
            and torch.equal(sc2.view(torch.uint8), sc.view(torch.uint8))
        ):
            all_match_requant = False
        rel = (np.abs(ours - w0.float().numpy()).max() / np.abs(w0.float().numpy()).max())
        max_rel = max(max_rel, float(rel))
    lines.append(
        f"- numpy decode `e2m1(code) * (f32(e4m3 scale) * weight_scale_2)` (fp32) equals "
        f"ModelOpt's `NVFP4QTensor.dequantize(dtype=float32)` bit for bit on all "
        f"{len(qnames)} quantized Linears: **{all_match_mo}**."
    )
    lines.append(
        f"- The other order `(e2m1 * scale) * weight_scale_2` differs in the last fp32 bit for "
        f"{n_order_diff} of {n_total} elements ({100.0 * n_order_diff / n_total:.2f}%)."
    )
    lines.append(
        f"- `NVFP4QTensor.quantize(original_bf16_weight, 16, weights_scaling_factor_2=exported "
        f"weight_scale_2)` reproduces the exported `weight` bytes and `weight_scale` bytes exactly "
        f"for every Linear: **{all_match_requant}**."
    )
    lines.append(
        f"- Max |dequantized - original| / max|original| over the Linears: {max_rel:.4f}."
    )

    # The planted cases
    d = SPECIAL_LAYER[: -len(".weight")]
    sc_u8 = exp[d + ".weight_scale"].view(torch.uint8).numpy()
    s2 = float(exp[d + ".weight_scale_2"].item())
    r, c, val = OUTLIER
    bf = float(torch.tensor(val, dtype=torch.bfloat16).float())
    lines.append(
        f"- Planted cases in `{SPECIAL_LAYER}` [192, 320]: "
        f"outlier {val} at (row {r}, col {c}) -> `weight_scale_2` = {s2!r} "
        f"(= {abs(bf)}/(6*448) = {np.float32(abs(bf)) / np.float32(2688.0)!r}; "
        f"its block scale byte 0x{sc_u8[r, c // 16]:02X}); "
        f"zero block (row {ZERO_BLOCK[0]}, block {ZERO_BLOCK[1]}) -> scale byte "
        f"0x{sc_u8[ZERO_BLOCK]:02X}; tiny ~1e-6 block (row {TINY_BLOCK[0]}, block {TINY_BLOCK[1]}) "
        f"-> scale byte 0x{sc_u8[TINY_BLOCK]:02X}; subnormal block (row {SUBNORMAL_BLOCK[0]}, "
        f"block {SUBNORMAL_BLOCK[1]}) -> scale byte 0x{sc_u8[SUBNORMAL_BLOCK]:02X}."
    )
    return lines


def reference_logits(src: Path, exp_dir: Path, out_path: Path, seed: int):
    """fp32 eager forward of the HF model on a fixed sequence, with (a) the original BF16
    weights and (b) every quantized Linear weight replaced by its exact fp32 dequantization
    `e2m1 * (f32(weight_scale) * weight_scale_2)` (W4A16 semantics). Returns markdown lines."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed + 2)
    ids = torch.randint(0, MODEL_CFG["vocab_size"], (1, REF_LEN), generator=gen)
    with torch.no_grad():
        l0 = m(input_ids=ids).logits[0].float().clone()
        params = dict(m.named_parameters())
        e2m1 = torch.tensor(E2M1)
        with safe_open(exp_dir / "model.safetensors", "pt") as f:
            for k in f.keys():
                if not k.endswith(".weight_scale"):
                    continue
                q = k[: -len(".weight_scale")]
                wq = f.get_tensor(q + ".weight")
                sc = f.get_tensor(q + ".weight_scale").float()
                s2 = f.get_tensor(q + ".weight_scale_2").float()
                N, K = wq.shape[0], wq.shape[1] * 2
                c = torch.empty(N, K, dtype=torch.long)
                c[:, 0::2] = (wq & 0xF).long()
                c[:, 1::2] = (wq >> 4).long()
                w = (e2m1[c].view(N, K // 16, 16) * (sc * s2).unsqueeze(-1)).view(N, K)
                params[q + ".weight"].copy_(w)
        l1 = m(input_ids=ids).logits[0].float().clone()
    save_file(
        {"input_ids": ids.contiguous(), "logits_original": l0.contiguous(), "logits_w4a16_dequant": l1.contiguous()},
        out_path,
        metadata={"note": "fp32 eager HF LlamaForCausalLM forward; see README.md"},
    )
    agree = (l0.argmax(-1) == l1.argmax(-1)).float().mean().item()
    return [
        f"- `reference_logits.safetensors`: `input_ids` I64 [1, {REF_LEN}] (seeded), "
        f"`logits_original` F32 [{REF_LEN}, 256] (HF fp32 eager forward with the BF16 weights of "
        "`original.safetensors` upcast), `logits_w4a16_dequant` F32 (same forward with every "
        "quantized Linear weight replaced by its fp32 dequantization from `model.safetensors`; "
        "activations not quantized, i.e. W4A16 semantics). "
        f"max |diff| between the two = {(l0 - l1).abs().max().item():.4f}, "
        f"argmax agreement {agree:.3f}.",
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "data")
    ap.add_argument("--no-w4a16", action="store_true")
    ap.add_argument("--keep-w4a16-weights", action="store_true")
    args = ap.parse_args()

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    torch.use_deterministic_algorithms(True)
    out = args.out / "modelopt_tiny"
    out_w = args.out / "modelopt_tiny_w4a16"

    import importlib.metadata as md

    versions = {
        p: md.version(p)
        for p in ["torch", "transformers", "nvidia-modelopt", "safetensors", "numpy", "accelerate"]
    }
    print("versions:", versions)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = tmp / "bf16"
        built = build_model(args.seed)
        built.save_pretrained(src)
        reloaded = load_bf16(src)
        sd_built = built.state_dict()
        sd = {k: v.detach().contiguous().clone() for k, v in reloaded.state_dict().items()}
        assert set(sd) == set(sd_built), (set(sd) ^ set(sd_built))
        for k in sd:
            assert sd[k].dtype == torch.bfloat16 and torch.equal(sd[k], sd_built[k]), k

        # 1. NVFP4 (W4A4) export
        exp_tmp = tmp / "nvfp4"
        quantize_and_export(src, "NVFP4_DEFAULT_CFG", exp_tmp, args.seed)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        from safetensors.torch import save_file

        save_file(dict(sorted(sd.items())), out / "original.safetensors", metadata={"format": "pt"})
        exported = sorted(p.name for p in exp_tmp.iterdir())
        print("exported files:", exported)
        for name in exported:
            if name.endswith(".safetensors") or name.endswith(".json"):
                if "tokenizer" in name or name == "special_tokens_map.json":
                    continue
                shutil.copy(exp_tmp / name, out / name)

        # 2. W4A16 export
        w4a16_lines = []
        if not args.no_w4a16:
            w_tmp = tmp / "w4a16"
            quantize_and_export(src, "W4A16_NVFP4_CFG", w_tmp, args.seed)
            if out_w.exists():
                shutil.rmtree(out_w)
            out_w.mkdir(parents=True)
            for name in sorted(p.name for p in w_tmp.iterdir()):
                if name.endswith(".json") and "tokenizer" not in name:
                    shutil.copy(w_tmp / name, out_w / name)
            if args.keep_w4a16_weights:
                shutil.copy(w_tmp / "model.safetensors", out_w / "model.safetensors")
            rows_w, meta_w = st_listing(w_tmp / "model.safetensors")
            (out_w / "tensors.txt").write_text(
                f"# tensors of the W4A16_NVFP4_CFG export's model.safetensors "
                f"(metadata {json.dumps(meta_w)})\n" + fmt_listing(rows_w) + "\n"
            )
            from safetensors import safe_open

            with safe_open(w_tmp / "model.safetensors", "pt") as fw, safe_open(
                out / "model.safetensors", "pt"
            ) as fn:
                kw, kn = set(fw.keys()), set(fn.keys())
                only_n = sorted(kn - kw)
                only_w = sorted(kw - kn)
                diff = [
                    k
                    for k in sorted(kw & kn)
                    if not torch.equal(
                        fw.get_tensor(k).view(torch.uint8)
                        if fw.get_tensor(k).dtype == torch.float8_e4m3fn
                        else fw.get_tensor(k),
                        fn.get_tensor(k).view(torch.uint8)
                        if fn.get_tensor(k).dtype == torch.float8_e4m3fn
                        else fn.get_tensor(k),
                    )
                ]
            w4a16_lines = [
                f"- Tensors only in the NVFP4 (W4A4) export: {len(only_n)} "
                f"({', '.join(sorted(set(k.rsplit('.', 1)[-1] for k in only_n))) or '-'}).",
                f"- Tensors only in the W4A16 export: {len(only_w)}.",
                f"- Common tensors that differ: {len(diff)} {diff[:8]}.",
            ]
            (out_w / "README.md").write_text(
                "# modelopt_tiny_w4a16\n\n"
                "Same BF16 model as `../modelopt_tiny/original.safetensors`, exported by ModelOpt "
                "with `mtq.W4A16_NVFP4_CFG` by `scripts/modelopt/make_tiny_checkpoint.py` "
                "(versions in `../modelopt_tiny/README.md`).\n\n"
                "Only the json files and the tensor listing are committed (size budget). "
                "Compared with the NVFP4_DEFAULT_CFG export in `../modelopt_tiny/`:\n\n"
                + "\n".join(w4a16_lines)
                + "\n\nSo `../modelopt_tiny/model.safetensors` minus its `*.input_scale` tensors is "
                "this export's `model.safetensors`, tensor for tensor (when the line above says 0).\n"
            )

        # 3. README
        check_lines = checks(out / "original.safetensors", out)
        check_lines += reference_logits(src, out, out / "reference_logits.safetensors", args.seed)
        rows_o, _ = st_listing(out / "original.safetensors")
        shards = sorted(p.name for p in out.glob("model*.safetensors"))
        rows_r, _ = st_listing(out / "reference_logits.safetensors")
        rows_e = []
        meta_e = None
        for s in shards:
            r, meta_e = st_listing(out / s)
            rows_e += r
        jsons = {p.name: p.read_text() for p in sorted(out.glob("*.json"))}
        sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir())}

    cmd = "python scripts/modelopt/make_tiny_checkpoint.py" + (
        f" --seed {args.seed}" if args.seed != 0 else ""
    )
    readme = [
        "# modelopt_tiny: a tiny Llama exported by NVIDIA ModelOpt (NVFP4)",
        "",
        "Generated by `scripts/modelopt/make_tiny_checkpoint.py` (do not edit by hand; rerun it).",
        "",
        "## How it was made",
        "",
        "```",
        "python3 -m venv /root/.cache/modelopt-venv && . /root/.cache/modelopt-venv/bin/activate",
        f"pip install torch=={versions['torch'].split('+')[0]}",
        f"pip install \"transformers=={versions['transformers']}\" "
        f"nvidia-modelopt=={versions['nvidia-modelopt']} requests safetensors accelerate",
        cmd,
        "```",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ", CPU only.",
        "",
        f"Model: `LlamaForCausalLM`, {json.dumps(MODEL_CFG)}. "
        f"Seed {args.seed}: every parameter is drawn N(0, 0.02) in fp32 and cast to BF16, "
        "except the RMSNorm gains (1 + N(0, 0.1)). "
        "The model is saved with `save_pretrained` and reloaded with `from_pretrained(dtype=bfloat16)` "
        "(needed by the export), then `mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop)` "
        f"calibrates on {CALIB['n_seq']} random token sequences of length {CALIB['seq_len']} "
        "and `export_hf_checkpoint(model, export_dir=...)` writes the export.",
        "",
        "## Files",
        "",
        "| file | bytes |",
        "|---|---|",
        *[f"| `{k}` | {v} |" for k, v in sizes.items() if k != "README.md"],
        "",
        "- `original.safetensors`: the BF16 weights exactly as fed to ModelOpt (HF names).",
        "- `model.safetensors`, `*.json`: ModelOpt's export, unchanged.",
        "- `reference_logits.safetensors`: fp32 reference logits (see Checks).",
        "- `../modelopt_tiny_w4a16/`: the same model exported with `mtq.W4A16_NVFP4_CFG` "
        "(json files and tensor listing only).",
        "",
        "## Checks (run by the script on every regeneration)",
        "",
        *check_lines,
        *(["", "W4A16 export vs this one:", ""] + w4a16_lines if w4a16_lines else []),
        "",
        "## Notes",
        "",
        "@NOTES@",
        "",
        "## Tensors in `model.safetensors` (ModelOpt export)",
        "",
        f"safetensors `__metadata__`: `{json.dumps(meta_e)}`",
        "",
        "```",
        fmt_listing(rows_e),
        "```",
        "",
        "## Tensors in `reference_logits.safetensors`",
        "",
        "```",
        fmt_listing(rows_r),
        "```",
        "",
        "## Tensors in `original.safetensors`",
        "",
        "```",
        fmt_listing(rows_o),
        "```",
        "",
        "## json files",
        "",
    ]
    for name, text in jsons.items():
        readme += [f"`{name}`:", "", "```json", text.rstrip(), "```", ""]
    notes_path = Path(__file__).with_name("NOTES.md")
    notes = notes_path.read_text().strip() if notes_path.exists() else "(none)"
    (out / "README.md").write_text("\n".join(readme).replace("@NOTES@", notes) + "\n")

    total = sum(p.stat().st_size for d in (out, out_w) if d.exists() for p in d.iterdir())
    print(f"total bytes written: {total}")
    if total > 2 * 1024 * 1024:
        print("WARNING: over the 2 MB budget", file=sys.stderr)


if __name__ == "__main__":
    main()
