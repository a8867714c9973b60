"""Exercise of notebook 05: merge two partial attention results (the rule behind ring attention).

Each ring step attends a rank's queries to *part* of the keys and returns a softmax-normalized partial
output with its log-sum-exp. :func:`merge_partial_states` (the solution, the same rule as
:func:`treeattn_lab.reference.merge_attention_states`) combines two of them into the result over the
union of their keys; :func:`check_merge_partial_states` is the checker.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...reference import masked_attention, merge_attention_states


def merge_partial_states(out_a, lse_a, out_b, lse_b):
    """Attention over keys ``A u B`` from the partial results over ``A`` and over ``B``.

    ``out_* [T, H, D]`` are normalized partial outputs and ``lse_* [T, H]`` their (natural-log)
    log-sum-exps, ``-inf`` where a part saw no key. With ``lse = logaddexp(lse_a, lse_b)`` each part is
    weighted by ``exp(lse_part - lse)``: its share of the union's softmax mass. Returns ``(out, lse)``.
    """
    return merge_attention_states(out_a, lse_a, out_b, lse_b)


def _random_case(gen: torch.Generator, kind: str):
    """Partial results of real attention over a random split of the keys (so the answer is known)."""
    T, S, H, D = (
        int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((1, 7), (2, 9), (1, 3), (2, 5))
    )
    q = torch.randn(T, H, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(S, H, D, generator=gen, dtype=torch.float64) for _ in range(2))
    if kind == "large":  # scores of several hundred: exp() overflows unless the maximum is subtracted
        q = q * 60
    in_a = torch.rand(S, generator=gen) < 0.5
    in_a[0], in_a[1] = True, False  # both parts hold keys
    causal = torch.ones(T, S, dtype=torch.bool)
    if kind == "empty":  # some rows see no key of one part, or none at all
        causal = torch.rand(T, S, generator=gen) < 0.4
    mask_a, mask_b = causal & in_a[None, :], causal & ~in_a[None, :]
    parts = [masked_attention(q, k, v, m, return_lse=True) for m in (mask_a, mask_b)]
    want = masked_attention(q, k, v, causal, return_lse=True)
    return parts, want


def _hint(got_out, got_lse, want_out, want_lse) -> str:
    if torch.isnan(got_out).any() or torch.isnan(got_lse).any():
        if torch.isinf(want_lse).any():
            return (
                "hint: a row where a part saw no key has lse -inf and output 0; where both are -inf the "
                "merged row is 0 with lse -inf (avoid -inf - -inf)."
            )
        return (
            "hint: exp() of scores in the hundreds overflows; compute lse = logaddexp(lse_a, lse_b) "
            "and weights exp(lse_a - lse), which are at most 1."
        )
    if not torch.allclose(got_lse, want_lse, rtol=1e-6, atol=1e-6, equal_nan=False):
        return "hint: the union's log-sum-exp is log(exp(lse_a) + exp(lse_b)), torch.logaddexp(lse_a, lse_b)."
    return (
        "hint: weight each partial output by its share of the mass, exp(lse_part - lse) (one value per "
        "row and head: add a trailing dimension to broadcast over D)."
    )


def check_merge_partial_states(
    fn: Callable, *, trials: int = 30, seed: int | None = None, verbose: bool = True
) -> bool:
    """Check ``fn(out_a, lse_a, out_b, lse_b) -> (out, lse)`` against attention over the union of keys.

    Cases are real partial results (random queries, keys split at random into two parts), including
    rows where a part, or both, saw nothing and scores large enough to overflow a naive ``exp``. Prints
    ``pass`` or ``fail`` with the first failing case and a hint; returns the verdict.
    """
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))) if seed is None else seed)
    for trial in range(trials):
        kind = ("plain", "empty", "large")[trial % 3]
        ((out_a, lse_a), (out_b, lse_b)), (want_out, want_lse) = _random_case(gen, kind)
        inputs = [x.clone() for x in (out_a, lse_a, out_b, lse_b)]
        try:
            got_out, got_lse = fn(*inputs)
            got_out, got_lse = torch.as_tensor(got_out).double(), torch.as_tensor(got_lse).double()
        except Exception as e:  # the learner's bug, reported rather than raised
            if verbose:
                print(f"fail: fn raised {type(e).__name__}: {e}")
                print("hint: return a pair (out [T, H, D], lse [T, H]) of tensors.")
            return False
        ok = (
            got_out.shape == want_out.shape
            and got_lse.shape == want_lse.shape
            and torch.allclose(got_out, want_out, rtol=1e-6, atol=1e-8)
            and torch.equal(torch.isinf(got_lse), torch.isinf(want_lse))
            and torch.allclose(
                got_lse[torch.isfinite(want_lse)], want_lse[torch.isfinite(want_lse)], rtol=1e-6, atol=1e-8
            )
        )
        if not ok:
            if verbose:
                print(
                    f"fail on case {trial + 1} ({kind}): out {tuple(out_a.shape)}, lse {tuple(lse_a.shape)}"
                )
                print(f"  lse_a = {lse_a.flatten()[:6].tolist()}\n  lse_b = {lse_b.flatten()[:6].tolist()}")
                if got_out.shape == want_out.shape and got_lse.shape == want_lse.shape:
                    print(_hint(got_out, got_lse, want_out, want_lse))
                else:
                    print(
                        f"hint: expected shapes {tuple(want_out.shape)} and {tuple(want_lse.shape)}, "
                        f"got {tuple(got_out.shape)} and {tuple(got_lse.shape)}"
                    )
            return False
    if verbose:
        print(f"pass: {trials} merges of real partial results (empty parts and huge scores included)")
    return True


__all__ = ["check_merge_partial_states", "merge_partial_states"]
