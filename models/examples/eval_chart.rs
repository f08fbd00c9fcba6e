//! Quality vs bytes chart of `eval --json` results (docs/accuracy.md's PNG).
//!
//! ```sh
//! cargo run --release -p candle-fp4-models --example eval_chart -- \
//!     --out docs/img/recipes_quality_vs_bytes.png /tmp/ev/final.json
//! ```
//!
//! Four panels against the decoder Linears' bytes relative to all-NVFP4: perplexity
//! increase over BF16 (mean over the evaluation texts, and the worst text), mean KL,
//! top-1 agreement, greedy agreement on the factual prompts. One point per model, named
//! by its label; models whose label starts with `mix` are joined by a line. Texts whose
//! name starts with `calib` (the calibration text's held-out part) are left out.

use anyhow::{bail, Context, Result};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};
use serde_json::Value as Json;
use std::path::PathBuf;

struct Point {
    label: String,
    ratio: f64,
    /// Mean and worst perplexity increase over BF16 (%), mean KL, top-1 (%), prompts (%).
    ppl_mean: f64,
    ppl_worst: f64,
    kl: f64,
    top1: f64,
    agree: f64,
}

fn points(j: &Json) -> Result<Vec<Point>> {
    let refs = j["reference"]["texts"]
        .as_array()
        .context("no reference texts")?;
    // The calibration text's held-out part (`calib…`) is reported in the table, not here.
    let held_out = |t: &&Json| !t["text"].as_str().unwrap_or("").starts_with("calib");
    let ref_ppl: Vec<f64> = refs
        .iter()
        .filter(held_out)
        .filter_map(|t| t["ppl"].as_f64())
        .collect();
    let mut out = vec![];
    for m in j["models"].as_array().context("no models")? {
        let texts: Vec<&Json> = m["texts"]
            .as_array()
            .context("no texts")?
            .iter()
            .filter(held_out)
            .collect();
        let inc: Vec<f64> = texts
            .iter()
            .zip(&ref_ppl)
            .filter_map(|(t, r)| Some(100.0 * (t["ppl"].as_f64()? / r - 1.0)))
            .collect();
        let mean = |f: &dyn Fn(&Json) -> Option<f64>| {
            texts.iter().filter_map(|t| f(t)).sum::<f64>() / texts.len().max(1) as f64
        };
        out.push(Point {
            label: m["label"].as_str().unwrap_or("?").to_string(),
            ratio: m["ratio"].as_f64().context("no ratio")?,
            ppl_mean: inc.iter().sum::<f64>() / inc.len().max(1) as f64,
            ppl_worst: inc.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
            kl: mean(&|t| t["kl"].as_f64()),
            top1: 100.0 * mean(&|t| t["top1"].as_f64()),
            agree: 100.0 * m["prompts"]["agreement"].as_f64().unwrap_or(f64::NAN),
        });
    }
    Ok(out)
}

type Panel<'a> = (&'a str, &'a dyn Fn(&Point) -> f64, Option<f64>);

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let (mut out, mut font, mut inputs) = (
        PathBuf::from("recipes.png"),
        PathBuf::from("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"),
        vec![],
    );
    while let Some(a) = args.next() {
        match a.as_str() {
            "--out" => out = args.next().context("--out FILE")?.into(),
            "--font" => font = args.next().context("--font FILE.ttf")?.into(),
            _ => inputs.push(PathBuf::from(a)),
        }
    }
    if inputs.is_empty() {
        bail!("usage: eval_chart [--out FILE.png] [--font FILE.ttf] RESULTS.json...");
    }
    let bytes: &'static [u8] = Box::leak(
        std::fs::read(&font)
            .with_context(|| format!("cannot read the font {}", font.display()))?
            .into_boxed_slice(),
    );
    register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow::anyhow!("{}: not a usable TrueType font", font.display()))?;
    let mut pts = vec![];
    for p in &inputs {
        let j: Json = serde_json::from_str(&std::fs::read_to_string(p)?)
            .with_context(|| format!("{}: not JSON", p.display()))?;
        pts.extend(points(&j)?);
    }
    pts.sort_by(|a, b| a.ratio.total_cmp(&b.ratio));
    let (w, h) = (1400u32, 1000u32);
    let mut buf = vec![0u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(
            "SmolLM2-135M NVFP4 recipes vs BF16 on held-out text and prompts",
            ("sans-serif", 26),
        )?;
        let panels: [Panel; 4] = [
            (
                "perplexity increase over BF16, % (mean of texts; x = worst)",
                &|p| p.ppl_mean,
                Some(10.0),
            ),
            ("mean KL(BF16 || model), nats/token", &|p| p.kl, None),
            (
                "top-1 agreement with BF16 on the texts, %",
                &|p| p.top1,
                Some(85.0),
            ),
            (
                "greedy agreement on factual prompts, %",
                &|p| p.agree,
                Some(80.0),
            ),
        ];
        let x0 = 0.95;
        let x1 = pts.iter().map(|p| p.ratio).fold(1.0, f64::max) + 0.1;
        for (area, (title, f, target)) in root.split_evenly((2, 2)).iter().zip(panels) {
            let mut ys: Vec<f64> = pts.iter().map(f).filter(|v| v.is_finite()).collect();
            if title.starts_with("perplexity") {
                ys.extend(pts.iter().map(|p| p.ppl_worst));
            }
            ys.extend(target);
            let lo = ys.iter().cloned().fold(f64::INFINITY, f64::min);
            let hi = ys.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let pad = (hi - lo).max(1e-3) * 0.12;
            let mut c = ChartBuilder::on(area)
                .caption(title, ("sans-serif", 18))
                .margin(12)
                .x_label_area_size(36)
                .y_label_area_size(56)
                .build_cartesian_2d(x0..x1, (lo - pad).min(0.0f64.max(lo - pad))..hi + pad)?;
            c.configure_mesh()
                .x_desc("decoder Linear bytes / all-NVFP4")
                .label_style(("sans-serif", 14))
                .draw()?;
            if let Some(t) = target {
                c.draw_series(LineSeries::new([(x0, t), (x1, t)], RED.mix(0.5)))?;
            }
            let mix: Vec<(f64, f64)> = pts
                .iter()
                .filter(|p| p.label.starts_with("mix"))
                .map(|p| (p.ratio, f(p)))
                .collect();
            c.draw_series(LineSeries::new(mix, BLUE.mix(0.6)))?;
            for p in &pts {
                let y = f(p);
                if !y.is_finite() {
                    continue;
                }
                c.draw_series(std::iter::once(Circle::new((p.ratio, y), 5, BLUE.filled())))?;
                c.draw_series(std::iter::once(Text::new(
                    p.label.clone(),
                    (p.ratio + 0.008, y),
                    ("sans-serif", 13),
                )))?;
                if title.starts_with("perplexity") {
                    c.draw_series(std::iter::once(Cross::new(
                        (p.ratio, p.ppl_worst),
                        5,
                        BLACK,
                    )))?;
                }
            }
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
