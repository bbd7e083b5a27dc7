#!/usr/bin/env python3
"""Writes the checked-in seed corpora of the fuzz targets (fuzz/corpus/<target>/) from the fixtures
in tests/fixtures, each file under 64 KiB. Run from anywhere: `python3 fuzz/seeds/make_seeds.py`.
The output is deterministic; re-running it rewrites the same bytes."""
import hashlib
import json
import os
import struct

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIX = os.path.join(ROOT, "tests", "fixtures")
OUT = os.path.join(ROOT, "fuzz", "corpus")


def put(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    assert len(data) < 64 * 1024, (target, name, len(data))
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def fixture(*p):
    with open(os.path.join(FIX, *p), "rb") as f:
        return f.read()


# --- picchioflat: the Picchio (C) image of picchio_c/qwen3_moe, cut down to stay small.
img = fixture("picchio_c", "qwen3_moe", "experts.picchioflat")
BS = 4096
sb = bytearray(img[:BS])
(n_entries,) = struct.unpack_from("<I", sb, 36)
index = img[BS:BS + 24 * n_entries]


def image_with(k):
    """A valid prefix store: the first k entries, their payloads, the index hash recomputed."""
    idx = index[:24 * k]
    s = bytearray(sb)
    struct.pack_into("<I", s, 36, k)
    struct.pack_into("<Q", s, 48, 24 * k)
    s[64:96] = hashlib.sha256(idx).digest()
    (data_offset,) = struct.unpack_from("<Q", s, 56)
    end = max(struct.unpack_from("<Q", idx, 24 * i)[0] + struct.unpack_from("<I", idx, 24 * i + 12)[0] for i in range(k))
    region = bytes(s) + idx + bytes(data_offset - BS - len(idx))
    return region + img[data_offset:end]


put("picchioflat", "prefix_store_2_entries", image_with(2))
put("picchioflat", "prefix_store_5_entries", image_with(5))
# The superblock and index region of the full image: every entry lies past the end.
put("picchioflat", "index_region_only", img[:2 * BS])
put("picchioflat", "superblock_only", img[:BS])

# --- safetensors: small files crafted with the fixtures' dtypes and spellings, and real headers cut.


def st(tensors, metadata=None, data=None, extra=b""):
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    at = 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + nbytes]}
        at += nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    body = data if data is not None else bytes((i * 7) & 0xFF for i in range(at))
    return struct.pack("<Q", len(h)) + h + body + extra


put("safetensors", "valid_mixed_dtypes", st([
    ("model.embed_tokens.weight", "BF16", [4, 8], 64),
    ("model.layers.0.mlp.gate.weight", "F32", [2, 8], 64),
    ("model.layers.0.mlp.experts.0.gate_up_proj", "U8", [64], 64),
    ("model.layers.0.mlp.experts.0.gate_up_proj.qs", "F32", [4], 16),
    ("lm_head.weight", "I8", [4, 8], 32),
    ("model.norm.weight", "F16", [8], 16),
], metadata={"format": "pt"}))
put("safetensors", "zero_element_tensor", st([("empty", "F32", [0, 4], 0), ("one", "BF16", [1], 2)]))
put("safetensors", "offsets_disagree_with_shape", st([("a", "F32", [4, 2], 24)]))
put("safetensors", "huge_length_prefix", struct.pack("<Q", (1 << 64) - 9) + b"{}")
put("safetensors", "non_json_header", struct.pack("<Q", 9) + b"not json!")
dup = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}'
put("safetensors", "duplicate_names", struct.pack("<Q", len(dup)) + dup + bytes(8))
over = b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}'
put("safetensors", "overlapping_ranges", struct.pack("<Q", len(over)) + over + bytes(12))
put("safetensors", "past_eof", st([("a", "F32", [16], 64)], data=bytes(10)))
# Real headers of the fixtures (their data cut off: truncated files).
for name, path in [("gpt_oss_mxfp4_header", ("gpt_oss_mxfp4", "model.safetensors")),
                   ("qwen3_moe_wide_header", ("qwen3_moe_wide", "model.safetensors"))]:
    b = fixture(*path)
    (n,) = struct.unpack_from("<Q", b)
    put("safetensors", name, b[:8 + n + 256])

# --- safetensors_index: index files for the target's two scratch shards, and the fixture's own.
S1, S2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
put("safetensors_index", "valid", json.dumps({"metadata": {"total_size": 40}, "weight_map": {"a": S1, "b": S1, "c": S2, "shared": S2}}).encode())
put("safetensors_index", "missing_tensor", json.dumps({"weight_map": {"a": S1, "zzz": S2}}).encode())
put("safetensors_index", "path_and_dir", json.dumps({"weight_map": {"a": "../x", "b": "subdir", "c": "."}}).encode())
put("safetensors_index", "fixture_qwen3_moe", fixture("qwen3_moe", "model.safetensors.index.json"))

# --- config: every fixture config.json (both architectures, both spellings of the keys).
for d in ["qwen3_moe", "qwen3_moe_wide", "qwen3_moe_text", "gpt_oss_mxfp4", "gpt_oss_bf16"]:
    put("config", d, fixture(d, "config.json"))

