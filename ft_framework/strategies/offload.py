"""One device with the optimizer offloaded to the CPU (``strategy.offload_optimizer``), its step
either after backward (serial, the reference) or overlapped with backward.

The optimizer holds fp32 master weights and its state (moments, anchors) in host memory and steps
them with the C++ kernel. On a GPU the model's parameters are device copies of the masters; on a
CPU they are the masters themselves.

Overlapped (``overlap: true``), see docs/offload.md:

1. During the last micro-batch's backward, a post-accumulate-grad hook collects each parameter as
   soon as its gradient is final (on CUDA after a copy to pinned host memory on a side stream),
   and hands a bucket of them to a worker thread once they hold ``bucket_mb`` of gradients (the
   rest when backward ends): one hand-off per bucket, not per tensor, so that many small
   tensors do not each pay a queue round trip and a GIL switch.
2. The worker steps the bucket at once with the *unclipped* gradients (the kernel runs without
   the GIL, so backward goes on), speculating that clipping will not fire; on CUDA it copies the
   new weights back on another side stream. A gradient whose norm is not finite (a NaN or an
   infinity in it) leaves its tensor untouched: such a step could not be undone.
3. After backward the global gradient norm decides: keep every step (the usual case); or clipping
   fires, and every speculative step is rolled back with the kernel's inverse step and taken again
   with the clipped gradient; or a gradient is not finite, and every step is rolled back and the
   step is skipped. Each rollback is counted (``offload_rollbacks`` in metrics.jsonl).
4. After a step that clipped (or was skipped) the next one does not speculate: its worker only
   copies gradients and takes their norms during backward, and the step follows the decision
   (clipping tends to fire in runs; three passes over the state would cost more than one). The
   step after a step that did not clip speculates again.

The serial path computes the same norm over the same host gradients, clips, then steps: the two
end within 1e-6 (relative) of each other (tests/unit/strategies/test_offload.py).

Device-lean (``training.precision: bf16``, serial and overlapped): the device holds the model in
bf16 only (no fp32 device weights, no autocast, so no weight-cast cache); every gradient leaves
the device as it becomes final (offload_transport.py: the hook copies it into a host landing
buffer and frees it; micro-batches accumulate in fp32 on the host by default), the step reads the
bf16 gradients there, and writes the new weights back rounded to bf16. With the compact state
(optimizer.state_dtype bfloat16) it runs in the bf16 weight form: an anchored parameter keeps no
fp32 weight, the step reads its gradient in the landing buffer (or the fp32 sum) and writes the new
bf16 weight theta* + delta in its place, and that buffer goes to the device: 12 host bytes per
parameter with theta* (16 with the fp32 sums of accumulation); the overlapped path then does not
speculate (an undo of the compact state would cost 8 B/param more, and the gradient it needs is
overwritten). With fp32 precision the model's parameters are fp32 (on a CPU, the masters
themselves). A parameter's weights are written by the worker only after autograd has accumulated
its gradient, when backward no longer reads them (a weight read in backward under
``torch.no_grad``/``detach`` would break that).
"""

from __future__ import annotations

import logging

import contextlib
import functools
import queue
import threading
from typing import Any, Mapping

import torch
from torch import nn

from ft_framework.checkpointing.fragments import MASTER, formed_fragment, whole_tensor_fragments
from ft_framework.errors import UserError
from ft_framework.optim.base import AnchoredOptimizer
from ft_framework.optim.compact import round_nearest_bf16
from ft_framework.strategies.base import anchors_for, mixout_reads_anchors
from ft_framework.strategies.checkpointable import StrategyCheckpoint
from ft_framework.strategies.offload_transport import (ACCUMULATE_ON, MAX_GRADS_IN_FLIGHT, Arrival, GradientTransport,
                                                        StagingRing)
from ft_framework.strategies.single import SingleDeviceStrategy

__all__ = ["OffloadedSingleDeviceStrategy"]

logger = logging.getLogger(__name__)


# Overlapped offload: gradients handed to the CPU worker at a time. Large enough that a bucket's
# Python overhead is small against its step, small enough that the first step starts early in
# backward (benchmarks/offload_overlap.py measures both shapes).
DEFAULT_BUCKET_MB = 4.0


