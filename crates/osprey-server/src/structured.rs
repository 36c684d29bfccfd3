//! Grammars on the reply, by masking each step's logits with llguidance (the grammar engine of
//! mistral.rs and of vLLM's `guidance` backend): before a token is sampled, every token the
//! grammar cannot take next gets -inf. Two uses: structured outputs (`response_format`
//! `{"type": "json_object"}` or `{"type": "json_schema", ...}` hold the answer, after any
//! reasoning, to JSON matching the schema) and forced tool calls (a call that `tool_choice`
//! demands is held to the tools' schemas after its injected opening).
//!
//! The vocabulary is indexed once per server (a byte trie of the tokenizer's 248K tokens); each
//! request compiles its grammar into a matcher that follows the reply token by token. Every added
//! token (`<|im_end|>`, and also `<think>` and `<tool_call>`) is marked special, so a grammar
//! spells text with ordinary tokens and names a special token only where it means it (a call's
//! closing `</tool_call>`); the end of turn is allowed exactly when the grammar is complete.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie, TokenId};
use llguidance::{Matcher, ParserFactory};
use osprey_prompt::PromptFormat;
use serde_json::{json, Value};
use tokenizers::decoders::DecoderWrapper;
use tokenizers::Tokenizer;

/// What a request's `response_format` asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum ResponseFormat {
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON matching `schema`; `strict`: every keyword must be enforceable (otherwise unknown
    /// keywords are ignored).
    JsonSchema {
        schema: Value,
        strict: bool,
    },
}

impl ResponseFormat {
    /// Reads an OpenAI `response_format` value.
    pub fn parse(v: &Value) -> Result<Self, String> {
        let kind = v.get("type").and_then(Value::as_str).ok_or(
            "'response_format' needs a 'type': \"text\", \"json_object\" or \"json_schema\"",
        )?;
        match kind {
            "text" => Ok(ResponseFormat::Text),
            "json_object" => Ok(ResponseFormat::JsonObject),
            "json_schema" => {
                let spec = v
                    .get("json_schema")
                    .and_then(Value::as_object)
                    .ok_or("response_format 'json_schema' needs a 'json_schema' object")?;
                let schema = match spec.get("schema") {
                    None => json!({}),
                    Some(s @ Value::Object(_)) => s.clone(),
                    Some(_) => return Err("'json_schema.schema' must be an object".into()),
                };
                let strict = match spec.get("strict") {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(b)) => *b,
                    Some(_) => return Err("'json_schema.strict' must be a boolean".into()),
                };
                Ok(ResponseFormat::JsonSchema { schema, strict })
            }
            other => Err(format!(
                "response_format type \"{other}\" is not supported (expected text, json_object or json_schema)"
            )),
        }
    }

    /// The JSON schema to enforce, with the separators the answer uses (`", "` and `": "`, as
    /// `json.dumps` writes them) unless the schema sets its own `x-guidance`: no free runs of
    /// whitespace for a model to loop in.
    fn schema(&self) -> Option<Value> {
        let (mut schema, strict) = match self {
            ResponseFormat::Text => return None,
            ResponseFormat::JsonObject => (json!({"type": "object"}), false),
            ResponseFormat::JsonSchema { schema, strict } => (schema.clone(), *strict),
        };
        if let Some(obj) = schema.as_object_mut() {
            obj.entry("x-guidance")
                .or_insert_with(|| separators(!strict));
        }
        Some(schema)
    }
}

/// llguidance's JSON options: `json.dumps`'s separators, no free whitespace, and with `lenient`
/// keywords it cannot enforce ignored rather than refused.
fn separators(lenient: bool) -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": lenient})
}

