//! A [`Tokenizer`] built from a GGUF's own metadata (`tokenizer.ggml.*`), so a bare `.gguf` needs no
//! tokenizer.json beside it; docs/format.md, "GGUF files", lists the keys.
//!
//! What llama.cpp's converter writes for a byte-level BPE (`convert_hf_to_gguf.py`,
//! `TextModel._set_vocab_gpt2`, and gguf-py's `SpecialVocab`):
//! - `tokenizer.ggml.model` = `gpt2`; `tokenizer.ggml.pre` names the pre-tokenizer, chosen by hashing
//!   the Hugging Face tokenizer's ids on a check text (`get_vocab_base_pre`);
//! - `tokenizer.ggml.tokens`: one string per id up to the model's `vocab_size`, ids the Hugging Face
//!   tokenizer lacks written as `[PAD<id>]`; `tokenizer.ggml.token_type`, one i32 per token:
//!   1 normal, 3 control (an added token marked special, or one that looks like `<|…|>`),
//!   4 user-defined (other added tokens), 5 unused (the `[PAD<id>]` fillers);
//! - `tokenizer.ggml.merges`: the BPE merges in rank order, each `"left right"`;
//! - `tokenizer.ggml.{bos,eos,eot,eom,unknown,seperator,padding,mask}_token_id` when known, and
//!   `tokenizer.ggml.add_{bos,eos,sep}_token`; `tokenizer.chat_template` when the model has one.
//!
//! From these we rebuild the Hugging Face pipeline the file was made from: a BPE model over the
//! normal and added tokens with the merges, the named pre-tokenizer's split regex followed by
//! byte-level mapping, a byte-level decoder, and the control and user-defined tokens as added
//! tokens (special = control). The pre-tokenizer is a table entry ([`PRE_TOKENIZERS`]): its regex
//! is the one llama.cpp's `llama-vocab.cpp` quotes as the original tokenizer.json expression for
//! that name, and the parts of the Hugging Face tokenizer the GGUF does not record (Qwen2's NFC
//! normalizer, o200k's `ignore_merges`) come with the entry.

use picchio_core::format::gguf::{Array, GgufFile, Value};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use super::tokenizer::Tokenizer;
use crate::error::{Error, Result};

/// `tokenizer.ggml.model`.
pub const KEY_MODEL: &str = "tokenizer.ggml.model";
/// `tokenizer.ggml.pre`.
pub const KEY_PRE: &str = "tokenizer.ggml.pre";
/// `tokenizer.ggml.tokens`.
pub const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
/// `tokenizer.ggml.token_type`.
pub const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
/// `tokenizer.ggml.merges`.
pub const KEY_MERGES: &str = "tokenizer.ggml.merges";
/// `tokenizer.chat_template`.
pub const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";

/// The `tokenizer.ggml.model` values this module builds.
pub const SUPPORTED_MODELS: &[&str] = &["gpt2"];

/// llama.cpp's token types (`enum llama_token_type`), as `tokenizer.ggml.token_type` holds them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenType {
    /// 1: an ordinary vocabulary entry.
    Normal,
    /// 3: an added token marked special (`<|im_end|>`), or one that looks like it.
    Control,
    /// 4: any other added token (`<think>`).
    UserDefined,
    /// 5: an id the source tokenizer does not have (`[PAD151669]`): left out.
    Unused,
}

impl TokenType {
    fn from_id(id: i64) -> Option<TokenType> {
        match id {
            1 => Some(TokenType::Normal),
            3 => Some(TokenType::Control),
            4 => Some(TokenType::UserDefined),
            5 => Some(TokenType::Unused),
            _ => None,
        }
    }
}

/// How one `tokenizer.ggml.pre` value is rebuilt as a Hugging Face pre-tokenization.
#[derive(Debug)]
pub struct PreTokenizer {
    /// The value of `tokenizer.ggml.pre`.
    pub name: &'static str,
    /// The split regex (behaviour `Isolated`), before byte-level mapping.
    pub regex: &'static str,
    /// Whether the source tokenizer NFC-normalizes its input first (Qwen2's tokenizer.json does;
    /// llama.cpp does not).
    pub nfc: bool,
    /// Whether a pre-token that is itself a vocabulary entry is taken whole before any merge
    /// (tiktoken's rule; tokenizer.json `model.ignore_merges`).
    pub ignore_merges: bool,
}

