//! Grouped-query self-attention: fused q|k|v, RoPE, attention over the layer's
//! [`LayerCache`], o_proj.

use super::capture::{LinearInputs, Site};
use super::linear::{check_dims, rebiased, FusedLinear, Loader};
use crate::config::LlamaConfig;
use crate::kv_cache::LayerCache;
use crate::rope::Rope;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_fp4::quant_linear::QuantLinear;
use candle_fp4::tensor_parallel::{self as tp, AllReduce, HeadSplit};
use std::sync::Arc;

/// One layer's self-attention (`model.layers.{i}.self_attn`).
#[derive(Debug)]
pub struct Attention {
    qkv: FusedLinear,
    o: QuantLinear,
    rope: Rope,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    /// Tensor parallel: the sum over the ranks after o_proj (row-parallel).
    reduce: Option<Arc<dyn AllReduce>>,
}

impl Attention {
    /// Loads `{prefix}.q_proj|k_proj|v_proj` (fused) and `{prefix}.o_proj`, checking their
    /// shapes against `cfg`.
    pub fn load(ld: &Loader<'_>, cfg: &LlamaConfig, prefix: &str, rope: &Rope) -> Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let names = [
            format!("{prefix}.q_proj"),
            format!("{prefix}.k_proj"),
            format!("{prefix}.v_proj"),
        ];
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let qkv = ld.fused(&names)?;
        check_dims(
            ld.ckpt.origin(),
            &format!("{prefix}.q_proj|k_proj|v_proj"),
            qkv.out_features(),
            qkv.in_features(),
            (nh + 2 * nkv) * hd,
            h,
        )?;
        let o = ld.linear(&format!("{prefix}.o_proj"))?;
        check_dims(
            ld.ckpt.origin(),
            &format!("{prefix}.o_proj"),
            o.out_features(),
            o.in_features(),
            h,
            nh * hd,
        )?;
        Ok(Self {
            qkv,
            o,
            rope: rope.clone(),
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
            dtype: ld.dtype,
            reduce: None,
        })
    }

    /// Attention from its fused `q|k|v` layer and `o`, shapes checked against `cfg`, e.g.
    /// built in memory ([`super::random`]).
    pub fn from_parts(
        cfg: &LlamaConfig,
        qkv: QuantLinear,
        o: QuantLinear,
        rope: &Rope,
        dtype: DType,
    ) -> Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let what = "Attention::from_parts";
        check_dims(
            what,
            "q|k|v",
            qkv.out_features(),
            qkv.in_features(),
            (nh + 2 * nkv) * hd,
            h,
        )?;
        check_dims(what, "o", o.out_features(), o.in_features(), h, nh * hd)?;
        Ok(Self {
            qkv: FusedLinear::One(qkv),
            o,
            rope: rope.clone(),
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
            dtype,
            reduce: None,
        })
    }

    /// Rank `split.shard()`'s part on `device` (Megatron): q|k|v column-parallel by
    /// heads (the rank's whole GQA groups), o_proj row-parallel, its output summed over
    /// the ranks by `reduce`; `rope` on `device`.
    pub(super) fn shard(
        &self,
        split: &HeadSplit,
        reduce: Arc<dyn AllReduce>,
        rope: &Rope,
        device: &Device,
    ) -> Result<Self> {
        let hd = self.head_dim;
        let want = [self.heads * hd, self.kv_heads * hd, self.kv_heads * hd];
        if split.qkv_members() != want || split.head_dim() != hd {
            bail!(
                "Attention::shard: the split's q|k|v rows {:?} (head_dim {}) are not the layer's {want:?} (head_dim {hd})",
                split.qkv_members(),
                split.head_dim()
            )
        }
        let shard = split.shard();
        let (nh, nkv) = (split.heads(), split.kv_heads());
        Ok(Self {
            qkv: self
                .qkv
                .shard_columns(&split.qkv_members(), shard, device)?,
            o: tp::row_parallel(&self.o, shard, device)?,
            rope: rope.clone(),
            heads: nh,
            kv_heads: nkv,
            head_dim: self.head_dim,
            dtype: self.dtype,
            reduce: Some(reduce),
        })
    }

    /// Sums o_proj's output over the ranks with `reduce` (a layer whose weights are
    /// already a rank's shard, e.g. drawn at random in the rank's shapes).
    pub(super) fn set_reduce(&mut self, reduce: Arc<dyn AllReduce>) {
        self.reduce = Some(reduce);
    }

    /// o_proj, then (tensor parallel) the sum over the ranks.
    pub(super) fn o_out(&self, y: &Tensor) -> candle_core::Result<Tensor> {
        let a = self.o.forward(y)?;
        match &self.reduce {
            Some(r) => r.all_reduce(&a),
            None => Ok(a),
        }
    }

    /// Whether q/k/v carry a bias.
    pub fn has_qkv_bias(&self) -> bool {
        self.qkv.has_bias()
    }

    /// The Linears of `site` (q, k, v fused or not, or o_proj); none for the MLP's.
    pub fn linears(&self, site: Site) -> Vec<&QuantLinear> {
        match site {
            Site::Qkv => self.qkv.layers(),
            Site::O => vec![&self.o],
            Site::GateUp | Site::Down => vec![],
        }
    }

    /// Every Linear (q/k/v, o), mutably.
    pub fn linears_mut(&mut self) -> Vec<&mut QuantLinear> {
        let mut v = self.qkv.layers_mut();
        v.push(&mut self.o);
        v
    }

    /// Replaces the Linears of `site` (q, k, v in that order; or o_proj) by `layers`
    /// with the old shapes, keeping the old biases.
    pub fn set_linears(&mut self, site: Site, layers: Vec<QuantLinear>) -> Result<()> {
        match site {
            Site::Qkv => self.qkv.replace(layers),
            Site::O => {
                let mut new = rebiased(&[&self.o], layers)?;
                self.o = new.pop().context("no layer given")?;
                Ok(())
            }
            Site::GateUp | Site::Down => bail!("attention has no {site:?} Linears"),
        }
    }

    /// Attention over `x` `[t, hidden]` at positions `pos..pos + t`, `mask` the causal
    /// mask of a chunk (`None` for one token); stores the chunk's K/V in `cache`.
    pub fn forward(
        &self,
        x: &Tensor,
        pos: usize,
        mask: Option<&Tensor>,
        cache: &mut LayerCache,
    ) -> candle_core::Result<Tensor> {
        self.forward_captured(x, pos, mask, cache, &mut super::capture::ignore_inputs)
    }

    /// One decode token of every sequence: `x` `[batch, hidden]`, sequence `b` at position
    /// `positions[b]` (U32 `[batch]` on the device, equal to its cached length); stores K/V
    /// at the lengths held on the device ([`LayerCache::decode_batch`]). Nothing here reads
    /// a host-side position, so the call can be captured in a CUDA graph.
    pub fn forward_decode(
        &self,
        x: &Tensor,
        positions: &Tensor,
        cache: &mut LayerCache,
        for_graph: bool,
    ) -> candle_core::Result<Tensor> {
        self.decode_from_qkv(&self.qkv.forward(x)?, positions, cache, for_graph)
    }

    /// [`forward_decode`](Self::forward_decode) behind the residual add and `norm`: `x` the
    /// residual stream, `delta` what to add to it first (`None`: nothing) →
    /// `(x + delta, attention output)`, the norm inside the q|k|v GEMV's kernel where it
    /// can run there ([`QuantLinear::forward_add_norm`]).
    pub fn forward_decode_add_norm(
        &self,
        x: &Tensor,
        delta: Option<&Tensor>,
        norm: &super::norm::RmsNorm,
        positions: &Tensor,
        cache: &mut LayerCache,
        for_graph: bool,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (s, qkv) = self.qkv.forward_add_norm(x, delta, norm, false)?;
        Ok((s, self.decode_from_qkv(&qkv, positions, cache, for_graph)?))
    }

    /// The decode step after the q|k|v projection (`qkv` `[batch, (heads + 2·kv_heads)·d]`).
    fn decode_from_qkv(
        &self,
        qkv: &Tensor,
        positions: &Tensor,
        cache: &mut LayerCache,
        for_graph: bool,
    ) -> candle_core::Result<Tensor> {
        let b = qkv.dim(0)?;
        let (nh, nkv, hd) = (self.heads, self.kv_heads, self.head_dim);
        if let Some(f) = self.rope.fused() {
            if qkv.dtype() == DType::BF16 && cache.fuses_rope_append() {
                // One kernel rotates q and k and stores k and v in the cache.
                let y = cache.decode_batch_rope(f, qkv, positions, for_graph)?;
                let y = y.reshape((b, nh * hd))?.to_dtype(self.dtype)?;
                return self.o_out(&y);
            }
        }
        let (q, k, v) = match self.rope.fused() {
            // One kernel: q and k rotated, v copied, [b, nh + 2·nkv, hd].
            Some(f) if qkv.dtype() == DType::BF16 => {
                let r = f.forward(qkv, positions)?;
                (
                    r.narrow(1, 0, nh)?,
                    r.narrow(1, nh, nkv)?,
                    r.narrow(1, nh + nkv, nkv)?,
                )
            }
            _ => {
                let heads = |start: usize, n: usize| -> candle_core::Result<Tensor> {
                    qkv.narrow(1, start * hd, n * hd)?
                        .reshape((b, n, 1, hd))?
                        .contiguous()
                };
                let q = self.rope.apply_at(&heads(0, nh)?, positions)?;
                let k = self.rope.apply_at(&heads(nh, nkv)?, positions)?;
                (q, k, heads(nh + nkv, nkv)?)
            }
        };
        let y = cache.decode_batch(
            &k.reshape((b, nkv, hd))?,
            &v.reshape((b, nkv, hd))?,
            &q.reshape((b, nh, hd))?,
            for_graph,
        )?; // [b, nh, hd] BF16
        let y = y.reshape((b, nh * hd))?.to_dtype(self.dtype)?;
        self.o_out(&y)
    }

    /// [`forward`](Self::forward), reporting the inputs of q/k/v ([`Site::Qkv`]) and
    /// o_proj ([`Site::O`]) to `hook`.
    pub fn forward_captured(
        &self,
        x: &Tensor,
        pos: usize,
        mask: Option<&Tensor>,
        cache: &mut LayerCache,
        hook: &mut LinearInputs<'_>,
    ) -> candle_core::Result<Tensor> {
        let t = x.dim(0)?;
        let (nh, nkv, hd) = (self.heads, self.kv_heads, self.head_dim);
        let n_rep = nh / nkv;
        hook(Site::Qkv, x)?;
        let qkv = self.qkv.forward(x)?;
        let heads = |start: usize, n: usize| -> candle_core::Result<Tensor> {
            qkv.narrow(1, start * hd, n * hd)?
                .reshape((t, n, hd))?
                .transpose(0, 1)?
                .contiguous()
        };
        let q = self
            .rope
            .apply(&heads(0, nh)?.unsqueeze(0)?, pos)?
            .squeeze(0)?;
        let k = self
            .rope
            .apply(&heads(nh, nkv)?.unsqueeze(0)?, pos)?
            .squeeze(0)?;
        let v = heads(nh + nkv, nkv)?;
        if t == 1 && cache.batch() == 1 {
            // Decode: the cache stores the token, then attends over everything it holds.
            let y = cache.decode(&k, &v, &q)?; // [nh, hd] BF16
            let y = y.reshape((1, nh * hd))?.to_dtype(self.dtype)?;
            hook(Site::O, &y)?;
            return self.o_out(&y);
        }
        let (ka, va) = cache.prefill(&k, &v)?; // [nkv, l, hd] BF16
        let l = ka.dim(1)?;
        // Query heads h·n_rep..(h+1)·n_rep share KV head h: [nkv, n_rep·t, hd].
        let q = q.reshape((nkv, n_rep * t, hd))?;
        let ka = ka.to_dtype(self.dtype)?.contiguous()?;
        let va = va.to_dtype(self.dtype)?.contiguous()?;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut att = (q.matmul(&ka.t()?)? * scale)?.to_dtype(DType::F32)?;
        if let Some(m) = mask {
            att = att
                .reshape((nkv, n_rep, t, l))?
                .broadcast_add(m)?
                .reshape((nkv, n_rep * t, l))?;
        }
        let att = candle_nn::ops::softmax_last_dim(&att)?.to_dtype(self.dtype)?;
        let y = att.matmul(&va)?; // [nkv, n_rep·t, hd]
        let y = y
            .reshape((nh, t, hd))?
            .transpose(0, 1)?
            .reshape((t, nh * hd))?;
        hook(Site::O, &y)?;
        self.o_out(&y)
    }
}

/// The additive causal mask of `t` tokens at positions `pos..pos + t` over `pos + t`
/// keys, `[t, pos + t]`; none for a single token.
pub(super) fn causal_mask(
    t: usize,
    pos: usize,
    device: &Device,
) -> candle_core::Result<Option<Tensor>> {
    if t <= 1 {
        return Ok(None);
    }
    let l = pos + t;
    let m: Vec<f32> = (0..t)
        .flat_map(|i| (0..l).map(move |j| if j > pos + i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Ok(Some(Tensor::from_vec(m, (t, l), device)?))
}
