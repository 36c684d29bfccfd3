//! The `osprey` binary end to end on a tiny synthetic checkpoint: synth, inspect, generate, score,
//! bench, and clear errors (never panics) for bad checkpoints and bad input.

use std::path::Path;
use std::process::{Command, Output};

fn osprey(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_osprey"))
        .args(args)
        .env("OSPREY_LOG", "info")
        .output()
        .expect("run osprey")
}

fn ok(args: &[&str]) -> (String, String) {
    let o = osprey(args);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(o.status.success(), "osprey {args:?} failed:\n{err}");
    (out, err)
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn fails(args: &[&str]) -> String {
    let o = osprey(args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "osprey {args:?} should fail");
    assert!(
        !err.contains("panicked"),
        "osprey {args:?} panicked:\n{err}"
    );
    err
}

fn synth(dir: &Path) {
    ok(&[
        "synth",
        "--preset",
        "tiny",
        "--seed",
        "5",
        "--out",
        dir.to_str().unwrap(),
    ]);
}

#[test]
fn synth_inspect_generate_score() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("tiny");
    synth(&m);
    let ms = m.to_str().unwrap();

    let (out, _) = ok(&["inspect", "--model", ms]);
    assert!(out.contains("4 (3 Gated DeltaNet, 1 attention)"), "{out}");
    assert!(
        out.contains("quantisation: 4-bit affine, group 64, 8 module overrides"),
        "{out}"
    );
    assert!(out.contains("routed experts"), "{out}");

    // greedy generation is deterministic and reports throughput
    let args = [
        "generate",
        "--model",
        ms,
        "--chat",
        "--prompt",
        "Hi",
        "--max-tokens",
        "12",
        "--temperature",
        "0",
    ];
    let (a, err) = ok(&args);
    let (b, _) = ok(&args);
    assert_eq!(a, b);
    assert!(err.contains("decode: ") && err.contains("tok/s"), "{err}");
    // the int8 KV cache (the CPU backend rounds K and V as the GPU stores them)
    let (_, err) = ok(&[&args[..], &["--kv-cache", "int8"]].concat());
    assert!(err.contains("decode: "), "{err}");
    // a system message opens the conversation: the prompt grows by its turn
    let prompt_tokens = |err: &str| -> usize {
        let after = err
            .split("prompt: ")
            .nth(1)
            .unwrap_or_else(|| panic!("{err}"));
        after.split(' ').next().unwrap().parse().unwrap()
    };
    let (_, with_system) = ok(&[&args[..], &["--system", "Be brief."]].concat());
    // <|im_start|> system \n Be brief. <|im_end|> \n
    assert!(
        prompt_tokens(&with_system) >= prompt_tokens(&err) + 6,
        "{with_system}"
    );
    // a thinking budget closes the reasoning block after that many tokens (a random model's
    // reply is all reasoning without it); the first 3 tokens are the unbudgeted reply's
    let (budgeted, _) = ok(&[&args[..], &["--thinking-budget", "3"]].concat());
    assert!(budgeted.contains("\n</think>"), "{budgeted:?}");
    assert!(!a.contains("</think>"), "{a:?}");
    let first_three = budgeted.split("\n</think>").next().unwrap();
    assert!(
        !first_three.trim().is_empty() && a.starts_with(first_three),
        "{a:?} {budgeted:?}"
    );
    let err = fails(&["generate", "--model", ms, "--thinking-budget", "3"]);
    assert!(err.contains("--chat"), "{err}");
    // sampled generation with a seed is reproducible too
    let args = [
        "generate",
        "--model",
        ms,
        "--prompt",
        "Hi",
        "--max-tokens",
        "12",
        "--temperature",
        "1",
        "--seed",
        "9",
    ];
    assert_eq!(ok(&args).0, ok(&args).0);

    let ids = tmp.path().join("ids.json");
    std::fs::write(&ids, "[1, 2, 3, 248045, 846]").unwrap();
    let out = tmp.path().join("logits.safetensors");
    ok(&[
        "score",
        "--model",
        ms,
        "--tokens",
        ids.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("logits").unwrap();
    assert_eq!(t.shape(), &[5, 248320]);
    assert_eq!(t.dtype(), safetensors::Dtype::F32);

    let json = tmp.path().join("bench.json");
    ok(&[
        "bench",
        "decode",
        "--model",
        ms,
        "--context",
        "16,32",
        "--steps",
        "2",
        "--rounds",
        "1",
        "--out",
        json.to_str().unwrap(),
    ]);
    let v = read_json(&json);
    assert_eq!(v["kind"], "decode");
    assert_eq!(v["results"].as_array().unwrap().len(), 2);
    assert!(v["results"][0]["tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(v["sampling"].is_null(), "greedy by default");
    // The report names the commit the binary was built from, as --version does.
    let commit = v["commit"].as_str().unwrap();
    let (version, _) = ok(&["--version"]);
    assert!(
        version.contains(&format!("({commit})")),
        "{version} vs {commit}"
    );
    let head = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success());
    if let Some(head) = head {
        let head = String::from_utf8_lossy(&head.stdout).trim().to_string();
        assert!(
            commit.starts_with(&head),
            "built from {commit}, HEAD is {head}"
        );
    }

    // --sample: tokens drawn with the checkpoint's generation_config, recorded in the report
    ok(&[
        "bench",
        "decode",
        "--model",
        ms,
        "--context",
        "16",
        "--steps",
        "2",
        "--rounds",
        "1",
        "--sample",
        "--out",
        json.to_str().unwrap(),
    ]);
    let v = read_json(&json);
    assert_eq!(v["sampling"]["top_k"], 20);
    assert!((v["sampling"]["temperature"].as_f64().unwrap() - 1.0).abs() < 1e-6);
    assert!(v["results"][0]["tokens_per_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn bad_checkpoints_give_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("m");
    synth(&m);
    let ms = m.to_str().unwrap();
    let weights = m.join("model.safetensors");
    let full = std::fs::read(&weights).unwrap();

    // truncated file
    std::fs::write(&weights, &full[..full.len() / 2]).unwrap();
    let err = fails(&["inspect", "--model", ms]);
    assert!(
        err.contains("model.safetensors") && err.contains("not a valid safetensors"),
        "{err}"
    );

    // garbage header
    std::fs::write(&weights, b"\xff\xff\xff\xff\xff\xff\xff\x7fjunk").unwrap();
    let err = fails(&["generate", "--model", ms]);
    assert!(err.contains("not a valid safetensors"), "{err}");
    std::fs::write(&weights, &full).unwrap();

    // a config that disagrees with the tensors: every problem is listed
    let cfg_path = m.join("config.json");
    let mut v = read_json(&cfg_path);
    v["text_config"]["moe_intermediate_size"] = 256.into();
    std::fs::write(&cfg_path, v.to_string()).unwrap();
    let err = fails(&["inspect", "--model", ms]);
    assert!(err.contains("does not match its config.json"), "{err}");
    assert!(err.contains("switch_mlp.gate_proj.weight: shape"), "{err}");
    assert!(err.contains("switch_mlp.down_proj.weight: shape"), "{err}");

    // malformed config
    std::fs::write(
        &cfg_path,
        "{\"model_type\": \"qwen3_5_moe\", \"text_config\": {}}",
    )
    .unwrap();
    let err = fails(&["inspect", "--model", ms]);
    assert!(err.contains("text_config.num_hidden_layers"), "{err}");
    std::fs::write(&cfg_path, "not json").unwrap();
    assert!(fails(&["inspect", "--model", ms]).contains("not valid JSON"));

    // missing directory
    assert!(fails(&["inspect", "--model", "/nonexistent/osprey"]).contains("config.json"));
}

#[test]
fn bad_input_gives_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("m");
    synth(&m);
    let ms = m.to_str().unwrap();
    let ids = tmp.path().join("ids.json");
    std::fs::write(&ids, "[1, -2]").unwrap();
    let out = tmp.path().join("o.safetensors");
    let err = fails(&[
        "score",
        "--model",
        ms,
        "--tokens",
        ids.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(err.contains("JSON array of token ids"), "{err}");
    std::fs::write(&ids, "[999999]").unwrap();
    let err = fails(&[
        "score",
        "--model",
        ms,
        "--tokens",
        ids.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(err.contains("outside the vocabulary"), "{err}");
    let err = fails(&["generate", "--model", ms, "--system", "x"]);
    assert!(err.contains("--chat"), "{err}");
    let err = fails(&["generate", "--model", ms, "--top-p", "0"]);
    assert!(err.contains("top_p"), "{err}");
    let err = fails(&["generate", "--model", ms, "--backend", "tpu"]);
    assert!(err.contains("--backend tpu"), "{err}");
    let err = fails(&["generate", "--model", ms, "--kv-cache", "fp8"]);
    assert!(err.contains("fp8") && err.contains("int8"), "{err}");
    let err = fails(&["bench", "prefill", "--model", ms, "--prompt", "12x"]);
    assert!(err.contains("12x"), "{err}");
    // the timeline reads marks that only instrumented CUDA kernels record
    let err = fails(&[
        "bench",
        "decode",
        "--model",
        ms,
        "--backend",
        "cpu",
        "--context",
        "16",
        "--timeline",
        tmp.path().join("t.json").to_str().unwrap(),
    ]);
    assert!(err.contains("--timeline needs --backend cuda"), "{err}");
}

#[test]
fn terminal_chat_holds_a_conversation() {
    use std::io::Write;
    use std::process::Stdio;
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("m");
    synth(&m);
    let mut child = Command::new(env!("CARGO_BIN_EXE_osprey"))
        .args([
            "chat",
            "--model",
            m.to_str().unwrap(),
            "--max-tokens",
            "4",
            "--temperature",
            "0",
            "--system",
            "You are terse.",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Hi\n/think off\nAnd again?\n/reset\n/quit\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("(thinking off)") && stdout.contains("(conversation cleared)"),
        "{stdout}"
    );
    // two replies, each reporting its speed
    assert_eq!(stderr.matches("tok/s]").count(), 2, "{stderr}");
    // the reasoning of the first (thinking) turn is shown dimmed
    assert!(stdout.contains("\x1b[2m"), "{stdout}");
}

#[test]
fn eval_against_reference_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("m");
    synth(&m);
    let ms = m.to_str().unwrap();
    let ids = tmp.path().join("ids.json");
    std::fs::write(
        &ids,
        "[248045, 846, 198, 12675, 248046, 198, 248045, 74455]",
    )
    .unwrap();
    let reference = tmp.path().join("ref.safetensors");
    ok(&[
        "score",
        "--model",
        ms,
        "--tokens",
        ids.to_str().unwrap(),
        "--out",
        reference.to_str().unwrap(),
    ]);
    let json = tmp.path().join("eval.json");
    let (out, _) = ok(&[
        "eval",
        "--model",
        ms,
        "--tokens",
        ids.to_str().unwrap(),
        "--reference",
        reference.to_str().unwrap(),
        "--out",
        json.to_str().unwrap(),
    ]);
    assert!(out.contains("top-1 agreement 100.00%"), "{out}");
    let v = read_json(&json);
    assert_eq!(v["fidelity"]["positions"], 7);
    assert_eq!(v["fidelity"]["max_abs_logit_error"], 0.0);
    // another model's logits differ: agreement drops, perplexities differ
    let other = tmp.path().join("other");
    ok(&[
        "synth",
        "--preset",
        "tiny",
        "--seed",
        "99",
        "--out",
        other.to_str().unwrap(),
    ]);
    let (out, _) = ok(&[
        "eval",
        "--model",
        other.to_str().unwrap(),
        "--tokens",
        ids.to_str().unwrap(),
        "--reference",
        reference.to_str().unwrap(),
    ]);
    assert!(
        !out.contains("top-1 agreement 100.00%") || !out.contains("(+0.000%)"),
        "{out}"
    );
    let err = fails(&[
        "eval",
        "--model",
        ms,
        "--tokens",
        ids.to_str().unwrap(),
        "--reference",
        reference.to_str().unwrap(),
        "--tensor",
        "nope",
    ]);
    assert!(err.contains("no tensor \"nope\""), "{err}");
}

#[test]
fn quantize_writes_an_mlx_checkpoint_and_refuses_what_it_cannot_convert() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/reference");
    let hf = fixtures.join("qwen35_hf_bf16");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q4");
    let (_, log) = ok(&[
        "quantize",
        "--model",
        hf.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(log.contains("357 tensors, 4-bit groups of 64"), "{log}");
    let config = read_json(&out.join("config.json"));
    assert_eq!(config["quantization"]["bits"], 4);
    assert_eq!(
        config["quantization"]["language_model.model.layers.0.mlp.gate"]["bits"],
        8
    );
    let err = fails(&[
        "quantize",
        "--model",
        hf.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(err.contains("already holds a checkpoint"), "{err}");
    let other = tmp.path().join("other");
    let out_s = out.to_str().unwrap();
    let err = fails(&[
        "quantize",
        "--model",
        out_s,
        "--out",
        other.to_str().unwrap(),
    ]);
    assert!(err.contains("already quantised"), "{err}");
    let next = fixtures.join("qwen3next_hf_bf16");
    let err = fails(&[
        "quantize",
        "--model",
        next.to_str().unwrap(),
        "--out",
        other.to_str().unwrap(),
    ]);
    assert!(err.contains("qwen3_5_moe"), "{err}");
    let err = fails(&[
        "quantize",
        "--model",
        hf.to_str().unwrap(),
        "--out",
        other.to_str().unwrap(),
        "--bits",
        "3",
    ]);
    assert!(err.contains("--bits 3"), "{err}");
    let err = fails(&[
        "quantize",
        "--model",
        "/nonexistent",
        "--out",
        other.to_str().unwrap(),
    ]);
    assert!(err.contains("/nonexistent"), "{err}");
}

#[test]
fn generate_speculative_prints_the_plain_greedy_text() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("tiny-mtp");
    let ms = m.to_str().unwrap();
    ok(&[
        "synth", "--preset", "tiny", "--layers", "2", "--mtp", "--out", ms,
    ]);
    let run = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            ms,
            "--backend",
            "cpu",
            "--temperature",
            "0",
            "--max-tokens",
            "12",
            "--prompt",
            "The osprey dives",
        ];
        args.extend_from_slice(extra);
        ok(&args)
    };
    let (plain, _) = run(&[]);
    for drafts in ["mtp", "ngram"] {
        let (out, err) = run(&["--speculative", drafts]);
        assert_eq!(out, plain, "--speculative {drafts}");
        assert!(err.contains("drafts accepted"), "{err}");
    }
    // what it cannot do is refused by name
    let err = fails(&["generate", "--model", ms, "--speculative", "mtp"]);
    assert!(err.contains("--temperature 0"), "{err}");
    let err = fails(&[
        "generate",
        "--model",
        ms,
        "--backend",
        "cuda",
        "--speculative",
        "mtp",
        "--temperature",
        "0",
    ]);
    assert!(err.contains("CPU backend"), "{err}");
}
