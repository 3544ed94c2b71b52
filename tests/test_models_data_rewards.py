"""Tiny offline model + tokenizer, the length-ratio reward, and the prompt loaders."""

from __future__ import annotations

import json
import math
import os
import threading
import unicodedata
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from comlrl.data import STORY_PROMPTS, load_prompts_file, story_prompts
from comlrl.models import (
    load_causal_lm,
    load_tiny_model,
    load_tiny_tokenizer,
    load_tokenizer,
)
from comlrl.models import tiny
from comlrl.rewards import length_ratio_reward

# Text that trips up normalising or clean-up tokenizers: NFD accents, emoji with ZWJ and
# variation selectors, CJK, control bytes, runs of whitespace, " ." (HF clean-up target).
UNICODE_SAMPLES = [
    "",
    "Describe a city in the clouds:",
    "héllo wörld — «quotes» ñ",
    "e\u0301 (NFD) vs \u00e9 (NFC)",
    "🐉👩‍👩‍👧 ☁️ 中文字符 日本語 한국어 العربية",
    "tabs\tand\nnewlines\r\n  double  spaces . , ! ?",
    "\x00\x01\x7f nul and del",
    "<|endoftext|> as text",
]


def _tensors(model_dir) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(model_dir, "model.safetensors"))


# --------------------------------------------------------------------------------------------
# Tiny model: building
# --------------------------------------------------------------------------------------------


def test_two_builds_are_bit_identical(tmp_path, tiny_model_dir):
    a = tiny.ensure_tiny_model(tmp_path / "a", "small")
    b = tiny.ensure_tiny_model(tmp_path / "b", "small")
    for other in (b, tiny_model_dir):
        ta, tb = _tensors(a), _tensors(other)
        assert ta.keys() == tb.keys() and ta
        for name in ta:
            assert torch.equal(ta[name], tb[name]), name
        for fname in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (Path(a) / fname).read_bytes() == (Path(other) / fname).read_bytes(), fname


def test_medium_build_is_deterministic_and_leaves_caller_rng_alone():
    torch.manual_seed(7)
    before = torch.get_rng_state()
    m1 = tiny.build_model("medium")
    assert torch.equal(torch.get_rng_state(), before)
    m2 = tiny.build_model("medium")
    sd1, sd2 = m1.state_dict(), m2.state_dict()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    cfg = m1.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (4, 256, 512)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)


def test_ensure_is_idempotent_and_refuses_foreign_dirs(tmp_path):
    out = tiny.ensure_tiny_model(tmp_path / "m", "small")
    weights = Path(out) / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert tiny.ensure_tiny_model(tmp_path / "m", "small") == out
    assert weights.stat().st_mtime_ns == mtime  # not rebuilt

    with pytest.raises(RuntimeError, match="different tiny model"):
        tiny.ensure_tiny_model(out, "medium")

    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="not a complete tiny model"):
        tiny.ensure_tiny_model(half, "small")

    with pytest.raises(ValueError, match="Unknown tiny model size"):
        tiny.ensure_tiny_model(tmp_path / "x", "huge")


def test_concurrent_builders_agree(tmp_path):
    target = tmp_path / "race"
    results, errors = [], []

    def build():
        try:
            results.append(tiny.ensure_tiny_model(target, "small"))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == [str(target.resolve())] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["race"]  # temp dirs cleaned up
    assert (target / tiny.MARKER_FILE).is_file()


def test_cli_builds(tmp_path, capsys):
    tiny.main([str(tmp_path / "cli"), "--size", "small"])
    assert capsys.readouterr().out.strip() == str((tmp_path / "cli").resolve())
    assert (tmp_path / "cli" / tiny.MARKER_FILE).is_file()


def test_cache_root_and_versioned_path(monkeypatch, tmp_path, tiny_model_dir):
    monkeypatch.setenv("COMLRL_CACHE", str(tmp_path))
    assert tiny.default_cache_root() == tmp_path
    assert Path(tiny_model_dir).name == f"tiny-qwen2-small-{tiny.spec_hash('small')}"
    assert tiny.spec_hash("small") != tiny.spec_hash("medium")


# --------------------------------------------------------------------------------------------
# Tiny model: loading and using
# --------------------------------------------------------------------------------------------


