"""The in-place KV cache (jointspec.backends.kvcache): it must hold exactly what transformers' DynamicCache holds.

Every check compares with DynamicCache fed the same tensors, or with the same entries gathered by hand; all are
exact (the cache only copies values), so nothing here can fail by chance.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig

from jointspec.backends.hf import CausalLM
from jointspec.backends.kvcache import MIN_CAPACITY, BufferedCache, BufferedLayer

from helpers import decode_greedy, random_prompt

CONFIG = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=64, vocab_size=64)


def entries(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 2, n, 8, generator=generator),   # [batch, kv_heads, n, head_dim]
            torch.randn(1, 2, n, 8, generator=generator))


def feed(cache, chunks: list[int], seed: int = 0) -> None:
    for i, n in enumerate(chunks):
        for layer in range(2):
            cache.update(*entries(seed + 10 * i + layer, n), layer)


def assert_same(buffered: BufferedCache, reference: DynamicCache) -> None:
    for ours, theirs in zip(buffered.layers, reference.layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    assert buffered.get_seq_length() == reference.get_seq_length()


def test_appends_and_crops_like_dynamic_cache_across_growth():
    buffered, reference = BufferedCache(CONFIG), DynamicCache(config=CONFIG)
    assert all(isinstance(layer, BufferedLayer) for layer in buffered.layers)
    chunks = [MIN_CAPACITY - 3, 1, 5, 2 * MIN_CAPACITY, 3]  # crosses the first capacity, then doubles past it
    for i, n in enumerate(chunks):
        feed(buffered, [n], seed=i)
        feed(reference, [n], seed=i)
        assert_same(buffered, reference)
        buffered.crop(-2)
        reference.crop(-2)
        assert_same(buffered, reference)
    # Doubling: the buffer holds the longest length reached (766) and is less than twice as long.
    assert 766 <= buffered.layers[0]._key_buffer.shape[-2] < 2 * 766


def test_a_known_length_takes_its_room_at_the_first_write_and_grows_by_a_quarter_past_it():
    buffered, reference = BufferedCache(CONFIG, length=700), DynamicCache(config=CONFIG)
    feed(buffered, [5])
    feed(reference, [5])
    buffers = [(layer._key_buffer, layer._value_buffer) for layer in buffered.layers]
    assert all(key.shape[-2] == 700 for key, _ in buffers)
    for i, n in enumerate([300, 200, 195]):  # up to the room exactly: no buffer replaced, no copy
        feed(buffered, [n], seed=i + 1)
        feed(reference, [n], seed=i + 1)
    assert_same(buffered, reference)
    assert all(layer._key_buffer is key and layer._value_buffer is value
               for layer, (key, value) in zip(buffered.layers, buffers))
    feed(buffered, [3], seed=9)  # a tree's nodes at the end: a quarter more (at least MIN_CAPACITY), not twice
    feed(reference, [3], seed=9)
    assert_same(buffered, reference)
    assert buffered.layers[0]._key_buffer.shape[-2] == 700 + max(700 // 4, MIN_CAPACITY)


def test_a_half_cache_widens_at_each_read_and_keeps_no_float32_copy():
    buffered = BufferedCache(CONFIG, torch.float16)
    feed(buffered, [6])
    layer = buffered.layers[0]
    keys = layer.keys
    assert keys.dtype == torch.float32 and torch.equal(keys, layer._key_buffer[..., :6, :].float())
    assert layer._key_view is None and layer._value_view is None  # nothing the size of the cache kept
    assert layer.get_seq_length() == 6 and buffered.get_seq_length() == 6


def test_keep_gathers_scattered_entries_in_order():
    buffered, reference = BufferedCache(CONFIG), DynamicCache(config=CONFIG)
    feed(buffered, [6, 7])
    feed(reference, [6, 7])
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 7, 9, 12])  # the context, then a path through a 7-node tree
    buffered.keep(positions)
    for layer in reference.layers:
        layer.keys, layer.values = layer.keys.index_select(-2, positions), layer.values.index_select(-2, positions)
    assert_same(buffered, reference)
    feed(buffered, [3], seed=5)  # appends after the gathered path
    feed(reference, [3], seed=5)
    assert_same(buffered, reference)


@pytest.mark.parametrize("then", [2, MIN_CAPACITY])  # within the taken-over buffer, or growing it at once
def test_keys_replaced_from_outside_are_taken_over(then):
    # transformers' batch utilities assign new keys/values tensors; the next append must start from those.
    buffered, reference = BufferedCache(CONFIG), DynamicCache(config=CONFIG)
    feed(buffered, [5])
    feed(reference, [5])
    for cache in (buffered, reference):
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[..., :3, :].clone(), layer.values[..., :3, :].clone()
    assert_same(buffered, reference)
    feed(buffered, [then], seed=3)
    feed(reference, [then], seed=3)
    assert_same(buffered, reference)
    buffered.crop(-1)
    reference.crop(-1)
    assert_same(buffered, reference)


def test_views_follow_the_length_and_replacing_one_side_keeps_the_other():
    buffered = BufferedCache(CONFIG)
    feed(buffered, [4])
    layer = buffered.layers[0]
    keys = layer.keys
    assert layer.keys is keys  # one view per length, made when first read
    buffered.crop(-1)
    assert layer.keys.shape[-2] == 3 and torch.equal(layer.keys, keys[..., :3, :])
    values = layer.values.clone()
    layer.keys = layer.keys[..., :2, :].clone()  # only the keys replaced: the values stay what they were
    assert torch.equal(layer.values, values) and layer.keys.shape[-2] == 2


def test_slots_written_by_the_caller_read_like_appended_entries():
    """append_slots (what the compiled decoder layer writes into) holds what update() would, across growth."""
    buffered, reference = BufferedCache(CONFIG), DynamicCache(config=CONFIG)
    for i, n in enumerate([MIN_CAPACITY - 1, 4, 1]):  # the second call outgrows the first buffer
        for layer in range(2):
            keys, values = entries(10 * i + layer, n)
            key_buffer, value_buffer, start = buffered.layers[layer].append_slots(n, keys[:, :, :0])
            key_buffer[:, :, start:start + n] = keys
            value_buffer[:, :, start:start + n] = values
            reference.update(keys, values, layer)
        assert_same(buffered, reference)


def test_rows_for_every_layer_read_like_appended_entries():
    """BufferedCache.append_rows (what the compiled layers take, every layer at once) holds what update() would,
    across growth and crops; its rows are the same objects until a buffer grows, and then new ones."""
    buffered, reference = BufferedCache(CONFIG), DynamicCache(config=CONFIG)
    seen = None
    for i, n in enumerate([3, MIN_CAPACITY - 4, 1, 4, 2]):  # the fourth outgrows the first buffers
        keys = [entries(10 * i + layer, n) for layer in range(2)]
        key_rows, value_rows, start = buffered.append_rows(n, keys[0][0][:, :, :0])
        assert start == reference.get_seq_length() and len(key_rows) == len(value_rows) == 2
        for layer, (k, v) in enumerate(keys):
            key_rows[layer][:, start:start + n] = k[0]
            value_rows[layer][:, start:start + n] = v[0]
            reference.update(k, v, layer)
        assert_same(buffered, reference)
        grew = i == 3
        if seen is not None:
            assert all((mine is not theirs) == grew for mine, theirs in zip(key_rows + value_rows, seen))
        seen = key_rows + value_rows
        if i == 1:  # a crop keeps the buffers, and the rows
            buffered.crop(-2)
            reference.crop(-2)


def test_the_decode_loop_gives_each_layer_its_room_once(target_model):
    """The loop tells the target how long the sequence can grow (reset(length=...)): the buffers hold exactly the
    prompt and the new tokens, taken at the first write, where doubling would have left them at 256 or more."""
    target = CausalLM(target_model, name="room")
    prompt = random_prompt(0)
    assert len(decode_greedy(target, prompt, "pld", 30)) == 30
    assert all(layer._key_buffer.shape[-2] == len(prompt) + 30 for layer in target.cache.layers)
