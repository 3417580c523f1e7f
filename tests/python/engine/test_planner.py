"""The cluster planner (python/braid/planner.py, tools/plan.py) and the schedule bindings it
times pipelines with (braid._C.make_1f1b & co., simulate)."""

import pytest

from braid import _C

# ---- schedule bindings -------------------------------------------------------------------


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (8, 16), (4, 4)])
def test_1f1b_bubble_is_p_minus_1_over_m(pp, m):
    result = _C.simulate(_C.make_1f1b(pp, m), forward=1.0, backward=2.0)
    assert result.ok and result.error == ""
    assert result.bubble_fraction == pytest.approx((pp - 1) / m)
    assert result.makespan == pytest.approx(3.0 * (m + pp - 1))
    assert result.max_in_flight == [min(pp - r, m) for r in range(pp)]


def test_gpipe_bubble_and_memory():
    result = _C.simulate(_C.make_gpipe(4, 8))
    assert result.bubble_fraction == pytest.approx(3 / 8)
    assert result.max_in_flight == [8] * 4


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 2)])
def test_interleaved_bubble_is_p_minus_1_over_vm(pp, m, v):
    schedule = _C.make_interleaved_1f1b(pp, m, v)
    assert (schedule.pp, schedule.microbatches, schedule.virtual_stages) == (pp, m, v)
    assert schedule.num_model_chunks == pp * v
    result = _C.simulate(schedule, forward=1.0 / v, backward=2.0 / v)
    assert result.bubble_fraction == pytest.approx((pp - 1) / (v * m))
    warmup = [_C.interleaved_warmup_steps(pp, m, v, r) for r in range(pp)]
    assert result.max_in_flight == [min(w + 1, v * m) for w in warmup]


def test_per_chunk_costs_and_their_shape():
    schedule = _C.make_1f1b(2, 4)
    slow_last = _C.simulate(schedule, forward_by_chunk=[[1.0], [2.0]],
                            backward_by_chunk=[[2.0], [4.0]])
    assert slow_last.busy == pytest.approx([12.0, 24.0])
    assert slow_last.makespan > _C.simulate(schedule).makespan
    with pytest.raises(ValueError, match="one row per pipeline rank"):
        _C.simulate(schedule, forward_by_chunk=[[1.0]])
    with pytest.raises(ValueError, match="chunks per rank"):
        _C.simulate(schedule, forward_by_chunk=[[1.0, 1.0], [1.0, 1.0]])


def test_p2p_cost_and_semantics():
    schedule = _C.make_1f1b(4, 8)
    base = _C.simulate(schedule)
    slow = _C.simulate(schedule, p2p=0.5)
    eager = _C.simulate(schedule, p2p=0.5, semantics=_C.P2PSemantics.eager)
    assert slow.makespan > base.makespan
    assert eager.ok and eager.makespan <= slow.makespan


def test_forward_only_and_stage_layers():
    result = _C.simulate(_C.make_forward_only(4, 8))
    assert result.ok and result.busy == pytest.approx([8.0] * 4)
    assert _C.stage_layers(8, 2, 2) == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    assert _C.stage_layers(10, 2, 1, first_stage_layers=4) == [[(0, 4)], [(4, 10)]]
    with pytest.raises(ValueError):
        _C.stage_layers(10, 4)
    with pytest.raises(ValueError):
        _C.make_interleaved_1f1b(4, 6, 2)  # m % pp != 0


def test_deadlock_surfaces_as_an_error():
    # GPipe, pp 2, one microbatch, with rank 0 waiting for the gradient before it sends the
    # activation: rank 1 waits for that activation, rank 0 for the gradient.
    P = _C.P2PKind
    schedule = _C.make_gpipe(2, 1)
    ranks = schedule.ranks
    ranks[0] = [_C.Action.forward(0, 0),
                _C.Action.exchange([_C.P2POp(P.recv_grad, 0, 0, 1)]),
                _C.Action.exchange([_C.P2POp(P.send_activation, 0, 0, 1)]),
                _C.Action.backward(0, 0)]
    schedule.ranks = ranks
    result = _C.simulate(schedule)
    assert not result.ok
    assert "deadlock" in result.error
    assert sorted(result.blocked_ranks) == [0, 1]


def test_mismatched_schedule_surfaces_as_an_error():
    schedule = _C.make_1f1b(2, 4)
    ranks = schedule.ranks
    ranks[1] = list(reversed(ranks[1]))
    schedule.ranks = ranks
    result = _C.simulate(schedule)
    assert not result.ok and "mismatched" in result.error
