"""``Layout.vocab_pad``: vocabulary-parallel tensors cut as vLLM cuts a padded vocabulary.

vLLM's formula (``VocabParallelEmbedding._get_indices`` for the original vocabulary)
is restated here and compared over a table of vocabularies, world sizes and paddings
with ``tpcut.padded_vocab_rows``; ``tests/vllm/test_vocab_cut.py`` runs vLLM's own
function on the same table. Through the planner: each rank's bytes are its rows of
the tensor, a tied checkpoint's embedding gets the head's rows, ranks past the
vocabulary get an empty slice, other tensors are untouched, digests are anchored per
cut, quantized geometry still refuses a cut through a scale block, and the field is
bounded.
"""

from __future__ import annotations

import itertools

import pytest

from tests.unit.plan.fake_llama import fake_checkpoint, llama_config, llama_specs
from weightd.server.base.errors import InvalidRequest, QuantizationSplitError, ShardingError
from weightd.server.plan.builtin_rules import rules_for
from weightd.server.plan.layout import MAX_VOCAB_PAD, Layout
from weightd.server.plan.planner import plan
from weightd.server.plan.rules import Rule, Split
from weightd.server.plan.slices import cut_tensor, peer_slices
from weightd.server.plan.tpcut import padded_vocab_rows
from weightd.v1 import weightd_pb2 as pb

#: Vocabularies of real models (GPT-2 50257, Llama 3 128256, Qwen2 151936, ...) and
#: small ones that leave the last ranks short or empty.
VOCABS = (1, 30, 63, 64, 65, 250, 1000, 1024, 32000, 32001, 50257, 128256, 151936)
TPS = (1, 2, 3, 4, 6, 8, 16)
PADS = (1, 6, 8, 64, 128, 256, 1000, 2048)
TABLE = list(itertools.product(VOCABS, TPS, PADS))


