"""The forms of linear attention (models/linear_attention/) against each other and the slow, readable
reference: one helper checks any two forms, which share one signature, with and without decay."""

from functools import partial

import pytest
import torch

from models.linear_attention.fused import linear_attention_fused
from models.linear_attention.naive import linear_attention_naive, phi_naive
from models.linear_attention.parallel import linear_attention_parallel
from models.linear_attention.recurrent import linear_attention_recurrent, recurrent_step
from models.linear_attention.state import LinearAttentionState, decayed_count, update_shares
from models.linear_transformer import DECAY_RULES, PHI_FLOOR, phi
from tests.models.conftest import TEST_DEVICE
from tests.models.helpers import generator

FORMS = {
    "naive": linear_attention_naive,
    "parallel": linear_attention_parallel,
    "recurrent": linear_attention_recurrent,
    "fused": linear_attention_fused,
}
cpu_only = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the fused form is the CPU serving path")
# Each head's decay g: none (plain linear attention), or a fast, an undecayed and a slow head.
DECAYS = {"undecayed": None, "decayed": [0.5, 1.0, 0.9375]}


def decay_of(kind: str, heads: int) -> torch.Tensor | None:
    """decay [H] for `heads` heads, or None (no decay)."""
    return None if DECAYS[kind] is None else torch.tensor(DECAYS[kind][:heads], dtype=torch.float64)


def qkv(batch, heads, events, dim, seed, dtype=torch.float64):
    """Feature-mapped queries and keys and plain values [B, H, T, D]."""
    g = generator(seed)
    q, k, v = (torch.randn(batch, heads, events, dim, generator=g, dtype=torch.float64) for _ in range(3))
    return phi(q).to(dtype), phi(k).to(dtype), v.to(dtype)


def assert_forms_agree(form, reference, q, k, v, state=None, valid=None, decay=None, tolerance=1e-10):
    """Same outputs on the valid events and the same final state, from the same arguments."""
    out, final = form(q, k, v, state, valid, decay)
    expected, expected_final = reference(q, k, v, state, valid, decay)
    keep = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool) if valid is None else valid  # [B, T]
    assert out.shape == expected.shape
    assert (out - expected).transpose(1, 2)[keep].abs().max().item() <= tolerance
    assert (final.s - expected_final.s).abs().max().item() <= tolerance
    assert (final.z - expected_final.z).abs().max().item() <= tolerance
    assert torch.equal(final.n, expected_final.n)


def carried_state(batch, heads, dim, seed, decay=None) -> LinearAttentionState:
    # What 50 earlier events left, with accounts that have seen 50, 0 and 7 of them.
    lengths = torch.tensor([50, 0, 7, 50, 12])[:batch]
    valid = torch.arange(50)[None, :] < lengths[:, None]
    _, state = linear_attention_naive(*qkv(batch, heads, 50, dim, seed), valid=valid, decay=decay)
    return state


def holes(batch, events, seed) -> torch.Tensor:
    """valid [B, T] with padding anywhere, not only at the end; the last account all padding."""
    valid = torch.rand(batch, events, generator=generator(seed)) < 0.7
    valid[-1] = False
    return valid


@pytest.mark.parametrize("form", ["parallel", "recurrent", pytest.param("fused", marks=cpu_only)])
@pytest.mark.parametrize("carried", [False, True], ids=["from-zero", "carried-state"])
@pytest.mark.parametrize("padded", ["whole", "padded", "holes"])
@pytest.mark.parametrize("decay", sorted(DECAYS))
def test_every_form_equals_the_reference(form, carried, padded, decay):
    q, k, v = qkv(3, 2, 40, 4, seed=1)
    g = decay_of(decay, 2)
    state = carried_state(3, 2, 4, seed=2, decay=g) if carried else None
    valid = {
        "whole": None,
        "padded": torch.arange(40)[None, :] < torch.tensor([40, 17, 0])[:, None],
        "holes": holes(3, 40, seed=5),
    }[padded]
    assert_forms_agree(FORMS[form], linear_attention_naive, q, k, v, state, valid, g)


