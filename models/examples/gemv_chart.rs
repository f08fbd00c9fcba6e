//! GEMV time / matmul time vs M, per shape, from a `tune` log or a `benches/gemv_cuda.rs`
//! log (the PNG of docs/benchmarks.md).
//!
//! ```sh
//! cargo run --release -p candle-fp4-models --example gemv_chart -- \
//!     --out docs/img/gemv_vs_matmul.png docs/logs/s13/tune-decode/tune.log
//! ```
//!
//! Reads `tune`'s lines (`name NxK m= M: packed X us, dequant+matmul Y (..); bf16 gemv Z,
//! matmul W (..)`), or else the summary table the bench prints last (`| shape | M | NVFP4
//! µs | ... |`), and draws, per model (SmolLM2, Llama-3.1-8B, 70B, 70B tensor-parallel-2 shards), the packed
//! NVFP4 GEMV's time over candle's BF16 matmul on a resident BF16 weight (solid) and over
//! NVFP4's own matmul path, dequantize + matmul (dashed), against M. Below 1 the GEMV wins.

use anyhow::{bail, Context, Result};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// (M, GEMV µs, matmul µs, dequantize + matmul µs) rows of one shape.
type Series = Vec<(f64, f64, f64, f64)>;

/// `tune`'s per-(shape, M) lines; an empty map when the text has none.
fn parse_tune(text: &str) -> Result<BTreeMap<String, Series>> {
    let mut out: BTreeMap<String, Series> = BTreeMap::new();
    for line in text.lines() {
        let Some((head, rest)) = line.split_once(": packed ") else {
            continue;
        };
        let t: Vec<&str> = head.split_whitespace().collect();
        // `name NxK m= M` or `name NxK m=MM`
        let (name, shape, m) = match t.as_slice() {
            [name, shape, "m=", m] => (*name, *shape, *m),
            [name, shape, m] => (*name, *shape, m.trim_start_matches("m=")),
            _ => bail!("tune line `{line}`: expected `name NxK m= M: packed ...`"),
        };
        let nums: Vec<f64> = rest
            .split(|c: char| !(c.is_ascii_digit() || c == '.'))
            .filter(|s| !s.is_empty() && *s != ".")
            .map(|s| s.parse::<f64>())
            .collect::<std::result::Result<_, _>>()
            .with_context(|| format!("tune line `{line}`: not a number"))?;
        // packed, dequant+matmul, (ratio), bf16 gemv, matmul, (ratio)
        let [packed, dqmm, _, _, mm, ..] = nums.as_slice() else {
            bail!("tune line `{line}`: expected six numbers after `packed`")
        };
        let m: f64 = m
            .parse()
            .with_context(|| format!("tune line `{line}`: M is not a number"))?;
        let shape = shape.trim_end_matches('s');
        let key = if name.trim_end_matches('s') == shape {
            shape.to_string() // SmolLM2's shapes are named by themselves
        } else {
            format!("{shape} {name}")
        };
        out.entry(key).or_default().push((m, *packed, *mm, *dqmm));
    }
    Ok(out)
}

/// The bench's summary table, or `tune`'s lines.
fn parse(text: &str) -> Result<BTreeMap<String, Series>> {
    let tune = parse_tune(text)?;
    if !tune.is_empty() {
        return Ok(tune);
    }
    let mut out: BTreeMap<String, Series> = BTreeMap::new();
    let mut in_table = false;
    for line in text.lines() {
        if line.starts_with("| shape | M |") {
            in_table = true;
            continue;
        }
        if !in_table || !line.starts_with('|') || line.starts_with("|---") {
            continue;
        }
        let c: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        if c.len() < 9 {
            bail!("table row with {} columns: {line}", c.len());
        }
        let num = |i: usize| -> Result<f64> {
            c[i].parse::<f64>()
                .with_context(|| format!("column {i} of `{line}` is not a number"))
        };
        out.entry(c[0].to_string())
            .or_default()
            .push((num(1)?, num(2)?, num(7)?, num(8)?));
    }
    if out.is_empty() {
        bail!("no `| shape | M | ...` table in the log");
    }
    Ok(out)
}

/// The panel of the tensor-parallel-2 shards (8B and 70B).
const TP2: &str = "Llama-3.1-8B / 70B, tensor-parallel 2 shards";

