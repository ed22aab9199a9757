"""The device-lean offload's gradient transport (docs/offload.md, "The device-lean offload").

With a 16-bit model on the device, each gradient leaves the device as soon as it is final: the
post-accumulate-grad hook copies it into a host landing buffer of its own dtype (pinned, on a side
stream, on CUDA) and frees the device gradient. The device then holds the 16-bit weights and at
most ``copies_in_flight`` gradients whose copies are still running (``MAX_GRADS_IN_FLIGHT`` by
default; ``strategy.offload_optimizer.copies_in_flight``). A copy that finds the window full waits
for the oldest one in the hook, which blocks backward's thread: ``CopyWindow`` counts those waits
and the seconds they took.

Gradient accumulation (more than one micro-batch per step) happens in fp32 in host memory by
default (``accumulate="host"``): after each micro-batch's copy, its gradient is added into an fp32
host sum, so the device never holds more than the gradients in flight, and the sum rounds once per
micro-batch in fp32 instead of in the model's 16-bit dtype. ``accumulate="device"`` keeps
autograd's accumulation in the device gradient (one 16-bit gradient per parameter held on the
device until the last micro-batch) and copies only the final one.

The landing buffers are the strategy's (it may make a buffer serve twice: with the compact state
each anchored parameter's buffer also receives the new bf16 weight the step writes in the
gradient's place, offload.py). ``StagingRing`` bounds the other direction's host copies: the new
weights of the fp32 state on their way to a GPU, a few tensors' worth, not the model's.

On a CPU device the same code runs, the copies being host copies (so the tests run it).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

import torch

__all__ = ["ACCUMULATE_ON", "MAX_GRADS_IN_FLIGHT", "Arrival", "CopyWindow", "GradientTransport", "StagingRing"]

# The default of how many device gradients' copies to the host may still be running: one more
# copy waits for the oldest, so a slow copy stream cannot keep a growing number of freed gradients
# alive on the device (record_stream holds each one until its copy has run).
MAX_GRADS_IN_FLIGHT = 2
ACCUMULATE_ON = ("host", "device")


class Arrival:
    """One parameter's gradient in host memory for this step: `grad` is what the step reads (the
    landing buffer, or the fp32 host sum when micro-batches were accumulated), `ready` the event of
    its copy (None on a CPU device), `add_from` a landing buffer still to be added into `grad`
    once the copy is done (the last micro-batch of a host accumulation)."""

    __slots__ = ("master", "dev", "grad", "ready", "add_from", "_resolved")

    def __init__(self, master: torch.Tensor, dev: torch.Tensor, grad: torch.Tensor, ready=None,
                 add_from: torch.Tensor | None = None):
        self.master, self.dev, self.grad, self.ready, self.add_from = master, dev, grad, ready, add_from
        self._resolved = False

    def resolve(self) -> torch.Tensor:
        """Waits for the copy and finishes the host sum; returns the gradient the step reads.
        Idempotent (the worker and the training thread may both reach it, never at once)."""
        if not self._resolved:
            if self.ready is not None:
                self.ready.synchronize()
            if self.add_from is not None:
                self.grad.add_(self.add_from)
            self._resolved = True
        return self.grad


class CopyWindow:
    """At most `size` copies in flight, each known by an event with `synchronize()` (a CUDA event).
    `make_room` waits for the oldest ones until another may start, counting the waits and their
    seconds: the time the hook held backward's thread."""

    def __init__(self, size: int = MAX_GRADS_IN_FLIGHT):
        if size < 1:
            raise ValueError(f"copies in flight must be >= 1, got {size}")
        self.size = size
        self._events: deque = deque()
        self.waits = 0           # copies that found the window full
        self.wait_seconds = 0.0  # time spent waiting for room

    def make_room(self) -> None:
        if len(self._events) < self.size:
            return
        t0 = time.perf_counter()
        while len(self._events) >= self.size:
            self._events.popleft().synchronize()
        self.waits += 1
        self.wait_seconds += time.perf_counter() - t0

    def add(self, event) -> None:
        self._events.append(event)

    def clear(self) -> None:
        self._events.clear()


class StagingRing:
    """`size` host buffers of `numel` elements each (pinned when `pin`), through which new weights
    go to the device: `stage` rounds a weight into the next buffer, once that buffer's previous copy
    has run (its event synchronized), and hands it to `send`, which starts the copy and returns its
    event. So staging holds `size` tensors' worth (the largest parameter's), whatever the model's
    size. Thread-safe: the overlapped offload's worker and the training thread both stage."""

    def __init__(self, size: int, numel: int, dtype: torch.dtype, pin: bool):
        if size < 1:
            raise ValueError(f"a staging ring needs at least one buffer, got {size}")
        self.buffers = [torch.empty(numel, dtype=dtype, pin_memory=pin) for _ in range(size)]
        self._events: list = [None] * size
        self._next = 0
        self._lock = threading.Lock()

    def stage(self, weight: torch.Tensor, send: Callable[[torch.Tensor], object]) -> None:
        with self._lock:
            i, self._next = self._next, (self._next + 1) % len(self.buffers)
            if self._events[i] is not None:
                self._events[i].synchronize()  # its last copy has read it
            staged = self.buffers[i][:weight.numel()].view(weight.shape)
            staged.copy_(weight)  # rounded to the buffer's dtype (to nearest even, as DeepSpeed's copy)
            self._events[i] = send(staged)

    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


