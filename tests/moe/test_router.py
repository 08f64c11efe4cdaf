"""Router, auxiliary losses and single-process dispatch: exact counts, capacity bound, the
load-balancing and z losses on hand-computed examples, the injected gradient, round trips."""
from __future__ import annotations

import math

import pytest
import torch

from megastrategy.errors import MegatronConfigError
from megastrategy.moe import MoELayer
from megastrategy.moe.dispatcher import AllGatherDispatcher, AllToAllDispatcher
from megastrategy.moe.router import (
    TopKRouter,
    capacity_keep_mask,
    expert_capacity,
    load_balancing_loss,
    z_loss,
)


def _router_with_logits(logits: torch.Tensor, top_k: int, **kw):
    """A router whose logits for input ``x = logits`` are exactly ``logits`` (weight = identity)."""
    E = logits.size(1)
    r = TopKRouter(E, E, top_k, **kw).double()
    with torch.no_grad():
        r.weight.copy_(torch.eye(E, dtype=torch.float64))
    return r, logits.double()


def _random_router(T=64, H=16, E=8, k=2, seed=0, skew=0.0, **kw):
    torch.manual_seed(seed)
    r = TopKRouter(H, E, k, **kw)
    x = torch.randn(T, H)
    if skew:  # make expert 0 popular so that capacity bites
        with torch.no_grad():
            r.weight[0] = x.mean(0) * skew
    return r, x


def test_dropless_routing_makes_exactly_T_times_k_distinct_assignments():
    for k in (1, 2, 3):
        r, x = _random_router(T=50, E=6, k=k)
        out = r(x)
        assert out.keep is None
        assert out.indices.shape == (50, k)
        assert int(out.tokens_per_expert.sum()) == 50 * k
        assert all(len(set(row.tolist())) == k for row in out.indices)  # k distinct experts per token
        rows, counts, _ = AllToAllDispatcher(6).dispatch(x, out.indices, out.weights, out.keep)
        assert rows.size(0) == 50 * k and sum(counts) == 50 * k
        assert counts == out.tokens_per_expert.tolist()


@pytest.mark.parametrize("cf", [0.25, 0.5, 1.0, 1.5])
def test_capacity_factor_bounds_every_expert_and_drops_the_lowest_scores(cf):
    T, E, k = 64, 8, 2
    r, x = _random_router(T=T, E=E, k=k, skew=4.0, capacity_factor=cf)
    out = r(x)
    cap = expert_capacity(T, E, k, cf)
    assert cap == math.ceil(T * k / E * cf)
    kept = torch.zeros(E, dtype=torch.long).index_add_(0, out.indices[out.keep], torch.ones(int(out.keep.sum()), dtype=torch.long))
    assert int(kept.max()) <= cap
    assert int(out.tokens_per_expert.max()) > cap or cf >= 1.5  # the skew really overloads an expert
    # an expert drops only when full, and drops its lowest-weighted assignments
    for e in range(E):
        routed = out.indices == e
        mine_kept = out.weights[routed & out.keep]
        mine_dropped = out.weights[routed & ~out.keep]
        if mine_dropped.numel():
            assert int(kept[e]) == cap
            assert mine_kept.min() >= mine_dropped.max()
    _, counts, _ = AllToAllDispatcher(E).dispatch(x, out.indices, out.weights, out.keep)
    assert counts == kept.tolist()


def test_capacity_keep_mask_ties_keep_the_earlier_token():
    indices = torch.tensor([[0], [0], [0], [1]])
    scores = torch.tensor([[0.5], [0.5], [0.9], [0.3]])
    keep = capacity_keep_mask(indices, scores, num_experts=2, capacity=2)
    assert keep.squeeze(1).tolist() == [True, False, True, True]


