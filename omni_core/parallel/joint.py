"""The `joint` encoder schedule (DESIGN.md §3): the encoders work per micro-batch in the time their rank would
otherwise wait, and each micro-batch's embeddings travel to the LLM as soon as they are made.

Under `omni` this is MegaScale-Omni's joint encoder-LLM pipeline: a pipeline stage that waits for activations
or gradients (the 1F1B warm-up and cool-down bubbles, a slow peer) encodes micro-batches instead, stage 0
takes micro-batch m's embeddings when its forward of m starts, and the encoders' backward of m runs once
stage 0's backward of m has sent their gradients. Under `disaggregated` it is DistTrain's pipelined encoders:
the encoder ranks make micro-batch m + 1 while the LLM runs m.

How it runs on a rank. After `EncoderStep`'s common start (metadata, the assignment, inputs shipped; blocking
collectives, identical to `phased`), a thread takes the rank's encoder work: forward of every micro-batch in
order, then backward of every micro-batch in order (fixed orders: the encoders' gradients sum in the same
order every step). The thread runs at the kernel's idle priority (`SCHED_IDLE`), so it computes only when the
rank's own training thread waits: it fills bubbles rather than competing with the LLM, as a low-priority
stream would on a GPU. Rows go to their consumers (every stage-0 rank of the item's data shard, its CP share)
by point-to-point sends, one per (micro-batch, consumer), on a process group of their own; gradients return
the same way on another, sent from each consumer's gradient hook on its rows. Every receive is posted before
the thread starts, and after that each group is used by one thread only. LSSP's exchanges run inside the
thread on their own groups, in the canonical order every member shares.

The thread cannot raise into the training thread, which may be blocked in a receive from a peer that waits
for this thread's sends: an error in it prints its traceback and ends the process (the supervisor reports the
rank's failure). Built for CPU ranks (gloo); on CUDA the same schedule needs a low-priority stream.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from omni_core.parallel.encoder_items import Piece, Transfer
    from omni_core.parallel.encoders import EncoderStep

Span = tuple["Piece", int, int]  # a piece and its [first, end) rows for one consumer


def _lower_priority() -> None:
    """This thread at SCHED_IDLE (Linux; pid 0 is the calling thread): it runs only when the CPU is idle."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


