"""runtime/embeddings.py without a model: which rows a pooling reads, how a job's inputs are cut
into calls and rows, and how the states add up to normalized vectors."""

from __future__ import annotations

import numpy as np
import pytest

from qwc.runtime.embeddings import EmbeddingJob, needed_rows, normalized


def test_each_pooling_reads_its_rows_of_a_chunk():
    assert needed_rows("mean", 10, 4, 20) == [0, 1, 2, 3]
    assert needed_rows("cls", 0, 4, 20) == [0] and needed_rows("cls", 4, 4, 20) == []
    assert needed_rows("last", 16, 4, 20) == [3] and needed_rows("last", 0, 4, 20) == []


def _run(job: EmbeddingJob, rows: int, max_tokens: int, hidden: int = 3):
    """The job through a fake engine whose state at each token is (token, token, 1) and whose
    rows' caches are lists; returns the calls' parts."""
    caches = {r: [] for r in range(rows)}
    calls = []
    while not job.finished:
        busy = set(job.holding)
        parts = job.plan([r for r in range(rows) if r not in busy], max_tokens, rows)
        assert parts and sum(len(p.tokens) for p in parts) <= max_tokens
        calls.append(parts)
        states = []
        for p in parts:
            if p.start == 0:
                caches[p.row] = []
            assert len(caches[p.row]) == p.start   # the chunk continues what its row holds
            caches[p.row] += p.tokens
            states.append(np.array([[p.tokens[i], p.tokens[i], 1.0] for i in p.rows]).reshape(-1, hidden))
        job.add(parts, states)
    return calls


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_inputs_longer_than_a_call_continue_in_their_rows(pooling):
    inputs = [[1, 2, 3], list(range(10, 40)), [7], list(range(50, 57))]
    job = EmbeddingJob(inputs, pooling)
    calls = _run(job, rows=2, max_tokens=8)
    assert max(len(c) for c in calls) <= 2
    want = {"last": [x[-1] for x in inputs], "cls": [x[0] for x in inputs], "mean": [np.mean(x) for x in inputs]}
    for v, t in zip(job.vectors, want[pooling]):
        assert np.allclose(v, normalized(np.array([t, t, 1.0])), atol=1e-6)


def test_one_row_takes_the_inputs_one_after_another():
    job = EmbeddingJob([[1, 2], [3, 4, 5]], "mean")
    calls = _run(job, rows=1, max_tokens=256)
    assert [[(p.index, p.row) for p in c] for c in calls] == [[(0, 0)], [(1, 0)]]


def test_a_zero_state_stays_zero_and_an_unknown_pooling_is_refused():
    assert not normalized(np.zeros(4)).any()
    with pytest.raises(ValueError, match="pooling 'max'"):
        EmbeddingJob([[1]], "max")
