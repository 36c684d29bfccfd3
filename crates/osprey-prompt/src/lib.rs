//! From conversations to token ids and back: the model's `tokenizer.json` (through the
//! `tokenizers` crate), its Jinja chat template (through minijinja with Python compatibility), the
//! stop ids of `generation_config.json`, and incremental detokenisation for streaming.

mod template;

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;
use tokenizers::Tokenizer;

pub use template::ChatTemplate;

/// Options of one chat rendering.
#[derive(Clone, Debug, Default)]
pub struct ChatOptions {
    pub add_generation_prompt: bool,
    /// `tools` list (OpenAI function objects), if any.
    pub tools: Option<Value>,
    /// Extra template variables (`enable_thinking`, `preserve_thinking`, ...).
    pub kwargs: serde_json::Map<String, Value>,
    /// End the prompt inside the final message, so the model continues it (an assistant reply
    /// "prefilled" by the caller), as transformers' `continue_final_message` does.
    pub continue_final_message: bool,
}

/// Generation defaults read from `generation_config.json`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

/// The tokenizer's named special tokens (`tokenizer_config.json`), for clients that ask the
/// server about its tokenizer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpecialTokens {
    pub bos: Option<String>,
    pub eos: Option<String>,
    pub pad: Option<String>,
}

pub struct PromptFormat {
    pub tokenizer: Tokenizer,
    pub special: SpecialTokens,
    pub template: ChatTemplate,
    /// Token ids that end generation.
    pub stop_ids: Vec<u32>,
    pub defaults: GenerationDefaults,
    /// Ids the tokenizer can produce; higher rows of the embedding are padding.
    pub vocab_size: usize,
    /// Tokens of `<|im_start|>assistant\n`, the opening of an assistant turn.
    assistant_header: Vec<u32>,
    user_header: Vec<u32>,
}

impl PromptFormat {
    /// Reads tokenizer.json, the chat template (chat_template.jinja, or tokenizer_config.json's
    /// `chat_template`) and generation_config.json from a model directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| anyhow::anyhow!("cannot load {}: {e}", tok_path.display()))?;
        let tokenizer_config = tokenizer_config(dir)?;
        let template = ChatTemplate::from_dir(dir, &tokenizer_config)?;
        let vocab_size = tokenizer.get_vocab_size(true);

