from pipeline.data.conversations import (
    capture_sequence,
    tokenize_with_loss_mask,
)


def test_loss_mask_covers_exactly_the_assistant_content_and_end_token(tiny_tokenizer):
    messages = [
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "    return a + b"},
        {"role": "user", "content": "def sub(a, b):"},
        {"role": "assistant", "content": "    return a - b"},
    ]
    ids, mask = tokenize_with_loss_mask(tiny_tokenizer, messages)
    masked_text = "".join(tiny_tokenizer.decode([t]) for t, m in zip(ids, mask, strict=True) if m)
    assert masked_text == "    return a + b<|end|>    return a - b<|end|>"
    unmasked = tiny_tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "<|user|>" in unmasked and "<|assistant|>" in unmasked and "return" not in unmasked


def test_capture_sequence_keeps_the_generated_ids_verbatim(tiny_tokenizer):
    messages = [{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": "ignored text"}]
    generated = [5, 6, 7, tiny_tokenizer.eos_token_id]
    ids, mask = capture_sequence(tiny_tokenizer, messages, generated, max_length=100)
    assert ids[-4:] == generated and mask[-4:] == [1, 1, 1, 1]
    assert sum(mask) == 4
    assert tiny_tokenizer.decode(ids[:-4]).endswith("<|assistant|>")
    ids, mask = capture_sequence(tiny_tokenizer, messages, generated, max_length=len(ids) - 2)
    assert len(ids) == len(mask) and sum(mask) == 2