# --- nvme_identify: pages as QEMU's controller writes them (the unit tests' values).
ctrl = bytearray(4096)
struct.pack_into("<H", ctrl, 0, 0x1B36)
ctrl[4:24] = b"deadbeef".ljust(20)
ctrl[24:64] = b"QEMU NVMe Ctrl".ljust(40)
ctrl[64:72] = b"7.2.0".ljust(8)
ctrl[77] = 7
ctrl[512], ctrl[513] = 0x66, 0x44
struct.pack_into("<I", ctrl, 516, 1)
put("nvme_identify", "controller_qemu", bytes(ctrl))
ns = bytearray(4096)
struct.pack_into("<QQQ", ns, 0, 1 << 21, 1 << 21, 1 << 20)
ns[25], ns[26] = 1, 1
struct.pack_into("<II", ns, 128, 9 << 16, (2 << 24) | (12 << 16) | 8)
put("nvme_identify", "namespace_two_formats", bytes(ns))

# --- nvme_cqe: a ring of 4 (size byte 2) and completions as a controller posts them.


def cqe(cid, sqhd, status, phase, dw0=0):
    return struct.pack("<IIHHHH", dw0, 0, sqhd, 1, cid, (status << 1) | phase)


put("nvme_cqe", "in_order", bytes([2]) + b"".join(cqe(c, c + 1, 0, 1) for c in range(3)))
put("nvme_cqe", "wrap_and_errors", bytes([2]) + b"".join([
    cqe(2, 1, 0, 1), cqe(0, 2, 0x02, 1), cqe(1, 3, (2 << 8) | 0x81, 1), cqe(0, 0, 0, 0), cqe(2, 1, 0, 0)]))
put("nvme_cqe", "unknown_cid", bytes([5]) + cqe(0xFFFF, 0, 0, 1) + cqe(0, 0xFFFF, 0, 1))

# --- device_signatures: device heads with the signatures the scan knows (libblkid's offsets).
put("device_signatures", "blank", bytes(8192))
mbr = bytearray(4096)
mbr[446 + 4] = 0x83
mbr[446 + 16 + 4] = 0xEE
mbr[510:512] = b"\x55\xaa"
mbr[512:520] = b"EFI PART"
put("device_signatures", "mbr_and_gpt", bytes(mbr))
ext = bytearray(4096)
ext[1080:1082] = b"\x53\xef"
struct.pack_into("<I", ext, 1048, 2)
put("device_signatures", "ext4", bytes(ext))
fat = bytearray(1024)
fat[3:11] = b"MSDOS5.0"
fat[82:90] = b"FAT32   "
fat[510:512] = b"\x55\xaa"
put("device_signatures", "vfat", bytes(fat))
swap = bytearray(4096)
swap[4086:4096] = b"SWAPSPACE2"
put("device_signatures", "swap", bytes(swap))
put("device_signatures", "picchioflat", img[:BS])

# --- chat_template: first byte even = tokenizer_config.json, odd = chat_template.jinja (beside the
# Qwen3 fixture's tokenizer config).
qwen_tc = fixture("qwen3_moe_text", "tokenizer_config.json")
put("chat_template", "qwen3_tokenizer_config", b"\x00" + qwen_tc)
put("chat_template", "gpt_oss_tokenizer_config", b"\x00" + fixture("tokenizers", "gpt_oss", "tokenizer_config.json"))
put("chat_template", "qwen3_chat_template_jinja", b"\x01" + json.loads(qwen_tc)["chat_template"].encode())
put("chat_template", "template_list", b"\x00" + json.dumps({
    "eos_token": {"content": "<|im_end|>"},
    "chat_template": [{"name": "tool_use", "template": "{{ tools }}"},
                      {"name": "default", "template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                                                      "{% if add_generation_prompt %}<assistant>{% endif %}"}]}).encode())
put("chat_template", "raise_exception", b"\x01{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}")

# --- gguf: gguf-py's tiny GGUF and its split halves (tests/fixtures/gguf), and hand-made headers:
# nested arrays, a big-endian version, a huge count, an F32 tensor with general.alignment 64.
for name in ["tiny.gguf", "tiny-split-00001-of-00002.gguf", "tiny-split-00002-of-00002.gguf"]:
    put("gguf", name.replace(".gguf", ""), fixture("gguf", name))


def gguf_str(s):
    return struct.pack("<Q", len(s)) + s


def gguf(version, tensors, kvs, endian="<"):
    return b"GGUF" + struct.pack(endian + "IQQ", version, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)


nested = gguf_str(b"nested") + struct.pack("<IIQ", 9, 9, 2) + struct.pack("<IQ", 4, 1) + struct.pack("<I", 7) \
    + struct.pack("<IQ", 8, 1) + gguf_str(b"x")
put("gguf", "nested_arrays", gguf(3, [], [nested]))
put("gguf", "big_endian", gguf(3, [], [nested], endian=">"))
put("gguf", "huge_kv_count", b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 62))
align = gguf_str(b"general.alignment") + struct.pack("<II", 4, 64)
f32 = gguf_str(b"w") + struct.pack("<IQQIQ", 2, 4, 2, 0, 0)
q8 = gguf_str(b"q") + struct.pack("<IQIQ", 1, 32, 8, 64)
head = gguf(2, [f32, q8], [align])
head += bytes(-len(head) % 64)
put("gguf", "v2_aligned_64", head + struct.pack("<8f", *range(8)) + bytes(32) + b"\x00\x3c" + bytes(range(32)))