def test_load_balancing_loss_matches_a_hand_computed_example():
    # E=2, k=1, T=3: probs [[.9,.1],[.6,.4],[.2,.8]] -> top-1 experts 0,0,1
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.2, 0.8]], dtype=torch.float64)
    r, x = _router_with_logits(probs.log(), top_k=1, aux_loss_coeff=0.1)
    out = r(x)
    assert out.indices.squeeze(1).tolist() == [0, 0, 1]
    assert out.tokens_per_expert.tolist() == [2, 1]
    # P = [1.7, 1.3], f = [2, 1]: 2 * 0.1 / (1 * 9) * (3.4 + 1.3)
    assert out.aux_loss.item() == pytest.approx(0.2 / 9 * 4.7, rel=1e-12)
    assert out.aux_loss.item() == pytest.approx(0.1044444444444, rel=1e-10)

    # E=3, k=2, T=2: top-2 of [.5,.3,.2] = {0,1}, of [.1,.6,.3] = {1,2}; f = [1,2,1]
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]], dtype=torch.float64)
    r, x = _router_with_logits(probs.log(), top_k=2, aux_loss_coeff=1.0)
    out = r(x)
    assert out.tokens_per_expert.tolist() == [1, 2, 1]
    # P = [.6, .9, .5]: 3 / (2 * 4) * (.6 + 1.8 + .5) = 1.0875
    assert out.aux_loss.item() == pytest.approx(1.0875, rel=1e-12)
    # softmax top-k weights are the probabilities themselves (not renormalized)
    assert torch.allclose(out.weights, torch.tensor([[0.5, 0.3], [0.6, 0.3]], dtype=torch.float64))


def test_uniform_routing_gives_exactly_the_coefficient():
    probs = torch.full((4, 4), 0.25)
    f = torch.tensor([2, 2, 2, 2])
    assert load_balancing_loss(probs, f, top_k=2, coeff=0.01).item() == pytest.approx(0.01)


def test_z_loss_matches_a_hand_computed_example():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]], dtype=torch.float64)
    # logsumexp = ln 2, ln 4 -> mean of squares = (1 + 4) / 2 * ln(2)^2
    assert z_loss(logits, 0.5).item() == pytest.approx(0.5 * 2.5 * math.log(2) ** 2, rel=1e-12)


def test_sigmoid_scores_are_renormalized_over_the_top_k():
    r, x = _random_router(score="sigmoid", k=3)
    w = r(x).weights
    assert torch.allclose(w.sum(-1), torch.ones(w.size(0)))
    r1, x1 = _random_router(score="sigmoid", k=1)
    out = r1(x1)
    assert torch.allclose(out.weights.squeeze(1), torch.sigmoid(out.logits).max(-1).values)


def _explicit_reference(layer: MoELayer, x: torch.Tensor, g: torch.Tensor, aux_weight: float):
    """The same layer written as a plain loop, with the auxiliary losses added to the loss."""
    t = x.reshape(-1, layer.hidden_size)
    r = layer.router(t)
    out = torch.zeros_like(t)
    for j in range(layer.top_k):
        for e in range(layer.num_experts):
            sel = r.indices[:, j] == e
            out[sel] += r.weights[sel, j, None] * layer.experts[str(e)](t[sel], layer.experts.activation)
    loss = (out.reshape(x.shape) * g).sum()
    for extra in (r.aux_loss, r.z_loss):
        if extra is not None:
            loss = loss + aux_weight * extra
    return out.reshape(x.shape), loss


@pytest.mark.parametrize("scale", [1.0, 0.25])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_injected_aux_gradient_equals_adding_the_losses_to_the_loss(scale, score):
    torch.manual_seed(3)
    layer = MoELayer(8, 16, 4, top_k=2, score=score, aux_loss_coeff=0.05, z_loss_coeff=1e-2).double()
    layer.aux_loss_scale = scale
    ref = MoELayer(8, 16, 4, top_k=2, score=score, aux_loss_coeff=0.05, z_loss_coeff=1e-2).double()
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(2, 9, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 9, 8, dtype=torch.float64)
    y = layer(x)
    (y * g).sum().backward()  # the user's loss: no aux term in it

    x2 = x.detach().clone().requires_grad_(True)
    y2, loss = _explicit_reference(ref, x2, g, aux_weight=scale)
    loss.backward()
    assert torch.allclose(y, y2, atol=1e-12)
    assert torch.allclose(x.grad, x2.grad, atol=1e-12)
    for (n, p), (_, p2) in zip(layer.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p.grad, p2.grad, atol=1e-12), n
    # the router's gradient really contains the aux term
    layer.zero_grad()
    layer.aux_loss_scale = 0.0
    (layer(x) * g).sum().backward()
    assert not torch.allclose(layer.router.weight.grad, ref.router.weight.grad)