/// Every pre-tokenizer this module builds. The regexes are the tokenizer.json expressions that
/// llama.cpp's `llama-vocab.cpp` quotes for `LLAMA_VOCAB_PRE_TYPE_QWEN2` and `..._GPT4O` (it runs
/// rewrites of them in its own regex engine).
pub const PRE_TOKENIZERS: &[PreTokenizer] = &[
    // Qwen2, Qwen2.5, Qwen3 (convert_hf_to_gguf.py: hash of Qwen/Qwen1.5-7B, Qwen3-Embedding).
    PreTokenizer {
        name: "qwen2",
        regex: r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        nfc: true,
        ignore_merges: false,
    },
    // o200k (GPT-4o, gpt-oss's o200k_harmony; convert_hf_to_gguf.py: hash of Xenova/gpt-4o).
    PreTokenizer {
        name: "gpt-4o",
        regex: r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        nfc: false,
        ignore_merges: true,
    },
];

/// The special token ids and flags a GGUF records (each `None` when its key is absent). llama.cpp
/// also guesses an end-of-turn id from token text when `eot` is absent; that guess is not made here.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// `tokenizer.ggml.bos_token_id`.
    pub bos: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos: Option<u32>,
    /// `tokenizer.ggml.eot_token_id` (end of turn).
    pub eot: Option<u32>,
    /// `tokenizer.ggml.eom_token_id` (end of message).
    pub eom: Option<u32>,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unk: Option<u32>,
    /// `tokenizer.ggml.seperator_token_id` (llama.cpp's spelling).
    pub sep: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub pad: Option<u32>,
    /// `tokenizer.ggml.mask_token_id`.
    pub mask: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`: whether a prompt starts with `bos`.
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token`: whether a prompt ends with `eos`.
    pub add_eos: Option<bool>,
    /// `tokenizer.ggml.add_sep_token`.
    pub add_sep: Option<bool>,
}

