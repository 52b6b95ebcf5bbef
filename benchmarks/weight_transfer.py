"""1. Weight transfer: rlcomm's WeightSender/WeightReceiver against three ways of moving the
same state dict from the trainer (rank 0) to 1 and 3 receivers over WEIGHT_TRANSFER.

rlcomm runs three ways. ``rlcomm_ppo`` is the path the PPO loop uses by default (lockstep,
``loop.max_staleness=0``) and carries the goals: the trainer's module is bound with
``WeightSender.bind`` and sent with ``send(module)``, so its parameters live in the send buffers
and nothing is copied or even looked up; each receiver's module is bound too and receives with
``receive_into``, in place (the bytes land in the memory the module acts with), load and
verification timed; every ``VERIFY_EVERY``-th version is checksummed and verified, as PPO's
default ``loop.verify_weights_every``. ``rlcomm_ppo_async`` is PPO's path with
``loop.max_staleness >= 1``: the same sender; each receiver posts the receive into a spare buffer
(double buffering), completes it and swaps it into its module with ``load``. ``rlcomm`` sends a
plain state dict, packed by copy on every send; its receivers end with views.
The references:

- ``flat_limit``: one broadcast of a preallocated flat uint8 buffer holding the same bytes (no
  packing at all): the limit;
- ``per_tensor``: one broadcast per tensor (OpenRLHF's path);
- ``fresh_flatten``: per dtype, ``torch.cat`` into a fresh buffer, broadcast it, and split it
  into views on the receivers (the seed's path);
- ``reused_flatten`` (diagnostic): pack into one persistent buffer, one broadcast: rlcomm's
  design without its header and per-dtype broadcasts, so that the pack copy's cost shows.

Receivers end with views of the received bytes, or with them in their module (the PPO paths).
A sample starts at a barrier and ends when the last receiver has its copy (no barrier inside the
time); for the large model a sample is the mean of 10 back-to-back transfers. Methods alternate
within every repetition, ``flat_limit`` next to ``rlcomm_ppo``. The sender's pack copy is also
timed alone, without communication.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlcomm import CommContext, ParallelMode
from rlcomm.testing import run_ranks
from rlcomm.weights import WeightReceiver, WeightSender

from .core import Goal, Row, Settings, compare, interleave, timed
from .procs import backend_for, rank_device, sync_fn

NAME = "weight_transfer"
WT = ParallelMode.WEIGHT_TRANSFER
RLCOMM = ("rlcomm_ppo", "rlcomm_ppo_async", "rlcomm")  # PPO's default path carries the goals
LABELS = {"rlcomm_ppo": "rlcomm PPO path", "rlcomm_ppo_async": "rlcomm PPO async path",
          "rlcomm": "rlcomm state dict"}
VERIFY_EVERY = 10  # as app.loops.ppo.PPOLoop.verify_weights_every
LIMIT_GOAL = Goal("<=", 1 / 0.9, whole_iqr=True)  # rlcomm >= 0.9 x the limit's throughput
PER_TENSOR_GOAL = Goal("<=", 0.5)  # rlcomm >= 2 x per-tensor's throughput (large model)

# name -> (shape, dtype)
Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


def small_mlp() -> Shapes:
    """A PPO-sized MLP policy: 4 linear layers and a log-std, 9 tensors, ~100k parameters."""
    sizes = [(64, 256), (256, 256), (256, 64), (64, 8)]
    shapes: Shapes = {}
    for i, (fan_in, fan_out) in enumerate(sizes):
        shapes[f"net.{i}.weight"] = ((fan_out, fan_in), torch.float32)
        shapes[f"net.{i}.bias"] = ((fan_out,), torch.float32)
    shapes["log_std"] = ((8,), torch.float32)
    return shapes


def large_transformer(
    layers: int = 16, width: int = 352, vocab: int = 3200, context: int = 512
) -> Shapes:
    """A ~25M-parameter transformer: 196 tensors, odd blocks in bfloat16 (mixed dtypes)."""
    shapes: Shapes = {
        "embed.weight": ((vocab, width), torch.float32),
        "pos.weight": ((context, width), torch.float32),
    }
    for i in range(layers):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        block = {
            "attn.qkv.weight": (3 * width, width),
            "attn.qkv.bias": (3 * width,),
            "attn.out.weight": (width, width),
            "attn.out.bias": (width,),
            "ln1.weight": (width,),
            "ln1.bias": (width,),
            "ln2.weight": (width,),
            "ln2.bias": (width,),
            "mlp.fc1.weight": (4 * width, width),
            "mlp.fc1.bias": (4 * width,),
            "mlp.fc2.weight": (width, 4 * width),
            "mlp.fc2.bias": (width,),
        }
        shapes.update({f"blocks.{i}.{name}": (shape, dtype) for name, shape in block.items()})
    shapes["ln_f.weight"] = ((width,), torch.float32)
    shapes["ln_f.bias"] = ((width,), torch.float32)
    return shapes


MODELS: dict[str, Callable[[], Shapes]] = {"small": small_mlp, "large": large_transformer}


def state_dict_bytes(shapes: Shapes) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes.values())


def make_state_dict(shapes: Shapes, device: torch.device, fill: bool) -> dict[str, Tensor]:
    """Random weights on the sender (``fill``), uninitialised buffers of the same shapes elsewhere."""
    make = torch.randn if fill else torch.empty
    return {
        name: make(shape, dtype=dtype, device=device) for name, (shape, dtype) in shapes.items()
    }


def as_module(state_dict: dict[str, Tensor]) -> nn.Module:
    """A module whose ``state_dict()`` has the names of ``state_dict`` and shares its tensors
    (as frozen parameters), standing in for the trainer's model."""
    root = nn.Module()
    for name, tensor in state_dict.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = owner.get_submodule(part)
        owner.register_parameter(leaf, nn.Parameter(tensor, requires_grad=False))
    return root


