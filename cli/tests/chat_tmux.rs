//! `picchio chat` in a real terminal (a tmux pane) on the vendored real-tokenizer model: two turns,
//! the second prefilling only what the first did not leave in the KV cache (checked against the
//! prompts rendered from the saved conversation and `picchio run`'s greedy tokens), `/save`,
//! `/reset` starting from an empty cache, and Ctrl-C stopping an answer but not the program (a
//! second Ctrl-C at the prompt ends it). Linux only (tmux; the test kit's tool check).
#![cfg(target_os = "linux")]

mod common;

use std::path::Path;
use std::process::Command;

use common::serve::packed_model;
use picchio_runtime::chat::{ChatFormat, Message, RenderOptions};
use picchio_runtime::model::tokenizer::Tokenizer;
use picchio_runtime::Config;

const TEST: &str = "chat_in_tmux";

struct Tmux {
    name: String,
    /// Where the shell that runs the command writes its exit status.
    status: std::path::PathBuf,
}

impl Tmux {
    /// A detached tmux session running `cmd` (kept open after it exits so its screen can be read).
    /// `cmd` runs under a shell that writes its exit status to a file when it ends (see
    /// [`Tmux::exit_status`]); the shell's `trap : INT` keeps it alive through the Ctrl-Cs sent to
    /// the program (a caught signal, unlike an ignored one, is not inherited by the program).
    fn start(name: &str, cmd: &str) -> Tmux {
        let name = format!("picchio-{name}-{}", std::process::id());
        let status = std::env::temp_dir().join(format!("{name}.status"));
        let _ = std::fs::remove_file(&status);
        let wrapped = format!("trap : INT; {cmd}; echo $? > {}", status.display());
        let ok = Command::new("tmux")
            .args(["new-session", "-d", "-s", &name, "-x", "200", "-y", "60", &wrapped])
            .status()
            .unwrap()
            .success();
        assert!(ok, "tmux new-session failed");
        let _ = Command::new("tmux").args(["set-option", "-t", &name, "remain-on-exit", "on"]).status();
        Tmux { name, status }
    }

    fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", &self.name];
        args.extend_from_slice(keys);
        assert!(Command::new("tmux").args(&args).status().unwrap().success());
    }

    fn line(&self, text: &str) {
        self.keys(&["-l", text]);
        self.keys(&["Enter"]);
    }

    fn screen(&self) -> String {
        let o = Command::new("tmux").args(["capture-pane", "-p", "-J", "-S", "-", "-t", &self.name]).output().unwrap();
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// The exit status of the pane's process once it is dead.
    /// The program's exit status as its shell wrote it (`"0"`, …; `128 + N` for signal `N`), once the
    /// pane is dead. (Read from the shell, not from tmux's `#{pane_dead_status}`: tmux 3.3a left a
    /// dead pane's process unreaped at times, and its status empty.)
    fn exit_status(&self) -> String {
        std::fs::read_to_string(&self.status).unwrap_or_default().trim().to_string()
    }

    /// The pane's shell has ended (after writing the program's exit status).
    fn dead(&self) -> bool {
        let o =
            Command::new("tmux").args(["display-message", "-p", "-t", &self.name, "#{pane_dead}"]).output().unwrap();
        String::from_utf8_lossy(&o.stdout).trim() == "1"
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        eprintln!("--- tmux screen of {}:\n{}", self.name, self.screen());
        let _ = Command::new("tmux").args(["kill-session", "-t", &self.name]).status();
        let _ = std::fs::remove_file(&self.status);
    }
}

/// The stats lines (`[N tokens, ...]`) of the log.
fn stats(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log).unwrap_or_default().lines().filter(|l| l.starts_with('[')).map(str::to_owned).collect()
}

/// `(prompt tokens, reused)` of a stats line `[..; prompt P tokens, R reused ...]`.
fn prompt_and_reused(line: &str) -> (usize, usize) {
    let after = line.split("prompt ").nth(1).unwrap();
    let mut w = after.split_whitespace();
    let p = w.next().unwrap().parse().unwrap();
    let r = w.nth(1).unwrap().parse().unwrap();
    (p, r)
}

