"""The megakernel's static schedule and VMEM budget (pure Python)."""

import dataclasses

import pytest

from weld.kernels.megakernel import plan as mk

SMOLLM2_135M = mk.MegakernelSpec(hidden=576, intermediate=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                                 vocab=49152, num_layers=30)
LLAMA3_8B = mk.MegakernelSpec(hidden=4096, intermediate=14336, num_heads=32, num_kv_heads=8, head_dim=128,
                              vocab=128256, num_layers=32)
TINY = mk.MegakernelSpec(hidden=16, intermediate=24, num_heads=4, num_kv_heads=2, head_dim=4, vocab=40,
                         num_layers=2, weight_bytes=4, kv_bytes=4, page_size=4, pages_per_kv_tile=2)


def test_schedule_order_runs_through_layers_into_the_lm_head():
    tiles = mk.stream_schedule(TINY, tile_rows=8, vocab_tile_rows=16)
    names = [(t.layer, t.matrix) for t in tiles]
    # q: 4 * 4 = 16 rows -> 2 tiles; k, v: 2 * 4 = 8 -> 1 each; o: 16 -> 2; gate, up: 24 -> 8 + 8 + 8; down: 16 -> 2
    per_layer = [("q", 2), ("k", 1), ("v", 1), ("o", 2), ("gate", 3), ("up", 3), ("down", 2)]
    expected = [(layer, name) for layer in range(2) for name, n in per_layer for _ in range(n)]
    expected += [(-1, "lm_head")] * 3  # 40 vocab rows in tiles of 16: 16, 16, 8
    assert names == expected
    assert [t.index for t in tiles] == list(range(len(tiles)))
    head = [t for t in tiles if t.matrix == "lm_head"]
    assert [(t.row_start, t.rows, t.cols) for t in head] == [(0, 16, 16), (16, 16, 16), (32, 8, 16)]
    down = [t for t in tiles if t.matrix == "down"][0]
    assert (down.rows, down.cols, down.nbytes) == (8, 24, 8 * 24 * 4)


def test_schedule_covers_every_weight_once():
    tiles = mk.stream_schedule(SMOLLM2_135M, tile_rows=256, vocab_tile_rows=2048)
    # hand count: per layer (960 + 576 + 3072) * 576 + 576 * 1536 = 3,538,944 weights; x 30 layers
    # + 49152 * 576 LM head = 134,479,872 weights (SmolLM2-135M without its tied embedding copy)
    assert sum(t.nbytes for t in tiles) == 134_479_872 * 2
    assert SMOLLM2_135M.num_layers * SMOLLM2_135M.layer_weight_bytes() + SMOLLM2_135M.lm_head_bytes() == 134_479_872 * 2
    for layer in range(30):
        for name, rows, _ in SMOLLM2_135M.matrices():
            mine = [t for t in tiles if t.layer == layer and t.matrix == name]
            assert sum(t.rows for t in mine) == rows and mine[0].row_start == 0


def test_vmem_bytes_by_hand():
    p = mk.make_plan(TINY, ring_depth=3, tile_rows=8, vocab_tile_rows=16)
    # widths off the 128-lane tiles get a ring each: the 16-input tiles' slot fits the tallest (16
    # vocab rows), the 24-input ring holds `down`'s 8-row tiles; f32
    assert p.slot_bytes == 16 * 16 * 4 + 8 * 24 * 4
    assert p.ring_bytes == 3 * (16 * 16 + 8 * 24) * 4
    wide = mk.make_plan(dataclasses.replace(TINY, hidden=128, intermediate=256, num_heads=32), ring_depth=3,
                        tile_rows=8, vocab_tile_rows=16)
    assert wide.slot_bytes == 16 * 256 * 4  # whole lane tiles share one ring: tallest x widest
    assert p.kv_bytes == 2 * 2 * (2 * 4 * 128 * 4)  # K+V, a ring of 2, 2 pages of 4 tokens, rows of 2 heads x 4 dims in 128 lanes
    # per token, f32: residual, normed, o/down output, the embedding row (4*16); q, roped q, attention
    # out (3*16); k, v (2*8); gate, up (2*24); the logits row (40); + the greedy id (4 B), the new K and
    # V (2*8 x 4 B). Vectors: 2 norms x 2 layers x 16 + the final norm (16) + rope frequencies (2).
    per_token = (64 + 48 + 16 + 48 + 40) * 4 + 4 + 16 * 4
    assert p.activation_bytes == per_token + (2 * 2 * 16 + 16 + 2) * 4
    with_switches = mk.make_plan(dataclasses.replace(TINY, batch=2, qkv_bias=True, o_bias=True, qk_norm=True))
    # + qkv bias (32 per layer), o bias (16 per layer), q and k norms (2 * 4 per layer), two rows
    assert with_switches.activation_bytes == 2 * per_token + (2 * 2 * 16 + 16 + 2 + 2 * (32 + 16 + 8)) * 4
    assert p.vmem_bytes == p.ring_bytes + p.kv_bytes + p.activation_bytes


def test_fit_plan_keeps_the_ring_when_it_fits():
    p = mk.fit_plan(SMOLLM2_135M, "v5e", ring_depth=4)
    assert p.ring_depth == 4 and p.vmem_bytes <= p.vmem_limit_bytes == mk.vmem_limit("v5e")


