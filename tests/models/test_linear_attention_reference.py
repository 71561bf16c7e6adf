"""The linear Transformer's fast paths against the slow, readable reference (models/linear_attention_naive.py)."""

import pytest
import torch

from models.linear_attention_naive import linear_attention_naive, phi_naive
from models.linear_transformer import PHI_FLOOR, causal_linear_attention, linear_attention_step, phi
from tests.models.helpers import generator


def qkv(batch, heads, events, dim, seed, dtype=torch.float64):
    g = generator(seed)
    return [
        torch.randn(batch, heads, events, dim, generator=g, dtype=torch.float64).to(dtype) for _ in range(3)
    ]


@pytest.mark.parametrize("events", [1, 5, 64, 100, 300])
@pytest.mark.parametrize("chunk_events", [1, 7, 64, 512])
@pytest.mark.parametrize("carried", [False, True], ids=["from-zero", "carried-state"])
def test_chunked_parallel_form_equals_the_reference(events, chunk_events, carried):
    q, k, v = qkv(2, 3, events, 4, seed=events)
    s0 = z0 = None
    if carried:  # sums left by 50 earlier events
        _, s0, z0 = linear_attention_naive(*qkv(2, 3, 50, 4, seed=99))
    expected, s_expected, z_expected = linear_attention_naive(q, k, v, s0, z0)
    zeros_s, zeros_z = torch.zeros(2, 3, 4, 4, dtype=q.dtype), torch.zeros(2, 3, 4, dtype=q.dtype)
    out, s, z = causal_linear_attention(
        phi(q), phi(k), v, zeros_s if s0 is None else s0, zeros_z if z0 is None else z0, chunk_events
    )
    assert (out - expected).abs().max().item() <= 1e-10
    assert (s - s_expected).abs().max().item() <= 1e-10
    assert (z - z_expected).abs().max().item() <= 1e-10


def test_recurrent_step_on_running_means_equals_the_reference():
    q, k, v = qkv(2, 3, 200, 4, seed=1)
    expected, s_expected, z_expected = linear_attention_naive(q, k, v)
    s_mean, z_mean = torch.zeros(2, 3, 4, 4, dtype=q.dtype), torch.zeros(2, 3, 4, dtype=q.dtype)
    for t in range(200):
        share = torch.full((2, 1, 1), 1.0 / (t + 1), dtype=q.dtype)
        step = (phi(q[:, :, t]), phi(k[:, :, t]), v[:, :, t], s_mean, z_mean, share)
        out, s_mean, z_mean = linear_attention_step(*step)
        assert (out - expected[:, :, t]).abs().max().item() <= 1e-10
    assert (s_mean * 200 - s_expected).abs().max().item() <= 1e-10
    assert (z_mean * 200 - z_expected).abs().max().item() <= 1e-10


def test_100k_steps_of_the_recurrence_in_float32_stay_near_float64(record_property):
    # The serving recurrence exactly as the detector runs it (float32 running means), one event at a
    # time over 100,000 events, against float64 sums through the chunked form.
    events = 100_000
    q, k, v = qkv(1, 2, events, 4, seed=2)
    zeros_s, zeros_z = torch.zeros(1, 2, 4, 4, dtype=q.dtype), torch.zeros(1, 2, 4, dtype=q.dtype)
    expected, s_expected, _ = causal_linear_attention(phi(q), phi(k), v, zeros_s, zeros_z)
    phi_q, phi_k, v32 = phi(q.float()), phi(k.float()), v.float()
    s_mean, z_mean = zeros_s.float(), zeros_z.float()
    s_new, z_new = torch.empty_like(s_mean), torch.empty_like(z_mean)
    shares = 1.0 / torch.arange(1, events + 1, dtype=torch.float32)
    worst = 0.0
    with torch.inference_mode():
        for t in range(events):
            # As serving runs it: new means go into preallocated tensors (two sets, swapped each event).
            step = (phi_q[:, :, t], phi_k[:, :, t], v32[:, :, t], s_mean, z_mean, shares[t].view(1, 1, 1))
            out, _, _ = linear_attention_step(*step, out=(s_new, z_new))
            s_mean, s_new, z_mean, z_new = s_new, s_mean, z_new, z_mean
            if t % 100 == 99 or t == events - 1:
                worst = max(worst, (out.double() - expected[:, :, t]).abs().max().item())
    record_property("max_abs_error", worst)
    print(
        f"linear attention recurrence, float32 running means over {events:,} events: |out diff| <= {worst:.1e}"
    )
    assert worst <= 1e-3
    assert (s_mean.double() * events - s_expected).abs().max().item() / s_expected.abs().max().item() <= 1e-3


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
    # Events past a chunk boundary are padded inside causal_linear_attention; their rows must not divide by 0.
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 70, 4, seed=3))
    out, _, _ = causal_linear_attention(
        phi(q), phi(k), v, torch.zeros(1, 2, 4, 4, dtype=q.dtype), torch.zeros(1, 2, 4, dtype=q.dtype), 64
    )
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