class _Speculation:
    """One parameter's gradient as the worker saw it: master, host gradient, the gradient's norm,
    the coefficients of the speculative step (None: not stepped) and whether the kernel refused
    the step (the gradient is not finite)."""

    __slots__ = ("master", "grad", "norm", "coefficients", "refused")

    def __init__(self, master: torch.Tensor, grad: torch.Tensor, norm: torch.Tensor, coefficients=None,
                 refused: bool = False):
        self.master, self.grad, self.norm = master, grad, norm
        self.coefficients, self.refused = coefficients, refused


def _bucket_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's 2-norm, in one call (on CPU the same bits as torch.linalg.vector_norm per
    tensor, which torch.nn.utils.get_total_norm takes on a CPU). 16-bit gradients' norms are taken
    and kept in fp32 (a bf16 norm would be off by up to 0.4%, and clipping decides on it)."""
    if not grads:
        return []
    if all(g.dtype == torch.float32 for g in grads):
        return list(torch._foreach_norm(grads))
    return list(torch._foreach_norm(grads, 2, dtype=torch.float32))


def _total_norm(norms: list[torch.Tensor]) -> torch.Tensor:
    """The global 2-norm from per-tensor norms, as torch.nn.utils.get_total_norm combines them for
    one device (bit for bit: tests/unit/strategies/test_offload.py compares with SingleDeviceStrategy)."""
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(torch.stack(norms))]))


class OffloadedSingleDeviceStrategy(SingleDeviceStrategy):
    """SingleDeviceStrategy whose optimizer steps fp32 masters in host memory, after backward
    (``overlap=False``) or during it (``overlap=True``).

    `worker_threads`: OpenMP threads of each kernel call (None: torch.get_num_threads()).
    `bucket_mb`: overlapped only, the gradient megabytes (MiB) handed to the worker at a time.
    `accumulate`: bf16 only, where micro-batches' gradients are summed: "host" (fp32, in host
    memory) or "device" (autograd's bf16 sum in the device gradient).
    `copies_in_flight`: bf16 only, gradients whose copies to the host may run at once (None:
    offload_transport.MAX_GRADS_IN_FLIGHT); one more waits in the hook, blocking backward.
    """

    def __init__(self, precision: str = "fp32", device: str = "auto", overlap: bool = False,
                 worker_threads: int | None = None, bucket_mb: float = DEFAULT_BUCKET_MB,
                 accumulate: str = "host", copies_in_flight: int | None = None):
        super().__init__(precision, device)
        if accumulate not in ACCUMULATE_ON:
            raise UserError(f"strategy.offload_optimizer.accumulate must be one of {', '.join(ACCUMULATE_ON)}, "
                            f"got {accumulate!r}")
        self.accumulate = accumulate
        if copies_in_flight is not None and not (isinstance(copies_in_flight, int) and copies_in_flight >= 1):
            raise UserError(f"strategy.offload_optimizer.copies_in_flight must be an integer >= 1, got {copies_in_flight!r}")
        self.copies_in_flight = MAX_GRADS_IN_FLIGHT if copies_in_flight is None else copies_in_flight
        # The device-lean offload: a 16-bit model on the device, gradients moved off as they arrive.
        self.lean = precision == "bf16"
        self.device_dtype = torch.bfloat16 if self.lean else torch.float32
        self._transport: GradientTransport | None = None
        self._last_micro_batch = True
        # The new bf16 weights of the fp32 state on their way to a GPU: copies_in_flight pinned
        # buffers of the largest parameter (the bf16 weight form needs none: its landing buffers go).
        self._staging: StagingRing | None = None
        # The bf16 weight form (lean and compact, set at set-up): each step writes the new weights
        # into the landing buffers, and the overlapped path does not speculate.
        self.bf16_weights = False
        if self.scaler is not None:
            raise UserError("strategy.offload_optimizer does not take training.precision fp16 (its loss "
                            "scaler skips steps the offloaded step cannot see); use bf16 or fp32")
        self.overlap = bool(overlap)
        self.worker_threads = worker_threads
        if not bucket_mb > 0:
            raise UserError(f"strategy.offload_optimizer.bucket_mb must be > 0, got {bucket_mb}")
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self._bucket: list[tuple] = []  # parameters whose gradients are final, not yet handed over
        self._bucket_fill = 0
        self.rollbacks = 0        # speculative steps rolled back (clipping fired, or not finite)
        self.skipped_steps = 0    # steps skipped because a gradient was not finite
        self.speculated_steps = 0  # steps whose worker stepped during backward (kept or rolled back)
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []   # (model parameter, master)
        self._master_of: dict[int, nn.Parameter] = {}
        self._host_grad: dict[int, torch.Tensor] = {}
        self._names: dict[int, str] = {}
        self._armed = False
        # Whether this step speculates: not after a step that clipped or was not finite (then
        # the worker only copies the gradients and takes their norms during backward).
        self._speculate = True
        self._speculated: list[_Speculation] = []
        self._worker_error: BaseException | None = None
        self._queue: queue.Queue | None = None
        self._worker: threading.Thread | None = None
        self._hooks: list = []
        self._model_params: list[nn.Parameter] = []
        cuda = self.device.type == "cuda"
        self._d2h = torch.cuda.Stream(self.device) if cuda else None
        self._h2d = torch.cuda.Stream(self.device) if cuda else None

    # ---- set-up ----------------------------------------------------------------------------------
    def setup(self, model: nn.Module, build_optimizer, anchors=None):
        # Built while the model is still in host memory: its fp32 parameters become the masters.
        optimizer = build_optimizer(model)
        if not isinstance(optimizer, AnchoredOptimizer):
            raise UserError(f"strategy.offload_optimizer needs an ft_framework optimizer (optimizer.name), "
                            f"got {type(optimizer).__name__}")
        # In the model's order: the global norm sums the per-tensor norms in this order, as
        # clip_grad_norm_ over model.parameters() does (the param groups list them otherwise).
        model_order = {id(p): i for i, p in enumerate(model.parameters())}
        masters = sorted((p for g in optimizer.param_groups for p in g["params"]),
                         key=lambda p: model_order.get(id(p), len(model_order)))
        master_ids = {id(m) for m in masters}
        bad = [n for n, p in model.named_parameters()
               if id(p) in master_ids and (p.device.type != "cpu" or p.dtype != torch.float32)]
        if bad:
            raise UserError(f"strategy.offload_optimizer keeps fp32 masters in host memory; parameter "
                            f"{bad[0]!r} is not an fp32 CPU tensor (load the model in fp32)")
        self._names = {id(p): n for n, p in model.named_parameters()}
        cuda = self.device.type == "cuda"
        self.optimizer = optimizer
        self.bf16_weights = self.lean and optimizer.compact and optimizer.delta_masters
        self._speculate = not self.bf16_weights
        if self.overlap and self.bf16_weights:  # the run says what it does instead of what was asked
            logger.warning("strategy.offload_optimizer.overlap: with the compact state in bf16 weights the step "
                           "runs after backward, not during it (speculating would keep 8 more host bytes per "
                           "parameter to undo a step); gradients still stream to the host during backward")
        # The bf16 weight form places theta* itself, parameter by parameter (below).
        wanted = anchors_for(optimizer, anchors, self._names.values()) if anchors and self.bf16_weights else set()
        landing: dict[int, torch.Tensor] = {}
        if self.device.type == "cpu" and not self.lean:
            self._pairs = [(m, m) for m in masters]
        else:
            # The model gets device copies of the masters, in the device dtype (bf16 when lean; on a
            # CPU too, so that the CPU runs the GPU's code path with host copies).
            copies = {}
            for m in masters:  # one at a time: the bf16 form frees each fp32 weight and theta* as it goes
                if self.lean:
                    # The landing buffer, holding the master rounded to bf16 (to nearest even) until
                    # the first gradient lands: the device copy is made from it.
                    buffer = torch.empty(m.shape, dtype=self.device_dtype, pin_memory=cuda)
                    buffer.copy_(m.detach())
                    landing[id(m)] = buffer
                    copies[id(m)] = nn.Parameter(buffer.to(self.device) if cuda else buffer.clone(),
                                                 requires_grad=m.requires_grad)
                    name = self._names[id(m)]
                    if name in wanted:
                        # theta* taken out of `anchors` once placed (in bf16): set-up never holds the
                        # fp32 theta*, the fp32 weight and the new state of the whole model at once.
                        optimizer.set_anchor(m, anchors.pop(name), copy=False)
                        optimizer.init_state(m)  # delta = theta - theta*, from the fp32 weight
                        optimizer.keep_bf16_weight(m, buffer)  # the fp32 weight is freed
                    continue
                if cuda:
                    m.data = m.data.pin_memory()
                copies[id(m)] = nn.Parameter(m.detach().to(self.device, self.device_dtype),
                                             requires_grad=m.requires_grad)
            for module in model.modules():
                for key, p in list(module.named_parameters(recurse=False)):
                    if id(p) in master_ids:
                        setattr(module, key, copies[id(p)])
            self._pairs = [(copies[id(m)], m) for m in masters]
            if cuda and not self.lean:
                self._host_grad = {id(m): torch.empty_like(m, pin_memory=True) for m in masters}
            if cuda and self.lean and not self.bf16_weights and masters:
                self._staging = StagingRing(self.copies_in_flight, max(m.numel() for m in masters),
                                            self.device_dtype, pin=True)
        self._master_of = {id(dev): m for dev, m in self._pairs}
        # Lean: frozen parameters and floating buffers go to bf16 as well (no fp32 left on the device).
        self.model = model.to(self.device, self.device_dtype) if self.lean else model.to(self.device)
        self._model_params = list(self.model.parameters())
        if wanted:
            mixout_reads_anchors(self.model, optimizer)
        elif anchors:
            self.place_anchors(anchors)
        if self.lean:
            self._transport = GradientTransport(self._pairs, self.device, self.accumulate, self.copies_in_flight,
                                                landing=landing)
        if self.overlap:
            self._start_worker()
        if self.overlap or self.lean:
            self._hooks = [dev.register_post_accumulate_grad_hook(self._on_grad_ready)
                           for dev, _ in self._pairs if dev.requires_grad]
        return self.model, self.optimizer

    def autocast(self):
        # Lean: the model is bf16 itself; autocast would only add its fp32->bf16 weight casts.
        return contextlib.nullcontext() if self.lean else super().autocast()

    def device_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        """(role, name, tensor) of every tensor this strategy keeps on the model's device: the
        model's parameters and buffers, and gradients still held there. The masters, their state,
        θ*, landing buffers and sums are host memory and are not listed (on a CPU device too)."""
        model = self.unwrapped_model()
        out = [("weight", n, p.detach()) for n, p in model.named_parameters()]
        out += [("buffer", n, b) for n, b in model.named_buffers()]
        out += [("gradient", n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        return out

    @property
    def worker_thread(self) -> threading.Thread | None:
        """The thread that steps during backward (None unless overlapped), e.g. to pin it to a core."""
        return self._worker

    def host_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        """(role, name, tensor) of every tensor this strategy keeps in host memory for the step: the
        masters (an fp32 weight; in the bf16 weight form an anchored master's data is its landing
        buffer), their optimizer state (moments, delta, theta*, step counts, undo copies of
        speculative compact steps), the landing buffers, the fp32 sums of accumulation, the staging
        of new weights and the fp32 host gradients of the fp32 offload on a GPU. Some share memory
        (a bf16-weight master is its landing buffer): count each storage once. On a CPU device
        without bf16 the masters are the model's parameters."""
        out = []
        for name, m in self._named_masters():
            out.append(("master", name, m.detach()))
            for key, value in self.optimizer.state.get(m, {}).items():
                if isinstance(value, torch.Tensor):
                    out.append((key, name, value))
            undo = self.optimizer._undo.get(id(m))
            if undo is not None and undo[0] is m:
                out += [("undo", name, t) for t in undo[2:]]
            if id(m) in self._host_grad:
                out.append(("host gradient", name, self._host_grad[id(m)]))
        if self._transport is not None:
            names = {id(m): n for n, m in self._named_masters()}
            out += [("landing", names[key], t) for key, t in self._transport.landing.items()]
            out += [("fp32 sum", names[key], t) for key, t in self._transport._sums.items()]
        if self._staging is not None:
            out += [("staging", f"slot {i}", t) for i, t in enumerate(self._staging.buffers)]
        return out

    def _named_masters(self):
        return [(self._names[id(m)], m) for _, m in self._pairs]

    def place_anchors(self, anchors: Mapping[str, torch.Tensor]) -> None:
        """theta* into the fp32 host masters of the anchored groups."""
        wanted = anchors_for(self.optimizer, anchors, (n for n, _ in self.unwrapped_model().named_parameters()))
        for name, m in self._named_masters():
            if name in wanted:
                self.optimizer.set_anchor(m, anchors[name], copy=False)
        # On a CPU the masters are the model's parameters, so Mixout can read their anchors; on a
        # GPU the model holds device copies (no anchor of their own) and Mixout keeps its copy.
        mixout_reads_anchors(self.model, self.optimizer)

    # ---- the overlapped step -------------------------------------------------------------------
    def _start_worker(self) -> None:
        self._queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="ft-offload-step", daemon=True)
        self._worker.start()

    def _on_grad_ready(self, dev: torch.Tensor) -> None:
        """Post-accumulate-grad hook: lean, moves the gradient to host memory (every micro-batch);
        overlapped, adds the parameter to the bucket, and hands the bucket to the worker once it is
        full (last micro-batch only)."""
        master = self._master_of[id(dev)]
        if self.lean:
            arrival = self._transport.take(dev, master, self._last_micro_batch)
            if arrival is None or not self._armed:
                return
            self._bucket.append(arrival)
        elif not self._armed:
            return
        elif self._d2h is None:
            self._bucket.append(Arrival(master, dev, dev.grad))
        else:
            host = self._host_grad[id(master)]
            compute = torch.cuda.current_stream(self.device)
            self._d2h.wait_stream(compute)  # the gradient, and every kernel that read the weights, first
            with torch.cuda.stream(self._d2h):
                host.copy_(dev.grad, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self._d2h)
            dev.grad.record_stream(self._d2h)
            self._bucket.append(Arrival(master, dev, host, ready))
        self._bucket_fill += master.numel() * master.element_size()
        if self._bucket_fill >= self.bucket_bytes:
            self._hand_over()

    def _hand_over(self) -> None:
        if self._bucket:
            self._queue.put(self._bucket)
        self._bucket, self._bucket_fill = [], 0

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._process(item)
            except BaseException as exc:  # re-raised by clip_and_step on the training thread
                self._worker_error = exc
            finally:
                self._queue.task_done()

    def _help_drain(self) -> None:
        """After backward the training thread, idle until the step is decided, steps queued
        parameters too (the worker is usually a few layers behind)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                self._process(item)
            finally:
                self._queue.task_done()

    def _process(self, arrivals: list[Arrival]) -> None:
        """Steps a bucket's tensors whose gradients are finite, with one optimizer call."""
        bucket = [(a.master, a.resolve(), a.ready, a.dev) for a in arrivals]
        # Here, not after backward: the norms overlap too. One call and one finiteness check per
        # bucket, not per tensor (each torch call also hands the GIL to the training thread and back).
        norms = _bucket_norms([grad for _, grad, _, _ in bucket])
        # A Fisher pass (optim/fisher.py) reads the gradients in the step after backward, once: a
        # speculative step would hand them to it a second time.
        if not self._speculate or self.optimizer.gradient_sink is not None:
            self._speculated += [_Speculation(master, grad, norm) for (master, grad, _, _), norm in zip(bucket, norms)]
            return
        finite = []
        all_finite = bool(torch.isfinite(torch.stack(norms)).all())
        for (master, grad, _, dev), norm in zip(bucket, norms):
            if all_finite or torch.isfinite(norm):
                finite.append((master, grad, norm, dev))
            else:  # a NaN or an infinity: never stepped, so never undone
                self._speculated.append(_Speculation(master, grad, norm, refused=True))
        if not finite:
            return
        used = self._step_tensors([m for m, _, _, _ in finite], [g for _, g, _, _ in finite], keep_undo=True)
        for (master, grad, norm, dev), c in zip(finite, used):
            self._speculated.append(_Speculation(master, grad, norm, c))
            if c is not None:
                self._copy_to_device(dev, master)

    def _copy_to_device(self, dev: torch.Tensor, master: torch.Tensor) -> None:
        if dev is master:
            return  # fp32 on a CPU: the master is the model's parameter
        if self.bf16_weights:
            # The step wrote the new bf16 weight into the landing buffer (pinned on CUDA): it goes as is.
            master = self._transport.landing[id(master)]
        if self._h2d is None:
            with torch.no_grad():
                dev.copy_(master)  # rounded to the device dtype (to nearest even, as DeepSpeed's copy)
            return
        if self._staging is not None:
            # Rounded to bf16 on the host: the copy moves 2 B/param and no fp32 lands on the device.
            self._staging.stage(master, lambda staged: self._send(dev, staged))
            return
        with torch.no_grad(), torch.cuda.stream(self._h2d):
            dev.copy_(master, non_blocking=True)

    def _send(self, dev: torch.Tensor, staged: torch.Tensor):
        """Copies `staged` to `dev` on the host-to-device stream; returns the copy's event."""
        with torch.no_grad(), torch.cuda.stream(self._h2d):
            dev.copy_(staged, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._h2d)
        return done

    def backward(self, loss: torch.Tensor, last_micro_batch: bool = True) -> None:
        self._armed = self.overlap and last_micro_batch
        self._last_micro_batch = last_micro_batch
        if self._transport is not None:
            self._transport.add_pending()  # the earlier micro-batch's sums, before its buffers are reused
        try:
            loss.backward()
            if self._armed:
                self._hand_over()  # the last, partly filled bucket
        finally:
            self._armed = False
            self._bucket, self._bucket_fill = [], 0

    # ---- after backward ----------------------------------------------------------------------------
    def _host_grads(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(model parameter, master, host gradient) of every parameter with a gradient."""
        if self._transport is not None:
            return [(a.dev, a.master, a.grad) for a in self._transport.arrivals()]
        out = []
        for dev, m in self._pairs:
            if dev.grad is None:
                continue
            if self._d2h is None:
                out.append((dev, m, dev.grad))
            else:
                host = self._host_grad[id(m)]
                host.copy_(dev.grad)
                out.append((dev, m, host))
        return out

    def _step_now(self, masters: list[torch.Tensor], grads: list[torch.Tensor], max_grad_norm: float | None,
                  norm: torch.Tensor) -> None:
        """Steps `masters` with `grads` (every one finite), clipped as torch.nn.utils.clip_grad_norm_
        clips them, and copies the new weights to the device. fp32 gradients are scaled in place;
        16-bit ones into fp32 copies (scaled in bf16 they would round again), one tensor at a time,
        so that at most one tensor's fp32 copy exists (all at once they would take 4 B/param)."""
        coef = torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0) if max_grad_norm and grads else None
        if coef is None or not bool(coef < 1.0):
            self._step_tensors(masters, grads)
            self._copy_all_to_device(masters)
            return
        # fp32 in place with one foreach op, as clip_grad_norm_ multiplies (on a CPU, torch 2.13's
        # foreach mul by a 0-dim tensor rounds differently from a per-tensor mul_).
        exact = [(m, g) for m, g in zip(masters, grads) if g.dtype == torch.float32]
        if exact:
            torch._foreach_mul_([g for _, g in exact], coef.to(exact[0][1].device))
            self._step_tensors([m for m, _ in exact], [g for _, g in exact])
        for m, g in zip(masters, grads):
            if g.dtype != torch.float32:
                self._step_tensors([m], [g.float().mul_(coef)])
        self._copy_all_to_device(masters)

    def _step_tensors(self, masters: list[torch.Tensor], grads: list[torch.Tensor], keep_undo: bool = False):
        """optimizer.step_tensors with finite gradients; in the bf16 weight form each new weight is
        written into its landing buffer (over the gradient, where that is what the step reads)."""
        weights = [self._transport.landing[id(m)] for m in masters] if self.bf16_weights else None
        return self.optimizer.step_tensors(masters, grads, num_threads=self.worker_threads, known_finite=True,
                                           keep_undo=keep_undo, weights=weights)

    def clip_and_step(self, max_grad_norm: float | None) -> float:
        norm = self._overlapped_step(max_grad_norm) if self.overlap else self._serial_step(max_grad_norm)
        if self._h2d is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._h2d)  # the next forward reads them
        # The model's parameters hold every gradient (on a CPU they are the masters; on a GPU the
        # masters have none): model.zero_grad, with the module walk done once at set-up.
        for p in self._model_params:
            p.grad = None
        if self._transport is not None:
            self._transport.end_step()
        self._last_micro_batch = True
        return float(norm)

    def _serial_step(self, max_grad_norm: float | None) -> torch.Tensor:
        entries = self._host_grads()
        grads = [g for _, _, g in entries]
        norm = _total_norm(_bucket_norms(grads))
        if not torch.isfinite(norm):
            self.skipped_steps += 1
            return norm
        # A finite global norm means every element is finite: the kernel need not check again
        # (as after the decision below), and the tensors go to it in one call.
        self._step_now([m for _, m, _ in entries], grads, max_grad_norm, norm)
        return norm

    def _overlapped_step(self, max_grad_norm: float | None) -> torch.Tensor:
        self._help_drain()
        self._queue.join()
        if self._worker_error is not None:
            error, self._worker_error = self._worker_error, None
            self._speculated = []
            raise RuntimeError("the offloaded optimizer step failed in its worker thread") from error
        spec, self._speculated = self._speculated, []
        seen = {id(s.master) for s in spec}
        # Gradients no hook delivered (a backward without last_micro_batch) join the unstepped ones.
        late = [(m, g) for _, m, g in self._host_grads() if id(m) not in seen]
        spec += [_Speculation(m, g, n) for (m, g), n in zip(late, _bucket_norms([g for _, g in late]))]
        if self._h2d is not None:
            self._h2d.synchronize()  # no copy may still read a master that a rollback rewrites
        order = {id(m): i for i, (_, m) in enumerate(self._pairs)}
        spec.sort(key=lambda s: order[id(s.master)])  # the serial path's order: the same norm, bit for bit
        grads = [s.grad for s in spec]
        norm = _total_norm([s.norm for s in spec])
        stepped = [s for s in spec if s.coefficients is not None]
        finite = bool(torch.isfinite(norm)) and not any(s.refused for s in spec)
        clips = finite and self._would_clip(max_grad_norm, norm)
        # A step whose coefficients changed since it ran (the lr was set after backward) is redone too.
        stale = self.optimizer.coefficients_changed([s.master for s in stepped], [s.coefficients for s in stepped])
        self._speculate = finite and not clips and not self.bf16_weights
        if stepped:
            self.speculated_steps += 1
        if finite and not clips and not stale:
            keep = {id(s.master) for s in stepped}
            todo = [s for s in spec if id(s.master) not in keep]  # not speculated: step them now
            self._step_now([s.master for s in todo], [s.grad for s in todo], None, norm)
            return norm
        if stepped:
            self.rollbacks += 1
            self.optimizer.rollback_tensors([s.master for s in stepped], [s.grad for s in stepped],
                                            [s.coefficients for s in stepped], num_threads=self.worker_threads)
        if not finite:
            self.skipped_steps += 1
            self._copy_all_to_device([s.master for s in stepped])
            return norm
        self._step_now([s.master for s in spec], grads, max_grad_norm, norm)
        return norm

    def _copy_all_to_device(self, masters: list[torch.Tensor]) -> None:
        dev_of = {id(m): dev for dev, m in self._pairs}
        for m in masters:
            self._copy_to_device(dev_of[id(m)], m)

    @staticmethod
    def _would_clip(max_grad_norm: float | None, norm: torch.Tensor) -> bool:
        return bool(max_grad_norm) and bool(torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0) < 1.0)

    def abandon_step(self) -> None:
        """Undoes what a forward or backward that raised (out of memory, say) left half done, so the
        next step starts clean: the worker's queue is drained and its speculative steps rolled back
        (within a few ulp, as any rollback), every gradient on the device and in transit dropped.
        Counted in no counter: the step never reached its decision."""
        self._armed = False
        self._bucket, self._bucket_fill = [], 0
        if self.overlap:
            self._help_drain()
            self._queue.join()
            self._worker_error = None
            spec, self._speculated = self._speculated, []
            stepped = [s for s in spec if s.coefficients is not None]
            if self._h2d is not None:
                self._h2d.synchronize()
            if stepped:
                self.optimizer.rollback_tensors([s.master for s in stepped], [s.grad for s in stepped],
                                                [s.coefficients for s in stepped], num_threads=self.worker_threads)
                self._copy_all_to_device([s.master for s in stepped])
                if self._h2d is not None:
                    self._h2d.synchronize()
        for p in self._model_params:
            p.grad = None
        if self._transport is not None:
            self._transport.end_step()
        self._last_micro_batch = True

    # ---- telemetry, checkpoints, shutdown --------------------------------------------------------
    def train_metrics(self) -> dict[str, Any]:
        return {"offload_rollbacks": self.rollbacks, "offload_skipped_steps": self.skipped_steps,
                "offload_speculated_steps": self.speculated_steps}

    @property
    def copy_waits(self) -> tuple[int, float]:
        """(times the gradient hook found the copy window full, seconds it waited there in all):
        the time backward's thread was blocked by the device-lean transport (0 without CUDA)."""
        if self._transport is None:
            return 0, 0.0
        return self._transport.window.waits, self._transport.window.wait_seconds

    def checkpointable(self) -> "_OffloadCheckpoint":
        return _OffloadCheckpoint(self)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()
            self._worker = None
        super().close()


