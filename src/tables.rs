//! Tuned dispatch tables: per GPU architecture, for which `(N, K, silu_mul, bf16)` and
//! token tiles the GEMV beats candle's matmul.
//!
//! One JSON file per architecture (`tables/sm90.json`, ...), embedded at build time and
//! overridable at run time by the environment variable [`TABLES_ENV`] (a folder holding
//! `<arch>.json`, or one file). A token tile `nt ∈ {1, 2, 4}` covers `8·nt` tokens.
//! Entries are written only from measurements (`benches/`); an absent entry means "use
//! matmul".
//!
//! ```json
//! { "arch": "sm90", "device": "NVIDIA H200", "measured": "2026-11-30 ...",
//!   "entries": [ { "n": 4096, "k": 4096, "silu_mul": false, "bf16": false, "nts": [1, 2] } ] }
//! ```

use crate::variants::GEMV_NTS;
use candle_core::{bail, Device, DeviceLocation, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Environment variable overriding the embedded tables: a folder with `<arch>.json` files
/// or the path of one table file.
pub const TABLES_ENV: &str = "CANDLE_FP4_TABLES";

/// Token-tile counts the kernels are built for (`8·nt` tokens each).
pub const NT_CHOICES: [usize; 3] = GEMV_NTS;

/// One tuned shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TableEntry {
    /// Output features (for `silu_mul`, the fused `[gate | up]` row count).
    pub n: usize,
    /// Input features.
    pub k: usize,
    /// Whether the fused `silu(gate)·up` epilogue is on.
    pub silu_mul: bool,
    /// BF16 weight (true) or NVFP4 weight (false).
    pub bf16: bool,
    /// Token tiles at which the GEMV was measured faster than matmul.
    pub nts: Vec<usize>,
    /// The measured margin of each listed tile: geometric-mean speedup over the matmul
    /// path across the M it serves (written by `tune`; absent in older tables).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub margins: Vec<f64>,
}

/// A tuned table for one architecture.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TunedTable {
    /// Architecture tag, e.g. `sm90`.
    pub arch: String,
    /// The device it was measured on.
    #[serde(default)]
    pub device: String,
    /// When and how it was measured.
    #[serde(default)]
    pub measured: String,
    /// The tuned shapes.
    #[serde(default)]
    pub entries: Vec<TableEntry>,
}

impl TunedTable {
    /// Parses and validates a table (every `nt` in {1, 2, 4}, `n`, `k` positive, `k % 64 == 0`).
    pub fn from_json(text: &str, origin: &str) -> Result<Self> {
        let t: TunedTable = serde_json::from_str(text)
            .map_err(|e| candle_core::Error::Msg(format!("tuned table {origin}: {e}")))?;
        for e in &t.entries {
            if e.n == 0 || e.k == 0 || e.k % 64 != 0 {
                bail!(
                    "tuned table {origin}: entry n = {}, k = {} is not a valid GEMV shape",
                    e.n,
                    e.k
                );
            }
            if let Some(nt) = e.nts.iter().find(|nt| !NT_CHOICES.contains(nt)) {
                bail!(
                    "tuned table {origin}: entry {}x{} has nt = {nt}, not one of {NT_CHOICES:?}",
                    e.n,
                    e.k
                );
            }
        }
        Ok(t)
    }

    fn entry(&self, n: usize, k: usize, silu_mul: bool, bf16: bool) -> Option<&TableEntry> {
        self.entries
            .iter()
            .find(|e| e.n == n && e.k == k && e.silu_mul == silu_mul && e.bf16 == bf16)
    }

    /// The smallest tuned `nt` with `8·nt ≥ m`, or `None` (use matmul).
    pub fn pick_nt(
        &self,
        n: usize,
        k: usize,
        m: usize,
        silu_mul: bool,
        bf16: bool,
    ) -> Option<usize> {
        if m == 0 || m > 8 * GEMV_NTS[GEMV_NTS.len() - 1] {
            return None;
        }
        let e = self.entry(n, k, silu_mul, bf16)?;
        e.nts.iter().copied().filter(|nt| 8 * nt >= m).min()
    }