def test_fit_plan_shrinks_the_ring_then_fails_clearly():
    # Tiles of 4096 rows of 14336 bf16 (112 MiB each) never fit; tiles that fit only 2 deep shrink the ring.
    big = dataclasses.replace(LLAMA3_8B, batch=8)
    with pytest.raises(mk.VmemBudgetError, match=r"needs \d+ B of VMEM .* but v7 allows \d+ B"):
        mk.fit_plan(big, "v7", ring_depth=4, tile_rows=4096)
    rows = 1024  # down tile: 1024 x 14336 x 2 B = 28 MiB; 4 slots exceed v6e's budget, 3 do not
    p = mk.fit_plan(LLAMA3_8B, "v6e", ring_depth=4, tile_rows=rows, vocab_tile_rows=rows)
    assert p.ring_depth == 3
    assert mk.make_plan(LLAMA3_8B, ring_depth=4, tile_rows=rows, vocab_tile_rows=rows).vmem_bytes > mk.vmem_limit("v6e")


def test_bad_inputs_raise_value_errors_naming_the_value():
    with pytest.raises(ValueError, match="unknown TPU generation 'v4'"):
        mk.vmem_limit("v4")
    with pytest.raises(ValueError, match="num_heads \\(6\\) must be a multiple of num_kv_heads \\(4\\)"):
        dataclasses.replace(TINY, num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="MegakernelSpec.hidden must be a positive int, got 0"):
        dataclasses.replace(TINY, hidden=0)
    with pytest.raises(ValueError, match="ring_depth must be >= 2, got 1"):
        mk.make_plan(TINY, ring_depth=1)


def test_step_bytes_and_floor():
    # batch 1, 16 tokens of context = one page: K and V of 16 tokens x 3 heads x 64 dims x 2 B per layer;
    # plus one bf16 embedding row read and one f32 row of 49152 logits written
    kv = 30 * 2 * 16 * 3 * 64 * 2 + 30 * 2 * 3 * 64 * 2
    io = 576 * 2 + 49152 * 4
    assert mk.step_bytes(SMOLLM2_135M, 16) == 134_479_872 * 2 + kv + io
    assert mk.step_floor_seconds(SMOLLM2_135M, "v5e", 16) == pytest.approx((134_479_872 * 2 + kv + io) / 819e9)
    # int8 weights: one byte per weight plus a 4-byte scale per output row
    int8 = dataclasses.replace(SMOLLM2_135M, weight_bytes=1, scale_bytes=4)
    rows = 30 * (576 + 192 + 192 + 576 + 1536 + 1536 + 576) + 49152
    assert mk.step_bytes(int8, 16) == 134_479_872 + 4 * rows + kv + 576 + 49152 * 4


def test_routed_pairs_rows_are_whole_lane_tiles_at_least_two_wide():
    """A routed pair's gate / up and its row's summed outputs are stored at a traced row, where
    Mosaic takes rows of whole 128-lane tiles, two or more (`TRACED_ROW_LANES`): gpt-oss's 2,880
    expert rows in tiles of 256 end in a tile of 64, written 256 wide from row 2,816; the buffers
    and the VMEM budget reach that far."""
    assert [mk.traced_row_width(n) for n in (1, 64, 128, 256, 257, 2880)] == [256, 256, 256, 256, 384, 2944]
    gpt_oss = dataclasses.replace(TINY, hidden=2880, intermediate=2880, num_heads=64, num_kv_heads=8, head_dim=64,
                                  sparse_layers=(0, 1), num_experts=32, top_k=4, expert_intermediate=2880)
    tiles = mk.stream_schedule(gpt_oss, tile_rows=256)
    gate = [t for t in tiles if t.layer == 0 and t.pair == 0 and t.matrix == "gate"]
    assert [(t.row_start, t.rows) for t in gate][-2:] == [(2560, 256), (2816, 64)]
    assert mk.pair_row_width(tiles, "gate", 2880) == mk.pair_row_width(tiles, "down", 2880) == 2816 + 256
    whole = dataclasses.replace(gpt_oss, hidden=2048, intermediate=2048, expert_intermediate=2048)
    assert mk.pair_row_width(mk.stream_schedule(whole, tile_rows=256), "up", 2048) == 2048  # nothing past it
    # the budget counts the wider rows: per routed row, 4 pairs' gate and up and the summed outputs
    wider = mk.activation_bytes(gpt_oss, tiles) - mk.activation_bytes(gpt_oss, [])
    assert wider == gpt_oss.moe_tokens * 4 * (4 * 2 * (3072 - 2944) + (3072 - 2944))


def test_whole_head_tiles_hold_eight_heads_on_a_ring_of_their_own():
    """MLA's W_UK / W_UV stream in tiles of `HEAD_ALIGN` whole heads (a looped tile's head offset
    then provably a multiple of a f32 tile's 8 sublanes), through a ring of their own width."""
    assert mk.ring_key("float", 512) == ("float", 0, False)  # whole lane tiles: the kind's shared ring
    assert mk.ring_key("float", 512, whole_heads=True) == ("float", 512, False)
    assert mk.ring_key("float", 576) == ("float", 576, False)  # off the lane tiles: a ring of that width