fn wait(what: &str, t: &Tmux, mut cond: impl FnMut() -> bool) {
    let held = picchio_testkit::wait_until(picchio_testkit::bin::HANG_LIMIT, &mut cond);
    assert!(held, "{what} never happened; screen:\n{}", t.screen());
}

/// Sends `line`, waits until the answer has begun (text follows the prompt line), presses Ctrl-C
/// and waits until the answer says `(stopped)`.
fn stop_an_answer(t: &Tmux, line: &str) {
    t.line(line);
    wait("the answer to begin", t, || {
        let s = t.screen();
        s.split(&format!("> {line}")).nth(1).is_some_and(|rest| rest.trim().chars().count() > 3)
    });
    t.keys(&["C-c"]);
    wait("the answer to stop", t, || t.screen().contains("(stopped)"));
}

fn ids_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
#[ignore = "needs tmux"]
fn chat_in_tmux() {
    picchio_testkit::loopdev::require_tool(TEST, "tmux", &["-V"]);
    let tmp = common::scratch();
    let model = packed_model(tmp.path());
    let (m, exe) = (model.to_str().unwrap(), env!("CARGO_BIN_EXE_picchio"));
    let log = tmp.path().join("chat.log");
    let saved = tmp.path().join("conv.json");

    // Two turns, /save, /reset, a third turn, /exit. The bare form `picchio --model DIR` is chat.
    let cmd = format!("{exe} --model {m} --ecap 4 --ctx 256 -n 8 2>{}", log.display());
    let t = Tmux::start("turns", &cmd);
    wait("the banner", &t, || std::fs::read_to_string(&log).unwrap_or_default().contains("picchio chat:"));
    t.line("Hi there");
    wait("turn 1", &t, || stats(&log).len() == 1);
    t.line("Tell me more.");
    wait("turn 2", &t, || stats(&log).len() == 2);
    t.line(&format!("/save {}", saved.display()));
    wait("/save", &t, || t.screen().contains("(saved 4 messages"));
    t.line("/reset");
    wait("/reset", &t, || t.screen().contains("(new conversation)"));
    t.line("Hi there");
    wait("turn 3", &t, || stats(&log).len() == 3);
    t.line("/stats");
    wait("/stats", &t, || t.screen().contains("(3 turns, 2 messages"));
    t.line("/exit");
    wait("exit", &t, || t.dead());
    let st = stats(&log);

    // Expected: turn 1 reuses nothing; turn 2 reuses the longest common prefix of its prompt with
    // what turn 1 left in the KV cache (turn 1's prompt and answer but its last token); turn 3,
    // after /reset, nothing.
    let conv: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    let msgs: Vec<Message> = serde_json::from_value(conv["messages"].clone()).unwrap();
    assert_eq!(msgs.iter().map(|m| m.role.as_str()).collect::<Vec<_>>(), ["user", "assistant", "user", "assistant"]);
    let cfg = Config::from_dir(&model).unwrap();
    let f = ChatFormat::from_dir(&model, &cfg).unwrap().unwrap();
    let tok = Tokenizer::from_dir(&model).unwrap().unwrap();
    let gen = RenderOptions { add_generation_prompt: true, ..Default::default() };
    let p1 = tok.encode(&f.render(&msgs[..1], gen).unwrap()).unwrap();
    let p2 = tok.encode(&f.render(&msgs[..3], gen).unwrap()).unwrap();
    let ids = p1.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let run: serde_json::Value = serde_json::from_str(&common::ok(&[
        "run",
        "--model",
        m,
        "--ecap",
        "4",
        "--prompt-ids",
        &ids,
        "-n",
        "8",
        "--json",
        "--stop-at-eos",
    ]))
    .unwrap();
    let a1 = ids_of(&run["tokens"]);
    assert_eq!(tok.decode_text(&a1).unwrap(), msgs[1].content, "turn 1's answer is run's greedy answer");
    let kv1 = [&p1[..], &a1[..a1.len() - 1]].concat();
    let shared = p2.iter().zip(&kv1).take_while(|(a, b)| a == b).count();
    assert!(shared >= p1.len(), "turn 2 shares turn 1's prompt");
    assert_eq!(prompt_and_reused(&st[0]), (p1.len(), 0), "{}", st[0]);
    assert_eq!(prompt_and_reused(&st[1]), (p2.len(), shared), "{}", st[1]);
    assert!(st[1].contains(&format!("{} prefilled", p2.len() - shared)), "{}", st[1]);
    assert_eq!(prompt_and_reused(&st[2]), (p1.len(), 0), "after /reset: {}", st[2]);

    // Ctrl-C during a long answer stops it; the program goes on; Ctrl-C at the prompt ends it.
    let log2 = tmp.path().join("chat2.log");
    let cmd = format!("{exe} chat --model {m} --ecap 4 --ctx 512 -n 480 --ignore-eos 2>{}", log2.display());
    let t2 = Tmux::start("ctrlc", &cmd);
    wait("the banner", &t2, || std::fs::read_to_string(&log2).unwrap_or_default().contains("picchio chat:"));
    stop_an_answer(&t2, "Hi there");
    let st = stats(&log2);
    assert_eq!(st.len(), 1);
    let n: usize = st[0].trim_start_matches('[').split_whitespace().next().unwrap().parse().unwrap();
    assert!(n < 480, "Ctrl-C stopped the answer early: {}", st[0]);
    assert!(!t2.dead(), "Ctrl-C during an answer does not end the program");
    t2.line("/stats");
    wait("/stats after Ctrl-C", &t2, || t2.screen().contains("(1 turns, 2 messages"));
    t2.keys(&["C-c"]);
    wait("exit on Ctrl-C at the prompt", &t2, || t2.dead());
    assert!(std::fs::read_to_string(&log2).unwrap().contains("bye"));
}