        let mut stop_ids = Vec::new();
        let mut defaults = GenerationDefaults::default();
        let gen_path = dir.join("generation_config.json");
        if gen_path.exists() {
            let text = std::fs::read_to_string(&gen_path)?;
            let g: Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", gen_path.display()))?;
            match g.get("eos_token_id") {
                Some(Value::Number(n)) => stop_ids.extend(n.as_u64().map(|x| x as u32)),
                Some(Value::Array(a)) => {
                    stop_ids.extend(a.iter().filter_map(|v| v.as_u64()).map(|x| x as u32))
                }
                _ => {}
            }
            let f = |k: &str| g.get(k).and_then(Value::as_f64).map(|x| x as f32);
            defaults = GenerationDefaults {
                temperature: f("temperature"),
                top_k: g.get("top_k").and_then(Value::as_u64).map(|x| x as usize),
                top_p: f("top_p"),
                min_p: f("min_p"),
                repetition_penalty: f("repetition_penalty"),
            };
        }
        // the chat template's end-of-turn token always stops generation
        for special in ["<|im_end|>", "<|endoftext|>"] {
            if let Some(id) = tokenizer.token_to_id(special) {
                if !stop_ids.contains(&id) {
                    stop_ids.push(id);
                }
            }
        }
        let header = |text: &str| -> Result<Vec<u32>> {
            Ok(tokenizer
                .encode(text, false)
                .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?
                .get_ids()
                .to_vec())
        };
        let special = special_tokens(&tokenizer_config, &tokenizer, &stop_ids);
        let assistant_header = header("<|im_start|>assistant\n")?;
        let user_header = header("<|im_start|>user\n")?;
        Ok(PromptFormat {
            tokenizer,
            special,
            template,
            stop_ids,
            defaults,
            vocab_size,
            assistant_header,
            user_header,
        })
    }

    /// Text to ids; special-token text such as `<|im_start|>` maps to its id.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Ids to text (special tokens skipped, tags like `<think>` kept).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))
    }

    /// Renders a conversation with the chat template.
    pub fn render(&self, messages: &Value, opts: &ChatOptions) -> Result<String> {
        if !messages.is_array() {
            bail!("messages must be a list");
        }
        self.template.render(messages, opts)
    }

    /// Renders and encodes a conversation.
    pub fn encode_chat(&self, messages: &Value, opts: &ChatOptions) -> Result<Vec<u32>> {
        self.encode(&self.render(messages, opts)?)
    }

    /// Position just after the last `<|im_start|>assistant\n` in `ids`: where the rendering of the
    /// next turn stops matching this one (earlier turns' reasoning is dropped from history), so
    /// the place to snapshot the session state for reuse.
    pub fn assistant_turn_start(&self, ids: &[u32]) -> Option<usize> {
        let h = &self.assistant_header;
        ids.windows(h.len())
            .rposition(|w| w == h.as_slice())
            .map(|i| i + h.len())
    }

    /// Position of the first `<|im_start|>user\n` in `ids` when something comes before it: the
    /// end of the system prompt and tool definitions, which new conversations of one agent share.
    pub fn first_user_turn_start(&self, ids: &[u32]) -> Option<usize> {
        let h = &self.user_header;
        ids.windows(h.len())
            .position(|w| w == h.as_slice())
            .filter(|&i| i > 0)
    }

    /// Where to snapshot a chat prompt's state for reuse, ascending: the end of a system part of
    /// at least `min_shared` tokens (other conversations start with it), and the start of the
    /// reply's turn (the conversation's next turn resumes there).
    pub fn branch_points(&self, ids: &[u32], min_shared: usize) -> Vec<usize> {
        let shared = self
            .first_user_turn_start(ids)
            .filter(|&at| at >= min_shared);
        let mut points: Vec<usize> = shared
            .into_iter()
            .chain(self.assistant_turn_start(ids))
            .collect();
        points.dedup();
        points
    }

    pub fn incremental(&self) -> IncrementalDecoder<'_> {
        IncrementalDecoder {
            tok: &self.tokenizer,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }
}

/// `tokenizer_config.json`, parsed; Null when the directory has none.
fn tokenizer_config(dir: &Path) -> Result<Value> {
    let path = dir.join("tokenizer_config.json");
    match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display())),
        Err(_) => Ok(Value::Null),
    }
}

/// `tokenizer_config.json`'s bos/eos/pad tokens (a string, or an object with `content`); without
/// the file, or its eos, the first stop id's token is the eos.
fn special_tokens(config: &Value, tokenizer: &Tokenizer, stop_ids: &[u32]) -> SpecialTokens {
    let named = |key: &str| match &config[key] {
        Value::String(s) => Some(s.clone()),
        v => v["content"].as_str().map(String::from),
    };
    SpecialTokens {
        bos: named("bos_token"),
        eos: named("eos_token")
            .or_else(|| stop_ids.first().and_then(|&id| tokenizer.id_to_token(id))),
        pad: named("pad_token"),
    }
}

/// Streams text from tokens: a token's text is released once it is complete UTF-8 (byte-level
/// BPE may split a character across tokens), decoding only a short window each time.
pub struct IncrementalDecoder<'a> {
    tok: &'a Tokenizer,
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl IncrementalDecoder<'_> {
    fn text(&self, from: usize, to: usize) -> String {
        self.tok
            .decode(&self.ids[from..to], true)
            .unwrap_or_default()
    }

    pub fn push(&mut self, id: u32) -> String {
        self.ids.push(id);
        let before = self.text(self.prefix, self.read);
        let after = self.text(self.prefix, self.ids.len());
        if after.len() > before.len()
            && !after.ends_with('\u{FFFD}')
            && after.is_char_boundary(before.len())
        {
            self.prefix = self.read;
            self.read = self.ids.len();
            after[before.len()..].to_string()
        } else {
            String::new()
        }
    }

    pub fn flush(&mut self) -> String {
        let before = self.text(self.prefix, self.read);
        let after = self.text(self.prefix, self.ids.len());
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        after.get(before.len()..).unwrap_or_default().to_string()
    }
}
