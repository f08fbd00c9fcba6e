//! `model.safetensors.index.json`: which shard holds which tensor, parsed from bytes.

use super::folder::check_file_name;
use crate::error::CheckpointError;
use serde_json::Value;

/// A parsed `model.safetensors.index.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardIndex {
    /// The shard file names, in order of first appearance in `weight_map`; each is a plain
    /// file name (no separator, not `..`, not absolute).
    pub files: Vec<String>,
    /// `(tensor, index into files)` for every `weight_map` entry, in file order.
    pub weight_map: Vec<(String, usize)>,
}

impl ShardIndex {
    /// Parses the bytes of an index file; `origin` names it in errors. Checks that it is a
    /// JSON object with a non-empty `weight_map` object whose values are plain file names
    /// ([`check_file_name`]). Reads nothing from disk.
    pub fn parse(bytes: &[u8], origin: &str) -> Result<Self, CheckpointError> {
        let invalid = |reason: String| CheckpointError::InvalidIndex {
            file: origin.to_string(),
            reason,
        };
        let text =
            std::str::from_utf8(bytes).map_err(|e| invalid(format!("not UTF-8 text: {e}")))?;
        let json: Value =
            serde_json::from_str(text).map_err(|e| invalid(format!("invalid JSON: {e}")))?;
        let Some(map) = json.get("weight_map") else {
            return Err(invalid("no `weight_map` object".into()));
        };
        let Some(map) = map.as_object() else {
            return Err(invalid(format!(
                "`weight_map` must be an object, got {}",
                short(map)
            )));
        };
        let mut files: Vec<String> = vec![];
        let mut weight_map = Vec::with_capacity(map.len());
        for (tensor, file) in map {
            let Some(file) = file.as_str() else {
                return Err(invalid(format!(
                    "weight_map[`{tensor}`] must be a file name, got {}",
                    short(file)
                )));
            };
            check_file_name(&format!("{origin}: weight_map[`{tensor}`]"), file)?;
            let i = match files.iter().position(|f| f == file) {
                Some(i) => i,
                None => {
                    files.push(file.to_string());
                    files.len() - 1
                }
            };
            weight_map.push((tensor.clone(), i));
        }
        if files.is_empty() {
            return Err(invalid("`weight_map` lists no files".into()));
        }
        Ok(Self { files, weight_map })
    }
}

/// A JSON value for an error message, cut to 80 characters.
fn short(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s,
    }
}
