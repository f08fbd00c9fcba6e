//! Model-level evaluation: a quantized model against its reference over texts (windows
//! scored position by position, [`super::metrics`]), greedy completions of short prompts
//! ([`super::prompts`]) and decode speed.
//!
//! (Errors are `anyhow`, as everything that drives a [`Llama`] in this crate.)

use super::metrics::{argmax, log_softmax, TextSums};
use crate::llama::Llama;
use crate::tokenizer::TextTokenizer;
use anyhow::{bail, Result};
use std::time::Instant;

/// Shortest final window still scored (a text rarely ends on a window boundary).
pub const MIN_WINDOW: usize = 32;

/// The scoring windows of `ids`: `ids[skip..]` cut into windows of `ctx` tokens, the
/// last one kept if it has at least [`MIN_WINDOW`] tokens.
pub fn windows(ids: &[u32], ctx: usize, skip: usize) -> Result<Vec<&[u32]>> {
    if ctx < 2 {
        bail!("windows of {ctx} tokens: need at least 2");
    }
    if skip >= ids.len() {
        bail!(
            "skipping {skip} of {} tokens leaves nothing to score",
            ids.len()
        );
    }
    Ok(ids[skip..]
        .chunks(ctx)
        .filter(|w| w.len() >= MIN_WINDOW.min(ctx))
        .collect())
}

/// Scores `windows` with the reference and every model: in each window (from an empty
/// KV cache) every position but the last predicts the next token. Returns the
/// reference's own sums (its NLL; KL 0, agreement 1) and one [`TextSums`] per model.
pub fn score_windows(
    reference: &mut Llama,
    models: &mut [&mut Llama],
    windows: &[&[u32]],
    on_window: &mut dyn FnMut(usize),
) -> Result<(TextSums, Vec<TextSums>)> {
    let mut ref_sums = TextSums::default();
    let mut sums = vec![TextSums::default(); models.len()];
    for (wi, w) in windows.iter().enumerate() {
        if w.len() < 2 {
            continue;
        }
        let r = reference.forward_all(w, 0)?.to_vec2::<f32>()?;
        let rows: Vec<(Vec<f64>, usize)> = r[..w.len() - 1]
            .iter()
            .map(|row| Ok((log_softmax(row)?, argmax(row))))
            .collect::<Result<_>>()?;
        for ((lp, top), (row, &t)) in rows.iter().zip(r.iter().zip(&w[1..])) {
            ref_sums.add_with_reference(lp, *top, row, t)?;
        }
        drop(r);
        for (m, s) in models.iter_mut().zip(sums.iter_mut()) {
            let q = m.forward_all(w, 0)?.to_vec2::<f32>()?;
            for ((lp, top), (row, &t)) in rows.iter().zip(q.iter().zip(&w[1..])) {
                s.add_with_reference(lp, *top, row, t)?;
            }
        }
        on_window(wi);
    }
    Ok((ref_sums, sums))
}

/// Greedy completion of `prompt` (token ids) by `model`: up to `max_new` tokens, stopping
/// at an end-of-generation token. Returns the generated ids.
pub fn greedy(
    model: &mut Llama,
    tok: &TextTokenizer,
    prompt: &[u32],
    max_new: usize,
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        bail!("greedy: empty prompt");
    }
    let mut out = vec![];
    let mut logits = model.forward(prompt, 0)?.to_vec1::<f32>()?;
    while out.len() < max_new {
        let next = argmax(&logits) as u32;
        if tok.is_eos(next) {
            break;
        }
        out.push(next);
        if out.len() == max_new || prompt.len() + out.len() >= model.max_seq_len() {
            break;
        }
        logits = model
            .forward(&[next], prompt.len() + out.len() - 1)?
            .to_vec1::<f32>()?;
    }
    Ok(out)
}

/// Decode speed: after a prefill of `prompt`, `steps` single-token greedy steps (end
/// tokens ignored), in tokens per second.
pub fn decode_speed(model: &mut Llama, prompt: &[u32], steps: usize) -> Result<f64> {
    if prompt.is_empty() || steps == 0 {
        bail!("decode_speed: needs a prompt and at least one step");
    }
    if prompt.len() + steps > model.max_seq_len() {
        bail!(
            "decode_speed: {} + {steps} tokens exceed the context of {}",
            prompt.len(),
            model.max_seq_len()
        );
    }
    let logits = model.forward(prompt, 0)?.to_vec1::<f32>()?;
    let mut next = argmax(&logits) as u32;
    let t = Instant::now();
    for s in 0..steps {
        let l = model.forward(&[next], prompt.len() + s)?.to_vec1::<f32>()?;
        next = argmax(&l) as u32;
    }
    Ok(steps as f64 / t.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_cover_the_text_after_the_skip() {
        let ids: Vec<u32> = (0..1100).collect();
        let w = windows(&ids, 512, 0).unwrap();
        assert_eq!(
            w.iter().map(|w| w.len()).collect::<Vec<_>>(),
            [512, 512, 76]
        );
        let w = windows(&ids, 512, 100).unwrap();
        assert_eq!(w[0][0], 100);
        assert_eq!(w.len(), 2); // 512 + 488
        let w = windows(&ids, 512, 1080).unwrap();
        assert!(w.is_empty()); // 20 tokens: below MIN_WINDOW
        assert!(windows(&ids, 1, 0).is_err());
        assert!(windows(&ids, 512, 1100).is_err());
    }
}
