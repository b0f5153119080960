"""One checkpoint write at a time on a thread of its own, so training goes on meanwhile.

`start` hands the writer a save whose state is already in host memory; `wait`
blocks until it is committed. A save that starts while the previous one is
still writing first waits for it (at most one in flight: host memory holds
one copy of the state, and checkpoints stay in step order). The writer keeps
the seconds it spent writing and the seconds the loop spent waiting for it,
for the run's time line.
"""

import threading
import time

from absl import logging

from tpu_keras.errors import UserError, first_line


class SaveLost(UserError):
    """A background write that failed: the checkpoint of that step is not committed."""


class Writer:
    def __init__(self):
        self._thread = None
        self._step = None
        self._error = None
        self.background_seconds = 0.0  # writing, while the loop went on
        self.waiting_seconds = 0.0     # the loop blocked on a write in flight

    @property
    def in_flight(self):
        """The step being written, or None."""
        return self._step if self._thread is not None and self._thread.is_alive() else None

    def make_room(self, step: int) -> None:
        """Waits for the save in flight, saying so, before the save of `step` begins."""
        if self.in_flight is not None:
            logging.info("checkpoint of step %d: waiting for step %d's, still being written",
                         step, self.in_flight)
        self.wait()

    def start(self, step: int, write) -> None:
        """Runs `write()` (writes and commits the checkpoint of `step`) on the writer thread."""
        self.make_room(step)

        def work():
            began = time.perf_counter()
            try:
                write()
            except BaseException as error:  # reported by the next wait, in the loop's thread
                self._error = error
            finally:
                self.background_seconds += time.perf_counter() - began

        self._step, self._error = step, None
        # A daemon: a process that ends without waiting (a kill) must not hang on the write;
        # what it leaves is an uncommitted checkpoint, which nothing reads.
        self._thread = threading.Thread(target=work, name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Blocks until the save in flight is committed; raises `SaveLost` if its write failed."""
        if self._thread is None:
            return
        began = time.perf_counter()
        self._thread.join()
        self.waiting_seconds += time.perf_counter() - began
        self._thread, error, self._error = None, self._error, None
        if error is not None:
            raise SaveLost(f"the checkpoint of step {self._step} was not saved "
                           f"({type(error).__name__}: {first_line(error)}); the run "
                           "resumes from the one before it: check the checkpoint folder's space "
                           "and permissions, or set checkpoint.asynchronous=False")