/// A tokenizer read from a GGUF, with what the chat code needs beside it.
pub struct GgufTokenizer {
    /// The tokenizer (its [`Tokenizer::path`] is the GGUF).
    pub tokenizer: Tokenizer,
    /// `tokenizer.ggml.pre`'s entry.
    pub pre: &'static PreTokenizer,
    /// The special ids and add-bos/eos flags.
    pub special: SpecialTokens,
    /// `tokenizer.chat_template`, the Jinja source, when the file has one.
    pub chat_template: Option<String>,
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF's metadata describes: `tokenizer.ggml.model` `gpt2` with a
    /// `tokenizer.ggml.pre` of [`PRE_TOKENIZERS`], from `tokenizer.ggml.tokens`, `token_type` and
    /// `merges`; reads the special ids and `tokenizer.chat_template` beside it.
    ///
    /// # Errors
    /// [`Error::GgufTokenizer`] naming the file and the key: a missing key or one of the wrong type,
    /// an unknown model or pre-tokenizer (listing the supported ones), a token type other than
    /// 1/3/4/5, `token_type` and `tokens` of different lengths, a token spelled twice, a merge that
    /// is not two tokens whose concatenation is a token, a special id beyond the vocabulary.
    pub fn from_gguf(file: &GgufFile) -> Result<GgufTokenizer> {
        let meta = Meta { file };
        let model = meta.string(KEY_MODEL)?;
        if !SUPPORTED_MODELS.contains(&model) {
            return Err(meta.err(
                KEY_MODEL,
                format!(
                    "\"{model}\" is not a tokenizer model picchio builds (supported: {})",
                    SUPPORTED_MODELS.join(", ")
                ),
            ));
        }
        let pre_name = meta.string(KEY_PRE)?;
        let pre = PRE_TOKENIZERS.iter().find(|p| p.name == pre_name).ok_or_else(|| {
            let names: Vec<_> = PRE_TOKENIZERS.iter().map(|p| p.name).collect();
            meta.err(
                KEY_PRE,
                format!("\"{pre_name}\" is not a pre-tokenizer picchio builds (supported: {})", names.join(", ")),
            )
        })?;

        let tokens = meta.strings(KEY_TOKENS)?;
        let types = meta.token_types(tokens.len())?;
        let mut vocab = Vocab::with_capacity(tokens.len());
        let mut added = Vec::new();
        for (id, (text, ty)) in tokens.iter().zip(&types).enumerate() {
            if *ty == TokenType::Unused {
                continue;
            }
            let id = u32::try_from(id)
                .map_err(|_| meta.err(KEY_TOKENS, format!("{} tokens: more than u32 ids", tokens.len())))?;
            if let Some(first) = vocab.insert(text.clone(), id) {
                return Err(meta.err(KEY_TOKENS, format!("token {text:?} is spelled at ids {first} and {id}")));
            }
            if matches!(ty, TokenType::Control | TokenType::UserDefined) {
                // llama.cpp's converter writes added tokens already normalized.
                added.push((id, AddedToken::from(text.clone(), *ty == TokenType::Control).normalized(false)));
            }
        }
        let merges = meta.merges(&vocab)?;

        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(pre.ignore_merges)
            .build()
            .map_err(|e| meta.err(KEY_MERGES, e.to_string()))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        if pre.nfc {
            inner.with_normalizer(Some(NFC)).map_err(|e| meta.err(KEY_PRE, e.to_string()))?;
        }
        let split = Split::new(SplitPattern::Regex(pre.regex.to_owned()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| meta.err(KEY_PRE, format!("the regex of \"{}\": {e}", pre.name)))?;
        inner.with_pre_tokenizer(Some(Sequence::new(vec![split.into(), ByteLevel::new(false, false, false).into()])));
        inner.with_decoder(Some(ByteLevel::default()));
        inner
            .add_tokens(added.iter().map(|(_, t)| t.clone()))
            .map_err(|e| meta.err(KEY_TOKEN_TYPE, format!("adding the control and user-defined tokens: {e}")))?;
        for (id, t) in &added {
            if inner.token_to_id(&t.content) != Some(*id) {
                return Err(meta.err(KEY_TOKENS, format!("added token {:?} did not keep id {id}", t.content)));
            }
        }

        let special = meta.special(tokens.len())?;
        let chat_template = match file.get(KEY_CHAT_TEMPLATE) {
            None => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(v) => return Err(meta.wrong_type(KEY_CHAT_TEMPLATE, "string", v)),
        };
        Ok(GgufTokenizer { tokenizer: Tokenizer::from_parts(inner, file.path()), pre, special, chat_template })
    }
}

impl GgufTokenizer {
    /// The texts of the `bos`, `eos`, `pad` and `unk` ids as tokenizer_config.json spells them
    /// (`{"eos_token": "<|im_end|>", ...}`, absent ids left out): what
    /// [`crate::chat::template::JinjaTemplate::new`] takes as the template's special-token variables.
    pub fn template_tokens(&self) -> serde_json::Value {
        let mut map = serde_json::Map::new();
        let s = &self.special;
        for (name, id) in [("bos_token", s.bos), ("eos_token", s.eos), ("pad_token", s.pad), ("unk_token", s.unk)] {
            if let Some(text) = id.and_then(|id| self.tokenizer.id_to_token(id)) {
                map.insert(name.to_owned(), serde_json::Value::String(text));
            }
        }
        serde_json::Value::Object(map)
    }
}

/// Typed reads of the tokenizer keys, each error naming the file and the key.
struct Meta<'a> {
    file: &'a GgufFile,
}