    /// Whether the shape has any tuned entry.
    pub fn tuned(&self, n: usize, k: usize, silu_mul: bool, bf16: bool) -> bool {
        self.entry(n, k, silu_mul, bf16)
            .is_some_and(|e| !e.nts.is_empty())
    }
}

/// The embedded table text for an architecture tag, if the crate ships one.
pub fn embedded_table(arch: &str) -> Option<&'static str> {
    match arch {
        "sm90" => Some(include_str!("../tables/sm90.json")),
        _ => None,
    }
}

/// Loads the table for `arch`: from [`TABLES_ENV`] when set, else the embedded one, else
/// an empty table (every shape uses matmul).
pub fn load_table(arch: &str) -> Result<TunedTable> {
    if let Ok(p) = std::env::var(TABLES_ENV) {
        let path = std::path::Path::new(&p);
        let file = if path.is_dir() {
            path.join(format!("{arch}.json"))
        } else {
            path.to_path_buf()
        };
        if file.exists() {
            let text = std::fs::read_to_string(&file).map_err(|e| {
                candle_core::Error::Msg(format!(
                    "{TABLES_ENV}: cannot read {}: {e}",
                    file.display()
                ))
            })?;
            let t = TunedTable::from_json(&text, &file.display().to_string())?;
            if t.arch != arch {
                bail!(
                    "{TABLES_ENV}: {} is a table for {}, the device is {arch}",
                    file.display(),
                    t.arch
                );
            }
            return Ok(t);
        }
        if !path.is_dir() {
            bail!("{TABLES_ENV}: {} does not exist", file.display());
        }
    }
    match embedded_table(arch) {
        Some(text) => TunedTable::from_json(text, &format!("tables/{arch}.json")),
        None => Ok(TunedTable {
            arch: arch.to_string(),
            ..Default::default()
        }),
    }
}

/// The architecture tag of a device: `sm90` for compute capability 9.0, `None` on CPU.
pub fn device_arch(device: &Device) -> Result<Option<String>> {
    match device {
        Device::Cpu => Ok(None),
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => Ok(Some(crate::cuda::facts(d)?.arch.clone())),
        _ => bail!("candle-fp4: only CPU and CUDA devices are supported, got {device:?}"),
    }
}

/// The tuned table of `device` (its architecture's, see [`load_table`]), loaded on the first
/// call per device and kept; empty on CPU. Each device has its own: a process with GPUs of
/// two architectures uses both tables. Takes a lock: for planning, at load.
pub fn for_device(device: &Device) -> Result<Arc<TunedTable>> {
    type Cache = Mutex<HashMap<DeviceLocation, Arc<TunedTable>>>;
    static TABLES: OnceLock<Cache> = OnceLock::new();
    let Some(arch) = device_arch(device)? else {
        return Ok(Arc::new(TunedTable::default()));
    };
    let cache = TABLES.get_or_init(|| Mutex::new(HashMap::new()));
    let mut c = cache
        .lock()
        .map_err(|_| candle_core::Error::Msg("tuned table cache: poisoned lock".into()))?;
    if let Some(t) = c.get(&device.location()) {
        return Ok(t.clone());
    }
    let t = Arc::new(load_table(&arch)?);
    c.insert(device.location(), t.clone());
    Ok(t)
}

/// The smallest tuned token tile `nt` (8·nt tokens) with `8·nt ≥ m` for this shape on
/// `device`'s table, or `None`: use matmul.
pub fn pick_nt(
    device: &Device,
    n: usize,
    k: usize,
    m: usize,
    silu_mul: bool,
    bf16: bool,
) -> Result<Option<usize>> {
    Ok(for_device(device)?.pick_nt(n, k, m, silu_mul, bf16))
}

/// Whether `device`'s table has an entry for this shape.
pub fn tuned(device: &Device, n: usize, k: usize, silu_mul: bool, bf16: bool) -> Result<bool> {
    Ok(for_device(device)?.tuned(n, k, silu_mul, bf16))
}

