//! `picchio chat` (and the bare `picchio --model DIR [--store URI]`): a conversation in the
//! terminal. Answers stream as they are generated; the conversation is re-rendered with the
//! model's chat template each turn and only what is new is prefilled (the KV cache of the earlier
//! turns is reused, [`picchio_runtime::chat::turn`]); reasoning is shown dimmed or hidden; each
//! turn ends with its tok/s and cache hit rates. Ctrl-C stops the answer (also while the prompt
//! is still being prefilled); a second Ctrl-C before it stopped, a Ctrl-C at the prompt, SIGTERM,
//! `/exit` or the end of input end the program cleanly: the session is dropped, which shuts an
//! `nvme:` controller down (CC.SHN) and frees its DMA memory before the process exits.

use std::io::{BufRead, Write};
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use anyhow::Context;
use picchio_runtime::chat::engine::{Engine, FinishReason, Request};
use picchio_runtime::chat::Message;

/// Whether reasoning is printed.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningShow {
    /// Printed dimmed before the answer.
    Show,
    /// Not printed (it still counts as generated tokens).
    Hide,
}

/// Options of `picchio chat`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: super::model_args::ModelArgs,
    /// Show or hide the model's reasoning (Qwen3's <think>, GPT-OSS's analysis channel).
    #[arg(long, value_enum, default_value_t = ReasoningShow::Show)]
    pub reasoning: ReasoningShow,
    /// A system message at the start of the conversation.
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// Tokens per answer at most [default: the rest of the context].
    #[arg(short = 'n', long = "max-new-tokens", value_name = "N")]
    pub n: Option<usize>,
    /// Go on past the model's end-of-turn tokens (until -n or the context is full).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Sampling temperature; 0 (the default) is greedy.
    #[arg(long, value_name = "T", default_value_t = 0.0, value_parser = super::f32_in_range)]
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1].
    #[arg(long, value_name = "P", default_value_t = 1.0, value_parser = super::f32_in_range)]
    pub top_p: f32,
    /// Sampling seed.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub sampling: super::run::SamplingArgs,
}

const HELP: &str = "commands: /reset (new conversation), /stats, /save FILE (a new file; /save! FILE replaces one), \
                    /load FILE, /exit; Ctrl-C stops an answer";

/// Totals over the session, for `/stats`.
#[derive(Default)]
struct Totals {
    turns: usize,
    prompt: usize,
    cached: usize,
    generated: usize,
    hits: u64,
    misses: u64,
    bytes: u64,
}

/// What Ctrl-C (SIGINT) and SIGTERM mean in the chat, decided on a signal thread (no code of ours
/// runs in signal context): during an answer the first SIGINT stops the answer; a second one before
/// it stopped, one at the prompt, or SIGTERM ends the program — then the runtime's stop request
/// ([`picchio_runtime::interrupt::flag`]) is raised too, so a prefill between chunks or an `nvme:`
/// read waiting on the device gives up, and `exec` returns, dropping the session cleanly.
struct Signals {
    /// An answer is being generated.
    answering: AtomicBool,
    /// Stop the current answer.
    stop_answer: AtomicBool,
    /// End the program.
    quit: AtomicBool,
}

impl Signals {
    fn install() -> anyhow::Result<Arc<Signals>> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let s = Arc::new(Signals {
            answering: AtomicBool::new(false),
            stop_answer: AtomicBool::new(false),
            quit: AtomicBool::new(false),
        });
        // The handlers only set flags (signal_hook::flag, on Unix and Windows); a thread turns
        // them into the chat's meaning every 20 ms. Two Ctrl-C within one period count as one.
        let (int, term) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        signal_hook::flag::register(SIGINT, int.clone()).context("installing the Ctrl-C handler")?;
        signal_hook::flag::register(SIGTERM, term.clone()).context("installing the SIGTERM handler")?;
        let s2 = s.clone();
        std::thread::Builder::new()
            .name("picchio-signals".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(20));
                let terminate = term.swap(false, Ordering::SeqCst);
                let interrupt = int.swap(false, Ordering::SeqCst);
                if !terminate && !interrupt {
                    continue;
                }
                if !terminate && s2.answering.load(Ordering::SeqCst) && !s2.stop_answer.swap(true, Ordering::SeqCst) {
                    continue;
                }
                s2.quit.store(true, Ordering::SeqCst);
                picchio_runtime::interrupt::flag().store(true, Ordering::SeqCst);
            })
            .context("starting the signal thread")?;
        Ok(s)
    }

    /// Whether the current answer must end (stopped, or the program is ending).
    fn answer_stopped(&self) -> bool {
        self.stop_answer.load(Ordering::SeqCst) || self.quit.load(Ordering::SeqCst)
    }

    fn quitting(&self) -> bool {
        self.quit.load(Ordering::SeqCst)
    }
}

