//! Short factual completions: a prompt set (`prompt<TAB>expected` lines), the words a
//! completion starts with, and how two completions (or a completion and the expected
//! answer) are compared.

use candle_core::{bail, Result};
use std::path::Path;

/// One completion prompt and the answer it expects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    /// Plain text, completed without a chat template.
    pub text: String,
    /// The expected first word(s) of the completion.
    pub expected: String,
}

/// Words of a completion compared between models.
pub const COMPARED_WORDS: usize = 2;

/// Parses a prompt set: one `prompt<TAB>expected` per line; blank lines and lines
/// starting with `#` are skipped. `origin` names the source in errors.
pub fn parse_prompts(text: &str, origin: &str) -> Result<Vec<Prompt>> {
    let mut out = vec![];
    for (i, line) in text.lines().enumerate() {
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((p, e)) = line.split_once('\t') else {
            bail!("{origin}:{}: expected `prompt<TAB>expected`", i + 1);
        };
        if p.trim().is_empty() || words(e, usize::MAX).is_empty() || e.contains('\t') {
            bail!(
                "{origin}:{}: empty prompt or answer, or a second tab",
                i + 1
            );
        }
        out.push(Prompt {
            text: p.trim_end().to_string(),
            expected: e.trim().to_string(),
        });
    }
    if out.is_empty() {
        bail!("{origin}: no prompts");
    }
    Ok(out)
}

/// Reads a prompt set from a file ([`parse_prompts`]).
pub fn load_prompts(path: &Path) -> Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| candle_core::Error::Msg(format!("cannot read {}: {e}", path.display())))?;
    parse_prompts(&text, &path.display().to_string())
}

/// The first `n` words of `text`, normalized: split on whitespace, non-alphanumeric
/// characters trimmed from both ends of each word, lowercased, empty words dropped
/// (`" Paris."` and `"paris"` are the same word; `"H2O,"` is `"h2o"`).
pub fn words(text: &str, n: usize) -> Vec<String> {
    text.split_whitespace()
        .map(|w| {
            w.trim_matches(|c: char| !c.is_alphanumeric())
                .to_lowercase()
        })
        .filter(|w| !w.is_empty())
        .take(n)
        .collect()
}

/// Whether two completions start with the same [`COMPARED_WORDS`] words (a completion
/// with fewer words must match in all it has, and in how many it has).
pub fn same_start(a: &str, b: &str) -> bool {
    words(a, COMPARED_WORDS) == words(b, COMPARED_WORDS)
}

/// Whether a completion gives the expected answer: its first words are the expected
/// words, optionally after one leading article (`a`, `an`, `the`).
pub fn is_correct(completion: &str, expected: &str) -> bool {
    let want = words(expected, usize::MAX);
    let got = words(completion, want.len() + 1);
    if got.len() >= want.len() && got[..want.len()] == want[..] {
        return true;
    }
    matches!(got.first().map(String::as_str), Some("a" | "an" | "the"))
        && got.len() > want.len()
        && got[1..=want.len()] == want[..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_normalized() {
        assert_eq!(words(" Paris. It is", 2), ["paris", "it"]);
        assert_eq!(words("\n\"H2O,\" -- the", 3), ["h2o", "the"]);
        assert_eq!(words("  ", 2), Vec::<String>::new());
        assert_eq!(
            words(" 123,222 square kilometers", 2),
            ["123,222", "square"]
        );
    }

    #[test]
    fn completions_compare_by_their_first_two_words() {
        assert!(same_start(" Paris.", " paris"));
        assert!(same_start(" Paris, the capital", " Paris the city"));
        assert!(!same_start(" Paris, the capital", " Paris is"));
        assert!(!same_start(" Paris", " Paris is"));
        assert!(!same_start(" 123,222 square kilometers", " Paris."));
        assert!(same_start("", "..."));
    }

    #[test]
    fn answers_are_checked_with_an_optional_article() {
        assert!(is_correct(" Paris.", "Paris"));
        assert!(!is_correct(" the planet Jupiter", "Jupiter"));
        assert!(is_correct(" the Pacific Ocean", "Pacific"));
        assert!(is_correct(" New York City", "New York"));
        assert!(!is_correct(" the exoplanet Kepler-10", "Jupiter"));
        assert!(!is_correct("", "Paris"));
        assert!(!is_correct(" the", "Paris"));
    }

    #[test]
    fn prompt_sets_parse_and_bad_lines_are_errors() {
        let p = parse_prompts("# c\n\nThe capital of France is\tParis\nA\tb c\n", "t").unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].text, "The capital of France is");
        assert_eq!(p[0].expected, "Paris");
        assert!(parse_prompts("no tab here\n", "t").is_err());
        assert!(parse_prompts("a\t\n", "t").is_err());
        assert!(parse_prompts("a\tb\tc\n", "t").is_err());
        assert!(parse_prompts("# only a comment\n", "t").is_err());
    }

    #[test]
    fn the_shipped_prompt_sets_parse_and_do_not_overlap() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/prompts");
        let eval = load_prompts(&dir.join("factual_eval.tsv")).unwrap();
        let tune = load_prompts(&dir.join("factual_tune.tsv")).unwrap();
        assert!(eval.len() >= 100, "{}", eval.len());
        assert!(tune.len() >= 30, "{}", tune.len());
        for t in &tune {
            assert!(eval.iter().all(|e| e.text != t.text), "{} in both", t.text);
        }
        let mut seen = std::collections::HashSet::new();
        for e in &eval {
            assert!(seen.insert(&e.text), "{} twice", e.text);
        }
    }
}