/// The vocabulary indexed for grammars: built once, shared by every request.
pub struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    pub fn new(format: &PromptFormat) -> Result<Self> {
        let words = token_bytes(&format.tokenizer)?;
        let end_of_turn = format
            .tokenizer
            .token_to_id("<|im_end|>")
            .ok_or_else(|| anyhow!("the tokenizer has no <|im_end|> token"))?;
        let info = TokRxInfo::new(words.len() as u32, end_of_turn);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// A constraint for one reply, or None for plain text. An error names what in the schema
    /// could not be compiled.
    pub fn constraint(&self, format: &ResponseFormat) -> Result<Option<Constraint>> {
        let Some(schema) = format.schema() else {
            return Ok(None);
        };
        self.compile(TopLevelGrammar::from_json_schema(schema))
            .map(Some)
    }

    /// A grammar made into a reply's matcher; an error names what could not be compiled.
    fn compile(&self, grammar: TopLevelGrammar) -> Result<Constraint> {
        let matcher = Matcher::new(Ok(self.factory.create_parser(grammar)?));
        match matcher.get_error() {
            Some(e) => bail!("{e}"),
            None => Ok(Constraint { matcher }),
        }
    }
}

/// Each token's bytes, for the trie: a byte-level BPE token's characters mapped back to bytes
/// (GPT-2's alphabet: the printable bytes stand for themselves, the other 68 for U+0100 onwards
/// in byte order); an added token's text behind the special marker. (Read from the loaded
/// tokenizer: parsing its 15 MB JSON again held ~200 MB.)
fn token_bytes(tokenizer: &Tokenizer) -> Result<Vec<Vec<u8>>> {
    if !matches!(tokenizer.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
        bail!("structured outputs need a byte-level BPE tokenizer");
    }
    let mut byte_of = HashMap::with_capacity(256);
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        let c = if matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF) {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(next - 1).context("byte-level alphabet")?
        };
        byte_of.insert(c, b);
    }
    let added = tokenizer.get_added_tokens_decoder();
    let vocab = tokenizer.get_vocab(true);
    let mut words = vec![Vec::new(); vocab.values().max().map_or(0, |&m| m as usize + 1)];
    for (text, id) in vocab {
        words[id as usize] = if added.contains_key(&id) {
            [&[TokTrie::SPECIAL_TOKEN_MARKER], text.as_bytes()].concat()
        } else {
            text.chars()
                .map(|c| byte_of.get(&c).copied())
                .collect::<Option<Vec<u8>>>()
                .with_context(|| {
                    format!("token {id} ({text:?}) is not in the byte-level alphabet")
                })?
        };
    }
    Ok(words)
}

/// How a forced tool call continues after the opening the server injects (tool_choice
/// "required": `<tool_call>\n<function=`; a named function: also its name and `>\n`).
pub enum ForcedCall<'a> {
    AnyOf(&'a Value),
    Named(&'a Value, &'a str),
}

impl Grammars {
    /// A constraint holding a forced tool call to the tools' schemas: a function of the list
    /// (for "required"), then its parameters in the schema's order (the required ones, and each
    /// optional one or not), each value typed: strings as free text up to the closing tag (or
    /// one of their `enum`), other types as JSON of their schema; then the call's closing tags.
    /// None when a schema is beyond this (a `$ref`, say): the call is then left free as before.
    pub fn tool_call(&self, forced: ForcedCall) -> Option<Constraint> {
        self.compile(TopLevelGrammar::from_lark(tool_call_lark(forced)?))
            .ok()
    }
}

