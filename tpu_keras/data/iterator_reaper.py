"""Input iterators deleted on a thread of their own, so that no run waits on their teardown.

Deleting a tf.data iterator joins its autotuner's thread, which can be
asleep in a timed wait that cancellation does not cut short: the caller
blocks until the wait ends, for seconds, or for most of a minute once the
iterator is old (the autotuner's period doubles as it runs). `fit`
deletes its iterators when it returns, so a run of a few minutes could
spend half a minute doing nothing at its end, and again after every
validation; on a pod that is paid on every host, and on every `fit` of a
resumed run. The per-device iterators behind a `tf.distribute` dataset
have such threads too, and their options are TensorFlow's to set, not ours.

`release_off_thread(dataset)` makes every iterator of `dataset` (whoever
creates it: Keras's `fit` and `evaluate`, or user code) end on one daemon
thread instead: the thread keeps a reference to each, and deletes the ones
nobody else holds any more. The wait still happens, off to the side.

At the interpreter's exit the thread must not be inside a deletion (a
daemon thread that returns into Python during shutdown aborts the process),
so exit waits for the deletion under way; `python -m tpu_keras.train` ends
with `os._exit` once all is written, and waits for nothing.
"""

import atexit
import sys
import threading

_POLL_SECONDS = 1.0
_EXIT_WAIT_SECONDS = 120  # longer than the autotuner's longest sleep (60 s)


class _Reaper:
    """Holds iterators; a daemon thread deletes those that only it still references."""

    def __init__(self):
        self._iterators = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = None

    def keep(self, iterator):
        with self._lock:
            self._iterators.append(iterator)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="iterator-reaper",
                                                daemon=True)
                self._thread.start()
        return iterator

    def _run(self):
        while not self._stopping.wait(_POLL_SECONDS):
            with self._lock:
                self._iterators, unused = _split_by_use(self._iterators)
            unused.clear()  # the teardown waits here, on this thread, holding no lock

    def stop(self):
        """At exit: no new deletions, and the one under way finishes first. Iterators
        still kept are left to the interpreter's own teardown, on the main thread."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=_EXIT_WAIT_SECONDS)


def _split_by_use(iterators):
    """(iterators someone else still holds, iterators only `iterators` holds)."""
    kept, unused = [], []
    for iterator in iterators:
        # References: the list, this loop's name and getrefcount's argument.
        (unused if sys.getrefcount(iterator) <= 3 else kept).append(iterator)
    return kept, unused


_REAPER = _Reaper()
atexit.register(_REAPER.stop)
_SUBCLASSES = {}


def release_off_thread(dataset):
    """Returns `dataset`, whose iterators are from now on deleted by the reaper thread.

    The dataset keeps its type as far as TensorFlow and Keras can tell: its
    class becomes a subclass of its own whose `__iter__` also hands the new
    iterator to the reaper.
    """
    base = type(dataset)
    if base not in _SUBCLASSES:
        _SUBCLASSES[base] = type(base.__name__, (base,), {
            "__iter__": lambda self: _REAPER.keep(base.__iter__(self)),
            "__module__": base.__module__})
    dataset.__class__ = _SUBCLASSES[base]
    return dataset
