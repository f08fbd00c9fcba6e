# Experiment: fold a randomized-Hadamard rotation of the residual stream into a BF16 Llama checkpoint.
import json, struct, sys, os, shutil
import numpy as np
src, dst, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
kind = sys.argv[4] if len(sys.argv) > 4 else "hadamard"
def load(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    hdr = json.loads(b[8:8+n]); base = 8 + n
    out = {}
    for k, v in hdr.items():
        if k == "__metadata__": continue
        s, e = v["data_offsets"]; raw = b[base+s:base+e]
        assert v["dtype"] == "BF16", (k, v["dtype"])
        u = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
        out[k] = u.view(np.float32).reshape(v["shape"]).astype(np.float64)
    return out
def to_bf16(x):
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r
def save(path, ts):
    hdr = {}; off = 0; blobs = []
    for k in sorted(ts):
        a = to_bf16(ts[k]); raw = a.tobytes()
        hdr[k] = {"dtype": "BF16", "shape": list(ts[k].shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw); blobs.append(raw)
    h = json.dumps(hdr).encode(); h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h))); f.write(h)
        for r in blobs: f.write(r)
def paley12():
    q = 11; chi = np.zeros(q)
    for i in range(1, q): chi[(i*i) % q] = 1
    chi = np.where(chi == 1, 1, -1); chi[0] = 0
    Qm = np.array([[chi[(j - i) % q] for j in range(q)] for i in range(q)])
    S = np.zeros((q+1, q+1)); S[0, 1:] = 1; S[1:, 0] = -1; S[1:, 1:] = Qm
    H = S + np.eye(q+1)
    assert np.allclose(H @ H.T, 12 * np.eye(12)), "paley"
    return H
ts = load(os.path.join(src, "model.safetensors"))
cfg = json.load(open(os.path.join(src, "config.json")))
d = cfg["hidden_size"]; L = cfg["num_hidden_layers"]
rng = np.random.default_rng(seed)
if kind == "hadamard":
    H12 = paley12(); H2 = np.array([[1, 1], [1, -1]])
    H = np.kron(np.kron(H12, H12), np.kron(H2, H2))
    assert H.shape == (d, d) and np.allclose(H @ H.T, d * np.eye(d))
    Q = (rng.choice([-1.0, 1.0], size=d)[:, None] * H) / np.sqrt(d)
else:
    A = rng.standard_normal((d, d)); Q, R = np.linalg.qr(A); Q = Q * np.sign(np.diag(R))[None, :]
assert np.allclose(Q @ Q.T, np.eye(d), atol=1e-10)
E = ts["model.embed_tokens.weight"]
gf = ts["model.norm.weight"]
out = dict(ts)
out["model.embed_tokens.weight"] = E @ Q
out["lm_head.weight"] = (E * gf[None, :]) @ Q
out["model.norm.weight"] = np.ones(d)
for i in range(L):
    p = f"model.layers.{i}."
    g1 = ts[p + "input_layernorm.weight"]; g2 = ts[p + "post_attention_layernorm.weight"]
    for n in ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]:
        out[p + n + ".weight"] = (ts[p + n + ".weight"] * g1[None, :]) @ Q
    for n in ["mlp.gate_proj", "mlp.up_proj"]:
        out[p + n + ".weight"] = (ts[p + n + ".weight"] * g2[None, :]) @ Q
    for n in ["self_attn.o_proj", "mlp.down_proj"]:
        out[p + n + ".weight"] = Q.T @ ts[p + n + ".weight"]
    out[p + "input_layernorm.weight"] = np.ones(d); out[p + "post_attention_layernorm.weight"] = np.ones(d)
os.makedirs(dst, exist_ok=True)
save(os.path.join(dst, "model.safetensors"), out)
cfg["tie_word_embeddings"] = False
json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=2)
for f in os.listdir(src):
    if f not in ("model.safetensors", "config.json"): shutil.copy(os.path.join(src, f), dst)
print("rotated", kind, "seed", seed, "->", dst)
