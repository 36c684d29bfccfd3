//! `osprey chat`: a multi-turn conversation in the terminal on the same engine, streaming the
//! reply with the reasoning dimmed. Earlier turns' state is reused through the prefix cache.

use std::io::{BufRead, Write};
use std::ops::ControlFlow;

use anyhow::Result;
use osprey_engine::generate::{generate, GenerateOptions};
use osprey_prompt::{ChatOptions, PromptFormat};
use osprey_server::parse::{collect, Delta, OutputParser};
use osprey_server::worker::PrefixCache;
use serde_json::{json, Value};

use crate::commands::{load_engine, opening, reasoning_budget, sampling_params, Detok};
use crate::{ModelArgs, SamplingArgs};

const DIM: &str = "\x1b[2m";
const RESET: &str = "\x1b[0m";

pub fn run(
    args: &ModelArgs,
    max_tokens: usize,
    system: Option<&str>,
    thinking_budget: Option<usize>,
    sampling: &SamplingArgs,
) -> Result<()> {
    let (engine, dir) = load_engine(args)?;
    let format = PromptFormat::from_dir(&dir)?;
    let reasoning_budget = thinking_budget
        .map(|n| reasoning_budget(&format, n))
        .transpose()?;
    let mut cache = PrefixCache::new(8, 8 << 30);
    let mut history: Vec<Value> = opening(system);
    let mut thinking = true;
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    println!(
        "osprey chat on {} ({}). /reset, /think on|off, /quit",
        dir.display(),
        engine.backend.name()
    );
    loop {
        print!("\n> ");
        out.flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            return Ok(());
        }
        let line = line.trim();
        match line {
            "" => continue,
            "/quit" | "/exit" => return Ok(()),
            "/reset" => {
                history = opening(system);
                println!("(conversation cleared)");
                continue;
            }
            "/think on" | "/think off" => {
                thinking = line.ends_with("on");
                println!("(thinking {})", if thinking { "on" } else { "off" });
                continue;
            }
            _ => {}
        }
        history.push(json!({"role": "user", "content": line}));
        let mut kwargs = serde_json::Map::new();
        kwargs.insert("enable_thinking".into(), thinking.into());
        let text = format.render(
            &Value::Array(history.clone()),
            &ChatOptions {
                add_generation_prompt: true,
                tools: None,
                kwargs,
                ..Default::default()
            },
        )?;
        let prompt = format.encode(&text)?;
        // chat prompts always grow, so a hit is a proper prefix (never a whole-prompt hit)
        let (mut session, _, _) =
            cache.resume(&engine, &prompt, &format.branch_points(&prompt, usize::MAX))?;
        let opts = GenerateOptions {
            max_tokens,
            stop_ids: format.stop_ids.clone(),
            stop_strings: Vec::new(),
            sampling: sampling_params(sampling, &format),
            valid_vocab: format.vocab_size.min(engine.config().vocab_size),
            reasoning_budget: reasoning_budget.clone(),
        };
        let mut parser = OutputParser::new(text.ends_with("<think>\n"), None, "call_");
        let mut deltas = Vec::new();
        let mut show = |ds: Vec<Delta>, out: &mut std::io::Stdout| {
            for d in &ds {
                let _ = match d {
                    Delta::Reasoning(s) => write!(out, "{DIM}{s}{RESET}"),
                    Delta::Content(s) => write!(out, "{s}"),
                    _ => Ok(()),
                };
            }
            let _ = out.flush();
            deltas.extend(ds);
        };
        let from = session.tokens.len();
        let g = generate(
            &engine,
            &mut session,
            &prompt[from..],
            &opts,
            &mut Detok(format.incremental()),
            &mut |piece| {
                show(parser.push(piece), &mut std::io::stdout());
                ControlFlow::Continue(())
            },
        )?;
        show(parser.finish(), &mut out);
        let reply = collect(&deltas);
        history
            .push(json!({"role": "assistant", "content": reply.content, "reasoning_content": reply.reasoning}));
        eprintln!(
            "\n{DIM}[{} tokens, {:.1} tok/s]{RESET}",
            g.tokens.len(),
            g.decode.tokens_per_s()
        );
    }
}
