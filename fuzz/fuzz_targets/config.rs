//! `config.json` as the runtime reads it: the input is written as the config of a scratch model
//! directory and read with `Config::from_dir` (both architectures, both key spellings), then every
//! derived value the runtime asks for is computed (RoPE, MoE layers, attention windows, EOS ids).
//! Every outcome must be `Ok` or a clear error, without work or memory driven by a number in the file.
#![no_main]

use libfuzzer_sys::fuzz_target;
use picchio_runtime::Config;

fuzz_target!(|text: &[u8]| {
    let dir = picchio_fuzz::scratch_with("config", "config.json", text);
    let Ok(cfg) = Config::from_dir(&dir) else { return };
    let _ = (cfg.arch(), cfg.head_dim(), cfg.rope_theta(), cfg.rope(), cfg.swiglu_limit(), cfg.eos_ids());
    let moe = cfg.moe_layers();
    assert!(moe.len() <= cfg.num_hidden_layers);
    for l in 0..cfg.num_hidden_layers.min(4) {
        let _ = (cfg.layer_type(l), cfg.attention_window(l), cfg.is_moe_layer(l));
    }
});