def _by_dtype(state_dict: dict[str, Tensor]) -> dict[torch.dtype, list[Tensor]]:
    groups: dict[torch.dtype, list[Tensor]] = {}
    for tensor in state_dict.values():
        groups.setdefault(tensor.dtype, []).append(tensor)
    return groups


class ReusedFlat:
    """All tensors packed into one persistent uint8 buffer (every dtype, 64-byte aligned),
    sent as a single broadcast: rlcomm's design minus its header and per-dtype broadcasts, to
    show what the pack copy alone costs."""

    ALIGN = 64

    def __init__(self, state_dict: dict[str, Tensor], device: torch.device) -> None:
        offsets, end = [], 0
        for tensor in state_dict.values():
            offsets.append(end)
            end += -(-tensor.numel() * tensor.element_size() // self.ALIGN) * self.ALIGN
        self.wire = torch.empty(end, dtype=torch.uint8, device=device)
        self.groups: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}
        for offset, tensor in zip(offsets, state_dict.values()):
            raw = self.wire[offset : offset + tensor.numel() * tensor.element_size()]
            views, sources = self.groups.setdefault(tensor.dtype, ([], []))
            views.append(raw.view(tensor.dtype).view(tensor.shape))
            sources.append(tensor)

    @torch.no_grad()
    def pack(self) -> None:
        for views, sources in self.groups.values():
            torch._foreach_copy_(views, sources)


