//! What the `tune` binary measures and how it decides (pure, tested on the CPU): the GEMV
//! shapes of a model as the Llama port fuses its projections, optionally as the shard one
//! rank of a tensor-parallel group holds, and the rule that turns measured times into a
//! tuned-table entry.

use crate::config::LlamaConfig;
use anyhow::{bail, Context, Result};
use candle_fp4::tables::TableEntry;
use candle_fp4::tensor_parallel::vocab_parallel;

/// One GEMV the model runs per token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GemvShape {
    /// What it is (`q|k|v`, `o`, `gate|up`, `down`, `lm_head`).
    pub name: String,
    /// Output features (`[gate | up]` rows for `silu_mul`).
    pub n: usize,
    /// Input features.
    pub k: usize,
    /// The fused `silu(gate)·up` epilogue.
    pub silu_mul: bool,
}

/// The GEMV shapes of `cfg` for one rank of a `tp`-way tensor-parallel group (1: the
/// whole model): q|k|v and gate|up split by columns (heads, intermediate rows), o and
/// down by rows (their K), the lm_head by its vocabulary rows where they divide
/// ([`vocab_parallel`], as the model splits it) and whole otherwise. Every split must be exact (whole heads per
/// rank) or it is an error naming the dimension.
pub fn gemv_shapes(cfg: &LlamaConfig, tp: usize) -> Result<Vec<GemvShape>> {
    let (h, hd, i) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    if tp == 0 {
        bail!("tensor-parallel size must be at least 1");
    }
    for (what, v) in [
        ("num_attention_heads", nh),
        ("num_key_value_heads", nkv),
        ("intermediate_size", i),
    ] {
        if !v.is_multiple_of(tp) {
            bail!("{what} = {v} does not split into {tp} equal shards");
        }
    }
    let s = |name: &str, n: usize, k: usize, silu_mul: bool| GemvShape {
        name: name.to_string(),
        n,
        k,
        silu_mul,
    };
    Ok(vec![
        s("q|k|v", (nh + 2 * nkv) * hd / tp, h, false),
        s("o", h, nh * hd / tp, false),
        s("gate|up", 2 * i / tp, h, true),
        s("down", h, i / tp, false),
        s(
            "lm_head",
            if vocab_parallel(cfg.vocab_size, tp) {
                cfg.vocab_size / tp
            } else {
                cfg.vocab_size
            },
            h,
            false,
        ),
    ])
}

/// Shapes from a list `NxK[s],...` (`s`: the `silu_mul` epilogue), e.g. `4096x4096,28672x4096s`.
pub fn parse_shapes(list: &str) -> Result<Vec<GemvShape>> {
    let mut out = vec![];
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (body, silu_mul) = match item.strip_suffix('s') {
            Some(b) => (b, true),
            None => (item, false),
        };
        let (n, k) = body
            .split_once('x')
            .with_context(|| format!("shape `{item}` is not NxK"))?;
        let n: usize = n
            .parse()
            .with_context(|| format!("shape `{item}`: N is not a number"))?;
        let k: usize = k
            .parse()
            .with_context(|| format!("shape `{item}`: K is not a number"))?;
        if n == 0 || k == 0 || !k.is_multiple_of(64) || (silu_mul && !n.is_multiple_of(2)) {
            bail!("shape `{item}`: need N > 0 (even with silu), K a positive multiple of 64");
        }
        out.push(GemvShape {
            name: item.to_string(),
            n,
            k,
            silu_mul,
        });
    }
    if out.is_empty() {
        bail!("no shapes in `{list}`");
    }
    Ok(out)
}

/// Token tiles and the M each serves: nt 1 for M 1..=8, 2 for 9..=16, 4 for 17..=32.
pub const TILE_RANGES: [(usize, usize, usize); 3] = [(1, 1, 8), (2, 9, 16), (4, 17, 32)];