class JointStep:
    """One step of the joint schedule on this rank (module docstring). `rows(m)`: the consumer's leaf of
    micro-batch m's rows (blocks until they arrive); `finish()`: after the LLM's backward, the rest."""

    def __init__(
        self,
        step: EncoderStep,
        pieces: list[Piece],
        transfers: list[Transfer],
        inputs: dict[Piece, torch.Tensor],
        n_micro: int,
        dtype: torch.dtype,
    ):
        self.step, self.pieces, self.inputs, self.n_micro, self.dtype = step, pieces, inputs, n_micro, dtype
        self.rank, self.dim = step.rank, step.model.args.llm.dim
        self.outgoing: dict[tuple[int, int], list[Span]] = defaultdict(list)  # (micro, consumer)
        self.incoming: dict[tuple[int, int], list[Span]] = defaultdict(list)  # (micro, source)
        for consumer, piece, first, end in transfers:  # packed order within each key
            if piece.rank == self.rank:
                self.outgoing[(piece.item.micro, consumer)].append((piece, first, end))
            if consumer == self.rank:
                self.incoming[(piece.item.micro, piece.rank)].append((piece, first, end))
        self.made = [threading.Event() for _ in range(n_micro)]
        self.graded = [threading.Event() for _ in range(n_micro)]
        self.local_rows: dict[int, torch.Tensor] = {}
        self.local_grads: dict[int, torch.Tensor] = {}
        self.sent: dict[tuple[int, int], torch.Tensor] = {}  # rows as made, graph attached (the backward's roots)
        self.in_flight: list[tuple[dist.Work, torch.Tensor]] = []  # sends and their buffers, until finish()
        self.leaves: dict[int, torch.Tensor] = {}
        self.tokens: dict[int, torch.Tensor | None] = {}  # the sharded encoders' chains', per micro-batch
        self.layout: dict[int, list[tuple[int, int]]] = {}  # a leaf's (source, rows) runs, in leaf order
        self.cpu_s = 0.0  # the thread's encoder compute (CPU time: waiting at idle priority is not work)
        self.graded_by_hook: set[int] = set()
        self.rows_in = {
            key: self._receive(key[1], self._size(spans), step.rows_group, key[0])
            for key, spans in self.incoming.items()
            if key[1] != self.rank
        }
        self.grads_in = {}
        if step.trains:
            self.grads_in = {
                key: self._receive(key[1], self._size(spans), step.grads_group, key[0])
                for key, spans in self.outgoing.items()
                if key[1] != self.rank and step.roles.sends_gradient(key[1])
            }
        self.thread = threading.Thread(target=self._work, name="omni-encoders", daemon=True)
        self.thread.start()

    @staticmethod
    def _size(spans: list[Span]) -> int:
        return sum(end - first for _, first, end in spans)

    def _receive(self, source: int, rows: int, group: dist.ProcessGroup, micro: int) -> tuple[torch.Tensor, dist.Work]:
        buffer = torch.empty(rows, self.dim, dtype=self.dtype, device=self.step.device)
        work = dist.irecv(buffer, src=source, group=group, tag=micro)
        assert work is not None  # None only for a rank outside `group`; the handoff's groups are the world
        return buffer, work

    def _send(self, payload: torch.Tensor, dest: int, group: dist.ProcessGroup, micro: int) -> None:
        """Post a send, kept in flight with its buffer until `finish`."""
        work = dist.isend(payload, dst=dest, group=group, tag=micro)
        assert work is not None  # None only for a rank outside `group`; the handoff's groups are the world
        self.in_flight.append((work, payload))

    # --- the encoder thread ------------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            _lower_priority()
            for micro in range(self.n_micro):
                self._forward(micro)
            if self.step.trains:
                for micro in range(self.n_micro):
                    self._backward(micro)
        except BaseException:
            print(f"rank {self.rank}: the joint schedule's encoder thread failed", file=sys.stderr)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)

    def _forward(self, micro: int) -> None:
        step, started = self.step, time.thread_time()
        mine = [p for p in self.pieces if p.rank == self.rank and p.item.micro == micro]
        device, dtype = step.device, self.dtype
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            produced, self.tokens[micro] = step.compute.encode(mine, self.inputs)
        for (m, consumer), spans in sorted(self.outgoing.items()):
            if m != micro:
                continue
            rows = torch.cat([produced[p][first - p.rows[0] : end - p.rows[0]] for p, first, end in spans]).to(dtype)
            self.sent[(micro, consumer)] = rows
            if consumer == self.rank:
                self.local_rows[micro] = rows.detach()
            else:
                payload = rows.detach().contiguous()
                self._send(payload, consumer, step.rows_group, micro)
        self.cpu_s += time.thread_time() - started
        self.made[micro].set()

    def _backward(self, micro: int) -> None:
        roots, grads = [], []
        for (m, consumer), rows in sorted(self.sent.items()):
            if m != micro or not self.step.roles.sends_gradient(consumer):
                continue
            if consumer == self.rank:
                self.graded[micro].wait()
                grad = self.local_grads[micro]
            else:
                grad, work = self.grads_in[(micro, consumer)]
                work.wait()
            if rows.requires_grad:  # rows of frozen encoders only: nothing to run
                roots.append(rows)
                grads.append(grad)
        token = self.tokens.get(micro)
        if token is not None and token.requires_grad:  # every rank's backward reaches the sharded blocks
            roots.append(token)
            grads.append(torch.zeros_like(token))
        started = time.thread_time()
        if roots:
            torch.autograd.backward(roots, grads)
        self.cpu_s += time.thread_time() - started

    # --- the training thread -----------------------------------------------------------------------------

    def rows(self, micro: int) -> torch.Tensor:
        """Micro-batch `micro`'s rows on this consumer, sorted by packed position: a leaf whose gradient hook
        sends each source its share (waits for the rows on first use)."""
        if micro in self.leaves:
            return self.leaves[micro]
        runs, chunks = [], []
        for (m, source), spans in sorted(self.incoming.items()):
            if m != micro:
                continue
            if source == self.rank:
                self.made[micro].wait()
                buffer = self.local_rows[micro]
            else:
                buffer, work = self.rows_in[(micro, source)]
                work.wait()
            sizes = [end - first for _, first, end in spans]
            for (piece, first, _), chunk in zip(spans, buffer.split(sizes), strict=True):
                chunks.append((piece.item.start + first, source, chunk))
        chunks.sort(key=lambda c: c[0])
        for _, source, chunk in chunks:
            runs.append((source, chunk.shape[0]))
        rows = (
            torch.cat([c for _, _, c in chunks])
            if chunks
            else torch.zeros(0, self.dim, dtype=self.dtype, device=self.step.device)
        )
        leaf = rows.detach().requires_grad_(self.step.trains)
        if self.step.trains and chunks:
            leaf.register_hook(lambda grad, m=micro: self._send_gradient(m, grad))
        self.leaves[micro], self.layout[micro] = leaf, runs
        return leaf

    def _send_gradient(self, micro: int, grad: torch.Tensor) -> None:
        """Each source's share of the gradient of micro-batch `micro`'s rows, in the order it sent them (its rows
        are in packed order among the leaf's). Only tensor-parallel rank 0 sends: its peers hold the same rows."""
        if micro in self.graded_by_hook:
            raise RuntimeError(f"the gradient of micro-batch {micro}'s encoder rows arrived twice in one step")
        self.graded_by_hook.add(micro)
        if not self.step.roles.sends_gradient(self.rank):
            return
        shares: dict[int, list[torch.Tensor]] = defaultdict(list)
        for (source, _rows), part in zip(
            self.layout[micro], grad.split([r for _, r in self.layout[micro]]), strict=True
        ):
            shares[source].append(part)
        for source, parts in shares.items():
            payload = torch.cat(parts).detach().contiguous()
            if source == self.rank:
                self.local_grads[micro] = payload
                self.graded[micro].set()
            else:
                self._send(payload, source, self.step.grads_group, micro)

    def finish(self) -> float:
        """After the LLM's backward: every receive waited for (no stale one may match the next step's sends),
        zero gradients for rows the backward did not reach (so no encoder rank waits for ever), the thread's
        backward awaited, every send completed. Returns the thread's encoder compute seconds."""
        for micro in range(self.n_micro):
            if any(m == micro for m, _ in self.incoming):
                leaf = self.rows(micro)
                if self.step.trains and micro not in self.graded_by_hook:
                    self._send_gradient(micro, torch.zeros_like(leaf))
        self.thread.join()
        for work, _ in self.in_flight:
            work.wait()
        self.in_flight.clear()
        return self.cpu_s
