//! The tokenizer of a model folder (`tokenizer.json`), its end-of-generation ids and its
//! chat template, rendered in Rust for the template families we recognize (ChatML,
//! Llama 3, Llama 2) — no Jinja engine.

use crate::config::{ids_of, LlamaConfig};
use anyhow::{anyhow, bail, Context, Result};
use candle_fp4::checkpoint::ModelFolder;
use serde_json::Value;
use std::path::Path;
use tokenizers::Tokenizer;

/// A recognized chat template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatTemplate {
    /// `<|im_start|>role\n…<|im_end|>\n` (SmolLM2, Qwen, …), with the system prompt the
    /// template inserts when none is given.
    ChatMl {
        /// The system message used when the caller gives none.
        default_system: Option<String>,
    },
    /// `<|start_header_id|>role<|end_header_id|>\n\n…<|eot_id|>`.
    Llama3,
    /// `[INST] <<SYS>>…<</SYS>> … [/INST]`.
    Llama2,
}

impl ChatTemplate {
    /// One user turn (after an optional system turn) up to where the assistant's answer
    /// starts; `bos` is the BOS token's text (Llama 2 / 3 templates start with it).
    pub fn render(&self, bos: &str, user: &str, system: Option<&str>) -> String {
        match self {
            ChatTemplate::ChatMl { default_system } => {
                let mut s = String::new();
                if let Some(sys) = system.or(default_system.as_deref()) {
                    s += &format!("<|im_start|>system\n{sys}<|im_end|>\n");
                }
                s + &format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
            }
            ChatTemplate::Llama3 => {
                let mut s = bos.to_string();
                if let Some(sys) = system {
                    s += &format!("<|start_header_id|>system<|end_header_id|>\n\n{sys}<|eot_id|>");
                }
                s + &format!(
                    "<|start_header_id|>user<|end_header_id|>\n\n{user}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
                )
            }
            ChatTemplate::Llama2 => match system {
                Some(sys) => format!("{bos}[INST] <<SYS>>\n{sys}\n<</SYS>>\n\n{user} [/INST]"),
                None => format!("{bos}[INST] {user} [/INST]"),
            },
        }
    }

    /// Recognizes the family of a Jinja chat template.
    pub fn detect(template: &str) -> Option<Self> {
        if template.contains("<|im_start|>") {
            Some(Self::ChatMl {
                default_system: chatml_default_system(template),
            })
        } else if template.contains("<|start_header_id|>") {
            Some(Self::Llama3)
        } else if template.contains("[INST]") {
            Some(Self::Llama2)
        } else {
            None
        }
    }
}

/// The literal system message a ChatML template inserts when the conversation has none
/// (`'<|im_start|>system\nYou are …<|im_end|>\n'`), if it has one.
fn chatml_default_system(t: &str) -> Option<String> {
    const HEAD: &str = "<|im_start|>system";
    let mut rest = t;
    while let Some(i) = rest.find(HEAD) {
        rest = &rest[i + HEAD.len()..];
        let body = rest.strip_prefix('\n').or_else(|| rest.strip_prefix("\\n"));
        if let Some(body) = body {
            if let Some(end) = body.find("<|im_end|>") {
                let msg = &body[..end];
                let literal = !msg.is_empty() && !msg.contains(['{', '}', '\'', '"', '+', '\n']);
                if literal {
                    return Some(msg.to_string());
                }
            }
        }
    }
    None
}

/// A model's tokenizer with what generation needs.
pub struct TextTokenizer {
    tokenizer: Tokenizer,
    /// Ids that end generation.
    pub eos_ids: Vec<u32>,
    /// The chat template family, if the model has a template we recognize.
    pub template: Option<ChatTemplate>,
    /// The raw template text had one we do not recognize.
    pub unknown_template: bool,
    bos_text: Option<String>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("eos_ids", &self.eos_ids)
            .field("template", &self.template)
            .finish()
    }
}

fn parse_json(text: &str, origin: &str) -> Result<Value> {
    serde_json::from_str(text).with_context(|| format!("{origin}: invalid JSON"))
}

/// A special token's text from `tokenizer_config.json` (a string or `{"content": …}`).
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

impl TextTokenizer {
    /// Reads `dir/tokenizer.json` (required), `tokenizer_config.json`,
    /// `chat_template.jinja` and `generation_config.json` (optional), through
    /// [`ModelFolder`] (regular files inside the folder).
    pub fn from_dir(dir: impl AsRef<Path>, cfg: &LlamaConfig) -> Result<Self> {
        let dir = dir.as_ref();
        let folder = ModelFolder::new(dir)?;
        let Some((_, tokenizer)) = folder.read_text("tokenizer.json")? else {
            bail!("{}: no tokenizer.json in the model folder", dir.display());
        };
        let text =
            |name: &str| -> Result<Option<String>> { Ok(folder.read_text(name)?.map(|(_, t)| t)) };
        Self::from_parts(
            &tokenizer,
            text("tokenizer_config.json")?.as_deref(),
            text("chat_template.jinja")?.as_deref(),
            text("generation_config.json")?.as_deref(),
            cfg,
            &dir.display().to_string(),
        )
    }