def test_recorded_losses_are_the_training_forwards_only():
    torch.manual_seed(0)
    layer = MoELayer(8, 16, 4, z_loss_coeff=1e-3)
    x = torch.randn(10, 8)
    a = layer.router(x).aux_loss.item()
    layer(x)
    layer(x)
    with torch.no_grad():
        layer(x * 100)  # evaluation: not recorded
    layer.eval()
    layer(x * 100)
    assert layer.pop_recorded("aux").item() == pytest.approx(a)
    assert layer.pop_recorded("aux") is None
    assert layer.pop_recorded("z") is not None


@pytest.mark.parametrize("dispatcher", [AllToAllDispatcher, AllGatherDispatcher])
def test_dispatch_then_combine_is_the_identity_with_identity_experts(dispatcher):
    torch.manual_seed(1)
    T, H, E, k = 40, 6, 8, 3
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    indices = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    w = torch.rand(T, k, dtype=torch.float64)
    w = (w / w.sum(-1, keepdim=True)).requires_grad_(True)
    d = dispatcher(E)
    rows, counts, state = d.dispatch(x, indices, w)
    assert rows.size(0) == T * k and sum(counts) == T * k
    y = d.combine(rows, state)  # identity experts
    assert torch.allclose(y, x, atol=1e-12)
    g = torch.randn(T, H, dtype=torch.float64)
    (y * g).sum().backward()
    assert torch.allclose(x.grad, g, atol=1e-12)  # sum_j w_j = 1
    assert torch.allclose(w.grad, (g * x.detach()).sum(-1, keepdim=True).expand(T, k), atol=1e-12)
    # rows come grouped by expert
    assert torch.equal(torch.cat([torch.full((c,), e) for e, c in enumerate(counts)]),
                       indices.reshape(-1).sort().values)


def test_moe_layer_init_is_deterministic_and_keeps_every_expert():
    torch.manual_seed(5)
    a = MoELayer(8, 16, 4)
    torch.manual_seed(5)
    b = MoELayer(8, 16, 4)
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(a.state_dict()[n], b.state_dict()[n]) for n in a.state_dict())
    assert sorted(a.experts.keys(), key=int) == ["0", "1", "2", "3"]
    assert not torch.equal(a.experts["0"].w1, a.experts["1"].w1)


def test_bad_arguments_are_config_errors():
    with pytest.raises(MegatronConfigError, match="top_k=5"):
        MoELayer(8, 16, 4, top_k=5)
    with pytest.raises(MegatronConfigError, match="score='relu'"):
        MoELayer(8, 16, 4, score="relu")
    with pytest.raises(MegatronConfigError, match="capacity_factor=0"):
        MoELayer(8, 16, 4, capacity_factor=0)
    with pytest.raises(MegatronConfigError, match="dispatcher='ring'"):
        MoELayer(8, 16, 4, dispatcher="ring")


def test_validate_moe_names_argument_value_rule_and_choices():
    from torch import nn

    from megastrategy.moe.integration import validate_moe
    from megastrategy.parallel_state import ParallelLayout

    model = nn.ModuleDict({"blocks": nn.ModuleList([MoELayer(8, 12, 6)])})
    validate_moe(model, ParallelLayout(world_size=6, ep=3))  # fine
    validate_moe(nn.Linear(2, 2), ParallelLayout(world_size=4, ep=4))  # no MoE: nothing to check
    with pytest.raises(MegatronConfigError) as err:
        validate_moe(model, ParallelLayout(world_size=4, ep=4))
    msg = str(err.value)
    assert "ep=4" in msg and "num_experts=6" in msg and "blocks.0" in msg and "not divisible" in msg
    assert "[1, 2, 3, 6]" in msg
    with pytest.raises(MegatronConfigError, match=r"etp=8.*ffn_hidden_size=12.*\[1, 2, 3, 4, 6, 12\]"):
        validate_moe(model, ParallelLayout(world_size=8, etp=8))