/// The model a shape belongs to (the bench's and `tune`'s shape lists).
fn model(shape: &str) -> &'static str {
    let (n, k) = shape
        .split(' ')
        .next()
        .and_then(|s| s.split_once('x'))
        .unwrap_or(("0", "0"));
    match (n, k) {
        (_, "576") | ("576", _) => "SmolLM2-135M",
        ("10240", "8192") | ("8192", "8192") | ("57344", _) | ("8192", "28672") | (_, "8192")
            if n != "5120" && n != "28672" =>
        {
            "Llama-3.1-70B"
        }
        ("5120", _)
        | ("8192", "4096")
        | ("28672", "8192")
        | ("8192", "14336")
        | ("3072", _)
        | ("4096", "2048")
        | ("14336", _)
        | ("4096", "7168") => TP2,
        _ => "Llama-3.1-8B",
    }
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let (mut out, mut font, mut input) = (
        PathBuf::from("gemv_vs_matmul.png"),
        PathBuf::from("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"),
        None,
    );
    while let Some(a) = args.next() {
        match a.as_str() {
            "--out" => out = args.next().context("--out FILE")?.into(),
            "--font" => font = args.next().context("--font FILE.ttf")?.into(),
            _ => input = Some(PathBuf::from(a)),
        }
    }
    let Some(input) = input else {
        bail!("usage: gemv_chart [--out FILE.png] [--font FILE.ttf] GEMV_CUDA.log");
    };
    let text = std::fs::read_to_string(&input)
        .with_context(|| format!("cannot read {}", input.display()))?;
    let shapes = parse(&text)?;
    let bytes: &'static [u8] = Box::leak(
        std::fs::read(&font)
            .with_context(|| format!("cannot read the font {}", font.display()))?
            .into_boxed_slice(),
    );
    register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow::anyhow!("{}: not a usable TrueType font", font.display()))?;
    let models = ["SmolLM2-135M", "Llama-3.1-8B", "Llama-3.1-70B", TP2];
    let (w, h) = (1400u32, 1000u32);
    let mut buf = vec![0u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(
            "H200: packed NVFP4 GEMV time / matmul time vs M (solid: BF16 matmul; dashed: dequantize + matmul)",
            ("sans-serif", 22),
        )?;
        for (area, m) in root.split_evenly((2, 2)).iter().zip(models) {
            let mine: Vec<(&String, &Series)> =
                shapes.iter().filter(|(s, _)| model(s) == m).collect();
            let hi = mine
                .iter()
                .flat_map(|(_, v)| v.iter().map(|r| r.1 / r.2))
                .fold(1.2f64, f64::max)
                * 1.1;
            let mut c = ChartBuilder::on(area)
                .caption(m, ("sans-serif", 18))
                .margin(12)
                .x_label_area_size(36)
                .y_label_area_size(56)
                .build_cartesian_2d(0.0f64..33.0, 0.0f64..hi)?;
            c.configure_mesh()
                .x_desc("M (tokens)")
                .y_desc("GEMV / matmul")
                .label_style(("sans-serif", 14))
                .draw()?;
            c.draw_series(LineSeries::new([(0.0, 1.0), (33.0, 1.0)], BLACK.mix(0.4)))?;
            for (i, (shape, rows)) in mine.iter().enumerate() {
                let color = Palette99::pick(i).to_rgba();
                c.draw_series(LineSeries::new(
                    rows.iter().map(|r| (r.0, r.1 / r.2)),
                    color.stroke_width(2),
                ))?
                .label(shape.as_str())
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2))
                });
                c.draw_series(DashedLineSeries::new(
                    rows.iter().map(|r| (r.0, r.1 / r.3)),
                    6,
                    4,
                    color.stroke_width(1),
                ))?;
            }
            c.configure_series_labels()
                .label_font(("sans-serif", 13))
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK.mix(0.3))
                .position(SeriesLabelPosition::UpperLeft)
                .draw()?;
        }
        root.present()?;
    }
    let file =
        std::fs::File::create(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.set_compression(png::Compression::Best);
    enc.write_header()?.write_image_data(&buf)?;
    println!("wrote {}", out.display());
    Ok(())
}
