"""The host cache: one fixed buffer, cut into equal chunk slots, reused by every checkpoint.

Snapshots copy into free slots; flushes release them once written. When no slot is free the copy
waits (backpressure), so host memory never grows past the buffer, and a tensor bigger than the
whole cache simply streams through it slot by slot.

The buffer is shared memory (a memfd, mapped here and by the I/O worker process, which checksums
and writes the slots: save/flow/io_worker.py). Faulting its pages in happens on a background thread so
constructing the engine never stalls training. On CPU the thread touches every page and hands
slots out as soon as they are touched, so the first snapshot starts copying after the first slot
instead of after the whole buffer. It touches one byte per page (the kernel zero-fills the page)
on its own thread at the lowest CPU priority: a checkpoint load that runs meanwhile, on as many
threads as there are cores, keeps them. With CUDA the buffer is pinned (``cudaHostRegister`` of
many GB takes seconds); slots become available when pinning finishes, which the first snapshot's
copies wait for, never ``save`` itself. It is registered *portable* (pinned for every GPU's
context, not only the registering one): restore's shared staging slots (``staged_read``) feed
targets on any GPU of the process, and a copy from memory another context does not see as pinned
silently becomes a pageable, synchronous one. ``close`` unregisters it bound to the cache's
device, checks the result, and leaves the mapping alone while registration may still be using it.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

from .device import bind_thread, on_device
from .errors import CacheError
from .files import ALIGN
from .priority import lowest_cpu_priority
from .threads import EngineThread

_PAGE = 4096
#: ``cudaHostRegisterPortable``: the pages count as pinned in every CUDA context of the process.
REGISTER_PORTABLE = 1


def _cudart() -> Any:
    """CUDA's runtime bindings (a seam: the CPU tests put a recording stand-in here)."""
    return torch.cuda.cudart()