/// The table entry of one shape from `(m, gemv µs, matmul-path µs)` measurements: a tile
/// is listed when the GEMV's geometric-mean speedup over the layer's matmul path across
/// the measured M it serves is above 1, with that speedup as its margin. `None` when no
/// tile wins (the shape then runs the matmul).
pub fn table_entry(
    shape: &GemvShape,
    bf16: bool,
    rows: &[(usize, f64, f64)],
) -> Option<TableEntry> {
    let mut nts = vec![];
    let mut margins = vec![];
    for (nt, lo, hi) in TILE_RANGES {
        let logs: Vec<f64> = rows
            .iter()
            .filter(|(m, g, mm)| *m >= lo && *m <= hi && *g > 0.0 && *mm > 0.0)
            .map(|(_, g, mm)| (mm / g).ln())
            .collect();
        if logs.is_empty() {
            continue;
        }
        let gm = (logs.iter().sum::<f64>() / logs.len() as f64).exp();
        if gm > 1.0 {
            nts.push(nt);
            margins.push((gm * 1000.0).round() / 1000.0);
        }
    }
    if nts.is_empty() {
        return None;
    }
    Some(TableEntry {
        n: shape.n,
        k: shape.k,
        silu_mul: shape.silu_mul,
        bf16,
        nts,
        margins,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama_70b() -> LlamaConfig {
        let text = r#"{"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
            "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}"#;
        LlamaConfig::from_json_str(text, "test").unwrap()
    }

    #[test]
    fn seventy_b_shapes_and_their_tensor_parallel_shards() {
        let c = llama_70b();
        let dims = |tp| -> Vec<(usize, usize, bool)> {
            gemv_shapes(&c, tp)
                .unwrap()
                .iter()
                .map(|s| (s.n, s.k, s.silu_mul))
                .collect()
        };
        assert_eq!(
            dims(1),
            [
                (10240, 8192, false),
                (8192, 8192, false),
                (57344, 8192, true),
                (8192, 28672, false),
                (128256, 8192, false)
            ]
        );
        assert_eq!(
            dims(2),
            [
                (5120, 8192, false),
                (8192, 4096, false),
                (28672, 8192, true),
                (8192, 14336, false),
                (64128, 8192, false)
            ]
        );
        // A vocabulary that does not divide keeps the lm_head whole on every rank.
        let mut odd = c.clone();
        odd.vocab_size = 128257;
        assert_eq!(gemv_shapes(&odd, 2).unwrap()[4].n, 128257);
        assert!(gemv_shapes(&c, 3).is_err(), "64 heads do not split 3 ways");
        assert!(gemv_shapes(&c, 0).is_err());
    }

    #[test]
    fn shape_lists() {
        let s = parse_shapes("4096x4096, 28672x4096s").unwrap();
        assert_eq!((s[1].n, s[1].k, s[1].silu_mul), (28672, 4096, true));
        for bad in ["", "4096", "4096x100", "0x64", "3x64s", "ax64"] {
            assert!(parse_shapes(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn table_rule_lists_the_tiles_that_win_with_their_margin() {
        let shape = GemvShape {
            name: "t".into(),
            n: 64,
            k: 64,
            silu_mul: false,
        };
        // GEMV twice as fast up to M = 8, equal at 16, slower at 32.
        let rows = [(1, 1.0, 2.0), (8, 1.0, 2.0), (16, 2.0, 2.0), (32, 3.0, 2.0)];
        let e = table_entry(&shape, false, &rows).unwrap();
        assert_eq!(e.nts, [1]);
        assert_eq!(e.margins, [2.0]);
        let lose = [(1, 3.0, 2.0), (32, 3.0, 2.0)];
        assert!(table_entry(&shape, false, &lose).is_none());
        // The entry round-trips through the table parser.
        let json = format!(
            r#"{{"arch":"sm90","entries":[{}]}}"#,
            serde_json::to_string(&e).unwrap()
        );
        let t = candle_fp4::tables::TunedTable::from_json(&json, "test").unwrap();
        assert_eq!(t.pick_nt(64, 64, 5, false, false), Some(1));
        assert_eq!(t.pick_nt(64, 64, 9, false, false), None);
    }
}