@pytest.mark.parametrize("events", [1, 5, 64, 100, 300])
@pytest.mark.parametrize("chunk_events", [1, 7, 64, 512])
@pytest.mark.parametrize("carried", [False, True], ids=["from-zero", "carried-state"])
@pytest.mark.parametrize("decay", sorted(DECAYS))
def test_chunked_parallel_form_equals_the_reference_whatever_the_chunk(events, chunk_events, carried, decay):
    q, k, v = qkv(2, 3, events, 4, seed=events)
    g = decay_of(decay, 3)
    state = carried_state(2, 3, 4, seed=99, decay=g) if carried else None
    parallel = partial(linear_attention_parallel, chunk_events=chunk_events)
    assert_forms_agree(parallel, linear_attention_naive, q, k, v, state, decay=g)


@pytest.mark.parametrize("chunk_events", [1, 7, 64])
def test_padding_anywhere_neither_adds_to_nor_decays_the_state(chunk_events):
    # Each account's valid events alone, packed together, give the same outputs and state as with the
    # padding between them: a padded event is no event, for the decay too.
    q, k, v = qkv(3, 3, 50, 4, seed=6)
    g = decay_of("decayed", 3)
    state = carried_state(3, 3, 4, seed=7, decay=g)
    valid = holes(3, 50, seed=8)
    out, final = linear_attention_parallel(q, k, v, state, valid, g, chunk_events=chunk_events)
    for b in range(3):
        alone = LinearAttentionState(*(t[b : b + 1] for t in state))
        packed = [t[b : b + 1, :, valid[b]] for t in (q, k, v)]
        expected, expected_final = linear_attention_naive(*packed, alone, decay=g)
        if valid[b].any():
            assert (out[b][:, valid[b]] - expected[0]).abs().max().item() <= 1e-10
        for got, want in zip(final, expected_final, strict=True):
            assert (got[b : b + 1].double() - want.double()).abs().max().item() <= 1e-10


def test_the_reference_weighs_event_j_by_g_to_its_age_at_event_t():
    # out_t = sum_j g^(t - j) (phi(q_t).phi(k_j)) v_j / sum_j g^(t - j) (phi(q_t).phi(k_j)), written out
    # whole per head, against the reference's recurrence; then the state's decayed means.
    q, k, v = qkv(2, 3, 12, 4, seed=9)
    g = decay_of("decayed", 3)
    out, final = linear_attention_naive(q, k, v, decay=g)
    t = torch.arange(12, dtype=torch.float64)
    age = (t[:, None] - t[None, :]).clamp(min=0)  # [T, T]
    weights = g[:, None, None] ** age * (age.new_ones(12, 12).tril())  # [H, T, T]
    a = (q @ k.transpose(-1, -2)) * weights  # [B, H, T, T]
    assert (out - (a @ v) / a.sum(-1, keepdim=True)).abs().max().item() <= 1e-12
    last = weights[:, -1]  # [H, T]: each event's weight in the final sums
    n_g = last.sum(-1)  # [H] the decayed count
    s = torch.einsum("ht,bhtd,bhte->bhde", last, k, v) / n_g[:, None, None]
    z = torch.einsum("ht,bhtd->bhd", last, k) / n_g[:, None]
    assert (final.s - s).abs().max().item() <= 1e-12 and (final.z - z).abs().max().item() <= 1e-12
    assert torch.allclose(decayed_count(final.n, g), n_g.expand(2, 3), rtol=1e-14, atol=0)


def test_decayed_count_and_shares_follow_the_recurrence_and_are_plain_counts_at_g_1():
    g = torch.tensor([0.75, 1 - 2.0**-20, 1.0], dtype=torch.float64)
    n = torch.arange(0, 3_000)
    count = decayed_count(n, g)  # [N, H]
    recurrence = torch.zeros(3, dtype=torch.float64)
    for i in range(3_000):  # n_g after i events, then one more: g n_g + 1
        assert torch.allclose(count[i], recurrence, rtol=1e-12, atol=0), i
        recurrence = g * recurrence + 1
    assert count[:, 2].tolist() == n.double().tolist()  # g = 1: the plain count, exactly
    assert (count[:, 0] <= 4).all() and abs(count[-1, 0].item() - 4) <= 1e-12  # bounded by 1 / (1 - g)
    n = torch.arange(0, 1 << 20)
    shares = update_shares(n, g, torch.float32)  # [N, H]
    # g = 1: bit for bit the share the undecayed step always took, 1 / (n + 1) in the state's dtype.
    assert torch.equal(shares[:, 2], 1.0 / (n + 1).to(torch.float32))
    assert torch.equal(shares[-1, 0], torch.tensor(0.25)) and (shares[:, 1] > 0).all()