def _theta_star_plus_delta(state: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
    """The fp32 weight theta* + delta of a bf16-weight master into `out` (1-D, fp32), without a
    temporary: theta* widened exactly, then one fp32 addition per element, the bits of
    ``state["anchor"].float() + state["delta"]``."""
    out.copy_(state["anchor"].reshape(-1))
    out.add_(state["delta"].reshape(-1))


class _OffloadCheckpoint(StrategyCheckpoint):
    """The fp32 host masters and their state; a load refreshes the device weights from them."""

    def fragments(self) -> list:
        """A bf16-weight master has no fp32 weight: its fragment's value is theta* + delta in fp32,
        formed when the checkpoint writer reaches it and freed once written (formed_fragment), so a
        save holds one parameter's at a time, not 4 B per anchored parameter. A load gives it a
        tensor of its own: what is loaded there is dropped, or gives delta where the checkpoint has
        none (layout.py)."""
        s = self.strategy
        out = []
        for name, m in s._named_masters():
            fragments = whole_tensor_fragments([(name, m)], s.optimizer, s.is_main_process)
            if s.optimizer.has_bf16_weight(m):
                state = s.optimizer.state[m]
                master = formed_fragment(name, MASTER, m.numel(), torch.float32,
                                         functools.partial(_theta_star_plus_delta, state), write=s.is_main_process)
                fragments = [master if f.field == MASTER else f for f in fragments]
            out += fragments
        return out

    def prepare_load(self) -> None:
        for _, m in self.strategy._pairs:
            self.strategy.optimizer.init_state(m)

    def after_load(self) -> None:
        s = self.strategy
        for dev, m in s._pairs:
            if s.bf16_weights:  # the weight the device gets, as a step writes it
                state = s.optimizer.state[m]
                s._transport.landing[id(m)].copy_(round_nearest_bf16(state["anchor"].float() + state["delta"])
                                                  if s.optimizer.has_bf16_weight(m) else m.detach())
            s._copy_to_device(dev, m)
        if s._h2d is not None:
            s._h2d.synchronize()