pub fn exec(mut a: Args) -> anyhow::Result<()> {
    let sampler = a.sampling.options(a.temperature, a.top_p, a.seed)?;
    let signals = Signals::install()?;
    let engine = a.model.open()?;
    let result = talk(&a, engine, &signals, sampler);
    // The session was dropped in `talk` (an nvme: controller shut down, its DMA memory freed).
    if signals.quitting() {
        eprintln!("bye");
    }
    result
}

/// The conversation loop; returns when the user ends it. Consumes `engine`, so the session is
/// dropped (and an nvme: controller shut down) before the caller says goodbye.
fn talk(
    a: &Args,
    mut engine: Engine,
    signals: &Signals,
    sampler: picchio_runtime::model::sampler::SamplerOptions,
) -> anyhow::Result<()> {
    if engine.format.is_none() {
        anyhow::bail!(
            "{} has no chat template (tokenizer_config.json `chat_template` or chat_template.jinja): use `picchio run`",
            engine.session.model.dir().display()
        );
    }
    eprintln!(
        "picchio chat: {} ({}, store {}, context {} tokens). {HELP}",
        engine.name,
        engine.format.as_ref().map(|f| f.describe()).unwrap_or_default(),
        engine.session.info.store,
        engine.context()
    );
    let prompt = Prompt::start()?;
    let mut messages = initial(a);
    let mut totals = Totals::default();
    let out = std::io::stdout();
    loop {
        prompt.ask()?;
        // Wait for a line; Ctrl-C here ends the program.
        let line = loop {
            if signals.quitting() {
                println!();
                return Ok(());
            }
            match prompt.lines.recv_timeout(Duration::from_millis(100)) {
                Ok(Input::Line(l)) => break Some(l),
                Ok(Input::End) | Err(mpsc::RecvTimeoutError::Disconnected) => break None,
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
            }
        };
        let Some(line) = line else {
            println!();
            return Ok(());
        };
        let line = line.trim_end_matches(['\r', '\n']);
        if line.trim().is_empty() {
            continue;
        }
        if let Some(cmd) = line.strip_prefix('/') {
            let (name, arg) = cmd.split_once(' ').map_or((cmd, ""), |(n, r)| (n, r.trim()));
            match name {
                "exit" | "quit" => return Ok(()),
                "reset" => {
                    messages = initial(a);
                    engine.session.reset_kv();
                    println!("(new conversation)");
                }
                "stats" => print_stats(&engine, &totals, &messages),
                "save" | "save!" if !arg.is_empty() => match save(Path::new(arg), &messages, name == "save!") {
                    Ok(()) => println!("(saved {} messages to {arg})", messages.len()),
                    Err(e) => println!("(could not save: {e:#})"),
                },
                "load" if !arg.is_empty() => match load(Path::new(arg)) {
                    Ok(m) => {
                        messages = m;
                        println!("(loaded {} messages from {arg})", messages.len());
                    }
                    Err(e) => println!("(could not load: {e:#})"),
                },
                _ => println!("({HELP})"),
            }
            continue;
        }
        messages.push(Message::new("user", line));
        let req = Request { max_tokens: a.n, sampler, ignore_eos: a.ignore_eos, ..Request::chat(messages.clone()) };
        let mut dim = false;
        let show = a.reasoning == ReasoningShow::Show;
        signals.stop_answer.store(false, Ordering::SeqCst);
        signals.answering.store(true, Ordering::SeqCst);
        let result = engine.run(
            &req,
            &mut |d| {
                let mut o = out.lock();
                if show && !d.reasoning.is_empty() {
                    if !dim {
                        let _ = write!(o, "\x1b[2m");
                        dim = true;
                    }
                    let _ = write!(o, "{}", d.reasoning);
                }
                if !d.content.is_empty() {
                    if dim {
                        let _ = writeln!(o, "\x1b[0m");
                        dim = false;
                    }
                    let _ = write!(o, "{}", d.content);
                }
                let _ = o.flush();
                ControlFlow::Continue(())
            },
            &|| signals.answer_stopped(),
        );
        signals.answering.store(false, Ordering::SeqCst);
        if dim {
            print!("\x1b[0m");
        }
        println!();
        if signals.quitting() {
            // A second Ctrl-C (or SIGTERM) while answering: leave, whatever the answer came to.
            return Ok(());
        }
        let o = match result {
            Ok(o) => o,
            Err(e) => {
                messages.pop();
                println!("(error: {})", picchio_core::error::chain(&e));
                if matches!(e, picchio_runtime::Error::ContextOverflow { .. })
                    && messages.iter().any(|m| m.role == "assistant")
                {
                    // The conversation so far fills the context: say how to go on.
                    println!("(the conversation no longer fits the context: /reset starts a new one; --ctx N or -n N when starting picchio)");
                }
                continue;
            }
        };
        if o.finish == FinishReason::Cancelled && o.turn.completion_tokens() == 0 {
            // Stopped before the answer began (during the prefill): the question leaves the
            // conversation, so no empty assistant turn is rendered into the next prompts.
            messages.pop();
            println!("(stopped before answering; the message is not kept)");
            continue;
        }
        if o.finish == FinishReason::Cancelled {
            println!("(stopped)");
        }
        let st = &o.turn.stats;
        totals.turns += 1;
        totals.prompt += st.prompt_tokens;
        totals.cached += o.turn.cached_tokens;
        totals.generated += o.turn.completion_tokens();
        totals.hits += st.cache_hits;
        totals.misses += st.cache_misses;
        totals.bytes += st.bytes_read;
        let tok_s = if o.turn.tokens.len() > 1 { st.decode_tok_s } else { 0.0 };
        eprintln!(
            "[{} tokens, {tok_s:.1} tok/s; prompt {} tokens, {} reused from the KV cache ({:.0}%), {} prefilled in {:.0} ms; \
             first token after {:.0} ms; expert cache {:.0}% hits ({} / {}), {:.1} MB read]",
            o.turn.completion_tokens(),
            st.prompt_tokens,
            o.turn.cached_tokens,
            100.0 * o.turn.cached_tokens as f64 / st.prompt_tokens.max(1) as f64,
            st.prompt_tokens - o.turn.cached_tokens,
            st.prefill_ms,
            o.turn.first_token_ms,
            100.0 * st.cache_hits as f64 / (st.cache_hits + st.cache_misses).max(1) as f64,
            st.cache_hits,
            st.cache_hits + st.cache_misses,
            st.bytes_read as f64 / 1e6
        );
        let reasoning = (!o.reasoning.is_empty()).then(|| o.reasoning.clone());
        messages.push(Message { reasoning_content: reasoning, ..Message::new("assistant", &o.content) });
    }
}