def _rlcomm_steps(
    ctx: CommContext, state_dict: dict[str, Tensor], device: torch.device, is_src: bool
) -> tuple[Callable[[], object], Callable[[], object], Callable[[], object]]:
    """This rank's side of rlcomm's plain, PPO and posted-PPO transfers."""
    if not is_src:
        return (
            WeightReceiver(ctx, WT, device=device).receive,
            _ppo_receive(ctx, state_dict, device, posted=False),
            _ppo_receive(ctx, state_dict, device, posted=True),
        )
    plain = partial(WeightSender(ctx, WT, device=device).send, state_dict)
    # PPO's sender, one per PPO path: a bound module of its own (fresh tensors, so the
    # state dict of the plain row stays unbound).
    senders = []
    for _ in range(2):
        module = as_module({name: t.clone() for name, t in state_dict.items()})
        sender = WeightSender(ctx, WT, device=device, verify_every=VERIFY_EVERY)
        sender.bind(module)
        senders.append(partial(sender.send, module))
    return plain, senders[0], senders[1]


def transfer_steps(
    ctx: CommContext, state_dict: dict[str, Tensor], device: torch.device
) -> dict[str, Callable[[], object]]:
    """One transfer of ``state_dict`` per method, as this rank's side of it."""
    group = ctx.get_group(WT)
    src = ctx.get_declared_ranks(WT)[0]
    is_src = ctx.get_global_rank() == src
    nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if is_src:
        # The weights' own bytes: an untouched buffer would be read from the kernel's shared
        # zero page (one cached 4 KiB page), which sends 20% faster than any real weights.
        torch.cat([t.reshape(-1).view(torch.uint8) for t in state_dict.values()], out=flat)
    by_dtype = _by_dtype(state_dict)
    reused = ReusedFlat(state_dict, device)

    def per_tensor() -> None:
        for tensor in state_dict.values():
            dist.broadcast(tensor, src=src, group=group)

    def fresh_flatten() -> None:
        views: list[Tensor] = []
        for dtype, tensors in by_dtype.items():
            if is_src:
                buffer = torch.cat([t.reshape(-1) for t in tensors])
            else:
                buffer = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
            dist.broadcast(buffer, src=src, group=group)
            if not is_src:  # unflatten into views, as the seed's receiver did
                parts = buffer.split([t.numel() for t in tensors])
                views.extend(part.view(t.shape) for part, t in zip(parts, tensors))

    def reused_flatten() -> None:
        if is_src:
            reused.pack()
        dist.broadcast(reused.wire, src=src, group=group)

    rlcomm, rlcomm_ppo, rlcomm_ppo_async = _rlcomm_steps(ctx, state_dict, device, is_src)
    # In timing order: the goal's pair side by side, so that drift between them is least.
    return {
        "flat_limit": partial(dist.broadcast, flat, src=src, group=group),
        "rlcomm_ppo": rlcomm_ppo,
        "rlcomm_ppo_async": rlcomm_ppo_async,
        "rlcomm": rlcomm,
        "per_tensor": per_tensor,
        "fresh_flatten": fresh_flatten,
        "reused_flatten": reused_flatten,
    }


def _ppo_receive(
    ctx: CommContext, state_dict: dict[str, Tensor], device: torch.device, posted: bool
) -> Callable[[], object]:
    """One PPO rollout rank's receive into its bound policy: in place (lockstep), or
    ``posted`` into a spare buffer and swapped in (``max_staleness >= 1``)."""
    module = as_module({name: torch.empty_like(t) for name, t in state_dict.items()})
    receiver = WeightReceiver(ctx, WT, expected=module.state_dict(), device=device)
    receiver.bind(module)

    def receive() -> None:
        if not posted or receiver.version == 0:  # the first transfer agrees on the layout
            receiver.receive_into(module)
            return
        receiver.post()
        receiver.receive()
        receiver.load(module)

    return receive