def test_auto_classes_load_offline(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.tie_word_embeddings and model.config.vocab_size == tiny.VOCAB_SIZE
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    auto_tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ours = load_tokenizer(tiny_model_dir)
    assert isinstance(auto_tok, PreTrainedTokenizerFast)
    assert isinstance(ours, PreTrainedTokenizerFast)
    for tok in (auto_tok, ours):
        assert len(tok) == tiny.VOCAB_SIZE
        vocab = tok.get_vocab()
        assert vocab["<|endoftext|>"] == tiny.EOS_TOKEN_ID
        assert sorted(v for k, v in vocab.items() if k != "<|endoftext|>") == list(range(256))
    # Whichever class AutoTokenizer picks (transformers 5: Qwen2Tokenizer), ids agree with ours
    # on NFC text, so code that uses plain AutoTokenizer sees the same token stream.
    for text in UNICODE_SAMPLES:
        nfc = unicodedata.normalize("NFC", text)
        assert auto_tok(nfc)["input_ids"] == ours(nfc)["input_ids"], text


@pytest.mark.parametrize("text", UNICODE_SAMPLES)
def test_tokenizer_round_trips_any_text_byte_for_byte(tiny_model_dir, text):
    tok = load_tokenizer(tiny_model_dir)
    ids = tok(text, add_special_tokens=True)["input_ids"]
    if "<|endoftext|>" not in text:
        assert ids == list(text.encode("utf-8"))  # one id per byte, id == byte value
    assert tok.decode(ids) == text


def test_special_token_ids_agree_everywhere(tiny_model_dir):
    from transformers import AutoConfig, GenerationConfig

    tok = load_tokenizer(tiny_model_dir)
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    gen = GenerationConfig.from_pretrained(tiny_model_dir)
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == tok.pad_token_id == tiny.EOS_TOKEN_ID < cfg.vocab_size
    for c in (cfg, gen):
        assert (c.eos_token_id, c.pad_token_id, c.bos_token_id) == (tok.eos_token_id,) * 3


def test_forward_and_generate(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir)
    tok = load_tokenizer(tiny_model_dir)
    tok.padding_side = "left"
    batch = tok(["Design a playground on Mars:", "Hi"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], tiny.VOCAB_SIZE)
    assert torch.isfinite(logits).all()

    torch.manual_seed(0)
    out = model.generate(
        **batch, max_new_tokens=6, do_sample=True, temperature=0.6, top_k=50, top_p=0.6
    )
    assert out.shape[0] == 2 and batch["input_ids"].shape[1] < out.shape[1] <= batch[
        "input_ids"
    ].shape[1] + 6
    assert int(out.max()) < tiny.VOCAB_SIZE
    assert all(isinstance(s, str) for s in tok.batch_decode(out, skip_special_tokens=True))


def test_load_causal_lm_dtype_strings(tiny_model_dir):
    assert load_causal_lm(tiny_model_dir, torch_dtype="bfloat16").dtype == torch.bfloat16
    assert load_causal_lm(tiny_model_dir, torch_dtype="auto").dtype == torch.float32
    m = load_causal_lm(tiny_model_dir, dtype="float32", attn_implementation="eager")
    assert m.dtype == torch.float32 and m.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="Unsupported dtype"):
        load_causal_lm(tiny_model_dir, torch_dtype="float33")


def test_convenience_loaders_use_cache(tiny_model_dir):
    root = Path(tiny_model_dir).parent
    model = load_tiny_model("small", root=root)
    tok = load_tiny_tokenizer("small", root=root)
    assert model.config.hidden_size == 64 and len(tok) == tiny.VOCAB_SIZE


def test_medium_fixture(tiny_medium_model_dir):
    cfg = json.loads((Path(tiny_medium_model_dir) / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (4, 256)


# --------------------------------------------------------------------------------------------
# Rewards
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "first, second, expected",
    [
        ("ab", "abcde", 1.0),  # ratio 2.5, inside [2, 3]
        ("ab", "abcd", 1.0),  # ratio 2.0, lower bound inclusive
        ("ab", "abcdef", 1.0),  # ratio 3.0, upper bound inclusive
        ("abcd", "wxyz", math.exp(-1.0)),  # ratio 1 -> 1 below the lower bound
        ("ab", "a" * 8, math.exp(-1.0)),  # ratio 4 -> 1 above the upper bound
        ("", "abc", 1.0),  # empty first: denominator max(0, 1) = 1 -> ratio 3
        ("", "", math.exp(-2.0)),  # ratio 0
    ],
)
def test_length_ratio_reward_values(first, second, expected):
    assert length_ratio_reward([first], [second]) == [pytest.approx(expected, abs=1e-12)]


def test_length_ratio_reward_batch_and_custom_band():
    assert length_ratio_reward(["a", "ab"], ["a", "a"], low=1.0, high=1.0) == [
        1.0,
        pytest.approx(math.exp(-0.5)),
    ]
    with pytest.raises(ValueError, match="pair up"):
        length_ratio_reward(["a"], ["a", "b"])
    with pytest.raises(ValueError, match="low <= high"):
        length_ratio_reward(["a"], ["a"], low=3.0, high=2.0)


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def test_story_prompts():
    ds = story_prompts()
    assert ds.column_names == ["prompt"]
    assert ds["prompt"] == list(STORY_PROMPTS) and len(ds) == 4
    assert ds["prompt"][0] == "Describe a city in the clouds:"


def test_load_json_list_columns_and_jsonl(tmp_path):
    records = [{"prompt": "p1", "id": 1}, {"prompt": "p2", "id": 2}, {"prompt": "p3", "id": 3}]
    (tmp_path / "list.json").write_text(json.dumps(records))
    (tmp_path / "cols.json").write_text(json.dumps({"prompt": ["p1", "p2", "p3"]}))
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")

    ds = load_prompts_file(tmp_path / "list.json")
    assert ds["prompt"] == ["p1", "p2", "p3"] and ds["id"] == [1, 2, 3]
    assert load_prompts_file(str(tmp_path / "cols.json"))["prompt"] == ["p1", "p2", "p3"]
    assert load_prompts_file(tmp_path / "rows.jsonl", limit=2)["prompt"] == ["p1", "p2"]


def test_load_custom_prompt_field(tmp_path):
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": "why?"}) + "\n")
    ds = load_prompts_file(tmp_path / "q.jsonl", prompt_field="question")
    assert ds[0] == {"question": "why?", "prompt": "why?"}


def test_load_prompts_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json.*current directory"):
        load_prompts_file("nope.json")

    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_prompts_file(tmp_path / "empty.jsonl")
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ValueError, match="empty"):
        load_prompts_file(tmp_path / "empty.json")

    (tmp_path / "field.json").write_text(json.dumps([{"text": "a", "id": 1}]))
    with pytest.raises(ValueError, match=r"no field 'prompt'; fields present: \['id', 'text'\]"):
        load_prompts_file(tmp_path / "field.json")

    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        load_prompts_file(tmp_path / "bad.jsonl")

    (tmp_path / "data.csv").write_text("prompt\na\n")
    with pytest.raises(ValueError, match="unsupported extension"):
        load_prompts_file(tmp_path / "data.csv")
