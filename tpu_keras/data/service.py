"""A local tf.data service (one dispatcher, one worker) for testing and small setups.

    python -m tpu_keras.data.service --port=5050

On a pod the dispatcher and workers run on CPU machines of their own, so
input work scales beyond the TPU hosts; pipelines reach them through
`data.service_address`. This process stands in for that fleet on one machine
and prints `ready grpc://127.0.0.1:PORT` once both servers are up.
"""

from absl import flags
import tensorflow as tf

from tpu_keras import cli

_PORT = flags.DEFINE_integer("port", 0, "Dispatcher port; 0 picks a free one.")


def main(argv):
    del argv
    service = tf.data.experimental.service
    dispatcher = service.DispatchServer(service.DispatcherConfig(port=_PORT.value))
    address = dispatcher.target.split("://")[-1]
    worker = service.WorkerServer(service.WorkerConfig(dispatcher_address=address))
    print(f"ready {dispatcher.target}", flush=True)
    worker.join()


if __name__ == "__main__":
    cli.run(main)
