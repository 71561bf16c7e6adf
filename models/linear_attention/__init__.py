"""Causal linear attention (Katharopoulos et al. 2020) in four forms with one signature.

Every form takes the same arguments and returns (output, final_state), so any two can be swapped and
checked against each other (tests/models/test_linear_attention.py does so with one helper):

    form(phi_q, phi_k, v, state=None, valid=None, decay=None) -> (out [B, H, T, Dv], LinearAttentionState)

phi_q, phi_k: [B, H, T, D] queries and keys after the feature map (the caller's: phi in
models/linear_transformer.py); v: [B, H, T, Dv]; state: what earlier events left (state.py), none when
None; valid: [B, T] bool, False marking padding, which never touches the state (neither adds to it nor
decays it) and whose outputs are don't-care (every event valid when None); decay: [H], each head's fixed
factor g in (0, 1] on its sums per event (1 for every head when None: plain linear attention). Shapes:
B accounts, H heads, T events, D key dim, Dv value dim.

- naive.py: one event at a time with plain sums, written to be read; the reference.
- parallel.py: chunked, quadratic inside a chunk and recurrent between chunks; training's form.
- recurrent.py: one event at a time on the decayed running means, as the serving step runs it in torch.
- fused.py: the same recurrence compiled (numba, CPU); the serving step's fast path.
"""
