//! The chat-format loaders as a front end reads a model directory: the input is written as the
//! directory's `tokenizer_config.json` (first byte even) or as its `chat_template.jinja` beside the
//! Qwen3 fixture's tokenizer config (first byte odd), read with `ChatFormat::from_dir`, then a fixed
//! conversation (system, two user turns, an assistant turn with think content and a tool call, a
//! tool result, function tools) is rendered with and without the generation prompt, and its
//! reasoning split and its tool calls taken out (Hermes and harmony parsers). Every outcome must be `Ok` or a clear error: no panic, no hang (a template's
//! work is bounded by minijinja's fuel), no allocation driven by a number in the file.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use picchio_runtime::chat::template::{Message, RenderOptions};
use picchio_runtime::chat::{ChatFormat, TemplateValue};
use picchio_runtime::Config;

/// A Qwen3-MoE config.json (the architecture decides only whether harmony is the fallback).
const CONFIG: &str = r#"{"architectures":["Qwen3MoeForCausalLM"],"model_type":"qwen3_moe","hidden_size":64,
"intermediate_size":128,"moe_intermediate_size":32,"num_hidden_layers":2,"num_attention_heads":4,
"num_key_value_heads":2,"head_dim":16,"num_experts":4,"num_experts_per_tok":2,"vocab_size":256,
"max_position_embeddings":512,"rms_norm_eps":1e-6,"rope_theta":10000.0}"#;

/// The Qwen3 fixture's tokenizer config (the special tokens a chat_template.jinja is given).
const QWEN3_TOKENIZER_CONFIG: &[u8] = include_bytes!("../../tests/fixtures/qwen3_moe_text/tokenizer_config.json");

fn config() -> &'static Config {
    static CFG: OnceLock<Config> = OnceLock::new();
    CFG.get_or_init(|| {
        let dir = picchio_fuzz::scratch_with("chat_config", "config.json", CONFIG.as_bytes());
        Config::from_dir(&dir).expect("the fixed config parses")
    })
}

/// The conversation rendered for every input, in OpenAI's message shape.
const CONVERSATION: &str = r#"[
 {"role": "system", "content": "You are a helpful assistant."},
 {"role": "user", "content": "What is the weather in Pisa?"},
 {"role": "assistant", "content": "Let me look.", "reasoning_content": "The user wants the weather.",
  "tool_calls": [{"id": "call_0", "type": "function",
                  "function": {"name": "get_weather", "arguments": {"city": "Pisa"}}}]},
 {"role": "tool", "content": "{\"temperature\": 14}", "tool_call_id": "call_0", "name": "get_weather"},
 {"role": "user", "content": "And tomorrow?"}
]"#;

/// The function tools given with it.
const TOOLS: &str = r#"[{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]"#;

fuzz_target!(|input: &[u8]| {
    let Some((&mode, body)) = input.split_first() else { return };
    let dir = picchio_fuzz::scratch_dir().join("chat");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch");
    if mode % 2 == 0 {
        picchio_fuzz::put(&dir, "tokenizer_config.json", body);
    } else {
        picchio_fuzz::put(&dir, "tokenizer_config.json", QWEN3_TOKENIZER_CONFIG);
        picchio_fuzz::put(&dir, "chat_template.jinja", body);
    }
    let Ok(Some(format)) = ChatFormat::from_dir(&dir, config()) else { return };
    let messages: Vec<Message> = serde_json::from_str(CONVERSATION).expect("the fixed conversation parses");
    let tools: Vec<TemplateValue> = serde_json::from_str(TOOLS).expect("the fixed tools parse");
    for (add_generation_prompt, enable_thinking) in [(true, None), (false, Some(false))] {
        let opts = RenderOptions { add_generation_prompt, enable_thinking, tools: &tools };
        if let Ok(text) = format.render(&messages, opts) {
            // Part way through a turn (a marker may be held back) and at its end.
            let _ = format.reasoning().split(&text, false);
            let _ = format.reasoning().split(&text, true);
            // The tool-call parsers read the same kind of text (the model's output).
            for done in [false, true] {
                let _ = picchio_runtime::chat::tools::split_hermes(&text, done);
                let _ = picchio_runtime::chat::harmony::split_output_calls(&text, done);
            }
        }
    }
});