/// A Lark string literal (JSON's escaping is Lark's).
fn lit(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// The Lark rules of one function's parameters and closing tags, named `body_{f}`.
fn function_lark(f: usize, function: &Value, rules: &mut Vec<String>) -> Option<()> {
    let params = &function["parameters"];
    let required: Vec<&str> = params["required"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let mut body = Vec::new();
    for (k, (name, schema)) in params["properties"]
        .as_object()
        .into_iter()
        .flatten()
        .enumerate()
    {
        if schema.get("$ref").is_some() {
            return None;
        }
        let open = lit(&format!("<parameter={name}>\n"));
        let value = format!("v_{f}_{k}");
        let strings: Option<Vec<String>> = schema["enum"]
            .as_array()
            .and_then(|e| e.iter().map(|v| v.as_str().map(lit)).collect());
        match (schema["type"].as_str(), strings) {
            (Some("string") | None, Some(choices)) if !choices.is_empty() => rules.push(format!(
                "{value}: ({}) \"\\n</parameter>\\n\"",
                choices.join(" | ")
            )),
            (Some("string") | None, _) => {
                rules.push(format!("{value}[suffix=\"\\n</parameter>\\n\"]: /(?s:.*)/"))
            }
            (Some(_), _) => {
                let mut schema = schema.clone();
                schema
                    .as_object_mut()?
                    .insert("x-guidance".into(), separators(false));
                rules.push(format!("j_{f}_{k}: %json {schema}"));
                rules.push(format!("{value}: j_{f}_{k} \"\\n</parameter>\\n\""));
            }
        }
        rules.push(format!("p_{f}_{k}: {open} {value}"));
        let optional = if required.contains(&name.as_str()) {
            ""
        } else {
            "?"
        };
        body.push(format!("p_{f}_{k}{optional}"));
    }
    rules.push(format!(
        "body_{f}: {} \"</function>\\n\" </tool_call>",
        body.join(" ")
    ));
    Some(())
}

fn tool_call_lark(forced: ForcedCall) -> Option<String> {
    let mut rules = Vec::new();
    let tools = match forced {
        ForcedCall::AnyOf(tools) | ForcedCall::Named(tools, _) => tools.as_array()?,
    };
    let mut starts = Vec::new();
    for (f, t) in tools.iter().enumerate() {
        let name = t["function"]["name"].as_str()?;
        match forced {
            ForcedCall::Named(_, wanted) if wanted != name => continue,
            ForcedCall::Named(..) => starts.push(format!("body_{f}")),
            ForcedCall::AnyOf(_) => {
                rules.push(format!("call_{f}: {} body_{f}", lit(&format!("{name}>\n"))));
                starts.push(format!("call_{f}"));
            }
        }
        function_lark(f, &t["function"], &mut rules)?;
    }
    if starts.is_empty() {
        return None;
    }
    rules.insert(0, format!("start: {}", starts.join(" | ")));
    Some(rules.join("\n"))
}

/// One reply's grammar state.
pub struct Constraint {
    matcher: Matcher,
}

impl Clone for Constraint {
    /// An independent copy of the state (for another reply from the same point: a request's
    /// `n` choices); the grammar's compiled tables are shared.
    fn clone(&self) -> Self {
        Constraint {
            matcher: self.matcher.deep_clone(),
        }
    }
}

impl Constraint {
    /// `logits` with every token the grammar cannot take next at -inf.
    pub fn mask(&mut self, logits: &[f32]) -> Result<Vec<f32>> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| anyhow!("structured output: {e}"))?;
        let mut masked = vec![f32::NEG_INFINITY; logits.len()];
        let mut any = false;
        allowed.iter_set_entries(|i| {
            if let Some(&l) = logits.get(i) {
                masked[i] = l;
                any = true;
            }
        });
        if !any {
            bail!("structured output: the grammar allows no token of the vocabulary here");
        }
        Ok(masked)
    }

    /// Follows the reply's next token.
    pub fn advance(&mut self, token: u32) -> Result<()> {
        self.matcher
            .consume_token(token as TokenId)
            .map_err(|e| anyhow!("structured output: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::sync::OnceLock;

    fn format() -> &'static PromptFormat {
        static F: OnceLock<PromptFormat> = OnceLock::new();
        F.get_or_init(|| {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/qwen3.6-35b-a3b");
            PromptFormat::from_dir(&dir).unwrap()
        })
    }

    fn grammars() -> &'static Grammars {
        static G: OnceLock<Grammars> = OnceLock::new();
        G.get_or_init(|| Grammars::new(format()).unwrap())
    }

    /// Decodes under `rf` with a stand-in model: fixed pseudo-random logits each step, the best
    /// allowed token taken, until the end of turn (or `limit` tokens). Returns the text and
    /// whether it ended with the end of turn.
    fn run(rf: &ResponseFormat, seed: u64, limit: usize) -> (String, bool) {
        run_with(
            grammars().constraint(rf).unwrap().unwrap(),
            seed,
            limit,
            &[],
        )
    }

    /// `prefer`: a token sequence the stand-in model starts every fourth step and, once started,
    /// follows while the grammar lets it (random logits alone never close a free-text value).
    fn run_with(mut c: Constraint, seed: u64, limit: usize, prefer: &[u32]) -> (String, bool) {
        let f = format();
        let im_end = f.tokenizer.token_to_id("<|im_end|>").unwrap();
        let mut state = seed;
        let mut tokens = Vec::new();
        let mut at = 0;
        for step in 0..limit {
            let mut logits: Vec<f32> = (0..f.vocab_size)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (state >> 40) as f32 / (1u64 << 24) as f32
                })
                .collect();
            let next = prefer.get(at).filter(|_| at > 0 || step % 4 == 3);
            if let Some(&t) = next {
                logits[t as usize] += 1.0;
            }
            let masked = c.mask(&logits).unwrap();
            let best = (0..masked.len())
                .max_by(|&a, &b| masked[a].total_cmp(&masked[b]))
                .unwrap() as u32;
            if best == im_end {
                return (f.decode(&tokens).unwrap(), true);
            }
            at = if next == Some(&best) {
                (at + 1) % prefer.len()
            } else {
                0
            };
            c.advance(best).unwrap();
            tokens.push(best);
        }
        (f.decode(&tokens).unwrap(), false)
    }

    #[test]
    fn a_schema_holds_random_logits_to_matching_json() {
        let schema = json!({
            "type": "object",
            "properties": {
                "ok": {"type": "boolean"},
                "n": {"type": "integer", "minimum": 0, "maximum": 9},
                "mood": {"enum": ["calm", "busy"]}
            },
            "required": ["ok", "n", "mood"],
            "additionalProperties": false
        });
        let rf = ResponseFormat::JsonSchema {
            schema,
            strict: true,
        };
        for seed in 0..4 {
            let (text, ended) = run(&rf, seed, 64);
            assert!(ended, "no end of turn after 64 tokens: {text:?}");
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
            assert!(v["ok"].is_boolean(), "{text}");
            let n = v["n"].as_i64().unwrap();
            assert!((0..=9).contains(&n), "{text}");
            assert!(
                ["calm", "busy"].contains(&v["mood"].as_str().unwrap()),
                "{text}"
            );
            assert_eq!(v.as_object().unwrap().len(), 3, "{text}");
            assert!(
                text.starts_with("{\"ok\": "),
                "separators as json.dumps: {text}"
            );
        }
    }

    #[test]
    fn json_object_mode_gives_an_object() {
        let (text, ended) = run(&ResponseFormat::JsonObject, 7, 400);
        if ended {
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
            assert!(v.is_object(), "{text}");
        } else {
            // random logits may keep a string open; what came out is still a JSON object's start
            assert!(text.starts_with('{'), "{text:?}");
        }
    }

    #[test]
    fn special_tokens_are_never_allowed() {
        let f = format();
        let mut c = grammars()
            .constraint(&ResponseFormat::JsonSchema {
                schema: json!({"type": "string"}),
                strict: false,
            })
            .unwrap()
            .unwrap();
        let masked = c.mask(&vec![0.0; f.vocab_size]).unwrap();
        for tag in [
            "<|im_end|>",
            "<think>",
            "</think>",
            "<tool_call>",
            "<|im_start|>",
        ] {
            let id = f.tokenizer.token_to_id(tag).unwrap() as usize;
            assert_eq!(masked[id], f32::NEG_INFINITY, "{tag} allowed at the start");
        }
        let quote = f.encode("\"").unwrap()[0] as usize;
        assert_eq!(masked[quote], 0.0);
    }

    #[test]
    fn response_formats_parse_and_bad_ones_are_named() {
        assert_eq!(
            ResponseFormat::parse(&json!({"type": "text"})),
            Ok(ResponseFormat::Text)
        );
        assert_eq!(
            ResponseFormat::parse(&json!({"type": "json_object"})),
            Ok(ResponseFormat::JsonObject)
        );
        let rf = ResponseFormat::parse(&json!({"type": "json_schema", "json_schema":
            {"name": "x", "schema": {"type": "object"}, "strict": true}}))
        .unwrap();
        assert_eq!(
            rf,
            ResponseFormat::JsonSchema {
                schema: json!({"type": "object"}),
                strict: true
            }
        );
        for (bad, says) in [
            (json!({}), "needs a 'type'"),
            (json!({"type": "yaml"}), "\"yaml\" is not supported"),
            (
                json!({"type": "json_schema"}),
                "needs a 'json_schema' object",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": 3}}),
                "must be an object",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}),
                "must be a boolean",
            ),
        ] {
            let err = ResponseFormat::parse(&bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn schemas_that_cannot_compile_are_errors() {
        let bad = ResponseFormat::JsonSchema {
            schema: json!({"type": "object", "properties": {"a": {"type": "nonsense"}}}),
            strict: true,
        };
        assert!(grammars().constraint(&bad).is_err());
        assert!(grammars()
            .constraint(&ResponseFormat::Text)
            .unwrap()
            .is_none());
    }

    const TOOLS: &str = r#"[
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                           "unit": {"enum": ["C", "F"]}, "hot": {"type": "boolean"}},
            "required": ["city", "days"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    ]"#;

    /// The calls a reply parses into, with their typed arguments.
    fn calls_of(text: &str) -> Vec<(String, Value)> {
        let tools: Value = serde_json::from_str(TOOLS).unwrap();
        let mut p = crate::parse::OutputParser::new(
            false,
            Some(crate::parse::ToolSchemas::from_tools(&tools)),
            "call_",
        );
        let mut deltas = p.push(text);
        deltas.extend(p.finish());
        crate::parse::collect(&deltas)
            .calls
            .into_iter()
            .map(|c| (c.name, serde_json::from_str(&c.arguments).unwrap()))
            .collect()
    }

    #[test]
    fn a_forced_call_holds_random_logits_to_the_tools_schemas() {
        let tools: Value = serde_json::from_str(TOOLS).unwrap();
        let close = format().encode("\n</parameter>\n").unwrap();
        for seed in 0..6 {
            let c = grammars()
                .tool_call(ForcedCall::Named(&tools, "get_weather"))
                .unwrap();
            let (text, ended) = run_with(c, seed, 300, &close);
            assert!(ended, "{text:?}");
            let calls = calls_of(&format!("<tool_call>\n<function=get_weather>\n{text}"));
            assert_eq!(calls.len(), 1, "{text:?}");
            let args = calls[0].1.as_object().unwrap();
            assert!(args["city"].is_string(), "{text:?}");
            assert!(
                (1..=7).contains(&args["days"].as_i64().unwrap()),
                "{text:?}"
            );
            if let Some(u) = args.get("unit") {
                assert!(u == "C" || u == "F", "{text:?}");
            }
            if let Some(h) = args.get("hot") {
                assert!(h.is_boolean(), "{text:?}");
            }
            assert!(args
                .keys()
                .all(|k| ["city", "days", "unit", "hot"].contains(&k.as_str())));

            let c = grammars().tool_call(ForcedCall::AnyOf(&tools)).unwrap();
            let (text, ended) = run_with(c, seed, 300, &close);
            assert!(ended, "{text:?}");
            let calls = calls_of(&format!("<tool_call>\n<function={text}"));
            assert_eq!(calls.len(), 1, "{text:?}");
            assert!(
                ["get_weather", "get_time"].contains(&calls[0].0.as_str()),
                "{text:?}"
            );
        }
    }

    #[test]
    fn token_bytes_match_llguidance_reading_of_the_tokenizer_json() {
        let tok = &format().tokenizer;
        let json: Value = serde_json::from_str(&tok.to_string(false).unwrap()).unwrap();
        let mut theirs = llguidance::token_bytes_from_tokenizer_json(&json).unwrap();
        for id in tok.get_added_tokens_decoder().keys() {
            let w = &mut theirs[*id as usize];
            if w.first() != Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
                w.insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
            }
        }
        let ours = token_bytes(tok).unwrap();
        assert_eq!(ours.len(), 248_077);
        assert_eq!(ours, theirs);
        let space_a = tok.token_to_id("Ġa").unwrap() as usize;
        assert_eq!(ours[space_a], b" a");
    }

    #[test]
    fn a_schema_with_references_leaves_the_call_free() {
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
            "properties": {"x": {"$ref": "#/$defs/X"}}, "$defs": {"X": {"type": "integer"}}}}}]);
        assert!(grammars().tool_call(ForcedCall::AnyOf(&tools)).is_none());
        assert!(grammars()
            .tool_call(ForcedCall::Named(&tools, "g"))
            .is_none());
    }
}
