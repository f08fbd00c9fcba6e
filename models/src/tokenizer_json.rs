//! Building a `tokenizers::Tokenizer` from the text of a `tokenizer.json` without letting a
//! malformed file panic inside the `tokenizers` crate.
//!
//! `tokenizers` 0.23 deserializes some components with `expect` (found by the `tokenizer`
//! fuzz target): a JSON syntax error inside the `decoder` value panics in
//! `DecoderWrapper::deserialize` ("Helper"), and a `Precompiled` normalizer whose fields do
//! not parse panics too ("Precompiled"). So the text is parsed into a `serde_json::Value`
//! first (every syntax error becomes our error, and deserializing from a `Value` cannot hit
//! the streaming "Helper" path), `Precompiled` normalizers (SentencePiece-compiled, used by
//! T5-style tokenizers, never by Llama's) are refused, and the `Value` is then deserialized.

use anyhow::{anyhow, bail, Result};
use serde_json::Value;
use tokenizers::Tokenizer;

/// Whether `v` (a normalizer, possibly a `Sequence`) contains a `Precompiled` normalizer.
fn has_precompiled(v: &Value, depth: usize) -> bool {
    if depth > 64 {
        return true; // deeper than any real file: refuse rather than recurse on
    }
    match v {
        Value::Object(o) => {
            o.get("type").and_then(Value::as_str) == Some("Precompiled")
                || o.contains_key("precompiled_charsmap")
                || o.values().any(|x| has_precompiled(x, depth + 1))
        }
        Value::Array(a) => a.iter().any(|x| has_precompiled(x, depth + 1)),
        _ => false,
    }
}

/// Parses the text of a `tokenizer.json` (`origin` names it in errors).
pub fn parse_tokenizer(text: &str, origin: &str) -> Result<Tokenizer> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| anyhow!("{origin}: invalid JSON: {e}"))?;
    if !v.is_object() {
        bail!("{origin}: expected a JSON object");
    }
    if v.get("normalizer").is_some_and(|n| has_precompiled(n, 0)) {
        bail!("{origin}: a `Precompiled` (SentencePiece-compiled) normalizer is not supported");
    }
    serde_json::from_value(v).map_err(|e| anyhow!("{origin}: {e}"))
}
