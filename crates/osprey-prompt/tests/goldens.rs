//! Chat rendering and tokenisation against transformers' `apply_chat_template` and `encode`
//! (goldens made by tools/make_prompt_goldens.py from assets/qwen3.6-35b-a3b).

use std::path::PathBuf;

use osprey_prompt::{ChatOptions, PromptFormat};
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn format() -> PromptFormat {
    PromptFormat::from_dir(&root().join("assets/qwen3.6-35b-a3b")).unwrap()
}

fn goldens() -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(root().join("fixtures/prompt/goldens.json")).unwrap(),
    )
    .unwrap()
}

#[test]
fn conversations_render_and_encode_like_transformers() {
    let f = format();
    let g = goldens();
    let cases = g["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    let continued = cases.iter().filter(|c| c["continue_final_message"] == true);
    assert!(continued.count() >= 5);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let opts = ChatOptions {
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            tools: (!case["tools"].is_null()).then(|| case["tools"].clone()),
            kwargs: case["kwargs"].as_object().unwrap().clone(),
            continue_final_message: case["continue_final_message"] == true,
        };
        let text = f
            .render(&case["messages"], &opts)
            .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        assert_eq!(
            text,
            case["text"].as_str().unwrap(),
            "{name}: rendered text differs"
        );
        let ids: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(f.encode(&text).unwrap(), ids, "{name}: ids differ");
    }
}

#[test]
fn plain_texts_encode_like_transformers_and_round_trip() {
    let f = format();
    for case in goldens()["encode"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ids: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(f.encode(text).unwrap(), ids, "{text:?}");
        assert_eq!(f.decode(&ids).unwrap(), text);
    }
}

#[test]
fn published_prompt_ids() {
    // model-spec §6.4: "Hi" with thinking off
    let f = format();
    let msgs = serde_json::json!([{"role": "user", "content": "Hi"}]);
    let mut kwargs = serde_json::Map::new();
    kwargs.insert("enable_thinking".into(), Value::Bool(false));
    let ids = f
        .encode_chat(
            &msgs,
            &ChatOptions {
                add_generation_prompt: true,
                kwargs,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(
        ids,
        vec![248045, 846, 198, 12675, 248046, 198, 248045, 74455, 198, 248068, 271, 248069, 271]
    );
}

#[test]
fn stop_ids_and_defaults_from_generation_config() {
    let f = format();
    assert_eq!(f.special.eos.as_deref(), Some("<|im_end|>"));
    assert_eq!(f.special.pad.as_deref(), Some("<|endoftext|>"));
    assert_eq!(f.special.bos, None);
    assert!(f.template.source().contains("<|im_start|>"));
    assert_eq!(f.stop_ids, vec![248046, 248044]);
    assert_eq!(f.defaults.top_k, Some(20));
    assert_eq!(f.defaults.top_p, Some(0.95));
    assert_eq!(f.vocab_size, 248077);
}

#[test]
fn template_errors_are_reported_not_panics() {
    let f = format();
    let e = f
        .render(&serde_json::json!([]), &ChatOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("No messages provided"), "{e}");
    let e = f
        .render(&serde_json::json!([{"role": "narrator", "content": "x"}, {"role": "user", "content": "y"}]), &ChatOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("Unexpected message role"), "{e}");
}

#[test]
fn incremental_decoding_equals_full_decoding() {
    let f = format();
    let text = "Streaming café 你好 👩‍💻 <think>\nok\n</think> done";
    let ids = f.encode(text).unwrap();
    let mut dec = f.incremental();
    let mut out = String::new();
    for &id in &ids {
        out += &dec.push(id);
    }
    out += &dec.flush();
    assert_eq!(out, text);
}

#[test]
fn assistant_turn_start_is_after_the_last_assistant_header() {
    let f = format();
    let msgs = serde_json::json!([{"role": "user", "content": "Hi"}]);
    let ids = f
        .encode_chat(
            &msgs,
            &ChatOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        )
        .unwrap();
    // ... <|im_start|> assistant \n | <think> \n
    let at = f.assistant_turn_start(&ids).unwrap();
    assert_eq!(&ids[at - 3..at], &[248045, 74455, 198]);
    assert_eq!(ids[at], 248068);
    assert_eq!(f.assistant_turn_start(&[1, 2, 3]), None);
}

#[test]
fn branch_points_are_the_system_parts_end_and_the_reply_start() {
    let f = format();
    let opts = ChatOptions {
        add_generation_prompt: true,
        ..Default::default()
    };
    let system = "You are a careful agent. ".repeat(20);
    let msgs = serde_json::json!([{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]);
    let ids = f.encode_chat(&msgs, &opts).unwrap();
    let shared = f.first_user_turn_start(&ids).unwrap();
    // ... <|im_end|> \n | <|im_start|> user \n Hi
    assert_eq!(ids[shared], 248045);
    assert_eq!(ids[shared - 1], 198);
    let other = serde_json::json!([{"role": "system", "content": system}, {"role": "user", "content": "Something else"}]);
    let other_ids = f.encode_chat(&other, &opts).unwrap();
    assert_eq!(
        ids[..shared],
        other_ids[..shared],
        "conversations share the system part"
    );
    let reply = f.assistant_turn_start(&ids).unwrap();
    assert_eq!(f.branch_points(&ids, 0), vec![shared, reply]);
    // a short system part is not worth a snapshot; no system part has none
    assert_eq!(f.branch_points(&ids, shared + 1), vec![reply]);
    let bare = f
        .encode_chat(
            &serde_json::json!([{"role": "user", "content": "Hi"}]),
            &opts,
        )
        .unwrap();
    assert_eq!(f.first_user_turn_start(&bare), None);
}