class GradientTransport:
    """Moves each gradient of `pairs` ((device parameter, host master)) to host memory as it
    becomes final, and frees it on the device. `landing`: the host buffer of each master (by id),
    in the device parameter's dtype; made here when not given."""

    def __init__(self, pairs: list[tuple[torch.nn.Parameter, torch.Tensor]], device: torch.device,
                 accumulate: str = "host", copies_in_flight: int = MAX_GRADS_IN_FLIGHT,
                 landing: dict[int, torch.Tensor] | None = None):
        if accumulate not in ACCUMULATE_ON:
            raise ValueError(f"accumulate must be one of {', '.join(ACCUMULATE_ON)}, got {accumulate!r}")
        self.device = device
        self.accumulate_on_host = accumulate == "host"
        cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if cuda else None
        # One landing buffer per parameter in the device dtype (2 B/param for bf16), pinned on CUDA
        # so the copy is asynchronous DMA. They stay valid until the step has read them (the
        # overlapped step's rollback reads the same gradient again).
        self.landing = landing if landing is not None else {
            id(m): torch.empty(dev.shape, dtype=dev.dtype, pin_memory=cuda) for dev, m in pairs}
        self._sums: dict[int, torch.Tensor] = {}  # fp32 host sums, made at the first accumulation
        self._summed: set[int] = set()            # masters whose sum holds this step's earlier micro-batches
        self._pending: list[Arrival] = []         # earlier micro-batches' copies, added at the next backward
        self.window = CopyWindow(copies_in_flight)
        self.arrived: dict[int, Arrival] = {}     # this step's final gradients, by master id
        self._pairs = pairs

    # ---- the hook's side ---------------------------------------------------------------------
    def take(self, dev: torch.nn.Parameter, master: torch.Tensor, last_micro_batch: bool) -> Arrival | None:
        """Copies `dev`'s gradient to host memory and frees it on the device. Returns the arrival
        when the gradient is final for this step (the last micro-batch), else None."""
        if not last_micro_batch and not self.accumulate_on_host:
            return None  # autograd keeps accumulating into the device gradient
        key = id(master)
        landing = self.landing[key]
        ready = self._copy(dev.grad, landing)
        dev.grad = None
        if not last_micro_batch:
            self._pending.append(Arrival(master, dev, landing, ready))
            return None
        if key in self._summed:
            arrival = Arrival(master, dev, self._sums[key], ready, add_from=landing)
        else:
            arrival = Arrival(master, dev, landing, ready)
        self.arrived[key] = arrival
        return arrival

    def _copy(self, grad: torch.Tensor, landing: torch.Tensor):
        if self._stream is None:
            landing.copy_(grad)
            return None
        self.window.make_room()  # blocks backward's thread while the window is full
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # the gradient's kernel, and every kernel before it, first
        with torch.cuda.stream(self._stream):
            landing.copy_(grad, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        # The caching allocator may hand the freed gradient's block to the compute stream only
        # once this copy has read it.
        grad.record_stream(self._stream)
        self.window.add(ready)
        return ready

    # ---- the training thread's side ------------------------------------------------------------
    def add_pending(self) -> None:
        """Adds the earlier micro-batches' copies into the fp32 host sums. Called before the next
        backward, which overwrites the landing buffers (on a GPU this host work overlaps the
        forward that was just queued)."""
        for arrival in self._pending:
            key = id(arrival.master)
            if arrival.ready is not None:
                arrival.ready.synchronize()
            total = self._sums.get(key)
            if total is None:
                total = self._sums[key] = torch.empty(arrival.master.shape, dtype=torch.float32)
            if key in self._summed:
                total.add_(arrival.grad)
            else:
                total.copy_(arrival.grad)  # exact: a 16-bit value is an fp32 value
                self._summed.add(key)
        self._pending = []

    def arrivals(self) -> list[Arrival]:
        """This step's gradients in the order of `pairs`, every copy finished and every sum complete
        (a parameter whose gradient came only in earlier micro-batches reads its sum)."""
        self.add_pending()
        for dev, m in self._pairs:
            key = id(m)
            if key not in self.arrived and key in self._summed:
                self.arrived[key] = Arrival(m, dev, self._sums[key])
        out = [self.arrived[id(m)] for _, m in self._pairs if id(m) in self.arrived]
        for arrival in out:
            arrival.resolve()
        return out

    def end_step(self) -> None:
        """Forgets this step's gradients (the buffers stay for the next one)."""
        self.arrived = {}
        self._summed = set()
        self._pending = []
        self.window.clear()

    def host_bytes(self) -> int:
        """Host memory the transport holds: landing buffers and fp32 sums."""
        return sum(t.numel() * t.element_size() for t in (*self.landing.values(), *self._sums.values()))