    /// Builds the tokenizer from the texts of `tokenizer.json` and the optional
    /// `tokenizer_config.json`, `chat_template.jinja` and `generation_config.json`;
    /// `origin` names the folder in errors. Reads nothing from disk.
    pub fn from_parts(
        tokenizer_json: &str,
        tokenizer_config: Option<&str>,
        chat_template: Option<&str>,
        generation_config: Option<&str>,
        cfg: &LlamaConfig,
        origin: &str,
    ) -> Result<Self> {
        let tokenizer = crate::tokenizer_json::parse_tokenizer(
            tokenizer_json,
            &format!("{origin}/tokenizer.json"),
        )?;
        let tc = match tokenizer_config {
            Some(t) => parse_json(t, &format!("{origin}/tokenizer_config.json"))?,
            None => Value::Null,
        };
        let mut template_text: Option<String> = match tc.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(a)) => a
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .or(a.first())
                .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
            _ => None,
        };
        if template_text.is_none() {
            template_text = chat_template.map(str::to_string);
        }
        let template = template_text.as_deref().and_then(ChatTemplate::detect);
        let unknown_template = template_text.is_some() && template.is_none();

        let mut eos_ids = cfg.eos_token_ids.clone();
        if let Some(g) = generation_config {
            let gorigin = format!("{origin}/generation_config.json");
            if let Value::Object(g) = parse_json(g, &gorigin)? {
                eos_ids.extend(ids_of(&g, "eos_token_id", &gorigin)?);
            }
        }
        let mut add_text = |t: Option<String>| {
            if let Some(id) = t.and_then(|t| tokenizer.token_to_id(&t)) {
                eos_ids.push(id);
            }
        };
        add_text(token_text(tc.get("eos_token")));
        match template {
            Some(ChatTemplate::ChatMl { .. }) => add_text(Some("<|im_end|>".into())),
            Some(ChatTemplate::Llama3) => add_text(Some("<|eot_id|>".into())),
            _ => {}
        }
        let mut seen = std::collections::HashSet::new();
        eos_ids.retain(|x| seen.insert(*x));
        let bos_text = token_text(tc.get("bos_token"))
            .or_else(|| cfg.bos_token_id.and_then(|b| tokenizer.id_to_token(b)));
        Ok(Self {
            tokenizer,
            eos_ids,
            template,
            unknown_template,
            bos_text,
        })
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Encodes text; `add_special` lets `tokenizer.json`'s post-processor add BOS etc.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        Ok(self
            .tokenizer
            .encode(text, add_special)
            .map_err(|e| anyhow!("tokenizer: {e}"))?
            .get_ids()
            .to_vec())
    }

    /// Decodes token ids to text, skipping special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| anyhow!("tokenizer: {e}"))
    }

    /// The prompt as the chat template renders one user turn (plus a system turn when
    /// given, or the template's default), ending where the assistant's answer starts.
    /// `None` when the model has no recognized template.
    pub fn render_chat(&self, user: &str, system: Option<&str>) -> Option<String> {
        let bos = self.bos_text.as_deref().unwrap_or_default();
        Some(self.template.as_ref()?.render(bos, user, system))
    }

    /// Token ids of a prompt: through the chat template unless `raw` (or the model has
    /// none we recognize), else as plain text.
    pub fn prompt_ids(&self, prompt: &str, raw: bool, system: Option<&str>) -> Result<Vec<u32>> {
        match (raw, self.render_chat(prompt, system)) {
            (false, Some(text)) => self.encode(&text, false),
            _ => self.encode(prompt, true),
        }
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_template_families() {
        // SmolLM2's template (newlines as real characters, as in its GGUF metadata).
        let smol = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}";
        assert_eq!(
            ChatTemplate::detect(smol),
            Some(ChatTemplate::ChatMl {
                default_system: Some(
                    "You are a helpful AI assistant named SmolLM, trained by Hugging Face".into()
                )
            })
        );
        // Escaped `\n` inside Jinja strings, and a template without a default system turn.
        let escaped = r"{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}";
        assert_eq!(
            ChatTemplate::detect(escaped),
            Some(ChatTemplate::ChatMl {
                default_system: Some("Be brief.".into())
            })
        );
        let qwen_like = "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}";
        assert_eq!(
            ChatTemplate::detect(qwen_like),
            Some(ChatTemplate::ChatMl {
                default_system: None
            })
        );
        let llama3 = "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}";
        assert_eq!(ChatTemplate::detect(llama3), Some(ChatTemplate::Llama3));
        assert_eq!(
            ChatTemplate::detect("{{ bos_token + '[INST] ' + content + ' [/INST]' }}"),
            Some(ChatTemplate::Llama2)
        );
        assert_eq!(ChatTemplate::detect("{{ messages }}"), None);
    }

    #[test]
    fn renders_one_user_turn() {
        let c = ChatTemplate::ChatMl {
            default_system: Some("Be kind.".into()),
        };
        assert_eq!(
            c.render("", "hi", None),
            "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert!(c
            .render("", "hi", Some("Be short."))
            .starts_with("<|im_start|>system\nBe short.<|im_end|>"));
        assert_eq!(
            ChatTemplate::Llama3.render("<|begin_of_text|>", "hi", Some("S")),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        assert_eq!(
            ChatTemplate::Llama2.render("<s>", "hi", None),
            "<s>[INST] hi [/INST]"
        );
        assert_eq!(
            ChatTemplate::Llama2.render("<s>", "hi", Some("S")),
            "<s>[INST] <<SYS>>\nS\n<</SYS>>\n\nhi [/INST]"
        );
    }
}