def test_the_mixed_rule_is_four_speeds_and_one_undecayed_head():
    assert DECAY_RULES["mixed"](4) == [0.75, 0.9375, 0.984375, 1.0]
    assert DECAY_RULES["mixed"](1) == [1.0] and DECAY_RULES["none"](3) == [1.0, 1.0, 1.0]
    assert all(0 < g < 1 for g in DECAY_RULES["retnet"](8))


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("decay", sorted(DECAYS))
def test_fused_form_equals_the_recurrent_one_in_serving_precision(dtype, decay):
    # Accounts whose running means take each branch of torch.lerp (weights 1, 1/2, then below 1/2); with
    # decay, the heads of one account take different branches.
    q, k, v = qkv(4, 2, 30, 8, seed=3, dtype=dtype)
    g = decay_of(decay, 2)
    state = carried_state(4, 2, 8, seed=4, decay=g)
    state = LinearAttentionState(state.s.to(dtype), state.z.to(dtype), state.n)
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-5}[dtype]
    assert_forms_agree(
        linear_attention_fused, linear_attention_recurrent, q, k, v, state, decay=g, tolerance=tolerance
    )


def test_100k_steps_of_the_recurrence_in_float32_stay_near_float64(record_property):
    # The serving recurrence exactly as the detector's torch step runs it (float32 running means, new means
    # into preallocated tensors), one event at a time over 100,000 events, against the chunked form in
    # float64. Three heads: a fast and a slow decayed head, and an undecayed one.
    events = 100_000
    q, k, v = qkv(1, 3, events, 4, seed=2)
    g = torch.tensor(DECAY_RULES["mixed"](3), dtype=torch.float64)
    expected, expected_final = linear_attention_parallel(q, k, v, decay=g)
    q32, k32, v32 = q.float(), k.float(), v.float()
    s_mean, z_mean = torch.zeros(1, 3, 4, 4), torch.zeros(1, 3, 4)
    s_new, z_new = torch.empty_like(s_mean), torch.empty_like(z_mean)
    shares = update_shares(torch.arange(events), g, torch.float32)  # [T, H]
    worst = 0.0
    with torch.inference_mode():
        for t in range(events):
            step = (q32[:, :, t], k32[:, :, t], v32[:, :, t], s_mean, z_mean, shares[t].view(1, 3, 1))
            out, _, _ = recurrent_step(*step, out=(s_new, z_new))
            s_mean, s_new, z_mean, z_new = s_new, s_mean, z_new, z_mean  # two sets, swapped each event
            if t % 100 == 99 or t == events - 1:
                worst = max(worst, (out.double() - expected[:, :, t]).abs().max().item())
    record_property("max_abs_error", worst)
    print(
        f"linear attention recurrence, float32 decayed means over {events:,} events: "
        f"|out diff| <= {worst:.1e}"
    )
    assert worst <= 1e-3
    s_expected = expected_final.s
    assert (s_mean.double() - s_expected).abs().max().item() / s_expected.abs().max().item() <= 1e-3


def test_phi_is_elu_plus_one_and_never_zero_even_in_bf16():
    x = torch.linspace(-12, 12, 2001, dtype=torch.float64)
    assert (phi(x) - phi_naive(x)).abs().max().item() <= 1e-15
    very_negative = torch.tensor([-7.0, -20.0, -100.0, -1e4], dtype=torch.bfloat16)
    # Why phi is written the way it is: elu(x) + 1 in bf16 cancels to exactly 0 from x < -6.2 on.
    assert (phi_naive(very_negative) == 0).all()
    assert (phi(very_negative) >= PHI_FLOOR).all() and phi(very_negative).dtype == torch.float32
    assert torch.equal(
        phi(very_negative[:2].float()), torch.exp(very_negative[:2].float()).clamp(min=PHI_FLOOR)
    )


def test_padding_in_the_parallel_form_keeps_gradients_finite():
    # Events past a chunk boundary are padded inside the parallel form; their rows must not divide by 0.
    q, k, v = (t.detach().requires_grad_() for t in qkv(1, 2, 70, 4, seed=3))
    out, _ = linear_attention_parallel(q, k, v, chunk_events=64)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