def vllm_rows(vocab: int, tp: int, rank: int, pad: int) -> tuple[int, int] | None:
    """vLLM 0.32's ``pad_vocab_size`` + ``_get_indices`` (no added vocabulary), restated.

    None where vLLM's ``divide(padded, tp)`` asserts.
    """
    padded = ((vocab + pad - 1) // pad) * pad
    if padded % tp:
        return None
    per = padded // tp
    start, stop = rank * per, rank * per + per
    return min(start, vocab), min(stop, vocab)


@pytest.mark.parametrize(("vocab", "tp", "pad"), TABLE)
def test_rows_are_vllms_for_every_rank(vocab: int, tp: int, pad: int) -> None:
    covered = 0
    for rank in range(tp):
        want = vllm_rows(vocab, tp, rank, pad)
        if want is None:
            with pytest.raises(
                ValueError, match=f"not divisible by tensor-parallel world_size {tp}"
            ):
                padded_vocab_rows(vocab, tp, rank, pad)
            return
        got = padded_vocab_rows(vocab, tp, rank, pad)
        assert got == want
        assert got[0] == covered  # contiguous, in rank order
        covered = got[1]
    assert covered == vocab  # every row exactly once


def test_the_table_has_uneven_empty_and_refused_cases() -> None:
    """The table exercises what matters: shares differ, some are empty, some refused."""
    kinds = set()
    for vocab, tp, pad in TABLE:
        rows = [vllm_rows(vocab, tp, r, pad) for r in range(tp)]
        if None in rows:
            kinds.add("refused")
            continue
        sizes = {b - a for a, b in rows if b is not None and a is not None}
        kinds.add("uneven" if len(sizes) > 1 else "even")
        if 0 in sizes:
            kinds.add("empty")
    assert kinds == {"refused", "uneven", "even", "empty"}


# --- through the planner ------------------------------------------------------------------

VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


@pytest.mark.parametrize(("vocab", "tp", "pad"), [(1000, 2, 64), (1000, 4, 64), (1000, 3, 6)])
def test_each_rank_gets_exactly_its_rows_and_other_tensors_are_unchanged(
    vocab: int, tp: int, pad: int
) -> None:
    config = llama_config(vocab=vocab, heads=12, kv=12, head_dim=8, hidden=96, inter=96)
    fake = fake_checkpoint(config, llama_specs(config))
    rules = rules_for(config)
    for rank in range(tp):
        padded = plan(fake.ckpt, rules, Layout(tp_size=tp, tp_rank=rank, vocab_pad=pad))
        a, b = vllm_rows(vocab, tp, rank, pad) or (0, 0)
        assert b > a
        for s in padded.slices:
            if s.name in VOCAB_TENSORS:
                want = fake.array(s.name)[a:b]
                assert s.shape == want.shape and s.split_dim == 0 and not s.replicated
                assert fake.gather(s.shard, s.pattern) == want.tobytes()
                assert s.partition.key == (tp, 1, pad)
    # Every other tensor is cut as at vocab_pad 0 (which refuses 1000 % 3 rows).
    if vocab % tp == 0:
        for rank in range(tp):
            even = plan(fake.ckpt, rules, Layout(tp_size=tp, tp_rank=rank))
            padded = plan(fake.ckpt, rules, Layout(tp_size=tp, tp_rank=rank, vocab_pad=pad))
            for e, p in zip(even.slices, padded.slices, strict=True):
                assert e.name == p.name
                if e.name not in VOCAB_TENSORS:
                    assert e == p
                else:
                    assert e.shape != p.shape or tp == 1


def test_tied_embeddings_get_the_heads_rows() -> None:
    """No lm_head in the checkpoint: the embedding's slice is vLLM's rows, which the tied
    head shares; with both present the two cuts are the same rows."""
    config = llama_config(vocab=1000)
    tied = fake_checkpoint(config, llama_specs(config, tied=True))
    both = fake_checkpoint(config, llama_specs(config))
    rules = rules_for(config)
    for rank, (a, b) in enumerate([(0, 512), (512, 1000)]):
        layout = Layout(tp_size=2, tp_rank=rank, vocab_pad=64)
        (embed,) = plan(tied.ckpt, rules, layout, ("model.embed_tokens.weight",)).slices
        assert "lm_head.weight" not in {s.name for s in plan(tied.ckpt, rules, layout).slices}
        assert tied.gather(embed.shard, embed.pattern) == tied.array(embed.name)[a:b].tobytes()
        e, h = plan(both.ckpt, rules, layout, VOCAB_TENSORS).slices
        assert e.shape == h.shape == (b - a, 64)
        assert both.gather(h.shard, h.pattern) == both.array(h.name)[a:b].tobytes()


def test_ranks_past_the_vocabulary_get_an_empty_slice() -> None:
    """65 rows padded to 128 over 4 ranks: 32, 32, 1, 0 rows."""
    config = llama_config(vocab=65)
    fake = fake_checkpoint(config, llama_specs(config))
    rules = rules_for(config)
    sizes = []
    for rank in range(4):
        (s,) = plan(
            fake.ckpt, rules, Layout(tp_size=4, tp_rank=rank, vocab_pad=64), ("lm_head.weight",)
        ).slices
        sizes.append(s.shape[0])
        assert s.shape[1:] == (64,)
        assert s.nbytes == s.shape[0] * 64 * 2
        assert (
            fake.gather(s.shard, s.pattern)
            == fake.array(s.name)[32 * rank : 65].tobytes()[: s.nbytes]
        )
    assert sizes == [32, 32, 1, 0]


def test_a_padded_vocabulary_tp_does_not_divide_is_refused_naming_the_tensor() -> None:
    config = llama_config(vocab=1000, heads=12, kv=12, head_dim=8, hidden=96, inter=96)
    fake = fake_checkpoint(config, llama_specs(config))
    with pytest.raises(ShardingError) as err:
        plan(fake.ckpt, rules_for(config), Layout(tp_size=3, tp_rank=0, vocab_pad=64))
    assert str(err.value) == (
        "tensor 'model.embed_tokens.weight': dim 0 of size 1000: padded to a multiple of "
        "vocab_pad 64 it has 1024 rows, which is not divisible by tensor-parallel world_size 3"
    )


def test_vocab_pad_zero_still_refuses_a_vocabulary_tp_does_not_divide() -> None:
    config = llama_config(vocab=1000, heads=12, kv=12, head_dim=8, hidden=96, inter=96)
    fake = fake_checkpoint(config, llama_specs(config))
    with pytest.raises(ShardingError, match="size 1000 is not divisible by tensor-parallel"):
        plan(fake.ckpt, rules_for(config), Layout(tp_size=3, tp_rank=0))


def test_a_vocabulary_padding_leaves_alone_shares_anchors_with_equal_blocks() -> None:
    """1024 rows need no padding to 64: the same slices, the same partition (and so the
    same anchored digests) as vocab_pad 0; 1000 rows get a partition of their own."""
    for vocab, own in ((1024, False), (1000, True)):
        config = llama_config(vocab=vocab)
        fake = fake_checkpoint(config, llama_specs(config))
        rules = rules_for(config)
        (e,) = plan(fake.ckpt, rules, Layout(tp_size=2, tp_rank=1), ("lm_head.weight",)).slices
        (p,) = plan(
            fake.ckpt, rules, Layout(tp_size=2, tp_rank=1, vocab_pad=64), ("lm_head.weight",)
        ).slices
        assert (e.partition.key != p.partition.key) is own
        assert (e == p) is not own


def test_peer_slices_are_every_ranks_vllm_rows() -> None:
    config = llama_config(vocab=1000)
    fake = fake_checkpoint(config, llama_specs(config))
    rules = rules_for(config)
    layout = Layout(tp_size=4, tp_rank=2, vocab_pad=64)
    (s,) = plan(fake.ckpt, rules, layout, ("lm_head.weight",)).slices
    peers = peer_slices(fake.ckpt, rules, s, layout)
    assert [p.shape[0] for p in peers] == [256, 256, 256, 232]
    assert peers[2] == s
    assert b"".join(fake.gather(p.shard, p.pattern) for p in peers) == (
        fake.array("lm_head.weight").tobytes()
    )


# --- quantized geometry ----------------------------------------------------------------------

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


def _fp8_head(vocab: int) -> tuple[dict[str, object], object]:
    config = {**llama_config(vocab=vocab, hidden=128), "quantization_config": FP8}
    specs = {
        "lm_head.weight": ("F8_E4M3", (vocab, 128)),
        "lm_head.weight_scale_inv": ("F32", (-(-vocab // 128), 1)),
    }
    return config, fake_checkpoint(config, specs)


@pytest.mark.parametrize(
    ("tp", "pad", "scale_rows"),
    [(2, 64, [4, 4]), (8, 64, [1] * 7 + [1]), (4, 2048, [4, 4, 0, 0])],
)
def test_fp8_block_scales_follow_the_padded_cut(tp: int, pad: int, scale_rows: list[int]) -> None:
    """1000 rows, 128-row scale blocks (8 of them, the last partial): boundaries on whole
    blocks are cut with their scales; empty ranks get empty weight and scale slices."""
    config, fake = _fp8_head(1000)
    rules = rules_for(config)
    got = []
    for rank in range(tp):
        layout = Layout(tp_size=tp, tp_rank=rank, vocab_pad=pad)
        a, b = vllm_rows(1000, tp, rank, pad) or (0, 0)
        for name in ("lm_head.weight", "lm_head.weight_scale_inv"):
            s = cut_tensor(
                fake.ckpt.tensors[name], Rule("", Split.VOCAB), rules, fake.ckpt.tensors, layout
            )
            if name == "lm_head.weight":
                assert s.shape == (b - a, 128)
                assert fake.gather(s.shard, s.pattern) == fake.array(name)[a:b].tobytes()
            else:
                got.append(s.shape[0])
                lo = a // 128
                want = fake.array(name)[lo : lo + s.shape[0]]
                assert fake.gather(s.shard, s.pattern) == want.tobytes()
    assert got == scale_rows
    assert sum(got) == 8


def test_a_padded_cut_through_a_scale_block_is_refused() -> None:
    """16 ranks of 64 rows: the boundary at 64 cuts the first 128-row scale block."""
    config, fake = _fp8_head(1000)
    with pytest.raises(QuantizationSplitError, match="boundary at 64, which cuts"):
        cut_tensor(
            fake.ckpt.tensors["lm_head.weight"],
            Rule("", Split.VOCAB),
            rules_for(config),
            fake.ckpt.tensors,
            Layout(tp_size=16, tp_rank=0, vocab_pad=64),
        )


# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize("pad", [MAX_VOCAB_PAD + 1, 2**31, 2**32 - 1])
def test_vocab_pad_out_of_bounds_is_invalid_argument_naming_the_field(pad: int) -> None:
    layout = Layout.of(pb.Layout(tp_size=2, tp_rank=0, vocab_pad=pad))
    with pytest.raises(InvalidRequest) as err:
        layout.check()
    assert str(err.value) == (
        f"vocab_pad {pad} is invalid: it must be between 0 (equal blocks) and {MAX_VOCAB_PAD}"
    )


def test_vocab_pad_travels_in_the_layout_and_its_description() -> None:
    layout = Layout.of(pb.Layout(tp_size=2, tp_rank=1, vocab_pad=64))
    assert layout == Layout(tp_size=2, tp_rank=1, vocab_pad=64)
    assert layout.describe() == "tp 1/2, vocab_pad 64"
    assert Layout.of(pb.Layout(tp_size=2, tp_rank=1)).vocab_pad == 0  # an old client
    layout.check()
    Layout(tp_size=2, vocab_pad=MAX_VOCAB_PAD).check()


def test_adapters_refuse_vocab_pad() -> None:
    """Adapter slices follow the base rules' equal blocks; a padded cut is not offered."""
    from weightd.server.adapters.service import check_tp_only

    check_tp_only(Layout(tp_size=2, tp_rank=1))
    with pytest.raises(InvalidRequest) as err:
        check_tp_only(Layout(tp_size=2, tp_rank=1, vocab_pad=64))
    assert str(err.value) == ("vocab_pad 64: adapters are cut in equal blocks only (vocab_pad 0)")