/// Loads the kernels and runs each tuned variant of this shape once on `device`, so the
/// first real call pays no module-load or first-launch cost. A no-op on CPU.
pub fn warmup(
    device: &Device,
    n: usize,
    k: usize,
    silu_mul: bool,
    pdl: bool,
    bf16: bool,
) -> Result<()> {
    if device.is_cpu() {
        return Ok(());
    }
    let table = for_device(device)?;
    for nt in GEMV_NTS {
        if table.pick_nt(n, k, 8 * nt, silu_mul, bf16) != Some(nt) {
            continue;
        }
        let m = 8 * nt;
        let x = candle_core::Tensor::zeros((m, k), candle_core::DType::BF16, device)?;
        if bf16 {
            let w = candle_core::Tensor::zeros((n, k), candle_core::DType::BF16, device)?;
            // One token tile: what a BF16 layer runs, the packed kernel over the natural
            // layout (where it serves the shape).
            let plan = if nt == 1 {
                crate::gemv::plan_bf16_gemv(&w, silu_mul, pdl)?
            } else {
                None
            };
            match plan {
                Some(p) => {
                    crate::gemv::bf16_gemv_planned_packed(&x, &w, &p)?;
                }
                _ => {
                    crate::gemv::bf16_gemv(&x, &w, silu_mul, pdl)?;
                }
            }
        } else {
            let w = candle_core::Tensor::zeros((n, k / 2), candle_core::DType::U8, device)?;
            let (np, sp) = crate::nvfp4::swizzled_shape(n, k / 16);
            let s = candle_core::Tensor::zeros((np, sp), candle_core::DType::U8, device)?;
            crate::gemv::nvfp4_gemv(&x, &w, &s, 1.0, silu_mul, pdl)?;
        }
    }
    device.synchronize()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> TunedTable {
        TunedTable::from_json(
            r#"{"arch":"sm90","entries":[
                {"n":4096,"k":4096,"silu_mul":false,"bf16":false,"nts":[1,4]},
                {"n":4096,"k":4096,"silu_mul":true,"bf16":false,"nts":[2]}]}"#,
            "test",
        )
        .unwrap()
    }

    #[test]
    fn pick_nt_takes_smallest_covering_tile() {
        let t = table();
        for m in 1..=8 {
            assert_eq!(t.pick_nt(4096, 4096, m, false, false), Some(1));
        }
        for m in 9..=32 {
            assert_eq!(t.pick_nt(4096, 4096, m, false, false), Some(4), "m = {m}");
        }
        assert_eq!(t.pick_nt(4096, 4096, 33, false, false), None);
        assert_eq!(t.pick_nt(4096, 4096, 0, false, false), None);
        assert_eq!(t.pick_nt(4096, 4096, 16, true, false), Some(2));
        assert_eq!(t.pick_nt(4096, 4096, 17, true, false), None);
        assert_eq!(t.pick_nt(4096, 4096, 1, false, true), None);
        assert_eq!(t.pick_nt(4096, 1024, 1, false, false), None);
        assert!(t.tuned(4096, 4096, true, false));
        assert!(!t.tuned(4096, 4096, true, true));
    }

    #[test]
    fn bad_tables_are_errors() {
        assert!(TunedTable::from_json(
            r#"{"arch":"sm90","entries":[{"n":1,"k":64,"silu_mul":false,"bf16":false,"nts":[3]}]}"#,
            "t"
        )
        .is_err());
        assert!(TunedTable::from_json(
            r#"{"arch":"sm90","entries":[{"n":1,"k":48,"silu_mul":false,"bf16":false,"nts":[1]}]}"#,
            "t"
        )
        .is_err());
        assert!(TunedTable::from_json("not json", "t").is_err());
    }

    #[test]
    fn shipped_tables_parse() {
        let t = TunedTable::from_json(embedded_table("sm90").unwrap(), "sm90").unwrap();
        assert_eq!(t.arch, "sm90");
        // Every shipped entry is a measured shape with at least one winning tile.
        assert!(!t.entries.is_empty());
        assert!(t.entries.iter().all(|e| !e.nts.is_empty()));
    }
}
