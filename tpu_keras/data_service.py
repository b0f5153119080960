"""A local tf.data service (one dispatcher, one worker) for testing and small setups.

    python -m tpu_keras.data_service --port=5050

On a pod the dispatcher and workers run on CPU machines of their own, so
input work scales beyond the TPU hosts; pipelines reach them through
`data.service_address`. This process stands in for that fleet on one machine
and prints `ready grpc://localhost:PORT` once both servers are up.

Neither server authenticates, and TensorFlow binds both to every interface
(its gRPC servers take a port, never an address), so this process says so at
start. Under `python -m tpu_keras.launch --data_service` it runs inside the
launcher's private network, where nothing outside reaches it.
"""

import sys

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
    print("notice: the tf.data service's dispatcher and worker listen on all interfaces, without "
          "authentication (TensorFlow has no option to bind one address); keep them in a private "
          "network (`python -m tpu_keras.launch --data_service` starts them in its own) or block "
          "their ports to other machines with a firewall", file=sys.stderr, flush=True)
    print(f"ready {dispatcher.target}", flush=True)
    worker.join()


if __name__ == "__main__":
    cli.start(main)
