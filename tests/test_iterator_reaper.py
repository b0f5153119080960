"""Input iterators end on the reaper thread, never on the thread that dropped them."""

import threading
import time

import tensorflow as tf

from tpu_keras.data import iterator_reaper


def test_a_dropped_iterator_is_deleted_on_the_reaper_thread():
    deleted_on = []

    class Tracked:
        """Stands in for an iterator's C++ teardown: records the thread that ran it."""

        def __del__(self):
            deleted_on.append(threading.current_thread().name)

    dataset = iterator_reaper.release_off_thread(tf.data.Dataset.range(10).prefetch(2))
    assert isinstance(dataset, tf.data.Dataset)
    iterator = iter(dataset)
    assert int(next(iterator)) == 0
    iterator.tracked = Tracked()  # deleted with the iterator
    held = iter(dataset)  # still in use: must survive
    del iterator
    deadline = time.time() + 30
    while not deleted_on and time.time() < deadline:
        time.sleep(0.1)
    assert deleted_on == ["iterator-reaper"]
    assert [int(x) for x in held] == list(range(10))