#[test]
#[ignore = "needs tmux"]
fn ctrl_c_twice_ends_the_chat_and_shuts_the_nvme_controller_down() {
    picchio_testkit::loopdev::require_tool(
        "ctrl_c_twice_ends_the_chat_and_shuts_the_nvme_controller_down",
        "tmux",
        &["-V"],
    );
    let tmp = common::scratch();
    let model = packed_model(tmp.path());
    let exe = env!("CARGO_BIN_EXE_picchio");
    let log = tmp.path().join("chat.log");
    // Our NVMe driver against the software controller model reading the image; -v logs the
    // driver's shutdown and what the model saw. No --model: the image records it.
    let store = format!("nvme-sim:{}", model.join("experts.picchioflat").display());
    let cmd = format!(
        "env -u PICCHIO_MODEL {exe} -v --store {store} --ecap 4 --ctx 512 -n 480 --ignore-eos 2>{}",
        log.display()
    );
    let t = Tmux::start("nvme", &cmd);
    let text = || std::fs::read_to_string(&log).unwrap_or_default();
    wait("the banner", &t, || text().contains("picchio chat:"));
    assert!(text().contains("store nvme-sim:"), "{}", text());
    // Ctrl-C twice: the first stops the answer, the second ends the program. The second is sent once
    // the first has been seen (two SIGINTs sent at once can arrive as one: a pending standard
    // signal is not queued twice), so it is the prompt's Ctrl-C that ends the chat here. A second
    // Ctrl-C during the answer takes the same exit (`quit`) but is not sent here: a test cannot time
    // it to land inside the answer without depending on the machine's speed.
    stop_an_answer(&t, "Hi there");
    t.keys(&["C-c"]);
    wait("the exit", &t, || t.dead());
    let log = text();
    assert_eq!(t.exit_status(), "0", "a clean exit: {log}");
    // The session was dropped before the goodbye: the driver shut the controller down (CC.SHN,
    // CSTS.SHST complete), the model saw exactly one shutdown, and every DMA buffer was freed.
    let at = |s: &str| log.find(s).unwrap_or_else(|| panic!("no {s:?} in the log:\n{log}"));
    let shut = at("shutdown complete (CSTS.SHST=2)");
    let model_saw = at("nvme-sim controller model stopped: 1 shutdown(s)");
    let freed = at("nvme-sim DMA memory freed");
    let bye = at("bye");
    assert!(shut < model_saw && model_saw < bye && freed < bye, "{log}");
    assert!(log.contains("enabled at the end: false"), "{log}");
}