fn initial(a: &Args) -> Vec<Message> {
    a.system.iter().map(|s| Message::new("system", s)).collect()
}

/// What the user gave at the prompt.
enum Input {
    /// A line (without its end).
    Line(String),
    /// The end of input.
    End,
}

/// The prompt's reader, on a thread so the conversation loop can notice a signal while it waits:
/// stdin line by line; `> ` is printed here.
struct Prompt {
    /// The lines.
    lines: mpsc::Receiver<Input>,
}

impl Prompt {
    fn start() -> anyhow::Result<Prompt> {
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if tx.send(Input::Line(line)).is_err() {
                    return;
                }
            }
            let _ = tx.send(Input::End);
        });
        Ok(Prompt { lines })
    }

    /// Shows the prompt for the next line.
    fn ask(&self) -> anyhow::Result<()> {
        print!("> ");
        std::io::stdout().flush().context("writing the prompt")
    }
}

fn print_stats(engine: &Engine, t: &Totals, messages: &[Message]) {
    println!(
        "({} turns, {} messages; {} prompt tokens of which {} reused ({:.0}%), {} generated; KV cache {} of {} positions; \
         expert cache {} hits / {} misses, {:.1} MB read from {})",
        t.turns,
        messages.len(),
        t.prompt,
        t.cached,
        100.0 * t.cached as f64 / t.prompt.max(1) as f64,
        t.generated,
        engine.session.kv_ids().len(),
        engine.context(),
        t.hits,
        t.misses,
        t.bytes as f64 / 1e6,
        engine.session.info.store
    );
}

/// `/save FILE` writes a new file and refuses an existing one (naming it); `/save! FILE`
/// (`replace`) replaces it, through a temporary file beside it renamed over it, so a failed write
/// leaves the old file whole.
fn save(path: &Path, messages: &[Message], replace: bool) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(&serde_json::json!({ "messages": messages }))? + "\n";
    if !replace {
        let mut f = match std::fs::OpenOptions::new().write(true).create_new(true).open(path) {
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => anyhow::bail!(
                "{} already exists: /save! {} replaces it, or choose another name",
                path.display(),
                path.display()
            ),
            r => r.with_context(|| format!("creating {}", path.display()))?,
        };
        return f.write_all(text.as_bytes()).with_context(|| format!("writing {}", path.display()));
    }
    if path.is_dir() {
        anyhow::bail!("{} is a directory", path.display());
    }
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    let tmp = path.with_file_name(name);
    let written = std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, path))
        .with_context(|| format!("writing {}", path.display()));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

fn load(path: &Path) -> anyhow::Result<Vec<Message>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let m: Vec<Message> = serde_json::from_value(v["messages"].clone())
        .with_context(|| format!("{}: expected {{\"messages\": [{{\"role\", \"content\"}}...]}}", path.display()))?;
    picchio_runtime::chat::template::check_messages(&m)?;
    Ok(m)
}