class HostCache:
    def __init__(self, nbytes: int, chunk_bytes: int, pin: bool, device: int | None = None):
        """``device``: the CUDA device the allocating thread binds to before pinning (``device.py``)."""
        if chunk_bytes % ALIGN or chunk_bytes <= 0:
            raise ValueError("chunk size must be a positive multiple of 4096")
        self.chunk_bytes = chunk_bytes
        self.num_slots = max(1, nbytes // chunk_bytes)
        self.nbytes = self.num_slots * chunk_bytes
        self.pinned = pin
        self.device = device
        self._registered = False  # pinned with cudaHostRegister: unregistered at close
        # The memory, shared with the I/O worker process; its pages are faulted in (or pinned) below.
        self.shared_fd: int | None = None
        if hasattr(os, "memfd_create"):
            self.shared_fd = os.memfd_create("datastates-host-cache", getattr(os, "MFD_CLOEXEC", 0))
            os.ftruncate(self.shared_fd, self.nbytes)
            self._mmap = mmap.mmap(self.shared_fd, self.nbytes)
        else:  # no memfd (not Linux): private memory, flushed from this process only
            self._mmap = mmap.mmap(-1, self.nbytes)
        self._cond = threading.Condition()
        self._free: list[int] = []
        self._error: BaseException | None = None
        self._buffer: torch.Tensor | None = None
        self._array: np.ndarray | None = None
        self._ready = threading.Event()
        self._closing = threading.Event()
        self._thread = EngineThread(self._allocate, "datastates-cache-alloc")
        self._thread.start()

    def _allocate(self) -> None:
        lowest_cpu_priority()
        try:
            bind_thread(self.device)  # pinning makes a CUDA context current: the rank's, not GPU 0's
            buffer = torch.frombuffer(self._mmap, dtype=torch.uint8)  # page-aligned, as O_DIRECT needs
            if self.pinned:
                status = _cudart().cudaHostRegister(buffer.data_ptr(), self.nbytes, REGISTER_PORTABLE)
                if int(status) != 0:
                    raise CacheError(f"cudaHostRegister of {self.nbytes} bytes failed (CUDA error {int(status)})")
                self._registered = True
            self._buffer = buffer
            self._array = np.frombuffer(self._mmap, dtype=np.uint8)
            self._ready.set()
            for slot in range(self.num_slots):
                if self._closing.is_set():
                    return
                if not self.pinned:  # pinned pages are resident already; one write per page faults it in
                    self._array[slot * self.chunk_bytes:(slot + 1) * self.chunk_bytes:_PAGE] = 0
                with self._cond:
                    self._free.append(slot)
                    self._cond.notify_all()
        except BaseException as exc:  # reported to whoever waits for a slot
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def wait_allocated(self, timeout: float) -> None:
        self._thread.join(timeout)
        if self._error is not None:
            raise CacheError(f"host cache of {self.nbytes} bytes could not be allocated: {self._error}") from self._error
        if self._thread.is_alive():
            raise CacheError(f"host cache allocation did not finish within {timeout:.0f}s")

    def close(self, timeout: float = 60.0) -> None:
        """Stop pre-faulting and drop the buffer (a thread inside torch must not outlive exit).

        If the allocating thread is still inside ``cudaHostRegister`` after ``timeout``, the
        mapping is left to the process's exit: unmapping it would pull the pages from under the
        call. A failed ``cudaHostUnregister`` raises ``CacheError`` (the mapping is then left too).
        """
        self._closing.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._buffer = None
            self._array = None
            raise CacheError(f"host cache of {self.nbytes} bytes: its allocation (pinning) was still running "
                             f"after {timeout:.0f}s; the memory is left mapped until the process exits")
        if self._registered and self._buffer is not None:
            with on_device(self.device):  # the context that registered it, not whatever this thread has
                status = int(_cudart().cudaHostUnregister(self._buffer.data_ptr()))
            self._registered = False
            if status != 0:
                self._buffer = None
                self._array = None
                raise CacheError(f"cudaHostUnregister of the {self.nbytes}-byte host cache failed (CUDA error "
                                 f"{status}); the memory is left mapped")
        self._buffer = None
        self._array = None
        try:
            self._mmap.close()
        except BufferError:  # a view of it is still referenced: it goes with the last one
            pass
        if self.shared_fd is not None:
            os.close(self.shared_fd)
            self.shared_fd = None

    def acquire(self, timeout: float, check: Callable[[], None] = lambda: None,
                on_wait: Callable[[], None] | None = None) -> int:
        """Take a free slot, waiting for flushes to release one (backpressure).

        ``on_wait`` runs once, under the cache's lock, when no slot is free and the wait begins;
        ``check`` runs at every wake-up and may raise to give up.
        """
        with self._cond:
            self._wait_free(timeout, check, on_wait)
            return self._free.pop()

    def _wait_free(self, timeout: float, check: Callable[[], None], on_wait: Callable[[], None] | None) -> None:
        """Under the lock: return once a slot is free (``acquire``'s wait)."""
        deadline = time.monotonic() + timeout
        if not self._free and on_wait is not None:
            on_wait()
        while not self._free:
            if self._error is not None:
                raise CacheError(f"host cache allocation failed: {self._error}") from self._error
            check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise CacheError(
                    f"no host cache slot was freed within {timeout:.0f}s: the flush is stuck or too slow"
                )
            self._cond.wait(min(left, 0.5))

    def acquire_run(self, most: int, timeout: float, check: Callable[[], None] = lambda: None,
                    on_wait: Callable[[], None] | None = None) -> tuple[int, int]:
        """``(first, count)``: 1 <= ``count`` <= ``most`` free slots that lie next to each other in memory.

        Waits like ``acquire`` for the first free slot, then takes the longest run of neighbouring
        free slots (the lowest such run on a tie), so a copy, a checksum and a write can each cover
        many chunks in one call that releases the GIL (fewer round trips with the training thread).
        """
        with self._cond:
            self._wait_free(timeout, check, on_wait)
            free = sorted(self._free)
            best_first, best_count = free[0], 1
            first, count = free[0], 1
            for slot in free[1:]:
                if slot == first + count:
                    count += 1
                else:
                    first, count = slot, 1
                if count > best_count:
                    best_first, best_count = first, count
            count = min(best_count, max(1, most))
            taken = set(range(best_first, best_first + count))
            self._free = [s for s in free if s not in taken]
            return best_first, count

    def release_run(self, first: int, count: int) -> None:
        with self._cond:
            self._free.extend(range(first, first + count))
            self._cond.notify_all()

    def run_view(self, first: int, count: int) -> torch.Tensor:
        """``count`` neighbouring slots from ``first`` as one uint8 tensor (for copies)."""
        base = first * self.chunk_bytes
        return self._buffer[base: base + count * self.chunk_bytes]

    def wake(self) -> None:
        """Make a waiting ``acquire`` run its ``check`` now (its caller's plans changed)."""
        with self._cond:
            self._cond.notify_all()

    def release(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify_all()

    def view(self, slot: int) -> torch.Tensor:
        """The slot as a uint8 tensor (for copies)."""
        base = slot * self.chunk_bytes
        return self._buffer[base: base + self.chunk_bytes]

    def shared_memory(self) -> memoryview:
        """The whole buffer (available at once, before its pages are faulted in)."""
        return memoryview(self._mmap)

    def memory(self, slot: int, nbytes: int) -> memoryview:
        """The first ``nbytes`` from ``slot`` on (a slot or a run of neighbouring ones) as a buffer, no copy."""
        base = slot * self.chunk_bytes
        return memoryview(self._array[base: base + nbytes])

    @property
    def free_slots(self) -> int:
        with self._cond:
            return len(self._free)
