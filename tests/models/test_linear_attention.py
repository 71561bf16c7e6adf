"""The forms of linear attention (models/linear_attention/) against each other and the slow, readable
reference: one helper checks any two forms, which share one signature."""

from functools import partial

import pytest
import torch

from models.linear_attention.fused import linear_attention_fused
from models.linear_attention.naive import linear_attention_naive, phi_naive
from models.linear_attention.parallel import linear_attention_parallel
from models.linear_attention.recurrent import linear_attention_recurrent, recurrent_step
from models.linear_attention.state import LinearAttentionState
from models.linear_transformer import PHI_FLOOR, phi
from tests.models.conftest import TEST_DEVICE
from tests.models.helpers import generator

FORMS = {
    "naive": linear_attention_naive,
    "parallel": linear_attention_parallel,
    "recurrent": linear_attention_recurrent,
    "fused": linear_attention_fused,
}
cpu_only = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the fused form is the CPU serving path")


def qkv(batch, heads, events, dim, seed, dtype=torch.float64):
    """Feature-mapped queries and keys and plain values [B, H, T, D]."""
    g = generator(seed)
    q, k, v = (torch.randn(batch, heads, events, dim, generator=g, dtype=torch.float64) for _ in range(3))
    return phi(q).to(dtype), phi(k).to(dtype), v.to(dtype)


def assert_forms_agree(form, reference, q, k, v, state=None, valid=None, tolerance=1e-10):
    """Same outputs on the valid events and the same final state, from the same arguments."""
    out, final = form(q, k, v, state, valid)
    expected, expected_final = reference(q, k, v, state, valid)
    keep = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool) if valid is None else valid  # [B, T]
    assert out.shape == expected.shape
    assert (out - expected).transpose(1, 2)[keep].abs().max().item() <= tolerance
    assert (final.s - expected_final.s).abs().max().item() <= tolerance
    assert (final.z - expected_final.z).abs().max().item() <= tolerance
    assert torch.equal(final.n, expected_final.n)


def carried_state(batch, heads, dim, seed) -> LinearAttentionState:
    # What 50 earlier events left, with accounts that have seen 50, 0 and 7 of them.
    lengths = torch.tensor([50, 0, 7, 50, 12])[:batch]
    valid = torch.arange(50)[None, :] < lengths[:, None]
    _, state = linear_attention_naive(*qkv(batch, heads, 50, dim, seed), valid=valid)
    return state


@pytest.mark.parametrize("form", ["parallel", "recurrent", pytest.param("fused", marks=cpu_only)])
@pytest.mark.parametrize("carried", [False, True], ids=["from-zero", "carried-state"])
@pytest.mark.parametrize("padded", [False, True], ids=["whole", "padded"])
def test_every_form_equals_the_reference(form, carried, padded):
    q, k, v = qkv(3, 2, 40, 4, seed=1)
    state = carried_state(3, 2, 4, seed=2) if carried else None
    valid = torch.arange(40)[None, :] < torch.tensor([40, 17, 0])[:, None] if padded else None
    assert_forms_agree(FORMS[form], linear_attention_naive, q, k, v, state, valid)


@pytest.mark.parametrize("events", [1, 5, 64, 100, 300])
@pytest.mark.parametrize("chunk_events", [1, 7, 64, 512])
@pytest.mark.parametrize("carried", [False, True], ids=["from-zero", "carried-state"])
def test_chunked_parallel_form_equals_the_reference_whatever_the_chunk(events, chunk_events, carried):
    q, k, v = qkv(2, 3, events, 4, seed=events)
    state = carried_state(2, 3, 4, seed=99) if carried else None
    parallel = partial(linear_attention_parallel, chunk_events=chunk_events)
    assert_forms_agree(parallel, linear_attention_naive, q, k, v, state)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_fused_form_equals_the_recurrent_one_in_serving_precision(dtype):
    # Accounts whose running means take each branch of torch.lerp (weights 1, 1/2, then below 1/2).
    q, k, v = qkv(4, 2, 30, 8, seed=3, dtype=dtype)
    state = carried_state(4, 2, 8, seed=4)
    state = LinearAttentionState(state.s.to(dtype), state.z.to(dtype), state.n)
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-5}[dtype]
    assert_forms_agree(
        linear_attention_fused, linear_attention_recurrent, q, k, v, state, tolerance=tolerance
    )


def test_100k_steps_of_the_recurrence_in_float32_stay_near_float64(record_property):
    # The serving recurrence exactly as the detector's torch step runs it (float32 running means, new means
    # into preallocated tensors), one event at a time over 100,000 events, against the chunked form in
    # float64.
    events = 100_000
    q, k, v = qkv(1, 2, events, 4, seed=2)
    expected, expected_final = linear_attention_parallel(q, k, v)
    q32, k32, v32 = q.float(), k.float(), v.float()
    s_mean, z_mean = torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4)
    s_new, z_new = torch.empty_like(s_mean), torch.empty_like(z_mean)
    shares = 1.0 / torch.arange(1, events + 1, dtype=torch.float32)
    worst = 0.0
    with torch.inference_mode():
        for t in range(events):
            step = (q32[:, :, t], k32[:, :, t], v32[:, :, t], s_mean, z_mean, shares[t].view(1, 1, 1))
            out, _, _ = recurrent_step(*step, out=(s_new, z_new))
            s_mean, s_new, z_mean, z_new = s_new, s_mean, z_new, z_mean  # two sets, swapped each event
            if t % 100 == 99 or t == events - 1:
                worst = max(worst, (out.double() - expected[:, :, t]).abs().max().item())
    record_property("max_abs_error", worst)
    print(
        f"linear attention recurrence, float32 running means over {events:,} events: |out diff| <= {worst:.1e}"
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
