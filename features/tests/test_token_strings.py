"""Tokens as the feature pages show them: a byte-level BPE token that holds part of a character's
UTF-8 bytes shows as those bytes (it decoded alone to "\ufffd", and the logit effects listed "�")."""

from transformers import AutoTokenizer

from features.selectors import token_strings


def test_partial_characters_show_as_their_bytes_and_whole_tokens_as_text(tiny_gpt2_folder):
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_folder)
    ids = tokenizer("naïve — ok").input_ids
    shown = token_strings(tokenizer, ids)
    assert "\ufffd" not in "".join(shown)
    assert "".join(shown).startswith("na<0xC3><0xAF>ve")  # ï is C3 AF in UTF-8
    assert "<0xE2><0x80><0x94>" in "".join(shown)  # the em dash, E2 80 94
    assert shown[-1] == tokenizer.decode([ids[-1]])  # whole tokens as they decode
    assert token_strings(None, [5, -1]) == ["#5", ""]
