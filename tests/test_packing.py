"""LPT micro-batch planning, packed collation, and packed == one-by-one loss on a tiny Llama."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import chat, tiny_chat_tokenizer, tiny_llama, write_jsonl

from osft.trainer.data import IGNORE_INDEX, collate_packed, plan_micro_batches, tokenize_chat_file
from osft.trainer.data.packing import lpt_assign


def random_lengths(n, low=1, high=900, seed=0):
    return np.random.default_rng(seed).integers(low, high, size=n).astype(np.int64)


def check_plan(plan, lengths, cap, num_ranks):
    assert len(plan) == num_ranks
    assert len({len(per_rank) for per_rank in plan}) == 1  # same number of micro-batches per rank
    seen = [i for per_rank in plan for mb in per_rank for i in mb]
    assert sorted(seen) == list(range(len(lengths)))  # every index exactly once
    for per_rank in plan:
        for mb in per_rank:
            assert int(lengths[mb].sum()) <= cap
            assert mb == sorted(mb)


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 8])
def test_capacity_and_every_index_once(num_ranks):
    lengths = random_lengths(2000)
    cap = 4096
    plan = plan_micro_batches(lengths, cap, num_ranks)
    check_plan(plan, lengths, cap, num_ranks)
    n_bins = sum(len(p) for p in plan)
    lower = num_ranks * -(-int(lengths.sum()) // (cap * num_ranks))
    assert n_bins % num_ranks == 0 and lower <= n_bins <= lower + 2 * num_ranks


def test_numba_function_is_compiled():
    plan_micro_batches(random_lengths(10), 2048)
    assert len(lpt_assign.signatures) > 0


def test_deterministic_with_ties_broken_by_index():
    lengths = np.array([5, 5, 5, 5, 3, 3, 7, 7], dtype=np.int64)
    first = plan_micro_batches(lengths, 12, 2)
    assert all(plan_micro_batches(lengths.copy(), 12, 2) == first for _ in range(3))
    lengths = random_lengths(500, high=50, seed=3)  # many ties
    assert plan_micro_batches(lengths, 300, 4) == plan_micro_batches(lengths, 300, 4)


def sequential_fill(lengths, cap):
    """Reference packer: fill a bin in sample order until the next sample does not fit."""
    bins, cur, load = [], [], 0
    for i, n in enumerate(lengths.tolist()):
        if load + n > cap:
            bins.append(load)
            cur, load = [], 0
        cur.append(i)
        load += n
    return bins + [load]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loads_are_balanced_and_bins_few(seed):
    lengths = random_lengths(3000, seed=seed)
    cap = 8192
    plan = plan_micro_batches(lengths, cap, 1)
    loads = np.array([lengths[mb].sum() for mb in plan[0]])
    reference = np.array(sequential_fill(lengths, cap))
    assert len(loads) <= len(reference)
    assert loads.max() - loads.min() <= lengths.max()  # LPT bound: spread <= longest sample
    assert loads.max() - loads.min() < reference.max() - reference.min()
    assert loads.std() < reference.std()


def test_micro_batch_m_has_similar_load_across_ranks():
    lengths = random_lengths(1000, seed=5)
    plan = plan_micro_batches(lengths, 4096, 4)
    for m in range(len(plan[0])):
        loads = [int(lengths[plan[r][m]].sum()) for r in range(4)]
        assert max(loads) - min(loads) <= lengths.max()


def test_oversize_sample_is_named():
    with pytest.raises(ValueError, match="sample 2 has 5000 tokens, more than max_tokens_per_micro_batch 4096"):
        plan_micro_batches(np.array([10, 20, 5000, 30]), 4096)
    with pytest.raises(ValueError, match="lengths must be >= 1"):
        plan_micro_batches(np.array([10, 0]), 4096)


def test_fewer_samples_than_ranks_and_empty():
    plan = plan_micro_batches(np.array([7, 3]), 100, 4)
    assert plan == [[[0]], [[1]], [[]], [[]]]  # the only case where a micro-batch is empty
    assert plan_micro_batches(np.array([], dtype=np.int64), 100, 2) == [[], []]


def test_grows_bins_until_it_fits():
    lengths = np.array([6, 6, 6], dtype=np.int64)  # total 18 -> 2 bins of 10 would do on paper
    plan = plan_micro_batches(lengths, 10, 1)
    assert len(plan[0]) == 3
    plan = plan_micro_batches(lengths, 10, 2)
    assert [len(p) for p in plan] == [2, 2] and plan[1][1] == []


def test_collate_shapes_positions_and_shifted_labels():
    samples = [
        {"input_ids": [10, 11, 12, 13], "labels": [-100, -100, 12, 13]},
        {"input_ids": np.array([20, 21, 22]), "labels": np.array([-100, 21, 22])},
        {"input_ids": torch.tensor([30, 31]), "labels": torch.tensor([-100, -100])},
    ]
    b = collate_packed(samples)
    for key in ("input_ids", "position_ids", "labels"):
        assert b[key].shape == (1, 9) and b[key].dtype == torch.int64
    assert b["input_ids"].tolist() == [[10, 11, 12, 13, 20, 21, 22, 30, 31]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1]]
    assert b["labels"].tolist() == [[-100, 12, 13, -100, 21, 22, -100, -100, -100]]
    assert (b["num_loss_tokens"], b["num_tokens"], b["num_samples"]) == (4, 9, 3)
    assert b["sample_bounds"] == ((0, 4), (4, 7), (7, 9))  # where position_ids restart
    empty = collate_packed([])
    assert empty["input_ids"].shape == (1, 0) and empty["num_samples"] == 0
    with pytest.raises(ValueError, match="same, non-zero length"):
        collate_packed([{"input_ids": [1, 2], "labels": [1]}])


def summed_loss(logits, labels):
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), reduction="sum",
                           ignore_index=IGNORE_INDEX)


@pytest.fixture(scope="module")
def three_samples(tmp_path_factory):
    tok = tiny_chat_tokenizer()
    rows = [chat("hi", "Hello! How can I help?"),
            chat("What is the capital of France?", "Paris.", "And of Spain?", "Madrid, I think."),
            chat("Tell me a joke about numbers", "Why was six afraid of seven? Because seven ate nine.")]
    path = write_jsonl(tmp_path_factory.mktemp("pack") / "three.jsonl", rows)
    data = tokenize_chat_file(path, tok, 256)
    samples = [data[i] for i in range(3)]
    assert len({s["length"] for s in samples}) == 3
    return len(tok), samples


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_and_logits_equal_one_by_one(three_samples, attn):
    vocab, samples = three_samples
    model = tiny_llama(vocab, attn_implementation=attn)
    plan = plan_micro_batches(np.array([s["length"] for s in samples]), 1024)
    assert plan == [[[0, 1, 2]]]  # one packed micro-batch of the 3 samples
    packed = collate_packed([samples[i] for i in plan[0][0]])
    with torch.no_grad():
        # use_cache=False: with a cache, transformers does not look for packed sequences
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
        loss = summed_loss(logits, packed["labels"])
        alone_logits, alone_loss, n_loss = [], 0.0, 0
        for s in samples:
            one = collate_packed([s])
            out = model(input_ids=one["input_ids"], position_ids=one["position_ids"], use_cache=False).logits
            alone_logits.append(out[0])
            alone_loss += summed_loss(out, one["labels"])
            n_loss += one["num_loss_tokens"]
        # sensitivity: the same row without restarting positions lets samples attend to each other
        leaky = model(input_ids=packed["input_ids"], use_cache=False).logits
    assert packed["num_loss_tokens"] == n_loss > 0
    torch.testing.assert_close(loss, torch.as_tensor(alone_loss), rtol=1e-5, atol=0)
    torch.testing.assert_close(logits[0], torch.cat(alone_logits), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(leaky[0], torch.cat(alone_logits), rtol=1e-3, atol=1e-3)
