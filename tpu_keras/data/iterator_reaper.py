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
nobody else holds any more. The wait still happens, off to the side; at
exit the process does not wait for it.
"""

import atexit
import sys
import threading
import time

_POLL_SECONDS = 1.0


class _Reaper:
    """Holds iterators; a daemon thread deletes those that only it still references."""

    def __init__(self):
        self._iterators = []
        self._lock = threading.Lock()
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
        while True:
            time.sleep(_POLL_SECONDS)
            with self._lock:
                self._iterators, unused = _split_by_use(self._iterators)
            unused.clear()  # the teardown waits here, on this thread, holding no lock

    def abandon(self):
        """At exit: hand what is left to the daemon thread, so that the interpreter's
        shutdown (on the main thread) never deletes an iterator."""
        with self._lock:
            left, self._iterators = self._iterators, []
        if left:
            threading.Thread(target=lambda: left.clear(), daemon=True).start()


def _split_by_use(iterators):
    """(iterators someone else still holds, iterators only `iterators` holds)."""
    kept, unused = [], []
    for iterator in iterators:
        # References: the list, this loop's name and getrefcount's argument.
        (unused if sys.getrefcount(iterator) <= 3 else kept).append(iterator)
    return kept, unused


_REAPER = _Reaper()
atexit.register(_REAPER.abandon)
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
