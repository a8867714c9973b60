"""The process group, and how ranks agree before they compute together.

Every collective call of the distributed layer starts the same way, on every rank:

1. the rank checks its own arguments and, if they are valid, reduces what must be equal on every rank
   (rollouts, settings, a ring's pattern, a model's parameters) to a digest;
2. the digests, or the rank's rejection of its input, are all-gathered (:func:`agree`);
3. if any rank rejected its input, or two digests differ, **every** rank raises
   :class:`RankMismatchError` naming the ranks. No rank is left waiting for a peer that gave up.

Calls made again and again with the same inputs (a ring attention layer in every step) agree with
``quick=True``: one all-reduce of a 63-bit fingerprint of the digest and a problem flag, with the full
exchange above only where a fingerprint differs or a rank has a problem (to name them).

Small control messages and barriers run on a gloo *monitor group* (:func:`monitor_group`: the group
itself when it is gloo, else a gloo side group over the same ranks), so they never block a GPU stream.
"""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist


class RankMismatchError(ValueError):
    """The ranks hold different inputs or settings, or one rejected its input (raised on every rank)."""


class RankFailureError(RuntimeError):
    """A rank failed or hung during a collective step (raised on every rank)."""


# ============================================================================================ process group
def init_distributed(
    backend: str | None = None, *, timeout_s: float = 600.0
) -> tuple[int, int, torch.device]:
    """``init_process_group`` from torchrun's environment: NCCL with one GPU per local rank where CUDA is
    available, else gloo; every collective times out after ``timeout_s``. Returns (rank, world, device).

    Sets ``NCCL_NVLS_ENABLE=0`` (NVLink multicast off) when it is unset."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


_MONITOR_GROUPS: dict = {}


def monitor_group(group):
    """A gloo group over the ranks of ``group``, for barriers and small objects (``group`` itself if gloo).

    Collective the first time for a given NCCL group: every rank creates the side group at the same call.
    """
    if "nccl" not in str(dist.get_backend(group)).lower():
        return group
    key = id(group)
    if key not in _MONITOR_GROUPS:
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        _MONITOR_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
    return _MONITOR_GROUPS[key]


def monitored_barrier(monitor, timeout_s: float, where: str) -> None:
    """A barrier that raises on every rank (rank 0 naming the missing ranks) instead of hanging."""
    if dist.get_world_size(monitor) == 1:
        return
    try:
        dist.monitored_barrier(group=monitor, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as e:
        rank = dist.get_rank(monitor)
        raise RankFailureError(
            f"rank {rank}: not every rank reached the barrier {where} within {timeout_s:g} s (a rank hung, "
            f"died or is much slower): {e}"
        ) from e


def rank_in(group) -> int:
    """This process's rank in ``group``; a clear error for a process outside it (torch returns -1)."""
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    return rank


def gather_objects(obj, monitor) -> list:
    """``obj`` of every rank of ``monitor``, in rank order."""
    out = [None] * dist.get_world_size(monitor)
    dist.all_gather_object(out, obj, group=monitor)
    return out


# ================================================================================================ agreement
def describe(error: BaseException) -> str:
    """How a rank's error is reported to its peers: ``"ValueError: ..."``."""
    return f"{type(error).__name__}: {error}"


def agree(
    digest: str | None,
    problem: str | None,
    monitor,
    *,
    what: str,
    hint: str,
    cause: BaseException | None = None,
    quick: bool = False,
) -> None:
    """Collective: raise :class:`RankMismatchError` on every rank when a rank has a ``problem`` or the
    ``digest``\\ s differ. ``what`` names what the digests cover; ``hint`` says how to fix a mismatch;
    ``cause``: this rank's own error behind its ``problem`` (raised from).

    ``quick``: first compare, in one all-reduce of three integers, a 63-bit fingerprint of the digests
    (its maximum and minimum over ranks) and whether any rank has a problem; the digests and problems
    are exchanged (to name the ranks) only where that finds a difference. Every rank takes the same
    branch, since every rank sees the same reduced values."""
    if quick and _fingerprints_agree(digest, problem, monitor):
        return
    rank = dist.get_rank(monitor)
    gathered = gather_objects({"digest": digest, "problem": problem}, monitor)
    problems = [(r, g["problem"]) for r, g in enumerate(gathered) if g["problem"]]
    if problems:
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in problems)
        raise RankMismatchError(
            f"rank {rank}: rank(s) {[r for r, _ in problems]} rejected their input ({detail})"
        ) from cause
    digests = [g["digest"] for g in gathered]
    if len(set(digests)) > 1:
        raise RankMismatchError(f"rank {rank}: the ranks disagree on {what} ({_holders(digests)}); {hint}")