impl Meta<'_> {
    fn err(&self, key: &str, message: String) -> Error {
        Error::GgufTokenizer { path: self.file.path().to_owned(), key: key.to_owned(), message }
    }

    fn wrong_type(&self, key: &str, expected: &str, found: &Value) -> Error {
        self.err(key, format!("expected {expected}, found {}", found.type_name()))
    }

    fn value(&self, key: &str) -> Result<&Value> {
        self.file.get(key).ok_or_else(|| self.err(key, "missing (a gpt2 tokenizer needs it)".into()))
    }

    fn string(&self, key: &str) -> Result<&str> {
        match self.value(key)? {
            Value::String(s) => Ok(s),
            v => Err(self.wrong_type(key, "string", v)),
        }
    }

    fn strings(&self, key: &str) -> Result<&[String]> {
        match self.value(key)? {
            Value::Array(Array::String(s)) => Ok(s),
            v => Err(self.wrong_type(key, "array of string", v)),
        }
    }

    /// `tokenizer.ggml.token_type`: integers (the converter writes i32), one per token.
    fn token_types(&self, n_tokens: usize) -> Result<Vec<TokenType>> {
        let raw: Vec<i64> = match self.value(KEY_TOKEN_TYPE)? {
            Value::Array(Array::I32(v)) => v.iter().map(|&t| t.into()).collect(),
            Value::Array(Array::U32(v)) => v.iter().map(|&t| t.into()).collect(),
            Value::Array(Array::I8(v)) => v.iter().map(|&t| t.into()).collect(),
            Value::Array(Array::U8(v)) => v.iter().map(|&t| t.into()).collect(),
            v => return Err(self.wrong_type(KEY_TOKEN_TYPE, "array of i32", v)),
        };
        if raw.len() != n_tokens {
            return Err(self.err(
                KEY_TOKEN_TYPE,
                format!("has {} entries but {KEY_TOKENS} has {n_tokens}: one type per token is expected", raw.len()),
            ));
        }
        raw.iter()
            .enumerate()
            .map(|(i, &t)| {
                TokenType::from_id(t).ok_or_else(|| {
                    self.err(
                        KEY_TOKEN_TYPE,
                        format!(
                            "token {i} has type {t}: expected 1 (normal), 3 (control), 4 (user-defined) or 5 (unused)"
                        ),
                    )
                })
            })
            .collect()
    }

    /// `tokenizer.ggml.merges`: `"left right"`, split at the first space after the first character
    /// (as llama.cpp does), both sides and their concatenation tokens of `vocab`.
    fn merges(&self, vocab: &Vocab) -> Result<Vec<(String, String)>> {
        let lines = self.strings(KEY_MERGES)?;
        let mut out = Vec::with_capacity(lines.len());
        for (i, line) in lines.iter().enumerate() {
            let first = line.chars().next().map_or(0, char::len_utf8);
            let (a, b) =
                line[first..].find(' ').map(|p| (&line[..first + p], &line[first + p + 1..])).ok_or_else(|| {
                    self.err(KEY_MERGES, format!("entry {i} {line:?} is not two tokens separated by a space"))
                })?;
            for part in [a, b] {
                if !vocab.contains_key(part) {
                    return Err(self.err(KEY_MERGES, format!("entry {i} {line:?}: {part:?} is not a token")));
                }
            }
            if !vocab.contains_key(&format!("{a}{b}")) {
                return Err(self.err(
                    KEY_MERGES,
                    format!("entry {i} {line:?}: the merged {:?} is not a token", format!("{a}{b}")),
                ));
            }
            out.push((a.to_owned(), b.to_owned()));
        }
        Ok(out)
    }

    fn special(&self, n_tokens: usize) -> Result<SpecialTokens> {
        let id = |name: &str| -> Result<Option<u32>> {
            let key = format!("tokenizer.ggml.{name}_token_id");
            let Some(v) = self.file.get(&key) else { return Ok(None) };
            let id = v.as_u64().ok_or_else(|| self.wrong_type(&key, "a non-negative integer", v))?;
            match u32::try_from(id) {
                Ok(id) if (id as usize) < n_tokens => Ok(Some(id)),
                _ => Err(self.err(&key, format!("id {id} is beyond the {n_tokens} tokens"))),
            }
        };
        let flag = |name: &str| -> Result<Option<bool>> {
            let key = format!("tokenizer.ggml.add_{name}_token");
            match self.file.get(&key) {
                None => Ok(None),
                Some(Value::Bool(b)) => Ok(Some(*b)),
                Some(v) => Err(self.wrong_type(&key, "bool", v)),
            }
        };
        Ok(SpecialTokens {
            bos: id("bos")?,
            eos: id("eos")?,
            eot: id("eot")?,
            eom: id("eom")?,
            unk: id("unknown")?,
            sep: id("seperator")?,
            pad: id("padding")?,
            mask: id("mask")?,
            add_bos: flag("bos")?,
            add_eos: flag("eos")?,
            add_sep: flag("sep")?,
        })
    }
}