def pack_seconds(state_dict: dict[str, Tensor], device: torch.device, reps: int) -> float:
    """Median seconds of the sender's pack copy alone (no communication)."""
    packer = ReusedFlat(state_dict, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    samples = interleave({"pack": partial(timed, packer.pack, 1, sync)}, reps, warmup=1)
    return statistics.median(samples["pack"])


def _rank_main(
    rank: int, world_size: int, plan: list[tuple[str, int, int]], warmup: int
) -> dict[str, tuple[dict[str, list[float]], float]]:
    """Per model of ``plan`` (model, inner calls per sample, repetitions): every method's
    samples, and the median of the pack copy alone (on the sender; 0 elsewhere)."""
    backend = backend_for(world_size)
    ctx = CommContext()
    ctx.init_distributed_env(backend=backend, timeout=300)
    try:
        ctx.init_group([list(range(world_size))], WT, backend=backend)
        device = rank_device(rank, backend)
        sync = sync_fn(ctx.get_group(WT), backend)
        results = {}
        for model, inner, reps in plan:
            state_dict = make_state_dict(MODELS[model](), device, fill=rank == 0)
            steps = transfer_steps(ctx, state_dict, device)
            timers = {
                name: partial(timed, step, inner, sync, trailing_sync=False)
                for name, step in steps.items()
            }
            samples = interleave(timers, reps, warmup)
            pack = pack_seconds(state_dict, device, reps) if rank == 0 else 0.0
            results[model] = samples, pack
            del state_dict, steps, timers
        return results
    finally:
        ctx.destroy()


def run(settings: Settings) -> list[Row]:
    plan = [
        ("small", settings.reps(50, 20), settings.reps(21, 5)),
        # A sample is the mean of VERIFY_EVERY back-to-back transfers (as PPO sends them,
        # version after version), so each holds exactly one verified version: one transfer's
        # time varies by +-20% with the scheduling of 4 processes on 2 cores, and samples with
        # and without a verified version would make the goal's interquartile range measure
        # that mix, not the path.
        ("large", VERIFY_EVERY, settings.reps(11, 3)),
    ]
    rows = []
    for receivers in (1, 3):
        world = receivers + 1
        results = run_ranks(_rank_main, world, plan, settings.reps(2, 1))
        for model, _, _ in plan:
            # Timed on the last receiver: until its copy of the weights has arrived.
            samples, pack = results[world - 1][model][0], results[0][model][1]
            rows += _rows(model, receivers, samples, pack, backend_for(world))
    return rows


def _rows(
    model: str, receivers: int, samples: dict[str, list[float]], pack: float, backend: str
) -> list[Row]:
    shapes = MODELS[model]()
    nbytes = state_dict_bytes(shapes)
    params = sum(math.prod(shape) for shape, _ in shapes.values())
    size = f"{params / 1e6:.1f}M" if params >= 1e6 else f"{params / 1e3:.0f}k"
    what = f"{size} params, {len(shapes)} tensors, {nbytes / 2**20:.1f} MiB, {backend}"
    limit = statistics.median(samples["flat_limit"])
    goals: dict[str, tuple[Goal | None, str]] = {
        "flat_limit": (
            # The goal is on the large model's bandwidth-bound transfer; the small model's
            # ~300 us transfer is latency-bound, where ~80 us of Python per send+receive+load shows.
            LIMIT_GOAL if model == "large" else None,
            f"{what}; the sender's pack copy alone takes {pack * 1e3:.2f} ms "
            f"({pack / limit:.0%} of the limit)",
        ),
        "per_tensor": (PER_TENSOR_GOAL if model == "large" else None, what),
        "fresh_flatten": (None, what),
        "reused_flatten": (None, f"{what}; reference = pack into one reused buffer + 1 broadcast"),
    }
    rows = []
    for method in RLCOMM:
        label = LABELS[method]
        for reference, (goal, note) in goals.items():
            row = compare(
                NAME,
                f"{model} -> {receivers} recv, {label} vs {reference}",
                samples,
                method,
                reference,
                goal if method == "rlcomm_ppo" else None,
            )
            assert row.rlcomm is not None and row.reference is not None
            row.note = note
            row.extra.update(
                method=method,
                bytes=nbytes,
                pack_seconds=pack,
                rlcomm_GBps=nbytes / row.rlcomm.median / 1e9,
                reference_GBps=nbytes / row.reference.median / 1e9,
            )
            rows.append(row)
    return rows