def _fingerprints_agree(digest: str | None, problem: str | None, monitor) -> bool:
    """The quick check of :func:`agree`: one int64 MAX all-reduce of (fingerprint, -fingerprint, problem),
    so the fingerprints agree exactly when their maximum equals their minimum."""
    fingerprint = _fingerprint(digest)
    flags = torch.tensor([fingerprint, -fingerprint, int(problem is not None)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=monitor)
    return int(flags[0]) == -int(flags[1]) and not int(flags[2])


def _fingerprint(digest: str | None) -> int:
    """A 63-bit fingerprint of a hex ``digest``: its first 64 bits shifted right by one, in
    ``0 .. 2**63 - 1`` so that it and its negation fit an int64; -1 for no digest."""
    return int(digest[:16], 16) >> 1 if digest is not None else -1


def _holders(digests: list[str]) -> str:
    """``"ranks [0, 2] hold 1a2b...; ranks [1] hold 3c4d..."``."""
    groups: dict[str, list[int]] = {}
    for r, d in enumerate(digests):
        groups.setdefault(d, []).append(r)
    return "; ".join(f"ranks {ranks} hold {d[:12]}" for d, ranks in groups.items())


def sha256(*parts) -> str:
    """SHA-256 of ``parts``: bytes as they are, tensors by their dtype, shape and values, others by repr."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            x = part.detach().to("cpu").contiguous()
            h.update(f"{x.dtype}{tuple(x.shape)}".encode())
            h.update(bytes(x.reshape(-1).view(torch.uint8).numpy()) if x.numel() else b"")
        elif isinstance(part, bytes):
            h.update(part)
        else:
            h.update(repr(part).encode())
        h.update(b"\x00")
    return h.hexdigest()


# ======================================================================================== model parameters
_CHUNK_BYTES = 1 << 24
_MODULUS = 65521  # positions weigh 1..65521: with bytes < 2**8 every product stays below 2**24


def _checksum(x: torch.Tensor) -> torch.Tensor:
    """Two integer checksums of a tensor's bytes, computed where the tensor lives (``[2]`` int64): their
    sum, and their sum weighted by position (``1 + i mod 65521``). Integer sums are exact in any order, so
    equal tensors give equal checksums on every rank, and one changed byte always changes the second."""
    data = x.detach().contiguous().reshape(-1).view(torch.uint8)
    out = torch.zeros(2, dtype=torch.int64, device=data.device)
    for start in range(0, data.numel(), _CHUNK_BYTES):
        chunk = data[start : start + _CHUNK_BYTES].to(torch.int64)
        pos = torch.arange(start, start + chunk.numel(), device=chunk.device, dtype=torch.int64)
        out[0] += chunk.sum()
        out[1] += (chunk * (pos % _MODULUS + 1)).sum()
    return out


def parameter_summary(model: torch.nn.Module) -> list[tuple]:
    """``(name, shape, dtype, checksums)`` of every parameter of ``model``, in registration order: what
    :func:`parameter_difference` compares across ranks (one device-to-host copy for all checksums)."""
    named = list(model.named_parameters())
    if not named:
        return []
    home = named[0][1].device
    sums = torch.stack([_checksum(p).to(home) for _, p in named]).tolist()
    return [(n, tuple(p.shape), str(p.dtype), tuple(c)) for (n, p), c in zip(named, sums, strict=True)]


def parameter_difference(summaries: list[list[tuple]]) -> str | None:
    """How the ranks' :func:`parameter_summary`\\ s differ from rank 0's (None when they are equal)."""
    first = summaries[0]
    for r, other in enumerate(summaries[1:], start=1):
        if other == first:
            continue
        if [s[0] for s in other] != [s[0] for s in first]:
            return (
                f"rank {r} has {len(other)} parameters, named differently from rank 0's {len(first)} (a "
                "different architecture)"
            )
        for mine, theirs in zip(first, other, strict=True):
            if mine[1:3] != theirs[1:3]:
                return (
                    f"parameter {mine[0]!r} is {theirs[2]} {list(theirs[1])} on rank {r} but {mine[2]} "
                    f"{list(mine[1])} on rank 0"
                )
            if mine[3] != theirs[3]:
                return f"parameter {mine[0]!r} has different values on rank {r} and rank 0"
    return None
